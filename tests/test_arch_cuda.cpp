// gemma3's sliding window on the GPU training path (CUDA builds: bf16 compute, PyTorch's fused attention
// with an explicit window mask). The CPU build compiles none of this; tests/test_arch.cpp checks the CPU path
// against libllama.
#if defined(VOODOO_HAVE_CUDA)

#include "ggml/gguf.h"
#include "model/fixture.h"
#include "model/gguf_weights.h"
#include "model/registry.h"
#include "test_util.h"

#include <gtest/gtest.h>

using namespace voodoo;

TEST(cuda_arch, gemma3_bf16_forward_on_the_gpu_keeps_the_sliding_window) {
    // 3 layers, two sliding over the last 4 positions: the bf16 GPU forward must be near the f32 CPU forward of
    // the same file, and far from the one of the file whose window spans the whole sequence.
    test::temp_dir dir;
    fixture_spec s;
    s.arch = "gemma3";
    s.vocab_path = std::string(VOODOO_LLAMA_MODELS_DIR) + "/ggml-vocab-llama-spm.gguf";
    s.tied_output = true;
    s.n_layer = 3;
    s.n_head_kv = 1;
    s.sliding_window = 4;
    s.sliding_window_pattern = 3;
    s.seed = 11;
    const std::string windowed = dir.file("w.gguf"), wide = dir.file("wide.gguf");
    write_fixture(s, windowed);
    s.sliding_window = 4096;
    write_fixture(s, wide);

    const torch::Tensor tokens = torch::arange(0, 128 * 7919, 7919, torch::kLong).remainder(32000).view({1, -1});
    auto cpu_logits = [&](const std::string & path) {
        const gguf_file file(path);
        auto model = build_model(file);
        gguf_weights w(file);
        torch::NoGradGuard no_grad;
        return model->forward(tokens, w)[0];
    };
    const torch::Tensor ref = cpu_logits(windowed), ref_wide = cpu_logits(wide);

    const gguf_file file(windowed);
    auto model = build_model(file);
    model->set_compute_dtype(torch::kBFloat16);
    gguf_weights w(file, torch::Device(torch::kCUDA, 0), 0, torch::kBFloat16);
    torch::Tensor gpu;
    {
        torch::NoGradGuard no_grad;
        gpu = model->forward(tokens.to(torch::kCUDA), w)[0].to(torch::kCPU);
    }
    const double scale = ref.abs().max().item<double>();
    const double rel = (gpu - ref).abs().max().item<double>() / scale;
    const double rel_wide = (gpu - ref_wide).abs().max().item<double>() / scale;
    RecordProperty("rel", std::to_string(rel));
    RecordProperty("rel_wide", std::to_string(rel_wide));
    EXPECT_LT(rel, 3e-2);
    EXPECT_GT(rel_wide, 3 * rel) << "rel " << rel;
}

#endif
