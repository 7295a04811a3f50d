#include "test_util.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <thread>

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

using voodoo::test::run_voodoo;

TEST(cli, inspect_lists_the_48_tensors_of_stories260k_and_the_total) {
    const auto r = run_voodoo("inspect " + voodoo::test::stories260k());
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("48 tensors"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("file size     1185376 bytes"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("blk.4.ffn_down.weight"), std::string::npos);
    EXPECT_NE(r.output.find("no block type fits ne0 = 172"), std::string::npos);
    size_t rows = 0;
    for (size_t pos = 0; (pos = r.output.find(" f32 ", pos)) != std::string::npos; ++pos) {
        ++rows;
    }
    EXPECT_EQ(rows, 48u);
}

TEST(cli, inspect_json_gives_sizes_bpw_and_menus) {
    const auto r = run_voodoo("inspect --json - " + voodoo::test::stories260k());
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const auto j = nlohmann::json::parse(r.output);
    EXPECT_EQ(j["n_tensors"], 48);
    EXPECT_EQ(j["file_bytes"], 1185376);
    int64_t bytes = 0, weights = 0, selectable = 0;
    for (const auto & t : j["tensors"]) {
        bytes += t["bytes"].get<int64_t>();
        int64_t n = 1;
        for (const auto & d : t["shape"]) {
            n *= d.get<int64_t>();
        }
        weights += n;
        selectable += t["selectable"].get<bool>();
        if (t["name"] == "blk.0.ffn_down.weight") {
            EXPECT_EQ(t["menu"], nlohmann::json::array({"f16", "bf16"}));
            EXPECT_TRUE(t["float_only"].get<bool>());
        }
        if (t["name"] == "blk.0.attn_norm.weight") {
            EXPECT_FALSE(t["selectable"].get<bool>());
        }
    }
    EXPECT_EQ(j["tensor_bytes"], bytes);
    EXPECT_EQ(j["n_weights"], weights);
    EXPECT_EQ(j["bpw"].get<double>(), 32.0);  // every tensor is F32: 8·(4·n)/n is exact in f64
    // token_embd, output and the 7 matrices of each of the 5 blocks.
    EXPECT_EQ(selectable, 2 + 7 * 5);
    EXPECT_EQ(j["n_selectable"], selectable);
}

TEST(cli, inspect_metadata_lists_every_key) {
    const auto r = run_voodoo("inspect --metadata " + voodoo::test::stories260k());
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("general.architecture"), std::string::npos);
    EXPECT_NE(r.output.find("tokenizer.ggml.tokens"), std::string::npos);
    EXPECT_NE(r.output.find("str[512]"), std::string::npos) << r.output;
}

TEST(cli, a_missing_file_is_one_error_line_and_exit_1) {
    const auto r = run_voodoo("inspect /nonexistent/model.gguf");
    EXPECT_EQ(r.exit_code, 1);
    EXPECT_EQ(r.output, "voodoo: error: cannot open '/nonexistent/model.gguf': No such file or directory\n");
}

TEST(cli, a_non_gguf_file_is_one_error_line_and_exit_1) {
    voodoo::test::temp_dir dir;
    const std::string path = dir.file("notes.txt");
    std::ofstream(path) << "hello";
    const auto r = run_voodoo("inspect " + path);
    EXPECT_EQ(r.exit_code, 1);
    EXPECT_EQ(r.output.rfind("voodoo: error: '" + path + "' is not a GGUF file", 0), 0u) << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
}

TEST(cli, help_shows_examples_and_unknown_flags_exit_nonzero) {
    const auto help = run_voodoo("--help");
    EXPECT_EQ(help.exit_code, 0);
    EXPECT_NE(help.output.find("voodoo inspect model.gguf"), std::string::npos) << help.output;
    const auto bad = run_voodoo("inspect --no-such-flag x.gguf");
    EXPECT_NE(bad.exit_code, 0);
    EXPECT_NE(bad.output.find("--no-such-flag"), std::string::npos) << bad.output;
    // quantize's help prints the GPU's defaults beside its flags, and names what a CPU run takes instead.
    const auto quantize = run_voodoo("quantize --help");
    EXPECT_EQ(quantize.exit_code, 0);
    EXPECT_NE(quantize.output.find("On the CPU (no --device cuda) a flag not given takes its cpu default instead: "
                                   "--probe-sequences 2"),
              std::string::npos)
        << quantize.output;
    EXPECT_NE(quantize.output.find("'all'"), std::string::npos) << quantize.output;  // --menu all
}

TEST(cli, doctor_reports_the_llama_cpp_release_and_libtorch) {
    const auto r = run_voodoo("doctor --json -");
    const auto j = nlohmann::json::parse(r.output);
    std::map<std::string, nlohmann::json> by_name;
    for (const auto & c : j) {
        by_name[c["name"]] = c;
    }
    EXPECT_NE(by_name["llama.cpp"]["value"].get<std::string>().find("v0.4.0"), std::string::npos);
    EXPECT_TRUE(by_name["ggml backends"]["ok"].get<bool>()) << by_name["ggml backends"].dump();
    EXPECT_FALSE(by_name["LibTorch"]["value"].get<std::string>().empty());
    // Exit code 1 exactly when a check failed.
    bool all_ok = true;
    for (const auto & c : j) {
        all_ok = all_ok && c["ok"].get<bool>();
    }
    EXPECT_EQ(r.exit_code, all_ok ? 0 : 1);
}

