// How well an anchored probe stands in for the full one (issue "the best file at every size": the CPU path
// must make one size of mix30M in minutes, and a full probe measures every candidate with a forward pass).
//
// Given a full probe (every candidate's ΔKL measured, WORK/run-*/probe.json of `voodoo quantize`), this
// measures only n types per tensor from it, predicts the rest from the importance-weighted squared error
// (weighted_errors, predict_from_anchors), and reports for each n:
//   - the prediction error |ln(predicted / measured)| over the unmeasured candidates (median, p90, max);
//   - the knapsack regret: at budgets spread from the all-cheapest to the all-Q8_0 file, the measured Σ ΔKL
//     of the exact knapsack on predicted values against that of the exact knapsack on measured values.
//
//   probe_anchors MODEL.gguf --imatrix IM.gguf --probe WORK/run-X/probe.json --cache WORK/candidates --out R.json
//
// The imatrix and candidate cache should be the ones the probe was measured with (same WORK folder): with
// another imatrix the candidates differ slightly from those the probe measured.
#include "common/error.h"
#include "common/file.h"
#include "export/export.h"
#include "ggml/gguf.h"
#include "ggml/types.h"
#include "model/gguf_weights.h"
#include "train/budget.h"
#include "train/probe.h"
#include "train/trainer.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>

namespace {

double quantile(std::vector<double> v, double q) {
    if (v.empty()) {
        return std::numeric_limits<double>::quiet_NaN();
    }
    std::sort(v.begin(), v.end());
    return v[static_cast<size_t>(q * static_cast<double>(v.size() - 1) + 0.5)];
}

}  // namespace

