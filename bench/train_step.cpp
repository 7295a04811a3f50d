// bench/train_step: one gate-training step (bf16 teacher forward without autograd, gated student forward
// and backward, CE + KL over the vocabulary in chunks, AdamW on the gates) on a synthetic llama-architecture
// model of a real model's shape, with the fused GPU mixture and with the reference path (dense candidates,
// plain LibTorch), in the same run. Reports step time, tokens/s, model FLOP utilisation, peak GPU memory and
// the candidates' GPU memory, as a table and as JSON (docs/BENCHMARKS.md says how it was run).
//
// The candidates' bytes are real ggml quantizations of the tensor's first --tile-rows rows, repeated down
// the rows: every row is valid data of its type and the kernels do the same work as on a real model, while
// the benchmark does not spend an hour quantizing billions of weights on the CPU. Timing does not depend on
// the values; the training tests and `voodoo quantize --device cuda` use real candidates. F16, BF16 and F32
// candidates are made whole from the real weights (a conversion, not a search), so that the fused path can
// share them with the teacher as the trainer does.
#include "common/error.h"
#include "ggml/gguf.h"
#include "ggml/quant.h"
#include "ggml/types.h"
#include "model/blocks.h"
#include "model/fixture.h"
#include "model/gguf_weights.h"
#include "model/registry.h"
#include "train/budget.h"
#include "train/gated.h"
#include "train/loss.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#if defined(VOODOO_HAVE_CUDA)
#include <c10/cuda/CUDACachingAllocator.h>
#endif
#include <torch/csrc/autograd/profiler_kineto.h>
#if defined(VOODOO_HAVE_CUDA)
#include "cuda/gpu.h"
#endif

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>

using namespace voodoo;
namespace fs = std::filesystem;

namespace {

struct model_shape {
    std::string name;
    int64_t n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff;
    std::string vocab;  // file name under the vocab folder
    bool tied;
    std::string arch = "llama";
    // qwen35: one attention layer in every full_attention_interval, the others gated delta nets of ssm_n_group key
    // heads and ssm_dt_rank value heads of ssm_d_state each
    int64_t full_attention_interval = 0, ssm_d_state = 0, ssm_n_group = 0, ssm_dt_rank = 0;
    // qwen3moe: n_expert experts of FFN n_ff_exp per layer, n_expert_used per token
    int64_t n_expert = 0, n_expert_used = 0, n_ff_exp = 0;
};

const std::map<std::string, model_shape> & shapes() {
    // Qwen3-0.6B (tied embeddings) and Llama-3-8B on the llama architecture; Qwen3.5-0.8B's shape on qwen35 (hidden
    // 1024, 24 layers, three gated delta nets of 16 heads × 128 to one gated attention layer of 8 query and 2 KV
    // heads × 256, FFN 3584, its real 248,320-token vocabulary, tied head; from the model's config.json as we read
    // it: speed and memory only).
    static const std::map<std::string, model_shape> s = {
        {"qwen35-0.8b", {"qwen35-0.8b", 1024, 24, 8, 2, 256, 3584, "ggml-vocab-qwen35.gguf", true, "qwen35", 4, 128, 16, 16}},
        {"qwen3-0.6b", {"qwen3-0.6b", 1024, 28, 16, 8, 128, 3072, "ggml-vocab-qwen2.gguf", true}},
        {"llama3-8b", {"llama3-8b", 4096, 32, 32, 8, 128, 14336, "ggml-vocab-llama-bpe.gguf", false}},
        {"tiny", {"tiny", 256, 2, 4, 2, 64, 512, "ggml-vocab-llama-spm.gguf", false}},
        // Qwen3-30B-A3B's shape (qwen3moe: hidden 2048, 48 layers, 32 query and 4 KV heads of 128, 128 experts of FFN
        // 768, 8 per token, untied head, the Qwen2/3 vocabulary of 151,936), from its config.json as we read it.
        {"qwen3-30b-a3b", {"qwen3-30b-a3b", 2048, 48, 32, 4, 128, 6144, "ggml-vocab-qwen2.gguf", false, "qwen3moe", 0, 0, 0, 0,
                           128, 8, 768}},
    };
    return s;
}

std::vector<std::string> split_list(const std::string & s) {
    std::vector<std::string> out;
    for (size_t a = 0; a <= s.size();) {
        const size_t b = std::min(s.find(',', a), s.size());
        out.push_back(s.substr(a, b - a));
        a = b + 1;
    }
    return out;
}

void sync(torch::Device d) {
#if defined(VOODOO_HAVE_CUDA)
    if (d.is_cuda()) {
        torch::cuda::synchronize(d.index());
    }
#else
    (void)d;
#endif
}

int64_t peak_bytes(torch::Device d) {
#if defined(VOODOO_HAVE_CUDA)
    if (d.is_cuda()) {
        const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(d.index());
        return stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak;
    }
#endif
    (void)d;
    return 0;
}

void reset_peak(torch::Device d) {
#if defined(VOODOO_HAVE_CUDA)
    if (d.is_cuda()) {
        c10::cuda::CUDACachingAllocator::emptyCache();
        c10::cuda::CUDACachingAllocator::resetPeakStats(d.index());
    }
#endif
    (void)d;
}

// The first `tile` rows of tensor t as f32.
std::vector<float> tile_f32(const gguf_file & f, const gguf_tensor & t, int64_t tile) {
    const int64_t ne0 = t.ne[0], rows = std::min<int64_t>(tile, t.n_rows());
    const auto all = f.data(t);
    const size_t row_bytes = ggml_row_size(t.type, ne0);
    return dequantize(t.type, all.subspan(0, row_bytes * static_cast<size_t>(rows)), ne0);
}

}  // namespace

