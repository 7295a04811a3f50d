#include "common/error.h"
#include "common/progress.h"
#include "data/dataset.h"
#include "export/export.h"
#include "ggml/types.h"
#include "imatrix/imatrix.h"
#include "model/fixture.h"
#include "test_util.h"
#include "train/journal.h"
#include "train/trainer.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <filesystem>
#include <cstring>
#include <fstream>
#include <thread>

using namespace voodoo;
using voodoo::test::error_of;
using voodoo::test::temp_dir;

namespace {

// TinyStories tokens for stories260K, made once for every test here.
const std::string & stories_data() {
    static temp_dir dir;
    static const std::string path = [] {
        data_options d;
        d.model = test::stories260k();
        d.texts = {test::shared_data() + "/text/tinystories/tinystories_val.txt"};
        d.ctx = 64;
        d.val_fraction = 0.05;
        d.out_dir = dir.file("data");
        prepare_data(d);
        return d.out_dir;
    }();
    return path;
}

train_options quick(const std::string & run_dir) {
    train_options o;
    o.goal = {target_kind::size, 304352};
    o.run_dir = run_dir;
    o.steps = 8;
    o.batch = 1;
    o.seq = 32;
    o.journal_every = 1;
    o.lr = 0.2;
    return o;
}

/// Compares two runs' log.jsonl line by line, every field but the timing (tokens_per_s) equal; returns the lines read.
int same_log_lines(const std::string & path_a, const std::string & path_b) {
    std::ifstream a(path_a), b(path_b);
    int lines = 0;
    for (std::string la, lb; std::getline(a, la) && std::getline(b, lb); ++lines) {
        nlohmann::json ja = nlohmann::json::parse(la), jb = nlohmann::json::parse(lb);
        ja.erase("tokens_per_s");
        jb.erase("tokens_per_s");
        EXPECT_EQ(ja, jb) << lines;
    }
    return lines;
}

}  // namespace

TEST(train, finishes_with_a_recipe_that_fits_the_target_exactly_as_exported) {
    temp_dir dir;
    gguf_file src(test::stories260k());
    token_data data(stories_data());
    const train_result r = train_gates(src, src, data.train(), nullptr, quick(dir.file("run")));
    EXPECT_TRUE(r.finished);
    EXPECT_EQ(r.steps_done, 8);
    EXPECT_LE(r.total_bytes, 304352);
    ASSERT_TRUE(std::filesystem::exists(dir.file("run/recipe.json")));
    ASSERT_TRUE(std::filesystem::exists(dir.file("run/recipe.tensor-types.txt")));
    const recipe saved = recipe_load(dir.file("run/recipe.json"));
    EXPECT_EQ(saved.target, "size=304352");
    export_options eo;
    eo.target = saved.target;
    EXPECT_EQ(static_cast<double>(planned_file_bytes(src, saved, eo)), r.total_bytes);
    EXPECT_EQ(static_cast<double>(export_gguf(src, saved, dir.file("out.gguf"), eo).file_bytes), r.total_bytes);
    std::ifstream log(dir.file("run/log.jsonl"));
    int lines = 0;
    for (std::string line; std::getline(log, line); ++lines) {
        const auto j = nlohmann::json::parse(line);
        EXPECT_EQ(j["step"], lines);
        for (const char * key : {"loss", "ce", "kl", "size_term", "tau", "bytes", "lr", "tokens_per_s"}) {
            EXPECT_TRUE(j.contains(key)) << key;
        }
    }
    EXPECT_EQ(lines, 8);
    EXPECT_NE(r.summary.find("ffn_down.weight"), std::string::npos) << r.summary;
}

