// Which tensors Voodoo chooses a type for, and among which types (DESIGN.md, "The math").
#pragma once

#include <ggml.h>

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace voodoo {

/// True for a weight llama.cpp would quantize: 2-D or more, name ends in "weight", not a norm, router,
/// conv kernel, positional table or the other exclusions of llama.cpp's tensor_allows_quantization
/// (src/llama-quant.cpp, with quantize_output_tensor on). Everything else is copied byte for byte.
bool tensor_is_selectable(std::string_view name, int n_dims);

/// The default menu: the general-purpose llama.cpp storage types from IQ1_S to Q8_0 plus F16 and BF16,
/// by increasing bits per weight. Left out: TQ1_0/TQ2_0 (ternary-trained models), MXFP4/NVFP4 (models
/// trained for FP4) and Q1_0/Q2_0; a --menu can still name them.
const std::vector<ggml_type> & default_menu_types();

/// The menu of one tensor: the types of `types` whose block size divides ne0, the ones that llama.cpp
/// refuses without an imatrix (IQ1/IQ2/IQ3_XXS family) only when has_imatrix. Order kept.
/// A tensor no block type fits keeps F16/BF16 (when in `types`), as llama.cpp falls back to F16.
std::vector<ggml_type> menu_for(std::span<const ggml_type> types, int64_t ne0, bool has_imatrix);

/// The 32-weight-block types that llama.cpp writes where a 256-block type does not fit a row
/// (tensor_type_fallback, src/llama-quant.cpp): IQ4_NL, Q4_0, Q4_1, Q5_0, Q5_1.
bool is_fallback_type(ggml_type type);

/// The default menu of one tensor of row length ne0: menu_for(default_menu_types(), ne0, has_imatrix), less the
/// fallback types (is_fallback_type) wherever a 256-block type fits the row, unless `with_fallbacks`.
/// Why: on every tensor of mix30M's three full probes (36 tensors each, docs/BENCHMARKS.md "The default menu without
/// llama.cpp's fallback types") none of the five is on the lower convex hull of (bytes, ΔKL), which the knapsack
/// chooses from, and IQ4_NL, Q4_0 and Q5_0 are not even on the Pareto front; yet with an imatrix their quantizers cost
/// a quarter of the candidates' build. Where no 256-block type fits (rows of 64, 2,880, …) they stay: they are then
/// the only 4-6 bit types. `with_fallbacks` keeps them everywhere: quantize --max-slowdown (Q4_0 and IQ4_NL have
/// the fastest CPU kernels) and `--menu all`.
std::vector<ggml_type> default_menu_for(int64_t ne0, bool has_imatrix, bool with_fallbacks);

}  // namespace voodoo

namespace voodoo {

/// The type llama-quantize really writes when `target` does not fit a tensor's ne0: llama.cpp's
/// tensor_type_fallback (src/llama-quant.cpp): 256-block IQ types → IQ4_NL, Q2_K/Q3_K → Q4_0,
/// Q4_K → Q5_0, Q5_K → Q5_1, Q6_K → Q8_0, and F16 when the fallback does not fit either.
/// Returns `target` when it fits.
ggml_type llama_type_fallback(ggml_type target, int64_t ne0);

}  // namespace voodoo
