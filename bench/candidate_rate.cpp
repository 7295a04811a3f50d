// Voodoo's candidates against llama-quantize's own time for the same work (issue #16: "measure their rate, weights ×
// types per second per core, against llama-quantize's own time for the same types").
//
// For each stock recipe named, llama_model_quantize (the function llama-quantize calls; eval/baseline.h) makes the
// file from the source with the imatrix; then build_candidates (trainer.h) quantizes every tensor Voodoo gates to the
// type that file gave it, with the same imatrix, on the same threads, into an empty candidate cache. Both are
// llama.cpp's quantizers (ggml_quantize_chunk) on the same weights and types: the difference is the pipeline around
// them (reading BF16, threads, writing). Both write their bytes to disk (the stock file; the cache, fsynced).
//
//   candidate_rate MODEL.gguf --imatrix IM.gguf --recipes Q4_K_S,IQ4_XS,IQ2_XXS [--threads N] [--out R.json]
//
// Prints one row per recipe and writes the rows as JSON: weights quantized, seconds, M weights per second per core.
#include "common/error.h"
#include "common/file.h"
#include "eval/baseline.h"
#include "ggml/gguf.h"
#include "ggml/types.h"
#include "imatrix/imatrix.h"
#include "train/budget.h"
#include "train/candidates.h"
#include "train/trainer.h"

#include <CLI/CLI.hpp>
#include <ggml.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <filesystem>
#include <map>
#include <thread>

using namespace voodoo;
namespace fs = std::filesystem;

int main(int argc, char ** argv) {
    std::string model_path, imatrix_path, recipes = "Q4_K_S,IQ4_XS,IQ2_XXS", out_path, scratch;
    int threads = 0;
    CLI::App app{"Voodoo's candidates against llama_model_quantize on the same tensors and types"};
    app.add_option("model", model_path, "Source GGUF (BF16/F16/F32)")->required()->check(CLI::ExistingFile);
    app.add_option("--imatrix", imatrix_path, "llama.cpp imatrix of the model")->required()->check(CLI::ExistingFile);
    app.add_option("--recipes", recipes, "Stock recipes, comma-separated")->capture_default_str();
    app.add_option("--threads", threads, "Threads for both (0 = every core)")->capture_default_str();
    app.add_option("--scratch", scratch, "Folder for the stock files and caches (default: beside --out, else /tmp)");
    app.add_option("--out", out_path, "JSON report");
    CLI11_PARSE(app, argc, argv);
    try {
        const int n = threads > 0 ? threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
        const fs::path dir = scratch.empty() ? fs::temp_directory_path() / fmt::format("candidate-rate-{}", getpid()) : fs::path(scratch);
        fs::create_directories(dir);
        const gguf_file src(model_path);
        const importance_map importance = imatrix_importance(read_imatrix(imatrix_path));
        menu_options mo;
        mo.has_imatrix = true;
        mo.importance = &importance;
        const std::vector<tensor_menu> menus = build_menus(src, mo);
        // The lattice quantizers' grids are built once per process (≈ 17 s on the 2-core machine): before any timing,
        // so that neither side pays them.
        for (ggml_type t : {GGML_TYPE_IQ1_S, GGML_TYPE_IQ1_M, GGML_TYPE_IQ2_XXS, GGML_TYPE_IQ2_XS, GGML_TYPE_IQ2_S,
                            GGML_TYPE_IQ3_XXS, GGML_TYPE_IQ3_S}) {
            ggml_quantize_init(t);
        }
        nlohmann::json rows = nlohmann::json::array();
        fmt::print("{} on {} threads ({} tensors gated)\n", model_path, n, menus.size());
        fmt::print("| recipe | weights quantized by llama-quantize | s | M w/s/core | by Voodoo | s | M w/s/core | Voodoo/llama |\n");
        fmt::print("|---|---:|---:|---:|---:|---:|---:|---:|\n");
        for (size_t a = 0; a <= recipes.size();) {
            const size_t e = std::min(recipes.find(',', a), recipes.size());
            const std::string name = recipes.substr(a, e - a);
            a = e + 1;
            if (name.empty()) {
                continue;
            }
            baseline_options bo;
            bo.source = model_path;
            bo.imatrix = imatrix_path;
            bo.n_threads = n;
            const std::string stock_path = (dir / fmt::format("stock-{}.gguf", name)).string();
            const auto t0 = std::chrono::steady_clock::now();
            const baseline_result stock = make_baseline(bo, name, stock_path);
            const double llama_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            // The type llama-quantize gave each tensor, for the tensors it quantized.
            const gguf_file made(stock_path);
            std::map<std::string, ggml_type> given;
            int64_t llama_weights = 0;
            for (const gguf_tensor & t : made.tensors()) {
                given[t.name] = t.type;
                llama_weights += type_info_of(t.type).is_quantized ? t.n_elements() : 0;
            }
            std::vector<tensor_menu> same;
            int64_t voodoo_weights = 0;
            for (const tensor_menu & m : menus) {
                const auto it = given.find(m.tensor->name);
                if (it == given.end() || it->second == m.tensor->type || !type_info_of(it->second).is_quantized) {
                    continue;
                }
                tensor_menu one = m;
                one.types = {it->second};
                same.push_back(one);
                voodoo_weights += m.tensor->n_elements();
            }
            const std::string cache_dir = (dir / fmt::format("cache-{}", name)).string();
            remove_tree(cache_dir);
            const candidate_cache cache(cache_dir);
            const auto t1 = std::chrono::steady_clock::now();
            const std::vector<gated_tensor> built = build_candidates(src, same, &importance, cache, n);
            const double voodoo_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
            const double lr = static_cast<double>(llama_weights) / llama_s / n / 1e6;
            const double vr = static_cast<double>(voodoo_weights) / voodoo_s / n / 1e6;
            fmt::print("| {} | {} | {:.1f} | {:.2f} | {} | {:.1f} | {:.2f} | {:.2f} |\n", name, llama_weights, llama_s, lr,
                       voodoo_weights, voodoo_s, vr, vr / lr);
            rows.push_back({{"recipe", name}, {"threads", n}, {"llama_weights", llama_weights}, {"llama_seconds", llama_s},
                            {"llama_mw_per_s_per_core", lr}, {"voodoo_weights", voodoo_weights},
                            {"voodoo_seconds", voodoo_s}, {"voodoo_mw_per_s_per_core", vr}, {"voodoo_over_llama", vr / lr},
                            {"types", stock.type_counts}});
            remove_tree(cache_dir);
            fs::remove(stock_path);
        }
        if (!out_path.empty()) {
            write_file_atomic(out_path, nlohmann::json{{"model", model_path}, {"rows", rows}}.dump(2) + "\n");
        }
        if (scratch.empty()) {
            remove_tree(dir.string());
        }
    } catch (const std::exception & e) {
        fmt::print(stderr, "candidate_rate: {}\n", e.what());
        return 1;
    }
    return 0;
}
