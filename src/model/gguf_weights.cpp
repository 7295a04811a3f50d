#include "model/gguf_weights.h"

#include "common/error.h"
#include "ggml/gguf.h"
#include "ggml/quant.h"
#include "ggml/types.h"

#include <vector>

namespace voodoo {

namespace {

std::vector<int64_t> torch_shape(const gguf_tensor & t) {
    std::vector<int64_t> sizes;
    for (int d = t.n_dims - 1; d >= 0; --d) {
        sizes.push_back(t.ne[d]);
    }
    return sizes;
}

bool is_float_type(ggml_type type) {
    return type == GGML_TYPE_F32 || type == GGML_TYPE_F16 || type == GGML_TYPE_BF16;
}

}  // namespace

torch::ScalarType torch_dtype_of(int ggml_type_id, const std::string & tensor_name) {
    const auto type = static_cast<ggml_type>(ggml_type_id);
    switch (type) {
        case GGML_TYPE_F32: return torch::kFloat;
        case GGML_TYPE_F16: return torch::kHalf;
        case GGML_TYPE_BF16: return torch::kBFloat16;
        default: break;
    }
    if (type < 0 || type >= GGML_TYPE_COUNT || !ggml_is_quantized(type) || !ggml_get_type_traits(type)->to_float) {
        fail("tensor '{}' is of type {}, which is not a weight type (expected F32, F16, BF16 or a quantized type)",
             tensor_name, type_name(type));
    }
    return torch::kFloat;
}

gguf_weights::gguf_weights(const gguf_file & file, torch::Device device, int n_threads,
                           std::optional<torch::ScalarType> matrix_dtype)
    : file_(file), device_(device), n_threads_(n_threads), matrix_dtype_(matrix_dtype) {}

bool gguf_weights::has(const std::string & name) const { return file_.find_tensor(name) != nullptr; }

torch::Tensor gguf_weights::host_tensor(const std::string & name) {
    const gguf_tensor & t = file_.tensor(name);
    const torch::ScalarType dtype = torch_dtype_of(t.type, name);
    const std::span<const uint8_t> bytes = file_.data(t);
    if (is_float_type(t.type)) {
        // The map is read-only; torch needs a non-const pointer but nothing here writes through it.
        return torch::from_blob(const_cast<uint8_t *>(bytes.data()), torch_shape(t), torch::TensorOptions().dtype(dtype));
    }
    torch::Tensor out = torch::empty(torch_shape(t), torch::kFloat);
    dequantize_into(t.type, bytes, t.ne[0], {out.data_ptr<float>(), static_cast<size_t>(out.numel())}, n_threads_,
                    name);
    return out;
}

std::vector<std::string> gguf_weights::tensors_read() const { return {read_.begin(), read_.end()}; }

torch::Tensor gguf_weights::get(const std::string & name) {
    if (auto it = cache_.find(name); it != cache_.end()) {
        return it->second;
    }
    const gguf_tensor & t = file_.tensor(name);
    read_.insert(name);
    torch::Tensor host = host_tensor(name);
    const bool convert = matrix_dtype_ && t.n_dims >= 2 && host.scalar_type() != *matrix_dtype_;
    if (device_.is_cpu() && is_float_type(t.type) && !convert) {
        return host;  // a view of the map: nothing to keep
    }
    torch::Tensor kept = host.to(device_, convert ? *matrix_dtype_ : host.scalar_type(), false, device_.is_cpu() && convert);
    cache_.emplace(name, kept);
    return kept;
}

torch::Tensor gguf_weights::rows(const std::string & name, const torch::Tensor & ids) {
    const gguf_tensor & t = file_.tensor(name);
    read_.insert(name);
    if (t.n_dims != 2) {
        fail("'{}': rows() of tensor '{}' needs a 2-D tensor, it has shape {}", file_.path(), name,
             shape_str(t.shape()));
    }
    torch::Tensor idx = ids.to(torch::kCPU, torch::kLong).contiguous();
    if (idx.numel() > 0) {
        const int64_t lo = idx.min().item<int64_t>();
        const int64_t hi = idx.max().item<int64_t>();
        if (lo < 0 || hi >= t.ne[1]) {
            fail("'{}': row id {} out of range for tensor '{}' of {} rows", file_.path(), lo < 0 ? lo : hi, name,
                 t.ne[1]);
        }
    }
    if (cache_.count(name) || is_float_type(t.type)) {
        torch::Tensor all = get(name);
        return all.index_select(0, idx.to(all.device()));
    }
    // Quantized and not kept: dequantize only the rows asked for.
    torch_dtype_of(t.type, name);
    const size_t row_size = ggml_row_size(t.type, t.ne[0]);
    const std::span<const uint8_t> bytes = file_.data(t);
    torch::Tensor out = torch::empty({idx.numel(), t.ne[0]}, torch::kFloat);
    const int64_t * id = idx.data_ptr<int64_t>();
    float * dst = out.data_ptr<float>();
    for (int64_t i = 0; i < idx.numel(); ++i) {
        dequantize_into(t.type, bytes.subspan(id[i] * row_size, row_size), t.ne[0],
                        {dst + i * t.ne[0], static_cast<size_t>(t.ne[0])}, 1, name);
    }
    return device_.is_cpu() ? out : out.to(device_);
}

}  // namespace voodoo