TEST(train, a_resumed_run_ends_with_the_same_recipe_as_an_uninterrupted_one) {
    temp_dir dir;
    gguf_file src(test::stories260k());
    token_data data(stories_data());
    auto o = quick(dir.file("a"));
    o.st_gumbel_fraction = 0.5;  // the noise must replay too
    o.cache_dir = dir.file("cache");
    const train_result whole = train_gates(src, src, data.train(), nullptr, o);

    auto b = o;
    b.run_dir = dir.file("b");
    b.should_stop = [](int step) { return step == 2; };
    const train_result first = train_gates(src, src, data.train(), nullptr, b);
    EXPECT_FALSE(first.finished);
    EXPECT_EQ(first.steps_done, 3);
    EXPECT_FALSE(std::filesystem::exists(dir.file("b/recipe.json")));
    b.should_stop = nullptr;
    b.resume = true;
    std::ofstream(dir.file("b/log.jsonl"), std::ios::app) << R"({"step": 3, "lo)";  // a write cut short by the stop
    const train_result rest = train_gates(src, src, data.train(), nullptr, b);
    EXPECT_TRUE(rest.finished);
    const auto ja = recipe_to_json(recipe_load(dir.file("a/recipe.json")));
    const auto jb = recipe_to_json(recipe_load(dir.file("b/recipe.json")));
    EXPECT_EQ(ja["tensors"], jb["tensors"]);  // types and gate probabilities, bit for bit
    // The log of the resumed run has each step once, and the cut line is gone.
    std::ifstream log(dir.file("b/log.jsonl"));
    int lines = 0;
    for (std::string line; std::getline(log, line); ++lines) {
        EXPECT_EQ(nlohmann::json::parse(line)["step"], lines);
    }
    EXPECT_EQ(lines, 8);
}

TEST(train, a_teacher_in_another_file_with_the_same_weights_trains_what_the_shared_source_trains) {
    // The teacher defaults to the source, and then one set of weights serves both; a copy of the file as --teacher
    // gets its own set. The same tensors either way, so the same log and gates bit for bit.
    temp_dir dir;
    gguf_file src(test::stories260k());
    std::filesystem::copy_file(test::stories260k(), dir.file("teacher.gguf"));
    gguf_file teacher(dir.file("teacher.gguf"));
    token_data data(stories_data());
    const train_result shared = train_gates(src, src, data.train(), nullptr, quick(dir.file("shared")));
    const train_result own = train_gates(src, teacher, data.train(), nullptr, quick(dir.file("own")));
    EXPECT_EQ(test::read_file(dir.file("shared/recipe.json")), test::read_file(dir.file("own/recipe.json")));
    EXPECT_EQ(same_log_lines(dir.file("shared/log.jsonl"), dir.file("own/log.jsonl")), 8);
}

TEST(train, recomputing_the_layers_trains_the_same_log_and_recipe_bit_for_bit_with_gumbel_noise_and_routed_tokens) {
    // --recompute on runs each layer again in the backward at the weight source's same draws (the Gumbel noise of the
    // straight-through steps, the routes of per-token routing): the same values and gradients on the CPU, so the same
    // log and gates. Without the draws set back, the recomputed layers would see other noise and other routes.
    temp_dir dir;
    gguf_file src(test::stories260k());
    token_data data(stories_data());
    for (const std::string routing : {"mix", "ptqr"}) {
        SCOPED_TRACE(routing);
        auto run = [&](const std::string & name, const std::string & recompute) {
            train_options o = quick(dir.file(routing + "-" + name));
            o.st_gumbel_fraction = routing == "mix" ? 0.5 : 0.0;  // the two are exclusive
            o.routing = routing;
            o.recompute = recompute;
            train_gates(src, src, data.train(), nullptr, o);
        };
        run("plain", "off");
        run("recomputed", "on");
        EXPECT_EQ(test::read_file(dir.file(routing + "-plain/recipe.json")),
                  test::read_file(dir.file(routing + "-recomputed/recipe.json")));
        EXPECT_EQ(same_log_lines(dir.file(routing + "-plain/log.jsonl"), dir.file(routing + "-recomputed/log.jsonl")), 8);
    }
}

TEST(train, recompute_auto_turns_on_only_when_a_gpu_would_not_hold_the_activations) {
    EXPECT_TRUE(resolve_recompute("on", 0, 0));
    EXPECT_FALSE(resolve_recompute("off", int64_t{1} << 40, 1));
    EXPECT_FALSE(resolve_recompute("auto", int64_t{1} << 40, 0));  // the CPU: never
    EXPECT_TRUE(resolve_recompute("auto", int64_t{50} << 30, int64_t{40} << 30));
    EXPECT_FALSE(resolve_recompute("auto", int64_t{30} << 30, int64_t{40} << 30));
    // The whole Llama-3-8B shape: 2.89 M inputs and outputs of its gated matrices per token.
    EXPECT_EQ(activation_bytes_estimate(8 * 2048, 2'887'680), int64_t{6} * 8 * 2048 * 2'887'680);
    // Recomputed: each layer's bf16 input (16,384 × 4096 × 2 bytes × 32 layers, 4 GiB) and one layer's share.
    EXPECT_EQ(activation_bytes_recomputed(8 * 2048, 4096, 32, int64_t{32} << 30), (int64_t{4} << 30) + (int64_t{1} << 30));
    EXPECT_NE(error_of([] { resolve_recompute("sometimes", 0, 0); }).find("--recompute sometimes"), std::string::npos);
}

