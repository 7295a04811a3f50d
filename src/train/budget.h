// Menus, targets and the byte budget: what every selectable tensor may become, what each choice costs
// in exact bytes, and the exact-budget finalize (DESIGN.md "The math").
#pragma once

#include "export/export.h"
#include "ggml/gguf.h"

#include <ggml.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace voodoo {

struct menu_options {
    std::vector<ggml_type> types;                                        // empty = the default menu (default_menu_for)
    /// With the default menu: offer llama.cpp's 32-block fallback types (IQ4_NL, Q4_0, Q4_1, Q5_0, Q5_1) also where a
    /// 256-block type fits (`--menu all`; quantize --max-slowdown). An explicit --menu/--menu-for is used as given.
    bool with_fallbacks = false;
    std::vector<std::pair<std::string, std::vector<ggml_type>>> per_role; // regex on the tensor name → its menu
    bool has_imatrix = false;
    /// The imatrix's entries, when known: a tensor without one (token_embd: no matmul reads it) gets no
    /// IQ1/IQ2/IQ3_XXS type even with has_imatrix, since llama-quantize refuses it ("Missing importance matrix
    /// for tensor … in a very low-bit quantization"). nullptr: every tensor counts as covered.
    const importance_map * importance = nullptr;
};

/// True for "--menu all" (any case, spaces around it ignored): the default menu with the fallback types everywhere
/// (menu_options::with_fallbacks).
bool is_all_menu(const std::string & spec);

/// Parses "--menu Q4_K,Q5_K,Q6_K" (comma-separated ggml type names). Throws voodoo::error naming the flag, also for
/// "all" inside a list (it stands alone: is_all_menu).
std::vector<ggml_type> parse_menu(const std::string & list, const std::string & flag);

/// Parses "--menu-for 'attn_.*=Q4_K,Q5_K,Q6_K'". Throws voodoo::error naming the flag.
std::pair<std::string, std::vector<ggml_type>> parse_menu_for(const std::string & spec);

/// Applies the menu flags of `voodoo train` and `voodoo quantize` to m: `--menu` ("" = the default menu; "all" = with
/// llama.cpp's fallback types on every tensor; else parse_menu's list), each `--menu-for` (parse_menu_for), and
/// `speed_limited` (--max-token-seconds, --max-slowdown): the fallback types kept, since Q4_0 and IQ4_NL have the
/// fastest CPU kernels (default_menu_for). Throws voodoo::error as parse_menu and parse_menu_for.
void apply_menu_flags(menu_options & m, const std::string & menu, const std::vector<std::string> & menu_for,
                      bool speed_limited);

/// The menu of one selectable tensor.
struct tensor_menu {
    const gguf_tensor * tensor;
    std::vector<ggml_type> types;   // by increasing bits per weight; never empty
    bool float_only;                // no block type fits ne0: chooses among F16/BF16 (reported)
};

/// Every selectable tensor whose menu is not empty, in source order. A tensor's menu is the first
/// --menu-for pattern that matches its name (std::regex_search), else the --menu, filtered by
/// menu_for (block fits ne0; IQ1/IQ2/IQ3_XXS only with an imatrix entry for the tensor), else the default menu
/// (default_menu_for: without the 32-block fallback types where a 256-block type fits, unless with_fallbacks). A tensor with an empty menu keeps
/// its source type (counted as fixed bytes). Throws voodoo::error when a type the user named (--menu,
/// --menu-for) fits no tensor of the model, naming the type.
std::vector<tensor_menu> build_menus(const gguf_file & file, const menu_options & opts);

enum class target_kind { bpw, size, ratio };

struct target {
    target_kind kind;
    double value;            // bits per weight, bytes, or a fraction of the Q8_0 file
    /// "bpw=4.5", "size=304352", "ratio=0.45": recorded in the recipe and the GGUF.
    std::string str() const;
};

/// Parses a size: "304352", "300KB", "296.5KiB", "1.5GiB", "500MiB", "2GB", "4G", "300k" (B; KB/MB/GB powers of
/// 1000; KiB/MiB/GiB and the bare K/M/G of `ls -h` powers of 1024; any case). Throws voodoo::error naming the
/// flag and the accepted forms.
double parse_size(const std::string & s, const std::string & flag);

