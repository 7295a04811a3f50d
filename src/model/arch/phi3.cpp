// llama.cpp's LLM_ARCH_PHI3 (src/models/phi3.cpp there): Phi-3, Phi-3.5, Phi-4(-mini). Pre-norm decoder with
// a fused attn_qkv ([n_embd, n_embd + 2·n_embd_kv]: Q, K, V rows in that order) or split Q/K/V, rope in the
// NEOX pairing over rope.dimension_count dims (Phi-4-mini rotates part of the head), queries scaled by
// 1/sqrt(head size), and a SwiGLU MLP whose gate and up are fused in ffn_up ([n_embd, 2·n_ff], gate first).
// Long-context files (convert_hf_to_gguf.py's longrope) carry rope_factors_long / rope_factors_short and
// rope.scaling.attn_factor: as llama.cpp, the long factors divide the angles when the context exceeds
// rope.scaling.original_context_length, else the short ones; the context of a forward of T tokens is the one
// llama.cpp makes for it (T rounded up to a multiple of 256). attention.sliding_window is ignored, as llama.cpp
// ignores it for phi3 (it disables Phi SWA). Refused with an error: mixture of experts (phimoe is another
// architecture), rope scaling types other than none/linear (convert writes none for longrope files), a head
// size other than n_embd / n_head, a tensor the graph does not read.
#include "model/arch/arch.h"
#include "model/arch/llama_like.h"

#include "common/error.h"
#include "ggml/gguf.h"

#include <fmt/format.h>

namespace voodoo {

namespace {

class phi3_model : public causal_lm {
public:
    phi3_model(model_hparams hp, bool has_long, bool has_short)
        : causal_lm(std::move(hp)), has_long_(has_long), has_short_(has_short) {}

    torch::Tensor hidden(const torch::Tensor & tokens, weight_source & w) override {
        check_tokens(tokens);
        forward_context ctx = context(w);
        const int64_t T = tokens.size(1);
        const model_hparams & hp = hp_;

        // x: [B, T, n_embd] in the compute dtype
        torch::Tensor x = ctx.input ? *ctx.input : token_embeddings(ctx, tokens, hp.n_embd);
        rope_config rope;
        rope.freq_base = hp.rope_freq_base;
        rope.freq_scale = hp.rope_freq_scale;
        rope.attn_factor = hp.rope_attn_factor;
        // llama_model::get_rope_factors: long factors when n_ctx_seq > n_ctx_orig_yarn; llama.cpp pads n_ctx to 256.
        const int64_t n_ctx = (T + 255) / 256 * 256;
        const bool long_ctx = n_ctx > hp.n_ctx_orig;
        if (long_ctx && has_long_) {
            rope.freq_factors = "rope_factors_long.weight";
        } else if (!long_ctx && has_short_) {
            rope.freq_factors = "rope_factors_short.weight";
        }
        const rope_tables tables = make_rope_tables(ctx, hp.n_rot, rope, T, tokens.device());

        for (int64_t il = ctx.first_layer; il < ctx.layer_end(hp); ++il) {
            x = run_layer(ctx, x, [this, il, tables](forward_context & ctx, const torch::Tensor & x_in) {
                const model_hparams & hp = hp_;
                const torch::Tensor h = rms_norm(ctx, layer_tensor(il, "attn_norm.weight"), x_in, hp.norm_rms_eps);
                qkv_heads a = attention_qkv(ctx, fmt::format("blk.{}", il), h, hp);
                a.q = apply_rope(a.q, tables, hp);
                a.k = apply_rope(a.k, tables, hp);
                const torch::Tensor x = x_in + linear(ctx, layer_tensor(il, "attn_output.weight"), causal_attention(a.q, a.k, a.v, hp.kq_scale));
                return x + fused_swiglu_mlp(ctx, fmt::format("blk.{}", il), rms_norm(ctx, layer_tensor(il, "ffn_norm.weight"), x, hp.norm_rms_eps));
            });
        }
        return ctx.last_stage(hp) ? rms_norm(ctx, "output_norm.weight", x, hp.norm_rms_eps) : x;
    }

private:
    bool has_long_, has_short_;
};

}  // namespace

std::unique_ptr<causal_lm> build_phi3(const gguf_file & file) {
    model_hparams hp = read_llama_like_hparams(file, rope_type_neox);
    if (hp.n_embd_head_v != hp.n_embd_head_k) {
        fail("'{}': '{}.attention.value_length' = {} must equal '{}.attention.key_length' = {} for phi3 (llama.cpp "
             "asserts it)", file.path(), hp.arch, hp.n_embd_head_v, hp.arch, hp.n_embd_head_k);
    }
    // load_arch_tensors sizes Q and attn_output as [n_embd, n_embd].
    if (hp.n_embd_q() != hp.n_embd) {
        fail("'{}': '{}.attention.head_count' {} × head size {} must equal '{}.embedding_length' {} for phi3",
             file.path(), hp.arch, hp.n_head, hp.n_embd_head_k, hp.arch, hp.n_embd);
    }
    tensor_checklist tensors(file);
    check_llama_like_tensors(tensors, hp, {.fused_gate_up = true});
    const std::string rot_why = fmt::format("{}.rope.dimension_count = {}", hp.arch, hp.n_rot);
    const bool has_long = tensors.optional("rope_factors_long.weight", {hp.n_rot / 2}, rot_why);
    const bool has_short = tensors.optional("rope_factors_short.weight", {hp.n_rot / 2}, rot_why);
    tensors.refuse_others(hp);
    return std::make_unique<phi3_model>(std::move(hp), has_long, has_short);
}

}  // namespace voodoo
