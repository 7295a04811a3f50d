// Reference logits from libllama itself: the numbers stock llama.cpp serves for a model and tokens.
// The parity check compares the LibTorch forward against these; evaluation reuses the same calls.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

struct llama_model;

namespace voodoo {

/// A GGUF loaded by libllama on the CPU (weights as stored, no GPU offload), for tokenizing text and
/// computing the logits of every position of a token sequence.
class llama_reference {
public:
    /// Throws voodoo::error naming the path, with libllama's complaint, when libllama cannot load it.
    /// `n_threads` 0 = all cores.
    explicit llama_reference(const std::string & path, int n_threads = 0);
    ~llama_reference();
    llama_reference(const llama_reference &) = delete;
    llama_reference & operator=(const llama_reference &) = delete;

    int32_t n_vocab() const;
    /// Token ids of `text` with the model's own tokenizer (llama_tokenize); `add_special` adds BOS/EOS as
    /// the model's metadata asks.
    std::vector<int32_t> tokenize(const std::string & text, bool add_special = true) const;

    /// Logits of every position of one sequence starting at position 0: [tokens.size(), n_vocab] f32,
    /// row-major. One llama_decode in a fresh context with n_batch = n_ubatch = n_ctx ≥ tokens, K/V cache
    /// in F32 and flash attention off, so that nothing is rounded that the weights do not round.
    /// Throws voodoo::error when tokens is empty, an id is out of range, or llama_decode fails.
    std::vector<float> logits(std::span<const int32_t> tokens) const;

    /// logits(tokens), and the experts a mixture-of-experts model routed each token to: per MoE layer in graph order,
    /// [tokens.size() · n_expert_used] int32 token-major (row t = the ids of its experts, largest weight first), as
    /// build_moe_ffn's `ffn_moe_topk-<il>` node holds them (captured with the eval callback). Empty for a dense model.
    std::vector<float> logits(std::span<const int32_t> tokens, std::vector<std::vector<int32_t>> & experts) const;

private:
    std::vector<float> run(std::span<const int32_t> tokens, std::vector<std::vector<int32_t>> * experts) const;

    std::string path_;
    int n_threads_;
    llama_model * model_ = nullptr;
};

}  // namespace voodoo
