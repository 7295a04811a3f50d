// `voodoo eval`: llama-perplexity's PPL and KLD in libllama, and its refusals.
#include "common/error.h"
#include "eval/baseline.h"
#include "eval/eval.h"
#include "eval/report.h"
#include "ggml/gguf.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <cstdlib>
#include <chrono>
#include <cmath>
#include <thread>
#include <fstream>
#include <sstream>

#include <csignal>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

namespace {

using voodoo::test::stories260k;

/// The first `bytes` of the TinyStories validation text, cut at a line end: a few thousand tokens.
std::string write_short_text(const voodoo::test::temp_dir & dir, size_t bytes = 8000) {
    std::string text = voodoo::test::read_file(voodoo::test::shared_data() + "/text/tinystories/tinystories_val.txt");
    text.resize(text.rfind('\n', bytes) + 1);
    const std::string path = dir.file("tinystories-short.txt");
    std::ofstream(path, std::ios::binary) << text;
    return path;
}

/// Expects run_eval to fail with a message containing every one of `parts`.
void expect_eval_error(const voodoo::eval_options & opt, const std::vector<std::string> & files,
                       const std::vector<std::string> & parts) {
    try {
        voodoo::run_eval(opt, files);
        ADD_FAILURE() << "run_eval did not fail";
    } catch (const voodoo::error & e) {
        for (const std::string & part : parts) {
            EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << "missing '" << part << "' in: " << e.what();
        }
    }
}

}  // namespace

// Named, not anonymous: a TEST_F's class derives from it, and GCC warns (-Wsubobject-linkage) of a base in an anonymous
// namespace once the unity build includes this file in another.
namespace eval_tests {

class eval_test : public ::testing::Test {
protected:
    static void SetUpTestSuite() {
        setenv("VOODOO_PROGRESS", "0", 1);
        dir_ = new voodoo::test::temp_dir();
        text_ = write_short_text(*dir_);
        q8_0_ = dir_->file("stories260K-Q8_0.gguf");
        voodoo::make_baseline({stories260k(), "", 1}, "Q8_0", q8_0_);
    }
    static void TearDownTestSuite() { delete dir_; }

    static voodoo::eval_options options(int n_chunks = 3) {
        voodoo::eval_options o;
        o.reference = stories260k();
        o.text = text_;
        o.n_ctx = 128;
        o.n_chunks = n_chunks;
        o.n_threads = 1;  // the test machine is shared: spinning decode threads only slow it down
        o.speed_reps = 0; // the speed columns have their own test
        return o;
    }

    static inline voodoo::test::temp_dir * dir_ = nullptr;
    static inline std::string text_;
    static inline std::string q8_0_;
};

}  // namespace eval_tests

using eval_tests::eval_test;

