#include "common/error.h"
#include "ggml/types.h"

#include <gtest/gtest.h>

using namespace voodoo;

TEST(types, table_holds_every_storage_type_with_ggml_numbers) {
    EXPECT_EQ(type_table().size(), 28u);
    const type_info & q4k = type_info_of(GGML_TYPE_Q4_K);
    EXPECT_EQ(q4k.name, "q4_K");
    EXPECT_EQ(q4k.blck_size, 256);
    EXPECT_EQ(q4k.type_size, 144u);
    EXPECT_DOUBLE_EQ(q4k.bpw, 4.5);
    const type_info & q80 = type_info_of(GGML_TYPE_Q8_0);
    EXPECT_EQ(q80.blck_size, 32);
    EXPECT_EQ(q80.type_size, 34u);
    EXPECT_DOUBLE_EQ(q80.bpw, 8.5);
    EXPECT_DOUBLE_EQ(type_info_of(GGML_TYPE_F16).bpw, 16.0);
    EXPECT_FALSE(type_info_of(GGML_TYPE_BF16).is_quantized);
    EXPECT_DOUBLE_EQ(type_info_of(GGML_TYPE_IQ1_S).bpw, 1.5625);
}

TEST(types, imatrix_rules_follow_ggml_and_llama_quant) {
    // ggml_quantize_requires_imatrix: IQ2_XXS, IQ2_XS, IQ1_S.
    EXPECT_TRUE(type_info_of(GGML_TYPE_IQ2_XXS).requires_imatrix);
    EXPECT_TRUE(type_info_of(GGML_TYPE_IQ1_S).requires_imatrix);
    EXPECT_FALSE(type_info_of(GGML_TYPE_IQ3_XXS).requires_imatrix);
    // llama-quant.cpp tensor_requires_imatrix adds IQ3_XXS, IQ2_S, IQ1_M.
    EXPECT_TRUE(type_info_of(GGML_TYPE_IQ3_XXS).needs_imatrix);
    EXPECT_TRUE(type_info_of(GGML_TYPE_IQ2_S).needs_imatrix);
    EXPECT_TRUE(type_info_of(GGML_TYPE_IQ1_M).needs_imatrix);
    EXPECT_FALSE(type_info_of(GGML_TYPE_IQ3_S).needs_imatrix);
    EXPECT_FALSE(type_info_of(GGML_TYPE_Q2_K).needs_imatrix);
}

TEST(types, non_storage_types_are_refused) {
    EXPECT_THROW(type_info_of(GGML_TYPE_Q8_K), error);
    EXPECT_THROW(type_info_of(GGML_TYPE_I32), error);
}

TEST(types, names_parse_case_insensitively) {
    EXPECT_EQ(type_from_name("Q4_K"), GGML_TYPE_Q4_K);
    EXPECT_EQ(type_from_name("q4_k"), GGML_TYPE_Q4_K);
    EXPECT_EQ(type_from_name("IQ2_XXS"), GGML_TYPE_IQ2_XXS);
    EXPECT_EQ(type_from_name("bf16"), GGML_TYPE_BF16);
    EXPECT_FALSE(type_from_name("q4_K_M").has_value());
    try {
        parse_type("Q4_K_M", "--menu");
        FAIL() << "expected an error";
    } catch (const error & e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find("--menu"), std::string::npos) << msg;
        EXPECT_NE(msg.find("'Q4_K_M'"), std::string::npos) << msg;
        EXPECT_NE(msg.find("q4_K"), std::string::npos) << msg;  // lists what would work
    }
}

TEST(types, bytes_are_rows_times_ggml_row_size) {
    for (const type_info & info : type_table()) {
        const int64_t ne0 = 256 * 3;  // every block size (32, 64, 256) divides it
        const int64_t ne[3] = {ne0, 7, 2};
        EXPECT_EQ(tensor_bytes(info.type, ne), 14 * ggml_row_size(info.type, ne0)) << info.name;
        EXPECT_EQ(tensor_bytes(info.type, ne), static_cast<size_t>(14 * ne0 / info.blck_size) * info.type_size)
            << info.name;
    }
}

TEST(types, a_row_that_does_not_fit_the_block_names_tensor_shape_and_type) {
    const int64_t ne[2] = {172, 64};
    EXPECT_FALSE(type_fits(GGML_TYPE_Q4_0, 172));
    EXPECT_TRUE(type_fits(GGML_TYPE_F16, 172));
    try {
        tensor_bytes(GGML_TYPE_Q4_K, ne, "blk.0.ffn_down.weight");
        FAIL() << "expected an error";
    } catch (const error & e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find("blk.0.ffn_down.weight"), std::string::npos) << msg;
        EXPECT_NE(msg.find("[172, 64]"), std::string::npos) << msg;
        EXPECT_NE(msg.find("q4_K"), std::string::npos) << msg;
        EXPECT_NE(msg.find("256"), std::string::npos) << msg;
    }
}
