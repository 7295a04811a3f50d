// llama.cpp's LLM_ARCH_QWEN3MOE (src/models/qwen3moe.cpp there): Qwen3 mixture-of-experts models (Qwen3-30B-A3B,
// Qwen3-235B-A22B, Qwen3-Coder-30B-A3B). The qwen3 attention block (NEOX rope, RMSNorm over each head of Q and K)
// with a mixture-of-experts FFN in every layer: an F32 router ffn_gate_inp [n_embd, n_expert], softmax gating, the
// top expert_used_count experts renormalised, SwiGLU experts in three 3-D tensors ffn_{gate,up,down}_exps (blocks.h
// moe_ffn). Refused with an error: rope yarn/longrope, n_rot or value_length other than the head size, grouped
// expert routing, a per-layer expert count, a tensor the graph does not read.
#include "model/arch/arch.h"
#include "model/arch/llama_like.h"

#include "ggml/gguf.h"

#include <fmt/format.h>

namespace voodoo {

namespace {

class qwen3moe_model : public causal_lm {
public:
    explicit qwen3moe_model(model_hparams hp) : causal_lm(std::move(hp)) {}

    torch::Tensor hidden(const torch::Tensor & tokens, weight_source & w) override {
        check_tokens(tokens);
        forward_context ctx = context(w);
        const int64_t T = tokens.size(1);
        const model_hparams & hp = hp_;

        torch::Tensor x = token_embeddings(ctx, tokens, hp.n_embd);
        const rope_tables rope = make_rope_tables(ctx, hp, T, tokens.device());
        for (int64_t il = 0; il < hp.n_layer; ++il) {
            const std::string blk = fmt::format("blk.{}", il);
            const torch::Tensor h = rms_norm(ctx, layer_tensor(il, "attn_norm.weight"), x, hp.norm_rms_eps);
            qkv_heads a = attention_qkv(ctx, blk, h, hp);
            a.q = apply_rope(rms_norm(ctx, layer_tensor(il, "attn_q_norm.weight"), a.q, hp.norm_rms_eps), rope, hp);
            a.k = apply_rope(rms_norm(ctx, layer_tensor(il, "attn_k_norm.weight"), a.k, hp.norm_rms_eps), rope, hp);
            x = x + linear(ctx, layer_tensor(il, "attn_output.weight"), causal_attention(a.q, a.k, a.v, hp.kq_scale));
            x = x + moe_ffn(ctx, blk, rms_norm(ctx, layer_tensor(il, "ffn_norm.weight"), x, hp.norm_rms_eps), hp);
        }
        return rms_norm(ctx, "output_norm.weight", x, hp.norm_rms_eps);
    }
};

}  // namespace

void check_expert_tensors(tensor_checklist & tensors, const model_hparams & hp, int64_t il, bool fused_gate_up) {
    auto blk = [il](const char * name) { return fmt::format("blk.{}.{}", il, name); };
    const std::string why = fmt::format("n_embd {}, {}.expert_count = {} and {}.expert_feed_forward_length = {}",
                                        hp.n_embd, hp.arch, hp.n_expert, hp.arch, hp.n_ff_exp);
    tensors.require(blk("ffn_gate_inp.weight"), {hp.n_embd, hp.n_expert}, why);
    if (!fused_gate_up ||
        !tensors.optional(blk("ffn_gate_up_exps.weight"), {hp.n_embd, 2 * hp.n_ff_exp, hp.n_expert}, why + " (gate and up fused)")) {
        tensors.require(blk("ffn_gate_exps.weight"), {hp.n_embd, hp.n_ff_exp, hp.n_expert}, why);
        tensors.require(blk("ffn_up_exps.weight"), {hp.n_embd, hp.n_ff_exp, hp.n_expert}, why);
    }
    tensors.require(blk("ffn_down_exps.weight"), {hp.n_ff_exp, hp.n_embd, hp.n_expert}, why);
}

std::unique_ptr<causal_lm> build_qwen3moe(const gguf_file & file) {
    model_hparams hp = read_llama_like_hparams(file, rope_type_neox, false, /*experts=*/true);
    read_expert_hparams(file, hp);
    require_rope_over_whole_head(file, hp);
    tensor_checklist tensors(file);
    const std::string embd = fmt::format("qwen3moe.embedding_length = {}", hp.n_embd);
    const std::string head_why = fmt::format("qwen3moe.attention.key_length = {}", hp.n_embd_head_k);
    tensors.require("token_embd.weight", {hp.n_embd, hp.n_vocab}, embd + " and the vocabulary");
    tensors.require("output_norm.weight", {hp.n_embd}, embd);
    tensors.optional("output.weight", {hp.n_embd, hp.n_vocab}, embd + " and the vocabulary");
    for (int64_t il = 0; il < hp.n_layer; ++il) {
        tensors.require(layer_tensor(il, "attn_norm.weight"), {hp.n_embd}, embd);
        check_attention_tensors(tensors, hp, il);
        tensors.require(layer_tensor(il, "attn_q_norm.weight"), {hp.n_embd_head_k}, head_why);
        tensors.require(layer_tensor(il, "attn_k_norm.weight"), {hp.n_embd_head_k}, head_why);
        tensors.require(layer_tensor(il, "ffn_norm.weight"), {hp.n_embd}, embd);
        check_expert_tensors(tensors, hp, il);
    }
    tensors.refuse_others(hp);
    return std::make_unique<qwen3moe_model>(std::move(hp));
}

}  // namespace voodoo
