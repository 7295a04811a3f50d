#include "common/error.h"
#include "common/file.h"
#include "eval/baseline.h"
#include "eval/speed_table.h"
#include "export/recipe.h"
#include "ggml/gguf.h"
#include "pipeline/quantize.h"
#include "train/candidates.h"
#include "train/prune.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <tuple>
#include <vector>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <sys/wait.h>
#include <unistd.h>

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
    q.speed_reps = 0;  // speed has its own test (test_eval.cpp)
    q.train.steps = 3;
    q.train.batch = 1;
    q.train.seq = 32;
    q.train.probe_sequences = 2;
    q.command = "voodoo quantize stories260K.gguf --like Q5_0";
    return q;
}

}  // namespace

TEST(quantize, stock_files_with_an_earlier_recipes_tensor_types_are_named_in_the_eval_not_dropped_silently) {
    // Found by a new user's trial: the demo made 29 stock files and its table had 15, with no word on the others. On
    // stories260K llama.cpp's fallbacks give Q6_K and Q8_0 one file (every tensor Q8_0): it is scored once, and
    // eval.md and eval.json name the other.
    test::temp_dir dir;
    auto q = small_job(dir.file("work"));
    q.baselines = "Q6_K,Q8_0";
    const quantize_result r = run_quantize(q);
    ASSERT_EQ(r.eval.files.size(), 2u);  // ours, Q6_K
    EXPECT_TRUE(std::filesystem::exists(dir.file("work/baselines/stories260K-Q8_0.gguf")));
    const std::string md = test::read_file(dir.file("work/eval.md"));
    EXPECT_NE(md.find("Stock file made in " + dir.file("work/baselines") + " but not scored, it has the tensor types of an "
                      "earlier recipe's file (llama.cpp's fallbacks where a type does not fit a tensor's rows): Q8_0 as Q6_K."),
              std::string::npos) << md;
    EXPECT_NE(r.table.find("Q8_0 as Q6_K"), std::string::npos) << r.table;
    const auto j = nlohmann::json::parse(test::read_file(dir.file("work/eval.json")));
    EXPECT_EQ(j["stock_files_not_scored"], nlohmann::json::parse(R"([{"recipe": "Q8_0", "same_types_as": "Q6_K"}])"));
    // A run again reuses the eval (its record matches eval.json as written) and names the file again.
    const quantize_result again = run_quantize(q);
    EXPECT_NE(again.table.find("Q8_0 as Q6_K"), std::string::npos) << again.table;
    EXPECT_EQ(test::read_file(dir.file("work/eval.json")), j.dump(2) + "\n");
}

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
    for (const char * f : {"eval.md", "eval.json", "eval.png", "imatrix.gguf", "run-Q5_0/recipe.json", "data/data.json",
                           "run-Q5_0/candidates.built.json"}) {
        EXPECT_TRUE(std::filesystem::exists(dir.path / "work" / f)) << f;
    }
    // The model card beside the file (issue #20), and what its stock rebuild command names lies beside it too.
    EXPECT_EQ(r.card, dir.file("work/README.md"));
    const std::string card = test::read_file(r.card);
    EXPECT_EQ(card.rfind("---\n", 0), 0u) << card;
    EXPECT_NE(card.find("- voodoo\n"), std::string::npos) << card;
    EXPECT_NE(card.find("stories260K-Q5_0.gguf"), std::string::npos) << "the comparison table";
    EXPECT_NE(card.find("](eval.png)"), std::string::npos) << "the plot";
    EXPECT_NE(card.find("voodoo quantize"), std::string::npos) << "the command";
    const std::string types = std::filesystem::path(r.out).replace_extension(".tensor-types.txt").string();
    EXPECT_EQ(test::read_file(types), recipe_tensor_types(recipe_load(dir.file("work/run-Q5_0/recipe.json"))));
    EXPECT_NE(card.find(fmt::format("llama-quantize --imatrix imatrix.gguf --tensor-type-file {} stories260K.gguf {} Q8_0",
                                    std::filesystem::path(types).filename().string(),
                                    std::filesystem::path(r.out).filename().string())),
              std::string::npos)
        << card;
    // Again: every stage is found done, and the same file comes out.
    const auto before = std::filesystem::last_write_time(r.out);
    const quantize_result again = run_quantize(q);
    EXPECT_EQ(again.out, r.out);
    EXPECT_EQ(std::filesystem::last_write_time(r.out), before);
}

// Runs the job and returns what it printed on stderr (the stage lines).
std::string stages_of(const quantize_options & q) {
    testing::internal::CaptureStderr();
    try {
        run_quantize(q);
    } catch (...) {
        std::cerr << testing::internal::GetCapturedStderr();
        throw;
    }
    return testing::internal::GetCapturedStderr();
}

bool has_line(const std::string & log, const std::string & start, const std::string & also = "") {
    for (size_t a = 0; a < log.size();) {
        const size_t e = std::min(log.find('\n', a), log.size());
        const std::string line = log.substr(a, e - a);
        if (line.rfind(start, 0) == 0 && line.find(also) != std::string::npos) {
            return true;
        }
        a = e + 1;
    }
    return false;
}

