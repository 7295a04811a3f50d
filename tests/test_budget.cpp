#include "common/error.h"
#include "model/fixture.h"
#include "train/budget.h"
#include "ggml/selection.h"
#include "ggml/types.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <map>
#include <random>

using namespace voodoo;
using voodoo::test::error_of;

namespace {


std::vector<std::vector<double>> random_table(const budget & b, uint32_t seed) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<double> u(0.0, 1.0);
    std::vector<std::vector<double>> v;
    for (const auto & c : b.cost) {
        std::vector<double> row;
        for (size_t k = 0; k < c.size(); ++k) {
            row.push_back(u(rng));
        }
        v.push_back(row);
    }
    return v;
}

// Estimated loss that falls with bytes, like quantization error does.
std::vector<std::vector<double>> loss_falling_with_bytes(const budget & b, uint32_t seed) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<double> u(0.5, 2.0);
    std::vector<std::vector<double>> v;
    for (const auto & c : b.cost) {
        const double sens = u(rng);
        std::vector<double> row;
        for (double bytes : c) {
            row.push_back(sens * 1e4 / bytes);
        }
        v.push_back(row);
    }
    return v;
}

}  // namespace

TEST(budget, sizes_parse_with_decimal_and_binary_units) {
    EXPECT_EQ(parse_size("304352", "--target-size"), 304352);
    EXPECT_EQ(parse_size("300KB", "--target-size"), 300000);
    EXPECT_EQ(parse_size("1.5KiB", "--target-size"), 1536);
    EXPECT_EQ(parse_size("2 MiB", "--target-size"), 2 * 1024 * 1024);
    EXPECT_EQ(parse_size("4.5GiB", "--target-size"), std::floor(4.5 * 1024 * 1024 * 1024));
    EXPECT_EQ(parse_size("1gb", "--target-size"), 1e9);
    // The bare K/M/G of ls -h and df -h (issue #21: "4G" and "300k" were refused): powers of 1024.
    EXPECT_EQ(parse_size("4G", "--target-size"), 4.0 * 1024 * 1024 * 1024);
    EXPECT_EQ(parse_size("300k", "--target-size"), 300 * 1024);
    EXPECT_EQ(parse_size("21.5M", "--target-size"), std::floor(21.5 * 1024 * 1024));
    const std::string msg = error_of([] { parse_size("lots", "--target-size"); });
    EXPECT_NE(msg.find("--target-size 'lots'"), std::string::npos) << msg;
}

TEST(budget, menus_parse_and_sort_by_bits_per_weight) {
    EXPECT_EQ(parse_menu("Q8_0, q4_0,Q5_1", "--menu"),
              (std::vector<ggml_type>{GGML_TYPE_Q4_0, GGML_TYPE_Q5_1, GGML_TYPE_Q8_0}));
    EXPECT_NE(error_of([] { parse_menu("Q4_0,Q4_K_M", "--menu"); }).find("Q4_K_M"), std::string::npos);
    // "all" stands alone, in any case (a new user's trial: "all,q4_K" was "unknown ggml type 'all'").
    EXPECT_TRUE(is_all_menu("all"));
    EXPECT_TRUE(is_all_menu(" ALL "));
    EXPECT_FALSE(is_all_menu("all,q4_K"));
    EXPECT_NE(error_of([] { parse_menu("all,q4_K", "--menu"); }).find("'all' stands alone"), std::string::npos);
    const auto role = parse_menu_for("attn_.*=Q4_0,Q8_0");
    EXPECT_EQ(role.first, "attn_.*");
    EXPECT_NE(error_of([] { parse_menu_for("Q4_0"); }).find("PATTERN=TYPES"), std::string::npos);
    EXPECT_NE(error_of([] { parse_menu_for("attn_[=Q4_0"); }).find("regular expression"), std::string::npos);
}

