// Importance matrices in llama.cpp's formats (docs/DATA.md): the GGUF imatrix that llama-imatrix writes
// today (`<tensor>.in_sum2`, `<tensor>.counts`, imatrix.* metadata) and the legacy `.dat`, so that an imatrix
// made by llama-imatrix works here and ours works in llama-quantize.
#pragma once

#include "ggml/gguf.h"

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <map>
#include <unordered_map>
#include <string>
#include <vector>

namespace voodoo {

/// One matmul weight's statistic.
struct imatrix_entry {
    /// [n_mat, ne0] row-major: Σx² over every activation row x that met the weight, per input column
    /// (n_mat = 1 for a 2-D weight, the number of experts for a 3-D MoE weight).
    /// Legacy `.dat` entries hold (Σx²/count)·ncall instead, as llama-imatrix wrote them.
    std::vector<float> in_sum2;
    /// [n_mat]: activation rows (tokens) summed per matrix; legacy entries hold {ncall}.
    std::vector<int64_t> counts;

    int64_t n_mat() const { return static_cast<int64_t>(counts.size()); }
    int64_t ne0() const { return counts.empty() ? 0 : static_cast<int64_t>(in_sum2.size()) / n_mat(); }
};

struct imatrix {
    std::map<std::string, imatrix_entry> entries;   // by GGUF weight name ("blk.0.attn_q.weight")
    std::vector<std::string> datasets;              // imatrix.datasets: the text the statistic came from
    int64_t chunk_count = 0;                        // imatrix.chunk_count: chunks of chunk_size tokens seen
    int64_t chunk_size = 0;                         // imatrix.chunk_size: tokens per chunk (0 in legacy files)
    bool legacy = false;                            // read from a `.dat`
};

/// Writes `im` as llama.cpp's GGUF imatrix (tools/imatrix/imatrix.cpp save_imatrix): general.type = "imatrix",
/// imatrix.datasets, imatrix.chunk_count, imatrix.chunk_size (u32), and per weight in name order
/// `<name>.in_sum2` F32 [ne0, n_mat] and `<name>.counts` F32 [1, n_mat]. Atomic.
/// Throws voodoo::error for a legacy imatrix (its raw sums are lost) or an inconsistent entry.
void write_imatrix_gguf(const std::string & path, const imatrix & im);

/// Reads an imatrix file: GGUF (starts with "GGUF") or legacy `.dat`, with llama.cpp's rules
/// (common/imatrix-loader.cpp). Throws voodoo::error naming the file: unreadable, truncated, an in_sum2 without
/// its counts, a non-F32 tensor, sizes that do not divide, non-finite values, no entries, or a GGUF without the
/// imatrix.* metadata (llama-quantize refuses those too).
imatrix read_imatrix(const std::string & path);

/// The per-column importance llama-quantize gives ggml_quantize_chunk for weight `name`, [n_mat · ne0]:
/// in_sum2 / count per matrix (count 0 → 1.0), or for a legacy file in_sum2 / ncall — the exact float
/// arithmetic of tools/quantize/quantize.cpp load_imatrix. Throws voodoo::error when `name` is absent.
std::vector<float> imatrix_column_importance(const imatrix & im, const std::string & name);

/// Per-tensor importance, as llama-quantize hands it to ggml_quantize_chunk: for each tensor name,
/// ne0 · n_experts values, in_sum2 / counts of llama.cpp's imatrix (tools/quantize/quantize.cpp load_imatrix).
using importance_map = std::unordered_map<std::string, std::vector<float>>;

/// imatrix_column_importance of every entry.
importance_map imatrix_importance(const imatrix & im);

/// How many experts of one expert tensor (an entry with n_mat > 1: a MUL_MAT_ID weight) the calibration reached.
struct expert_coverage {
    std::string name;                   // the tensor, e.g. "blk.0.ffn_up_exps.weight"
    int64_t n_experts = 0;              // n_mat
    int64_t n_reached = 0;              // experts with count > 0
    int64_t min_tokens = 0;             // fewest tokens routed to a reached expert (0 when none is reached)
    int64_t max_tokens = 0;             // most tokens routed to one expert
    std::vector<int64_t> unreached;     // the experts with count 0: llama-quantize gives them importance 1
    std::vector<int64_t> tokens;        // [n_experts]: the tokens routed to each expert (the imatrix's counts)
};

/// The coverage of every expert entry of `im`, in name order (empty for a dense model's imatrix). Legacy `.dat`
/// entries have no per-expert counts and are left out.
std::vector<expert_coverage> imatrix_expert_coverage(const imatrix & im);

/// The coverage as JSON, one object per expert tensor: name, n_experts, n_reached, min_tokens, max_tokens, unreached,
/// tokens (WORK/experts.json and `voodoo imatrix --json`).
nlohmann::json expert_coverage_json(const std::vector<expert_coverage> & coverage);

/// One line per layer: "blk.3: 46 of 48 experts reached (1–37 tokens each); never: 5, 17", taken from the layer's
/// first expert tensor (a layer's gate, up and down experts see the same routed tokens). Empty for no experts.
std::string expert_coverage_text(const std::vector<expert_coverage> & coverage);

/// Checks that every entry names a weight of `model` whose shape it fits: ne0 input columns and
/// ne2·ne3 matrices. Throws voodoo::error naming the imatrix (`what`), the tensor and both sizes otherwise —
/// an imatrix made for another model.
void require_imatrix_fits(const imatrix & im, const gguf_file & model, const std::string & what);

}  // namespace voodoo
