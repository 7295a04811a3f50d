// Candidates for the targets (train/prune.h): the sampled importance-weighted error, the eager types, and that pruning
// keeps every type the exact knapsack of the full menus chooses (issue #16: "show that pruning never changes the
// recipe"), on mix30M's learned weights and on stories260K end to end.
#include "data/vocab.h"
#include "ggml/gguf.h"
#include "ggml/types.h"
#include "model/gguf_weights.h"
#include "model/registry.h"
#include "train/budget.h"
#include "train/candidates.h"
#include "train/probe.h"
#include "train/prune.h"
#include "train/trainer.h"
#include "test_util.h"
#include "tolerance.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <map>

using namespace voodoo;

namespace {

std::string mix30m() { return test::shared_data() + "/models/mix30M/mix30M.gguf"; }

// A positive importance, uneven across the columns (and experts), for each named tensor.
importance_map uneven_importance(const gguf_file & f, const std::vector<std::string> & names, uint32_t seed) {
    importance_map imp;
    for (const std::string & name : names) {
        const gguf_tensor & t = f.tensor(name);
        std::vector<float> a;
        for (float x : test::gaussian(static_cast<size_t>(t.ne[0] * t.ne[2]), seed++)) {
            a.push_back(0.05f + x * x);
        }
        imp[name] = a;
    }
    return imp;
}

std::vector<gated_tensor> built(const gguf_file & f, const std::vector<tensor_menu> & menus, const importance_map & imp) {
    std::vector<gated_tensor> gated;
    for (const tensor_menu & m : menus) {
        gated_tensor g;
        g.tensor = m.tensor;
        g.types = m.types;
        for (ggml_type t : g.types) {
            g.bytes.push_back(quantize_tensor(f, *g.tensor, t, importance_for(&imp, *g.tensor)));
        }
        gated.push_back(std::move(g));
    }
    return gated;
}

}  // namespace

TEST(prune, the_sampled_error_of_every_row_is_the_exact_weighted_error_lattice_types_included) {
    // Learned weights (mix30M, BF16) and F32 ones (stories260K); a lattice type, a K-quant, a legacy type, F16 and the
    // source's own type.
    struct tc {
        std::string model, name;
        std::vector<ggml_type> types;
    };
    for (const tc & c : {tc{mix30m(), "blk.0.attn_k.weight",
                            {GGML_TYPE_IQ2_XXS, GGML_TYPE_IQ3_S, GGML_TYPE_Q4_K, GGML_TYPE_Q5_0, GGML_TYPE_F16, GGML_TYPE_BF16}},
                         tc{test::stories260k(), "blk.1.ffn_up.weight",
                            {GGML_TYPE_IQ4_NL, GGML_TYPE_Q4_1, GGML_TYPE_Q8_0, GGML_TYPE_F16, GGML_TYPE_F32}}}) {
        const gguf_file f(c.model);
        const importance_map imp = uneven_importance(f, {c.name}, 11);
        const std::vector<tensor_menu> menus = {{&f.tensor(c.name), c.types, false}};
        prune_options every;
        every.min_sample_rows = f.tensor(c.name).n_rows();
        const auto hat = sampled_weighted_errors(f, menus, &imp, every, 2);
        gguf_weights dense(f);
        const auto exact = weighted_errors(dense, built(f, menus, imp), &imp, torch::kCPU);
        for (size_t k = 0; k < c.types.size(); ++k) {
            // The same rows' bytes (rows quantize independently); per term the f32 difference, its square and the
            // product with a round once in weighted_errors (≤ 4u relative) where Ê rounds only the difference.
            EXPECT_LE(std::abs(hat[0][k] - exact[0][k]), test::gamma_n(4) * exact[0][k] + 1e-300)
                << c.name << " as " << type_name(c.types[k]);
        }
        EXPECT_EQ(hat[0].back(), 0.0) << "the source's own bytes";
        EXPECT_GT(hat[0][0], hat[0][2]) << "the lowest-bit type errs most";
        // The default sample (32 of 256 or 64 rows) is within a factor of 2 of the whole on these learned weights.
        const auto sampled = sampled_weighted_errors(f, menus, &imp, prune_options{}, 2);
        for (size_t k = 0; k + 2 < c.types.size(); ++k) {  // the block types (F16 of a few rounded values aside)
            EXPECT_GT(sampled[0][k], 0.5 * exact[0][k]) << c.name << " as " << type_name(c.types[k]);
            EXPECT_LT(sampled[0][k], 2.0 * exact[0][k]) << c.name << " as " << type_name(c.types[k]);
        }
    }
}

