// Quantize and dequantize throughput of the ggml bridge (weights per second), all cores.
// Run: make bench   (or build/bin/bench_quant --benchmark_filter=q4_K)
#include "ggml/quant.h"
#include "ggml/selection.h"
#include "ggml/types.h"

#include <benchmark/benchmark.h>

#include <random>

namespace {

constexpr int64_t k_ne0 = 4096;
constexpr int64_t k_rows = 256;

const std::vector<float> & weights() {
    static const std::vector<float> w = [] {
        std::mt19937 rng(1);
        std::normal_distribution<float> d(0.0f, 1.0f);
        std::vector<float> v(k_ne0 * k_rows);
        for (float & x : v) {
            x = d(rng);
        }
        return v;
    }();
    return w;
}

const std::vector<float> & imatrix() {
    static const std::vector<float> im(k_ne0, 1.0f);
    return im;
}

void bm_quantize(benchmark::State & state, ggml_type type) {
    const auto & w = weights();
    for (auto _ : state) {
        auto q = voodoo::quantize(type, w, k_ne0, imatrix());
        benchmark::DoNotOptimize(q.data());
    }
    state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(w.size()));
}

void bm_dequantize(benchmark::State & state, ggml_type type) {
    const auto q = voodoo::quantize(type, weights(), k_ne0, imatrix());
    for (auto _ : state) {
        auto y = voodoo::dequantize(type, q, k_ne0);
        benchmark::DoNotOptimize(y.data());
    }
    state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(weights().size()));
}

// One core, 16 rows of 4096 (65,536 weights), every quantized type of the default menu: the per-core rate that sets
// how long candidates take (docs/BENCHMARKS.md).
void bm_quantize_one_core(benchmark::State & state, ggml_type type) {
    const std::span<const float> part(weights().data(), static_cast<size_t>(16 * k_ne0));
    voodoo::quantize(type, part.first(static_cast<size_t>(k_ne0)), k_ne0, imatrix(), 1);  // the IQ grids, built once
    for (auto _ : state) {
        auto q = voodoo::quantize(type, part, k_ne0, imatrix(), 1);
        benchmark::DoNotOptimize(q.data());
    }
    state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(part.size()));
}

const int registered = [] {
    for (ggml_type t : voodoo::default_menu_types()) {
        if (voodoo::type_info_of(t).is_quantized) {
            benchmark::RegisterBenchmark(("quantize_1core/" + voodoo::type_name(t)).c_str(), bm_quantize_one_core, t)
                ->Unit(benchmark::kMillisecond)
                ->UseRealTime();
        }
    }
    return 0;
}();

}  // namespace

BENCHMARK_CAPTURE(bm_quantize, q8_0, GGML_TYPE_Q8_0)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(bm_quantize, q4_K, GGML_TYPE_Q4_K)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(bm_quantize, q6_K, GGML_TYPE_Q6_K)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(bm_quantize, iq4_xs, GGML_TYPE_IQ4_XS)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(bm_quantize, iq2_xxs, GGML_TYPE_IQ2_XXS)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(bm_dequantize, q4_K, GGML_TYPE_Q4_K)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(bm_dequantize, iq2_xxs, GGML_TYPE_IQ2_XXS)->Unit(benchmark::kMillisecond)->UseRealTime();

BENCHMARK_MAIN();
