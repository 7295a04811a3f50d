#include "eval/report.h"

#include "common/error.h"
#include "common/units.h"
#include "common/file.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <sstream>

#include <unistd.h>

namespace voodoo {

namespace {

/// Compact for small numbers: 0.000123 → "1.23e-04", 0.0512 → "0.0512".
std::string num(double v) {
    if (v == 0) {
        return "0";
    }
    if (std::abs(v) < 1e-3) {
        return fmt::format("{:.2e}", v);
    }
    return fmt::format("{:.4f}", v);
}

nlohmann::json file_json(const eval_file_result & f, bool is_reference) {
    nlohmann::json j = {
        {"path", f.path},
        {"name", f.name},
        {"file_bytes", f.file_bytes},
        {"tensor_bytes", f.tensor_bytes},
        {"n_weights", f.n_weights},
        {"bpw", f.bpw},
        {"ppl", f.ppl},
        {"ppl_err", f.ppl_err},
    };
    if (f.pp512 > 0) {
        j["pp512_tps"] = f.pp512;
        j["pp512_tps_sd"] = f.pp512_sd;
        j["tg128_tps"] = f.tg128;
        j["tg128_tps_sd"] = f.tg128_sd;
        if (f.speed_other_cores >= 0) {
            j["speed_other_load_cores"] = f.speed_other_cores;
            j["speed_under_load"] = speed_under_load(f);
        }
    }
    if (!is_reference) {
        j["ln_ppl_ratio"] = f.ln_ppl_ratio;
        j["ln_ppl_ratio_err"] = f.ln_ppl_ratio_err;
        j["ppl_ratio"] = f.ppl_ratio;
        j["ppl_ratio_err"] = f.ppl_ratio_err;
        j["kld_mean"] = f.kld_mean;
        j["kld_err"] = f.kld_err;
        j["kld_median"] = f.kld_median;
        j["kld_p99"] = f.kld_p99;
        j["kld_p999"] = f.kld_p999;
        j["kld_max"] = f.kld_max;
        j["same_top"] = f.same_top;
        j["same_top_err"] = f.same_top_err;
    }
    return j;
}

/// The longest prefix common to every file name that ends with '-' or '_' ("stories260K-"), or "".
std::string common_label_prefix(const std::vector<eval_file_result> & files) {
    if (files.size() < 2) {
        return {};
    }
    std::string prefix = files[0].name;
    for (const eval_file_result & f : files) {
        size_t n = 0;
        while (n < prefix.size() && n < f.name.size() && prefix[n] == f.name[n]) {
            ++n;
        }
        prefix.resize(n);
    }
    const size_t cut = prefix.find_last_of("-_");
    return cut == std::string::npos ? std::string() : prefix.substr(0, cut + 1);
}

/// A file's name without the common prefix and the .gguf extension: "Q4_K_M".
std::string short_label(const std::string & name, const std::string & prefix) {
    std::string s = name.substr(prefix.size());
    if (s.size() > 5 && s.compare(s.size() - 5, 5, ".gguf") == 0) {
        s.resize(s.size() - 5);
    }
    return s;
}

}  // namespace

std::string gp_quote(const std::string & s) {
    std::string out = "'";
    for (char ch : s) {
        out += ch;
        if (ch == '\'') {
            out += '\'';
        }
    }
    return out + "'";
}


std::string eval_to_markdown(const eval_result & r) {
    const bool speed = r.speed_reps > 0;
    std::string out;
    out += "| file | size MiB | BPW | PPL | PPL ratio | mean KLD | median KLD | p99 KLD | p99.9 KLD | max KLD | same top |";
    out += speed ? " pp512 t/s | tg128 t/s |\n" : "\n";
    out += "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|";
    out += speed ? "---:|---:|\n" : "\n";
    const auto size_cols = [](const eval_file_result & f) {
        return fmt::format("{:.3f} | {:.3f}", static_cast<double>(f.file_bytes) / k_mib, f.bpw);
    };
    const auto speed_cols = [&](const eval_file_result & f) {
        if (!speed) {
            return std::string();
        }
        const char * loaded = speed_under_load(f) ? " ⚠" : "";
        return f.pp512 > 0 ? fmt::format(" {:.0f} ± {:.0f}{} | {:.1f} ± {:.1f}{} |", f.pp512, f.pp512_sd, loaded, f.tg128,
                                         f.tg128_sd, loaded)
                           : std::string(" (not measured) | |");  // the reference without its speed (eval_options)
    };
    out += fmt::format("| {} (reference) | {} | {:.4f} ± {:.4f} | 1 | | | | | | |{}\n", r.ref.name, size_cols(r.ref),
                       r.ref.ppl, r.ref.ppl_err, speed_cols(r.ref));
    for (const eval_file_result & f : r.files) {
        out += fmt::format("| {} | {} | {:.4f} ± {:.4f} | {:.4f} ± {:.4f} | {} ± {} | {} | {} | {} | {} | {:.2f}% ± {:.2f}% |{}\n",
                           f.name, size_cols(f), f.ppl, f.ppl_err, f.ppl_ratio, f.ppl_ratio_err, num(f.kld_mean),
                           num(f.kld_err), num(f.kld_median), num(f.kld_p99), num(f.kld_p999), num(f.kld_max),
                           100.0 * f.same_top, 100.0 * f.same_top_err, speed_cols(f));
    }
    out += fmt::format("\n{} chunks of {} tokens of {} ({} tokens), {} tokens scored per file; KLD in nats per token "
                       "against {}; computed by libllama on {}.\n",
                       r.n_chunks, r.n_ctx, r.text, r.n_text_tokens, r.n_scored, r.ref.name,
                       eval_devices_text(r.devices));
    if (speed) {
        out += fmt::format("Speed in libllama on this machine, llama-bench's method: pp512 = 512 prompt tokens in one "
                           "batch, tg128 = 128 tokens generated one by one; mean ± sd of {} run{} on {} thread{}{}.\n",
                           r.speed_reps, r.speed_reps == 1 ? "" : "s", r.speed_threads, r.speed_threads == 1 ? "" : "s",
                           r.speed_reps == 1 ? " (one run: no spread measured)" : "");
        if (const std::string w = speed_load_warning(r); !w.empty()) {
            out += w + "\n";
        }
    }
    return out;
}

std::string speed_load_warning(const eval_result & r) {
    double worst = -1;
    int n = 0;
    std::string names;
    const auto look = [&](const eval_file_result & f) {
        if (f.pp512 > 0 && speed_under_load(f)) {
            ++n;
            names += (names.empty() ? "" : ", ") + f.name;
            worst = std::max(worst, f.speed_other_cores);
        }
    };
    look(r.ref);
    for (const eval_file_result & f : r.files) {
        look(f);
    }
    if (n == 0) {
        return "";
    }
    return fmt::format("⚠ Measured under load: other processes kept up to {:.1f} cores busy on average while the speed of "
                       "{} file{} was measured ({}), so {} speed figures can be far below a quiet machine's, not only "
                       "by the share of the cores taken: ggml's threads wait for each other at every step, and one "
                       "busy core can slow a run on every core a hundredfold. Measure again on a quiet machine, or with "
                       "fewer threads than the idle cores (`voodoo eval … --speed-reps N --threads T`).",
                       worst, n, n == 1 ? "" : "s", names, n == 1 ? "its" : "their");
}

std::string eval_devices_text(const std::vector<std::string> & devices) {
    if (devices.empty()) {
        return "the CPU";
    }
    std::string out;
    for (const std::string & d : devices) {
        out += (out.empty() ? "" : ", ") + d;
    }
    return out;
}

nlohmann::json eval_to_json(const eval_result & r) {
    nlohmann::json files = nlohmann::json::array();
    for (const eval_file_result & f : r.files) {
        files.push_back(file_json(f, false));
    }
    return {
        {"reference", file_json(r.ref, true)},
        {"text", r.text},
        {"n_ctx", r.n_ctx},
        {"n_chunks", r.n_chunks},
        {"n_text_tokens", r.n_text_tokens},
        {"n_scored", r.n_scored},
        {"speed_reps", r.speed_reps},
        {"speed_threads", r.speed_threads},
        {"devices", r.devices},
        {"files", files},
    };
}

namespace {

eval_file_result file_from_json(const nlohmann::json & j) {
    eval_file_result f;
    f.path = j.at("path").get<std::string>();
    f.name = j.at("name").get<std::string>();
    f.file_bytes = j.at("file_bytes").get<size_t>();
    f.tensor_bytes = j.at("tensor_bytes").get<size_t>();
    f.n_weights = j.at("n_weights").get<int64_t>();
    f.bpw = j.at("bpw").get<double>();
    f.ppl = j.at("ppl").get<double>();
    f.ppl_err = j.at("ppl_err").get<double>();
    f.ln_ppl_ratio = j.value("ln_ppl_ratio", 0.0);
    f.ln_ppl_ratio_err = j.value("ln_ppl_ratio_err", 0.0);
    f.ppl_ratio = j.value("ppl_ratio", 1.0);
    f.ppl_ratio_err = j.value("ppl_ratio_err", 0.0);
    f.kld_mean = j.value("kld_mean", 0.0);
    f.kld_err = j.value("kld_err", 0.0);
    f.kld_median = j.value("kld_median", 0.0);
    f.kld_p99 = j.value("kld_p99", 0.0);
    f.kld_p999 = j.value("kld_p999", 0.0);
    f.kld_max = j.value("kld_max", 0.0);
    f.same_top = j.value("same_top", 1.0);
    f.same_top_err = j.value("same_top_err", 0.0);
    f.pp512 = j.value("pp512_tps", 0.0);
    f.pp512_sd = j.value("pp512_tps_sd", 0.0);
    f.tg128 = j.value("tg128_tps", 0.0);
    f.tg128_sd = j.value("tg128_tps_sd", 0.0);
    f.speed_other_cores = j.value("speed_other_load_cores", -1.0);
    return f;
}

}  // namespace

eval_result eval_from_json(const nlohmann::json & j, const std::string & source) {
    try {
        eval_result r;
        r.ref = file_from_json(j.at("reference"));
        r.reference = r.ref.path;
        r.text = j.at("text").get<std::string>();
        r.n_ctx = j.at("n_ctx").get<int>();
        r.n_chunks = j.at("n_chunks").get<int>();
        r.n_text_tokens = j.at("n_text_tokens").get<int64_t>();
        r.n_scored = j.at("n_scored").get<int64_t>();
        r.speed_reps = j.value("speed_reps", 0);
        r.speed_threads = j.value("speed_threads", 0);
        r.devices = j.value("devices", std::vector<std::string>{});
        for (const auto & f : j.at("files")) {
            r.files.push_back(file_from_json(f));
        }
        return r;
    } catch (const nlohmann::json::exception & e) {
        fail("'{}' is not an eval report of `voodoo eval --json` or `voodoo quantize` ({})", source, e.what());
    }
}

bool gnuplot_available() {
    const char * path = std::getenv("PATH");
    if (!path) {
        return false;
    }
    const std::string all = path;
    for (size_t a = 0; a <= all.size();) {
        const size_t b = std::min(all.find(':', a), all.size());
        const std::string dir = all.substr(a, b - a);
        if (!dir.empty() && access((std::filesystem::path(dir) / "gnuplot").c_str(), X_OK) == 0) {
            return true;
        }
        a = b + 1;
    }
    return false;
}

void eval_plot(const eval_result & r, const std::string & png_path) {
    if (r.files.empty()) {
        fail("nothing to plot: the evaluation has no files");
    }
    // Pareto front: sorted by size, a file is on it when its KLD is below every smaller file's.
    std::vector<size_t> order(r.files.size());
    std::iota(order.begin(), order.end(), size_t{0});
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
        return r.files[a].file_bytes != r.files[b].file_bytes ? r.files[a].file_bytes < r.files[b].file_bytes
                                                              : r.files[a].kld_mean < r.files[b].kld_mean;
    });
    std::vector<size_t> front;
    for (size_t i : order) {
        if (front.empty() || r.files[i].kld_mean < r.files[front.back()].kld_mean) {
            front.push_back(i);
        }
    }
    const bool log_y = std::all_of(r.files.begin(), r.files.end(), [](const auto & f) { return f.kld_mean > 0; });

    gnuplot_job job;
    const std::string points = job.path("points.dat");
    const std::string front_dat = job.path("front.dat");
    // Files with the same size and KLD (recipes that fell back to the same types) share one point and
    // label; labels alternate above and below their point so that neighbours stay readable.
    const std::string prefix = common_label_prefix(r.files);
    size_t n_labels = 0;
    {
        std::ofstream p(points), fr(front_dat);
        std::vector<bool> merged(r.files.size(), false);
        for (size_t a = 0; a < order.size(); ++a) {
            const eval_file_result & f = r.files[order[a]];
            if (merged[order[a]]) {
                continue;
            }
            std::string label = short_label(f.name, prefix);
            for (size_t b = a + 1; b < order.size(); ++b) {
                const eval_file_result & g = r.files[order[b]];
                if (g.file_bytes == f.file_bytes && g.kld_mean == f.kld_mean) {
                    label += " = " + short_label(g.name, prefix);
                    merged[order[b]] = true;
                }
            }
            p << fmt::format("{:.6f} {:.9g} \"{}\"\n", static_cast<double>(f.file_bytes) / k_mib, f.kld_mean, label);
            n_labels += 1;
        }
        for (size_t i : front) {
            fr << fmt::format("{:.6f} {:.9g}\n", static_cast<double>(r.files[i].file_bytes) / k_mib, r.files[i].kld_mean);
        }
    }
    std::string script;
    script += "set title " + gp_quote(fmt::format("mean KLD against {} vs file size ({}, ctx {}, {} chunks){}",
                                                  r.ref.name, std::filesystem::path(r.text).filename().string(),
                                                  r.n_ctx, r.n_chunks,
                                                  prefix.empty() ? "" : "; files " + prefix + "*.gguf")) + "\n";
    script += "set xlabel 'file size (MiB)'\nset ylabel 'mean KLD (nats/token)'\nset grid\nset key top right\n";
    script += "set offsets graph 0.05, graph 0.15, graph 0.05, graph 0.05\n";
    if (log_y) {
        script += "set logscale y\nset format y '%g'\n";
    }
    script += "plot " + gp_quote(front_dat) + " using 1:2 with lines lw 2 lc rgb '#cc4444' title 'Pareto front', \\\n";
    script += "     " + gp_quote(points) + " using 1:2 with points pt 7 ps 1.5 lc rgb '#2255aa' title 'files', \\\n";
    // Even lines (every other point by size) labelled above, odd ones below.
    script += "     " + gp_quote(points) + " every 2::0 using 1:2:3 with labels offset 1,0.7 left font ',9' notitle";
    if (n_labels > 1) {
        script += ", \\\n     " + gp_quote(points) + " every 2::1 using 1:2:3 with labels offset 1,-0.7 left font ',9' notitle";
    }
    script += "\n";
    job.render(script, png_path, 1200, 800);
}