TEST(prune, the_eager_types_are_fast_block_types_spread_in_error_and_a_short_menu_is_kept_whole) {
    const gguf_file f(mix30m());
    const importance_map imp = uneven_importance(f, {"blk.0.attn_q.weight"}, 3);
    menu_options mo;
    mo.has_imatrix = true;
    mo.importance = &imp;
    std::vector<tensor_menu> menus;
    for (const tensor_menu & m : build_menus(f, mo)) {
        if (m.tensor->name == "blk.0.attn_q.weight" || m.tensor->name == "blk.0.attn_k.weight") {
            menus.push_back(m);
        }
    }
    ASSERT_EQ(menus.size(), 2u);
    menus[1].types = {GGML_TYPE_Q4_K, GGML_TYPE_Q6_K, GGML_TYPE_Q8_0, GGML_TYPE_BF16};  // shorter than min_menu (5)
    const auto hat = sampled_weighted_errors(f, menus, &imp, prune_options{}, 2);
    const auto eager = eager_types(menus, hat, prune_options{});
    std::vector<ggml_type> chosen;
    size_t largest_fast = menus[0].types.size();
    for (size_t k = 0; k < menus[0].types.size(); ++k) {
        const ggml_type t = menus[0].types[k];
        if (!lattice_quantizer(t) && type_info_of(t).is_quantized &&
            (largest_fast == menus[0].types.size() || hat[0][k] > hat[0][largest_fast])) {
            largest_fast = k;
        }
        if (eager[0][k]) {
            chosen.push_back(t);
            EXPECT_FALSE(lattice_quantizer(t)) << type_name(t);
            EXPECT_TRUE(type_info_of(t).is_quantized) << type_name(t);
        }
    }
    EXPECT_GT(menus[0].types.size(), 15u) << "the default menu with an imatrix: lattice types included";
    ASSERT_EQ(chosen.size(), 2u);
    ASSERT_LT(largest_fast, menus[0].types.size());
    EXPECT_TRUE(eager[0][largest_fast]) << "the fast type of largest error is eager";
    EXPECT_EQ(chosen.back(), GGML_TYPE_Q8_0) << "and the one of least error among the block types";
    EXPECT_EQ(std::count(eager[1].begin(), eager[1].end(), true), 2);
    // The short menu is kept whole whatever the budget: pruning it saves too little to risk a choice.
    std::vector<std::vector<double>> measured(2);
    for (size_t i = 0; i < 2; ++i) {
        for (size_t k = 0; k < menus[i].types.size(); ++k) {
            measured[i].push_back(eager[i][k] ? hat[i][k] : std::numeric_limits<double>::quiet_NaN());
        }
    }
    export_options eo;
    budget b = make_budget(f, menus, {target_kind::size, 1e12}, eo, /*check_range =*/false);
    b.limit = b.min_total;
    const prune_plan p = plan_pruning(menus, hat, measured, eager, {b}, {}, prune_options{});
    EXPECT_EQ(p.keep[1], std::vector<bool>(4, true));
    EXPECT_LT(std::count(p.keep[0].begin(), p.keep[0].end(), true), static_cast<long>(menus[0].types.size()));
}

