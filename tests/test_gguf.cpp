#include "common/error.h"
#include "common/file.h"
#include "ggml/gguf.h"
#include "ggml/quant.h"
#include "ggml/types.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <fmt/format.h>

#include <cstring>
#include <fstream>
#include <functional>
#include <memory>

#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

using namespace voodoo;
using voodoo::test::temp_dir;

namespace {

// Same type and same bytes (scalars, strings and arrays alike).
bool kv_equal(const gguf_context * a, int64_t ia, const gguf_context * b, int64_t ib) {
    const gguf_type t = gguf_get_kv_type(a, ia);
    if (t != gguf_get_kv_type(b, ib)) {
        return false;
    }
    if (t == GGUF_TYPE_STRING) {
        return std::strcmp(gguf_get_val_str(a, ia), gguf_get_val_str(b, ib)) == 0;
    }
    if (t != GGUF_TYPE_ARRAY) {
        return std::memcmp(gguf_get_val_data(a, ia), gguf_get_val_data(b, ib), gguf_scalar_size(t)) == 0;
    }
    const gguf_type at = gguf_get_arr_type(a, ia);
    const size_t n = gguf_get_arr_n(a, ia);
    if (at != gguf_get_arr_type(b, ib) || n != gguf_get_arr_n(b, ib)) {
        return false;
    }
    if (at == GGUF_TYPE_STRING) {
        for (size_t i = 0; i < n; ++i) {
            if (std::strcmp(gguf_get_arr_str(a, ia, i), gguf_get_arr_str(b, ib, i)) != 0) {
                return false;
            }
        }
        return true;
    }
    return std::memcmp(gguf_get_arr_data(a, ia), gguf_get_arr_data(b, ib), n * gguf_scalar_size(at)) == 0;
}

void expect_error_naming(const std::string & path, const std::string & part) {
    try {
        gguf_file f(path);
        FAIL() << "expected an error for " << path;
    } catch (const error & e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find(path), std::string::npos) << msg;
        EXPECT_NE(msg.find(part), std::string::npos) << msg;
        EXPECT_EQ(msg.find('\n'), std::string::npos) << "one line: " << msg;
    }
}

}  // namespace

TEST(gguf, reads_stories260k_header_and_tensors) {
    gguf_file f(test::stories260k());
    EXPECT_EQ(f.version(), 3u);
    EXPECT_EQ(f.architecture(), "llama");
    EXPECT_EQ(f.tensors().size(), 48u);
    EXPECT_EQ(f.n_kv(), 19);
    EXPECT_EQ(f.get_int("llama.embedding_length"), 64);
    EXPECT_EQ(f.get_int("llama.feed_forward_length"), 172);
    EXPECT_EQ(f.get_int("llama.block_count"), 5);
    EXPECT_FALSE(f.get_int("llama.no_such_key").has_value());
    EXPECT_THROW(f.get_int("general.architecture"), error);
    const gguf_tensor & emb = f.tensor("token_embd.weight");
    EXPECT_EQ(emb.type, GGML_TYPE_F32);
    EXPECT_EQ(emb.n_dims, 2);
    EXPECT_EQ(emb.ne[0], 64);
    EXPECT_EQ(emb.ne[1], 512);
    EXPECT_EQ(emb.n_bytes, 64u * 512u * 4u);
    size_t total = 0;
    for (const gguf_tensor & t : f.tensors()) {
        EXPECT_EQ(t.type, GGML_TYPE_F32) << t.name;
        total += t.n_bytes;
    }
    // Every F32 tensor here is a multiple of 32 bytes, so the data section has no padding.
    EXPECT_EQ(total, f.file_size() - f.data_offset());
    EXPECT_THROW(f.tensor("no.such.weight"), error);
}

