#include "model/model.h"

#include "common/error.h"

#include <fmt/ranges.h>

namespace voodoo {

torch::Tensor causal_lm::forward(const torch::Tensor & tokens, weight_source & w) {
    return head(hidden(tokens, w), w);
}

torch::Tensor causal_lm::hidden_layers(const torch::Tensor & tokens, const torch::Tensor & input, int64_t first,
                                       int64_t end, weight_source & w) {
    if (first < 0 || end > hp_.n_layer || first >= end) {
        fail("layers [{}, {}): a range of layers inside [0, {}) is needed", first, end, hp_.n_layer);
    }
    if (!input.defined() && first != 0) {
        fail("layers [{}, {}): a range that does not start at layer 0 needs the hidden states entering layer {}", first,
             end, first);
    }
    if (input.defined() && (input.dim() != 3 || input.size(0) != tokens.size(0) || input.size(1) != tokens.size(1) ||
                            input.size(2) != hp_.n_embd)) {
        fail("layers [{}, {}): the input hidden states are [{}], expected [{}, {}, {}]", first, end,
             fmt::join(input.sizes(), ", "), tokens.size(0), tokens.size(1), hp_.n_embd);
    }
    struct reset {
        causal_lm & m;
        ~reset() {
            m.range_input_ = torch::Tensor();
            m.range_first_ = 0;
            m.range_end_ = -1;
        }
    } guard{*this};
    range_input_ = input;
    range_first_ = first;
    range_end_ = end;
    return hidden(tokens, w);
}

torch::Tensor causal_lm::head(const torch::Tensor & x, weight_source & w) {
    forward_context ctx = context(w);
    return linear(ctx, head_weight(), x).to(torch::kFloat);
}

void causal_lm::set_tensor_parallel(const tensor_parallel * tp) {
    if (tp_ != nullptr) {
        fail("{} model: tensor parallelism is already set (rank {} of {})", hp_.arch, tp_->rank(), tp_->size());
    }
    if (tp == nullptr || tp->size() == 1) {
        return;  // one rank: the whole model, no communication
    }
    const int n = tp->size();
    if ((hp_.arch != "llama" && hp_.arch != "qwen2" && hp_.arch != "qwen3") || hp_.n_expert > 0) {
        fail("tensor parallelism over {} ranks: architecture '{}'{} is not split yet (llama, qwen2 and qwen3 are); "
             "train it on one GPU or with layer sharding", n, hp_.arch, hp_.n_expert > 0 ? " with experts" : "");
    }
    for (const auto & [key, value] : {std::pair{"attention.head_count", hp_.n_head},
                                      std::pair{"attention.head_count_kv", hp_.n_head_kv}}) {
        if (value % n != 0) {
            fail("tensor parallelism over {} ranks: {}.{} = {} is not a multiple of {}; use a number of ranks that "
                 "divides it", n, hp_.arch, key, value, n);
        }
    }
    if (hp_.n_ff < n) {
        fail("tensor parallelism over {} ranks: {}.feed_forward_length = {} gives some rank no FFN width; use fewer ranks",
             n, hp_.arch, hp_.n_ff);
    }
    hp_.n_head /= n;
    hp_.n_head_kv /= n;
    const auto [ff_first, ff_end] = tp_range_of("blk.0.ffn_up.weight", hp_.n_ff, tp->rank(), n);
    hp_.n_ff = ff_end - ff_first;
    tp_ = tp;
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
