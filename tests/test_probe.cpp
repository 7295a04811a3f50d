// The anchored probe: the importance-weighted error of every candidate, which candidates it measures, how the
// others are predicted, and that what it measures is what the full probe measures.
#include "ggml/gguf.h"
#include "model/gguf_weights.h"
#include "model/registry.h"
#include "train/candidates.h"
#include "train/loss.h"
#include "train/probe.h"
#include "train/trainer.h"
#include "test_util.h"
#include "tolerance.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>

using namespace voodoo;

namespace {

const double unmeasured = std::numeric_limits<double>::quiet_NaN();

// Two tensors of stories260K, each with its own bytes (F32, the source), Q8_0 and Q4_0 as llama.cpp makes them.
std::vector<gated_tensor> three_candidates(const gguf_file & f, const importance_map * importance) {
    std::vector<gated_tensor> gated;
    for (const char * name : {"blk.0.attn_q.weight", "blk.2.ffn_up.weight"}) {
        gated_tensor g;
        g.tensor = &f.tensor(name);
        g.types = {GGML_TYPE_Q4_0, GGML_TYPE_Q8_0, GGML_TYPE_F32};
        for (ggml_type t : g.types) {
            g.bytes.push_back(quantize_tensor(f, *g.tensor, t, importance_for(importance, *g.tensor)));
        }
        gated.push_back(std::move(g));
    }
    return gated;
}

gated_tensor of_types(std::vector<ggml_type> types) {
    gated_tensor g;
    g.types = std::move(types);
    return g;
}

}  // namespace

TEST(probe, the_weighted_error_is_the_importance_weighted_squared_error_of_each_candidate) {
    const gguf_file f(test::stories260k());
    importance_map importance;
    for (const char * name : {"blk.0.attn_q.weight", "blk.2.ffn_up.weight"}) {
        const std::vector<float> g = test::gaussian(static_cast<size_t>(f.tensor(name).ne[0]), 7);
        std::vector<float> a;
        for (float x : g) {
            a.push_back(0.1f + x * x);  // positive, uneven across columns
        }
        importance[name] = a;
    }
    const std::vector<gated_tensor> gated = three_candidates(f, &importance);
    gguf_weights dense(f);
    const auto err = weighted_errors(dense, gated, &importance, torch::kCPU);
    ASSERT_EQ(err.size(), 2u);
    for (size_t i = 0; i < gated.size(); ++i) {
        const torch::Tensor w = dense.get(gated[i].tensor->name).to(torch::kDouble).reshape({-1, gated[i].tensor->ne[0]});
        const torch::Tensor a = torch::tensor(importance[gated[i].tensor->name], torch::kDouble);
        for (size_t k = 0; k < gated[i].types.size(); ++k) {
            const torch::Tensor q = candidate_weights(gated[i], k, torch::kCPU).to(torch::kDouble);
            const double want = ((w - q).square() * a).sum().item<double>();
            // Per term: the f32 difference, its square and the product with a each round once (≤ 4u relative);
            // the sum is in f64.
            EXPECT_LE(std::abs(err[i][k] - want), test::gamma_n(4) * want + 1e-300)
                << gated[i].tensor->name << " type " << k;
        }
        EXPECT_EQ(err[i][2], 0.0) << "the source's own bytes differ from the source";
        EXPECT_GT(err[i][0], err[i][1]) << "Q4_0 must err more than Q8_0";
    }
    // Without an importance entry every column weighs 1.
    const auto plain = weighted_errors(dense, gated, nullptr, torch::kCPU);
    const torch::Tensor w = dense.get(gated[0].tensor->name).to(torch::kDouble).reshape({-1, gated[0].tensor->ne[0]});
    const double want = (w - candidate_weights(gated[0], 0, torch::kCPU).to(torch::kDouble)).square().sum().item<double>();
    EXPECT_LE(std::abs(plain[0][0] - want), test::gamma_n(3) * want);
}

