// The GPU dequantizers' rules (src/cuda/deq_rules.h) run on the CPU here, in CI: for every type of the
// default menu they must equal libggml-base's to_float bit for bit. The same header is what the CUDA
// kernels compile; tests/test_cuda.cpp checks the kernels themselves on the GPU machine.
#include "cuda/deq_host.h"
#include "ggml/quant.h"
#include "ggml/selection.h"
#include "ggml/types.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

using namespace voodoo;

namespace {

constexpr int64_t k_rule_ne0 = 512;
constexpr int64_t k_rule_rows = 16;

std::vector<ggml_type> menu_and_f32() {
    std::vector<ggml_type> t = default_menu_types();
    t.push_back(GGML_TYPE_F32);
    return t;
}

// Index of the first element whose bits differ, or -1.
int64_t first_bit_difference(const std::vector<float> & a, const std::vector<float> & b) {
    for (size_t i = 0; i < a.size(); ++i) {
        if (std::memcmp(&a[i], &b[i], 4) != 0) {
            return static_cast<int64_t>(i);
        }
    }
    return -1;
}

}  // namespace

TEST(cuda_rules, every_menu_type_equals_ggml_to_float_bit_for_bit_on_quantized_gaussians) {
    std::vector<float> imatrix = test::gaussian(k_rule_ne0, 9);
    for (float & x : imatrix) {
        x = 0.1f + x * x;
    }
    for (const ggml_type type : menu_and_f32()) {
        ASSERT_TRUE(deq::has_rule(type)) << type_name(type);
        for (uint32_t seed : {1u, 2u}) {
            std::vector<float> w = test::gaussian(k_rule_ne0 * k_rule_rows, seed);
            for (size_t i = 0; i < w.size(); i += 97) {
                w[i] *= 20.0f;  // outliers: large scales and clipped codes
            }
            const auto bytes = quantize(type, w, k_rule_ne0, type_info_of(type).needs_imatrix ? std::span<const float>(imatrix)
                                                                                          : std::span<const float>());
            const std::vector<float> want = dequantize(type, bytes, k_rule_ne0);
            std::vector<float> got(want.size(), std::nanf(""));
            dequantize_by_rule(type, bytes, k_rule_ne0, got);
            const int64_t at = first_bit_difference(want, got);
            EXPECT_EQ(at, -1) << type_name(type) << " seed " << seed << ": weight " << at << " is "
                              << (at >= 0 ? got[at] : 0.f) << ", ggml gives " << (at >= 0 ? want[at] : 0.f);
        }
    }
}

TEST(cuda_rules, every_menu_type_equals_ggml_to_float_bit_for_bit_on_random_bytes) {
    // Random bytes reach every grid index, sign pattern, scale and shift, not only those a quantizer picks.
    // f16 fields are random too; a NaN or inf scale must come out the same way (both NaN).
    std::mt19937 rng(5);
    for (const ggml_type type : menu_and_f32()) {
        const size_t n = tensor_bytes(type, std::vector<int64_t>{k_rule_ne0, 16 * k_rule_rows});
        std::vector<uint8_t> bytes(n);
        for (auto & b : bytes) {
            b = static_cast<uint8_t>(rng());
        }
        const std::vector<float> want = dequantize(type, bytes, k_rule_ne0);
        std::vector<float> got(want.size(), 0.0f);
        dequantize_by_rule(type, bytes, k_rule_ne0, got);
        int64_t bad = -1;
        for (size_t i = 0; i < want.size() && bad < 0; ++i) {
            const bool both_nan = std::isnan(want[i]) && std::isnan(got[i]);
            if (!both_nan && std::memcmp(&want[i], &got[i], 4) != 0) {
                bad = static_cast<int64_t>(i);
            }
        }
        EXPECT_EQ(bad, -1) << type_name(type) << ": weight " << bad << " is " << (bad >= 0 ? got[bad] : 0.f)
                           << ", ggml gives " << (bad >= 0 ? want[bad] : 0.f);
    }
}

TEST(cuda_rules, float_rows_of_any_length_equal_ggml) {
    // Rows of 172 (stories260K's ffn_down): the tail of a row that is not a multiple of 8.
    for (const ggml_type type : {GGML_TYPE_F16, GGML_TYPE_BF16, GGML_TYPE_F32}) {
        const auto w = test::gaussian(172 * 5, 4);
        const auto bytes = quantize(type, w, 172);
        const std::vector<float> want = dequantize(type, bytes, 172);
        std::vector<float> got(want.size(), std::nanf(""));
        dequantize_by_rule(type, bytes, 172, got);
        EXPECT_EQ(first_bit_difference(want, got), -1) << type_name(type);
    }
}

