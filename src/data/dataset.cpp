#include "data/dataset.h"

#include "common/error.h"
#include "common/file.h"
#include "common/progress.h"
#include "common/sha256.h"
#include "data/text.h"
#include "data/vocab.h"
#include "ggml/gguf.h"

#include <filesystem>
#include <fstream>
#include <numeric>
#include <sstream>
#include <string_view>

namespace voodoo {

namespace {

// splitmix64: a fixed, portable generator, so a seed gives the same split on every standard library
// (std::shuffle's algorithm is implementation-defined).
struct splitmix64 {
    uint64_t state;
    uint64_t next() {
        uint64_t z = (state += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return z ^ (z >> 31);
    }
    // Uniform in [0, n) by Lemire's multiply-shift (bias below 2^-40 for any n we shuffle).
    uint64_t below(uint64_t n) { return static_cast<uint64_t>((static_cast<__uint128_t>(next()) * n) >> 64); }
};

struct document {
    size_t source;                  // index into the text files
    std::vector<int32_t> tokens;    // separator included
};

struct split_stats {
    int64_t n_documents = 0;
    int64_t n_tokens = 0;           // of the documents, separators included
    int64_t n_chunks = 0;
    int64_t n_tokens_dropped = 0;   // the tail that did not fill a chunk
};

// Cuts the documents' tokens into chunks of ctx, each starting with BOS when bos >= 0.
std::vector<int32_t> make_chunks(const std::vector<const document *> & docs, int64_t ctx, int32_t bos,
                                 split_stats & stats) {
    std::vector<int32_t> stream;
    for (const document * d : docs) {
        stream.insert(stream.end(), d->tokens.begin(), d->tokens.end());
    }
    stats.n_documents = static_cast<int64_t>(docs.size());
    stats.n_tokens = static_cast<int64_t>(stream.size());
    const int64_t per_chunk = bos >= 0 ? ctx - 1 : ctx;
    stats.n_chunks = stats.n_tokens / per_chunk;
    stats.n_tokens_dropped = stats.n_tokens - stats.n_chunks * per_chunk;
    std::vector<int32_t> chunks;
    chunks.reserve(static_cast<size_t>(stats.n_chunks * ctx));
    for (int64_t c = 0; c < stats.n_chunks; ++c) {
        if (bos >= 0) {
            chunks.push_back(bos);
        }
        const auto first = stream.begin() + c * per_chunk;
        chunks.insert(chunks.end(), first, first + per_chunk);
    }
    return chunks;
}

// The "sources" of data.json: an array of objects, each with a string "path"; none when the key is absent.
std::vector<std::string> read_sources(const nlohmann::json & sidecar, const std::string & json_path) {
    std::vector<std::string> out;
    const auto it = sidecar.find("sources");
    if (it == sidecar.end()) {
        return out;
    }
    if (!it->is_array()) {
        fail("'{}': \"sources\" must be an array of {{\"path\": ...}} objects, it is {}; make the folder again with "
             "`voodoo data`",
             json_path, it->type_name());
    }
    for (size_t i = 0; i < it->size(); ++i) {
        const nlohmann::json & s = (*it)[i];
        if (!s.is_object() || !s.contains("path") || !s["path"].is_string()) {
            fail("'{}': sources[{}] has no string \"path\"; make the folder again with `voodoo data`", json_path, i);
        }
        out.push_back(s["path"].get<std::string>());
    }
    return out;
}

nlohmann::json split_json(const std::string & file, const split_stats & s) {
    return {{"file", file},
            {"n_documents", s.n_documents},
            {"n_tokens", s.n_tokens},
            {"n_chunks", s.n_chunks},
            {"n_tokens_dropped", s.n_tokens_dropped}};
}

// "the text 'a.txt'" or "the texts 'a.txt' and 'b.txt'", for messages.
std::string text_list(const std::vector<std::string> & texts) {
    std::string s = texts.size() == 1 ? "the text " : "the texts ";
    for (size_t i = 0; i < texts.size(); ++i) {
        s += (i == 0 ? "" : i + 1 == texts.size() ? " and " : ", ") + ("'" + texts[i] + "'");
    }
    return s;
}

}  // namespace

nlohmann::json prepare_data(const data_options & o) {
    if (o.texts.empty()) {
        fail("no text given; pass one or more UTF-8 text files with --text");
    }
    if (o.ctx < 2 || o.ctx > (1 << 20)) {
        fail("--ctx {} is out of range; give 2 to 1048576 tokens per chunk (512 is llama-perplexity's default)", o.ctx);
    }
    if (!(o.val_fraction >= 0.0 && o.val_fraction < 1.0)) {
        fail("--val-fraction {} is out of range; give a share in [0, 1), e.g. 0.05", o.val_fraction);
    }
    if (o.out_dir.empty()) {
        fail("no output folder; pass --out DIR");
    }
    const vocab voc(o.model);
    if (voc.n_tokens() <= 0) {
        fail("'{}' has an empty vocabulary", o.model);
    }
    if (voc.n_ctx_train() > 0 && o.ctx > voc.n_ctx_train()) {  // as the eval refuses its --eval-ctx (eval.h)
        fail("--ctx {} is larger than the context '{}' was trained on ({}): its imatrix and training would see "
             "positions it never saw; use --ctx {} or less",
             o.ctx, o.model, voc.n_ctx_train(), voc.n_ctx_train());
    }
    const int32_t bos = voc.add_bos() ? voc.bos() : -1;
    if (voc.add_bos() && bos < 0) {
        fail("'{}': the vocabulary asks for BOS but has no BOS token", o.model);
    }
    const int32_t eos = voc.eos();
    const std::string eos_text = voc.token_text(eos);

    // Read, check and split every file before tokenizing anything: a bad file fails fast.
    std::vector<std::unique_ptr<mapped_file>> maps;
    std::vector<std::vector<std::string_view>> docs_of;
    nlohmann::json sources = nlohmann::json::array();
    size_t total_bytes = 0;
    for (const std::string & path : o.texts) {
        auto map = std::make_unique<mapped_file>(path);
        const std::string_view text(reinterpret_cast<const char *>(map->bytes().data()), map->size());
        require_utf8(text, path);
        std::vector<std::string_view> docs = split_documents(text, eos_text);
        if (docs.empty()) {
            fail("'{}' holds no text ({} bytes, all whitespace); give a file with text", path, text.size());
        }
        for (std::string_view d : docs) {
            total_bytes += d.size();
        }
        sources.push_back({{"path", path},
                           {"bytes", text.size()},
                           {"sha256", sha256_hex(map->bytes())},
                           {"n_documents", docs.size()}});
        docs_of.push_back(std::move(docs));
        maps.push_back(std::move(map));
    }

    std::vector<document> documents;
    std::vector<int64_t> uncovered(o.texts.size(), 0);      // <unk> and byte-fallback tokens, per file
    std::vector<int64_t> file_tokens(o.texts.size(), 0);
    {
        progress bar("data", static_cast<int64_t>(total_bytes), "B");
        int64_t n_tokens = 0;
        for (size_t f = 0; f < docs_of.size(); ++f) {
            for (std::string_view d : docs_of[f]) {
                document doc{f, voc.tokenize(d, /*add_special =*/false, /*parse_special =*/false)};
                if (eos >= 0) {
                    doc.tokens.push_back(eos);
                }
                n_tokens += static_cast<int64_t>(doc.tokens.size());
                const size_t text_tokens = doc.tokens.size() - (eos >= 0 ? 1 : 0);
                uncovered[f] += uncovered_tokens(voc.get(), std::span<const int32_t>(doc.tokens).first(text_tokens));
                file_tokens[f] += static_cast<int64_t>(text_tokens);
                documents.push_back(std::move(doc));
                bar.add(static_cast<int64_t>(d.size()), fmt::format("{} tokens", n_tokens));
            }
        }
    }

    for (size_t f = 0; f < o.texts.size(); ++f) {  // as the eval refuses its text (eval.h)
        const double share = file_tokens[f] > 0 ? static_cast<double>(uncovered[f]) / static_cast<double>(file_tokens[f]) : 0.0;
        if (share > k_max_uncovered_share) {
            fail("the text '{}' is not in a script the vocabulary of '{}' covers: {:.0f}% of its {} tokens are <unk> "
                 "or byte-fallback tokens (at most {:.0f}% allowed); calibrate on text in the model's language",
                 o.texts[f], o.model, 100.0 * share, file_tokens[f], 100.0 * k_max_uncovered_share);
        }
    }
    std::vector<size_t> order(documents.size());
    std::iota(order.begin(), order.end(), size_t{0});
    splitmix64 rng{o.seed};
    for (size_t i = order.size(); i > 1; --i) {
        std::swap(order[i - 1], order[rng.below(i)]);
    }
    int64_t total_tokens = 0;
    for (const document & d : documents) {
        total_tokens += static_cast<int64_t>(d.tokens.size());
    }
    std::vector<const document *> val_docs, train_docs;
    int64_t val_tokens = 0;
    for (size_t k = 0; k < order.size(); ++k) {
        const size_t i = order[k];
        // The last document always goes to train: a single document cannot be split.
        const bool to_val = o.val_fraction > 0 && k + 1 < order.size() &&
                            static_cast<double>(val_tokens) < o.val_fraction * static_cast<double>(total_tokens);
        (to_val ? val_docs : train_docs).push_back(&documents[i]);
        if (to_val) {
            val_tokens += static_cast<int64_t>(documents[i].tokens.size());
        }
    }

    split_stats train_stats, val_stats;
    const std::vector<int32_t> train = make_chunks(train_docs, o.ctx, bos, train_stats);
    const std::vector<int32_t> val = make_chunks(val_docs, o.ctx, bos, val_stats);
    // A chunk is ctx tokens, the first of them BOS when the vocabulary adds one: ctx − 1 of the text's.
    const std::string files = text_list(o.texts);
    const std::string chunk = bos >= 0 ? fmt::format("--ctx {} (a BOS and {} tokens of text)", o.ctx, o.ctx - 1)
                                       : fmt::format("--ctx {}", o.ctx);
    if (train_stats.n_chunks == 0) {
        fail("{} is too short for one chunk of {}: {} tokens in all, {} of them in the train split ({} held out for "
             "validation, whole documents); give more text or a smaller --ctx",
             files, chunk, total_tokens, train_stats.n_tokens, val_tokens);
    }
    if (o.val_fraction > 0 && val_stats.n_chunks == 0) {
        fail("{} holds too little for a validation chunk of {}: the documents held out (--val-fraction {}) are {} "
             "tokens; give more text, a larger --val-fraction, a smaller --ctx, or --val-fraction 0",
             files, chunk, o.val_fraction, val_stats.n_tokens);
    }

    namespace fs = std::filesystem;
    std::error_code ec;
    fs::create_directories(o.out_dir, ec);
    if (ec) {
        fail("cannot create output folder '{}': {}", o.out_dir, ec.message());
    }
    const uint32_t flags = bos >= 0 ? token_file_flag_bos : 0;
    const auto n_vocab = static_cast<uint32_t>(voc.n_tokens());
    write_token_file((fs::path(o.out_dir) / "train.tokens").string(), train, static_cast<uint32_t>(o.ctx),
                     voc.hash(), n_vocab, flags);
    write_token_file((fs::path(o.out_dir) / "val.tokens").string(), val, static_cast<uint32_t>(o.ctx), voc.hash(),
                     n_vocab, flags);

    nlohmann::json sidecar = {
        {"format", "voodoo-tokens"},
        {"version", token_file_version},
        {"model", o.model},
        {"vocab_hash", vocab_hash_hex(voc.hash())},
        {"tokenizer_model", voc.tokenizer_model()},
        {"n_vocab", voc.n_tokens()},
        {"ctx", o.ctx},
        {"bos", bos},
        {"eos_separator", eos},
        {"seed", o.seed},
        {"val_fraction", o.val_fraction},
        {"sources", sources},
        {"train", split_json("train.tokens", train_stats)},
        {"val", split_json("val.tokens", val_stats)},
    };
    write_file_atomic((fs::path(o.out_dir) / "data.json").string(), sidecar.dump(2) + "\n");
    return sidecar;
}

token_data::token_data(const std::string & dir) : dir_(dir) {
    namespace fs = std::filesystem;
    const std::string json_path = (fs::path(dir) / "data.json").string();
    {
        mapped_file map(json_path);
        try {
            sidecar_ = nlohmann::json::parse(map.bytes().begin(), map.bytes().end());
        } catch (const nlohmann::json::exception & e) {
            fail("'{}' is not valid JSON ({}); make the folder again with `voodoo data`", json_path, e.what());
        }
    }
    // Each field is checked for its JSON type before it is read: nlohmann's value() throws its own type_error
    // (an internal error to the user) on "format": 5 or "sources": "x".
    const auto format = sidecar_.is_object() ? sidecar_.find("format") : sidecar_.end();
    if (!sidecar_.is_object() || format == sidecar_.end() || *format != "voodoo-tokens") {
        fail("'{}' is not a Voodoo data sidecar (no \"format\": \"voodoo-tokens\"); make the folder with `voodoo data`",
             json_path);
    }
    sources_ = read_sources(sidecar_, json_path);
    train_ = std::make_unique<token_file>((fs::path(dir) / "train.tokens").string());
    val_ = std::make_unique<token_file>((fs::path(dir) / "val.tokens").string());
    if (train_->vocab_hash() != val_->vocab_hash() || train_->ctx() != val_->ctx()) {
        fail("'{}': train.tokens and val.tokens disagree (vocabulary or ctx); make the folder again with `voodoo data`",
             dir);
    }
    if (train_->n_chunks() == 0) {
        fail("'{}' holds no chunk (`voodoo data` never writes an empty train split); make the folder again with "
             "`voodoo data`",
             train_->path());
    }
}

void token_data::require_vocab_of(const std::string & model_path) const {
    const gguf_file model(model_path);
    train_->require_vocab(vocab_hash(model), model_path);
}

}  // namespace voodoo