TEST(prune, on_mix30m_the_exact_knapsack_of_the_kept_types_is_the_full_menus_at_every_budget) {
    // mix30M's layer 0 (seven matrices of learned weights) with the default menu, every candidate built and probed on
    // 64 tokens of wiki.test.raw: the truth. Pruning sees only the eager types' ΔKL and the sampled errors.
    const gguf_file f(mix30m());
    std::vector<std::string> names;
    for (const char * n : {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}) {
        names.push_back(std::string("blk.0.") + n + ".weight");
    }
    const importance_map imp = uneven_importance(f, names, 21);
    menu_options mo;
    mo.has_imatrix = true;
    mo.importance = &imp;
    std::vector<tensor_menu> menus;
    for (const tensor_menu & m : build_menus(f, mo)) {
        if (imp.count(m.tensor->name)) {
            menus.push_back(m);
        }
    }
    ASSERT_EQ(menus.size(), names.size());
    const std::vector<gated_tensor> gated = built(f, menus, imp);
    std::unique_ptr<causal_lm> model = build_model(f);
    gguf_weights dense(f), teacher(f);
    const vocab v(mix30m());
    const std::vector<int32_t> ids = v.tokenize(test::read_file(test::shared_data() + "/text/wikitext-2-raw/wiki.test.raw").substr(0, 4000), true);
    ASSERT_GE(ids.size(), 64u);
    const torch::Tensor tokens = torch::tensor(std::vector<int64_t>(ids.begin(), ids.begin() + 64), torch::kLong).reshape({1, 64});
    const auto truth = probe_sensitivity(*model, dense, teacher, gated, tokens, torch::kCPU, 64);

    const prune_options po;
    const auto hat = sampled_weighted_errors(f, menus, &imp, po, 2);
    const auto eager = eager_types(menus, hat, po);
    std::vector<std::vector<double>> measured(menus.size());
    for (size_t i = 0; i < menus.size(); ++i) {
        for (size_t k = 0; k < menus[i].types.size(); ++k) {
            measured[i].push_back(eager[i][k] ? truth[i][k] : std::numeric_limits<double>::quiet_NaN());
        }
    }
    export_options eo;
    budget b = make_budget(f, menus, {target_kind::size, 1e12}, eo, /*check_range =*/false);
    const double lo = b.min_total, hi = b.max_total;
    int64_t kept = 0, total = 0;
    for (int j = 0; j <= 40; ++j) {
        b.limit = lo + (hi - lo) * j / 40.0;
        const std::vector<int> full = allocate_exact(b, truth);
        const prune_plan p = plan_pruning(menus, hat, measured, eager, {b}, {}, po);
        kept += p.kept;
        total += p.total;
        for (size_t i = 0; i < menus.size(); ++i) {
            EXPECT_TRUE(p.keep[i][static_cast<size_t>(full[i])])
                << "budget " << j << "/40: " << menus[i].tensor->name << " as " << type_name(menus[i].types[static_cast<size_t>(full[i])])
                << " was pruned";
        }
        // And the exact knapsack of the kept types alone, on the full menus' grid, is the same recipe.
        const std::vector<tensor_menu> kept_menus = pruned_menus(menus, p.keep);
        budget bp = make_budget(f, kept_menus, {target_kind::size, 1e12}, eo, /*check_range =*/false);
        bp.limit = b.limit;
        share_grid(bp, b);
        std::vector<std::vector<double>> kept_truth(menus.size());
        for (size_t i = 0; i < menus.size(); ++i) {
            for (size_t k = 0; k < menus[i].types.size(); ++k) {
                if (p.keep[i][k]) {
                    kept_truth[i].push_back(truth[i][k]);
                }
            }
        }
        const std::vector<int> pruned = allocate_exact(bp, kept_truth);
        for (size_t i = 0; i < menus.size(); ++i) {
            EXPECT_EQ(kept_menus[i].types[static_cast<size_t>(pruned[i])], menus[i].types[static_cast<size_t>(full[i])])
                << "budget " << j << "/40: " << menus[i].tensor->name;
        }
    }
    // It prunes: over these budgets a third of the candidates is kept (32% when written; the lattice types only at low
    // budgets, the float types only at the highest).
    EXPECT_LT(kept, total / 2) << kept << " of " << total;
}

TEST(prune, train_with_pruned_candidates_gives_the_recipe_of_every_candidate_on_stories260k) {
    const test::temp_dir tmp;
    const std::string dir = tmp.path.string();
    const std::string text = test::shared_data() + "/text/tinystories/tinystories_val.txt";
    ASSERT_EQ(test::run_voodoo(fmt::format("data --model {} --text {} --ctx 128 --out {}/data", test::stories260k(), text, dir)).exit_code, 0);
    std::map<std::string, nlohmann::json> recipes;
    for (const char * mode : {"targets", "all"}) {
        const std::string out = fmt::format("{}/run-{}", dir, mode);
        const auto r = test::run_voodoo(fmt::format("train --model {} --data {}/data --target-bpw 7.5 --menu "
                                                    "Q4_0,IQ4_NL,Q4_1,Q5_0,Q5_1,Q8_0,F16,F32 --steps 8 --batch 2 "
                                                    "--probe-sequences 2 --select-sequences 2 --candidates {} --out {} -t 2",
                                                    test::stories260k(), dir, mode, out));
        ASSERT_EQ(r.exit_code, 0) << r.output;
        if (std::string(mode) == "targets") {
            EXPECT_NE(r.output.find("candidates built for the targets"), std::string::npos) << r.output;
        }
        nlohmann::json types;
        for (const auto & t : nlohmann::json::parse(test::read_file(out + "/recipe.json"))["tensors"]) {
            types[t["name"].get<std::string>()] = t["type"];
        }
        recipes[mode] = types;
    }
    EXPECT_EQ(recipes["targets"], recipes["all"]);
}