TEST(train, refuses_to_reuse_or_resume_the_wrong_run_directory) {
    temp_dir dir;
    gguf_file src(test::stories260k());
    token_data data(stories_data());
    auto o = quick(dir.file("run"));
    o.steps = 2;
    train_gates(src, src, data.train(), nullptr, o);
    EXPECT_NE(error_of([&] { train_gates(src, src, data.train(), nullptr, o); }).find("--resume"), std::string::npos);
    o.resume = true;
    o.steps = 5;  // another run
    EXPECT_NE(error_of([&] { train_gates(src, src, data.train(), nullptr, o); }).find("other options"),
              std::string::npos);
    auto fresh = quick(dir.file("empty"));
    fresh.resume = true;
    EXPECT_NE(error_of([&] { train_gates(src, src, data.train(), nullptr, fresh); }).find("no journal"),
              std::string::npos);
}

// Not a libFuzzer harness: the archive inside journal.pt is read by LibTorch's deserializer (its zip reader, its
// unpickler and TorchScript's type parser), and the fuzz build (fuzz/) compiles only Voodoo's own readers with ASan
// and UBSan. Debian's LibTorch is not built with them, so under libFuzzer its code would run without coverage or
// sanitizer checks, and linking it would pull hundreds of MB into every harness; fuzz/fuzz_journal.cpp fuzzes the
// envelope (train/journal_file.cpp), which has no LibTorch. Here a real journal is cut at every length and has
// every byte flipped: each must be one voodoo::error naming the file. Before the envelope, a flipped byte in the
// archive's TorchScript source crashed libtorch 1.13 (SIGSEGV in ScriptTypeParser::parseClassConstant).
TEST(train, a_journal_cut_short_or_with_any_byte_flipped_is_one_error_naming_it_not_a_crash) {
    temp_dir dir;
    const std::string path = dir.file("journal.pt");
    auto gates = [] {
        std::vector<gated_tensor> g(2);
        g[0].gate = torch::tensor({3.0f, 0.5f, -1.0f}).requires_grad_(true);
        g[1].gate = torch::zeros({5}).requires_grad_(true);
        return g;
    };
    auto adamw = [](std::vector<gated_tensor> & g) {
        return torch::optim::AdamW(std::vector<torch::Tensor>{g[0].gate, g[1].gate}, torch::optim::AdamWOptions(0.1));
    };
    std::vector<gated_tensor> saved = gates();
    auto opt = adamw(saved);
    (saved[0].gate.sum() + saved[1].gate.pow(2).sum()).backward();
    opt.step();
    save_journal(path, "fp", 4, saved, opt);
    const std::string bytes = test::read_file(path);
    {
        auto g = gates();
        auto o = adamw(g);
        EXPECT_EQ(load_journal(path, "fp", g, o, 8), 4);
        EXPECT_TRUE(torch::equal(g[0].gate, saved[0].gate));
        EXPECT_NE(error_of([&] { load_journal(path, "fp", g, o, 3); }).find("its step is not a count in [0, 3]"),
                  std::string::npos);
    }
    int refused = 0;
    auto expect_refused = [&](const std::string & damaged, const std::string & what, const std::string & reason) {
        test::write_file(path, damaged);
        auto g = gates();
        auto o = adamw(g);
        try {
            load_journal(path, "fp", g, o, 8);
            ADD_FAILURE() << what << ": loaded";
        } catch (const voodoo::error & e) {
            const std::string msg = e.what();
            EXPECT_NE(msg.find("journal '" + path + "'"), std::string::npos) << what << ": " << msg;
            EXPECT_NE(msg.find(reason), std::string::npos) << what << ": " << msg;
            ++refused;
        } catch (const std::exception & e) {
            ADD_FAILURE() << what << ": not a voodoo::error: " << e.what();
        }
        EXPECT_TRUE(torch::equal(g[0].gate, gates()[0].gate)) << what << ": a gate was set";
    };
    for (size_t n = 0; n < bytes.size(); ++n) {
        expect_refused(bytes.substr(0, n), fmt::format("cut to {} of {} bytes", n, bytes.size()),
                       n < 32 ? "is not a Voodoo journal" : "cut short");
    }
    for (size_t i = 0; i < bytes.size(); ++i) {
        std::string damaged = bytes;
        damaged[i] = static_cast<char>(damaged[i] ^ 0xff);
        expect_refused(damaged, fmt::format("byte {} of {} flipped", i, bytes.size()), "");
    }
    EXPECT_EQ(refused, static_cast<int>(2 * bytes.size()));
    // A journal of a Voodoo before the envelope (a plain LibTorch archive) is refused by name, not read.
    test::write_file(path, bytes.substr(32));
    EXPECT_NE(error_of([&] { auto g = gates(); auto o = adamw(g); load_journal(path, "fp", g, o, 8); })
                  .find("is not a Voodoo journal"),
              std::string::npos);
}

