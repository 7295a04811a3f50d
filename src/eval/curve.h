// The size–KLD curve: a ladder of Voodoo files beside every stock recipe (and the greedy peer of
// bench/greedy_peer when present), as a table, JSON and a two-panel plot (mean and p99 KLD against size).
#pragma once

#include "eval/eval.h"

#include <nlohmann/json_fwd.hpp>

#include <string>
#include <vector>

namespace voodoo {

/// The series a file belongs to, from its name: "voodoo" (`<stem>.Voodoo<NN>[.<label>].gguf`), "greedy"
/// (`<stem>.greedy[.<label>].gguf`, bench/greedy_peer) or "stock" (everything else).
std::string curve_series(const std::string & file_name);

/// One rung of the curve: a Voodoo file against the best stock file no larger than it (least mean KLD).
struct curve_rung {
    const eval_file_result * voodoo;
    const eval_file_result * best_stock;    // nullptr when every stock file is larger
    const eval_file_result * greedy;        // the greedy peer's file of the same label, or nullptr
    double ratio;                           // voodoo mean KLD / best_stock's (0 without one)
};

/// The rungs, by increasing size. `r.files` must outlive them.
std::vector<curve_rung> curve_rungs(const eval_result & r);

/// The rungs as a markdown table (size, mean/p99 KLD, same-top of Voodoo; the best stock file no larger; the
/// ratio; the greedy peer) and as JSON.
std::string curve_to_markdown(const eval_result & r);
nlohmann::json curve_to_json(const eval_result & r);

/// Two panels side by side, mean KLD and p99 KLD (log scale) against file size in MiB: Voodoo's curve as a
/// line, the greedy peer's as a dashed line, every stock file as a labelled point. Throws voodoo::error when
/// gnuplot is missing or fails.
void curve_plot(const eval_result & r, const std::string & png_path);

}  // namespace voodoo
