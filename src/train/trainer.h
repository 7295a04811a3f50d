// Gate training (`voodoo train`): learns, for every selectable tensor, which candidate it deserves,
// under an exact byte budget, then finalizes a recipe (DESIGN.md "The math").
#pragma once

#include "export/recipe.h"
#include "ggml/gguf.h"
#include "train/budget.h"
#include "train/candidates.h"
#include "train/gated.h"

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

namespace voodoo {

namespace dist {
class process_group;
}

class token_file;

/// Written in the run folder (train_options::run_dir) once the train stage's candidates are built, before the
/// training: the tensors, the build's seconds, and the candidates built in memory only (no room in the cache's
/// disk). voodoo quantize's eval ahead waits for it before deciding whether the stock files still fit on the disk.
inline constexpr const char * k_candidates_built_file = "candidates.built.json";

struct train_options {
    target goal;
    menu_options menu;
    std::string run_dir;                // journal, log.jsonl, recipe.json, recipe.tensor-types.txt
    std::string cache_dir;              // candidate cache ("" = <run_dir>/candidates)
    std::string imatrix_path;           // recorded in the recipe ("" = none)
    export_options export_opts;         // the imatrix metadata export will write (imatrix_export_options),
                                        // so the budget counts the exact header
    int steps = 200;                    // optimizer steps
    int batch = 4;                      // sequences per micro-batch
    int accum = 1;                      // micro-batches per optimizer step (gradients really accumulate)
    int seq = 0;                        // tokens per sequence (0 = the token file's chunk length)
    double lr = 0.05;                   // AdamW peak learning rate on the gate logits, cosine to lr · lr_final
    double lr_final = 0.1;
    double weight_decay = 0.0;
    double tau0 = 1.0, tau1 = 0.01;     // p = softmax(g/τ), τ geometric from τ0 to τ1
    double lambda_kl = 1.0;             // L = λ_CE·CE + λ_KL·KL(teacher‖student) + λ_size·relu(|B/B*−1| − tol)²
    double lambda_ce = 1.0;
    double lambda_size = 1000.0;
    double size_tol = 0.005;
    double st_gumbel_fraction = 0.0;    // last fraction of steps with straight-through Gumbel hardening
    std::string routing = "mix";        // "mix" or "ptqr": what each token of the forward sees (gated.h routing_mode);
                                        // ptqr excludes st_gumbel_fraction > 0
    int probe_sequences = 8;            // sequences on which each candidate's ΔKL alone is measured
    int probe_anchors = -1;             // types measured per tensor, the rest predicted from the imatrix-weighted
                                        // error (anchor_plan); 0 = every type; -1 = auto: every type unless the
                                        // eager probe's rate says the rest would take over probe_auto_seconds
                                        // (probe.h resolve_probe_anchors; every type without candidate pruning)
    double probe_auto_seconds = 120;    // auto's limit on the full probe's remaining forwards (seconds)
    std::string probe_file;             // where the probe is kept and reused ("" = <run_dir>/probe.json); the ladder
                                        // of `voodoo quantize` shares one between its sizes
    int select_sequences = 16;          // validation sequences on which the final selection measures each recipe
    std::vector<std::string> prior_recipes; // recipe.json files of smaller budgets (a ladder): also candidates of
                                        // the final selection, so a larger budget never measures worse
    std::string compute;                // "f32" or "bf16": the training forward ("" = bf16 on CUDA, f32 on the CPU);
                                        // the selection always runs in f32
    // The probe's arithmetic (resolved_probe_compute): auto (tf32 on a CUDA device, f32 on the CPU), f32, tf32, or bf16
    // only to measure what bf16 costs.
    std::string probe_compute = "auto";
    double gate_init = 3.0;             // the start allocation's gate logit (the others start at 0)
    int journal_every = 50;             // steps between journals (and one at the end)
    bool resume = false;                // continue from <run_dir>/journal.pt
    uint64_t seed = 42;
    int threads = 0;                    // 0 = every core
    std::string device = "cpu";         // "cpu", "cuda" or "cuda:N" (CUDA builds): where the student trains
    std::string mixture;                // "fused", "reference" or "cpu" ("" = fused on CUDA, cpu on the CPU)
    std::string candidates = "targets"; // "targets": build only the candidates some recipe under the targets could use
                                        // (train/prune.h); "all": every type of every menu
    std::vector<target> prune_goals;    // the targets "targets" keeps candidates for (empty = goal alone): a ladder's
                                        // every size, so that its sizes share one set of candidates and one probe
    std::string build_ahead = "auto";   // "on": while the eager probe runs, build the candidates it will likely keep
                                        // (prune.h build_ahead_jobs) on the otherwise idle cores; "off"; "auto": on
                                        // when training on a GPU (on the CPU the probe itself takes the cores)
    std::string prune_stages = "auto";  // with candidates "targets": "1" (one plan after the eager probe), "2" (then the
                                        // knapsack's choices and their neighbours built, measured, and planned again:
                                        // prune.h stage_types), or "auto" (resolved_prune_stages)
    std::string eager_types = "cheap";  // with candidates "targets": which types are built and probed first: "cheap"
                                        // (the fast quantizers, ≥ 20 M weights/s a core, when they span the menu's
                                        // low end: Q3_K and Q8_0) or "fast" (every non-lattice type: Q2_K and Q8_0,
                                        // before session 37); prune.h prune_options::eager_max_cost
    std::string candidates_on = "auto"; // fused path: "gpu", "host" (pinned, streamed ahead of use) or "auto" (the GPU
                                        // while they fit beside the teacher; gated.h candidate_residency)
    int64_t loss_chunk = 0;             // positions per chunk of the CE/KL over the vocabulary (0 = default_loss_chunk: ~512 MB of logits on a GPU, ≤ 31 MiB on the CPU)
    std::string recompute = "auto";     // activation checkpointing (blocks.h run_layer): "on", "off", or "auto": on when
                                        // the training forward's activations would not fit the GPU (resolve_recompute)
    double max_token_seconds = 0;       // > 0: the final recipe's predicted generation time per token (speed_table.h)
                                        // may not exceed this; recipes over it are left out of the final selection
                                        // and the speed-constrained exact knapsack is added (quantize --max-slowdown)
    std::string speed_table;            // the type speed table's file (load_or_measure_type_speeds) with it
    /// Several processes (issue #17): the ranks of `group` (torchrun's, dist::launch_env_from_environment) train one
    /// student together, `parallel` saying how: "tp" (tensor parallelism: every layer split over the ranks, Megatron
    /// style; llama, qwen2, qwen3) or "layers" (layer sharding: contiguous layers per rank, balanced by bytes). Every
    /// rank reads the same data, builds the candidates, runs the probe and the final selection; the training step is
    /// split, the gate gradients summed over the ranks, so every rank holds the same gates; rank 0 alone writes the
    /// run directory (log, journal, probe, recipe). The journal holds whole gates, so a run resumes with any number of
    /// ranks. null: one process.
    dist::process_group * group = nullptr;
    std::string parallel = "tp";
    /// Asked after every step; true stops the run after writing a journal (Ctrl-C uses it too).
    std::function<bool(int step)> should_stop;
};

struct train_result {
    recipe final_recipe;
    bool finished;                      // false when should_stop interrupted the run (then only steps_done and
                                        // limit_bytes are filled: no selection is made, the journal is saved)
    int steps_done;
    double total_bytes;                 // the budgeted quantity of the final recipe (file or tensor bytes)
    double limit_bytes;
    double seconds;
    std::string summary;                // the table printed at the end
    /// The final selection: each candidate recipe's measured KL on the validation chunks, the chosen one first.
    struct selection_entry {
        std::string name;               // "trained", "probe-exact" or a prior recipe's path
        double val_kl;                  // mean KL(teacher ‖ recipe), nats per token, f32
        double estimated;               // Σ probe ΔKL of its choices
        double bytes;                   // the budgeted quantity
    };
    std::vector<selection_entry> selection;
    std::pair<int64_t, int64_t> select_tokens_shape{0, 0};  // sequences × tokens the selection measured
    bool select_held_apart = false;     // the validation split (else the probe's sequences)
    std::string device;                 // where it trained, and how the mixture was formed
    std::string mixture;
    int64_t candidate_device_bytes = 0; // what the candidates took on the device (0 on the cpu path)
    int64_t candidates_built = 0;       // (tensor, type) pairs built and trained, of
    int64_t candidates_in_menus = 0;    //   every type of every menu (equal with --candidates all)
    double candidate_bytes_built = 0, candidate_bytes_in_menus = 0;
    int64_t candidate_host_bytes = 0;   // host-resident candidates' pinned bytes (fused path, candidates_on)
    candidate_stream_stats stream_stats; // what their stream copied
};

/// The final selection as written to RUN/selection.json (and `voodoo train --json`): [{recipe, val_kl,
/// probe_estimate, bytes}], the chosen recipe first.
nlohmann::json selection_to_json(const train_result & r);

/// Every candidate's bytes of `menus` (menu order), quantized on `threads` cores (0 = all) through `cache`,
/// with a progress bar, and each one's xxh3-64 (gated_tensor::hashes). `keep` (optional): the tensors whose
/// candidates this process builds or reads and holds; the others get empty bytes and hashes 0, which the caller fills
/// (a layer-sharded rank, issue #17: it reads and holds the candidates of its own layers only, the other hashes come
/// from their owners). Throws voodoo::error naming the tensor when llama.cpp's quantizer refuses a type.
/// `stop` (optional; Ctrl-C: train_options::should_stop): asked before each candidate; once true, the threads finish
/// the candidates in progress (each is in the cache, as every one built before) and voodoo::stopped is thrown, saying
/// how many were built. An 8B model's candidates take a quarter of an hour (docs/BENCHMARKS.md, issue #16).
std::vector<gated_tensor> build_candidates(const gguf_file & src, const std::vector<tensor_menu> & menus,
                                           const importance_map * importance, const candidate_cache & cache,
                                           int threads, const std::function<bool(const std::string &)> & keep = {},
                                           const std::function<bool()> & stop = {});

/// The defaults for `--device cpu`, where one forward of a 30M-weight model runs about 1,000× slower than on
/// an H200 and a run must still take minutes (docs/BENCHMARKS.md, "One size of mix30M on the CPU"): the probe on
/// 2 sequences, measuring 2 types per tensor and predicting the rest (bench/probe_anchors: 0.6% mean knapsack
/// regret on mix30M); 40 training steps of 2 × 128 tokens; the final selection on 8 sequences; pruning in one stage
/// (the second's probe forwards cost more there than the building they save). Each is set only where given(flag) is
/// false: "--probe-sequences", "--probe-anchors", "--steps", "--batch", "--seq", "--select-sequences",
/// "--prune-stages". Returns the flags it set, for the run's log.
/// `ctx`: the calibration chunk length (the training sequences are at most 128 tokens and at most ctx).
std::vector<std::string> apply_cpu_defaults(train_options & o, const std::function<bool(const std::string &)> & given,
                                            int64_t ctx);

/// The probe's arithmetic for --probe-compute `probe_compute` on --device `device`: "auto" is "tf32" on a CUDA device
/// ("cuda", "cuda:N") and "f32" on the CPU; any other value is returned as given. TF32 (f32 products on the tensor
/// cores, inputs rounded to a 10-bit mantissa) measured on mix30M's learned weights, every candidate of the default
/// menu: |ln(ΔKL_tf32 / ΔKL_f32)| median 0.0008, the Q8_0 candidates' median 0.27 (their ΔKL, ~1e-7, is near TF32's
/// rounding), and the exact knapsack on the TF32 values within 0.0014% of the f32 one's Σ ΔKL at 40 budgets; the same
/// three files as the f32 probe; the probe's forwards 2.7× as fast on an H100 (docs/BENCHMARKS.md, session 29).
std::string resolved_probe_compute(const std::string & probe_compute, const std::string & device);

/// The stages of candidate pruning for --prune-stages `mode` ("1", "2" or "auto") on --device `device`: "auto" is 2 on
/// a CUDA device, whose probe measures a candidate in a fraction of its build's time while the cores build others
/// (Qwen3-1.7B shape, one H100 host: 0.11 s a forward, the train stage 414.0 → 352.5 s), and 1 on the CPU, where the
/// probe and the build share the cores and a forward costs far more than the build it saves (mix30M on 2 cores: 1.8 s
/// a forward against 0.14 s a candidate; docs/BENCHMARKS.md, session 32). Throws voodoo::error naming the flag for
/// another value.
int resolved_prune_stages(const std::string & mode, const std::string & device);

/// The torch device of a --device value: "cpu", "cuda" or "cuda:N". Throws voodoo::error naming the flag
/// when the value is malformed, or when CUDA is asked of a build or machine without it.
torch::Device parse_train_device(const std::string & s);

/// Where the fused path keeps each gated tensor's candidates on `device` (issue #18), decided before any work: the
/// GPU holds the teacher's matrices in bf16 (`teacher_bytes`), a reserve for activations (the larger of 16 GiB and a
/// fifth of the device; docs/BENCHMARKS.md has measured peaks) and the GPU-resident candidates; with
/// candidates_on "auto" the largest tensors go to pinned host memory until the rest fit (host_resident_plan).
struct residency_plan {
    std::vector<bool> on_host;      // [menus.size()]
    std::vector<int64_t> bytes;     // each tensor's candidate bytes, Σ over its menu
    int64_t host_bytes = 0;         // of those on the host
    int64_t all_bytes = 0;
    int64_t device_bytes = 0;       // the GPU's memory (0: not a CUDA device)
    int64_t reserve = 0;
    bool teacher_fits = true;       // teacher_bytes + reserve ≤ device_bytes
};
/// `device_bytes`: the GPU's memory (device_total_memory; 0 for the CPU: nothing is planned).
/// `tp_rank` of `tp_size` > 1 (tensor parallelism, issue #17): each tensor counts the bytes of that rank's shards of
/// its candidates (dist::tp_shard_ne), what the rank holds on its device for training (the dry run's per-rank plan;
/// for the probe a tensor-parallel rank places whole candidates, which is what the trainer plans with).
residency_plan plan_residency(const std::vector<tensor_menu> & menus, const std::string & candidates_on,
                              int64_t device_bytes, int64_t teacher_bytes, int tp_rank = 0, int tp_size = 1);

/// The training forward's saved activations, estimated: 6 bytes × tokens of a micro-batch × Σ (ne0 + rows) of the
/// gated matrices the rank multiplies (`io_per_token`), the rule dry_run's memory plan uses (fitted to the measured
/// Qwen3-0.6B step; the whole Llama-3-8B shape measured 3.5 bytes: docs/BENCHMARKS.md), in bytes.
int64_t activation_bytes_estimate(int64_t tokens, int64_t io_per_token);

/// The same activations with each layer recomputed in the backward (activation checkpointing): every layer's input,
/// tokens × n_embd in bf16 (2 bytes), plus one layer's share of `all_layers_bytes` (activation_bytes_estimate), in
/// bytes. n_layer ≥ 1.
int64_t activation_bytes_recomputed(int64_t tokens, int64_t n_embd, int64_t n_layer, int64_t all_layers_bytes);

/// Whether training recomputes each layer in the backward (activation checkpointing): `mode` "on" or "off" as given;
/// "auto": on when the device is a GPU (`free_bytes` > 0: its memory less the teacher's weights, the candidates on it
/// and the loss's logits) and activation_bytes_estimate exceeds free_bytes; never on the CPU (free_bytes = 0).
/// Throws voodoo::error naming --recompute for another mode.
bool resolve_recompute(const std::string & mode, int64_t activation_bytes, int64_t free_bytes);

/// Checks a --device name ("cpu", "cuda", "cuda:N") against this build without touching the GPU, so that a
/// parent process can refuse it at once and leave CUDA to its training child. Whether cuda:N exists is known
/// only once CUDA starts (parse_train_device). Throws voodoo::error naming the flag.
void check_device_name(const std::string & s);

/// Trains the gates of `src` on `train` chunks with `teacher` as the distillation target (usually src
/// itself) and writes the run directory. `importance` (optional) is the imatrix's per-tensor importance.
/// Throws voodoo::error before any work for an impossible target, a menu type no tensor takes, a token
/// file of another vocabulary, a journal of another run; during training, for a NaN/inf loss (naming the
/// step and tensor; the last good journal is kept).
/// `val` (optional): chunks held apart from training (`voodoo data`'s val split) on which the final
/// selection measures each candidate recipe; without it, the probe's chunks are used.
train_result train_gates(const gguf_file & src, const gguf_file & teacher, const token_file & train,
                         const importance_map * importance, const train_options & opts,
                         const token_file * val = nullptr);

}  // namespace voodoo
