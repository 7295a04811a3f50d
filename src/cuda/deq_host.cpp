#include "cuda/deq_host.h"

#include "common/error.h"
#include "ggml/types.h"

#include <algorithm>
#include <cstring>
#include <vector>

// ggml's own tables: ggml-common.h of the pinned source, compiled here in its C++ flavour.
#define GGML_COMMON_DECL_CPP
#define GGML_COMMON_IMPL_CPP
#include <ggml-common.h>

namespace voodoo {

namespace {

// The block sizes the rules assume are ggml's (a layout change upstream fails the build, not a test).
static_assert(sizeof(block_q4_0) == 18 && sizeof(block_q4_1) == 20 && sizeof(block_q5_0) == 22 &&
              sizeof(block_q5_1) == 24 && sizeof(block_q8_0) == 34);
static_assert(sizeof(block_q2_K) == 84 && sizeof(block_q3_K) == 110 && sizeof(block_q4_K) == 144 &&
              sizeof(block_q5_K) == 176 && sizeof(block_q6_K) == 210);
static_assert(sizeof(block_iq2_xxs) == 66 && sizeof(block_iq2_xs) == 74 && sizeof(block_iq2_s) == 82 &&
              sizeof(block_iq3_xxs) == 98 && sizeof(block_iq3_s) == 110 && sizeof(block_iq1_s) == 50 &&
              sizeof(block_iq1_m) == 56 && sizeof(block_iq4_nl) == 18 && sizeof(block_iq4_xs) == 136);
static_assert(offsetof(block_q2_K, qs) == 16 && offsetof(block_q3_K, scales) == 96 && offsetof(block_q5_K, qh) == 16 &&
              offsetof(block_q6_K, scales) == 192 && offsetof(block_iq2_s, qh) == 66 && offsetof(block_iq3_s, signs) == 74 &&
              offsetof(block_iq1_s, qh) == 34 && offsetof(block_iq1_m, scales) == 48 && offsetof(block_iq4_xs, qs) == 8);

}  // namespace

const deq::tables & host_deq_tables() {
    static const deq::tables t = {iq2xxs_grid, iq2xs_grid, iq2s_grid, iq3xxs_grid, iq3s_grid,
                                  iq1s_grid, ksigns_iq2xs, kvalues_iq4nl};
    return t;
}

const packed_deq_tables & packed_host_deq_tables() {
    static const std::vector<uint8_t> bytes = [] {
        std::vector<uint8_t> b;
        auto put = [&](const void * p, size_t n) {
            while (b.size() % 16) {
                b.push_back(0);
            }
            const auto * c = static_cast<const uint8_t *>(p);
            b.insert(b.end(), c, c + n);
        };
        put(iq2xxs_grid, sizeof(iq2xxs_grid));
        put(iq2xs_grid, sizeof(iq2xs_grid));
        put(iq2s_grid, sizeof(iq2s_grid));
        put(iq3xxs_grid, sizeof(iq3xxs_grid));
        put(iq3s_grid, sizeof(iq3s_grid));
        put(iq1s_grid, sizeof(iq1s_grid));
        put(ksigns_iq2xs, sizeof(ksigns_iq2xs));
        put(kvalues_iq4nl, sizeof(kvalues_iq4nl));
        return b;
    }();
    static const packed_deq_tables packed = [] {
        packed_deq_tables p{bytes, {}};
        const size_t sizes[8] = {sizeof(iq2xxs_grid), sizeof(iq2xs_grid), sizeof(iq2s_grid), sizeof(iq3xxs_grid),
                                 sizeof(iq3s_grid),   sizeof(iq1s_grid),  sizeof(ksigns_iq2xs), sizeof(kvalues_iq4nl)};
        size_t at = 0;
        for (int i = 0; i < 8; ++i) {
            at = (at + 15) / 16 * 16;
            p.offsets[i] = at;
            at += sizes[i];
        }
        return p;
    }();
    return packed;
}

void dequantize_by_rule(ggml_type type, std::span<const uint8_t> bytes, int64_t ne0, std::span<float> out) {
    if (!deq::has_rule(type)) {
        fail("no GPU dequantization rule for type {}", type_name(type));
    }
    const int64_t bs = deq::block_size(type);
    if (ne0 % bs != 0 || ne0 < 1) {
        fail("a row of {} weights does not fit type {} (block size {})", ne0, type_name(type), bs);
    }
    const int64_t row_bytes = ne0 / bs * deq::block_bytes(type);
    if (static_cast<int64_t>(bytes.size()) % row_bytes != 0 ||
        static_cast<int64_t>(bytes.size()) / row_bytes * ne0 != static_cast<int64_t>(out.size())) {
        fail("dequantize_by_rule: {} bytes of {} rows of {} weights do not match {} outputs", bytes.size(),
             type_name(type), ne0, out.size());
    }
    const int64_t n_rows = static_cast<int64_t>(bytes.size()) / row_bytes;
    const deq::tables & tb = host_deq_tables();
    for (int64_t r = 0; r < n_rows; ++r) {
        for (int64_t i0 = 0; i0 < ne0; i0 += 8) {
            float y[8];
            const int n = static_cast<int>(std::min<int64_t>(8, ne0 - i0));
            deq::deq_upto8(type, bytes.data() + r * row_bytes, static_cast<int>(i0), n, y, tb);
            std::memcpy(out.data() + r * ne0 + i0, y, static_cast<size_t>(n) * sizeof(float));
        }
    }
}

}  // namespace voodoo
