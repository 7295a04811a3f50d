#include "export/model_card.h"
#include "export/recipe.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <string>

using namespace voodoo;

namespace {

// The card of stories260K quantized to Q4_0 everywhere, from a copy of it whose metadata `edit` changes.
std::string card_of(const test::temp_dir & dir, const std::function<void(gguf_context *)> & edit) {
    const std::string path = dir.file("model.gguf");
    test::rewrite_gguf(test::stories260k(), path, edit);
    const gguf_file src(path);
    recipe r = recipe_from_model(src);
    for (recipe_tensor & t : r.tensors) {
        t.type = GGML_TYPE_Q4_0;
    }
    r.target = "size=277248";
    model_card_input in;
    in.source = path;
    in.files = {{dir.file("model.Voodoo73.gguf"), dir.file("model.Voodoo73.tensor-types.txt"), r}};
    in.imatrix = dir.file("imatrix file.gguf");
    in.command = shell_command({"voodoo", "quantize", path, "--like", "Q4_0"});
    return model_card_markdown(src, in);
}

}  // namespace

TEST(model_card, front_matter_takes_base_model_and_license_from_the_source_metadata) {
    test::temp_dir dir;
    const std::string card = card_of(dir, [](gguf_context * c) {
        gguf_set_val_str(c, "general.license", "apache-2.0");
        gguf_set_val_str(c, "general.source.huggingface.repository", "someone/stories-260k");
    });
    ASSERT_EQ(card.rfind("---\n", 0), 0u) << card;
    const size_t end = card.find("\n---\n", 4);
    ASSERT_NE(end, std::string::npos);
    const std::string front = card.substr(4, end - 4);
    EXPECT_NE(front.find("base_model: \"someone/stories-260k\"\n"), std::string::npos) << front;
    EXPECT_NE(front.find("license: \"apache-2.0\"\n"), std::string::npos) << front;
    EXPECT_NE(front.find("tags:\n- gguf\n- quantized\n- voodoo\n"), std::string::npos) << front;
    EXPECT_NE(front.find("quantized_by: \"Voodoo\""), std::string::npos) << front;
    // Every layer's tensors of a family on one row, with their count.
    EXPECT_NE(card.find("| `blk.*.attn_q.weight` | q4_0 ×5 |"), std::string::npos) << card;
    // The stock rebuild: the imatrix name with a space is quoted for the shell; the files are named as they lie
    // beside the card.
    EXPECT_NE(card.find("llama-quantize --imatrix 'imatrix file.gguf' --tensor-type-file model.Voodoo73.tensor-types.txt "
                        "model.gguf model.Voodoo73.gguf Q8_0\n"),
              std::string::npos)
        << card;
    EXPECT_EQ(card.find("## Against the stock"), std::string::npos) << "no eval, no comparison section";
}

TEST(model_card, a_source_without_license_or_repository_leaves_them_out) {
    test::temp_dir dir;
    const std::string card = card_of(dir, [](gguf_context * c) {
        gguf_remove_key(c, "general.license");
        gguf_set_val_str(c, "general.name", "llama");  // a name, not a Hub repository
    });
    const std::string front = card.substr(0, card.find("\n---\n", 4));
    EXPECT_EQ(front.find("license:"), std::string::npos) << front;
    EXPECT_EQ(front.find("base_model:"), std::string::npos) << front;
    const std::string from_url = card_of(dir, [](gguf_context * c) {
        gguf_set_val_str(c, "general.base_model.0.repo_url", "https://huggingface.co/karpathy/tinyllamas");
    });
    EXPECT_NE(from_url.find("base_model: \"karpathy/tinyllamas\"\n"), std::string::npos) << from_url;
}

TEST(model_card, a_readme_the_publisher_wrote_is_never_overwritten) {
    test::temp_dir dir;
    const std::string gguf = dir.file("m.Voodoo70.gguf");
    EXPECT_EQ(model_card_path(dir.path.string(), gguf), dir.file("README.md"));
    test::write_file(dir.file("README.md"), "# my own card\n");
    EXPECT_EQ(model_card_path(dir.path.string(), gguf), dir.file("m.Voodoo70.README.md"));
    test::write_file(dir.file("README.md"), std::string("---\n---\n\n") + k_model_card_marker + "\n# an older card of ours\n");
    EXPECT_EQ(model_card_path(dir.path.string(), gguf), dir.file("README.md"));
}

TEST(model_card, shell_command_quotes_only_what_the_shell_would_split_or_expand) {
    EXPECT_EQ(shell_command({"voodoo", "quantize", "/m/a.gguf", "--like", "Q4_K_M,Q6_K"}),
              "voodoo quantize /m/a.gguf --like Q4_K_M,Q6_K");
    EXPECT_EQ(shell_command({"--text", "my text.txt", "it's", "$HOME", ""}), "--text 'my text.txt' 'it'\\''s' '$HOME' ''");
}
