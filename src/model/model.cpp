#include "model/model.h"

#include "common/error.h"

#include <fmt/ranges.h>

namespace voodoo {

torch::Tensor causal_lm::forward(const torch::Tensor & tokens, weight_source & w) {
    return head(hidden(tokens, w), w);
}

torch::Tensor causal_lm::head(const torch::Tensor & x, weight_source & w) {
    forward_context ctx = context(w);
    return linear(ctx, head_weight(), x).to(torch::kFloat);
}

void causal_lm::set_compute_dtype(torch::ScalarType dtype) {
    if (dtype != torch::kFloat && dtype != torch::kBFloat16) {
        fail("compute dtype {} is not supported; use float32 or bfloat16", c10::toString(dtype));
    }
    dtype_ = dtype;
}

void causal_lm::check_tokens(const torch::Tensor & tokens) const {
    if (tokens.dim() != 2 || tokens.scalar_type() != torch::kLong || tokens.size(1) < 1) {
        fail("{} forward: tokens must be [batch, n_tokens] int64 with n_tokens >= 1, got {} of {}", hp_.arch,
             c10::toString(tokens.scalar_type()), fmt::format("{}", fmt::join(tokens.sizes(), ", ")));
    }
}

}  // namespace voodoo
