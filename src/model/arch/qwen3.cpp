// llama.cpp's LLM_ARCH_QWEN3 (src/models/qwen3.cpp there): Qwen3 dense models. The llama block with rope
// in the NEOX pairing and an RMSNorm over each head of Q and of K (attn_q_norm / attn_k_norm, [head_dim])
// before the rope; the head size comes from attention.key_length (it need not be n_embd / n_head).
// Refused with an error: mixture of experts (qwen3moe is another architecture), rope yarn/longrope,
// n_rot or value_length other than the head size, a tensor the graph does not read.
#include "model/arch/arch.h"
#include "model/arch/llama_like.h"

#include "ggml/gguf.h"

#include <fmt/format.h>

namespace voodoo {

namespace {

class qwen3_model : public causal_lm {
public:
    explicit qwen3_model(model_hparams hp) : causal_lm(std::move(hp)) {}

    torch::Tensor hidden(const torch::Tensor & tokens, weight_source & w) override {
        check_tokens(tokens);
        forward_context ctx = context(w);
        const int64_t T = tokens.size(1);
        const model_hparams & hp = hp_;

        // x: [B, T, n_embd] in the compute dtype
        torch::Tensor x = token_embeddings(ctx, tokens, hp.n_embd);
        const rope_tables rope = make_rope_tables(ctx, hp, T, tokens.device());

        for (int64_t il = 0; il < hp.n_layer; ++il) {
            const torch::Tensor h = rms_norm(ctx, layer_tensor(il, "attn_norm.weight"), x, hp.norm_rms_eps);
            qkv_heads a = attention_qkv(ctx, fmt::format("blk.{}", il), h, hp);
            // q, k: [B, T, heads, head_dim]; the norm runs over head_dim, per head.
            a.q = apply_rope(rms_norm(ctx, layer_tensor(il, "attn_q_norm.weight"), a.q, hp.norm_rms_eps), rope, hp);
            a.k = apply_rope(rms_norm(ctx, layer_tensor(il, "attn_k_norm.weight"), a.k, hp.norm_rms_eps), rope, hp);
            x = x + linear(ctx, layer_tensor(il, "attn_output.weight"), causal_attention(a.q, a.k, a.v, hp.kq_scale));
            x = x + swiglu_mlp(ctx, fmt::format("blk.{}", il), rms_norm(ctx, layer_tensor(il, "ffn_norm.weight"), x, hp.norm_rms_eps));
        }
        return rms_norm(ctx, "output_norm.weight", x, hp.norm_rms_eps);
    }
};

}  // namespace

std::unique_ptr<causal_lm> build_qwen3(const gguf_file & file) {
    model_hparams hp = read_llama_like_hparams(file, rope_type_neox);
    require_rope_over_whole_head(file, hp);
    tensor_checklist tensors(file);
    check_llama_like_tensors(tensors, hp, {.qk_norm = true});
    tensors.refuse_others(hp);
    return std::make_unique<qwen3_model>(std::move(hp));
}

}  // namespace voodoo