namespace {

TEST_F(eval_test, the_reference_against_itself_has_kld_0_and_same_top_100_percent) {
    const voodoo::eval_result r = voodoo::run_eval(options(), {stories260k()});
    ASSERT_EQ(r.files.size(), 1u);
    const voodoo::eval_file_result & f = r.files[0];
    EXPECT_EQ(f.kld_mean, 0.0);
    EXPECT_EQ(f.kld_max, 0.0);
    EXPECT_EQ(f.kld_p999, 0.0);
    EXPECT_EQ(f.same_top, 1.0);
    EXPECT_EQ(f.ppl, r.ref.ppl);
    EXPECT_EQ(f.ppl_ratio, 1.0);
    EXPECT_EQ(f.ln_ppl_ratio, 0.0);
    // A 260K-parameter model on TinyStories: low but not trivial perplexity, with an uncertainty.
    EXPECT_GT(r.ref.ppl, 1.5);
    EXPECT_LT(r.ref.ppl, 20.0);
    EXPECT_GT(r.ref.ppl_err, 0.0);
}

TEST_F(eval_test, chunks_of_ctx_tokens_score_their_second_half) {
    const voodoo::eval_result r = voodoo::run_eval(options(3), {stories260k()});
    EXPECT_EQ(r.n_chunks, 3);
    EXPECT_EQ(r.n_ctx, 128);
    // Rows n_ctx/2 … n_ctx−2 predict tokens n_ctx/2+1 … n_ctx−1: 63 tokens per chunk.
    EXPECT_EQ(r.n_scored, 3 * (128 - 1 - 64));
    EXPECT_GT(r.n_text_tokens, 3 * 128);
}

TEST_F(eval_test, q8_0_has_a_small_positive_kld_and_a_ppl_close_to_the_reference) {
    const voodoo::eval_result r = voodoo::run_eval(options(), {q8_0_});
    const voodoo::eval_file_result & f = r.files[0];
    EXPECT_GT(f.kld_mean, 0.0);
    EXPECT_LT(f.kld_mean, 0.01);
    EXPECT_GT(f.kld_err, 0.0);
    EXPECT_LE(f.kld_median, f.kld_p99);
    EXPECT_LE(f.kld_p99, f.kld_p999);
    EXPECT_LE(f.kld_p999, f.kld_max);
    EXPECT_NEAR(f.ppl / r.ref.ppl, 1.0, 0.01);
    // f64: ppl = exp(a), ref = exp(b) and ratio = exp(a − b), each exp within 1 ulp (2u): the two sides differ
    // by ≤ (2 + 2 + 1 division + 2 + |a − b| through the subtraction)·u relative; log adds 1 ulp of its result.
    const double u = 0x1p-53, x = f.ln_ppl_ratio;
    EXPECT_NEAR(f.ppl_ratio, f.ppl / r.ref.ppl, (8 + std::abs(x)) * u * f.ppl_ratio);
    EXPECT_NEAR(std::log(f.ppl_ratio), x, 4 * u * (1 + std::abs(x)));
    EXPECT_GT(f.same_top, 0.9);
    EXPECT_LE(f.same_top, 1.0);  // n_same / n with n_same ≤ n: a correctly rounded division stays ≤ 1
    EXPECT_EQ(f.file_bytes, 379168u);  // what llama_model_quantize makes of stories260K as Q8_0
}

TEST_F(eval_test, the_thread_count_does_not_change_any_number) {
    auto one = options(1);
    auto two = options(1);
    two.n_threads = 2;
    const voodoo::eval_result a = voodoo::run_eval(one, {q8_0_});
    const voodoo::eval_result b = voodoo::run_eval(two, {q8_0_});
    EXPECT_EQ(a.ref.ppl, b.ref.ppl);
    EXPECT_EQ(a.files[0].kld_mean, b.files[0].kld_mean);
    EXPECT_EQ(a.files[0].kld_max, b.files[0].kld_max);
    EXPECT_EQ(a.files[0].same_top, b.files[0].same_top);
}

namespace {
/// Every figure of two results, compared for equality (the session's numbers are run_eval's bit for bit).
void expect_same_numbers(const voodoo::eval_result & a, const voodoo::eval_result & b) {
    ASSERT_EQ(a.files.size(), b.files.size());
    EXPECT_EQ(a.n_scored, b.n_scored);
    auto same = [](const voodoo::eval_file_result & x, const voodoo::eval_file_result & y) {
        EXPECT_EQ(x.name, y.name);
        EXPECT_EQ(x.ppl, y.ppl) << x.name;
        EXPECT_EQ(x.ppl_err, y.ppl_err) << x.name;
        EXPECT_EQ(x.ln_ppl_ratio, y.ln_ppl_ratio) << x.name;
        EXPECT_EQ(x.ln_ppl_ratio_err, y.ln_ppl_ratio_err) << x.name;
        EXPECT_EQ(x.kld_mean, y.kld_mean) << x.name;
        EXPECT_EQ(x.kld_err, y.kld_err) << x.name;
        EXPECT_EQ(x.kld_median, y.kld_median) << x.name;
        EXPECT_EQ(x.kld_p99, y.kld_p99) << x.name;
        EXPECT_EQ(x.kld_p999, y.kld_p999) << x.name;
        EXPECT_EQ(x.kld_max, y.kld_max) << x.name;
        EXPECT_EQ(x.same_top, y.same_top) << x.name;
    };
    same(a.ref, b.ref);
    for (size_t f = 0; f < a.files.size(); ++f) {
        same(a.files[f], b.files[f]);
    }
}
}  // namespace

TEST_F(eval_test, a_session_scored_in_steps_gives_run_evals_numbers_bit_for_bit) {
    // quantize's eval ahead: the reference first (its logits kept), a stock file while training runs, stopped and
    // resumed, our file last; or the reference not kept and decoded again. Every way, run_eval's numbers.
    const auto opt = options(3);
    const std::vector<std::string> files = {stories260k(), q8_0_};
    const voodoo::eval_result plain = voodoo::run_eval(opt, files);
    {
        voodoo::eval_session s(opt, int64_t{1} << 30);
        EXPECT_TRUE(s.keeps_reference());
        // 3 chunks × (128 − 1 − 64) scored rows × a 512-token vocabulary × 4 bytes
        EXPECT_EQ(s.reference_bytes(), int64_t{3} * 63 * 512 * 4);
        EXPECT_TRUE(s.score({}));  // the reference alone
        EXPECT_FALSE(s.score({q8_0_}, [] { return true; }));  // stopped before its first decode
        EXPECT_TRUE(s.score({q8_0_}));
        EXPECT_THROW(s.finish(files), voodoo::error);  // stories260k() is not scored yet
    }
    {
        voodoo::eval_session s(opt, int64_t{1} << 30);
        EXPECT_TRUE(s.score({q8_0_}));
        EXPECT_TRUE(s.score(files));
        expect_same_numbers(plain, s.finish(files));
        EXPECT_THROW(s.finish(files), voodoo::error);  // once
    }
    {
        // Every chunk kept, then stop_keeping: the session goes on from what it kept.
        voodoo::eval_session s(opt, int64_t{1} << 30);
        EXPECT_TRUE(s.score({q8_0_}));
        s.stop_keeping();
        EXPECT_TRUE(s.score(files));
        expect_same_numbers(plain, s.finish(files));
    }
    {
        voodoo::eval_session s(opt, 0);  // nothing kept: the reference is decoded again, its own sums added once
        EXPECT_FALSE(s.keeps_reference());
        EXPECT_TRUE(s.score({q8_0_}));
        EXPECT_TRUE(s.score(files));
        expect_same_numbers(plain, s.finish(files));
    }
    {
        // Stopped by another thread wherever it happens to be, then finished: the same numbers.
        voodoo::eval_session s(opt, int64_t{1} << 30);
        std::atomic<bool> stop{false};
        std::thread stopper([&] {
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
            stop = true;
        });
        s.score({q8_0_}, [&stop] { return stop.load(); });
        stopper.join();
        EXPECT_TRUE(s.score(files));
        expect_same_numbers(plain, s.finish(files));
    }
}

TEST_F(eval_test, reports_are_a_markdown_table_json_and_a_png) {
    const voodoo::eval_result r = voodoo::run_eval(options(2), {stories260k(), q8_0_});
    const std::string md = voodoo::eval_to_markdown(r);
    EXPECT_EQ(md.rfind("| file | size MiB | BPW | PPL |", 0), 0u) << md;
    EXPECT_NE(md.find("stories260K.gguf (reference)"), std::string::npos);
    EXPECT_NE(md.find("| stories260K-Q8_0.gguf | 0.362 | 9.966 |"), std::string::npos) << md;
    const nlohmann::json j = voodoo::eval_to_json(r);
    EXPECT_EQ(j["files"].size(), 2u);
    EXPECT_EQ(j["files"][1]["file_bytes"], 379168);
    EXPECT_EQ(j["files"][0]["kld_mean"], 0.0);
    EXPECT_EQ(j["n_scored"], 2 * 63);
    // Where libllama computed: the pinned package has CPU backends only (a GPU one comes from GGML_BACKEND_PATH).
    if (std::getenv("GGML_BACKEND_PATH") == nullptr) {
        EXPECT_TRUE(r.devices.empty());
        EXPECT_NE(md.find("; computed by libllama on the CPU."), std::string::npos) << md;
        EXPECT_EQ(j["devices"], nlohmann::json::array());
    }
    const std::string png = dir_->file("plot.png");
    voodoo::eval_plot(r, png);
    const std::string bytes = voodoo::test::read_file(png);
    ASSERT_GT(bytes.size(), 1000u);
    EXPECT_EQ(bytes.substr(1, 3), "PNG");
}

TEST_F(eval_test, a_file_of_another_vocabulary_is_refused_naming_both_files) {
    const std::string vocab = std::string(VOODOO_SOURCE_DIR) + "/.deps/llama.cpp/models/ggml-vocab-llama-spm.gguf";
    expect_eval_error(options(), {vocab}, {vocab, stories260k(), "another vocabulary", "32000", "512"});
}

TEST_F(eval_test, a_file_with_other_tensors_or_architecture_is_refused) {
    const voodoo::gguf_file src(stories260k());
    // A copy without blk.4.ffn_down.weight: another model as far as eval is concerned.
    const std::string missing = dir_->file("missing-tensor.gguf");
    {
        voodoo::gguf_writer w(missing, src.alignment());
        w.copy_kv(src);
        for (const auto & t : src.tensors()) {
            if (t.name != "blk.4.ffn_down.weight") {
                w.add_tensor(t.name, t.type, t.shape());
            }
        }
        w.begin_data();
        for (const auto & t : src.tensors()) {
            if (t.name != "blk.4.ffn_down.weight") {
                w.write_tensor(t.name, src.data(t));
            }
        }
        w.commit();
    }
    expect_eval_error(options(), {missing}, {missing, "47 tensors", "48"});
    // The same tensors under another architecture name.
    const std::string gpt2 = dir_->file("gpt2.gguf");
    {
        voodoo::gguf_writer w(gpt2, src.alignment());
        w.copy_kv(src);
        gguf_set_val_str(w.ctx(), "general.architecture", "gpt2");
        for (const auto & t : src.tensors()) {
            w.add_tensor(t.name, t.type, t.shape());
        }
        w.begin_data();
        for (const auto & t : src.tensors()) {
            w.write_tensor(t.name, src.data(t));
        }
        w.commit();
    }
    expect_eval_error(options(), {gpt2}, {gpt2, "'gpt2' model", "'llama'"});
}

TEST_F(eval_test, a_ctx_beyond_the_training_context_is_refused_naming_the_flag_and_limit) {
    auto o = options();
    o.n_ctx = 4096;
    expect_eval_error(o, {stories260k()}, {"--ctx 4096", "llama.context_length = 2048", "--ctx 2048 or less"});
}

TEST_F(eval_test, text_in_a_script_the_vocab_does_not_cover_is_refused) {
    const std::string path = dir_->file("chinese.txt");
    {
        std::ofstream out(path, std::ios::binary);
        for (int i = 0; i < 200; ++i) {
            out << "从前有一只小猫，它住在一个大森林里。每天早上，它都会去河边喝水。\n";
        }
    }
    auto o = options();
    o.text = path;
    expect_eval_error(o, {stories260k()}, {path, "not in a script", "byte-fallback"});
}

TEST_F(eval_test, a_text_shorter_than_two_chunks_is_refused) {
    const std::string path = dir_->file("short.txt");
    std::ofstream(path) << "Once upon a time there was a cat.\n";
    auto o = options();
    o.text = path;
    expect_eval_error(o, {stories260k()}, {path, "needs at least 256"});
}

TEST(eval_cli, writes_the_table_json_and_plot_and_fails_in_one_line) {
    voodoo::test::temp_dir dir;
    const std::string text = write_short_text(dir);
    const std::string out = dir.file("out");
    const auto r = voodoo::test::run_voodoo("eval --reference " + stories260k() + " --text " + text +
                                            " --ctx 64 --chunks 2 --threads 1 --speed-reps 0 --out-dir " + out + " " + stories260k());
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("| stories260K.gguf | 1.130 | 32.000 |"), std::string::npos) << r.output;
    const auto j = nlohmann::json::parse(voodoo::test::read_file(out + "/eval.json"));
    EXPECT_EQ(j["n_ctx"], 64);
    EXPECT_EQ(j["files"][0]["same_top"], 1.0);
    EXPECT_EQ(voodoo::test::read_file(out + "/eval.png").substr(1, 3), "PNG");
    EXPECT_EQ(voodoo::test::read_file(out + "/eval.md").rfind("| file |", 0), 0u);
    for (const char * name : {"table: ", "json: ", "plot: "}) {  // each file written is named on stdout
        EXPECT_NE(r.output.find(name + out + "/eval."), std::string::npos) << name << r.output;
    }

