#include "cli/commands.h"
#include "pipeline/hf_source.h"
#include "model/parity.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <memory>

namespace voodoo::cli {

namespace {

command add_check_parity(CLI::App & app) {
    auto * sub = app.add_subcommand(
        "check-parity", "Run a GGUF through Voodoo's LibTorch forward and through libllama; compare the logits");
    sub->footer("Exit 0 when max|Δlogit| / max|logit| is within the bound for the file's weight types, 3 when it is not (1 on an error).\n"
                "examples:\n  voodoo check-parity model.gguf\n"
                "  voodoo check-parity model.gguf --text ../shared/data/text/tinystories/tinystories_val.txt --tokens 256\n"
                "  voodoo check-parity model.gguf --json -");
    struct options {
        std::string path;
        std::string work;
        parity_options parity;
        std::string json;
    };
    auto o = std::make_shared<options>();
    sub->add_option("file", o->path, "GGUF file, or a Hugging Face model folder (converted once into --work)")->required();
    sub->add_option("--work", o->work, "Where a Hugging Face folder's GGUF is kept (default: <name>.voodoo, as quantize's)");
    sub->add_option("--text", o->parity.text_path, "Tokenize this text file (default: fixed pseudo-random token ids)")
        ->check(CLI::ExistingFile);
    sub->add_option("--tokens", o->parity.n_tokens, "Positions to compare")->capture_default_str();
    sub->add_option("-t,--threads", o->parity.n_threads, "Threads for both runtimes (0 = VOODOO_THREADS if set, else every core)")->capture_default_str()->check(non_negative());
    add_json_option(sub, o->json, "The report");
    return {sub, [o] {
        const std::string gguf = gguf_of_source(o->path, o->work.empty() ? default_work_folder(o->path) : o->work);
        const parity_report report = check_parity(gguf, o->parity);
        write_json_to(o->json, parity_to_json(report));
        if (o->json != "-") {
            fmt::print("{}", parity_to_text(report));
        }
        return report.within ? 0 : 3;
    }};
}

}  // namespace

VOODOO_COMMAND(check_parity, add_check_parity);

}  // namespace voodoo::cli