TEST(quantize, a_rerun_with_other_options_makes_again_what_they_change_and_says_so) {
    // Issue #21: a re-run in the same work folder used to reuse every stage whatever changed. Each stage now
    // keeps a record of its inputs; a change re-does that stage and every stage after it, in one line each.
    test::temp_dir dir;
    auto q = small_job(dir.file("work"));
    q.baselines = "none";
    q.eval_chunks = 0;
    const std::string w = dir.file("work");
    auto data_json = [&] {
        std::ifstream in(w + "/data/data.json");
        return nlohmann::json::parse(in);
    };
    auto times_json = [&] {
        std::ifstream in(w + "/times.json");
        return nlohmann::json::parse(in);
    };
    stages_of(q);
    const nlohmann::json first_times = times_json();
    EXPECT_FALSE(first_times.contains("earlier"));
    std::string log = stages_of(q);
    EXPECT_TRUE(has_line(log, "== data:", "(done)")) << log;
    EXPECT_TRUE(has_line(log, "== imatrix:", "(done)")) << log;
    EXPECT_TRUE(has_line(log, "== train:", "(done)")) << log;
    EXPECT_TRUE(has_line(log, "== export:", "(done)")) << log;
    // The rerun's times (every stage done) do not replace the first run's, which trained: they are kept under "earlier".
    {
        const nlohmann::json t = times_json();
        ASSERT_TRUE(t.contains("earlier") && t["earlier"].is_array() && t["earlier"].size() == 1u) << t.dump();
        EXPECT_EQ(t["earlier"][0], first_times);
        EXPECT_LT(t["train"].get<double>(), first_times["train"].get<double>());
    }

    q.ctx = 48;  // the data, so everything after it
    log = stages_of(q);
    EXPECT_TRUE(has_line(log, "== data:", "made again (ctx 64 → 48)")) << log;
    EXPECT_TRUE(has_line(log, "== imatrix:", "made again (data ")) << log;
    EXPECT_TRUE(has_line(log, "== baselines:", "made again (imatrix ")) << log;
    EXPECT_TRUE(has_line(log, "== train:", "made again (")) << log;
    EXPECT_EQ(data_json()["ctx"], 48);

    q.train.seed = 7;  // the shuffle of the documents and the training
    log = stages_of(q);
    EXPECT_TRUE(has_line(log, "== data:", "seed 42 → 7")) << log;
    EXPECT_EQ(data_json()["seed"], 7);

    q.imatrix_chunks = 4;  // the imatrix, not the data
    log = stages_of(q);
    EXPECT_TRUE(has_line(log, "== data:", "(done)")) << log;
    EXPECT_TRUE(has_line(log, "== imatrix:", "made again (chunks 8 → 4)")) << log;
    EXPECT_TRUE(has_line(log, "== train:", "made again (")) << log;

    q.train.steps = 2;  // only the training
    log = stages_of(q);
    EXPECT_TRUE(has_line(log, "== imatrix:", "(done)")) << log;
    EXPECT_TRUE(has_line(log, "== train:", "made again (steps 3 → 2)")) << log;

    q.train.prune_stages = "2";  // the candidates' pruning (auto is 1 on the CPU): the training, and back
    log = stages_of(q);
    EXPECT_TRUE(has_line(log, "== train:", "made again (candidates ")) << log;
    q.train.prune_stages = "auto";
    log = stages_of(q);
    EXPECT_TRUE(has_line(log, "== train:", "made again (candidates ")) << log;

    q.texts = {test::shared_data() + "/text/tinyshakespeare/input.txt"};  // other texts
    log = stages_of(q);
    EXPECT_TRUE(has_line(log, "== data:", "made again (texts ")) << log;
    EXPECT_EQ(data_json()["sources"].size(), 1u);
    EXPECT_NE(data_json()["sources"][0].dump().find("tinyshakespeare"), std::string::npos);

    // A second target in the same work folder trains beside the first and shares every earlier stage.
    const std::string first = test::read_file(w + "/run-Q5_0/recipe.json");
    q.like = "Q4_0";
    log = stages_of(q);
    EXPECT_TRUE(has_line(log, "== data:", "(done)")) << log;
    EXPECT_TRUE(has_line(log, "== imatrix:", "(done)")) << log;
    EXPECT_TRUE(has_line(log, "== train:", "run-Q4_0")) << log;
    EXPECT_EQ(test::read_file(w + "/run-Q5_0/recipe.json"), first);
    EXPECT_NE(test::read_file(w + "/run-Q4_0/recipe.json"), first);
}

TEST(quantize, a_rerun_of_a_finished_job_reads_its_eval_and_scores_again_when_a_file_or_option_changed) {
    // A re-run of a finished job scored every file again (220 s for mix30M's ladder on the CPU, session 37's trial).
    // The eval stage's record (eval.stage.json) now says what made eval.json: the same files, text and options read it.
    test::temp_dir dir;
    auto q = small_job(dir.file("work"));
    q.baselines = "Q4_0";
    const std::string w = dir.file("work");
    std::string log = stages_of(q);
    EXPECT_FALSE(has_line(log, "== eval:", "(done")) << log;
    const std::string first = test::read_file(w + "/eval.json");
    ASSERT_TRUE(std::filesystem::exists(w + "/eval.stage.json"));

    log = stages_of(q);
    EXPECT_TRUE(has_line(log, "== eval:", "(done: ")) << log;
    EXPECT_EQ(test::read_file(w + "/eval.json"), first);
    EXPECT_NE(test::read_file(w + "/eval.md").find("Q4_0"), std::string::npos);

    q.eval_chunks = 3;  // an option of the eval alone
    log = stages_of(q);
    EXPECT_TRUE(has_line(log, "== train:", "(done)")) << log;
    EXPECT_TRUE(has_line(log, "== eval:")) << log;
    EXPECT_TRUE(has_line(log, "== eval:", "(scored: chunks 4 → 3)")) << log;
    const std::string second = test::read_file(w + "/eval.json");
    EXPECT_NE(second, first);

    // A scored file made again (here: only its modification time) is scored again; so is a damaged eval.json.
    std::string stock;
    for (const auto & e : std::filesystem::directory_iterator(w + "/baselines")) {
        if (e.path().extension() == ".gguf") {
            stock = e.path().string();
        }
    }
    ASSERT_FALSE(stock.empty());
    std::filesystem::last_write_time(stock, std::filesystem::last_write_time(stock) + std::chrono::seconds(2));
    log = stages_of(q);
    EXPECT_FALSE(has_line(log, "== eval:", "(done")) << log;
    EXPECT_EQ(test::read_file(w + "/eval.json"), second);  // the same bytes scored: the same numbers
    test::write_file(w + "/eval.json", "{ not json");
    log = stages_of(q);
    EXPECT_FALSE(has_line(log, "== eval:", "(done")) << log;
    EXPECT_EQ(test::read_file(w + "/eval.json"), second);
    // An eval.json that still parses but was edited (a file's row removed) is not the table the record wrote.
    {
        nlohmann::json j = nlohmann::json::parse(second);
        ASSERT_TRUE(j.contains("files") && j["files"].size() >= 2u) << j.dump();
        j["files"].erase(j["files"].size() - 1);
        test::write_file(w + "/eval.json", j.dump(2) + "\n");
    }
    log = stages_of(q);
    EXPECT_TRUE(has_line(log, "== eval:", "(scored: eval_json ")) << log;
    EXPECT_EQ(test::read_file(w + "/eval.json"), second);
}

TEST(quantize, a_second_target_whose_file_name_is_taken_by_the_first_keeps_both_files) {
    // A new user's trial (session 38): stories260K's Q4_K_M and Q5_0 targets both round to Voodoo80, and the second
    // wrote over the first's file. The second now takes its label, as a ladder's files do; a run of the same target
    // made again still replaces its own file.
    test::temp_dir dir;
    auto q = small_job(dir.file("work"));
    q.baselines = "none";
    q.eval_chunks = 0;
    q.like = "Q4_K_M";
    const quantize_result a = run_quantize(q);
    q.like = "Q5_0";
    const quantize_result b = run_quantize(q);
    ASSERT_NE(b.out.find(".Q5_0.gguf"), std::string::npos) << "the two names no longer collide: " << a.out << ", " << b.out;
    EXPECT_EQ(b.out.substr(0, b.out.size() - std::string(".Q5_0.gguf").size()) + ".gguf", a.out);
    ASSERT_TRUE(std::filesystem::exists(a.out));
    ASSERT_TRUE(std::filesystem::exists(b.out));
    EXPECT_NE(gguf_file(a.out).get_string("voodoo.target"), gguf_file(b.out).get_string("voodoo.target"));
    EXPECT_EQ(gguf_file(a.out).get_string("voodoo.recipe_hash").value_or(""),
              recipe_hash(recipe_load(dir.file("work/run-Q4_K_M/recipe.json"))));
    q.like = "Q4_K_M";  // the first target again, made again with other steps: its own file is replaced
    q.train.steps = 2;
    const quantize_result c = run_quantize(q);
    EXPECT_EQ(c.out, a.out);
    EXPECT_EQ(gguf_file(c.out).get_string("voodoo.recipe_hash").value_or(""),
              recipe_hash(recipe_load(dir.file("work/run-Q4_K_M/recipe.json"))));
}

