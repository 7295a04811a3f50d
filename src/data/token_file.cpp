#include "data/token_file.h"

#include "common/error.h"
#include "data/vocab.h"

#include <cstring>

namespace voodoo {

namespace {

constexpr char k_magic[8] = {'V', 'O', 'O', 'D', 'O', 'T', 'O', 'K'};

void check_tokens(std::span<const int32_t> tokens, uint32_t n_vocab, const std::string & path) {
    for (size_t i = 0; i < tokens.size(); ++i) {
        if (tokens[i] < 0 || static_cast<uint32_t>(tokens[i]) >= n_vocab) {
            fail("'{}': token {} at position {} is outside the vocabulary of {} tokens; the file is corrupt, make it "
                 "again with `voodoo data`",
                 path, tokens[i], i, n_vocab);
        }
    }
}

}  // namespace

void write_token_file(const std::string & path, std::span<const int32_t> tokens, uint32_t ctx, uint64_t vocab_hash,
                      uint32_t n_vocab, uint32_t flags) {
    if (ctx == 0 || tokens.size() % ctx != 0) {
        fail("'{}': {} tokens are not whole chunks of ctx = {}", path, tokens.size(), ctx);
    }
    check_tokens(tokens, n_vocab, path);
    token_file_header h{};
    std::memcpy(h.magic, k_magic, sizeof k_magic);
    h.version = token_file_version;
    h.ctx = ctx;
    h.vocab_hash = vocab_hash;
    h.n_chunks = tokens.size() / ctx;
    h.n_vocab = n_vocab;
    h.flags = flags;
    atomic_file out(path);
    out.write(&h, sizeof h);
    out.write(tokens.data(), tokens.size_bytes());
    out.commit();
}

token_file::token_file(const std::string & path) : path_(path), map_(path) {
    const auto bytes = map_.bytes();
    if (bytes.size() < sizeof(token_file_header) || std::memcmp(bytes.data(), k_magic, sizeof k_magic) != 0) {
        fail("'{}' is not a Voodoo token file (no 'VOODOTOK' header); make one with `voodoo data`", path);
    }
    std::memcpy(&header_, bytes.data(), sizeof header_);
    if (header_.version != token_file_version) {
        fail("'{}': token file version {} is not supported (this Voodoo reads version {}); make it again with "
             "`voodoo data`",
             path, header_.version, token_file_version);
    }
    if (header_.ctx == 0) {
        fail("'{}': the header gives chunks of 0 tokens; the file is corrupt, make it again with `voodoo data`", path);
    }
    // Counted from the file's size, not from the header's product: n_chunks · ctx · 4 of a corrupt header can wrap
    // around 2^64 to the size of a short file.
    const uint64_t chunk_bytes = uint64_t{header_.ctx} * sizeof(int32_t);
    const uint64_t token_bytes = bytes.size() - sizeof(token_file_header);
    if (token_bytes % chunk_bytes != 0 || header_.n_chunks != token_bytes / chunk_bytes) {
        fail("'{}': the header promises {} chunks of {} tokens ({} bytes each) but the file holds {} bytes of tokens; "
             "it is truncated or corrupt, make it again with `voodoo data`",
             path, header_.n_chunks, header_.ctx, chunk_bytes, token_bytes);
    }
    check_tokens(tokens(), header_.n_vocab, path);
}

std::span<const int32_t> token_file::tokens() const {
    const uint8_t * p = map_.bytes().data() + sizeof(token_file_header);
    return {reinterpret_cast<const int32_t *>(p), static_cast<size_t>(n_tokens())};
}

std::span<const int32_t> token_file::chunk(int64_t i) const {
    if (i < 0 || i >= n_chunks()) {
        fail("'{}': chunk {} asked for, the file has {} chunks", path_, i, n_chunks());
    }
    return tokens().subspan(static_cast<size_t>(i * ctx()), static_cast<size_t>(ctx()));
}

void token_file::require_vocab(uint64_t model_vocab_hash, const std::string & model_path) const {
    if (model_vocab_hash != header_.vocab_hash) {
        fail("'{}' was made with another vocabulary (vocab hash {}) than '{}' has ({}); run `voodoo data --model {}` "
             "on the text again",
             path_, vocab_hash_hex(header_.vocab_hash), model_path, vocab_hash_hex(model_vocab_hash), model_path);
    }
}

}  // namespace voodoo
