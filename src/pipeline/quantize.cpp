#include "pipeline/quantize.h"

#include "dist/dist.h"
#include "pipeline/hf_source.h"
#include "pipeline/dry_run.h"
#include "eval/speed_table.h"

#include "common/error.h"
#include "common/file.h"
#include "common/progress.h"
#include "common/units.h"
#include "train/candidates.h"
#include "data/dataset.h"
#include "eval/baseline.h"
#include "eval/curve.h"
#include "eval/report.h"
#include "export/export.h"
#include "export/model_card.h"
#include "ggml/quant.h"
#include "ggml/runtime.h"
#include "ggml/types.h"
#include "imatrix/collect.h"
#include "imatrix/imatrix.h"
#include "ggml/selection.h"
#include "pipeline/stages.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <atomic>
#include <thread>
#include <optional>
#include <set>

#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

namespace voodoo {

namespace {

namespace fs = std::filesystem;

// Each stage line also marks the time: the job ends with how long each stage took (WORK/times.json).
struct stage_mark {
    std::string name;
    std::chrono::steady_clock::time_point at;
    int64_t max_rss_before = 0;  // max_rss_so_far() when the stage began: the previous stage's value at its end
    int64_t disk_before = 0;     // the work folder's bytes on disk when the stage began (tree_disk_bytes)
};

// The job's work folder, whose bytes on disk each stage mark records (set by run_quantize before its first stage).
std::string & stage_work_folder() {
    static std::string work;
    return work;
}

// The largest resident set so far of this process or of any child it has waited for (the train stage's child), in
// bytes: getrusage's ru_maxrss (KiB on Linux), RUSAGE_SELF and RUSAGE_CHILDREN. It never falls, so a stage whose
// value at its end is above the previous stage's set a new peak.
int64_t max_rss_so_far() {
    rusage self{}, children{};
    getrusage(RUSAGE_SELF, &self);
    getrusage(RUSAGE_CHILDREN, &children);
    return int64_t{1024} * std::max<int64_t>(self.ru_maxrss, children.ru_maxrss);
}

std::vector<stage_mark> & stage_marks() {
    static std::vector<stage_mark> marks;
    return marks;
}

// The job's stop test (quantize_options::train.should_stop, set by run_quantize): checked at every stage mark.
std::function<bool(int)> & stage_stop() {
    static std::function<bool(int)> stop;
    return stop;
}

// Marks the start of a stage (its time, peak memory and disk so far) and prints it; throws voodoo::stopped first when
// the job was asked to stop (Ctrl-C), so that a stage that never polls the stop test (the baselines, the eval) is
// not begun after one.
void stage(const char * name, const std::string & what) {
    if (stage_stop() && stage_stop()(-1)) {
        throw stopped(fmt::format("stopped before the {} stage; run the same command again: finished stages are kept",
                                  name));
    }
    stage_marks().push_back({name, std::chrono::steady_clock::now(), max_rss_so_far(), tree_disk_bytes(stage_work_folder())});
    fmt::print(stderr, "== {}: {}\n", name, what);
}

// A stage line that marks no time: more news of the stage in progress.
void note_line(const char * name, const std::string & what) { fmt::print(stderr, "== {}: {}\n", name, what); }

// Seconds per stage (summed over a ladder's rungs, in order of first appearance) from the marks, printed in one
// line and written to WORK/times.json.
void report_stage_times(const std::string & work) {
    auto & marks = stage_marks();
    if (marks.empty()) {
        return;
    }
    const auto end = std::chrono::steady_clock::now();
    nlohmann::ordered_json j = nlohmann::ordered_json::object();
    for (size_t i = 0; i < marks.size(); ++i) {
        const auto until = i + 1 < marks.size() ? marks[i + 1].at : end;
        const double s = std::chrono::duration<double>(until - marks[i].at).count();
        j[marks[i].name] = j.value(marks[i].name, 0.0) + s;
    }
    // Host memory and the work folder's disk by stage: each at the stage's end (the mark of the next, or now); a
    // stage met twice (a ladder's rungs) keeps its largest.
    nlohmann::ordered_json rss = nlohmann::ordered_json::object(), disk = nlohmann::ordered_json::object();
    const int64_t disk_now = tree_disk_bytes(stage_work_folder());
    for (size_t i = 0; i < marks.size(); ++i) {
        const int64_t r = i + 1 < marks.size() ? marks[i + 1].max_rss_before : max_rss_so_far();
        const int64_t d = i + 1 < marks.size() ? marks[i + 1].disk_before : disk_now;
        rss[marks[i].name] = std::max(r, rss.value(marks[i].name, int64_t{0}));
        disk[marks[i].name] = std::max(d, disk.value(marks[i].name, int64_t{0}));
    }
    const double total = std::chrono::duration<double>(end - marks.front().at).count();
    std::string line;
    for (const auto & [name, s] : j.items()) {
        line += fmt::format("{}{} {:.1f} s", line.empty() ? "" : " · ", name, s.get<double>());
    }
    j["total"] = total;
    // Not a stage: readers that sum the stages skip it (it is an object, not seconds).
    j["max_rss_bytes_at_stage_end"] = rss;
    j["work_disk_bytes_at_stage_end"] = disk;
    // The earlier runs' records in this folder, kept under "earlier" (oldest first): a rerun that finds its stages done
    // takes seconds, and its record must not replace the measurements of the run that did the work.
    const std::string path = (fs::path(work) / "times.json").string();
    nlohmann::ordered_json earlier = nlohmann::ordered_json::array();
    if (fs::exists(path)) {
        std::ifstream in(path);
        auto old = nlohmann::ordered_json::parse(in, nullptr, /*allow_exceptions =*/false);
        if (old.is_object()) {
            if (old.contains("earlier") && old["earlier"].is_array()) {
                earlier = std::move(old["earlier"]);
                old.erase("earlier");
            }
            earlier.push_back(std::move(old));
        }
    }
    if (!earlier.empty()) {
        j["earlier"] = std::move(earlier);
    }
    fmt::print(stderr, "== times: {} · total {:.1f} s, peak RSS {:.1f} GiB ({})\n", line, total,
               static_cast<double>(max_rss_so_far()) / 1073741824.0, path);
    write_file_atomic(path, j.dump(2) + "\n");
    marks.clear();
}

// Splits "a,b , c" into its non-empty, trimmed items.
std::vector<std::string> comma_list(const std::string & list) {
    std::vector<std::string> items;
    for (size_t a = 0; a <= list.size();) {
        const size_t e = std::min(list.find(',', a), list.size());
        std::string item = list.substr(a, e - a);
        a = e + 1;
        item.erase(0, item.find_first_not_of(" \t"));
        item.erase(item.find_last_not_of(" \t") + 1);
        if (!item.empty()) {
            items.push_back(item);
        }
    }
    return items;
}

std::string types_list(const std::vector<ggml_type> & types) {
    std::string s;
    for (ggml_type t : types) {
        if (!s.empty()) {
            s += ",";
        }
        s += type_name(t);
    }
    return s;
}

}  // namespace

std::vector<int> wait_children(const std::vector<int> & pids, const std::function<bool()> & stop,
                               const std::function<void(size_t, int)> & on_exit) {
    std::vector<int> status(pids.size(), 0);
    std::vector<bool> running(pids.size(), true);
    bool forwarded = false;
    for (size_t left = pids.size(); left > 0;) {
        bool ended = false;
        for (size_t i = 0; i < pids.size(); ++i) {
            if (!running[i]) {
                continue;
            }
            int st = 0;
            const pid_t got = waitpid(pids[i], &st, WNOHANG);
            if (got == pids[i] || (got < 0 && errno != EINTR)) {  // ended, or not ours to wait for
                running[i] = false;
                status[i] = got < 0 ? (127 << 8) : st;
                --left;
                ended = true;
                if (on_exit) {
                    on_exit(i, status[i]);
                }
            }
        }
        if (left == 0) {
            break;
        }
        if (!forwarded && stop && stop()) {
            forwarded = true;  // once: a child that heard the terminal's Ctrl-C too only sets its flag again
            for (size_t i = 0; i < pids.size(); ++i) {
                if (running[i]) {
                    kill(pids[i], SIGINT);
                }
            }
        }
        if (!ended) {
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
        }
    }
    return status;
}

namespace {

// Runs args[0] with args and waits for it. Throws voodoo::error naming `what` when it cannot start, when it
// exits 130 (interrupted: `stopped`), or when it fails (its own error is on stderr).
// Starts args[0] with args in a child process whose stdout goes to its stderr (a stage's report is progress here:
// stdout is for the job's result); in the child, `prepare` runs first (redirections, environment). Throws
// voodoo::error naming `what` when no process can be started.
pid_t start_child(std::vector<std::string> & args, const std::string & what, const std::function<void()> & prepare) {
    std::vector<char *> argv;
    for (auto & a : args) {
        argv.push_back(a.data());
    }
    argv.push_back(nullptr);
    std::fflush(nullptr);
    const pid_t pid = fork();
    if (pid < 0) {
        fail("{}: cannot start a child process: {}", what, std::strerror(errno));
    }
    if (pid == 0) {
        if (prepare) {
            prepare();
        }
        dup2(STDERR_FILENO, STDOUT_FILENO);
        execv(argv[0], argv.data());
        std::fprintf(stderr, "cannot run %s: %s\n", argv[0], std::strerror(errno));
        _exit(127);
    }
    return pid;
}

void run_child(std::vector<std::string> args, const std::string & what, const std::string & stopped) {
    const pid_t pid = start_child(args, what, {});
    const int status = wait_children({pid}, [] { return stage_stop() && stage_stop()(-1); })[0];
    if (WIFEXITED(status) && WEXITSTATUS(status) == 130) {
        throw voodoo::stopped(stopped);
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fail("{} failed{}", what,
             WIFSIGNALED(status) ? fmt::format(" with signal {}", WTERMSIG(status)) : fmt::format(" (exit {})", WEXITSTATUS(status)));
    }
}

// `args` as `ranks` processes of one torchrun-style group (RANK = LOCAL_RANK = r, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
// in each child's environment); rank 0 writes to stderr, rank r > 0 to `log_prefix`r.log. Waits for all; throws
// voodoo::error naming the first rank that failed (and its log), or `stopped` when one was interrupted.
void run_ranks(std::vector<std::string> args, int ranks, const std::string & log_prefix, const std::string & what,
               const std::string & stopped) {
    const int port = dist::free_tcp_port();
    // The ranks share this host's cores: unless VOODOO_THREADS says otherwise, each rank's default thread count (its
    // quantizers, libllama and, without OMP_NUM_THREADS, LibTorch) is its share of the cores, as torchrun's
    // OMP_NUM_THREADS=1 keeps ranks from oversubscribing; -t still sets it outright.
    const char * user_threads = std::getenv("VOODOO_THREADS");
    const std::string share = user_threads != nullptr && *user_threads != '\0'
                                  ? std::string()
                                  : std::to_string(std::max(1, resolve_threads(0) / std::max(1, ranks)));
    std::vector<pid_t> pids;
    for (int r = 0; r < ranks; ++r) {
        const std::string log = fmt::format("{}{}.log", log_prefix, r);
        pids.push_back(start_child(args, fmt::format("{} (rank {})", what, r), [&] {
            if (r > 0) {
                const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
                if (fd >= 0) {
                    dup2(fd, STDERR_FILENO);
                }
            }
            setenv("RANK", std::to_string(r).c_str(), 1);
            setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
            setenv("WORLD_SIZE", std::to_string(ranks).c_str(), 1);
            setenv("LOCAL_WORLD_SIZE", std::to_string(ranks).c_str(), 1);
            setenv("MASTER_ADDR", "127.0.0.1", 1);
            setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
            if (!share.empty()) {
                setenv("VOODOO_THREADS", share.c_str(), 1);
            }
        }));
    }
    // In the order they end: the first rank to fail is the one to name (the others then fail waiting for it), and
    // the rest are stopped rather than left waiting for a collective that cannot come.
    std::string failed;
    bool interrupted = false;
    std::vector<bool> running(static_cast<size_t>(ranks), true);
    wait_children(pids, [] { return stage_stop() && stage_stop()(-1); }, [&](size_t i, int status) {
        const int r = static_cast<int>(i);
        running[i] = false;
        interrupted = interrupted || (WIFEXITED(status) && WEXITSTATUS(status) == 130);
        if (failed.empty() && !(WIFEXITED(status) && (WEXITSTATUS(status) == 0 || WEXITSTATUS(status) == 130))) {
            failed = fmt::format("{} failed on rank {} of {}{}{}", what, r, ranks,
                                 WIFSIGNALED(status) ? fmt::format(" with signal {}", WTERMSIG(status))
                                                     : fmt::format(" (exit {})", WEXITSTATUS(status)),
                                 r > 0 ? fmt::format("; its output: {}{}.log", log_prefix, r) : std::string());
            for (int q = 0; q < ranks; ++q) {
                if (running[static_cast<size_t>(q)]) {
                    kill(pids[static_cast<size_t>(q)], SIGTERM);
                }
            }
        }
    });
    if (!failed.empty()) {
        fail("{}", failed);
    }
    if (interrupted) {
        throw voodoo::stopped(stopped);
    }
}

// `exe train …` with the same options, in a child process; returns when it has finished. Throws
// voodoo::error when it cannot start, was interrupted, or failed (its own error is on stderr).
void train_in_child(const std::string & exe, const quantize_options & o, const train_options & t,
                    const std::string & data_dir, const std::string & imatrix_path) {
    std::vector<std::string> args = {exe, "train", "--model", o.model, "--data", data_dir, "--out", t.run_dir,
                                     "--cache", t.cache_dir, "--imatrix", imatrix_path};
    if (o.allow_requantize) {
        args.push_back("--allow-requantize");
    }
    switch (t.goal.kind) {
        case target_kind::bpw: args.insert(args.end(), {"--target-bpw", fmt::format("{:.17g}", t.goal.value)}); break;
        case target_kind::size: args.insert(args.end(), {"--target-size", fmt::format("{:.0f}", t.goal.value)}); break;
        case target_kind::ratio: args.insert(args.end(), {"--ratio", fmt::format("{:.17g}", t.goal.value)}); break;
    }
    if (!t.menu.types.empty()) {
        args.insert(args.end(), {"--menu", types_list(t.menu.types)});
    } else if (t.menu.with_fallbacks) {
        args.insert(args.end(), {"--menu", "all"});
    }
    for (const auto & [regex, types] : t.menu.per_role) {
        args.insert(args.end(), {"--menu-for", regex + "=" + types_list(types)});
    }
    auto num = [&](const char * flag, auto v) { args.insert(args.end(), {flag, fmt::format("{}", v)}); };
    num("--steps", t.steps);
    num("--batch", t.batch);
    num("--accum", t.accum);
    num("--seq", t.seq);
    num("--lr", t.lr);
    num("--tau0", t.tau0);
    num("--tau1", t.tau1);
    num("--lambda-kl", t.lambda_kl);
    num("--lambda-ce", t.lambda_ce);
    num("--lambda-size", t.lambda_size);
    num("--select-sequences", t.select_sequences);
    if (!t.probe_file.empty()) {
        args.insert(args.end(), {"--probe-file", t.probe_file});
    }
    for (const std::string & r : t.prior_recipes) {
        args.insert(args.end(), {"--prior-recipe", r});
    }
    if (!t.compute.empty()) {
        args.insert(args.end(), {"--compute", t.compute});
    }
    args.insert(args.end(), {"--probe-compute", t.probe_compute});
    num("--size-tol", t.size_tol);
    num("--st-gumbel-fraction", t.st_gumbel_fraction);
    args.insert(args.end(), {"--routing", t.routing});
    num("--probe-sequences", t.probe_sequences);
    args.insert(args.end(), {"--probe-anchors", t.probe_anchors < 0 ? std::string("auto") : fmt::format("{}", t.probe_anchors)});
    num("--probe-auto-seconds", t.probe_auto_seconds);
    num("--gate-init", t.gate_init);
    num("--journal-every", t.journal_every);
    num("--seed", t.seed);
    num("--threads", t.threads);
    num("--loss-chunk", t.loss_chunk);
    if (t.max_token_seconds > 0) {
        args.insert(args.end(), {"--max-token-seconds", fmt::format("{:.17g}", t.max_token_seconds), "--speed-table", t.speed_table});
    }
    args.insert(args.end(), {"--device", t.device});
    if (!t.mixture.empty()) {
        args.insert(args.end(), {"--mixture", t.mixture});
    }
    args.insert(args.end(), {"--candidates-on", t.candidates_on});
    args.insert(args.end(), {"--recompute", t.recompute});
    args.insert(args.end(), {"--candidates", t.candidates});
    args.insert(args.end(), {"--build-ahead", t.build_ahead});
    args.insert(args.end(), {"--prune-stages", t.prune_stages});
    args.insert(args.end(), {"--eager-types", t.eager_types});
    for (const target & g : t.prune_goals) {
        args.insert(args.end(), {"--prune-for", g.str()});
    }
    if (t.resume) {
        args.push_back("--resume");
    }
    if (o.gpus > 1) {
        args.insert(args.end(), {"--parallel", t.parallel});
        run_ranks(args, o.gpus, (fs::path(t.run_dir) / "rank").string(),
                  fmt::format("train stage ('{} train' as {} ranks on {}, --parallel {})", exe, o.gpus, t.device, t.parallel),
                  "training stopped; run the same command again to resume");
        return;
    }
    run_child(args, fmt::format("train stage ('{} train' on {})", exe, t.device),
              "training stopped; run the same command again to resume");
}

// `exe imatrix …` on a GPU in a child process, for the reason train_in_child gives; with ranks > 1 as that many
// torchrun-style ranks (issue #17), each running a share of the chunks, or with `layers` (--parallel layers) each its
// share of the layers of every chunk's forward; rank r > 0 logging to `<out>.rank<r>.log`.
void imatrix_in_child(const std::string & exe, const imatrix_options & io, const std::string & device,
                      const std::string & out, int ranks, bool layers) {
    const std::vector<std::string> args = {exe, "imatrix", "--model", io.model, "--data", io.data_dir, "--out", out,
                                           "--chunks", fmt::format("{}", io.max_chunks), "--threads",
                                           fmt::format("{}", io.n_threads), "--device", device, "--forward", "torch",
                                           "--parallel", layers ? "layers" : "chunks"};
    if (ranks > 1) {
        run_ranks(args, ranks, out + ".rank", fmt::format("imatrix stage ('{} imatrix' as {} ranks on {})", exe, ranks, device),
                  "the imatrix stage was stopped; run the same command again");
        return;
    }
    run_child(args, fmt::format("imatrix stage ('{} imatrix' on {})", exe, device),
              "the imatrix stage was stopped; run the same command again");
}

// A mixture of experts: which experts the calibration reached, per layer, on stderr and in `json_path` (issue #18:
// users ask). An expert never routed to is quantized with importance 1, by llama-quantize and by us alike; more
// calibration text reaches more. Nothing for a dense model.
void report_expert_coverage(const std::string & imatrix_path, const std::string & json_path) {
    const std::vector<expert_coverage> coverage = imatrix_expert_coverage(read_imatrix(imatrix_path));
    if (coverage.empty()) {
        return;
    }
    int64_t n_experts = 0, n_reached = 0;
    for (const expert_coverage & c : coverage) {
        n_experts += c.n_experts;
        n_reached += c.n_reached;
    }
    fmt::print(stderr, "  experts the calibration reached ({} of {} over the {} expert tensors; each expert's tokens in {}):\n",
               n_reached, n_experts, coverage.size(), json_path);
    const std::string text = expert_coverage_text(coverage);
    for (size_t a = 0; a < text.size();) {
        const size_t e = text.find('\n', a);
        fmt::print(stderr, "    {}\n", text.substr(a, e - a));
        a = e + 1;
    }
    if (n_reached < n_experts) {
        fmt::print(stderr, "  {} experts (counted over the expert tensors) were never routed to: they are quantized without importance (weight 1), "
                           "as llama-quantize does; more calibration text (--text, --imatrix-chunks) reaches more\n",
                   n_experts - n_reached);
    }
    write_file_atomic(json_path, nlohmann::json{{"imatrix", imatrix_path}, {"experts", expert_coverage_json(coverage)}}.dump(2) + "\n");
}

// Stock recipes to compare with: every recipe llama.cpp makes for the model, or for "nearest" those that can be
// among the six nearest in size to ours (nearest_stock_recipes), duplicates by tensor types dropped; then for
// "nearest" the six nearest each of our files.
// The stock recipes pick_baselines makes for files of `our_sizes` bytes: --baselines' list, or for "nearest" those
// that can be among the six nearest (sized by llama.cpp's dry run, nothing made).
std::vector<std::string> baseline_names(const quantize_options & o, const baseline_options & bo,
                                        const std::vector<size_t> & our_sizes) {
    if (o.baselines == "none") {
        return {};
    }
    std::vector<std::string> names;
    if (o.baselines == "nearest" || o.baselines == "all-that-fit") {
        names = recipes_all_that_fit(!bo.imatrix.empty());
    } else {
        for (size_t a = 0; a <= o.baselines.size();) {
            const size_t e = std::min(o.baselines.find(',', a), o.baselines.size());
            if (e > a) {
                names.push_back(o.baselines.substr(a, e - a));
            }
            a = e + 1;
        }
    }
    if (o.baselines == "nearest") {  // only those that can be among the six nearest, sized by llama.cpp's dry run
        names = nearest_stock_recipes(bo, names, our_sizes, 6);
    }
    return names;
}

std::vector<std::string> pick_baselines(const quantize_options & o, const baseline_options & bo,
                                        const std::vector<size_t> & our_sizes, const std::string & dir,
                                        std::vector<std::pair<std::string, std::string>> & same_types) {
    if (o.baselines == "none") {
        return {};
    }
    const auto made = make_baselines(bo, baseline_names(o, bo, our_sizes), dir);
    std::vector<const baseline_result *> ok;
    for (const auto & r : made) {
        if (r.ok && r.same_types_as.empty()) {
            ok.push_back(&r);
        } else if (r.ok) {
            same_types.emplace_back(r.recipe, r.same_types_as);
        }
    }
    if (o.baselines == "nearest" && ok.size() > 6) {
        // The six nearest in size to each of our files.
        std::set<const baseline_result *> keep;
        for (size_t ours : our_sizes) {
            std::vector<const baseline_result *> by = ok;
            std::sort(by.begin(), by.end(), [&](const baseline_result * a, const baseline_result * b) {
                return std::abs(static_cast<double>(a->file_bytes) - static_cast<double>(ours)) <
                       std::abs(static_cast<double>(b->file_bytes) - static_cast<double>(ours));
            });
            keep.insert(by.begin(), by.begin() + 6);
        }
        ok.assign(keep.begin(), keep.end());
    }
    std::sort(ok.begin(), ok.end(), [](const baseline_result * a, const baseline_result * b) {
        return a->file_bytes < b->file_bytes;
    });
    std::vector<std::string> paths;
    for (const auto * r : ok) {
        paths.push_back(r->path);
    }
    return paths;
}

// The eval ahead (--eval-ahead; issue #16: "eval of the Voodoo file and the nearest stock recipes must not dominate
// the job"). While the train stage runs (in a child process, on the GPU), a thread of this process in Linux's idle
// scheduling class (SCHED_IDLE, sched(7): it runs only on cores that nothing else wants, and the threads it starts,
// libllama's and the quantizer's, inherit the class) makes the stock files the eval will likely compare with and
// scores the reference and them on the eval text, keeping the reference's logits (eval_session). The eval stage
// then stops it, and decodes what is left: our files and any chunk not reached. The numbers are the eval's own, bit
// for bit (eval_session). The speed runs (llama-bench) stay in the eval stage, on a quiet machine. A failure here
// ends the ahead quietly: the eval stage does the same work again and reports the error there.
class eval_ahead {
public:
    /// `ev`: the eval's options; `make_files`: makes (or finds) the stock files and returns their paths, checking
    /// `stopping` between files; `keep_max`: eval_session's keep_reference_max_bytes.
    /// `score` false: the stock files only, nothing scored (libllama evaluates on a GPU: the eval stage scores
    /// everything there in seconds).
    eval_ahead(const eval_options & ev,
               std::function<std::vector<std::string>(const std::atomic<bool> &, bool & made_all)> make_files,
               int64_t keep_max, bool score = true)
        : start_(std::chrono::steady_clock::now()), score_(score) {
        thread_ = std::thread([this, ev, make_files = std::move(make_files), keep_max] {
            sched_param sp{};
            sp.sched_priority = 0;
            idle_ = pthread_setschedparam(pthread_self(), SCHED_IDLE, &sp) == 0;
            try {
                if (!score_) {
                    std::vector<std::string> files = make_files(stop_, made_all_);
                    const std::lock_guard lock(mutex_);
                    files_ = files;
                    return;
                }
                auto session = std::make_unique<eval_session>(ev, keep_max);
                std::vector<std::string> files = make_files(stop_, made_all_);
                {
                    const std::lock_guard lock(mutex_);
                    files_ = files;
                }
                session_ = std::move(session);
                done_ = session_->score(files, [this] { return stop_.load(); }, false);
            } catch (const std::exception & e) {
                const std::lock_guard lock(mutex_);
                error_ = e.what();
                session_.reset();
            }
        });
    }
    ~eval_ahead() {
        stop_ = true;
        if (thread_.joinable()) {
            thread_.join();
        }
    }
    eval_ahead(const eval_ahead &) = delete;
    eval_ahead & operator=(const eval_ahead &) = delete;

