#include "common/error.h"
#include "ggml/quant.h"
#include "ggml/types.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <thread>

#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

using namespace voodoo;

namespace {

constexpr int64_t k_ne0 = 512;
constexpr int64_t k_rows = 256;

// RMSE of quantize→dequantize of a 256×512 N(0, 1) tensor (test::gaussian seed 1), measured on
// 2026-11-29 with llama.cpp v0.4.0; seeds 1–3 agree within 1%. IQ2_XXS, IQ2_XS and IQ1_S get the
// imatrix of quantize_all below. A band is ±3% of the measurement: a change of quantizer shows.
const std::map<std::string, double> k_rmse = {
    {"f32", 0.0},        {"f16", 0.000208},   {"bf16", 0.001664},  {"q8_0", 0.005373},  {"q6_K", 0.017822},
    {"q5_K", 0.036143},  {"q5_1", 0.037912},  {"q5_0", 0.042795},  {"q4_K", 0.071603},  {"iq4_nl", 0.076293},
    {"iq4_xs", 0.076870}, {"q4_1", 0.078384}, {"q4_0", 0.086153},  {"nvfp4", 0.095337}, {"mxfp4", 0.114912},
    {"q3_K", 0.151093},  {"iq3_s", 0.166076}, {"iq3_xxs", 0.213408}, {"iq2_s", 0.265687}, {"q2_K", 0.296304},
    {"iq2_xs", 0.304994}, {"iq2_xxs", 0.347892}, {"iq1_s", 0.496512}, {"iq1_m", 0.582222}, {"q1_0", 0.601141},
    {"q2_0", 0.720104},  {"tq1_0", 0.811003}, {"tq2_0", 0.811003},
};

std::vector<float> test_imatrix() {
    auto v = test::gaussian(k_ne0, 7);
    for (float & x : v) {
        x = 0.5f + std::abs(x);
    }
    return v;
}

double rmse(const std::vector<float> & a, const std::vector<float> & b) {
    double se = 0;
    for (size_t i = 0; i < a.size(); ++i) {
        se += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    }
    return std::sqrt(se / a.size());
}

}  // namespace

TEST(quant, every_storage_type_round_trips_within_its_measured_rmse_band_in_exact_bytes) {
    const auto x = test::gaussian(k_rows * k_ne0, 1);
    const auto imat = test_imatrix();
    ASSERT_EQ(k_rmse.size(), type_table().size());
    for (const type_info & info : type_table()) {
        SCOPED_TRACE(info.name);
        const std::vector<float> im = info.requires_imatrix ? imat : std::vector<float>{};
        const auto q = quantize(info.type, x, k_ne0, im);
        const int64_t ne[2] = {k_ne0, k_rows};
        EXPECT_EQ(q.size(), tensor_bytes(info.type, ne));
        EXPECT_NO_THROW(validate_rows(info.type, q, k_ne0));
        const auto y = dequantize(info.type, q, k_ne0);
        ASSERT_EQ(y.size(), x.size());
        const double want = k_rmse.at(info.name);
        const double got = rmse(x, y);
        EXPECT_GE(got, want * 0.97);
        EXPECT_LE(got, want * 1.03 + 1e-12);
    }
}

TEST(quant, bytes_equal_one_ggml_quantize_chunk_call_whatever_the_thread_count) {
    const auto x = test::gaussian(k_rows * k_ne0, 2);
    const auto imat = test_imatrix();
    for (ggml_type t : {GGML_TYPE_Q4_K, GGML_TYPE_IQ2_XXS, GGML_TYPE_Q8_0, GGML_TYPE_IQ4_XS, GGML_TYPE_BF16}) {
        SCOPED_TRACE(type_name(t));
        const int64_t ne[2] = {k_ne0, k_rows};
        std::vector<uint8_t> direct(tensor_bytes(t, ne));
        ggml_quantize_chunk(t, x.data(), direct.data(), 0, k_rows, k_ne0, imat.data());
        EXPECT_EQ(quantize(t, x, k_ne0, imat, 1), direct);
        EXPECT_EQ(quantize(t, x, k_ne0, imat, 2), direct);
        EXPECT_EQ(quantize(t, x, k_ne0, imat, 7), direct);
    }
}

