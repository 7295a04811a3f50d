#include "cli/commands.h"
#include "pipeline/hf_source.h"
#include "ggml/inspect.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <memory>

namespace voodoo::cli {

namespace {

command add_inspect(CLI::App & app) {
    auto * sub = app.add_subcommand("inspect", "Show a GGUF's tensors, types, sizes, BPW and each tensor's menu");
    sub->footer("examples:\n  voodoo inspect model.gguf\n  voodoo inspect model.gguf --metadata\n"
                "  voodoo inspect model.gguf --json model.json");
    struct options {
        std::string path;
        std::string work;
        std::string json;
        bool metadata = false;
        bool imatrix = false;
    };
    auto o = std::make_shared<options>();
    sub->add_option("file", o->path, "GGUF file, or a Hugging Face model folder (converted once into --work)")->required();
    sub->add_option("--work", o->work, "Where a Hugging Face folder's GGUF is kept (default: <name>.voodoo, as quantize's)");
    add_json_option(sub, o->json, "The report");
    sub->add_flag("--metadata", o->metadata, "Also list every metadata key and value");
    sub->add_flag("--with-imatrix", o->imatrix, "Show menus as they are with an imatrix (adds the IQ1/IQ2/IQ3_XXS types)");
    return {sub, [o] {
        const gguf_file file(gguf_of_source(o->path, o->work.empty() ? default_work_folder(o->path) : o->work));
        const inspect_report report = inspect_gguf(file, o->imatrix);
        if (!o->json.empty()) {
            nlohmann::json j = inspect_to_json(report);
            if (o->metadata) {
                nlohmann::json kv = nlohmann::json::object();
                for (int64_t i = 0; i < file.n_kv(); ++i) {
                    kv[gguf_get_key(file.ctx(), i)] = file.kv_json(i, 64);
                }
                j["metadata"] = kv;
            }
            write_json_to(o->json, j);
            if (o->json == "-") {
                return 0;
            }
        }
        if (o->metadata) {
            fmt::print("metadata of {}:\n{}\n", file.path(), metadata_to_text(file));
        }
        fmt::print("{}", inspect_to_text(report));
        return 0;
    }};
}

}  // namespace

VOODOO_COMMAND(inspect, add_inspect);

}  // namespace voodoo::cli