    /// Stops after the decode (or stock file) in progress and hands over the session: null when it failed. `note`
    /// says what was done ahead (or why nothing).
    std::unique_ptr<eval_session> stop(std::string & note) {
        stop_ = true;
        const auto t0 = std::chrono::steady_clock::now();
        thread_.join();
        const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        const double ran = std::chrono::duration<double>(t0 - start_).count();
        if (!score_) {
            note = error_.empty()
                       ? fmt::format("in the {:.1f} s before the eval, {} stock file{} made once the train stage's candidates "
                                     "were built ({}); waited {:.1f} s for the one in progress; the eval scores them all",
                                     ran, files_.size(), files_.size() == 1 ? "" : "s",
                                     idle_ ? "at idle priority" : "at normal priority: SCHED_IDLE was refused", waited)
                       : "no stock file made ahead (it failed): the baselines stage makes them";
            return nullptr;
        }
        if (!session_) {
            // The eval meets the same error and reports it: said once, there.
            note = fmt::format("nothing kept ({}): the eval does it all", error_.empty() ? "stopped early" : "it failed");
            return nullptr;
        }
        const std::string what = files_.empty() ? "the reference"
                                                : fmt::format("the reference and {} stock file{}", files_.size(),
                                                              files_.size() == 1 ? "" : "s");
        note = fmt::format("in the {2:.1f} s before the eval, {0} {1} ({3}{4}); waited {5:.1f} s for the decode in "
                           "progress{6}", what, done_ ? "scored on every chunk" : "scored in part (the rest now)", ran,
                           idle_ ? "at idle priority" : "at normal priority: SCHED_IDLE was refused",
                           session_->keeps_reference() ? ", the reference's logits kept" : "", waited,
                           made_all_ ? "" : "; stock files not made ahead: beside the candidates the run built and its own "
                                            "files they would not fit on the disk");
        return std::move(session_);
    }

private:
    std::atomic<bool> stop_{false};
    std::chrono::steady_clock::time_point start_;
    std::mutex mutex_;
    std::vector<std::string> files_;
    std::string error_;
    std::unique_ptr<eval_session> session_;
    bool done_ = false;
    bool idle_ = false;
    bool made_all_ = true;  // false when make_files found no room on the disk for the stock files
    bool score_ = true;     // false: the stock files only
    std::thread thread_;
};

// One size of a ladder: its target and the label its run folder and file carry.
struct rung {
    std::string label;      // "Q4_K_M" (--like), "size-304352", "ratio-0.45", "bpw-4.5"
    target goal;
    double order;           // sorts the rungs by increasing budget
    std::map<std::string, ggml_type> stock_types;   // --like: the stock file's type for every tensor
    std::string stock_path;                         // --like: where the stock file is (or will be) made
    bool planned = false;   // --like: sized by llama.cpp's dry run (plan_stock_file), the file not made yet
};

std::string goal_label(const target & g) {
    switch (g.kind) {
        case target_kind::bpw: return fmt::format("bpw-{}", g.value);
        case target_kind::size: return fmt::format("size-{:.0f}", g.value);
        case target_kind::ratio: return fmt::format("ratio-{}", g.value);
    }
    return "";
}

// The targets by increasing budget: the stock files' sizes for --like, else the goals. A stock file not made yet is
// sized by llama.cpp's dry run (plan_stock_file: to the byte, nothing quantized); it is made, when the eval compares
// with it, by the eval ahead or the baselines stage (issue #16: making it first cost 14.6 s of 16 cores at the
// Qwen3-1.7B shape, ≈ 70 s at Llama-3.1-8B's, before any other work could start).
std::vector<rung> plan_rungs(const quantize_options & o, const baseline_options & bo, const std::string & base_dir) {
    std::vector<rung> rungs;
    if (!o.like.empty()) {
        for (size_t a = 0; a <= o.like.size();) {
            const size_t e = std::min(o.like.find(',', a), o.like.size());
            std::string name = o.like.substr(a, e - a);
            a = e + 1;
            name.erase(0, name.find_first_not_of(" \t"));
            name.erase(name.find_last_not_of(" \t") + 1);
            if (name.empty()) {
                continue;
            }
            const std::string like_path =
                (fs::path(base_dir) / fmt::format("{}-{}.gguf", fs::path(o.model).stem().string(), name)).string();
            rung g{name, {}, 0, {}, like_path, !fs::exists(like_path)};
            size_t bytes = 0;
            if (g.planned) {
                stock_plan plan = plan_stock_file(bo, name);
                bytes = plan.file_bytes;
                g.stock_types = std::move(plan.types);
                stage("target", fmt::format("the size of stock {}: {} bytes (llama.cpp's dry run: its type for every tensor, "
                                            "nothing quantized; the file itself is made for the eval)", name, bytes));
            } else {
                bytes = file_size(like_path);
                const gguf_file stock(like_path);
                for (const gguf_tensor & x : stock.tensors()) {
                    g.stock_types[x.name] = x.type;
                }
                stage("target", fmt::format("the size of stock {}: {} bytes ({})", name, bytes, like_path));
            }
            g.goal = {target_kind::size, static_cast<double>(bytes)};
            g.order = static_cast<double>(bytes);
            rungs.push_back(std::move(g));
        }
    } else {
        const std::vector<target> goals = o.goals.empty() ? std::vector<target>{o.train.goal} : o.goals;
        for (const target & g : goals) {
            rungs.push_back({goal_label(g), g, g.value, {}, {}, false});
        }
    }
    if (rungs.empty()) {
        fail("--like '{}': no recipe name; give one or a comma list such as Q3_K_M,Q4_K_M,Q6_K", o.like);
    }
    std::stable_sort(rungs.begin(), rungs.end(), [](const rung & a, const rung & b) { return a.order < b.order; });
    // Stock recipes of the same size (llama.cpp's fallbacks on small models) are one target: the first name.
    rungs.erase(std::unique(rungs.begin(), rungs.end(),
                            [](const rung & a, const rung & b) {
                                if (a.order == b.order) {
                                    stage("target", fmt::format("{} is the same size as {}: one file for both", b.label, a.label));
                                }
                                return a.order == b.order;
                            }),
                rungs.end());
    return rungs;
}

// Exports the recipe at `recipe_path` to `out` unless `out` already holds that recipe made with this imatrix
// (the run folder's exports.json records each file it exported: recipe hash, imatrix digest, bytes).
void export_recipe_file(const gguf_file & src, const std::string & recipe_path, const std::string & out,
                        const train_options & t, const std::string & imatrix_digest) {
    const recipe r = recipe_load(recipe_path);
    const std::string record_path = (fs::path(recipe_path).parent_path() / "exports.json").string();
    nlohmann::json records = nlohmann::json::object();
    if (std::ifstream in(record_path); in) {
        records = nlohmann::json::parse(in, nullptr, false);
        if (!records.is_object()) {
            records = nlohmann::json::object();
        }
    }
    const std::string key = fs::absolute(out).lexically_normal().string();
    nlohmann::json made = {{"recipe_hash", recipe_hash(r)}, {"imatrix", imatrix_digest}};
    if (fs::exists(out) && records.contains(key)) {
        nlohmann::json was = records[key];
        const size_t bytes = was.value("bytes", size_t{0});
        was.erase("bytes");
        if (was == made && bytes == file_size(out) &&
            gguf_file(out).get_string("voodoo.recipe_hash").value_or("") == recipe_hash(r)) {
            stage("export", out + " (done)");
            return;
        }
    }
    stage("export", out);
    export_options eo = t.export_opts;
    eo.target = r.target;
    candidate_cache cache(t.cache_dir);
    // The recipe's candidates the train stage built in memory only (a disk without room for them all) are made again
    // here; the cache keeps them only where the file this writes still fits beside the reserve.
    int64_t file_bytes = 0;
    for (const auto & rt : r.tensors) {
        file_bytes += static_cast<int64_t>(rt.bytes);
    }
    cache.set_keep_free(k_disk_reserve_bytes + file_bytes);
    eo.cache = &cache;
    export_gguf(src, r, out, eo);
    made["bytes"] = file_size(out);
    records[key] = made;
    write_file_atomic(record_path, records.dump(2) + "\n");
}

// What decides the eval stage's table (its record, eval.stage.json): the reference and every scored file by path, size
// and modification time (a file made again has a new one), the text's digest, the resolved chunk, context and speed
// options, the threads of the speed runs, and the GPUs libllama computes on (the speed columns are this machine's). A
// re-run of a finished job with the same record, and an eval.json with the digest it recorded, reads eval.json instead
// of scoring again (minutes on the CPU).
nlohmann::json eval_inputs(const eval_options & ev, const std::vector<std::string> & files) {
    auto identity = [](const std::string & path) {
        std::error_code ec;
        const auto t = fs::last_write_time(path, ec);
        const int64_t ns = ec ? 0 : std::chrono::duration_cast<std::chrono::nanoseconds>(
                                        std::chrono::file_clock::to_sys(t).time_since_epoch()).count();
        return nlohmann::json{{"path", fs::absolute(path).lexically_normal().string()}, {"bytes", file_size(path)},
                              {"mtime_ns", ns}};
    };
    nlohmann::json scored = nlohmann::json::array();
    for (const std::string & f : files) {
        scored.push_back(identity(f));
    }
    return {{"reference", identity(ev.reference)}, {"text", file_digest(ev.text)}, {"ctx", ev.n_ctx},
            {"chunks", ev.n_chunks}, {"speed_reps", ev.speed_reps}, {"reference_speed", ev.reference_speed},
            {"files", scored}, {"gpus", llama_gpu_devices()},
            {"speed_threads", ev.speed_reps > 0 ? (ev.n_threads > 0 ? ev.n_threads : static_cast<int>(std::thread::hardware_concurrency())) : 0}};
}

// What decides a run's recipe: every input's digest and every option of the training and the final selection
// (not where or how fast it runs: device, mixture path, threads, loss chunk, journal cadence).
nlohmann::json run_inputs(const train_options & t, const std::string & model, const std::string & data,
                          const std::string & imatrix) {
    nlohmann::json menus = nlohmann::json::array();
    menus.push_back(types_list(t.menu.types));
    for (const auto & [regex, types] : t.menu.per_role) {
        menus.push_back(regex + "=" + types_list(types));
    }
    nlohmann::json priors = nlohmann::json::array();
    for (const std::string & p : t.prior_recipes) {
        priors.push_back(recipe_hash(recipe_load(p)));
    }
    nlohmann::json in = {{"model", model}, {"data", data}, {"imatrix", imatrix}, {"target", t.goal.str()}, {"menus", menus},
            {"steps", t.steps}, {"batch", t.batch}, {"accum", t.accum}, {"seq", t.seq}, {"lr", t.lr},
            {"lr_final", t.lr_final}, {"weight_decay", t.weight_decay}, {"tau0", t.tau0}, {"tau1", t.tau1},
            {"lambda_kl", t.lambda_kl}, {"lambda_ce", t.lambda_ce}, {"lambda_size", t.lambda_size},
            {"size_tol", t.size_tol}, {"st_gumbel_fraction", t.st_gumbel_fraction}, {"routing", t.routing}, {"gate_init", t.gate_init},
            {"probe_sequences", t.probe_sequences}, {"probe_anchors", t.probe_anchors},
            {"probe_compute", resolved_probe_compute(t.probe_compute, t.device)}, {"compute", t.compute}, {"select_sequences", t.select_sequences},
            {"seed", t.seed}, {"smaller_sizes", priors}};
    if (t.candidates != "all") {  // only when pruning: earlier work folders (every candidate built) stay valid
        nlohmann::json goals = nlohmann::json::array();
        for (const target & g : t.prune_goals) {
            goals.push_back(g.str());
        }
        in["candidates"] = {{"for", goals}, {"eager", t.eager_types}};  // session 37: "cheap" (before: "fast")
        if (resolved_prune_stages(t.prune_stages, t.device) == 2) {
            in["candidates"]["stages"] = 2;  // only then: earlier work folders (one stage) stay valid
            in["candidates"]["band"] = "from the staged errors";  // session 38 (prune.h stage_band_margin): before, 1/3-3
        }
    }
    if (t.max_token_seconds > 0) {
        in["max_token_seconds"] = t.max_token_seconds;  // only when set: earlier work folders stay valid
    }
    if (t.menu.types.empty()) {  // the default menu's rule (session 36: the fallback types only where they must be)
        in["default_menu"] = t.menu.with_fallbacks ? "all" : "fallback types where no 256-block type fits";
    }
    return in;
}

// The train and export stages of one target; returns the exported file. `label`: the rung's name (its run
// folder is WORK/run-<label>; in a ladder its file is named <model>.Voodoo<NN>.<label>.gguf, in --out when that
// is a folder). A run folder made with other inputs or options is made again.
std::string train_and_export(const quantize_options & o, train_options & t, const gguf_file & src,
                             const token_data & data, const importance_map & importance,
                             const std::string & imatrix_path, const std::string & work, const std::string & label,
                             bool ladder, const nlohmann::json & inputs) {
    const std::string recipe_path = (fs::path(t.run_dir) / "recipe.json").string();
    const std::string record = (fs::path(t.run_dir) / "stage.json").string();
    const std::string changed = fs::exists(t.run_dir) ? stage_changes(record, inputs) : "";
    if (!changed.empty()) {
        stage("train", fmt::format("{}: made again ({})", t.run_dir, changed));
        if (!remove_tree(t.run_dir)) {
            fail("cannot remove the old run folder '{}'; remove it by hand", t.run_dir);
        }
    }
    if (!fs::exists(recipe_path)) {
        fs::create_directories(t.run_dir);
        stage_save(record, inputs);
        t.resume = fs::exists(fs::path(t.run_dir) / "journal.pt");
        stage("train", t.run_dir + (t.resume ? " (resuming)" : ""));
        if (!o.train_exe.empty()) {
            train_in_child(o.train_exe, o, t, data.dir(), imatrix_path);
        } else {
            const train_result tr = train_gates(src, src, data.train(), &importance, t, &data.val());
            if (!tr.finished) {
                throw stopped(fmt::format("training stopped after step {}; run the same command again to resume", tr.steps_done));
            }
            fmt::print(stderr, "{}", tr.summary);
        }
    } else {
        stage("train", recipe_path + " (done)");
    }
    const recipe r = recipe_load(recipe_path);

    export_options eo = t.export_opts;
    eo.target = r.target;
    const double ratio = static_cast<double>(planned_file_bytes(src, r, eo)) /
                         static_cast<double>(q8_0_file_bytes(src, eo));
    const std::string folder = !o.out_dir.empty() ? o.out_dir : work;
    std::string out = o.out.empty() ? default_output_path(folder, src, ratio) : o.out;
    if (!o.out_dir.empty()) {
        fs::create_directories(o.out_dir);
    }
    // <model>.Voodoo<NN>.<label>.gguf: a ladder's files, and a target whose plain name another target's file holds.
    const auto with_label = [&label](const std::string & path) { return path.substr(0, path.size() - 5) + "." + label + ".gguf"; };
    if (ladder) {
        const std::string dir = !o.out_dir.empty() ? o.out_dir : o.out.empty() ? work : o.out;
        fs::create_directories(dir);
        out = with_label(default_output_path(dir, src, ratio));
    } else if (o.out.empty() && fs::exists(out)) {
        // Two targets of one work folder can round to the same Voodoo<NN> name (stories260K's Q4_K_M and Q5_0 sizes):
        // the file of another target is kept, and this one takes its label, as a ladder's files do. The same target's
        // file (a run made again) is replaced.
        std::string other;
        try {
            other = gguf_file(out).get_string("voodoo.target").value_or("");
        } catch (const std::exception &) {
            other.clear();  // not a file this reads: replaced, as before
        }
        if (!other.empty() && other != r.target) {
            const std::string labelled = with_label(out);
            fmt::print(stderr, "voodoo: note: '{}' holds another target's file ({}); this target's ({}) is '{}'\n", out,
                       other, r.target, labelled);
            out = labelled;
        }
    }
    export_recipe_file(src, recipe_path, out, t, inputs["imatrix"].get<std::string>());
    return out;
}

// The model card (export/model_card.h) beside the files, with what it points to: each file's
// llama-quantize --tensor-type-file (<file>.tensor-types.txt), the imatrix and the comparison plot, copied into the
// files' folder when it is not the work folder. Returns the card's path.
std::string write_model_card(const quantize_options & o, const gguf_file & src, const quantize_result & res,
                             const std::vector<std::string> & recipe_paths, const std::string & imatrix_path,
                             const std::string & work) {
    const fs::path folder = fs::absolute(res.out).parent_path();
    const bool in_work = same_file(folder.string(), fs::absolute(work).string());
    auto copy_file = [](const std::string & from, const std::string & to) {
        if (!same_file(from, to)) {
            const mapped_file m(from);
            write_file_atomic(to, m.bytes());
        }
    };
    auto copy_beside = [&](const std::string & from, const std::string & name) {
        const std::string to = (folder / name).string();
        copy_file(from, to);
        return to;
    };
    model_card_input in;
    in.source = o.model;
    in.command = o.command;
    const std::string stem = fs::path(o.model).stem().string();
    in.imatrix = in_work ? imatrix_path : copy_beside(imatrix_path, stem + ".imatrix.gguf");
    for (size_t i = 0; i < res.outs.size(); ++i) {
        const std::string & gguf = res.outs[i];
        const std::string types = fs::path(gguf).replace_extension(".tensor-types.txt").string();
        copy_file((fs::path(recipe_paths[i]).parent_path() / "recipe.tensor-types.txt").string(), types);
        in.files.push_back({gguf, types, recipe_load(recipe_paths[i])});
    }
    if (!res.eval.files.empty()) {
        in.eval = &res.eval;
        const fs::path plot = fs::path(work) / "eval.png";
        if (fs::exists(plot)) {
            in.plot = in_work ? "eval.png" : fs::path(copy_beside(plot.string(), stem + ".eval.png")).filename().string();
        }
    }
    const std::string path = model_card_path(folder.string(), res.outs.front());
    write_file_atomic(path, model_card_markdown(src, in));
    stage("card", path);
    return path;
}

}  // namespace

namespace {

// The dry run's inputs from the quantize options, reading only what exists in WORK (a finished imatrix, stock
// files already made) and making nothing.
nlohmann::json dry_run_of(const quantize_options & o, const gguf_file & src, const std::string & work) {
    dry_run_input in;
    in.src = &src;
    in.train = o.train;
    if (o.greedy_peer) {
        in.train.candidates = "all";  // as the run does: the greedy peer measures every candidate
    }
    in.train.menu.has_imatrix = true;
    in.train.threads = o.threads;
    in.ggml_threads = o.ggml_threads;
    in.ranks = std::max(1, o.gpus);
    in.cache_dir = (fs::path(work) / "candidates").string();
    in.ctx = o.ctx;
    for (const std::string & t : o.texts) {
        in.text_bytes += static_cast<int64_t>(file_size(t));
    }
    const std::string made = (fs::path(work) / "imatrix.gguf").string();
    in.imatrix = !o.imatrix.empty() ? o.imatrix : (fs::exists(made) ? made : "");
    in.planned_imatrix_file = made;
    in.planned_imatrix_dataset = o.texts.empty() ? "" : o.texts.front();
    if (o.imatrix.empty() && in.imatrix.empty()) {
        // About 4 bytes of English text per token; 10% goes to the validation split.
        const int64_t chunks = std::max<int64_t>(1, in.text_bytes / 4 / std::max<int64_t>(1, o.ctx) * 9 / 10);
        in.imatrix_chunks = o.imatrix_chunks < 0 ? chunks : std::min<int64_t>(o.imatrix_chunks, chunks);
    }
    if (o.like.empty()) {
        in.goals = o.goals.empty() ? std::vector<target>{o.train.goal} : o.goals;
    } else {
        for (const std::string & name : comma_list(o.like)) {
            // The stock file's size: the file's when made, else llama.cpp's dry run once the imatrix it is made with
            // is known (plan_stock_file, as the run sizes it), else not known yet.
            const fs::path stock = fs::path(work) / "baselines" / fmt::format("{}-{}.gguf", fs::path(o.model).stem().string(), name);
            double bytes = 0;
            if (fs::exists(stock)) {
                bytes = static_cast<double>(file_size(stock.string()));
            } else if (!in.imatrix.empty()) {
                baseline_options bo;
                bo.source = o.model;
                bo.allow_requantize = o.allow_requantize;
                bo.imatrix = in.imatrix;
                bytes = static_cast<double>(plan_stock_file(bo, name).file_bytes);
            }
            in.like_sizes.emplace_back(name, bytes);
        }
    }
    // The stock files a run makes, all for its eval stage (a --like target's is sized without making it): for
    // "all-that-fit" every recipe that fits, for "nearest" those that can be among the six nearest each file
    // (pick_baselines), for a list its names. Those not made yet are named (the disk figure estimates their bytes).
    int64_t distinct_all = 0;  // the recipes that fit whose files the eval scores (distinct_stock_recipes), when needed
    {
        std::vector<std::string> names;
        if (o.eval_chunks != 0 && (o.baselines == "nearest" || o.baselines == "all-that-fit")) {
            std::vector<std::string> all = recipes_all_that_fit(true);
            // Every recipe's file is made, but those that plan the same tensor types as an earlier one are scored once
            // (make_baselines' same_types_as): on a small model llama.cpp's fallbacks make many recipes one file.
            baseline_options dbo;
            dbo.source = o.model;
            dbo.allow_requantize = o.allow_requantize;
            dbo.imatrix = in.imatrix;
            distinct_all = static_cast<int64_t>(distinct_stock_recipes(dbo, all, true).size());
            if (o.baselines == "nearest") {  // as pick_baselines chooses them, for our sizes as estimated here
                std::vector<size_t> ours;
                double weights = 0;
                for (const gguf_tensor & t : src.tensors()) {
                    weights += static_cast<double>(t.n_elements());
                }
                for (const auto & [name, bytes] : in.like_sizes) {
                    ours.push_back(static_cast<size_t>(bytes > 0 ? bytes : estimate_stock_bytes(src, recipe_by_name(name))));
                }
                for (const target & g : in.goals) {
                    ours.push_back(static_cast<size_t>(
                        g.kind == target_kind::size  ? g.value
                        : g.kind == target_kind::bpw ? g.value * weights / 8
                                                     : g.value * estimate_stock_bytes(src, recipe_by_name("Q8_0"))));
                }
                baseline_options bo;
                bo.source = o.model;
                bo.allow_requantize = o.allow_requantize;
                all = nearest_stock_recipes(bo, all, ours, 6);
            }
            names.insert(names.end(), all.begin(), all.end());
        } else if (o.eval_chunks != 0 && o.baselines != "none") {
            const std::vector<std::string> listed = comma_list(o.baselines);
            names.insert(names.end(), listed.begin(), listed.end());
        }
        std::set<std::string> seen;
        for (const std::string & name : names) {
            const std::string up = recipe_by_name(name).name;
            const fs::path stock = fs::path(work) / "baselines" / fmt::format("{}-{}.gguf", fs::path(o.model).stem().string(), up);
            if (seen.insert(up).second && !fs::exists(stock)) {
                in.stock_recipes.push_back(up);
            }
        }
        in.stock_files = static_cast<int64_t>(seen.size());
    }
    if (o.eval_chunks != 0) {
        const int64_t outs = static_cast<int64_t>(in.goals.size() + in.like_sizes.size());
        int64_t stock = 0;
        if (o.baselines == "nearest") {
            stock = std::min(6 * outs, distinct_all);
        } else if (o.baselines == "all-that-fit") {
            stock = distinct_all;
        } else if (o.baselines != "none") {
            stock = static_cast<int64_t>(comma_list(o.baselines).size());
        }
        in.eval_files = outs * (o.greedy_peer ? 2 : 1) + stock;
        const std::string eval_text = o.eval_text.empty() ? o.texts.front() : o.eval_text;
        const int64_t all = static_cast<int64_t>(file_size(eval_text)) / 4;
        in.eval_tokens_per_file = o.eval_chunks < 0 ? all : std::min<int64_t>(all, static_cast<int64_t>(o.eval_chunks) * o.eval_ctx);
        in.eval_speed_reps = o.speed_reps;
        in.eval_reference_speed = o.reference_speed;
    }
    nlohmann::json plan = plan_dry_run(in);
    // The targets WORK has already trained (run-<label>/recipe.json): a run whose inputs are unchanged reuses them and
    // every stage before them, so the stage estimates (for a run from the start) are an upper bound there.
    std::vector<std::string> labels;
    if (!o.like.empty()) {
        labels = comma_list(o.like);
    } else {
        for (const target & g : in.goals) {
            labels.push_back(goal_label(g));
        }
    }
    nlohmann::json finished = nlohmann::json::array();
    for (const std::string & label : labels) {
        const fs::path recipe = fs::path(work) / ("run-" + label) / "recipe.json";
        if (fs::exists(recipe)) {
            finished.push_back(recipe.string());
        }
    }
    if (!finished.empty()) {
        plan["finished_runs"] = finished;
    }
    return plan;
}

}  // namespace

bool apply_eval_defaults(quantize_options & o, int64_t n_weights) {
    const double scale = 0.5e9 / static_cast<double>(std::max<int64_t>(1, n_weights));
    bool changed = false;
    if (o.eval_chunks == -2) {
        o.eval_chunks = static_cast<int>(std::clamp(std::round(40 * scale), 8.0, 40.0));
        changed = true;
    }
    if (o.speed_reps < 0) {
        o.speed_reps = static_cast<int>(std::clamp(std::round(5 * scale), 1.0, 5.0));
        o.reference_speed = scale >= 1;
        changed = true;
    }
    return changed;
}

int ggml_threads_for(int64_t n_weights) {
    return n_weights < 8'000'000 ? 1 : resolve_threads(0);
}

void check_full_precision_source(const gguf_file & src, bool allow_requantize) {
    size_t n_quantized = 0;
    const gguf_tensor * first_quantized = nullptr;
    for (const gguf_tensor & t : src.tensors()) {
        if (tensor_is_selectable(t.name, t.n_dims) && type_info_of(t.type).is_quantized) {
            first_quantized = first_quantized ? first_quantized : &t;
            ++n_quantized;
        }
    }
    if (first_quantized && !allow_requantize) {
        fail("'{}' is already quantized ({} is {}): Voodoo quantizes from the full-precision model (F32, F16 or "
             "BF16), which is also its teacher; convert the original checkpoint (convert_hf_to_gguf.py --outtype "
             "bf16) and give that, or pass --allow-requantize (as llama-quantize has it) to quantize this file anyway",
             src.path(), first_quantized->name, type_name(first_quantized->type));
    }
    if (first_quantized) {
        fmt::print(stderr,
                   "voodoo: warning: requantizing '{}': {} tensors are already quantized ({} is {}). Candidates are "
                   "made from their dequantized values, and this file is also the teacher, so every KLD is measured "
                   "against it, not against the original model; no file can be better than it.\n",
                   src.path(), n_quantized, first_quantized->name, type_name(first_quantized->type));
    }
}

eval_options eval_options_of(const quantize_options & o) {
    eval_options ev;
    ev.reference = o.model;
    ev.text = o.eval_text.empty() ? o.texts.front() : o.eval_text;
    ev.n_ctx = o.eval_ctx;
    ev.n_chunks = o.eval_chunks;
    ev.n_threads = o.ggml_threads;
    ev.speed_reps = o.speed_reps;
    ev.reference_speed = o.reference_speed;
    ev.ctx_flag = "--eval-ctx";
    ev.chunks_flag = "--eval-chunks";
    return ev;
}

namespace {

// A folder the job will make or write in (`flag`'s, e.g. --work): checked before anything is made, dry run included,
// so that a path under a regular file or in a folder this user cannot write fails now, naming the flag, and not at
// the stage that first writes there (the export, after the whole training). Nothing is left here (a file made in
// the nearest existing folder and removed: cannot_create_files_in).
void check_folder_can_be_written(const std::string & dir, const char * flag) {
    std::error_code ec;  // a folder this user cannot look in reads as missing here, and fails the check below
    fs::path p = fs::absolute(dir);
    while (!p.empty() && !fs::exists(p, ec) && p != p.root_path()) {
        p = p.parent_path();
    }
    if (fs::exists(p, ec) && !fs::is_directory(p, ec)) {
        fail("{} '{}' cannot be made: '{}' is a file, not a folder; give {} a folder path", flag, dir, p.string(), flag);
    }
    if (const int err = cannot_create_files_in(p.string()); err != 0) {
        fail("{} '{}': this user cannot write in '{}' ({}); give {} a folder this user can write in", flag, dir,
             p.string(), std::strerror(err), flag);
    }
}

}  // namespace

void check_quantize_options(const quantize_options & o, const gguf_file & src) {
    auto at_least = [](const char * flag, int64_t v, int64_t min, const char * what) {
        if (v < min) {
            fail("{} {}: {}", flag, v, what);
        }
    };
    if (o.texts.empty()) {
        fail("give at least one calibration text (--text)");
    }
    for (const std::string & t : o.texts) {
        if (file_size(t) == 0) {
            fail("--text '{}' is empty; give a UTF-8 text file (a few hundred KB or more)", t);
        }
    }
    if (!o.eval_text.empty()) {
        file_size(o.eval_text);
    }
    if (!o.out.empty() && same_file(o.out, src.path())) {  // export refuses it too, but only after the whole job
        fail("--out '{}' is the source model: Voodoo never writes over its source; give another path (or none: "
             "WORK/<model>.Voodoo<NN>.gguf)", o.out);
    }
    at_least("--ctx", o.ctx, 16,
             "expected at least 16 tokens per chunk, what the imatrix needs (llama-perplexity's 512 is the usual)");
    if (o.imatrix_chunks == 0 || o.imatrix_chunks < -1) {
        fail("--imatrix-chunks {}: expected a positive number of chunks, or -1 for all", o.imatrix_chunks);
    }
    at_least("--eval-ctx", o.eval_ctx, 16, "expected at least 16 tokens per chunk (512 is the usual)");
    at_least("--eval-chunks", o.eval_chunks, -2, "expected a number of chunks, -1 for all, 0 for no eval stage or auto");
    at_least("--speed-reps", o.speed_reps, -1, "expected a number of runs, 0 for no speed columns or auto");
    at_least("--threads", o.threads, 0, "expected a number of threads, or 0 for every core");
    at_least("--ggml-threads", o.ggml_threads, 0, "expected a number of threads, or 0 to choose by model size");
    at_least("--steps", o.train.steps, 0, "expected a number of steps (0: no training, the probe's recipe)");
    at_least("--batch", o.train.batch, 1, "expected at least one sequence per step");
    at_least("--seq", o.train.seq, 0, "expected tokens per sequence, or 0 for --ctx");
    at_least("--probe-sequences", o.train.probe_sequences, 1, "expected at least one sequence");
    at_least("--probe-anchors", o.train.probe_anchors, -1, "expected a number of types, 0 to measure every type, or auto");
    at_least("--select-sequences", o.train.select_sequences, 1, "expected at least one sequence");
    at_least("--loss-chunk", o.train.loss_chunk, 0, "expected positions per chunk, or 0 to choose by device");
    parse_routing(o.train.routing);
    if (!(o.train.lambda_size >= 0) || !(o.train.size_tol >= 0)) {
        fail("--lambda-size {} and --size-tol {}: expected finite numbers ≥ 0", o.train.lambda_size, o.train.size_tol);
    }
    if (!(o.train.tau0 > 0) || !(o.train.tau1 > 0)) {
        fail("--tau0 {} and --tau1 {}: the temperatures must be positive (1 → 0.01 is the default)", o.train.tau0,
             o.train.tau1);
    }
    check_device_name(o.train.device);
    if (o.train.device == "cpu" && o.train.mixture == "fused") {
        fail("--mixture fused runs on a CUDA device; pass --device cuda (a CUDA build), or --mixture cpu");
    }

    check_full_precision_source(src, o.allow_requantize);

    // Recipe names.
    const auto recipe_of_flag = [](const char * flag, const std::string & name) {
        try {
            recipe_by_name(name);
        } catch (const voodoo::error & e) {
            fail("{}: {}", flag, e.what());
        }
    };
    for (const std::string & name : comma_list(o.like)) {
        recipe_of_flag("--like", name);
    }
    if (o.baselines != "nearest" && o.baselines != "all-that-fit" && o.baselines != "none") {
        const auto names = comma_list(o.baselines);
        if (names.empty()) {
            fail("--baselines '{}': give nearest, all-that-fit, none or a comma list of recipe names", o.baselines);
        }
        for (const std::string & name : names) {
            recipe_of_flag("--baselines", name);
        }
    }
    if (!o.like.empty() && comma_list(o.like).empty()) {
        fail("--like '{}': no recipe name; give one or a comma list such as Q3_K_M,Q4_K_M,Q6_K", o.like);
    }
    const size_t n_targets = !o.like.empty() ? comma_list(o.like).size() : std::max<size_t>(1, o.goals.size());
    if (n_targets > 1 && !o.out.empty() && o.out.ends_with(".gguf")) {
        fail("--out '{}' names one file, but {} targets make {} files: give --out-dir FOLDER, or one target", o.out,
             n_targets, n_targets);
    }
    if (!o.out.empty() && !o.out_dir.empty()) {
        fail("--out '{}' and --out-dir '{}': give one (--out for one file, --out-dir for the folder of the files)",
             o.out, o.out_dir);
    }
    if (!o.out_dir.empty() && fs::exists(o.out_dir) && !fs::is_directory(o.out_dir)) {
        fail("--out-dir '{}' is a file; give a folder (it is made when missing)", o.out_dir);
    }
    // Where the job writes: every path checked now, not at the stage that first writes there.
    check_folder_can_be_written(o.work.empty() ? default_work_folder(o.model) : o.work, "--work");
    if (!o.out_dir.empty()) {
        check_folder_can_be_written(o.out_dir, "--out-dir");
    }
    if (!o.out.empty()) {
        std::error_code ec;  // a folder this user cannot look in: access() below says so
        const fs::path out = fs::absolute(o.out);
        if (fs::is_directory(out, ec)) {
            check_folder_can_be_written(o.out, "--out");
        } else if (fs::exists(out.parent_path(), ec) && !fs::is_directory(out.parent_path(), ec)) {
            fail("--out '{}': '{}' is a file, not a folder; give --out a path in a folder", o.out, out.parent_path().string());
        } else if (::access(out.parent_path().c_str(), F_OK) != 0 && errno == ENOENT) {
            fail("--out '{}': its folder '{}' does not exist; make it first, or give --out a path in an existing folder",
                 o.out, out.parent_path().string());
        } else if (const int err = cannot_create_files_in(out.parent_path().string()); err != 0) {
            fail("--out '{}': this user cannot write in '{}' ({}); give --out a path in a folder this user can write in",
                 o.out, out.parent_path().string(), std::strerror(err));
        }
    }

    // Menus (an imatrix will be there: made by the imatrix stage or given), and every target against them.
    menu_options m = o.train.menu;
    m.has_imatrix = true;
    const std::vector<tensor_menu> menus = build_menus(src, m);
    std::set<std::string> chosen;
    for (const tensor_menu & tm : menus) {
        chosen.insert(tm.tensor->name);
    }
    std::string kept;
    size_t kept_bytes = 0, n_kept = 0;
    for (const gguf_tensor & t : src.tensors()) {
        if (tensor_is_selectable(t.name, t.n_dims) && !chosen.count(t.name)) {
            ++n_kept;
            kept_bytes += t.n_bytes;
            if (n_kept <= 4) {
                kept += fmt::format("{}{} ({} bytes)", kept.empty() ? "" : ", ", t.name, t.n_bytes);
            }
        }
    }
    if (n_kept > 0) {
        fmt::print(stderr,
                   "voodoo: warning: {} tensor{} of '{}' fit{} no type of the menu and keep{} the source type, {} bytes "
                   "in all: {}{}; add F16 or BF16 to --menu to let them shrink\n",
                   n_kept, n_kept == 1 ? "" : "s", src.path(), n_kept == 1 ? "s" : "", n_kept == 1 ? "s" : "",
                   kept_bytes, kept, n_kept > 4 ? ", …" : "");
    }
    std::optional<imatrix> given;
    if (!o.imatrix.empty()) {
        given = read_imatrix(o.imatrix);
        require_imatrix_fits(*given, src, o.imatrix);
    }
    if (o.like.empty() && !o.dry_run) {  // a dry run reports each target's feasibility instead
        // The file's size counts the quantize.imatrix.* keys the export will write (imatrix_export_options): the path
        // recorded (WORK/imatrix.gguf, or the given file), the first dataset (the given imatrix's, or the first --text,
        // which the data stage records and the imatrix stage copies) and the chunk count (an integer of fixed size).
        // So a target at the very edge of the range is judged here as after the imatrix stage (checked again there).
        export_options eo = planned_imatrix_export_options(
            given ? o.imatrix : (fs::path(o.work.empty() ? default_work_folder(o.model) : o.work) / "imatrix.gguf").string(),
            given ? (given->datasets.empty() ? "" : given->datasets.front()) : (o.texts.empty() ? "" : o.texts.front()));
        for (const target & g : o.goals.empty() ? std::vector<target>{o.train.goal} : o.goals) {
            eo.target = g.str();
            make_budget(src, menus, g, eo);
        }
    }

    // The eval stage's text and context, with the source's vocabulary (no weights read): a bad --eval-text or
    // --eval-ctx is found now, not after the train stage.
    if (o.eval_chunks != 0) {
        try {
            check_eval_text(eval_options_of(o));
        } catch (const error & e) {
            fail("{}: {}", o.eval_text.empty() ? "the eval stage, on the first --text (no --eval-text given)"
                                               : "the eval stage (--eval-text)", e.what());
        }
    }
}

// The memory this process may use: the machine's, or less where an address-space limit (ulimit -v) or the cgroup's
// memory.max (a container's limit, cgroup v2) says so.
int64_t memory_limit_bytes() {
    int64_t limit = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<int64_t>(sysconf(_SC_PAGE_SIZE));
    if (rlimit rl{}; getrlimit(RLIMIT_AS, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
        limit = std::min(limit, static_cast<int64_t>(rl.rlim_cur));
    }
    if (std::ifstream in("/sys/fs/cgroup/memory.max"); in) {
        std::string v;
        in >> v;
        if (!v.empty() && v != "max") {
            try {
                limit = std::min(limit, static_cast<int64_t>(std::stoll(v)));
            } catch (const std::exception &) {
            }
        }
    }
    return limit;
}

// What the eval ahead does: nothing, the stock files only, or the stock files and the scoring.
enum class ahead_mode { none, files, score };

ahead_mode eval_ahead_mode(const quantize_options & o) {
    if (o.eval_chunks == 0 || o.eval_ahead == "off") {
        return ahead_mode::none;
    }
    // auto: on when the train stage runs on a GPU and the host has at least 8 cores. The A/B on one H100 machine
    // (16 cores, the Qwen3-1.7B shape, docs/BENCHMARKS.md, session 27): 425.0 s off, 413.2 s on (train +8.0 s,
    // eval -20.9 s, the same file). On the CPU device it loses: on the 2-core machine an idle-class thread beside
    // in-process training slowed it 2-3x (Linux's idle class did not keep it off the cores the quantizers use).
    // When libllama has a GPU (a backend from GGML_BACKEND_PATH, e.g. llama.cpp's CUDA one) the eval stage scores
    // there in seconds (7.6 s against 41.7 on 16 cores at the 1.7B shape, session 31), and the ahead only makes the
    // stock files, once the train stage's candidates are built: its training steps leave the cores idle (≈ 40 s at
    // 1.7B, ≈ 4.6 min at 8B), where its scoring on the CPU slowed the candidates (train +32 s, session 31).
    if (o.eval_ahead == "auto") {
        if (o.train.device == "cpu" || resolve_threads(0) < 8) {
            return ahead_mode::none;
        }
        if (!llama_gpu_devices().empty()) {
            return o.baselines == "none" ? ahead_mode::none : ahead_mode::files;
        }
        return ahead_mode::score;
    }
    return o.eval_ahead == "on" ? ahead_mode::score : o.eval_ahead == "files" ? ahead_mode::files : ahead_mode::none;
}

quantize_result run_quantize(const quantize_options & opts) {
    if (opts.texts.empty()) {
        fail("give at least one calibration text (--text)");
    }
    quantize_options o = opts;
    if (std::error_code ec; fs::is_directory(opts.model, ec)) {
        // A Hugging Face folder becomes a BF16 GGUF in the work folder first (once); the texts are checked before
        // that, since a conversion can take minutes.
        for (const std::string & t : opts.texts) {
            if (!fs::is_regular_file(t)) {
                fail("--text {}: no such file", t);
            }
        }
        if (o.work.empty()) {
            o.work = default_work_folder(opts.model);
        }
        o.model = gguf_of_source(opts.model, o.work);
    }
    const gguf_file src(o.model);
    // Every option is checked before anything is made.
    check_quantize_options(o, src);
    {
        // A recipe named twice in --like is one target (the dry run planned two files, the run printed its size twice).
        std::string names;
        std::set<std::string> seen;
        bool twice = false;
        for (const std::string & name : comma_list(o.like)) {
            if (seen.insert(recipe_by_name(name).name).second) {
                names += (names.empty() ? "" : ",") + name;
            } else {
                twice = true;
                fmt::print(stderr, "voodoo: warning: --like names {} more than once: one target\n", name);
            }
        }
        if (twice) {
            o.like = names;
        }
    }
    if (!o.announce.empty()) {
        fmt::print(stderr, "{}\n", o.announce);
    }
    {
        int64_t n = 0;
        for (const gguf_tensor & t : src.tensors()) {
            n += t.n_elements();
        }
        if (o.ggml_threads <= 0) {
            o.ggml_threads = ggml_threads_for(n);
        }
        const bool eval_auto = o.eval_chunks == -2 || o.speed_reps < 0;
        if (apply_eval_defaults(o, n) && eval_auto && o.eval_chunks != 0 && (o.eval_chunks != 40 || o.speed_reps != 5)) {
            fmt::print(stderr, "eval defaults for {:.2f} G weights: {} chunks of {} tokens, {} llama-bench run{} per file{} "
                               "(--eval-chunks and --speed-reps choose others)\n",
                       static_cast<double>(n) / 1e9, o.eval_chunks, o.eval_ctx, o.speed_reps, o.speed_reps == 1 ? "" : "s",
                       o.reference_speed ? "" : ", none of the source");
        }
        if (o.eval_chunks != 0) {
            const std::vector<std::string> gpus = llama_gpu_devices();
            if (!gpus.empty()) {
                fmt::print(stderr, "eval: libllama evaluates on {} (a GPU backend from GGML_BACKEND_PATH){}\n",
                           eval_devices_text(gpus),
                           o.eval_ahead == "auto" && eval_ahead_mode(o) == ahead_mode::files
                               ? ": --eval-ahead auto makes the stock files only, once the candidates are built" : "");
            }
        }
        // LibTorch's threads on the CPU follow the same rule: below 8M weights its OpenMP threads spin more than
        // they compute. make demo (stories260K, 0.26M weights) on the 2-core machine: 27.4 s on both cores,
        // 14.7 s on one, the same file (docs/BENCHMARKS.md).
        if (o.threads <= 0 && o.train.device == "cpu") {
            o.threads = ggml_threads_for(n);
        }
    }
    const std::string work = o.work.empty() ? default_work_folder(o.model) : o.work;
    if (o.dry_run) {
        quantize_result res;
        res.work = work;
        res.plan = dry_run_of(o, src, work);
        return res;
    }
    const folder_lock lock(work);  // one job per work folder (creates it)
    {
        // What a killed job left: in the work folder, and beside the exported files when they go elsewhere (a
        // ladder's --out is a folder, one file's its parent); that folder itself only, as it may be any folder.
        std::vector<std::pair<std::string, bool>> folders = {{work, true}};
        if (!o.out_dir.empty() || !o.out.empty()) {
            const fs::path out = !o.out_dir.empty() ? fs::path(o.out_dir) : fs::path(o.out);
            const fs::path folder = fs::is_directory(out) ? out : out.parent_path();
            folders.emplace_back(folder.empty() ? std::string(".") : folder.string(), false);
        }
        for (const auto & [folder, every_depth] : folders) {
            if (const size_t n = remove_stale_temporaries(folder, every_depth); n > 0) {
                fmt::print(stderr, "voodoo: removed {} unfinished file{} that a killed run left in '{}'\n", n,
                           n == 1 ? "" : "s", folder);
            }
        }
    }
    stage_work_folder() = work;
    stage_marks().clear();
    stage_stop() = o.train.should_stop;
    struct forget_stop {
        ~forget_stop() { stage_stop() = nullptr; }   // the test may capture what ends with this job
    } const forget;
    const std::string data_dir = (fs::path(work) / "data").string();
    const std::string model_id = model_digest(o.model, (fs::path(work) / "model.digest.json").string());

    // data: the texts' contents, the chunk length and the shuffle's seed (the vocabulary is checked below)
    nlohmann::json data_in = {{"ctx", o.ctx}, {"seed", o.train.seed}, {"texts", nlohmann::json::array()}};
    for (const std::string & t : o.texts) {
        data_in["texts"].push_back({{"path", t}, {"digest", file_digest(t)}});
    }
    const std::string data_record = (fs::path(data_dir) / "stage.json").string();
    auto make_data = [&](const std::string & why) {
        stage("data", data_dir + why);
        remove_tree(data_dir);
        data_options d;
        d.model = o.model;
        d.texts = o.texts;
        d.ctx = o.ctx;
        d.seed = o.train.seed;
        d.out_dir = data_dir;
        prepare_data(d);
        stage_save(data_record, data_in);
    };
    if (!fs::exists(fs::path(data_dir) / "data.json")) {
        make_data("");
    } else if (const std::string changed = stage_changes(data_record, data_in); !changed.empty()) {
        make_data(fmt::format(": made again ({})", changed));
    } else {
        try {
            token_data(data_dir).require_vocab_of(o.model);
            stage("data", data_dir + " (done)");
        } catch (const error & e) {
            make_data(fmt::format(": made again (the model's vocabulary is another: {})", e.what()));
        }
    }
    const token_data data(data_dir);
    data.require_vocab_of(o.model);
    const std::string data_id = stage_digest(data_in);

    // imatrix: made from the data and the model, or given
    std::string imatrix_path = (fs::path(work) / "imatrix.gguf").string();
    if (!o.imatrix.empty()) {
        imatrix_path = o.imatrix;
        stage("imatrix", imatrix_path + " (given)");
    } else {
        const nlohmann::json im_in = {{"model", model_id}, {"data", data_id}, {"chunks", o.imatrix_chunks}};
        const std::string record = (fs::path(work) / "imatrix.stage.json").string();
        const std::string changed = fs::exists(imatrix_path) ? stage_changes(record, im_in) : "";
        if (!fs::exists(imatrix_path) || !changed.empty()) {
            stage("imatrix", fmt::format("{} ({}){}", imatrix_path,
                                         o.train.device == "cpu" ? "libllama"
                                         : o.gpus > 1 && !o.train_exe.empty()
                                             ? fmt::format("LibTorch on {}, {} ranks", o.train.device, o.gpus)
                                             : "LibTorch on " + o.train.device,
                                         changed.empty() ? "" : fmt::format(": made again ({})", changed)));
            imatrix_options io;
            io.model = o.model;
            io.data_dir = data_dir;
            io.max_chunks = o.imatrix_chunks < 0 ? 0 : o.imatrix_chunks;
            io.n_threads = o.ggml_threads;
            if (o.train.device == "cpu") {
                write_imatrix_gguf(imatrix_path, collect_imatrix(io));
            } else if (!o.train_exe.empty()) {
                imatrix_in_child(o.train_exe, io, o.train.device, imatrix_path, o.gpus, o.train.parallel == "layers");
            } else {
                write_imatrix_gguf(imatrix_path, collect_imatrix_torch(io, parse_train_device(o.train.device)));
            }
            stage_save(record, im_in);
        } else {
            stage("imatrix", imatrix_path + " (done)");
        }
    }
    const std::string imatrix_id = file_digest(imatrix_path);
    report_expert_coverage(imatrix_path, (fs::path(work) / "experts.json").string());

    // the stock files: made with the model and the imatrix
    baseline_options bo;
    bo.source = o.model;
    bo.allow_requantize = o.allow_requantize;
    bo.imatrix = imatrix_path;
    bo.n_threads = o.threads;
    bo.reuse_existing = true;  // the folder is this model's and imatrix's (stage.json below): a stock file the eval
                               // ahead made during training is the eval's baseline, not made twice
    const std::string base_dir = (fs::path(work) / "baselines").string();
    {
        const nlohmann::json base_in = {{"model", model_id}, {"imatrix", imatrix_id}};
        const std::string record = (fs::path(base_dir) / "stage.json").string();
        if (fs::exists(base_dir)) {
            if (const std::string changed = stage_changes(record, base_in); !changed.empty()) {
                stage("baselines", fmt::format("{}: made again ({})", base_dir, changed));
                remove_tree(base_dir);
            }
        }
        fs::create_directories(base_dir);
        stage_save(record, base_in);
    }

    // the targets: one, or a ladder; a stock recipe's size when asked
    std::vector<rung> rungs = plan_rungs(o, bo, base_dir);
    const bool ladder = rungs.size() > 1;

    train_options t = o.train;
    if (o.greedy_peer && t.candidates != "all") {
        stage("candidates", "every type of every menu (--greedy-peer measures each tensor alone at each type)");
        t.candidates = "all";
    }
    for (const rung & g : rungs) {  // every size builds the candidates of all, so they share them and one probe
        t.prune_goals.push_back(g.goal);
    }
    t.cache_dir = (fs::path(work) / "candidates").string();
    t.probe_file = (fs::path(work) / "probe.json").string();
    t.imatrix_path = imatrix_path;
    t.menu.has_imatrix = true;
    t.threads = o.threads;
    importance_map importance;
    t.export_opts = imatrix_export_options(imatrix_path, imatrix_path, src, importance);

    // Every target is checked against what the menus can reach before any training.
    menu_options menu_opts = t.menu;
    menu_opts.importance = &importance;
    const std::vector<tensor_menu> menus = build_menus(src, menu_opts);
    std::vector<size_t> budgets;        // each target's bytes (a limit on the file or, for a bpw target, its tensors)
    double every_candidate_bytes = 0;   // every type of every menu: the most the candidate cache can grow
    {
        export_options eo = t.export_opts;
        eo.importance = &importance;
        for (const rung & g : rungs) {
            eo.target = g.goal.str();
            const budget b = make_budget(src, menus, g.goal, eo);
            budgets.push_back(static_cast<size_t>(b.limit));
            every_candidate_bytes = 0;
            for (const auto & costs : b.cost) {
                for (double c : costs) {
                    every_candidate_bytes += c;
                }
            }
        }
    }

    // The exported files must fit where they go, beside the disk's reserve: found here, before training, rather than
    // at the export after it (the train stage's cache already leaves the file's budget free: trainer.cpp).
    {
        int64_t out_bytes = 0;
        for (size_t b : budgets) {
            out_bytes += static_cast<int64_t>(b);
        }
        const fs::path dest = !o.out_dir.empty() ? fs::path(o.out_dir)
                              : !o.out.empty()   ? (ladder ? fs::path(o.out) : fs::path(o.out).parent_path())
                                                 : fs::path(work);
        const std::string where = dest.empty() ? std::string(".") : dest.string();
        check_disk_room(where, out_bytes,
                        budgets.size() == 1 ? std::string("the exported file")
                                            : fmt::format("the {} exported files", budgets.size()),
                        fmt::format("an output folder (-o, --out-dir) on a disk with at least {} free would fit, or a "
                                    "smaller target",
                                    bytes_text(static_cast<double>(out_bytes + k_disk_reserve_bytes))));
    }

    // The eval ahead, while the train stage runs (eval_ahead above).
    const eval_options ev = eval_options_of(o);
    std::unique_ptr<eval_ahead> ahead;
    const ahead_mode mode = eval_ahead_mode(o);
    if (mode != ahead_mode::none) {
        const int64_t keep_max = memory_limit_bytes() / 8;
        // The first size's train stage builds every size's candidates, and says so with this file once they are built.
        const std::string built = (fs::path(work) / ("run-" + rungs.front().label) / k_candidates_built_file).string();
        fs::remove(built);  // a previous run's: this run's train stage writes it again when its candidates are built
        const bool files_only = mode == ahead_mode::files;
        auto make_files = [&o, bo, base_dir, budgets, every_candidate_bytes, built, files_only, model = o.model](const std::atomic<bool> & stopping, bool & made_all) {
            const progress::quiet_scope quiet;
            const std::vector<std::string> names = baseline_names(o, bo, budgets);
            const std::string stem = fs::path(model).stem().string();
            auto path_of = [&](const std::string & name) { return (fs::path(base_dir) / (stem + "-" + name + ".gguf")).string(); };
            // Stock files are made ahead only when they fit beside every candidate the train stage could build and
            // our files (the dry run's disk sum): the train stage's own disk check must not meet a disk they filled.
            double need = every_candidate_bytes + static_cast<double>(k_disk_reserve_bytes);
            for (size_t b : budgets) {
                need += static_cast<double>(b);
            }
            const gguf_file source(model);
            size_t missing = 0;
            for (const std::string & name : names) {
                if (!fs::exists(path_of(name))) {
                    need += estimate_stock_bytes(source, recipe_by_name(name));
                    ++missing;
                }
            }
            bool make = !files_only && need <= static_cast<double>(free_disk_bytes(base_dir));
            if (!make && missing > 0) {
                // files_only: made in the training steps' window, when the cores are idle.
                // Not beside every candidate the menus hold (issue #16: at 8B they are 101.7 GiB, the probe keeps about
                // half, and a disk without room for the rest builds them in memory): wait for the train stage's own
                // candidates, which take every core meanwhile (this thread runs only on idle ones), then decide on
                // the room they left for the stock files and our files.
                while (!stopping && !fs::exists(built)) {
                    std::this_thread::sleep_for(std::chrono::milliseconds(500));
                }
                const double after = need - every_candidate_bytes;  // the reserve, our files, the stock files to make
                make = !stopping && after <= static_cast<double>(free_disk_bytes(base_dir));
            }
            made_all = make || missing == 0;
            std::vector<std::string> paths;
            for (const std::string & name : names) {
                if (stopping) {
                    break;
                }
                if (!make && !fs::exists(path_of(name))) {
                    continue;
                }
                const auto made = make_baselines(bo, {name}, base_dir);
                if (!made.empty() && made.front().ok) {
                    paths.push_back(made.front().path);
                }
            }
            return paths;
        };
        ahead = std::make_unique<eval_ahead>(ev, make_files, keep_max, !files_only);
        if (files_only) {
            note_line("eval", fmt::format("ahead (--eval-ahead {}): once the train stage's candidates are built, a thread at "
                                          "idle priority makes the stock files of --baselines {} (libllama scores on the "
                                          "GPU in the eval stage)", o.eval_ahead, o.baselines));
        } else {
            note_line("eval", fmt::format("ahead (--eval-ahead {}): while the train stage runs, a thread at idle priority scores "
                                          "the reference{}", o.eval_ahead,
                                          o.baselines == "none" ? "" : fmt::format(" and makes and scores the stock files of --baselines {}", o.baselines)));
        }
    }

    quantize_result res;
    res.work = work;
    std::vector<std::string> recipe_paths;  // each file's recipe.json
    std::vector<size_t> sizes;
    std::vector<std::string> peers;
    for (const rung & g : rungs) {
        t.goal = g.goal;
        t.run_dir = (fs::path(work) / ("run-" + g.label)).string();
        if (o.max_slowdown >= 0) {
            // The stock recipe of this size and its predicted generation time, in the table of this machine.
            const std::map<std::string, ggml_type> & stock_types = g.stock_types;
            std::vector<ggml_type> types;
            for (const auto & [name, type] : stock_types) {
                types.push_back(type);
            }
            for (const tensor_menu & tm : menus) {
                types.insert(types.end(), tm.types.begin(), tm.types.end());
            }
            std::sort(types.begin(), types.end());
            types.erase(std::unique(types.begin(), types.end()), types.end());
            t.speed_table = default_speed_table_path(o.threads);
            const type_speed_table table = load_or_measure_type_speeds(types, o.threads, t.speed_table);
            const double stock_s = predicted_token_seconds(src, stock_types, table);
            t.max_token_seconds = (1.0 + o.max_slowdown) * stock_s;
            stage("speed", fmt::format("stock {} predicted at {:.1f} µs per generated token; this file at most {:.1f} "
                                       "(--max-slowdown {}; table {})", g.label, 1e6 * stock_s, 1e6 * t.max_token_seconds,
                                       o.max_slowdown, t.speed_table));
        }
        const std::string out = train_and_export(o, t, src, data, importance, imatrix_path, work, g.label, ladder,
                                                 run_inputs(t, model_id, data_id, imatrix_id));
        t.prior_recipes.push_back((fs::path(t.run_dir) / "recipe.json").string());
        recipe_paths.push_back(t.prior_recipes.back());
        res.outs.push_back(out);
        sizes.push_back(file_size(out));
        if (o.greedy_peer) {
            const std::string peer = (fs::path(work) / fmt::format("{}.greedy{}.gguf", fs::path(o.model).stem().string(),
                                                                   ladder ? "." + g.label : "")).string();
            export_recipe_file(src, (fs::path(t.run_dir) / "greedy.recipe.json").string(), peer, t, imatrix_id);
            peers.push_back(peer);
        }
    }
    res.out = res.outs.back();
    res.file_bytes = file_size(res.out);
    {
        export_options eo = t.export_opts;
        res.q8_0_ratio = static_cast<double>(res.file_bytes) / static_cast<double>(q8_0_file_bytes(src, eo));
    }

    // eval beside the stock recipes
    if (o.eval_chunks == 0) {
        stage("eval", "skipped (--eval-chunks 0)");
        res.card = write_model_card(o, src, res, recipe_paths, imatrix_path, work);
        report_stage_times(work);
        return res;
    }
    stage("baselines", fmt::format("stock recipes ({}) in {}", o.baselines, base_dir));
    std::unique_ptr<eval_session> session;
    if (ahead) {  // its wait counts in this stage: it was making or scoring stock files
        std::string note;
        session = ahead->stop(note);
        ahead.reset();
        note_line("eval", "ahead: " + note);
        res.eval_ahead = note;
        if (session) {
            session->stop_keeping();  // chunks decoded from here on are needed once: not kept
        }
    }
    // Stock files made but not scored: their tensor types are an earlier recipe's (llama.cpp's fallbacks on a small
    // model's shapes make many recipes one file); eval.md and eval.json name them, so no file goes missing unexplained.
    std::vector<std::pair<std::string, std::string>> same_types;
    const auto baselines = pick_baselines(o, bo, sizes, base_dir, same_types);
    for (const rung & g : rungs) {  // a target sized by the dry run, against the file llama.cpp has now made
        if (g.planned && fs::exists(g.stock_path) && file_size(g.stock_path) != static_cast<size_t>(g.goal.value)) {
            fmt::print(stderr, "voodoo: warning: stock {} ('{}') is {} bytes, where llama.cpp's dry run gave {}: the {} file "
                               "was sized to the dry run's; please report this (plan_stock_file)\n", g.label, g.stock_path,
                       file_size(g.stock_path), static_cast<size_t>(g.goal.value), g.label);
        }
    }
    std::vector<std::string> files = res.outs;
    files.insert(files.end(), peers.begin(), peers.end());
    files.insert(files.end(), baselines.begin(), baselines.end());
    const std::string eval_json = (fs::path(work) / "eval.json").string();
    const std::string eval_record = (fs::path(work) / "eval.stage.json").string();
    nlohmann::json eval_in = eval_inputs(ev, files);
    std::optional<eval_result> done;
    std::string changed = "no eval.json yet";
    if (fs::exists(eval_json)) {
        // The record holds eval.json's digest as written: a table edited or cut since is scored again.
        nlohmann::json with_table = eval_in;
        with_table["eval_json"] = file_digest(eval_json);
        changed = stage_changes(eval_record, with_table);
        if (changed.empty()) {
            try {
                std::ifstream in(eval_json);
                done = eval_from_json(nlohmann::json::parse(in), eval_json);
            } catch (const std::exception &) {
                changed = "eval.json unreadable";  // scored again below
            }
        }
    }
    stage("eval", fmt::format("{} file{} on {}{}{}", files.size(), files.size() == 1 ? "" : "s", ev.text,
                              o.eval_text.empty() ? " (the calibration text: not held out)" : "",
                              done ? fmt::format(" (done: {}, made with the same files and options)", eval_json)
                                   : fmt::format(" (scored: {})", changed)));
    if (done) {
        res.eval = std::move(*done);
    } else {
        if (!session) {
            session = std::make_unique<eval_session>(ev, 0);   // run_eval's own steps: the same numbers
        }
        // Ctrl-C during the eval (minutes at a few billion weights) stops the scoring before its next decode.
        if (!session->score(files, [&should_stop = o.train.should_stop] { return should_stop && should_stop(-1); })) {
            throw stopped("stopped in the eval stage; run the same command again: the files are kept and the eval is "
                          "made again");
        }
        res.eval = session->finish(files);
    }
    res.table = eval_to_markdown(res.eval);
    nlohmann::json not_scored = nlohmann::json::array();
    if (!same_types.empty()) {
        std::vector<std::string> pairs;
        for (const auto & [recipe, as] : same_types) {
            pairs.push_back(fmt::format("{} as {}", recipe, as));
            not_scored.push_back({{"recipe", recipe}, {"same_types_as", as}});
        }
        res.table += fmt::format("\nStock file{} made in {} but not scored, {} the tensor types of an earlier recipe's file "
                                 "(llama.cpp's fallbacks where a type does not fit a tensor's rows): {}.\n",
                                 pairs.size() == 1 ? "" : "s", base_dir, pairs.size() == 1 ? "it has" : "each has",
                                 fmt::join(pairs, ", "));
    }
    write_file_atomic((fs::path(work) / "eval.md").string(), res.table);
    if (!done) {
        nlohmann::json j = eval_to_json(res.eval);
        j["stock_files_not_scored"] = not_scored;
        write_file_atomic(eval_json, j.dump(2) + "\n");
        eval_in["eval_json"] = file_digest(eval_json);
        stage_save(eval_record, eval_in);
    }
    if (ladder || o.greedy_peer) {
        res.table += "\n" + curve_to_markdown(res.eval);
        write_file_atomic((fs::path(work) / "curve.md").string(), curve_to_markdown(res.eval));
        write_file_atomic((fs::path(work) / "curve.json").string(), curve_to_json(res.eval).dump(2) + "\n");
    }
    // The drawing is the last, optional step: a machine without gnuplot (the GPU machine had none) keeps the
    // job's results and is told how to get the figure.
    if (gnuplot_available()) {
        eval_plot(res.eval, (fs::path(work) / "eval.png").string());
        if (ladder || o.greedy_peer) {
            curve_plot(res.eval, (fs::path(work) / "curve.png").string());
        }
    } else {
        fmt::print(stderr, "voodoo: note: gnuplot is not installed: no {}; apt-get install gnuplot-nox, then run "
                           "the same command again to draw it\n", (fs::path(work) / "eval.png").string());
    }
    res.card = write_model_card(o, src, res, recipe_paths, imatrix_path, work);
    report_stage_times(work);
    return res;
}

}  // namespace voodoo
