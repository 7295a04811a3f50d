// A model's vocabulary, loaded by libllama (vocab-only) so that Voodoo tokenizes exactly as llama.cpp does,
// and a stable hash of it that token files carry so that tokens are never read with another vocabulary.
#pragma once

#include "ggml/gguf.h"

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

struct llama_model;
struct llama_vocab;

namespace voodoo {

/// Stable 64-bit hash of a GGUF's vocabulary: XXH3-64 over tokenizer.ggml.model, tokenizer.ggml.pre, every token
/// string, every token type, every BPE merge, the BOS/EOS ids and tokenizer.ggml.add_bos_token (each length-
/// prefixed; an absent key hashes as absent). Two files tokenize the same text the same way when their hashes
/// agree. Throws voodoo::error naming the file when it has no tokenizer.ggml.tokens.
uint64_t vocab_hash(const gguf_file & file);

/// The hash as 16 lower-case hex digits (the form JSON sidecars carry).
std::string vocab_hash_hex(uint64_t hash);

/// How many of `tokens` (ids of `v`) are <unk> or byte-fallback tokens (LLAMA_TOKEN_ATTR_UNKNOWN or
/// LLAMA_TOKEN_ATTR_BYTE): text in a script the vocabulary does not cover.
int64_t uncovered_tokens(const llama_vocab * v, std::span<const int32_t> tokens);

/// uncovered_tokens as a share of the tokens; 0 for no tokens.
double uncovered_share(const llama_vocab * v, std::span<const int32_t> tokens);

/// The most of a text's tokens that may be uncovered (uncovered_share) before the eval and the data stage refuse it
/// as text in a language the model was not made for.
constexpr double k_max_uncovered_share = 0.5;

/// A model's vocabulary, loaded with libllama's vocab_only (no weights are read).
class vocab {
public:
    /// Throws voodoo::error naming the path when it is not a GGUF or libllama cannot load its vocabulary.
    explicit vocab(const std::string & model_path);
    ~vocab();
    vocab(const vocab &) = delete;
    vocab & operator=(const vocab &) = delete;

    const llama_vocab * get() const { return vocab_; }
    /// vocab_hash() of the model file.
    uint64_t hash() const { return hash_; }
    /// tokenizer.ggml.model ("llama", "gpt2", …).
    const std::string & tokenizer_model() const { return tokenizer_model_; }
    /// The context the model was trained on: the header's {general.architecture}.context_length, or 0 without one.
    int64_t n_ctx_train() const { return n_ctx_train_; }
    int32_t n_tokens() const;
    /// llama_vocab_get_add_bos: whether llama.cpp starts every sequence with BOS for this vocabulary.
    bool add_bos() const;
    /// The BOS / EOS token id, or -1 (LLAMA_TOKEN_NULL) when the vocabulary has none.
    int32_t bos() const;
    int32_t eos() const;
    /// The text of a token (llama_vocab_get_text), "" for an id out of range.
    std::string token_text(int32_t id) const;

    /// llama_tokenize of `text`. add_special: add BOS/EOS as the vocabulary asks (as llama.cpp does for a
    /// prompt); parse_special: read control-token texts ("<s>") as those tokens. Returns token ids.
    /// Throws voodoo::error when libllama cannot tokenize the text (more than 2^31 tokens).
    std::vector<int32_t> tokenize(std::string_view text, bool add_special, bool parse_special = false) const;

    /// The text of tokens joined (llama_detokenize, special tokens rendered), for messages and tests.
    std::string detokenize(const std::vector<int32_t> & tokens) const;

private:
    llama_model * model_ = nullptr;
    const llama_vocab * vocab_ = nullptr;
    uint64_t hash_ = 0;
    std::string tokenizer_model_;
    int64_t n_ctx_train_ = 0;
};

}  // namespace voodoo
