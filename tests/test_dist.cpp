// Several processes (issue #17): torchrun's variables, the layer balance, hidden_layers as a pipeline, and layer
// sharding over two Gloo processes against the single process.
#include "common/error.h"
#include "dist/dist.h"
#include "ggml/gguf.h"
#include "imatrix/imatrix.h"
#include "model/fixture.h"
#include "model/gguf_weights.h"
#include "model/registry.h"
#include "test_util.h"
#include "tolerance.h"
#include "train/candidates.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <tuple>

#include <sched.h>

using namespace voodoo;

namespace {

nlohmann::json read_json(const std::string & path) {
    std::ifstream in(path);
    return nlohmann::json::parse(in);
}

struct scoped_env {
    std::vector<std::string> names;
    void set(const char * n, const char * v) {
        setenv(n, v, 1);
        names.push_back(n);
    }
    ~scoped_env() {
        for (const auto & n : names) {
            unsetenv(n.c_str());
        }
    }
};

}  // namespace

TEST(dist, torchruns_variables_are_read_and_bad_ones_named) {
    {
        scoped_env e;
        unsetenv("WORLD_SIZE");
        EXPECT_FALSE(dist::launch_env_from_environment().has_value());
    }
    {
        scoped_env e;
        e.set("WORLD_SIZE", "4");
        e.set("RANK", "3");
        e.set("LOCAL_RANK", "1");
        e.set("MASTER_ADDR", "10.0.0.7");
        e.set("MASTER_PORT", "29511");
        const auto env = dist::launch_env_from_environment();
        ASSERT_TRUE(env.has_value());
        EXPECT_EQ(env->rank, 3);
        EXPECT_EQ(env->world_size, 4);
        EXPECT_EQ(env->local_rank, 1);
        EXPECT_EQ(env->master_addr, "10.0.0.7");
        EXPECT_EQ(env->master_port, 29511);
    }
    {
        scoped_env e;
        e.set("WORLD_SIZE", "2");
        e.set("RANK", "2");
        e.set("MASTER_PORT", "29500");
        EXPECT_NE(test::error_of([] { dist::launch_env_from_environment(); }).find("RANK=2 is outside [0, WORLD_SIZE=2)"),
                  std::string::npos);
    }
    {
        scoped_env e;
        e.set("WORLD_SIZE", "2");
        e.set("RANK", "0");
        EXPECT_NE(test::error_of([] { dist::launch_env_from_environment(); }).find("MASTER_PORT is not set"),
                  std::string::npos);
        e.set("MASTER_PORT", "http");
        EXPECT_NE(test::error_of([] { dist::launch_env_from_environment(); }).find("MASTER_PORT='http' is not an integer"),
                  std::string::npos);
    }
}

TEST(dist, layers_are_balanced_by_bytes_and_every_rank_gets_some) {
    using ranges = std::vector<std::pair<int64_t, int64_t>>;
    // By bytes, not by count: the heavy fifth layer goes alone.
    EXPECT_EQ(dist::balance_layers({1, 1, 1, 1, 10, 1}, 2), (ranges{{0, 4}, {4, 6}}));
    EXPECT_EQ(dist::balance_layers({5, 5, 5, 5}, 2), (ranges{{0, 2}, {2, 4}}));
    EXPECT_EQ(dist::balance_layers({5, 5, 5, 5}, 4), (ranges{{0, 1}, {1, 2}, {2, 3}, {3, 4}}));
    EXPECT_EQ(dist::balance_layers({5, 5, 5, 5}, 1), (ranges{{0, 4}}));
    // The embedding on the first rank and the head on the last count too.
    EXPECT_EQ(dist::balance_layers({5, 5, 5, 5}, 2, 10, 0), (ranges{{0, 1}, {1, 4}}));
    EXPECT_EQ(dist::balance_layers({5, 5, 5, 5}, 2, 0, 10), (ranges{{0, 3}, {3, 4}}));
    EXPECT_NE(test::error_of([] { dist::balance_layers({1, 1}, 3); }).find("2 layers cannot be split over 3 ranks"),
              std::string::npos);
}

TEST(dist, hidden_layers_in_a_pipeline_equal_hidden_bit_for_bit) {
    const gguf_file file(test::stories260k());
    auto model = build_model(file);
    gguf_weights w(file);
    const torch::Tensor tokens = torch::arange(1, 33, torch::kLong).view({1, 32});
    const torch::Tensor whole = model->hidden(tokens, w);
    const int64_t L = model->hparams().n_layer;
    torch::Tensor x = model->hidden_layers(tokens, torch::Tensor(), 0, 2, w);
    x = model->hidden_layers(tokens, x, 2, 3, w);
    x = model->hidden_layers(tokens, x, 3, L, w);
    EXPECT_TRUE(torch::equal(x, whole));
    EXPECT_FALSE(torch::equal(model->hidden_layers(tokens, torch::Tensor(), 0, 2, w), model->hidden_layers(tokens, torch::Tensor(), 0, 3, w)));
    EXPECT_NE(test::error_of([&] { model->hidden_layers(tokens, torch::Tensor(), 1, 2, w); }).find("needs the hidden states"),
              std::string::npos);
    EXPECT_NE(test::error_of([&] { model->hidden_layers(tokens, torch::Tensor(), 0, L + 1, w); }).find("inside [0,"),
              std::string::npos);
    EXPECT_NE(test::error_of([&] { model->hidden_layers(tokens, torch::zeros({1, 32, 3}), 1, 2, w); }).find("expected [1, 32,"),
              std::string::npos);
    // After a range, the model's own hidden() is whole again.
    EXPECT_TRUE(torch::equal(model->hidden(tokens, w), whole));
}

namespace {

/// The worker once as a single process and once as `ranks` Gloo processes on this machine (mode: layers, tp or
/// tp-without-f): both outputs.
std::pair<nlohmann::json, nlohmann::json> single_and_sharded(const std::string & model, int ranks, const test::temp_dir & dir,
                                                             const std::string & mode = "layers") {
    const std::string worker = VOODOO_DIST_WORKER_BIN;
    const test::run_result single =
        test::run_shell(fmt::format("env -u WORLD_SIZE {} {} {} 3 {} 2>&1", worker, model, dir.file("one.json"), mode));
    EXPECT_EQ(single.exit_code, 0) << single.output;
    // Ranks 1.. in the background (their output to files), rank 0 in the foreground; every exit status counts.
    std::string cmd = fmt::format("export WORLD_SIZE={} MASTER_ADDR=127.0.0.1 MASTER_PORT={}; pids=; ", ranks, dist::free_tcp_port());
    for (int r = 1; r < ranks; ++r) {
        cmd += fmt::format("RANK={} {} {} {} 3 {} > {} 2>&1 & pids=\"$pids $!\"; ", r, worker, model, dir.file("many.json"),
                           mode, dir.file(fmt::format("rank{}.log", r)));
    }
    cmd += fmt::format("RANK=0 {} {} {} 3 {} 2>&1; s=$?; for p in $pids; do wait $p || s=1; done; cat {}/rank*.log; exit $s",
                       worker, model, dir.file("many.json"), mode, dir.path.string());
    const test::run_result many = test::run_shell(cmd);
    EXPECT_EQ(many.exit_code, 0) << many.output;
    return {read_json(dir.file("one.json")), read_json(dir.file("many.json"))};
}

}  // namespace