TEST(cli, doctor_fails_when_ggml_backend_path_gives_libllama_no_gpu) {
    // GGML_BACKEND_PATH asks for a GPU backend (scripts/llama-cuda.sh); ggml only logs one that did not load, so the
    // doctor says so, with what would work, and exits 1.
    const auto r = voodoo::test::run_shell("GGML_BACKEND_PATH=/nonexistent/libggml-cuda.so " + std::string(VOODOO_BIN) +
                                           " doctor 2>&1; echo rc=$?");
    EXPECT_NE(r.output.find("GGML_BACKEND_PATH='/nonexistent/libggml-cuda.so' gave libllama no GPU (no such file)"),
              std::string::npos) << r.output;
    EXPECT_NE(r.output.find("scripts/llama-cuda.sh"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("rc=1"), std::string::npos) << r.output;
}

TEST(cli, version_and_command_line_errors_follow_one_convention) {
    // Issue #21: --version, and a command line CLI11 cannot parse gets the same "voodoo: error:" line as every
    // other error, with exit code 2 (1: the job failed; 3: an internal error; 130: stopped by Ctrl-C).
    const auto v = run_voodoo("--version");
    EXPECT_EQ(v.exit_code, 0);
    EXPECT_EQ(v.output.rfind("voodoo 0.", 0), 0u) << v.output;
    EXPECT_NE(v.output.find("llama.cpp"), std::string::npos) << v.output;
    const std::string text = voodoo::test::shared_data() + "/text/tinystories/tinystories_val.txt";
    const auto bad = run_voodoo("quantize x.gguf --text " + text + " --like Q4_0 --no-such-flag");
    EXPECT_EQ(bad.exit_code, 2);
    EXPECT_EQ(bad.output.rfind("voodoo: error: ", 0), 0u) << bad.output;
    EXPECT_NE(bad.output.find("--no-such-flag"), std::string::npos) << bad.output;
    EXPECT_NE(bad.output.find("voodoo quantize --help"), std::string::npos) << bad.output;
    // A text file that is not there is refused by its flag, before anything is made, in every command that reads one.
    const std::string model = voodoo::test::stories260k();  // eval checks its GGUFs exist too
    for (const std::string & cmd : std::vector<std::string>{"quantize x.gguf --like Q4_0 --text", "data --model x.gguf --out d --text",
                                  "eval --reference " + model + " " + model + " --text", "check-parity x.gguf --text"}) {
        const auto missing = run_voodoo(cmd + " /nonexistent/calib.txt");
        EXPECT_EQ(missing.exit_code, 2) << cmd;
        EXPECT_NE(missing.output.find("--text: File does not exist: /nonexistent/calib.txt"), std::string::npos)
            << cmd << ": " << missing.output;
    }
    const auto eval_text = run_voodoo("quantize x.gguf --like Q4_0 --text " + text + " --eval-text /nonexistent/e.txt");
    EXPECT_EQ(eval_text.exit_code, 2);
    EXPECT_NE(eval_text.output.find("--eval-text: File does not exist"), std::string::npos) << eval_text.output;
    const auto none = run_voodoo("");
    EXPECT_EQ(none.exit_code, 2);
    EXPECT_EQ(none.output.rfind("voodoo: error: give a command", 0), 0u) << none.output;
}

TEST(cli, quantize_takes_the_model_as_llama_cpp_does_and_refuses_a_bad_target_before_making_anything) {
    voodoo::test::temp_dir dir;
    const std::string text = voodoo::test::shared_data() + "/text/tinystories/tinystories_val.txt";
    const auto r = run_voodoo("quantize -m " + voodoo::test::stories260k() + " --text " + text +
                              " --target-size 1KB --work " + dir.file("w"));
    EXPECT_EQ(r.exit_code, 1);
    EXPECT_EQ(r.output.rfind("voodoo: error: target size=1000 is outside", 0), 0u) << r.output;
    EXPECT_NE(r.output.find("MiB"), std::string::npos) << r.output;
    EXPECT_FALSE(std::filesystem::exists(dir.file("w")));
    // An output path that is the source is refused before any work too (it was refused only at export).
    const auto onto_source = run_voodoo("quantize -m " + voodoo::test::stories260k() + " --text " + text +
                                        " --like Q4_0 -o " + voodoo::test::stories260k() + " --work " + dir.file("w"));
    EXPECT_EQ(onto_source.exit_code, 1) << onto_source.output;
    EXPECT_NE(onto_source.output.find("is the source model: Voodoo never writes over its source"), std::string::npos)
        << onto_source.output;
    EXPECT_FALSE(std::filesystem::exists(dir.file("w")));
    // So are an --out in a missing folder (it failed at export, after the training) and a --work under a regular file,
    // by a dry run as by the run (a dry run passed both): the error names the flag.
    const auto no_folder = run_voodoo("quantize -m " + voodoo::test::stories260k() + " --text " + text +
                                      " --like Q4_0 -o " + dir.file("nodir/x.gguf") + " --work " + dir.file("w"));
    EXPECT_EQ(no_folder.exit_code, 1) << no_folder.output;
    EXPECT_NE(no_folder.output.find("--out '" + dir.file("nodir/x.gguf") + "': its folder '" + dir.file("nodir") +
                                    "' does not exist"), std::string::npos) << no_folder.output;
    EXPECT_FALSE(std::filesystem::exists(dir.file("w")));
    voodoo::test::write_bytes(dir.file("a-file"), std::vector<uint8_t>{1});
    for (const std::string dry : {"", " --dry-run"}) {
        const auto under_file = run_voodoo("quantize -m " + voodoo::test::stories260k() + " --text " + text +
                                           " --like Q4_0 --work " + dir.file("a-file/w") + dry);
        EXPECT_EQ(under_file.exit_code, 1) << under_file.output;
        EXPECT_NE(under_file.output.find("--work '" + dir.file("a-file/w") + "' cannot be made: '" + dir.file("a-file") +
                                         "' is a file, not a folder"), std::string::npos) << under_file.output;
    }
    const auto bad_like = run_voodoo("quantize -m " + voodoo::test::stories260k() + " --text " + text +
                                     " --like Q4_K_X --dry-run");
    EXPECT_EQ(bad_like.exit_code, 1) << bad_like.output;
    EXPECT_NE(bad_like.output.find("--like: unknown recipe 'Q4_K_X'"), std::string::npos) << bad_like.output;
    const auto both = run_voodoo("quantize a.gguf -m b.gguf --text " + text + " --like Q4_0");
    EXPECT_EQ(both.exit_code, 2) << both.output;
    // A flag naming a missing file is a command-line error (README, "Exit codes"), -m as --text.
    const auto missing = run_voodoo("quantize -m " + dir.file("nosuch.gguf") + " --text " + text + " --like Q4_0");
    EXPECT_EQ(missing.exit_code, 2) << missing.output;
    EXPECT_NE(missing.output.find("nosuch.gguf"), std::string::npos) << missing.output;
    // llama.cpp's short flags: -o for the output file, -t for the threads (whole numbers >= 0).
    const auto short_flags = run_voodoo("quantize -m " + voodoo::test::stories260k() + " --text " + text +
                                        " --target-size 1KB -o " + dir.file("x.gguf") + " -t 1 --work " + dir.file("w"));
    EXPECT_EQ(short_flags.exit_code, 1) << short_flags.output;
    EXPECT_EQ(short_flags.output.rfind("voodoo: error: target size=1000 is outside", 0), 0u) << short_flags.output;
    const auto bad_threads = run_voodoo("quantize -m " + voodoo::test::stories260k() + " --text " + text +
                                        " --like Q4_0 -t -2 --ggml-threads -1");
    EXPECT_EQ(bad_threads.exit_code, 2) << bad_threads.output;
    const auto out_and_dir = run_voodoo("quantize -m " + voodoo::test::stories260k() + " --text " + text +
                                        " --like Q4_0 -o a.gguf --out-dir " + dir.file("d"));
    EXPECT_EQ(out_and_dir.exit_code, 2) << out_and_dir.output;
    EXPECT_NE(out_and_dir.output.find("excludes"), std::string::npos) << out_and_dir.output;
    EXPECT_NE(bad_threads.output.find("-2"), std::string::npos) << bad_threads.output;
    // --prune-stages takes 1, 2 or auto, in quantize and train alike; anything else names the flag, before any work.
    for (const std::string cmd : {"quantize -m " + voodoo::test::stories260k() + " --text " + text + " --like Q4_0 --work " + dir.file("s"),
                                  "train --model " + voodoo::test::stories260k() + " --data " + dir.file("d") +
                                      " --target-bpw 7 --out " + dir.file("r")}) {
        const auto stages = run_voodoo(cmd + " --prune-stages 3");
        EXPECT_EQ(stages.exit_code, 2) << cmd << "\n" << stages.output;
        EXPECT_NE(stages.output.find("--prune-stages: 3 not in {auto,1,2}"), std::string::npos) << stages.output;
        EXPECT_FALSE(std::filesystem::exists(dir.file("s")));
        EXPECT_FALSE(std::filesystem::exists(dir.file("r")));
    }
    // With every candidate built there is nothing to prune: --prune-stages given then says it does nothing.
    const auto all = run_voodoo("quantize -m " + voodoo::test::stories260k() + " --text " + text +
                                " --like Q4_0 --candidates all --prune-stages 2 --build-ahead on --dry-run --work " + dir.file("s"));
    EXPECT_EQ(all.exit_code, 0) << all.output;
    EXPECT_NE(all.output.find("warning: --prune-stages has no effect with --candidates all"), std::string::npos) << all.output;
    EXPECT_NE(all.output.find("warning: --build-ahead has no effect with --candidates all"), std::string::npos) << all.output;
    EXPECT_EQ(all.output.find("of the second stage"), std::string::npos) << all.output;
    // --greedy-peer builds every candidate too: its dry run plans no second stage either.
    const auto peer = run_voodoo("quantize -m " + voodoo::test::stories260k() + " --text " + text +
                                 " --like Q4_0 --greedy-peer --prune-stages 2 --dry-run --work " + dir.file("s"));
    EXPECT_EQ(peer.exit_code, 0) << peer.output;
    EXPECT_NE(peer.output.find("warning: --prune-stages has no effect with --greedy-peer"), std::string::npos) << peer.output;
    EXPECT_EQ(peer.output.find("of the second stage"), std::string::npos) << peer.output;
    // With the targets' candidates the dry run counts the second stage's forwards in its probe estimate.
    const auto staged = run_voodoo("quantize -m " + voodoo::test::stories260k() + " --text " + text +
                                   " --like Q4_0 --prune-stages 2 --dry-run --work " + dir.file("s"));
    EXPECT_EQ(staged.exit_code, 0) << staged.output;
    EXPECT_NE(staged.output.find("of the second stage of pruning, --prune-stages 2"), std::string::npos) << staged.output;
    EXPECT_FALSE(std::filesystem::exists(dir.file("s")));
    // A dry run of a target the run would refuse prints its plan, then exits 1 naming the target: a script's check.
    const auto dry_outside = run_voodoo("quantize -m " + voodoo::test::stories260k() + " --text " + text +
                                        " --target-size 1KB,400KB --dry-run --work " + dir.file("s"));
    EXPECT_EQ(dry_outside.exit_code, 1) << dry_outside.output;
    EXPECT_NE(dry_outside.output.find("OUTSIDE the range"), std::string::npos) << dry_outside.output;
    EXPECT_NE(dry_outside.output.find("voodoo: error: --dry-run: size=1000 outside the feasible sizes"), std::string::npos)
        << dry_outside.output;
    EXPECT_EQ(dry_outside.output.find("size=409600 outside"), std::string::npos) << dry_outside.output;
    EXPECT_FALSE(std::filesystem::exists(dir.file("s")));
}

TEST(cli, json_goes_to_the_file_named_or_to_stdout_for_a_dash_and_threads_are_dash_t_everywhere) {
    // Issue #21: --json FILE in every command that reports, - for stdout; -t the threads, as in llama.cpp's tools.
    voodoo::test::temp_dir dir;
    const std::string model = voodoo::test::stories260k();
    const auto to_file = run_voodoo("inspect " + model + " --json " + dir.file("sub/inspect.json"));
    ASSERT_EQ(to_file.exit_code, 0) << to_file.output;
    EXPECT_NE(to_file.output.find("48 tensors"), std::string::npos) << "the text report stays on stdout";
    const auto j = nlohmann::json::parse(voodoo::test::read_file(dir.file("sub/inspect.json")));
    EXPECT_EQ(j, nlohmann::json::parse(run_voodoo("inspect --json - " + model).output));
    const auto parity = run_voodoo("check-parity " + model + " --tokens 16 -t 1 --json " + dir.file("parity.json"));
    EXPECT_EQ(parity.exit_code, 0) << parity.output;
    EXPECT_TRUE(nlohmann::json::parse(voodoo::test::read_file(dir.file("parity.json"))).contains("within"));
    const auto no_value = run_voodoo("inspect " + model + " --json");
    EXPECT_EQ(no_value.exit_code, 2) << no_value.output;
    EXPECT_NE(no_value.output.find("--json"), std::string::npos) << no_value.output;
    const auto data = run_voodoo("data -m " + model + " -t 2 --text x.txt --out " + dir.file("d"));
    EXPECT_EQ(data.exit_code, 2) << "voodoo data has no threads: -t is not its text any more\n" << data.output;
}

TEST(cli, metadata_that_is_not_utf8_is_written_as_json_and_a_recipe_with_a_huge_number_is_one_error) {
    // Both found by the fuzzers (scripts/fuzz.sh): the first aborted `inspect --json`, the second escaped as an
    // internal error.
    voodoo::test::temp_dir dir;
    const std::string bad = dir.file("bad-utf8.gguf");
    voodoo::test::rewrite_gguf(voodoo::test::stories260k(), bad,
                               [](gguf_context * c) { gguf_set_val_str(c, "general.name", "st\xF9ries"); });
    const auto r = run_voodoo("inspect --metadata --json - " + bad);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const auto j = nlohmann::json::parse(r.output);
    EXPECT_EQ(j["metadata"]["general.name"], "st\xEF\xBF\xBDries");  // U+FFFD for the invalid byte
    voodoo::test::write_file(dir.file("recipe.json"), "{\"tensors\": [1e664808676]}");
    const auto e = run_voodoo("export --model " + voodoo::test::stories260k() + " --recipe " + dir.file("recipe.json") +
                              " --out " + dir.file("out.gguf"));
    EXPECT_EQ(e.exit_code, 1) << e.output;
    EXPECT_NE(e.output.find("is not valid JSON"), std::string::npos) << e.output;
    // A float where a dimension belongs: refused, not cast (undefined behaviour under UBSan).
    auto j2 = nlohmann::json::parse(R"({"model": "m.gguf", "tensors": [{"name": "output.weight", "shape": [1e128, 64],
                                       "source_type": "f32", "type": "q8_0"}]})");
    voodoo::test::write_file(dir.file("recipe2.json"), j2.dump());
    const auto e2 = run_voodoo("export --model " + voodoo::test::stories260k() + " --recipe " + dir.file("recipe2.json") +
                               " --out " + dir.file("out.gguf"));
    EXPECT_EQ(e2.exit_code, 1) << e2.output;
    EXPECT_NE(e2.output.find("must hold whole numbers"), std::string::npos) << e2.output;
    // Optional fields of the wrong type: "imatrix" as an array reached std::terminate (fuzz_recipe, 332,069 inputs
    // into the long run); a tensor's "source_type" or "probs" likewise.
    for (const char * bad : {R"("imatrix": ["x"])", R"("target": 5)", R"("architecture": {})"}) {
        voodoo::test::write_file(dir.file("recipe3.json"),
                                 std::string(R"({"model": "m.gguf", )") + bad +
                                     R"(, "tensors": [{"name": "output.weight", "shape": [64, 512], "type": "q8_0"}]})");
        const auto e3 = run_voodoo("export --model " + voodoo::test::stories260k() + " --recipe " + dir.file("recipe3.json") +
                                   " --out " + dir.file("out.gguf"));
        EXPECT_EQ(e3.exit_code, 1) << bad << "\n" << e3.output;
        EXPECT_NE(e3.output.find("has the wrong type"), std::string::npos) << e3.output;
    }
    for (const char * bad : {R"("source_type": 7)", R"("probs": "q8_0")"}) {
        voodoo::test::write_file(dir.file("recipe4.json"),
                                 std::string(R"({"model": "m.gguf", "tensors": [{"name": "output.weight", "shape": [64, 512], "type": "q8_0", )") +
                                     bad + "}]}");
        const auto e4 = run_voodoo("export --model " + voodoo::test::stories260k() + " --recipe " + dir.file("recipe4.json") +
                                   " --out " + dir.file("out.gguf"));
        EXPECT_EQ(e4.exit_code, 1) << bad << "\n" << e4.output;
        EXPECT_NE(e4.output.find("tensor 'output.weight'"), std::string::npos) << e4.output;
    }
}

