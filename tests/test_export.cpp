#include "common/error.h"
#include "export/export.h"
#include "ggml/inspect.h"
#include "ggml/runtime.h"
#include "ggml/types.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <llama.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <set>

#include <signal.h>
#include <sys/resource.h>

using namespace voodoo;
using voodoo::test::error_of;
using voodoo::test::temp_dir;

namespace {

// A recipe that cycles through every type of each tensor's menu, so the file mixes many types.
recipe mixed_recipe(const gguf_file & src, const std::vector<ggml_type> & cycle) {
    recipe r = recipe_from_model(src);
    size_t i = 0;
    for (recipe_tensor & t : r.tensors) {
        for (size_t k = 0; k < cycle.size(); ++k) {
            const ggml_type type = cycle[(i + k) % cycle.size()];
            if (type_fits(type, t.shape[0])) {
                t.type = type;
                break;
            }
        }
        t.bytes = tensor_bytes(t.type, t.shape, t.name);
        ++i;
    }
    return r;
}

importance_map random_importance(const gguf_file & src, uint32_t seed) {
    importance_map m;
    for (const recipe_tensor & t : recipe_from_model(src).tensors) {
        auto v = test::gaussian(static_cast<size_t>(t.shape[0]), seed++);
        for (float & x : v) {
            x = 0.1f + x * x;
        }
        m[t.name] = v;
    }
    return m;
}


const std::vector<ggml_type> k_export_cycle = {GGML_TYPE_IQ4_NL, GGML_TYPE_Q4_0, GGML_TYPE_Q4_1, GGML_TYPE_Q5_0,
                                        GGML_TYPE_Q5_1,   GGML_TYPE_Q8_0, GGML_TYPE_F16,  GGML_TYPE_BF16};

}  // namespace

TEST(export_gguf, equals_llama_model_quantize_with_the_recipe_as_overrides_on_stories260k) {
    temp_dir dir;
    gguf_file src(test::stories260k());
    const recipe r = mixed_recipe(src, k_export_cycle);
    std::set<ggml_type> used;
    for (const auto & t : r.tensors) {
        used.insert(t.type);
    }
    EXPECT_GE(used.size(), 6u);
    const std::string ours = dir.file("ours.gguf"), theirs = dir.file("theirs.gguf");
    export_gguf(src, r, ours, {});
    ASSERT_TRUE(test::llama_quantize_with_recipe(src.path(), theirs, r, nullptr));
    test::expect_same_tensor_data(ours, theirs);
}

TEST(export_gguf, equals_llama_model_quantize_with_the_same_imatrix) {
    temp_dir dir;
    gguf_file src(test::stories260k());
    const recipe r = mixed_recipe(src, k_export_cycle);
    const importance_map importance = random_importance(src, 11);
    export_options opts;
    opts.importance = &importance;
    opts.imatrix_file = "random.imatrix";
    const std::string ours = dir.file("ours.gguf"), theirs = dir.file("theirs.gguf");
    export_gguf(src, r, ours, opts);
    ASSERT_TRUE(test::llama_quantize_with_recipe(src.path(), theirs, r, &importance));
    test::expect_same_tensor_data(ours, theirs);
    // and the imatrix changed the bytes
    const std::string plain = dir.file("plain.gguf");
    export_gguf(src, r, plain, {});
    gguf_file a(ours), b(plain);
    const auto & t = a.tensor("blk.0.attn_q.weight");
    EXPECT_NE(std::memcmp(a.data(t).data(), b.data(b.tensor(t.name)).data(), t.n_bytes), 0);
    EXPECT_EQ(a.get_string("quantize.imatrix.file"), "random.imatrix");
}

TEST(export_gguf, output_loads_in_libllama_and_decodes) {
    temp_dir dir;
    gguf_file src(test::stories260k());
    const std::string out = dir.file("out.gguf");
    export_gguf(src, mixed_recipe(src, k_export_cycle), out, {});
    llama_runtime_init();
    llama_model_params mp = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(out.c_str(), mp);
    ASSERT_NE(model, nullptr);
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 64;
    cp.n_batch = 64;
    llama_context * ctx = llama_init_from_model(model, cp);
    ASSERT_NE(ctx, nullptr);
    std::vector<llama_token> tokens = {1, 400, 401, 402, 403, 404, 405, 406};
    ASSERT_EQ(llama_decode(ctx, llama_batch_get_one(tokens.data(), static_cast<int32_t>(tokens.size()))), 0);
    const float * logits = llama_get_logits_ith(ctx, -1);
    ASSERT_NE(logits, nullptr);
    for (int i = 0; i < 512; ++i) {
        ASSERT_TRUE(std::isfinite(logits[i]));
    }
    llama_free(ctx);
    llama_model_free(model);
}