TEST(quant, the_imatrix_changes_the_bytes) {
    const auto x = test::gaussian(k_rows * k_ne0, 3);
    EXPECT_NE(quantize(GGML_TYPE_Q4_K, x, k_ne0), quantize(GGML_TYPE_Q4_K, x, k_ne0, test_imatrix()));
}

TEST(quant, dequantize_is_ggml_to_float) {
    const auto x = test::gaussian(4 * 256, 4);
    const auto q = quantize(GGML_TYPE_Q3_K, x, 256);
    std::vector<float> direct(x.size());
    ggml_get_type_traits(GGML_TYPE_Q3_K)->to_float(q.data(), direct.data(), static_cast<int64_t>(x.size()));
    EXPECT_EQ(dequantize(GGML_TYPE_Q3_K, q, 256), direct);
}

TEST(quant, a_row_that_does_not_fit_is_rejected_naming_tensor_shape_and_type) {
    const auto x = test::gaussian(172 * 64, 5);
    try {
        quantize(GGML_TYPE_Q4_0, x, 172, {}, 0, "blk.0.ffn_down.weight");
        FAIL() << "expected an error";
    } catch (const error & e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find("blk.0.ffn_down.weight"), std::string::npos) << msg;
        EXPECT_NE(msg.find("[172, 64]"), std::string::npos) << msg;
        EXPECT_NE(msg.find("q4_0"), std::string::npos) << msg;
    }
}

// Default thread counts (every flag's 0): VOODOO_THREADS when set, else the cores this process may run on. The
// affinity is narrowed to one core in a child process (sched_setaffinity, as taskset does), so the test does not
// depend on the machine's core count; the parent's environment and affinity stay as they were.
TEST(quant, default_threads_are_voodoo_threads_else_the_cores_this_process_may_run_on) {
    const char * saved = std::getenv("VOODOO_THREADS");
    const std::string saved_value = saved ? saved : "";
    ::setenv("VOODOO_THREADS", "3", 1);
    EXPECT_EQ(resolve_threads(0), 3);
    EXPECT_EQ(resolve_threads(5), 5);  // a flag's own count wins
    for (const char * bad : {"0", "-2", "two", "4x", "99999"}) {
        ::setenv("VOODOO_THREADS", bad, 1);
        try {
            resolve_threads(0);
            ADD_FAILURE() << "VOODOO_THREADS=" << bad << " was accepted";
        } catch (const error & e) {
            EXPECT_NE(std::string(e.what()).find(std::string("VOODOO_THREADS='") + bad + "'"), std::string::npos) << e.what();
        }
    }
    ::unsetenv("VOODOO_THREADS");
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(sched_getcpu() >= 0 ? sched_getcpu() : 0, &one);
        const bool narrowed = sched_setaffinity(0, sizeof one, &one) == 0;
        ::_exit(narrowed && resolve_threads(0) == 1 ? 0 : 1);
    }
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "a process allowed one core did not default to 1 thread";
    if (saved) {
        ::setenv("VOODOO_THREADS", saved_value.c_str(), 1);
    }
}

TEST(quant, types_that_need_an_imatrix_refuse_to_run_without_one) {
    const auto x = test::gaussian(4 * 256, 6);
    EXPECT_THROW(quantize(GGML_TYPE_IQ2_XXS, x, 256, {}, 0, "blk.0.attn_q.weight"), error);
    EXPECT_THROW(quantize(GGML_TYPE_Q4_K, x, 256, std::vector<float>(100, 1.0f)), error);  // wrong length
}

