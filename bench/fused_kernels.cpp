// bench/fused_kernels (CUDA builds): the two fused kernels of src/cuda/gpu.h alone, on one [rows, ne0] tensor
// with the default menu's K = 15 candidates (Llama-3-8B's ffn_up shape by default), for the row kernels and
// each variant of the tiled kernels. Reports milliseconds per call, the bytes each call must move (resident
// candidate bytes, plus W_eff written or G read) as GB/s, and nanoseconds per weight, as a table and JSON.
//
// Candidate bytes are random (every byte pattern is valid input to a dequantizer, and timing does not depend
// on the values); with --share the F16 and BF16 candidates are the source's bf16 bytes, as in training.
#include "common/error.h"
#include "cuda/deq_rules.h"
#include "cuda/gpu.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <random>

using namespace voodoo;

int main(int argc, char ** argv) {
    CLI::App app{"bench/fused_kernels: the fused mixture and gate-gradient kernels alone, per variant"};
    int64_t rows = 14336, ne0 = 4096;
    int reps = 10;
    bool share = true;
    std::string json_out;
    app.add_option("--rows", rows, "Rows of the tensor")->capture_default_str();
    app.add_option("--ne0", ne0, "Weights per row")->capture_default_str();
    app.add_option("--reps", reps, "Timed calls per variant (the median is reported)")->capture_default_str();
    app.add_option("--share", share, "F16/BF16 candidates read the source's bf16 bytes")->capture_default_str();
    app.add_option("--json", json_out, "Write the results here as JSON");
    CLI11_PARSE(app, argc, argv);
    try {
        const torch::Device dev(torch::kCUDA, 0);
        // The default menu as bench/train_step meets it on these widths (no imatrix): K = 15.
        const std::vector<int> types = {deq::Q2_K, deq::IQ3_S, deq::Q3_K, deq::IQ4_XS, deq::IQ4_NL,
                                        deq::Q4_0, deq::Q4_K,  deq::Q4_1, deq::Q5_0,   deq::Q5_K,
                                        deq::Q5_1, deq::Q6_K,  deq::Q8_0, deq::F16,    deq::BF16};
        const int64_t n = rows * ne0;
        const torch::Tensor source = torch::randn({rows, ne0}, torch::TensorOptions().device(dev)).to(torch::kBFloat16);
        std::vector<std::vector<uint8_t>> bytes;
        std::mt19937_64 rng(1);
        for (int t : types) {
            const int64_t nb = n / deq::block_size(t) * deq::block_bytes(t);
            if (t == deq::BF16) {
                const torch::Tensor h = source.view(torch::kUInt8).view({-1}).cpu();
                bytes.emplace_back(h.data_ptr<uint8_t>(), h.data_ptr<uint8_t>() + nb);
            } else if (t == deq::F16) {
                const torch::Tensor h = source.to(torch::kHalf).view(torch::kUInt8).view({-1}).cpu();
                bytes.emplace_back(h.data_ptr<uint8_t>(), h.data_ptr<uint8_t>() + nb);
            } else {
                std::vector<uint8_t> b(static_cast<size_t>(nb));
                for (size_t i = 0; i + 8 <= b.size(); i += 8) {
                    const uint64_t r = rng();
                    std::memcpy(&b[i], &r, 8);
                }
                bytes.push_back(std::move(b));
            }
        }
        const gpu::candidate_set c =
            gpu::upload(bytes, types, rows, ne0, dev, "bench", share ? source : torch::Tensor());
        bytes.clear();
        const int64_t resident = gpu::resident_bytes(c);
        int64_t read_per_call = 0;  // what a tiled call copies into shared memory: shared bytes once
        for (size_t k = 0; k < types.size(); ++k) {
            bool seen = false;
            for (size_t j = 0; j < k; ++j) {
                seen = seen || c.bytes[j].data_ptr() == c.bytes[k].data_ptr();
            }
            read_per_call += seen ? 0 : c.bytes[k].numel();
        }
        const torch::Tensor p = torch::full({static_cast<int64_t>(types.size())}, 1.0f / types.size(),
                                            torch::TensorOptions().device(dev));
        const torch::Tensor g = torch::randn({rows, ne0}, torch::TensorOptions().device(dev)).to(torch::kBFloat16);
        fmt::print(stderr, "[{}, {}] = {:.1f} M weights, K = {}, candidates resident {:.1f} MiB ({:.2f} bits/weight), "
                           "read per call {:.1f} MiB\n",
                   rows, ne0, n / 1e6, types.size(), resident / 1048576.0, 8.0 * resident / n, read_per_call / 1048576.0);

        auto time = [&](auto && f) {
            for (int i = 0; i < 3; ++i) f();
            torch::cuda::synchronize();
            std::vector<double> ms;
            for (int i = 0; i < reps; ++i) {
                const auto a = std::chrono::steady_clock::now();
                f();
                torch::cuda::synchronize();
                ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count());
            }
            std::sort(ms.begin(), ms.end());
            return ms[ms.size() / 2];
        };
        nlohmann::json results = nlohmann::json::array();
        fmt::print("| kernels | mixture (ms) | mixture GB/s | gate grad (ms) | gate grad GB/s | ns/weight (both) |\n");
        fmt::print("|---|---:|---:|---:|---:|---:|\n");
        const torch::Tensor ref_w = [&] { gpu::set_tiled_kernels(false); return gpu::mixture(c, p, torch::Tensor(), torch::kBFloat16); }();
        for (int variant = 0; variant <= 4; ++variant) {
            gpu::set_tiled_kernels(variant > 0);
            gpu::set_tiled_min_blocks(variant);
            const double mix = time([&] { gpu::mixture(c, p, torch::Tensor(), torch::kBFloat16); });
            const double gg = time([&] { gpu::gate_grad(c, g, torch::Tensor()); });
            // Bit for bit (as int16: random bytes make NaN weights, and a NaN never equals itself).
            const bool same = torch::equal(gpu::mixture(c, p, torch::Tensor(), torch::kBFloat16).view(torch::kShort),
                                           ref_w.view(torch::kShort));
            const std::string name = variant == 0 ? "rows" : fmt::format("tiled, {} blocks/SM", variant);
            const double mix_gb = (read_per_call + 2.0 * n) / mix / 1e6, gg_gb = (read_per_call + 2.0 * n) / gg / 1e6;
            fmt::print("| {} | {:.2f} | {:.0f} | {:.2f} | {:.0f} | {:.3f} |{}\n", name, mix, mix_gb, gg, gg_gb,
                       (mix + gg) * 1e6 / n, same ? "" : " W differs from the row kernels!");
            results.push_back({{"kernels", name}, {"mixture_ms", mix}, {"gate_grad_ms", gg}, {"mixture_gbps", mix_gb},
                               {"gate_grad_gbps", gg_gb}, {"same_w", same}, {"rows", rows}, {"ne0", ne0},
                               {"K", types.size()}, {"resident_bytes", resident}, {"read_bytes", read_per_call}});
        }
        gpu::set_tiled_kernels(true);
        gpu::set_tiled_min_blocks(0);
        if (!json_out.empty()) {
            std::ofstream(json_out) << results.dump(2) << "\n";
        }
    } catch (const voodoo::error & e) {
        fmt::print(stderr, "error: {}\n", e.what());
        return 1;
    }
    return 0;
}
