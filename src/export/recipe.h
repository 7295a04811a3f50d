// A recipe: the type chosen for every selectable tensor of one model, with what it costs.
// Files (DESIGN.md "Files"): recipe.json and recipe.tensor-types.txt (llama-quantize --tensor-type-file).
#pragma once

#include "ggml/gguf.h"

#include <ggml.h>
#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace voodoo {

struct recipe_tensor {
    std::string name;
    std::vector<int64_t> shape;             // ggml order, ne0 first
    ggml_type source_type;
    ggml_type type;                         // the chosen type
    size_t bytes;                           // tensor_bytes(type, shape)
    std::map<std::string, double> probs;    // gate probabilities by type name (empty when not trained)
};

struct recipe {
    std::string model;                      // the source GGUF's path when the recipe was made
    std::string architecture;
    std::string target;                     // the budget as given: "size=304352", "bpw=4.5", "ratio=0.45"; "" = none
    std::string imatrix;                    // the imatrix file used, "" when none
    std::vector<recipe_tensor> tensors;     // selectable tensors, in source order
};

/// A recipe that keeps every selectable tensor of `file` as its source type.
recipe recipe_from_model(const gguf_file & file);

/// Checks the recipe fits `file`: every entry names a selectable tensor of the file with the same shape,
/// every selectable tensor has an entry, and every type is a storage type whose block fits ne0.
/// Throws voodoo::error naming the first tensor that does not and saying why.
void recipe_check(const recipe & r, const gguf_file & file);

/// recipe.json: {"voodoo_version", "model", "architecture", "target", "imatrix", "tensors": [{name, shape,
/// source_type, type, bytes, probs}], "totals": {...}} (totals are informative and recomputed on read).
nlohmann::json recipe_to_json(const recipe & r);
/// Parses recipe.json. Throws voodoo::error naming `path` and the field that is missing or wrong.
recipe recipe_from_json(const nlohmann::json & j, const std::string & path);

void recipe_save(const recipe & r, const std::string & path);
recipe recipe_load(const std::string & path);

/// The regular expression that matches exactly one tensor name: `^blk\.0\.attn_q\.weight$`.
std::string anchored_pattern(std::string_view name);

/// llama-quantize --tensor-type-file lines, one anchored pattern per tensor: `^blk\.0\.attn_q\.weight$=q4_K`.
std::string recipe_tensor_types(const recipe & r);

/// xxh3-64 (hex) of the tensor names and chosen types: identifies what the recipe makes.
std::string recipe_hash(const recipe & r);

/// The llama.cpp file type (llama_ftype) that names a file whose bulk type is `type`
/// (Q4_K → MOSTLY_Q4_K_M, Q8_0 → MOSTLY_Q8_0, F16 → MOSTLY_F16, …).
int llama_ftype_for(ggml_type type);

/// The type holding the most weights in the recipe (ties: the larger type).
ggml_type recipe_bulk_type(const recipe & r);

}  // namespace voodoo
