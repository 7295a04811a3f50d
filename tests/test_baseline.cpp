// `voodoo baseline`: stock recipes through llama_model_quantize, the imatrix passed through, refusals.
#include "common/error.h"
#include "eval/baseline.h"
#include "imatrix/imatrix.h"
#include "ggml/gguf.h"
#include "ggml/runtime.h"
#include "ggml/types.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <llama.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include <sys/stat.h>

namespace {

using voodoo::test::stories260k;

voodoo::baseline_options options(const std::string & imatrix = "") {
    setenv("VOODOO_PROGRESS", "0", 1);
    return {stories260k(), imatrix, 1};
}

/// A GGUF imatrix as llama-imatrix writes it: <tensor>.in_sum2 [ne0] and <tensor>.counts [1] for every
/// 2-D weight of stories260K, with sums = count · (1 + column index / ne0) so columns differ in weight.
std::string write_imatrix(const voodoo::test::temp_dir & dir) {
    const voodoo::gguf_file src(stories260k());
    const std::string path = dir.file("imatrix.gguf");
    voodoo::gguf_writer w(path);
    const char * datasets[] = {"tinystories_val.txt"};
    gguf_set_arr_str(w.ctx(), "imatrix.datasets", datasets, 1);
    gguf_set_val_u32(w.ctx(), "imatrix.chunk_count", 10);
    gguf_set_val_u32(w.ctx(), "imatrix.chunk_size", 512);
    std::vector<std::pair<std::string, std::vector<float>>> data;
    for (const auto & t : src.tensors()) {
        if (t.n_dims != 2 || t.name == "token_embd.weight") {
            continue;
        }
        const float count = 5120;
        std::vector<float> sums(static_cast<size_t>(t.ne[0]));
        for (size_t i = 0; i < sums.size(); ++i) {
            sums[i] = count * (1.0f + static_cast<float>(i) / static_cast<float>(sums.size()));
        }
        data.emplace_back(t.name + ".in_sum2", sums);
        data.emplace_back(t.name + ".counts", std::vector<float>{count});
    }
    for (const auto & [name, v] : data) {
        const int64_t ne[1] = {static_cast<int64_t>(v.size())};
        w.add_tensor(name, GGML_TYPE_F32, ne);
    }
    w.begin_data();
    for (const auto & [name, v] : data) {
        w.write_tensor(name, {reinterpret_cast<const uint8_t *>(v.data()), v.size() * sizeof(float)});
    }
    w.commit();
    return path;
}

TEST(baseline, q8_0_quantizes_every_weight_whose_rows_fit_and_loads_in_libllama) {
    voodoo::test::temp_dir dir;
    const std::string out = dir.file("q8.gguf");
    const voodoo::baseline_result r = voodoo::make_baseline(options(), "q8_0", out);
    EXPECT_TRUE(r.ok);
    EXPECT_EQ(r.recipe, "Q8_0");
    const voodoo::gguf_file made(out);
    const voodoo::gguf_file src(stories260k());
    ASSERT_EQ(made.tensors().size(), src.tensors().size());
    for (const auto & t : made.tensors()) {
        EXPECT_EQ(t.ne, src.tensor(t.name).ne) << t.name;
        // llama.cpp's rule: 1-D tensors stay F32; Q8_0 where 32 divides ne0; ffn_down (ne0 = 172) falls back to F16.
        const ggml_type want = t.n_dims == 1 ? GGML_TYPE_F32 : t.ne[0] % 32 == 0 ? GGML_TYPE_Q8_0 : GGML_TYPE_F16;
        EXPECT_EQ(t.type, want) << t.name;
    }
    EXPECT_EQ(r.file_bytes, made.file_size());
    EXPECT_EQ(r.type_counts.at("q8_0"), 32);
    EXPECT_EQ(r.type_counts.at("f16"), 5);
    EXPECT_NEAR(r.bpw, 9.966, 0.0005);  // the value written to 3 decimals: half a unit of the last
    EXPECT_EQ(made.get_int("general.file_type"), LLAMA_FTYPE_MOSTLY_Q8_0);

    voodoo::llama_runtime_init();
    llama_model_params mp = llama_model_default_params();
    llama_model * m = llama_model_load_from_file(out.c_str(), mp);
    ASSERT_NE(m, nullptr);
    int64_t n_weights = 0;
    for (const auto & t : src.tensors()) {
        n_weights += t.n_elements();
    }
    EXPECT_EQ(static_cast<int64_t>(llama_model_n_params(m)), n_weights);
    llama_model_free(m);
}

TEST(baseline, iq2_and_q2_k_s_recipes_without_an_imatrix_are_refused) {
    voodoo::test::temp_dir dir;
    for (const char * name : {"IQ2_XXS", "IQ2_M", "IQ1_S", "IQ3_XXS", "Q2_K_S"}) {
        const std::string msg = voodoo::test::error_of([&] { voodoo::make_baseline(options(), name, dir.file("x.gguf")); });
        EXPECT_NE(msg.find(std::string("recipe ") + name + " needs an imatrix"), std::string::npos) << msg;
        EXPECT_NE(msg.find("--imatrix"), std::string::npos) << msg;
    }
    EXPECT_FALSE(std::filesystem::exists(dir.file("x.gguf")));
}

TEST(baseline, the_imatrix_reaches_llama_model_quantize_with_llama_quantizes_metadata) {
    voodoo::test::temp_dir dir;
    const std::string im = write_imatrix(dir);
    const voodoo::imatrix q = voodoo::read_imatrix(im);
    EXPECT_EQ(q.entries.size(), 36u);  // output + 7 weights × 5 blocks
    EXPECT_FLOAT_EQ(voodoo::imatrix_column_importance(q, "blk.0.attn_q.weight")[32], 1.5f);  // sums / count

    const std::string with = dir.file("with.gguf");
    const voodoo::baseline_result r = voodoo::make_baseline(options(im), "IQ2_XXS", with);
    ASSERT_TRUE(r.ok);
    const voodoo::gguf_file made(with);
    EXPECT_EQ(made.get_string("quantize.imatrix.file"), im);
    EXPECT_EQ(made.get_string("quantize.imatrix.dataset"), "tinystories_val.txt");
    EXPECT_EQ(made.get_int("quantize.imatrix.entries_count"), 36);
    EXPECT_EQ(made.get_int("quantize.imatrix.chunks_count"), 10);

    // The imatrix weighs the rounding: IQ4_NL (IQ2_XXS's fallback for 64-wide rows) bytes change with it.
    const std::string without = dir.file("without.gguf");
    voodoo::make_baseline(options(), "IQ4_NL", without);
    const std::string with_nl = dir.file("with-nl.gguf");
    voodoo::make_baseline(options(im), "IQ4_NL", with_nl);
    const voodoo::gguf_file a(without), b(with_nl);
    const auto & ta = a.tensor("blk.0.attn_q.weight");
    const auto & tb = b.tensor("blk.0.attn_q.weight");
    ASSERT_EQ(ta.type, GGML_TYPE_IQ4_NL);
    ASSERT_EQ(tb.type, GGML_TYPE_IQ4_NL);
    EXPECT_FALSE(std::equal(a.data(ta).begin(), a.data(ta).end(), b.data(tb).begin()));
}

TEST(baseline, a_broken_imatrix_is_an_error_naming_it_and_nothing_is_written) {
    voodoo::test::temp_dir dir;
    const std::string dat = dir.file("imatrix.dat");
    std::ofstream(dat, std::ios::binary) << std::string("\x02\x00\x00\x00xxxx", 8);
    const std::string msg = voodoo::test::error_of([&] { voodoo::make_baseline(options(dat), "IQ2_XXS", dir.file("x.gguf")); });
    EXPECT_NE(msg.find(dat), std::string::npos) << msg;
    EXPECT_FALSE(std::filesystem::exists(dir.file("x.gguf")));
}

TEST(baseline, an_imatrix_of_another_model_is_refused) {
    voodoo::test::temp_dir dir;
    voodoo::imatrix im;
    im.entries["blk.0.attn_q.weight"] = {std::vector<float>(128, 1.0f), {10}};  // stories260K's rows are 64 wide
    im.datasets = {"x.txt"};
    im.chunk_count = 1;
    im.chunk_size = 64;
    const std::string path = dir.file("other.gguf");
    voodoo::write_imatrix_gguf(path, im);
    const std::string msg = voodoo::test::error_of([&] { voodoo::make_baseline(options(path), "IQ2_XXS", dir.file("x.gguf")); });
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_NE(msg.find("blk.0.attn_q.weight"), std::string::npos) << msg;
}

TEST(baseline, never_writes_over_the_source) {
    voodoo::test::temp_dir dir;
    const std::string src = dir.file("src.gguf");
    std::filesystem::copy_file(stories260k(), src);
    voodoo::baseline_options o = options();
    o.source = src;
    const std::string msg = voodoo::test::error_of([&] { voodoo::make_baseline(o, "Q8_0", src); });
    EXPECT_NE(msg.find("is the source file"), std::string::npos) << msg;
    EXPECT_EQ(std::filesystem::file_size(src), std::filesystem::file_size(stories260k()));
}

TEST(baseline, an_unknown_recipe_lists_the_known_ones) {
    const std::string msg = voodoo::test::error_of([] { voodoo::recipe_by_name("Q4_K_X"); });
    EXPECT_NE(msg.find("unknown recipe 'Q4_K_X'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("Q4_K_M"), std::string::npos) << msg;
    EXPECT_EQ(voodoo::recipe_by_name("q4_k").ftype, LLAMA_FTYPE_MOSTLY_Q4_K_M);  // llama-quantize's alias
}

TEST(baseline, all_that_fit_leaves_out_the_imatrix_recipes_only_without_an_imatrix) {
    const auto without = voodoo::recipes_all_that_fit(false);
    const auto with = voodoo::recipes_all_that_fit(true);
    const auto has = [](const std::vector<std::string> & v, const char * n) {
        return std::find(v.begin(), v.end(), n) != v.end();
    };
    for (const char * n : {"Q4_0", "Q8_0", "Q4_K_M", "Q6_K", "IQ4_NL", "IQ3_S", "F16", "BF16"}) {
        EXPECT_TRUE(has(without, n)) << n;
        EXPECT_TRUE(has(with, n)) << n;
    }
    for (const char * n : {"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "Q2_K_S"}) {
        EXPECT_FALSE(has(without, n)) << n;
        EXPECT_TRUE(has(with, n)) << n;
    }
    EXPECT_FALSE(has(with, "F32"));
    EXPECT_FALSE(has(with, "Q4_K"));  // aliases are not made twice
}

TEST(baseline_cli, all_that_fit_makes_every_file_and_marks_the_ones_that_fell_back_to_the_same_types) {
    voodoo::test::temp_dir dir;
    const auto r = voodoo::test::run_voodoo("baseline " + stories260k() + " --recipes all-that-fit --threads 1 --out-dir " +
                                            dir.file("b"));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    std::ifstream in(dir.file("b/baselines.json"));
    const auto j = nlohmann::json::parse(in);
    EXPECT_EQ(j.size(), voodoo::recipes_all_that_fit(false).size());
    std::map<std::string, nlohmann::json> by;
    for (const auto & e : j) {
        EXPECT_TRUE(e["ok"].get<bool>()) << e.dump();
        EXPECT_TRUE(std::filesystem::exists(e["path"].get<std::string>()));
        by[e["recipe"]] = e;
    }
    // 64-wide rows fit no 256-block type: Q6_K falls back to Q8_0 everywhere, Q2_K to Q4_0.
    EXPECT_EQ(by["Q6_K"]["same_types_as"], "Q8_0");
    EXPECT_EQ(by["Q2_K"]["same_types_as"], "Q4_0");
    EXPECT_EQ(by["Q8_0"]["file_bytes"], 379168);
    EXPECT_NE(r.output.find("| Q4_K_M | stories260K-Q4_K_M.gguf |"), std::string::npos) << r.output;
}

TEST(baseline_cli, a_dry_run_makes_nothing_and_gives_each_files_bytes_and_types_as_made) {
    // `voodoo baseline --dry-run`: llama.cpp's dry run sizes each recipe without making it (plan_stock_file), so its
    // JSON is what the files made then read, field for field, and the folder stays empty.
    voodoo::test::temp_dir dir;
    const std::string im = write_imatrix(dir);
    const std::string args = "baseline " + stories260k() + " --recipes Q4_K_M,IQ2_XXS,Q8_0,Q6_K --imatrix " + im + " --threads 1 ";
    const auto dry = voodoo::test::run_voodoo_stdout(args + "--dry-run --json -");
    ASSERT_EQ(dry.exit_code, 0) << dry.output;
    EXPECT_FALSE(std::filesystem::exists(dir.file("b")));
    const auto made = voodoo::test::run_voodoo(args + "--out-dir " + dir.file("b"));
    ASSERT_EQ(made.exit_code, 0) << made.output;
    std::ifstream in(dir.file("b/baselines.json"));
    const auto want = nlohmann::json::parse(in);
    const auto got = nlohmann::json::parse(dry.output);
    ASSERT_EQ(got.size(), 4u);
    EXPECT_EQ(got[3]["same_types_as"], "Q8_0");  // 64-wide rows: Q6_K falls back to Q8_0 everywhere
    for (size_t i = 0; i < got.size(); ++i) {
        for (const char * key : {"recipe", "file_bytes", "tensor_bytes", "n_weights", "bpw", "type_counts", "same_types_as"}) {
            EXPECT_EQ(got[i][key], want[i][key]) << key << " of " << want[i]["recipe"];
        }
    }
    EXPECT_NE(voodoo::test::run_voodoo("baseline " + stories260k() + " --dry-run").output.find(
                  "--dry-run needs --recipe NAME or --recipes LIST"), std::string::npos);
    const auto out = voodoo::test::run_voodoo("baseline " + stories260k() + " --recipe Q4_0 --dry-run --out " + dir.file("x.gguf"));
    EXPECT_EQ(out.exit_code, 1);
    EXPECT_NE(out.output.find("--dry-run makes no file"), std::string::npos) << out.output;
    EXPECT_FALSE(std::filesystem::exists(dir.file("x.gguf")));
}

TEST(baseline_cli, says_what_all_that_fit_leaves_out_makes_a_recipe_named_twice_once_and_names_a_missing_source) {
    voodoo::test::temp_dir dir;
    // Without an imatrix, all-that-fit leaves out the 8 recipes that need one, and says which.
    const auto all = voodoo::test::run_voodoo("baseline " + stories260k() + " --recipes all-that-fit --dry-run --threads 1");
    ASSERT_EQ(all.exit_code, 0) << all.output;
    const size_t note = all.output.find("--recipes all-that-fit without --imatrix leaves out the recipes that need one (");
    ASSERT_NE(note, std::string::npos) << all.output;
    const std::string left = all.output.substr(note, all.output.find('\n', note) - note);
    for (const char * n : {"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "Q2_K_S"}) {
        EXPECT_NE(left.find(n), std::string::npos) << n << " in " << left;
    }
    // One recipe named twice (in two spellings): one file, and stderr says so.
    const auto twice = voodoo::test::run_voodoo("baseline " + stories260k() + " --recipes Q4_0,Q8_0,q4_0,Q4_K_M,Q4_K --threads 1 --out-dir " +
                                                dir.file("b"));
    ASSERT_EQ(twice.exit_code, 0) << twice.output;
    EXPECT_NE(twice.output.find("--recipes names Q4_0 twice (as q4_0): made once"), std::string::npos) << twice.output;
    EXPECT_NE(twice.output.find("--recipes names Q4_K_M twice (as Q4_K): made once"), std::string::npos) << twice.output;
    std::ifstream in(dir.file("b/baselines.json"));
    EXPECT_EQ(nlohmann::json::parse(in).size(), 3u);
    // Names are checked by their flag, with what else the flag takes; spaces after commas are dropped.
    const auto unknown = voodoo::test::run_voodoo("baseline " + stories260k() + " --recipes Q4_0,all --dry-run");
    EXPECT_EQ(unknown.exit_code, 1) << unknown.output;
    EXPECT_NE(unknown.output.find("--recipes: unknown recipe 'all'"), std::string::npos) << unknown.output;
    EXPECT_NE(unknown.output.find("; or --recipes all-that-fit"), std::string::npos) << unknown.output;
    const auto several = voodoo::test::run_voodoo("baseline " + stories260k() + " --recipe Q4_0,Q8_0 --out " + dir.file("x.gguf"));
    EXPECT_NE(several.output.find("--recipe: unknown recipe 'Q4_0,Q8_0'"), std::string::npos) << several.output;
    EXPECT_NE(several.output.find("several recipes: --recipes A,B with --out-dir DIR"), std::string::npos) << several.output;
    const auto spaced = voodoo::test::run_voodoo("baseline " + stories260k() + " --recipes 'Q4_0, Q8_0' --dry-run");
    EXPECT_EQ(spaced.exit_code, 0) << spaced.output;
    EXPECT_NE(spaced.output.find("| Q8_0 |"), std::string::npos) << spaced.output;
    const auto no_im = voodoo::test::run_voodoo("baseline " + stories260k() + " --recipe Q4_0 --imatrix " + dir.file("im.gguf") +
                                                " --out " + dir.file("x.gguf"));
    EXPECT_EQ(no_im.exit_code, 2) << no_im.output;
    EXPECT_NE(no_im.output.find("--imatrix: File does not exist: " + dir.file("im.gguf")), std::string::npos) << no_im.output;
    // --out and --out-dir each go with their own flag; --out naming a folder is refused before any work.
    const auto both = voodoo::test::run_voodoo("baseline " + stories260k() + " --recipe Q4_0 --out " + dir.file("y.gguf") +
                                               " --out-dir " + dir.file("d"));
    EXPECT_EQ(both.exit_code, 1) << both.output;
    EXPECT_NE(both.output.find("--out-dir goes with --recipes (several files)"), std::string::npos) << both.output;
    const auto both2 = voodoo::test::run_voodoo("baseline " + stories260k() + " --recipes Q4_0 --out " + dir.file("y.gguf") +
                                                " --out-dir " + dir.file("d"));
    EXPECT_NE(both2.output.find("--out goes with --recipe (one file)"), std::string::npos) << both2.output;
    const auto folder = voodoo::test::run_voodoo("baseline " + stories260k() + " --recipe Q4_0 --out " + dir.path.string());
    EXPECT_EQ(folder.exit_code, 1) << folder.output;
    EXPECT_NE(folder.output.find("' is a folder: give the file's path"), std::string::npos) << folder.output;
    EXPECT_FALSE(std::filesystem::exists(dir.file("y.gguf")));
    EXPECT_FALSE(std::filesystem::exists(dir.file("d")));
    // An --out-dir that is a file is refused by its flag, nothing made.
    const auto file_dir = voodoo::test::run_voodoo("baseline " + stories260k() + " --recipes Q4_0 --out-dir " + stories260k() + "/sub");
    EXPECT_EQ(file_dir.exit_code, 2) << file_dir.output;
    EXPECT_NE(file_dir.output.find("--out-dir: '" + stories260k() + "' is a file, not a folder"), std::string::npos) << file_dir.output;
    // A missing source is named, as missing, before anything runs.
    const auto missing = voodoo::test::run_voodoo("baseline " + dir.file("nope.gguf") + " --recipe Q4_0 --out " + dir.file("x.gguf"));
    EXPECT_EQ(missing.exit_code, 2) << missing.output;  // a usage error, as every flag CLI11 refuses
    EXPECT_NE(missing.output.find("source: File does not exist: " + dir.file("nope.gguf")), std::string::npos) << missing.output;
    EXPECT_NE(missing.output.find("does not exist"), std::string::npos) << missing.output;
}

}  // namespace

TEST(baseline, a_folder_keyed_on_its_inputs_reuses_a_stock_file_already_made_and_describes_it_alike) {
    // voodoo quantize's eval ahead makes a stock file during training; its eval's baselines then read that same file
    // (reuse_existing) instead of quantizing the model again (issue #16: 26 s at the Qwen3-1.7B shape, ≈ 105 s at
    // Llama-3.1-8B's). The description must be make_baseline's, field for field.
    voodoo::test::temp_dir dir;
    const std::string folder = dir.file("b");
    voodoo::baseline_options o = options();
    const auto made = voodoo::make_baselines(o, {"Q4_0", "Q8_0"}, folder);
    ASSERT_EQ(made.size(), 2u);
    ASSERT_TRUE(made[0].ok && made[1].ok) << made[0].error << made[1].error;
    struct stat before {};
    ASSERT_EQ(stat(made[0].path.c_str(), &before), 0);

    o.reuse_existing = true;
    std::filesystem::remove(made[1].path);  // one file gone: that one is made again, the other read
    const auto again = voodoo::make_baselines(o, {"Q4_0", "Q8_0"}, folder);
    ASSERT_EQ(again.size(), 2u);
    struct stat after {};
    ASSERT_EQ(stat(again[0].path.c_str(), &after), 0);
    EXPECT_EQ(after.st_ino, before.st_ino) << "the existing file was quantized again (a new file renamed over it)";
    for (size_t i = 0; i < 2; ++i) {
        EXPECT_TRUE(again[i].ok) << again[i].error;
        EXPECT_EQ(again[i].file_bytes, made[i].file_bytes);
        EXPECT_EQ(again[i].tensor_bytes, made[i].tensor_bytes);
        EXPECT_EQ(again[i].n_weights, made[i].n_weights);
        EXPECT_EQ(again[i].type_counts, made[i].type_counts);
        EXPECT_EQ(again[i].tensor_types, made[i].tensor_types);
    }
    EXPECT_EQ(voodoo::test::read_file(again[1].path).size(), made[1].file_bytes);

    o.reuse_existing = false;  // the default (voodoo baseline): always made, so a changed imatrix is never missed
    const auto remade = voodoo::make_baselines(o, {"Q4_0"}, folder);
    ASSERT_TRUE(remade[0].ok);
    struct stat third {};
    ASSERT_EQ(stat(remade[0].path.c_str(), &third), 0);
    EXPECT_NE(third.st_ino, before.st_ino);
}


namespace {

// Every recipe that fits `model` made into `folder`; then for each made file's size and each midpoint between
// neighbours, the six nearest made files (duplicates by tensor types left out, as pick_baselines does) are among the
// recipes nearest_stock_recipes picks for that size without making any.
void expect_nearest_recipes_cover_the_six_nearest(const std::string & model, const std::string & imatrix,
                                                   const std::string & folder, bool fewer) {
    voodoo::baseline_options o{model, imatrix, 2};
    const std::vector<std::string> names = voodoo::recipes_all_that_fit(!imatrix.empty());
    const auto made = voodoo::make_baselines(o, names, folder);
    // Each file as plan_stock_file planned it without making it (llama.cpp's dry run, the header laid out as
    // llama-quant.cpp lays it): the same size to the byte, the same type for every tensor.
    for (const auto & r : made) {
        if (!r.ok) {
            continue;
        }
        const voodoo::stock_plan plan = voodoo::plan_stock_file(o, r.recipe);
        EXPECT_EQ(plan.file_bytes, r.file_bytes) << r.recipe << " of " << model;
        EXPECT_EQ(plan.tensor_bytes, r.tensor_bytes) << r.recipe << " of " << model;
        const voodoo::gguf_file file(r.path);
        ASSERT_EQ(plan.types.size(), file.tensors().size()) << r.recipe;
        for (const auto & t : file.tensors()) {
            EXPECT_EQ(plan.types.at(t.name), t.type) << r.recipe << " " << t.name;
        }
    }
    std::vector<const voodoo::baseline_result *> ok;
    for (const auto & r : made) {
        if (r.ok && r.same_types_as.empty()) {
            ok.push_back(&r);
        }
    }
    ASSERT_GT(ok.size(), 6u);
    // The files the eval scores (one per set of tensor types), as the dry run counts them without making any.
    std::vector<std::string> scored;
    for (const auto * r : ok) {
        scored.push_back(r->recipe);
    }
    EXPECT_EQ(voodoo::distinct_stock_recipes(o, names), scored) << model;
    std::sort(ok.begin(), ok.end(), [](auto * a, auto * b) { return a->file_bytes < b->file_bytes; });
    std::vector<size_t> sizes;
    for (size_t i = 0; i < ok.size(); ++i) {
        sizes.push_back(ok[i]->file_bytes);
        if (i + 1 < ok.size()) {
            sizes.push_back((ok[i]->file_bytes + ok[i + 1]->file_bytes) / 2);
        }
    }
    // The sizing's largest error over the files made: |file bytes − (dry-run tensor bytes + the source's other bytes)|.
    const voodoo::gguf_file src(model);
    double outside = static_cast<double>(src.file_size()), error = 0;
    for (const auto & t : src.tensors()) {
        outside -= static_cast<double>(t.n_bytes);
    }
    for (const auto * r : ok) {
        const double est = voodoo::stock_tensor_bytes(o, voodoo::recipe_by_name(r->recipe)) + outside;
        error = std::max(error, std::abs(est - static_cast<double>(r->file_bytes)));
    }
    EXPECT_LT(error, 0.02 * static_cast<double>(ok.front()->file_bytes)) << "the dry run sizes the stock files";
    for (size_t ours : sizes) {
        const std::vector<std::string> chosen = voodoo::nearest_stock_recipes(o, names, {ours}, 6);
        if (fewer) {
            EXPECT_LE(chosen.size(), names.size() / 2) << ours;  // 8 and the ties of the 8th
        }
        std::vector<const voodoo::baseline_result *> by = ok;
        std::sort(by.begin(), by.end(), [&](auto * a, auto * b) {
            return std::abs(static_cast<double>(a->file_bytes) - static_cast<double>(ours)) <
                   std::abs(static_cast<double>(b->file_bytes) - static_cast<double>(ours));
        });
        // Every file nearer than the sixth nearest by more than twice the sizing's largest error (its dry run prints
        // MiB to two decimals, and the headers differ by a few keys), ties included: pick_baselines may take any.
        const double sixth = std::abs(static_cast<double>(by[5]->file_bytes) - static_cast<double>(ours));
        for (const auto * r : by) {
            if (std::abs(static_cast<double>(r->file_bytes) - static_cast<double>(ours)) <= sixth - 2 * error) {
                EXPECT_NE(std::find(chosen.begin(), chosen.end(), r->recipe), chosen.end())
                    << r->recipe << " (" << r->file_bytes << " bytes) is among the six nearest " << ours
                    << " bytes but would not be made";
            }
        }
    }
}

}  // namespace

TEST(baseline, nearest_makes_only_the_recipes_that_can_be_nearest_and_the_dry_run_plans_every_stock_file_to_the_byte) {
    // Issue #16: `--baselines nearest` made every stock recipe (29 files) to keep the six nearest in size. It now
    // sizes each by llama_model_quantize's dry run and makes the eight nearest each of our sizes; checked against
    // every file made, on stories260K (its dims fit only 32-block types: llama.cpp falls back for most tensors, and
    // many recipes tie) and mix30M (learned weights, every type fits).
    voodoo::test::temp_dir dir;
    expect_nearest_recipes_cover_the_six_nearest(stories260k(), write_imatrix(dir), dir.file("stories"), false);
    expect_nearest_recipes_cover_the_six_nearest(voodoo::test::shared_data() + "/models/mix30M/mix30M.gguf", "",
                                                 dir.file("mix"), true);
}
