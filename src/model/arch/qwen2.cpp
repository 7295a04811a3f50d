// llama.cpp's LLM_ARCH_QWEN2 (src/models/qwen2.cpp there): Qwen2 / Qwen2.5. The llama block with rope in
// the NEOX pairing and biases on Q, K and V (attn_q/k/v.bias, or attn_qkv.bias with a fused attn_qkv),
// an optional output.bias, head size = n_embd / n_head = n_rot. Refused with an error: mixture of
// experts, rope yarn/longrope, a head size other than n_embd / n_head, a tensor the graph does not read.
#include "model/arch/arch.h"
#include "model/arch/llama_like.h"

#include "common/error.h"
#include "ggml/gguf.h"

#include <fmt/format.h>

namespace voodoo {

namespace {

class qwen2_model : public causal_lm {
public:
    explicit qwen2_model(model_hparams hp, bool output_bias) : causal_lm(std::move(hp)), output_bias_(output_bias) {}

    torch::Tensor hidden(const torch::Tensor & tokens, weight_source & w) override {
        check_tokens(tokens);
        forward_context ctx = context(w);
        const int64_t T = tokens.size(1);
        const model_hparams & hp = hp_;

        // x: [B, T, n_embd] in the compute dtype
        torch::Tensor x = ctx.input ? *ctx.input : token_embeddings(ctx, tokens, hp.n_embd);
        const rope_tables rope = make_rope_tables(ctx, hp, T, tokens.device());

        for (int64_t il = ctx.first_layer; il < ctx.layer_end(hp); ++il) {
            x = run_layer(ctx, x, [this, il, rope](forward_context & ctx, const torch::Tensor & x_in) {
                const model_hparams & hp = hp_;
                const torch::Tensor h = rms_norm(ctx, layer_tensor(il, "attn_norm.weight"), x_in, hp.norm_rms_eps);
                qkv_heads a = attention_qkv(ctx, fmt::format("blk.{}", il), h, hp);
                a.q = apply_rope(a.q, rope, hp);
                a.k = apply_rope(a.k, rope, hp);
                const torch::Tensor x = x_in + linear(ctx, layer_tensor(il, "attn_output.weight"), causal_attention(a.q, a.k, a.v, hp.kq_scale));
                return x + swiglu_mlp(ctx, fmt::format("blk.{}", il), rms_norm(ctx, layer_tensor(il, "ffn_norm.weight"), x, hp.norm_rms_eps));
            });
        }
        return ctx.last_stage(hp) ? rms_norm(ctx, "output_norm.weight", x, hp.norm_rms_eps) : x;
    }

    /// llama.cpp adds output.bias after the head, tied or not.
    torch::Tensor head(const torch::Tensor & x, weight_source & w) override {
        torch::Tensor logits = causal_lm::head(x, w);
        if (output_bias_ && hp_.tied_output) {
            logits = logits + w.get("output.bias").to(logits.device(), torch::kFloat);
        }
        return logits;
    }

private:
    bool output_bias_;  // the file has output.bias (causal_lm::head adds it itself when the head is output.weight)
};

}  // namespace

std::unique_ptr<causal_lm> build_qwen2(const gguf_file & file) {
    model_hparams hp = read_llama_like_hparams(file, rope_type_neox);
    require_rope_over_whole_head(file, hp);
    // load_arch_tensors sizes attn_q and attn_output as [n_embd, n_embd].
    if (hp.n_embd_q() != hp.n_embd) {
        fail("'{}': '{}.attention.head_count' {} × head size {} must equal '{}.embedding_length' {} for qwen2",
             file.path(), hp.arch, hp.n_head, hp.n_embd_head_k, hp.arch, hp.n_embd);
    }
    tensor_checklist tensors(file);
    check_llama_like_tensors(tensors, hp, {});
    const bool output_bias = tensors.optional("output.bias", {hp.n_vocab}, "the vocabulary");
    tensors.refuse_others(hp);
    return std::make_unique<qwen2_model>(std::move(hp), output_bias);
}

}  // namespace voodoo
