// `voodoo imatrix`: collection through libllama's eval callback, llama.cpp's GGUF and legacy formats, and the
// promise that llama-quantize and Voodoo quantize with the same numbers from our file.
#include "common/error.h"
#include "data/dataset.h"
#include "ggml/gguf.h"
#include "ggml/quant.h"
#include "ggml/runtime.h"
#include "ggml/types.h"
#include "imatrix/collect.h"
#include "imatrix/imatrix.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <llama.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace {

using voodoo::test::run_voodoo;
using voodoo::test::stories260k;
using voodoo::test::temp_dir;

std::string tinystories_path() { return voodoo::test::shared_data() + "/text/tinystories/tinystories_val.txt"; }

// 8 chunks of 64 tokens of TinyStories for stories260K, made once for the whole suite (kept small: the
// collection runs the real model).
struct small_data {
    temp_dir tmp;
    std::string dir = tmp.file("data");
    small_data() {
        std::ifstream in(tinystories_path(), std::ios::binary);
        std::string text(40000, '\0');
        in.read(text.data(), static_cast<std::streamsize>(text.size()));
        text.resize(text.rfind("\n\n"));
        voodoo::test::write_file(tmp.file("stories.txt"), text);
        voodoo::data_options o;
        o.model = stories260k();
        o.texts = {tmp.file("stories.txt")};
        o.ctx = 64;
        o.val_fraction = 0.0;
        o.out_dir = dir;
        voodoo::prepare_data(o);
    }
};

const small_data & data() {
    static const small_data d;
    return d;
}

const voodoo::imatrix & collected() {
    static const voodoo::imatrix im = [] {
        voodoo::imatrix_options o;
        o.model = stories260k();
        o.data_dir = data().dir;
        o.max_chunks = 8;
        o.n_threads = 1;  // ggml's spinning thread pool crawls on cores other tests share (docs/DATA.md)
        return voodoo::collect_imatrix(o);
    }();
    return im;
}

std::vector<float> f32_of(const voodoo::gguf_file & f, const voodoo::gguf_tensor & t) {
    std::vector<float> v(static_cast<size_t>(t.n_elements()));
    std::memcpy(v.data(), f.data(t).data(), v.size() * sizeof(float));
    return v;
}

TEST(imatrix, collects_every_matmul_of_stories260k_including_the_output_head) {
    const voodoo::imatrix & im = collected();
    // 7 matrices in each of the 5 blocks, and output.weight; token_embd is a lookup, not a matmul.
    EXPECT_EQ(im.entries.size(), 7u * 5 + 1);
    EXPECT_TRUE(im.entries.contains("output.weight"));
    EXPECT_FALSE(im.entries.contains("token_embd.weight"));
    EXPECT_EQ(im.chunk_size, 64);
    EXPECT_EQ(im.chunk_count, 8);
    ASSERT_EQ(im.datasets.size(), 1u);
    const voodoo::gguf_file model(stories260k());
    for (const auto & [name, e] : im.entries) {
        SCOPED_TRACE(name);
        ASSERT_EQ(e.counts, std::vector<int64_t>({8 * 64}));  // every token of every chunk
        EXPECT_EQ(e.ne0(), model.tensor(name).ne[0]);         // one sum per input column
        for (float v : e.in_sum2) {
            EXPECT_GT(v, 0.0f);
        }
    }
    EXPECT_EQ(im.entries.at("blk.0.ffn_down.weight").ne0(), 172);
    EXPECT_NO_THROW(voodoo::require_imatrix_fits(im, model, "collected"));
    // attn_q, attn_k and attn_v read the same normed input, so they see the same Σx².
    EXPECT_EQ(im.entries.at("blk.2.attn_q.weight").in_sum2, im.entries.at("blk.2.attn_k.weight").in_sum2);
    EXPECT_EQ(im.entries.at("blk.2.ffn_gate.weight").in_sum2, im.entries.at("blk.2.ffn_up.weight").in_sum2);
}