TEST(probe, an_anchor_plan_measures_block_types_spread_in_error_and_never_the_source_bytes) {
    // Menu Q2_K, Q4_K, Q5_K, Q6_K, Q8_0, F16, BF16 of a BF16 source: BF16 is the source (E = 0), F16 differs
    // in a few rounded values.
    std::vector<gated_tensor> gated = {of_types({GGML_TYPE_Q2_K, GGML_TYPE_Q4_K, GGML_TYPE_Q5_K, GGML_TYPE_Q6_K,
                                                  GGML_TYPE_Q8_0, GGML_TYPE_F16, GGML_TYPE_BF16}),
                                       of_types({GGML_TYPE_F16, GGML_TYPE_BF16})};
    const std::vector<std::vector<double>> err = {{1000, 60, 15, 4, 0.25, 1e-9, 0}, {2e-9, 0}};
    const auto all = anchor_plan(gated, err, 0);
    EXPECT_EQ(all[0], (std::vector<bool>{true, true, true, true, true, true, false}));
    EXPECT_EQ(all[1], (std::vector<bool>{true, false}));
    const auto one = anchor_plan(gated, err, 1);
    EXPECT_EQ(one[0], (std::vector<bool>{true, false, false, false, false, false, false}));
    const auto two = anchor_plan(gated, err, 2);
    EXPECT_EQ(two[0], (std::vector<bool>{true, false, false, false, true, false, false}))
        << "the largest and least error among the block types, not F16";
    // Three: the middle target is ln E = (ln 1000 + ln 0.25) / 2 ≈ 2.76, nearest Q5_K (ln 15 ≈ 2.71).
    const auto three = anchor_plan(gated, err, 3);
    EXPECT_EQ(three[0], (std::vector<bool>{true, false, true, false, true, false, false}));
    // A menu of floats only measures its float type (there is nothing else to measure).
    EXPECT_EQ(two[1], (std::vector<bool>{true, false}));
    // More anchors than types: every block type with E > 0.
    const auto many = anchor_plan(gated, err, 9);
    EXPECT_EQ(many[0], (std::vector<bool>{true, true, true, true, true, false, false}));
}

TEST(probe, unmeasured_types_are_predicted_from_the_error_ratio_of_the_nearest_measured_ones) {
    std::vector<gated_tensor> gated = {of_types({GGML_TYPE_Q2_K, GGML_TYPE_Q4_K, GGML_TYPE_Q6_K, GGML_TYPE_Q8_0,
                                                  GGML_TYPE_F16, GGML_TYPE_BF16})};
    gguf_tensor t;
    t.name = "blk.0.attn_q.weight";
    gated[0].tensor = &t;
    const std::vector<std::vector<double>> err = {{100, 10, 1, 0.01, 1e-6, 0}};
    // Measured Q2_K (ratio 4) and Q6_K (ratio 1): Q4_K lies halfway in ln E, so its ratio is √(4 · 1) = 2;
    // Q8_0 and F16, below the least measured E, keep ratio 1; BF16 (E = 0) is 0.
    std::vector<std::vector<double>> sens = {{400, unmeasured, 1, unmeasured, unmeasured, unmeasured}};
    predict_from_anchors(gated, err, sens);
    EXPECT_DOUBLE_EQ(sens[0][0], 400);
    EXPECT_NEAR(sens[0][1], 20, 20 * 1e-12);
    EXPECT_DOUBLE_EQ(sens[0][2], 1);
    EXPECT_NEAR(sens[0][3], 0.01, 0.01 * 1e-12);
    EXPECT_NEAR(sens[0][4], 1e-6, 1e-6 * 1e-12);
    EXPECT_EQ(sens[0][5], 0.0);
    // A measured ΔKL at or below 0 (the probe's resolution): the ratio is interpolated linearly, not in logs.
    std::vector<std::vector<double>> flat = {{400, unmeasured, -1, unmeasured, unmeasured, unmeasured}};
    predict_from_anchors(gated, err, flat);
    EXPECT_NEAR(flat[0][1], 10 * (4 + 0.5 * (-1 - 4)), 1e-9);
    // Nothing measured: an error naming the tensor and the type.
    std::vector<std::vector<double>> none = {{unmeasured, unmeasured, unmeasured, unmeasured, unmeasured, unmeasured}};
    const std::string msg = test::error_of([&] { predict_from_anchors(gated, err, none); });
    EXPECT_NE(msg.find("blk.0.attn_q.weight"), std::string::npos) << msg;
    EXPECT_NE(msg.find("q2_K"), std::string::npos) << msg;
}