TEST(budget, the_menu_flags_of_train_and_quantize_apply_alike) {
    // apply_menu_flags is what both commands do with --menu, --menu-for and a speed limit.
    menu_options m;
    apply_menu_flags(m, "", {}, false);
    EXPECT_TRUE(m.types.empty());  // the default menu
    EXPECT_FALSE(m.with_fallbacks);
    apply_menu_flags(m, " All ", {}, false);
    EXPECT_TRUE(m.with_fallbacks);
    menu_options listed;
    apply_menu_flags(listed, "Q8_0,Q4_K", {"attn_.*=Q4_0,Q8_0", "ffn_down.*=Q6_K"}, true);
    EXPECT_EQ(listed.types, (std::vector<ggml_type>{GGML_TYPE_Q4_K, GGML_TYPE_Q8_0}));
    EXPECT_TRUE(listed.with_fallbacks) << "a speed limit keeps the fastest CPU kernels' types";
    ASSERT_EQ(listed.per_role.size(), 2u);
    EXPECT_EQ(listed.per_role[1].first, "ffn_down.*");
    EXPECT_NE(error_of([] { menu_options bad; apply_menu_flags(bad, "Q4_K,all", {}, false); }).find("--menu"),
              std::string::npos);
}

TEST(budget, stories260k_menus_follow_block_sizes_and_roles) {
    gguf_file f(test::stories260k());
    const auto menus = build_menus(f, {});
    EXPECT_EQ(menus.size(), 37u);
    int float_only = 0;
    for (const auto & m : menus) {
        float_only += m.float_only;
        if (m.tensor->name == "blk.0.ffn_down.weight") {
            EXPECT_EQ(m.types, (std::vector<ggml_type>{GGML_TYPE_F16, GGML_TYPE_BF16}));
        }
    }
    EXPECT_EQ(float_only, 5);

    menu_options roles;
    roles.types = {GGML_TYPE_Q4_0, GGML_TYPE_Q8_0, GGML_TYPE_F16};
    roles.per_role = {parse_menu_for("attn_.*=Q5_0,Q5_1")};
    for (const auto & m : build_menus(f, roles)) {
        if (m.tensor->name.find("attn_") != std::string::npos) {
            EXPECT_EQ(m.types, (std::vector<ggml_type>{GGML_TYPE_Q5_0, GGML_TYPE_Q5_1})) << m.tensor->name;
        }
    }
}

TEST(budget, the_default_menu_offers_the_fallback_types_only_where_no_256_block_type_fits) {
    // stories260K: 64- and 172-wide rows, no 256-block type fits, so the default menu keeps Q4_0 … Q5_1 and IQ4_NL.
    gguf_file small(test::stories260k());
    for (const auto & m : build_menus(small, {})) {
        EXPECT_EQ(m.types, menu_for(default_menu_types(), m.tensor->ne[0], false)) << m.tensor->name;
    }
    // mix30M: every row a multiple of 256; without them by default, with them under with_fallbacks (--menu all).
    gguf_file mix(test::shared_data() + "/models/mix30M/mix30M.gguf");
    menu_options all;
    all.with_fallbacks = true;
    const auto lean = build_menus(mix, {});
    const auto full = build_menus(mix, all);
    ASSERT_EQ(lean.size(), full.size());
    for (size_t i = 0; i < lean.size(); ++i) {
        EXPECT_EQ(std::count_if(lean[i].types.begin(), lean[i].types.end(), is_fallback_type), 0) << lean[i].tensor->name;
        EXPECT_EQ(std::count_if(full[i].types.begin(), full[i].types.end(), is_fallback_type), 5) << full[i].tensor->name;
        EXPECT_EQ(lean[i].types.size() + 5, full[i].types.size()) << lean[i].tensor->name;
    }
    // A --menu the user names is used as given, fallback types included.
    menu_options named;
    named.types = {GGML_TYPE_Q4_0, GGML_TYPE_Q4_K, GGML_TYPE_Q8_0};
    for (const auto & m : build_menus(mix, named)) {
        EXPECT_EQ(m.types, named.types) << m.tensor->name;
    }
}

