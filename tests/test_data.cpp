// `voodoo data`: tokenization through libllama, token files, the train/val split and its refusals.
#include "common/error.h"
#include "data/dataset.h"
#include "data/text.h"
#include "data/token_file.h"
#include "data/vocab.h"
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

std::string llama_models_dir() { return VOODOO_LLAMA_MODELS_DIR; }

// The first `bytes` of TinyStories, cut at a blank line: enough for a few dozen chunks, fast to tokenize.
std::string tinystories_head(size_t bytes) {
    const std::string all = voodoo::test::read_file(voodoo::test::shared_data() + "/text/tinystories/tinystories_val.txt");
    const size_t cut = all.find("\n\n", bytes);
    return all.substr(0, cut);
}

TEST(data, tokenizing_a_known_string_with_stories260k_gives_llama_tokenize_ids) {
    const std::string text = "Once upon a time, there was a little girl named Lily.";
    const voodoo::vocab v(stories260k());
    const std::vector<int32_t> ours = v.tokenize(text, /*add_special =*/true);

    // The same call made directly on libllama, from a model loaded here.
    llama_model_params mp = llama_model_default_params();
    mp.vocab_only = true;
    llama_model * model = llama_model_load_from_file(stories260k().c_str(), mp);
    ASSERT_NE(model, nullptr);
    std::vector<llama_token> direct(256);
    const int32_t n = llama_tokenize(llama_model_get_vocab(model), text.data(), static_cast<int32_t>(text.size()),
                                     direct.data(), static_cast<int32_t>(direct.size()), true, false);
    llama_model_free(model);
    ASSERT_GT(n, 0);
    direct.resize(static_cast<size_t>(n));
    EXPECT_EQ(ours, direct);
    // Pinned from llama.cpp v0.4.0: a change means libllama's tokenizer changed and token files must be remade.
    EXPECT_EQ(ours, std::vector<int32_t>({1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426}));

    // The vocabulary asks for BOS (id 1 in llama2.c's tok512), and the ids decode back to the text.
    EXPECT_TRUE(v.add_bos());
    EXPECT_EQ(v.bos(), 1);
    EXPECT_EQ(v.eos(), 2);
    ASSERT_FALSE(ours.empty());
    EXPECT_EQ(ours.front(), 1);
    EXPECT_EQ(v.n_tokens(), 512);
    const std::vector<int32_t> body(ours.begin() + 1, ours.end());
    EXPECT_EQ(v.detokenize(body), text);
}

// llama.cpp's own tokenizer fixtures (expected ids made by the reference tokenizers), read as its
// tests/test-tokenizer-0.cpp reads them: inputs split by "\n__ggml_vocab_test__\n", no special tokens.
void expect_fixture(const std::string & name) {
    const std::string base = llama_models_dir() + "/" + name;
    if (!std::filesystem::exists(base + ".inp")) {
        GTEST_SKIP() << "no llama.cpp source checkout with " << base << ".inp";
    }
    const std::string inp = voodoo::test::read_file(base + ".inp");
    std::vector<std::string> inputs;
    const std::string sep = "\n__ggml_vocab_test__\n";
    for (size_t pos = 0;;) {
        const size_t next = inp.find(sep, pos);
        if (next == std::string::npos) {
            inputs.push_back(inp.substr(pos));
            break;
        }
        inputs.push_back(inp.substr(pos, next - pos));
        pos = next + sep.size();
    }
    std::ifstream out(base + ".out");
    std::vector<std::vector<int32_t>> expected;
    for (std::string line; std::getline(out, line);) {
        std::istringstream ss(line);
        std::vector<int32_t> ids;
        for (int32_t id; ss >> id;) {
            ids.push_back(id);
        }
        expected.push_back(ids);
    }
    ASSERT_GE(inputs.size(), expected.size());
    ASSERT_GT(expected.size(), 20u);
    const voodoo::vocab v(base);
    for (size_t i = 0; i < expected.size(); ++i) {
        EXPECT_EQ(v.tokenize(inputs[i], false, false), expected[i]) << name << " input " << i << ": '" << inputs[i] << "'";
    }
}

