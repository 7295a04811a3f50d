#include "pipeline/dry_run.h"

#include "common/error.h"
#include "common/torch_info.h"
#include "common/units.h"
#include "common/file.h"
#include "dist/dist.h"
#include "eval/baseline.h"
#include "eval/speed_table.h"
#include "export/export.h"
#include "model/registry.h"
#include "ggml/quant.h"
#include "ggml/types.h"
#include "train/budget.h"
#include "train/candidates.h"
#include "train/gated.h"
#include "train/probe.h"
#include "train/prune.h"
#include "train/trainer.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <map>
#include <regex>
#include <set>

namespace voodoo {

namespace {

using dry_clock = std::chrono::steady_clock;

double dry_elapsed(dry_clock::time_point t0) {
    return std::chrono::duration<double>(dry_clock::now() - t0).count();
}

/// "blk.7.attn_q.weight" → "blk.*.attn_q.weight": the family a menu is reported for.
std::string dry_family(const std::string & name) {
    static const std::regex layer(R"(^blk\.\d+\.)");
    return std::regex_replace(name, layer, "blk.*.");
}

/// Quantization rate of `type` on one core, weights per second: the first rows (≥ 64K weights) of tensor t
/// quantized once, with unit importance where the type needs one (the rate hardly depends on its values).
double dry_quantize_rate(const gguf_file & src, const gguf_tensor & t, ggml_type type) {
    const int64_t ne0 = t.ne[0];
    const int64_t rows = std::min<int64_t>(t.n_rows(), std::max<int64_t>(1, (65536 + ne0 - 1) / ne0));
    const size_t row_bytes = tensor_bytes(t.type, std::array<int64_t, 2>{ne0, 1}, t.name);
    const std::span<const uint8_t> bytes = src.data(t).subspan(0, row_bytes * static_cast<size_t>(rows));
    const std::vector<float> x = dequantize(t.type, bytes, ne0, 1, t.name);
    const std::vector<float> ones(static_cast<size_t>(ne0), 1.0f);
    // One row first: the IQ1/IQ2/IQ3 types build their grids on first use (ggml_quantize_init; dry_run builds them
    // ahead, lattice_warmup), once per process.
    quantize(type, std::span<const float>(x).subspan(0, static_cast<size_t>(ne0)), ne0, ones, 1, t.name);
    const auto t0 = dry_clock::now();
    const std::vector<uint8_t> q = quantize(type, x, ne0, ones, 1, t.name);
    return static_cast<double>(x.size()) / std::max(dry_elapsed(t0), 1e-6);
}

/// f32 matrix-product rate of this machine's LibTorch on `threads` threads, FLOP/s: a [256, 1024] × [1024, 1024]
/// product, best of five after one.
double dry_cpu_flops(int threads) {
    const int before = torch::get_num_threads();
    set_torch_threads(threads);
    const torch::Tensor a = torch::randn({256, 1024}), b = torch::randn({1024, 1024});
    double best = 1e30;
    for (int i = 0; i < 6; ++i) {  // the first wakes the thread pool
        const auto t0 = dry_clock::now();
        const torch::Tensor c = torch::mm(a, b);
        best = std::min(best, dry_elapsed(t0));
    }
    torch::set_num_threads(before);
    return 2.0 * 256 * 1024 * 1024 / std::max(best, 1e-7);
}

/// Seconds per element of an f32 a += α·b over 4M elements on `threads` threads, best of three: the memory-bound
/// step that forming W_eff = Σ p_k deq(Q_k) and the gate gradients ⟨G, deq Q_k⟩ repeat for every candidate weight.
double dry_axpy_seconds(int threads) {
    const int before = torch::get_num_threads();
    set_torch_threads(threads);
    torch::Tensor a = torch::randn({1 << 22}), b = torch::randn({1 << 22});
    double best = 1e30;
    for (int i = 0; i < 3; ++i) {
        const auto t0 = dry_clock::now();
        a.add_(b, 0.5);
        best = std::min(best, dry_elapsed(t0));
    }
    torch::set_num_threads(before);
    return best / static_cast<double>(1 << 22);
}

std::string dry_bytes_text(double b) { return bytes_text(b); }

std::string dry_seconds_text(double s) {
    if (s < 1) {
        return "< 1 s";
    }
    if (s < 120) {
        return fmt::format("{:.0f} s", s);
    }
    if (s < 7200) {
        return fmt::format("{:.1f} min", s / 60);
    }
    return fmt::format("{:.1f} h", s / 3600);
}

}  // namespace

nlohmann::json plan_dry_run(const dry_run_input & in) {
    const gguf_file & src = *in.src;
    const bool gpu = in.train.device != "cpu";

    // The importance: the imatrix when one exists; else the coverage llama-imatrix (and voodoo imatrix) will give
    // (src/imatrix/collect.h): every blk.* matmul weight, output.weight, and token_embd.weight when it is the
    // tied head — the tensors a token reads whole (read_per_token). Only which tensors are covered matters to
    // the menus.
    importance_map importance;
    export_options eo = in.train.export_opts;
    const bool imatrix_known = !in.imatrix.empty();
    if (imatrix_known) {
        eo = imatrix_export_options(in.imatrix, in.imatrix, src, importance);
    } else if (!in.planned_imatrix_file.empty()) {
        // The sizes count the quantize.imatrix.* keys the imatrix stage's file will give the export.
        const std::string target = eo.target;
        eo = planned_imatrix_export_options(in.planned_imatrix_file, in.planned_imatrix_dataset);
        eo.target = target;
    }
    if (!imatrix_known && in.train.menu.has_imatrix) {
        for (const gguf_tensor & t : src.tensors()) {
            if (read_per_token(src, t)) {
                importance[t.name] = {};
            }
        }
    }
    menu_options mo = in.train.menu;
    mo.importance = mo.has_imatrix ? &importance : nullptr;
    const std::vector<tensor_menu> menus = build_menus(src, mo);

    nlohmann::json plan;
    int64_t n_weights = 0, gated_weights = 0, io_per_token = 0;
    for (const gguf_tensor & t : src.tensors()) {
        n_weights += t.n_elements();
    }
    plan["model"] = {{"path", src.path()}, {"weights", n_weights}, {"tensors", src.tensors().size()}};
    plan["device"] = in.train.device;

    // Menus by family.
    std::map<std::string, std::pair<int, std::vector<ggml_type>>> by_family;
    std::vector<std::string> order;
    for (const tensor_menu & m : menus) {
        const std::string f = dry_family(m.tensor->name);
        if (!by_family.count(f)) {
            order.push_back(f);
        }
        auto & e = by_family[f];
        e.first += 1;
        if (e.second.empty() || e.second.size() > m.types.size()) {
            e.second = m.types;  // the narrowest menu of the family (the layers normally all agree)
        }
        gated_weights += m.tensor->n_elements();
        io_per_token += m.tensor->ne[0] + m.tensor->n_rows();
    }
    plan["menus"] = nlohmann::json::array();
    for (const std::string & f : order) {
        nlohmann::json types = nlohmann::json::array();
        for (ggml_type t : by_family[f].second) {
            types.push_back(type_name(t));
        }
        plan["menus"].push_back({{"tensors", f}, {"n", by_family[f].first}, {"types", types}});
    }

    // Mixtures of experts: the 3-D expert tensors (one type each, every expert's slice quantized with its own imatrix
    // rows), what share of the weights they hold, and how many experts a token uses.
    {
        int64_t expert_tensors = 0, expert_weights = 0, n_expert = 0;
        for (const tensor_menu & m : menus) {
            if (m.tensor->n_dims == 3) {
                ++expert_tensors;
                expert_weights += m.tensor->n_elements();
                n_expert = std::max(n_expert, m.tensor->ne[2]);
            }
        }
        if (expert_tensors > 0) {
            const std::string arch = src.architecture();
            plan["experts"] = {{"tensors", expert_tensors},
                               {"experts_per_tensor", n_expert},
                               {"used_per_token", src.get_int(arch + ".expert_used_count").value_or(0)},
                               {"weights", expert_weights},
                               {"share_of_weights", static_cast<double>(expert_weights) / static_cast<double>(n_weights)}};
        }
    }

    // Candidates: every tensor × menu type (build_candidates); the cache holds the ones not of the source type.
    int64_t count = 0, in_cache = 0, to_build = 0;
    double bytes = 0, in_cache_bytes = 0, to_build_bytes = 0;
    std::map<ggml_type, int64_t> build_weights;               // weights to quantize per type
    std::map<ggml_type, const gguf_tensor *> sample_of;       // the largest tensor with the type in its menu
    for (const tensor_menu & m : menus) {
        const gguf_tensor & t = *m.tensor;
        for (ggml_type type : m.types) {
            const size_t n = tensor_bytes(type, t.shape(), t.name);
            ++count;
            bytes += static_cast<double>(n);
            if (type == t.type) {
                continue;  // the source bytes, copied
            }
            const bool hit = imatrix_known &&
                             candidate_cache::holds(in.cache_dir, candidate_cache::key(src, t, type, importance_for(&importance, t)), n);
            if (hit) {
                ++in_cache;
                in_cache_bytes += static_cast<double>(n + sizeof(uint64_t));
            } else {
                ++to_build;
                to_build_bytes += static_cast<double>(n + sizeof(uint64_t));
                build_weights[type] += t.n_elements();
                if (!sample_of.count(type) || sample_of[type]->n_elements() < t.n_elements()) {
                    sample_of[type] = &t;
                }
            }
        }
    }
    plan["candidates"] = {{"count", count}, {"bytes", bytes}, {"in_cache", in_cache}, {"in_cache_bytes", in_cache_bytes},
                          {"to_build", to_build}, {"to_build_bytes", to_build_bytes}, {"cache_dir", in.cache_dir},
                          {"cache_known", imatrix_known}, {"pruned_for_targets", in.train.candidates == "targets"}};

    // Sizes: the range the menus reach and each target in it.
    // Each target's range is make_budget's for that very target: the header holds the target's text
    // (voodoo.target = "size=304352"), so the file's fixed bytes depend on it by a few bytes and its padding.
    auto budget_of = [&](const target & g) {
        export_options e = eo;
        e.target = g.str();  // as run_quantize checks each target, and as export writes it
        return make_budget(src, menus, g, e, false);
    };
    target ref{target_kind::size, static_cast<double>(file_size(src.path()))};  // a like target not made yet: about
                                                                                  // as many digits as its size
    if (!in.goals.empty()) {
        ref = in.goals.front();
    } else if (!in.like_sizes.empty() && in.like_sizes.front().second > 0) {
        ref = {target_kind::size, in.like_sizes.front().second};
    }
    const budget range = budget_of(ref);
    nlohmann::json targets = nlohmann::json::array();
    for (const target & g : in.goals) {
        const budget b = budget_of(g);
        targets.push_back({{"target", g.str()}, {"bytes", b.limit}, {"feasible", b.limit >= b.min_total && b.limit <= b.max_total},
                           {"min_bytes", b.min_total}, {"max_bytes", b.max_total}});
    }
    for (const auto & [name, like_bytes] : in.like_sizes) {
        nlohmann::json j = {{"target", "like=" + name}};
        if (like_bytes > 0) {
            const budget b = budget_of({target_kind::size, like_bytes});
            j["bytes"] = like_bytes;
            j["feasible"] = like_bytes >= b.min_total && like_bytes <= b.max_total;
            j["min_bytes"] = b.min_total;
            j["max_bytes"] = b.max_total;
        } else {
            j["bytes"] = nullptr;
            j["feasible"] = nullptr;  // sized by the run once its imatrix exists (plan_stock_file: types depend on one)
            // Its estimate (estimate_stock_bytes: a few percent low, the recipe's promotions left out), against the
            // range with a tenth to spare either way: a target far outside it is said now, not after the imatrix (a new
            // user's trial: --menu mxfp4 on stories260K, whose only feasible size is 28% above stock Q4_K_M's).
            const double est = estimate_stock_bytes(src, recipe_by_name(name));
            j["estimated_bytes"] = est;
            j["likely_outside"] = est < 0.9 * static_cast<double>(range.min_total) ||
                                  est > 1.1 * static_cast<double>(range.max_total);
        }
        targets.push_back(j);
    }
    const double w = static_cast<double>(n_weights);
    plan["sizes"] = {{"min_bytes", range.min_total}, {"max_bytes", range.max_total}, {"min_bpw", 8 * range.min_total / w},
                     {"max_bpw", 8 * range.max_total / w}, {"of", ref.kind == target_kind::bpw ? "tensor data" : "file"},
                     {"exact", imatrix_known || !in.planned_imatrix_file.empty()}, {"targets", targets}};

    // Disk: the cache's folder and what the run would write there (issue #16: "will it fit?"). The candidates to
    // build are exact for --candidates all and an upper bound with targets (the probe decides; the run checks the
    // room for what it keeps before building it: check_disk_room). The exported files are the targets' bytes, a
    // --like target not made yet at its stock file's estimate; the stock files not made yet are estimated
    // (estimate_stock_bytes), the token data at the calibration text's bytes.
    {
        double files = 0, stock = 0;
        int64_t unknown = 0, n_files = 0;
        if (in.exports) {
            for (const auto & t : targets) {
                ++n_files;
                if (t["bytes"].is_null()) {
                    ++unknown;
                    files += estimate_stock_bytes(src, recipe_by_name(t["target"].get<std::string>().substr(5)));  // "like=NAME"
                } else {
                    files += t["bytes"].get<double>();
                }
            }
        }
        for (const std::string & name : in.stock_recipes) {
            stock += estimate_stock_bytes(src, recipe_by_name(name));
        }
        const double data = static_cast<double>(in.text_bytes);
        const int64_t free = free_disk_bytes(in.cache_dir);
        const double need = to_build_bytes + files + stock + data + static_cast<double>(k_disk_reserve_bytes);
        plan["disk"] = {{"folder", in.cache_dir}, {"free_bytes", free}, {"candidates_to_build_bytes", to_build_bytes},
                        {"candidates_exact", in.train.candidates != "targets"}, {"exported_files", n_files},
                        {"exported_files_bytes", files}, {"exported_files_unknown", unknown}, {"stock_files", in.stock_files},
                        {"stock_files_to_make", in.stock_recipes.size()}, {"stock_files_bytes_estimate", stock},
                        {"data_bytes_estimate", data}, {"reserve_bytes", k_disk_reserve_bytes},
                        {"fits_every_candidate", free < 0 ? nlohmann::json(nullptr) : nlohmann::json(need <= static_cast<double>(free))}};
    }

    // Rates measured here, and the assumed GPU rates.
    const int threads = resolve_threads(in.train.threads);
    const int ggml_threads = resolve_threads(in.ggml_threads);
    std::map<ggml_type, double> qrate;
    {
        // The lattice types' grids, built at once on their own threads (one after the other, ≈ 29 s of one core).
        std::vector<ggml_type> types;
        for (const auto & entry : sample_of) {
            types.push_back(entry.first);
        }
        lattice_warmup grids(types, threads);
    }
    for (const auto & [type, t] : sample_of) {
        qrate[type] = dry_quantize_rate(src, *t, type);
    }
    // A whole forward runs at a fraction of the product's peak. LibTorch's f32 forward with the vocabulary's
    // softmax and KL (probe, selection): 0.36 on the 2-core machine, where mix30M's eager probe (73 forwards of
    // 2 × 512 tokens, 82% of a whole forward each) takes 60.6 s since the CPU's loss chunk stays under glibc's mmap
    // threshold (0.21 before, at 2.1 s a forward); a training step's forward and backward: still 0.21 (mix30M's 40
    // steps of 2 × 128 tokens, 70-75 s with either chunk; docs/BENCHMARKS.md, session 35). libllama's (imatrix, eval):
    // 0.85, 1,800–2,000 tokens/s of mix30M there (docs/BENCHMARKS.md, "One size of mix30M on the CPU").
    constexpr double torch_efficiency = 0.36, torch_train_efficiency = 0.21, ggml_efficiency = 0.85;
    const double cpu_peak = dry_cpu_flops(in.train.threads);
    const double cpu = torch_efficiency * cpu_peak, cpu_ggml = ggml_efficiency * dry_cpu_flops(in.ggml_threads);
    const double cpu_train = torch_train_efficiency * cpu_peak;
    const double axpy = dry_axpy_seconds(in.train.threads);
    // A whole H200 step of a small model is bound by launches, not FLOPs (docs/BENCHMARKS.md: 22.8% MFU at the
    // Llama-3-8B slice); 100 TFLOP/s of bf16 and 30 of f32 are what the measured steps and probes reach.
    // The probe's f32 products on the tensor cores (--probe-compute tf32, auto's choice on a GPU) ran its forwards 2.7× as
    // fast on an H100 (Qwen3-1.7B shape, 8 × 512 tokens: 0.291 → 0.107 s; session 29): ≈ 80 TFLOP/s.
    const double gpu_bf16 = 100e12, gpu_f32 = 30e12, gpu_tf32 = 80e12;
    nlohmann::json rates = {{"cpu_f32_product_flops", cpu_peak}, {"cpu_forward_flops", cpu}, {"cpu_train_flops", cpu_train},
                            {"cpu_axpy_seconds_per_element", axpy}, {"threads", threads}, {"ggml_threads", ggml_threads},
                            {"quantize_weights_per_s_per_core", nlohmann::json::object()}};
    for (const auto & [type, r] : qrate) {
        rates["quantize_weights_per_s_per_core"][type_name(type)] = r;
    }
    if (gpu) {
        rates["gpu_bf16_flops_assumed"] = gpu_bf16;
        rates["gpu_f32_flops_assumed"] = gpu_f32;
    }
    rates["method"] = "candidates: each type's measured single-core rate × threads; forwards: 2 FLOPs per weight "
                      "per token at 0.36 (LibTorch) or 0.85 (libllama) of the measured f32 product rate (the fractions "
                      "mix30M's forwards reach on the 2-core machine), or the assumed GPU rate; a training step: 8 "
                      "FLOPs per weight per token (student forward and backward, teacher forward) at 0.21 of that rate "
                      "and, on the CPU, "
                      "3 axpy-equivalents per candidate weight (mixture, dequantization, gate gradient)";
    plan["rates"] = rates;

    // Stages.
    const int64_t seq = in.train.seq > 0 ? in.train.seq : in.ctx;
    const double fwd_flops_per_token = 2.0 * static_cast<double>(n_weights);
    nlohmann::json stages = nlohmann::json::array();
    auto add = [&](const std::string & stage, const std::string & work, double s) {
        stages.push_back({{"stage", stage}, {"work", work}, {"seconds", s}});
    };
    if (in.text_bytes > 0) {
        add("data", fmt::format("tokenize {} of text", dry_bytes_text(static_cast<double>(in.text_bytes))),
            static_cast<double>(in.text_bytes) / 5e6);
    }
    if (in.imatrix_chunks > 0) {
        const double tokens = static_cast<double>(in.imatrix_chunks * in.ctx);
        add("imatrix", fmt::format("{} chunks × {} tokens ({})", in.imatrix_chunks, in.ctx, gpu ? "LibTorch on the GPU" : "libllama"),
            tokens * fwd_flops_per_token / (gpu ? gpu_f32 : cpu_ggml));
    }
    {
        double s = 0;
        for (const auto & [type, n] : build_weights) {
            s += static_cast<double>(n) / (qrate[type] * threads);
        }
        add("candidates", fmt::format("{} quantizations on {} core{} ({} already in the cache)", to_build, threads, threads == 1 ? "" : "s", in_cache), s);
        if (in.train.candidates == "targets" && s > 0) {
            // Every candidate is an upper bound: pruning builds part of the menus' work, known only after the probe.
            stages.back()["likely_seconds"] = {k_pruned_work_share_low * s, k_pruned_work_share_high * s};
        }
    }
    // The probe and the selection run whole --ctx chunks. A candidate's forward runs from its own layer on
    // (probe_forward_share: about half a whole forward; the first, the source's, is whole).
    {
        int64_t forwards = 1, full = 1, anchored = 1, staged = 0;
        double work = 1, work_full = 1, work_anchored = 1, work_staged = 0;  // in whole forwards
        const int a = in.train.probe_anchors;
        // The second stage of pruning (--prune-stages 2, train/prune.h stage_types) measures each tensor's knapsack
        // choice and its stage_width neighbours on each side, beyond the eager types: at most 2 · width + 1 more.
        const bool two_stages = in.train.candidates == "targets" &&
                                resolved_prune_stages(in.train.prune_stages, in.train.device) == 2;
        const int64_t stage_span = 2 * prune_options{}.stage_width + 1;
        for (const tensor_menu & m : menus) {
            const int64_t k = static_cast<int64_t>(m.types.size());
            const double share = probe_forward_share(src, m.tensor->name);
            const int64_t n = a > 0 ? std::min<int64_t>(a, k) : k;
            forwards += n;
            full += k;
            anchored += std::min<int64_t>(2, k);
            work += share * static_cast<double>(n);
            work_full += share * static_cast<double>(k);
            work_anchored += share * static_cast<double>(std::min<int64_t>(2, k));
            const int64_t s = two_stages ? std::min(k - std::min<int64_t>(n, k), stage_span) : 0;
            staged += s;
            work_staged += share * static_cast<double>(s);
        }
        const bool tf32 = gpu && resolved_probe_compute(in.train.probe_compute, in.train.device) == "tf32";
        const double per_forward = static_cast<double>(in.train.probe_sequences * in.ctx) * fwd_flops_per_token /
                                   (gpu ? (tf32 ? gpu_tf32 : gpu_f32) : cpu);
        std::string how;
        if (a < 0) {  // auto (probe.h resolve_probe_anchors): the rest measured only when it fits the limit
            const bool all = per_forward * (work_full - work_anchored) <= in.train.probe_auto_seconds;
            forwards = all ? full : anchored;
            work = all ? work_full : work_anchored;
            how = all ? " (--probe-anchors auto: every type)" : " (--probe-anchors auto: 2 anchors per tensor)";
        }
        if (forwards < full && staged > 0) {  // anchored: the second stage's forwards come on top (at most)
            const int64_t more = std::min(staged, full - forwards);
            work += work_staged * static_cast<double>(more) / static_cast<double>(staged);
            forwards += more;
            how += fmt::format(" (with at most {} of the second stage of pruning, --prune-stages 2)", more);
        }
        add("probe", fmt::format("{} forwards of {} × {} tokens{}, {:.0f}% of a whole forward each on average", forwards,
                                 in.train.probe_sequences, in.ctx, how, 100.0 * work / static_cast<double>(forwards)),
            work * per_forward);
    }
    {
        const double tokens = static_cast<double>(in.train.steps) * in.train.batch * in.train.accum * static_cast<double>(seq);
        // The mixture W_eff = Σ p_k · deq(Q_k) of every gated tensor and its gate gradients, once per micro-batch:
        // memory-bound on the CPU; on the GPU the fused kernels' share of a step is small (docs/BENCHMARKS.md).
        double candidate_weights = 0;
        for (const tensor_menu & m : menus) {
            candidate_weights += static_cast<double>(m.types.size() * m.tensor->n_elements());
        }
        const double mix_s = gpu ? 0.0 : 3.0 * candidate_weights * axpy * static_cast<double>(in.train.steps) * in.train.accum;
        add("train", fmt::format("{} steps × {} × {} tokens", in.train.steps, in.train.batch * in.train.accum, seq),
            4.0 * fwd_flops_per_token * tokens / (gpu ? gpu_bf16 : cpu_train) + mix_s);
    }
    {
        // The trained recipe, the exact and the greedy knapsack, and the smaller sizes' recipes of a ladder.
        const int64_t recipes = 3 + static_cast<int64_t>(in.train.prior_recipes.size());
        const double tokens = static_cast<double>(recipes * in.train.select_sequences * in.ctx);
        add("select", fmt::format("about {} recipes × {} × {} tokens", recipes, in.train.select_sequences, in.ctx),
            tokens * fwd_flops_per_token / (gpu ? gpu_f32 : cpu));
    }
    add("export", fmt::format("{} file{}", std::max<size_t>(1, in.goals.size() + in.like_sizes.size()),
                              in.goals.size() + in.like_sizes.size() > 1 ? "s" : ""),
        range.max_total / 1e9 * static_cast<double>(std::max<size_t>(1, in.goals.size() + in.like_sizes.size())));
    if (in.stock_files > 0) {
        // llama_model_quantize of the whole model per stock file, at the median measured type rate.
        std::vector<double> r;
        for (const auto & [type, v] : qrate) {
            r.push_back(v);
        }
        std::sort(r.begin(), r.end());
        const double median = r.empty() ? 1e7 : r[r.size() / 2];
        add("baselines", fmt::format("{} stock files (llama_model_quantize)", in.stock_files),
            static_cast<double>(in.stock_files) * static_cast<double>(n_weights) / (median * threads));
    }
    if (in.eval_files > 0) {
        // Every file and the reference model, each token at least k_eval_token_floor (a small model's decode is bound
        // by libllama's per-token work, not its FLOPs: stories260K's 256-token chunks take ≈ 78 ms a file on the 2-core
        // machine, 0.3 ms a token, where its FLOPs say 0.01), then the llama-bench runs (--speed-reps): pp512 as 512
        // eval tokens, tg128 as 128 reads of the file's bytes at k_eval_memory_bytes_per_s, and k_bench_run_seconds
        // of set-up a run (stories260K: 0.31 s a run, mix30M's Q4_K_M: 0.38 s, on the 2-core machine, session 38).
        constexpr double k_eval_token_floor = 3e-4, k_eval_memory_bytes_per_s = 10e9, k_bench_run_seconds = 0.3;
        const double per_token = std::max(fwd_flops_per_token / cpu_ggml, k_eval_token_floor);
        const double tokens = static_cast<double>((in.eval_files + 1) * in.eval_tokens_per_file);
        double seconds = tokens * per_token;
        std::string speed;
        if (in.eval_speed_reps > 0) {
            const int64_t tests = in.eval_files + (in.eval_reference_speed ? 1 : 0);
            const int64_t runs = tests * in.eval_speed_reps;
            const double file_bytes = 0.5 * (range.min_total + range.max_total);  // a file of the feasible sizes
            seconds += static_cast<double>(runs) *
                       (k_bench_run_seconds + 512 * per_token + 128 * file_bytes / k_eval_memory_bytes_per_s);
            speed = fmt::format(", then llama-bench's pp512 and tg128 of {} file{}, {} time{} each (--speed-reps {})",
                                tests, tests == 1 ? "" : "s", in.eval_speed_reps, in.eval_speed_reps == 1 ? "" : "s",
                                in.eval_speed_reps);
        }
        add("eval", fmt::format("{} file{} and the reference × {} tokens (libllama){}", in.eval_files,
                                in.eval_files == 1 ? "" : "s", in.eval_tokens_per_file,
                                speed),
            seconds);
        plan["rates"]["eval_seconds_per_token_at_least"] = k_eval_token_floor;
        plan["rates"]["eval_memory_bytes_per_s"] = k_eval_memory_bytes_per_s;
        plan["rates"]["bench_run_seconds"] = k_bench_run_seconds;
    }
    plan["stages"] = stages;

    if (gpu) {
        // What the GPU holds while training: the candidates (the fused path keeps their bytes), the teacher's
        // weights in bf16, and activations, ≈ 6 bytes × tokens of a micro-batch × Σ (inputs + outputs) of the gated
        // matmuls (fitted to the measured Qwen3-0.6B step, docs/BENCHMARKS.md), plus the loss's logits chunk.
        // The reference path holds every candidate dense in bf16 instead.
        const bool reference = in.train.mixture == "reference";
        double dense = 0;
        int64_t n_vocab = 0;
        for (const tensor_menu & m : menus) {
            dense += 2.0 * static_cast<double>(m.types.size()) * static_cast<double>(m.tensor->n_elements());
        }
        for (const gguf_tensor & t : src.tensors()) {
            if (t.name == "token_embd.weight") {
                n_vocab = t.ne[1];
            }
        }
        const double cand = reference ? dense : bytes;
        const double teacher = 2.0 * static_cast<double>(n_weights);
        // Logits, their gradient and the teacher's, f32, one loss chunk at a time (0: about 512 MB each).
        const double logits = 3.0 * (in.train.loss_chunk > 0 ? static_cast<double>(in.train.loss_chunk * n_vocab) * 4 : 512e6);
        const int64_t tokens = static_cast<int64_t>(in.train.batch) * seq;
        const int64_t act_layers = activation_bytes_estimate(tokens, io_per_token);
        double act = static_cast<double>(act_layers) + logits;
        plan["gpu_memory"] = {{"candidates_bytes", cand}, {"teacher_bytes", teacher}, {"activations_bytes_estimate", act},
                              {"total_bytes_estimate", cand + teacher + act}, {"mixture", reference ? "reference" : "fused"}};
        // Where the fused path would keep them: the trainer's rule (plan_residency) on this machine's GPU.
        const residency_plan rp = plan_residency(menus, in.train.candidates_on,
                                                 device_total_memory(parse_train_device(in.train.device)),
                                                 static_cast<int64_t>(teacher));
        // Activation checkpointing as the trainer decides it (resolve_recompute): the activations against what the GPU
        // has beside the teacher, the GPU-resident candidates and the logits; with it, each layer keeps its input only.
        int64_t n_embd = 0, n_layer = 0;
        for (const gguf_tensor & t : src.tensors()) {
            if (t.name == "token_embd.weight" || (n_embd == 0 && t.name == "output.weight")) {
                n_embd = t.ne[0];
            }
            int64_t il = -1;
            if (t.name.starts_with("blk.") &&
                std::from_chars(t.name.data() + 4, t.name.data() + t.name.size(), il).ec == std::errc()) {
                n_layer = std::max<int64_t>(n_layer, il + 1);
            }
        }
        const double on_gpu = cand - (reference ? 0.0 : static_cast<double>(rp.host_bytes));
        const int64_t free_bytes =
            rp.device_bytes > 0 ? std::max<int64_t>(1, rp.device_bytes - static_cast<int64_t>(teacher + on_gpu + logits)) : 0;
        const bool recompute = resolve_recompute(in.train.recompute, act_layers, free_bytes);
        if (recompute) {
            act = static_cast<double>(activation_bytes_recomputed(tokens, n_embd, n_layer, act_layers)) + logits;
        }
        plan["gpu_memory"]["recompute"] = recompute;
        plan["gpu_memory"]["recompute_option"] = in.train.recompute;
        plan["gpu_memory"]["activations_bytes_estimate"] = act;
        plan["gpu_memory"]["activations_all_layers_bytes_estimate"] = static_cast<double>(act_layers) + logits;
        plan["gpu_memory"]["total_bytes_estimate"] = cand + teacher + act;
        if (!reference && rp.device_bytes > 0) {
            const int64_t device_bytes = rp.device_bytes, host_bytes = rp.host_bytes;
            const int64_t host_tensors = std::count(rp.on_host.begin(), rp.on_host.end(), true);
            plan["gpu_memory"]["device_bytes"] = device_bytes;
            plan["gpu_memory"]["candidates_on"] = in.train.candidates_on;
            plan["gpu_memory"]["host_candidates_bytes"] = host_bytes;
            plan["gpu_memory"]["host_candidate_tensors"] = host_tensors;
            plan["gpu_memory"]["fits"] = rp.teacher_fits;
        }
    }
    if (in.ranks > 1) {
        // What each rank of the train stage holds (issue #17), by the trainer's rules: the teacher's tensors as a GPU
        // keeps them (matrices bf16, vectors f32) and the candidates. Layer sharding: each rank its layers' tensors
        // (and the embedding or the head) and their candidates, in every stage. Tensor parallelism: the whole teacher
        // (its probe and selection read whole tensors), its shards of the candidates on the device, the whole
        // candidates in host memory.
        const bool layers = in.train.parallel == "layers";
        const bool tied = src.find_tensor("output.weight") == nullptr;
        std::vector<std::pair<int64_t, int64_t>> ranges;
        if (layers) {
            try {
                ranges = dist::balance_layers_of(src, in.ranks);
            } catch (const error & e) {
                fail("--parallel layers over {} ranks (--gpus): {}; use fewer ranks, or --parallel tp", in.ranks, e.what());
            }
        }
        if (!layers) {  // what the trainer refuses before any work, refused here too, in its order: the model's split
                        // (heads, FFN width; set_tensor_parallel), then each menu's
            struct planned_ranks : tensor_parallel {  // a split only: no forward runs
                int n = 1;
                int rank() const override { return 0; }
                int size() const override { return n; }
                torch::Tensor copy_to(const torch::Tensor & x) const override { return x; }
                torch::Tensor reduce_from(const torch::Tensor & x) const override { return x; }
                torch::Tensor max_over(const torch::Tensor & x) const override { return x; }
            } planned;
            planned.n = in.ranks;
            build_model(src)->set_tensor_parallel(&planned);
            for (const tensor_menu & m : menus) {
                if (const std::string problem = dist::tp_split_problem(*m.tensor, m.types, in.ranks); !problem.empty()) {
                    fail("--parallel tp over {} ranks: {}", in.ranks, problem);
                }
            }
        }
        const int64_t n_layer = ranges.empty() ? 0 : ranges.back().second;
        const auto candidate_bytes_of = [](const tensor_menu & m) {
            int64_t n = 0;
            for (const ggml_type type : m.types) {
                n += static_cast<int64_t>(tensor_bytes(type, m.tensor->ne, m.tensor->name));
            }
            return n;
        };
        const int64_t device_bytes = gpu ? device_total_memory(parse_train_device(in.train.device)) : 0;
        nlohmann::json per_rank = nlohmann::json::array();
        for (int r = 0; r < in.ranks; ++r) {
            const auto uses = [&](const std::string & name) {
                return !layers || dist::layer_shard_uses(name, ranges[static_cast<size_t>(r)], n_layer, tied);
            };
            int64_t teacher = 0, host = 0;
            for (const gguf_tensor & t : src.tensors()) {
                teacher += uses(t.name) ? t.n_elements() * (t.n_dims >= 2 ? 2 : 4) : 0;
            }
            std::vector<tensor_menu> mine;
            for (const tensor_menu & m : menus) {
                if (uses(m.tensor->name)) {
                    mine.push_back(m);
                    host += candidate_bytes_of(m);
                }
            }
            // On the device: the whole candidates of its tensors for the probe (a tensor-parallel rank's shards
            // replace them for training).
            const residency_plan rp = plan_residency(mine, in.train.candidates_on, device_bytes, teacher);
            const int64_t training = layers ? rp.all_bytes : plan_residency(mine, "gpu", 0, 0, r, in.ranks).all_bytes;
            nlohmann::json e = {{"rank", r}, {"teacher_bytes", teacher}, {"candidates_device_bytes", rp.all_bytes},
                                {"candidates_device_bytes_training", training}, {"candidates_host_bytes", host}};
            if (layers) {
                e["layers"] = {ranges[static_cast<size_t>(r)].first, ranges[static_cast<size_t>(r)].second};
            }
            if (device_bytes > 0) {
                e["device_bytes"] = device_bytes;
                e["fits"] = rp.teacher_fits;
            }
            per_rank.push_back(e);
        }
        plan["ranks"] = {{"parallel", in.train.parallel}, {"per_rank", per_rank}};
    }
    return plan;
}

std::string dry_run_to_text(const nlohmann::json & p) {
    std::string s = fmt::format("dry run of {} ({} weights) on {}: nothing is made\n", p["model"]["path"].get<std::string>(),
                                p["model"]["weights"].get<int64_t>(), p["device"].get<std::string>());
    s += "menus:\n";
    for (const auto & m : p["menus"]) {
        std::string types;
        for (const auto & t : m["types"]) {
            types += types.empty() ? "" : ",";
            types += t.get<std::string>();
        }
        s += fmt::format("  {:<28} ×{:<4} {}\n", m["tensors"].get<std::string>(), m["n"].get<int>(), types);
    }
    const auto & c = p["candidates"];
    s += fmt::format("candidates: {} ({}); to build: {} ({} in the cache {}, each entry with its 8-byte checksum); already there: {} ({})\n",
                     c["count"].get<int64_t>(), dry_bytes_text(c["bytes"].get<double>()), c["to_build"].get<int64_t>(),
                     dry_bytes_text(c["to_build_bytes"].get<double>()), c["cache_dir"].get<std::string>(),
                     c["in_cache"].get<int64_t>(), dry_bytes_text(c["in_cache_bytes"].get<double>()));
    if (c.value("pruned_for_targets", false)) {
        s += fmt::format("  (at most: with --candidates targets, the default, a few types per tensor are built and probed "
                         "first, then only those some recipe under the targets could use. The bytes{} below count every "
                         "candidate; the candidates' stage and the total also give the range that pruning built on the "
                         "models we measured (docs/BENCHMARKS.md): which candidates a model keeps is known only after its "
                         "probe)\n", p.contains("gpu_memory") ? " and GPU memory" : "");
    }
    if (!c["cache_known"].get<bool>()) {
        s += "  (no imatrix yet: a candidate's cache key holds its importance, so none can be counted as built)\n";
    }
    const auto & z = p["sizes"];
    // --target-bpw counts the tensor data (as the eval table's BPW); --target-size, --ratio and --like the whole file.
    const bool tensor_data = z["of"].get<std::string>() == "tensor data";
    s += fmt::format("feasible sizes: {:.0f} to {:.0f} bytes of {} ({} to {}; {:.3f} to {:.3f} bits per weight of {}){}\n",
                     z["min_bytes"].get<double>(),
                     z["max_bytes"].get<double>(), z["of"].get<std::string>(), dry_bytes_text(z["min_bytes"].get<double>()), dry_bytes_text(z["max_bytes"].get<double>()),
                     z["min_bpw"].get<double>(), z["max_bpw"].get<double>(),
                     tensor_data ? "the tensor data, as --target-bpw and the eval table's BPW count them"
                                 : "the whole file, metadata included: the eval table's BPW counts tensor data only",
                     z["exact"].get<bool>() ? "" : " (without the imatrix's header keys: a few hundred bytes off)");
    for (const auto & t : z["targets"]) {
        if (t["bytes"].is_null()) {
            s += fmt::format("  {}: the stock file's size, known once the imatrix is made (llama.cpp's dry run sizes it with the imatrix){}\n",
                             t["target"].get<std::string>(),
                             t.value("likely_outside", false)
                                 ? fmt::format("; estimated ≈ {:.0f} bytes, likely OUTSIDE the range: the run would refuse it "
                                               "once its imatrix is made (a menu with types that reach it, or another target)",
                                               t["estimated_bytes"].get<double>())
                                 : std::string());
        } else {
            s += fmt::format("  {}: {:.0f} bytes, {}\n", t["target"].get<std::string>(), t["bytes"].get<double>(),
                             t["feasible"].get<bool>() ? "feasible" : "OUTSIDE the range");
        }
    }
    if (p.contains("disk")) {
        const auto & d = p["disk"];
        const double free = d["free_bytes"].get<double>();
        const double cand = d["candidates_to_build_bytes"].get<double>(), files = d["exported_files_bytes"].get<double>();
        const double reserve = d["reserve_bytes"].get<double>();
        const bool exact = d["candidates_exact"].get<bool>();
        const int64_t n_files = d["exported_files"].get<int64_t>(), unknown = d["exported_files_unknown"].get<int64_t>();
        const int64_t n_stock = d["stock_files_to_make"].get<int64_t>();
        std::string writes = fmt::format("{}{} of candidates", exact ? "" : "at most ", dry_bytes_text(cand));
        if (n_files > 0) {
            writes += fmt::format(", {} exported file{} ({}{})", n_files, n_files == 1 ? "" : "s", unknown > 0 ? "≈ " : "",
                                  dry_bytes_text(files));
        }
        if (n_stock > 0) {
            writes += fmt::format(", {} stock file{} (≈ {})", n_stock, n_stock == 1 ? "" : "s",
                                  dry_bytes_text(d["stock_files_bytes_estimate"].get<double>()));
        }
        std::string verdict;
        if (free < 0) {
            verdict = "its free space cannot be read";
        } else if (free <= reserve) {
            verdict = fmt::format("DOES NOT FIT: less than the {} kept free; give a --work folder on a disk with more room",
                                  dry_bytes_text(reserve));
        } else if (d["fits_every_candidate"].get<bool>()) {
            verdict = exact ? "fits" : "fits even if every candidate is built";
        } else {
            verdict = exact ? "the candidates do not all fit: those beyond the disk would be built in memory only (a later "
                              "run builds them again; with several --gpus the run stops instead); a --work folder on a "
                              "larger disk or a smaller menu (--menu) keeps them all"
                            : "may not fit if most candidates are kept: those the disk cannot hold are then built in memory "
                              "only (a later run builds them again; with several --gpus the run stops instead); a --work "
                              "folder on a larger disk keeps them all";
        }
        s += fmt::format("disk: {} free in {}; the run writes {}, and keeps {} free: {}\n",
                         free < 0 ? std::string("unknown") : dry_bytes_text(free), d["folder"].get<std::string>(), writes,
                         dry_bytes_text(reserve), verdict);
    }
    if (p.contains("gpu_memory")) {
        const auto & g = p["gpu_memory"];
        s += fmt::format("GPU memory: candidates {} + teacher {} + activations ≈ {} = ≈ {}\n",
                         dry_bytes_text(g["candidates_bytes"].get<double>()), dry_bytes_text(g["teacher_bytes"].get<double>()),
                         dry_bytes_text(g["activations_bytes_estimate"].get<double>()), dry_bytes_text(g["total_bytes_estimate"].get<double>()));
        if (g.value("recompute", false)) {
            s += fmt::format("  activation checkpointing on (--recompute {}): each layer keeps its input and runs again in the "
                             "backward; every layer's activations would take ≈ {}\n",
                             g["recompute_option"].get<std::string>(),
                             dry_bytes_text(g["activations_all_layers_bytes_estimate"].get<double>()));
        }
    }
    if (p.contains("experts")) {
        const auto & e = p["experts"];
        s += fmt::format("experts: {} expert tensors of {} experts ({} used per token) hold {:.1f}% of the weights; each takes "
                         "one type for all its experts, each expert quantized with its own imatrix rows (experts.json "
                         "will say how many the calibration text reached)\n",
                         e["tensors"].get<int64_t>(), e["experts_per_tensor"].get<int64_t>(), e["used_per_token"].get<int64_t>(),
                         100.0 * e["share_of_weights"].get<double>());
    }
    if (p.contains("gpu_memory") && p["gpu_memory"].contains("device_bytes")) {
        const auto & g = p["gpu_memory"];
        s += fmt::format("  on this {} GPU (--candidates-on {}): {}{}\n", dry_bytes_text(g["device_bytes"].get<double>()),
                         g["candidates_on"].get<std::string>(),
                         g["host_candidate_tensors"].get<int64_t>() > 0
                             ? fmt::format("{} tensors' candidates ({}) in pinned host memory, streamed to the GPU ahead of use",
                                           g["host_candidate_tensors"].get<int64_t>(), dry_bytes_text(g["host_candidates_bytes"].get<double>()))
                             : std::string("every candidate on the GPU"),
                         g["fits"].get<bool>() ? "" : "; the teacher does not fit beside the activations' reserve: the run will refuse");
    }
    if (p.contains("ranks")) {
        const auto & rk = p["ranks"];
        s += fmt::format("ranks of the train stage (--gpus {} --parallel {}), each holding:\n", rk["per_rank"].size(),
                         rk["parallel"].get<std::string>());
        for (const auto & e : rk["per_rank"]) {
            const double dev = e["candidates_device_bytes"].get<double>(), train = e["candidates_device_bytes_training"].get<double>();
            s += fmt::format("  rank {}{}: teacher {}, candidates {} on its device{} and {} in host memory{}\n",
                             e["rank"].get<int>(),
                             e.contains("layers") ? fmt::format(" (layers [{}, {}))", e["layers"][0].get<int64_t>(),
                                                                e["layers"][1].get<int64_t>())
                                                  : std::string(),
                             dry_bytes_text(e["teacher_bytes"].get<double>()), dry_bytes_text(dev),
                             train != dev ? fmt::format(" (the probe's; its shards for training: {})", dry_bytes_text(train))
                                          : std::string(),
                             dry_bytes_text(e["candidates_host_bytes"].get<double>()),
                             !e.contains("fits") ? std::string()
                             : e["fits"].get<bool>()
                                 ? fmt::format(" (fits its {} GPU)", dry_bytes_text(e["device_bytes"].get<double>()))
                                 : fmt::format("; the teacher does NOT fit its {} GPU beside the activations' reserve: the "
                                               "run will refuse", dry_bytes_text(e["device_bytes"].get<double>())));
        }
    }
    if (p.contains("finished_runs")) {
        const size_t n = p["finished_runs"].size();
        s += fmt::format("note: the work folder has trained {} of these targets already ({}{}): a run whose inputs are "
                         "unchanged reuses {} and every stage before (their lines say \"(done)\"; the eval too when its record "
                         "eval.stage.json matches its files and options), "
                         "so the times below, for a run from the start, are an upper bound\n",
                         n, p["finished_runs"][0].get<std::string>(), n > 1 ? ", …" : "", n > 1 ? "them" : "it");
    }
    s += "stages (estimated here; rates and method in --json):\n";
    double total = 0, likely_low = 0, likely_high = 0;
    bool likely = false;
    // The time before the work, whose text can be long (the probe's: a new user's trial read its time run into it).
    for (const auto & st : p["stages"]) {
        const double sec = st["seconds"].get<double>();
        total += sec;
        std::string work = st["work"].get<std::string>();
        // The candidates with --candidates targets: every one's time (at most) and the range pruning is likely to build,
        // where it reads as a range at the printed precision.
        double low = sec, high = sec;
        if (st.contains("likely_seconds")) {
            low = st["likely_seconds"][0].get<double>();
            high = st["likely_seconds"][1].get<double>();
        }
        if (const std::string lo = dry_seconds_text(low), hi = dry_seconds_text(high); lo != hi) {
            likely = true;
            work += fmt::format("; every candidate: pruning built {:.0f}-{:.0f}% of this work on the models we "
                                "measured, ≈ {} to {}", 100 * k_pruned_work_share_low, 100 * k_pruned_work_share_high, lo, hi);
        } else {
            low = high = sec;
        }
        likely_low += low;
        likely_high += high;
        s += fmt::format("  {:<11} {:>8}  {}\n", st["stage"].get<std::string>(), dry_seconds_text(sec), work);
    }
    s += fmt::format("  {:<11} {:>8}{}\n", "total", dry_seconds_text(total),
                     likely ? fmt::format("  at most; ≈ {} to {} with what pruning is likely to build",
                                          dry_seconds_text(likely_low), dry_seconds_text(likely_high))
                            : std::string());
    return s;
}

void fail_if_outside_the_range(const nlohmann::json & plan, const std::string & model) {
    std::vector<std::string> outside;
    const nlohmann::json & sizes = plan.at("sizes");
    for (const auto & t : sizes.at("targets")) {
        if (t["feasible"].is_boolean() && !t["feasible"].get<bool>()) {
            outside.push_back(t["target"].get<std::string>());
        }
    }
    if (!outside.empty()) {
        fail("--dry-run: {} outside the feasible sizes of '{}' ({:.0f} to {:.0f} bytes of {}): the run would refuse {}; "
             "give a target in that range", fmt::join(outside, ", "), model, sizes["min_bytes"].get<double>(),
             sizes["max_bytes"].get<double>(), sizes["of"].get<std::string>(), outside.size() == 1 ? "it" : "them");
    }
}

}  // namespace voodoo
