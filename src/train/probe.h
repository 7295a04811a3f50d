// The sensitivity probe and the measured KL of whole recipes: what a candidate costs in KL(teacher ‖ student),
// always computed in f32 (a bf16 forward rounds logits by ~2⁻⁹ of their size, a KL noise floor of ~1e-4 per
// token that hides every difference between Q6_K, Q8_0 and BF16; docs/RESULTS.md measures it).
#pragma once

#include "model/model.h"
#include "train/gated.h"

#include <torch/torch.h>

#include <string>
#include <vector>

namespace voodoo {

/// ΔKL(teacher ‖ student) of every candidate alone on `tokens` ([B, T] int64 on the weights' device):
/// [tensor][menu type], nats per token, where the student is `dense` with that one tensor replaced by the
/// candidate's ggml to_float. Runs the model in `dtype` (kFloat, the default; kBFloat16 only to measure
/// what bf16 costs) whatever its compute dtype (restored after), the vocabulary `chunk` positions at a time.
/// Shows a progress bar.
std::vector<std::vector<double>> probe_sensitivity(causal_lm & model, weight_source & dense, weight_source & teacher,
                                                   const std::vector<gated_tensor> & gated,
                                                   const torch::Tensor & tokens, torch::Device device, int64_t chunk,
                                                   torch::ScalarType dtype = torch::kFloat);

/// The identity of a probe: the candidates' bytes (every type of every menu), the probe tokens, the model's
/// tensor names and the probe's dtype, as 16 hex digits. A probe file with another identity is never reused.
std::string probe_identity(const std::vector<gated_tensor> & gated, const torch::Tensor & tokens,
                           torch::ScalarType dtype = torch::kFloat);

/// Writes the probe to `path` atomically as JSON: {"identity", "tensors": [{"name", "delta_kl": {type: nats}}]}.
void save_probe(const std::string & path, const std::string & identity, const std::vector<gated_tensor> & gated,
                const std::vector<std::vector<double>> & sens);

/// The probe stored at `path` when it exists and has `identity` and the same tensors and menus; else empty.
/// Throws voodoo::error naming the file when it exists but is not a probe file.
std::vector<std::vector<double>> load_probe(const std::string & path, const std::string & identity,
                                            const std::vector<gated_tensor> & gated);

/// Mean KL(teacher ‖ student) in nats per token on `tokens`, in f32, where every gated tensor i is its
/// candidate choice[i] (a one-hot recipe, as it will be exported) and every other tensor is `dense`'s.
/// This is what the final selection compares (the calibration validation split).
double recipe_kl(causal_lm & model, weight_source & dense, weight_source & teacher,
                 const std::vector<gated_tensor> & gated, const std::vector<int> & choice,
                 const torch::Tensor & tokens, torch::Device device, int64_t chunk);

}  // namespace voodoo