namespace {

/// voodoo-dist-check as `ranks` processes on this host (torchrun's variables, LOCAL_RANK = RANK) on `device`: the
/// exit status (0 when every rank's collectives gave the exact values) and every rank's output.
test::run_result run_dist_check(int ranks, const std::string & device) {
    std::string cmd = fmt::format("export WORLD_SIZE={} MASTER_ADDR=127.0.0.1 MASTER_PORT={}; pids=; d=$(mktemp -d); ", ranks,
                                  dist::free_tcp_port());
    for (int r = 1; r < ranks; ++r) {
        cmd += fmt::format("RANK={0} LOCAL_RANK={0} {1} {2} > $d/{0}.log 2>&1 & pids=\"$pids $!\"; ", r,
                           VOODOO_DIST_CHECK_BIN, device);
    }
    cmd += fmt::format("RANK=0 LOCAL_RANK=0 {} {} 2>&1; s=$?; for p in $pids; do wait $p || s=1; done; cat $d/*.log 2>/dev/null; "
                       "rm -rf $d; exit $s", VOODOO_DIST_CHECK_BIN, device);
    return test::run_shell(cmd);
}

}  // namespace

TEST(dist, a_process_groups_sums_maximum_messages_and_barrier_are_exact_on_every_rank) {
    // Small integers, exact in f32 and bf16 whatever the order of the sum: every rank checks the exact values
    // (tests/dist_check.cpp). Gloo with two processes on the CPU; NCCL, one process a GPU, where this build has it.
    int checked = 0;
    if (dist::have_gloo()) {
        const test::run_result two = run_dist_check(2, "cpu");
        EXPECT_EQ(two.exit_code, 0) << two.output;
        EXPECT_NE(two.output.find("rank 1 of 2: gloo on cpu"), std::string::npos) << two.output;
        ++checked;
    }
    if (dist::have_nccl() && torch::cuda::device_count() > 0) {
        const int ranks = std::min<int>(2, static_cast<int>(torch::cuda::device_count()));
        const test::run_result gpus = run_dist_check(ranks, "cuda");
        EXPECT_EQ(gpus.exit_code, 0) << gpus.output;
        EXPECT_NE(gpus.output.find(fmt::format("rank 0 of {}: nccl on cuda:0", ranks)), std::string::npos) << gpus.output;
        ++checked;
    }
    if (checked == 0) {
        GTEST_SKIP() << "this build has neither c10d Gloo (libgloo-dev) nor NCCL with a GPU";
    }
}

TEST(dist, layer_sharding_over_gloo_processes_gives_the_single_process_gradients_and_recipe_bit_for_bit) {
    if (!dist::have_gloo()) {
        GTEST_SKIP() << "this build has no c10d Gloo (libgloo-dev)";
    }
    // Layer sharding changes no arithmetic: each rank runs the single process's operations on its layers, and only a
    // gate used on two ranks (the tied head: the embedding on the first rank, the head on the last) gets its two parts
    // summed, a + b, as the single process sums them. So the bound is 0: every loss, every gate gradient and every
    // gate after 3 AdamW steps bit for bit, hence the same recipe. stories260K (untied) on 2 ranks; a tied 4-layer
    // llama fixture on 3.
    test::temp_dir dir;
    fixture_spec tied;
    tied.arch = "llama";
    tied.n_embd = 64;
    tied.n_layer = 4;
    tied.n_head = 4;
    tied.n_head_kv = 2;
    tied.head_dim = 16;
    tied.n_ff = 128;
    tied.seed = 11;
    tied.tied_output = true;
    tied.weight_type = GGML_TYPE_F32;
    tied.vocab_path = voodoo::test::llama_spm_vocab();
    write_fixture(tied, dir.file("tied.gguf"));
    for (const auto & [model, ranks] : {std::pair{test::stories260k(), 2}, std::pair{dir.file("tied.gguf"), 3}}) {
        SCOPED_TRACE(fmt::format("{} on {} ranks", model, ranks));
        test::temp_dir work;
        const auto [a, b] = single_and_sharded(model, ranks, work);
        ASSERT_FALSE(a.is_null());
        ASSERT_FALSE(b.is_null());
        EXPECT_EQ(a["ranks"], 1);
        EXPECT_EQ(b["ranks"], ranks);
        ASSERT_EQ(b["layers"].size(), static_cast<size_t>(ranks));
        for (int r = 1; r < ranks; ++r) {
            EXPECT_EQ(b["layers"][r - 1][1], b["layers"][r][0]);  // contiguous
        }
        EXPECT_EQ(a["losses"], b["losses"]);
        ASSERT_EQ(a["grads"].size(), b["grads"].size());
        int nonzero = 0;
        for (size_t i = 0; i < a["grads"].size(); ++i) {
            EXPECT_EQ(a["grads"][i], b["grads"][i]) << "gate " << i << " (" << a["recipe"][i][0] << ")";
            nonzero += a["grads"][i][0].get<uint32_t>() != 0;
        }
        EXPECT_EQ(nonzero, static_cast<int>(a["grads"].size()));  // every gate is used and learns
        EXPECT_EQ(a["gates"], b["gates"]);
        EXPECT_EQ(a["recipe"], b["recipe"]);
    }
}

namespace {

/// How far the tensor-parallel run `b` may be from the single process `a` (both from the worker), and how far it is,
/// for the losses of every step and every gate's last gradient. The two runs differ only in the order of sums (the
/// row-parallel products summed over ranks, f's gradient sums, the cross-rank log-sum-exp, the gate gradients' sums
/// over ranks). To first order, by Higham's rule for sums in any order (tolerance.h), each quantity moves by at most
/// γ_n times the magnitude of its terms, n the longest chain of dependent sums: the forward's (`chain_forward`, from
/// the worker: per layer 4·n_embd + head_dim + 2·T + n_head·head_dim + n_ff, then n_embd + n_vocab for the head and
/// the log-sum-exp) for the losses, the forward's and the backward's (twice that) for the gradients. The magnitudes
/// come from the single process: for CE the log-sum-exp and the target's logit, for KL p_t(|log p_t| + |log p_s|); for
/// the gradient of gate k, p_k Σ_j p_j ⟨|G|, |D_k − D_j|⟩ with |G| = Σ_t |∂L/∂y_t|ᵀ|x_t| (an error of ∂L/∂W through
/// the mixture's candidates D), plus γ_{K+2+ranks} p_k(|∂L/∂p_k| + Σ_j p_j|∂L/∂p_j|) for the f32 softmax backward and
/// the sum over ranks.
struct tp_comparison {
    double worst_loss = 0;  // the largest |Δ| / bound over the losses
    double worst_grad = 0;  // … over the gate gradients
    int grads_over = 0;     // gate-gradient entries past their bound
    int grads = 0;
};

tp_comparison compare_tp(const nlohmann::json & a, const nlohmann::json & b, int ranks) {
    tp_comparison c;
    const int64_t chain = a["chain_forward"].get<int64_t>();
    for (size_t s = 0; s < a["losses"].size(); ++s) {
        for (size_t i = 0; i < 2; ++i) {
            const double bound = test::gamma_n(chain) * a["loss_scales"][i].get<double>();
            c.worst_loss = std::max(c.worst_loss, std::abs(a["losses"][s][i].get<double>() - b["losses"][s][i].get<double>()) / bound);
        }
    }
    for (size_t g = 0; g < a["grad_values"].size(); ++g) {
        const size_t K = a["grad_values"][g].size();
        for (size_t k = 0; k < K; ++k) {
            const double bound = test::gamma_n(2 * chain) * a["grad_scales"][g][k].get<double>() +
                                 test::gamma_n(static_cast<int64_t>(K) + 2 + ranks) * a["grad_local_scales"][g][k].get<double>();
            const double r = std::abs(a["grad_values"][g][k].get<double>() - b["grad_values"][g][k].get<double>()) / bound;
            c.worst_grad = std::max(c.worst_grad, r);
            c.grads_over += r > 1;
            c.grads += 1;
        }
    }
    return c;
}

fixture_spec small_fixture(const std::string & arch, bool tied, int n_layer) {
    fixture_spec f;
    f.arch = arch;
    f.n_embd = 64;
    f.n_layer = n_layer;
    f.n_head = 4;
    f.n_head_kv = 2;
    f.head_dim = arch == "qwen3" ? 32 : 16;
    f.n_ff = arch == "qwen3" ? 192 : 128;
    f.seed = 11;
    f.tied_output = tied;
    f.weight_type = GGML_TYPE_F32;
    f.vocab_path = std::string(VOODOO_LLAMA_MODELS_DIR) + (arch == "llama" ? "/ggml-vocab-llama-spm.gguf" : "/ggml-vocab-qwen2.gguf");
    return f;
}

}  // namespace