TEST(data, tokenizer_matches_llama_cpp_fixtures_for_spm_and_bpe_vocabularies) {
    expect_fixture("ggml-vocab-llama-spm.gguf");
    expect_fixture("ggml-vocab-gpt-2.gguf");
}

TEST(data, vocab_hash_is_stable_and_tells_vocabularies_apart) {
    const voodoo::gguf_file a(stories260k());
    const uint64_t h = voodoo::vocab_hash(a);
    EXPECT_EQ(h, voodoo::vocab_hash(voodoo::gguf_file(stories260k())));
    // Pinned: a change here makes every token file already written unreadable; bump the token file version then.
    EXPECT_EQ(voodoo::vocab_hash_hex(h), "6926191688a07749");
    const voodoo::gguf_file spm(llama_models_dir() + "/ggml-vocab-llama-spm.gguf");
    EXPECT_NE(h, voodoo::vocab_hash(spm));
}

TEST(data, documents_are_split_at_blank_lines_and_at_the_eos_text) {
    const std::string text = "one a\none b\n\n  \t\ntwo</s>three\n\n\n\nfour\r\n\r\nfive  ";
    const auto docs = voodoo::split_documents(text, "</s>");
    const std::vector<std::string_view> want = {"one a\none b", "two", "three", "four", "five"};
    EXPECT_EQ(docs, want);
    EXPECT_EQ(voodoo::split_documents(text, "").size(), 4u);  // "two</s>three" stays one document
}

TEST(data, prepare_writes_bos_led_chunks_deterministically_for_a_seed) {
    temp_dir tmp;
    voodoo::test::write_file(tmp.file("stories.txt"), tinystories_head(60000));
    voodoo::data_options o;
    o.model = stories260k();
    o.texts = {tmp.file("stories.txt")};
    o.ctx = 128;
    o.val_fraction = 0.1;
    o.seed = 42;
    o.out_dir = tmp.file("a");
    const nlohmann::json s = voodoo::prepare_data(o);
    o.out_dir = tmp.file("b");
    voodoo::prepare_data(o);
    o.seed = 43;
    o.out_dir = tmp.file("c");
    voodoo::prepare_data(o);

    EXPECT_EQ(voodoo::test::read_file(tmp.file("a/train.tokens")), voodoo::test::read_file(tmp.file("b/train.tokens")));
    EXPECT_EQ(voodoo::test::read_file(tmp.file("a/val.tokens")), voodoo::test::read_file(tmp.file("b/val.tokens")));
    EXPECT_NE(voodoo::test::read_file(tmp.file("a/train.tokens")), voodoo::test::read_file(tmp.file("c/train.tokens")));

    const voodoo::token_data data(tmp.file("a"));
    const voodoo::token_file & train = data.train();
    EXPECT_EQ(train.ctx(), 128);
    EXPECT_TRUE(train.starts_with_bos());
    EXPECT_EQ(train.n_chunks(), s["train"]["n_chunks"].get<int64_t>());
    EXPECT_GT(train.n_chunks(), 20);
    EXPECT_GE(data.val().n_chunks(), 1);
    // Each chunk: BOS, then 127 tokens of the stream; the stream's tokens are all used but the tail.
    for (int64_t i = 0; i < train.n_chunks(); ++i) {
        EXPECT_EQ(train.chunk(i)[0], 1);
    }
    const int64_t n_train = s["train"]["n_tokens"];
    EXPECT_EQ(train.n_chunks(), n_train / 127);
    EXPECT_EQ(s["train"]["n_tokens_dropped"].get<int64_t>(), n_train % 127);
    // Val holds about the asked share of the tokens, by whole documents.
    const double val_share = s["val"]["n_tokens"].get<double>() / (n_train + s["val"]["n_tokens"].get<double>());
    EXPECT_GE(val_share, 0.1);
    EXPECT_LT(val_share, 0.15);
    // The sidecar names the source with its sha256 and the model's vocabulary.
    EXPECT_EQ(s["sources"][0]["path"], tmp.file("stories.txt"));
    EXPECT_EQ(s["sources"][0]["sha256"].get<std::string>().size(), 64u);
    EXPECT_EQ(s["vocab_hash"], voodoo::vocab_hash_hex(voodoo::vocab_hash(voodoo::gguf_file(stories260k()))));
    // Stories are separated by EOS (2) in the stream.
    const auto all = train.tokens();
    EXPECT_GT(std::count(all.begin(), all.end(), 2), 10);
    EXPECT_NO_THROW(data.require_vocab_of(stories260k()));
}

