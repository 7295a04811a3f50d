// The imatrix libllama's graph gives (eval callback) against an independent computation: the LibTorch forward
// of the model runtime, whose matmul observer sums x² per input column of every weight on the same tokens.
#include "data/dataset.h"
#include "imatrix/collect.h"
#include "model/fixture.h"
#include "model/parity.h"
#include "test_util.h"
#include "tolerance.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>

namespace {

using voodoo::test::stories260k;
using voodoo::test::temp_dir;

// Collects the imatrix of `model` on 64 chunks of 64 tokens of TinyStories and checks every entry against the
// LibTorch forward's Σx²; returns the entries' names.
std::vector<std::string> cross_check(const std::string & model_path, const temp_dir & tmp) {
    {
        std::ifstream in(voodoo::test::shared_data() + "/text/tinystories/tinystories_val.txt", std::ios::binary);
        std::string text(30000, '\0');
        in.read(text.data(), static_cast<std::streamsize>(text.size()));
        text.resize(text.rfind("\n\n"));
        std::ofstream(tmp.file("stories.txt"), std::ios::binary) << text;
    }
    voodoo::data_options d;
    d.model = model_path;
    d.texts = {tmp.file("stories.txt")};
    d.ctx = 64;
    d.val_fraction = 0.0;
    d.out_dir = tmp.file("data");
    voodoo::prepare_data(d);
    constexpr int64_t n_chunks = 64;

    voodoo::imatrix_options o;
    o.model = model_path;
    o.data_dir = d.out_dir;
    o.max_chunks = n_chunks;
    o.n_threads = 1;  // ggml's spinning thread pool crawls on cores other tests share (docs/DATA.md)
    const voodoo::imatrix im = voodoo::collect_imatrix(o);
    EXPECT_EQ(im.chunk_count, n_chunks);

    // The same chunks through the LibTorch forward (collect_imatrix_torch: Σx² in f64, rounded to f32 once),
    // 8 chunks per forward as on a GPU.
    const voodoo::imatrix torch_im = voodoo::collect_imatrix_torch(o, torch::kCPU, 8 * d.ctx);
    EXPECT_EQ(torch_im.chunk_count, im.chunk_count);
    EXPECT_EQ(torch_im.chunk_size, im.chunk_size);
    EXPECT_EQ(torch_im.datasets, im.datasets);
    std::map<std::string, torch::Tensor> sums;
    std::map<std::string, int64_t> counts;
    for (const auto & [name, e] : torch_im.entries) {
        EXPECT_EQ(e.n_mat(), 1) << name;
        sums[name] = torch::tensor(e.in_sum2, torch::kDouble);
        counts[name] = e.counts[0];
    }
    EXPECT_EQ(sums.size(), im.entries.size());
    std::vector<std::string> names;
    double worst = 0.0;
    std::string worst_name;
    for (const auto & [name, e] : im.entries) {
        SCOPED_TRACE(name);
        names.push_back(name);
        if (!sums.contains(name)) {
            ADD_FAILURE() << "libllama collected " << name << ", which the LibTorch forward never multiplies";
            continue;
        }
        EXPECT_EQ(e.counts, std::vector<int64_t>({counts[name]}));
        const torch::Tensor ref = sums[name];
        if (ref.size(0) != e.ne0()) {
            ADD_FAILURE() << ref.size(0) << " columns in LibTorch, " << e.ne0() << " in the imatrix";
            continue;
        }
        const auto r = ref.accessor<double, 1>();
        for (int64_t j = 0; j < e.ne0(); ++j) {
            const double rel = std::abs(static_cast<double>(e.in_sum2[static_cast<size_t>(j)]) - r[j]) / r[j];
            if (rel > worst) {
                worst = rel;
                worst_name = name + " column " + std::to_string(j);
            }
        }
    }
    // libllama's collector sums count ≤ 4,096 positive x² per column sequentially in f32: relative error
    // ≤ γ_{count+1}; the LibTorch one sums in f64 and rounds once to f32 (2⁻²⁴). The activations come from two
    // forwards that agree within the F32 parity bound ε_p (parity_bound), so their squares' sums within
    // 2·ε_p + ε_p². It rejects a chunk left out (1/64 of every column).
    const double eps_p = voodoo::parity_bound("F32");
    const double bound = voodoo::test::gamma_n(n_chunks * d.ctx + 1) + std::ldexp(1.0, -24) +
                         2 * eps_p + eps_p * eps_p;
    EXPECT_LE(worst, bound) << "worst at " << worst_name;
    EXPECT_GT(1.0 / n_chunks, bound);
    std::printf("imatrix vs LibTorch: worst relative error per column %.3g (%s)\n", worst, worst_name.c_str());
    return names;
}

TEST(imatrix_cross_check, stories260k_on_64_tinystories_chunks_agrees_with_the_libtorch_forward_within_f32_summation_and_parity) {
    temp_dir tmp;
    const std::vector<std::string> names = cross_check(stories260k(), tmp);
    // Untied: the head is output.weight; token_embd is only looked up (get_rows), so it has no entry.
    EXPECT_NE(std::find(names.begin(), names.end(), "output.weight"), names.end());
    EXPECT_EQ(std::find(names.begin(), names.end(), "token_embd.weight"), names.end());
}

TEST(imatrix_cross_check, a_tied_head_gets_the_entry_of_its_matmul_under_token_embd) {
    temp_dir tmp;
    voodoo::fixture_spec spec;
    spec.vocab_path = std::string(VOODOO_LLAMA_MODELS_DIR) + "/ggml-vocab-llama-spm.gguf";
    spec.n_embd = 64;
    spec.n_layer = 2;
    spec.n_head = 2;
    spec.n_head_kv = 1;
    spec.head_dim = 32;
    spec.n_ff = 128;
    spec.tied_output = true;
    voodoo::write_fixture(spec, tmp.file("tied.gguf"));
    const std::vector<std::string> names = cross_check(tmp.file("tied.gguf"), tmp);
    // 7 matrices in each of 2 blocks and the head, read from token_embd.weight (64 columns: n_embd).
    EXPECT_EQ(names.size(), 7u * 2 + 1);
    EXPECT_NE(std::find(names.begin(), names.end(), "token_embd.weight"), names.end());
}

}  // namespace
