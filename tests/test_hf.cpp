// Hugging Face checkpoints in (issue #20): a model folder is converted once with llama.cpp's converter and then
// quantized like a GGUF; where Python or the converter's packages are missing, one error says what to install
// and what to run instead. The end-to-end test needs a Python with transformers, torch and sentencepiece (the GPU
// machine has them; scripts/device-run.sh hf runs it there) and is skipped elsewhere.
#include "pipeline/hf_source.h"
#include "test_util.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>

using namespace voodoo;
using namespace voodoo::test;
namespace fs = std::filesystem;

namespace {

/// A folder that looks like a checkpoint (config.json and a weights file) without being one: enough for every
/// check made before the converter runs.
void fake_checkpoint(const std::string & dir) {
    fs::create_directories(dir);
    write_file(dir + "/config.json", "{\"architectures\": [\"LlamaForCausalLM\"]}\n");
    write_file(dir + "/model.safetensors", "");
}

/// The exit code of `sh -c cmd` (output to stderr of this test).
int shell(const std::string & cmd) {
    const int status = std::system(cmd.c_str());
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
}

/// True when python3 here can import every module the converter and the checkpoint writer need.
bool python_has_converter_packages() {
    return shell("python3 -c 'import numpy, torch, transformers, yaml, sentencepiece' >/dev/null 2>&1") == 0;
}

}  // namespace

TEST(hf, without_python_one_error_says_what_to_install_and_what_to_run_instead) {
    temp_dir tmp;
    const std::string dir = tmp.file("tiny-llama");
    fake_checkpoint(dir);
    const std::string cmd = fmt::format("VOODOO_PYTHON=/nonexistent/python3 {} inspect {} --work {} 2>&1", VOODOO_BIN, dir,
                                        tmp.file("work"));
    FILE * p = popen(cmd.c_str(), "r");
    std::string out;
    char buf[4096];
    for (size_t n; (n = fread(buf, 1, sizeof buf, p)) > 0;) {
        out.append(buf, n);
    }
    const int status = pclose(p);
    EXPECT_EQ(WEXITSTATUS(status), 1) << out;
    EXPECT_NE(out.find(dir), std::string::npos) << out;                               // names the folder
    EXPECT_NE(out.find("'/nonexistent/python3' cannot be run"), std::string::npos) << out;  // what is missing
    EXPECT_NE(out.find("apt-get install python3"), std::string::npos) << out;          // what to install
    EXPECT_NE(out.find("requirements-convert_hf_to_gguf.txt"), std::string::npos) << out;
    EXPECT_NE(out.find("convert_hf_to_gguf.py " + dir + " --outtype bf16"), std::string::npos) << out;  // by hand
    EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << "one error line:\n" << out;
    EXPECT_FALSE(fs::exists(tmp.file("work"))) << "nothing is made before the converter can run";
}

TEST(hf, a_python_without_the_converters_packages_is_told_which_are_missing) {
    if (shell("command -v python3 >/dev/null") != 0) {
        GTEST_SKIP() << "no python3 here: the test above covers a missing interpreter";
    }
    if (python_has_converter_packages()) {
        GTEST_SKIP() << "python3 here has every package: the end-to-end test below runs instead";
    }
    temp_dir tmp;
    const std::string dir = tmp.file("tiny-llama");
    fake_checkpoint(dir);
    write_file(dir + "/tokenizer.model", "");  // asks for sentencepiece too
    const run_result r = run_voodoo(fmt::format("inspect {} --work {}", dir, tmp.file("work")));
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find("needs Python packages that python3 lacks: "), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("(needed: numpy, torch, transformers, yaml, sentencepiece)"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("-m pip install -r "), std::string::npos) << r.output;
    // The module python3 really lacks is the one named.
    const bool has_transformers = shell("python3 -c 'import transformers' >/dev/null 2>&1") == 0;
    const size_t lacks = r.output.find("lacks: "), needed = r.output.find("(needed:");
    ASSERT_NE(lacks, std::string::npos);
    EXPECT_EQ(r.output.substr(lacks, needed - lacks).find("transformers") != std::string::npos, !has_transformers) << r.output;
}