int main(int argc, char ** argv) {
    CLI::App app{"bench/train_step: one gate-training step, fused GPU mixture vs the reference path"};
    std::string shape_name = "qwen3-0.6b", work = "runs/bench", json_out, vocab_dir, device_str = "cuda", profile_dir;
    std::string paths_str = "fused,reference", menu_str, routings_str = "mix";
    int64_t layers = 0, seq = 2048, batch = 1, tile = 64;
    int steps = 5, warmup = 2;
    double peak_tflops = 989.0;
    app.add_option("--shape", shape_name, "qwen3-0.6b, qwen35-0.8b, qwen3-30b-a3b, llama3-8b or tiny")->capture_default_str();
    app.add_option("--layers", layers, "Layers (0 = the shape's own)")->capture_default_str();
    app.add_option("--seq", seq, "Tokens per sequence")->capture_default_str();
    app.add_option("--batch", batch, "Sequences per step")->capture_default_str();
    app.add_option("--steps", steps, "Timed steps (the median is reported)")->capture_default_str();
    app.add_option("--warmup", warmup, "Untimed steps first")->capture_default_str();
    app.add_option("--paths", paths_str, "Mixture paths to time: fused, fused-host (candidates in pinned host memory), reference, cpu")->capture_default_str();
    app.add_option("--routing", routings_str, "Training forward: mix, ptqr, or mix,ptqr to time both on each path")
        ->capture_default_str();
    app.add_option("--menu", menu_str, "Candidate types (default: the default menu, no imatrix)");
    app.add_option("--tile-rows", tile, "Rows really quantized per tensor shape, repeated down the rows")->capture_default_str();
    app.add_option("--work", work, "Folder for the fixture")->capture_default_str();
    app.add_option("--vocab-dir", vocab_dir, "Folder of ggml-vocab-*.gguf (default: the llama.cpp models folder)");
    app.add_option("--device", device_str, "cuda, cuda:N or cpu")->capture_default_str();
    app.add_option("--peak-tflops", peak_tflops, "Dense bf16 peak for MFU (H200 SXM datasheet: 989)")->capture_default_str();
    app.add_option("--json", json_out, "Write the results here as JSON");
    bool no_share = false, row_kernels = false, recompute = false;
    app.add_flag("--recompute", recompute,
                 "Activation checkpointing (blocks.h run_layer): each layer runs again in the backward; MFU still counts "
                 "4 forwards a step (model FLOPs), the GPU does 5 of the student's layers");
    app.add_flag("--no-share", no_share, "Fused path: upload BF16/F16 candidates even where the teacher's bf16 weights equal them");
    app.add_flag("--row-kernels", row_kernels, "Fused path: the row kernels only (not the tiled ones)");
    int min_blocks = 0;
    app.add_option("--min-blocks", min_blocks, "Fused path: the tiled kernels' variant, 1-4 blocks per multiprocessor (0 = default)")
        ->capture_default_str();
    app.add_option("--profile", profile_dir,
                   "After the timed steps, one more step per path under PyTorch's profiler: its trace goes to "
                   "DIR/trace-PATH.json (scripts/trace_summary.py sums it by kernel)");
    std::string products = "automatic";
    app.add_option("--expert-products", products, "Mixtures of experts: automatic, grouped or per-expert (blocks.h moe_ffn)")
        ->check(CLI::IsMember({"automatic", "grouped", "per-expert"}))
        ->capture_default_str();
    CLI11_PARSE(app, argc, argv);
    set_expert_products(products == "grouped"      ? expert_products::grouped
                        : products == "per-expert" ? expert_products::per_expert
                                                   : expert_products::automatic);
    try {
        const bool share = !no_share;
#if defined(VOODOO_HAVE_CUDA)
        gpu::set_tiled_kernels(!row_kernels);
        gpu::set_tiled_min_blocks(min_blocks);
#else
        (void)row_kernels;
        (void)min_blocks;
#endif
        const auto it = shapes().find(shape_name);
        if (it == shapes().end()) {
            fail("--shape '{}': expected qwen3-0.6b, qwen35-0.8b, qwen3-30b-a3b, llama3-8b or tiny", shape_name);
        }
        const model_shape & sh = it->second;
        torch::Device device = device_str == "cpu" ? torch::Device(torch::kCPU) : torch::Device(device_str);
        if (device.is_cuda() && !device.has_index()) {
            device = torch::Device(torch::kCUDA, 0);
        }
        torch::empty({1}, torch::TensorOptions().device(device));  // initializes the device and its allocator
        const torch::ScalarType compute = device.is_cuda() ? torch::kBFloat16 : torch::kFloat;
        if (vocab_dir.empty()) {
            vocab_dir = VOODOO_LLAMA_MODELS_DIR;
        }
        fixture_spec spec;
        spec.n_embd = sh.n_embd;
        spec.n_layer = layers > 0 ? layers : sh.n_layer;
        spec.n_head = sh.n_head;
        spec.n_head_kv = sh.n_head_kv;
        spec.head_dim = sh.head_dim;
        spec.n_ff = sh.n_ff;
        spec.tied_output = sh.tied;
        spec.arch = sh.arch;
        if (sh.arch == "qwen35") {
            spec.full_attention_interval = sh.full_attention_interval;
            spec.ssm_d_state = sh.ssm_d_state;
            spec.ssm_n_group = sh.ssm_n_group;
            spec.ssm_dt_rank = sh.ssm_dt_rank;
        }
        if (sh.n_expert > 0) {
            spec.n_expert = sh.n_expert;
            spec.n_expert_used = sh.n_expert_used;
            spec.n_ff_exp = sh.n_ff_exp;
        }
        spec.vocab_path = (fs::path(vocab_dir) / sh.vocab).string();
        spec.weight_type = GGML_TYPE_BF16;
        fs::create_directories(work);
        const std::string fixture = (fs::path(work) / fmt::format("{}-L{}.gguf", sh.name, spec.n_layer)).string();
        if (!fs::exists(fixture)) {
            fmt::print(stderr, "writing the fixture {}\n", fixture);
            write_fixture(spec, fixture);
        }
        const gguf_file src(fixture);
        auto model = build_model(src);
        model->set_compute_dtype(compute);
        model->set_recompute_layers(recompute);
        const model_hparams & hp = model->hparams();

        menu_options mo;
        if (!menu_str.empty()) {
            mo.types = parse_menu(menu_str, "--menu");
        }
        const std::vector<tensor_menu> menus = build_menus(src, mo);

        // Candidate bytes: each (shape, type) tile quantized once, repeated down the rows.
        const auto t0 = std::chrono::steady_clock::now();
        std::map<std::tuple<int64_t, int64_t, int>, std::vector<uint8_t>> tiles;
        std::vector<gated_tensor> gated(menus.size());
        int64_t n_weights_gated = 0;
        for (size_t i = 0; i < menus.size(); ++i) {
            const gguf_tensor & t = *menus[i].tensor;
            gated[i].tensor = &t;
            gated[i].types = menus[i].types;
            n_weights_gated += t.n_elements();
            std::vector<float> f32;
            for (ggml_type type : menus[i].types) {
                const auto key = std::make_tuple(t.ne[0], t.n_rows(), static_cast<int>(type));
                if (!tiles.count(key)) {
                    if (f32.empty()) {
                        f32 = tile_f32(src, t, tile);
                    }
                    tiles[key] = quantize(type, f32, t.ne[0], {}, 0, t.name);
                }
            }
        }
        const double quant_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        const size_t K = menus.empty() ? 0 : menus.front().types.size();
        fmt::print(stderr, "{}: {} layers, {} gated tensors, {} candidates each ({}), {:.2f} B weights gated; tiles in {:.1f} s\n",
                   sh.name, spec.n_layer, menus.size(), K,
                   menus.empty() ? "" : [&] { std::string s; for (auto t : menus.front().types) s += type_name(t) + " "; return s; }(),
                   n_weights_gated / 1e9, quant_s);

        auto expand = [&](const gguf_tensor & t, ggml_type type) {
            if (type == GGML_TYPE_F16 || type == GGML_TYPE_BF16 || type == GGML_TYPE_F32) {
                // Float candidates are cheap to make whole, and whole they can be the teacher's own weights
                // (the fused path shares them instead of storing them again).
                return quantize(type, dequantize(t.type, src.data(t), t.ne[0]), t.ne[0], {}, 0, t.name);
            }
            const std::vector<uint8_t> & tb = tiles.at(std::make_tuple(t.ne[0], t.n_rows(), static_cast<int>(type)));
            const size_t row = ggml_row_size(type, t.ne[0]);
            const size_t tile_rows = tb.size() / row;
            std::vector<uint8_t> out(row * static_cast<size_t>(t.n_rows()));
            for (int64_t r = 0; r < t.n_rows(); ++r) {
                std::memcpy(out.data() + static_cast<size_t>(r) * row, tb.data() + (static_cast<size_t>(r) % tile_rows) * row, row);
            }
            return out;
        };

        // Model FLOPs of one step: teacher forward + student forward + student backward (inputs and weights)
        // = 4 forwards; a forward is 2 FLOPs per matmul weight per token plus causal attention's
        // 2 · n_head · head_dim · T per layer per token (QKᵀ and PV over T/2 keys on average).
        // A mixture of experts counts the weights a token uses: n_expert_used of an expert tensor's n_expert experts.
        double matmul_weights = 0;
        for (const gguf_tensor & t : src.tensors()) {
            if (t.n_dims >= 2 && t.name != "token_embd.weight") {
                const double used = t.n_dims == 3 && hp.n_expert > 0
                                        ? static_cast<double>(hp.n_expert_used) / static_cast<double>(hp.n_expert)
                                        : 1.0;
                matmul_weights += used * static_cast<double>(t.n_elements());
            }
        }
        if (hp.tied_output) {
            matmul_weights += static_cast<double>(src.tensor("token_embd.weight").n_elements());
        }
        // Attention layers only: a gated delta net layer's recurrence (O(T · chunk) per head) is not counted, so
        // the MFU of a hybrid is a lower bound.
        const double n_attn_layers = sh.full_attention_interval > 0
                                         ? static_cast<double>(hp.n_layer / sh.full_attention_interval)
                                         : static_cast<double>(hp.n_layer);
        const double tokens = static_cast<double>(batch * seq);
        const double fwd = tokens * (2.0 * matmul_weights +
                                     2.0 * n_attn_layers * hp.n_head * hp.n_embd_head_k * static_cast<double>(seq));
        const double step_flops = 4.0 * fwd;

        std::vector<std::string> paths;
        for (size_t a = 0; a <= paths_str.size();) {
            const size_t b = std::min(paths_str.find(',', a), paths_str.size());
            paths.push_back(paths_str.substr(a, b - a));
            a = b + 1;
        }
        nlohmann::json results = nlohmann::json::array();
        const int64_t loss_chunk = default_loss_chunk(hp.n_vocab, device.is_cuda());  // the trainer's --loss-chunk 0
        for (const std::string & path_name : paths) {
            // "fused-host": the fused path with every candidate in pinned host memory, moved to the GPU a layer ahead
            // of use (gpu::candidate_stream), as the trainer's --candidates-on host does.
            const bool host_resident = path_name == "fused-host";
            const mixture_path path = parse_mixture_path(host_resident ? "fused" : path_name);
            std::shared_ptr<void> stream;
            if (host_resident) {
                int per_layer = 0;
                for (const gated_tensor & g : gated) {
                    per_layer += g.tensor->name.rfind("blk.0.", 0) == 0;
                }
                stream = make_candidate_stream(device, std::max(2, per_layer));
            }
            int64_t host_bytes = 0;
            reset_peak(device);
            const std::optional<torch::ScalarType> keep = device.is_cuda() ? std::optional(compute) : std::nullopt;
            gguf_weights teacher(src, device, 0, keep);
            gguf_weights dense(src, device, 0, keep);
            int64_t cand_bytes = 0;
            for (gated_tensor & g : gated) {
                g.bytes.clear();
                for (ggml_type type : g.types) {
                    g.bytes.push_back(expand(*g.tensor, type));
                }
                if (path == mixture_path::reference) {
                    // Dense candidates: ggml's to_float of each tile, repeated down the rows on the device.
                    g.path = path;
                    g.dtype = compute;
                    const int64_t rows = g.tensor->n_rows(), ne0 = g.tensor->ne[0];
                    g.dense = torch::empty({static_cast<int64_t>(g.types.size()), rows, ne0},
                                           torch::TensorOptions().dtype(compute).device(device));
                    for (size_t k = 0; k < g.types.size(); ++k) {
                        const auto & tb = tiles.at(std::make_tuple(ne0, rows, static_cast<int>(g.types[k])));
                        auto d = dequantize(g.types[k], tb, ne0);
                        const int64_t tr = static_cast<int64_t>(d.size()) / ne0;
                        const torch::Tensor td = torch::from_blob(d.data(), {tr, ne0}).to(device, compute);
                        g.dense[static_cast<int64_t>(k)].copy_(td.repeat({(rows + tr - 1) / tr, 1}).slice(0, 0, rows));
                    }
                    cand_bytes += g.dense.numel() * g.dense.element_size();
                } else {
                    // As the trainer does: the teacher's resident bf16 matrices stand in for the BF16/F16
                    // candidates equal to them (--no-share: every candidate gets its own copy).
                    const torch::Tensor source = path == mixture_path::fused && share && compute == torch::kBFloat16
                                                     ? teacher.get(g.tensor->name)
                                                     : torch::Tensor();
                    if (host_resident) {
                        host_bytes += place_candidates_on_host(g, device, compute, stream);
                    } else {
                        cand_bytes += place_candidates(g, path, device, compute, compute, source);
                    }
                }
                if (path != mixture_path::cpu) {
                    g.bytes.clear();
                    g.bytes.shrink_to_fit();
                }
            }
            // The trainer's layout: every gate a slice of one leaf, one AdamW update per step.
            int64_t n_gates = 0;
            for (const auto & g : gated) {
                n_gates += static_cast<int64_t>(g.types.size());
            }
            torch::Tensor all_gates = torch::zeros({n_gates}, torch::TensorOptions().device(device)).requires_grad_(true);
            for (size_t i = 0, at = 0; i < gated.size(); at += gated[i].types.size(), ++i) {
                gated[i].gate = all_gates.narrow(0, static_cast<int64_t>(at), static_cast<int64_t>(gated[i].types.size()));
            }
            for (const std::string & routing_name_s : split_list(routings_str)) {
            const routing_mode routing = parse_routing(routing_name_s);
            reset_peak(device);
            torch::optim::AdamW opt(std::vector<torch::Tensor>{all_gates}, torch::optim::AdamWOptions(0.05));
            gated_weights student(dense, gated);
            torch::manual_seed(1);
            std::vector<double> times;
            const bool profile = !profile_dir.empty();
            for (int s = 0; s < warmup + steps + (profile ? 1 : 0); ++s) {
                const bool profiled = s == warmup + steps;
                const torch::Tensor tok = torch::randint(0, hp.n_vocab, {batch, seq}, torch::kLong).to(device);
                sync(device);
                namespace prof = torch::autograd::profiler;
                const std::set<torch::profiler::impl::ActivityType> activities = {
                    torch::profiler::impl::ActivityType::CPU, torch::profiler::impl::ActivityType::CUDA};
                const torch::profiler::impl::ProfilerConfig config(torch::profiler::impl::ProfilerState::KINETO);
                if (profiled) {
                    prof::prepareProfiler(config, activities);
                    prof::enableProfiler(config, activities);
                }
                const auto a = std::chrono::steady_clock::now();
                opt.zero_grad();
                student.set_routing(routing, static_cast<uint64_t>(s));
                torch::Tensor h_t;
                {
                    torch::NoGradGuard no_grad;
                    h_t = model->hidden(tok, teacher);
                }
                const torch::Tensor h_s = model->hidden(tok, student);
                const distill_values v = chunked_distill(*model, h_s, student, h_t, teacher, tok, 1.0, 1.0, loss_chunk);
                opt.step();
                sync(device);
                const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count();
                if (profiled) {
                    fs::create_directories(profile_dir);
                    const std::string trace = (fs::path(profile_dir) / fmt::format("trace-{}-{}.json", path_name, routing_name_s)).string();
                    prof::disableProfiler()->save(trace);
                    fmt::print(stderr, "  {} profiled step: {:.3f} s, trace {}\n", path_name, dt, trace);
                    continue;
                }
                if (s >= warmup) {
                    times.push_back(dt);
                }
                fmt::print(stderr, "  {} {} step {}: {:.3f} s (CE {:.3f}, KL {:.4f})\n", path_name, routing_name_s, s, dt, v.ce, v.kl);
            }
            std::sort(times.begin(), times.end());
            const double med = times[times.size() / 2];
            const nlohmann::json r = {
                {"shape", sh.name},         {"layers", spec.n_layer},     {"path", path_name}, {"routing", routing_name_s},
                {"candidates", K},          {"seq", seq},                  {"batch", batch},
                {"step_s", med},            {"step_s_min", times.front()}, {"step_s_max", times.back()},
                {"tokens_per_s", tokens / med},
                {"tflops", step_flops / med / 1e12},
                {"mfu", step_flops / med / (peak_tflops * 1e12)},
                {"peak_gib", peak_bytes(device) / 1073741824.0},
                {"candidate_gib", cand_bytes / 1073741824.0},
                {"host_candidate_gib", host_bytes / 1073741824.0},
                {"stream", [&] {
                     const candidate_stream_stats st = candidate_stream_statistics(stream);
                     return nlohmann::json{{"uses", st.uses}, {"misses", st.misses}, {"copies", st.copies},
                                           {"bytes_copied", st.bytes_copied}, {"peak_resident_bytes", st.peak_resident_bytes}};
                 }()},
                {"weights_gated", n_weights_gated},
                {"shared_16bit", path == mixture_path::fused && share},
                {"kernels", path == mixture_path::fused ? (row_kernels ? std::string("rows") : fmt::format("tiled, min blocks {}", min_blocks)) : std::string("-")},
                {"recompute", recompute},
                {"step_flops", step_flops}};
            results.push_back(r);
            }
            for (gated_tensor & g : gated) {
                g.dense = torch::Tensor();
                g.device_bytes.reset();
                g.stream.reset();
                g.gate = torch::Tensor();
            }
        }
        fmt::print("| shape | layers | path | routing | K | seq | step (s) | tokens/s | TFLOP/s | MFU | peak GPU (GiB) | candidates (GiB) |\n");
        fmt::print("|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
        for (const auto & r : results) {
            fmt::print("| {} | {} | {} | {} | {} | {} | {:.3f} | {:.0f} | {:.0f} | {:.1f}% | {:.1f} | {:.2f} |\n",
                       r["shape"].get<std::string>(), r["layers"].get<int64_t>(), r["path"].get<std::string>(),
                       r["routing"].get<std::string>(),
                       r["candidates"].get<size_t>(), r["seq"].get<int64_t>(), r["step_s"].get<double>(),
                       r["tokens_per_s"].get<double>(), r["tflops"].get<double>(), 100 * r["mfu"].get<double>(),
                       r["peak_gib"].get<double>(), r["candidate_gib"].get<double>());
        }
        if (results.size() == 2 && results[0]["routing"] == results[1]["routing"]) {
            fmt::print("fused vs reference: {:.2f}x faster per step, {:.2f}x less candidate memory, {:.2f}x less peak memory\n",
                       results[1]["step_s"].get<double>() / results[0]["step_s"].get<double>(),
                       results[1]["candidate_gib"].get<double>() / results[0]["candidate_gib"].get<double>(),
                       results[1]["peak_gib"].get<double>() / results[0]["peak_gib"].get<double>());
        }
        if (!json_out.empty()) {
            std::ofstream(json_out) << results.dump(2) << "\n";
        }
    } catch (const voodoo::error & e) {
        fmt::print(stderr, "error: {}\n", e.what());
        return 1;
    }
    return 0;
}