    const auto bad = voodoo::test::run_voodoo("eval --reference " + stories260k() + " --text " + text +
                                              " --ctx 100000 " + stories260k());
    EXPECT_EQ(bad.exit_code, 1);
    EXPECT_EQ(bad.output.rfind("voodoo: error: --ctx 100000 is larger", 0), 0u) << bad.output;
    EXPECT_EQ(std::count(bad.output.begin(), bad.output.end(), '\n'), 1) << bad.output;
}

}  // namespace

TEST(eval_report, gnuplot_is_found_on_path_and_missed_without_it) {
    // make bootstrap installs gnuplot-nox; a PATH without it is what a machine without gnuplot looks like.
    const std::string saved = std::getenv("PATH") ? std::getenv("PATH") : "";
    EXPECT_TRUE(voodoo::gnuplot_available());
    voodoo::test::temp_dir empty;
    setenv("PATH", empty.path.c_str(), 1);
    EXPECT_FALSE(voodoo::gnuplot_available());
    setenv("PATH", saved.c_str(), 1);
    EXPECT_TRUE(voodoo::gnuplot_available());
}

TEST_F(eval_test, speed_columns_are_llama_bench_pp512_and_tg128_and_round_trip_through_json) {
    auto o = options(1);
    o.speed_reps = 3;
    const voodoo::eval_result r = voodoo::run_eval(o, {q8_0_});
    EXPECT_EQ(r.speed_reps, 3);
    EXPECT_EQ(r.speed_threads, 1);
    for (const voodoo::eval_file_result * f : {&r.ref, &r.files[0]}) {
        // Tokens per second of a real decode: positive and finite; a sample sd over 3 runs, ≥ 0.
        EXPECT_GT(f->pp512, 0.0) << f->name;
        EXPECT_GT(f->tg128, 0.0) << f->name;
        EXPECT_TRUE(std::isfinite(f->pp512) && std::isfinite(f->tg128)) << f->name;
        EXPECT_GE(f->pp512_sd, 0.0);
        EXPECT_GE(f->tg128_sd, 0.0);
    }
    const std::string md = voodoo::eval_to_markdown(r);
    EXPECT_NE(md.find("| same top | pp512 t/s | tg128 t/s |"), std::string::npos) << md;
    EXPECT_NE(md.find("mean ± sd of 3 runs on 1 thread."), std::string::npos) << md;
    const voodoo::eval_result back = voodoo::eval_from_json(voodoo::eval_to_json(r), "test");
    EXPECT_EQ(back.speed_reps, 3);
    EXPECT_EQ(back.files[0].pp512, r.files[0].pp512);
    EXPECT_EQ(back.files[0].tg128_sd, r.files[0].tg128_sd);
    EXPECT_EQ(back.ref.tg128, r.ref.tg128);
    // The load other processes put on the machine meanwhile is measured (≥ 0 cores) and kept.
    EXPECT_GE(r.files[0].speed_other_cores, 0.0);
    EXPECT_EQ(back.files[0].speed_other_cores, r.files[0].speed_other_cores);
    // Without repetitions: no columns, nothing measured (the KLD numbers are the same either way).
    o.speed_reps = 0;
    const voodoo::eval_result none = voodoo::run_eval(o, {q8_0_});
    EXPECT_EQ(none.files[0].pp512, 0.0);
    EXPECT_EQ(voodoo::eval_to_markdown(none).find("pp512"), std::string::npos);
    EXPECT_EQ(none.files[0].kld_mean, r.files[0].kld_mean);
}