TEST(dist, tensor_parallel_gloo_processes_give_the_single_process_losses_gradients_and_recipe_within_the_summation_bound) {
    if (!dist::have_gloo()) {
        GTEST_SKIP() << "this build has no c10d Gloo (libgloo-dev)";
    }
    // Megatron-style tensor parallelism over 2 Gloo processes: q/k/v and gate/up column-parallel, attn_output and
    // ffn_down row-parallel, the vocabulary split for the embedding and the head (CE and KL through a cross-rank
    // log-sum-exp), each rank holding only its shard of every candidate. Against the single process: every loss and
    // every gate gradient within the bound compare_tp derives, and the same recipe after 3 AdamW steps. llama tied
    // and untied, qwen2 (Q/K/V biases) and qwen3 (per-head Q/K norms).
    test::temp_dir dir;
    const std::vector<std::pair<std::string, fixture_spec>> models = {
        {"llama-tied", small_fixture("llama", true, 4)},
        {"llama-untied", small_fixture("llama", false, 4)},
        {"qwen2", small_fixture("qwen2", false, 2)},
        {"qwen3", small_fixture("qwen3", true, 3)},
    };
    for (const auto & [name, spec] : models) {
        SCOPED_TRACE(name);
        write_fixture(spec, dir.file(name + ".gguf"));
        test::temp_dir work;
        const auto [a, b] = single_and_sharded(dir.file(name + ".gguf"), 2, work, "tp");
        ASSERT_FALSE(a.is_null());
        ASSERT_FALSE(b.is_null());
        EXPECT_EQ(b["ranks"], 2);
        const tp_comparison c = compare_tp(a, b, 2);
        EXPECT_LE(c.worst_loss, 1.0);
        EXPECT_EQ(c.grads_over, 0) << "worst |Δ| / bound " << c.worst_grad;
        EXPECT_GT(c.grads, 0);
        EXPECT_EQ(a["recipe"], b["recipe"]);
    }
}

TEST(dist, ranks_that_recompute_their_layers_give_the_single_process_gradients_bit_for_bit_with_layers_and_within_the_bound_with_tp) {
    if (!dist::have_gloo()) {
        GTEST_SKIP() << "this build has no c10d Gloo (libgloo-dev)";
    }
    // Activation checkpointing under both kinds of parallelism: a layer-sharded rank recomputes its layers from the
    // stream it received; a tensor-parallel rank recomputes its shard of every layer, all-reducing again in the
    // backward's forward, in the same order on every rank. The single process recomputes too (the same numbers as
    // without: arch_recompute), so the comparisons are the ones of the tests above.
    test::temp_dir dir;
    write_fixture(small_fixture("llama", true, 4), dir.file("tied.gguf"));
    {
        test::temp_dir work;
        const auto [a, b] = single_and_sharded(dir.file("tied.gguf"), 2, work, "layers-recompute");
        ASSERT_FALSE(a.is_null());
        ASSERT_FALSE(b.is_null());
        EXPECT_EQ(b["ranks"], 2);
        EXPECT_EQ(a["losses"], b["losses"]);
        EXPECT_EQ(a["grads"], b["grads"]);
        EXPECT_EQ(a["recipe"], b["recipe"]);
    }
    {
        test::temp_dir work;
        const auto [a, b] = single_and_sharded(dir.file("tied.gguf"), 2, work, "tp-recompute");
        ASSERT_FALSE(a.is_null());
        ASSERT_FALSE(b.is_null());
        const tp_comparison c = compare_tp(a, b, 2);
        EXPECT_LE(c.worst_loss, 1.0);
        EXPECT_EQ(c.grads_over, 0) << "worst |Δ| / bound " << c.worst_grad;
        EXPECT_GT(c.grads, 0);
        EXPECT_EQ(a["recipe"], b["recipe"]);
    }
}

TEST(dist, the_summation_bound_catches_tensor_parallelism_without_megatrons_f) {
    if (!dist::have_gloo()) {
        GTEST_SKIP() << "this build has no c10d Gloo (libgloo-dev)";
    }
    // The bound of the test above is tight enough to fail an inexact tensor parallelism: leaving out f (the all-reduce
    // of the input gradient before column-parallel layers, what the issue suspects of the method's public
    // implementation) sends each rank back only its own part of ∂L/∂x, and the gate gradients of every layer below
    // the last move past their bound.
    test::temp_dir dir;
    write_fixture(small_fixture("llama", true, 4), dir.file("tied.gguf"));
    const auto [a, b] = single_and_sharded(dir.file("tied.gguf"), 2, dir, "tp-without-f");
    ASSERT_FALSE(a.is_null());
    ASSERT_FALSE(b.is_null());
    const tp_comparison c = compare_tp(a, b, 2);
    EXPECT_GT(c.grads_over, c.grads / 8) << "worst |Δ| / bound " << c.worst_grad;
}

