// Quantize and dequantize through ggml itself: the exact bytes llama-quantize writes and the exact
// floats llama.cpp's kernels see (exactness contract, DESIGN.md items 1 and 2).
#pragma once

#include <ggml.h>

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace voodoo {

/// Quantizes a row-major f32 tensor (src: [n_rows, ne0], ne0 innermost) to `type` with
/// ggml_quantize_chunk, the call llama-quantize makes, split over rows on `n_threads` threads
/// (0 = all cores). `imatrix`, when not empty, holds ne0 importance weights (Σx² per input column).
/// dst must hold exactly tensor_bytes(type, {ne0, n_rows}) bytes.
/// Throws voodoo::error naming `tensor_name` when ne0 does not fit the type's block, when the type
/// needs an imatrix and none is given, or when the sizes disagree.
void quantize_into(ggml_type type, std::span<const float> src, int64_t ne0, std::span<uint8_t> dst,
                   std::span<const float> imatrix = {}, int n_threads = 0, std::string_view tensor_name = "tensor");

/// quantize_into into a new buffer of exactly tensor_bytes(type, {ne0, n_rows}) bytes.
std::vector<uint8_t> quantize(ggml_type type, std::span<const float> src, int64_t ne0,
                              std::span<const float> imatrix = {}, int n_threads = 0,
                              std::string_view tensor_name = "tensor");

/// Dequantizes bytes of `type` (src: n_rows rows of ggml_row_size(type, ne0) bytes) to f32 with the
/// type's own to_float (F32 is copied). dst holds n_rows · ne0 floats.
/// Throws voodoo::error when the byte count is not a whole number of rows.
void dequantize_into(ggml_type type, std::span<const uint8_t> src, int64_t ne0, std::span<float> dst,
                     int n_threads = 0, std::string_view tensor_name = "tensor");

/// dequantize_into into a new buffer.
std::vector<float> dequantize(ggml_type type, std::span<const uint8_t> src, int64_t ne0, int n_threads = 0,
                              std::string_view tensor_name = "tensor");

/// Checks quantized bytes with ggml_validate_row_data (finite scales, valid codes), after checking the
/// byte count is whole rows. Throws voodoo::error naming the tensor when they are not valid.
void validate_rows(ggml_type type, std::span<const uint8_t> src, int64_t ne0, std::string_view tensor_name = "tensor");

/// Threads to use: n when positive, otherwise the number of cores.
int resolve_threads(int n);

}  // namespace voodoo
