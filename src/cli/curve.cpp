#include "cli/commands.h"
#include "common/error.h"
#include "common/file.h"
#include "eval/curve.h"
#include "eval/report.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <memory>

namespace voodoo::cli {

namespace {

command add_curve(CLI::App & app) {
    auto * sub = app.add_subcommand("curve", "The size–KLD curve of an evaluation: Voodoo files against the stock recipes");
    sub->footer("examples:\n"
                "  voodoo curve WORK/eval.json --out-dir WORK      # curve.md, curve.json, curve.png\n"
                "Reads the eval.json of `voodoo quantize` or `voodoo eval --json`; Voodoo files are *.Voodoo*.gguf,\n"
                "the greedy peer's *.greedy*.gguf, every other file a stock recipe.");
    struct options {
        std::string json, out_dir;
    };
    auto o = std::make_shared<options>();
    sub->add_option("eval_json", o->json, "eval.json of an evaluation")->required();
    sub->add_option("--out-dir", o->out_dir, "Folder for curve.md, curve.json and curve.png")->required()->check(folder_to_write());
    return {sub, [o] {
        std::ifstream in(o->json);
        if (!std::filesystem::is_regular_file(o->json) || !in) {
            fail("cannot read '{}': give the eval.json that `voodoo quantize` or `voodoo eval --json` wrote", o->json);
        }
        nlohmann::json j;
        try {
            j = nlohmann::json::parse(in);
        } catch (const nlohmann::json::exception & e) {
            fail("'{}' is not JSON: {}", o->json, e.what());
        }
        const eval_result r = eval_from_json(j, o->json);
        const std::filesystem::path dir(o->out_dir);
        if (std::filesystem::exists(dir) && !std::filesystem::is_directory(dir)) {
            fail("--out-dir '{}' is a file: give a folder (it is made when missing)", o->out_dir);
        }
        std::filesystem::create_directories(dir);
        const std::string table = curve_to_markdown(r);
        fmt::print("{}", table);
        write_file_atomic((dir / "curve.md").string(), table);
        write_file_atomic((dir / "curve.json").string(), curve_to_json(r).dump(2) + "\n");
        curve_plot(r, (dir / "curve.png").string());
        fmt::print("wrote {0}/curve.md, {0}/curve.json, {0}/curve.png\n", o->out_dir);
        return 0;
    }};
}

}  // namespace

VOODOO_COMMAND(curve, add_curve);

}  // namespace voodoo::cli
