// The sensitivity probe and the measured KL of whole recipes: what a candidate costs in KL(teacher ‖ student),
// always computed in f32 (a bf16 forward rounds logits by ~2⁻⁹ of their size, a KL noise floor of ~1e-4 per
// token that hides every difference between Q6_K, Q8_0 and BF16; docs/RESULTS.md measures it).
#pragma once

#include "model/model.h"
#include "imatrix/imatrix.h"
#include "train/gated.h"

#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

namespace voodoo {

namespace dist {
struct layer_pipeline;
}

/// ΔKL(teacher ‖ student) of every candidate alone on `tokens` ([B, T] int64 on the weights' device):
/// [tensor][menu type], nats per token, where the student is `dense` with that one tensor replaced by the
/// candidate's ggml to_float. Runs the model in `dtype` (kFloat, the default; kBFloat16 only to measure
/// what bf16 costs) whatever its compute dtype (restored after), the vocabulary `chunk` positions at a time.
/// Shows a progress bar.
/// `measure` (optional, [tensor][menu type]): only the pairs marked true are measured, the others are NaN
/// (predict_from_anchors fills them); with none marked, no forward runs.
/// A candidate of layer l's tensor ("blk.l.…") runs only layers l … n_layer − 1 and the head, from `dense`'s residual
/// stream entering layer l (computed once, kept for every `stride`-th layer, the least stride that keeps those
/// streams, f32 [B, T, n_embd] each, within `stream_bytes`; a candidate then starts at the kept layer below its own);
/// a head of its own (output.weight, untied) runs only the head. The same arithmetic as a whole forward
/// (causal_lm::hidden_layers), so the same ΔKL bit for bit (tests/test_arch.cpp, every architecture), in about
/// half the time on a model whose layers outweigh its head.
///
/// `pipe` (layer sharding over several processes, issue #17): every rank of pipe->pg calls this with the same
/// arguments, and each candidate's forward runs rank to rank: its tensor's rank starts it (from its own kept stream
/// entering that layer; the first rank from the tokens, the last alone for an untied head), each later rank runs its
/// layers on the stream it receives and passes it on, and the last rank computes the KL; one all-reduce then gives
/// every rank every value. A rank reads only the weights and candidates of its own layers (layer_pipeline::uses), so
/// a teacher larger than one device can be probed; each keeps the streams of its own layers within `stream_bytes`.
/// The same operations on the same values as one process: the same ΔKL bit for bit (tests/test_dist.cpp).
/// `stop` (optional; Ctrl-C): asked before each candidate's forward; once true, voodoo::stopped is thrown (the
/// eager probe of an 8B model takes minutes: docs/BENCHMARKS.md). With `pipe`, a rank that stops leaves the others
/// to the launcher, which stops them (quantize --gpus).
/// `ready` (optional, one process only): called with i before tensor i's first measured forward, and never before
/// the streams are computed; the caller may fill gated[i]'s bytes and hashes then (a tensor's candidates built while
/// the earlier tensors are measured: issue #16), and the probe reads gated[i]'s bytes only after it. Throws
/// voodoo::error when given with a pipeline of several ranks.
/// `name` names the probe in the message of a stop ("the eager probe", "the second stage's probe").
std::vector<std::vector<double>> probe_sensitivity(causal_lm & model, weight_source & dense, weight_source & teacher,
                                                   const std::vector<gated_tensor> & gated,
                                                   const torch::Tensor & tokens, torch::Device device, int64_t chunk,
                                                   torch::ScalarType dtype = torch::kFloat,
                                                   const std::vector<std::vector<bool>> * measure = nullptr,
                                                   int64_t stream_bytes = int64_t(2) << 30,
                                                   const dist::layer_pipeline * pipe = nullptr,
                                                   const std::function<bool()> & stop = {},
                                                   const std::function<void(size_t)> & ready = {},
                                                   const char * name = "the probe");

/// The share of a whole forward's matrix weights that probe_sensitivity runs for a candidate of `tensor` in `file`:
/// its layer and every later one, and the head (output.weight, or token_embd.weight when the head is tied), over all
/// layers and the head; 1 for a tensor outside the layers but the head, the head's share for an untied head. The
/// layer streams' stride is not counted (every layer's stream kept). What the dry run's probe estimate multiplies a
/// whole forward by (pipeline/dry_run.cpp): on the 8B shape the probe's forward measured 0.304 s at 2 × 512 tokens on
/// an H100, about half a whole one (docs/BENCHMARKS.md, session 28).
double probe_forward_share(const gguf_file & file, const std::string & tensor);

/// The importance-weighted squared error of every candidate, [tensor][menu type]:
///   E_k = Σ_rows Σ_j a_j · (W_ij − deq(Q_k)_ij)²,
/// W the source weights (`dense`), a the tensor's imatrix importance (per input column, per expert for 3-D
/// tensors; 1 where `importance` has no entry). This is the quantity llama.cpp's quantizers minimize
/// (ggml-quants.c, quant_weights), and, with the Fisher's Kronecker factorization F ≈ E[ggᵀ] ⊗ E[xxᵀ] whose
/// input factor the imatrix's diagonal is, the second-order ΔKL of candidate k is c_t · E_k up to the
/// output factor c_t, which is the same for every type of one tensor. Exact 0 for a candidate equal to the
/// source. Computed on `device` in f32 (f64 sums).
/// With `pipe` (layer sharding, issue #17) a rank computes the entries of the tensors it owns
/// (layer_pipeline::owner_of) and reads no other tensor's weights, and one all-reduce, which adds only zeros to each
/// entry, gives every rank every entry: the single process's values bit for bit.
std::vector<std::vector<double>> weighted_errors(weight_source & dense, const std::vector<gated_tensor> & gated,
                                                 const importance_map * importance, torch::Device device,
                                                 const dist::layer_pipeline * pipe = nullptr);

/// Of `live` (indices into e, each e > 0), n spread evenly in log e: targets evenly spaced in log e from the largest to
/// the least (n = 1: the largest), each taking the nearest index not yet taken. Every index (largest e first) when
/// n ≤ 0 or n ≥ live.size(). The anchors of anchor_plan and the eager types of train/prune.h.
std::vector<size_t> spread_in_log_error(std::vector<size_t> live, const std::vector<double> & e, int n);

/// Which candidates an anchored probe measures, [tensor][menu type]: per tensor, `n_anchors` block types spread
/// evenly in log E over those with E > 0 (the one of largest E always; with n ≥ 2 the one of least E). Float
/// types (F16/BF16/F32) are anchors only in a menu without block types: one that differs from a float source
/// in a few rounded values has a ΔKL below the probe's resolution. Types with E = 0 (the source's own bytes)
/// are never measured (ΔKL 0). n_anchors ≤ 0: every type with E > 0.
std::vector<std::vector<bool>> anchor_plan(const std::vector<gated_tensor> & gated,
                                           const std::vector<std::vector<double>> & err, int n_anchors);

/// Fills the unmeasured entries of `sens` (NaN) from the measured ones of the same tensor: ΔKL_k = r(E_k) · E_k,
/// where r = ΔKL/E is interpolated between the two measured types nearest in E (log r linear in log E when both
/// ratios are positive, else r linear in log E) and held constant beyond the measured range; E_k = 0 gives 0.
/// Throws voodoo::error naming the tensor when an entry with E > 0 has no measured type to predict it from.
void predict_from_anchors(const std::vector<gated_tensor> & gated, const std::vector<std::vector<double>> & err,
                          std::vector<std::vector<double>> & sens);

/// The identity of a probe: the candidates' bytes (every type of every menu, each by its xxh3-64: gated_tensor::hashes), the probe tokens, the model's
/// tensor names, the probe's dtype and its anchors per tensor (0 = all), and whether its f32 products ran in TF32, as 16 hex digits. A probe file with another identity is never reused.
std::string probe_identity(const std::vector<gated_tensor> & gated, const torch::Tensor & tokens,
                           torch::ScalarType dtype = torch::kFloat, int anchors = 0, bool tf32 = false);

/// While alive, lets CUDA's f32 matrix products run on the tensor cores in TF32 (inputs rounded to a 10-bit
/// mantissa, f32 accumulation: PyTorch's allow_tf32 for cuBLAS) when `on`, and restores the previous setting when it
/// ends; with `on` false it changes nothing. Process-wide (a LibTorch global), so only for one thread's work at a
/// time. The probe's `--probe-compute tf32` (issue #16: the f32 probe's forwards are the GPU's longest stage at 8B);
/// docs/BENCHMARKS.md measures what it does to the ΔKL against f32.
class tf32_matmul_scope {
public:
    explicit tf32_matmul_scope(bool on);
    ~tf32_matmul_scope();
    tf32_matmul_scope(const tf32_matmul_scope &) = delete;
    tf32_matmul_scope & operator=(const tf32_matmul_scope &) = delete;
private:
    bool on_;
    bool saved_ = false;
};

/// Writes the probe to `path` atomically as JSON: {"identity", "tensors": [{"name", "delta_kl": {type: nats},
/// "measured": [types]}]}; "measured" lists the types a forward measured (the others were predicted or are the
/// source's own bytes), every type when `measured` is null.
void save_probe(const std::string & path, const std::string & identity, const std::vector<gated_tensor> & gated,
                const std::vector<std::vector<double>> & sens,
                const std::vector<std::vector<bool>> * measured = nullptr);

/// The probe stored at `path` when it exists and has `identity` and the same tensors and menus; else empty.
/// Throws voodoo::error naming the file when it exists but is not a probe file.
std::vector<std::vector<double>> load_probe(const std::string & path, const std::string & identity,
                                            const std::vector<gated_tensor> & gated);

/// What `--probe-anchors auto` (the default) decided: 0 = every kept type measured, else the anchors per tensor.
struct probe_anchor_choice {
    int anchors = 0;
    double seconds_per_forward = 0;  // the eager probe's wall time per candidate forward (NaN when unknown)
};

/// `--probe-anchors auto` (issue #16): after the eager probe (train/prune.h) has measured `eager_forwards` candidates
/// in `eager_seconds`, the full probe measures the `rest` kept ones too when that takes at most `limit_seconds` at the
/// same rate (a forward's cost depends on the model and the tokens, not on the type), else the `eager` types of each
/// tensor are its anchors and the others are predicted from their imatrix-weighted error (predict_from_anchors; on
/// mix30M that costs nothing measurable from Q4_K_M's size up and ≤ 3.7% of validation KL below, docs/RESULTS.md).
/// The rate is kept at `path` (JSON, written atomically when `write`, with `identity`, the eager probe's), so a run
/// that reuses the eager probe (a ladder's next size, --resume) decides as the first did; with eager_seconds < 0 and
/// no such file, the rate is unknown and the anchors are taken (the fast choice). Seconds; `rest` ≥ 0. Throws
/// voodoo::error naming the file when it exists and is not such a file.
probe_anchor_choice resolve_probe_anchors(const std::string & path, const std::string & identity, double eager_seconds,
                                          int64_t eager_forwards, int64_t rest, int eager, double limit_seconds, bool write);

/// Mean KL(teacher ‖ student) in nats per token on `tokens`, in f32, where every gated tensor i is its
/// candidate choice[i] (a one-hot recipe, as it will be exported) and every other tensor is `dense`'s.
/// This is what the final selection compares (the calibration validation split).
/// `pipe` (layer sharding, issue #17): every rank calls this with the same arguments; the teacher's and the recipe's
/// forwards run rank to rank, each rank reading only its own layers' weights and candidates, the last computes the KL
/// and every rank returns it: one process's value bit for bit.
double recipe_kl(causal_lm & model, weight_source & dense, weight_source & teacher,
                 const std::vector<gated_tensor> & gated, const std::vector<int> & choice,
                 const torch::Tensor & tokens, torch::Device device, int64_t chunk,
                 const dist::layer_pipeline * pipe = nullptr);

}  // namespace voodoo
