#include "cli/commands.h"
#include "data/dataset.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <memory>

namespace voodoo::cli {

namespace {

command add_data(CLI::App & app) {
    auto * sub = app.add_subcommand("data", "Tokenize calibration text with a model's vocabulary into train/val chunks");
    sub->footer("examples:\n"
                "  voodoo data --model model.gguf --text wiki.train.raw --out data/\n"
                "  voodoo data --model model.gguf --text a.txt b.txt --ctx 256 --val-fraction 0.1 --seed 7 --out data/\n"
                "writes DIR/train.tokens, DIR/val.tokens and DIR/data.json (see docs/DATA.md)");
    auto o = std::make_shared<data_options>();
    auto json = std::make_shared<std::string>();
    sub->add_option("--model,-m", o->model, "GGUF whose vocabulary tokenizes (only the vocabulary is loaded)")
        ->required();
    sub->add_option("--text", o->texts, "UTF-8 text files; blank lines (or the EOS text) separate documents")
        ->required()
        ->check(CLI::ExistingFile);
    sub->add_option("--out,-o", o->out_dir, "Output folder (created when missing)")->required();
    sub->add_option("--ctx,-c", o->ctx, "Tokens per chunk, BOS included")->capture_default_str();
    sub->add_option("--val-fraction", o->val_fraction, "Share of the tokens held out for validation (whole documents)")
        ->capture_default_str();
    sub->add_option("--seed", o->seed, "Seed of the document shuffle")->capture_default_str();
    add_json_option(sub, *json, "The sidecar (data.json)");
    return {sub, [o, json] {
        const nlohmann::json s = prepare_data(*o);
        write_json_to(*json, s);
        if (*json == "-") {
            return 0;
        }
        fmt::print("vocabulary  {} ({} tokens, hash {})\n", s["tokenizer_model"].get<std::string>(),
                   s["n_vocab"].get<int64_t>(), s["vocab_hash"].get<std::string>());
        for (const char * split : {"train", "val"}) {
            const auto & j = s[split];
            fmt::print("{:<5}       {} chunks of {} tokens from {} documents ({} tokens, {} dropped) -> {}/{}\n", split,
                       j["n_chunks"].get<int64_t>(), o->ctx, j["n_documents"].get<int64_t>(),
                       j["n_tokens"].get<int64_t>(), j["n_tokens_dropped"].get<int64_t>(), o->out_dir,
                       j["file"].get<std::string>());
        }
        return 0;
    }};
}

}  // namespace

VOODOO_COMMAND(data, add_data);

}  // namespace voodoo::cli
