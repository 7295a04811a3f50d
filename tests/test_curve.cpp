#include "common/error.h"
#include "eval/curve.h"
#include "eval/report.h"
#include "ggml/gguf.h"
#include "train/probe.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>

using namespace voodoo;

namespace {

eval_file_result file(const std::string & name, size_t bytes, double kld, double p99) {
    eval_file_result f;
    f.path = "/w/" + name;
    f.name = name;
    f.file_bytes = bytes;
    f.kld_mean = kld;
    f.kld_p99 = p99;
    f.same_top = 0.9;
    return f;
}

eval_result ladder_result() {
    eval_result r;
    r.ref = file("m.gguf", 1000, 0, 0);
    r.text = "t.txt";
    r.n_ctx = 512;
    r.n_chunks = 4;
    r.files = {file("m.Voodoo60.Q4_K_M.gguf", 600, 0.010, 0.1), file("m.Voodoo40.IQ2_M.gguf", 400, 0.050, 0.5),
               file("m.greedy.Q4_K_M.gguf", 600, 0.012, 0.12), file("m-Q4_K_M.gguf", 605, 0.030, 0.3),
               file("m-Q4_K_S.gguf", 580, 0.040, 0.4), file("m-Q4_0.gguf", 590, 0.060, 0.6),
               file("m-IQ2_M.gguf", 410, 0.2, 2.0)};
    return r;
}

}  // namespace

TEST(curve, files_belong_to_a_series_by_name) {
    EXPECT_EQ(curve_series("mix30M.Voodoo66.Q4_K_M.gguf"), "voodoo");
    EXPECT_EQ(curve_series("mix30M.Voodoo66.gguf"), "voodoo");
    EXPECT_EQ(curve_series("mix30M.greedy.Q4_K_M.gguf"), "greedy");
    EXPECT_EQ(curve_series("mix30M-Q4_K_M.gguf"), "stock");
}

TEST(curve, each_voodoo_file_meets_the_best_stock_file_no_larger_and_its_greedy_peer) {
    const eval_result r = ladder_result();
    const auto rungs = curve_rungs(r);
    ASSERT_EQ(rungs.size(), 2u);
    EXPECT_EQ(rungs[0].voodoo->name, "m.Voodoo40.IQ2_M.gguf");  // by size
    EXPECT_EQ(rungs[0].best_stock, nullptr);                     // IQ2_M's stock file is 10 bytes larger
    EXPECT_EQ(rungs[0].greedy, nullptr);
    // At 600 bytes: Q4_K_S (580, 0.040) and Q4_0 (590, 0.060) are no larger; Q4_K_M (605) is larger.
    EXPECT_EQ(rungs[1].best_stock->name, "m-Q4_K_S.gguf");
    EXPECT_DOUBLE_EQ(rungs[1].ratio, 0.010 / 0.040);
    ASSERT_NE(rungs[1].greedy, nullptr);
    EXPECT_EQ(rungs[1].greedy->name, "m.greedy.Q4_K_M.gguf");
    const std::string md = curve_to_markdown(r);
    EXPECT_NE(md.find("| m.Voodoo60.Q4_K_M.gguf |"), std::string::npos) << md;
    EXPECT_NE(md.find("0.25"), std::string::npos) << md;
    const nlohmann::json j = curve_to_json(r);
    EXPECT_EQ(j["rungs"][1]["best_stock"]["file"], "m-Q4_K_S.gguf");
}

TEST(curve, an_eval_report_reads_back_from_its_json) {
    eval_result r = ladder_result();
    r.devices = {"CUDA0: NVIDIA H100 80GB HBM3"};
    const eval_result back = eval_from_json(eval_to_json(r), "r.json");
    EXPECT_EQ(back.devices, r.devices);
    EXPECT_NE(eval_to_markdown(back).find("; computed by libllama on CUDA0: NVIDIA H100 80GB HBM3."), std::string::npos);
    ASSERT_EQ(back.files.size(), r.files.size());
    EXPECT_EQ(back.files[3].name, "m-Q4_K_M.gguf");
    EXPECT_EQ(back.files[3].file_bytes, 605u);
    EXPECT_DOUBLE_EQ(back.files[3].kld_p99, 0.3);
    EXPECT_EQ(curve_to_markdown(back), curve_to_markdown(r));
    const std::string msg = test::error_of([] { eval_from_json(nlohmann::json::object(), "bad.json"); });
    EXPECT_NE(msg.find("bad.json"), std::string::npos) << msg;
}

TEST(curve, the_plot_is_drawn_with_both_panels) {
    test::temp_dir dir;
    curve_plot(ladder_result(), dir.file("curve.png"));
    std::ifstream in(dir.file("curve.png"), std::ios::binary);
    char magic[4] = {};
    in.read(magic, 4);
    EXPECT_EQ(std::string(magic + 1, 3), "PNG");
}

TEST(probe, a_stored_probe_is_reused_only_for_the_same_candidates_and_tokens) {
    test::temp_dir dir;
    const gguf_file f(test::stories260k());
    std::vector<gated_tensor> gated(2);
    gated[0].tensor = &f.tensors()[1];
    gated[1].tensor = &f.tensors()[2];
    for (auto & g : gated) {
        g.types = {GGML_TYPE_Q4_0, GGML_TYPE_Q8_0};
        g.bytes = {{1, 2, 3}, {4, 5, 6}};
    }
    const torch::Tensor tokens = torch::arange(8, torch::kLong).view({2, 4});
    const std::string id = probe_identity(gated, tokens);
    const std::vector<std::vector<double>> sens = {{0.5, 0.01}, {0.25, 0.002}};
    save_probe(dir.file("probe.json"), id, gated, sens);
    EXPECT_EQ(load_probe(dir.file("probe.json"), id, gated), sens);
    // Another token, another candidate byte, another dtype: another identity, nothing reused.
    EXPECT_NE(probe_identity(gated, tokens + 1), id);
    EXPECT_NE(probe_identity(gated, tokens, torch::kBFloat16), id);
    // TF32 products: another identity; an f32 probe keeps the identity it had before the flag existed.
    EXPECT_NE(probe_identity(gated, tokens, torch::kFloat, 0, true), id);
    EXPECT_EQ(probe_identity(gated, tokens, torch::kFloat, 0, false), id);
    auto changed = gated;
    changed[1].bytes[0][2] = 9;
    EXPECT_NE(probe_identity(changed, tokens), id);
    EXPECT_TRUE(load_probe(dir.file("probe.json"), probe_identity(changed, tokens), changed).empty());
    EXPECT_TRUE(load_probe(dir.file("absent.json"), id, gated).empty());
    std::ofstream(dir.file("bad.json")) << "{not json";
    const std::string msg = test::error_of([&] { load_probe(dir.file("bad.json"), id, gated); });
    EXPECT_NE(msg.find("bad.json"), std::string::npos) << msg;
}