TEST(dist, a_ranks_candidate_shard_holds_llamas_own_bytes_of_its_part_and_misaligned_splits_are_named) {
    // A rank's candidates are cut from the bytes llama.cpp quantized: dequantizing a rank's shard gives exactly the
    // rank's part of the whole candidate (rows for column- and vocabulary-parallel tensors, whole blocks of every row
    // for row-parallel ones). The split names follow Megatron's; the ranges are contiguous and cover every row.
    EXPECT_EQ(tp_split_of("blk.3.attn_q.weight"), tp_split::column_parallel);
    EXPECT_EQ(tp_split_of("blk.3.attn_v.bias"), tp_split::column_parallel);
    EXPECT_EQ(tp_split_of("blk.0.ffn_up.weight"), tp_split::column_parallel);
    EXPECT_EQ(tp_split_of("blk.0.ffn_down.weight"), tp_split::row_parallel);
    EXPECT_EQ(tp_split_of("blk.11.attn_output.weight"), tp_split::row_parallel);
    EXPECT_EQ(tp_split_of("blk.11.attn_output.bias"), tp_split::replicated);
    EXPECT_EQ(tp_split_of("blk.0.attn_norm.weight"), tp_split::replicated);
    EXPECT_EQ(tp_split_of("token_embd.weight"), tp_split::vocab_parallel);
    EXPECT_EQ(tp_split_of("output.weight"), tp_split::vocab_parallel);
    EXPECT_EQ(tp_range(10, 0, 3), (std::pair<int64_t, int64_t>{0, 4}));
    EXPECT_EQ(tp_range(10, 1, 3), (std::pair<int64_t, int64_t>{4, 7}));
    EXPECT_EQ(tp_range(10, 2, 3), (std::pair<int64_t, int64_t>{7, 10}));
    // The FFN's width in whole 256-weight units, one split for gate/up rows and down columns: 1280 = 5 units over 2.
    EXPECT_EQ(tp_range_of("blk.2.ffn_down.weight", 1280, 0, 2), (std::pair<int64_t, int64_t>{0, 768}));
    EXPECT_EQ(tp_range_of("blk.2.ffn_up.weight", 1280, 1, 2), (std::pair<int64_t, int64_t>{768, 1280}));
    EXPECT_EQ(tp_range_of("blk.2.attn_output.weight", 1280, 1, 2), (std::pair<int64_t, int64_t>{640, 1280}));
    gguf_tensor down1280{"blk.0.ffn_down.weight", GGML_TYPE_BF16, 2, {1280, 512, 1, 1}, 0, 0};
    EXPECT_EQ(dist::tp_split_problem(down1280, {GGML_TYPE_Q4_K, GGML_TYPE_Q8_0}, 2), "");
    EXPECT_NE(dist::tp_split_problem(down1280, {GGML_TYPE_Q4_K}, 8).find("cannot split"), std::string::npos);

    test::temp_dir dir;
    fixture_spec spec = small_fixture("llama", false, 1);
    spec.n_embd = 256;
    spec.n_ff = 512;
    spec.head_dim = 64;
    write_fixture(spec, dir.file("m.gguf"));
    const gguf_file file(dir.file("m.gguf"));
    for (const char * name : {"blk.0.ffn_down.weight", "blk.0.ffn_gate.weight", "output.weight"}) {
        SCOPED_TRACE(name);
        gated_tensor whole;
        whole.tensor = &file.tensor(name);
        whole.types = {GGML_TYPE_Q4_K, GGML_TYPE_Q8_0};
        for (const ggml_type type : whole.types) {
            whole.bytes.push_back(quantize_tensor(file, *whole.tensor, type, {}, {}, 1));
        }
        place_candidates(whole, mixture_path::cpu, torch::kCPU, torch::kFloat, torch::kFloat);
        std::deque<gguf_tensor> shapes;
        for (int rank = 0; rank < 2; ++rank) {
            gated_tensor part = dist::shard_gated_tensor(whole, rank, 2, shapes);
            place_candidates(part, mixture_path::cpu, torch::kCPU, torch::kFloat, torch::kFloat);
            for (size_t k = 0; k < whole.types.size(); ++k) {
                const torch::Tensor want = dist::tp_shard(name, candidate_weights(whole, k, torch::kCPU), rank, 2);
                EXPECT_TRUE(torch::equal(candidate_weights(part, k, torch::kCPU), want)) << type_name(whole.types[k]);
            }
        }
    }
    // ffn_down's 512 columns over 4 ranks are 128 each: half a Q4_K block.
    gated_tensor down;
    down.tensor = &file.tensor("blk.0.ffn_down.weight");
    down.types = {GGML_TYPE_Q8_0, GGML_TYPE_Q4_K};
    for (const ggml_type type : down.types) {
        down.bytes.push_back(quantize_tensor(file, *down.tensor, type, {}, {}, 1));
    }
    std::deque<gguf_tensor> shapes;
    const std::string e = test::error_of([&] { dist::shard_gated_tensor(down, 1, 4, shapes); });
    EXPECT_NE(e.find("'blk.0.ffn_down.weight'"), std::string::npos) << e;
    EXPECT_NE(e.find("q4_K (256-weight blocks) cannot split"), std::string::npos) << e;

    // A model whose heads the ranks do not divide is refused before any work, naming the key.
    auto model = build_model(file);
    struct three_ranks : tensor_parallel {
        int rank() const override { return 0; }
        int size() const override { return 3; }
        torch::Tensor copy_to(const torch::Tensor & x) const override { return x; }
        torch::Tensor reduce_from(const torch::Tensor & x) const override { return x; }
        torch::Tensor max_over(const torch::Tensor & x) const override { return x; }
    } three;
    const std::string m = test::error_of([&] { model->set_tensor_parallel(&three); });
    EXPECT_NE(m.find("llama.attention.head_count = 4 is not a multiple of 3"), std::string::npos) << m;
}

namespace {

/// The first 200 kB of TinyStories' validation text, written to `path`: calibration text for the CLI tests.
void write_calibration_text(const std::string & path) {
    std::string text(200000, '\0');
    std::ifstream in(test::shared_data() + "/text/tinystories/tinystories_val.txt");
    in.read(text.data(), static_cast<std::streamsize>(text.size()));
    text.resize(static_cast<size_t>(in.gcount()));
    std::ofstream(path) << text;
}

/// Calibration data for stories260K in `dir` (write_calibration_text, then `voodoo data` into dir/d: 64-token chunks,
/// a tenth held apart), and the `voodoo train` arguments of a short run on it: `steps` steps over Q4_0 and Q8_0, one
/// thread. "" (and a failure recorded) when `voodoo data` failed.
std::string stories_train_args(const test::temp_dir & dir, int steps) {
    write_calibration_text(dir.file("t.txt"));
    const std::string model = test::stories260k();
    const auto made = test::run_voodoo(fmt::format("data --model {} --text {} --ctx 64 --val-fraction 0.1 --out {}", model,
                                                   dir.file("t.txt"), dir.file("d")));
    EXPECT_EQ(made.exit_code, 0) << made.output;
    return made.exit_code != 0 ? std::string()
                               : fmt::format("train --model {} --data {} --target-size 420000 --menu Q4_0,Q8_0 --steps {} "
                                             "--probe-sequences 2 --select-sequences 2 -t 1", model, dir.file("d"), steps);
}

/// `voodoo ARGS --out OUT EXTRA0` as rank 0 and `voodoo ARGS --out OUT EXTRA1` as rank 1 of a torchrun-style group
/// of two on this host (rank 1's output after rank 0's). Exit status 0 when both ranks exit 0, or with `both_fail`
/// when both exit non-zero; 1 otherwise.
test::run_result run_two_ranks(const std::string & args, const std::string & out, const std::string & extra0,
                               const std::string & extra1, bool both_fail = false) {
    return test::run_shell(fmt::format(
        "export VOODOO_PROGRESS=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT={0}; "
        "RANK=1 {1} {2} --out {3} {5} > {3}.rank1.log 2>&1 & p=$!; "
        "RANK=0 {1} {2} --out {3} {4} 2>&1; s=$?; wait $p; s1=$?; cat {3}.rank1.log; {6}",
        dist::free_tcp_port(), VOODOO_BIN, args, out, extra0, extra1,
        both_fail ? "[ $s -ne 0 ] && [ $s1 -ne 0 ]" : "[ $s -eq 0 ] && [ $s1 -eq 0 ]"));
}

/// (name, type) of every tensor of a recipe.json: a tensor-parallel run's gate probabilities differ in rounding.
std::vector<std::pair<std::string, std::string>> recipe_types(const std::string & path) {
    std::vector<std::pair<std::string, std::string>> out;
    for (const auto & t : read_json(path)["tensors"]) {
        out.emplace_back(t["name"].get<std::string>(), t["type"].get<std::string>());
    }
    return out;
}

}  // namespace