TEST(export_gguf, metadata_is_copied_with_file_type_and_provenance) {
    temp_dir dir;
    gguf_file src(test::stories260k());
    recipe r = mixed_recipe(src, {GGML_TYPE_Q8_0});  // bulk Q8_0; ffn_down falls to f16 by the cycle rule
    for (auto & t : r.tensors) {
        if (!type_fits(GGML_TYPE_Q8_0, t.shape[0])) {
            t.type = GGML_TYPE_F16;
            t.bytes = tensor_bytes(t.type, t.shape, t.name);
        }
    }
    r.target = "ratio=1";
    export_options opts;
    opts.target = r.target;
    const std::string out = dir.file("out.gguf");
    const export_result res = export_gguf(src, r, out, opts);
    gguf_file f(out);
    for (int64_t i = 0; i < src.n_kv(); ++i) {
        const std::string key = gguf_get_key(src.ctx(), i);
        ASSERT_GE(f.find_key(key), 0) << key;
        if (key != "general.file_type") {
            EXPECT_EQ(f.kv_json(f.find_key(key)), src.kv_json(i)) << key;
        }
    }
    EXPECT_EQ(f.get_int("general.file_type"), LLAMA_FTYPE_MOSTLY_Q8_0);
    EXPECT_EQ(f.get_string("voodoo.recipe_hash"), recipe_hash(r));
    EXPECT_EQ(f.get_string("voodoo.target"), "ratio=1");
    EXPECT_EQ(*f.get_float("voodoo.bpw"), static_cast<double>(static_cast<float>(res.bpw)));  // an f32: rounded once
    // The all-Q8_0 recipe (with llama.cpp's F16 fallback) is the Q8_0 reference itself.
    EXPECT_EQ(res.file_bytes, q8_0_file_bytes(src, opts));
    EXPECT_DOUBLE_EQ(res.q8_0_ratio, 1.0);
    EXPECT_EQ(std::filesystem::path(default_output_path(dir.path.string(), src, res.q8_0_ratio)).filename(),
              "stories260K.Voodoo100.gguf");
}

TEST(export_gguf, planned_size_is_the_size_on_disk_and_inspect_shows_the_recipe) {
    temp_dir dir;
    gguf_file src(test::stories260k());
    const recipe r = mixed_recipe(src, k_export_cycle);
    export_options opts;
    opts.target = "size=400000";
    const size_t planned = planned_file_bytes(src, r, opts);
    const std::string out = dir.file("out.gguf");
    const export_result res = export_gguf(src, r, out, opts);
    EXPECT_EQ(res.file_bytes, planned);
    gguf_file f(out);
    const inspect_report rep = inspect_gguf(f, false);
    EXPECT_EQ(rep.file_bytes, planned);
    size_t recipe_bytes = 0;
    for (const recipe_tensor & t : r.tensors) {
        EXPECT_EQ(f.tensor(t.name).type, t.type) << t.name;
        recipe_bytes += t.bytes;
    }
    size_t selectable_bytes = 0;
    for (const inspect_tensor & t : rep.tensors) {
        if (t.selectable) {
            selectable_bytes += t.tensor.n_bytes;
        }
    }
    EXPECT_EQ(selectable_bytes, recipe_bytes);
}

TEST(export_gguf, a_recipe_for_another_model_is_refused_and_nothing_is_written) {
    temp_dir dir;
    gguf_file src(test::stories260k());
    const std::string out = dir.file("out.gguf");

    recipe renamed = recipe_from_model(src);
    renamed.tensors[3].name = "blk.9.attn_q.weight";
    EXPECT_NE(error_of([&] { export_gguf(src, renamed, out, {}); }).find("blk.9.attn_q.weight"), std::string::npos);

    recipe reshaped = recipe_from_model(src);
    reshaped.tensors[0].shape = {128, 512};
    EXPECT_NE(error_of([&] { export_gguf(src, reshaped, out, {}); }).find("[128, 512]"), std::string::npos);

    recipe missing = recipe_from_model(src);
    missing.tensors.pop_back();
    EXPECT_NE(error_of([&] { export_gguf(src, missing, out, {}); }).find("no type for tensor"), std::string::npos);

    recipe unfit = recipe_from_model(src);
    unfit.tensors[0].type = GGML_TYPE_Q4_K;
    const std::string msg = error_of([&] { export_gguf(src, unfit, out, {}); });
    EXPECT_NE(msg.find("token_embd.weight"), std::string::npos) << msg;
    EXPECT_NE(msg.find("q4_K"), std::string::npos) << msg;

    EXPECT_TRUE(std::filesystem::is_empty(dir.path));
}

