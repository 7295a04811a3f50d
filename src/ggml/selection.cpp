#include "ggml/selection.h"

#include "ggml/types.h"

#include <algorithm>
#include <string>

namespace voodoo {

namespace {

bool contains(std::string_view s, std::string_view part) { return s.find(part) != std::string_view::npos; }

}  // namespace

bool tensor_is_selectable(std::string_view name, int n_dims) {
    if (n_dims < 2 || !name.ends_with("weight")) {
        return false;
    }
    // Same exclusions, same order, as llama.cpp's tensor_allows_quantization.
    static constexpr std::string_view k_excluded_parts[] = {
        "_norm.weight",          "ffn_gate_inp.weight",     "ffn_gate_tid2eid.weight", "altup",
        "laurel",                "per_layer_model_proj",    "ssm_conv1d",              "shortconv.conv.weight",
        "indexer.k_proj.weight", "indexer.q_proj.weight",   "time_mix_first.weight",   "time_mix_w0.weight",
        "time_mix_w1.weight",    "time_mix_w2.weight",      "time_mix_v0.weight",      "time_mix_v1.weight",
        "time_mix_v2.weight",    "time_mix_a0.weight",      "time_mix_a1.weight",      "time_mix_a2.weight",
        "time_mix_g1.weight",    "time_mix_g2.weight",      "time_mix_decay_w1.weight", "time_mix_decay_w2.weight",
        "time_mix_lerp_fused.weight", "attn_rel_b.weight",  ".position_embd",          "sam.pos_embd",
        "sam.neck.",             "sam.net_",                ".rel_pos",                ".patch_embd",
        ".patch_merger",         "a.rvq.codebook",          "mm.a.code_embd",
    };
    for (std::string_view part : k_excluded_parts) {
        if (contains(name, part)) {
            return false;
        }
    }
    // LLM_TENSOR_POS_EMBD and LLM_TENSOR_TOKEN_TYPES ("position_embd.weight", "token_types.weight").
    return name != "position_embd.weight" && name != "token_types.weight";
}

const std::vector<ggml_type> & default_menu_types() {
    static const std::vector<ggml_type> types = [] {
        std::vector<ggml_type> t = {
            GGML_TYPE_IQ1_S, GGML_TYPE_IQ1_M,  GGML_TYPE_IQ2_XXS, GGML_TYPE_IQ2_XS, GGML_TYPE_IQ2_S,
            GGML_TYPE_Q2_K,  GGML_TYPE_IQ3_XXS, GGML_TYPE_IQ3_S,  GGML_TYPE_Q3_K,   GGML_TYPE_IQ4_XS,
            GGML_TYPE_IQ4_NL, GGML_TYPE_Q4_0,  GGML_TYPE_Q4_K,    GGML_TYPE_Q4_1,   GGML_TYPE_Q5_0,
            GGML_TYPE_Q5_K,  GGML_TYPE_Q5_1,   GGML_TYPE_Q6_K,    GGML_TYPE_Q8_0,   GGML_TYPE_F16,
            GGML_TYPE_BF16,
        };
        std::stable_sort(t.begin(), t.end(),
                         [](ggml_type a, ggml_type b) { return type_info_of(a).bpw < type_info_of(b).bpw; });
        return t;
    }();
    return types;
}

std::vector<ggml_type> menu_for(std::span<const ggml_type> types, int64_t ne0, bool has_imatrix) {
    std::vector<ggml_type> menu;
    for (ggml_type t : types) {
        if (type_fits(t, ne0) && (has_imatrix || !type_info_of(t).needs_imatrix)) {
            menu.push_back(t);
        }
    }
    return menu;
}

bool is_fallback_type(ggml_type type) {
    switch (type) {
        case GGML_TYPE_IQ4_NL:
        case GGML_TYPE_Q4_0:
        case GGML_TYPE_Q4_1:
        case GGML_TYPE_Q5_0:
        case GGML_TYPE_Q5_1: return true;
        default: return false;
    }
}

std::vector<ggml_type> default_menu_for(int64_t ne0, bool has_imatrix, bool with_fallbacks) {
    std::vector<ggml_type> menu = menu_for(default_menu_types(), ne0, has_imatrix);
    const bool superblock_fits = std::any_of(menu.begin(), menu.end(), [](ggml_type t) {
        return type_info_of(t).is_quantized && type_info_of(t).blck_size == 256;
    });
    if (!with_fallbacks && superblock_fits) {
        std::erase_if(menu, is_fallback_type);
    }
    return menu;
}

}  // namespace voodoo

namespace voodoo {

ggml_type llama_type_fallback(ggml_type target, int64_t ne0) {
    if (type_fits(target, ne0)) {
        return target;
    }
    ggml_type fallback = target;
    switch (target) {
        case GGML_TYPE_IQ1_S:
        case GGML_TYPE_IQ1_M:
        case GGML_TYPE_IQ2_XXS:
        case GGML_TYPE_IQ2_XS:
        case GGML_TYPE_IQ2_S:
        case GGML_TYPE_IQ3_XXS:
        case GGML_TYPE_IQ3_S:
        case GGML_TYPE_IQ4_XS: fallback = GGML_TYPE_IQ4_NL; break;
        case GGML_TYPE_Q2_0:
        case GGML_TYPE_Q2_K:
        case GGML_TYPE_Q3_K:
        case GGML_TYPE_TQ1_0:
        case GGML_TYPE_TQ2_0: fallback = GGML_TYPE_Q4_0; break;
        case GGML_TYPE_Q4_K: fallback = GGML_TYPE_Q5_0; break;
        case GGML_TYPE_Q5_K: fallback = GGML_TYPE_Q5_1; break;
        case GGML_TYPE_Q6_K: fallback = GGML_TYPE_Q8_0; break;
        default: break;
    }
    return type_fits(fallback, ne0) ? fallback : GGML_TYPE_F16;
}

}  // namespace voodoo
