// The host side of the GPU dequantizers: ggml's lookup tables, and the same eight-weight rules applied on
// the CPU, so that the CPU build (and CI) checks the rules the kernels run against libggml-base.
#pragma once

#include "cuda/deq_rules.h"

#include <ggml.h>

#include <cstddef>
#include <cstdint>
#include <span>

namespace voodoo {

/// ggml's i-quant tables (ggml-common.h of the pinned llama.cpp, compiled into this library), in host memory.
const deq::tables & host_deq_tables();

/// The tables as one block of bytes, in the order of deq::tables' fields, and each field's offset into it:
/// what the CUDA side uploads once and points a device deq::tables into.
struct packed_deq_tables {
    std::span<const uint8_t> bytes;
    size_t offsets[8];
};
const packed_deq_tables & packed_host_deq_tables();

/// to_float of `n_rows` rows of ne0 weights of `type` through deq::deq8 on the CPU: the GPU's rule, run here.
/// bytes: n_rows · ggml_row_size(type, ne0); out: n_rows · ne0 floats. Throws voodoo::error when the type
/// has no rule, ne0 is not a multiple of its block size, or a size disagrees.
void dequantize_by_rule(ggml_type type, std::span<const uint8_t> bytes, int64_t ne0, std::span<float> out);

}  // namespace voodoo