TEST(data, a_token_file_made_with_another_vocabulary_is_refused) {
    temp_dir tmp;
    voodoo::test::write_file(tmp.file("stories.txt"), tinystories_head(20000));
    const auto r = run_voodoo("data --model " + stories260k() + " --text " + tmp.file("stories.txt") +
                              " --ctx 64 --out " + tmp.file("d"));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const voodoo::token_data data(tmp.file("d"));
    const std::string other = llama_models_dir() + "/ggml-vocab-llama-spm.gguf";
    try {
        data.require_vocab_of(other);
        FAIL() << "a token file of stories260K's vocabulary was accepted for llama-spm's";
    } catch (const voodoo::error & e) {
        EXPECT_NE(std::string(e.what()).find("another vocabulary"), std::string::npos) << e.what();
    }
}

// Bad text: a one-line error naming the file, exit 1, and no output folder at all.
void expect_refused(const std::string & text, const std::string & message, const std::string & extra = "") {
    temp_dir tmp;
    voodoo::test::write_file(tmp.file("in.txt"), text);
    const auto r = run_voodoo("data --model " + stories260k() + " --text " + tmp.file("in.txt") + " --out " +
                              tmp.file("out") + " " + extra);
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << r.output;
    EXPECT_FALSE(std::filesystem::exists(tmp.file("out"))) << "something was written for: " << message;
}