TEST(eval_speed, the_load_of_another_process_is_counted_and_this_processs_own_is_not) {
    // other_cpu_load: the machine's busy time (/proc/stat, sampled at each clock tick) less this process's (getrusage,
    // summed by the scheduler), over the wall time.
    const double tick = 1.0 / static_cast<double>(sysconf(_SC_CLK_TCK));
    auto spin_for = [](double seconds) {
        const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
        volatile uint64_t x = 0;
        while (std::chrono::steady_clock::now() < end) {
            x = x + 1;
        }
    };
    {
        // This process's own busy thread is subtracted. Other processes may be busy meanwhile (ctest runs tests side by
        // side), so only what cannot fail on a busy machine is asserted: a reading, finite and not negative.
        const voodoo::other_cpu_load load;
        std::thread mine([&] { spin_for(0.3); });
        mine.join();
        ASSERT_GE(load.other_seconds(), 0.0) << "/proc/stat is readable on Linux";
        EXPECT_TRUE(std::isfinite(load.other_cores()));
    }
    // A child's busy loop counts as much CPU time as the kernel gave it (wait4's rusage), within the ticks' sampling:
    // a process that runs part of each tick is counted in whole ticks or none, so the bound is half of it (the
    // sampling's spread over ≈ 100 ticks is ≈ 10 of them) less a tick at each of the two readings.
    const voodoo::other_cpu_load load;
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
        spin_for(1.0);
        _exit(0);
    }
    int status = 0;
    rusage ru{};
    ASSERT_EQ(wait4(child, &status, 0, &ru), child);
    const double other = load.other_seconds();
    const auto sec = [](const timeval & t) { return static_cast<double>(t.tv_sec) + 1e-6 * static_cast<double>(t.tv_usec); };
    const double child_cpu = sec(ru.ru_utime) + sec(ru.ru_stime);
    ASSERT_GT(child_cpu, 0.1) << "the child ran";
    EXPECT_GE(other, 0.5 * child_cpu - 2 * tick) << "the child's " << child_cpu << " s of CPU";
    EXPECT_GT(load.other_cores(), 0.0);
}

