// The chunked gated delta rule (src/model/blocks.cpp) forward and backward, tokens per second. Two shapes: one
// Qwen3.5-0.8B layer (16 heads of 128, 2,048 tokens), and the same sequence with 2 heads of 8, where the arithmetic
// is negligible and the time is the number of operations launched (what bounds the hybrid's step on a GPU,
// docs/BENCHMARKS.md). On a CUDA build with a GPU it runs there, synchronizing after each step.
// Run: make bench && build/bin/delta_rule   (or build-cuda/bin/delta_rule on the GPU machine)
#include "model/blocks.h"

#include <ATen/record_function.h>
#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <atomic>

namespace {

/// Top-level ATen operators run, forward and backward (an operator called inside another is not counted; views
/// are): on a GPU each is at least one kernel launch or a host-side view, so this counts the launches that bound
/// a small-shape step.
std::atomic<int64_t> g_ops{0};
thread_local int g_depth = 0;

void bm_delta_rule(benchmark::State & state) {
    const int64_t T = state.range(0), H = state.range(1), d = state.range(2);
    const torch::Device device = torch::cuda::is_available() ? torch::Device(torch::kCUDA) : torch::Device(torch::kCPU);
    torch::manual_seed(1);
    const auto opts = torch::TensorOptions().dtype(torch::kFloat).device(device);
    auto unit = [](torch::Tensor x) { return x / x.norm(2, -1, true); };
    const torch::Tensor q = unit(torch::randn({1, T, H, d}, opts)), k = unit(torch::randn({1, T, H, d}, opts));
    const torch::Tensor v = torch::randn({1, T, H, d}, opts);
    const torch::Tensor g = -torch::softplus(torch::randn({1, T, H}, opts)) * 0.3;
    const torch::Tensor beta = torch::sigmoid(torch::randn({1, T, H}, opts));
    static const at::CallbackHandle counter = at::addGlobalCallback(
        at::RecordFunctionCallback(
            [](const at::RecordFunction &) -> std::unique_ptr<at::ObserverContext> {
                if (g_depth++ == 0) {
                    g_ops.fetch_add(1, std::memory_order_relaxed);
                }
                return nullptr;
            },
            [](const at::RecordFunction &, at::ObserverContext *) { --g_depth; })
            .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
    (void)counter;
    const int64_t ops_before = g_ops.load();
    for (auto _ : state) {
        std::vector<torch::Tensor> xs = {q.clone().requires_grad_(true), k.clone().requires_grad_(true),
                                         v.clone().requires_grad_(true), g.clone().requires_grad_(true),
                                         beta.clone().requires_grad_(true)};
        voodoo::gated_delta_rule(xs[0], xs[1], xs[2], xs[3], xs[4]).sum().backward();
        if (device.is_cuda()) {
            torch::cuda::synchronize();
        }
    }
    state.SetItemsProcessed(state.iterations() * T);
    state.counters["ops_per_step"] = static_cast<double>(g_ops.load() - ops_before) / static_cast<double>(state.iterations());
    state.SetLabel(device.is_cuda() ? "cuda" : "cpu");
}

}  // namespace

BENCHMARK(bm_delta_rule)->Args({2048, 16, 128})->Args({2048, 2, 8})->Unit(benchmark::kMillisecond)->UseRealTime();

BENCHMARK_MAIN();