TEST(train, an_impossible_target_is_refused_before_any_work) {
    temp_dir dir;
    gguf_file src(test::stories260k());
    token_data data(stories_data());
    auto o = quick(dir.file("run"));
    o.goal = {target_kind::size, 100000};
    const std::string msg = error_of([&] { train_gates(src, src, data.train(), nullptr, o); });
    EXPECT_NE(msg.find("outside what the menus can reach"), std::string::npos) << msg;
    EXPECT_FALSE(std::filesystem::exists(dir.file("run")));
}

TEST(train, a_non_finite_loss_stops_naming_the_tensor_and_keeps_the_last_good_journal) {
    temp_dir dir;
    gguf_file src(test::stories260k());
    token_data data(stories_data());
    auto o = quick(dir.file("run"));
    o.should_stop = [](int step) { return step == 1; };
    train_gates(src, src, data.train(), nullptr, o);
    const auto journal = dir.file("run/journal.pt");
    const auto before = std::filesystem::last_write_time(journal);

    // A teacher whose output norm holds a NaN: every teacher logit is NaN.
    const std::string bad = dir.file("nan-teacher.gguf");
    {
        gguf_writer w(bad, src.alignment());
        w.copy_kv(src);
        for (const gguf_tensor & t : src.tensors()) {
            w.add_tensor(t.name, t.type, t.shape());
        }
        for (const gguf_tensor & t : src.tensors()) {
            std::vector<uint8_t> bytes(src.data(t).begin(), src.data(t).end());
            if (t.name == "output_norm.weight") {
                const float nan = std::nanf("");
                std::memcpy(bytes.data(), &nan, sizeof nan);
            }
            w.write_tensor(t.name, bytes);
        }
        w.commit();
    }
    gguf_file teacher(bad);
    o.should_stop = nullptr;
    o.resume = true;
    const std::string msg = error_of([&] { train_gates(src, teacher, data.train(), nullptr, o); });
    EXPECT_NE(msg.find("not finite"), std::string::npos) << msg;
    EXPECT_NE(msg.find("token_embd.weight"), std::string::npos) << msg;  // the first tensor probed
    EXPECT_NE(msg.find(dir.file("run")), std::string::npos) << msg;
    EXPECT_EQ(std::filesystem::last_write_time(journal), before);
}

TEST(train, tokens_of_another_vocabulary_are_refused) {
    temp_dir dir;
    fixture_spec spec;
    spec.n_embd = 64;
    spec.n_layer = 1;
    spec.n_head = 2;
    spec.n_head_kv = 1;
    spec.head_dim = 32;
    spec.n_ff = 128;
    spec.vocab_path = std::string(VOODOO_LLAMA_MODELS_DIR) + "/ggml-vocab-gpt-2.gguf";
    write_fixture(spec, dir.file("gpt2.gguf"));
    data_options d;
    d.model = dir.file("gpt2.gguf");
    d.texts = {test::shared_data() + "/text/tinystories/tinystories_val.txt"};
    d.ctx = 64;
    d.out_dir = dir.file("gpt2-data");
    prepare_data(d);
    token_data other(d.out_dir);
    gguf_file src(test::stories260k());
    const std::string msg = error_of([&] { train_gates(src, src, other.train(), nullptr, quick(dir.file("run"))); });
    EXPECT_NE(msg.find("vocabulary"), std::string::npos) << msg;
}