TEST(gguf, round_trip_preserves_every_key_and_tensor_byte) {
    temp_dir dir;
    const std::string out = dir.file("copy.gguf");
    gguf_file src(test::stories260k());
    {
        gguf_writer w(out, src.alignment());
        w.copy_kv(src);
        for (const gguf_tensor & t : src.tensors()) {
            w.add_tensor(t.name, t.type, t.shape());
        }
        for (const gguf_tensor & t : src.tensors()) {
            w.write_tensor(t.name, src.data(t));
        }
        w.commit();
    }
    gguf_file copy(out);
    ASSERT_EQ(copy.n_kv(), src.n_kv());
    for (int64_t i = 0; i < src.n_kv(); ++i) {
        const char * key = gguf_get_key(src.ctx(), i);
        const int64_t j = copy.find_key(key);
        ASSERT_GE(j, 0) << key;
        EXPECT_TRUE(kv_equal(src.ctx(), i, copy.ctx(), j)) << key;
    }
    ASSERT_EQ(copy.tensors().size(), src.tensors().size());
    for (size_t i = 0; i < src.tensors().size(); ++i) {
        const gguf_tensor & a = src.tensors()[i];
        const gguf_tensor & b = copy.tensors()[i];
        EXPECT_EQ(a.name, b.name);
        EXPECT_EQ(a.type, b.type);
        EXPECT_EQ(a.ne, b.ne);
        const auto da = src.data(a);
        const auto db = copy.data(b);
        ASSERT_EQ(da.size(), db.size());
        EXPECT_EQ(std::memcmp(da.data(), db.data(), da.size()), 0) << a.name;
    }
    // ggml wrote the source too, so the copy is the same file, byte for byte.
    EXPECT_EQ(test::read_bytes(out), test::read_bytes(test::stories260k()));
}

TEST(gguf, writes_mixed_types_with_a_non_default_alignment) {
    temp_dir dir;
    const std::string out = dir.file("mixed.gguf");
    const auto w0 = test::gaussian(256 * 4, 1);
    const auto w1 = test::gaussian(64 * 3, 2);
    const auto q0 = quantize(GGML_TYPE_Q4_K, w0, 256);
    const auto q1 = quantize(GGML_TYPE_Q8_0, w1, 64);
    const int64_t ne0[2] = {256, 4};
    const int64_t ne1[2] = {64, 3};
    {
        gguf_writer w(out, 64);
        gguf_set_val_str(w.ctx(), "general.architecture", "test");
        gguf_set_val_u32(w.ctx(), "test.value", 7);
        w.add_tensor("a.weight", GGML_TYPE_Q4_K, ne0);
        w.add_tensor("b.weight", GGML_TYPE_Q8_0, ne1);
        w.write_tensor("a.weight", q0);
        w.write_tensor("b.weight", q1);
        w.commit();
    }
    gguf_file f(out);
    EXPECT_EQ(f.alignment(), 64u);
    EXPECT_EQ(f.data_offset() % 64, 0u);
    EXPECT_EQ(f.get_int("test.value"), 7);
    EXPECT_EQ(f.tensor("b.weight").offset % 64, 0u);
    const auto a = f.data(f.tensor("a.weight"));
    const auto b = f.data(f.tensor("b.weight"));
    EXPECT_TRUE(std::equal(a.begin(), a.end(), q0.begin(), q0.end()));
    EXPECT_TRUE(std::equal(b.begin(), b.end(), q1.begin(), q1.end()));
}

TEST(gguf, writer_refuses_out_of_order_or_missized_tensors_and_leaves_no_file) {
    temp_dir dir;
    const std::string out = dir.file("bad.gguf");
    const int64_t ne[2] = {64, 2};
    std::vector<uint8_t> bytes(64 * 2 * 4);
    {
        gguf_writer w(out);
        w.add_tensor("a.weight", GGML_TYPE_F32, ne);
        w.add_tensor("b.weight", GGML_TYPE_F32, ne);
        EXPECT_THROW(w.add_tensor("a.weight", GGML_TYPE_F32, ne), error);
        EXPECT_THROW(w.add_tensor("c.weight", GGML_TYPE_Q4_K, ne), error);  // 64 does not fit a 256 block
        EXPECT_THROW(w.write_tensor("b.weight", bytes), error);
        EXPECT_THROW(w.write_tensor("a.weight", std::span<const uint8_t>(bytes).first(10)), error);
        w.write_tensor("a.weight", bytes);
        EXPECT_THROW(w.commit(), error);  // b.weight was never written
    }
    EXPECT_FALSE(std::filesystem::exists(out));
    EXPECT_TRUE(std::filesystem::is_empty(dir.path)) << "the temporary file was removed";
}

TEST(gguf, a_full_disk_is_an_error_and_leaves_no_file) {
    temp_dir dir;
    const std::string out = dir.file("full.gguf");
    gguf_file src(test::stories260k());
    const std::string msg = test::error_with_file_size_limit(200000, [&] {
        gguf_writer w(out, src.alignment());
        w.copy_kv(src);
        for (const gguf_tensor & t : src.tensors()) {
            w.add_tensor(t.name, t.type, t.shape());
        }
        for (const gguf_tensor & t : src.tensors()) {
            w.write_tensor(t.name, src.data(t));
        }
        w.commit();
    });
    EXPECT_NE(msg.find(out), std::string::npos) << msg;
    EXPECT_NE(msg.find("nothing was written"), std::string::npos) << msg;
    EXPECT_NE(msg.find("bytes it needs"), std::string::npos) << msg;  // how much room to make
    EXPECT_FALSE(std::filesystem::exists(out));
    EXPECT_TRUE(std::filesystem::is_empty(dir.path));
}

