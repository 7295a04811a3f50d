#include "ggml/inspect.h"

#include "ggml/selection.h"
#include "ggml/types.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <map>

namespace voodoo {

inspect_report inspect_gguf(const gguf_file & file, bool has_imatrix) {
    inspect_report r{};
    r.path = file.path();
    r.architecture = file.architecture();
    r.version = file.version();
    r.alignment = file.alignment();
    r.n_kv = file.n_kv();
    r.file_bytes = file.file_size();
    for (const gguf_tensor & t : file.tensors()) {
        inspect_tensor it{t, tensor_is_selectable(t.name, t.n_dims), {}, false};
        if (it.selectable) {
            it.menu = default_menu_for(t.ne[0], has_imatrix, false);
            it.float_only = std::none_of(it.menu.begin(), it.menu.end(),
                                         [](ggml_type ty) { return type_info_of(ty).is_quantized; });
            ++r.n_selectable;
            r.n_selectable_weights += t.n_elements();
        }
        r.tensor_bytes += t.n_bytes;
        r.n_weights += t.n_elements();
        r.tensors.push_back(std::move(it));
    }
    r.bpw = r.n_weights ? 8.0 * static_cast<double>(r.tensor_bytes) / static_cast<double>(r.n_weights) : 0.0;
    return r;
}

namespace {

std::string menu_str(const std::vector<ggml_type> & menu) {
    std::string s;
    for (ggml_type t : menu) {
        s += s.empty() ? "" : " ";
        s += type_name(t);
    }
    return s;
}

}  // namespace

std::string inspect_to_text(const inspect_report & r) {
    std::string out = fmt::format("{}\n  GGUF v{}, architecture '{}', {} tensors, {} metadata keys, alignment {}\n\n",
                                  r.path, r.version, r.architecture.empty() ? "?" : r.architecture,
                                  r.tensors.size(), r.n_kv, r.alignment);
    size_t w = 4;
    for (const inspect_tensor & t : r.tensors) {
        w = std::max(w, t.tensor.name.size());
    }
    out += fmt::format("  {:<{}}  {:<8} {:<22} {:>12}  {}\n", "name", w, "type", "shape", "bytes", "menu");
    std::map<std::string, int> float_only;
    for (const inspect_tensor & t : r.tensors) {
        std::string menu = t.selectable ? menu_str(t.menu) : "(copied as is)";
        if (t.float_only) {
            menu += fmt::format("  (no block type fits ne0 = {})", t.tensor.ne[0]);
        }
        out += fmt::format("  {:<{}}  {:<8} {:<22} {:>12}  {}\n", t.tensor.name, w, type_name(t.tensor.type),
                           shape_str(t.tensor.shape()), t.tensor.n_bytes, menu);
    }
    int64_t n_float_only = 0;
    for (const inspect_tensor & t : r.tensors) {
        n_float_only += t.float_only;
    }
    out += fmt::format("\n  file size     {} bytes ({:.3f} MiB)\n", r.file_bytes,
                       static_cast<double>(r.file_bytes) / (1024.0 * 1024.0));
    out += fmt::format("  tensor data   {} bytes, {} weights, {:.4f} BPW\n", r.tensor_bytes, r.n_weights, r.bpw);
    out += fmt::format("  selectable    {} of {} tensors ({} weights); {} without a block type (float types only)\n",
                       r.n_selectable, r.tensors.size(), r.n_selectable_weights, n_float_only);
    return out;
}

nlohmann::json inspect_to_json(const inspect_report & r) {
    nlohmann::json tensors = nlohmann::json::array();
    for (const inspect_tensor & t : r.tensors) {
        nlohmann::json menu = nlohmann::json::array();
        for (ggml_type ty : t.menu) {
            menu.push_back(type_name(ty));
        }
        tensors.push_back({{"name", t.tensor.name},
                           {"type", type_name(t.tensor.type)},
                           {"shape", std::vector<int64_t>(t.tensor.shape().begin(), t.tensor.shape().end())},
                           {"bytes", t.tensor.n_bytes},
                           {"offset", t.tensor.offset},
                           {"selectable", t.selectable},
                           {"float_only", t.float_only},
                           {"menu", menu}});
    }
    return {{"path", r.path},
            {"gguf_version", r.version},
            {"architecture", r.architecture},
            {"alignment", r.alignment},
            {"n_kv", r.n_kv},
            {"file_bytes", r.file_bytes},
            {"tensor_bytes", r.tensor_bytes},
            {"n_weights", r.n_weights},
            {"bpw", r.bpw},
            {"n_tensors", r.tensors.size()},
            {"n_selectable", r.n_selectable},
            {"n_selectable_weights", r.n_selectable_weights},
            {"tensors", tensors}};
}

std::string metadata_to_text(const gguf_file & file, size_t max_array) {
    std::string out;
    for (int64_t i = 0; i < file.n_kv(); ++i) {
        const gguf_type type = gguf_get_kv_type(file.ctx(), i);
        std::string type_str = gguf_type_name(type);
        std::string value = file.kv_json(i, max_array).dump();
        if (type == GGUF_TYPE_ARRAY) {
            const size_t n = gguf_get_arr_n(file.ctx(), i);
            type_str = fmt::format("{}[{}]", gguf_type_name(gguf_get_arr_type(file.ctx(), i)), n);
            if (n > max_array) {
                value.pop_back();
                value += fmt::format(", … {} more]", n - max_array);
            }
        }
        if (value.size() > 160) {
            value.resize(157);  // (GCC 12 warns of a bogus overflow for substr(…) + "…")
            value += "…";
        }
        out += fmt::format("  {:<44} {:<14} {}\n", gguf_get_key(file.ctx(), i), type_str, value);
    }
    return out;
}

}  // namespace voodoo
