// The fuzzer's bytes as a file: the readers take paths (they memory-map them), so each input is written to one
// scratch file per process and read back through the reader exactly as a user's file would be.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

#include <unistd.h>

namespace voodoo::fuzz {

/// A path of this process's own under /tmp: /tmp/voodoo-fuzz-<pid><suffix>.
inline std::string scratch_path(const char * suffix) {
    return "/tmp/voodoo-fuzz-" + std::to_string(getpid()) + suffix;
}

/// Writes the bytes to path, replacing the file.
inline void write_file(const std::string & path, const uint8_t * data, size_t size) {
    FILE * f = std::fopen(path.c_str(), "wb");
    if (f) {
        std::fwrite(data, 1, size, f);
        std::fclose(f);
    }
}

inline std::string as_file(const uint8_t * data, size_t size, const char * suffix) {
    const std::string path = scratch_path(suffix);
    write_file(path, data, size);
    return path;
}

}  // namespace voodoo::fuzz