TEST(dist, voodoo_train_under_torchruns_variables_trains_the_single_process_recipe_with_tp_and_with_layers) {
    if (!dist::have_gloo()) {
        GTEST_SKIP() << "this build has no c10d Gloo (libgloo-dev)";
    }
    // `voodoo train` started as torchrun starts it (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; two processes) trains
    // the recipe one process trains: with --parallel layers the same log bit for bit (layer sharding changes no
    // arithmetic), with --parallel tp the same recipe (the losses differ only in the order of sums: the test above
    // bounds them). Rank 0 alone writes the run directory; the probe's candidates are measured half by each rank.
    test::temp_dir dir;
    const std::string args = stories_train_args(dir, 6);
    ASSERT_FALSE(args.empty());
    const auto one = test::run_shell(fmt::format("env -u WORLD_SIZE VOODOO_PROGRESS=0 {} {} --out {} 2>&1", VOODOO_BIN, args,
                                                 dir.file("one")));
    ASSERT_EQ(one.exit_code, 0) << one.output;
    const auto log_of = [](const std::string & path) {
        std::vector<std::pair<double, double>> out;
        std::ifstream in(path);
        for (std::string line; std::getline(in, line);) {
            const auto j = nlohmann::json::parse(line);
            out.emplace_back(j["ce"].get<double>(), j["kl"].get<double>());
        }
        return out;
    };
    for (const std::string mode : {"tp", "layers"}) {
        SCOPED_TRACE(mode);
        const std::string out = dir.file("two-" + mode);
        const auto two = run_two_ranks(args, out, "--parallel " + mode, "--parallel " + mode);
        ASSERT_EQ(two.exit_code, 0) << two.output;
        EXPECT_NE(two.output.find("rank 1 of 2 (cpu, gloo), --parallel " + mode), std::string::npos) << two.output;
        // The probe's measurements split over the ranks: with tp half the candidates each, with layers every
        // candidate's forward rank to rank (the same values: the layer-sharded log is equal bit for bit).
        EXPECT_NE(two.output.find(mode == "tp" ? "probe: rank 1 of 2 measures" : "probe: rank 1 of 2 runs layers ["),
                  std::string::npos) << two.output;
        // The candidates' building split too: with tp each rank quantizes half of them into the shared cache, then
        // reads all; with layers each those of its own layers' tensors, which it alone reads.
        long built_by_both = 0, of = 0;
        for (const char * r : {"candidates: rank 0 of 2 built ", "candidates: rank 1 of 2 built "}) {
            const size_t at = two.output.find(r);
            ASSERT_NE(at, std::string::npos) << r << two.output;
            size_t used = 0;
            const long built = std::stol(two.output.substr(at + std::strlen(r)), &used);
            of = std::stol(two.output.substr(at + std::strlen(r) + used + 4));  // "N of M"
            EXPECT_GT(built, 0);
            EXPECT_LT(built, of);
            if (mode == "tp") {
                EXPECT_LE(2 * built, of + 1) << "at most half of them, rounded up";
            }
            built_by_both += built;
        }
        EXPECT_EQ(built_by_both, of);
        EXPECT_EQ(recipe_types(out + "/recipe.json"), recipe_types(dir.file("one/recipe.json")));
        // The selection's recipes, measured one by each rank in turn: the single process's KL values bit for bit.
        EXPECT_NE(two.output.find(mode == "tp" ? "select: rank 1 of 2 measures " : "select: rank 1 of 2 runs layers ["),
                  std::string::npos) << two.output;
        const nlohmann::json sel_one = read_json(dir.file("one/selection.json")), sel_two = read_json(out + "/selection.json");
        ASSERT_EQ(sel_one.size(), sel_two.size());
        for (size_t i = 0; i < sel_one.size(); ++i) {
            EXPECT_EQ(sel_one[i]["recipe"], sel_two[i]["recipe"]);
            EXPECT_EQ(sel_one[i]["val_kl"].get<double>(), sel_two[i]["val_kl"].get<double>()) << sel_one[i]["recipe"];
        }
        const auto a = log_of(dir.file("one/log.jsonl")), b = log_of(out + "/log.jsonl");
        ASSERT_EQ(a.size(), 6u);
        ASSERT_EQ(b.size(), 6u);
        if (mode == "layers") {
            EXPECT_EQ(a, b);
        }
    }
    // A split the model does not allow is refused on every rank before any work (no probe), naming the key.
    const std::string out = dir.file("three");
    const auto three = test::run_shell(fmt::format(
        "export VOODOO_PROGRESS=0 WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 MASTER_PORT={0}; pids=; "
        "for r in 1 2; do RANK=$r {1} {2} --out {3} --parallel tp > {3}.rank$r.log 2>&1 & pids=\"$pids $!\"; done; "
        "RANK=0 {1} {2} --out {3} --parallel tp 2>&1; s=$?; for p in $pids; do wait $p && s=0; done; "
        "cat {3}.rank*.log; exit $s", dist::free_tcp_port(), VOODOO_BIN, args, out));
    EXPECT_NE(three.exit_code, 0) << three.output;
    EXPECT_NE(three.output.find("llama.attention.head_count = 8 is not a multiple of 3"), std::string::npos) << three.output;
    EXPECT_EQ(three.output.find("probe:"), std::string::npos) << three.output;
    // Ranks started with other options are refused on every rank before any work, naming what differs.
    {
        const std::string run = dir.file("unlike");
        const auto unlike = run_two_ranks(args, run, "", "--seed 7", /*both_fail=*/true);
        EXPECT_EQ(unlike.exit_code, 0) << unlike.output;
        EXPECT_NE(unlike.output.find("rank 0 of 2: the training options, menus or calibration tokens differ between the ranks"),
                  std::string::npos) << unlike.output;
        EXPECT_EQ(unlike.output.find("probe:"), std::string::npos) << unlike.output;
    }
    // What is not split over ranks yet is refused on every rank, naming the flag.
    const std::vector<std::pair<std::string, std::string>> not_split = {
        {"--parallel tp --routing ptqr", "--routing ptqr is not split over several ranks yet"},
        {"--parallel layers --st-gumbel-fraction 0.2", "--st-gumbel-fraction 0.2 with --parallel layers"}};
    for (const auto & [flags, message] : not_split) {
        const std::string run = dir.file("refused");
        const auto refused = test::run_shell(fmt::format(
            "export VOODOO_PROGRESS=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT={0}; "
            "RANK=1 {1} {2} --out {3} {4} > {3}.rank1.log 2>&1 & p=$!; "
            "RANK=0 {1} {2} --out {3} {4} 2>&1; s=$?; wait $p && s=0; cat {3}.rank1.log; exit $s",
            dist::free_tcp_port(), VOODOO_BIN, args, run, flags));
        EXPECT_NE(refused.exit_code, 0) << refused.output;
        EXPECT_NE(refused.output.find(message), std::string::npos) << refused.output;
    }
}

