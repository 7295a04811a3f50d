#include "cli/commands.h"
#include "common/error.h"
#include "common/file.h"
#include "eval/baseline.h"
#include "ggml/gguf.h"
#include "ggml/types.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <memory>

namespace voodoo::cli {

namespace {

/// recipe_by_name, its error naming `flag` and what else it takes.
const stock_recipe & checked_recipe(const std::string & flag, const std::string & name) {
    try {
        return recipe_by_name(name);
    } catch (const error & e) {
        fail("{}: {}{}", flag, e.what(),
             flag == "--recipes" ? "; or --recipes all-that-fit"
             : name.find(',') != std::string::npos ? "; several recipes: --recipes A,B with --out-dir DIR"
                                                    : "");
    }
}

/// --recipes: "all-that-fit" (those that fit with or without an imatrix; without one, the recipes that need it are
/// left out and stderr says which) or a comma list (a recipe named twice, in any spelling or alias recipe_by_name
/// accepts — one llama_ftype —, is made once, and stderr says so; spaces around a name are dropped). An unknown name
/// is refused here, naming --recipes (checked_recipe).
std::vector<std::string> recipe_names(const std::string & recipes, bool has_imatrix) {
    if (recipes == "all-that-fit") {
        std::vector<std::string> names = recipes_all_that_fit(has_imatrix);
        if (!has_imatrix) {
            std::string left;
            for (const std::string & name : recipes_all_that_fit(true)) {
                if (std::find(names.begin(), names.end(), name) == names.end()) {
                    left += (left.empty() ? "" : ", ") + name;
                }
            }
            if (!left.empty()) {
                fmt::print(stderr, "--recipes all-that-fit without --imatrix leaves out the recipes that need one ({}); "
                                   "give --imatrix imatrix.gguf to make them too\n", left);
            }
        }
        return names;
    }
    std::vector<std::string> names;
    std::vector<llama_ftype> ftypes;  // names[i]'s: one llama_ftype is one recipe, whatever it is called (Q4_K is Q4_K_M)
    for (size_t start = 0; start <= recipes.size();) {
        const size_t comma = std::min(recipes.find(',', start), recipes.size());
        std::string name = recipes.substr(start, comma - start);
        name.erase(0, name.find_first_not_of(" \t"));  // "Q4_0, Q8_0"
        name.erase(name.find_last_not_of(" \t") + 1);
        if (!name.empty()) {
            const llama_ftype ftype = checked_recipe("--recipes", name).ftype;
            const auto seen = std::find(ftypes.begin(), ftypes.end(), ftype);
            if (seen != ftypes.end()) {
                const std::string & first = names[static_cast<size_t>(seen - ftypes.begin())];
                fmt::print(stderr, "--recipes names {} twice{}: made once\n", first, name == first ? "" : " (as " + name + ")");
            } else {
                ftypes.push_back(ftype);
                names.push_back(name);
            }
        }
        start = comma + 1;
    }
    return names;
}

nlohmann::json result_json(const baseline_result & r) {
    return {{"recipe", r.recipe},         {"path", r.path},           {"ok", r.ok},
            {"error", r.error},           {"file_bytes", r.file_bytes}, {"tensor_bytes", r.tensor_bytes},
            {"n_weights", r.n_weights},   {"bpw", r.bpw},             {"type_counts", r.type_counts},
            {"same_types_as", r.same_types_as}};
}

command add_baseline(CLI::App & app) {
    auto * sub = app.add_subcommand("baseline", "Make stock llama.cpp recipes (Q4_K_M, IQ2_M, …) with llama_model_quantize");
    sub->footer("examples:\n"
                "  voodoo baseline model-f16.gguf --recipe Q4_K_M --out model-Q4_K_M.gguf\n"
                "  voodoo baseline model-f16.gguf --recipe IQ2_M --imatrix imatrix.gguf --out model-IQ2_M.gguf\n"
                "  voodoo baseline model-f16.gguf --recipes all-that-fit --out-dir baselines\n"
                "  voodoo baseline model-f16.gguf --recipes Q4_0,Q8_0 --out-dir baselines\n"
                "  voodoo baseline model-f16.gguf --recipes Q4_K_M,Q5_K_M --imatrix imatrix.gguf --dry-run");
    struct options {
        baseline_options base;
        std::string recipe;
        std::string recipes;
        std::string out;
        std::string out_dir;
        std::string json;
        bool dry_run = false;
    };
    auto o = std::make_shared<options>();
    sub->add_option("source", o->base.source, "Full-precision GGUF (F32/F16/BF16)")->required()->check(CLI::ExistingFile);
    auto * one = sub->add_option("--recipe", o->recipe, "One llama-quantize recipe: Q4_K_M, Q8_0, IQ2_M, …");
    auto * many = sub->add_option("--recipes", o->recipes, "'all-that-fit' or a comma-separated list (with --out-dir, or --dry-run)");
    one->excludes(many);
    sub->add_option("--imatrix", o->base.imatrix, "llama.cpp GGUF imatrix (needed by IQ1/IQ2/IQ3_XXS and Q2_K_S)")->check(CLI::ExistingFile);
    sub->add_option("--out", o->out, "Output GGUF (with --recipe)");
    sub->add_option("--out-dir", o->out_dir, "Output folder (with --recipes): SOURCE_STEM-RECIPE.gguf, baselines.json")->check(folder_to_write());
    sub->add_option("-t,--threads", o->base.n_threads, "Quantization threads (default: VOODOO_THREADS if set, else every core)")->check(non_negative());
    add_json_option(sub, o->json, "Each file made (recipe, path, bytes, BPW, tensor types)");
    sub->add_flag("--allow-requantize", o->base.allow_requantize, "Accept an already quantized source (llama-quantize's flag)");
    sub->add_flag("--dry-run", o->dry_run,
                  "Make nothing: each recipe's file size to the byte and its tensor types, from llama.cpp's own dry run "
                  "(as voodoo quantize --like sizes its target; give the --imatrix the file would be made with)");
    return {sub, [o] {
        if (o->dry_run) {
            if (o->recipe.empty() && o->recipes.empty()) {
                fail("--dry-run needs --recipe NAME or --recipes LIST");
            }
            if (!o->out.empty() || !o->out_dir.empty()) {
                fail("--dry-run makes no file: drop --out/--out-dir, or drop --dry-run to make the files");
            }
            if (!o->recipe.empty()) {
                checked_recipe("--recipe", o->recipe);
            }
            const std::vector<std::string> names = !o->recipe.empty() ? std::vector<std::string>{o->recipe}
                                                                        : recipe_names(o->recipes, !o->base.imatrix.empty());
            const gguf_file src(o->base.source);
            std::vector<baseline_result> results;
            nlohmann::json j = nlohmann::json::array();
            for (const std::string & name : names) {
                const stock_plan plan = plan_stock_file(o->base, name);
                baseline_result r;
                r.recipe = recipe_by_name(name).name;
                r.path = "(not made: --dry-run)";
                r.ok = true;
                r.file_bytes = plan.file_bytes;
                r.tensor_bytes = plan.tensor_bytes;
                for (const gguf_tensor & t : src.tensors()) {
                    r.n_weights += t.n_elements();
                    r.type_counts[type_name(plan.types.at(t.name))] += 1;
                    r.tensor_types.push_back(plan.types.at(t.name));
                }
                for (const baseline_result & earlier : results) {  // as make_baselines marks them
                    if (earlier.tensor_types == r.tensor_types) {
                        r.same_types_as = earlier.recipe;
                        break;
                    }
                }
                r.bpw = 8.0 * static_cast<double>(r.tensor_bytes) / static_cast<double>(std::max<int64_t>(1, r.n_weights));
                j.push_back(result_json(r));
                results.push_back(std::move(r));
            }
            if (o->json != "-") {
                fmt::print("{}", baselines_to_markdown(results));
            }
            write_json_to(o->json, o->recipe.empty() ? j : j.front());
            return 0;
        }
        if (!o->recipe.empty()) {
            checked_recipe("--recipe", o->recipe);
            if (o->out.empty()) {
                fail("--recipe {} needs --out F.gguf", o->recipe);
            }
            if (!o->out_dir.empty()) {
                fail("--out-dir goes with --recipes (several files); --recipe {} writes the one file --out names", o->recipe);
            }
            if (std::filesystem::is_directory(o->out)) {
                fail("--out '{}' is a folder: give the file's path (--out {}/NAME.gguf), or --recipes {} --out-dir {}",
                     o->out, o->out, o->recipe, o->out);
            }
            const baseline_result r = make_baseline(o->base, o->recipe, o->out);
            if (o->json != "-") {
                fmt::print("{}", baselines_to_markdown({r}));
            }
            write_json_to(o->json, result_json(r));
            return r.ok ? 0 : 1;
        }
        if (o->recipes.empty()) {
            fail("give --recipe NAME --out F.gguf, or --recipes all-that-fit --out-dir DIR");
        }
        if (o->out_dir.empty()) {
            fail("--recipes needs --out-dir DIR");
        }
        if (!o->out.empty()) {
            fail("--out goes with --recipe (one file); --recipes writes its files into --out-dir {}", o->out_dir);
        }
        const std::vector<baseline_result> results =
            make_baselines(o->base, recipe_names(o->recipes, !o->base.imatrix.empty()), o->out_dir);
        if (o->json != "-") {
            fmt::print("{}", baselines_to_markdown(results));
        }
        nlohmann::json j = nlohmann::json::array();
        for (const baseline_result & r : results) {
            j.push_back(result_json(r));
        }
        const std::string json_path = (std::filesystem::path(o->out_dir) / "baselines.json").string();
        write_file_atomic(json_path, j.dump(2) + "\n");
        if (o->json != "-") {
            fmt::print("json: {}\n", json_path);
        }
        write_json_to(o->json, j);
        const bool all_ok = std::all_of(results.begin(), results.end(), [](const auto & r) { return r.ok; });
        return all_ok ? 0 : 1;
    }};
}

}  // namespace

VOODOO_COMMAND(baseline, add_baseline);

}  // namespace voodoo::cli
