// Files: read-only memory maps and atomic writes (temp file in the destination folder, fsync, rename).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>

namespace voodoo {

/// Size of a regular file in bytes. Throws voodoo::error naming the path when it is missing,
/// unreadable or not a regular file.
size_t file_size(const std::string & path);

/// True when a and b name the same file on disk (same device and inode). False if either is missing.
bool same_file(const std::string & a, const std::string & b);

/// Removes `path` and, when it is a folder, everything under it (rm -rf; symbolic links are removed, not
/// followed). A missing path is not an error. Returns false when something could not be removed.
/// Use this, not std::filesystem::remove_all: PyTorch's CUDA wheels (2.11) export their own copy of
/// remove_all from libtorch.so, and a program linked against them that calls it jumps to address 0
/// (seen on the GPU machine: tests/test_util.h's temp_dir and the eval plot's scratch folder).
bool remove_tree(const std::string & path) noexcept;

/// The bytes `path` takes on its disk: st_blocks × 512 (du's count, so a sparse file counts what it holds) of
/// the file, or of every file and folder under it, links not followed. 0 for a missing path. For the job's
/// report of disk by stage (issue #16).
int64_t tree_disk_bytes(const std::string & path) noexcept;

/// Bytes an unprivileged writer may still put on the file system holding `path` (statvfs: f_bavail ×
/// f_frsize), or of its nearest existing ancestor when it does not exist yet (a work folder a run will
/// create). -1 when none can be read.
int64_t free_disk_bytes(const std::string & path) noexcept;

/// 0 when a new file can be made in the existing folder `dir`, else the errno why not. A file is made there (mkstemp)
/// and removed at once: access(W_OK) is not enough, root passes it on /proc and other file systems that refuse new
/// files. For checks before any work (quantize's -o and --work, the --json destinations).
int cannot_create_files_in(const std::string & dir) noexcept;

/// A read-only, private memory map of a whole file. Empty files map to an empty span.
class mapped_file {
public:
    /// Throws voodoo::error naming the path when it cannot be opened or mapped.
    explicit mapped_file(const std::string & path);
    ~mapped_file();
    mapped_file(const mapped_file &) = delete;
    mapped_file & operator=(const mapped_file &) = delete;

    std::span<const uint8_t> bytes() const { return {data_, size_}; }
    size_t size() const { return size_; }

private:
    const uint8_t * data_ = nullptr;
    size_t size_ = 0;
};

/// A file written under a temporary name beside its destination and renamed over it by commit().
/// Until commit() succeeds the destination is untouched; destroying an uncommitted atomic_file
/// removes the temporary. Every write is checked: a full disk is an error naming the destination.
class atomic_file {
public:
    /// Opens `<dir>/.<name>.<pid>.<n>.tmp`. Throws voodoo::error when the folder is not writable.
    explicit atomic_file(std::string path);
    ~atomic_file();
    atomic_file(const atomic_file &) = delete;
    atomic_file & operator=(const atomic_file &) = delete;

    /// Appends bytes. Throws voodoo::error (with the OS reason, e.g. "No space left on device").
    void write(const void * data, size_t n);
    void write(std::span<const uint8_t> bytes) { write(bytes.data(), bytes.size()); }
    /// Appends n zero bytes.
    void write_zeros(size_t n);
    /// Bytes written so far.
    size_t tell() const { return written_; }
    /// The file's whole size when known in advance: a failed write then says how many bytes it needs.
    void expect(size_t total) { expected_ = total; }
    /// Flushes, fsyncs, renames onto the destination and fsyncs the folder.
    void commit();

    const std::string & path() const { return path_; }
    const std::string & temp_path() const { return temp_path_; }

private:
    std::string path_;
    std::string temp_path_;
    FILE * file_ = nullptr;
    size_t written_ = 0;
    size_t expected_ = 0;
    bool committed_ = false;

    [[noreturn]] void fail_write(int err) const;
};

/// One job at a time in a work folder: an exclusive flock(2) on `<dir>/.lock`, held as long as this object (and
/// so its process) lives. The kernel drops it when the process ends in any way, SIGKILL included, so a killed job
/// never leaves a stuck lock; the file itself stays and only records the holder's process id. Not inherited by
/// programs the holder starts (close-on-exec): a child does its part under the parent's lock.
class folder_lock {
public:
    /// Creates `dir` when missing and takes the lock at once (never waits). Throws voodoo::error naming the
    /// folder and the process id of the job that holds it, or, naming `flag` (the option that gave the folder, e.g.
    /// "--work"), the OS reason when the folder cannot be made or its lock file cannot be opened.
    explicit folder_lock(const std::string & dir, const std::string & flag = "--work");
    ~folder_lock();
    folder_lock(const folder_lock &) = delete;
    folder_lock & operator=(const folder_lock &) = delete;

private:
    int fd_ = -1;
};

/// Removes the temporaries that atomic_file left in `dir` (with `every_depth`, under it at every depth, links not
/// followed) when its process was killed before commit() (SIGKILL, a power cut): files named `.<name>.<pid>.<n>.tmp`
/// whose process `pid` no longer runs (kill(pid, 0) says ESRCH). A live writer's temporaries are never touched.
/// Returns how many were removed; a missing folder removes none. Called by quantize at its start: the work folder
/// (every depth, under its lock) and the folder of the exported files (itself only).
size_t remove_stale_temporaries(const std::string & dir, bool every_depth = true);

/// Writes a whole text or binary file atomically (atomic_file + commit).
void write_file_atomic(const std::string & path, std::span<const uint8_t> bytes);
void write_file_atomic(const std::string & path, const std::string & text);

}  // namespace voodoo