TEST(dist, layer_sharded_ranks_probe_and_select_rank_to_rank_reading_only_their_own_layers_and_give_the_single_process_values) {
    if (!dist::have_gloo()) {
        GTEST_SKIP() << "this build has no c10d Gloo (libgloo-dev)";
    }
    // With --parallel layers the probe's and the selection's forwards run rank to rank, so no rank reads another rank's
    // layers (what lets a teacher larger than one GPU train): each rank reports the tensors it read, and together they
    // are the file's, each once, but a tied embedding, which the first rank embeds with and the last rank's head
    // reads. The probe's ΔKL, the selection's KL and the recipe are the single process's bit for bit. Two models: an
    // untied head (stories260K, whose output.weight is probed on the last rank alone) and a tied one (a llama fixture,
    // whose token_embd candidates the first and the last rank both read).
    test::temp_dir dir;
    write_calibration_text(dir.file("t.txt"));
    fixture_spec spec;
    spec.vocab_path = voodoo::test::llama_spm_vocab();
    spec.n_embd = 64;
    spec.n_layer = 3;
    spec.n_head = 2;
    spec.n_head_kv = 1;
    spec.head_dim = 32;
    spec.n_ff = 128;
    spec.weight_type = GGML_TYPE_F16;
    spec.tied_output = true;
    write_fixture(spec, dir.file("tied.gguf"));
    for (const auto & [model, tied] : {std::pair{test::stories260k(), false}, std::pair{dir.file("tied.gguf"), true}}) {
        SCOPED_TRACE(model);
        const std::string data = dir.file(tied ? "d-tied" : "d");
        const auto made = test::run_voodoo(fmt::format("data --model {} --text {} --ctx 64 --val-fraction 0.1 --out {}", model,
                                                       dir.file("t.txt"), data));
        ASSERT_EQ(made.exit_code, 0) << made.output;
        const std::string args = fmt::format("train --model {} --data {} {} --menu Q4_0,Q8_0 --steps 3 "
                                             "--probe-sequences 2 --select-sequences 2 -t 1", model, data,
                                             tied ? "--ratio 0.8" : "--target-size 420000");
        const std::string one = dir.file(tied ? "one-tied" : "one"), two = dir.file(tied ? "two-tied" : "two");
        const auto single = test::run_shell(fmt::format("env -u WORLD_SIZE VOODOO_PROGRESS=0 {} {} --out {} 2>&1", VOODOO_BIN,
                                                        args, one));
        ASSERT_EQ(single.exit_code, 0) << single.output;
        const auto ranks = run_two_ranks(args, two, "--parallel layers", "--parallel layers");
        ASSERT_EQ(ranks.exit_code, 0) << ranks.output;
        EXPECT_EQ(read_json(one + "/probe.json"), read_json(two + "/probe.json"));
        EXPECT_EQ(read_json(one + "/selection.json"), read_json(two + "/selection.json"));
        EXPECT_EQ(read_json(one + "/recipe.json")["tensors"], read_json(two + "/recipe.json")["tensors"]);
        const size_t n_tensors = gguf_file(model).tensors().size();
        size_t read_by_both = 0;
        for (int r = 0; r < 2; ++r) {
            const std::string head = fmt::format("rank {} of 2: read ", r);
            const size_t at = ranks.output.find(head);
            ASSERT_NE(at, std::string::npos) << ranks.output;
            const size_t n = std::stoul(ranks.output.substr(at + head.size()));
            const std::string rest = ranks.output.substr(at, ranks.output.find('\n', at) - at);
            EXPECT_NE(rest.find(fmt::format(" of the source's {} tensors, each of its own layers, embedding or head", n_tensors)),
                      std::string::npos) << rest;
            EXPECT_LT(n, n_tensors) << rest;
            read_by_both += n;
        }
        EXPECT_EQ(read_by_both, n_tensors + (tied ? 1 : 0)) << ranks.output;
        // Host memory too: each rank holds the candidate bytes of its own layers' tensors only (the last line of each
        // rank is the kept candidates'), together every candidate (a tied embedding's on both ranks).
        int64_t held_by_both = 0, all = 0;
        for (int r = 0; r < 2; ++r) {
            const std::string head = fmt::format("rank {} of 2: candidates in host memory: ", r);
            const size_t at = ranks.output.rfind(head);
            ASSERT_NE(at, std::string::npos) << ranks.output;
            const size_t open = ranks.output.find('(', at);
            size_t used = 0;
            const int64_t held = std::stoll(ranks.output.substr(open + 1), &used);
            all = std::stoll(ranks.output.substr(open + 1 + used + 4));  // "N of M bytes"
            EXPECT_GT(held, 0);
            EXPECT_LT(held, all);
            held_by_both += held;
        }
        EXPECT_GE(held_by_both, all);
        if (!tied) {
            EXPECT_EQ(held_by_both, all);
        }
    }
}

TEST(dist, the_dry_run_says_what_each_rank_holds_with_layers_or_with_tp) {
    // `voodoo quantize --dry-run --gpus 2` plans each rank of the train stage by the trainer's rules, making nothing.
    // Layer sharding (stories260K): each rank its layers' tensors of the teacher and their candidates, the two together
    // the whole (the head is untied). Tensor parallelism (a llama fixture whose splits fall on Q4_0's blocks): every
    // rank the whole teacher, and all candidates in host memory and on its device for the probe, half of their bytes
    // (its shards) on its device for training.
    test::temp_dir dir;
    fixture_spec spec;
    spec.vocab_path = voodoo::test::llama_spm_vocab();
    spec.weight_type = GGML_TYPE_F16;
    write_fixture(spec, dir.file("m.gguf"));
    const std::string text = test::shared_data() + "/text/tinystories/tinystories_val.txt";
    for (const auto & [model, mode] : {std::pair{test::stories260k(), std::string("layers")}, std::pair{dir.file("m.gguf"), std::string("tp")}}) {
        SCOPED_TRACE(mode);
        const std::string bpw = mode == "layers" ? "11" : "6";  // inside each model's range with this menu
        const test::run_result r = test::run_voodoo_stdout(fmt::format(
            "quantize {} --text {} --target-bpw {} --menu Q4_0,Q8_0 --ctx 64 --candidates all --eval-chunks 0 --work {} "
            "--gpus 2 --parallel {} --dry-run --json -", model, text, bpw, dir.file("w-" + mode), mode));
        ASSERT_EQ(r.exit_code, 0) << r.output;
        EXPECT_FALSE(std::filesystem::exists(dir.file("w-" + mode))) << "a dry run makes nothing";
        const nlohmann::json p = nlohmann::json::parse(r.output);
        ASSERT_TRUE(p.contains("ranks")) << r.output;
        EXPECT_EQ(p["ranks"]["parallel"], mode);
        const auto & per_rank = p["ranks"]["per_rank"];
        ASSERT_EQ(per_rank.size(), 2u);
        int64_t whole_teacher = 0;
        for (const gguf_tensor & t : gguf_file(model).tensors()) {
            whole_teacher += t.n_elements() * (t.n_dims >= 2 ? 2 : 4);
        }
        const int64_t candidates = p["candidates"]["bytes"].get<int64_t>();
        ASSERT_GT(candidates, 0);
        int64_t teacher_sum = 0, host_sum = 0, training_sum = 0;
        for (const auto & e : per_rank) {
            teacher_sum += e["teacher_bytes"].get<int64_t>();
            host_sum += e["candidates_host_bytes"].get<int64_t>();
            training_sum += e["candidates_device_bytes_training"].get<int64_t>();
            if (mode == "layers") {
                EXPECT_LT(e["teacher_bytes"].get<int64_t>(), whole_teacher);
                EXPECT_LT(e["candidates_host_bytes"].get<int64_t>(), candidates);
                EXPECT_EQ(e["candidates_device_bytes"], e["candidates_host_bytes"]);
                EXPECT_EQ(e["candidates_device_bytes_training"], e["candidates_host_bytes"]);
            } else {
                EXPECT_EQ(e["teacher_bytes"].get<int64_t>(), whole_teacher);
                EXPECT_EQ(e["candidates_host_bytes"].get<int64_t>(), candidates);
                EXPECT_EQ(e["candidates_device_bytes"].get<int64_t>(), candidates);
                EXPECT_EQ(e["candidates_device_bytes_training"].get<int64_t>() * 2, candidates);
            }
        }
        if (mode == "layers") {
            EXPECT_EQ(teacher_sum, whole_teacher);
            EXPECT_EQ(host_sum, candidates);
            EXPECT_EQ(per_rank[0]["layers"][0], 0);
            EXPECT_EQ(per_rank[0]["layers"][1], per_rank[1]["layers"][0]);
            EXPECT_EQ(per_rank[1]["layers"][1], 5);  // stories260K's layers
        } else {
            EXPECT_EQ(training_sum, candidates);
        }
        // The text form says it too.
        const test::run_result text_form = test::run_voodoo_stdout(fmt::format(
            "quantize {} --text {} --target-bpw {} --menu Q4_0,Q8_0 --ctx 64 --candidates all --eval-chunks 0 --work {} "
            "--gpus 2 --parallel {} --dry-run", model, text, bpw, dir.file("w-" + mode), mode));
        ASSERT_EQ(text_form.exit_code, 0) << text_form.output;
        EXPECT_NE(text_form.output.find("ranks of the train stage (--gpus 2 --parallel " + mode + "), each holding:"),
                  std::string::npos) << text_form.output;
    }
    // A split the trainer refuses is refused by the dry run too, the model's first: the fixture's 4 heads over 3 ranks.
    const test::run_result three = test::run_voodoo(fmt::format(
        "quantize {} --text {} --target-bpw 6 --menu Q4_0,Q8_0 --ctx 64 --eval-chunks 0 --work {} --gpus 3 --parallel tp "
        "--dry-run", dir.file("m.gguf"), text, dir.file("w-three")));
    EXPECT_NE(three.exit_code, 0) << three.output;
    EXPECT_NE(three.output.find("head_count = 4 is not a multiple of 3"), std::string::npos) << three.output;
}

