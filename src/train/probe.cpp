#include "train/probe.h"

#include "common/error.h"
#include "common/file.h"
#include "common/progress.h"
#include "ggml/types.h"
#include "model/replaced_weight.h"
#include "train/loss.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <unordered_map>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace voodoo {

namespace {

// The model in `dtype` (f32: the probe measures differences far below bf16's rounding) for the lifetime of
// this object.
class dtype_scope {
public:
    dtype_scope(causal_lm & m, torch::ScalarType dtype) : model_(m), saved_(m.compute_dtype()) {
        model_.set_compute_dtype(dtype);
    }
    ~dtype_scope() { model_.set_compute_dtype(saved_); }
    dtype_scope(const dtype_scope &) = delete;
    dtype_scope & operator=(const dtype_scope &) = delete;

private:
    causal_lm & model_;
    torch::ScalarType saved_;
};

std::vector<int64_t> torch_shape(const gated_tensor & g) {
    std::vector<int64_t> shape;
    for (int d = g.tensor->n_dims - 1; d >= 0; --d) {
        shape.push_back(g.tensor->ne[static_cast<size_t>(d)]);
    }
    return shape;
}

// `base` with any number of tensors answered by given ones: a whole one-hot recipe.
class chosen_weights : public weight_source {
public:
    explicit chosen_weights(weight_source & base) : base_(base) {}
    void set(const std::string & name, torch::Tensor w) { w_[name] = std::move(w); }
    torch::Tensor get(const std::string & name) override {
        const auto it = w_.find(name);
        return it != w_.end() ? it->second : base_.get(name);
    }
    torch::Tensor rows(const std::string & name, const torch::Tensor & ids) override {
        const auto it = w_.find(name);
        return it != w_.end() ? it->second.index_select(0, ids.reshape({-1})) : base_.rows(name, ids);
    }
    bool has(const std::string & name) const override { return base_.has(name); }

private:
    weight_source & base_;
    std::unordered_map<std::string, torch::Tensor> w_;
};

double kl_of(causal_lm & model, weight_source & w, const torch::Tensor & h_t, weight_source & teacher,
             const torch::Tensor & tokens, int64_t chunk) {
    return chunked_distill(model, model.hidden(tokens, w), w, h_t, teacher, tokens, 1.0, 0.0, chunk).kl;
}

}  // namespace

std::vector<std::vector<double>> probe_sensitivity(causal_lm & model, weight_source & dense, weight_source & teacher,
                                                   const std::vector<gated_tensor> & gated,
                                                   const torch::Tensor & tokens, torch::Device device, int64_t chunk,
                                                   torch::ScalarType dtype) {
    torch::NoGradGuard no_grad;
    dtype_scope scope(model, dtype);
    const torch::Tensor h_t = model.hidden(tokens, teacher);
    const double base = kl_of(model, dense, h_t, teacher, tokens, chunk);
    int64_t n_candidates = 0;
    for (const auto & g : gated) {
        n_candidates += static_cast<int64_t>(g.types.size());
    }
    progress bar("probe", n_candidates, "cand");
    replaced_weight swap(dense);  // the source model with one tensor as one candidate
    std::vector<std::vector<double>> out;
    for (const gated_tensor & g : gated) {
        std::vector<double> row;
        for (size_t k = 0; k < g.types.size(); ++k) {
            swap.set(g.tensor->name, candidate_weights(g, k, device).view(torch_shape(g)));
            row.push_back(kl_of(model, swap, h_t, teacher, tokens, chunk) - base);
            bar.add(1);
        }
        out.push_back(std::move(row));
    }
    bar.finish();
    return out;
}

