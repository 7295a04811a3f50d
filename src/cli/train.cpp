#include "cli/commands.h"
#include "common/error.h"
#include "data/dataset.h"
#include "dist/dist.h"
#include "export/export.h"
#include "eval/speed_table.h"
#include "ggml/quant.h"
#include "pipeline/dry_run.h"
#include "pipeline/quantize.h"
#include "train/prune.h"
#include "train/trainer.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <filesystem>

#include <memory>

namespace voodoo::cli {

namespace {

command add_train(CLI::App & app) {
    auto * sub = app.add_subcommand("train", "Learn each tensor's type under an exact byte budget; writes a recipe");
    sub->footer("examples:\n"
                "  voodoo train --model m.gguf --data data/ --target-size 300KB --out run/\n"
                "  voodoo train --model m.gguf --data data/ --imatrix m.imatrix.gguf --ratio 0.45 --out run/\n"
                "  voodoo train --model m.gguf --data data/ --target-bpw 4.5 --menu Q4_K,Q5_K,Q6_K,Q8_0 --out run/\n"
                "  voodoo train ... --out run/ --resume      # continue after Ctrl-C\n"
                "Then: voodoo export --model m.gguf --recipe run/recipe.json --out out/");
    struct options {
        std::string model, data, out, imatrix, teacher, menu, cache, target_size, json;
        std::vector<std::string> menu_for;
        std::vector<std::string> prune_for;
        double target_bpw = 0, ratio = 0;
        bool allow_requantize = false;
        bool dry_run = false;
        train_options t;
    };
    auto o = std::make_shared<options>();
    sub->add_option("--model", o->model, "Source GGUF (F32/F16/BF16; an already quantized one with --allow-requantize)")->required();
    sub->add_option("--data", o->data, "Folder written by `voodoo data`")->required();
    sub->add_option("--out", o->out, "Run directory (journal, log.jsonl, recipe.json)")->required();
    auto * bpw = sub->add_option("--target-bpw", o->target_bpw, "Budget in bits per weight over every tensor (llama-quantize's BPW)");
    auto * size = sub->add_option("--target-size", o->target_size, "Budget as the output file's size on disk: bytes, KB, MiB, GiB …");
    auto * ratio = sub->add_option("--ratio", o->ratio, "Budget as a fraction of the all-Q8_0 file (0.45 → Voodoo45)");
    bpw->excludes(size)->excludes(ratio);
    size->excludes(ratio);
    sub->add_option("--imatrix", o->imatrix, "Importance matrix (GGUF or legacy .dat) from `voodoo imatrix` or llama-imatrix")->check(CLI::ExistingFile);
    sub->add_option("--teacher", o->teacher, "Teacher GGUF (default: the model itself)");
    sub->add_option("--menu", o->menu, "Candidate types, comma-separated, or 'all' (default: IQ1_S … Q8_0, F16, BF16, without IQ4_NL, Q4_0, Q4_1, "
                    "Q5_0, Q5_1 where a 256-block type fits; 'all' and --max-token-seconds keep those too)");
    sub->add_option("--menu-for", o->menu_for, "Per-role menu 'REGEX=TYPES', e.g. 'attn_.*=Q4_K,Q5_K,Q6_K' (repeatable)");
    sub->add_option("--cache", o->cache, "Candidate cache folder (default: RUN/candidates)");
    sub->add_option("--steps", o->t.steps, "Optimizer steps")->capture_default_str();
    sub->add_option("--batch", o->t.batch, "Sequences per micro-batch")->capture_default_str();
    sub->add_option("--accum", o->t.accum, "Micro-batches per step (gradient accumulation)")->capture_default_str();
    sub->add_option("--seq", o->t.seq, "Tokens per sequence (0 = the data's chunk length)")->capture_default_str();
    sub->add_option("--lr", o->t.lr, "Peak learning rate of the gates (AdamW, cosine)")->capture_default_str();
    sub->add_option("--tau0", o->t.tau0, "Start temperature")->capture_default_str();
    sub->add_option("--tau1", o->t.tau1, "End temperature")->capture_default_str();
    sub->add_option("--lambda-kl", o->t.lambda_kl, "Weight of KL(teacher ‖ student)")->capture_default_str();
    sub->add_option("--lambda-ce", o->t.lambda_ce, "Weight of the cross-entropy on the calibration tokens")->capture_default_str();
    sub->add_option("--lambda-size", o->t.lambda_size, "Weight of the size penalty")->capture_default_str();
    sub->add_option("--size-tol", o->t.size_tol, "Dead zone of the size penalty (relative)")->capture_default_str();
    sub->add_option("--st-gumbel-fraction", o->t.st_gumbel_fraction, "Last fraction of steps with straight-through Gumbel")
        ->capture_default_str();
    sub->add_option("--routing", o->t.routing,
                    "What each token of the forward sees: mix (the mixture of the candidates) or ptqr (per-token quant "
                    "routing: one candidate drawn from the gate, straight-through backward)")
        ->capture_default_str()->check(CLI::IsMember({"mix", "ptqr"}));
    sub->add_option("--probe-sequences", o->t.probe_sequences, "Sequences for each candidate's ΔKL probe")
        ->capture_default_str();
    sub->add_option("--probe-anchors", o->t.probe_anchors,
                    "Types measured per tensor; the others are predicted from the imatrix-weighted error (0 = all; "
                    "auto = all unless the eager probe's rate says the rest would take over --probe-auto-seconds, "
                    "then 2)")
        ->default_str("auto")->transform(count_or_auto());
    sub->add_option("--probe-auto-seconds", o->t.probe_auto_seconds,
                    "With --probe-anchors auto: the longest the full probe's remaining forwards may take")
        ->capture_default_str()->check(non_negative_number());
    sub->add_option("--probe-file", o->t.probe_file, "Where the probe is kept and reused (default: RUN/probe.json)");
    sub->add_option("--select-sequences", o->t.select_sequences,
                    "Validation sequences on which the final selection measures each candidate recipe")->capture_default_str();
    sub->add_option("--prior-recipe", o->t.prior_recipes,
                    "recipe.json of a smaller budget, also a candidate of the final selection (repeatable)");
    sub->add_option("--probe-compute", o->t.probe_compute, "The probe's arithmetic: auto (tf32 on a CUDA device, f32 on the CPU), f32, tf32 (CUDA: f32 products on the tensor cores), or bf16 only to measure what bf16 costs")
        ->capture_default_str()->check(CLI::IsMember({"auto", "f32", "tf32", "bf16"}));
    sub->add_option("--compute", o->t.compute, "Training forward dtype: f32 or bf16 (default: bf16 on cuda, f32 on cpu)")
        ->check(CLI::IsMember({"f32", "bf16"}));
    sub->add_option("--gate-init", o->t.gate_init, "Start logit of the probe's allocation")->capture_default_str();
    sub->add_option("--journal-every", o->t.journal_every, "Steps between journals")->capture_default_str();
    sub->add_flag("--resume", o->t.resume, "Continue the run in --out from its journal");
    sub->add_option("--max-token-seconds", o->t.max_token_seconds,
                    "Limit on the recipe's predicted seconds per generated token (quantize --max-slowdown sets it)")
        ->check(non_negative_number());
    sub->add_option("--speed-table", o->t.speed_table,
                    "The type speed table for --max-token-seconds (default: measured once, in ~/.cache/voodoo)");
    sub->add_flag("--dry-run", o->dry_run,
                  "Make nothing: print the menus, the candidates to build (and those in the cache), the feasible size "
                  "range, the GPU memory and each stage's estimated time");
    sub->add_flag("--allow-requantize", o->allow_requantize,
                  "Accept an already quantized source (as llama-quantize): it is also the teacher");
    add_json_option(sub, o->json, "The result (recipe, bytes against the limit, the final selection's measurements)");
    sub->add_option("--device", o->t.device, "Where to train: cpu, cuda or cuda:N (CUDA builds)")->capture_default_str();
    sub->add_option("--candidates", o->t.candidates,
                    "Which candidates to build: targets (those some recipe under the targets could use: a few per tensor "
                    "probed first, the others predicted; train/prune.h) or all (every type of every menu)")
        ->capture_default_str()->check(CLI::IsMember({"targets", "all"}));
    sub->add_option("--prune-for", o->prune_for,
                    "More targets the candidates are built for (bpw=X, size=BYTES or ratio=X, comma-separated): a "
                    "ladder's other sizes, so that its sizes share their candidates and probe")->delimiter(',');
    sub->add_option("--prune-stages", o->t.prune_stages,
                    "With --candidates targets: 1 (one plan after the first probe), 2 (then the knapsack's choices and their "
                    "neighbours built and probed, and the plan made again with them known: fewer candidates to build for more "
                    "probe forwards, a gain on a GPU and a loss on the CPU), or auto (2 on a GPU, 1 on the CPU)")
        ->capture_default_str()->check(CLI::IsMember({"auto", "1", "2"}));
    add_eager_types_option(sub, o->t.eager_types);
    sub->add_option("--build-ahead", o->t.build_ahead,
                    "With --candidates targets: probe each tensor's first candidates as soon as they are built, and build "
                    "those the probe will likely keep while it ends (on, off: build, then probe, or auto: on a GPU, whose "
                    "probe leaves the cores idle)")
        ->capture_default_str()->check(CLI::IsMember({"auto", "on", "off"}));
    sub->add_option("--candidates-on", o->t.candidates_on, "Fused path: where the candidates live: gpu, host (pinned host memory, each layer moved to the GPU ahead of use) or auto (the GPU while they fit beside the teacher)")->capture_default_str()->check(CLI::IsMember({"gpu", "host", "auto"}));
    sub->add_option("--mixture", o->t.mixture, "How W_eff is formed: fused (GPU kernels; default on cuda), reference (dense candidates, plain LibTorch) or cpu");
    sub->add_option("--recompute", o->t.recompute,
                    "Activation checkpointing: each layer keeps only its input and runs again in the backward (one more "
                    "forward, far less memory): on, off, or auto (on when a GPU would not hold every layer's activations)")
        ->capture_default_str()->check(CLI::IsMember({"auto", "on", "off"}));
    sub->add_option("--loss-chunk", o->t.loss_chunk, "Positions per chunk of the CE/KL over the vocabulary: memory and speed only (the sums' rounding aside). 0 = by device: f32 logits of about 512 MB per chunk on a GPU, at most 31 MiB on the CPU")->capture_default_str();
    sub->add_option("--seed", o->t.seed, "Seed (data order, Gumbel noise)")->capture_default_str();
    sub->add_option("-t,--threads", o->t.threads, "Threads (0 = VOODOO_THREADS if set, else every core; LibTorch's OMP_NUM_THREADS when set)")->capture_default_str()->check(non_negative());
    sub->add_option("--parallel", o->t.parallel,
                    "Under torchrun (WORLD_SIZE > 1): how the ranks split the training step: tp (tensor parallelism: "
                    "every layer split, Megatron style; llama, qwen2, qwen3) or layers (contiguous layers per rank, the probe and "
                    "the selection too: each rank holds only its own layers, for a model larger than one GPU)")
        ->capture_default_str()->check(CLI::IsMember({"tp", "layers"}));
    return {sub, [o, bpw, size, ratio, sub] {
        train_options t = o->t;
        if (bpw->count()) {
            t.goal = {target_kind::bpw, o->target_bpw};
        } else if (size->count()) {
            t.goal = {target_kind::size, parse_size(o->target_size, "--target-size")};
        } else if (ratio->count()) {
            t.goal = {target_kind::ratio, o->ratio};
        } else {
            fail("give one target: --target-bpw, --target-size or --ratio");
        }
        apply_menu_flags(t.menu, o->menu, o->menu_for, t.max_token_seconds > 0);
        for (const std::string & g : o->prune_for) {
            if (!g.empty()) {
                t.prune_goals.push_back(parse_target_spec(g, "--prune-for"));
            }
        }
        for (const char * flag : {"--prune-stages", "--build-ahead"}) {
            if (sub->count(flag) > 0 && t.candidates == "all") {
                fmt::print(stderr, "warning: {} has no effect with --candidates all (every candidate is built)\n", flag);
            }
        }
        if (!t.prune_goals.empty() && t.candidates == "all") {
            fmt::print(stderr, "warning: --prune-for has no effect with --candidates all (every candidate is built)\n");
        }
        t.run_dir = o->out;
        t.cache_dir = o->cache;
        const gguf_file src(o->model);
        check_full_precision_source(src, o->allow_requantize);
        const token_data data(o->data);
        data.require_vocab_of(o->model);
        if (t.device == "cpu") {
            const auto set = apply_cpu_defaults(t, [&](const std::string & f) { return sub->count(f) > 0; }, data.train().ctx());
            if (!set.empty()) {
                fmt::print(stderr, "cpu defaults: {} (docs/BENCHMARKS.md; give a flag to override it)\n", fmt::join(set, ", "));
            }
        }
        std::unique_ptr<gguf_file> teacher;
        if (!o->teacher.empty()) {
            teacher = std::make_unique<gguf_file>(o->teacher);
        }
        importance_map importance;
        if (!o->imatrix.empty()) {
            t.export_opts = imatrix_export_options(o->imatrix, o->imatrix, src, importance);
            t.menu.has_imatrix = true;
            t.imatrix_path = o->imatrix;
        }
        if (o->dry_run) {
            dry_run_input in;
            in.src = &src;
            in.train = t;
            in.goals = {t.goal};
            in.exports = false;  // train writes the recipe; `voodoo export` makes the file
            in.imatrix = o->imatrix;
            in.cache_dir = t.cache_dir.empty() ? (std::filesystem::path(o->out) / "candidates").string() : t.cache_dir;
            in.ctx = data.train().ctx();
            in.train_chunks = data.train().n_chunks();
            const nlohmann::json plan = plan_dry_run(in);
            write_json_to(o->json, plan);
            if (o->json != "-") {
                fmt::print("{}", dry_run_to_text(plan));
            }
            fail_if_outside_the_range(plan, o->model);  // as the real run refuses it
            return 0;
        }
        if (t.max_token_seconds > 0 && t.speed_table.empty()) {
            t.speed_table = default_speed_table_path(t.threads);
        }
        t.should_stop = stop_on_sigint();
        // torchrun's ranks (issue #17): `torchrun --no-python --nproc-per-node N voodoo train …`, or a SLURM job that
        // sets the same variables. Each rank trains on cuda:LOCAL_RANK when --device cuda names no index.
        std::unique_ptr<dist::process_group> group;
        const std::optional<dist::launch_env> env = dist::launch_env_from_environment();
        if (env && env->world_size > 1) {
            if (t.device == "cuda") {
                t.device = fmt::format("cuda:{}", env->local_rank);
            }
            // Ranks may reach a collective minutes apart (a probe's share, a candidate build): PyTorch's default
            // timeout, 30 minutes, for the rendezvous and every collective.
            // NCCL on a GPU rank when the build has it (PyTorch's CUDA LibTorch), else Gloo.
            const torch::Device where = t.device.starts_with("cuda") ? torch::Device(t.device) : torch::Device(torch::kCPU);
            group = std::make_unique<dist::process_group>(*env, std::chrono::minutes(30), where);
            t.group = group.get();
            fmt::print(stderr, "rank {} of {} ({}, {}), --parallel {}, {} CPU threads\n", env->rank, env->world_size,
                       t.device, group->backend(), t.parallel, resolve_threads(t.threads));
        }
        const bool rank0 = !env || env->rank == 0;
        const train_result r = train_gates(src, teacher ? *teacher : src, data.train(),
                                           o->imatrix.empty() ? nullptr : &importance, t, &data.val());
        if (!r.finished) {
            fmt::print(stderr, "interrupted after step {}: journal written to {}/journal.pt; continue with --resume\n",
                       r.steps_done, o->out);
            return 130;
        }
        if (!rank0) {
            return 0;  // rank 0 reports and writes
        }
        if (o->json != "-") {
            fmt::print("{}", r.summary);
            fmt::print("wrote {0}/recipe.json and {0}/recipe.tensor-types.txt in {1:.1f} s\n", o->out, r.seconds);
        }
        const std::filesystem::path run(o->out);
        write_json_to(o->json, {{"recipe", (run / "recipe.json").string()},
                                {"tensor_types", (run / "recipe.tensor-types.txt").string()},
                                {"target", r.final_recipe.target}, {"total", r.total_bytes}, {"limit", r.limit_bytes},
                                // Several ranks: rank 0 writes this; bytes_on_device is rank 0's own, the rest global.
                                {"ranks", env ? env->world_size : 1},
                                {"steps", r.steps_done}, {"seconds", r.seconds}, {"device", r.device},
                                {"mixture", r.mixture}, {"routing", t.routing},
                                {"selection_tokens", {r.select_tokens_shape.first, r.select_tokens_shape.second}},
                                {"selection_held_apart", r.select_held_apart}, {"selection", selection_to_json(r)},
                                {"candidates", {{"built", r.candidates_built}, {"in_menus", r.candidates_in_menus},
                                                {"bytes_built", r.candidate_bytes_built},
                                                {"bytes_in_menus", r.candidate_bytes_in_menus},
                                                {"bytes_on_device", r.candidate_device_bytes}}}});
        return 0;
    }};
}

}  // namespace

VOODOO_COMMAND(train, add_train);

}  // namespace voodoo::cli