TEST(cli, quantize_train_export_and_baseline_report_as_json_to_a_file_or_alone_on_stdout) {
    // Issue #21: --json FILE (- for stdout) in the four commands that make files too; with -, stdout holds the JSON
    // and nothing else (progress and a training child's report go to stderr).
    voodoo::test::temp_dir dir;
    const std::string model = voodoo::test::stories260k();
    const std::string text = dir.file("calib.txt");
    voodoo::test::write_file(text, voodoo::test::read_file(voodoo::test::shared_data() + "/text/tinystories/tinystories_val.txt").substr(0, 60000));

    const auto q = voodoo::test::run_voodoo_stdout(
        "quantize " + model + " --text " + text + " --target-size 400000 --ctx 64 --menu Q4_0,Q8_0 --steps 1 --probe-sequences 1 "
        "--select-sequences 1 --eval-chunks 1 --speed-reps 0 --baselines Q4_0 -t 1 --work " + dir.file("work") + " --json -");
    ASSERT_EQ(q.exit_code, 0) << q.output;
    const auto jq = nlohmann::json::parse(q.output);  // throws (and fails) on any other output
    ASSERT_EQ(jq["files"].size(), 1u);
    EXPECT_EQ(jq["files"][0]["file_bytes"].get<int64_t>(),
              static_cast<int64_t>(std::filesystem::file_size(jq["files"][0]["path"].get<std::string>())));
    EXPECT_EQ(jq["work"], dir.file("work"));
    EXPECT_EQ(jq["eval"]["files"].size(), 2u) << "the Voodoo file and stock Q4_0";

    const auto b = voodoo::test::run_voodoo_stdout("baseline " + model + " --recipe Q8_0 --out " + dir.file("q8.gguf") + " --json -");
    ASSERT_EQ(b.exit_code, 0) << b.output;
    const auto jb = nlohmann::json::parse(b.output);
    EXPECT_EQ(jb["recipe"], "Q8_0");
    EXPECT_EQ(jb["file_bytes"].get<int64_t>(), static_cast<int64_t>(std::filesystem::file_size(dir.file("q8.gguf"))));

    const std::string run = dir.file("work/run-size-400000");
    const auto e = run_voodoo("export --model " + model + " --recipe " + run + "/recipe.json --out " + dir.file("e.gguf") +
                              " --json " + dir.file("export.json"));
    ASSERT_EQ(e.exit_code, 0) << e.output;
    EXPECT_NE(e.output.find("wrote"), std::string::npos) << "with a file, the text report stays";
    const auto je = nlohmann::json::parse(voodoo::test::read_file(dir.file("export.json")));
    EXPECT_EQ(je["file_bytes"].get<int64_t>(), static_cast<int64_t>(std::filesystem::file_size(dir.file("e.gguf"))));
    EXPECT_GT(je["bpw"].get<double>(), 4.0);

    const auto t = voodoo::test::run_voodoo_stdout("train --model " + model + " --data " + dir.file("work/data") +
                                                   " --target-size 400000 --menu Q4_0,Q8_0 --steps 1 --probe-sequences 1 "
                                                   "--select-sequences 1 --out " + dir.file("run") + " --json -");
    ASSERT_EQ(t.exit_code, 0) << t.output;
    const auto jt = nlohmann::json::parse(t.output);
    EXPECT_LE(jt["total"].get<double>(), jt["limit"].get<double>());
    EXPECT_EQ(jt["routing"], "mix");
    EXPECT_FALSE(jt["selection"].empty());
    EXPECT_TRUE(std::filesystem::exists(jt["recipe"].get<std::string>()));
    // The candidates built for the targets, of every type of every menu (a two-type menu is kept whole).
    EXPECT_GT(jt["candidates"]["built"].get<int64_t>(), 0);
    EXPECT_EQ(jt["candidates"]["built"], jt["candidates"]["in_menus"]);
    EXPECT_GT(jt["candidates"]["bytes_built"].get<double>(), 0.0);
    EXPECT_EQ(jt["candidates"]["bytes_built"], jt["candidates"]["bytes_in_menus"]);
}

