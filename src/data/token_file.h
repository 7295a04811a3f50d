// Token files: fixed-length chunks of int32 token ids behind a small header that names the vocabulary they
// were made with (docs/DATA.md). `voodoo data` writes one per split (train.tokens, val.tokens) and a JSON
// sidecar (data.json); the imatrix collector and the trainer read them with token_file.
#pragma once

#include "common/file.h"

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace voodoo {

/// The header at the start of a token file, 48 bytes, little-endian; int32 tokens follow it.
struct token_file_header {
    char magic[8];          // "VOODOTOK"
    uint32_t version;       // 1
    uint32_t ctx;           // tokens per chunk
    uint64_t vocab_hash;    // vocab_hash() of the model whose vocabulary made the tokens
    uint64_t n_chunks;
    uint32_t n_vocab;       // every token id is < n_vocab
    uint32_t flags;         // token_file_flag_*
    uint64_t reserved;      // 0
};
static_assert(sizeof(token_file_header) == 48);

inline constexpr uint32_t token_file_version = 1;
/// Every chunk starts with the vocabulary's BOS (llama_vocab_get_add_bos was true).
inline constexpr uint32_t token_file_flag_bos = 1;

/// Writes a token file atomically: header, then chunks ([n_chunks, ctx] int32, row-major).
/// Throws voodoo::error when tokens.size() is not a multiple of ctx, a token is outside [0, n_vocab),
/// or the file cannot be written (then nothing is left at `path`).
void write_token_file(const std::string & path, std::span<const int32_t> tokens, uint32_t ctx, uint64_t vocab_hash,
                      uint32_t n_vocab, uint32_t flags);

/// A token file opened for reading (memory-mapped; chunks are views into the map).
class token_file {
public:
    /// Checks the magic, version, size and that every token is < n_vocab. Throws voodoo::error naming the
    /// path otherwise.
    explicit token_file(const std::string & path);

    const std::string & path() const { return path_; }
    int64_t n_chunks() const { return static_cast<int64_t>(header_.n_chunks); }
    int64_t ctx() const { return header_.ctx; }
    int64_t n_tokens() const { return n_chunks() * ctx(); }
    uint64_t vocab_hash() const { return header_.vocab_hash; }
    int64_t n_vocab() const { return header_.n_vocab; }
    bool starts_with_bos() const { return (header_.flags & token_file_flag_bos) != 0; }

    /// Chunk i: ctx() token ids. Throws voodoo::error when i is out of range.
    std::span<const int32_t> chunk(int64_t i) const;
    /// Every token, [n_chunks, ctx] row-major.
    std::span<const int32_t> tokens() const;

    /// Throws voodoo::error, naming this file and `model_path`, when the file was made with another vocabulary
    /// (its vocab hash differs from `model_vocab_hash`): its token ids would mean other words for that model.
    void require_vocab(uint64_t model_vocab_hash, const std::string & model_path) const;

private:
    std::string path_;
    mapped_file map_;
    token_file_header header_{};
};

}  // namespace voodoo
