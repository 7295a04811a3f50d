// How well an anchored probe stands in for the full one (issue "the best file at every size": the CPU path
// must make one size of mix30M in minutes, and a full probe measures every candidate with a forward pass).
//
// Given a full probe (every candidate's ΔKL measured, WORK/run-*/probe.json of `voodoo quantize`), this
// measures only n types per tensor from it, predicts the rest from the importance-weighted squared error
// (weighted_errors, predict_from_anchors), and reports for each n:
//   - the prediction error |ln(predicted / measured)| over the unmeasured candidates (median, p90, max);
//   - the knapsack regret: at budgets spread from the all-cheapest to the all-Q8_0 file, the measured Σ ΔKL
//     of the exact knapsack on predicted values against that of the exact knapsack on measured values;
// and, for candidate pruning (train/prune.h, issue #16), with --eager N,… and --margins M,…: the eager types' ΔKL
// taken from the probe and the others predicted from the sampled errors as the train stage does, the error of those
// predictions (alone, and as the ratio of two types of one tensor), and at every budget what plan_pruning keeps
// (candidates, bytes, and the quantizers' work by quantize_cost_per_weight), how often it prunes the exact knapsack's
// choice on the measured ΔKL, and the regret of the knapsack of the kept types; --per-budget lists the kept types.
// --staged W,… adds the two-stage plan (--prune-stages 2: stage_types' W neighbours each side of the knapsack's choice
// measured, the plan made again in the band of --stage-margin), counting everything either stage builds.
//
//   probe_anchors MODEL.gguf --imatrix IM.gguf --probe WORK/run-X/probe.json --cache WORK/candidates --out R.json
//
// --against P2.json compares a second full probe of the same candidates (another arithmetic: --probe-compute tf32 or
// bf16) with the first, taken as the truth: |ln(P2 / P1)| per type (median, max, over the candidates whose P1 ΔKL is
// above 1e-8) and the regret of the exact knapsack on P2's values, measured with P1's, at the same budgets.
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
#include "train/prune.h"
#include "train/trainer.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>

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
    bool per_budget = false;
    std::vector<int> eager_counts = {2};
    app.add_option("--eager", eager_counts, "Candidate pruning: eager types per tensor to try (prune_options::eager)")
        ->delimiter(',')->capture_default_str();
    app.add_flag("--per-budget", per_budget, "Candidate pruning: print what each budget keeps, by type");
    std::string against_path;
    app.add_option("--against", against_path, "A second full probe of the same candidates to compare with --probe");
    std::vector<double> margins = {0.5};
    app.add_option("--margins", margins, "Candidate pruning: bands to try (prune_options::margin)")->delimiter(',')->capture_default_str();
    std::vector<int> stage_widths;
    std::string dump_path;
    app.add_option("--dump", dump_path, "Candidate pruning: every candidate's sampled error, bytes, eager flag, prediction "
                   "from the eager types and measured ΔKL, as JSON (for studies of the prediction's error)");
    bool all_anchors = false;
    double eager_max_cost = voodoo::prune_options{}.eager_max_cost;
    app.add_option("--eager-max-cost", eager_max_cost, "Candidate pruning: the eager types' largest quantizer cost, µs per "
                   "weight on one core (prune_options::eager_max_cost; 0: every fast type)")->capture_default_str();
    double stage_margin = voodoo::prune_options{}.stage_margin;
    app.add_option("--stage-margin", stage_margin, "With --staged: the second plan's band (prune_options::stage_margin)")->capture_default_str();
    double calibrate = voodoo::prune_options{}.stage_error_scale;
    app.add_option("--stage-error-scale", calibrate,
                   "With --staged: the second plan's band from the second stage's own errors (prune.h stage_band_margin: "
                   "this scale × the staged types' largest |ln(measured / predicted)|, between --stage-margin and 0.5); "
                   "0: --stage-margin alone")->capture_default_str();
    app.add_flag("--stage-all-anchors", all_anchors, "With --staged: the second plan predicts from every measured type, "
                 "not from the eager types alone (the train stage's way)");
    app.add_option("--staged", stage_widths, "Candidate pruning in two stages (prune.h stage_types): the neighbours each "
                   "side of the knapsack's choice measured before the second plan, widths to try beside the one-stage plan")
        ->delimiter(',');
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
        auto budget_at = [&](int j) {  // the j-th of `budgets` limits, spread evenly, midpoints
            budget b = b0;
            b.limit = b.min_total + (std::min(b.max_total, b.q8_0_bytes) - b.min_total) * (j + 0.5) / budgets;
            return b;
        };
        nlohmann::json report = {{"model", model_path}, {"probe", probe_path}, {"tensors", gated.size()},
                                 {"eager_max_cost", eager_max_cost}};
        if (!against_path.empty()) {
            std::ifstream in2(against_path);
            if (!in2) {
                fail("cannot open the probe '{}' (--against)", against_path);
            }
            const nlohmann::json aj = nlohmann::json::parse(in2);
            const std::vector<std::vector<double>> other = load_probe(against_path, aj.value("identity", ""), gated);
            if (other.empty()) {
                fail("probe '{}' (--against) does not hold every menu type of every tensor of '{}'", against_path, model_path);
            }
            std::map<std::string, std::vector<double>> by_type;
            std::vector<double> all;
            for (size_t i = 0; i < gated.size(); ++i) {
                for (size_t k = 0; k < gated[i].types.size(); ++k) {
                    if (full[i][k] > 1e-8 && other[i][k] > 0) {
                        const double e = std::abs(std::log(other[i][k] / full[i][k]));
                        by_type[type_name(gated[i].types[k])].push_back(e);
                        all.push_back(e);
                    }
                }
            }
            fmt::print("--against {}: |ln(against / probe)| over {} candidates: median {:.4f} p90 {:.4f} max {:.4f}\n",
                       against_path, all.size(), quantile(all, 0.5), quantile(all, 0.9), quantile(all, 1.0));
            nlohmann::json types = nlohmann::json::object();
            for (const auto & [name, v] : by_type) {
                fmt::print("  {:<8} median {:.4f} max {:.4f} (n {})\n", name, quantile(v, 0.5), quantile(v, 1.0), v.size());
                types[name] = {{"median", quantile(v, 0.5)}, {"max", quantile(v, 1.0)}, {"n", v.size()}};
            }
            std::vector<double> regrets;
            for (int j = 0; j < budgets; ++j) {
                const budget b = budget_at(j);
                const double best = estimated_loss(full, allocate_exact(b, full));
                const double got = estimated_loss(full, allocate_exact(b, other));
                regrets.push_back(best > 0 ? got / best - 1.0 : 0.0);
            }
            double mean = 0;
            for (double r : regrets) {
                mean += r / static_cast<double>(regrets.size());
            }
            const double mx = *std::max_element(regrets.begin(), regrets.end());
            fmt::print("  knapsack on the --against values, measured with --probe's: regret mean {:.3f}% max {:.3f}% over {} budgets\n",
                       100 * mean, 100 * mx, budgets);
            report["against"] = {{"probe", against_path}, {"abs_log_error", {{"median", quantile(all, 0.5)},
                                 {"p90", quantile(all, 0.9)}, {"max", quantile(all, 1.0)}, {"n", all.size()}}},
                                 {"by_type", types}, {"regret", regrets}, {"mean_regret", mean}, {"max_regret", mx}};
        }
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
                const budget b = budget_at(j);
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
        // Candidate pruning (train/prune.h) against the truth: the eager types' ΔKL from this probe, the others
        // predicted from the sampled errors, at every budget; what each band keeps, and whether the exact knapsack on
        // the measured ΔKL of the kept types alone (on the full menus' grid) is the full menus' one.
        const auto hat = sampled_weighted_errors(src, menus, &importance, prune_options{}, threads);
        for (int n_eager : eager_counts) {
            prune_options po;
            po.eager = n_eager;
            po.eager_max_cost = eager_max_cost;
            const auto eager = eager_types(menus, hat, po);
            std::vector<std::vector<double>> measured(menus.size());
            for (size_t i = 0; i < menus.size(); ++i) {
                for (size_t k = 0; k < menus[i].types.size(); ++k) {
                    measured[i].push_back(eager[i][k] ? full[i][k] : std::numeric_limits<double>::quiet_NaN());
                }
            }
            // How far the predictions are from the truth, alone and as the ratio of two types of one tensor.
            const prune_plan p0 = plan_pruning(menus, hat, measured, eager, {b0}, {}, po);
            std::vector<double> alone, pair;
            for (size_t i = 0; i < menus.size(); ++i) {
                for (size_t k = 0; k < menus[i].types.size(); ++k) {
                    if (eager[i][k] || !(full[i][k] > 1e-8) || !(p0.predicted[i][k] > 0)) {
                        continue;
                    }
                    alone.push_back(std::abs(std::log(p0.predicted[i][k] / full[i][k])));
                    for (size_t j = 0; j < menus[i].types.size(); ++j) {
                        if (j != k && full[i][j] > 1e-8 && p0.predicted[i][j] > 0) {
                            pair.push_back(std::abs(std::log((p0.predicted[i][k] / p0.predicted[i][j]) / (full[i][k] / full[i][j]))));
                        }
                    }
                }
            }
            if (!dump_path.empty()) {
                nlohmann::json d = nlohmann::json::array();
                for (size_t i = 0; i < menus.size(); ++i) {
                    nlohmann::json types = nlohmann::json::array();
                    for (size_t k = 0; k < menus[i].types.size(); ++k) {
                        types.push_back({{"type", type_name(menus[i].types[k])}, {"bytes", b0.cost[i][k]},
                                         {"err_hat", hat[i][k]}, {"eager", static_cast<bool>(eager[i][k])},
                                         {"predicted", p0.predicted[i][k]}, {"measured", full[i][k]},
                                         {"work", quantize_cost_per_weight(menus[i].types[k]) *
                                                      static_cast<double>(menus[i].tensor->n_elements())}});
                    }
                    d.push_back({{"name", menus[i].tensor->name}, {"types", types}});
                }
                write_file_atomic(fmt::format("{}.eager{}.json", dump_path, n_eager), d.dump(1) + "\n");
            }
            fmt::print("\npredictions from {} eager types: |ln(predicted / measured)| median {:.3f} p90 {:.3f} p99 {:.3f} max "
                       "{:.3f}; of a pair's ratio: median {:.3f} p90 {:.3f} p99 {:.3f} max {:.3f}\n", po.eager,
                       quantile(alone, 0.5), quantile(alone, 0.9), quantile(alone, 0.99), quantile(alone, 1.0),
                       quantile(pair, 0.5), quantile(pair, 0.9), quantile(pair, 0.99), quantile(pair, 1.0));
            report["prediction"].push_back({{"eager", n_eager}, {"abs_log_error", {{"median", quantile(alone, 0.5)}, {"p90", quantile(alone, 0.9)},
                                                       {"p99", quantile(alone, 0.99)}, {"max", quantile(alone, 1.0)}}},
                                    {"pair_abs_log_error", {{"median", quantile(pair, 0.5)}, {"p90", quantile(pair, 0.9)},
                                                            {"p99", quantile(pair, 0.99)}, {"max", quantile(pair, 1.0)}}}});
            fmt::print("{:>5} {:>6} {:>14} {:>12} {:>11} {:>10} {:>11} {:>12}\n", "eager", "margin", "kept", "kept bytes", "kept work",
                       "pruned best", "max regret", "mean regret");
            std::vector<int> variants = {-1};  // -1: one plan, as the train stage without --prune-stages 2
            variants.insert(variants.end(), stage_widths.begin(), stage_widths.end());
            for (double m : margins) for (int width : variants) {
                po.margin = m;
                int64_t kept = 0, total = 0, missed = 0;
                double kept_bytes = 0, total_bytes = 0, worst = 0, kept_cost = 0, mean_regret = 0;
                double band_sum = 0, band_max = 0;  // the second plans' bands (as margins), --stage-error-scale's
                for (int j = 0; j < budgets; ++j) {
                    const budget b = budget_at(j);
                    const std::vector<int> best = allocate_exact(b, full);
                    prune_plan p = plan_pruning(menus, hat, measured, eager, {b}, {}, po);
                    if (width >= 0) {
                        // The second stage: the knapsack's choice and its neighbours measured (from the full probe),
                        // then planned again; what was built in either stage counts (and stays in the menus).
                        const auto staged = stage_types(menus, p, measured, {b}, width);
                        std::vector<std::vector<double>> m2 = measured;
                        for (size_t i = 0; i < menus.size(); ++i) {
                            for (size_t k = 0; k < menus[i].types.size(); ++k) {
                                m2[i][k] = staged[i][k] ? full[i][k] : m2[i][k];
                            }
                        }
                        prune_options po2 = po;
                        po2.stage_margin = stage_margin;
                        po2.stage_error_scale = calibrate;
                        po2.margin = stage_band_margin(menus, p, m2, staged, eager, po2);  // the train stage's rule
                        band_sum += po2.margin / budgets;
                        band_max = std::max(band_max, po2.margin);
                        prune_plan p2 = plan_pruning(menus, hat, m2, eager, {b}, {}, po2, all_anchors ? nullptr : &measured);
                        keep_also(menus, p2, staged);
                        p = std::move(p2);
                    }
                    kept += p.kept;
                    total += p.total;
                    kept_bytes += p.kept_bytes;
                    total_bytes += p.total_bytes;
                    // The quantizers' work (prune.h quantize_cost_per_weight): what the build's time follows.
                    double cost_kept = 0, cost_all = 0;
                    std::map<std::string, int> kept_types;
                    for (size_t i = 0; i < menus.size(); ++i) {
                        for (size_t k = 0; k < menus[i].types.size(); ++k) {
                            const double c = quantize_cost_per_weight(menus[i].types[k]) *
                                             static_cast<double>(menus[i].tensor->n_elements());
                            cost_all += c;
                            cost_kept += p.keep[i][k] ? c : 0.0;
                            kept_types[type_name(menus[i].types[k])] += p.keep[i][k];
                        }
                    }
                    kept_cost += cost_kept / cost_all / budgets;
                    if (per_budget) {
                        std::string types;
                        for (const auto & [t, n] : kept_types) {
                            types += fmt::format(" {}:{}", t, n);
                        }
                        fmt::print("  budget {:>2} ({:.3f} of the all-Q8_0 file): kept {} ({:.1f}% of the work){}\n", j,
                                   static_cast<double>(b.limit) / static_cast<double>(b.q8_0_bytes), p.kept,
                                   100 * cost_kept / cost_all, types);
                    }
                    const std::vector<tensor_menu> km = pruned_menus(menus, p.keep);
                    budget bp = make_budget(src, km, target{target_kind::size, 1e12}, eopts, /*check_range =*/false);
                    bp.limit = b.limit;
                    share_grid(bp, b);
                    std::vector<std::vector<double>> kt(menus.size());
                    for (size_t i = 0; i < menus.size(); ++i) {
                        missed += !p.keep[i][static_cast<size_t>(best[i])];
                        for (size_t k = 0; k < menus[i].types.size(); ++k) {
                            if (p.keep[i][k]) {
                                kt[i].push_back(full[i][k]);
                            }
                        }
                    }
                    const double got = estimated_loss(kt, allocate_exact(bp, kt)), want = estimated_loss(full, best);
                    worst = std::max(worst, want > 0 ? got / want - 1.0 : 0.0);
                    mean_regret += (want > 0 ? got / want - 1.0 : 0.0) / budgets;
                }
                fmt::print("{:>5} {:>6.2f} {:>6}/{:<7} {:>11.1f}% {:>10.1f}% {:>10} {:>10.3f}% {:>11.4f}%{}\n", n_eager, m, kept, total,
                           100 * kept_bytes / total_bytes, 100 * kept_cost, missed, 100 * worst, 100 * mean_regret,
                           width < 0 ? std::string()
                                     : fmt::format("  (two stages, width {}{})", width,
                                                   calibrate > 0 ? fmt::format("; bands from the staged errors × {}: margin "
                                                                               "mean {:.3f}, largest {:.3f}",
                                                                               calibrate, band_sum, band_max)
                                                                 : std::string()));
                report["pruning"].push_back({{"eager", n_eager}, {"margin", m}, {"stages", width < 0 ? 1 : 2},
                                             {"stage_width", width < 0 ? 0 : width}, {"stage_margin", width < 0 ? 0.0 : stage_margin}, {"kept", kept}, {"candidates", total},
                                             {"kept_bytes_fraction", kept_bytes / total_bytes}, {"kept_work_fraction", kept_cost},
                                             {"best_choices_pruned", missed}, {"max_regret", worst}, {"mean_regret", mean_regret},
                                             {"stage_margin_from_errors", width < 0 ? 0.0 : calibrate},
                                             {"stage_margin_mean", band_sum}, {"stage_margin_largest", band_max}});
            }
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