namespace {

// Starts `voodoo args…` with stderr on a pipe (VOODOO_PROGRESS=0), reads its lines until one starts with
// `header` (empty: the first line), waits `delay_ms`, and kills it with SIGKILL. Returns whether it was killed
// (false: it ended before).
struct signalled_run {
    int status = 0;          // waitpid's
    bool sent = false;       // the header was seen and the signal sent
    std::string after;       // stderr after the header
};

// Runs voodoo with `args` (stderr read line by line, stdout to /dev/null), sends `sig` `delay_ms` after the first
// stderr line that starts with `header`, and reads the rest of its stderr until it ends.
signalled_run signal_voodoo_at(const std::vector<std::string> & args, const std::string & header, int delay_ms, int sig) {
    signalled_run r;
    int fds[2];
    if (::pipe(fds) != 0) {
        return r;
    }
    const pid_t pid = ::fork();
    if (pid == 0) {
        ::dup2(fds[1], STDERR_FILENO);
        const int null = ::open("/dev/null", O_WRONLY);
        ::dup2(null, STDOUT_FILENO);
        ::close(fds[0]);
        ::setenv("VOODOO_PROGRESS", "0", 1);
        std::vector<char *> argv;
        std::string bin = VOODOO_BIN;
        argv.push_back(bin.data());
        std::vector<std::string> copy = args;
        for (std::string & a : copy) {
            argv.push_back(a.data());
        }
        argv.push_back(nullptr);
        ::execv(argv[0], argv.data());
        ::_exit(127);
    }
    ::close(fds[1]);
    FILE * err = ::fdopen(fds[0], "r");
    char line[4096];
    bool seen = header.empty();
    while (!seen && std::fgets(line, sizeof line, err)) {
        seen = std::string(line).starts_with(header);
    }
    if (seen) {
        std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
        ::kill(pid, sig);
        r.sent = true;
    }
    while (std::fgets(line, sizeof line, err)) {
        r.after += line;
    }
    std::fclose(err);
    ::waitpid(pid, &r.status, 0);
    return r;
}

// signal_voodoo_at with SIGKILL: true when the kill landed before the job ended.
bool kill_voodoo_at(const std::vector<std::string> & args, const std::string & header, int delay_ms) {
    const signalled_run r = signal_voodoo_at(args, header, delay_ms, SIGKILL);
    return r.sent && WIFSIGNALED(r.status) && WTERMSIG(r.status) == SIGKILL;
}

}  // namespace

