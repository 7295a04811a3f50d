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

TEST(selection, the_default_menu_leaves_the_fallback_types_to_rows_no_256_block_fits) {
    // 4,096-wide rows: every type fits, so IQ4_NL, Q4_0, Q4_1, Q5_0 and Q5_1 (llama.cpp's fallbacks) are left out.
    const auto wide = default_menu_for(4096, true, false);
    const auto every = menu_for(default_menu_types(), 4096, true);
    EXPECT_EQ(wide.size(), every.size() - 5);
    for (ggml_type t : every) {
        EXPECT_EQ(std::count(wide.begin(), wide.end(), t), is_fallback_type(t) ? 0 : 1) << type_name(t);
    }
    EXPECT_EQ(std::count(wide.begin(), wide.end(), GGML_TYPE_Q8_0), 1);  // a 32-block type, but no fallback
    // with_fallbacks (--menu all, --max-slowdown): the whole menu.
    EXPECT_EQ(default_menu_for(4096, true, true), every);
    // 64- and 2,880-wide rows: no 256-block type fits, so the fallback types are the 4-6 bit types and stay.
    EXPECT_EQ(default_menu_for(64, true, false), menu_for(default_menu_types(), 64, true));
    const auto narrow = default_menu_for(2880, true, false);
    EXPECT_EQ(narrow, menu_for(default_menu_types(), 2880, true));
    EXPECT_EQ(std::count(narrow.begin(), narrow.end(), GGML_TYPE_IQ4_NL), 1);
    // Without an imatrix a 256-block type (Q2_K … Q6_K, IQ4_XS) still fits: the rule is the same.
    const auto no_imatrix = default_menu_for(4096, false, false);
    EXPECT_EQ(std::count_if(no_imatrix.begin(), no_imatrix.end(), is_fallback_type), 0);
    EXPECT_EQ(std::count(no_imatrix.begin(), no_imatrix.end(), GGML_TYPE_Q4_K), 1);
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