TEST(dist, a_rank_keeps_on_its_device_only_the_candidates_of_its_layers_or_its_shards_and_trains_the_same_recipe) {
    if (!dist::have_gloo()) {
        GTEST_SKIP() << "this build has no c10d Gloo (libgloo-dev)";
    }
    // The reference mixture keeps every candidate dense on the device (here the CPU), so its bytes are countable without
    // a GPU. One process holds them all; two ranks hold disjoint parts for training: with --parallel layers the tensors
    // of each rank's layers, with --parallel tp each rank's shards (whole rows or whole blocks of each row), which add
    // up to the single process's bytes exactly. The probe and the selection read the rest from host memory, so the
    // recipe is the single process's.
    test::temp_dir dir;
    const std::string args = stories_train_args(dir, 4) + " --mixture reference";
    ASSERT_FALSE(args.empty());
    const auto one = test::run_shell(fmt::format("env -u WORLD_SIZE VOODOO_PROGRESS=0 {} {} --out {} --json {} 2>&1", VOODOO_BIN,
                                                 args, dir.file("one"), dir.file("one.json")));
    ASSERT_EQ(one.exit_code, 0) << one.output;
    const int64_t whole = read_json(dir.file("one.json"))["candidates"]["bytes_on_device"].get<int64_t>();
    ASSERT_GT(whole, 0);
    const auto one_recipe = recipe_types(dir.file("one/recipe.json"));
    for (const std::string mode : {"tp", "layers"}) {
        SCOPED_TRACE(mode);
        const std::string out = dir.file("two-" + mode);
        const auto two = run_two_ranks(args, out, "--parallel " + mode, "--parallel " + mode);
        ASSERT_EQ(two.exit_code, 0) << two.output;
        int64_t sum = 0;
        for (int r = 0; r < 2; ++r) {
            const std::string head = fmt::format("rank {} of 2: candidates for training on cpu: ", r);
            const size_t at = two.output.find(head);
            ASSERT_NE(at, std::string::npos) << two.output;
            const size_t open = two.output.find('(', two.output.find("MiB", at));
            const int64_t bytes = std::stoll(two.output.substr(open + 1));
            EXPECT_GT(bytes, 0) << two.output;
            EXPECT_LT(bytes, whole) << two.output;
            sum += bytes;
        }
        EXPECT_EQ(sum, whole) << two.output;
        EXPECT_EQ(recipe_types(out + "/recipe.json"), one_recipe);
    }
}

TEST(dist, voodoo_imatrix_as_two_ranks_gives_the_single_process_counts_each_sum_within_one_f32_ulp_and_by_layers_bit_for_bit) {
    if (!dist::have_gloo()) {
        GTEST_SKIP() << "this build has no c10d Gloo (libgloo-dev)";
    }
    // The LibTorch forward on the CPU, one 64-token chunk per forward, so two ranks run alternate chunks. Each rank's
    // column sums are f64; the all-reduce adds the two partial sums, so a column's f64 value differs from the single
    // process's only by reassociating n ≤ n_chunks non-negative terms: relative error ≤ γ_n(f64) ≈ n · 1.1e-16, far
    // below half an f32 ulp (6e-8), so after the one rounding to f32 each column is equal or one ulp apart. The
    // counts are integers: equal. A rank whose sums were not added would be off by about half, far past one ulp.
    test::temp_dir dir;
    ASSERT_FALSE(stories_train_args(dir, 1).empty());  // makes dir/d
    const std::string args = fmt::format("imatrix --model {} --data {} --forward torch --batch-tokens 64 -t 1",
                                         test::stories260k(), dir.file("d"));
    const auto one = test::run_shell(fmt::format("env -u WORLD_SIZE VOODOO_PROGRESS=0 {} {} --out {} 2>&1", VOODOO_BIN, args,
                                                 dir.file("one.gguf")));
    ASSERT_EQ(one.exit_code, 0) << one.output;
    const std::string out = dir.file("two.gguf");
    const auto two = run_two_ranks(args, out, "", "");
    ASSERT_EQ(two.exit_code, 0) << two.output;
    EXPECT_NE(two.output.find("rank 1 of 2 (cpu, gloo): imatrix"), std::string::npos) << two.output;
    const imatrix a = read_imatrix(dir.file("one.gguf")), b = read_imatrix(out);
    EXPECT_EQ(a.chunk_count, b.chunk_count);
    ASSERT_GT(a.chunk_count, 4);
    ASSERT_EQ(a.entries.size(), b.entries.size());
    int64_t columns = 0, equal = 0;
    for (const auto & [name, ea] : a.entries) {
        SCOPED_TRACE(name);
        ASSERT_TRUE(b.entries.count(name));
        const imatrix_entry & eb = b.entries.at(name);
        EXPECT_EQ(ea.counts, eb.counts);
        ASSERT_EQ(ea.in_sum2.size(), eb.in_sum2.size());
        for (size_t i = 0; i < ea.in_sum2.size(); ++i) {
            const float x = ea.in_sum2[i], y = eb.in_sum2[i];
            EXPECT_TRUE(x == y || std::nextafter(x, y) == y) << i << ": " << x << " vs " << y;
            equal += x == y;
            ++columns;
        }
    }
    EXPECT_GT(columns, 0);
    EXPECT_GT(equal, columns * 9 / 10) << equal << " of " << columns << " columns equal bit for bit";
    // --parallel layers: every forward rank to rank (rank 0 the first layers, rank 1 the rest and the head), so each
    // entry is summed on one rank in the single process's order and the all-reduce adds zeros: bit for bit.
    {
        const std::string by_layers = dir.file("layers.gguf");
        const auto lay = run_two_ranks(args + " --parallel layers", by_layers, "", "");
        ASSERT_EQ(lay.exit_code, 0) << lay.output;
        EXPECT_NE(lay.output.find("rank 1 of 2: imatrix of layers ["), std::string::npos) << lay.output;
        // Each rank read only its layers' tensors (and the embedding or the norm and head): together each once.
        const size_t n_tensors = gguf_file(test::stories260k()).tensors().size();
        size_t read_by_both = 0;
        for (int r = 0; r < 2; ++r) {
            const std::string head = fmt::format("rank {} of 2: read ", r);
            const size_t at = lay.output.find(head);
            ASSERT_NE(at, std::string::npos) << lay.output;
            const size_t n = std::stoul(lay.output.substr(at + head.size()));
            EXPECT_LT(n, n_tensors);
            read_by_both += n;
        }
        EXPECT_EQ(read_by_both, n_tensors) << lay.output;
        const imatrix c = read_imatrix(by_layers);
        EXPECT_EQ(a.chunk_count, c.chunk_count);
        ASSERT_EQ(a.entries.size(), c.entries.size());
        for (const auto & [name, ea] : a.entries) {
            SCOPED_TRACE(name);
            ASSERT_TRUE(c.entries.count(name));
            EXPECT_EQ(ea.counts, c.entries.at(name).counts);
            EXPECT_EQ(ea.in_sum2, c.entries.at(name).in_sum2);
        }
    }
    // Ranks started with other options are refused on every rank (else their shares would not add up to any run's).
    const auto other = run_two_ranks(args, dir.file("other.gguf"), "", "--chunks 8", /*both_fail=*/true);
    EXPECT_EQ(other.exit_code, 0) << other.output;
    EXPECT_NE(other.output.find("rank 1 of 2: --chunks, --batch-tokens or the calibration chunks differ between the ranks"),
              std::string::npos) << other.output;
    EXPECT_FALSE(std::filesystem::exists(dir.file("other.gguf")));
    // Ranks split the LibTorch forward only; libllama's graph on a GPU does not exist: both refused, naming the flag.
    const auto libllama_ranks = test::run_shell(fmt::format(
        "WORLD_SIZE=2 RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT={} {} imatrix --model {} --data {} --out {} 2>&1",
        dist::free_tcp_port(), VOODOO_BIN, test::stories260k(), dir.file("d"), dir.file("refused.gguf")));
    EXPECT_NE(libllama_ranks.exit_code, 0);
    EXPECT_NE(libllama_ranks.output.find("splits the chunks of the LibTorch forward"), std::string::npos)
        << libllama_ranks.output;
    const auto libllama_gpu = test::run_voodoo(fmt::format("imatrix --model {} --data {} --out {} --forward libllama --device cuda",
                                                           test::stories260k(), dir.file("d"), dir.file("refused.gguf")));
    EXPECT_NE(libllama_gpu.exit_code, 0);
    EXPECT_NE(libllama_gpu.output.find("--forward libllama runs on the CPU"), std::string::npos) << libllama_gpu.output;
    EXPECT_FALSE(std::filesystem::exists(dir.file("refused.gguf")));
}

