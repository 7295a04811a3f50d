// Synthetic fixtures shared by the test processes of one ctest run.
#pragma once

#include "model/fixture.h"
#include "test_util.h"

#include <fmt/format.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <mutex>
#include <string>

namespace voodoo::test {

/// Every field of `s` as text: the cache key of cached_fixture. A field added to fixture_spec must be added here
/// too (the static_assert below fails when fixture_spec's size changes, as a reminder).
inline std::string fixture_spec_text(const fixture_spec & s) {
    static_assert(sizeof(fixture_spec) == 280, "fixture_spec changed: add its new fields to fixture_spec_text");
    return fmt::format(
        "{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{:a}|{:a}|{}|{}|{}|{:a}|{:a}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}", s.arch,
        s.n_embd, s.n_layer, s.n_head, s.n_head_kv, s.head_dim, s.n_ff, s.n_ctx_train, s.vocab_path,
        static_cast<int>(s.weight_type), s.seed, s.tied_output, s.rope_freq_base, s.rms_eps, s.n_rot, s.sliding_window,
        s.sliding_window_pattern, s.rope_freq_base_swa, s.final_logit_softcapping, s.rope_factors, s.n_ctx_orig,
        s.full_attention_interval, s.shortconv_l_cache, s.ssm_d_state, s.ssm_n_group, s.ssm_dt_rank, s.ssm_d_conv,
        s.n_expert, s.n_expert_used, s.n_ff_exp, s.n_ff_shexp);
}

/// The fixture of `spec` (write_fixture), written once and then read by every test that asks for the same spec.
/// Under ctest the file lives in $VOODOO_TEST_FIXTURES, a folder that one ctest run shares between its test processes
/// (tests/CMakeLists.txt empties it before the first test and removes it after the last): each architecture's
/// fixture (a real vocabulary of up to 248k tokens, 140-170 MB of F32) took 3 s of CPU to write, once per test
/// process. write_fixture writes atomically (temp file + rename), so processes that write the same spec at once
/// leave one whole file. Without that variable (the test binary run alone), a folder of this process's own.
/// Returns the file's path; a test must not change the file (it may copy it).
inline std::string cached_fixture(const fixture_spec & spec) {
    static std::mutex mutex;
    static std::map<std::string, std::string> paths;
    static temp_dir own;
    const std::string key = fixture_spec_text(spec);
    const std::lock_guard lock(mutex);
    if (const auto it = paths.find(key); it != paths.end()) {
        return it->second;
    }
    uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a of the key
    for (const char c : key) {
        h = (h ^ static_cast<uint8_t>(c)) * 0x100000001b3ull;
    }
    const char * shared = std::getenv("VOODOO_TEST_FIXTURES");
    const std::filesystem::path dir = shared && *shared ? std::filesystem::path(shared) : own.path;
    std::filesystem::create_directories(dir);
    const std::string path = (dir / fmt::format("{}-{:016x}.gguf", spec.arch, h)).string();
    if (!std::filesystem::exists(path)) {
        write_fixture(spec, path);
    }
    return paths.emplace(key, path).first->second;
}

}  // namespace voodoo::test