TEST(cli, quantize_killed_with_sigkill_in_any_stage_then_run_again_makes_the_same_bytes) {
    // Issue #19: kill -9 at a point in each stage (right after its header line, and at several points of the
    // training stage, which holds candidates, probe, gate training and selection), then the same command again:
    // the file, the recipe and the evaluation must be byte for byte those of an uninterrupted run. The same work
    // path every time, since the recipe and the file record it.
    voodoo::test::temp_dir dir;
    const std::string text = voodoo::test::read_file(voodoo::test::shared_data() + "/text/tinystories/tinystories_val.txt");
    voodoo::test::write_file(dir.file("calib.txt"), text.substr(0, 150000));
    voodoo::test::write_file(dir.file("held.txt"), text.substr(text.size() - 40000));
    const std::string work = dir.file("w");
    const std::vector<std::string> args = {
        "quantize", voodoo::test::stories260k(), "--text", dir.file("calib.txt"), "--eval-text", dir.file("held.txt"),
        "--like", "Q4_0", "--ctx", "64", "--imatrix-chunks", "16", "--steps", "8", "--batch", "2", "--probe-sequences", "2", "--select-sequences",
        "2", "--eval-ctx", "64", "--eval-chunks", "4", "--baselines", "Q4_0", "-t", "1", "--work", work,
        "--speed-reps", "0"};  // speed is measured, never the same twice: eval.json compares the quality numbers
    std::string line;
    for (const std::string & a : args) {
        line += "'" + a + "' ";
    }
    const std::vector<std::string> outputs = {"stories260K.Voodoo73.gguf", "run-Q4_0/recipe.json",
                                              "run-Q4_0/recipe.tensor-types.txt", "eval.json"};
    ASSERT_EQ(run_voodoo(line).exit_code, 0);
    std::map<std::string, std::string> want;
    for (const std::string & f : outputs) {
        want[f] = voodoo::test::read_file(work + "/" + f);
    }
    const auto times = nlohmann::json::parse(voodoo::test::read_file(work + "/times.json"));
    const int train_ms = static_cast<int>(1000 * times["train"].get<double>());
    // Host memory by stage: the peak so far at each stage's end never falls, and the train stage (a child process
    // holding the model and its candidates) leaves one above the job's start.
    const auto & rss = times.at("max_rss_bytes_at_stage_end");
    int64_t last = 0;
    for (const char * stage : {"data", "imatrix", "target", "train", "export", "baselines", "eval", "card"}) {
        ASSERT_TRUE(rss.contains(stage)) << stage;
        EXPECT_GE(rss[stage].get<int64_t>(), last) << stage;
        last = rss[stage].get<int64_t>();
    }
    EXPECT_GT(rss["train"].get<int64_t>(), int64_t{1} << 20);
    // The work folder's disk by stage: the candidate cache is there by the train stage's end, and the export adds
    // the file (nothing is removed in between).
    const auto & disk = times.at("work_disk_bytes_at_stage_end");
    ASSERT_TRUE(disk.contains("train") && disk.contains("export"));
    EXPECT_GE(disk["train"].get<int64_t>(), voodoo::tree_disk_bytes(work + "/candidates"));
    EXPECT_GT(voodoo::tree_disk_bytes(work + "/candidates"), 0);
    EXPECT_GE(disk["export"].get<int64_t>() - disk["train"].get<int64_t>(),
              voodoo::tree_disk_bytes(work + "/stories260K.Voodoo73.gguf"));

    struct point {
        std::string header;
        int delay_ms;
    };
    std::vector<point> points;
    for (const char * stage : {"data", "imatrix", "target", "train", "export", "baselines", "eval", "card"}) {
        points.push_back({std::string("== ") + stage + ":", 0});
    }
    for (int i = 1; i <= 4; ++i) {
        points.push_back({"== train:", train_ms * i / 5});
    }
    int killed = 0;
    for (const point & p : points) {
        SCOPED_TRACE(p.header + " + " + std::to_string(p.delay_ms) + " ms");
        voodoo::remove_tree(work);
        killed += kill_voodoo_at(args, p.header, p.delay_ms);
        const auto again = run_voodoo(line);
        ASSERT_EQ(again.exit_code, 0) << again.output;
        for (const std::string & f : outputs) {
            EXPECT_TRUE(voodoo::test::read_file(work + "/" + f) == want[f]) << f << " differs from the uninterrupted run's";
        }
    }
    RecordProperty("killed", killed);
    EXPECT_GE(killed, 8) << "most kills must land before the job ends";
}

