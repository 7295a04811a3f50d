// The stronger peer than stock (issue "the best file at every size"): the best non-learned allocator, a
// measured-sensitivity greedy knapsack — every tensor measured alone at every type (the probe's ΔKL), then,
// from every tensor at its dearest type, the downgrade with the least ΔKL per byte saved until the exact byte
// budget holds, then the upgrades with the most ΔKL saved per byte that still fit. It runs the `voodoo
// quantize` ladder with --greedy-peer, so Voodoo, the peer and every stock recipe share data, imatrix,
// candidates and probe, and are scored together in libllama; prints per size Voodoo / peer / best stock.
//
//   greedy_peer MODEL.gguf --text CALIB.txt --eval-text HELDOUT.txt --like IQ2_M,Q3_K_M,Q4_K_M,Q6_K --work W
//
// Outputs: W/curve.{md,json,png} (the peer as the dashed curve), W/eval.{md,json}, W/greedy-peer.json.
#include "common/error.h"
#include "common/file.h"
#include "eval/curve.h"
#include "pipeline/quantize.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <filesystem>

int main(int argc, char ** argv) {
    voodoo::quantize_options q;
    q.greedy_peer = true;
    q.baselines = "all-that-fit";
    CLI::App app("Voodoo against the measured-sensitivity greedy knapsack and every stock recipe, at every size");
    app.add_option("model", q.model, "Source GGUF")->required();
    app.add_option("--text", q.texts, "Calibration text file(s)")->required();
    app.add_option("--eval-text", q.eval_text, "Held-out text")->required();
    app.add_option("--like", q.like, "Stock recipes whose sizes are the targets (comma list)")->required();
    app.add_option("--work", q.work, "Work folder (shared with `voodoo quantize`)")->required();
    app.add_option("--baselines", q.baselines, "Stock recipes to compare")->capture_default_str();
    app.add_option("--ctx", q.ctx, "Calibration chunk length")->capture_default_str();
    app.add_option("--eval-ctx", q.eval_ctx, "Eval chunk length")->capture_default_str();
    app.add_option("--eval-chunks", q.eval_chunks, "Eval chunks")->capture_default_str();
    app.add_option("--steps", q.train.steps, "Training steps")->capture_default_str();
    app.add_option("--threads", q.threads, "LibTorch threads")->capture_default_str();
    app.add_option("--ggml-threads", q.ggml_threads, "libllama threads")->capture_default_str();
    app.add_option("--device", q.train.device, "cpu or cuda")->capture_default_str();
    app.add_option("--compute", q.train.compute, "Training dtype: f32 or bf16");
    CLI11_PARSE(app, argc, argv);
    if (q.train.device != "cpu") {
        q.train_exe = (std::filesystem::path(argv[0]).parent_path() / "voodoo").string();
    }
    try {
        const voodoo::quantize_result r = voodoo::run_quantize(q);
        nlohmann::json out = voodoo::curve_to_json(r.eval);
        int voodoo_better = 0, n = 0;
        fmt::print("\n{:<44} {:>10} {:>12} {:>12} {:>10}\n", "size", "Voodoo", "greedy peer", "best stock", "V/peer");
        for (const auto & g : voodoo::curve_rungs(r.eval)) {
            if (!g.greedy) {
                continue;
            }
            ++n;
            voodoo_better += g.voodoo->kld_mean <= g.greedy->kld_mean;
            fmt::print("{:<44} {:>10.5f} {:>12.5f} {:>12} {:>10.3f}\n", g.voodoo->name, g.voodoo->kld_mean,
                       g.greedy->kld_mean, g.best_stock ? fmt::format("{:.5f}", g.best_stock->kld_mean) : "-",
                       g.voodoo->kld_mean / g.greedy->kld_mean);
        }
        fmt::print("Voodoo at or below the greedy peer at {} of {} sizes\n", voodoo_better, n);
        out["voodoo_at_or_below_greedy"] = voodoo_better;
        out["sizes"] = n;
        voodoo::write_file_atomic((std::filesystem::path(q.work) / "greedy-peer.json").string(), out.dump(2) + "\n");
    } catch (const voodoo::error & e) {
        fmt::print(stderr, "greedy_peer: {}\n", e.what());
        return 1;
    }
    return 0;
}
