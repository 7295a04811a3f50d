#include "export/recipe.h"

#include "common/error.h"
#include "common/file.h"
#include "ggml/selection.h"
#include "ggml/types.h"

#include <llama.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <type_traits>

#include <fstream>

#define XXH_INLINE_ALL
#include <xxhash.h>

#ifndef VOODOO_VERSION
#define VOODOO_VERSION "0.0.0"
#endif

namespace voodoo {

recipe recipe_from_model(const gguf_file & file) {
    recipe r;
    r.model = file.path();
    r.architecture = file.architecture();
    for (const gguf_tensor & t : file.tensors()) {
        if (!tensor_is_selectable(t.name, t.n_dims)) {
            continue;
        }
        r.tensors.push_back({t.name, {t.shape().begin(), t.shape().end()}, t.type, t.type, t.n_bytes, {}});
    }
    return r;
}

void recipe_check(const recipe & r, const gguf_file & file) {
    std::map<std::string, const recipe_tensor *> by_name;
    for (const recipe_tensor & rt : r.tensors) {
        if (!by_name.emplace(rt.name, &rt).second) {
            fail("recipe lists tensor '{}' twice", rt.name);
        }
        const gguf_tensor * t = file.find_tensor(rt.name);
        if (!t) {
            fail("recipe tensor '{}' is not in '{}': the recipe was made for another model ('{}')", rt.name,
                 file.path(), r.model);
        }
        if (!std::equal(rt.shape.begin(), rt.shape.end(), t->shape().begin(), t->shape().end())) {
            fail("recipe tensor '{}' has shape {} but '{}' has {}: the recipe was made for another model", rt.name,
                 shape_str(rt.shape), file.path(), shape_str(t->shape()));
        }
        if (!tensor_is_selectable(t->name, t->n_dims)) {
            fail("recipe tensor '{}' is not a quantizable weight (norms, biases and 1-D tensors are copied as they are)",
                 rt.name);
        }
        type_info_of(rt.type);  // a storage type
        tensor_bytes(rt.type, rt.shape, rt.name);  // throws when the block does not fit ne0
    }
    for (const gguf_tensor & t : file.tensors()) {
        if (tensor_is_selectable(t.name, t.n_dims) && !by_name.count(t.name)) {
            fail("recipe has no type for tensor '{}' of '{}': the recipe was made for another model", t.name,
                 file.path());
        }
    }
}

nlohmann::json recipe_to_json(const recipe & r) {
    nlohmann::json tensors = nlohmann::json::array();
    size_t bytes = 0;
    int64_t weights = 0;
    for (const recipe_tensor & t : r.tensors) {
        nlohmann::json jt = {{"name", t.name},
                             {"shape", t.shape},
                             {"source_type", type_name(t.source_type)},
                             {"type", type_name(t.type)},
                             {"bytes", t.bytes}};
        if (!t.probs.empty()) {
            jt["probs"] = t.probs;
        }
        tensors.push_back(std::move(jt));
        bytes += t.bytes;
        weights += n_elements(t.shape);
    }
    return {{"voodoo_version", VOODOO_VERSION},
            {"model", r.model},
            {"architecture", r.architecture},
            {"target", r.target},
            {"imatrix", r.imatrix},
            {"recipe_hash", recipe_hash(r)},
            {"totals",
             {{"selectable_bytes", bytes},
              {"selectable_weights", weights},
              {"selectable_bpw", weights ? 8.0 * static_cast<double>(bytes) / static_cast<double>(weights) : 0.0}}},
            {"tensors", tensors}};
}

namespace {

template <typename T>
T field(const nlohmann::json & j, const char * key, const std::string & path, const std::string & where) {
    if (!j.is_object() || !j.contains(key)) {
        fail("recipe '{}': {} has no field '{}'", path, where, key);
    }
    // A float where a whole number belongs (1e128 as a dimension) is refused here: nlohmann's conversion would cast
    // it, which is undefined behaviour out of range (found by fuzz_recipe under UBSan).
    auto whole = [](const nlohmann::json & v) { return v.is_number_integer(); };
    if constexpr (std::is_integral_v<T>) {
        if (!whole(j.at(key))) {
            fail("recipe '{}': field '{}' of {} must be a whole number, got {}", path, key, where, j.at(key).dump());
        }
    } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
        if (j.at(key).is_array() && !std::all_of(j.at(key).begin(), j.at(key).end(), whole)) {
            fail("recipe '{}': field '{}' of {} must hold whole numbers, got {}", path, key, where,
                 j.at(key).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
        }
    }
    try {
        return j.at(key).get<T>();
    } catch (const nlohmann::json::exception &) {
        fail("recipe '{}': field '{}' of {} has the wrong type ({})", path, key, where, j.at(key).type_name());
    }
}

// An optional field: `fallback` when absent, else field<T> (the same checks and errors).
template <typename T>
T optional_field(const nlohmann::json & j, const char * key, T fallback, const std::string & path,
                 const std::string & where) {
    return j.is_object() && j.contains(key) ? field<T>(j, key, path, where) : fallback;
}

}  // namespace

recipe recipe_from_json(const nlohmann::json & j, const std::string & path) {
    recipe r;
    r.model = field<std::string>(j, "model", path, "the recipe");
    // Optional fields through the same checks: a wrong type is one error naming it, not an escaped exception
    // ("imatrix": [...] reached std::terminate: found by fuzz_recipe).
    r.architecture = optional_field<std::string>(j, "architecture", "", path, "the recipe");
    r.target = optional_field<std::string>(j, "target", "", path, "the recipe");
    r.imatrix = optional_field<std::string>(j, "imatrix", "", path, "the recipe");
    const auto tensors = field<nlohmann::json>(j, "tensors", path, "the recipe");
    if (!tensors.is_array()) {
        fail("recipe '{}': 'tensors' must be an array", path);
    }
    for (size_t i = 0; i < tensors.size(); ++i) {
        const auto & jt = tensors[i];
        const std::string where = fmt::format("tensor #{}", i);
        recipe_tensor t;
        t.name = field<std::string>(jt, "name", path, where);
        t.shape = field<std::vector<int64_t>>(jt, "shape", path, "tensor '" + t.name + "'");
        t.type = parse_type(field<std::string>(jt, "type", path, "tensor '" + t.name + "'"),
                            fmt::format("recipe '{}', tensor '{}'", path, t.name));
        t.source_type = jt.contains("source_type")
                            ? parse_type(field<std::string>(jt, "source_type", path, "tensor '" + t.name + "'"),
                                         fmt::format("recipe '{}'", path))
                            : t.type;
        if (t.shape.empty() || t.shape.size() > 4) {
            fail("recipe '{}': tensor '{}' has shape {}, expected 1 to 4 dimensions", path, t.name, shape_str(t.shape));
        }
        t.bytes = tensor_bytes(t.type, t.shape, t.name);
        if (jt.contains("probs")) {
            t.probs = field<std::map<std::string, double>>(jt, "probs", path, "tensor '" + t.name + "'");
        }
        r.tensors.push_back(std::move(t));
    }
    return r;
}

void recipe_save(const recipe & r, const std::string & path) {
    write_file_atomic(path, recipe_to_json(r).dump(2) + "\n");
}

recipe recipe_load(const std::string & path) {
    file_size(path);  // a clear error when missing
    std::ifstream in(path);
    nlohmann::json j;
    try {
        j = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception & e) {  // parse errors, and numbers out of range (found by fuzz_recipe)
        fail("recipe '{}' is not valid JSON: {}", path, e.what());
    }
    return recipe_from_json(j, path);
}

std::string anchored_pattern(std::string_view name) {
    std::string pattern = "^";
    for (char c : name) {
        if (c == '.') {
            pattern += '\\';
        }
        pattern += c;
    }
    return pattern + "$";
}

std::string recipe_tensor_types(const recipe & r) {
    std::string out;
    for (const recipe_tensor & t : r.tensors) {
        out += anchored_pattern(t.name) + "=" + type_name(t.type) + "\n";
    }
    return out;
}

std::string recipe_hash(const recipe & r) {
    std::string canon;
    for (const recipe_tensor & t : r.tensors) {
        canon += t.name + "=" + type_name(t.type) + "\n";
    }
    return fmt::format("{:016x}", XXH3_64bits(canon.data(), canon.size()));
}

int llama_ftype_for(ggml_type type) {
    switch (type) {
        case GGML_TYPE_F32: return LLAMA_FTYPE_ALL_F32;
        case GGML_TYPE_F16: return LLAMA_FTYPE_MOSTLY_F16;
        case GGML_TYPE_BF16: return LLAMA_FTYPE_MOSTLY_BF16;
        case GGML_TYPE_Q4_0: return LLAMA_FTYPE_MOSTLY_Q4_0;
        case GGML_TYPE_Q4_1: return LLAMA_FTYPE_MOSTLY_Q4_1;
        case GGML_TYPE_Q5_0: return LLAMA_FTYPE_MOSTLY_Q5_0;
        case GGML_TYPE_Q5_1: return LLAMA_FTYPE_MOSTLY_Q5_1;
        case GGML_TYPE_Q8_0: return LLAMA_FTYPE_MOSTLY_Q8_0;
        case GGML_TYPE_Q2_K: return LLAMA_FTYPE_MOSTLY_Q2_K;
        case GGML_TYPE_Q3_K: return LLAMA_FTYPE_MOSTLY_Q3_K_M;
        case GGML_TYPE_Q4_K: return LLAMA_FTYPE_MOSTLY_Q4_K_M;
        case GGML_TYPE_Q5_K: return LLAMA_FTYPE_MOSTLY_Q5_K_M;
        case GGML_TYPE_Q6_K: return LLAMA_FTYPE_MOSTLY_Q6_K;
        case GGML_TYPE_IQ2_XXS: return LLAMA_FTYPE_MOSTLY_IQ2_XXS;
        case GGML_TYPE_IQ2_XS: return LLAMA_FTYPE_MOSTLY_IQ2_XS;
        case GGML_TYPE_IQ2_S: return LLAMA_FTYPE_MOSTLY_IQ2_S;
        case GGML_TYPE_IQ3_XXS: return LLAMA_FTYPE_MOSTLY_IQ3_XXS;
        case GGML_TYPE_IQ3_S: return LLAMA_FTYPE_MOSTLY_IQ3_S;
        case GGML_TYPE_IQ1_S: return LLAMA_FTYPE_MOSTLY_IQ1_S;
        case GGML_TYPE_IQ1_M: return LLAMA_FTYPE_MOSTLY_IQ1_M;
        case GGML_TYPE_IQ4_NL: return LLAMA_FTYPE_MOSTLY_IQ4_NL;
        case GGML_TYPE_IQ4_XS: return LLAMA_FTYPE_MOSTLY_IQ4_XS;
        case GGML_TYPE_TQ1_0: return LLAMA_FTYPE_MOSTLY_TQ1_0;
        case GGML_TYPE_TQ2_0: return LLAMA_FTYPE_MOSTLY_TQ2_0;
        case GGML_TYPE_MXFP4: return LLAMA_FTYPE_MOSTLY_MXFP4_MOE;
        case GGML_TYPE_NVFP4: return LLAMA_FTYPE_MOSTLY_NVFP4;
        case GGML_TYPE_Q1_0: return LLAMA_FTYPE_MOSTLY_Q1_0;
        case GGML_TYPE_Q2_0: return LLAMA_FTYPE_MOSTLY_Q2_0;
        default: fail("no llama.cpp file type for ggml type {}", type_name(type));
    }
}

ggml_type recipe_bulk_type(const recipe & r) {
    std::map<ggml_type, int64_t> weights;
    for (const recipe_tensor & t : r.tensors) {
        weights[t.type] += n_elements(t.shape);
    }
    ggml_type best = GGML_TYPE_F32;
    int64_t best_n = -1;
    for (const auto & [type, n] : weights) {
        if (n > best_n || (n == best_n && type_info_of(type).bpw > type_info_of(best).bpw)) {
            best = type;
            best_n = n;
        }
    }
    return best;
}

}  // namespace voodoo