TEST(cli, quantize_stopped_with_ctrl_c_exits_130_and_the_same_command_resumes) {
    // README: "130: stopped by Ctrl-C (run the same command again to resume)". SIGINT right after a stage's header
    // (the imatrix, which does not poll the stop test, and the eval, which does before each decode): the job stops
    // at the next stage mark at the latest, says so on one line and exits 130; the same command then finishes.
    voodoo::test::temp_dir dir;
    const std::string text = voodoo::test::read_file(voodoo::test::shared_data() + "/text/tinystories/tinystories_val.txt");
    voodoo::test::write_file(dir.file("calib.txt"), text.substr(0, 150000));
    const std::string work = dir.file("w");
    const std::vector<std::string> args = {"quantize", voodoo::test::stories260k(), "--text", dir.file("calib.txt"),
                                           "--like", "Q4_0", "--ctx", "64", "--steps", "4", "--batch", "2",
                                           "--probe-sequences", "2", "--select-sequences", "2", "--eval-ctx", "64",
                                           "--eval-chunks", "4", "--baselines", "Q4_0", "--speed-reps", "0", "-t", "1",
                                           "--work", work};
    std::string line;
    for (const std::string & a : args) {
        line += "'" + a + "' ";
    }
    for (const char * header : {"== imatrix:", "== eval:"}) {
        SCOPED_TRACE(header);
        voodoo::remove_tree(work);
        const signalled_run r = signal_voodoo_at(args, header, 0, SIGINT);
        ASSERT_TRUE(r.sent);
        ASSERT_TRUE(WIFEXITED(r.status)) << r.after;
        EXPECT_EQ(WEXITSTATUS(r.status), 130) << r.after;
        EXPECT_NE(r.after.find("voodoo: stopped "), std::string::npos) << r.after;
        EXPECT_NE(r.after.find("run the same command again"), std::string::npos) << r.after;
        const auto again = run_voodoo(line);
        ASSERT_EQ(again.exit_code, 0) << again.output;
        EXPECT_NE(again.output.find("== data: " + work + "/data (done)"), std::string::npos) << again.output;
    }
}

