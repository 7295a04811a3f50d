// Candidates for the targets (issue #16): build only the (tensor, type) pairs that some recipe under the run's
// targets could use, instead of every type of every menu. The default menu costs ≈ 3.3 core-µs per weight to
// quantize (≈ 6 min for 1.7 G weights on 16 cores), three quarters of it in llama.cpp's lattice quantizers (IQ1_S …
// IQ3_S: 1.5–7 M weights/s per core, against 8–45 M for the K-quants and legacy types and 290 M for Q8_0;
// bench_quant's quantize_1core, docs/BENCHMARKS.md), and an 8B model's whole menu is ≈ 90 GB of candidates. The steps:
//   1. Ê: every menu type's importance-weighted error, measured on a sample of each tensor's rows
//      (sampled_weighted_errors: ggml_quantize_chunk of those rows, so the same quantizer as the candidate's). The
//      lattice types' part is measured beside step 2's build (error_split), while their grids build on their own
//      threads (ggml/quant.h lattice_warmup): those take ≈ 32 core-s, 19 s of it IQ1's, one after the other.
//   2. The eager types: per tensor, a few fast (non-lattice) types spread in log Ê, built in full and measured by
//      the probe (eager_types).
//   3. Every other type's ΔKL predicted from Ê and the measured ratios ΔKL/Ê of its tensor (the anchored probe's
//      second-order model, probe.h predict_from_anchors) and given a band [margin · prediction, prediction / margin].
//      At every target, a type is kept when, for some ΔKL in the bands, it is its tensor's Lagrangian choice
//      (least ΔKL + λ · bytes) at some multiplier λ the budget can have (the λ that fits the budget with the lower
//      bounds, the predictions and the upper bounds), and so is the exact knapsack's choice on the predictions
//      with its `neighbours` on either side in the menu; the eager types are kept too (plan_pruning).
//   While the probe of step 2 runs on a GPU, the idle cores build a guess at step 3's types (build_ahead_jobs, with
//   trainer.h's build_ahead), so that the build after the probe finds them in the cache.
//   4. (--prune-stages 2, the default on a GPU) The knapsack's choice of every tensor on the predictions and its
//      neighbours (stage_types) are built and probed (the cores meanwhile building the rest of step 3's keeps,
//      likeliest first), and the plan is made again with them known, the others predicted from the eager types as
//      before, in the band of stage_margin. A known competitor leaves the band on one side of each comparison instead
//      of both, so the second plan keeps fewer: against a full probe at 40 budgets, the quantizers' work of what is
//      built falls from 42.1% to 35.9% of the menus' on mix30M and from 86.3% to 75.9% on stories260K, and the
//      exact knapsack's best choice is never pruned on either (the one-stage plan prunes it at 2 budgets of
//      stories260K; docs/BENCHMARKS.md, session 32).
// What pruning may change, and what it may not: a pruned type is never the best at any multiplier the budget can
// have unless its true ΔKL lies outside its band, and the pruned run's exact knapsack uses the full menus' byte grid
// (budget.h share_grid), so it is the full menus' knapsack whenever that one's choice is kept. tests/test_prune.cpp
// checks, on mix30M's learned weights at 41 budgets with every candidate built and probed, that the exact knapsack of
// the kept types is the full menus'. The trained recipe can still differ: training moves fewer gates (the final
// selection then measures both it and the knapsack's), and with an anchored probe (--probe-anchors N) the eager types
// are the anchors, not the types spread in exact error, so the predictions of the others differ
// (docs/BENCHMARKS.md measures both on mix30M and stories260K).
#pragma once

#include "ggml/gguf.h"
#include "imatrix/imatrix.h"
#include "train/budget.h"

#include <ggml.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace voodoo {