TEST(quantize, an_imatrix_the_user_has_replaces_the_imatrix_stage) {
    test::temp_dir dir;
    auto q = small_job(dir.file("a"));
    q.baselines = "none";
    q.eval_chunks = 0;
    stages_of(q);
    auto given = small_job(dir.file("b"));
    given.baselines = "none";
    given.eval_chunks = 0;
    given.imatrix = dir.file("a/imatrix.gguf");
    const std::string log = stages_of(given);
    EXPECT_TRUE(has_line(log, "== imatrix:", "(given)")) << log;
    EXPECT_FALSE(std::filesystem::exists(dir.file("b/imatrix.gguf")));
    // The same imatrix and options: the same recipe.
    EXPECT_EQ(test::read_file(dir.file("a/run-Q5_0/recipe.tensor-types.txt")),
              test::read_file(dir.file("b/run-Q5_0/recipe.tensor-types.txt")));
    // An imatrix of another model is refused before anything is made.
    auto other = given;
    other.work = dir.file("c");
    other.model = test::shared_data() + "/models/mix30M/mix30M.gguf";
    const std::string msg = test::error_of([&] { run_quantize(other); });
    EXPECT_NE(msg.find(given.imatrix), std::string::npos) << msg;
    EXPECT_FALSE(std::filesystem::exists(dir.file("c")));
}

TEST(quantize, every_bad_option_is_refused_before_anything_is_made) {
    // Issue #21: these were refused only after the data and imatrix stages (or after training). Each is now
    // refused from the model file alone, naming the flag or file, and no work folder is created.
    test::temp_dir dir;
    const std::string work = dir.file("work");
    struct bad {
        const char * what;
        std::function<void(quantize_options &)> change;
        std::vector<std::string> says;
    };
    std::string q8_0 = dir.file("stories260K-Q8_0.gguf");
    {
        baseline_options bo;
        bo.source = test::stories260k();
        make_baseline(bo, "Q8_0", q8_0);
    }
    const std::vector<bad> cases = {
        {"a recipe name", [](auto & q) { q.like = "Q9_K"; }, {"unknown recipe 'Q9_K'", "Q4_K_M"}},
        {"a baseline name", [](auto & q) { q.baselines = "Q4_0,nope"; }, {"unknown recipe 'nope'"}},
        {"a size too small",
         [](auto & q) {
             q.like.clear();
             q.goals = {{target_kind::size, 1000}};
         },
         {"size=1000", "outside", "MiB", "BPW"}},
        {"a ratio too large",
         [](auto & q) {
             q.like.clear();
             q.goals = {{target_kind::ratio, 2}};
         },
         {"ratio=2", "outside", "of the all-Q8_0 file"}},
        {"a BPW of 0",
         [](auto & q) {
             q.like.clear();
             q.goals = {{target_kind::bpw, 0}};
         },
         {"bpw=0", "outside"}},
        {"a device", [](auto & q) { q.train.device = "gpu"; }, {"--device 'gpu'"}},
        {"a missing eval text", [&](auto & q) { q.eval_text = dir.file("none.txt"); }, {"none.txt"}},
        {"a missing calibration text", [&](auto & q) { q.texts.push_back(dir.file("gone.txt")); }, {"gone.txt"}},
        {"a negative ctx", [](auto & q) { q.ctx = -1; }, {"--ctx -1"}},
        {"a ctx below the imatrix's 16", [](auto & q) { q.ctx = 8; }, {"--ctx 8", "at least 16"}},
        {"imatrix chunks 0", [](auto & q) { q.imatrix_chunks = 0; }, {"--imatrix-chunks 0", "-1 for all"}},
        {"negative threads", [](auto & q) { q.threads = -3; }, {"--threads -3"}},
        {"a negative loss chunk", [](auto & q) { q.train.loss_chunk = -5; }, {"--loss-chunk -5", "0 to choose by device"}},
        {"a --menu-for that matches nothing",
         [](auto & q) { q.train.menu.per_role = {{"nomatch.*", {GGML_TYPE_Q4_0}}}; },
         {"--menu-for 'nomatch.*'", "matches no"}},
        {"a missing imatrix", [&](auto & q) { q.imatrix = dir.file("im.gguf"); }, {"im.gguf"}},
        {"a quantized source", [&](auto & q) { q.model = q8_0; }, {"already quantized", "convert", "--allow-requantize"}},
        {"--out and --out-dir",
         [&](auto & q) {
             q.out = dir.file("x.gguf");
             q.out_dir = dir.file("d");
         },
         {"give one"}},
        {"an --out-dir that is a file", [&](auto & q) { q.out_dir = q8_0; }, {"is a file"}},
        // The eval stage's text and context (session 24: these were found only after the train stage).
        {"an eval text shorter than two chunks",
         [&](auto & q) {
             q.eval_text = dir.file("short.txt");
             test::write_file(q.eval_text, "Once upon a time there was a cat.\n");
         },
         {"the eval stage (--eval-text): ", "short.txt", "tokens; --eval-ctx 64 needs at least 128", "smaller --eval-ctx"}},
        {"an empty eval text",
         [&](auto & q) {
             q.eval_text = dir.file("empty.txt");
             test::write_file(q.eval_text, "");
         },
         {"empty.txt", "is empty"}},
        {"an eval ctx beyond the training context", [](auto & q) { q.eval_ctx = 1 << 20; },
         {"--eval-ctx 1048576 is larger than the context", "use --eval-ctx"}},
        {"an eval ctx below the smallest", [](auto & q) { q.eval_ctx = 8; }, {"--eval-ctx 8", "at least 16"}},
    };
    for (const bad & c : cases) {
        SCOPED_TRACE(c.what);
        auto q = small_job(work);
        c.change(q);
        const std::string msg = test::error_of([&] { run_quantize(q); });
        for (const std::string & s : c.says) {
            EXPECT_NE(msg.find(s), std::string::npos) << msg;
        }
        EXPECT_FALSE(std::filesystem::exists(work)) << msg;
    }
}

TEST(quantize, a_second_job_in_the_same_work_folder_is_refused_at_once_naming_the_first) {
    // Issue #19: two jobs in one work folder would write the same stage files. What a running job holds:
    test::temp_dir dir;
    const std::string work = dir.file("work");
    const folder_lock first(work);
    const std::string msg = test::error_of([&] { run_quantize(small_job(work)); });
    EXPECT_NE(msg.find("in use by another voodoo job (pid " + std::to_string(::getpid()) + ")"), std::string::npos)
        << msg;
    EXPECT_FALSE(std::filesystem::exists(work + "/data")) << "the second job made its data stage";
    EXPECT_FALSE(std::filesystem::exists(work + "/model.digest.json")) << "the second job read the model";
}

