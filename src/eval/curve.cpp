#include "eval/curve.h"

#include "common/error.h"
#include "common/units.h"
#include "eval/report.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>

namespace voodoo {

namespace {

// The label after the series tag: "mix30M.Voodoo66.Q4_K_M.gguf" → "Q4_K_M", "mix30M.greedy.Q4_K_M.gguf" → "Q4_K_M".
std::string rung_label(const std::string & name) {
    std::string s = name.size() > 5 && name.ends_with(".gguf") ? name.substr(0, name.size() - 5) : name;
    size_t tag = s.find(".Voodoo");
    if (tag == std::string::npos) {
        tag = s.find(".greedy");
    }
    const size_t dot = tag == std::string::npos ? std::string::npos : s.find('.', tag + 1);
    return dot == std::string::npos ? "" : s.substr(dot + 1);
}

std::vector<const eval_file_result *> of_series(const eval_result & r, const std::string & series) {
    std::vector<const eval_file_result *> out;
    for (const auto & f : r.files) {
        if (curve_series(f.name) == series) {
            out.push_back(&f);
        }
    }
    std::sort(out.begin(), out.end(), [](const auto * a, const auto * b) { return a->file_bytes < b->file_bytes; });
    return out;
}

}  // namespace

std::string curve_series(const std::string & name) {
    if (name.find(".Voodoo") != std::string::npos) {
        return "voodoo";
    }
    if (name.find(".greedy") != std::string::npos) {
        return "greedy";
    }
    return "stock";
}

std::vector<curve_rung> curve_rungs(const eval_result & r) {
    const auto stock = of_series(r, "stock");
    const auto greedy = of_series(r, "greedy");
    std::vector<curve_rung> rungs;
    for (const eval_file_result * v : of_series(r, "voodoo")) {
        curve_rung g{v, nullptr, nullptr, 0.0};
        for (const eval_file_result * s : stock) {
            if (s->file_bytes <= v->file_bytes && (!g.best_stock || s->kld_mean < g.best_stock->kld_mean)) {
                g.best_stock = s;
            }
        }
        const std::string label = rung_label(v->name);
        for (const eval_file_result * p : greedy) {
            if (!label.empty() && rung_label(p->name) == label) {
                g.greedy = p;
            }
        }
        g.ratio = g.best_stock && g.best_stock->kld_mean > 0 ? v->kld_mean / g.best_stock->kld_mean : 0.0;
        rungs.push_back(g);
    }
    return rungs;
}

std::string curve_to_markdown(const eval_result & r) {
    std::string out = "| Voodoo file | MiB | mean KLD | p99 KLD | same top | best stock file no larger | MiB | mean KLD | "
                      "p99 KLD | Voodoo / stock | greedy peer mean KLD (MiB) |\n"
                      "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|\n";
    for (const curve_rung & g : curve_rungs(r)) {
        const auto * v = g.voodoo;
        out += fmt::format("| {} | {:.3f} | {:.4g} | {:.4g} | {:.2f}% | ", v->name, v->file_bytes / k_mib, v->kld_mean,
                           v->kld_p99, 100.0 * v->same_top);
        if (g.best_stock) {
            out += fmt::format("{} | {:.3f} | {:.4g} | {:.4g} | {:.2f} | ", g.best_stock->name,
                               g.best_stock->file_bytes / k_mib, g.best_stock->kld_mean, g.best_stock->kld_p99, g.ratio);
        } else {
            out += "(none) | | | | | ";
        }
        out += g.greedy ? fmt::format("{:.4g} ({:.3f}) |\n", g.greedy->kld_mean, g.greedy->file_bytes / k_mib) : "|\n";
    }
    out += fmt::format("\nKLD in nats per token against {} on {} (ctx {}, {} chunks, {} tokens scored per file), "
                       "in libllama.\n", r.ref.name, r.text, r.n_ctx, r.n_chunks, r.n_scored);
    return out;
}

nlohmann::json curve_to_json(const eval_result & r) {
    nlohmann::json rungs = nlohmann::json::array();
    for (const curve_rung & g : curve_rungs(r)) {
        nlohmann::json j = {{"file", g.voodoo->name}, {"bytes", g.voodoo->file_bytes}, {"kld_mean", g.voodoo->kld_mean},
                            {"kld_p99", g.voodoo->kld_p99}, {"same_top", g.voodoo->same_top}};
        if (g.best_stock) {
            j["best_stock"] = {{"file", g.best_stock->name}, {"bytes", g.best_stock->file_bytes},
                               {"kld_mean", g.best_stock->kld_mean}, {"kld_p99", g.best_stock->kld_p99}};
            j["ratio"] = g.ratio;
        }
        if (g.greedy) {
            j["greedy"] = {{"file", g.greedy->name}, {"bytes", g.greedy->file_bytes}, {"kld_mean", g.greedy->kld_mean},
                           {"kld_p99", g.greedy->kld_p99}};
        }
        rungs.push_back(j);
    }
    return {{"reference", r.ref.name}, {"text", r.text}, {"n_ctx", r.n_ctx}, {"n_chunks", r.n_chunks},
            {"n_scored", r.n_scored}, {"rungs", rungs}};
}

void curve_plot(const eval_result & r, const std::string & png_path) {
    if (r.files.empty()) {
        fail("nothing to plot: the evaluation has no files");
    }
    gnuplot_job job;
    const char * series[] = {"voodoo", "greedy", "stock"};
    // The x range of the curves (5% margins), so that far-away stock files (F16, BF16) do not squash them.
    double lo = std::numeric_limits<double>::infinity(), hi = 0;
    for (const char * name : {"voodoo", "greedy"}) {
        for (const auto * f : of_series(r, name)) {
            lo = std::min(lo, static_cast<double>(f->file_bytes) / k_mib);
            hi = std::max(hi, static_cast<double>(f->file_bytes) / k_mib);
        }
    }
    const bool zoom = hi > 0;
    lo *= 0.95;
    hi *= 1.05;
    bool any[3] = {false, false, false};
    for (int s = 0; s < 3; ++s) {
        std::ofstream out(job.path(fmt::format("{}.dat", series[s])));
        for (const auto * f : of_series(r, series[s])) {
            const double mib = static_cast<double>(f->file_bytes) / k_mib;
            if (zoom && (mib < lo || mib > hi)) {
                continue;
            }
            // Stock files are named <stem>-<RECIPE>.gguf: the recipe labels the point.
            const size_t dash = f->name.rfind('-');
            const std::string label = s == 2 && dash != std::string::npos && f->name.ends_with(".gguf")
                                          ? f->name.substr(dash + 1, f->name.size() - dash - 6)
                                          : std::string();
            out << fmt::format("{:.6f} {:.9g} {:.9g} \"{}\"\n", f->file_bytes / k_mib, std::max(f->kld_mean, 1e-9),
                               std::max(f->kld_p99, 1e-9), label);
            any[s] = true;
        }
    }
    std::string body = "set multiplot layout 1,2 title " +
                       gp_quote(fmt::format("KLD against {} vs file size ({}, ctx {}, {} chunks)", r.ref.name,
                                            std::filesystem::path(r.text).filename().string(), r.n_ctx, r.n_chunks)) +
                       "\nset logscale y\nset format y '%g'\nset grid\nset key top right\nset xlabel 'file size (MiB)'\n";
    if (zoom) {
        body += fmt::format("set xrange [{:.6f}:{:.6f}]\n", lo, hi);
    }
    for (int col : {2, 3}) {
        body += fmt::format("set ylabel '{}'\nplot ", col == 2 ? "mean KLD (nats/token)" : "p99 KLD (nats/token)");
        std::vector<std::string> parts;
        if (any[2]) {
            parts.push_back(gp_quote(job.path("stock.dat")) + fmt::format(" using 1:{} with points pt 7 ps 1.2 lc rgb '#888888' title 'stock llama.cpp recipes'", col));
            parts.push_back(gp_quote(job.path("stock.dat")) + fmt::format(" using 1:{}:4 with labels offset 0.6,0.6 left font ',8' notitle", col));
        }
        if (any[1]) {
            parts.push_back(gp_quote(job.path("greedy.dat")) + fmt::format(" using 1:{} with linespoints dt 2 lw 2 pt 6 lc rgb '#22aa55' title 'greedy knapsack (measured ΔKL)'", col));
        }
        if (any[0]) {
            parts.push_back(gp_quote(job.path("voodoo.dat")) + fmt::format(" using 1:{} with linespoints lw 2 pt 7 lc rgb '#cc2222' title 'Voodoo'", col));
        }
        for (size_t i = 0; i < parts.size(); ++i) {
            body += (i ? ", \\\n     " : "") + parts[i];
        }
        body += "\n";
    }
    body += "unset multiplot\n";
    job.render(body, png_path, 1600, 700);
}

}  // namespace voodoo
