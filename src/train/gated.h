// The gated student: every selectable tensor is W_eff = Σ_k softmax(g/τ)_k · deq(Q_k(W)), where Q_k(W)
// are the exact candidate bytes and deq is ggml's to_float. Candidates stay in their quantized bytes;
// each is dequantized when the mixture is formed and again in backward, so no K dense copies live on.
#pragma once

#include "ggml/gguf.h"
#include "model/weights.h"

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace voodoo {

/// How W_eff and ∂L/∂p are computed (the same function three ways).
enum class mixture_path {
    cpu,        // host bytes, ggml's to_float on the CPU in forward and again in backward (no dense copies)
    fused,      // CUDA builds: bytes resident on the GPU, the fused kernels of src/cuda/gpu.h
    reference,  // plain LibTorch ops on K dense dequantized candidates ([K, rows, ne0] on the device): the
                // oracle of the fused path, and the baseline of bench/train_step; any device
};

/// "cpu", "fused", "reference" → the path; throws voodoo::error naming the flag value otherwise.
mixture_path parse_mixture_path(const std::string & s);
std::string mixture_path_name(mixture_path p);

/// What each token of the student's forward sees (issue #22).
enum class routing_mode {
    mix,   // the mixture W_eff = Σ_k p_k · deq(Q_k), for every token
    ptqr,  // per-token quant routing: each token is routed to one candidate drawn from p, so the forward only
           // sees weights that can be deployed; the backward is straight-through, as if mixed
};

/// "mix" or "ptqr" → the mode; throws voodoo::error naming --routing otherwise.
routing_mode parse_routing(const std::string & s);

/// The candidates of one selectable tensor: the menu's types and their exact bytes.
struct gated_tensor {
    const gguf_tensor * tensor;                 // the source tensor (shape, name)
    std::vector<ggml_type> types;               // the menu, K types
    std::vector<std::vector<uint8_t>> bytes;    // K candidates, tensor_bytes(types[k], shape) each; empty where a
                                                // layer-sharded rank does not hold them (build_candidates' keep)
    std::vector<uint64_t> hashes;               // K xxh3-64 of the bytes (build_candidates; empty: hash the bytes)
    torch::Tensor gate;                         // [K] f32 logits g, a leaf that requires grad (on the device)
    torch::Tensor grad_p;                       // [K] f64: last backward's ∂L/∂p_k = ⟨∂L/∂W_eff, deq(Q_k)⟩
    int n_threads = 0;                          // dequantization threads (0 = all cores)
    mixture_path path = mixture_path::cpu;
    torch::ScalarType dtype = torch::kFloat;    // of W_eff (fused: kFloat or kBFloat16, formed in that dtype)
    torch::Tensor dense;                        // reference path: [K, rows, ne0] dequantized candidates
    std::shared_ptr<void> device_bytes;         // fused path: the gpu::candidate_set (CUDA builds)
    std::shared_ptr<void> stream;               // host-resident fused candidates: the gpu::candidate_stream that
    size_t stream_id = 0;                       // moves them to the GPU when used, and their id there
};

/// Where the fused path keeps the candidates' bytes (issue #18).
enum class candidate_residency {
    gpu,   // resident on the GPU for the whole run (the fastest, when they fit)
    host,  // pinned host memory, each tensor's candidates moved to the GPU ahead of use (gpu::candidate_stream)
    automatic,  // on the GPU while they fit beside the teacher and the activations, the largest tensors on the host
};
/// "gpu", "host", "auto" → the residency; throws voodoo::error naming --candidates-on otherwise.
candidate_residency parse_candidate_residency(const std::string & s);

/// What a candidate stream did (gpu::candidate_stream::counters), for logs and benchmarks.
struct candidate_stream_stats {
    int64_t uses = 0, misses = 0, copies = 0, bytes_copied = 0, peak_resident_bytes = 0, host_bytes = 0;
};

/// The stream that moves host-resident candidates to `device` (CUDA builds), `lookahead` tensors ahead of use
/// (gpu.h candidate_stream: the order of use is learned from the first step). Throws voodoo::error without CUDA.
std::shared_ptr<void> make_candidate_stream(torch::Device device, int lookahead);
candidate_stream_stats candidate_stream_statistics(const std::shared_ptr<void> & stream);

/// The total memory of a CUDA device in bytes (0 for the CPU or a build without CUDA).
int64_t device_total_memory(torch::Device device);

/// Which gated tensors' candidates live in pinned host memory (true) rather than on the GPU, for `mode`, given each
/// tensor's candidate bytes (Σ over its menu): gpu → none, host → all, automatic → the largest tensors first until
/// the rest fit in `gpu_bytes_for_candidates`. [candidate_bytes.size()].
std::vector<bool> host_resident_plan(const std::vector<int64_t> & candidate_bytes, candidate_residency mode,
                                     int64_t gpu_bytes_for_candidates);

/// The fused path with t's candidates in pinned host memory, registered with `stream` (make_candidate_stream), which
/// moves them to the GPU when the mixture or the gate gradient needs them. The same numbers as place_candidates'
/// fused path (the same bytes, the same kernels). Returns the pinned host bytes. Throws as place_candidates does.
int64_t place_candidates_on_host(gated_tensor & t, torch::Device device, torch::ScalarType w_dtype,
                                 const std::shared_ptr<void> & stream);

/// Moves the candidates of `t` to `device` for `path`: fused uploads the quantized bytes (CUDA builds only;
/// the host bytes are kept for export and the probe); reference dequantizes every candidate with ggml on the
/// CPU and keeps them dense in `dense_dtype`; cpu keeps the host bytes. Returns the device bytes the
/// candidates now take. Throws voodoo::error when the path needs CUDA this build lacks, or a type has no
/// GPU dequantizer (fused).
/// `source` (fused path, optional): the tensor's own weights as bf16 [rows, ne0] on `device` (the GPU
/// teacher's copy of the same file): BF16 and F16 candidates bit-identical to what it gives read it instead
/// of a copy (gpu::upload says how this is checked), and their bytes are not counted.
int64_t place_candidates(gated_tensor & t, mixture_path path, torch::Device device, torch::ScalarType w_dtype,
                         torch::ScalarType dense_dtype, const torch::Tensor & source = torch::Tensor());

/// deq(Q_k) of t as [rows, ne0] f32 on the path's device (the probe's single-candidate weights).
torch::Tensor candidate_weights(const gated_tensor & t, size_t k, torch::Device device);

/// W_eff = Σ_k p_k · deq(Q_k) as a [ne1, ne0] f32 tensor, differentiable in p ([K] f32). Backward gives
/// ∂L/∂p_k = ⟨∂L/∂W_eff, deq(Q_k)⟩ (DESIGN.md), computed by dequantizing each candidate again, and stores
/// it in t.grad_p. Works for 2-D tensors; 3-D tensors are flattened to [ne1·ne2, ne0].
torch::Tensor gated_mixture(const torch::Tensor & p, gated_tensor & t);

/// Rows ids ([n] int64) of the mixture, [n, ne0] f32: only those rows of each candidate are dequantized
/// (the token embedding of a batch). Same gradient rule, over the rows used.
torch::Tensor gated_mixture_rows(const torch::Tensor & p, const torch::Tensor & ids, gated_tensor & t);

/// n routes drawn from p ([K], f32 or f64, any device; entries ≥ 0 summing to 1 within rounding): [n] int64 on the
/// CPU, route i = k with probability p_k. The same categorical draw as Gumbel-argmax (argmax_k log p_k + G_ik), made
/// by inversion with one uniform per route: u_i = (53 bits of mt19937_64(seed)) · 2⁻⁵³, route i = the first k with
/// u_i < Σ_{j≤k} p_j / Σ_j p_j. A candidate with p_k = 0 is never drawn. The same seed gives the same routes on
/// every machine (the generator and the 53-bit conversion are fixed by the C++ standard, not by the library).
torch::Tensor draw_routes(const torch::Tensor & p, int64_t n, uint64_t seed);

/// PTQR's product of x with the gated tensor t: token i ([..., ne0] flattened to n rows) gets
/// y_i = x_i · deq(Q_{routes[i]})ᵀ, each candidate's tokens in one matrix product with the candidate formed from its
/// bytes (on the path's device; the fused path's dequantization kernel on a GPU). The backward is straight-through:
/// ∂L/∂x_i = G_i · w and ∂L/∂w = Σ_i G_iᵀ x_i, so that through w = W_eff = Σ_k p_k deq(Q_k),
/// ∂L/∂p_k = Σ_i ⟨G_iᵀ x_i, deq(Q_k)⟩ — the mixing path's gradients at the routed forward (issue #22).
/// x [..., ne0] and w [ne1, ne0] in one dtype on one device; routes [n] int64 on the CPU, each in [0, K).
/// Returns [..., ne1] in x's dtype. Throws voodoo::error when shapes or routes disagree with t.
torch::Tensor routed_product(const torch::Tensor & x, const torch::Tensor & w, const torch::Tensor & routes,
                             gated_tensor & t);

/// PTQR's embedding lookup: row i of the result ([n, ne0], the path's dtype and device) is row ids[i] of candidate
/// routes[i], exactly. Backward as gated_mixture_rows (straight-through): ∂L/∂p_k = Σ_i ⟨G_i, deq(Q_k)[ids[i]]⟩,
/// stored in t.grad_p. ids and routes [n] int64. Throws voodoo::error for a row or route out of range.
torch::Tensor routed_rows(const torch::Tensor & p, const torch::Tensor & ids, const torch::Tensor & routes,
                          gated_tensor & t);

/// The student's weight_source: gated tensors answer with their mixture at the current temperature, every
/// other tensor comes from `dense` (norms, biases, tensors without a menu).
class gated_weights : public weight_source {
public:
    gated_weights(weight_source & dense, std::vector<gated_tensor> & tensors);

    /// τ of p = softmax(g / τ).
    void set_temperature(double tau) { tau_ = tau; }
    double temperature() const { return tau_; }
    /// Straight-through Gumbel hardening: forward uses one-hot argmax((g + Gumbel)/τ), backward the soft
    /// probabilities. `seed` makes the noise reproducible (it changes every call of next_noise).
    void set_straight_through(bool on, uint64_t seed);
    /// Per-token quant routing (routing_mode::ptqr) or the mixture. `seed` makes the routes reproducible (each
    /// product and embedding lookup draws new ones: draw_routes with a seed derived from it and a call count).
    void set_routing(routing_mode mode, uint64_t seed);

    /// p of tensor i at the current temperature, [K], differentiable in its gate.
    torch::Tensor probs(size_t i) const;

    torch::Tensor get(const std::string & name) override;
    torch::Tensor rows(const std::string & name, const torch::Tensor & ids) override;
    /// Gated 3-D tensors: only experts `ids` of the mixture are formed (gated_mixture_rows over their rows), and the
    /// gate gradient sums over those experts only; the rest as weight_source::experts.
    torch::Tensor experts(const std::string & name, const torch::Tensor & ids) override;
    bool has(const std::string & name) const override;
    /// Under PTQR, gated tensors answer each token with its routed candidate (routed_product); else x · wᵀ.
    torch::Tensor product_with(const std::string & name, const torch::Tensor & x, const torch::Tensor & w) override;
    /// {Gumbel noise draws, route draws} made so far under the current seeds (weight_source::draw_state).
    std::vector<uint64_t> draw_state() const override { return {noise_calls_, route_calls_}; }
    void set_draw_state(const std::vector<uint64_t> & state) override;

private:
    torch::Tensor forward_probs(size_t i);
    uint64_t next_route_seed() { return route_seed_ * 0xD1B54A32D192ED03ull + route_calls_++; }

    weight_source & dense_;
    std::vector<gated_tensor> & tensors_;
    std::unordered_map<std::string, size_t> index_;
    double tau_ = 1.0;
    bool straight_through_ = false;
    uint64_t noise_seed_ = 0;
    uint64_t noise_calls_ = 0;
    routing_mode routing_ = routing_mode::mix;
    uint64_t route_seed_ = 0;
    uint64_t route_calls_ = 0;
};

}  // namespace voodoo