TEST(quantize, a_menu_that_leaves_tensors_at_their_source_type_says_which) {
    // stories260K's ffn_down (172 wide) fits no block type: with a menu of block types only it stays F32.
    auto q = small_job("unused");
    q.train.menu.types = {GGML_TYPE_Q4_0, GGML_TYPE_Q8_0};
    testing::internal::CaptureStderr();
    check_quantize_options(q, gguf_file(q.model));
    const std::string log = testing::internal::GetCapturedStderr();
    EXPECT_NE(log.find("voodoo: warning: 5 tensors"), std::string::npos) << log;
    EXPECT_NE(log.find("blk.0.ffn_down.weight (44032 bytes)"), std::string::npos) << log;
    EXPECT_NE(log.find("220160 bytes"), std::string::npos) << log;
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
    child.out_dir = dir.file("files");  // and the file where --out-dir says
    run_quantize(in_process);
    const quantize_result r = run_quantize(child);
    EXPECT_EQ(std::filesystem::path(r.out).parent_path(), std::filesystem::path(dir.file("files")));
    EXPECT_TRUE(std::filesystem::path(r.out).filename().string().starts_with("stories260K.Voodoo")) << r.out;
    EXPECT_TRUE(std::filesystem::exists(r.out)) << r.out;
    const std::string a = test::read_file(dir.file("a/run-Q5_0/recipe.tensor-types.txt"));
    EXPECT_FALSE(a.empty());
    EXPECT_EQ(a, test::read_file(dir.file("b/run-Q5_0/recipe.tensor-types.txt")));
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

TEST(quantize, allow_requantize_quantizes_a_quantized_source_against_itself_as_llama_quantize_does) {
    // Issue #21: llama-quantize's --allow-requantize. A Q8_0 file is the source and the teacher: the stock Q5_0 made
    // from it (llama_model_quantize with allow_requantize) sets the budget, and the Voodoo file fits it.
    test::temp_dir dir;
    const std::string q8_0 = dir.file("stories260K-Q8_0.gguf");
    baseline_options bo;
    bo.source = test::stories260k();
    ASSERT_TRUE(make_baseline(bo, "Q8_0", q8_0).ok);
    auto q = small_job(dir.file("work"));
    q.model = q8_0;
    q.baselines = "Q5_0";
    q.allow_requantize = true;
    const quantize_result r = run_quantize(q);
    ASSERT_EQ(r.eval.files.size(), 2u);
    const auto & stock = r.eval.files[1];
    EXPECT_NE(stock.name.find("Q5_0"), std::string::npos) << stock.name;
    EXPECT_LE(r.file_bytes, static_cast<size_t>(stock.file_bytes));
    EXPECT_TRUE(std::isfinite(r.eval.files[0].kld_mean));
    EXPECT_EQ(r.eval.reference, q8_0) << "every KLD is against the quantized source";
    // The stock tool refuses the same source without the flag; so does a baseline without it.
    bo.source = q8_0;
    const std::string refused = test::error_of([&] { make_baseline(bo, "Q4_0", dir.file("no.gguf")); });
    EXPECT_NE(refused.find("already quantized"), std::string::npos) << refused;
    EXPECT_NE(refused.find("--allow-requantize"), std::string::npos) << refused;
    EXPECT_FALSE(std::filesystem::exists(dir.file("no.gguf")));
    bo.allow_requantize = true;
    EXPECT_TRUE(make_baseline(bo, "Q4_0", dir.file("yes.gguf")).ok);
}

TEST(quantize, a_recipe_named_twice_in_like_is_one_target) {
    // From a new user's trial: --like Q4_K_M,Q4_K_M planned two exported files in the dry run while the run made one.
    test::temp_dir tmp;
    const std::string args = fmt::format("quantize {} --text {} --like Q5_0,q5_0 --ctx 64 --eval-chunks 0 --work {} "
                                         "--dry-run", test::stories260k(),
                                         test::shared_data() + "/text/tinystories/tinystories_val.txt", tmp.file("work"));
    const test::run_result r = test::run_voodoo_stdout(args + " --json -");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const nlohmann::json plan = nlohmann::json::parse(r.output);
    EXPECT_EQ(plan["sizes"]["targets"].size(), 1u) << plan["sizes"].dump();
    const test::run_result text = test::run_voodoo(args);
    ASSERT_EQ(text.exit_code, 0) << text.output;
    EXPECT_NE(text.output.find("--like names q5_0 more than once: one target"), std::string::npos) << text.output;
}

TEST(quantize, the_dry_runs_candidates_stage_gives_every_candidates_time_and_the_range_pruning_is_likely_to_build) {
    // Issue #16: with --candidates targets (the default) the dry run counted every candidate, so its total at the 8B
    // shape (73 min, session 22) read far above the job. The stage keeps that upper bound and adds the measured share
    // of the menus' work that pruning built (prune.h k_pruned_work_share_low/high); --candidates all builds every one.
    test::temp_dir tmp;
    const std::string args = fmt::format("quantize {} --text {} --like Q5_0 --ctx 64 --eval-chunks 0 --work {} --dry-run",
                                         test::stories260k(), test::shared_data() + "/text/tinystories/tinystories_val.txt",
                                         tmp.file("work"));
    auto candidates_stage = [&](const std::string & more) {
        const test::run_result r = test::run_voodoo_stdout(args + more + " --json -");
        EXPECT_EQ(r.exit_code, 0) << r.output;
        const nlohmann::json plan = nlohmann::json::parse(r.output);
        for (const auto & st : plan["stages"]) {
            if (st["stage"] == "candidates") {
                return st;
            }
        }
        ADD_FAILURE() << "no candidates stage: " << r.output;
        return nlohmann::json();
    };
    const nlohmann::json pruned = candidates_stage("");
    ASSERT_TRUE(pruned.contains("likely_seconds")) << pruned.dump();
    const double every = pruned["seconds"].get<double>();
    ASSERT_GT(every, 0.0);
    EXPECT_DOUBLE_EQ(pruned["likely_seconds"][0].get<double>(), voodoo::k_pruned_work_share_low * every);
    EXPECT_DOUBLE_EQ(pruned["likely_seconds"][1].get<double>(), voodoo::k_pruned_work_share_high * every);
    EXPECT_FALSE(candidates_stage(" --candidates all").contains("likely_seconds"));
    // The text gives the range only where it reads as one: stories260K's candidates take well under a second.
    const test::run_result text = test::run_voodoo(args);
    ASSERT_EQ(text.exit_code, 0) << text.output;
    EXPECT_EQ(text.output.find("≈ < 1 s to < 1 s"), std::string::npos) << text.output;
}

TEST(quantize, the_dry_run_says_when_a_like_target_not_sized_yet_is_likely_outside_the_feasible_sizes) {
    // Found by a new user's trial: with --menu mxfp4 stories260K has one feasible size, 28% above stock Q4_K_M's; the
    // dry run passed and the run refused the target after its imatrix. The stock file's estimate now says so at once.
    test::temp_dir tmp;
    const std::string args = fmt::format("quantize {} --text {} --like Q4_K_M --ctx 64 --eval-chunks 0 --work {} --dry-run",
                                         test::stories260k(), test::shared_data() + "/text/tinystories/tinystories_val.txt",
                                         tmp.file("work"));
    for (const bool mxfp4 : {false, true}) {
        const std::string menu = mxfp4 ? " --menu mxfp4" : "";
        const test::run_result r = test::run_voodoo_stdout(args + menu + " --json -");
        ASSERT_EQ(r.exit_code, 0) << r.output;
        const nlohmann::json plan = nlohmann::json::parse(r.output);
        const nlohmann::json & t = plan["sizes"]["targets"][0];
        ASSERT_TRUE(t["bytes"].is_null()) << t.dump();  // sized by llama.cpp's dry run once the imatrix exists
        const double est = t["estimated_bytes"].get<double>(), lo = plan["sizes"]["min_bytes"].get<double>();
        EXPECT_EQ(t["likely_outside"].get<bool>(), mxfp4) << t.dump() << plan["sizes"].dump();
        EXPECT_EQ(est < 0.9 * lo, mxfp4) << t.dump() << plan["sizes"].dump();
        const test::run_result text = test::run_voodoo(args + menu);
        ASSERT_EQ(text.exit_code, 0) << text.output;
        EXPECT_EQ(text.output.find("likely OUTSIDE the range") != std::string::npos, mxfp4) << text.output;
    }
}

TEST(quantize, the_dry_runs_eval_counts_every_token_at_libllamas_floor_and_the_llama_bench_runs) {
    // The demo's dry run said 1 s for an eval that took 88 s: a small model's decode is bound by libllama's per-token
    // work, not its FLOPs, and the llama-bench runs (--speed-reps) were not counted. Both are now, by the rates in
    // the plan's "rates" (the figures of a model's FLOPs are the same on every machine; the floors are this project's
    // 2-core measurements, docs/BENCHMARKS.md).
    test::temp_dir tmp;
    const std::string base = fmt::format("quantize {} --text {} --eval-text {} --like Q5_0 --ctx 64 --eval-ctx 64 "
                                         "--eval-chunks 4 --baselines Q4_0 --work {} --dry-run --json -",
                                         test::stories260k(), test::shared_data() + "/text/tinystories/tinystories_val.txt",
                                         test::shared_data() + "/text/gutenberg/pg11.txt", tmp.file("work"));
    auto eval_stage = [&](const std::string & more) {
        const test::run_result r = test::run_voodoo_stdout(base + more);
        EXPECT_EQ(r.exit_code, 0) << r.output;
        const nlohmann::json plan = nlohmann::json::parse(r.output);
        for (const auto & st : plan["stages"]) {
            if (st["stage"] == "eval") {
                return std::make_pair(st, plan["rates"]);
            }
        }
        ADD_FAILURE() << "no eval stage: " << r.output;
        return std::make_pair(nlohmann::json(), nlohmann::json());
    };
    const auto [none, rates] = eval_stage(" --speed-reps 0");
    const auto [three, rates3] = eval_stage(" --speed-reps 3");
    // 2 files (ours, stock Q4_0) and the reference, 4 chunks of 64 tokens each, at least the floor a token.
    const double floor = rates["eval_seconds_per_token_at_least"].get<double>();
    EXPECT_GE(none["seconds"].get<double>(), 3 * 4 * 64 * floor * (1 - 1e-12));
    EXPECT_EQ(none["work"].get<std::string>().find("llama-bench"), std::string::npos) << none.dump();
    // 3 runs of each file and of the reference (--reference-speed is on by default): 9 runs, each at least its set-up.
    EXPECT_NE(three["work"].get<std::string>().find("llama-bench's pp512 and tg128 of 3 files, 3 times each (--speed-reps 3)"),
              std::string::npos) << three.dump();
    EXPECT_GE(three["seconds"].get<double>() - none["seconds"].get<double>(),
              9 * rates3["bench_run_seconds"].get<double>() * (1 - 1e-12));
}

TEST(quantize, the_dry_runs_eval_counts_the_stock_files_of_all_that_fit_once_per_set_of_tensor_types) {
    // The demo's dry run counted 30 files to score where its eval scored 16: on stories260K llama.cpp's fallbacks
    // make many recipes one file (make_baselines marks them same_types_as, and the eval scores one). The dry run now
    // counts what distinct_stock_recipes plans with llama.cpp's dry run (baseline's tests check that against the
    // files made), plus our file.
    test::temp_dir tmp;
    const test::run_result r = test::run_voodoo_stdout(fmt::format(
        "quantize {} --text {} --eval-text {} --like Q5_0 --ctx 64 --eval-ctx 64 --eval-chunks 4 --speed-reps 0 "
        "--baselines all-that-fit --work {} --dry-run --json -",
        test::stories260k(), test::shared_data() + "/text/tinystories/tinystories_val.txt",
        test::shared_data() + "/text/gutenberg/pg11.txt", tmp.file("work")));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const nlohmann::json plan = nlohmann::json::parse(r.output);
    voodoo::baseline_options bo;
    bo.source = test::stories260k();
    const std::vector<std::string> all = voodoo::recipes_all_that_fit(true);
    const size_t distinct = voodoo::distinct_stock_recipes(bo, all, true).size();  // the run makes its imatrix first
    ASSERT_LT(distinct, all.size()) << "stories260K's recipes share files (llama.cpp's fallbacks)";
    bool found = false;
    for (const auto & st : plan["stages"]) {
        if (st["stage"] == "eval") {
            found = true;
            EXPECT_EQ(st["work"].get<std::string>().rfind(fmt::format("{} files and the reference", 1 + distinct), 0), 0u)
                << st.dump();
        }
    }
    EXPECT_TRUE(found) << r.output;
}

TEST(quantize, a_dry_run_makes_nothing_and_its_byte_figures_are_what_the_real_run_builds) {
    test::temp_dir tmp;
    const std::string work = tmp.file("work");
    const std::string args = fmt::format("quantize {} --text {} --like Q5_0 --ctx 64 --imatrix-chunks 8 --steps 3 "
                                         "--batch 1 --seq 32 --probe-sequences 2 --eval-chunks 0 --candidates all --work {}",
                                         test::stories260k(), test::shared_data() + "/text/tinystories/tinystories_val.txt", work);
    // (--candidates all: the dry run counts every candidate; with the default, targets, the run builds at most those.)
    // Before any run: nothing is made, the like target is not known yet, no candidate counts as built.
    test::run_result r = test::run_voodoo_stdout(args + " --dry-run --json -");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_FALSE(std::filesystem::exists(work)) << "a dry run makes nothing";
    const nlohmann::json before = nlohmann::json::parse(r.output);
    EXPECT_EQ(before["candidates"]["in_cache"], 0);
    EXPECT_GT(before["candidates"]["to_build"].get<int64_t>(), 0);
    EXPECT_TRUE(before["sizes"]["targets"][0]["bytes"].is_null());
    EXPECT_TRUE(before["sizes"]["exact"].get<bool>());  // the imatrix's header keys as the imatrix stage will write them
    // The disk: the candidates to build are exact with --candidates all; the --like file's size is not known yet.
    EXPECT_EQ(before["disk"]["candidates_to_build_bytes"], before["candidates"]["to_build_bytes"]);
    EXPECT_TRUE(before["disk"]["candidates_exact"].get<bool>());
    EXPECT_EQ(before["disk"]["exported_files_unknown"], 1);
    // No stock file is made: no eval compares with one, and the --like target's is sized by llama.cpp's dry run.
    EXPECT_EQ(before["disk"]["stock_files_to_make"], 0);
    EXPECT_EQ(before["disk"]["stock_files_bytes_estimate"].get<double>(), 0.0);
    EXPECT_EQ(before["disk"]["folder"], work + "/candidates");
    EXPECT_GT(before["disk"]["free_bytes"].get<int64_t>(), 0);  // the work folder's nearest existing ancestor's
    std::vector<std::string> stages;
    for (const auto & s : before["stages"]) {
        stages.push_back(s["stage"]);
        EXPECT_GE(s["seconds"].get<double>(), 0.0);
    }
    // No eval stage (--eval-chunks 0), so no baselines stage either.
    EXPECT_EQ(stages, (std::vector<std::string>{"data", "imatrix", "candidates", "probe", "train", "select", "export"}));
    EXPECT_FALSE(before.contains("finished_runs"));

    // The real run: its cache holds exactly the candidates the dry run said it would build.
    r = test::run_voodoo(args);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    int64_t entries = 0;
    double entry_bytes = 0;
    for (const auto & e : std::filesystem::recursive_directory_iterator(work + "/candidates")) {
        if (e.is_regular_file() && e.path().extension() == ".bin") {
            ++entries;
            entry_bytes += static_cast<double>(e.file_size());
        }
    }
    EXPECT_EQ(entries, before["candidates"]["to_build"].get<int64_t>());
    EXPECT_EQ(entry_bytes, before["candidates"]["to_build_bytes"].get<double>());

    // After it: every candidate is in the cache, the imatrix makes the range exact, the stock file's size is known
    // and the file made is within it.
    r = test::run_voodoo_stdout(args + " --dry-run --json -");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const nlohmann::json after = nlohmann::json::parse(r.output);
    EXPECT_EQ(after["candidates"]["count"], before["candidates"]["count"]);
    EXPECT_EQ(after["candidates"]["bytes"], before["candidates"]["bytes"]);
    EXPECT_EQ(after["candidates"]["in_cache"], before["candidates"]["to_build"]);
    EXPECT_EQ(after["candidates"]["in_cache_bytes"], before["candidates"]["to_build_bytes"]);
    EXPECT_EQ(after["candidates"]["to_build"], 0);
    // The target is trained: the plan says the run would reuse it (a new user's trial read 7.8 min for a rerun that
    // takes a second), in the JSON and in the text.
    ASSERT_TRUE(after.contains("finished_runs")) << after.dump();
    EXPECT_EQ(after["finished_runs"], nlohmann::json::array({work + "/run-Q5_0/recipe.json"}));
    r = test::run_voodoo(args + " --dry-run");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("has trained 1 of these targets already (" + work + "/run-Q5_0/recipe.json): a run whose "
                            "inputs are unchanged reuses it"), std::string::npos) << r.output;
    EXPECT_EQ(after["disk"]["candidates_to_build_bytes"], 0.0);
    EXPECT_EQ(after["disk"]["exported_files_unknown"], 0);
    EXPECT_EQ(after["disk"]["stock_files_to_make"], 0);
    EXPECT_TRUE(after["sizes"]["exact"].get<bool>());
    // The range before the imatrix existed was already the exact one (the keys it will write were counted).
    EXPECT_EQ(after["sizes"]["min_bytes"], before["sizes"]["min_bytes"]);
    EXPECT_EQ(after["sizes"]["max_bytes"], before["sizes"]["max_bytes"]);
    // The run made no stock file (no eval), and sized its target without one: both sizes are the file llama.cpp
    // makes with the run's imatrix, made here.
    EXPECT_FALSE(std::filesystem::exists(work + "/baselines/stories260K-Q5_0.gguf"));
    const std::string stock = tmp.file("stories260K-Q5_0.gguf");
    ASSERT_TRUE(make_baseline({test::stories260k(), work + "/imatrix.gguf", 1}, "Q5_0", stock).ok);
    EXPECT_EQ(after["sizes"]["targets"][0]["bytes"].get<double>(), static_cast<double>(file_size(stock)));
    EXPECT_EQ(after["disk"]["exported_files_bytes"].get<double>(), static_cast<double>(file_size(stock)));
    EXPECT_TRUE(after["sizes"]["targets"][0]["feasible"].get<bool>());
    std::string made;
    for (const auto & e : std::filesystem::directory_iterator(work)) {
        if (e.path().filename().string().find(".Voodoo") != std::string::npos && e.path().extension() == ".gguf") {
            made = e.path().string();
        }
    }
    ASSERT_FALSE(made.empty());
    const double made_bytes = static_cast<double>(file_size(made));
    EXPECT_GE(made_bytes, after["sizes"]["min_bytes"].get<double>());
    EXPECT_LE(made_bytes, after["sizes"]["max_bytes"].get<double>());
    // The edge of the range (found by a new user's trial: it was 32 bytes off, the target's text being in the
    // header): the printed minimum for a --target-size is a target the real run accepts, one byte less is not.
    for (const double edge : {0.0, -1.0}) {
        r = test::run_voodoo_stdout(fmt::format("quantize {} --text {} --target-size 270000 --ctx 64 --eval-chunks 0 "
                                                "--baselines none --work {} --dry-run --json -", test::stories260k(),
                                                test::shared_data() + "/text/tinystories/tinystories_val.txt", work));
        ASSERT_EQ(r.exit_code, 0) << r.output;
        const double min_bytes = nlohmann::json::parse(r.output)["sizes"]["targets"][0]["min_bytes"].get<double>();
        r = test::run_voodoo_stdout(fmt::format("quantize {} --text {} --target-size {:.0f} --ctx 64 --eval-chunks 0 "
                                                "--baselines none --work {} --dry-run --json -", test::stories260k(),
                                                test::shared_data() + "/text/tinystories/tinystories_val.txt",
                                                min_bytes + edge, work));
        // Outside the range the dry run still writes its plan, then exits 1 as the real run does.
        ASSERT_EQ(r.exit_code, edge == 0.0 ? 0 : 1) << r.output;
        EXPECT_EQ(nlohmann::json::parse(r.output)["sizes"]["targets"][0]["feasible"].get<bool>(), edge == 0.0) << edge;
        const test::run_result real = test::run_voodoo(fmt::format(
            "quantize {} --text {} --target-size {:.0f} --ctx 64 --imatrix-chunks 8 --steps 1 --batch 1 --seq 32 "
            "--probe-sequences 1 --select-sequences 1 --eval-chunks 0 --baselines none --work {}", test::stories260k(),
            test::shared_data() + "/text/tinystories/tinystories_val.txt", min_bytes + edge, work));
        EXPECT_EQ(real.exit_code, edge == 0.0 ? 0 : 1) << real.output;
    }
    // `voodoo train --dry-run` on the same data, imatrix and cache says the same.
    r = test::run_voodoo_stdout(fmt::format("train --model {} --data {}/data --imatrix {}/imatrix.gguf --target-size {:.0f} "
                                            "--out {} --cache {}/candidates --dry-run --json -",
                                            test::stories260k(), work, work, made_bytes, tmp.file("run"), work));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const nlohmann::json train_plan = nlohmann::json::parse(r.output);
    EXPECT_EQ(train_plan["candidates"]["count"], after["candidates"]["count"]);
    EXPECT_EQ(train_plan["candidates"]["to_build"], 0);
    EXPECT_EQ(train_plan["sizes"]["min_bytes"], after["sizes"]["min_bytes"]);
    EXPECT_TRUE(train_plan["sizes"]["targets"][0]["feasible"].get<bool>());
    EXPECT_FALSE(std::filesystem::exists(tmp.file("run"))) << "a dry run makes nothing";
    // Below the range train's dry run, as quantize's, prints its plan and exits 1 naming the target.
    r = test::run_voodoo(fmt::format("train --model {} --data {}/data --imatrix {}/imatrix.gguf --target-size 1000 "
                                     "--out {} --cache {}/candidates --dry-run", test::stories260k(), work, work,
                                     tmp.file("run"), work));
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find("OUTSIDE the range"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("voodoo: error: --dry-run: size=1000 outside the feasible sizes"), std::string::npos) << r.output;
    EXPECT_FALSE(std::filesystem::exists(tmp.file("run"))) << "a dry run makes nothing";
    EXPECT_NE(r.output.find("bits per weight of the whole file"), std::string::npos) << r.output;
    // A --target-bpw range counts the tensor data, and the line says so (it said "the whole file" before session 37).
    // (the middle of the file's range in bits per weight: inside the tensor data's too, which differs by the metadata)
    const double mid_bpw = (train_plan["sizes"]["min_bpw"].get<double>() + train_plan["sizes"]["max_bpw"].get<double>()) / 2;
    r = test::run_voodoo(fmt::format("train --model {} --data {}/data --imatrix {}/imatrix.gguf --target-bpw {:.3f} "
                                     "--out {} --cache {}/candidates --dry-run", test::stories260k(), work, work, mid_bpw,
                                     tmp.file("run"), work));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("bytes of tensor data"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("bits per weight of the tensor data"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("of the whole file"), std::string::npos) << r.output;
}

TEST(quantize, max_slowdown_keeps_the_predicted_generation_time_within_the_stock_recipes) {
    test::temp_dir tmp;
    const std::string work = tmp.file("work");
    const std::string cache = tmp.file("cache");  // the speed table goes to $XDG_CACHE_HOME/voodoo
    const std::string base = fmt::format("quantize {} --text {} --like Q5_0 --ctx 64 --imatrix-chunks 8 --steps 3 "
                                         "--batch 1 --seq 32 --probe-sequences 2 --eval-chunks 0 --work {}",
                                         test::stories260k(), test::shared_data() + "/text/tinystories/tinystories_val.txt", work);
    // Only with --like: the stock recipe of the same size is what the time is compared with.
    test::run_result r = test::run_voodoo(fmt::format("quantize {} --text {} --target-size 300000 --max-slowdown 0.1",
                                                      test::stories260k(), test::shared_data() + "/text/tinystories/tinystories_val.txt"));
    EXPECT_EQ(r.exit_code, 1);
    EXPECT_NE(r.output.find("--max-slowdown compares each file with the stock recipe of its size: give the target as --like"),
              std::string::npos) << r.output;
    for (const char * bad : {"-0.1", "abc"}) {
        r = test::run_voodoo(fmt::format("quantize {} --text {} --like Q5_0 --max-slowdown {}", test::stories260k(),
                                         test::shared_data() + "/text/tinystories/tinystories_val.txt", bad));
        EXPECT_NE(r.exit_code, 0);
        EXPECT_NE(r.output.find(fmt::format("--max-slowdown: expected a number >= 0, got '{}'", bad)), std::string::npos)
            << r.output;
    }

    const std::string cmd = fmt::format("XDG_CACHE_HOME={} {} {} --max-slowdown 0.02 2>&1", cache, VOODOO_BIN, base);
    FILE * p = popen(cmd.c_str(), "r");
    std::string out;
    char buf[4096];
    for (size_t n; (n = fread(buf, 1, sizeof buf, p)) > 0;) {
        out.append(buf, n);
    }
    ASSERT_EQ(WEXITSTATUS(pclose(p)), 0) << out;
    EXPECT_NE(out.find("== speed: stock Q5_0 predicted at"), std::string::npos) << out;
    EXPECT_NE(out.find("select: --max-slowdown: at most"), std::string::npos) << out;

    // The table was measured once and kept; the file's recipe, predicted with it, is within 1.02 × stock Q5_0.
    const std::string table_path = cache + "/voodoo/type-speed-t1.json";
    ASSERT_TRUE(std::filesystem::exists(table_path)) << out;
    const gguf_file src(test::stories260k());
    // (No eval, so the run made no stock file: the one llama.cpp makes with the run's imatrix, made here.)
    ASSERT_TRUE(make_baseline({test::stories260k(), work + "/imatrix.gguf", 1}, "Q5_0", tmp.file("stories260K-Q5_0.gguf")).ok);
    const gguf_file stock(tmp.file("stories260K-Q5_0.gguf"));
    std::map<std::string, ggml_type> stock_types, voodoo_types;
    std::vector<ggml_type> types;
    for (const gguf_tensor & t : stock.tensors()) {
        stock_types[t.name] = t.type;
    }
    for (const recipe_tensor & t : recipe_load(work + "/run-Q5_0/recipe.json").tensors) {
        voodoo_types[t.name] = t.type;
        types.push_back(t.type);
    }
    const type_speed_table table = load_or_measure_type_speeds(types, 1, table_path);
    for (const auto & [type, spw] : table.seconds_per_weight) {
        EXPECT_GT(spw, 0.0) << type_name(type);
        EXPECT_LT(spw, 1e-6) << type_name(type) << ": a mat-vec runs at more than a million weights per second";
    }
    const double stock_s = predicted_token_seconds(src, stock_types, table);
    const double voodoo_s = predicted_token_seconds(src, voodoo_types, table);
    EXPECT_LE(voodoo_s, 1.02 * stock_s * (1 + 1e-12)) << voodoo_s << " vs stock " << stock_s;
    // stories260K's head is untied: its token embedding is read one row per token, not counted.
    const gguf_tensor * embd = nullptr;
    for (const gguf_tensor & t : src.tensors()) {
        if (t.name == "token_embd.weight") {
            embd = &t;
        }
    }
    ASSERT_NE(embd, nullptr);
    EXPECT_FALSE(read_per_token(src, *embd));
}

TEST(quantize, the_eval_defaults_shrink_with_the_model_above_half_a_billion_weights_and_leave_given_values) {
    // chunks = clamp(round(40 · 0.5 G / n), 8, 40), runs = clamp(round(5 · 0.5 G / n), 1, 5).
    const std::vector<std::tuple<int64_t, int, int>> cases = {
        {260'000, 40, 5}, {30'000'000, 40, 5}, {500'000'000, 40, 5}, {600'000'000, 33, 4},
        {1'720'000'000, 12, 1}, {8'030'000'000, 8, 1}, {70'000'000'000, 8, 1}};
    for (const auto & [n, chunks, reps] : cases) {
        quantize_options o;
        EXPECT_TRUE(apply_eval_defaults(o, n));
        EXPECT_EQ(o.eval_chunks, chunks) << n << " weights";
        EXPECT_EQ(o.speed_reps, reps) << n << " weights";
        EXPECT_EQ(o.reference_speed, n <= 500'000'000) << n << " weights: the source's own speed only when small";
    }
    quantize_options given;
    given.eval_chunks = 100;
    given.speed_reps = 0;
    EXPECT_FALSE(apply_eval_defaults(given, 8'030'000'000));
    EXPECT_EQ(given.eval_chunks, 100);
    EXPECT_EQ(given.speed_reps, 0);
    given.eval_chunks = -1;  // every chunk stays every chunk
    EXPECT_FALSE(apply_eval_defaults(given, 8'030'000'000));
    EXPECT_EQ(given.eval_chunks, -1);
}

TEST(quantize, an_output_folder_without_room_for_the_file_is_refused_before_training_naming_the_folder) {
    // The exported file's disk is checked once the target's bytes are known, before the train stage: a disk that
    // cannot hold it beside the 256 MiB reserve stops the job there, naming the folder and what would fit, instead of
    // after training at the export.
    const test::temp_dir dir;
    const std::string tight = dir.file("tight");
    std::filesystem::create_directories(tight);
    // A tmpfs of the reserve and 64 KiB: stories260K's file at Q5_0's size (≈ 300 KB) does not fit there.
    if (std::system(fmt::format("mount -t tmpfs -o size={} tmpfs '{}' 2>/dev/null", k_disk_reserve_bytes + (int64_t{64} << 10),
                                tight).c_str()) != 0) {
        GTEST_SKIP() << "mounting a tmpfs needs root (CI runs as root)";
    }
    struct unmount {
        std::string d;
        ~unmount() { (void)std::system(fmt::format("umount '{}'", d).c_str()); }
    } const um{tight};
    auto q = small_job(dir.file("work"));
    q.out_dir = tight + "/out";
    const std::string msg = test::error_of([&] { run_quantize(q); });
    EXPECT_NE(msg.find("not enough disk for the exported file in '" + tight + "/out'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("an output folder (-o, --out-dir) on a disk with at least"), std::string::npos) << msg;
    EXPECT_FALSE(std::filesystem::exists(dir.file("work/run-Q5_0/recipe.json")));  // no training ran
    EXPECT_TRUE(std::filesystem::is_empty(tight));
}

TEST(quantize, the_eval_ahead_of_training_gives_the_evals_numbers_bit_for_bit) {
    // --eval-ahead: while the train stage runs in its child process, the reference and the stock files are scored at
    // idle priority and the eval stage finishes the job; every number equals the eval's without it. The recipes are
    // equal (the test above), so are the files, and so must be every figure of eval.json.
    test::temp_dir dir;
    auto plain = small_job(dir.file("a"));
    plain.train_exe = VOODOO_BIN;
    plain.eval_ahead = "off";
    auto ahead = plain;
    ahead.work = dir.file("b");
    ahead.eval_ahead = "on";
    // --eval-ahead files (auto's choice when libllama evaluates on a GPU): the stock files only, made once the
    // train stage says its candidates are built; everything is scored in the eval stage.
    auto files = plain;
    files.work = dir.file("c");
    files.eval_ahead = "files";
    const quantize_result a = run_quantize(plain);
    const quantize_result b = run_quantize(ahead);
    const quantize_result c = run_quantize(files);
    EXPECT_TRUE(a.eval_ahead.empty()) << a.eval_ahead;
    EXPECT_NE(b.eval_ahead.find("the reference"), std::string::npos) << b.eval_ahead;
    EXPECT_EQ(b.eval_ahead.find("nothing kept"), std::string::npos) << b.eval_ahead;
    // How many of the two (Q4_0, Q5_0) it made before the eval stage stopped it depends on timing (training after
    // the candidates is short here); the eval stage makes the rest, and the numbers below are the same either way.
    EXPECT_NE(c.eval_ahead.find(" made once the train stage's candidates were built"), std::string::npos) << c.eval_ahead;
    EXPECT_EQ(c.eval_ahead.find("it failed"), std::string::npos) << c.eval_ahead;
    // Both stock files were made (ahead or at the eval stage) and compared.
    ASSERT_EQ(a.eval.files.size(), 3u);
    ASSERT_EQ(b.eval.files.size(), a.eval.files.size());
    ASSERT_EQ(c.eval.files.size(), a.eval.files.size());
    auto same = [](const eval_file_result & x, const eval_file_result & y) {
        EXPECT_EQ(x.name, y.name);
        EXPECT_EQ(x.file_bytes, y.file_bytes);
        EXPECT_EQ(x.ppl, y.ppl) << x.name;
        EXPECT_EQ(x.kld_mean, y.kld_mean) << x.name;
        EXPECT_EQ(x.kld_err, y.kld_err) << x.name;
        EXPECT_EQ(x.kld_median, y.kld_median) << x.name;
        EXPECT_EQ(x.kld_p99, y.kld_p99) << x.name;
        EXPECT_EQ(x.kld_max, y.kld_max) << x.name;
        EXPECT_EQ(x.same_top, y.same_top) << x.name;
        EXPECT_EQ(x.ln_ppl_ratio_err, y.ln_ppl_ratio_err) << x.name;
    };
    same(a.eval.ref, b.eval.ref);
    same(a.eval.ref, c.eval.ref);
    for (size_t f = 0; f < a.eval.files.size(); ++f) {
        same(a.eval.files[f], b.eval.files[f]);
        same(a.eval.files[f], c.eval.files[f]);
    }
    EXPECT_GT(b.eval.files.front().kld_mean, 0.0);
}

namespace {

// A child running `script` in /bin/sh with SIGINT at its default (the test runner may have it ignored, and a
// non-interactive shell cannot trap a signal ignored on entry).
pid_t sh_child(const char * script) {
    const pid_t pid = fork();
    if (pid == 0) {
        std::signal(SIGINT, SIG_DFL);
        execl("/bin/sh", "sh", "-c", script, static_cast<char *>(nullptr));
        _exit(127);
    }
    return pid;
}

}  // namespace

TEST(quantize, a_stop_request_reaches_the_stages_child_processes_as_one_sigint_each) {
    // Two "ranks" that stop cleanly (exit 130, as voodoo does on SIGINT) only when told, each on its own after 10 s
    // with exit 7 (so a signal that never comes fails the test rather than hangs it), and one that ends by itself.
    // The stop is asked only once both have set their trap (each touches a file after it), so that a slow start on a
    // loaded machine cannot meet the signal at its default action.
    const test::temp_dir dir;
    const std::string a = dir.file("a.ready"), b = dir.file("b.ready");
    auto waits = [](const std::string & ready) {
        return fmt::format("trap 'exit 130' INT; touch '{}'; i=0; while [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done; "
                           "exit 7", ready);
    };
    const std::string sa = waits(a), sb = waits(b);
    const std::vector<int> pids = {sh_child(sa.c_str()), sh_child("exit 3"), sh_child(sb.c_str())};
    auto stop = [&] { return std::filesystem::exists(a) && std::filesystem::exists(b); };
    std::vector<size_t> order;
    const std::vector<int> status = wait_children(pids, stop, [&](size_t i, int) { order.push_back(i); });
    ASSERT_EQ(status.size(), 3u);
    for (size_t i : {size_t{0}, size_t{2}}) {
        ASSERT_TRUE(WIFEXITED(status[i])) << i;
        EXPECT_EQ(WEXITSTATUS(status[i]), 130) << "child " << i << " did not get the SIGINT";
    }
    ASSERT_TRUE(WIFEXITED(status[1]));
    EXPECT_EQ(WEXITSTATUS(status[1]), 3);
    std::sort(order.begin(), order.end());
    EXPECT_EQ(order, (std::vector<size_t>{0, 1, 2}));  // on_exit once for each

    // No stop test: a child runs to its own end.
    const std::vector<int> alone = wait_children({sh_child("sleep 0.2; exit 0")}, {});
    ASSERT_TRUE(WIFEXITED(alone[0]));
    EXPECT_EQ(WEXITSTATUS(alone[0]), 0);
}