TEST(train, with_an_imatrix_the_exported_file_still_fits_the_target_to_the_byte) {
    temp_dir dir;
    gguf_file src(test::stories260k());
    token_data data(stories_data());
    // A valid imatrix for every matmul weight (random positive sums over 100 tokens).
    imatrix im;
    im.datasets = {"random"};
    im.chunk_count = 3;
    im.chunk_size = 64;
    uint32_t seed = 5;
    for (const auto & t : src.tensors()) {
        if (t.n_dims == 2) {
            imatrix_entry e;
            for (float x : test::gaussian(static_cast<size_t>(t.ne[0]), seed++)) {
                e.in_sum2.push_back(100.0f * (0.1f + x * x));
            }
            e.counts = {100};
            im.entries[t.name] = e;
        }
    }
    const std::string im_path = dir.file("imatrix.gguf");
    write_imatrix_gguf(im_path, im);

    importance_map importance;
    auto o = quick(dir.file("run"));
    o.steps = 3;
    o.export_opts = imatrix_export_options(im_path, im_path, src, importance);
    o.menu.has_imatrix = true;
    o.imatrix_path = im_path;
    const train_result r = train_gates(src, src, data.train(), &importance, o);
    const recipe saved = recipe_load(dir.file("run/recipe.json"));
    EXPECT_EQ(saved.imatrix, im_path);
    importance_map again;
    export_options eo = imatrix_export_options(im_path, saved.imatrix, src, again);
    eo.target = saved.target;
    const auto res = export_gguf(src, saved, dir.file("out.gguf"), eo);
    EXPECT_EQ(static_cast<double>(res.file_bytes), r.total_bytes);
    EXPECT_LE(res.file_bytes, 304352u);
    EXPECT_EQ(gguf_file(dir.file("out.gguf")).get_string("quantize.imatrix.file"), im_path);
}

namespace {

std::vector<nlohmann::json> log_of(const std::string & run_dir) {
    std::ifstream in(run_dir + "/log.jsonl");
    std::vector<nlohmann::json> out;
    for (std::string line; std::getline(in, line);) {
        out.push_back(nlohmann::json::parse(line));
    }
    return out;
}

}  // namespace

TEST(train, the_loss_taken_a_few_positions_at_a_time_equals_the_whole_and_the_reference_path_the_cpu_path) {
    // Chunks of 7 positions (sequences of 32) and dense reference candidates: the same losses, step by step,
    // as the default run (one chunk, streaming CPU mixture), up to f32 summation order.
    temp_dir dir;
    gguf_file src(test::stories260k());
    token_data data(stories_data());
    train_options a = quick(dir.file("a"));
    a.steps = 3;
    train_options b = a;
    b.run_dir = dir.file("b");
    b.loss_chunk = 7;
    b.mixture = "reference";
    const train_result ra = train_gates(src, src, data.train(), nullptr, a);
    const train_result rb = train_gates(src, src, data.train(), nullptr, b);
    EXPECT_EQ(ra.mixture, "cpu");
    EXPECT_EQ(rb.mixture, "reference");
    const auto la = log_of(a.run_dir), lb = log_of(b.run_dir);
    ASSERT_EQ(la.size(), 3u);
    ASSERT_EQ(lb.size(), 3u);
    for (size_t i = 0; i < la.size(); ++i) {
        for (const char * key : {"ce", "kl", "bytes"}) {
            const double x = la[i][key], y = lb[i][key];
            EXPECT_NEAR(x, y, 1e-5 * std::max(1.0, std::abs(x))) << key << " at step " << i;
        }
    }
}

TEST(train, a_device_this_build_or_machine_lacks_is_refused_before_any_work) {
    temp_dir dir;
    gguf_file src(test::stories260k());
    token_data data(stories_data());
    train_options o = quick(dir.file("run"));
    o.device = "tpu";
    EXPECT_NE(error_of([&] { train_gates(src, src, data.train(), nullptr, o); }).find("--device 'tpu'"), std::string::npos);
    o.device = "cpu";
    // auto: the tensor cores' f32 mode on a CUDA device, f32 on the CPU; a value given is kept.
    EXPECT_EQ(resolved_probe_compute("auto", "cpu"), "f32");
    EXPECT_EQ(resolved_probe_compute("auto", "cuda"), "tf32");
    EXPECT_EQ(resolved_probe_compute("auto", "cuda:1"), "tf32");
    EXPECT_EQ(resolved_probe_compute("f32", "cuda"), "f32");
    EXPECT_EQ(resolved_probe_compute("bf16", "cpu"), "bf16");
    o.probe_compute = "tf32";  // the tensor cores' f32 mode: CUDA only
    EXPECT_NE(error_of([&] { train_gates(src, src, data.train(), nullptr, o); }).find("--probe-compute tf32"), std::string::npos);
    o.probe_compute = "f32";
    o.mixture = "fused";
    EXPECT_NE(error_of([&] { train_gates(src, src, data.train(), nullptr, o); }).find("--mixture fused"), std::string::npos);
#if !defined(VOODOO_HAVE_CUDA)
    o.device = "cuda";
    o.mixture.clear();
    EXPECT_NE(error_of([&] { train_gates(src, src, data.train(), nullptr, o); }).find("built without CUDA"), std::string::npos);
#endif
    EXPECT_FALSE(std::filesystem::exists(dir.file("run/journal.pt")));
}