TEST(eval_speed, speed_measured_under_load_is_marked_in_the_table_and_warned_of) {
    voodoo::eval_result r;
    r.speed_reps = 1;
    r.speed_threads = 2;
    r.ref.name = "ref.gguf";
    r.ref.pp512 = 100;
    r.ref.tg128 = 10;
    r.ref.speed_other_cores = 0.1;  // quiet
    voodoo::eval_file_result f;
    f.name = "busy.gguf";
    f.pp512 = 50;
    f.tg128 = 5;
    f.speed_other_cores = 1.25;  // another process kept 1.25 cores busy
    r.files.push_back(f);
    std::string md = voodoo::eval_to_markdown(r);
    EXPECT_NE(md.find("50 ± 0 ⚠ | 5.0 ± 0.0 ⚠ |"), std::string::npos) << md;
    EXPECT_EQ(md.find("100 ± 0 ⚠"), std::string::npos) << md;
    EXPECT_NE(md.find("other processes kept up to 1.2 cores busy on average while the speed of 1 file was measured "
                      "(busy.gguf)"),
              std::string::npos)
        << md;
    EXPECT_NE(md.find("--threads T"), std::string::npos) << "the advice names fewer threads: " << md;
    const nlohmann::json j = voodoo::eval_to_json(r);
    EXPECT_EQ(j["files"][0]["speed_under_load"], true);
    EXPECT_EQ(j["reference"]["speed_under_load"], false);
    const voodoo::eval_result back = voodoo::eval_from_json(j, "test");
    EXPECT_EQ(back.files[0].speed_other_cores, 1.25);
    EXPECT_EQ(voodoo::speed_load_warning(back), voodoo::speed_load_warning(r));
    // Below the threshold, or not measured (an eval.json of an earlier version): no mark, no warning.
    r.files[0].speed_other_cores = voodoo::k_speed_load_warn_cores / 2;
    EXPECT_EQ(voodoo::speed_load_warning(r), "");
    r.files[0].speed_other_cores = -1;
    md = voodoo::eval_to_markdown(r);
    EXPECT_EQ(md.find("⚠"), std::string::npos) << md;
}