TEST(export_gguf, refuses_to_write_over_the_source) {
    temp_dir dir;
    const std::string copy = dir.file("model.gguf");
    std::filesystem::copy_file(test::stories260k(), copy);
    gguf_file src(copy);
    const auto before = std::filesystem::file_size(copy);
    const std::string msg = error_of([&] { export_gguf(src, recipe_from_model(src), copy, {}); });
    EXPECT_NE(msg.find("source model"), std::string::npos) << msg;
    EXPECT_EQ(std::filesystem::file_size(copy), before);
}

TEST(export_gguf, a_full_disk_leaves_no_partial_file) {
    temp_dir dir;
    gguf_file src(test::stories260k());
    const std::string out = dir.file("out.gguf");
    const std::string msg = test::error_with_file_size_limit(
        100000, [&] { export_gguf(src, mixed_recipe(src, k_export_cycle), out, {}); });
    EXPECT_NE(msg.find("nothing was written"), std::string::npos) << msg;
    EXPECT_TRUE(std::filesystem::is_empty(dir.path));
}

TEST(candidates, a_full_disk_while_caching_is_one_error_naming_the_entry_and_a_rerun_continues) {
    // Issue #19: a file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored: writes then fail with EFBIG, as on a full disk)
    // under the largest entry. The small entries are kept, the large one fails naming its path and its size, no
    // entry is left half-written under its name, and with the space back the same call finishes.
    temp_dir dir;
    gguf_file src(test::stories260k());
    candidate_cache cache(dir.file("cache"));
    const gguf_tensor & small_t = src.tensor("blk.0.attn_q.weight");  // 64 × 64: 4,352 bytes at Q8_0
    const gguf_tensor & big_t = src.tensor("token_embd.weight");     // 512 × 64: 34,816 bytes at Q8_0
    const std::string big_key = candidate_cache::key(src, big_t, GGML_TYPE_Q8_0, {});
    const std::string big_entry = dir.file("cache/" + big_key.substr(0, 2) + "/" + big_key + ".bin");
    std::vector<uint8_t> kept;
    const std::string msg = test::error_with_file_size_limit(10000, [&] {
        kept = candidate_bytes(src, small_t, GGML_TYPE_Q8_0, {}, &cache);
        candidate_bytes(src, big_t, GGML_TYPE_Q8_0, {}, &cache);
    });
    EXPECT_NE(msg.find(big_entry), std::string::npos) << msg;
    EXPECT_NE(msg.find("of the 34824 bytes it needs"), std::string::npos) << msg;  // the candidate and its checksum
    EXPECT_FALSE(std::filesystem::exists(big_entry));
    for (const auto & e : std::filesystem::recursive_directory_iterator(dir.file("cache"))) {
        EXPECT_FALSE(e.path().filename().string().ends_with(".tmp")) << e.path();
    }
    EXPECT_TRUE(cache.load(candidate_cache::key(src, small_t, GGML_TYPE_Q8_0, {}), kept.size()).has_value());
    const auto big = candidate_bytes(src, big_t, GGML_TYPE_Q8_0, {}, &cache);
    EXPECT_EQ(big, quantize_tensor(src, big_t, GGML_TYPE_Q8_0, {}));
    EXPECT_TRUE(std::filesystem::exists(big_entry));
}

