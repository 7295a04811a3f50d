// llama.cpp's LLM_ARCH_QWEN35 and LLM_ARCH_QWEN35MOE (src/models/qwen35.cpp, qwen35moe.cpp and delta-net-base.cpp
// there): Qwen3.5 models, dense or mixtures of experts (qwen35moe: the FFN of every layer is the routed experts of
// blocks.h moe_ffn plus a shared expert gated per token by sigmoid; see qwen35_model::experts). A hybrid
// of gated delta net layers and gated attention layers (three to one in the released models). Per layer: RMSNorm
// (attn_norm) → the layer's mixer → residual, then RMSNorm (post_attention_norm) → SwiGLU MLP → residual.
// - Gated delta net layer: attn_qkv → causal depthwise convolution of ssm.conv_kernel taps (ssm_conv1d) → SiLU →
//   Q, K (L2-normalised per head, eps = rms eps, tiled to the value heads as ggml_repeat does), V; decay
//   g = softplus(ssm_alpha(x) + ssm_dt.bias) · ssm_a and β = sigmoid(ssm_beta(x)); gated_delta_rule; RMSNorm over each
//   value head (ssm_norm) times SiLU(attn_gate(x)); ssm_out.
// - Attention layer: attn_q gives per head [query | gate]; RMSNorm of each Q and K head; rope over
//   rope.dimension_count dims in the NEOX pairing (M-RoPE with every text position equal: pairs of the fourth
//   section rotate by position 0, as llama.cpp feeds text tokens); GQA scaled by 1/sqrt(head size); times
//   sigmoid(gate); attn_output.
// Layers are recurrent unless (il + 1) % full_attention_interval == 0 (default 4), or as attention.recurrent_layers
// says. Refused with an error: multi-token-prediction layers (nextn_predict_layers > 0), value heads not a multiple
// of key heads, ssm.inner_size ≠ value heads × state size, a non-F32 convolution kernel, rope yarn/longrope, a
// tensor the graph does not read.
#include "model/arch/arch.h"
#include "model/arch/llama_like.h"

#include "common/error.h"
#include "ggml/gguf.h"
#include "ggml/types.h"

#include <fmt/format.h>

namespace voodoo {

namespace {

class qwen35_model : public causal_lm {
public:
    explicit qwen35_model(model_hparams hp) : causal_lm(std::move(hp)) {}

    torch::Tensor hidden(const torch::Tensor & tokens, weight_source & w) override {
        check_tokens(tokens);
        forward_context ctx = context(w);
        const model_hparams & hp = hp_;

        // x: [B, T, n_embd] in the compute dtype
        torch::Tensor x = ctx.input ? *ctx.input : token_embeddings(ctx, tokens, hp.n_embd);
        const rope_tables rope = text_rope_tables(ctx, tokens.size(1), tokens.device());

        for (int64_t il = ctx.first_layer; il < ctx.layer_end(hp); ++il) {
            x = run_layer(ctx, x, [this, il, rope](forward_context & ctx, const torch::Tensor & x_in) {
                const model_hparams & hp = hp_;
                const torch::Tensor h = rms_norm(ctx, layer_tensor(il, "attn_norm.weight"), x_in, hp.norm_rms_eps);
                const torch::Tensor x = x_in + (hp.is_recurrent(il) ? delta_net(ctx, il, h) : attention(ctx, il, h, rope));
                const torch::Tensor f = rms_norm(ctx, layer_tensor(il, "post_attention_norm.weight"), x, hp.norm_rms_eps);
                return x + (hp.n_expert > 0 ? experts(ctx, il, f) : swiglu_mlp(ctx, fmt::format("blk.{}", il), f));
            });
        }
        return ctx.last_stage(hp) ? rms_norm(ctx, "output_norm.weight", x, hp.norm_rms_eps) : x;
    }

private:
    /// ggml_rope_multi's angles for text, whose t, h and w positions are the token's and e position 0
    /// (llm_graph_input_pos::set_input): a pair rotates by its position unless its section is the fourth.
    rope_tables text_rope_tables(forward_context & ctx, int64_t T, torch::Device device) const {
        const model_hparams & hp = hp_;
        rope_tables t = make_rope_tables(ctx, hp, T, torch::kCPU);
        const int64_t s0 = hp.rope_sections[0], s1 = hp.rope_sections[1], s2 = hp.rope_sections[2];
        const int64_t n_sect = s0 + s1 + s2 + hp.rope_sections[3];
        for (int64_t i = 0; i < hp.n_rot / 2; ++i) {
            // ggml_mrope_cache_init, interleaved (LLAMA_ROPE_TYPE_IMROPE): which position pair i takes.
            const int64_t sector = i % n_sect;
            const bool text_position = (sector % 3 == 0 && sector < 3 * s0) || (sector % 3 == 1 && sector < 3 * s1) ||
                                       (sector % 3 == 2 && sector < 3 * s2);
            if (!text_position) {
                t.cos.select(1, i).fill_(hp.rope_attn_factor);
                t.sin.select(1, i).fill_(0.0f);
            }
        }
        return {t.cos.to(device), t.sin.to(device)};
    }

