#include "ggml/quant.h"

#include "common/error.h"
#include "ggml/types.h"

#include <algorithm>
#include <cstring>
#include <thread>

namespace voodoo {

int resolve_threads(int n) {
    if (n > 0) {
        return n;
    }
    return std::max(1u, std::thread::hardware_concurrency());
}

namespace {

// Runs fn(row_begin, row_end) over [0, rows) in contiguous slices, one per thread; small work stays
// on the calling thread (thread start-up costs more than quantizing a few thousand weights).
template <typename Fn>
void parallel_rows(int64_t rows, int64_t ne0, int n_threads, Fn && fn) {
    constexpr int64_t k_min_weights_per_thread = 1 << 16;
    int64_t threads = std::min<int64_t>(resolve_threads(n_threads), rows);
    threads = std::min<int64_t>(threads, std::max<int64_t>(1, rows * ne0 / k_min_weights_per_thread));
    if (threads <= 1) {
        fn(int64_t{0}, rows);
        return;
    }
    std::vector<std::thread> pool;
    const int64_t per = (rows + threads - 1) / threads;
    for (int64_t r0 = 0; r0 < rows; r0 += per) {
        pool.emplace_back([&fn, r0, r1 = std::min(rows, r0 + per)] { fn(r0, r1); });
    }
    for (auto & t : pool) {
        t.join();
    }
}

int64_t whole_rows(ggml_type type, size_t n_bytes, int64_t ne0, std::string_view tensor_name) {
    const size_t row = ggml_row_size(type, ne0);
    if (row == 0 || n_bytes % row != 0) {
        fail("tensor '{}': {} bytes of {} are not a whole number of rows of {} weights ({} bytes each)", tensor_name,
             n_bytes, type_name(type), ne0, row);
    }
    return static_cast<int64_t>(n_bytes / row);
}

}  // namespace

void quantize_into(ggml_type type, std::span<const float> src, int64_t ne0, std::span<uint8_t> dst,
                   std::span<const float> imatrix, int n_threads, std::string_view tensor_name) {
    const type_info & info = type_info_of(type);
    if (ne0 <= 0 || src.size() % static_cast<size_t>(ne0) != 0) {
        fail("tensor '{}': {} weights are not a whole number of rows of ne0 = {}", tensor_name, src.size(), ne0);
    }
    const int64_t rows = static_cast<int64_t>(src.size()) / ne0;
    const int64_t ne[2] = {ne0, rows};
    const size_t want = tensor_bytes(type, ne, tensor_name);
    if (dst.size() != want) {
        fail("tensor '{}' {} as {}: destination holds {} bytes, needs {}", tensor_name, shape_str(ne), info.name,
             dst.size(), want);
    }
    if (!imatrix.empty() && imatrix.size() != static_cast<size_t>(ne0)) {
        fail("tensor '{}' {}: the imatrix has {} values, expected ne0 = {}", tensor_name, shape_str(ne),
             imatrix.size(), ne0);
    }
    if (info.requires_imatrix && imatrix.empty()) {
        fail("tensor '{}': {} needs an importance matrix; pass --imatrix or choose another type", tensor_name,
             info.name);
    }
    ggml_quantize_init(type);  // builds the IQ grids once, before the threads share them
    const float * imat = imatrix.empty() ? nullptr : imatrix.data();
    parallel_rows(rows, ne0, n_threads, [&](int64_t r0, int64_t r1) {
        // ggml_quantize_chunk places row r at dst + r · row_size itself, so every slice gets the same base.
        ggml_quantize_chunk(type, src.data(), dst.data(), r0 * ne0, r1 - r0, ne0, imat);
    });
}

std::vector<uint8_t> quantize(ggml_type type, std::span<const float> src, int64_t ne0, std::span<const float> imatrix,
                              int n_threads, std::string_view tensor_name) {
    if (ne0 <= 0 || src.size() % static_cast<size_t>(ne0) != 0) {
        fail("tensor '{}': {} weights are not a whole number of rows of ne0 = {}", tensor_name, src.size(), ne0);
    }
    const int64_t ne[2] = {ne0, static_cast<int64_t>(src.size()) / ne0};
    std::vector<uint8_t> out(tensor_bytes(type, ne, tensor_name));
    quantize_into(type, src, ne0, out, imatrix, n_threads, tensor_name);
    return out;
}

void dequantize_into(ggml_type type, std::span<const uint8_t> src, int64_t ne0, std::span<float> dst, int n_threads,
                     std::string_view tensor_name) {
    if (!type_fits(type, ne0)) {
        const int64_t ne[1] = {ne0};
        tensor_bytes(type, ne, tensor_name);  // throws the standard "does not fit" error
    }
    const int64_t rows = whole_rows(type, src.size(), ne0, tensor_name);
    if (dst.size() != static_cast<size_t>(rows * ne0)) {
        fail("tensor '{}': destination holds {} floats, needs {}", tensor_name, dst.size(), rows * ne0);
    }
    const size_t row_size = ggml_row_size(type, ne0);
    if (type == GGML_TYPE_F32) {
        std::memcpy(dst.data(), src.data(), src.size());
        return;
    }
    const ggml_to_float_t to_float = ggml_get_type_traits(type)->to_float;
    if (!to_float) {
        fail("tensor '{}': ggml has no to_float for {}", tensor_name, type_name(type));
    }
    parallel_rows(rows, ne0, n_threads, [&](int64_t r0, int64_t r1) {
        to_float(src.data() + r0 * row_size, dst.data() + r0 * ne0, (r1 - r0) * ne0);
    });
}

std::vector<float> dequantize(ggml_type type, std::span<const uint8_t> src, int64_t ne0, int n_threads,
                              std::string_view tensor_name) {
    const int64_t rows = whole_rows(type, src.size(), ne0, tensor_name);
    std::vector<float> out(static_cast<size_t>(rows * ne0));
    dequantize_into(type, src, ne0, out, n_threads, tensor_name);
    return out;
}

void validate_rows(ggml_type type, std::span<const uint8_t> src, int64_t ne0, std::string_view tensor_name) {
    // ggml reports the bad block on stderr itself; we name the tensor and the row.
    const int64_t rows = whole_rows(type, src.size(), ne0, tensor_name);
    const size_t row_size = ggml_row_size(type, ne0);
    for (int64_t r = 0; r < rows; ++r) {
        if (!ggml_validate_row_data(type, src.data() + r * row_size, row_size)) {
            fail("tensor '{}' ({}): row {} holds invalid data (NaN/inf scale or bad code)", tensor_name,
                 type_name(type), r);
        }
    }
}

}  // namespace voodoo