gnuplot_job::gnuplot_job()
    : dir_((std::filesystem::temp_directory_path() / fmt::format("voodoo-plot-{}-{}", getpid(),
                                                                   static_cast<const void *>(this))).string()) {
    std::filesystem::create_directories(dir_);
}

gnuplot_job::~gnuplot_job() { remove_tree(dir_); }

std::string gnuplot_job::path(const std::string & name) const { return (std::filesystem::path(dir_) / name).string(); }

void gnuplot_job::render(const std::string & body, const std::string & png_path, int width, int height) {
    const std::string png = path("plot.png");
    std::string script = fmt::format("if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) {{ set terminal pngcairo size {0},{1} "
                                     "font 'sans,10' }} else {{ set terminal png size {0},{1} }}\n", width, height);
    script += "set output " + gp_quote(png) + "\nset termoption noenhanced\n" + body;
    const std::string script_path = path("plot.gp");
    std::ofstream(script_path) << script;

    const std::string cmd = "gnuplot " + gp_quote(script_path) + " 2>&1";
    FILE * pipe = popen(cmd.c_str(), "r");
    if (!pipe) {
        fail("cannot run gnuplot for '{}': install it (apt-get install gnuplot-nox)", png_path);
    }
    std::string output;
    char buf[1024];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, pipe)) > 0) {
        output.append(buf, n);
    }
    const int status = pclose(pipe);
    if (status != 0 || !std::filesystem::exists(png)) {
        while (!output.empty() && output.back() == '\n') {
            output.pop_back();
        }
        fail("gnuplot failed to draw '{}'{}{} (install gnuplot-nox if it is missing)", png_path,
             output.empty() ? "" : ": ", output);
    }
    const mapped_file bytes(png);
    write_file_atomic(png_path, bytes.bytes());
}

}  // namespace voodoo
