// ggml's to_float, eight weights at a time, for every type of the default menu: one source for the
// CUDA kernels (nvcc) and the CPU build (g++), so that CI proves on the CPU what the GPU computes.
//
// The rule of each type follows dequantize_row_<type> in llama.cpp's ggml/src/ggml-quants.c at the pinned
// commit, operation by operation: every product and sum is one f32 operation rounded to nearest, in
// ggml's order (mul() and add() below forbid fused multiply-adds on the GPU, where nvcc would contract
// them), so the results equal ggml's bit for bit. Block layouts are ggml-common.h's, read as bytes at the
// offsets named in each rule (tests/test_cuda_rules.cpp checks every type against libggml-base).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define VOODOO_HD __device__ __forceinline__
#define VOODOO_HHD __host__ __device__ inline
#else
#include <ggml.h>
#define VOODOO_HD inline
#define VOODOO_HHD inline
#endif

namespace voodoo::deq {

/// ggml's lookup tables the i-quants need (ggml-common.h), wherever they live: host memory for the CPU
/// build, device memory for the kernels (uploaded once from the host copies).
struct tables {
    const uint64_t * iq2xxs_grid;   // 256
    const uint64_t * iq2xs_grid;    // 512
    const uint64_t * iq2s_grid;     // 1024
    const uint32_t * iq3xxs_grid;   // 256
    const uint32_t * iq3s_grid;     // 512
    const uint64_t * iq1s_grid;     // 2048
    const uint8_t * ksigns_iq2xs;   // 128
    const int8_t * kvalues_iq4nl;   // 16
};

// ggml_type numbers (ggml.h), repeated as constants so the nvcc side needs no ggml header.
enum type_id : int {
    F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12,
    Q5_K = 13, Q6_K = 14, IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19, IQ4_NL = 20, IQ3_S = 21,
    IQ2_S = 22, IQ4_XS = 23, IQ1_M = 29, BF16 = 30,
    // Not a ggml type: an F16 candidate read from bf16 bytes (a BF16 source's own weights, shared with the
    // teacher instead of stored again). Its rule is ggml's F16 candidate of a BF16 source, fp16(bf16 value):
    // ggml_fp32_to_fp16 of the bf16 value as f32, round to nearest even, then back to f32.
    F16_OF_BF16 = 1000,
};

/// Whether this file has a rule for ggml type `t` (the default menu's types, F32 included).
VOODOO_HHD bool has_rule(int t) {
    switch (t) {
        case F32: case F16: case BF16: case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q8_0: case Q2_K:
        case Q3_K: case Q4_K: case Q5_K: case Q6_K: case IQ2_XXS: case IQ2_XS: case IQ2_S: case IQ3_XXS:
        case IQ3_S: case IQ1_S: case IQ1_M: case IQ4_NL: case IQ4_XS:
            return true;
        default:
            return false;
    }
}

/// Weights per block and bytes per block of type t (ggml_blck_size, ggml_type_size); 0 when no rule.
/// F16_OF_BF16 reads bf16 bytes: 1 weight, 2 bytes.
VOODOO_HHD int block_size(int t) {
    switch (t) {
        case F32: case F16: case BF16: case F16_OF_BF16: return 1;
        case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q8_0: case IQ4_NL: return 32;
        default: return has_rule(t) ? 256 : 0;
    }
}
VOODOO_HHD int block_bytes(int t) {
    switch (t) {
        case F32: return 4;
        case F16: case BF16: case F16_OF_BF16: return 2;
        case Q4_0: return 18; case Q4_1: return 20; case Q5_0: return 22; case Q5_1: return 24;
        case Q8_0: return 34; case Q2_K: return 84; case Q3_K: return 110; case Q4_K: return 144;
        case Q5_K: return 176; case Q6_K: return 210; case IQ2_XXS: return 66; case IQ2_XS: return 74;
        case IQ2_S: return 82; case IQ3_XXS: return 98; case IQ3_S: return 110; case IQ1_S: return 50;
        case IQ1_M: return 56; case IQ4_NL: return 18; case IQ4_XS: return 136;
        default: return 0;
    }
}

// One f32 operation, rounded to nearest, never fused with a neighbour.
#if defined(__CUDACC__)
VOODOO_HD float mul(float a, float b) { return __fmul_rn(a, b); }
VOODOO_HD float add(float a, float b) { return __fadd_rn(a, b); }
VOODOO_HD float sub(float a, float b) { return __fsub_rn(a, b); }
VOODOO_HD float fp16(const uint8_t * p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return __half2float(__ushort_as_half(h));
}
VOODOO_HD float bf16(const uint8_t * p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return __uint_as_float(static_cast<uint32_t>(h) << 16);
}
VOODOO_HD float round_fp16(float x) { return __half2float(__float2half_rn(x)); }
// float(v) for |v| < 2^22, exactly as a conversion instruction gives it, in two full-rate instructions: the
// bits of 1.5 · 2^23 plus v are the float 1.5 · 2^23 + v (exact), minus 1.5 · 2^23 (exact). Hopper converts
// integers to floats at 16 a clock per multiprocessor against 128 additions, and a dequantizer converts
// every weight.
VOODOO_HD float i2f(int v) { return __fsub_rn(__int_as_float(0x4B400000 + v), 12582912.0f); }
#else
VOODOO_HD float mul(float a, float b) { return a * b; }
VOODOO_HD float add(float a, float b) { return a + b; }
VOODOO_HD float sub(float a, float b) { return a - b; }
VOODOO_HD float fp16(const uint8_t * p) {
    ggml_fp16_t h;
    memcpy(&h, p, 2);
    return ggml_fp16_to_fp32(h);
}
VOODOO_HD float bf16(const uint8_t * p) {
    uint16_t h;
    memcpy(&h, p, 2);
    const uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
VOODOO_HD float round_fp16(float x) { return ggml_fp16_to_fp32(ggml_fp32_to_fp16(x)); }
VOODOO_HD float i2f(int v) {  // the same two steps as the GPU's, so that CI checks this formula
    const uint32_t u = 0x4B400000u + static_cast<uint32_t>(v);
    float f;
    memcpy(&f, &u, 4);
    return f - 12582912.0f;
}
#endif

VOODOO_HD uint16_t u16(const uint8_t * p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
VOODOO_HD uint32_t u32(const uint8_t * p) {
    return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) | (static_cast<uint32_t>(p[2]) << 16) |
           (static_cast<uint32_t>(p[3]) << 24);
}
VOODOO_HD uint8_t grid_byte(uint64_t g, int j) { return static_cast<uint8_t>(g >> (8 * j)); }

// get_scale_min_k4 of ggml-quants.c: the 6-bit scale and min of sub-block j of a Q4_K/Q5_K block.
VOODOO_HD void scale_min_k4(int j, const uint8_t * q, int & sc, int & m) {
    if (j < 4) {
        sc = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4);
    }
}

/// to_float of weight i of a row of a float type (F32, F16, BF16): the tail of a row whose length is not a
/// multiple of 8 (only float types allow such rows; every block type's block is a multiple of 8).
VOODOO_HD float deq1_float(int t, const uint8_t * row, int64_t i) {
    if (t == F16) {
        return fp16(row + i * 2);
    }
    if (t == BF16) {
        return bf16(row + i * 2);
    }
    if (t == F16_OF_BF16) {
        return round_fp16(bf16(row + i * 2));
    }
    float f;
    memcpy(&f, row + i * 4, 4);
    return f;
}

/// The n ≤ 8 weights i0 .. i0+n-1 of one row: deq8 when n = 8, else (float types) one at a time.
VOODOO_HD void deq_upto8(int t, const uint8_t * row, int i0, int n, float * y, const tables & tb);

/// y[0..8) = to_float of weights i0 .. i0+7 of one row, whose bytes start at `row`. i0 is a multiple of 8
/// (a column: 32-bit index arithmetic, rows are far shorter than 2^31 weights).
/// `t` must satisfy has_rule(t).
VOODOO_HD void deq8(int t, const uint8_t * row, int i0, float * y, const tables & tb) {
    switch (t) {
        case F32:
            memcpy(y, row + i0 * 4, 32);
            return;
        case F16:
            for (int j = 0; j < 8; ++j) y[j] = fp16(row + (i0 + j) * 2);
            return;
        case BF16:
            for (int j = 0; j < 8; ++j) y[j] = bf16(row + (i0 + j) * 2);
            return;
        case F16_OF_BF16:
            for (int j = 0; j < 8; ++j) y[j] = round_fp16(bf16(row + (i0 + j) * 2));
            return;
        case Q4_0: {  // d @0, qs[16] @2; weight j < 16: low nibble of qs[j], else high nibble of qs[j-16]
            const uint8_t * b = row + (i0 / 32) * 18;
            const int j0 = static_cast<int>(i0 % 32);
            const float d = fp16(b);
            for (int j = 0; j < 8; ++j) {
                const int l = j0 + j;
                const int q = l < 16 ? (b[2 + l] & 0x0F) : (b[2 + l - 16] >> 4);
                y[j] = mul(i2f(static_cast<int>(q - 8)), d);
            }
            return;
        }
        case Q4_1: {  // d @0, m @2, qs[16] @4
            const uint8_t * b = row + (i0 / 32) * 20;
            const int j0 = static_cast<int>(i0 % 32);
            const float d = fp16(b), m = fp16(b + 2);
            for (int j = 0; j < 8; ++j) {
                const int l = j0 + j;
                const int q = l < 16 ? (b[4 + l] & 0x0F) : (b[4 + l - 16] >> 4);
                y[j] = add(mul(i2f(static_cast<int>(q)), d), m);
            }
            return;
        }
        case Q5_0:
        case Q5_1: {  // Q5_0: d @0, qh[4] @2, qs[16] @6; Q5_1: d @0, m @2, qh[4] @4, qs[16] @8
            const bool one = t == Q5_1;
            const uint8_t * b = row + (i0 / 32) * (one ? 24 : 22);
            const int j0 = static_cast<int>(i0 % 32);
            const float d = fp16(b);
            const uint32_t qh = u32(b + (one ? 4 : 2));
            const uint8_t * qs = b + (one ? 8 : 6);
            for (int j = 0; j < 8; ++j) {
                const int l = j0 + j;
                int q;
                if (l < 16) {
                    q = (qs[l] & 0x0F) | (((qh >> l) << 4) & 0x10);
                } else {
                    q = (qs[l - 16] >> 4) | ((qh >> (l - 16 + 12)) & 0x10);
                }
                y[j] = one ? add(mul(i2f(static_cast<int>(q)), d), fp16(b + 2)) : mul(i2f(static_cast<int>(q - 16)), d);
            }
            return;
        }
        case Q8_0: {  // d @0, qs[32] int8 @2
            const uint8_t * b = row + (i0 / 32) * 34;
            const int j0 = static_cast<int>(i0 % 32);
            const float d = fp16(b);
            for (int j = 0; j < 8; ++j) {
                y[j] = mul(i2f(static_cast<int>(static_cast<int8_t>(b[2 + j0 + j]))), d);
            }
            return;
        }
        case Q2_K: {  // scales[16] @0, qs[64] @16, d @80, dmin @82
            const uint8_t * b = row + (i0 / 256) * 84;
            const int l0 = static_cast<int>(i0 % 256);
            const int half = l0 / 128, rem = l0 % 128;            // 128 weights per 32 bytes of qs
            const int shift = 2 * (rem / 32), part = (rem % 32) / 16, l16 = rem % 16;
            const int is = half * 8 + (rem / 32) * 2 + part;
            const uint8_t sc = b[is];
            const float d = fp16(b + 80), mn = fp16(b + 82);
            const float dl = mul(d, i2f(static_cast<int>(sc & 0xF))), ml = mul(mn, i2f(static_cast<int>(sc >> 4)));
            const uint8_t * q = b + 16 + half * 32 + part * 16;
            for (int j = 0; j < 8; ++j) {
                y[j] = sub(mul(dl, i2f(static_cast<int>((q[l16 + j] >> shift) & 3))), ml);
            }
            return;
        }
        case Q3_K: {  // hmask[32] @0, qs[64] @32, scales[12] @96, d @108
            const uint8_t * b = row + (i0 / 256) * 110;
            const int l0 = static_cast<int>(i0 % 256);
            const int half = l0 / 128, rem = l0 % 128;
            const int jj = rem / 32, part = (rem % 32) / 16, l16 = rem % 16;
            const int is = half * 8 + jj * 2 + part;              // scale index 0..15
            const uint8_t * s = b + 96;
            // The 6-bit scales: low 4 bits from s[0..7] (nibbles), high 2 bits from s[8..11].
            const int lo = is < 8 ? (s[is] & 0xF) : (s[is - 8] >> 4);
            const int hi = (s[8 + (is % 4)] >> (2 * (is / 4))) & 3;
            const int scale = (lo | (hi << 4)) - 32;
            const float dl = mul(fp16(b + 108), i2f(static_cast<int>(scale)));
            const int shift = 2 * jj;
            const uint8_t m = static_cast<uint8_t>(1u << (half * 4 + jj));
            const uint8_t * q = b + 32 + half * 32 + part * 16;
            const uint8_t * hm = b + part * 16;
            for (int j = 0; j < 8; ++j) {
                const int v = static_cast<int8_t>((q[l16 + j] >> shift) & 3) - ((hm[l16 + j] & m) ? 0 : 4);
                y[j] = mul(dl, i2f(static_cast<int>(v)));
            }
            return;
        }
        case Q4_K:
        case Q5_K: {  // Q4_K: d @0, dmin @2, scales[12] @4, qs[128] @16; Q5_K: ... qh[32] @16, qs[128] @48
            const bool five = t == Q5_K;
            const uint8_t * b = row + (i0 / 256) * (five ? 176 : 144);
            const int l0 = static_cast<int>(i0 % 256);
            const int chunk = l0 / 64, hi = (l0 % 64) / 32, l = l0 % 32;
            int sc, m;
            scale_min_k4(chunk * 2 + hi, b + 4, sc, m);
            const float d1 = mul(fp16(b), i2f(static_cast<int>(sc))), m1 = mul(fp16(b + 2), i2f(static_cast<int>(m)));
            const uint8_t * q = b + (five ? 48 : 16) + chunk * 32;
            const uint8_t u = static_cast<uint8_t>(1u << (2 * chunk + hi));
            for (int j = 0; j < 8; ++j) {
                int v = hi ? (q[l + j] >> 4) : (q[l + j] & 0xF);
                if (five) {
                    v += (b[16 + l + j] & u) ? 16 : 0;
                }
                y[j] = sub(mul(d1, i2f(static_cast<int>(v))), m1);
            }
            return;
        }
        case Q6_K: {  // ql[128] @0, qh[64] @128, scales[16] int8 @192, d @208
            const uint8_t * b = row + (i0 / 256) * 210;
            const int l0 = static_cast<int>(i0 % 256);
            const int n = l0 / 128, rem = l0 % 128, quarter = rem / 32, l = rem % 32;
            const uint8_t * ql = b + n * 64;
            const uint8_t * qh = b + 128 + n * 32;
            const int8_t * sc = reinterpret_cast<const int8_t *>(b + 192 + n * 8);
            const float d = fp16(b + 208);
            const float ds = mul(d, i2f(static_cast<int>(sc[l / 16 + 2 * quarter])));
            for (int j = 0; j < 8; ++j) {
                const int ll = l + j;
                int q;
                switch (quarter) {
                    case 0: q = (ql[ll] & 0xF) | (((qh[ll] >> 0) & 3) << 4); break;
                    case 1: q = (ql[ll + 32] & 0xF) | (((qh[ll] >> 2) & 3) << 4); break;
                    case 2: q = (ql[ll] >> 4) | (((qh[ll] >> 4) & 3) << 4); break;
                    default: q = (ql[ll + 32] >> 4) | (((qh[ll] >> 6) & 3) << 4); break;
                }
                y[j] = mul(ds, i2f(static_cast<int>(static_cast<int8_t>(q) - 32)));
            }
            return;
        }
        case IQ2_XXS: {  // d @0, qs[32] u16 @2: per 32 weights, 4 grid bytes then 4×7 sign bits + 4-bit scale
            const uint8_t * b = row + (i0 / 256) * 66;
            const int l0 = static_cast<int>(i0 % 256);
            const int ib32 = l0 / 32, l = (l0 % 32) / 8;
            const uint8_t * a = b + 2 + 8 * ib32;
            const uint32_t aux1 = u32(a + 4);
            const float db = mul(mul(fp16(b), add(0.5f, i2f(static_cast<int>(aux1 >> 28)))), 0.25f);
            const uint64_t g = tb.iq2xxs_grid[a[l]];
            const uint8_t signs = tb.ksigns_iq2xs[(aux1 >> (7 * l)) & 127];
            for (int j = 0; j < 8; ++j) {
                y[j] = mul(mul(db, i2f(static_cast<int>(grid_byte(g, j)))), (signs & (1u << j)) ? -1.f : 1.f);
            }
            return;
        }
        case IQ2_XS: {  // d @0, qs[32] u16 @2, scales[8] @66
            const uint8_t * b = row + (i0 / 256) * 74;
            const int l0 = static_cast<int>(i0 % 256);
            const int ib32 = l0 / 32, l = (l0 % 32) / 8;
            const uint8_t s = b[66 + ib32];
            const float db = mul(mul(fp16(b), add(0.5f, i2f(static_cast<int>(l < 2 ? (s & 0xf) : (s >> 4))))), 0.25f);
            const uint16_t q = u16(b + 2 + 2 * (4 * ib32 + l));
            const uint64_t g = tb.iq2xs_grid[q & 511];
            const uint8_t signs = tb.ksigns_iq2xs[q >> 9];
            for (int j = 0; j < 8; ++j) {
                y[j] = mul(mul(db, i2f(static_cast<int>(grid_byte(g, j)))), (signs & (1u << j)) ? -1.f : 1.f);
            }
            return;
        }
        case IQ2_S: {  // d @0, qs[64] @2 (32 grid bytes, then 32 sign bytes), qh[8] @66, scales[8] @74
            const uint8_t * b = row + (i0 / 256) * 82;
            const int l0 = static_cast<int>(i0 % 256);
            const int ib32 = l0 / 32, l = (l0 % 32) / 8;
            const uint8_t s = b[74 + ib32];
            const float dl = mul(mul(fp16(b), add(0.5f, i2f(static_cast<int>(l < 2 ? (s & 0xf) : (s >> 4))))), 0.25f);
            const int idx = b[2 + 4 * ib32 + l] | ((b[66 + ib32] << (8 - 2 * l)) & 0x300);
            const uint64_t g = tb.iq2s_grid[idx];
            const uint8_t signs = b[2 + 32 + 4 * ib32 + l];
            for (int j = 0; j < 8; ++j) {
                y[j] = mul(mul(dl, i2f(static_cast<int>(grid_byte(g, j)))), (signs & (1u << j)) ? -1.f : 1.f);
            }
            return;
        }
        case IQ3_XXS: {  // d @0, qs[64] @2 (grid indices), then 32 bytes of scales and signs @66
            const uint8_t * b = row + (i0 / 256) * 98;
            const int l0 = static_cast<int>(i0 % 256);
            const int ib32 = l0 / 32, l = (l0 % 32) / 8;
            const uint32_t aux = u32(b + 66 + 4 * ib32);
            const float db = mul(mul(fp16(b), add(0.5f, i2f(static_cast<int>(aux >> 28)))), 0.5f);
            const uint8_t signs = tb.ksigns_iq2xs[(aux >> (7 * l)) & 127];
            const uint8_t * qs = b + 2 + 8 * ib32;
            const uint32_t g1 = tb.iq3xxs_grid[qs[2 * l]], g2 = tb.iq3xxs_grid[qs[2 * l + 1]];
            for (int j = 0; j < 4; ++j) {
                y[j] = mul(mul(db, i2f(static_cast<int>(static_cast<uint8_t>(g1 >> (8 * j))))), (signs & (1u << j)) ? -1.f : 1.f);
                y[j + 4] = mul(mul(db, i2f(static_cast<int>(static_cast<uint8_t>(g2 >> (8 * j))))),
                               (signs & (1u << (j + 4))) ? -1.f : 1.f);
            }
            return;
        }
        case IQ3_S: {  // d @0, qs[64] @2, qh[8] @66, signs[32] @74, scales[4] @106
            const uint8_t * b = row + (i0 / 256) * 110;
            const int l0 = static_cast<int>(i0 % 256);
            const int ib32 = l0 / 32, l = (l0 % 32) / 8;
            const uint8_t s = b[106 + ib32 / 2];
            const float db = mul(fp16(b), i2f(static_cast<int>(1 + 2 * ((ib32 % 2) ? (s >> 4) : (s & 0xf)))));
            const uint8_t * qs = b + 2 + 8 * ib32;
            const uint8_t qh = b[66 + ib32];
            const uint8_t signs = b[74 + 4 * ib32 + l];
            const uint32_t g1 = tb.iq3s_grid[qs[2 * l] | ((qh << (8 - 2 * l)) & 256)];
            const uint32_t g2 = tb.iq3s_grid[qs[2 * l + 1] | ((qh << (7 - 2 * l)) & 256)];
            for (int j = 0; j < 4; ++j) {
                y[j] = mul(mul(db, i2f(static_cast<int>(static_cast<uint8_t>(g1 >> (8 * j))))), (signs & (1u << j)) ? -1.f : 1.f);
                y[j + 4] = mul(mul(db, i2f(static_cast<int>(static_cast<uint8_t>(g2 >> (8 * j))))),
                               (signs & (1u << (j + 4))) ? -1.f : 1.f);
            }
            return;
        }
        case IQ1_S: {  // d @0, qs[32] @2, qh[8] u16 @34
            const uint8_t * b = row + (i0 / 256) * 50;
            const int l0 = static_cast<int>(i0 % 256);
            const int ib = l0 / 32, l = (l0 % 32) / 8;
            const uint16_t qh = u16(b + 34 + 2 * ib);
            const float dl = mul(fp16(b), i2f(static_cast<int>(2 * ((qh >> 12) & 7) + 1)));
            const float delta = (qh & 0x8000) ? -0.125f : 0.125f;  // IQ1S_DELTA
            const uint64_t g = tb.iq1s_grid[b[2 + 4 * ib + l] | (((qh >> (3 * l)) & 7) << 8)];
            for (int j = 0; j < 8; ++j) {
                y[j] = mul(dl, add(i2f(static_cast<int>(static_cast<int8_t>(grid_byte(g, j)))), delta));
            }
            return;
        }
        case IQ1_M: {  // qs[32] @0, qh[16] @32, scales[8] @48 (four u16; the f16 scale in their top nibbles)
            const uint8_t * b = row + (i0 / 256) * 56;
            const int l0 = static_cast<int>(i0 % 256);
            const int ib = l0 / 32, l = (l0 % 32) / 8;
            const uint16_t sc0 = u16(b + 48), sc1 = u16(b + 50), sc2 = u16(b + 52), sc3 = u16(b + 54);
            const uint16_t scale = static_cast<uint16_t>((sc0 >> 12) | ((sc1 >> 8) & 0x00f0) | ((sc2 >> 4) & 0x0f00) |
                                                         (sc3 & 0xf000));
            uint8_t sbytes[2] = {static_cast<uint8_t>(scale & 0xff), static_cast<uint8_t>(scale >> 8)};
            const float d = fp16(sbytes);
            const uint16_t sc = u16(b + 48 + 2 * (ib / 2));
            const int shift = 6 * (ib % 2) + (l < 2 ? 0 : 3);
            const float dl = mul(d, i2f(static_cast<int>(2 * ((sc >> shift) & 0x7) + 1)));
            const uint8_t * qh = b + 32 + 2 * ib;
            const uint8_t h = qh[l / 2];
            const int idx = b[4 * ib + l] | ((l % 2 == 0 ? (h << 8) : (h << 4)) & 0x700);
            const float delta = (h & (l % 2 == 0 ? 0x08 : 0x80)) ? -0.125f : 0.125f;  // IQ1M_DELTA
            const uint64_t g = tb.iq1s_grid[idx];
            for (int j = 0; j < 8; ++j) {
                y[j] = mul(dl, add(i2f(static_cast<int>(static_cast<int8_t>(grid_byte(g, j)))), delta));
            }
            return;
        }
        case IQ4_NL: {  // d @0, qs[16] @2
            const uint8_t * b = row + (i0 / 32) * 18;
            const int j0 = static_cast<int>(i0 % 32);
            const float d = fp16(b);
            for (int j = 0; j < 8; ++j) {
                const int l = j0 + j;
                const int q = l < 16 ? (b[2 + l] & 0xf) : (b[2 + l - 16] >> 4);
                y[j] = mul(d, i2f(static_cast<int>(tb.kvalues_iq4nl[q])));
            }
            return;
        }
        case IQ4_XS: {  // d @0, scales_h u16 @2, scales_l[4] @4, qs[128] @8
            const uint8_t * b = row + (i0 / 256) * 136;
            const int l0 = static_cast<int>(i0 % 256);
            const int ib = l0 / 32, l = l0 % 32;
            const int ls = ((b[4 + ib / 2] >> (4 * (ib % 2))) & 0xf) | (((u16(b + 2) >> (2 * ib)) & 3) << 4);
            const float dl = mul(fp16(b), i2f(static_cast<int>(ls - 32)));
            const uint8_t * qs = b + 8 + 16 * ib;
            for (int j = 0; j < 8; ++j) {
                const int ll = l + j;
                const int q = ll < 16 ? (qs[ll] & 0xf) : (qs[ll - 16] >> 4);
                y[j] = mul(dl, i2f(static_cast<int>(tb.kvalues_iq4nl[q])));
            }
            return;
        }
        default:
            for (int j = 0; j < 8; ++j) y[j] = 0.0f;
            return;
    }
}

VOODOO_HD void deq_upto8(int t, const uint8_t * row, int i0, int n, float * y, const tables & tb) {
    if (n == 8) {
        deq8(t, row, i0, y, tb);
        return;
    }
    for (int j = 0; j < n; ++j) {
        y[j] = deq1_float(t, row, i0 + j);
    }
    for (int j = n; j < 8; ++j) {
        y[j] = 0.0f;
    }
}

}  // namespace voodoo::deq
