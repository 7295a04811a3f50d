#include "cli/commands.h"
#include "common/error.h"
#include "common/file.h"
#include "eval/report.h"
#include "pipeline/dry_run.h"
#include "pipeline/quantize.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <memory>

namespace voodoo::cli {

namespace {

command add_quantize(CLI::App & app) {
    auto * sub = app.add_subcommand("quantize", "The whole job: data → imatrix → train → export → eval beside stock recipes");
    sub->footer("examples:\n"
                "  voodoo quantize model.gguf --text calib.txt --like Q4_K_M --eval-text heldout.txt\n"
                "  voodoo quantize model.gguf --text a.txt --text b.txt --ratio 0.45 --out model.Voodoo45.gguf\n"
                "  voodoo quantize model.gguf --text calib.txt --like Q2_K,Q3_K_M,Q4_K_M,Q5_K_M,Q6_K --baselines all-that-fit\n"
                "A list of targets makes one file per size from one run of data, imatrix, candidates and probe,\n"
                "and draws the curve against the stock recipes (WORK/curve.png, curve.md, curve.json).\n"
                "Run it again after a stop: finished stages are kept, training resumes from its journal.\n" +
                [] {
                    // The defaults printed with each flag are the GPU's; say what a CPU run takes instead.
                    train_options t;
                    const std::vector<std::string> cpu = apply_cpu_defaults(t, [](const std::string &) { return false; }, 512);
                    return fmt::format("On the CPU (no --device cuda) a flag not given takes its cpu default instead: {}.",
                                       fmt::join(cpu, ", "));
                }());
    struct options {
        quantize_options q;
        std::string target_size, menu, target_bpw, ratio, model_flag, json;
        std::vector<std::string> menu_for;
    };
    auto o = std::make_shared<options>();
    // Named MODEL, not model: CLI11 2.4 (Ubuntu 24.04's) refuses a positional whose name is also --model's.
    // A flag naming a missing file is a command-line error (exit 2), as --text's and eval's -m are (README, "Exit
    // codes"); the positional MODEL, as every command's, is refused by the job (exit 1, "cannot open …").
    auto * model_pos = sub->add_option("MODEL", o->q.model, "Source GGUF (F32/F16/BF16) or Hugging Face model folder (converted once into WORK); or -m");
    auto * model_opt = sub->add_option("-m,--model", o->model_flag, "Source GGUF (as llama.cpp's tools take it)")
                           ->check(CLI::ExistingPath);
    model_pos->excludes(model_opt);
    sub->add_option("--imatrix", o->q.imatrix,
                    "An imatrix you have (llama-imatrix's GGUF or legacy .dat), checked against the model: no imatrix stage")
        ->check(CLI::ExistingFile);
    sub->add_option("--text", o->q.texts, "Calibration text file(s)")->required()->check(CLI::ExistingFile);
    sub->add_option("--eval-text", o->q.eval_text, "Held-out text for the comparison (default: the first --text)")
        ->check(CLI::ExistingFile);
    auto * bpw = sub->add_option("--target-bpw", o->target_bpw, "Budget in bits per weight (llama-quantize's BPW); a comma list makes a ladder");
    auto * size = sub->add_option("--target-size", o->target_size,
                                  "Budget as the file size on disk: bytes, KB/MB/GB, KiB/MiB/GiB or K/M/G (= KiB/MiB/GiB); a comma list makes a ladder");
    auto * ratio = sub->add_option("--ratio", o->ratio, "Budget as a fraction of the all-Q8_0 file; a comma list makes a ladder");
    auto * like = sub->add_option("--like", o->q.like, "Budget = the size of this stock recipe's file (Q4_K_M, …); a comma list makes a ladder");
    bpw->excludes(size)->excludes(ratio)->excludes(like);
    size->excludes(ratio)->excludes(like);
    ratio->excludes(like);
    auto * out = sub->add_option("-o,--output,--out", o->q.out, "Output GGUF (default: WORK/<model>.Voodoo<NN>.gguf)");
    sub->add_option("--out-dir", o->q.out_dir, "Folder for the output file(s), <model>.Voodoo<NN>[.<label>].gguf (default: WORK)")
        ->excludes(out)->check(folder_to_write());
    sub->add_option("--work", o->q.work, "Work folder (default: <model>.voodoo)");
    sub->add_option("--baselines", o->q.baselines, "Stock recipes to compare: nearest, all-that-fit, none, or Q4_K_M,Q5_0,…")
        ->capture_default_str();
    sub->add_flag("--greedy-peer", o->q.greedy_peer,
                  "Also export and compare the measured-sensitivity greedy knapsack at every size (<model>.greedy*.gguf)");
    sub->add_option("-c,--ctx-size,--ctx", o->q.ctx, "Calibration chunk length")->capture_default_str();
    sub->add_option("--imatrix-chunks", o->q.imatrix_chunks, "Chunks the imatrix sees (-1 = all)")->capture_default_str();
    sub->add_option("--eval-ctx", o->q.eval_ctx, "Eval chunk length")->capture_default_str();
    sub->add_option("--eval-chunks", o->q.eval_chunks,
                    "Eval chunks (-1 = all, 0 = no eval stage, auto = 40, fewer above 0.5 G weights, at least 8)")
        ->default_str("auto")->transform(CLI::Validator(
            [](std::string & v) -> std::string {
                v = v == "auto" ? "-2" : v;
                return {};
            }, "INT|auto"));
    sub->add_option("--speed-reps", o->q.speed_reps,
                    "Runs of llama-bench's pp512 and tg128 per compared file for the speed columns (0 = none, auto = 5, "
                    "fewer above 0.5 G weights, at least 1)")
        ->default_str("auto")->transform(count_or_auto());
    sub->add_option("--eval-ahead", o->q.eval_ahead,
                    "on: score the reference and the likely stock files on the eval text while training runs, on the cores "
                    "it leaves idle (SCHED_IDLE); the same numbers. files: only make the stock files, once the train "
                    "stage's candidates are built. auto: with a GPU device and at least 8 cores, files when libllama "
                    "has a GPU to evaluate on (GGML_BACKEND_PATH), else on; off on the CPU device")
        ->check(CLI::IsMember({"auto", "on", "files", "off"}))->capture_default_str();
    sub->add_option("--max-slowdown", o->q.max_slowdown,
                    "Each file generates at most this much slower than the stock recipe of its size (0.1 = 10%), as "
                    "predicted by a per-type speed table measured once on this machine; needs --like")
        ->check(non_negative_number());
    sub->add_option("--menu", o->menu,
                    "Candidate types, comma-separated, or 'all' (default: IQ1_S … Q8_0, F16, BF16, without IQ4_NL, Q4_0, "
                    "Q4_1, Q5_0, Q5_1 where a 256-block type fits; 'all' and --max-slowdown keep those too)");
    sub->add_option("--menu-for", o->menu_for, "Per-role menu 'REGEX=TYPES' (repeatable)");
    sub->add_option("--steps", o->q.train.steps, "Training steps")->capture_default_str();
    sub->add_option("--batch", o->q.train.batch, "Sequences per step")->capture_default_str();
    sub->add_option("--probe-sequences", o->q.train.probe_sequences, "Sequences for each candidate's ΔKL probe")
        ->capture_default_str();
    sub->add_option("--seq", o->q.train.seq, "Tokens per training sequence (0 = --ctx)")->capture_default_str();
    auto * threads = sub->add_option("-t,--threads", o->q.threads,
                                     "CPU threads for everything: LibTorch, quantization and libllama (0 = VOODOO_THREADS if set, else every core, LibTorch's "
                                     "OMP_NUM_THREADS when set; libllama's then by model size)")
                         ->capture_default_str()->check(non_negative());
    auto * ggml_threads = sub->add_option("--ggml-threads", o->q.ggml_threads,
                                          "Threads for libllama alone (imatrix, eval), over -t; 0 = 1 below 8M weights, "
                                          "else as -t 0")
                              ->capture_default_str()->check(non_negative());
    sub->add_option("--device", o->q.train.device, "Where to train: cpu, cuda or cuda:N (CUDA builds)")->capture_default_str();
    sub->add_option("--gpus", o->q.gpus,
                    "Train on this many GPUs of this host (cuda:0 …): the train stage runs as that many ranks with "
                    "torchrun's variables (with --device cpu: that many CPU processes)")
        ->capture_default_str()->check(CLI::PositiveNumber);
    sub->add_option("--parallel", o->q.train.parallel,
                    "With --gpus > 1: tp (tensor parallelism, Megatron style; llama, qwen2, qwen3) or layers "
                    "(contiguous layers per GPU, in every stage that runs the model: a model larger than one GPU)")
        ->capture_default_str()->check(CLI::IsMember({"tp", "layers"}));
    sub->add_option("--candidates", o->q.train.candidates,
                    "Which candidates to build: targets (those some recipe under the targets could use: a few per tensor "
                    "probed first, the others predicted; train/prune.h) or all (every type of every menu; what "
                    "--greedy-peer needs, and implies)")
        ->capture_default_str()->check(CLI::IsMember({"targets", "all"}));
    sub->add_option("--prune-stages", o->q.train.prune_stages,
                    "With --candidates targets: 1 (one plan after the first probe), 2 (then the knapsack's choices and their "
                    "neighbours built and probed, and the plan made again with them known: fewer candidates to build for more "
                    "probe forwards, a gain on a GPU and a loss on the CPU), or auto (2 on a GPU, 1 on the CPU)")
        ->capture_default_str()->check(CLI::IsMember({"auto", "1", "2"}));
    add_eager_types_option(sub, o->q.train.eager_types);
    sub->add_option("--build-ahead", o->q.train.build_ahead,
                    "With --candidates targets: probe each tensor's first candidates as soon as they are built, and build "
                    "those the probe will likely keep while it ends (on, off: build, then probe, or auto: on a GPU, whose "
                    "probe leaves the cores idle)")
        ->capture_default_str()->check(CLI::IsMember({"auto", "on", "off"}));
    sub->add_option("--recompute", o->q.train.recompute,
                    "Activation checkpointing in training: on, off, or auto (on when a GPU would not hold every layer's "
                    "activations)")
        ->capture_default_str()->check(CLI::IsMember({"auto", "on", "off"}));
    sub->add_option("--candidates-on", o->q.train.candidates_on, "Fused path: where the candidates live: gpu, host (pinned host memory, each layer moved to the GPU ahead of use) or auto (the GPU while they fit beside the teacher)")->capture_default_str()->check(CLI::IsMember({"gpu", "host", "auto"}));
    sub->add_option("--mixture", o->q.train.mixture, "How W_eff is formed: fused (GPU kernels; default on cuda), reference (dense candidates, plain LibTorch) or cpu");
    sub->add_option("--loss-chunk", o->q.train.loss_chunk, "Positions per chunk of the CE/KL over the vocabulary: memory and speed only (the sums' rounding aside). 0 = by device: f32 logits of about 512 MB per chunk on a GPU, at most 31 MiB on the CPU")->capture_default_str();
    sub->add_option("--lr", o->q.train.lr, "Peak learning rate of the gates (AdamW, cosine)")->capture_default_str();
    sub->add_option("--routing", o->q.train.routing,
                    "What each token of the training forward sees: mix (the mixture of the candidates) or ptqr "
                    "(per-token quant routing: one candidate drawn from the gate, straight-through backward)")
        ->capture_default_str()->check(CLI::IsMember({"mix", "ptqr"}));
    sub->add_option("--lambda-size", o->q.train.lambda_size, "Weight of the size penalty")->capture_default_str();
    sub->add_option("--size-tol", o->q.train.size_tol, "Dead zone of the size penalty (relative)")->capture_default_str();
    sub->add_option("--tau0", o->q.train.tau0, "Start temperature of the gates")->capture_default_str();
    sub->add_option("--tau1", o->q.train.tau1, "End temperature of the gates")->capture_default_str();
    sub->add_option("--gate-init", o->q.train.gate_init, "Start logit of the probe's allocation (others start at 0)")
        ->capture_default_str();
    sub->add_option("--lambda-ce", o->q.train.lambda_ce, "Weight of the cross-entropy on the calibration tokens")->capture_default_str();
    sub->add_option("--lambda-kl", o->q.train.lambda_kl, "Weight of KL(teacher ‖ student)")->capture_default_str();
    sub->add_option("--probe-anchors", o->q.train.probe_anchors,
                    "Types measured per tensor; the others are predicted from the imatrix-weighted error (0 = all; "
                    "auto = all unless the eager probe's rate says the rest would take over --probe-auto-seconds, "
                    "then 2)")
        ->default_str("auto")->transform(count_or_auto());
    sub->add_option("--probe-auto-seconds", o->q.train.probe_auto_seconds,
                    "With --probe-anchors auto: the longest the full probe's remaining forwards may take")
        ->capture_default_str()->check(non_negative_number());
    sub->add_option("--probe-compute", o->q.train.probe_compute, "The probe's arithmetic: auto (tf32 on a CUDA device, f32 on the CPU), f32, tf32 (CUDA: f32 products on the tensor cores), or bf16 only to measure what bf16 costs")
        ->capture_default_str()->check(CLI::IsMember({"auto", "f32", "tf32", "bf16"}));
    sub->add_option("--compute", o->q.train.compute, "Training forward dtype: f32 or bf16 (default: bf16 on cuda, f32 on cpu)")
        ->check(CLI::IsMember({"f32", "bf16"}));
    sub->add_option("--select-sequences", o->q.train.select_sequences,
                    "Validation sequences on which the final selection measures each candidate recipe")->capture_default_str()
        ->check(CLI::PositiveNumber);
    sub->add_option("--seed", o->q.train.seed, "Seed")->capture_default_str();
    sub->add_flag("--allow-requantize", o->q.allow_requantize,
                  "Accept an already quantized source (as llama-quantize): it is also the teacher, and no file can be better than it");
    sub->add_flag("--dry-run", o->q.dry_run,
                  "Make nothing: print the menus, the candidates to build (and those in WORK's cache), the feasible "
                  "size range and each target in it, the GPU memory and each stage's estimated time");
    add_json_option(sub, o->json, "What was made (files, sizes, the comparison with every stock file, the work folder)");
    return {sub, [o, bpw, size, ratio, like, sub, model_opt, threads, ggml_threads] {
        quantize_options q = o->q;
        if (model_opt->count()) {
            q.model = o->model_flag;
        }
        if (threads->count() && !ggml_threads->count()) {
            q.ggml_threads = q.threads;  // one -t for all CPU threads, as llama.cpp's tools take it
        }
        if (q.model.empty()) {
            fail("give the source model: voodoo quantize MODEL.gguf … (or -m MODEL.gguf)");
        }
        for (const char * flag : {"--prune-stages", "--build-ahead"}) {
            if (sub->count(flag) > 0 && (q.train.candidates == "all" || q.greedy_peer)) {
                fmt::print(stderr, "warning: {} has no effect with {} (every candidate is built)\n", flag,
                           q.greedy_peer ? "--greedy-peer" : "--candidates all");
            }
        }
        std::vector<std::string> cpu_defaults;
        if (q.train.device == "cpu") {
            cpu_defaults = apply_cpu_defaults(q.train, [&](const std::string & f) { return sub->count(f) > 0; }, q.ctx);
        }
        if (q.train.device != "cpu" || q.gpus > 1) {
            q.train_exe = "/proc/self/exe";  // the GPU only in the train stage's own process(es)
        }
        if (q.gpus > 1 && (q.train.device.starts_with("cuda:"))) {
            fail("--gpus {} with --device {}: the ranks take cuda:0 … cuda:{}; pass --device cuda (CUDA_VISIBLE_DEVICES "
                 "chooses which GPUs)", q.gpus, q.train.device, q.gpus - 1);
        }
        // One target or a comma list of them (a ladder).
        auto goals_of = [](const std::string & list, target_kind kind, const char * flag) {
            std::vector<target> goals;
            for (size_t a = 0; a <= list.size();) {
                const size_t e = std::min(list.find(',', a), list.size());
                std::string item = list.substr(a, e - a);
                a = e + 1;
                item.erase(0, item.find_first_not_of(" \t"));
                item.erase(item.find_last_not_of(" \t") + 1);
                if (item.empty()) {
                    continue;
                }
                if (kind == target_kind::size) {
                    goals.push_back({kind, parse_size(item, flag)});
                    continue;
                }
                try {
                    size_t used = 0;
                    const double v = std::stod(item, &used);
                    if (used != item.size() || !(v > 0)) {
                        throw std::invalid_argument(item);
                    }
                    goals.push_back({kind, v});
                } catch (const std::exception &) {
                    fail("{} '{}': expected a positive number (or a comma list of them)", flag, item);
                }
            }
            if (goals.empty()) {
                fail("{} '{}': no value", flag, list);
            }
            return goals;
        };
        if (bpw->count()) {
            q.goals = goals_of(o->target_bpw, target_kind::bpw, "--target-bpw");
        } else if (size->count()) {
            q.goals = goals_of(o->target_size, target_kind::size, "--target-size");
        } else if (ratio->count()) {
            q.goals = goals_of(o->ratio, target_kind::ratio, "--ratio");
        } else if (!like->count()) {
            fail("give one target: --target-bpw, --target-size, --ratio or --like");
        }
        if (!q.goals.empty()) {
            q.train.goal = q.goals.front();
        }
        if (q.max_slowdown >= 0 && !like->count()) {
            fail("--max-slowdown compares each file with the stock recipe of its size: give the target as --like "
                 "(e.g. --like Q4_K_M)");
        }
        apply_menu_flags(q.train.menu, o->menu, o->menu_for, q.max_slowdown >= 0);
        if (!cpu_defaults.empty()) {
            q.announce = fmt::format("cpu defaults: {} (docs/BENCHMARKS.md; give a flag to override it)",
                                     fmt::join(cpu_defaults, ", "));
        }
        q.train.should_stop = stop_on_sigint();
        q.command = command_line();
        const quantize_result r = run_quantize(q);
        if (q.dry_run) {
            write_json_to(o->json, r.plan);
            if (o->json != "-") {
                fmt::print("{}", dry_run_to_text(r.plan));
            }
            fail_if_outside_the_range(r.plan, q.model);  // a plan the run would refuse is an error: a script's check
            return 0;
        }
        if (o->json != "-") {
            fmt::print("\n{}\n", r.table);
            for (const std::string & f : r.outs) {
                fmt::print("wrote {} ({} bytes)\n", f, file_size(f));
            }
        }
        nlohmann::json files = nlohmann::json::array();
        for (const std::string & f : r.outs) {
            files.push_back({{"path", f}, {"file_bytes", file_size(f)}});
        }
        write_json_to(o->json, {{"files", files}, {"largest", r.out}, {"q8_0_ratio", r.q8_0_ratio}, {"work", r.work},
                                {"model_card", r.card}, {"eval", eval_to_json(r.eval)}});
        return 0;
    }};
}

}  // namespace

VOODOO_COMMAND(quantize, add_quantize);

}  // namespace voodoo::cli
