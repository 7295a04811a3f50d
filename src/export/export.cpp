#include "export/export.h"

#include "common/error.h"
#include "common/file.h"
#include "common/progress.h"
#include "ggml/selection.h"
#include "ggml/types.h"

#include <fmt/format.h>

#include <cmath>
#include <filesystem>
#include <map>

#ifndef VOODOO_VERSION
#define VOODOO_VERSION "0.0.0"
#endif

namespace voodoo {

namespace {

// The type of every tensor in the output: recipe types for the selectable ones, source types otherwise.
std::map<std::string, ggml_type> output_types(const gguf_file & src, const recipe & r) {
    std::map<std::string, ggml_type> types;
    for (const gguf_tensor & t : src.tensors()) {
        types[t.name] = t.type;
    }
    for (const recipe_tensor & rt : r.tensors) {
        types[rt.name] = rt.type;
    }
    return types;
}

// Sets the output's metadata. hash and bpw have fixed-size encodings so the header size never depends on them.
void set_output_metadata(gguf_context * ctx, const recipe & r, const export_options & opts, const std::string & hash,
                         float bpw) {
    gguf_set_val_u32(ctx, "general.file_type", static_cast<uint32_t>(llama_ftype_for(recipe_bulk_type(r))));
    gguf_set_val_u32(ctx, "general.quantization_version", GGML_QNT_VERSION);
    if (opts.importance) {
        gguf_set_val_str(ctx, "quantize.imatrix.file", opts.imatrix_file.c_str());
        if (!opts.imatrix_dataset.empty()) {
            gguf_set_val_str(ctx, "quantize.imatrix.dataset", opts.imatrix_dataset.c_str());
        }
        gguf_set_val_i32(ctx, "quantize.imatrix.entries_count", static_cast<int32_t>(opts.importance->size()));
        if (opts.imatrix_chunks > 0) {
            gguf_set_val_i32(ctx, "quantize.imatrix.chunks_count", static_cast<int32_t>(opts.imatrix_chunks));
        }
    }
    gguf_set_val_str(ctx, "voodoo.version", VOODOO_VERSION);
    gguf_set_val_str(ctx, "voodoo.recipe_hash", hash.c_str());
    gguf_set_val_f32(ctx, "voodoo.bpw", bpw);
    if (!opts.target.empty()) {
        gguf_set_val_str(ctx, "voodoo.target", opts.target.c_str());
    }
}

size_t file_bytes_for(const gguf_file & src, const std::map<std::string, ggml_type> & types, const recipe & r,
                      const export_options & opts) {
    gguf_context * ctx = gguf_init_empty();
    gguf_set_kv(ctx, src.ctx());
    set_output_metadata(ctx, r, opts, std::string(16, '0'), 0.0f);
    ggml_context * meta = ggml_init(ggml_init_params{ggml_tensor_overhead() * (src.tensors().size() + 1), nullptr, true});
    size_t data = 0;
    for (const gguf_tensor & t : src.tensors()) {
        const ggml_type type = types.at(t.name);
        ggml_tensor * g = ggml_new_tensor(meta, type, t.n_dims, t.ne.data());
        ggml_set_name(g, t.name.c_str());
        gguf_add_tensor(ctx, g);
        data += GGML_PAD(tensor_bytes(type, t.shape(), t.name), src.alignment());
    }
    // The header is padded to the alignment before the data section.
    const size_t header = GGML_PAD(gguf_get_meta_size(ctx), src.alignment());
    ggml_free(meta);
    gguf_free(ctx);
    return header + data;
}

}  // namespace

export_options imatrix_export_options(const std::string & path, const std::string & recorded_path,
                                      const gguf_file & model, importance_map & importance) {
    const imatrix im = read_imatrix(path);
    require_imatrix_fits(im, model, path);
    importance = imatrix_importance(im);
    export_options opts;
    opts.importance = &importance;
    opts.imatrix_file = recorded_path;
    opts.imatrix_dataset = im.datasets.empty() ? "" : im.datasets.front();
    opts.imatrix_chunks = im.chunk_count;
    return opts;
}

export_options planned_imatrix_export_options(const std::string & recorded_path, const std::string & dataset) {
    static const importance_map used;  // set_output_metadata writes the imatrix keys when importance is not null
    export_options opts;
    opts.importance = &used;
    opts.imatrix_file = recorded_path;
    opts.imatrix_dataset = dataset;
    opts.imatrix_chunks = 1;
    return opts;
}

size_t planned_file_bytes(const gguf_file & src, const recipe & r, const export_options & opts) {
    recipe_check(r, src);
    return file_bytes_for(src, output_types(src, r), r, opts);
}

size_t q8_0_file_bytes(const gguf_file & src, const export_options & opts) {
    recipe r = recipe_from_model(src);
    for (recipe_tensor & t : r.tensors) {
        t.type = llama_type_fallback(GGML_TYPE_Q8_0, t.shape[0]);
        t.bytes = tensor_bytes(t.type, t.shape, t.name);
    }
    return file_bytes_for(src, output_types(src, r), r, opts);
}

std::string default_output_path(const std::string & dir, const gguf_file & src, double q8_0_ratio) {
    std::string stem = std::filesystem::path(src.path()).stem().string();
    return (std::filesystem::path(dir) / fmt::format("{}.Voodoo{}.gguf", stem, std::lround(100.0 * q8_0_ratio)))
        .string();
}

export_result export_gguf(const gguf_file & src, const recipe & r, const std::string & out,
                          const export_options & opts) {
    recipe_check(r, src);
    if (same_file(out, src.path())) {
        fail("refusing to write '{}': it is the source model; choose another --out", out);
    }
    const auto types = output_types(src, r);

    size_t tensor_bytes_total = 0;
    int64_t n_weights = 0;
    for (const gguf_tensor & t : src.tensors()) {
        tensor_bytes_total += tensor_bytes(types.at(t.name), t.shape(), t.name);
        n_weights += t.n_elements();
    }
    const double bpw = n_weights ? 8.0 * static_cast<double>(tensor_bytes_total) / static_cast<double>(n_weights) : 0;

    gguf_writer w(out, src.alignment());
    w.copy_kv(src);
    set_output_metadata(w.ctx(), r, opts, recipe_hash(r), static_cast<float>(bpw));
    for (const gguf_tensor & t : src.tensors()) {
        w.add_tensor(t.name, types.at(t.name), t.shape());
    }
    w.begin_data();

    progress bar("export", static_cast<int64_t>(src.tensors().size()), "tensors");
    for (const gguf_tensor & t : src.tensors()) {
        const ggml_type type = types.at(t.name);
        if (type == t.type) {
            w.write_tensor(t.name, src.data(t));
        } else {
            const auto bytes = candidate_bytes(src, t, type, importance_for(opts.importance, t), opts.cache, {},
                                               opts.n_threads);
            w.write_tensor(t.name, bytes);
        }
        bar.add(1, t.name);
    }
    w.commit();
    bar.finish();

    export_result res;
    res.path = out;
    res.file_bytes = file_size(out);
    res.tensor_bytes = tensor_bytes_total;
    res.n_weights = n_weights;
    res.bpw = bpw;
    res.q8_0_ratio = static_cast<double>(res.file_bytes) / static_cast<double>(q8_0_file_bytes(src, opts));
    return res;
}

}  // namespace voodoo
