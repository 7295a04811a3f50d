// Shared helpers for the tests: where the shared data is, temporary folders, running the CLI.
#pragma once

#include "common/error.h"
#include "common/file.h"
#include "export/recipe.h"
#include "ggml/gguf.h"
#include "ggml/runtime.h"
#include "ggml/types.h"

#include <gtest/gtest.h>

#include <llama.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>

namespace voodoo::test {

/// ../shared/data beside the checkout, or $VOODOO_SHARED_DATA.
inline std::string shared_data() {
    if (const char * env = std::getenv("VOODOO_SHARED_DATA")) {
        return env;
    }
    return VOODOO_SHARED_DATA;
}

inline std::string stories260k() { return shared_data() + "/models/stories260K/stories260K.gguf"; }

#ifdef VOODOO_LLAMA_MODELS_DIR
/// llama.cpp's llama-spm vocabulary GGUF (32,000 tokens), the vocabulary of the synthetic llama fixtures.
inline std::string llama_spm_vocab() { return std::string(VOODOO_LLAMA_MODELS_DIR) + "/ggml-vocab-llama-spm.gguf"; }
#endif

/// A fresh empty folder under the system temp dir, removed when the object dies.
struct temp_dir {
    std::filesystem::path path;
    temp_dir() {
        std::string tmpl = (std::filesystem::temp_directory_path() / "voodoo-test-XXXXXX").string();
        path = mkdtemp(tmpl.data());
    }
    ~temp_dir() {
        voodoo::remove_tree(path.string());  // not std::filesystem::remove_all: see common/file.h
    }
    std::string file(const std::string & name) const { return (path / name).string(); }
};

struct run_result {
    int exit_code;
    std::string output;  // stdout and stderr together
};

/// Runs the voodoo CLI with arguments (a shell-quoted string) and captures its output (`stderr`: where stderr
/// goes, the same pipe as stdout by default).
inline run_result run_voodoo(const std::string & args, const std::string & stderr_to = "&1") {
    const std::string cmd = std::string(VOODOO_BIN) + " " + args + " 2>" + stderr_to;
    FILE * p = popen(cmd.c_str(), "r");
    run_result r{-1, {}};
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, p)) > 0) {
        r.output.append(buf, n);
    }
    const int status = pclose(p);
    r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    return r;
}

/// Runs a shell command line (bash -c) and captures its stdout (redirect stderr inside `cmd` to keep it).
inline run_result run_shell(const std::string & cmd) {
    std::string quoted = "'";
    for (const char c : cmd) {
        quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
    }
    quoted += "'";
    FILE * p = popen(("bash -c " + quoted).c_str(), "r");
    run_result r{-1, {}};
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, p)) > 0) {
        r.output.append(buf, n);
    }
    const int status = pclose(p);
    r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    return r;
}

/// Runs the voodoo CLI and captures its stdout alone (stderr, where progress goes, is dropped): for `--json -`.
inline run_result run_voodoo_stdout(const std::string & args) { return run_voodoo(args, "/dev/null"); }

/// n normal(0, 1) floats from a fixed seed.
inline std::vector<float> gaussian(size_t n, uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    std::vector<float> v(n);
    for (float & x : v) {
        x = dist(rng);
    }
    return v;
}

/// Both files hold the same tensors with the same types and the same bytes.
inline void expect_same_tensor_data(const std::string & a_path, const std::string & b_path) {
    voodoo::gguf_file a(a_path), b(b_path);
    ASSERT_EQ(a.tensors().size(), b.tensors().size());
    for (const voodoo::gguf_tensor & ta : a.tensors()) {
        const voodoo::gguf_tensor & tb = b.tensor(ta.name);
        EXPECT_EQ(voodoo::type_name(ta.type), voodoo::type_name(tb.type)) << ta.name;
        const auto da = a.data(ta), db = b.data(tb);
        ASSERT_EQ(da.size(), db.size()) << ta.name;
        EXPECT_EQ(std::memcmp(da.data(), db.data(), da.size()), 0) << ta.name << " differs";
    }
}