TEST(gguf, bad_files_give_one_line_errors) {
    temp_dir dir;
    const auto good = test::read_bytes(test::stories260k());

    expect_error_naming(dir.file("missing.gguf"), "No such file");

    const std::string empty = dir.file("empty.gguf");
    test::write_bytes(empty, {});
    expect_error_naming(empty, "not a GGUF file");

    const std::string text = dir.file("text.gguf");
    const std::string words = "Once upon a time there was a file that was not a GGUF.";
    test::write_bytes(text, std::vector<uint8_t>(words.begin(), words.end()));
    expect_error_naming(text, "not a GGUF file");

    // Cut inside the metadata: ggml's parser says what it could not read.
    const std::string cut_header = dir.file("cut-header.gguf");
    test::write_bytes(cut_header, std::vector<uint8_t>(good.begin(), good.begin() + 2000));
    expect_error_naming(cut_header, "not a valid GGUF file");

    // Cut inside the tensor data: the header parses, the last tensor runs past the end.
    const std::string cut_data = dir.file("cut-data.gguf");
    test::write_bytes(cut_data, std::vector<uint8_t>(good.begin(), good.end() - 1000));
    expect_error_naming(cut_data, "ends at byte");
    expect_error_naming(cut_data, "truncated or corrupt");

    // An unsupported version.
    auto v9 = good;
    v9[4] = 9;
    const std::string version = dir.file("v9.gguf");
    test::write_bytes(version, v9);
    expect_error_naming(version, "version 9");

    expect_error_naming(dir.path.string(), "not a regular file");
}

TEST(file, a_second_lock_on_a_work_folder_is_refused_naming_the_holder_and_is_granted_once_it_ends) {
    temp_dir dir;
    const std::string work = dir.file("work");
    {
        const folder_lock first(work);
        EXPECT_TRUE(std::filesystem::is_directory(work));
        const std::string msg = test::error_of([&] { folder_lock second(work); });
        EXPECT_NE(msg.find("'" + work + "' is in use by another voodoo job (pid " + std::to_string(::getpid()) + ")"),
                  std::string::npos)
            << msg;
    }
    EXPECT_NO_THROW(folder_lock again(work));
}

TEST(file, a_work_folder_that_cannot_be_made_is_refused_naming_the_flag) {
    // Under a regular file no folder can be made, whoever runs the test (root included, as in CI, where a read-only
    // folder would not stop the lock).
    temp_dir dir;
    const std::string file = dir.file("a-file");
    test::write_bytes(file, std::vector<uint8_t>{1, 2, 3});
    const std::string work = file + "/work";
    const std::string msg = test::error_of([&] { folder_lock lock(work, "--work"); });
    EXPECT_NE(msg.find("cannot make the work folder '" + work + "' (--work)"), std::string::npos) << msg;
    EXPECT_NE(msg.find("give --work a folder"), std::string::npos) << msg;
    EXPECT_EQ(test::read_file(file).size(), 3u) << "the file in the way is left alone";
}

namespace {

// Forks a child that makes what `hold` returns (a lock, a file being written), says so and waits to be killed;
// returns its process id once it holds it (-1 when no child could be started or it died first).
pid_t fork_holding(const std::function<std::shared_ptr<void>()> & hold) {
    int ready[2];
    if (::pipe(ready) != 0) {
        return -1;
    }
    const pid_t pid = ::fork();
    if (pid == 0) {
        std::shared_ptr<void> held;
        try {
            held = hold();
        } catch (...) {
            ::_exit(1);
        }
        const char c = 'x';
        (void) !::write(ready[1], &c, 1);
        for (;;) {
            ::pause();
        }
    }
    ::close(ready[1]);   // a child that dies first closes the last writer: the read returns 0
    char c = 0;
    const bool ok = pid > 0 && ::read(ready[0], &c, 1) == 1;
    ::close(ready[0]);
    return ok ? pid : -1;
}

}  // namespace