TEST(budget, a_menu_type_no_tensor_can_take_is_refused) {
    gguf_file f(test::stories260k());
    menu_options k;
    k.types = {GGML_TYPE_Q4_K, GGML_TYPE_Q8_0};
    const std::string msg = error_of([&] { build_menus(f, k); });
    EXPECT_NE(msg.find("q4_K fits no tensor"), std::string::npos) << msg;
    menu_options iq;
    iq.types = {GGML_TYPE_IQ2_XXS, GGML_TYPE_Q8_0};
    EXPECT_NE(error_of([&] { build_menus(f, iq); }).find("imatrix"), std::string::npos);
}

TEST(budget, an_impossible_target_is_refused_with_the_feasible_range) {
    gguf_file f(test::stories260k());
    const auto menus = build_menus(f, {});
    const std::string low = error_of([&] { make_budget(f, menus, {target_kind::size, 1000}, {}); });
    EXPECT_NE(low.find("size=1000"), std::string::npos) << low;
    EXPECT_NE(low.find("from "), std::string::npos) << low;
    EXPECT_NE(error_of([&] { make_budget(f, menus, {target_kind::bpw, 40}, {}); }).find("BPW"), std::string::npos);
    EXPECT_NE(error_of([&] { make_budget(f, menus, {target_kind::ratio, 0.05}, {}); }).find("ratio=0.05"),
              std::string::npos);
}

TEST(budget, the_all_cheapest_total_is_the_exported_file_size) {
    gguf_file f(test::stories260k());
    const auto menus = build_menus(f, {});
    const budget b = make_budget(f, menus, {target_kind::size, 400000}, {});
    std::vector<int> cheapest(menus.size(), 0), dearest;
    for (const auto & m : menus) {
        dearest.push_back(static_cast<int>(m.types.size()) - 1);
    }
    EXPECT_EQ(b.total(cheapest), b.min_total);
    EXPECT_EQ(b.total(dearest), b.max_total);
    const target goal{target_kind::size, 400000};
    EXPECT_EQ(static_cast<double>(planned_file_bytes(f, recipe_from_choice(f, menus, cheapest, {}, goal), {})),
              b.min_total);
    EXPECT_EQ(static_cast<double>(planned_file_bytes(f, recipe_from_choice(f, menus, dearest, {}, goal), {})),
              b.max_total);
}

TEST(budget, finalized_recipes_never_exceed_the_target_across_the_feasible_range) {
    voodoo::test::temp_dir dir;
    gguf_file f(test::stories260k());
    const auto menus = build_menus(f, {});
    const budget range = make_budget(f, menus, {target_kind::size, 400000}, {});
    int checked = 0;
    for (int i = 0; i <= 10; ++i) {
        for (target_kind kind : {target_kind::size, target_kind::bpw, target_kind::ratio}) {
            const double bytes = range.min_total + (range.max_total - range.min_total) * i / 10.0;
            target goal{kind, 0};
            if (kind == target_kind::size) {
                goal.value = std::floor(bytes);
            } else if (kind == target_kind::bpw) {
                goal.value = 8.0 * (bytes - range.fixed) / static_cast<double>(range.n_weights) + 0.2;
            } else {
                goal.value = bytes / static_cast<double>(q8_0_file_bytes(f, {}));
            }
            budget b;
            try {
                b = make_budget(f, menus, goal, {});
            } catch (const error &) {
                continue;  // a bpw point past the range's edge
            }
            SCOPED_TRACE(goal.str());
            ++checked;
            const auto probs = random_table(b, 100 + i);
            const auto choice = finalize_choice(b, probs, loss_falling_with_bytes(b, 200 + i));
            const double total = b.total(choice);
            EXPECT_LE(total, b.limit);
            const recipe r = recipe_from_choice(f, menus, choice, probs, goal);
            if (kind == target_kind::bpw) {
                size_t tensor_bytes_total = 0;
                for (const auto & t : f.tensors()) {
                    const auto it = std::find_if(r.tensors.begin(), r.tensors.end(),
                                                 [&](const recipe_tensor & rt) { return rt.name == t.name; });
                    tensor_bytes_total += it == r.tensors.end() ? t.n_bytes : it->bytes;
                }
                EXPECT_EQ(static_cast<double>(tensor_bytes_total), total);
                EXPECT_LE(8.0 * tensor_bytes_total / static_cast<double>(b.n_weights), goal.value);
            } else {
                EXPECT_EQ(static_cast<double>(planned_file_bytes(f, r, {})), total);
            }
            if (i == 5 && kind == target_kind::size) {
                const auto out = dir.file("final.gguf");
                EXPECT_EQ(static_cast<double>(export_gguf(f, r, out, {}).file_bytes), total);
            }
        }
    }
    EXPECT_GE(checked, 30);
}