/// Copies the GGUF src to dst, letting `edit` change the metadata and leaving out the tensor named `skip`.
inline void rewrite_gguf(const std::string & src, const std::string & dst, const std::function<void(gguf_context *)> & edit,
                         const std::string & skip = {}) {
    const voodoo::gguf_file in(src);
    voodoo::gguf_writer out(dst, in.alignment());
    out.copy_kv(in);
    edit(out.ctx());
    for (const voodoo::gguf_tensor & t : in.tensors()) {
        if (t.name != skip) {
            out.add_tensor(t.name, t.type, t.shape());
        }
    }
    out.begin_data();
    for (const voodoo::gguf_tensor & t : in.tensors()) {
        if (t.name != skip) {
            out.write_tensor(t.name, in.data(t));
        }
    }
    out.commit();
}

/// The whole file as a string ("" when it cannot be read).
inline std::string read_file(const std::string & path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

/// The whole file as bytes (empty when it cannot be read).
inline std::vector<uint8_t> read_bytes(const std::string & path) {
    std::ifstream in(path, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

/// Writes text (any bytes) to path, replacing the file.
inline void write_file(const std::string & path, const std::string & text) {
    std::ofstream(path, std::ios::binary) << text;
}

/// Writes bytes to path, replacing the file.
inline void write_bytes(const std::string & path, const std::vector<uint8_t> & bytes) {
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char *>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

/// The message of the voodoo::error fn throws, "" when it throws none.
inline std::string error_of(const std::function<void()> & fn) {
    try {
        fn();
    } catch (const voodoo::error & e) {
        return e.what();
    }
    return "";
}

/// error_of(fn) with every file limited to `bytes` (RLIMIT_FSIZE, with SIGXFSZ ignored so that a write past it
/// fails with EFBIG, as on a full disk); the limit and the signal are restored before it returns.
inline std::string error_with_file_size_limit(rlim_t bytes, const std::function<void()> & fn) {
    struct rlimit old {};
    getrlimit(RLIMIT_FSIZE, &old);
    struct rlimit small = old;
    small.rlim_cur = bytes;
    signal(SIGXFSZ, SIG_IGN);
    if (setrlimit(RLIMIT_FSIZE, &small) != 0) {
        signal(SIGXFSZ, SIG_DFL);
        return "setrlimit(RLIMIT_FSIZE) failed";
    }
    const std::string msg = error_of(fn);
    setrlimit(RLIMIT_FSIZE, &old);
    signal(SIGXFSZ, SIG_DFL);
    return msg;
}

/// What `llama-quantize --tensor-type-file recipe.tensor-types.txt [--imatrix …] SRC OUT Q8_0` writes: the
/// recipe as anchored tensor-type overrides of llama_model_quantize. importance may be null.
inline bool llama_quantize_with_recipe(const std::string & src, const std::string & out, const voodoo::recipe & r,
                                       const std::unordered_map<std::string, std::vector<float>> * importance) {
    voodoo::llama_runtime_init();
    std::vector<std::string> patterns;
    for (const auto & t : r.tensors) {
        patterns.push_back(voodoo::anchored_pattern(t.name));
    }
    std::vector<llama_model_tensor_override> overrides;
    for (size_t i = 0; i < r.tensors.size(); ++i) {
        overrides.push_back({patterns[i].c_str(), r.tensors[i].type});
    }
    overrides.push_back({nullptr, GGML_TYPE_COUNT});
    std::vector<llama_model_imatrix_data> imatrix;
    if (importance) {
        for (const auto & [name, values] : *importance) {
            imatrix.push_back({name.c_str(), values.data(), values.size()});
        }
        imatrix.push_back({nullptr, nullptr, 0});
    }
    llama_model_quantize_params params = llama_model_quantize_default_params();
    params.ftype = LLAMA_FTYPE_MOSTLY_Q8_0;
    params.nthread = 2;
    params.tt_overrides = overrides.data();
    params.imatrix = importance ? imatrix.data() : nullptr;
    return llama_model_quantize(src.c_str(), out.c_str(), &params) == 0;
}

}  // namespace voodoo::test
