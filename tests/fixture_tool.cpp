// voodoo-fixture: writes a synthetic GGUF (random weights, real tokenizer) for tests, benchmarks and the
// GPU machine. A test/bench tool, not part of the voodoo CLI.
#include "common/error.h"
#include "ggml/types.h"
#include "model/fixture.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>

int main(int argc, char ** argv) {
    CLI::App app{"voodoo-fixture: a synthetic GGUF of a given architecture and shape, random weights, real vocab"};
    app.footer("example (Qwen3-0.6B dimensions on the llama architecture, qwen2 vocab):\n"
               "  voodoo-fixture --vocab .deps/llama.cpp/models/ggml-vocab-qwen2.gguf --n-embd 1024 --n-layer 28 \\\n"
               "      --n-head 16 --n-head-kv 8 --head-dim 128 --n-ff 3072 --type bf16 -o qwen3-0.6b-shape.gguf");
    voodoo::fixture_spec s;
    std::string out;
    std::string type = "f32";
    app.add_option("-o,--output", out, "Output GGUF")->required();
    app.add_option("--vocab", s.vocab_path, "Vocab GGUF whose tokenizer.* keys are copied (ggml-vocab-*.gguf)")->required();
    app.add_option("--arch", s.arch, "Architecture: llama, qwen2, qwen3, gemma3, phi3, lfm2, qwen35, qwen3moe or qwen35moe")->capture_default_str();
    app.add_option("--n-embd", s.n_embd, "Model width")->capture_default_str();
    app.add_option("--n-layer", s.n_layer, "Layers")->capture_default_str();
    app.add_option("--n-head", s.n_head, "Attention heads")->capture_default_str();
    app.add_option("--n-head-kv", s.n_head_kv, "KV heads")->capture_default_str();
    app.add_option("--head-dim", s.head_dim, "Head size")->capture_default_str();
    app.add_option("--n-ff", s.n_ff, "FFN width")->capture_default_str();
    app.add_option("--type", type, "Type of the 2-D weights: f32, f16 or bf16")->capture_default_str();
    app.add_option("--seed", s.seed, "Random seed")->capture_default_str();
    app.add_flag("--tied", s.tied_output, "No output.weight: tie the head to token_embd");
    app.add_option("--rope-freq-base", s.rope_freq_base, "rope.freq_base")->capture_default_str();
    app.add_option("--rms-eps", s.rms_eps, "attention.layer_norm_rms_epsilon")->capture_default_str();
    app.add_option("--n-rot", s.n_rot, "Rotated dims per head (phi3; 0 = head size)")->capture_default_str();
    app.add_option("--sliding-window", s.sliding_window, "gemma3, lfm2: attention.sliding_window (0 = none)")->capture_default_str();
    app.add_option("--sliding-window-pattern", s.sliding_window_pattern, "gemma3: every n-th layer global (0 = llama.cpp's 6)")->capture_default_str();
    app.add_option("--rope-freq-base-swa", s.rope_freq_base_swa, "gemma3: rope base of the sliding layers")->capture_default_str();
    app.add_option("--softcap", s.final_logit_softcapping, "gemma3: final_logit_softcapping (0 = none)")->capture_default_str();
    app.add_flag("--rope-factors", s.rope_factors, "phi3: long/short rope factors, original_context_length --n-ctx-orig");
    app.add_option("--n-ctx-orig", s.n_ctx_orig, "phi3 with --rope-factors: rope.scaling.original_context_length")->capture_default_str();
    app.add_option("--full-attention-interval", s.full_attention_interval, "lfm2, qwen35: layer il attends when (il + 1) % n == 0, else it is recurrent")->capture_default_str();
    app.add_option("--shortconv-l-cache", s.shortconv_l_cache, "lfm2: shortconv.l_cache (kernel length)")->capture_default_str();
    app.add_option("--ssm-d-state", s.ssm_d_state, "qwen35: ssm.state_size (key and value head size)")->capture_default_str();
    app.add_option("--ssm-n-group", s.ssm_n_group, "qwen35: ssm.group_count (key heads)")->capture_default_str();
    app.add_option("--ssm-dt-rank", s.ssm_dt_rank, "qwen35: ssm.time_step_rank (value heads)")->capture_default_str();
    app.add_option("--ssm-d-conv", s.ssm_d_conv, "qwen35: ssm.conv_kernel")->capture_default_str();
    app.add_option("--n-expert", s.n_expert, "qwen3moe, qwen35moe: expert_count")->capture_default_str();
    app.add_option("--n-expert-used", s.n_expert_used, "qwen3moe, qwen35moe: expert_used_count (experts per token)")->capture_default_str();
    app.add_option("--n-ff-shexp", s.n_ff_shexp, "qwen35moe: expert_shared_feed_forward_length (0 = --n-ff)")->capture_default_str();
    app.add_option("--n-ff-exp", s.n_ff_exp, "qwen3moe, qwen35moe: expert_feed_forward_length (0 = --n-ff)")->capture_default_str();
    CLI11_PARSE(app, argc, argv);
    try {
        const bool moe = s.arch == "qwen3moe" || s.arch == "qwen35moe";
        for (const char * flag : {"--n-expert", "--n-expert-used", "--n-ff-exp", "--n-ff-shexp"}) {
            if (!moe && app.count(flag) > 0) {
                throw voodoo::error(fmt::format("{} is for the mixtures of experts (--arch qwen3moe or qwen35moe), not {}",
                                                flag, s.arch));
            }
        }
        if (s.arch != "qwen35moe" && app.count("--n-ff-shexp") > 0) {
            throw voodoo::error(fmt::format("--n-ff-shexp is qwen35moe's shared expert; {} has none", s.arch));
        }
        s.weight_type = voodoo::parse_type(type, "--type");
        voodoo::write_fixture(s, out);
        fmt::print("wrote {}\n", out);
    } catch (const voodoo::error & e) {
        fmt::print(stderr, "error: {}\n", e.what());
        return 1;
    }
    return 0;
}