struct prune_options {
    int eager = 2;                  // types per tensor built before the probe (spread in log Ê; ≥ 1)
    // The eager types are chosen among the fast types that cost at most this (quantize_cost_per_weight, µs per
    // weight on one core) when `eager` of them have Ê > 0; ≤ 0: among every fast type. The default, 1/20 (20 M
    // weights/s), leaves out Q2_K (8.1 M/s with an imatrix), which was every 256-block tensor's eager type of largest
    // error, for Q3_K (27.5 M/s): the eager build is on the critical path of the job, and Q2_K was 11% of the 1.7B
    // shape's kept build (docs/BENCHMARKS.md, session 37: the prune study with both anchors).
    double eager_max_cost = 1.0 / 20;
    // … and only when the cheap types' largest Ê is at least 1/eager_reach of the fast types' largest, so that the
    // eager types still span the menu's low end (Q3_K's Ê is ≈ 0.3 of Q2_K's; a menu whose cheap types are only
    // Q6_K and Q8_0 keeps its dearer low-bit anchor).
    double eager_reach = 8;
    double margin = 0.5;            // an unbuilt type's ΔKL lies in [margin, 1/margin] × its prediction (0 < margin ≤ 1)
    // The second stage (stage_types; docs/BENCHMARKS.md, session 32): the knapsack's choice and `stage_width` menu
    // types on each side of it measured, then the plan made again with every unmeasured type's ΔKL in [stage_margin,
    // 1/stage_margin] × its prediction: a band of 3 on each side covers the worst prediction measured on either model
    // with learned weights (|ln| 1.08 on stories260K, 0.56 on mix30M), and a width of 2 keeps the exact knapsack's
    // choices that are not its tensor's Lagrangian choice at any multiplier (width 1 pruned two on mix30M).
    int stage_width = 2;
    double stage_margin = 1.0 / 3.0;
    // The second plan's band from the second stage's own errors (stage_band_margin; docs/BENCHMARKS.md, session 38):
    // exp(∓ stage_error_scale × the largest |ln(measured / predicted)| of the staged types), never wider than
    // stage_margin's nor narrower than stage_margin_narrowest's. 0: stage_margin alone (the rule before session 38).
    double stage_error_scale = 1.5;
    double stage_margin_narrowest = 0.5;
    int neighbours = 1;             // menu types kept on each side of every knapsack choice
    double widen = 1.0;             // the budget's multiplier range (plan_pruning) is widened by this factor each way
    int64_t min_sample_rows = 32;   // Ê samples max(min_sample_rows, rows / sample_divisor) rows of each tensor
    int64_t sample_divisor = 128;   //   (every row when the tensor has fewer)
    size_t min_menu = 5;            // a tensor whose menu has fewer types keeps them all
};

/// The quantizers' work that `--candidates targets` builds (the eager, staged and kept candidates), as a share of every
/// menu type's: measured against full probes at 40 budgets each (docs/BENCHMARKS.md), 28.2% on mix30M (session 38's
/// band) and 75.9% on stories260K (session 32), whose small menus keep most of their types; the Qwen3-1.7B shape's
/// default job built ≈ 34% (session 39, random weights). The dry run's likely range for its candidates stage, which
/// it cannot narrow before the probe has run: measured shares, not a bound (a model of tiny tensors builds them all).
inline constexpr double k_pruned_work_share_low = 0.28, k_pruned_work_share_high = 0.76;

/// True for the types whose llama.cpp quantizer searches a lattice (ggml_quantize_init initializes its grid:
/// IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S; ggml.c). They are the slow ones to build.
bool lattice_quantizer(ggml_type type);

/// One core's time to quantize one weight to `type`, in µs, with an imatrix: bench_quant's quantize_1core on the
/// 2-core development machine (docs/BENCHMARKS.md; the H200 host's 16 threads measure 1.3–2× slower, in about the
/// same ratios). Only for ordering work (build_candidates' schedule); 0.002 for the float types (a conversion).
double quantize_cost_per_weight(ggml_type type);

/// Ê[tensor][menu type]: the importance-weighted squared error Σ_rows Σ_j a_j (W_ij − deq(Q_k)_ij)² (probe.h
/// weighted_errors) estimated on evenly spaced rows (R/n per sampled row, R the rows, n the sample): each sampled
/// row quantized alone by ggml_quantize_chunk with its expert's importance (a_j = 1 without an imatrix entry), as
/// quantize_tensor quantizes it. 0 for the source's own type (its bytes are copied). Rows quantize independently in
/// every llama.cpp type, so a sampled row's bytes are those of the full candidate's row: Ê is exact when every row
/// is sampled. `only` ([tensor][menu type], may be null) limits the work to its true entries (the others stay 0).
/// Runs on `n_threads` (0 = every core) with a progress bar. With `cache_dir` (the candidate cache's folder), each
/// value is kept in `<cache_dir>/errors/<xx>/<key>.err` (the value and its XXH3 checksum, written atomically) and read
/// back by a later run instead of quantizing the rows again (a resumed or re-targeted job: the lattice types' part took
/// 23.8 s of 16 cores at the Qwen3-1.7B shape, session 38), the key an XXH3-128 of what decides it: the sampled rows'
/// values, their importance, the type, the row scale and llama.cpp's commit. A missing or damaged file is measured
/// again. Throws voodoo::error naming the tensor when its imatrix entry has the wrong length (importance_for).
std::vector<std::vector<double>> sampled_weighted_errors(const gguf_file & src, const std::vector<tensor_menu> & menus,
                                                         const importance_map * importance, const prune_options & o,
                                                         int n_threads = 0,
                                                         const std::vector<std::vector<bool>> * only = nullptr,
                                                         const std::string & cache_dir = "");