TEST(dist, a_journal_written_by_one_process_resumes_on_two_ranks_with_the_same_steps_bit_for_bit) {
    if (!dist::have_gloo()) {
        GTEST_SKIP() << "this build has no c10d Gloo (libgloo-dev)";
    }
    // The journal holds whole gates and the AdamW state, never a rank's part: a run stopped (Ctrl-C) as one process
    // continues as two torchrun-style ranks with layer sharding and ends as the uninterrupted run does, every logged
    // step and the recipe bit for bit.
    test::temp_dir dir;
    const std::string args = stories_train_args(dir, 60);
    ASSERT_FALSE(args.empty());
    const auto whole = test::run_shell(fmt::format("env -u WORLD_SIZE VOODOO_PROGRESS=0 {} {} --out {} 2>&1", VOODOO_BIN,
                                                   args, dir.file("whole")));
    ASSERT_EQ(whole.exit_code, 0) << whole.output;
    // Interrupted once its log holds 5 steps: SIGINT stops it after the step in progress, with a journal.
    const std::string part = dir.file("part");
    const auto stopped = test::run_shell(fmt::format(
        "env -u WORLD_SIZE VOODOO_PROGRESS=0 {0} {1} --out {2} > {2}.log 2>&1 & p=$!; "
        "while [ \"$(cat {2}/log.jsonl 2>/dev/null | wc -l)\" -lt 5 ] && kill -0 $p 2>/dev/null; do sleep 0.02; done; "
        "kill -INT $p; wait $p; s=$?; cat {2}.log; exit $s", VOODOO_BIN, args, part));
    ASSERT_EQ(stopped.exit_code, 130) << stopped.output;
    ASSERT_TRUE(std::filesystem::exists(part + "/journal.pt"));
    const auto resumed = run_two_ranks(args, part, "--parallel layers --resume", "--parallel layers --resume");
    ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
    const auto steps_of = [](const std::string & path) {
        std::vector<std::tuple<int64_t, double, double, double>> out;
        std::ifstream in(path);
        for (std::string line; std::getline(in, line);) {
            const auto j = nlohmann::json::parse(line);
            out.emplace_back(j["step"].get<int64_t>(), j["ce"].get<double>(), j["kl"].get<double>(), j["bytes"].get<double>());
        }
        return out;
    };
    const auto a = steps_of(dir.file("whole/log.jsonl")), b = steps_of(part + "/log.jsonl");
    ASSERT_EQ(a.size(), 60u);
    EXPECT_EQ(a, b);
    EXPECT_EQ(read_json(dir.file("whole/recipe.json"))["tensors"], read_json(part + "/recipe.json")["tensors"]);
}

TEST(dist, voodoo_quantize_gpus_runs_the_train_stage_as_ranks_and_writes_the_same_file) {
    if (!dist::have_gloo()) {
        GTEST_SKIP() << "this build has no c10d Gloo (libgloo-dev)";
    }
    // `voodoo quantize --gpus 2` starts the train stage as two ranks itself (torchrun's variables, a free port), here
    // on the CPU: with --parallel layers the whole job writes the file one process writes, byte for byte (both jobs
    // run from their own folder with the same relative --work, since the file records the imatrix's path).
    test::temp_dir dir;
    write_calibration_text(dir.file("t.txt"));
    std::filesystem::create_directories(dir.file("one"));
    std::filesystem::create_directories(dir.file("two"));
    const std::string job = fmt::format("quantize {} --text {} --like Q4_0 --ctx 64 --imatrix-chunks 16 --steps 20 "
                                        "--eval-chunks 0 --work w -o out.gguf",
                                        test::stories260k(), dir.file("t.txt"));
    const auto one = test::run_shell(fmt::format("cd {} && env -u WORLD_SIZE VOODOO_PROGRESS=0 {} {} 2>&1", dir.file("one"),
                                                 VOODOO_BIN, job));
    ASSERT_EQ(one.exit_code, 0) << one.output;
    // Without VOODOO_THREADS (ctest sets it to 1), each rank's default threads are its share of the cores this
    // process may run on.
    const auto two = test::run_shell(fmt::format(
        "cd {} && env -u WORLD_SIZE -u VOODOO_THREADS VOODOO_PROGRESS=0 {} {} --gpus 2 --parallel layers 2>&1",
        dir.file("two"), VOODOO_BIN, job));
    ASSERT_EQ(two.exit_code, 0) << two.output;
    cpu_set_t cores;
    ASSERT_EQ(sched_getaffinity(0, sizeof cores, &cores), 0);
    const int share = std::max(1, CPU_COUNT(&cores) / 2);
    EXPECT_NE(two.output.find(fmt::format("rank 0 of 2 (cpu, gloo), --parallel layers, {} CPU threads", share)),
              std::string::npos)
        << two.output;
    EXPECT_NE(test::read_file(dir.file("two/w/run-Q4_0/rank1.log"))
                  .find(fmt::format("rank 1 of 2 (cpu, gloo), --parallel layers, {} CPU threads", share)),
              std::string::npos);
    const std::string a = test::read_file(dir.file("one/out.gguf")), b = test::read_file(dir.file("two/out.gguf"));
    ASSERT_GT(a.size(), 0u);
    EXPECT_TRUE(a == b) << "the files differ";

    const auto bad = test::run_voodoo(job + " --gpus 2 --device cuda:1");
    EXPECT_NE(bad.exit_code, 0);
    EXPECT_NE(bad.output.find("--gpus 2 with --device cuda:1"), std::string::npos) << bad.output;
}
