#include "ggml/llama_logits.h"

#include "common/error.h"
#include "ggml/log.h"
#include "ggml/quant.h"
#include "ggml/runtime.h"

#include <ggml-backend.h>
#include <llama.h>

#include <cstring>
#include <memory>

namespace voodoo {

llama_reference::llama_reference(const std::string & path, int n_threads)
    : path_(path), n_threads_(resolve_threads(n_threads)) {
    llama_runtime_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    ggml_log_capture capture;
    model_ = llama_model_load_from_file(path.c_str(), mp);
    if (!model_) {
        const std::string why = capture.text();
        fail("libllama cannot load '{}': {}", path, why.empty() ? "no reason given" : why);
    }
}

llama_reference::~llama_reference() {
    if (model_) {
        llama_model_free(model_);
    }
}

int32_t llama_reference::n_vocab() const { return llama_vocab_n_tokens(llama_model_get_vocab(model_)); }

std::vector<int32_t> llama_reference::tokenize(const std::string & text, bool add_special) const {
    const llama_vocab * vocab = llama_model_get_vocab(model_);
    std::vector<llama_token> out(text.size() + 8);
    int32_t n = llama_tokenize(vocab, text.data(), static_cast<int32_t>(text.size()), out.data(),
                               static_cast<int32_t>(out.size()), add_special, false);
    if (n < 0 && n != INT32_MIN) {
        out.resize(static_cast<size_t>(-n));
        n = llama_tokenize(vocab, text.data(), static_cast<int32_t>(text.size()), out.data(),
                           static_cast<int32_t>(out.size()), add_special, false);
    }
    if (n < 0) {
        fail("libllama cannot tokenize {} bytes of text with the vocabulary of '{}'", text.size(), path_);
    }
    out.resize(static_cast<size_t>(n));
    return {out.begin(), out.end()};
}

namespace {

// The eval callback that copies every `ffn_moe_topk-<il>` node ([n_expert_used, n_tokens] i32, possibly a strided
// view of the argsort) out of the graph, in the order the graph computes them.
struct topk_capture {
    std::vector<std::vector<int32_t>> * experts;
    std::vector<uint8_t> buf;
};

bool capture_topk(ggml_tensor * t, bool ask, void * user_data) {
    const bool wanted = std::strncmp(t->name, "ffn_moe_topk-", 13) == 0 && t->type == GGML_TYPE_I32;
    if (ask || !wanted) {
        return wanted;
    }
    auto * c = static_cast<topk_capture *>(user_data);
    c->buf.resize(ggml_nbytes(t));
    ggml_backend_tensor_get(t, c->buf.data(), 0, c->buf.size());
    std::vector<int32_t> ids(static_cast<size_t>(t->ne[0] * t->ne[1]));
    for (int64_t tok = 0; tok < t->ne[1]; ++tok) {
        for (int64_t k = 0; k < t->ne[0]; ++k) {
            std::memcpy(&ids[static_cast<size_t>(tok * t->ne[0] + k)], c->buf.data() + tok * t->nb[1] + k * t->nb[0],
                        sizeof(int32_t));
        }
    }
    c->experts->push_back(std::move(ids));
    return true;
}

}  // namespace

std::vector<float> llama_reference::logits(std::span<const int32_t> tokens) const { return run(tokens, nullptr); }

std::vector<float> llama_reference::logits(std::span<const int32_t> tokens,
                                           std::vector<std::vector<int32_t>> & experts) const {
    experts.clear();
    return run(tokens, &experts);
}

std::vector<float> llama_reference::run(std::span<const int32_t> tokens,
                                        std::vector<std::vector<int32_t>> * experts) const {
    const int32_t n_tokens = static_cast<int32_t>(tokens.size());
    const int32_t vocab = n_vocab();
    if (n_tokens == 0) {
        fail("logits of '{}': no tokens given", path_);
    }
    for (const int32_t t : tokens) {
        if (t < 0 || t >= vocab) {
            fail("logits of '{}': token id {} is outside the vocabulary of {} tokens", path_, t, vocab);
        }
    }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = static_cast<uint32_t>(n_tokens);
    cp.n_batch = static_cast<uint32_t>(n_tokens);
    cp.n_ubatch = static_cast<uint32_t>(n_tokens);
    cp.n_seq_max = 1;
    cp.n_threads = n_threads_;
    cp.n_threads_batch = n_threads_;
    cp.type_k = GGML_TYPE_F32;
    cp.type_v = GGML_TYPE_F32;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.no_perf = true;
    topk_capture topk{experts, {}};
    if (experts) {
        cp.cb_eval = capture_topk;
        cp.cb_eval_user_data = &topk;
    }
    ggml_log_capture capture;
    std::unique_ptr<llama_context, decltype(&llama_free)> ctx(llama_init_from_model(model_, cp), &llama_free);
    if (!ctx) {
        fail("libllama cannot make a context of {} tokens for '{}': {}", n_tokens, path_, capture.text());
    }
    llama_batch batch = llama_batch_init(n_tokens, 0, 1);
    for (int32_t i = 0; i < n_tokens; ++i) {
        batch.token[i] = tokens[static_cast<size_t>(i)];
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = 1;
    }
    batch.n_tokens = n_tokens;
    const int32_t rc = llama_decode(ctx.get(), batch);
    llama_batch_free(batch);
    if (rc != 0) {
        fail("llama_decode of {} tokens of '{}' failed ({}): {}", n_tokens, path_, rc, capture.text());
    }
    std::vector<float> out(static_cast<size_t>(n_tokens) * static_cast<size_t>(vocab));
    for (int32_t i = 0; i < n_tokens; ++i) {
        const float * row = llama_get_logits_ith(ctx.get(), i);
        if (!row) {
            fail("libllama returned no logits for position {} of '{}'", i, path_);
        }
        std::memcpy(out.data() + static_cast<size_t>(i) * vocab, row, sizeof(float) * static_cast<size_t>(vocab));
    }
    return out;
}

}  // namespace voodoo