    /// A gated delta net layer: h [B, T, n_embd] → [B, T, n_embd].
    torch::Tensor delta_net(forward_context & ctx, int64_t il, const torch::Tensor & h) const {
        using torch::indexing::Slice;
        const model_hparams & hp = hp_;
        const int64_t B = h.size(0), T = h.size(1);
        const int64_t d = hp.ssm_d_state, H_k = hp.ssm_n_group, H_v = hp.ssm_dt_rank;
        const int64_t key_dim = d * H_k, value_dim = d * H_v;

        // Q, K, V through the short causal convolution and SiLU: [B, T, 2·key_dim + value_dim] f32
        const torch::Tensor mixed = linear(ctx, layer_tensor(il, "attn_qkv.weight"), h);
        const torch::Tensor qkv = torch::silu(causal_conv1d(mixed, ctx.w.get(layer_tensor(il, "ssm_conv1d.weight"))));
        const std::vector<torch::Tensor> parts = qkv.split_with_sizes({key_dim, key_dim, value_dim}, -1);
        // ggml_l2_norm: x / max(‖x‖, eps) over each head; key heads tiled to the value heads (ggml_repeat).
        auto heads = [&](const torch::Tensor & x) {
            const torch::Tensor xh = x.reshape({B, T, H_k, d});
            const torch::Tensor n = xh.norm(2, -1, true).clamp_min(hp.norm_rms_eps);
            return (xh / n).repeat({1, 1, H_v / H_k, 1});
        };
        const torch::Tensor q = heads(parts[0]), k = heads(parts[1]);
        const torch::Tensor v = parts[2].reshape({B, T, H_v, d});

        const torch::Tensor alpha = linear(ctx, layer_tensor(il, "ssm_alpha.weight"), h).to(torch::kFloat);
        const torch::Tensor dt_bias = ctx.w.get(layer_tensor(il, "ssm_dt.bias")).to(h.device(), torch::kFloat);
        const torch::Tensor a = ctx.w.get(layer_tensor(il, "ssm_a")).to(h.device(), torch::kFloat);
        const torch::Tensor g = torch::softplus(alpha + dt_bias) * a;  // [B, T, H_v], ≤ 0
        const torch::Tensor beta = torch::sigmoid(linear(ctx, layer_tensor(il, "ssm_beta.weight"), h).to(torch::kFloat));

        const torch::Tensor o = gated_delta_rule(q, k, v, g, beta);  // [B, T, H_v, d] f32
        const torch::Tensor z = linear(ctx, layer_tensor(il, "attn_gate.weight"), h).reshape({B, T, H_v, d});
        const torch::Tensor gated = rms_norm(ctx, layer_tensor(il, "ssm_norm.weight"), o, hp.norm_rms_eps).to(torch::kFloat) *
                                    torch::silu(z.to(torch::kFloat));
        return linear(ctx, layer_tensor(il, "ssm_out.weight"), gated.reshape({B, T, value_dim}).to(ctx.dtype));
    }

