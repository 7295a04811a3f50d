#include "model/arch/llama_like.h"

#include "common/error.h"
#include "ggml/gguf.h"

#include <fmt/format.h>

namespace voodoo {

void check_attention_tensors(tensor_checklist & tensors, const model_hparams & hp, int64_t il) {
    auto blk = [il](const char * name) { return fmt::format("blk.{}.{}", il, name); };
    const std::string q_why = fmt::format("n_embd {} and head_count {} × key_length {}", hp.n_embd, hp.n_head, hp.n_embd_head_k);
    const std::string k_why = fmt::format("n_embd {} and head_count_kv {} × key_length {}", hp.n_embd, hp.n_head_kv, hp.n_embd_head_k);
    const std::string v_why = fmt::format("n_embd {} and head_count_kv {} × value_length {}", hp.n_embd, hp.n_head_kv, hp.n_embd_head_v);
    const std::string qkv_why = q_why + ", " + k_why + " and value_length " + std::to_string(hp.n_embd_head_v);
    const int64_t n_qkv = hp.n_embd_q() + hp.n_embd_k_gqa() + hp.n_embd_v_gqa();
    if (tensors.optional(blk("attn_qkv.weight"), {hp.n_embd, n_qkv}, qkv_why)) {
        tensors.optional(blk("attn_qkv.bias"), {n_qkv}, qkv_why);
    } else {
        tensors.require(blk("attn_q.weight"), {hp.n_embd, hp.n_embd_q()}, q_why);
        tensors.require(blk("attn_k.weight"), {hp.n_embd, hp.n_embd_k_gqa()}, k_why);
        tensors.require(blk("attn_v.weight"), {hp.n_embd, hp.n_embd_v_gqa()}, v_why);
        tensors.optional(blk("attn_q.bias"), {hp.n_embd_q()}, q_why);
        tensors.optional(blk("attn_k.bias"), {hp.n_embd_k_gqa()}, k_why);
        tensors.optional(blk("attn_v.bias"), {hp.n_embd_v_gqa()}, v_why);
    }
    tensors.require(blk("attn_output.weight"), {hp.n_embd_head_v * hp.n_head, hp.n_embd}, q_why);
}

void check_llama_like_tensors(tensor_checklist & tensors, const model_hparams & hp, const llama_like_layout & layout) {
    const std::string & arch = hp.arch;
    auto blk = [](int64_t il, const char * name) { return fmt::format("blk.{}.{}", il, name); };
    const std::string embd = fmt::format("{}.embedding_length = {}", arch, hp.n_embd);
    tensors.require("token_embd.weight", {hp.n_embd, hp.n_vocab}, embd + " and the vocabulary");
    tensors.require("output_norm.weight", {hp.n_embd}, embd);
    tensors.optional("output.weight", {hp.n_embd, hp.n_vocab}, embd + " and the vocabulary");
    const std::string ff_why = fmt::format("n_embd {} and {}.feed_forward_length = {}", hp.n_embd, arch, hp.n_ff);
    const std::string head_why = fmt::format("{}.attention.key_length = {}", arch, hp.n_embd_head_k);
    for (int64_t il = 0; il < hp.n_layer; ++il) {
        tensors.require(blk(il, "attn_norm.weight"), {hp.n_embd}, embd);
        check_attention_tensors(tensors, hp, il);
        if (layout.qk_norm) {
            tensors.require(blk(il, "attn_q_norm.weight"), {hp.n_embd_head_k}, head_why);
            tensors.require(blk(il, "attn_k_norm.weight"), {hp.n_embd_head_k}, head_why);
        }
        tensors.require(blk(il, "ffn_norm.weight"), {hp.n_embd}, embd);
        if (layout.experts) {
            check_expert_tensors(tensors, hp, il);
        } else if (layout.fused_gate_up) {
            tensors.require(blk(il, "ffn_up.weight"), {hp.n_embd, 2 * hp.n_ff}, ff_why + " (gate and up fused: 2·n_ff rows)");
        } else {
            tensors.require(blk(il, "ffn_gate.weight"), {hp.n_embd, hp.n_ff}, ff_why);
            tensors.require(blk(il, "ffn_up.weight"), {hp.n_embd, hp.n_ff}, ff_why);
        }
        if (!layout.experts) {
            tensors.require(blk(il, "ffn_down.weight"), {hp.n_ff, hp.n_embd}, ff_why);
        }
        if (layout.post_norms) {
            tensors.require(blk(il, "post_attention_norm.weight"), {hp.n_embd}, embd);
            tensors.require(blk(il, "post_ffw_norm.weight"), {hp.n_embd}, embd);
        }
    }
}

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

void require_rope_over_whole_head(const gguf_file & file, const model_hparams & hp) {
    if (hp.n_embd_head_v != hp.n_embd_head_k) {
        fail("'{}': '{}.attention.value_length' = {} must equal '{}.attention.key_length' = {} for {} (llama.cpp "
             "asserts it)", file.path(), hp.arch, hp.n_embd_head_v, hp.arch, hp.n_embd_head_k, hp.arch);
    }
    if (hp.n_rot != hp.n_embd_head_k) {
        fail("'{}': '{}.rope.dimension_count' = {} must equal the head size {} for {} (llama.cpp asserts it)",
             file.path(), hp.arch, hp.n_rot, hp.n_embd_head_k, hp.arch);
    }
}

}  // namespace voodoo