int main(int argc, char ** argv) {
    std::string model_path, imatrix_path, probe_path, cache_dir, out_path;
    std::vector<int> anchors = {1, 2, 3, 4, 6};
    int budgets = 40;
    int threads = 0;
    CLI::App app("An anchored probe (n types per tensor measured, the rest predicted) against the full probe");
    app.add_option("model", model_path, "Source GGUF")->required();
    app.add_option("--imatrix", imatrix_path, "The imatrix the probe's candidates were made with")->required();
    app.add_option("--probe", probe_path, "A full probe.json (every candidate measured)")->required();
    app.add_option("--cache", cache_dir, "Candidate cache folder (WORK/candidates)")->required();
    app.add_option("--out", out_path, "Report JSON");
    app.add_option("--anchors", anchors, "Anchor counts to try")->delimiter(',')->capture_default_str();
    app.add_option("--budgets", budgets, "Budgets between the all-cheapest and the all-Q8_0 file")->capture_default_str();
    app.add_option("--threads", threads, "Threads (0 = all cores)")->capture_default_str();
    CLI11_PARSE(app, argc, argv);
    try {
        using namespace voodoo;
        const gguf_file src(model_path);
        importance_map importance;
        const export_options eopts = imatrix_export_options(imatrix_path, imatrix_path, src, importance);
        menu_options mo;
        mo.has_imatrix = true;
        mo.importance = &importance;
        const std::vector<tensor_menu> menus = build_menus(src, mo);
        const candidate_cache cache(cache_dir);
        std::vector<gated_tensor> gated = build_candidates(src, menus, &importance, cache, threads);
        gguf_weights dense(src, torch::kCPU);
        const std::vector<std::vector<double>> err = weighted_errors(dense, gated, &importance, torch::kCPU);

        // The stored probe under its own identity: load_probe checks the tensors and every menu type.
        std::ifstream in(probe_path);
        if (!in) {
            fail("cannot open the probe '{}'", probe_path);
        }
        const nlohmann::json pj = nlohmann::json::parse(in);
        const std::vector<std::vector<double>> full = load_probe(probe_path, pj.value("identity", ""), gated);
        if (full.empty()) {
            fail("probe '{}' does not hold every menu type of every tensor of '{}': it was measured on another model "
                 "or menu", probe_path, model_path);
        }
        // An anchored probe stores predictions beside its measurements: every nonzero ΔKL must be measured.
        for (const auto & t : pj.at("tensors")) {
            const size_t n_nonzero = std::count_if(t.at("delta_kl").begin(), t.at("delta_kl").end(),
                                                   [](const nlohmann::json & v) { return v.get<double>() != 0.0; });
            if (t.contains("measured") && t.at("measured").size() < n_nonzero) {
                fail("probe '{}' is anchored (tensor '{}' has predicted types): give a full probe (--probe-anchors 0)",
                     probe_path, t.value("name", ""));
            }
        }

        // Budgets: exact file bytes from the all-cheapest file to the all-Q8_0 one (above it every ΔKL is ~1e-7).
        const budget b0 = make_budget(src, menus, target{target_kind::ratio, 1.0}, eopts);
        nlohmann::json report = {{"model", model_path}, {"probe", probe_path}, {"tensors", gated.size()}};
        fmt::print("{:>3} {:>9} {:>10} {:>10} {:>10} {:>12} {:>12}\n", "n", "measured", "med|ln|", "p90|ln|",
                   "max|ln|", "mean regret", "max regret");
        for (int n : anchors) {
            const auto plan = anchor_plan(gated, err, n);
            std::vector<std::vector<double>> sens(gated.size());
            int64_t measured = 0, total = 0;
            for (size_t i = 0; i < gated.size(); ++i) {
                for (size_t k = 0; k < gated[i].types.size(); ++k) {
                    sens[i].push_back(plan[i][k] ? full[i][k] : std::numeric_limits<double>::quiet_NaN());
                    measured += plan[i][k];
                    ++total;
                }
            }
            predict_from_anchors(gated, err, sens);
            std::vector<double> logerr;
            for (size_t i = 0; i < gated.size(); ++i) {
                for (size_t k = 0; k < gated[i].types.size(); ++k) {
                    // Only where the measurement stands above the probe's resolution (f32 sums of ~4k tokens).
                    if (!plan[i][k] && full[i][k] > 1e-8 && sens[i][k] > 0) {
                        logerr.push_back(std::abs(std::log(sens[i][k] / full[i][k])));
                    }
                }
            }
            std::vector<double> regrets;
            nlohmann::json rows = nlohmann::json::array();
            for (int j = 0; j < budgets; ++j) {
                budget b = b0;
                b.limit = b.min_total + (std::min(b.max_total, b.q8_0_bytes) - b.min_total) * (j + 0.5) / budgets;
                const double best = estimated_loss(full, allocate_exact(b, full));
                const double got = estimated_loss(full, allocate_exact(b, sens));
                const double regret = best > 0 ? got / best - 1.0 : 0.0;
                regrets.push_back(regret);
                rows.push_back({{"limit_bytes", b.limit}, {"measured_optimum", best}, {"anchored_choice", got},
                                {"regret", regret}});
            }
            double mean = 0;
            for (double r : regrets) {
                mean += r / static_cast<double>(regrets.size());
            }
            const double mx = *std::max_element(regrets.begin(), regrets.end());
            fmt::print("{:>3} {:>4}/{:<4} {:>10.3f} {:>10.3f} {:>10.3f} {:>11.2f}% {:>11.2f}%\n", n, measured, total,
                       quantile(logerr, 0.5), quantile(logerr, 0.9), quantile(logerr, 1.0), 100 * mean, 100 * mx);
            report["anchors"].push_back({{"n", n}, {"measured", measured}, {"candidates", total},
                                         {"median_abs_log_error", quantile(logerr, 0.5)},
                                         {"p90_abs_log_error", quantile(logerr, 0.9)},
                                         {"max_abs_log_error", quantile(logerr, 1.0)},
                                         {"mean_regret", mean}, {"max_regret", mx}, {"budgets", rows}});
        }
        if (!out_path.empty()) {
            write_file_atomic(out_path, report.dump(1) + "\n");
        }
    } catch (const voodoo::error & e) {
        fmt::print(stderr, "probe_anchors: {}\n", e.what());
        return 1;
    } catch (const std::exception & e) {
        fmt::print(stderr, "probe_anchors: {}\n", e.what());
        return 1;
    }
    return 0;
}
