// The ggml type table: every storage type a GGUF tensor can be quantized to, with its numbers taken
// from ggml's own traits (ggml_get_type_traits, ggml_row_size, ggml_quantize_requires_imatrix).
#pragma once

#include <ggml.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace voodoo {

struct type_info {
    ggml_type   type;
    std::string name;               // ggml's name: "q4_K", "iq2_xxs", "f16"
    int64_t     blck_size;          // weights per block; ne0 must be a multiple of it
    size_t      type_size;          // bytes per block
    double      bpw;                // bits per weight = 8 · type_size / blck_size
    bool        is_quantized;       // false for F32, F16, BF16
    bool        requires_imatrix;   // ggml refuses to quantize without one (ggml_quantize_requires_imatrix)
    bool        needs_imatrix;      // llama.cpp refuses without one (llama-quant.cpp tensor_requires_imatrix):
                                    // the IQ1/IQ2/IQ3_XXS family
};

/// Every storage type: the types ggml_quantize_chunk can produce (ggml.c), in ggml enum order.
const std::vector<type_info> & type_table();

/// The entry of a storage type. Throws voodoo::error for a type that is not a storage type (Q8_K, I32, …).
const type_info & type_info_of(ggml_type type);

/// ggml's name of any type ("q4_K"); "type(N)" for an unknown value.
std::string type_name(ggml_type type);

/// Parses a type name, case-insensitively ("Q4_K", "q4_k", "iq2_xxs", "F16"). Storage types only.
std::optional<ggml_type> type_from_name(std::string_view name);

/// Parses a type name or throws voodoo::error that lists the storage types (`what` names the flag or file).
ggml_type parse_type(std::string_view name, std::string_view what);

/// True when a row of ne0 weights is a whole number of `type` blocks.
bool type_fits(ggml_type type, int64_t ne0);

/// Number of rows of a tensor: ne1 · ne2 · ne3 (ne holds 1 to 4 dims, ggml order, ne[0] innermost).
int64_t n_rows(std::span<const int64_t> ne);

/// Number of elements of a tensor: ne0 · ne1 · ne2 · ne3.
int64_t n_elements(std::span<const int64_t> ne);

/// Exact bytes of a tensor of shape ne stored as `type`: n_rows · ggml_row_size(type, ne0).
/// Throws voodoo::error naming `tensor_name` when ne0 is not a multiple of the block size.
size_t tensor_bytes(ggml_type type, std::span<const int64_t> ne, std::string_view tensor_name = "tensor");

/// "[64, 512]" — ggml order, ne0 first.
std::string shape_str(std::span<const int64_t> ne);

}  // namespace voodoo
