// Export: a recipe written as an ordinary GGUF that stock llama.cpp runs, with the exact bytes
// llama-quantize would write for the same recipe (exactness contract, items 3 and 4).
#pragma once

#include "export/recipe.h"
#include "ggml/gguf.h"
#include "train/candidates.h"

#include <cstdint>
#include <string>

namespace voodoo {

struct export_options {
    const importance_map * importance = nullptr;   // per-tensor importance (in_sum2 / counts), or null
    std::string imatrix_file;                      // quantize.imatrix.file, when importance is given
    std::string imatrix_dataset;                   // quantize.imatrix.dataset ("" = not written)
    int64_t imatrix_chunks = 0;                    // quantize.imatrix.chunks_count (0 = not written)
    const candidate_cache * cache = nullptr;       // candidate bytes are taken from here when present
    std::string target;                            // voodoo.target, e.g. "size=304352" ("" = none)
    int n_threads = 0;                             // 0 = every core
};

struct export_result {
    std::string path;
    size_t file_bytes;          // the output's size on disk
    size_t tensor_bytes;        // Σ tensor data bytes
    int64_t n_weights;          // Σ elements over every tensor
    double bpw;                 // 8 · tensor_bytes / n_weights (llama-quantize's BPW)
    double q8_0_ratio;          // file_bytes / the all-Q8_0 file's bytes
};

/// The export options of an imatrix: its importance (into `importance`, which must outlive the options) and
/// the quantize.imatrix.* values llama-quantize writes. `recorded_path` is the file name written into the
/// GGUF (the path the recipe was trained with), so the header, and the file size, do not depend on how the
/// file is named at export time. Throws voodoo::error when the imatrix does not fit `model`.
export_options imatrix_export_options(const std::string & path, const std::string & recorded_path,
                                      const gguf_file & model, importance_map & importance);

/// The export options of an imatrix a run will make but has not made yet (quantize's imatrix stage), so that a file
/// can be sized before it exists: quantize.imatrix.file = `recorded_path`, .dataset = `dataset` (what the imatrix
/// will record: the first calibration text), .entries_count and .chunks_count (integers of fixed size, so their
/// values do not change the size; the options' importance is an empty map that only marks an imatrix as used).
export_options planned_imatrix_export_options(const std::string & recorded_path, const std::string & dataset);

/// The exact size on disk of the file export_gguf would write for `r` (metadata, tensor infos,
/// alignment padding, data). The provenance keys have fixed-size values, so this is exact before the
/// recipe is final. Throws like recipe_check.
size_t planned_file_bytes(const gguf_file & src, const recipe & r, const export_options & opts);

/// The size on disk of the all-Q8_0 file of src as llama-quantize makes it (Q8_0 where the block fits,
/// llama.cpp's fallback where it does not; non-selectable tensors as they are): the unit of --ratio.
size_t q8_0_file_bytes(const gguf_file & src, const export_options & opts);

/// `<dir>/<model>.Voodoo<NN>.gguf`, NN = round(100 · ratio) of the Q8_0 size.
std::string default_output_path(const std::string & dir, const gguf_file & src, double q8_0_ratio);

/// Writes src with every selectable tensor as its recipe type: every metadata key copied,
/// general.file_type set to the ftype of the recipe's bulk type, quantize.imatrix.* when an imatrix
/// is used, and voodoo.* provenance keys; tensors in source order with the source's alignment.
/// Memory holds a few tensors at a time. The file appears only when complete (atomic rename).
/// Throws voodoo::error: recipe for another model, a type that does not fit, out == src, a write
/// failure (full disk) — and then no output file exists.
export_result export_gguf(const gguf_file & src, const recipe & r, const std::string & out,
                          const export_options & opts);

}  // namespace voodoo