/// The split of sampled_weighted_errors' work that lets the lattice types' grids build meanwhile (issue #16), so
/// that the eager types are chosen and built before the lattice types' Ê is known: `first` every type without a
/// lattice grid, and every type of a tensor whose menu has no non-lattice block type; `later` the rest (lattice types
/// only). [tensor][menu type].
struct error_split {
    std::vector<std::vector<bool>> first, later;
    /// After `first` is measured (err_hat): the entries of `later` that eager_types needs too, moved out of it. They
    /// are a tensor's lattice types when none of its non-lattice block types has Ê > 0 (eager_types then chooses
    /// among every block type). With them measured, eager_types chooses what it would choose on the whole Ê.
    std::vector<std::vector<bool>> needed_now(const std::vector<tensor_menu> & menus,
                                              const std::vector<std::vector<double>> & err_hat);
};
error_split split_for_lattice_grids(const std::vector<tensor_menu> & menus);

/// The eager types, [tensor][menu type]: o.eager types among the non-lattice block types with Ê > 0 (the lattice and
/// float types when there are none), spread evenly in log Ê from the largest, as anchor_plan spreads the probe's
/// anchors; among those of them that cost at most o.eager_max_cost to quantize when o.eager of them do and the largest
/// Ê among those is within o.eager_reach of the largest (with the default menu on a 256-multiple row: Q3_K, Q6_K and
/// Q8_0, so Q3_K and Q8_0 where Q2_K and Q8_0 were before session 37).
std::vector<std::vector<bool>> eager_types(const std::vector<tensor_menu> & menus,
                                           const std::vector<std::vector<double>> & err_hat, const prune_options & o);

struct prune_plan {
    std::vector<std::vector<bool>> keep;            // [tensor][menu type]: built and trained
    std::vector<std::vector<double>> predicted;     // [tensor][menu type]: measured ΔKL, or the prediction (nats/token)
    int64_t kept = 0, total = 0;                    // candidates
    double kept_bytes = 0, total_bytes = 0;         // their bytes
};

/// Which candidates to build: `measured` holds the probe's ΔKL of the eager types ([tensor][menu type], NaN where
/// not measured); every other type is predicted from `err_hat` (predict_from_anchors) with the band of o.margin;
/// `budgets` are the targets' budgets over the same menus (a ladder's every size), `also` types that must stay (a
/// prior recipe's; same shape, may be empty). Keeps every type of a menu shorter than o.min_menu, the eager types, every type that is its tensor's Lagrangian
/// choice for some ΔKL in the bands at some multiplier of a budget (widened by o.widen), and the exact knapsack's
/// choice on the predictions with its o.neighbours on each side. `anchors` (optional, same shape as `measured`): the
/// measured ΔKL the predictions are made from, when only some of `measured` should be (the second stage predicts from
/// the eager types alone, as the first, and takes its own measurements as known: with them as anchors too the
/// predictions between them were measured worse on stories260K, docs/BENCHMARKS.md). Throws voodoo::error naming the
/// tensor when one of its types cannot be predicted (no eager type measured).
prune_plan plan_pruning(const std::vector<tensor_menu> & menus, const std::vector<std::vector<double>> & err_hat,
                        const std::vector<std::vector<double>> & measured, const std::vector<std::vector<bool>> & eager,
                        const std::vector<budget> & budgets, const std::vector<std::vector<bool>> & also,
                        const prune_options & o, const std::vector<std::vector<double>> * anchors = nullptr);

/// What to build while the probe of the eager types runs (issue #16; candidate_prefetch): the types plan_pruning
/// keeps when every tensor's ratio ΔKL/Ê is the same (the eager types' "measured" ΔKL taken as their Ê), so the
/// prediction the probe will sharpen per tensor, less the eager types already built; the likeliest keeps first (by
/// their distance in the menu from the exact knapsack's choice on the guess, the nearest at any budget), and among
/// equals the lattice types, then the largest tensors (the slow ones early). [tensor index, menu type index] pairs. A guess: what it builds and the
/// probe does not keep costs idle cores and cache disk only, and what it misses is built after the probe as before.
/// `unknown` (optional, [tensor][menu type]): types whose Ê is not measured yet (IQ1's while its grid builds): never
/// in the guess, nor chosen by its knapsack (their ΔKL taken as beyond any budget's reach).
std::vector<std::pair<size_t, size_t>> build_ahead_jobs(const std::vector<tensor_menu> & menus,
                                                        const std::vector<std::vector<double>> & err_hat,
                                                        const std::vector<std::vector<bool>> & eager,
                                                        const std::vector<budget> & budgets,
                                                        const std::vector<std::vector<bool>> & also,
                                                        const prune_options & o,
                                                        const std::vector<std::vector<bool>> * unknown = nullptr);