TEST(hf, a_folder_without_weights_or_without_config_is_refused_by_name) {
    temp_dir tmp;
    const std::string dir = tmp.file("no-weights");
    fs::create_directories(dir);
    write_file(dir + "/config.json", "{}\n");
    run_result r = run_voodoo(fmt::format("inspect {} --work {}", dir, tmp.file("work")));
    EXPECT_EQ(r.exit_code, 1);
    EXPECT_NE(r.output.find(dir + ": a Hugging Face folder (it has config.json) with no weights: expected *.safetensors"),
              std::string::npos) << r.output;
    const std::string plain = tmp.file("plain");
    fs::create_directories(plain);
    r = run_voodoo(fmt::format("quantize {} --text {} --like Q8_0 --work {}", plain,
                               shared_data() + "/text/tinystories/tinystories_val.txt", tmp.file("work")));
    EXPECT_EQ(r.exit_code, 1);
    EXPECT_NE(r.output.find(plain + ": a folder without config.json: give a GGUF file, or a Hugging Face model folder"),
              std::string::npos) << r.output;
}

TEST(hf, default_work_folder_is_named_after_the_model_as_quantize_names_it) {
    temp_dir tmp;
    const std::string dir = tmp.file("Tiny-Model-1B");
    fake_checkpoint(dir);
    EXPECT_EQ(default_work_folder(dir), "Tiny-Model-1B.voodoo");
    EXPECT_EQ(default_work_folder(dir + "/"), "Tiny-Model-1B.voodoo");
    EXPECT_EQ(default_work_folder("/a/b/mix30M.gguf"), "mix30M.voodoo");
}

TEST(hf, a_transformers_checkpoint_converts_once_and_quantizes_end_to_end) {
    if (!python_has_converter_packages()) {
        GTEST_SKIP() << "python3 here lacks transformers, torch or sentencepiece (the GPU machine has them: "
                        "scripts/device-run.sh hf)";
    }
    const std::string text = shared_data() + "/text/tinystories/tinystories_val.txt";
    for (const char * arch : {"llama", "qwen3"}) {
        SCOPED_TRACE(arch);
        temp_dir tmp;
        const std::string dir = tmp.file(fmt::format("tiny-{}", arch));
        ASSERT_EQ(shell(fmt::format("python3 {}/scripts/hf_checkpoint.py --arch {} --text {} --out {} >&2",
                                    VOODOO_SOURCE_DIR, arch, text, dir)), 0);
        const std::string work = tmp.file("work");
        const run_result q = run_voodoo(fmt::format(
            "quantize {} --text {} --like Q4_K_M --ctx 128 --eval-ctx 128 --eval-chunks 4 --steps 4 --batch 2 "
            "--probe-sequences 2 --select-sequences 2 --speed-reps 0 --work {} --json {}", dir, text, work, tmp.file("q.json")));
        ASSERT_EQ(q.exit_code, 0) << q.output;
        EXPECT_NE(q.output.find("converting the Hugging Face checkpoint to BF16 GGUF"), std::string::npos) << q.output;
        // The converted file: in the work folder, named after the checkpoint.
        std::string converted;
        for (const fs::directory_entry & e : fs::directory_iterator(work)) {
            if (e.path().filename().string().rfind("hf-", 0) == 0) {
                converted = (e.path() / fmt::format("tiny-{}.gguf", arch)).string();
            }
        }
        ASSERT_TRUE(fs::is_regular_file(converted)) << converted;
        // Equal to the one the same converter makes by hand.
        const std::string by_hand = tmp.file("by-hand.gguf");
        ASSERT_EQ(shell(fmt::format("python3 {} {} --outtype bf16 --outfile {} >/dev/null 2>&1", hf_converter_path(),
                                    dir, by_hand)), 0);
        EXPECT_TRUE(read_bytes(converted) == read_bytes(by_hand)) << converted << " differs from " << by_hand;
        // The Voodoo file and the stock one were evaluated in libllama (the comparison table names both).
        EXPECT_NE(q.output.find(fmt::format("tiny-{}.Voodoo", arch)), std::string::npos) << q.output;
        EXPECT_NE(q.output.find(fmt::format("tiny-{}-Q4_K_M.gguf", arch)), std::string::npos) << q.output;
        // A second command reuses the conversion.
        const run_result again = run_voodoo(fmt::format("inspect {} --work {}", dir, work));
        EXPECT_EQ(again.exit_code, 0) << again.output;
        EXPECT_NE(again.output.find("converted before, unchanged since"), std::string::npos) << again.output;
        EXPECT_EQ(again.output.find("converting the Hugging Face"), std::string::npos) << again.output;
    }
}