    /// qwen35moe's FFN (llama_model_qwen35moe::graph::build_layer_ffn): the routed experts (moe_ffn) plus the shared
    /// expert, a SwiGLU MLP (ffn_{gate,up,down}_shexp) scaled per token by sigmoid(f · ffn_gate_inp_shexp), where
    /// ffn_gate_inp_shexp is one [n_embd] vector (a matmul with one output, in f32 as the F32 vector makes it in
    /// llama.cpp). f [B, T, n_embd] → [B, T, n_embd].
    torch::Tensor experts(forward_context & ctx, int64_t il, const torch::Tensor & f) const {
        const std::string blk = fmt::format("blk.{}", il);
        const torch::Tensor routed = moe_ffn(ctx, blk, f, hp_);
        const torch::Tensor shared = linear(ctx, blk + ".ffn_down_shexp.weight",
                                            torch::silu(linear(ctx, blk + ".ffn_gate_shexp.weight", f)) *
                                                linear(ctx, blk + ".ffn_up_shexp.weight", f));
        const std::string gate_name = blk + ".ffn_gate_inp_shexp.weight";
        if (ctx.observer && *ctx.observer) {
            (*ctx.observer)(gate_name, f, -1);
        }
        const torch::Tensor gate_w = ctx.w.get(gate_name).to(f.device(), torch::kFloat).reshape({-1, 1});
        const torch::Tensor gate = torch::sigmoid(torch::matmul(f.to(torch::kFloat), gate_w));  // [B, T, 1]
        return (routed.to(torch::kFloat) + shared.to(torch::kFloat) * gate).to(ctx.dtype);
    }

