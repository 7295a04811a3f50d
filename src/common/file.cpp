#include "common/file.h"

#include "common/error.h"

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string_view>
#include <vector>

#include <fcntl.h>
#include <signal.h>
#include <ftw.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

namespace voodoo {

size_t file_size(const std::string & path) {
    struct stat st {};
    if (stat(path.c_str(), &st) != 0) {
        fail("cannot open '{}': {}", path, std::strerror(errno));
    }
    if (!S_ISREG(st.st_mode)) {
        fail("'{}' is not a regular file", path);
    }
    return static_cast<size_t>(st.st_size);
}

bool remove_tree(const std::string & path) noexcept {
    struct stat st {};
    if (lstat(path.c_str(), &st) != 0) {
        return errno == ENOENT;
    }
    // Depth first (FTW_DEPTH: a folder after its contents), never following links (FTW_PHYS).
    static thread_local bool ok;
    ok = true;
    const int rc = nftw(path.c_str(), [](const char * p, const struct stat *, int, struct FTW *) {
        if (::remove(p) != 0 && errno != ENOENT) {
            ok = false;
        }
        return 0;
    }, 16, FTW_DEPTH | FTW_PHYS);
    return rc == 0 && ok;
}

int64_t tree_disk_bytes(const std::string & path) noexcept {
    struct stat st {};
    if (lstat(path.c_str(), &st) != 0) {
        return 0;
    }
    static thread_local int64_t sum;
    sum = 0;
    nftw(path.c_str(), [](const char *, const struct stat * s, int, struct FTW *) {
        sum += static_cast<int64_t>(s->st_blocks) * 512;
        return 0;
    }, 16, FTW_PHYS);
    return sum;
}

int64_t free_disk_bytes(const std::string & path) noexcept {
    std::string p = path.empty() ? std::string(".") : path;
    for (int up = 0; up < 256; ++up) {
        struct statvfs v {};
        if (statvfs(p.c_str(), &v) == 0) {
            return static_cast<int64_t>(v.f_bavail) * static_cast<int64_t>(v.f_frsize);
        }
        if (errno != ENOENT && errno != ENOTDIR) {
            return -1;
        }
        const size_t cut = p.find_last_of('/', p.size() > 1 && p.back() == '/' ? p.size() - 2 : std::string::npos);
        p = cut == std::string::npos ? std::string(".") : cut == 0 ? std::string("/") : p.substr(0, cut);
    }
    return -1;
}

bool same_file(const std::string & a, const std::string & b) {
    struct stat sa {}, sb {};
    if (stat(a.c_str(), &sa) != 0 || stat(b.c_str(), &sb) != 0) {
        return false;
    }
    return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

mapped_file::mapped_file(const std::string & path) {
    size_ = file_size(path);
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        fail("cannot open '{}': {}", path, std::strerror(errno));
    }
    if (size_ > 0) {
        void * p = mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
        if (p == MAP_FAILED) {
            const int e = errno;
            close(fd);
            fail("cannot map '{}' ({} bytes): {}", path, size_, std::strerror(e));
        }
        data_ = static_cast<const uint8_t *>(p);
    }
    close(fd);
}

mapped_file::~mapped_file() {
    if (data_) {
        munmap(const_cast<uint8_t *>(data_), size_);
    }
}

atomic_file::atomic_file(std::string path) : path_(std::move(path)) {
    namespace fs = std::filesystem;
    const fs::path dest(path_);
    if (dest.filename().empty()) {
        fail("output path '{}' names a folder, not a file", path_);
    }
    const fs::path dir = dest.has_parent_path() ? dest.parent_path() : fs::path(".");
    std::error_code ec;
    if (!fs::is_directory(dir, ec)) {
        fail("cannot write '{}': folder '{}' does not exist", path_, dir.string());
    }
    // pid and a per-process counter: two writers of the same destination (threads storing one cache
    // entry) never share a temporary; the last rename wins with identical content.
    static std::atomic<uint64_t> counter{0};
    temp_path_ = (dir / fmt::format(".{}.{}.{}.tmp", dest.filename().string(), getpid(), counter++)).string();
    file_ = std::fopen(temp_path_.c_str(), "wb");
    if (!file_) {
        fail("cannot write '{}': {}", temp_path_, std::strerror(errno));
    }
}

namespace {

// The process id in an atomic_file temporary's name `.<name>.<pid>.<n>.tmp`, or -1 for any other name.
pid_t temporary_writer(std::string_view name) {
    if (name.size() < 8 || name.front() != '.' || !name.ends_with(".tmp")) {
        return -1;
    }
    name.remove_suffix(4);
    auto last_number = [&name]() -> int64_t {
        const size_t dot = name.rfind('.');
        if (dot == std::string_view::npos || dot + 1 == name.size() || dot == 0) {
            return -1;
        }
        int64_t v = 0;
        for (char c : name.substr(dot + 1)) {
            if (c < '0' || c > '9' || v > (int64_t{1} << 40)) {
                return -1;
            }
            v = v * 10 + (c - '0');
        }
        name = name.substr(0, dot);
        return v;
    };
    if (last_number() < 0) {
        return -1;
    }
    const int64_t pid = last_number();
    return pid > 0 && pid <= std::numeric_limits<pid_t>::max() && name.size() > 1 ? static_cast<pid_t>(pid) : -1;
}

}  // namespace

size_t remove_stale_temporaries(const std::string & dir, bool every_depth) {
    static thread_local std::vector<std::string> stale;   // nftw's callback has no user pointer
    static thread_local bool deep;
    stale.clear();
    deep = every_depth;
    nftw(dir.c_str(), [](const char * path, const struct stat *, int flag, struct FTW * ftw) -> int {
        if (!deep && flag == FTW_D && ftw->level > 0) {
            return FTW_SKIP_SUBTREE;
        }
        if (flag == FTW_F) {
            const pid_t pid = temporary_writer(path + ftw->base);
            if (pid > 0 && kill(pid, 0) != 0 && errno == ESRCH) {
                stale.emplace_back(path);
            }
        }
        return FTW_CONTINUE;
    }, 16, FTW_PHYS | FTW_ACTIONRETVAL);
    size_t n = 0;
    for (const std::string & p : stale) {
        n += std::remove(p.c_str()) == 0;
    }
    stale.clear();
    return n;
}

atomic_file::~atomic_file() {
    if (file_) {
        std::fclose(file_);
    }
    if (!committed_) {
        std::remove(temp_path_.c_str());
    }
}

void atomic_file::write(const void * data, size_t n) {
    if (n == 0) {
        return;
    }
    if (std::fwrite(data, 1, n, file_) != n) {
        fail_write(errno);
    }
    written_ += n;
}

void atomic_file::fail_write(int err) const {
    const std::string needed =
        expected_ > 0 ? fmt::format(" of the {} bytes it needs ({:.1f} MiB)", expected_, static_cast<double>(expected_) / 1048576.0)
                      : std::string();
    fail("writing '{}' failed after {} bytes{}: {}; nothing was written to the destination (free the space and run "
         "the same command again: what was finished is kept)",
         path_, written_, needed, std::strerror(err));
}

void atomic_file::write_zeros(size_t n) {
    static const uint8_t zeros[256] = {};
    while (n > 0) {
        const size_t k = std::min(n, sizeof(zeros));
        write(zeros, k);
        n -= k;
    }
}

void atomic_file::commit() {
    if (std::fflush(file_) != 0 || fsync(fileno(file_)) != 0) {
        fail_write(errno);
    }
    std::fclose(file_);
    file_ = nullptr;
    if (std::rename(temp_path_.c_str(), path_.c_str()) != 0) {
        fail("cannot rename '{}' to '{}': {}", temp_path_, path_, std::strerror(errno));
    }
    committed_ = true;
    const std::filesystem::path dest(path_);
    const std::string dir = dest.has_parent_path() ? dest.parent_path().string() : ".";
    const int fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) {
        fsync(fd);
        close(fd);
    }
}