/// Exact costs: cost[t][k] is what tensor t adds when it takes menu type k; `fixed` is the rest, so
/// that for any one-hot choice fixed + Σ cost is exactly the quantity the target limits — the output
/// file's bytes on disk (size and ratio targets: header and alignment padding included) or the tensor
/// data bytes (bpw target: 8 · tensor bytes / weights, as llama-quantize prints BPW).
struct budget {
    target goal;
    double limit;                             // bytes the total may not exceed
    double fixed;                             // bytes that no choice changes
    std::vector<std::vector<double>> cost;    // [tensor][menu type] bytes
    int64_t n_weights;                        // every tensor's elements
    double min_total;                         // all-cheapest
    double max_total;                         // all-dearest

    /// fixed + Σ_t cost[t][choice[t]].
    double total(const std::vector<int> & choice) const;
    /// A total in the target's unit: bpw, bytes, or fraction of Q8_0.
    double in_target_unit(double total_bytes) const;
    double q8_0_bytes = 0;                    // the all-Q8_0 file's bytes (ratio targets)
    /// allocate_exact's byte grid when it must be another budget's (a pruned menu's knapsack on the full menus'
    /// grid, so that it is the full knapsack restricted to the kept types): grid_unit bytes per step, each tensor's
    /// costs counted from grid_base[t]. Unset (grid_unit 0): the grid of this budget's own menus.
    double grid_unit = 0;
    std::vector<double> grid_base;
};

/// Gives `pruned` (a budget over a subset of `full`'s menu types, same tensors and target) the byte grid of `full`:
/// allocate_exact(pruned, …) is then allocate_exact(full, …) restricted to the kept types (train/prune.h).
void share_grid(budget & pruned, const budget & full, int64_t grid = int64_t(1) << 16);

/// Builds the budget. Throws voodoo::error before any work when the target is outside the feasible
/// range, giving the range in the target's unit.
/// With check_range = false the range is not checked (a dry run reports it instead).
budget make_budget(const gguf_file & file, const std::vector<tensor_menu> & menus, const target & goal,
                   const export_options & opts, bool check_range = true);

/// The final choice: argmax of each tensor's probabilities, then an exact-budget repair. While the total
/// exceeds the limit, take the downgrade with the least estimated loss increase per byte saved; then,
/// while bytes are left, take the upgrade with the most estimated loss decrease per byte that still fits
/// (a move to a type of the same cost with a lower estimated loss, F16 ↔ BF16, first).
/// est_loss[t][k] estimates the task loss with tensor t as type k (only differences within a tensor
/// matter). The result never exceeds the limit. Throws voodoo::error when no choice fits (limit < min_total).
std::vector<int> finalize_choice(const budget & b, const std::vector<std::vector<double>> & probs,
                                 const std::vector<std::vector<double>> & est_loss);

/// The choice that minimizes Σ_t est_loss[t][k_t] subject to total ≤ limit: the multiple-choice knapsack,
/// solved exactly by dynamic programming over the bytes above the all-cheapest total, on a grid of
/// (max_total − min_total) / `grid` bytes with every cost rounded up (so the result never exceeds the limit,
/// and gives up at most n_tensors grid steps of the budget). The grid depends on the menus only, not on the
/// limit, so a larger limit never gives a higher Σ est_loss (the feasible set only grows). Ties keep the
/// cheaper type. Time O(n_tensors · K · grid), memory n_tensors · grid bytes. Throws voodoo::error when
/// limit < min_total or a menu has more than 255 types.
std::vector<int> allocate_exact(const budget & b, const std::vector<std::vector<double>> & est_loss,
                                int64_t grid = int64_t(1) << 16);

/// Σ_t est_loss[t][choice[t]].
double estimated_loss(const std::vector<std::vector<double>> & est_loss, const std::vector<int> & choice);

/// The recipe of a choice (menu index per tensor); tensors without a menu keep their source type.
recipe recipe_from_choice(const gguf_file & file, const std::vector<tensor_menu> & menus,
                          const std::vector<int> & choice, const std::vector<std::vector<double>> & probs,
                          const target & goal);

}  // namespace voodoo