TEST(budget, repair_downgrades_the_cheapest_loss_per_byte_first_then_spends_the_rest) {
    budget b;
    b.goal = {target_kind::size, 0};
    b.fixed = 100;
    b.n_weights = 1;
    b.cost = {{10, 20, 40}, {10, 20, 40}};
    b.min_total = 120;
    b.max_total = 180;
    b.limit = 150;
    const std::vector<std::vector<double>> probs = {{0, 0, 1}, {0, 0, 1}};  // argmax: both dearest = 180
    // Tensor 0 loses little when downgraded, tensor 1 a lot.
    const std::vector<std::vector<double>> loss = {{1.0, 0.2, 0.0}, {50.0, 10.0, 0.0}};
    const auto choice = finalize_choice(b, probs, loss);
    EXPECT_EQ(choice, (std::vector<int>{0, 2}));  // 100 + 10 + 40 = 150: tensor 0 gives its bytes
    EXPECT_EQ(b.total(choice), 150);
    b.limit = 165;  // 15 left after repair cannot buy tensor 0's next step (10 → 20 fits)
    EXPECT_EQ(finalize_choice(b, probs, loss), (std::vector<int>{1, 2}));
}

TEST(budget, a_same_cost_type_with_a_lower_estimated_loss_is_taken) {
    budget b;
    b.goal = {target_kind::size, 0};
    b.fixed = 0;
    b.n_weights = 1;
    b.cost = {{10, 10}};  // F16 and BF16: same bytes
    b.min_total = 10;
    b.max_total = 10;
    b.limit = 10;
    EXPECT_EQ(finalize_choice(b, {{0, 1}}, {{0.001, 0.01}}), (std::vector<int>{0}));
    EXPECT_EQ(finalize_choice(b, {{1, 0}}, {{0.001, 0.01}}), (std::vector<int>{0}));
}

TEST(budget, a_tensor_the_imatrix_does_not_cover_gets_no_type_that_needs_one) {
    // llama-quantize refuses IQ1/IQ2/IQ3_XXS for a tensor without imatrix data; token_embd has none (no matmul
    // reads it), so with an imatrix only the covered tensors are offered those types.
    test::temp_dir dir;
    fixture_spec s;
    s.vocab_path = voodoo::test::llama_spm_vocab();
    s.n_layer = 1;
    write_fixture(s, dir.file("m.gguf"));
    const gguf_file file(dir.file("m.gguf"));
    importance_map importance;
    for (const gguf_tensor & t : file.tensors()) {
        if (t.name.starts_with("blk.") || t.name == "output.weight") {
            importance[t.name] = std::vector<float>(static_cast<size_t>(t.ne[0]), 1.0f);
        }
    }
    menu_options o;
    o.has_imatrix = true;
    o.importance = &importance;
    std::map<std::string, std::vector<ggml_type>> menu;
    for (const tensor_menu & m : build_menus(file, o)) {
        menu[m.tensor->name] = m.types;
    }
    auto has = [](const std::vector<ggml_type> & types, ggml_type t) { return std::count(types.begin(), types.end(), t) > 0; };
    EXPECT_TRUE(has(menu.at("blk.0.attn_q.weight"), GGML_TYPE_IQ1_S));
    EXPECT_TRUE(has(menu.at("output.weight"), GGML_TYPE_IQ2_XXS));
    EXPECT_FALSE(has(menu.at("token_embd.weight"), GGML_TYPE_IQ1_S));
    EXPECT_FALSE(has(menu.at("token_embd.weight"), GGML_TYPE_IQ2_XXS));
    EXPECT_FALSE(has(menu.at("token_embd.weight"), GGML_TYPE_IQ2_XS));
    EXPECT_TRUE(has(menu.at("token_embd.weight"), GGML_TYPE_IQ3_S));
}

