#include "cli/commands.h"
#include "common/file.h"
#include "eval/eval.h"
#include "eval/report.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <memory>

namespace voodoo::cli {

namespace {

command add_eval(CLI::App & app) {
    auto * sub = app.add_subcommand(
        "eval", "Perplexity and KL divergence of GGUFs against a reference, in libllama (llama-perplexity's conventions)");
    sub->footer("examples:\n"
                "  voodoo eval --reference model-f16.gguf --text wiki.test.raw model-Q4_K_M.gguf model-Q8_0.gguf\n"
                "  voodoo eval --reference m.gguf --text t.txt --ctx 128 --chunks 20 --out-dir out q1.gguf q2.gguf\n"
                "  voodoo eval --reference m.gguf --text t.txt --json r.json --plot r.png q.gguf");
    struct options {
        eval_options eval;
        std::vector<std::string> files;
        std::string json;
        std::string plot;
        std::string out_dir;
    };
    auto o = std::make_shared<options>();
    sub->add_option("files", o->files, "GGUF files to score (made from the reference model)")->required()->check(CLI::ExistingFile);
    sub->add_option("-m,--reference,--model", o->eval.reference, "Full-precision GGUF whose logits are the truth")->required()->check(CLI::ExistingFile);
    sub->add_option("--text", o->eval.text, "UTF-8 text file to score")->required()->check(CLI::ExistingFile);
    sub->add_option("--ctx", o->eval.n_ctx, "Tokens per chunk; the second half of each is scored")
        ->capture_default_str();
    sub->add_option("--chunks", o->eval.n_chunks, "Chunks to score (-1, the default: every whole chunk of the text)");
    sub->add_option("-t,--threads", o->eval.n_threads, "Threads (default: VOODOO_THREADS if set, else every core)")->check(non_negative());
    sub->add_option("--speed-reps", o->eval.speed_reps,
                    "Runs of llama-bench's pp512 and tg128 per file for the speed columns (0 = none)")
        ->capture_default_str()->check(non_negative());
    add_json_option(sub, o->json, "The results (default with --out-dir: DIR/eval.json)");
    sub->add_option("--plot", o->plot, "Draw mean KLD against file size as PNG here (default with --out-dir: DIR/eval.png)");
    sub->add_option("--out-dir", o->out_dir, "Folder for eval.md, eval.json and eval.png")->check(folder_to_write());
    return {sub, [o] {
        if (!o->out_dir.empty()) {
            std::filesystem::create_directories(o->out_dir);
            const std::filesystem::path dir(o->out_dir);
            if (o->json.empty()) {
                o->json = (dir / "eval.json").string();
            }
            if (o->plot.empty()) {
                o->plot = (dir / "eval.png").string();
            }
        }
        const eval_result r = run_eval(o->eval, o->files);
        const std::string table = eval_to_markdown(r);
        const bool text = o->json != "-";  // --json -: stdout holds the JSON alone
        if (text) {
            fmt::print("{}", table);
        }
        if (!o->out_dir.empty()) {
            const std::string md = (std::filesystem::path(o->out_dir) / "eval.md").string();
            write_file_atomic(md, table);
            if (text) {
                fmt::print("table: {}\n", md);
            }
        }
        write_json_to(o->json, eval_to_json(r));
        if (text && !o->json.empty()) {
            fmt::print("json: {}\n", o->json);
        }
        if (!o->plot.empty()) {
            eval_plot(r, o->plot);
            if (text) {
                fmt::print("plot: {}\n", o->plot);
            }
        }
        return 0;
    }};
}

}  // namespace

VOODOO_COMMAND(eval, add_eval);

}  // namespace voodoo::cli
