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

#define XXH_INLINE_ALL
#include <xxhash.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <set>

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

// The names of layer 0's matrices `short_names` (attn_q, ffn_up, …) in mix30M.
std::vector<std::string> layer0(std::initializer_list<const char *> short_names) {
    std::vector<std::string> names;
    for (const char * n : short_names) {
        names.push_back(std::string("blk.0.") + n + ".weight");
    }
    return names;
}

// The default menus, with an imatrix, of the tensors `imp` names (file order).
std::vector<tensor_menu> imatrix_menus(const gguf_file & f, const importance_map & imp) {
    menu_options mo;
    mo.has_imatrix = true;
    mo.importance = &imp;
    std::vector<tensor_menu> menus;
    for (const tensor_menu & m : build_menus(f, mo)) {
        if (imp.count(m.tensor->name)) {
            menus.push_back(m);
        }
    }
    return menus;
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

TEST(prune, sampled_errors_kept_in_the_cache_are_read_back_and_a_changed_input_measures_again) {
    // A resumed or re-targeted run reads Ê from the candidate cache's folder instead of quantizing the rows again.
    const gguf_file f(test::stories260k());
    const std::string name = "blk.1.ffn_up.weight";
    const importance_map imp = uneven_importance(f, {name}, 11);
    const std::vector<tensor_menu> menus = {{&f.tensor(name), {GGML_TYPE_IQ4_NL, GGML_TYPE_Q4_1, GGML_TYPE_Q8_0}, false}};
    test::temp_dir dir;
    const std::string cache = dir.file("candidates");
    const auto plain = sampled_weighted_errors(f, menus, &imp, prune_options{}, 1);
    const auto first = sampled_weighted_errors(f, menus, &imp, prune_options{}, 1, nullptr, cache);
    EXPECT_EQ(first, plain) << "keeping them changes no value";
    std::vector<std::filesystem::path> kept;
    for (const auto & e : std::filesystem::recursive_directory_iterator(cache)) {
        if (e.is_regular_file()) {
            kept.push_back(e.path());
        }
    }
    ASSERT_EQ(kept.size(), 3u) << "one file a type";
    // Read back, not measured: a kept value written over (with its checksum) is what the next call returns.
    std::sort(kept.begin(), kept.end());
    const auto write_value = [](const std::filesystem::path & p, double v, uint64_t sum) {
        std::ofstream out(p, std::ios::binary | std::ios::trunc);
        out.write(reinterpret_cast<const char *>(&v), sizeof v);
        out.write(reinterpret_cast<const char *>(&sum), sizeof sum);
    };
    const double planted = 12345.0;
    write_value(kept[0], planted, XXH3_64bits(&planted, sizeof planted));
    const auto second = sampled_weighted_errors(f, menus, &imp, prune_options{}, 1, nullptr, cache);
    int planted_seen = 0;
    for (size_t k = 0; k < 3; ++k) {
        planted_seen += second[0][k] == planted;
        EXPECT_TRUE(second[0][k] == planted || second[0][k] == first[0][k]) << k;
    }
    EXPECT_EQ(planted_seen, 1);
    // A damaged file (its checksum wrong) is measured again.
    write_value(kept[0], planted, 0);
    EXPECT_EQ(sampled_weighted_errors(f, menus, &imp, prune_options{}, 1, nullptr, cache), first);
    // Another importance is another key: measured, and kept beside the first.
    const importance_map other = uneven_importance(f, {name}, 12);
    const auto third = sampled_weighted_errors(f, menus, &other, prune_options{}, 1, nullptr, cache);
    EXPECT_EQ(third, sampled_weighted_errors(f, menus, &other, prune_options{}, 1));
    EXPECT_NE(third, first);
    size_t files = 0;
    for (const auto & e : std::filesystem::recursive_directory_iterator(cache)) {
        files += e.is_regular_file() ? 1 : 0;
    }
    EXPECT_EQ(files, 6u);
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
    EXPECT_GT(menus[0].types.size(), 15u) << "the default menu with an imatrix: lattice types included";
    // With the default cost limit (cheap fast types only) and without one (every fast type, as before session 37).
    for (const double max_cost : {prune_options{}.eager_max_cost, 0.0}) {
        prune_options po;
        po.eager_max_cost = max_cost;
        const auto eager = eager_types(menus, hat, po);
        std::vector<ggml_type> chosen;
        size_t largest_fast = menus[0].types.size();
        for (size_t k = 0; k < menus[0].types.size(); ++k) {
            const ggml_type t = menus[0].types[k];
            if (!lattice_quantizer(t) && type_info_of(t).is_quantized &&
                (max_cost <= 0 || quantize_cost_per_weight(t) <= max_cost) &&
                (largest_fast == menus[0].types.size() || hat[0][k] > hat[0][largest_fast])) {
                largest_fast = k;
            }
            if (eager[0][k]) {
                chosen.push_back(t);
                EXPECT_FALSE(lattice_quantizer(t)) << type_name(t);
                EXPECT_TRUE(type_info_of(t).is_quantized) << type_name(t);
                if (max_cost > 0) {
                    EXPECT_LE(quantize_cost_per_weight(t), max_cost) << type_name(t);
                }
            }
        }
        ASSERT_EQ(chosen.size(), 2u) << "max cost " << max_cost;
        ASSERT_LT(largest_fast, menus[0].types.size());
        EXPECT_TRUE(eager[0][largest_fast]) << "the fast type of largest error (within the cost limit) is eager";
        EXPECT_EQ(chosen.front(), max_cost > 0 ? GGML_TYPE_Q3_K : GGML_TYPE_Q2_K)
            << "Q2_K (8 M weights/s with an imatrix) is left out for Q3_K (27 M/s) under the default limit";
        EXPECT_EQ(chosen.back(), GGML_TYPE_Q8_0) << "and the one of least error among the block types";
        EXPECT_EQ(std::count(eager[1].begin(), eager[1].end(), true), 2);
        // The short menu's cheap types are Q6_K and Q8_0, whose errors lie far below Q4_K's (≈ 2 bits: ≈ 16×): the
        // eager types must still reach its low end, so Q4_K stays eager under either limit.
        ASSERT_GT(hat[1][0], prune_options{}.eager_reach * hat[1][1]) << "Q4_K's error against Q6_K's";
        EXPECT_TRUE(eager[1][0]) << "q4_K, max cost " << max_cost;
    }
    const auto eager = eager_types(menus, hat, prune_options{});
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
    const std::vector<std::string> names = layer0({"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"});
    const importance_map imp = uneven_importance(f, names, 21);
    const std::vector<tensor_menu> menus = imatrix_menus(f, imp);
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
    double work_one = 0, work_two = 0;  // the quantizers' work of what each way builds
    const auto work = [&](const prune_plan & p) {
        double w = 0;
        for (size_t i = 0; i < menus.size(); ++i) {
            for (size_t k = 0; k < menus[i].types.size(); ++k) {
                w += p.keep[i][k] ? quantize_cost_per_weight(menus[i].types[k]) * static_cast<double>(menus[i].tensor->n_elements()) : 0.0;
            }
        }
        return w;
    };
    for (int j = 0; j <= 80; ++j) {
        b.limit = lo + (hi - lo) * (j % 41) / 40.0;
        const std::vector<int> full = allocate_exact(b, truth);
        prune_plan p = plan_pruning(menus, hat, measured, eager, {b}, {}, po);
        if (j > 40) {
            // The second stage (--prune-stages 2): the knapsack's choices and their neighbours measured, the plan made
            // again with them known (predicted from the eager types alone, in the second band), as the train stage does.
            work_one += work(p);
            const auto staged = stage_types(menus, p, measured, {b}, po.stage_width);
            std::vector<std::vector<double>> more = measured;
            for (size_t i = 0; i < menus.size(); ++i) {
                for (size_t k = 0; k < menus[i].types.size(); ++k) {
                    more[i][k] = staged[i][k] ? truth[i][k] : more[i][k];
                }
            }
            prune_options po2 = po;
            po2.margin = po.stage_margin;
            p = plan_pruning(menus, hat, more, eager, {b}, {}, po2, &measured);
            keep_also(menus, p, staged);
            work_two += work(p);
        } else {
            kept += p.kept;
            total += p.total;
        }
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
    // And the second stage builds less than the first plan keeps, for the same recipe.
    EXPECT_LT(work_two, work_one);
}

TEST(prune, train_with_pruned_candidates_built_ahead_or_not_gives_the_recipe_of_every_candidate_on_stories260k) {
    const test::temp_dir tmp;
    const std::string dir = tmp.path.string();
    const std::string text = test::shared_data() + "/text/tinystories/tinystories_val.txt";
    ASSERT_EQ(test::run_voodoo(fmt::format("data --model {} --text {} --ctx 128 --out {}/data", test::stories260k(), text, dir)).exit_code, 0);
    std::map<std::string, nlohmann::json> recipes;
    // "ahead": pruned, with the likely kept types built while the probe runs (on the CPU only when asked).
    // "staged": pruned in two stages (--prune-stages 2), with the builds ahead of both probes.
    for (const std::string mode : {"targets", "all", "ahead", "staged"}) {
        const std::string out = fmt::format("{}/run-{}", dir, mode);
        const std::string how = mode == "ahead"    ? "targets --build-ahead on --prune-stages 1"
                                : mode == "staged" ? "targets --build-ahead on --prune-stages 2"
                                                   : mode + " --build-ahead off --prune-stages 1";
        const auto r = test::run_voodoo(fmt::format("train --model {} --data {}/data --target-bpw 7.5 --menu "
                                                    "Q4_0,IQ4_NL,Q4_1,Q5_0,Q5_1,Q8_0,F16,F32 --steps 8 --batch 2 "
                                                    "--probe-sequences 2 --select-sequences 2 --candidates {} --out {} -t 2",
                                                    test::stories260k(), dir, how, out));
        ASSERT_EQ(r.exit_code, 0) << r.output;
        if (mode != "all") {
            EXPECT_NE(r.output.find("candidates built for the targets"), std::string::npos) << r.output;
        }
        // Building ahead, the probe measures each tensor's candidates as soon as they are built.
        EXPECT_EQ(r.output.find("eager candidates probed as they were built") != std::string::npos, mode == "ahead" || mode == "staged") << r.output;
        EXPECT_EQ(r.output.find("likely candidates built ahead while the probe ended") != std::string::npos, mode == "ahead" || mode == "staged") << r.output;
        EXPECT_EQ(r.output.find("measured as they were built") != std::string::npos, mode == "staged") << r.output;
        EXPECT_EQ(r.output.find("pruning, second stage") != std::string::npos, mode == "staged") << r.output;
        nlohmann::json types;
        for (const auto & t : nlohmann::json::parse(test::read_file(out + "/recipe.json"))["tensors"]) {
            types[t["name"].get<std::string>()] = t["type"];
        }
        recipes[mode] = types;
    }
    EXPECT_EQ(recipes["targets"], recipes["all"]);
    EXPECT_EQ(recipes["ahead"], recipes["all"]);
    // The probe as built measures what the probe after the build measures, bit for bit (the same bytes).
    const auto eager_probe = [&](const std::string & mode) {
        return nlohmann::json::parse(test::read_file(fmt::format("{}/run-{}/probe.eager.json", dir, mode)));
    };
    EXPECT_EQ(eager_probe("ahead"), eager_probe("targets"));
    EXPECT_EQ(eager_probe("staged"), eager_probe("targets"));
    EXPECT_EQ(recipes["staged"], recipes["all"]);
    // The guesses built ahead that the probe did not keep leave the cache: it then holds what the run without
    // building ahead holds, entry for entry.
    auto entries = [&](const std::string & mode) {
        std::set<std::string> names;
        for (const auto & e : std::filesystem::recursive_directory_iterator(fmt::format("{}/run-{}/candidates", dir, mode))) {
            if (e.is_regular_file() && e.path().extension() == ".bin") {
                names.insert(e.path().filename().string());
            }
        }
        return names;
    };
    EXPECT_FALSE(entries("targets").empty());
    EXPECT_EQ(entries("ahead"), entries("targets"));
    EXPECT_LT(entries("targets").size(), entries("all").size());
    EXPECT_LE(entries("staged").size(), entries("all").size());
}

TEST(prune, a_guess_made_before_iq1s_errors_are_in_leaves_its_types_out_and_is_otherwise_the_same_kind_of_guess) {
    // While IQ1's grid builds (≈ 19 s on one core), the build-ahead guess goes without IQ1_S/IQ1_M's Ê (trainer.cpp).
    const gguf_file f(mix30m());
    const std::vector<std::string> names = layer0({"attn_q", "attn_k", "ffn_up"});
    const importance_map imp = uneven_importance(f, names, 5);
    const std::vector<tensor_menu> menus = imatrix_menus(f, imp);
    const prune_options po;
    std::vector<std::vector<bool>> iq1(menus.size()), others(menus.size());
    size_t n_iq1 = 0;
    for (size_t i = 0; i < menus.size(); ++i) {
        for (size_t k = 0; k < menus[i].types.size(); ++k) {
            const bool is_iq1 = menus[i].types[k] == GGML_TYPE_IQ1_S || menus[i].types[k] == GGML_TYPE_IQ1_M;
            iq1[i].push_back(is_iq1);
            others[i].push_back(!is_iq1);
            n_iq1 += is_iq1;
        }
    }
    // Every Ê but IQ1's (0: not measured yet, as in the train stage; and its grid is not built in this process).
    const auto hat = sampled_weighted_errors(f, menus, &imp, po, 2, &others);
    const auto eager = eager_types(menus, hat, po);
    ASSERT_EQ(n_iq1, 2 * menus.size()) << "the default menu with an imatrix offers IQ1_S and IQ1_M";
    export_options eo;
    budget b = make_budget(f, menus, {target_kind::size, 1e12}, eo, /*check_range =*/false);
    // At the least budget only the IQ1 types fit, so the knapsack must take them whatever their ΔKL; at the middle of
    // the range they are not near the choice.
    for (const double at : {0.0, 0.02, 0.5}) {
        b.limit = b.min_total + at * (b.max_total - b.min_total);
        const auto jobs = build_ahead_jobs(menus, hat, eager, {b}, {}, po, &iq1);
        for (const auto & [i, k] : jobs) {
            EXPECT_FALSE(iq1[i][k]) << "an IQ1 type in the guess at " << at << ": " << menus[i].tensor->name;
            EXPECT_FALSE(eager[i][k]);
        }
        if (at == 0.5) {
            EXPECT_FALSE(jobs.empty());
            // Without `unknown`, the zero Ê would make the IQ1 types look exact, and the guess would take them.
            const auto naive = build_ahead_jobs(menus, hat, eager, {b}, {}, po);
            EXPECT_TRUE(std::any_of(naive.begin(), naive.end(), [&](const auto & j) { return iq1[j.first][j.second]; }))
                << "the test would not tell the two apart";
        }
    }
}

TEST(prune, the_second_plans_band_follows_the_staged_types_errors_between_its_widest_and_narrowest) {
    // stage_band_margin (session 38): the largest |ln(measured / predicted)| of the staged, not eager, types, × the
    // scale, clamped to [ln 2, ln 3] by default; every other entry (eager, not staged, NaN) is ignored.
    const gguf_file f(mix30m());
    const std::vector<std::string> names = layer0({"attn_q", "ffn_up"});
    const importance_map imp = uneven_importance(f, names, 3);
    const std::vector<tensor_menu> menus = imatrix_menus(f, imp);
    ASSERT_EQ(menus.size(), 2u);
    const double nan = std::numeric_limits<double>::quiet_NaN();
    prune_plan first;
    std::vector<std::vector<double>> measured;
    std::vector<std::vector<bool>> staged, eager;
    for (const tensor_menu & m : menus) {
        ASSERT_GE(m.types.size(), 4u);
        first.predicted.emplace_back(m.types.size(), 1e-3);
        measured.emplace_back(m.types.size(), nan);
        staged.emplace_back(m.types.size(), false);
        eager.emplace_back(m.types.size(), false);
    }
    const prune_options po;  // scale 1.5, widest 1/3, narrowest 1/2
    EXPECT_EQ(stage_band_margin(menus, first, measured, staged, eager, po), po.stage_margin) << "nothing staged";
    // An eager type far off, and a staged one measured 10% above its prediction: the band is the narrowest.
    eager[0][0] = staged[0][0] = true;
    measured[0][0] = 1e-2;
    staged[0][1] = true;
    measured[0][1] = 1.1e-3;
    measured[1][3] = 1e-1;  // measured but not staged: ignored
    EXPECT_DOUBLE_EQ(stage_band_margin(menus, first, measured, staged, eager, po), po.stage_margin_narrowest);
    // A staged type 1.6× off: ln 1.6 × 1.5 = 0.705 lies between ln 2 and ln 3, so the margin is 1.6^-1.5.
    staged[1][2] = true;
    measured[1][2] = 1.6e-3;
    EXPECT_NEAR(stage_band_margin(menus, first, measured, staged, eager, po), std::pow(1.6, -1.5), 1e-12);
    // What set it, for the log: the two staged misses (ln 1.1, ln 1.6), the largest's tensor, type and values.
    stage_band_miss why;
    stage_band_margin(menus, first, measured, staged, eager, po, &why);
    EXPECT_EQ(why.types, 2);
    EXPECT_NEAR(why.largest, std::log(1.6), 1e-12);
    EXPECT_NEAR(why.median, std::log(1.6), 1e-12);  // the upper median of two
    EXPECT_EQ(why.tensor, menus[1].tensor->name);
    EXPECT_EQ(why.type, menus[1].types[2]);
    EXPECT_EQ(why.measured, 1.6e-3);
    EXPECT_EQ(why.predicted, 1e-3);
    // Below its prediction counts the same; 3× off is clamped to the widest band.
    measured[1][2] = 1e-3 / 3;
    EXPECT_NEAR(stage_band_margin(menus, first, measured, staged, eager, po), po.stage_margin, 1e-12);
    prune_options fixed = po;
    fixed.stage_error_scale = 0;  // the rule before session 38
    measured[1][2] = 1.0e-3;
    EXPECT_EQ(stage_band_margin(menus, first, measured, staged, eager, fixed), po.stage_margin);
}

TEST(prune, the_types_built_ahead_are_likely_keeps_not_yet_built_the_likeliest_first) {
    // mix30M's layer 0 with the default menu at a budget halfway between the all-cheapest and the all-dearest file.
    const gguf_file f(mix30m());
    const std::vector<std::string> names = layer0({"attn_q", "attn_k", "ffn_up"});
    const importance_map imp = uneven_importance(f, names, 5);
    const std::vector<tensor_menu> menus = imatrix_menus(f, imp);
    ASSERT_EQ(menus.size(), names.size());
    const prune_options po;
    const auto hat = sampled_weighted_errors(f, menus, &imp, po, 2);
    const auto eager = eager_types(menus, hat, po);
    export_options eo;
    budget b = make_budget(f, menus, {target_kind::size, 1e12}, eo, /*check_range =*/false);
    b.limit = 0.5 * (b.min_total + b.max_total);
    const auto jobs = build_ahead_jobs(menus, hat, eager, {b}, {}, po);
    ASSERT_FALSE(jobs.empty());
    size_t in_menus = 0;
    for (const tensor_menu & m : menus) {
        in_menus += m.types.size();
    }
    EXPECT_LT(jobs.size() + 2 * menus.size(), in_menus) << "a guess at the kept types, not the whole menus";
    // The same guess as plan_pruning's when every tensor's ΔKL/Ê is 1: here the measured values are exactly Ê.
    std::vector<std::vector<double>> measured(menus.size());
    for (size_t i = 0; i < menus.size(); ++i) {
        for (size_t k = 0; k < menus[i].types.size(); ++k) {
            measured[i].push_back(eager[i][k] ? hat[i][k] : std::numeric_limits<double>::quiet_NaN());
        }
    }
    const prune_plan p = plan_pruning(menus, hat, measured, eager, {b}, {}, po);
    // In the order of their distance in the menu from the knapsack's choice on the guess; among equals, lattice first.
    const std::vector<int> choice = allocate_exact(b, p.predicted);
    int last_distance = 0;
    bool lattice_done = false;
    for (const auto & [i, k] : jobs) {
        EXPECT_FALSE(eager[i][k]) << "the eager types are built already";
        EXPECT_NE(menus[i].types[k], menus[i].tensor->type) << "the source's own type is copied, never built";
        const int d = std::abs(static_cast<int>(k) - choice[i]);
        EXPECT_GE(d, last_distance) << "the likeliest keeps first: " << menus[i].tensor->name << " as " << type_name(menus[i].types[k]);
        lattice_done = d > last_distance ? false : lattice_done;
        last_distance = d;
        const bool lattice = lattice_quantizer(menus[i].types[k]);
        EXPECT_FALSE(lattice && lattice_done) << "among equals the lattice types come first: " << type_name(menus[i].types[k]);
        lattice_done = lattice_done || !lattice;
    }
    size_t kept_not_eager = 0;
    for (size_t i = 0; i < menus.size(); ++i) {
        for (size_t k = 0; k < menus[i].types.size(); ++k) {
            kept_not_eager += p.keep[i][k] && !eager[i][k] && menus[i].types[k] != menus[i].tensor->type;
        }
    }
    EXPECT_EQ(jobs.size(), kept_not_eager);
}

namespace {

// Checks that the cache holds every job's candidate as llama.cpp's quantizer makes it; returns their bytes.
size_t cached_as_llama_makes(const gguf_file & f, const candidate_cache & cache,
                             const std::vector<candidate_prefetch::job> & jobs, const importance_map * imp) {
    size_t bytes = 0;
    for (const auto & j : jobs) {
        const std::vector<uint8_t> want = quantize_tensor(f, *j.tensor, j.type, importance_for(imp, *j.tensor));
        const auto got = cache.load(candidate_cache::key(f, *j.tensor, j.type, importance_for(imp, *j.tensor)), want.size());
        EXPECT_TRUE(got.has_value()) << j.tensor->name << " " << type_name(j.type);
        EXPECT_TRUE(got && *got == want) << j.tensor->name << " " << type_name(j.type);
        bytes += want.size();
    }
    return bytes;
}

}  // namespace

TEST(prune, a_prefetch_with_several_workers_builds_its_jobs_then_thens_and_counts_them_from_the_first_without_a_gap) {
    // 8 threads: two workers of 4 (on 2 cores here; what counts is the order and the bytes, not the speed). The jobs
    // that `then` returns, once the first are built, are built after them; wait_for(n) returns once the first n are.
    const gguf_file f(test::stories260k());
    std::vector<candidate_prefetch::job> first, later;
    for (const gguf_tensor & t : f.tensors()) {
        if (t.n_dims == 2 && t.name.rfind("blk.", 0) == 0 && t.ne[0] % 32 == 0) {  // the blocks fit (not ffn_down's 172)
            first.push_back({&t, GGML_TYPE_Q4_0});
            later.push_back({&t, GGML_TYPE_Q5_1});
        }
    }
    ASSERT_GT(first.size(), 8u);
    const test::temp_dir tmp;
    const candidate_cache cache((tmp.path / "cache").string());
    std::atomic<int> thens{0};
    candidate_prefetch ahead(f, first, nullptr, cache, 8, [&] {
        ++thens;
        return later;
    });
    ASSERT_TRUE(ahead.wait_for(3));
    EXPECT_GE(ahead.built(), 3);
    const int64_t all = static_cast<int64_t>(first.size() + later.size());
    ASSERT_EQ(ahead.wait(), all);
    EXPECT_EQ(thens.load(), 1);
    EXPECT_EQ(ahead.bytes(), cached_as_llama_makes(f, cache, first, nullptr) + cached_as_llama_makes(f, cache, later, nullptr));
    // Stopped before its first jobs are done, `then` is never asked, and what was counted is whole in the cache.
    const gguf_file big(mix30m());
    std::vector<candidate_prefetch::job> many;
    for (const gguf_tensor & t : big.tensors()) {
        if (t.n_dims == 2 && t.name.rfind("blk.", 0) == 0) {
            many.push_back({&t, GGML_TYPE_IQ3_S});
        }
    }
    const test::temp_dir tmp2;
    const candidate_cache cache2((tmp2.path / "cache").string());
    std::atomic<int> asked{0};
    candidate_prefetch stopped(big, many, nullptr, cache2, 8, [&] {
        ++asked;
        return std::vector<candidate_prefetch::job>{};
    });
    const int64_t n = stopped.stop();
    EXPECT_LT(n, static_cast<int64_t>(many.size()));
    EXPECT_EQ(asked.load(), 0);
    for (int64_t j = 0; j < n; ++j) {
        const auto & job = many[static_cast<size_t>(j)];
        EXPECT_TRUE(candidate_cache::holds(cache2.dir(), candidate_cache::key(big, *job.tensor, job.type, {}),
                                           tensor_bytes(job.type, job.tensor->shape(), job.tensor->name)))
            << job.tensor->name;
    }
}

TEST(prune, candidates_built_ahead_hold_llamas_bytes_in_the_cache_and_stop_waits_for_the_job_in_progress) {
    const gguf_file f(test::stories260k());
    const gguf_tensor & q = f.tensor("blk.0.attn_q.weight");
    const gguf_tensor & up = f.tensor("blk.0.ffn_up.weight");
    const importance_map imp = uneven_importance(f, {q.name, up.name}, 9);
    const test::temp_dir tmp;
    const candidate_cache cache((tmp.path / "cache").string());
    const std::vector<candidate_prefetch::job> jobs = {
        {&q, GGML_TYPE_Q4_0}, {&q, GGML_TYPE_IQ4_NL}, {&up, GGML_TYPE_Q5_1}, {&up, GGML_TYPE_Q8_0}};
    candidate_prefetch ahead(f, jobs, &imp, cache, 2);
    ASSERT_EQ(ahead.wait(), 4);
    EXPECT_EQ(ahead.bytes(), cached_as_llama_makes(f, cache, jobs, &imp));
    // Stopped at once: it finishes at most the job in progress, and what it built is whole in the cache. The jobs
    // (mix30M's blocks as IQ3_S and Q4_K: seconds of work on one core) cannot all be done before stop() is called.
    const gguf_file big(mix30m());
    std::vector<candidate_prefetch::job> many;
    for (const gguf_tensor & t : big.tensors()) {
        if (t.n_dims == 2 && t.name.rfind("blk.", 0) == 0) {
            for (ggml_type type : {GGML_TYPE_IQ3_S, GGML_TYPE_Q4_K}) {
                many.push_back({&t, type});
            }
        }
    }
    const test::temp_dir tmp2;
    const candidate_cache cache2((tmp2.path / "cache").string());
    candidate_prefetch stopped(big, many, nullptr, cache2, 1);
    const int64_t n = stopped.stop();
    EXPECT_LT(n, static_cast<int64_t>(many.size()));
    int64_t held = 0;
    for (const auto & j : many) {
        held += candidate_cache::holds(cache2.dir(), candidate_cache::key(big, *j.tensor, j.type, {}),
                                       tensor_bytes(j.type, j.tensor->shape(), j.tensor->name));
    }
    EXPECT_EQ(held, n);
}

TEST(prune, the_candidate_schedule_changes_no_byte_whatever_the_threads) {
    // build_candidates runs the longest jobs first and a job longer than one thread's share on every thread (rows
    // split): every candidate must hold quantize_tensor's bytes on one thread, with 1, 3 or 8 threads. mix30M's
    // embedding (16.4 M of the 19.8 M weights here) makes the split path run.
    const gguf_file f(mix30m());
    std::vector<std::string> names = {"token_embd.weight"};
    for (const std::string & n : layer0({"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"})) {
        names.push_back(n);
    }
    const importance_map imp = uneven_importance(f, names, 3);
    std::vector<tensor_menu> menus = imatrix_menus(f, imp);
    ASSERT_EQ(menus.size(), names.size());
    const std::vector<ggml_type> types = {GGML_TYPE_Q4_0, GGML_TYPE_Q6_K, GGML_TYPE_Q8_0};
    double total = 0, largest = 0;
    for (tensor_menu & m : menus) {
        m.types = types;
        for (ggml_type t : types) {
            const double c = static_cast<double>(m.tensor->n_elements()) * quantize_cost_per_weight(t);
            total += c;
            largest = std::max(largest, c);
        }
    }
    EXPECT_GT(largest, total / 8) << "with 8 threads some job is longer than a thread's share: the split path runs";
    std::vector<std::vector<std::vector<uint8_t>>> one_thread;
    for (const tensor_menu & m : menus) {
        one_thread.emplace_back();
        for (ggml_type t : m.types) {
            one_thread.back().push_back(quantize_tensor(f, *m.tensor, t, importance_for(&imp, *m.tensor), {}, 1));
        }
    }
    for (int threads : {1, 3, 8}) {
        const test::temp_dir tmp;
        const candidate_cache cache(tmp.path.string());
        const std::vector<gated_tensor> g = build_candidates(f, menus, &imp, cache, threads);
        ASSERT_EQ(g.size(), menus.size());
        for (size_t i = 0; i < g.size(); ++i) {
            for (size_t k = 0; k < g[i].types.size(); ++k) {
                EXPECT_EQ(g[i].bytes[k], one_thread[i][k]) << threads << " threads: " << g[i].tensor->name << " as "
                                                           << type_name(g[i].types[k]);
            }
        }
    }
    // A cache that already holds some of them (built ahead while a probe ran): those count no build cost in the
    // schedule, and every candidate is still the same bytes.
    const test::temp_dir tmp;
    const candidate_cache cache(tmp.path.string());
    build_candidates(f, std::vector<tensor_menu>(menus.begin() + 1, menus.end()), &imp, cache, 2);
    const std::vector<gated_tensor> g = build_candidates(f, menus, &imp, cache, 8);
    for (size_t i = 0; i < g.size(); ++i) {
        for (size_t k = 0; k < g[i].types.size(); ++k) {
            EXPECT_EQ(g[i].bytes[k], one_thread[i][k]) << "partly cached: " << g[i].tensor->name << " as "
                                                       << type_name(g[i].types[k]);
        }
    }
}

TEST(prune, a_stop_request_ends_the_candidate_build_after_the_candidates_in_progress_and_keeps_them) {
    // Ctrl-C while candidates build (a quarter of an hour at 8B): the build asks the stop test before each candidate,
    // stops, and throws voodoo::stopped; what was built is in the cache, and the same build again reads it back.
    const gguf_file f(test::stories260k());
    std::vector<tensor_menu> menus;
    for (const char * name : {"blk.0.attn_q.weight", "blk.1.ffn_up.weight", "blk.2.attn_v.weight"}) {
        tensor_menu m;
        m.tensor = &f.tensor(name);
        m.types = {GGML_TYPE_Q4_0, GGML_TYPE_Q5_0, GGML_TYPE_Q8_0};
        menus.push_back(m);
    }
    const test::temp_dir tmp;
    const candidate_cache cache(tmp.path.string());
    auto entries = [&] {
        int64_t n = 0;
        for (const auto & e : std::filesystem::recursive_directory_iterator(tmp.path)) {
            n += e.is_regular_file();
        }
        return n;
    };
    int asked = 0;
    std::string msg;
    try {
        // One thread: the candidates are built one at a time, so the third question finds two built.
        (void)build_candidates(f, menus, nullptr, cache, 1, {}, [&] { return ++asked >= 3; });
        ADD_FAILURE() << "the build did not stop";
    } catch (const stopped & e) {
        msg = e.what();
    }
    EXPECT_EQ(asked, 3);
    EXPECT_EQ(entries(), 2) << "the two candidates built before the stop are kept";
    EXPECT_NE(msg.find("2 of 9"), std::string::npos) << msg;
    EXPECT_NE(msg.find(tmp.path.string()), std::string::npos) << msg;
    EXPECT_NE(msg.find("run the same command again"), std::string::npos) << msg;
    // Never asked to stop: every candidate, the same bytes as quantize_tensor's.
    const std::vector<gated_tensor> g = build_candidates(f, menus, nullptr, cache, 1, {}, [] { return false; });
    EXPECT_EQ(entries(), 9);
    for (size_t i = 0; i < g.size(); ++i) {
        for (size_t k = 0; k < g[i].types.size(); ++k) {
            EXPECT_EQ(g[i].bytes[k], quantize_tensor(f, *menus[i].tensor, menus[i].types[k], {}, {}, 1))
                << menus[i].tensor->name << " as " << type_name(menus[i].types[k]);
        }
    }
}

TEST(prune, a_stop_request_ends_a_prefetch_wait_after_the_job_in_progress) {
    // The ranks of `quantize --gpus N` build their share with candidate_prefetch and wait for it: the wait asks the
    // stop test (Ctrl-C) and stops after the candidate in progress. mix30M's embedding (16.4 M weights) takes a
    // second or more per K-quant on one thread, so the first question comes while the first job runs.
    const gguf_file f(mix30m());
    const gguf_tensor & embd = f.tensor("token_embd.weight");
    const test::temp_dir tmp;
    const candidate_cache cache(tmp.path.string());
    candidate_prefetch part(f, {{&embd, GGML_TYPE_Q4_K}, {&embd, GGML_TYPE_Q5_K}, {&embd, GGML_TYPE_Q6_K}}, nullptr,
                            cache, 1);
    EXPECT_FALSE(part.wait([] { return true; }));
    EXPECT_LT(part.built(), 3);
    candidate_prefetch all(f, {{&embd, GGML_TYPE_Q4_K}}, nullptr, cache, 1);
    EXPECT_TRUE(all.wait([] { return false; }));
    EXPECT_EQ(all.built(), 1);
}

namespace {

// A tmpfs of `bytes` mounted at `dir` for the life of the object (root only: `mounted` false elsewhere).
struct small_disk {
    std::string dir;
    bool mounted = false;
    small_disk(std::string d, int64_t bytes) : dir(std::move(d)) {
        std::filesystem::create_directories(dir);
        mounted = std::system(fmt::format("mount -t tmpfs -o size={} tmpfs '{}' 2>/dev/null", bytes, dir).c_str()) == 0;
    }
    ~small_disk() {
        if (mounted) {
            (void)std::system(fmt::format("umount '{}'", dir).c_str());
        }
    }
};

}  // namespace

TEST(prune, a_cache_without_disk_room_keeps_what_fits_builds_the_rest_in_memory_and_trains_the_same_recipe) {
    // Issue #16 ("will it fit?"): the kept candidates of the default menu at 8B are tens of GB, more than the GPU
    // machine's disk. The build checks the room on the cache's disk first (need + the 256 MiB reserve against statvfs's
    // free bytes); when it is short, the cache keeps only what leaves the reserve and the exported file's budget free,
    // and the rest are built in memory only (the job holds every candidate's bytes in memory anyway), with a warning
    // that says what would keep them all. Before session 29 the job stopped there.
    const test::temp_dir tmp;
    const std::string dir = tmp.path.string();
    small_disk tight(dir + "/tight", k_disk_reserve_bytes + (int64_t{64} << 10));
    if (!tight.mounted) {
        GTEST_SKIP() << "mounting a tmpfs needs root (CI runs as root)";
    }
    small_disk roomy(dir + "/roomy", k_disk_reserve_bytes + (int64_t{16} << 20));
    ASSERT_TRUE(roomy.mounted);
    // free_disk_bytes of a folder not made yet is its nearest existing ancestor's.
    EXPECT_EQ(free_disk_bytes(tight.dir + "/not/yet"), free_disk_bytes(tight.dir));
    EXPECT_LE(free_disk_bytes(tight.dir), k_disk_reserve_bytes + (int64_t{64} << 10));

    const std::string text = test::shared_data() + "/text/tinystories/tinystories_val.txt";
    ASSERT_EQ(test::run_voodoo(fmt::format("data --model {} --text {} --ctx 128 --out {}/data", test::stories260k(), text, dir)).exit_code, 0);
    auto train = [&](const std::string & cache, const std::string & out) {
        return test::run_voodoo(fmt::format("train --model {} --data {}/data --target-bpw 9 --menu Q4_0,Q5_0,Q8_0,F16 "
                                            "--steps 2 --batch 1 --probe-sequences 1 --select-sequences 1 --candidates all "
                                            "--cache {} --out {} -t 2",
                                            test::stories260k(), dir, cache, out));
    };
    auto types_of = [](const std::string & run) {
        std::ifstream in(run + "/recipe.tensor-types.txt");
        return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    };
    const auto ok = train(roomy.dir + "/candidates", dir + "/run-roomy");
    ASSERT_EQ(ok.exit_code, 0) << ok.output;
    EXPECT_EQ(ok.output.find("not enough disk"), std::string::npos) << ok.output;
    EXPECT_EQ(ok.output.find("in memory only"), std::string::npos) << ok.output;
    // What it wrote is what the check counted (a second run needs nothing more).
    const int64_t written = tree_disk_bytes(roomy.dir + "/candidates");
    EXPECT_GT(written, 0);
    const auto again = train(roomy.dir + "/candidates", dir + "/run-again");
    ASSERT_EQ(again.exit_code, 0) << again.output;
    EXPECT_EQ(tree_disk_bytes(roomy.dir + "/candidates"), written);
    ASSERT_FALSE(types_of(dir + "/run-roomy").empty());

    const auto tight_run = train(tight.dir + "/candidates", dir + "/run-tight");
    ASSERT_EQ(tight_run.exit_code, 0) << tight_run.output;
    for (const std::string & said : {std::string("not enough disk in '") + tight.dir + "/candidates",
                                     std::string("built in memory only"), std::string("--work"),
                                     std::string("built in memory only, not kept in")}) {
        EXPECT_NE(tight_run.output.find(said), std::string::npos) << said << "\n" << tight_run.output;
    }
    // Nothing fits beside the reserve there, so nothing was stored, and the recipe is the roomy run's: the same bytes.
    EXPECT_LT(tree_disk_bytes(tight.dir), int64_t{64} << 10);
    EXPECT_EQ(types_of(dir + "/run-tight"), types_of(dir + "/run-roomy"));

    // Pruned (the default): a warning before the probe, from the candidates it will likely keep, then the same
    // fallback once the probe has decided, and the run ends.
    const auto pruned = test::run_voodoo(fmt::format("train --model {} --data {}/data --target-bpw 9 --steps 2 --batch 1 "
                                                     "--probe-sequences 1 --select-sequences 1 --cache {}/pruned --out {}/run-pruned -t 2",
                                                     test::stories260k(), dir, tight.dir, dir));
    ASSERT_EQ(pruned.exit_code, 0) << pruned.output;
    const size_t warned = pruned.output.find("the probe will likely keep");
    const size_t probed = pruned.output.find("pruning: the eager probe in");
    const size_t fallback = pruned.output.find("not enough disk in");
    ASSERT_NE(warned, std::string::npos) << pruned.output;
    ASSERT_NE(probed, std::string::npos) << pruned.output;
    ASSERT_NE(fallback, std::string::npos) << pruned.output;
    EXPECT_LT(warned, probed);
    EXPECT_LT(probed, fallback);
    EXPECT_TRUE(std::filesystem::exists(dir + "/run-pruned/recipe.json"));
}

TEST(prune, a_cache_with_keep_free_stores_only_what_leaves_that_much_free) {
    const test::temp_dir tmp;
    small_disk disk(tmp.path.string() + "/d", int64_t{4} << 20);
    if (!disk.mounted) {
        GTEST_SKIP() << "mounting a tmpfs needs root (CI runs as root)";
    }
    candidate_cache cache(disk.dir + "/c");
    const std::vector<uint8_t> mib(size_t{1} << 20, 7);
    EXPECT_TRUE(cache.store("aa01", mib));  // keep_free 0: every entry stored
    cache.set_keep_free(free_disk_bytes(disk.dir) - (int64_t{3} << 19));  // room for one more MiB entry, not two
    EXPECT_TRUE(cache.store("aa02", mib));
    EXPECT_FALSE(cache.store("aa03", mib));
    EXPECT_EQ(cache.not_stored(), 1);
    EXPECT_EQ(cache.not_stored_bytes(), static_cast<int64_t>(mib.size() + sizeof(uint64_t)));
    EXPECT_TRUE(cache.load("aa02", mib.size()).has_value());
    EXPECT_FALSE(cache.load("aa03", mib.size()).has_value());
}

TEST(prune, errors_measured_in_two_parts_around_the_lattice_grids_are_the_whole_and_choose_the_same_eager_types) {
    // The trainer measures Ê of the types without a lattice grid first, chooses and builds the eager types, and
    // measures the lattice types beside them (while their grids build): the same numbers, the same eager types.
    const gguf_file f(mix30m());
    const importance_map imp = uneven_importance(f, {"blk.0.attn_q.weight", "blk.0.ffn_down.weight", "blk.1.attn_v.weight"}, 5);
    std::vector<tensor_menu> menus = imatrix_menus(f, imp);
    ASSERT_EQ(menus.size(), 3u);
    // The default menus less the two lattice types of the slowest grids (IQ1's and IQ2_S's: ≈ 23 s of one core to
    // build, and nothing here depends on which lattice types there are).
    for (tensor_menu & m : menus) {
        std::erase_if(m.types, [](ggml_type t) { return t == GGML_TYPE_IQ1_S || t == GGML_TYPE_IQ1_M || t == GGML_TYPE_IQ2_S; });
        ASSERT_GT(std::count_if(m.types.begin(), m.types.end(), [](ggml_type t) { return lattice_quantizer(t); }), 2);
    }
    menus[2].types = {GGML_TYPE_IQ2_XXS, GGML_TYPE_IQ3_S, GGML_TYPE_BF16};  // no non-lattice block type: all at first
    const auto whole = sampled_weighted_errors(f, menus, &imp, prune_options{}, 2);
    error_split split = split_for_lattice_grids(menus);
    auto parts = sampled_weighted_errors(f, menus, &imp, prune_options{}, 2, &split.first);
    const auto now = split.needed_now(menus, parts);
    for (size_t i = 0; i < menus.size(); ++i) {
        EXPECT_EQ(std::count(now[i].begin(), now[i].end(), true), 0) << "every tensor here has a fast type of error > 0";
        for (size_t k = 0; k < menus[i].types.size(); ++k) {
            const ggml_type t = menus[i].types[k];
            EXPECT_EQ(split.later[i][k], i < 2 && lattice_quantizer(t)) << menus[i].tensor->name << " " << type_name(t);
            EXPECT_NE(split.first[i][k], split.later[i][k]);
        }
    }
    EXPECT_EQ(eager_types(menus, parts, prune_options{}), eager_types(menus, whole, prune_options{}))
        << "the eager types, chosen before the lattice types' Ê is known";
    const auto later = sampled_weighted_errors(f, menus, &imp, prune_options{}, 2, &split.later);
    for (size_t i = 0; i < menus.size(); ++i) {
        for (size_t k = 0; k < menus[i].types.size(); ++k) {
            parts[i][k] = split.later[i][k] ? later[i][k] : parts[i][k];
        }
    }
    EXPECT_EQ(parts, whole) << "each type's rows are quantized and summed alike in either part";
    // A tensor whose non-lattice block types all measured no error: eager_types chooses among its lattice types too,
    // so they move to what is needed now.
    std::vector<std::vector<double>> zero_fast = whole;
    for (size_t k = 0; k < menus[0].types.size(); ++k) {
        zero_fast[0][k] = lattice_quantizer(menus[0].types[k]) ? zero_fast[0][k] : 0.0;
    }
    error_split again = split_for_lattice_grids(menus);
    const auto now0 = again.needed_now(menus, zero_fast);
    EXPECT_EQ(now0[0], split.later[0]);
    EXPECT_EQ(std::count(again.later[0].begin(), again.later[0].end(), true), 0);
    EXPECT_EQ(again.later[1], split.later[1]);
}
