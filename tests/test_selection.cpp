#include "ggml/selection.h"
#include "ggml/types.h"

#include <gtest/gtest.h>

#include <algorithm>

using namespace voodoo;

TEST(selection, weights_of_two_or_more_dims_are_selectable_like_llama_quantize) {
    EXPECT_TRUE(tensor_is_selectable("token_embd.weight", 2));
    EXPECT_TRUE(tensor_is_selectable("output.weight", 2));
    EXPECT_TRUE(tensor_is_selectable("blk.3.attn_q.weight", 2));
    EXPECT_TRUE(tensor_is_selectable("blk.3.ffn_down_exps.weight", 3));
}

TEST(selection, norms_biases_routers_and_one_dim_tensors_are_copied) {
    EXPECT_FALSE(tensor_is_selectable("blk.0.attn_norm.weight", 1));
    EXPECT_FALSE(tensor_is_selectable("blk.0.attn_q_norm.weight", 2));  // "_norm.weight" even when 2-D
    EXPECT_FALSE(tensor_is_selectable("blk.0.attn_q.bias", 1));
    EXPECT_FALSE(tensor_is_selectable("blk.0.attn_q.weight", 1));
    EXPECT_FALSE(tensor_is_selectable("blk.0.ffn_gate_inp.weight", 2));
    EXPECT_FALSE(tensor_is_selectable("position_embd.weight", 2));
    EXPECT_FALSE(tensor_is_selectable("blk.0.ssm_conv1d.weight", 2));
    EXPECT_FALSE(tensor_is_selectable("rope_freqs", 1));
}

TEST(selection, default_menu_runs_from_iq1_s_to_q8_0_then_floats_by_bpw) {
    const auto & menu = default_menu_types();
    EXPECT_EQ(menu.front(), GGML_TYPE_IQ1_S);
    EXPECT_EQ(menu[menu.size() - 3], GGML_TYPE_Q8_0);
    EXPECT_TRUE(std::is_sorted(menu.begin(), menu.end(), [](ggml_type a, ggml_type b) {
        return type_info_of(a).bpw < type_info_of(b).bpw;
    }));
}

TEST(selection, a_64_wide_tensor_gets_the_32_block_types_and_the_floats) {
    const auto menu = menu_for(default_menu_types(), 64, true);
    const std::vector<ggml_type> want = {GGML_TYPE_IQ4_NL, GGML_TYPE_Q4_0, GGML_TYPE_Q4_1, GGML_TYPE_Q5_0,
                                         GGML_TYPE_Q5_1,   GGML_TYPE_Q8_0, GGML_TYPE_F16,  GGML_TYPE_BF16};
    EXPECT_EQ(menu, want);
}

TEST(selection, a_tensor_no_block_fits_keeps_the_float_types) {
    const auto menu = menu_for(default_menu_types(), 172, true);
    EXPECT_EQ(menu, (std::vector<ggml_type>{GGML_TYPE_F16, GGML_TYPE_BF16}));
}

TEST(selection, the_iq1_iq2_iq3_xxs_family_needs_an_imatrix) {
    const auto without = menu_for(default_menu_types(), 4096, false);
    const auto with = menu_for(default_menu_types(), 4096, true);
    EXPECT_EQ(std::count(without.begin(), without.end(), GGML_TYPE_IQ2_XXS), 0);
    EXPECT_EQ(std::count(without.begin(), without.end(), GGML_TYPE_IQ3_XXS), 0);
    EXPECT_EQ(std::count(without.begin(), without.end(), GGML_TYPE_IQ3_S), 1);
    EXPECT_EQ(std::count(with.begin(), with.end(), GGML_TYPE_IQ1_S), 1);
    EXPECT_EQ(with.size(), default_menu_types().size());
    EXPECT_EQ(without.size(), with.size() - 6);
}

TEST(selection, qwen_gemma_phi_extras_are_copied_and_fused_tensors_are_selectable_whole) {
    // qwen2's biases, qwen3/gemma3's per-head Q/K norms, gemma3's post norms, phi3's rope factors: copied,
    // as llama.cpp's tensor_allows_quantization leaves them (1-D, a bias, or "_norm.weight").
    for (const char * name : {"blk.0.attn_k.bias", "blk.0.attn_qkv.bias", "output.bias", "blk.1.attn_k_norm.weight",
                              "blk.1.post_attention_norm.weight", "blk.1.post_ffw_norm.weight",
                              "rope_factors_long.weight", "rope_factors_short.weight"}) {
        EXPECT_FALSE(tensor_is_selectable(name, 1)) << name;
    }
    // phi3's fused attn_qkv and gate+up ffn_up are one 2-D weight each, as llama-quantize sees them.
    EXPECT_TRUE(tensor_is_selectable("blk.0.attn_qkv.weight", 2));
    EXPECT_TRUE(tensor_is_selectable("blk.0.ffn_up.weight", 2));
}

TEST(selection, hybrid_convolution_kernels_are_copied_and_their_projections_are_selectable) {
    // llama-quant.cpp never quantizes the 2-D convolution kernels of LFM2 ("shortconv.conv.weight") and of the
    // delta net / Mamba layers ("ssm_conv1d"), nor LFM2's final norm (stored as token_embd_norm).
    EXPECT_FALSE(tensor_is_selectable("blk.0.shortconv.conv.weight", 2));
    EXPECT_FALSE(tensor_is_selectable("blk.0.ssm_conv1d.weight", 2));
    EXPECT_FALSE(tensor_is_selectable("token_embd_norm.weight", 1));
    EXPECT_FALSE(tensor_is_selectable("token_embd_norm.weight", 2));
    // Qwen3.5's per-head decay and bias (1-D; ssm_a has no ".weight") and the delta net's norm.
    EXPECT_FALSE(tensor_is_selectable("blk.0.ssm_a", 1));
    EXPECT_FALSE(tensor_is_selectable("blk.0.ssm_dt.bias", 1));
    EXPECT_FALSE(tensor_is_selectable("blk.0.ssm_norm.weight", 1));
    // Their matmul weights are chosen for like any other.
    for (const char * name : {"blk.0.shortconv.in_proj.weight", "blk.0.shortconv.out_proj.weight", "blk.0.attn_gate.weight",
                              "blk.0.ssm_alpha.weight", "blk.0.ssm_beta.weight", "blk.0.ssm_out.weight"}) {
        EXPECT_TRUE(tensor_is_selectable(name, 2)) << name;
    }
}