TEST(cli, ctrl_c_in_the_probe_run_as_its_candidates_are_built_names_the_eager_probe_and_the_same_command_resumes) {
    // With --build-ahead on (auto's choice on a GPU) the eager probe measures each tensor as its candidates are built
    // (trainer.cpp probe_as_built). SIGINT as it starts (the line before it): the job stops during that probe, says
    // which one, exits 130, and the same command finishes with the recipe of a run never stopped.
    voodoo::test::temp_dir dir;
    const std::string text = voodoo::test::read_file(voodoo::test::shared_data() + "/text/tinystories/tinystories_val.txt");
    voodoo::test::write_file(dir.file("calib.txt"), text.substr(0, 150000));
    std::vector<std::string> args = {"quantize", voodoo::test::stories260k(), "--text", dir.file("calib.txt"), "--like",
                                     "Q4_0", "--ctx", "64", "--steps", "2", "--batch", "2", "--probe-sequences", "2",
                                     "--select-sequences", "2", "--eval-chunks", "0", "--build-ahead", "on",
                                     "--prune-stages", "2", "-t", "1", "--work"};
    auto line_of = [](const std::vector<std::string> & a) {
        std::string line;
        for (const std::string & x : a) {
            line += "'" + x + "' ";
        }
        return line;
    };
    auto whole = args;
    whole.push_back(dir.file("whole"));
    ASSERT_EQ(run_voodoo(line_of(whole)).exit_code, 0);
    args.push_back(dir.file("stopped"));
    const signalled_run r = signal_voodoo_at(args, "pruning: eager types ", 0, SIGINT);
    ASSERT_TRUE(r.sent);
    ASSERT_TRUE(WIFEXITED(r.status)) << r.after;
    EXPECT_EQ(WEXITSTATUS(r.status), 130) << r.after;
    EXPECT_NE(r.after.find("stopped during the eager probe"), std::string::npos) << r.after;
    EXPECT_NE(r.after.find("run the same command again"), std::string::npos) << r.after;
    const auto again = run_voodoo(line_of(args));
    ASSERT_EQ(again.exit_code, 0) << again.output;
    // The same recipe (its imatrix path names each work folder).
    const auto stopped = nlohmann::json::parse(voodoo::test::read_file(dir.file("stopped") + "/run-Q4_0/recipe.json"));
    const auto whole_recipe = nlohmann::json::parse(voodoo::test::read_file(dir.file("whole") + "/run-Q4_0/recipe.json"));
    EXPECT_EQ(stopped["recipe_hash"], whole_recipe["recipe_hash"]);
    EXPECT_TRUE(stopped["tensors"] == whole_recipe["tensors"]) << "the resumed run chose another recipe";
}

