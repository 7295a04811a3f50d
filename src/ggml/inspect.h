// `voodoo inspect`: what a GGUF holds and what Voodoo would choose among.
#pragma once

#include "ggml/gguf.h"

#include <nlohmann/json_fwd.hpp>

#include <string>
#include <vector>

namespace voodoo {

struct inspect_tensor {
    gguf_tensor tensor;
    bool selectable;                // tensor_is_selectable
    std::vector<ggml_type> menu;    // default_menu_for(ne0, has_imatrix, false); empty when not selectable
    bool float_only;                // selectable, but no block type fits ne0 (keeps F16/BF16/F32)
};

struct inspect_report {
    std::string path;
    std::string architecture;
    uint32_t version;
    size_t alignment;
    int64_t n_kv;
    size_t file_bytes;              // the file's size on disk
    size_t tensor_bytes;            // Σ tensor data bytes (no padding)
    int64_t n_weights;              // Σ elements over every tensor
    double bpw;                     // 8 · tensor_bytes / n_weights, as llama-quantize prints BPW
    int64_t n_selectable;
    int64_t n_selectable_weights;
    std::vector<inspect_tensor> tensors;
};

/// Builds the report of an open file; menus assume an imatrix is given when has_imatrix.
inspect_report inspect_gguf(const gguf_file & file, bool has_imatrix);

/// The report as a human-readable table.
std::string inspect_to_text(const inspect_report & report);

/// The report as JSON (sizes in bytes, shapes in ggml order).
nlohmann::json inspect_to_json(const inspect_report & report);

/// Every metadata key with its type and value (arrays shortened to max_array items) as text lines.
std::string metadata_to_text(const gguf_file & file, size_t max_array = 8);

}  // namespace voodoo