TEST(budget, allocate_exact_finds_the_least_estimated_loss_that_fits) {
    // Small instances against brute force: costs in whole bytes and a grid of one byte, so the DP is exact.
    std::mt19937 rng(7);
    std::uniform_int_distribution<int> bytes(1, 40);
    std::uniform_real_distribution<double> loss(0.0, 1.0);
    for (int trial = 0; trial < 50; ++trial) {
        budget b;
        b.goal = {target_kind::size, 0};
        b.fixed = 100;
        b.n_weights = 1;
        std::vector<std::vector<double>> est;
        b.min_total = b.max_total = b.fixed;
        for (int t = 0; t < 4; ++t) {
            std::vector<double> c, l;
            for (int k = 0; k < 4; ++k) {
                c.push_back(bytes(rng));
                l.push_back(loss(rng));
            }
            b.min_total += *std::min_element(c.begin(), c.end());
            b.max_total += *std::max_element(c.begin(), c.end());
            b.cost.push_back(c);
            est.push_back(l);
        }
        b.limit = b.min_total + std::floor((b.max_total - b.min_total) * loss(rng));
        double best = std::numeric_limits<double>::infinity();
        for (int code = 0; code < 256; ++code) {
            const std::vector<int> c = {code & 3, (code >> 2) & 3, (code >> 4) & 3, (code >> 6) & 3};
            if (b.total(c) <= b.limit) {
                best = std::min(best, estimated_loss(est, c));
            }
        }
        const auto choice = allocate_exact(b, est, static_cast<int64_t>(b.max_total - b.min_total));
        SCOPED_TRACE(trial);
        EXPECT_LE(b.total(choice), b.limit);
        EXPECT_DOUBLE_EQ(estimated_loss(est, choice), best);
    }
}

TEST(budget, a_larger_budget_never_gives_a_higher_estimated_loss) {
    // The finalize's exact allocation on stories260K's real menus and byte costs, 300 budgets across the
    // feasible range, with a loss that falls with bytes and with one that does not (random per type).
    gguf_file f(test::stories260k());
    const auto menus = build_menus(f, {});
    const budget range = make_budget(f, menus, {target_kind::size, 400000}, {});
    for (uint32_t seed : {1u, 2u}) {
        const auto est = seed == 1 ? loss_falling_with_bytes(range, 300) : random_table(range, 301);
        double previous = std::numeric_limits<double>::infinity();
        double previous_total = 0;
        for (int i = 0; i <= 300; ++i) {
            budget b = range;
            b.limit = std::floor(range.min_total + (range.max_total - range.min_total) * i / 300.0);
            const auto choice = allocate_exact(b, est);
            const double loss = estimated_loss(est, choice);
            SCOPED_TRACE(fmt::format("seed {} limit {}", seed, b.limit));
            EXPECT_LE(b.total(choice), b.limit);
            EXPECT_LE(loss, previous);
            previous = loss;
            previous_total = b.total(choice);
        }
        EXPECT_GT(previous_total, range.min_total);
    }
}

TEST(budget, a_finer_grid_never_gives_a_higher_estimated_loss) {
    // Costs round up to the grid; a grid whose step divides the coarse one's keeps every choice the coarse one
    // allowed, so its optimum can only be as good or better.
    gguf_file f(test::stories260k());
    const auto menus = build_menus(f, {});
    budget b = make_budget(f, menus, {target_kind::size, 300000}, {});
    const auto est = loss_falling_with_bytes(b, 5);
    const auto coarse = allocate_exact(b, est, 64);
    const auto fine = allocate_exact(b, est, int64_t(1) << 18);
    EXPECT_LE(b.total(coarse), b.limit);
    EXPECT_LE(b.total(fine), b.limit);
    EXPECT_LE(estimated_loss(est, fine), estimated_loss(est, coarse));
}
