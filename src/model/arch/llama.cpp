// llama.cpp's LLM_ARCH_LLAMA (src/models/llama.cpp there): pre-norm decoder, RMSNorm, rope in NORM
// pairing (the Q/K rows were permuted by convert_hf_to_gguf.py for it), grouped-query attention scaled by
// 1/sqrt(head_dim), SwiGLU MLP, output head separate or tied to token_embd. Optional biases are used
// where present. Refused with an error: mixture-of-experts llama, fused attn_qkv, rope yarn/longrope.
#include "model/arch/arch.h"

#include "common/error.h"
#include "ggml/gguf.h"
#include "model/gguf_weights.h"

#include <fmt/format.h>

#include <set>

namespace voodoo {

namespace {

class llama_model : public causal_lm {
public:
    explicit llama_model(model_hparams hp) : causal_lm(std::move(hp)) {}

    torch::Tensor hidden(const torch::Tensor & tokens, weight_source & w) override {
        check_tokens(tokens);
        forward_context ctx = context(w);
        const int64_t B = tokens.size(0), T = tokens.size(1);
        const model_hparams & hp = hp_;

        // x: [B, T, n_embd] in the compute dtype
        torch::Tensor x = ctx.input ? *ctx.input : token_embeddings(ctx, tokens, hp.n_embd);
        const rope_tables rope = make_rope_tables(ctx, hp, T, tokens.device());

        for (int64_t il = ctx.first_layer; il < ctx.layer_end(hp); ++il) {
            x = run_layer(ctx, x, [this, il, rope, B, T](forward_context & ctx, const torch::Tensor & x_in) {
                const model_hparams & hp = hp_;
                const torch::Tensor h = rms_norm(ctx, layer_tensor(il, "attn_norm.weight"), x_in, hp.norm_rms_eps);
                torch::Tensor q = linear(ctx, layer_tensor(il, "attn_q.weight"), h).view({B, T, hp.n_head, hp.n_embd_head_k});
                torch::Tensor k = linear(ctx, layer_tensor(il, "attn_k.weight"), h).view({B, T, hp.n_head_kv, hp.n_embd_head_k});
                torch::Tensor v = linear(ctx, layer_tensor(il, "attn_v.weight"), h).view({B, T, hp.n_head_kv, hp.n_embd_head_v});
                q = apply_rope(q, rope, hp);
                k = apply_rope(k, rope, hp);
                const torch::Tensor a = causal_attention(q, k, v, hp.kq_scale);
                const torch::Tensor x = x_in + linear(ctx, layer_tensor(il, "attn_output.weight"), a);
                return x + swiglu_mlp(ctx, fmt::format("blk.{}", il), rms_norm(ctx, layer_tensor(il, "ffn_norm.weight"), x, hp.norm_rms_eps));
            });
        }
        return ctx.last_stage(hp) ? rms_norm(ctx, "output_norm.weight", x, hp.norm_rms_eps) : x;
    }
};

/// Every tensor the forward reads has the shape the metadata implies, is a weight type, and the file
/// holds no tensor a llama model does not have (llama.cpp refuses those files too).
void check_tensors(const gguf_file & file, const model_hparams & hp) {
    const std::string arch = hp.arch;
    std::set<std::string> known;
    auto expect = [&](const std::string & name, std::initializer_list<int64_t> ne, std::string_view why) {
        expect_tensor_shape(file, name, ne, why);
        torch_dtype_of(file.tensor(name).type, name);
        known.insert(name);
    };
    auto optional = [&](const std::string & name, std::initializer_list<int64_t> ne, std::string_view why) {
        if (file.find_tensor(name)) {
            expect(name, ne, why);
        }
    };
    const std::string embd = fmt::format("{}.embedding_length = {}", arch, hp.n_embd);
    expect("token_embd.weight", {hp.n_embd, hp.n_vocab}, embd + " and the vocabulary");
    expect("output_norm.weight", {hp.n_embd}, embd);
    optional("output.weight", {hp.n_embd, hp.n_vocab}, embd + " and the vocabulary");
    optional("rope_freqs.weight", {hp.n_rot / 2}, fmt::format("{}.rope.dimension_count = {}", arch, hp.n_rot));
    const std::string q_why = fmt::format("n_embd {} and head_count {} × key_length {}", hp.n_embd, hp.n_head, hp.n_embd_head_k);
    const std::string k_why = fmt::format("n_embd {} and head_count_kv {} × key_length {}", hp.n_embd, hp.n_head_kv, hp.n_embd_head_k);
    const std::string v_why = fmt::format("n_embd {} and head_count_kv {} × value_length {}", hp.n_embd, hp.n_head_kv, hp.n_embd_head_v);
    const std::string ff_why = fmt::format("n_embd {} and {}.feed_forward_length = {}", hp.n_embd, arch, hp.n_ff);
    for (int64_t il = 0; il < hp.n_layer; ++il) {
        if (file.find_tensor(layer_tensor(il, "attn_qkv.weight"))) {
            fail("'{}': tensor '{}': fused QKV llama files are not supported yet (split attn_q/attn_k/attn_v are)",
                 file.path(), layer_tensor(il, "attn_qkv.weight"));
        }
        expect(layer_tensor(il, "attn_norm.weight"), {hp.n_embd}, embd);
        expect(layer_tensor(il, "attn_q.weight"), {hp.n_embd, hp.n_embd_q()}, q_why);
        expect(layer_tensor(il, "attn_k.weight"), {hp.n_embd, hp.n_embd_k_gqa()}, k_why);
        expect(layer_tensor(il, "attn_v.weight"), {hp.n_embd, hp.n_embd_v_gqa()}, v_why);
        expect(layer_tensor(il, "attn_output.weight"), {hp.n_embd_head_v * hp.n_head, hp.n_embd}, q_why);
        optional(layer_tensor(il, "attn_q.bias"), {hp.n_embd_q()}, q_why);
        optional(layer_tensor(il, "attn_k.bias"), {hp.n_embd_k_gqa()}, k_why);
        optional(layer_tensor(il, "attn_v.bias"), {hp.n_embd_v_gqa()}, v_why);
        optional(layer_tensor(il, "attn_output.bias"), {hp.n_embd}, embd);
        expect(layer_tensor(il, "ffn_norm.weight"), {hp.n_embd}, embd);
        expect(layer_tensor(il, "ffn_gate.weight"), {hp.n_embd, hp.n_ff}, ff_why);
        expect(layer_tensor(il, "ffn_up.weight"), {hp.n_embd, hp.n_ff}, ff_why);
        expect(layer_tensor(il, "ffn_down.weight"), {hp.n_ff, hp.n_embd}, ff_why);
        optional(layer_tensor(il, "ffn_gate.bias"), {hp.n_ff}, ff_why);
        optional(layer_tensor(il, "ffn_up.bias"), {hp.n_ff}, ff_why);
        optional(layer_tensor(il, "ffn_down.bias"), {hp.n_embd}, embd);
    }
    for (const gguf_tensor & t : file.tensors()) {
        if (!known.count(t.name)) {
            fail("'{}': tensor '{}' is not part of a {}-layer {} model (is {}.block_count right?)", file.path(), t.name,
                 hp.n_layer, arch, arch);
        }
    }
}

}  // namespace

std::unique_ptr<causal_lm> build_llama(const gguf_file & file) {
    model_hparams hp = read_llama_like_hparams(file, rope_type_norm);
    // llama.cpp's checks for LLM_ARCH_LLAMA (load_hparams and the graph's asserts).
    if (hp.n_rot != hp.n_embd_head_k) {
        fail("'{}': '{}.rope.dimension_count' = {} must equal the head size {} for llama (llama.cpp: invalid n_rot)",
             file.path(), hp.arch, hp.n_rot, hp.n_embd_head_k);
    }
    if (hp.n_embd_head_v != hp.n_embd_head_k) {
        fail("'{}': '{}.attention.value_length' = {} must equal '{}.attention.key_length' = {} for llama",
             file.path(), hp.arch, hp.n_embd_head_v, hp.arch, hp.n_embd_head_k);
    }
    check_tensors(file, hp);
    return std::make_unique<llama_model>(std::move(hp));
}

}  // namespace voodoo