    /// A gated attention layer: h [B, T, n_embd] → [B, T, n_embd].
    torch::Tensor attention(forward_context & ctx, int64_t il, const torch::Tensor & h, const rope_tables & rope) const {
        using torch::indexing::Slice;
        const model_hparams & hp = hp_;
        const int64_t B = h.size(0), T = h.size(1), d = hp.n_embd_head_k;
        // attn_q: per head [query (d) | gate (d)]
        const torch::Tensor qg = linear(ctx, layer_tensor(il, "attn_q.weight"), h).view({B, T, hp.n_head, 2 * d});
        torch::Tensor q = qg.index({"...", Slice(0, d)});
        const torch::Tensor gate = qg.index({"...", Slice(d, 2 * d)}).reshape({B, T, hp.n_head * d});
        torch::Tensor k = linear(ctx, layer_tensor(il, "attn_k.weight"), h).view({B, T, hp.n_head_kv, d});
        const torch::Tensor v = linear(ctx, layer_tensor(il, "attn_v.weight"), h).view({B, T, hp.n_head_kv, d});
        q = apply_rope(rms_norm(ctx, layer_tensor(il, "attn_q_norm.weight"), q, hp.norm_rms_eps), rope, hp);
        k = apply_rope(rms_norm(ctx, layer_tensor(il, "attn_k_norm.weight"), k, hp.norm_rms_eps), rope, hp);
        const torch::Tensor att = causal_attention(q, k, v, hp.kq_scale) * torch::sigmoid(gate);
        return linear(ctx, layer_tensor(il, "attn_output.weight"), att);
    }
};

/// The tensors llama_model_qwen35::load_arch_tensors creates (without MTP layers), with their shapes.
void check_qwen35_tensors(const gguf_file & file, const model_hparams & hp) {
    tensor_checklist tensors(file);
    auto blk = [](int64_t il, const char * name) { return fmt::format("blk.{}.{}", il, name); };
    const std::string embd = fmt::format("{}.embedding_length = {}", hp.arch, hp.n_embd);
    const std::string ff_why = fmt::format("n_embd {} and {}.feed_forward_length = {}", hp.n_embd, hp.arch, hp.n_ff);
    const int64_t d = hp.n_embd_head_k;
    const std::string q_why = fmt::format("n_embd {}, head_count {} × key_length {} × 2 (query and gate)", hp.n_embd, hp.n_head, d);
    const std::string kv_why = fmt::format("n_embd {} and head_count_kv {} × key_length {}", hp.n_embd, hp.n_head_kv, d);
    const std::string head_why = fmt::format("{}.attention.key_length = {}", hp.arch, d);
    const int64_t key_dim = hp.ssm_d_state * hp.ssm_n_group, value_dim = hp.ssm_d_state * hp.ssm_dt_rank;
    const std::string ssm_why = fmt::format("{}.ssm.state_size {} × group_count {} (keys) and × time_step_rank {} (values)",
                                            hp.arch, hp.ssm_d_state, hp.ssm_n_group, hp.ssm_dt_rank);
    const std::string heads_why = fmt::format("{}.ssm.time_step_rank = {}", hp.arch, hp.ssm_dt_rank);
    tensors.require("token_embd.weight", {hp.n_embd, hp.n_vocab}, embd + " and the vocabulary");
    tensors.require("output_norm.weight", {hp.n_embd}, embd);
    tensors.optional("output.weight", {hp.n_embd, hp.n_vocab}, embd + " and the vocabulary");
    for (int64_t il = 0; il < hp.n_layer; ++il) {
        tensors.require(blk(il, "attn_norm.weight"), {hp.n_embd}, embd);
        tensors.require(blk(il, "post_attention_norm.weight"), {hp.n_embd}, embd);
        if (hp.is_recurrent(il)) {
            const std::string kernel = blk(il, "ssm_conv1d.weight");
            tensors.require(blk(il, "attn_qkv.weight"), {hp.n_embd, 2 * key_dim + value_dim}, ssm_why);
            tensors.require(blk(il, "attn_gate.weight"), {hp.n_embd, value_dim}, ssm_why);
            tensors.require(kernel, {hp.ssm_d_conv, 2 * key_dim + value_dim},
                            fmt::format("{}.ssm.conv_kernel = {} and {}", hp.arch, hp.ssm_d_conv, ssm_why));
            if (file.tensor(kernel).type != GGML_TYPE_F32) {
                fail("'{}': tensor '{}' is {}; the convolution kernel must be F32 (llama.cpp's ggml_ssm_conv reads "
                     "f32, and convert_hf_to_gguf.py always writes it so)", file.path(), kernel,
                     type_name(file.tensor(kernel).type));
            }
            tensors.require(blk(il, "ssm_dt.bias"), {hp.ssm_dt_rank}, heads_why);
            tensors.require(blk(il, "ssm_a"), {hp.ssm_dt_rank}, heads_why);
            tensors.require(blk(il, "ssm_beta.weight"), {hp.n_embd, hp.ssm_dt_rank}, heads_why);
            tensors.require(blk(il, "ssm_alpha.weight"), {hp.n_embd, hp.ssm_dt_rank}, heads_why);
            tensors.require(blk(il, "ssm_norm.weight"), {hp.ssm_d_state}, ssm_why);
            tensors.require(blk(il, "ssm_out.weight"), {value_dim, hp.n_embd}, ssm_why);
        } else {
            tensors.require(blk(il, "attn_q.weight"), {hp.n_embd, 2 * hp.n_embd_q()}, q_why);
            tensors.require(blk(il, "attn_k.weight"), {hp.n_embd, hp.n_embd_k_gqa()}, kv_why);
            tensors.require(blk(il, "attn_v.weight"), {hp.n_embd, hp.n_embd_v_gqa()}, kv_why);
            tensors.require(blk(il, "attn_output.weight"), {hp.n_embd_q(), hp.n_embd}, q_why);
            tensors.require(blk(il, "attn_q_norm.weight"), {d}, head_why);
            tensors.require(blk(il, "attn_k_norm.weight"), {d}, head_why);
        }
        if (hp.n_expert > 0) {
            check_expert_tensors(tensors, hp, il, /*fused_gate_up=*/true);
            const std::string sh_why = fmt::format("n_embd {} and {}.expert_shared_feed_forward_length = {}", hp.n_embd,
                                                   hp.arch, hp.n_ff_shexp);
            tensors.require(blk(il, "ffn_gate_inp_shexp.weight"), {hp.n_embd}, embd);
            tensors.require(blk(il, "ffn_gate_shexp.weight"), {hp.n_embd, hp.n_ff_shexp}, sh_why);
            tensors.require(blk(il, "ffn_up_shexp.weight"), {hp.n_embd, hp.n_ff_shexp}, sh_why);
            tensors.require(blk(il, "ffn_down_shexp.weight"), {hp.n_ff_shexp, hp.n_embd}, sh_why);
        } else {
            tensors.require(blk(il, "ffn_gate.weight"), {hp.n_embd, hp.n_ff}, ff_why);
            tensors.require(blk(il, "ffn_up.weight"), {hp.n_embd, hp.n_ff}, ff_why);
            tensors.require(blk(il, "ffn_down.weight"), {hp.n_ff, hp.n_embd}, ff_why);
        }
    }
    tensors.refuse_others(hp);
}

/// llama_model_qwen35::load_arch_hparams: the gated delta net's sizes, the M-RoPE sections, the layer kinds.
void read_qwen35_hparams(const gguf_file & file, model_hparams & hp) {
    const metadata_reader md(file, hp.arch);
    if (const std::optional<int64_t> nextn = file.get_int(md.key("nextn_predict_layers")); nextn && *nextn > 0) {
        fail("'{}': metadata key '{}' = {}: multi-token-prediction layers are not supported", file.path(),
             md.key("nextn_predict_layers"), *nextn);
    }
    if (hp.n_embd_head_v != hp.n_embd_head_k) {
        fail("'{}': '{}' = {} must equal '{}' = {} (llama.cpp asserts it)", file.path(), md.key("attention.value_length"),
             hp.n_embd_head_v, md.key("attention.key_length"), hp.n_embd_head_k);
    }
    hp.ssm_d_conv = md.required_positive("ssm.conv_kernel", "the delta net's convolution taps");
    hp.ssm_d_inner = md.required_positive("ssm.inner_size", "value heads × value head size");
    hp.ssm_d_state = md.required_positive("ssm.state_size", "the key and value head size");
    hp.ssm_dt_rank = md.required_positive("ssm.time_step_rank", "the number of value heads");
    hp.ssm_n_group = md.required_positive("ssm.group_count", "the number of key heads");
    if (hp.ssm_dt_rank % hp.ssm_n_group != 0) {
        fail("'{}': '{}' = {} (value heads) is not a multiple of '{}' = {} (key heads)", file.path(),
             md.key("ssm.time_step_rank"), hp.ssm_dt_rank, md.key("ssm.group_count"), hp.ssm_n_group);
    }
    if (hp.ssm_d_inner != hp.ssm_dt_rank * hp.ssm_d_state) {
        fail("'{}': '{}' = {} ≠ time_step_rank {} × state_size {}: llama.cpp's delta net needs value heads of the key "
             "head size", file.path(), md.key("ssm.inner_size"), hp.ssm_d_inner, hp.ssm_dt_rank, hp.ssm_d_state);
    }
    const std::optional<std::vector<int64_t>> sections = md.per_layer("rope.dimension_sections", 4);
    if (!sections) {
        fail("'{}': missing metadata key '{}' (the M-RoPE sections); a {} GGUF from convert_hf_to_gguf.py has it",
             file.path(), md.key("rope.dimension_sections"), hp.arch);
    }
    hp.rope_sections = *sections;
    if (hp.rope_sections[0] + hp.rope_sections[1] + hp.rope_sections[2] + hp.rope_sections[3] == 0) {
        fail("'{}': metadata key '{}' is all zeros", file.path(), md.key("rope.dimension_sections"));
    }
    if (const std::optional<std::vector<int64_t>> recurrent = md.per_layer("attention.recurrent_layers", hp.n_layer)) {
        for (const int64_t r : *recurrent) {
            hp.recurrent_layers.push_back(r != 0);
        }
    } else {
        const int64_t interval = md.optional_positive("full_attention_interval", 4);
        for (int64_t il = 0; il < hp.n_layer; ++il) {
            hp.recurrent_layers.push_back((il + 1) % interval != 0);
        }
    }
}

}  // namespace

std::unique_ptr<causal_lm> build_qwen35(const gguf_file & file) {
    model_hparams hp = read_llama_like_hparams(file, rope_type_neox);
    read_qwen35_hparams(file, hp);
    check_qwen35_tensors(file, hp);
    return std::make_unique<qwen35_model>(std::move(hp));
}

std::unique_ptr<causal_lm> build_qwen35moe(const gguf_file & file) {
    model_hparams hp = read_llama_like_hparams(file, rope_type_neox, false, /*experts=*/true);
    read_qwen35_hparams(file, hp);
    read_expert_hparams(file, hp);
    if (hp.n_ff_shexp <= 0) {
        fail("'{}': missing metadata key 'qwen35moe.expert_shared_feed_forward_length' (and no "
             "'qwen35moe.feed_forward_length' to take it from)", file.path());
    }
    check_qwen35_tensors(file, hp);
    return std::make_unique<qwen35_model>(std::move(hp));
}

}  // namespace voodoo
