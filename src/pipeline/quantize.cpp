#include "pipeline/quantize.h"

#include "common/error.h"
#include "common/file.h"
#include "data/dataset.h"
#include "eval/baseline.h"
#include "eval/curve.h"
#include "eval/report.h"
#include "export/export.h"
#include "ggml/types.h"
#include "imatrix/collect.h"
#include "imatrix/imatrix.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <thread>
#include <set>

#include <sys/wait.h>
#include <unistd.h>

namespace voodoo {

namespace {

namespace fs = std::filesystem;

void stage(const char * name, const std::string & what) { fmt::print(stderr, "== {}: {}\n", name, what); }

std::string types_list(const std::vector<ggml_type> & types) {
    std::string s;
    for (ggml_type t : types) {
        s += (s.empty() ? "" : ",") + type_name(t);
    }
    return s;
}

// `exe train …` with the same options, in a child process; returns when it has finished. Throws
// voodoo::error when it cannot start, was interrupted, or failed (its own error is on stderr).
void train_in_child(const std::string & exe, const quantize_options & o, const train_options & t,
                    const std::string & data_dir, const std::string & imatrix_path) {
    std::vector<std::string> args = {exe, "train", "--model", o.model, "--data", data_dir, "--out", t.run_dir,
                                     "--cache", t.cache_dir, "--imatrix", imatrix_path};
    switch (t.goal.kind) {
        case target_kind::bpw: args.insert(args.end(), {"--target-bpw", fmt::format("{:.17g}", t.goal.value)}); break;
        case target_kind::size: args.insert(args.end(), {"--target-size", fmt::format("{:.0f}", t.goal.value)}); break;
        case target_kind::ratio: args.insert(args.end(), {"--ratio", fmt::format("{:.17g}", t.goal.value)}); break;
    }
    if (!t.menu.types.empty()) {
        args.insert(args.end(), {"--menu", types_list(t.menu.types)});
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
    num("--probe-sequences", t.probe_sequences);
    num("--probe-anchors", t.probe_anchors);
    num("--gate-init", t.gate_init);
    num("--journal-every", t.journal_every);
    num("--seed", t.seed);
    num("--threads", t.threads);
    num("--loss-chunk", t.loss_chunk);
    args.insert(args.end(), {"--device", t.device});
    if (!t.mixture.empty()) {
        args.insert(args.end(), {"--mixture", t.mixture});
    }
    if (t.resume) {
        args.push_back("--resume");
    }
    std::vector<char *> argv;
    for (auto & a : args) {
        argv.push_back(a.data());
    }
    argv.push_back(nullptr);
    std::fflush(nullptr);
    const pid_t pid = fork();
    if (pid < 0) {
        fail("train stage: cannot start a child process: {}", std::strerror(errno));
    }
    if (pid == 0) {
        execv(exe.c_str(), argv.data());
        std::fprintf(stderr, "cannot run %s: %s\n", exe.c_str(), std::strerror(errno));
        _exit(127);
    }
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    if (WIFEXITED(status) && WEXITSTATUS(status) == 130) {
        fail("training stopped; run the same command again to resume");
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fail("train stage ('{} train' on {}) failed{}", exe, t.device,
             WIFSIGNALED(status) ? fmt::format(" with signal {}", WTERMSIG(status)) : fmt::format(" (exit {})", WEXITSTATUS(status)));
    }
}

// Stock recipes to compare with: every recipe llama.cpp makes for the model (duplicates by tensor types
// dropped), then the ones nearest in size to ours unless all are asked for.
std::vector<std::string> pick_baselines(const quantize_options & o, const baseline_options & bo,
                                        const std::vector<size_t> & our_sizes, const std::string & dir) {
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
    const auto made = make_baselines(bo, names, dir);
    std::vector<const baseline_result *> ok;
    for (const auto & r : made) {
        if (r.ok && r.same_types_as.empty()) {
            ok.push_back(&r);
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

// One size of a ladder: its target and the label its run folder and file carry.
struct rung {
    std::string label;      // "Q4_K_M" (--like), "size-304352", "ratio-0.45", "bpw-4.5"
    target goal;
    double order;           // sorts the rungs by increasing budget
};

std::string goal_label(const target & g) {
    switch (g.kind) {
        case target_kind::bpw: return fmt::format("bpw-{}", g.value);
        case target_kind::size: return fmt::format("size-{:.0f}", g.value);
        case target_kind::ratio: return fmt::format("ratio-{}", g.value);
    }
    return "";
}

// The targets by increasing budget: the stock files' sizes for --like (made now when missing), else the goals.
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
            const size_t bytes = fs::exists(like_path) ? file_size(like_path) : make_baseline(bo, name, like_path).file_bytes;
            stage("target", fmt::format("the size of stock {}: {} bytes", name, bytes));
            rungs.push_back({name, {target_kind::size, static_cast<double>(bytes)}, static_cast<double>(bytes)});
        }
    } else {
        const std::vector<target> goals = o.goals.empty() ? std::vector<target>{o.train.goal} : o.goals;
        for (const target & g : goals) {
            rungs.push_back({goal_label(g), g, g.value});
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

// Exports the recipe at `recipe_path` to `out` unless `out` already holds that recipe (voodoo.recipe_hash).
void export_recipe_file(const gguf_file & src, const std::string & recipe_path, const std::string & out,
                        const train_options & t) {
    const recipe r = recipe_load(recipe_path);
    if (fs::exists(out)) {
        const gguf_file prev(out);
        if (prev.get_string("voodoo.recipe_hash").value_or("") == recipe_hash(r)) {
            stage("export", out + " (done)");
            return;
        }
    }
    stage("export", out);
    export_options eo = t.export_opts;
    eo.target = r.target;
    candidate_cache cache(t.cache_dir);
    eo.cache = &cache;
    export_gguf(src, r, out, eo);
}

// The train and export stages of one target; returns the exported file. `label` non-empty: a ladder's rung
// (its file is named <model>.Voodoo<NN>.<label>.gguf, in --out when that is a folder).
std::string train_and_export(const quantize_options & o, train_options & t, const gguf_file & src,
                             const token_data & data, const importance_map & importance,
                             const std::string & imatrix_path, const std::string & work, const std::string & label) {
    const std::string recipe_path = (fs::path(t.run_dir) / "recipe.json").string();
    if (!fs::exists(recipe_path)) {
        t.resume = fs::exists(fs::path(t.run_dir) / "journal.pt");
        stage("train", t.run_dir + (t.resume ? " (resuming)" : ""));
        if (!o.train_exe.empty()) {
            train_in_child(o.train_exe, o, t, data.dir(), imatrix_path);
        } else {
            const train_result tr = train_gates(src, src, data.train(), &importance, t, &data.val());
            if (!tr.finished) {
                fail("training stopped after step {}; run the same command again to resume", tr.steps_done);
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
    std::string out = o.out.empty() ? default_output_path(work, src, ratio) : o.out;
    if (!label.empty()) {
        const std::string dir = o.out.empty() ? work : o.out;
        fs::create_directories(dir);
        out = default_output_path(dir, src, ratio);
        out = out.substr(0, out.size() - 5) + "." + label + ".gguf";
    }
    export_recipe_file(src, recipe_path, out, t);
    return out;
}

}  // namespace

int ggml_threads_for(int64_t n_weights) {
    return n_weights < 8'000'000 ? 1 : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

quantize_result run_quantize(const quantize_options & opts) {
    if (opts.texts.empty()) {
        fail("give at least one calibration text (--text)");
    }
    const gguf_file src(opts.model);
    quantize_options o = opts;
    if (o.ggml_threads <= 0) {
        int64_t n = 0;
        for (const gguf_tensor & t : src.tensors()) {
            n += t.n_elements();
        }
        o.ggml_threads = ggml_threads_for(n);
    }
    const std::string work = o.work.empty() ? (fs::path(o.model).stem().string() + ".voodoo") : o.work;
    fs::create_directories(work);
    const std::string data_dir = (fs::path(work) / "data").string();

    // data
    if (!fs::exists(fs::path(data_dir) / "data.json")) {
        stage("data", data_dir);
        data_options d;
        d.model = o.model;
        d.texts = o.texts;
        d.ctx = o.ctx;
        d.seed = o.train.seed;
        d.out_dir = data_dir;
        prepare_data(d);
    } else {
        stage("data", data_dir + " (done)");
    }
    const token_data data(data_dir);
    data.require_vocab_of(o.model);
    if (data.sources() != o.texts) {
        fail("work folder '{}' holds data made from other texts; give the same --text or another --work", work);
    }

    // imatrix
    const std::string imatrix_path = (fs::path(work) / "imatrix.gguf").string();
    if (!fs::exists(imatrix_path)) {
        stage("imatrix", imatrix_path);
        imatrix_options io;
        io.model = o.model;
        io.data_dir = data_dir;
        io.max_chunks = o.imatrix_chunks;
        io.n_threads = o.ggml_threads;
        write_imatrix_gguf(imatrix_path, collect_imatrix(io));
    } else {
        stage("imatrix", imatrix_path + " (done)");
    }

    // the targets: one, or a ladder; a stock recipe's size when asked
    baseline_options bo;
    bo.source = o.model;
    bo.imatrix = imatrix_path;
    bo.n_threads = o.threads;
    const std::string base_dir = (fs::path(work) / "baselines").string();
    fs::create_directories(base_dir);
    std::vector<rung> rungs = plan_rungs(o, bo, base_dir);
    const bool ladder = rungs.size() > 1;
    if (ladder && !o.out.empty() && o.out.ends_with(".gguf")) {
        fail("--out '{}' names one file, but {} targets make {} files: give a folder for --out, or one target", o.out,
             rungs.size(), rungs.size());
    }

    train_options t = o.train;
    t.cache_dir = (fs::path(work) / "candidates").string();
    t.probe_file = (fs::path(work) / "probe.json").string();
    t.imatrix_path = imatrix_path;
    t.menu.has_imatrix = true;
    t.threads = o.threads;
    importance_map importance;
    t.export_opts = imatrix_export_options(imatrix_path, imatrix_path, src, importance);

    // Every target is checked against what the menus can reach before any training.
    {
        menu_options m = t.menu;
        m.importance = &importance;
        const std::vector<tensor_menu> menus = build_menus(src, m);
        export_options eo = t.export_opts;
        eo.importance = &importance;
        for (const rung & g : rungs) {
            eo.target = g.goal.str();
            make_budget(src, menus, g.goal, eo);
        }
    }

    quantize_result res;
    std::vector<size_t> sizes;
    std::vector<std::string> peers;
    for (const rung & g : rungs) {
        t.goal = g.goal;
        t.run_dir = (fs::path(work) / (ladder ? "run-" + g.label : "run")).string();
        const std::string out = train_and_export(o, t, src, data, importance, imatrix_path, work, ladder ? g.label : "");
        t.prior_recipes.push_back((fs::path(t.run_dir) / "recipe.json").string());
        res.outs.push_back(out);
        sizes.push_back(file_size(out));
        if (o.greedy_peer) {
            const std::string peer = (fs::path(work) / fmt::format("{}.greedy{}.gguf", fs::path(o.model).stem().string(),
                                                                   ladder ? "." + g.label : "")).string();
            export_recipe_file(src, (fs::path(t.run_dir) / "greedy.recipe.json").string(), peer, t);
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
        return res;
    }
    const auto baselines = pick_baselines(o, bo, sizes, base_dir);
    eval_options ev;
    ev.reference = o.model;
    ev.text = o.eval_text.empty() ? o.texts.front() : o.eval_text;
    ev.n_ctx = o.eval_ctx;
    ev.n_chunks = o.eval_chunks;
    ev.n_threads = o.ggml_threads;
    std::vector<std::string> files = res.outs;
    files.insert(files.end(), peers.begin(), peers.end());
    files.insert(files.end(), baselines.begin(), baselines.end());
    stage("eval", fmt::format("{} files on {}{}", files.size(), ev.text,
                              o.eval_text.empty() ? " (the calibration text: not held out)" : ""));
    res.eval = run_eval(ev, files);
    res.table = eval_to_markdown(res.eval);
    write_file_atomic((fs::path(work) / "eval.md").string(), res.table);
    write_file_atomic((fs::path(work) / "eval.json").string(), eval_to_json(res.eval).dump(2) + "\n");
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
    return res;
}

}  // namespace voodoo
