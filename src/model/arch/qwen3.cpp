// llama.cpp's LLM_ARCH_QWEN3 and LLM_ARCH_QWEN3MOE (src/models/qwen3.cpp and qwen3moe.cpp there). Qwen3 dense models:
// the llama block with rope in the NEOX pairing and an RMSNorm over each head of Q and of K (attn_q_norm /
// attn_k_norm, [head_dim]) before the rope; the head size comes from attention.key_length (it need not be
// n_embd / n_head). Qwen3's mixtures of experts (30B-A3B, 235B-A22B) are the same block with, in every layer's FFN,
// an F32 router ffn_gate_inp [n_embd, n_expert], softmax gating, the top expert_used_count experts renormalised and
// SwiGLU experts in three 3-D tensors ffn_{gate,up,down}_exps (blocks.h moe_ffn).
// Refused with an error: a qwen3 file with experts (qwen3moe is its own architecture), grouped expert routing or a
// per-layer expert count (qwen3moe), rope yarn/longrope, n_rot or value_length other than the head size, a tensor
// the graph does not read.
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
        torch::Tensor x = ctx.input ? *ctx.input : token_embeddings(ctx, tokens, hp.n_embd);
        const rope_tables rope = make_rope_tables(ctx, hp, T, tokens.device());

        for (int64_t il = ctx.first_layer; il < ctx.layer_end(hp); ++il) {
            x = run_layer(ctx, x, [this, il, rope](forward_context & ctx, const torch::Tensor & x_in) {
                const model_hparams & hp = hp_;
                const torch::Tensor h = rms_norm(ctx, layer_tensor(il, "attn_norm.weight"), x_in, hp.norm_rms_eps);
                qkv_heads a = attention_qkv(ctx, fmt::format("blk.{}", il), h, hp);
                // q, k: [B, T, heads, head_dim]; the norm runs over head_dim, per head.
                a.q = apply_rope(rms_norm(ctx, layer_tensor(il, "attn_q_norm.weight"), a.q, hp.norm_rms_eps), rope, hp);
                a.k = apply_rope(rms_norm(ctx, layer_tensor(il, "attn_k_norm.weight"), a.k, hp.norm_rms_eps), rope, hp);
                const torch::Tensor x = x_in + linear(ctx, layer_tensor(il, "attn_output.weight"), causal_attention(a.q, a.k, a.v, hp.kq_scale));
                const torch::Tensor f = rms_norm(ctx, layer_tensor(il, "ffn_norm.weight"), x, hp.norm_rms_eps);
                // qwen3moe: the mixture of experts (blocks.h moe_ffn) in every layer's FFN
                return x + (hp.n_expert > 0 ? moe_ffn(ctx, fmt::format("blk.{}", il), f, hp) : swiglu_mlp(ctx, fmt::format("blk.{}", il), f));
            });
        }
        return ctx.last_stage(hp) ? rms_norm(ctx, "output_norm.weight", x, hp.norm_rms_eps) : x;
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

std::unique_ptr<causal_lm> build_qwen3moe(const gguf_file & file) {
    model_hparams hp = read_llama_like_hparams(file, rope_type_neox, false, /*experts=*/true);
    read_expert_hparams(file, hp);
    require_rope_over_whole_head(file, hp);
    tensor_checklist tensors(file);
    check_llama_like_tensors(tensors, hp, {.qk_norm = true, .experts = true});
    tensors.refuse_others(hp);
    return std::make_unique<qwen3_model>(std::move(hp));
}

}  // namespace voodoo