TEST(probe, a_candidates_forward_runs_its_layer_the_later_ones_and_the_head) {
    // stories260K: 5 layers and a head of its own (output.weight). The share of a whole forward's matrix weights each
    // candidate's probe forward runs, counted here from the file's tensors.
    const gguf_file f(test::stories260k());
    ASSERT_NE(f.find_tensor("output.weight"), nullptr);
    std::vector<double> layer(5, 0.0);
    for (const gguf_tensor & t : f.tensors()) {
        if (t.n_dims >= 2 && t.name.rfind("blk.", 0) == 0) {
            layer[static_cast<size_t>(t.name[4] - '0')] += static_cast<double>(t.n_elements());
        }
    }
    const double head = static_cast<double>(f.tensor("output.weight").n_elements());
    const double total = head + layer[0] + layer[1] + layer[2] + layer[3] + layer[4];
    EXPECT_DOUBLE_EQ(probe_forward_share(f, "blk.0.attn_q.weight"), 1.0);
    EXPECT_DOUBLE_EQ(probe_forward_share(f, "blk.3.ffn_up.weight"), (head + layer[3] + layer[4]) / total);
    EXPECT_DOUBLE_EQ(probe_forward_share(f, "blk.4.ffn_down.weight"), (head + layer[4]) / total);
    EXPECT_DOUBLE_EQ(probe_forward_share(f, "output.weight"), head / total);  // only the head runs
    EXPECT_DOUBLE_EQ(probe_forward_share(f, "token_embd.weight"), 1.0);    // the embedding: the whole forward
}

TEST(probe, a_stop_request_ends_the_probe_before_the_next_forward) {
    // Ctrl-C during the probe (minutes at 8B): asked before each candidate's forward, it throws voodoo::stopped saying
    // how far the probe went. Four candidates to measure (Q4_0 and Q8_0 of two tensors; the F32 source's own bytes
    // are measured too, here: no plan).
    const gguf_file f(test::stories260k());
    const std::vector<gated_tensor> gated = three_candidates(f, nullptr);
    std::unique_ptr<causal_lm> model = build_model(f);
    gguf_weights dense(f), teacher(f);
    const torch::Tensor tokens = torch::randint(1, model->hparams().n_vocab, {1, 16}, torch::kLong);
    int asked = 0;
    std::string msg;
    try {
        (void)probe_sensitivity(*model, dense, teacher, gated, tokens, torch::kCPU, 16, torch::kFloat, nullptr,
                                int64_t(2) << 30, nullptr, [&] { return ++asked >= 3; });
        ADD_FAILURE() << "the probe did not stop";
    } catch (const stopped & e) {
        msg = e.what();
    }
    EXPECT_EQ(asked, 3);
    EXPECT_NE(msg.find("after 2 of 6"), std::string::npos) << msg;
    // Never asked to stop: the same ΔKL as without a stop test.
    const auto plain = probe_sensitivity(*model, dense, teacher, gated, tokens, torch::kCPU, 16);
    const auto polled = probe_sensitivity(*model, dense, teacher, gated, tokens, torch::kCPU, 16, torch::kFloat, nullptr,
                                          int64_t(2) << 30, nullptr, [] { return false; });
    EXPECT_EQ(polled, plain);
}

TEST(probe, an_anchored_probe_measures_exactly_what_the_full_probe_measures_at_its_anchors) {
    const gguf_file f(test::stories260k());
    const std::vector<gated_tensor> gated = three_candidates(f, nullptr);
    std::unique_ptr<causal_lm> model = build_model(f);
    gguf_weights dense(f), teacher(f);
    const torch::Tensor tokens = torch::randint(1, model->hparams().n_vocab, {2, 32}, torch::kLong);
    const int64_t chunk = 24;  // not a divisor of the 64 positions: the last chunk is short
    const auto full = probe_sensitivity(*model, dense, teacher, gated, tokens, torch::kCPU, chunk);
    const auto err = weighted_errors(dense, gated, nullptr, torch::kCPU);
    const auto plan = anchor_plan(gated, err, 1);
    const auto part = probe_sensitivity(*model, dense, teacher, gated, tokens, torch::kCPU, chunk, torch::kFloat, &plan);
    for (size_t i = 0; i < gated.size(); ++i) {
        EXPECT_EQ(full[i][2], 0.0) << "the source's own bytes change nothing";
        EXPECT_GT(full[i][0], full[i][1]) << "Q4_0 must cost more KL than Q8_0";
        for (size_t k = 0; k < 3; ++k) {
            if (plan[i][k]) {
                EXPECT_EQ(part[i][k], full[i][k]);  // the same forward on the same tokens
            } else {
                EXPECT_TRUE(std::isnan(part[i][k]));
            }
        }
    }
    // What the probe computes with its cached teacher log-probabilities is the KL of the recipe that differs
    // from the source in that one tensor, as the final selection measures it (chunked_distill, recomputed).
    const double one = recipe_kl(*model, dense, teacher, gated, {0, 2}, tokens, torch::kCPU, chunk);
    EXPECT_EQ(one, full[0][0]);
}

