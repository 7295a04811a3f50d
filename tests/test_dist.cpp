// Several processes (issue #17): torchrun's variables, the layer balance, hidden_layers as a pipeline, and layer
// sharding over two Gloo processes against the single process.
#include "common/error.h"
#include "dist/dist.h"
#include "ggml/gguf.h"
#include "model/fixture.h"
#include "model/gguf_weights.h"
#include "model/registry.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>

using namespace voodoo;

namespace {

/// A TCP port nobody listens on now (the kernel's choice for port 0).
int free_port() {
    const int s = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = 0;
    socklen_t len = sizeof a;
    bind(s, reinterpret_cast<sockaddr *>(&a), sizeof a);
    getsockname(s, reinterpret_cast<sockaddr *>(&a), &len);
    close(s);
    return ntohs(a.sin_port);
}

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

/// The worker once as a single process and once as `ranks` Gloo processes on this machine: both outputs.
std::pair<nlohmann::json, nlohmann::json> single_and_sharded(const std::string & model, int ranks, const test::temp_dir & dir) {
    const std::string worker = VOODOO_DIST_WORKER_BIN;
    const test::run_result single =
        test::run_shell(fmt::format("env -u WORLD_SIZE {} {} {} 3 2>&1", worker, model, dir.file("one.json")));
    EXPECT_EQ(single.exit_code, 0) << single.output;
    // Ranks 1.. in the background (their output to files), rank 0 in the foreground; every exit status counts.
    std::string cmd = fmt::format("export WORLD_SIZE={} MASTER_ADDR=127.0.0.1 MASTER_PORT={}; pids=; ", ranks, free_port());
    for (int r = 1; r < ranks; ++r) {
        cmd += fmt::format("RANK={} {} {} {} 3 > {} 2>&1 & pids=\"$pids $!\"; ", r, worker, model, dir.file("many.json"),
                           dir.file(fmt::format("rank{}.log", r)));
    }
    cmd += fmt::format("RANK=0 {} {} {} 3 2>&1; s=$?; for p in $pids; do wait $p || s=1; done; cat {}/rank*.log; exit $s",
                       worker, model, dir.file("many.json"), dir.path.string());
    const test::run_result many = test::run_shell(cmd);
    EXPECT_EQ(many.exit_code, 0) << many.output;
    return {read_json(dir.file("one.json")), read_json(dir.file("many.json"))};
}

}  // namespace

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
    tied.vocab_path = std::string(VOODOO_LLAMA_MODELS_DIR) + "/ggml-vocab-llama-spm.gguf";
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
