// The dense weight_source: every tensor of a GGUF file as it is stored (the teacher's weights).
#pragma once

#include "model/weights.h"

#include <optional>
#include <string>
#include <functional>
#include <set>
#include <unordered_map>

namespace voodoo {

class gguf_file;

/// All tensors of a gguf_file. F32, F16 and BF16 tensors keep their dtype (the forward converts
/// them to its compute dtype where it uses them); on the CPU they are views of the file's memory map,
/// not copies, and so read-only: never modify a tensor this returns in place. Any quantized type
/// (Q8_0, Q4_K, IQ2_XS, …) is dequantized to f32 by ggml's own to_float (voodoo::dequantize), once,
/// and kept: a quantized file can serve as teacher. On another device every tensor is copied there
/// once and kept. The gguf_file must outlive this object and every tensor it returned.
class gguf_weights : public weight_source {
public:
    /// `n_threads` for dequantization (0 = all cores). `matrix_dtype` (e.g. kBFloat16 for a GPU teacher):
    /// tensors of two or more dimensions are kept in that dtype on the device (converted once), 1-D tensors
    /// (norms, biases) keep f32; unset keeps every tensor's own dtype.
    explicit gguf_weights(const gguf_file & file, torch::Device device = torch::kCPU, int n_threads = 0,
                          std::optional<torch::ScalarType> matrix_dtype = std::nullopt);

    /// [ne1, ne0] for 2-D tensors, [ne0] for 1-D, reversed ggml order in general. Throws voodoo::error
    /// naming the file and tensor when it is absent or of a type that is not a weight type (I8, I32, …).
    torch::Tensor get(const std::string & name) override;
    /// Rows `ids` ([n] int64, each < ne1) of a 2-D tensor as [n, ne0]; a quantized tensor dequantizes
    /// only these rows. Throws voodoo::error naming the tensor when an id is out of range.
    torch::Tensor rows(const std::string & name, const torch::Tensor & ids) override;
    bool has(const std::string & name) const override;

    const gguf_file & file() const { return file_; }

    /// The names of the tensors get() or rows() has served since construction, sorted: what this object read (a
    /// layer-sharded rank reads only its own layers', tests/test_dist.cpp).
    std::vector<std::string> tensors_read() const;

private:
    /// The tensor on the CPU: a view of the map (float types) or a dequantized copy.
    torch::Tensor host_tensor(const std::string & name);

    const gguf_file & file_;
    torch::Device device_;
    int n_threads_;
    std::optional<torch::ScalarType> matrix_dtype_;
    std::unordered_map<std::string, torch::Tensor> cache_;  // dequantized or device copies
    std::set<std::string> read_;                             // tensors_read()
};

/// The torch dtype ggml type `type` is kept as: kFloat, kHalf or kBFloat16 for F32/F16/BF16 (the same
/// bit layouts), kFloat for quantized types (dequantized). Throws voodoo::error for other types.
torch::ScalarType torch_dtype_of(int ggml_type_id, const std::string & tensor_name);

}  // namespace voodoo