TEST(imatrix, gguf_file_has_llama_cpp_layout_and_reads_back_bit_exact) {
    temp_dir tmp;
    voodoo::write_imatrix_gguf(tmp.file("imatrix.gguf"), collected());
    const voodoo::gguf_file f(tmp.file("imatrix.gguf"));
    EXPECT_EQ(f.get_string("general.type"), "imatrix");
    EXPECT_EQ(gguf_get_kv_type(f.ctx(), f.find_key("imatrix.chunk_count")), GGUF_TYPE_UINT32);
    EXPECT_EQ(gguf_get_kv_type(f.ctx(), f.find_key("imatrix.chunk_size")), GGUF_TYPE_UINT32);
    EXPECT_EQ(f.get_int("imatrix.chunk_count"), 8);
    EXPECT_EQ(f.get_int("imatrix.chunk_size"), 64);
    EXPECT_EQ(f.tensors().size(), 2u * 36);
    const voodoo::gguf_tensor & sums = f.tensor("blk.0.ffn_down.weight.in_sum2");
    EXPECT_EQ(sums.type, GGML_TYPE_F32);
    EXPECT_EQ(sums.ne, (std::array<int64_t, 4>{172, 1, 1, 1}));
    const voodoo::gguf_tensor & counts = f.tensor("blk.0.ffn_down.weight.counts");
    EXPECT_EQ(counts.ne, (std::array<int64_t, 4>{1, 1, 1, 1}));
    EXPECT_EQ(f32_of(f, counts), std::vector<float>({512.0f}));
    // Names in sorted order, as llama-imatrix writes them.
    EXPECT_EQ(f.tensors().front().name, "blk.0.attn_k.weight.in_sum2");
    EXPECT_EQ(f.tensors().back().name, "output.weight.counts");

    const voodoo::imatrix back = voodoo::read_imatrix(tmp.file("imatrix.gguf"));
    EXPECT_FALSE(back.legacy);
    EXPECT_EQ(back.datasets, collected().datasets);
    ASSERT_EQ(back.entries.size(), collected().entries.size());
    for (const auto & [name, e] : collected().entries) {
        EXPECT_EQ(back.entries.at(name).in_sum2, e.in_sum2) << name;
        EXPECT_EQ(back.entries.at(name).counts, e.counts) << name;
    }
}

// A legacy .dat written byte by byte as llama-imatrix's save_imatrix_legacy lays it out.
std::string legacy_dat(const std::vector<std::pair<std::string, std::vector<float>>> & entries, int32_t ncall,
                       bool trailer) {
    std::string b;
    auto i32 = [&](int32_t v) { b.append(reinterpret_cast<const char *>(&v), 4); };
    i32(static_cast<int32_t>(entries.size()));
    for (const auto & [name, values] : entries) {
        i32(static_cast<int32_t>(name.size()));
        b += name;
        i32(ncall);
        i32(static_cast<int32_t>(values.size()));
        b.append(reinterpret_cast<const char *>(values.data()), values.size() * 4);
    }
    if (trailer) {
        i32(ncall);
        i32(9);
        b += "wiki.raw!";
    }
    return b;
}