TEST(cuda_rules, the_check_catches_a_one_ulp_change) {
    // The comparison is exact: a rule off by one unit in the last place in one weight would fail.
    const auto w = test::gaussian(k_rule_ne0 * 4, 3);
    const auto bytes = quantize(GGML_TYPE_Q4_K, w, k_rule_ne0);
    const std::vector<float> want = dequantize(GGML_TYPE_Q4_K, bytes, k_rule_ne0);
    std::vector<float> got(want.size());
    dequantize_by_rule(GGML_TYPE_Q4_K, bytes, k_rule_ne0, got);
    ASSERT_EQ(first_bit_difference(want, got), -1);
    got[100] = std::nextafter(got[100], INFINITY);
    EXPECT_EQ(first_bit_difference(want, got), 100);
}

TEST(cuda_rules, a_type_without_a_rule_or_a_row_that_does_not_fit_is_refused) {
    std::vector<uint8_t> bytes(tensor_bytes(GGML_TYPE_TQ1_0, std::vector<int64_t>{256, 1}));
    std::vector<float> out(256);
    EXPECT_NE(test::error_of([&] { dequantize_by_rule(GGML_TYPE_TQ1_0, bytes, 256, out); }).find("tq1_0"),
              std::string::npos);
    std::vector<uint8_t> q4k(tensor_bytes(GGML_TYPE_Q4_K, std::vector<int64_t>{256, 1}));
    std::vector<float> wrong(128);
    EXPECT_NE(test::error_of([&] { dequantize_by_rule(GGML_TYPE_Q4_K, q4k, 128, wrong); }).find("does not fit"),
              std::string::npos);
}

TEST(cuda_rules, an_f16_candidate_read_from_bf16_bytes_equals_ggml_f16_of_the_bf16_source) {
    // The shared-weights candidate (deq::F16_OF_BF16): ggml's F16 candidate of a BF16 source, computed from the
    // bf16 bytes the teacher keeps. Every finite bf16 pattern, so fp16's overflow (to ±inf), subnormal and
    // round-to-even cases are all met.
    std::vector<uint8_t> bf16_bytes;
    std::vector<float> source;
    for (uint32_t h = 0; h < 0x10000; ++h) {
        const uint32_t u = h << 16;
        float f;
        std::memcpy(&f, &u, 4);
        if (!std::isfinite(f)) {
            continue;
        }
        bf16_bytes.push_back(static_cast<uint8_t>(h & 0xff));
        bf16_bytes.push_back(static_cast<uint8_t>(h >> 8));
        source.push_back(f);
    }
    const int64_t n = static_cast<int64_t>(source.size()) / 8 * 8;
    source.resize(static_cast<size_t>(n));
    const std::vector<float> want = dequantize(GGML_TYPE_F16, quantize(GGML_TYPE_F16, source, n), n);
    std::vector<float> got(static_cast<size_t>(n));
    for (int64_t i0 = 0; i0 < n; i0 += 8) {
        deq::deq8(deq::F16_OF_BF16, bf16_bytes.data(), static_cast<int>(i0), got.data() + i0, host_deq_tables());
    }
    const int64_t bad = first_bit_difference(want, got);
    EXPECT_EQ(bad, -1) << "bf16 " << (bad >= 0 ? source[static_cast<size_t>(bad)] : 0.f) << ": rule gives "
                       << (bad >= 0 ? got[static_cast<size_t>(bad)] : 0.f) << ", ggml "
                       << (bad >= 0 ? want[static_cast<size_t>(bad)] : 0.f);
    EXPECT_EQ(deq::block_size(deq::F16_OF_BF16), 1);
    EXPECT_EQ(deq::block_bytes(deq::F16_OF_BF16), 2);
}

TEST(cuda_rules, the_integer_to_float_shortcut_is_exact_on_its_range) {
    // deq::i2f (1.5 · 2^23 added in the bits, then subtracted) must equal a conversion for |v| < 2^22; the rules
    // use it on small integers (quants, grid bytes, scales).
    for (int v = -(1 << 22); v < (1 << 22); v += (v > -300 && v < 300) ? 1 : 977) {
        ASSERT_EQ(deq::i2f(v), static_cast<float>(v)) << v;
    }
    EXPECT_EQ(deq::i2f(-(1 << 22)), -4194304.0f);
    EXPECT_EQ(deq::i2f((1 << 22) - 1), 4194303.0f);
}