TEST(file, a_lock_whose_job_was_killed_with_sigkill_is_not_stuck) {
    temp_dir dir;
    const std::string work = dir.file("work");
    const pid_t pid = fork_holding([&] { return std::make_shared<folder_lock>(work); });   // the first job
    ASSERT_GT(pid, 0);
    const std::string msg = test::error_of([&] { folder_lock second(work); });
    EXPECT_NE(msg.find("(pid " + std::to_string(pid) + ")"), std::string::npos) << msg;
    ::kill(pid, SIGKILL);
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
    EXPECT_TRUE(std::filesystem::exists(work + "/.lock")) << "the killed job's lock file is still there";
    EXPECT_NO_THROW(folder_lock after(work)) << "a killed job's lock was left stuck";
}

TEST(file, the_temporaries_of_a_writer_killed_with_sigkill_are_removed_and_a_live_writers_kept) {
    temp_dir dir, outside;
    const std::filesystem::path sub = dir.path / "baselines";
    std::filesystem::create_directories(sub);
    const pid_t pid = fork_holding([&] {   // a writer killed before commit(): its temporary stays behind
        auto f = std::make_shared<atomic_file>((sub / "m-Q4_0.gguf").string());
        f->write("GGUF", 4);
        return f;
    });
    ASSERT_GT(pid, 0);
    ::kill(pid, SIGKILL);
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    std::string dead;   // .m-Q4_0.gguf.<pid>.<n>.tmp (n: the process's count of atomic_files so far)
    for (const auto & e : std::filesystem::directory_iterator(sub)) {
        dead = e.path().string();
    }
    ASSERT_NE(dead.find(fmt::format(".m-Q4_0.gguf.{}.", pid)), std::string::npos) << "the killed writer left no temporary";
    atomic_file live((sub / "m-Q5_0.gguf").string());   // this process's: alive, kept
    live.write("GGUF", 4);
    const std::string others[] = {dir.file(".x.gguf.tmp"), dir.file("notes.tmp"), dir.file(".a.b.tmp")};
    for (const std::string & o : others) {
        test::write_bytes(o, {1});
    }
    const std::string beyond_link = (outside.path / std::filesystem::path(dead).filename()).string();
    test::write_bytes(beyond_link, {1});
    std::filesystem::create_directory_symlink(outside.path, dir.path / "link");  // must not be followed
    EXPECT_EQ(remove_stale_temporaries(dir.path.string()), 1u);
    EXPECT_FALSE(std::filesystem::exists(dead));
    EXPECT_EQ(std::distance(std::filesystem::directory_iterator(sub), {}), 1) << "the live writer's temporary was removed";
    for (const std::string & o : others) {
        EXPECT_TRUE(std::filesystem::exists(o)) << o << " is no temporary of atomic_file's";
    }
    EXPECT_TRUE(std::filesystem::exists(beyond_link)) << "a symbolic link was followed";
    EXPECT_EQ(remove_stale_temporaries(dir.file("missing")), 0u);
    // The folder itself only: one in a subfolder stays, one in the folder goes.
    const std::string in_sub = (sub / std::filesystem::path(dead).filename()).string();
    const std::string in_dir = dir.file(std::filesystem::path(dead).filename().string());
    test::write_bytes(in_sub, {1});
    test::write_bytes(in_dir, {1});
    EXPECT_EQ(remove_stale_temporaries(dir.path.string(), false), 1u);
    EXPECT_TRUE(std::filesystem::exists(in_sub));
    EXPECT_FALSE(std::filesystem::exists(in_dir));
}

TEST(file, remove_tree_removes_a_nested_folder_without_following_links) {
    temp_dir keep, dir;
    const std::string kept = keep.file("kept.txt");
    test::write_bytes(kept, {1, 2, 3});
    const std::filesystem::path root = dir.path / "a";
    std::filesystem::create_directories(root / "b" / "c");
    test::write_bytes((root / "b" / "c" / "x.bin").string(), {4});
    test::write_bytes((root / "y.bin").string(), {5});
    std::filesystem::create_directory_symlink(keep.path, root / "link");  // must not be followed
    EXPECT_TRUE(remove_tree(root.string()));
    EXPECT_FALSE(std::filesystem::exists(root));
    EXPECT_TRUE(std::filesystem::exists(kept)) << "remove_tree followed a symbolic link";
    EXPECT_TRUE(remove_tree(root.string())) << "a missing path is not an error";
    const std::string file = dir.file("plain.bin");
    test::write_bytes(file, {6});
    EXPECT_TRUE(remove_tree(file));
    EXPECT_FALSE(std::filesystem::exists(file));
}