void write_file_atomic(const std::string & path, std::span<const uint8_t> bytes) {
    atomic_file f(path);
    f.expect(bytes.size());
    f.write(bytes);
    f.commit();
}

void write_file_atomic(const std::string & path, const std::string & text) {
    write_file_atomic(path, std::span<const uint8_t>(reinterpret_cast<const uint8_t *>(text.data()), text.size()));
}

int cannot_create_files_in(const std::string & dir) noexcept {
    std::string name = (std::filesystem::path(dir) / ".voodoo-write-check-XXXXXX").string();
    const int fd = ::mkstemp(name.data());
    if (fd < 0) {
        return errno;
    }
    ::close(fd);
    ::unlink(name.c_str());
    return 0;
}

folder_lock::folder_lock(const std::string & dir, const std::string & flag) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) {
        fail("cannot make the work folder '{}' ({}): {}; give {} a folder this user can create and write in", dir, flag,
             ec.message(), flag);
    }
    const std::string path = (std::filesystem::path(dir) / ".lock").string();
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd_ < 0) {
        const int err = errno;
        fail("cannot write in the work folder '{}' ({}): its lock file '{}': {}; give {} a folder this user can write in",
             dir, flag, path, std::strerror(err), flag);
    }
    if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
        const int err = errno;
        char buf[32] = {};
        const ssize_t n = ::pread(fd_, buf, sizeof buf - 1, 0);
        ::close(fd_);
        fd_ = -1;
        if (err == EWOULDBLOCK) {
            const std::string pid = n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string("unknown");
            fail("the work folder '{}' is in use by another voodoo job (pid {}); wait for it to end, or give this "
                 "one another --work folder",
                 dir, pid.substr(0, pid.find_first_of("\n ")));
        }
        fail("cannot lock '{}': {}", path, std::strerror(err));
    }
    const std::string pid = std::to_string(::getpid()) + "\n";
    if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
        const int err = errno;
        ::close(fd_);
        fd_ = -1;
        fail("cannot write the lock file '{}': {}", path, std::strerror(err));
    }
}

folder_lock::~folder_lock() {
    if (fd_ >= 0) {
        ::close(fd_);  // releases the flock
    }
}

}  // namespace voodoo