TEST(imatrix, reads_a_legacy_dat_and_divides_by_ncall_as_llama_quantize_does) {
    temp_dir tmp;
    std::vector<float> q(64), down(172);
    for (size_t i = 0; i < q.size(); ++i) {
        q[i] = 10.0f * static_cast<float>(i + 1);
    }
    for (size_t i = 0; i < down.size(); ++i) {
        down[i] = 0.5f * static_cast<float>(i);
    }
    voodoo::test::write_file(tmp.file("old.dat"), legacy_dat({{"blk.0.attn_q.weight", q}, {"blk.1.ffn_down.weight", down}}, 10, true));
    const voodoo::imatrix im = voodoo::read_imatrix(tmp.file("old.dat"));
    EXPECT_TRUE(im.legacy);
    EXPECT_EQ(im.chunk_count, 10);
    EXPECT_EQ(im.datasets, std::vector<std::string>({"wiki.raw!"}));
    const std::vector<float> imp = voodoo::imatrix_column_importance(im, "blk.0.attn_q.weight");
    ASSERT_EQ(imp.size(), 64u);
    EXPECT_EQ(imp[0], 1.0f);
    EXPECT_EQ(imp[63], 64.0f);
    EXPECT_NO_THROW(voodoo::require_imatrix_fits(im, voodoo::gguf_file(stories260k()), "old.dat"));
    // The trailer is optional.
    voodoo::test::write_file(tmp.file("bare.dat"), legacy_dat({{"blk.0.attn_q.weight", q}}, 10, false));
    EXPECT_EQ(voodoo::read_imatrix(tmp.file("bare.dat")).entries.size(), 1u);
    // A truncated file is an error that names it.
    const std::string whole = legacy_dat({{"blk.0.attn_q.weight", q}}, 10, false);
    voodoo::test::write_file(tmp.file("cut.dat"), whole.substr(0, whole.size() - 8));
    try {
        voodoo::read_imatrix(tmp.file("cut.dat"));
        FAIL() << "a truncated .dat was read";
    } catch (const voodoo::error & e) {
        EXPECT_NE(std::string(e.what()).find("cut.dat"), std::string::npos) << e.what();
    }
}

TEST(imatrix, column_importance_is_in_sum2_over_counts_per_matrix) {
    voodoo::imatrix im;
    im.entries["blk.0.ffn_up_exps.weight"] = {{2, 4, 6, 9, 9, 9}, {2, 0}};  // 2 experts × 3 columns
    EXPECT_EQ(voodoo::imatrix_column_importance(im, "blk.0.ffn_up_exps.weight"),
              std::vector<float>({1, 2, 3, 1, 1, 1}));  // an expert never routed to gets 1, as llama-quantize does
    EXPECT_THROW(voodoo::imatrix_column_importance(im, "nope.weight"), voodoo::error);
}

// Exactness: llama_model_quantize fed our file's numbers the way llama-quantize feeds them (in_sum2 / counts,
// through llama_model_imatrix_data) writes the very bytes that our own quantizer writes with the same numbers.
TEST(imatrix, llama_model_quantize_with_our_imatrix_writes_our_quantized_bytes) {
    voodoo::llama_runtime_init();
    temp_dir tmp;
    voodoo::write_imatrix_gguf(tmp.file("imatrix.gguf"), collected());
    const voodoo::imatrix im = voodoo::read_imatrix(tmp.file("imatrix.gguf"));
    std::map<std::string, std::vector<float>> importance;
    std::vector<llama_model_imatrix_data> entries;
    for (const auto & [name, e] : im.entries) {
        importance[name] = voodoo::imatrix_column_importance(im, name);
    }
    for (const auto & [name, v] : importance) {
        entries.push_back({name.c_str(), v.data(), v.size()});
    }
    entries.push_back({nullptr, nullptr, 0});

    for (const llama_ftype ftype : {LLAMA_FTYPE_MOSTLY_Q4_0, LLAMA_FTYPE_MOSTLY_IQ4_NL}) {
        SCOPED_TRACE(static_cast<int>(ftype));
        llama_model_quantize_params params = llama_model_quantize_default_params();
        params.ftype = ftype;
        params.pure = true;
        params.nthread = 1;
        params.imatrix = entries.data();
        const std::string out = tmp.file("q.gguf");
        ASSERT_EQ(llama_model_quantize(stories260k().c_str(), out.c_str(), &params), 0u);

        const voodoo::gguf_file src(stories260k());
        const voodoo::gguf_file q(out);
        ASSERT_EQ(q.tensors().size(), src.tensors().size());
        int n_quantized = 0, n_imatrix_mattered = 0;
        for (const voodoo::gguf_tensor & t : q.tensors()) {
            SCOPED_TRACE(t.name);
            const voodoo::gguf_tensor & s = src.tensor(t.name);
            const std::vector<float> w = f32_of(src, s);
            const auto it = importance.find(t.name);
            const std::span<const float> imat =
                it == importance.end() ? std::span<const float>{} : std::span<const float>(it->second);
            const std::vector<uint8_t> ours =
                t.type == GGML_TYPE_F32 ? std::vector<uint8_t>(src.data(s).begin(), src.data(s).end())
                                        : voodoo::quantize(t.type, w, t.ne[0], imat, 1, t.name);
            const auto theirs = q.data(t);
            ASSERT_EQ(ours.size(), theirs.size());
            EXPECT_TRUE(std::equal(ours.begin(), ours.end(), theirs.begin()));
            if (voodoo::type_info_of(t.type).is_quantized) {
                ++n_quantized;
                if (!imat.empty() && voodoo::quantize(t.type, w, t.ne[0], {}, 1, t.name) != ours) {
                    ++n_imatrix_mattered;
                }
            }
        }
        // Every 64-wide matrix is a 32-block type (ffn_down, 172 wide, falls back); the imatrix changed them.
        EXPECT_EQ(n_quantized, 2 + 6 * 5);
        EXPECT_GE(n_imatrix_mattered, 30);
    }
}