TEST(probe, cpu_defaults_set_only_the_flags_not_given_and_never_a_sequence_longer_than_the_chunks) {
    train_options o;
    o.steps = 7;  // as if given on the command line
    const auto set = apply_cpu_defaults(o, [](const std::string & f) { return f == "--steps"; }, 64);
    EXPECT_EQ(o.steps, 7);
    EXPECT_EQ(o.probe_sequences, 2);
    EXPECT_EQ(o.probe_anchors, 2);
    EXPECT_EQ(o.batch, 2);
    EXPECT_EQ(o.seq, 64) << "at most the calibration chunk length";
    EXPECT_EQ(o.select_sequences, 8);
    EXPECT_EQ(o.prune_stages, "1");
    EXPECT_EQ(set.size(), 6u);
    EXPECT_NE(std::find(set.begin(), set.end(), "--prune-stages 1"), set.end());
    train_options all;
    EXPECT_TRUE(apply_cpu_defaults(all, [](const std::string &) { return true; }, 512).empty());
    EXPECT_EQ(all.steps, train_options{}.steps);
}

TEST(probe, auto_anchors_measure_the_rest_only_within_the_limit_and_a_reused_eager_probe_decides_as_the_first) {
    const test::temp_dir tmp;
    const std::string path = (tmp.path / "probe.auto.json").string();
    // 40 eager forwards in 10 s: 0.25 s each; 100 more take 25 s.
    probe_anchor_choice c = resolve_probe_anchors(path, "id-a", 10.0, 40, 100, 2, 30.0, true);
    EXPECT_EQ(c.anchors, 0);
    EXPECT_EQ(c.seconds_per_forward, 0.25);
    c = resolve_probe_anchors(path, "id-a", 10.0, 40, 100, 2, 20.0, false);
    EXPECT_EQ(c.anchors, 2) << "25 s is over a limit of 20 s: the eager types are the anchors";
    // The eager probe reused (no time of this process): the rate written by the first run decides.
    c = resolve_probe_anchors(path, "id-a", -1, 0, 100, 2, 30.0, false);
    EXPECT_EQ(c.seconds_per_forward, 0.25);
    EXPECT_EQ(c.anchors, 0);
    EXPECT_EQ(resolve_probe_anchors(path, "id-a", -1, 0, 200, 3, 30.0, false).anchors, 3) << "200 forwards: 50 s";
    // Another eager probe's rate, or none: unknown, so the fast choice; nothing left to measure: every type.
    c = resolve_probe_anchors(path, "id-b", -1, 0, 100, 2, 30.0, false);
    EXPECT_TRUE(std::isnan(c.seconds_per_forward));
    EXPECT_EQ(c.anchors, 2);
    EXPECT_EQ(resolve_probe_anchors((tmp.path / "none.json").string(), "id-a", -1, 0, 100, 2, 1e9, false).anchors, 2);
    EXPECT_EQ(resolve_probe_anchors((tmp.path / "none.json").string(), "id-a", -1, 0, 0, 2, 0.0, false).anchors, 0);
    // A file that is not a rate file is named in the error.
    test::write_file(path, "[1, 2]");
    try {
        resolve_probe_anchors(path, "id-a", -1, 0, 100, 2, 30.0, false);
        ADD_FAILURE() << "a rate file without its fields was accepted";
    } catch (const error & e) {
        EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    }
}

