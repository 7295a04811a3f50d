// Reports of `voodoo eval`: a markdown table, JSON, and a gnuplot Pareto plot of KLD against size.
#pragma once

#include "eval/eval.h"

#include <nlohmann/json_fwd.hpp>

#include <string>

namespace voodoo {

/// The results as a markdown table, one row per file (reference first): size (MiB), BPW, PPL ± stderr,
/// PPL ratio, mean KLD ± stderr, median, p99, p99.9 and max KLD, same-top-token %; then a line that
/// says which text, ctx and how many chunks and tokens were scored.
std::string eval_to_markdown(const eval_result & r);

/// The warning eval.md carries when a speed figure was measured under load (eval_file_result::speed_other_cores at
/// least k_speed_load_warn_cores: the files named, the largest load), or "" when none was.
std::string speed_load_warning(const eval_result & r);

/// Where libllama computed, for a report: "the CPU" when `devices` (eval_result::devices) is empty, else the devices
/// joined by ", ".
std::string eval_devices_text(const std::vector<std::string> & devices);

/// Every number of the result as JSON (sizes in bytes, KLD in nats per token, same_top as a fraction).
nlohmann::json eval_to_json(const eval_result & r);

/// The inverse of eval_to_json. Throws voodoo::error naming `source` (the file it came from) when a field is
/// missing or of the wrong kind.
eval_result eval_from_json(const nlohmann::json & j, const std::string & source);

/// Draws mean KLD (y, log scale when every KLD is positive) against file size in MiB (x) with gnuplot
/// (pngcairo, else png), one labelled point per file and the Pareto front (no file both smaller and
/// closer) joined by a line; the PNG is written atomically to `png_path`. Throws voodoo::error when
/// gnuplot is missing or fails (its message included) or the destination cannot be written.
void eval_plot(const eval_result & r, const std::string & png_path);

/// Whether a `gnuplot` executable is on PATH (what eval_plot runs).
bool gnuplot_available();

/// One gnuplot drawing: a private temporary folder for its data files (removed with the object), then
/// render() runs gnuplot on a script body (the terminal and output lines are added: pngcairo, else png, of
/// width × height pixels) and writes the PNG atomically to png_path. Throws voodoo::error when gnuplot is
/// missing or fails (its message included).
class gnuplot_job {
public:
    gnuplot_job();
    ~gnuplot_job();
    gnuplot_job(const gnuplot_job &) = delete;
    gnuplot_job & operator=(const gnuplot_job &) = delete;
    /// A file in the job's folder.
    std::string path(const std::string & name) const;
    void render(const std::string & body, const std::string & png_path, int width, int height);

private:
    std::string dir_;
};

/// A gnuplot string literal: single quotes, a quote doubled.
std::string gp_quote(const std::string & s);

}  // namespace voodoo
