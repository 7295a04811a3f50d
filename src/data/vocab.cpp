#include "data/vocab.h"

#include "common/error.h"
#include "ggml/log.h"
#include "ggml/runtime.h"

#include <fmt/format.h>
#include <llama.h>
#include <xxhash.h>

#include <climits>
#include <cstring>
#include <type_traits>

namespace voodoo {

static_assert(std::is_same_v<llama_token, int32_t>, "token files store llama_token as int32");

namespace {

// Feeds length-prefixed fields so that ("ab", "c") and ("a", "bc") hash differently.
class hasher {
public:
    hasher() : state_(XXH3_createState()) { XXH3_64bits_reset(state_); }
    ~hasher() { XXH3_freeState(state_); }
    hasher(const hasher &) = delete;
    hasher & operator=(const hasher &) = delete;

    void bytes(const void * p, size_t n) {
        const uint64_t len = n;
        XXH3_64bits_update(state_, &len, sizeof len);
        XXH3_64bits_update(state_, p, n);
    }
    void str(std::string_view s) { bytes(s.data(), s.size()); }
    void absent() { str("\x01<absent>"); }
    uint64_t digest() const { return XXH3_64bits_digest(state_); }

private:
    XXH3_state_t * state_;
};

void hash_key(hasher & h, const gguf_file & file, const char * key) {
    h.str(key);
    const int64_t id = file.find_key(key);
    if (id < 0) {
        h.absent();
        return;
    }
    const gguf_context * ctx = file.ctx();
    const gguf_type type = gguf_get_kv_type(ctx, id);
    if (type == GGUF_TYPE_STRING) {
        h.str(gguf_get_val_str(ctx, id));
    } else if (type == GGUF_TYPE_ARRAY) {
        const gguf_type arr = gguf_get_arr_type(ctx, id);
        const size_t n = gguf_get_arr_n(ctx, id);
        h.bytes(&n, sizeof n);
        if (arr == GGUF_TYPE_STRING) {
            for (size_t i = 0; i < n; ++i) {
                h.str(gguf_get_arr_str(ctx, id, i));
            }
        } else {
            h.bytes(gguf_get_arr_data(ctx, id), n * gguf_scalar_size(arr));
        }
    } else {
        // Integers hash by value so that a u32 and an i32 id of the same token agree.
        const int64_t v = type == GGUF_TYPE_FLOAT32 || type == GGUF_TYPE_FLOAT64 ? 0 : file.get_int(key).value();
        h.bytes(&v, sizeof v);
    }
}

}  // namespace

uint64_t vocab_hash(const gguf_file & file) {
    if (file.find_key("tokenizer.ggml.tokens") < 0) {
        fail("'{}' has no vocabulary (no tokenizer.ggml.tokens); give the model's own GGUF, which carries its tokenizer",
             file.path());
    }
    hasher h;
    for (const char * key : {"tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
                             "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
                             "tokenizer.ggml.eos_token_id", "tokenizer.ggml.add_bos_token"}) {
        hash_key(h, file, key);
    }
    return h.digest();
}

std::string vocab_hash_hex(uint64_t hash) { return fmt::format("{:016x}", hash); }

int64_t uncovered_tokens(const llama_vocab * v, std::span<const int32_t> tokens) {
    int64_t uncovered = 0;
    for (const int32_t t : tokens) {
        uncovered += (llama_vocab_get_attr(v, t) & (LLAMA_TOKEN_ATTR_UNKNOWN | LLAMA_TOKEN_ATTR_BYTE)) != 0;
    }
    return uncovered;
}

double uncovered_share(const llama_vocab * v, std::span<const int32_t> tokens) {
    return tokens.empty() ? 0.0 : static_cast<double>(uncovered_tokens(v, tokens)) / static_cast<double>(tokens.size());
}

vocab::vocab(const std::string & model_path) {
    {
        const gguf_file file(model_path);  // validates before libllama sees the file
        hash_ = vocab_hash(file);
        tokenizer_model_ = file.get_string("tokenizer.ggml.model").value_or("");
        if (const auto arch = file.get_string("general.architecture")) {
            n_ctx_train_ = file.get_int(*arch + ".context_length").value_or(0);
        }
    }
    llama_runtime_init();
    llama_model_params params = llama_model_default_params();
    params.vocab_only = true;
    params.n_gpu_layers = 0;
    ggml_log_capture capture;
    model_ = llama_model_load_from_file(model_path.c_str(), params);
    if (!model_) {
        const std::string why = capture.text();
        fail("libllama could not load the vocabulary of '{}' ({})", model_path, why.empty() ? "no reason given" : why);
    }
    vocab_ = llama_model_get_vocab(model_);
}

vocab::~vocab() {
    if (model_) {
        llama_model_free(model_);
    }
}

int32_t vocab::n_tokens() const { return llama_vocab_n_tokens(vocab_); }
bool vocab::add_bos() const { return llama_vocab_get_add_bos(vocab_); }
int32_t vocab::bos() const { return llama_vocab_bos(vocab_); }
int32_t vocab::eos() const { return llama_vocab_eos(vocab_); }

std::string vocab::token_text(int32_t id) const {
    if (id < 0 || id >= n_tokens()) {
        return {};
    }
    return llama_vocab_get_text(vocab_, id);
}

std::vector<int32_t> vocab::tokenize(std::string_view text, bool add_special, bool parse_special) const {
    if (text.size() > static_cast<size_t>(INT32_MAX)) {
        fail("cannot tokenize {} bytes at once; libllama takes at most {} bytes per call", text.size(), INT32_MAX);
    }
    const auto len = static_cast<int32_t>(text.size());
    // A first guess that is enough for most text; llama_tokenize returns -needed when it is not.
    std::vector<int32_t> out(text.size() / 2 + 8);
    int32_t n = llama_tokenize(vocab_, text.data(), len, out.data(), static_cast<int32_t>(out.size()), add_special,
                               parse_special);
    if (n < 0) {
        if (n == INT32_MIN) {
            fail("tokenizing {} bytes gives more than 2^31 tokens; split the text", text.size());
        }
        out.resize(static_cast<size_t>(-n));
        n = llama_tokenize(vocab_, text.data(), len, out.data(), static_cast<int32_t>(out.size()), add_special,
                           parse_special);
    }
    out.resize(static_cast<size_t>(n));
    return out;
}

std::string vocab::detokenize(const std::vector<int32_t> & tokens) const {
    std::string text(tokens.size() * 8 + 16, '\0');
    int32_t n = llama_detokenize(vocab_, tokens.data(), static_cast<int32_t>(tokens.size()), text.data(),
                                 static_cast<int32_t>(text.size()), false, true);
    if (n < 0) {
        text.resize(static_cast<size_t>(-n));
        n = llama_detokenize(vocab_, tokens.data(), static_cast<int32_t>(tokens.size()), text.data(),
                             static_cast<int32_t>(text.size()), false, true);
    }
    text.resize(static_cast<size_t>(std::max(n, 0)));
    return text;
}

}  // namespace voodoo