TEST(probe, auto_anchors_on_stories260k_probe_as_every_type_or_as_two_anchors_by_the_measured_rate) {
    // `voodoo train` with pruned candidates: --probe-anchors auto with a limit no probe meets measures what
    // --probe-anchors 2 measures, with a limit every probe meets what --probe-anchors 0 measures (the same ΔKL bit for
    // bit, the same recipe), and a run that reuses the eager probe (--probe-file of the first) decides as it did.
    const test::temp_dir tmp;
    const std::string dir = tmp.path.string();
    const std::string text = test::shared_data() + "/text/tinystories/tinystories_val.txt";
    ASSERT_EQ(test::run_voodoo(fmt::format("data --model {} --text {} --ctx 128 --out {}/data", test::stories260k(), text, dir)).exit_code, 0);
    auto train = [&](const std::string & name, const std::string & flags) {
        const auto r = test::run_voodoo(fmt::format("train --model {} --data {}/data --target-bpw 7.5 --menu "
                                                    "Q4_0,IQ4_NL,Q4_1,Q5_0,Q5_1,Q8_0,F16,F32 --steps 4 --batch 2 "
                                                    "--probe-sequences 2 --select-sequences 2 --out {}/{} -t 2 {}",
                                                    test::stories260k(), dir, dir, name, flags));
        EXPECT_EQ(r.exit_code, 0) << r.output;
        return r.output;
    };
    auto probe = [&](const std::string & name) {
        return nlohmann::json::parse(test::read_file(dir + "/" + name + "/probe.json"))["tensors"];
    };
    auto recipe = [&](const std::string & name) {
        nlohmann::json types;  // name → type (the file also records the run's folder)
        for (const auto & t : nlohmann::json::parse(test::read_file(dir + "/" + name + "/recipe.json"))["tensors"]) {
            types[t["name"].get<std::string>()] = t["type"];
        }
        return types;
    };
    const std::string over = train("auto-over", "--probe-anchors auto --probe-auto-seconds 0");
    EXPECT_NE(over.find("probe (--probe-anchors auto): the 2 eager types of each tensor are its anchors"), std::string::npos) << over;
    train("two", "--probe-anchors 2");
    EXPECT_EQ(probe("auto-over"), probe("two"));
    EXPECT_EQ(recipe("auto-over"), recipe("two"));
    const std::string within = train("auto-within", "--probe-anchors auto --probe-auto-seconds 1e9");
    EXPECT_NE(within.find("probe (--probe-anchors auto): every kept type measured"), std::string::npos) << within;
    train("all", "--probe-anchors 0");
    EXPECT_EQ(probe("auto-within"), probe("all"));
    EXPECT_EQ(recipe("auto-within"), recipe("all"));
    EXPECT_TRUE(std::filesystem::exists(dir + "/auto-within/probe.auto.json"));
    const std::string again = train("again", fmt::format("--probe-anchors auto --probe-auto-seconds 1e9 --probe-file {}/auto-within/probe.json", dir));
    EXPECT_NE(again.find("probe of the eager candidates: "), std::string::npos) << again;
    EXPECT_NE(again.find("probe (--probe-anchors auto): every kept type measured"), std::string::npos) << again;
    EXPECT_EQ(recipe("again"), recipe("all"));
}

TEST(probe, the_tf32_scope_turns_tf32_on_for_its_life_and_restores_what_was_set) {
    auto & ctx = at::globalContext();
    const bool before = ctx.allowTF32CuBLAS();
    ctx.setAllowTF32CuBLAS(false);
    {
        const tf32_matmul_scope off(false);  // off: changes nothing
        EXPECT_FALSE(ctx.allowTF32CuBLAS());
        const tf32_matmul_scope on(true);
        EXPECT_TRUE(ctx.allowTF32CuBLAS());
    }
    EXPECT_FALSE(ctx.allowTF32CuBLAS());
    ctx.setAllowTF32CuBLAS(true);
    {
        const tf32_matmul_scope on(true);
        EXPECT_TRUE(ctx.allowTF32CuBLAS());
    }
    EXPECT_TRUE(ctx.allowTF32CuBLAS());  // what was set before, not false
    ctx.setAllowTF32CuBLAS(before);
}