TEST(imatrix, an_imatrix_for_another_model_is_refused) {
    const voodoo::gguf_file model(stories260k());
    voodoo::imatrix wrong_name = collected();
    wrong_name.entries["blk.9.attn_q.weight"] = wrong_name.entries.at("blk.0.attn_q.weight");
    try {
        voodoo::require_imatrix_fits(wrong_name, model, "wrong.gguf");
        FAIL() << "an entry for a tensor the model lacks was accepted";
    } catch (const voodoo::error & e) {
        EXPECT_NE(std::string(e.what()).find("'blk.9.attn_q.weight', which"), std::string::npos) << e.what();
    }
    voodoo::imatrix wrong_size = collected();
    wrong_size.entries["blk.0.attn_q.weight"].in_sum2.resize(128, 1.0f);
    try {
        voodoo::require_imatrix_fits(wrong_size, model, "wrong.gguf");
        FAIL() << "an entry of 128 columns was accepted for a 64-column tensor";
    } catch (const voodoo::error & e) {
        EXPECT_NE(std::string(e.what()).find("holds 128 values"), std::string::npos) << e.what();
    }
    // Through the CLI: exit 1 with the reason.
    temp_dir tmp;
    voodoo::write_imatrix_gguf(tmp.file("wrong.gguf"), wrong_size);
    const auto r = run_voodoo("imatrix --model " + stories260k() + " --show " + tmp.file("wrong.gguf"));
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find("made for another model"), std::string::npos) << r.output;
}

TEST(imatrix, a_gguf_without_imatrix_metadata_is_refused) {
    // stories260K itself is a GGUF but not an imatrix.
    try {
        voodoo::read_imatrix(stories260k());
        FAIL() << "a model GGUF was read as an imatrix";
    } catch (const voodoo::error & e) {
        EXPECT_NE(std::string(e.what()).find("lacks the imatrix metadata"), std::string::npos) << e.what();
    }
}

TEST(imatrix, tokens_of_another_vocabulary_are_refused_and_nothing_is_written) {
    temp_dir tmp;
    voodoo::test::write_file(tmp.file("t.txt"), std::string(4000, 'a') + "\n\n" + std::string(4000, 'b'));
    const std::string other = std::string(VOODOO_LLAMA_MODELS_DIR) + "/ggml-vocab-llama-spm.gguf";
    voodoo::data_options d;
    d.model = other;
    d.texts = {tmp.file("t.txt")};
    d.ctx = 32;
    d.val_fraction = 0.0;
    d.out_dir = tmp.file("d");
    voodoo::prepare_data(d);
    const auto r = run_voodoo("imatrix --model " + stories260k() + " --data " + tmp.file("d") + " --out " + tmp.file("i.gguf"));
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find("another vocabulary"), std::string::npos) << r.output;
    EXPECT_FALSE(std::filesystem::exists(tmp.file("i.gguf")));
}

}  // namespace
