// `voodoo quantize`: the whole chain in one command — data → imatrix → train → export → eval beside the
// stock recipes — each stage resumable (a finished stage is not redone).
#pragma once

#include "eval/eval.h"
#include "train/trainer.h"

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace voodoo {

struct quantize_options {
    std::string model;                      // source GGUF
    std::vector<std::string> texts;         // calibration text files
    std::string eval_text;                  // held-out text for the comparison ("" = the first calibration text)
    std::string like;                       // a stock recipe whose file size is the target, or a comma list of them
                                            // (a ladder: one file per size); "" = goals or train.goal
    std::vector<target> goals;              // targets of a ladder (one file per target); empty = train.goal
    std::string out;                        // output GGUF ("" = WORK/<model>.Voodoo<NN>.gguf); a ladder: a folder
    std::string out_dir;                    // folder for the output file(s) ("" = WORK, or --out's folder in a ladder)
    std::string work;                       // work folder: data/, imatrix.gguf, run-<label>/, baselines/, eval.*
    std::string imatrix;                    // an imatrix the user has (GGUF or legacy .dat): no imatrix stage
    bool allow_requantize = false;          // accept an already quantized source (llama-quantize's --allow-requantize):
                                            // it is then also the teacher, and every KLD is measured against it
    bool greedy_peer = false;               // also export the measured-sensitivity greedy knapsack at every size
                                            // (<model>.greedy[.<label>].gguf) and compare it (bench/greedy_peer)
    std::string baselines = "nearest";      // "nearest", "all-that-fit", "none" or a comma list of recipe names
    int64_t ctx = 512;                      // calibration chunk length
    int64_t imatrix_chunks = 128;           // train chunks the imatrix sees; -1 = all
    int eval_ctx = 512;
    int eval_chunks = -2;                   // -1 = every chunk of the eval text; -2 = auto (apply_eval_defaults: 40,
                                            // fewer above 0.5 G weights, at least 8); 40 × 256 scored tokens give a
                                            // mean KLD within ~1% (its stderr), and the eval is libllama on the CPU
    double max_slowdown = -1;               // ≥ 0: each file's predicted generation time per token at most (1 + this) ×
                                            // that of the stock recipe of its size (--like; speed_table.h); < 0: off
    int speed_reps = -1;                    // llama-bench pp512/tg128 runs per compared file (eval_options::speed_reps);
                                            // -1 = auto (apply_eval_defaults: 5, fewer above 0.5 G weights, at least 1)
    bool reference_speed = true;            // also the source's speed (auto: only up to 0.5 G weights)
    /// "auto", "on", "files" or "off". on: score the reference and the likely stock files on the eval text while the
    /// train stage runs, at idle priority (quantize.cpp, eval_ahead; the numbers are the eval's own). files: only make
    /// the stock files, once the train stage's candidates are built (its training steps leave the cores idle). auto:
    /// with a GPU device and at least 8 cores, files when libllama has a GPU to evaluate on, else on; off on the CPU
    /// device (eval_ahead_mode says what was measured).
    std::string eval_ahead = "auto";
    int threads = 0;                        // LibTorch and quantization threads; 0 = every core (on the cpu device: by model size, ggml_threads_for)
    int ggml_threads = 0;                   // libllama threads (imatrix, eval); 0 = by model size (ggml_threads_for)
    train_options train;                    // goal, menus, schedule (run_dir is WORK/run-<label>)
    std::string command;                    // the command line that asked for this (recorded in the model card)
    std::string announce;                   // a line printed once the options pass their checks (the CLI's cpu defaults)
    /// When set (the CLI sets it to itself for --device cuda), the train stage runs as `train_exe train …` in a
    /// child process: the GPU is initialized there only and its memory is given back when training ends, before
    /// this process's libllama work (eval) loads models. (A crash first blamed on libllama sharing a process with
    /// CUDA was libtorch.so's own std::filesystem::remove_all: common/file.h, remove_tree.)
    std::string train_exe;
    /// Ranks of the train stage on this host (issue #17): > 1 runs `train_exe train … --parallel P` as that many
    /// processes with torchrun's variables (RANK = LOCAL_RANK = 0 … gpus − 1, WORLD_SIZE, MASTER_ADDR 127.0.0.1, a free
    /// MASTER_PORT), each on cuda:LOCAL_RANK (with --device cuda) or the CPU; rank 0's output on stderr, the others' in
    /// <run>/rank<N>.log. Needs train_exe.
    int gpus = 1;
    bool dry_run = false;                   // make nothing: plan_dry_run's report in quantize_result::plan
};

/// libllama's threads (and LibTorch's, training on the CPU) for a model of `n_weights` weights when --ggml-threads
/// (--threads) is 0: one below 8M weights, where
/// each decode is so short that ggml's thread barriers (one per collected matmul) cost more than a second
/// thread gains and spin on a shared machine (docs/DATA.md), else every core. Measured on the 2-core machine:
/// mix30M's imatrix 49 s on 1 thread, 35 s on 2; its eval 1.4k tok/s on 1 thread (docs/BENCHMARKS.md).
int ggml_threads_for(int64_t n_weights);

struct quantize_result {
    std::string out;                        // the largest file of a ladder
    std::vector<std::string> outs;          // every file, by increasing size
    size_t file_bytes;
    double q8_0_ratio;
    eval_result eval;                       // empty files when baselines == "none" and no eval ran
    std::string table;                      // the final comparison table (markdown)
    std::string card;                       // the model card written beside the files (README.md)
    std::string work;                       // the work folder it used
    nlohmann::json plan;                    // a dry run's report (plan_dry_run, and "finished_runs": the targets'
                                            // WORK/run-<label>/recipe.json that exist, when any); null otherwise
    std::string eval_ahead;                 // what the eval ahead did ("" when it did not run: eval_ahead_runs)
};

/// The source must be full precision (F32, F16, BF16 in every selectable tensor), since Voodoo's candidates and its
/// teacher are made from it: a quantized one is refused naming a tensor and --allow-requantize, or, with
/// allow_requantize, accepted with a warning on stderr that it is also the teacher.
void check_full_precision_source(const gguf_file & src, bool allow_requantize);

/// Checks every option against the source model before anything is made (no file, no folder): texts and files
/// exist, counts are in range, recipe and type names exist, the device is one this build has, the source is full
/// precision, every --menu-for pattern names a tensor, and every --target-bpw/--target-size/--ratio is within what
/// the menus can reach (the range printed in bytes, MiB and BPW). Prints a warning naming the tensors a --menu
/// leaves at their source type. Throws voodoo::error naming the flag or file and what would work.
void check_quantize_options(const quantize_options & opts, const gguf_file & src);

/// The eval's auto defaults for a model of `n_weights` weights (issue #16: the eval of an 8B model must not dominate
/// the job): libllama evaluates on the CPU at a cost ∝ weights × tokens, so above 0.5 G weights the chunks and the
/// llama-bench runs per file shrink in proportion, keeping the eval's work near that of 40 chunks and 5 runs of a
/// 0.5 G model: chunks = clamp(round(40 · 0.5 G / n), 8, 40), runs = clamp(round(5 · 0.5 G / n), 1, 5). So 40 and
/// 5 up to 0.5 G, 12 and 1 for 1.7 G, 8 and 1 for 8 G (8 chunks: the mean KLD's stderr ≈ 2.2% instead of ≈ 1%).
/// With auto runs, the source's own speed is measured only up to 0.5 G weights (its BF16 tg128 on the CPU is the
/// eval's slowest part: 25 s of the 118 s at the Qwen3-1.7B shape, docs/BENCHMARKS.md).
/// Only the fields that are auto (-2 chunks, -1 runs) change; returns true when one did.
bool apply_eval_defaults(quantize_options & o, int64_t n_weights);

/// Runs the chain (with opts.dry_run, only checks the options and returns the plan: pipeline/dry_run.h; nothing is
/// made, save a Hugging Face folder's conversion, which reading the model needs). Each stage keeps a record of what made it (pipeline/stages.h): a re-run with other texts,
/// --ctx, --seed, --imatrix-chunks, model, imatrix or training options re-does that stage and every stage after it,
/// saying so in one line; a new target in the same work folder trains beside the earlier ones (WORK/run-<label>).
/// A ladder (several targets) shares data, imatrix, candidates and the probe; its sizes train
/// in increasing order (WORK/run-<label>), each also choosing among the smaller sizes' recipes, so a larger
/// file never measures worse on the validation split; the curve against every stock file it compares with is
/// written as WORK/curve.{md,json,png}. Throws voodoo::error from any stage, naming it; what finished stays in WORK.
quantize_result run_quantize(const quantize_options & opts);

/// Waits for the child processes `pids` (a stage's child: `voodoo train` or `voodoo imatrix` on a GPU, or torchrun-style
/// ranks) and returns each one's waitpid status, in the order of `pids`. While they run, `stop` (the job's stop test,
/// may be empty) is asked every 100 ms; once it is true, each child still running gets one SIGINT, the clean stop it
/// would get from a terminal's Ctrl-C, which signals the whole foreground process group. A SIGINT sent to this process
/// alone (`kill -INT`, a script or scheduler stopping the job) reached only the parent before, and the child trained on
/// to its end. `on_exit(i, status)` (optional) runs as each child ends, in the order they end.
std::vector<int> wait_children(const std::vector<int> & pids, const std::function<bool()> & stop,
                               const std::function<void(size_t, int)> & on_exit = {});

}  // namespace voodoo
