// Synthetic models for tests and benchmarks (not a user feature): a GGUF of a given architecture and
// shape with random weights and a real tokenizer, that libllama loads and runs.
#pragma once

#include <ggml.h>

#include <cstdint>
#include <string>
#include <vector>

namespace voodoo {

struct fixture_spec {
    std::string arch = "llama";     // general.architecture; fixture_architectures() lists what is written
    int64_t n_embd = 256;
    int64_t n_layer = 2;
    int64_t n_head = 4;
    int64_t n_head_kv = 2;
    int64_t head_dim = 64;          // may differ from n_embd / n_head (written as attention.key/value_length)
    int64_t n_ff = 512;
    int64_t n_ctx_train = 4096;
    std::string vocab_path;         // a vocab GGUF, e.g. .deps/llama.cpp/models/ggml-vocab-llama-spm.gguf
    ggml_type weight_type = GGML_TYPE_F32;  // of the 2-D weights: F32, F16 or BF16; norms stay F32
    uint64_t seed = 1;
    bool tied_output = false;       // no output.weight: the head reuses token_embd.weight
    float rope_freq_base = 10000.0f;
    float rms_eps = 1e-5f;
};

/// The architectures write_fixture can write.
std::vector<std::string> fixture_architectures();

/// Writes the fixture to out_path (atomically). Weights: every 2-D tensor N(0, 1/sqrt(ne0)) (fan-in scale:
/// unit-size activations, attention far from uniform, logits of order 1), every norm 1 + N(0, 0.1).
/// Values depend only on (seed, tensor name, index), so a spec always gives the same bytes. Metadata:
/// every `<arch>.*` key libllama reads, general.file_type, and every `tokenizer.*` key of the vocab file
/// (n_vocab = its token count). Throws voodoo::error naming the field when the spec is invalid (unknown
/// arch, type not F32/F16/BF16, n_head not a multiple of n_head_kv, odd head_dim, vocab without tokens)
/// or when out_path is the vocab file.
void write_fixture(const fixture_spec & spec, const std::string & out_path);

}  // namespace voodoo