TEST(train, ptqr_routes_tokens_replays_on_resume_and_excludes_st_gumbel) {
    temp_dir dir;
    gguf_file src(test::stories260k());
    token_data data(stories_data());
    auto o = quick(dir.file("a"));
    o.routing = "ptqr";
    o.cache_dir = dir.file("cache");
    train_gates(src, src, data.train(), nullptr, o);

    auto b = o;
    b.run_dir = dir.file("b");
    b.should_stop = [](int step) { return step == 2; };
    EXPECT_FALSE(train_gates(src, src, data.train(), nullptr, b).finished);
    b.should_stop = nullptr;
    b.resume = true;
    EXPECT_TRUE(train_gates(src, src, data.train(), nullptr, b).finished);
    const auto ja = recipe_to_json(recipe_load(dir.file("a/recipe.json")));
    const auto jb = recipe_to_json(recipe_load(dir.file("b/recipe.json")));
    EXPECT_EQ(ja["tensors"], jb["tensors"]);  // the routes replay: types and gate probabilities, bit for bit

    // The routed forward is not the mixture's: the first step's KL differs from a mixing run's on the same batch.
    auto m = o;
    m.routing = "mix";
    m.run_dir = dir.file("m");
    train_gates(src, src, data.train(), nullptr, m);
    auto first_kl = [&](const std::string & run) {
        std::ifstream log(dir.file(run + "/log.jsonl"));
        std::string line;
        std::getline(log, line);
        return nlohmann::json::parse(line)["kl"].get<double>();
    };
    EXPECT_NE(first_kl("a"), first_kl("m"));

    auto st = quick(dir.file("st"));
    st.routing = "ptqr";
    st.st_gumbel_fraction = 0.5;
    const std::string msg = error_of([&] { train_gates(src, src, data.train(), nullptr, st); });
    EXPECT_NE(msg.find("--routing ptqr and --st-gumbel-fraction"), std::string::npos) << msg;
    st.st_gumbel_fraction = 0;
    st.routing = "tokens";
    EXPECT_NE(error_of([&] { train_gates(src, src, data.train(), nullptr, st); }).find("--routing 'tokens'"),
              std::string::npos);
}

TEST(train, a_resumed_bar_counts_the_steps_done_before_but_rates_only_this_runs) {
    // A new user's trial: a resumed training's bar read "train 9/40 steps … 6.07M/s", its rate counting the steps a
    // journal held as done in no time. resume_from counts them in the bar, not in the rate.
    const char * was = std::getenv("VOODOO_PROGRESS");
    const std::string saved = was ? was : "";
    ::setenv("VOODOO_PROGRESS", "1", 1);
    testing::internal::CaptureStderr();
    {
        voodoo::progress bar("train", 100000, "steps");
        bar.resume_from(99000);
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        bar.add(1000);
    }
    const std::string err = testing::internal::GetCapturedStderr();
    if (was) {
        ::setenv("VOODOO_PROGRESS", saved.c_str(), 1);
    } else {
        ::unsetenv("VOODOO_PROGRESS");
    }
    // The final line: "train [####…] 100000/100000 steps 100.0% in 0.1s R/s steps", R = 1000 / elapsed (≤ 10k after
    // 100 ms); counting the 99,000 as well would be ≥ 20k unless the sleep took 5 s.
    const size_t at = err.rfind("100000/100000 steps");
    ASSERT_NE(at, std::string::npos) << err;
    const std::string tail = err.substr(at);
    const size_t per_s = tail.find("/s");
    ASSERT_NE(per_s, std::string::npos) << tail;
    const size_t start = tail.rfind(' ', per_s) + 1;
    std::string r = tail.substr(start, per_s - start);
    double scale = 1;
    if (!r.empty() && (r.back() == 'k' || r.back() == 'M')) {
        scale = r.back() == 'k' ? 1e3 : 1e6;
        r.pop_back();
    }
    const double rate = std::stod(r) * scale;
    EXPECT_GT(rate, 0.0) << tail;
    EXPECT_LT(rate, 20000.0) << tail;
}