TEST(cli, quantize_refuses_an_output_or_work_folder_where_no_file_can_be_made_before_any_work_dry_run_too) {
    // Found by a new user's trial: root passes access(W_OK) on /proc, so `-o /proc/out.gguf` ran the data and imatrix
    // stages and then blamed the disk, and the dry run passed both; now a file is made there and removed to check.
    voodoo::test::temp_dir dir;
    const std::string base = "quantize " + voodoo::test::stories260k() + " --text " + voodoo::test::shared_data() +
                             "/text/tinystories/tinystories_val.txt --like Q4_0 --ctx 64 --eval-chunks 0 ";
    for (const std::string & dry : {std::string(""), std::string(" --dry-run")}) {
        auto r = run_voodoo(base + "--work " + dir.file("w") + " -o /proc/out.gguf" + dry);
        EXPECT_EQ(r.exit_code, 1) << r.output;
        EXPECT_NE(r.output.find("--out '/proc/out.gguf': this user cannot write in '/proc'"), std::string::npos) << r.output;
        EXPECT_FALSE(std::filesystem::exists(dir.file("w") + "/data")) << "the work was done before the refusal";
        r = run_voodoo(base + "--work /proc/voodoo-work" + dry);
        EXPECT_EQ(r.exit_code, 1) << r.output;
        EXPECT_NE(r.output.find("--work '/proc/voodoo-work': this user cannot write in '/proc'"), std::string::npos) << r.output;
    }
    // A folder that takes files passes, and the check leaves nothing behind in it.
    const auto ok = run_voodoo(base + "--work " + dir.file("w") + " -o " + dir.file("out.gguf") + " --dry-run");
    EXPECT_EQ(ok.exit_code, 0) << ok.output;
    size_t entries = 0;
    for ([[maybe_unused]] const auto & e : std::filesystem::directory_iterator(dir.path)) {
        ++entries;
    }
    EXPECT_EQ(entries, 0u) << "the dry run makes nothing";
}

TEST(cli, a_json_destination_that_cannot_be_written_is_refused_before_any_work) {
    // Found trying the commands as a new user: --json /proc/x.json ran the whole job, then failed on the report.
    voodoo::test::temp_dir dir;
    const std::string model = voodoo::test::stories260k();
    for (const std::string & bad : {std::string("/proc/x.json"), dir.path.string() + "/"}) {
        const auto r = run_voodoo("baseline " + model + " --recipe Q8_0 --out " + dir.file("q8.gguf") + " --json " + bad);
        EXPECT_EQ(r.exit_code, 2) << r.output;
        EXPECT_NE(r.output.find("--json"), std::string::npos) << r.output;
        EXPECT_FALSE(std::filesystem::exists(dir.file("q8.gguf"))) << "the work was done before the refusal";
    }
    // train refuses a quantized source as quantize does, and takes --allow-requantize.
    ASSERT_EQ(run_voodoo("baseline " + model + " --recipe Q8_0 --out " + dir.file("q8.gguf")).exit_code, 0);
    const auto t = run_voodoo("train --model " + dir.file("q8.gguf") + " --data " + dir.file("nodata") +
                              " --target-size 300000 --out " + dir.file("run"));
    EXPECT_EQ(t.exit_code, 1) << t.output;
    EXPECT_NE(t.output.find("--allow-requantize"), std::string::npos) << t.output;
}
