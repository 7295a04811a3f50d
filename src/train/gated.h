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

/// The candidates of one selectable tensor: the menu's types and their exact bytes.
struct gated_tensor {
    const gguf_tensor * tensor;                 // the source tensor (shape, name)
    std::vector<ggml_type> types;               // the menu, K types
    std::vector<std::vector<uint8_t>> bytes;    // K candidates, tensor_bytes(types[k], shape) each
    torch::Tensor gate;                         // [K] f32 logits g, a leaf that requires grad (on the device)
    torch::Tensor grad_p;                       // [K] f64: last backward's ∂L/∂p_k = ⟨∂L/∂W_eff, deq(Q_k)⟩
    int n_threads = 0;                          // dequantization threads (0 = all cores)
    mixture_path path = mixture_path::cpu;
    torch::ScalarType dtype = torch::kFloat;    // of W_eff (fused: kFloat or kBFloat16, formed in that dtype)
    torch::Tensor dense;                        // reference path: [K, rows, ne0] dequantized candidates
    std::shared_ptr<void> device_bytes;         // fused path: the gpu::candidate_set (CUDA builds)
};

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

    /// p of tensor i at the current temperature, [K], differentiable in its gate.
    torch::Tensor probs(size_t i) const;

    torch::Tensor get(const std::string & name) override;
    torch::Tensor rows(const std::string & name, const torch::Tensor & ids) override;
    bool has(const std::string & name) const override;

private:
    torch::Tensor forward_probs(size_t i);

    weight_source & dense_;
    std::vector<gated_tensor> & tensors_;
    std::unordered_map<std::string, size_t> index_;
    double tau_ = 1.0;
    bool straight_through_ = false;
    uint64_t noise_seed_ = 0;
    uint64_t noise_calls_ = 0;
};

}  // namespace voodoo