TEST(export_gguf, recipe_files_round_trip_and_tensor_types_are_anchored) {
    temp_dir dir;
    gguf_file src(test::stories260k());
    recipe r = mixed_recipe(src, k_export_cycle);
    r.tensors[0].probs = {{"q4_0", 0.75}, {"q8_0", 0.25}};
    r.target = "size=300000";
    recipe_save(r, dir.file("recipe.json"));
    const recipe back = recipe_load(dir.file("recipe.json"));
    ASSERT_EQ(back.tensors.size(), r.tensors.size());
    for (size_t i = 0; i < r.tensors.size(); ++i) {
        EXPECT_EQ(back.tensors[i].name, r.tensors[i].name);
        EXPECT_EQ(back.tensors[i].type, r.tensors[i].type);
        EXPECT_EQ(back.tensors[i].bytes, r.tensors[i].bytes);
        EXPECT_EQ(back.tensors[i].shape, r.tensors[i].shape);
    }
    EXPECT_EQ(back.tensors[0].probs, r.tensors[0].probs);
    EXPECT_EQ(back.target, "size=300000");
    EXPECT_EQ(recipe_hash(back), recipe_hash(r));
    const std::string lines = recipe_tensor_types(r);
    EXPECT_NE(lines.find("^blk\\.0\\.attn_q\\.weight$=" + type_name(r.tensors[2].type) + "\n"), std::string::npos)
        << lines;
    EXPECT_EQ(std::count(lines.begin(), lines.end(), '\n'), static_cast<long>(r.tensors.size()));

    const std::string bad = dir.file("bad.json");
    write_file_atomic(bad, std::string(R"({"model": "m", "tensors": [{"name": "x", "shape": [64, 2], "type": "q9_9"}]})"));
    const std::string msg = error_of([&] { recipe_load(bad); });
    EXPECT_NE(msg.find("q9_9"), std::string::npos) << msg;
    EXPECT_NE(msg.find(bad), std::string::npos) << msg;
}

TEST(candidates, the_cache_returns_the_same_bytes_and_ignores_a_damaged_entry) {
    temp_dir dir;
    gguf_file src(test::stories260k());
    candidate_cache cache(dir.file("cache"));
    const gguf_tensor & t = src.tensor("blk.1.ffn_up.weight");
    const auto direct = quantize_tensor(src, t, GGML_TYPE_Q5_1, {});
    const auto first = candidate_bytes(src, t, GGML_TYPE_Q5_1, {}, &cache);
    EXPECT_EQ(first, direct);
    const std::string key = candidate_cache::key(src, t, GGML_TYPE_Q5_1, {});
    ASSERT_TRUE(cache.load(key, direct.size()).has_value());
    EXPECT_EQ(candidate_bytes(src, t, GGML_TYPE_Q5_1, {}, &cache), direct);
    // Another type, another importance: other keys.
    EXPECT_NE(candidate_cache::key(src, t, GGML_TYPE_Q5_0, {}), key);
    const std::vector<float> im(64, 2.0f);
    EXPECT_NE(candidate_cache::key(src, t, GGML_TYPE_Q5_1, im), key);
    // A truncated entry is not used.
    cache.store(key, std::span<const uint8_t>(direct).first(10));
    EXPECT_FALSE(cache.load(key, direct.size()).has_value());
    EXPECT_EQ(candidate_bytes(src, t, GGML_TYPE_Q5_1, {}, &cache), direct);
}

TEST(candidates, an_entry_of_the_right_size_whose_bytes_are_damaged_is_rebuilt_not_used) {
    // Before the checksum, any bytes of the right size were returned as the candidate: trained on and exported.
    temp_dir dir;
    gguf_file src(test::stories260k());
    candidate_cache cache(dir.file("cache"));
    const gguf_tensor & t = src.tensor("blk.1.attn_k.weight");
    const auto direct = candidate_bytes(src, t, GGML_TYPE_Q8_0, {}, &cache);
    const std::string key = candidate_cache::key(src, t, GGML_TYPE_Q8_0, {});
    const std::string entry = dir.file("cache/" + key.substr(0, 2) + "/" + key + ".bin");
    std::vector<uint8_t> bytes = test::read_bytes(entry);
    ASSERT_EQ(bytes.size(), direct.size() + 8);  // the candidate, then its xxh3-64
    bytes[100] ^= 0x40;
    test::write_bytes(entry, bytes);
    EXPECT_FALSE(cache.load(key, direct.size()).has_value());
    EXPECT_EQ(candidate_bytes(src, t, GGML_TYPE_Q8_0, {}, &cache), direct);
    EXPECT_EQ(test::read_bytes(entry).size(), direct.size() + 8);  // rebuilt in place
    EXPECT_TRUE(cache.load(key, direct.size()).has_value());
    // An entry without a checksum (an older Voodoo's, or any file of the candidate's size) is not used either.
    test::write_bytes(entry, direct);
    EXPECT_FALSE(cache.load(key, direct.size()).has_value());
    test::write_bytes(entry, std::vector<uint8_t>(direct.size() + 8, 0xff));
    EXPECT_FALSE(cache.load(key, direct.size()).has_value());
}
