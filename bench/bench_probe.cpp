// The sensitivity probe of one model, every quantizable tensor as Q8_0 on 2 × 128 tokens in f32 on the CPU:
// whole forwards per candidate (stream_bytes 0) against forwards that start at the candidate's layer from the kept
// source streams (the default). Both give the same ΔKL bit for bit (tests/test_arch.cpp); this measures the time.
// Run: make bench, or build/bin/bench_probe (VOODOO_BENCH_MODEL=path.gguf for another model than mix30M).
#include "ggml/gguf.h"
#include "model/gguf_weights.h"
#include "model/registry.h"
#include "train/candidates.h"
#include "train/probe.h"

#include <benchmark/benchmark.h>

#include <cstdlib>

namespace {

std::string model_path() {
    if (const char * env = std::getenv("VOODOO_BENCH_MODEL")) {
        return env;
    }
    return std::string(VOODOO_SHARED_DATA) + "/models/mix30M/mix30M.gguf";
}

void bm_probe(benchmark::State & state) {
    using namespace voodoo;
    const gguf_file f(model_path());
    auto model = build_model(f);
    gguf_weights dense(f), teacher(f);
    std::vector<gated_tensor> gated;
    for (const gguf_tensor & t : f.tensors()) {
        if (t.n_dims >= 2 && t.ne[0] % 32 == 0) {
            gated_tensor g;
            g.tensor = &t;
            g.types = {GGML_TYPE_Q8_0};
            g.bytes.push_back(quantize_tensor(f, t, GGML_TYPE_Q8_0, {}));
            gated.push_back(std::move(g));
        }
    }
    const torch::Tensor tokens = torch::randint(1, model->hparams().n_vocab, {2, 128}, torch::kLong);
    const int64_t stream_bytes = state.range(0) ? int64_t(2) << 30 : 0;
    for (auto _ : state) {
        auto s = probe_sensitivity(*model, dense, teacher, gated, tokens, torch::kCPU, 256, torch::kFloat, nullptr, stream_bytes);
        benchmark::DoNotOptimize(s.data());
    }
    state.counters["candidates"] = static_cast<double>(gated.size());
    state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(gated.size()));
}

}  // namespace

// Arg 0: a whole forward per candidate; 1: from the kept layer streams.
BENCHMARK(bm_probe)->Arg(0)->Arg(1)->Unit(benchmark::kSecond)->UseRealTime()->Iterations(1);

BENCHMARK_MAIN();
