#include "common/error.h"
#include "ggml/gguf.h"
#include "pipeline/quantize.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <limits>

using namespace voodoo;

namespace {

quantize_options small_job(const std::string & work) {
    quantize_options q;
    q.model = test::stories260k();
    q.texts = {test::shared_data() + "/text/tinystories/tinystories_val.txt"};
    q.eval_text = test::shared_data() + "/text/gutenberg/pg11.txt";
    q.like = "Q5_0";
    q.work = work;
    q.baselines = "Q4_0,Q5_0";
    q.ctx = 64;
    q.imatrix_chunks = 8;
    q.eval_ctx = 64;
    q.eval_chunks = 4;
    q.train.steps = 3;
    q.train.batch = 1;
    q.train.seq = 32;
    q.train.probe_sequences = 2;
    return q;
}

}  // namespace

TEST(quantize, one_command_makes_a_file_within_the_stock_size_and_compares_it) {
    test::temp_dir dir;
    const auto q = small_job(dir.file("work"));
    const quantize_result r = run_quantize(q);
    const size_t q5_0 = std::filesystem::file_size(dir.file("work/baselines/stories260K-Q5_0.gguf"));
    EXPECT_LE(r.file_bytes, q5_0);
    EXPECT_EQ(std::filesystem::path(r.out).parent_path(), dir.path / "work");
    EXPECT_EQ(std::filesystem::path(r.out).filename().string().rfind("stories260K.Voodoo", 0), 0u) << r.out;
    ASSERT_EQ(r.eval.files.size(), 3u);  // ours, Q4_0, Q5_0
    EXPECT_GT(r.eval.files[0].kld_mean, 0.0);
    EXPECT_NE(r.table.find("Q5_0"), std::string::npos);
    for (const char * f : {"eval.md", "eval.json", "eval.png", "imatrix.gguf", "run/recipe.json", "data/data.json"}) {
        EXPECT_TRUE(std::filesystem::exists(dir.path / "work" / f)) << f;
    }
    // Again: every stage is found done, and the same file comes out.
    const auto before = std::filesystem::last_write_time(r.out);
    const quantize_result again = run_quantize(q);
    EXPECT_EQ(again.out, r.out);
    EXPECT_EQ(std::filesystem::last_write_time(r.out), before);
}

TEST(quantize, a_work_folder_of_other_texts_is_refused) {
    test::temp_dir dir;
    auto q = small_job(dir.file("work"));
    q.baselines = "none";
    run_quantize(q);
    q.texts = {test::shared_data() + "/text/tinyshakespeare/input.txt"};
    try {
        run_quantize(q);
        FAIL() << "expected an error";
    } catch (const error & e) {
        EXPECT_NE(std::string(e.what()).find("other texts"), std::string::npos) << e.what();
    }
}

TEST(quantize, the_train_stage_in_a_child_process_makes_the_same_recipe) {
    // What --device cuda does (the GPU only in the child's process), run here on the CPU: `voodoo train` in a
    // child with the same options writes the recipe the in-process stage writes.
    test::temp_dir dir;
    auto in_process = small_job(dir.file("a"));
    in_process.baselines = "none";
    auto child = in_process;
    child.work = dir.file("b");
    child.train_exe = VOODOO_BIN;
    run_quantize(in_process);
    run_quantize(child);
    const std::string a = test::read_file(dir.file("a/run/recipe.tensor-types.txt"));
    EXPECT_FALSE(a.empty());
    EXPECT_EQ(a, test::read_file(dir.file("b/run/recipe.tensor-types.txt")));
    child.train_exe = dir.file("no-such-voodoo");
    child.work = dir.file("c");
    EXPECT_NE(test::error_of([&] { run_quantize(child); }).find("train stage"), std::string::npos);
}

TEST(quantize, a_ladder_makes_one_file_per_size_from_one_probe_and_never_measures_worse_when_larger) {
    // Three stock sizes in one command: one data/imatrix/candidates/probe, a run per size in increasing order,
    // each choosing among its own recipes and the smaller sizes' on the validation split, and the curve.
    test::temp_dir dir;
    auto q = small_job(dir.file("work"));
    q.like = "Q5_1,Q4_0,Q5_0";  // any order: the rungs run by size
    q.baselines = "Q4_0,Q5_0,Q5_1";
    q.greedy_peer = true;
    const quantize_result r = run_quantize(q);
    ASSERT_EQ(r.outs.size(), 3u);
    const std::filesystem::path w = dir.path / "work";
    double previous_kl = std::numeric_limits<double>::infinity();
    for (const char * label : {"Q4_0", "Q5_0", "Q5_1"}) {
        SCOPED_TRACE(label);
        const std::filesystem::path run = w / (std::string("run-") + label);
        std::ifstream in(run / "selection.json");
        const auto sel = nlohmann::json::parse(in);
        ASSERT_GE(sel.size(), 3u);  // trained, probe-exact, probe-greedy (+ the smaller sizes' recipes)
        const double chosen = sel[0]["val_kl"].get<double>();
        for (const auto & e : sel) {
            EXPECT_LE(chosen, e["val_kl"].get<double>());
        }
        EXPECT_LE(chosen, previous_kl);  // a larger budget never measures worse
        previous_kl = chosen;
        EXPECT_TRUE(std::filesystem::exists(w / fmt::format("stories260K.greedy.{}.gguf", label)));
        const size_t stock = std::filesystem::file_size(w / "baselines" / fmt::format("stories260K-{}.gguf", label));
        bool found = false;
        for (const auto & out : r.outs) {
            if (out.find(std::string(".") + label + ".gguf") != std::string::npos) {
                found = true;
                EXPECT_LE(std::filesystem::file_size(out), stock) << out;
            }
        }
        EXPECT_TRUE(found);
    }
    EXPECT_TRUE(std::filesystem::exists(w / "probe.json"));
    for (const char * f : {"curve.md", "curve.json", "curve.png"}) {
        EXPECT_TRUE(std::filesystem::exists(w / f)) << f;
    }
    // Voodoo files, the greedy peer's and the three stock files are all scored.
    EXPECT_EQ(r.eval.files.size(), 9u);
}

TEST(quantize, a_ladder_with_an_impossible_size_is_refused_before_any_training) {
    test::temp_dir dir;
    auto q = small_job(dir.file("work"));
    q.like.clear();
    q.baselines = "none";
    q.goals = {{target_kind::size, 300000}, {target_kind::size, 1e9}};
    const std::string msg = test::error_of([&] { run_quantize(q); });
    EXPECT_NE(msg.find("size=1000000000"), std::string::npos) << msg;
    EXPECT_NE(msg.find("outside"), std::string::npos) << msg;
    EXPECT_FALSE(std::filesystem::exists(dir.path / "work" / "run-size-300000"));
    // One --out file for several targets is refused too.
    q.goals = {{target_kind::size, 290000}, {target_kind::size, 300000}};
    q.out = dir.file("one.gguf");
    const std::string out_msg = test::error_of([&] { run_quantize(q); });
    EXPECT_NE(out_msg.find("--out"), std::string::npos) << out_msg;
}