/// The second stage of a staged plan (issue #16; `--prune-stages 2`): which kept candidates to build and measure
/// before planning again. At every budget, the exact knapsack's choice on `p.predicted` and its `width` neighbours on
/// each side in the menu (ordered by size), where `p` keeps them, less those already measured (`measured` not NaN)
/// and the source's own type. Measured, they are known exactly in the second plan_pruning (no band), and they become
/// anchors of the predictions of the types between them, so the second plan keeps only the types that can still beat
/// known values: the band of the first plan is [margin, 1/margin] on both sides of a comparison, that of the second
/// on one. [tensor][menu type].
std::vector<std::vector<bool>> stage_types(const std::vector<tensor_menu> & menus, const prune_plan & p,
                                           const std::vector<std::vector<double>> & measured,
                                           const std::vector<budget> & budgets, int width);

/// The second plan's band (--prune-stages 2) as a margin (an unmeasured type's ΔKL in [margin, 1/margin] × its
/// prediction), from what the second stage measured: E = the largest |ln(measured[i][k] / first.predicted[i][k])| over
/// the `staged` types ([tensor][menu type]) that are not `eager`, i.e. how far the eager types' predictions missed on
/// this model, and margin = exp(−clamp(o.stage_error_scale · E, ln(1/o.stage_margin_narrowest), ln(1/o.stage_margin))).
/// A model whose predictions hold (mix30M: E ≈ 0.3) gets a narrower band and builds less; one whose predictions are
/// poor (stories260K) keeps the widest, stage_margin. Against the full probes of both models at 40 budgets each, scale
/// 1.5 prunes no best choice and builds 28.2% of mix30M's menus' work instead of 35.4% (docs/BENCHMARKS.md, session
/// 38; bench/probe_anchors --stage-error-scale). o.stage_error_scale ≤ 0, or no staged type measured: o.stage_margin.
/// `first`: the first plan (its predictions from the eager types); `measured`: NaN where not measured (nats/token).
/// With `why`, what set E: the staged type that missed most and the median miss (the log's band line; a single noisy
/// type, e.g. a tiny ΔKL read through TF32, widens the band as much as a model whose predictions all miss).
struct stage_band_miss {
    int64_t types = 0;             // staged, not eager, measured and predicted > 0: the misses E is the largest of
    double largest = 0, median = 0;  // |ln(measured / predicted)|
    std::string tensor;            // the largest's tensor and type, its ΔKL measured and predicted (nats/token)
    ggml_type type = GGML_TYPE_COUNT;
    double measured = 0, predicted = 0;
};
double stage_band_margin(const std::vector<tensor_menu> & menus, const prune_plan & first,
                         const std::vector<std::vector<double>> & measured, const std::vector<std::vector<bool>> & staged,
                         const std::vector<std::vector<bool>> & eager, const prune_options & o,
                         stage_band_miss * why = nullptr);

/// Adds `also` ([tensor][menu type]) to `p.keep` and counts p.kept and p.kept_bytes again (the second stage's
/// measured candidates stay in the menus whatever the second plan keeps: they are built).
void keep_also(const std::vector<tensor_menu> & menus, prune_plan & p, const std::vector<std::vector<bool>> & also);

/// Orders `jobs` ([tensor index, menu type index] pairs) the likeliest keeps first: by their distance in the menu
/// (ordered by size) from the exact knapsack's choice on `predicted` ([tensor][menu type], nats/token) at the nearest
/// of `budgets`, then the lattice types (the slow ones), then the larger tensors; stable. build_ahead_jobs' order, and
/// the second stage's build ahead (--prune-stages 2).
void order_likeliest_first(const std::vector<tensor_menu> & menus, const std::vector<std::vector<double>> & predicted,
                           const std::vector<budget> & budgets, std::vector<std::pair<size_t, size_t>> & jobs);

/// The menus with only the kept types (order kept).
std::vector<tensor_menu> pruned_menus(const std::vector<tensor_menu> & menus, const std::vector<std::vector<bool>> & keep);

/// Parses a target as target::str() writes it: "bpw=4.5", "size=304352", "ratio=0.45". Throws voodoo::error
/// naming `flag`.
target parse_target_spec(const std::string & s, const std::string & flag);

}  // namespace voodoo