// The same refusal through the library: the error names the problem and no output folder appears.
void expect_refused_by_library(const std::string & text, const std::string & message, int64_t ctx, double val) {
    temp_dir tmp;
    voodoo::test::write_file(tmp.file("in.txt"), text);
    voodoo::data_options o;
    o.model = stories260k();
    o.texts = {tmp.file("in.txt")};
    o.ctx = ctx;
    o.val_fraction = val;
    o.out_dir = tmp.file("out");
    try {
        voodoo::prepare_data(o);
        FAIL() << "accepted; expected: " << message;
    } catch (const voodoo::error & e) {
        EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
    EXPECT_FALSE(std::filesystem::exists(tmp.file("out"))) << "something was written for: " << message;
}

TEST(data, empty_text_is_refused_and_nothing_is_written) {
    expect_refused("", "holds no text");
    expect_refused_by_library("\n\n   \n", "holds no text", 512, 0.05);
}

TEST(data, text_shorter_than_one_chunk_is_refused_naming_the_file_and_the_flag_and_nothing_is_written) {
    expect_refused("Once upon a time there was a cat.\n", "in.txt' is too short for one chunk of --ctx 512 (a BOS and 511 tokens of text)");
    expect_refused_by_library(tinystories_head(20000), "in.txt' holds too little for a validation chunk of --ctx 512", 512, 0.001);
}

TEST(data, text_in_a_script_the_vocabulary_does_not_cover_is_refused_naming_the_file) {
    // stories260K's 512-token vocabulary is English: Chinese text becomes byte-fallback tokens, as in the eval.
    std::string zh;
    for (int i = 0; i < 400; ++i) {
        zh += "\xe4\xbb\x8a\xe5\xa4\xa9\xe5\xa4\xa9\xe6\xb0\x94\xe5\xbe\x88\xe5\xa5\xbd\xe3\x80\x82\n\n";  // 今天天气很好。
    }
    expect_refused(zh, "in.txt' is not in a script the vocabulary of");
    expect_refused(zh, "calibrate on text in the model's language");
    // English with a little of it is text the model can calibrate on.
    temp_dir tmp;
    voodoo::test::write_file(tmp.file("in.txt"), tinystories_head(200000) + zh.substr(0, 2000));
    const auto r = run_voodoo("data --model " + stories260k() + " --text " + tmp.file("in.txt") + " --out " + tmp.file("out") + " --ctx 64");
    EXPECT_EQ(r.exit_code, 0) << r.output;
}

TEST(data, a_ctx_beyond_the_models_trained_context_is_refused_before_tokenizing) {
    // stories260K: llama.context_length = 2048.
    expect_refused(tinystories_head(20000), "--ctx 4096 is larger than the context", "--ctx 4096");
    expect_refused(tinystories_head(20000), "(2048): its imatrix and training would see positions it never saw; use --ctx 2048 or less", "--ctx 4096");
}

TEST(data, non_utf8_text_is_refused_with_its_offset_and_nothing_is_written) {
    expect_refused("Once upon a time\nthere was a caf\xe9.\n", "not valid UTF-8: byte 0xe9 at offset 32 (line 2)");
    // Well-formed-looking but invalid sequences (RFC 3629): an overlong '/', a UTF-16 surrogate, past U+10FFFF.
    EXPECT_THROW(voodoo::require_utf8("overlong \xc0\xaf slash", "t"), voodoo::error);
    EXPECT_THROW(voodoo::require_utf8("surrogate \xed\xa0\x80 half", "t"), voodoo::error);
    EXPECT_THROW(voodoo::require_utf8("big \xf4\x90\x80\x80", "t"), voodoo::error);
    EXPECT_THROW(voodoo::require_utf8("cut \xe2\x82", "t"), voodoo::error);
    EXPECT_NO_THROW(voodoo::require_utf8("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\xa6\x99", "t"));
}

TEST(data, token_file_rejects_a_truncated_file) {
    temp_dir tmp;
    const std::vector<int32_t> tokens = {1, 5, 6, 7, 1, 8, 9, 10};
    voodoo::write_token_file(tmp.file("t.tokens"), tokens, 4, 0x1234, 512, voodoo::token_file_flag_bos);
    const voodoo::token_file f(tmp.file("t.tokens"));
    EXPECT_EQ(f.n_chunks(), 2);
    EXPECT_EQ(std::vector<int32_t>(f.chunk(1).begin(), f.chunk(1).end()), std::vector<int32_t>({1, 8, 9, 10}));
    EXPECT_THROW(f.chunk(2), voodoo::error);
    std::string bytes = voodoo::test::read_file(tmp.file("t.tokens"));
    voodoo::test::write_file(tmp.file("short.tokens"), bytes.substr(0, bytes.size() - 4));
    EXPECT_THROW(voodoo::token_file(tmp.file("short.tokens")), voodoo::error);
    EXPECT_THROW(voodoo::write_token_file(tmp.file("x.tokens"), tokens, 4, 0, 8, 0), voodoo::error);  // id 9 ≥ 8
    EXPECT_FALSE(std::filesystem::exists(tmp.file("x.tokens")));
}

TEST(data, a_token_file_whose_header_counts_wrap_around_2_64_is_refused_naming_it) {
    // Found by fuzz_tokens (scripts/fuzz.sh): 2^39 chunks of 0x29000000 tokens are 0x29 · 2^65 bytes, 0 modulo
    // 2^64, so a bare 48-byte header passed the size check and the token check then read far past the map
    // (UBSan stopped it first, at n_chunks · ctx).
    temp_dir tmp;
    voodoo::token_file_header h{};
    std::memcpy(h.magic, "VOODOTOK", 8);
    h.version = voodoo::token_file_version;
    h.ctx = 0x29000000;
    h.n_chunks = uint64_t{1} << 39;
    h.n_vocab = 512;
    voodoo::test::write_file(tmp.file("wrap.tokens"), std::string(reinterpret_cast<const char *>(&h), sizeof h));
    const std::string msg = voodoo::test::error_of([&] { voodoo::token_file f(tmp.file("wrap.tokens")); });
    EXPECT_NE(msg.find(tmp.file("wrap.tokens")), std::string::npos) << msg;
    EXPECT_NE(msg.find("promises 549755813888 chunks of 687865856 tokens"), std::string::npos) << msg;
    EXPECT_NE(msg.find("holds 0 bytes of tokens"), std::string::npos) << msg;
    h.ctx = 0;
    voodoo::test::write_file(tmp.file("zero.tokens"), std::string(reinterpret_cast<const char *>(&h), sizeof h));
    EXPECT_NE(voodoo::test::error_of([&] { voodoo::token_file f(tmp.file("zero.tokens")); }).find("chunks of 0 tokens"),
              std::string::npos);
}

TEST(data, a_data_json_field_of_the_wrong_type_or_an_empty_train_split_is_one_error_naming_the_file) {
    // nlohmann's value() threw its own type_error on these (an internal error, exit 3, in `voodoo imatrix`/`train`);
    // an empty train.tokens reached the trainer's chunk arithmetic (a division by 0 chunks).
    temp_dir tmp;
    const std::vector<int32_t> tokens = {1, 5, 6, 7, 1, 8, 9, 10};
    std::filesystem::create_directories(tmp.file("d"));
    voodoo::write_token_file(tmp.file("d/train.tokens"), tokens, 4, 0x1234, 512, voodoo::token_file_flag_bos);
    voodoo::write_token_file(tmp.file("d/val.tokens"), tokens, 4, 0x1234, 512, voodoo::token_file_flag_bos);
    const std::string json = tmp.file("d/data.json");
    auto error_for = [&](const std::string & text) {
        voodoo::test::write_file(json, text);
        return voodoo::test::error_of([&] { voodoo::token_data d(tmp.file("d")); });
    };
    for (const char * text : {R"({"format": 5})", R"([1, 2])", R"({"sources": []})"}) {
        const std::string msg = error_for(text);
        EXPECT_NE(msg.find(json), std::string::npos) << text << ": " << msg;
        EXPECT_NE(msg.find("is not a Voodoo data sidecar"), std::string::npos) << text << ": " << msg;
    }
    std::string msg = error_for(R"({"format": "voodoo-tokens", "sources": 5})");
    EXPECT_NE(msg.find(json + "': \"sources\" must be an array"), std::string::npos) << msg;
    EXPECT_NE(msg.find("it is number"), std::string::npos) << msg;
    msg = error_for(R"({"format": "voodoo-tokens", "sources": [{"path": "a.txt"}, {"path": 7}]})");
    EXPECT_NE(msg.find(json + "': sources[1] has no string \"path\""), std::string::npos) << msg;
    voodoo::test::write_file(json, R"({"format": "voodoo-tokens", "sources": [{"path": "a.txt"}]})");
    EXPECT_EQ(voodoo::token_data(tmp.file("d")).sources(), std::vector<std::string>({"a.txt"}));
    voodoo::write_token_file(tmp.file("d/train.tokens"), {}, 4, 0x1234, 512, voodoo::token_file_flag_bos);
    msg = voodoo::test::error_of([&] { voodoo::token_data d(tmp.file("d")); });
    EXPECT_NE(msg.find(tmp.file("d/train.tokens") + "' holds no chunk"), std::string::npos) << msg;
    // Through the CLI: one error line and exit 1, not an internal error.
    voodoo::test::write_file(json, R"({"format": "voodoo-tokens", "sources": "a.txt"})");
    const auto r = run_voodoo("imatrix --model " + stories260k() + " --data " + tmp.file("d") + " --out " +
                              tmp.file("im.gguf"));
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find("\"sources\" must be an array"), std::string::npos) << r.output;
}

}  // namespace