std::string probe_identity(const std::vector<gated_tensor> & gated, const torch::Tensor & tokens,
                           torch::ScalarType dtype) {
    XXH3_state_t * st = XXH3_createState();
    XXH3_64bits_reset(st);
    const int32_t dt = static_cast<int32_t>(dtype);
    XXH3_64bits_update(st, &dt, sizeof dt);
    for (const gated_tensor & g : gated) {
        XXH3_64bits_update(st, g.tensor->name.data(), g.tensor->name.size());
        for (size_t k = 0; k < g.types.size(); ++k) {
            const int32_t type = g.types[k];
            XXH3_64bits_update(st, &type, sizeof type);
            XXH3_64bits_update(st, g.bytes[k].data(), g.bytes[k].size());
        }
    }
    const torch::Tensor t = tokens.to(torch::kCPU, torch::kLong).contiguous();
    XXH3_64bits_update(st, t.data_ptr<int64_t>(), static_cast<size_t>(t.numel()) * sizeof(int64_t));
    const int64_t shape[2] = {t.size(0), t.size(1)};
    XXH3_64bits_update(st, shape, sizeof shape);
    const uint64_t h = XXH3_64bits_digest(st);
    XXH3_freeState(st);
    return fmt::format("{:016x}", h);
}

void save_probe(const std::string & path, const std::string & identity, const std::vector<gated_tensor> & gated,
                const std::vector<std::vector<double>> & sens) {
    nlohmann::json tensors = nlohmann::json::array();
    for (size_t i = 0; i < gated.size(); ++i) {
        nlohmann::json kl = nlohmann::json::object();
        for (size_t k = 0; k < gated[i].types.size(); ++k) {
            kl[type_name(gated[i].types[k])] = sens[i][k];
        }
        tensors.push_back({{"name", gated[i].tensor->name}, {"delta_kl", kl}});
    }
    const nlohmann::json j = {{"identity", identity}, {"unit", "nats per token, f32"}, {"tensors", tensors}};
    write_file_atomic(path, j.dump(1) + "\n");
}

std::vector<std::vector<double>> load_probe(const std::string & path, const std::string & identity,
                                            const std::vector<gated_tensor> & gated) {
    std::ifstream in(path);
    if (!in) {
        return {};
    }
    nlohmann::json j;
    try {
        j = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception & e) {
        fail("probe file '{}' is not JSON ({}); delete it to measure again", path, e.what());
    }
    if (!j.is_object() || !j.contains("identity") || !j.contains("tensors") || !j["tensors"].is_array()) {
        fail("'{}' is not a probe file (no identity/tensors); delete it to measure again", path);
    }
    if (j["identity"] != identity || j["tensors"].size() != gated.size()) {
        return {};
    }
    std::vector<std::vector<double>> sens;
    for (size_t i = 0; i < gated.size(); ++i) {
        const nlohmann::json & t = j["tensors"][i];
        if (t.value("name", "") != gated[i].tensor->name) {
            return {};
        }
        std::vector<double> row;
        for (ggml_type type : gated[i].types) {
            const auto it = t["delta_kl"].find(type_name(type));
            if (it == t["delta_kl"].end() || !it->is_number()) {
                return {};
            }
            row.push_back(it->get<double>());
        }
        sens.push_back(std::move(row));
    }
    return sens;
}

double recipe_kl(causal_lm & model, weight_source & dense, weight_source & teacher,
                 const std::vector<gated_tensor> & gated, const std::vector<int> & choice,
                 const torch::Tensor & tokens, torch::Device device, int64_t chunk) {
    if (choice.size() != gated.size()) {
        fail("recipe_kl: {} choices for {} gated tensors", choice.size(), gated.size());
    }
    torch::NoGradGuard no_grad;
    dtype_scope f32(model, torch::kFloat);
    chosen_weights w(dense);
    for (size_t i = 0; i < gated.size(); ++i) {
        w.set(gated[i].tensor->name,
              candidate_weights(gated[i], static_cast<size_t>(choice[i]), device).view(torch_shape(gated[i])));
    }
    const torch::Tensor h_t = model.hidden(tokens, teacher);
    return kl_of(model, w, h_t, teacher, tokens, chunk);
}

}  // namespace voodoo
