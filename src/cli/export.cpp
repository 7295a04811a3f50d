#include "cli/commands.h"
#include "common/error.h"
#include "export/export.h"
#include "imatrix/imatrix.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <memory>

namespace voodoo::cli {

namespace {

command add_export(CLI::App & app) {
    auto * sub = app.add_subcommand("export", "Write a recipe as a GGUF that stock llama.cpp runs");
    sub->footer("examples:\n"
                "  voodoo export --model model.gguf --recipe run/recipe.json --out model.Voodoo45.gguf\n"
                "  voodoo export --model model.gguf --recipe run/recipe.json --out out/   # names it <model>.Voodoo<NN>.gguf");
    struct options {
        std::string model, recipe, out, cache, imatrix, json;
        int threads = 0;
    };
    auto o = std::make_shared<options>();
    sub->add_option("--model", o->model, "Source GGUF (the one the recipe was made for)")->required();
    sub->add_option("--recipe", o->recipe, "recipe.json from `voodoo train`")->required();
    sub->add_option("--out", o->out, "Output GGUF, or a folder (an existing one, or any path ending in /)")->required();
    sub->add_option("--cache", o->cache, "Candidate cache folder to take bytes from (optional)");
    sub->add_option("--imatrix", o->imatrix, "Importance matrix (default: the one the recipe was trained with)")->check(CLI::ExistingFile);
    sub->add_option("-t,--threads", o->threads, "Threads (0 = VOODOO_THREADS if set, else every core)")->capture_default_str()->check(non_negative());
    add_json_option(sub, o->json, "What was written (path, bytes on disk, tensor bytes, BPW)");
    return {sub, [o] {
        const gguf_file src(o->model);
        const recipe r = recipe_load(o->recipe);
        const std::string imatrix_path = o->imatrix.empty() ? r.imatrix : o->imatrix;
        importance_map importance;
        export_options opts;
        if (!imatrix_path.empty()) {
            opts = imatrix_export_options(imatrix_path, r.imatrix.empty() ? imatrix_path : r.imatrix, src, importance);
        }
        opts.n_threads = o->threads;
        std::unique_ptr<candidate_cache> cache;
        if (!o->cache.empty()) {
            cache = std::make_unique<candidate_cache>(o->cache);
            opts.cache = cache.get();
        }
        opts.target = r.target;
        std::string out = o->out;
        if (out.ends_with('/')) {
            std::filesystem::create_directories(out);  // a folder by its trailing slash: made, as --out-dir folders are
        }
        if (std::filesystem::is_directory(out)) {
            const double ratio = static_cast<double>(planned_file_bytes(src, r, opts)) /
                                 static_cast<double>(q8_0_file_bytes(src, opts));
            out = default_output_path(out, src, ratio);
        }
        const export_result res = export_gguf(src, r, out, opts);
        if (o->json != "-") {
            fmt::print("wrote {}\n  {} bytes on disk, {} tensor bytes, {:.4f} BPW, {:.1f}% of the Q8_0 size\n", res.path,
                       res.file_bytes, res.tensor_bytes, res.bpw, 100.0 * res.q8_0_ratio);
        }
        write_json_to(o->json, {{"path", res.path}, {"file_bytes", res.file_bytes}, {"tensor_bytes", res.tensor_bytes},
                                {"bpw", res.bpw}, {"q8_0_ratio", res.q8_0_ratio}, {"recipe", o->recipe},
                                {"model", o->model}, {"imatrix", imatrix_path}});
        return 0;
    }};
}

}  // namespace

VOODOO_COMMAND(export, add_export);

}  // namespace voodoo::cli