TEST(quant, validation_finds_a_nan_scale) {
    const auto x = test::gaussian(4 * 64, 8);
    auto q = quantize(GGML_TYPE_Q8_0, x, 64);
    EXPECT_NO_THROW(validate_rows(GGML_TYPE_Q8_0, q, 64, "t"));
    const uint16_t nan_f16 = 0x7e00;
    std::memcpy(q.data() + 2 * 34, &nan_f16, 2);  // the scale of block 2 = row 1
    try {
        validate_rows(GGML_TYPE_Q8_0, q, 64, "blk.1.attn_v.weight");
        FAIL() << "expected an error";
    } catch (const error & e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find("blk.1.attn_v.weight"), std::string::npos) << msg;
        EXPECT_NE(msg.find("row 1"), std::string::npos) << msg;
    }
    EXPECT_THROW(validate_rows(GGML_TYPE_Q8_0, std::span<const uint8_t>(q).first(50), 64), error);
}

TEST(quant, lattice_tables_built_ahead_in_parallel_give_the_bytes_of_ggml_quantize_init_to_threads_that_start_at_once) {
    // Every lattice type's bytes from a process that builds its grids the usual way (ggml_quantize_init, one after
    // the other), against this process, whose grids a lattice_warmup builds in parallel while four threads already
    // quantize every type: each waits for its own grid, none reads one half built.
    // Every lattice grid but IQ2_S's (7 s of one core, built by the same function as IQ2_XS's and IQ2_XXS's); IQ1's
    // (the longest, the window the sleep below aims at) serves two types.
    const std::vector<ggml_type> lattice = {GGML_TYPE_IQ1_S,  GGML_TYPE_IQ1_M,   GGML_TYPE_IQ2_XXS,
                                            GGML_TYPE_IQ2_XS, GGML_TYPE_IQ3_XXS, GGML_TYPE_IQ3_S};
    std::vector<ggml_type> types = lattice;
    types.push_back(GGML_TYPE_Q4_K);
    const auto x = test::gaussian(4 * k_ne0, 9);
    const auto imat = test_imatrix();
    auto bytes_of = [&](ggml_type t) {
        const int64_t ne[2] = {k_ne0, 4};
        std::vector<uint8_t> q(tensor_bytes(t, ne));
        ggml_quantize_chunk(t, x.data(), q.data(), 0, 4, k_ne0, imat.data());  // ggml_quantize_init inside
        return q;
    };
    int out[2];
    ASSERT_EQ(::pipe(out), 0);
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
        ::close(out[0]);
        for (ggml_type t : types) {
            const auto q = bytes_of(t);
            if (::write(out[1], q.data(), q.size()) != static_cast<ssize_t>(q.size())) {
                ::_exit(1);
            }
        }
        ::_exit(0);
    }
    ::close(out[1]);
    std::vector<std::vector<uint8_t>> got(types.size());
    {
        lattice_warmup warmup(lattice, 4);
        // Into the window where llama.cpp's test for a built grid (its table's pointer, set first) already passes
        // but its neighbour lists are not yet made (IQ1's take seconds): a thread that did not wait would read them.
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        std::vector<std::thread> pool;
        for (size_t j = 0; j < types.size(); ++j) {
            pool.emplace_back([&, j] { got[j] = quantize(types[j], x, k_ne0, imat, 1); });
        }
        for (std::thread & t : pool) {
            t.join();
        }
    }
    for (size_t j = 0; j < types.size(); ++j) {
        SCOPED_TRACE(type_name(types[j]));
        std::vector<uint8_t> want(got[j].size());
        size_t have = 0;
        while (have < want.size()) {
            const ssize_t n = ::read(out[0], want.data() + have, want.size() - have);
            ASSERT_GT(n, 0) << "the child's bytes";
            have += static_cast<size_t>(n);
        }
        EXPECT_EQ(got[j], want);
    }
    ::close(out[0]);
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    EXPECT_EQ(bytes_of(GGML_TYPE_IQ1_S), got[0]) << "llama.cpp's own path after the warmup: the grid is not built again";
}
