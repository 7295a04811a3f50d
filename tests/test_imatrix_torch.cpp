// The imatrix libllama's graph gives (eval callback) against an independent computation: the LibTorch forward
// of the model runtime, whose matmul observer sums x² per input column of every weight on the same tokens.
#include "data/dataset.h"
#include "ggml/gguf.h"
#include "imatrix/collect.h"
#include "model/gguf_weights.h"
#include "model/parity.h"
#include "model/registry.h"
#include "test_util.h"
#include "tolerance.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>
#include <map>

namespace {

using voodoo::test::stories260k;
using voodoo::test::temp_dir;

TEST(imatrix_cross_check, stories260k_on_64_tinystories_chunks_agrees_with_the_libtorch_forward_within_f32_summation_and_parity) {
    temp_dir tmp;
    {
        std::ifstream in(voodoo::test::shared_data() + "/text/tinystories/tinystories_val.txt", std::ios::binary);
        std::string text(30000, '\0');
        in.read(text.data(), static_cast<std::streamsize>(text.size()));
        text.resize(text.rfind("\n\n"));
        std::ofstream(tmp.file("stories.txt"), std::ios::binary) << text;
    }
    voodoo::data_options d;
    d.model = stories260k();
    d.texts = {tmp.file("stories.txt")};
    d.ctx = 64;
    d.val_fraction = 0.0;
    d.out_dir = tmp.file("data");
    voodoo::prepare_data(d);
    constexpr int64_t n_chunks = 64;

    voodoo::imatrix_options o;
    o.model = stories260k();
    o.data_dir = d.out_dir;
    o.max_chunks = n_chunks;
    o.n_threads = 1;  // ggml's spinning thread pool crawls on cores other tests share (docs/DATA.md)
    const voodoo::imatrix im = voodoo::collect_imatrix(o);
    ASSERT_EQ(im.chunk_count, n_chunks);

    // The same chunks through the LibTorch forward, Σx² accumulated in f64.
    const voodoo::token_data data(d.out_dir);
    std::vector<int64_t> ids;
    for (int64_t i = 0; i < n_chunks; ++i) {
        for (int32_t t : data.train().chunk(i)) {
            ids.push_back(t);
        }
    }
    const torch::Tensor tokens = torch::tensor(ids, torch::kLong).reshape({n_chunks, data.train().ctx()});
    const voodoo::gguf_file file(stories260k());
    auto model = voodoo::build_model(file);
    voodoo::gguf_weights w(file);
    std::map<std::string, torch::Tensor> sums;
    std::map<std::string, int64_t> counts;
    model->set_observer([&](const std::string & name, const torch::Tensor & x) {
        const torch::Tensor rows = x.reshape({-1, x.size(-1)}).to(torch::kDouble);
        const torch::Tensor s = rows.square().sum(0);
        sums[name] = sums.contains(name) ? sums[name] + s : s;
        counts[name] += rows.size(0);
    });
    {
        torch::NoGradGuard no_grad;
        model->forward(tokens, w);
    }

    ASSERT_EQ(sums.size(), im.entries.size());
    double worst = 0.0;
    std::string worst_name;
    for (const auto & [name, e] : im.entries) {
        SCOPED_TRACE(name);
        ASSERT_TRUE(sums.contains(name));
        EXPECT_EQ(e.counts, std::vector<int64_t>({counts[name]}));
        const torch::Tensor ref = sums[name];
        ASSERT_EQ(ref.size(0), e.ne0());
        const auto r = ref.accessor<double, 1>();
        for (int64_t j = 0; j < e.ne0(); ++j) {
            const double rel = std::abs(static_cast<double>(e.in_sum2[static_cast<size_t>(j)]) - r[j]) / r[j];
            if (rel > worst) {
                worst = rel;
                worst_name = name + " column " + std::to_string(j);
            }
        }
    }
    // Our collector sums count ≤ 4,096 positive x² per column sequentially in f32: relative error ≤ γ_{count+1}.
    // The activations come from two forwards that agree within the F32 parity bound ε_p (parity_bound),
    // so their squares' sums within 2·ε_p + ε_p². It rejects a chunk left out (1/64 of every column).
    const double eps_p = voodoo::parity_bound("F32");
    const double bound = voodoo::test::gamma_n(n_chunks * data.train().ctx() + 1) + 2 * eps_p + eps_p * eps_p;
    EXPECT_LE(worst, bound) << "worst at " << worst_name;
    EXPECT_GT(1.0 / n_chunks, bound);
    std::printf("imatrix vs LibTorch: worst relative error per column %.3g (%s)\n", worst, worst_name.c_str());
}

}  // namespace
