#include "pipeline/stages.h"

#include "common/error.h"
#include "common/file.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <fstream>
#include <sys/stat.h>

namespace voodoo {

std::string file_digest(const std::string & path) {
    const mapped_file map(path);
    XXH3_state_t * state = XXH3_createState();
    XXH3_64bits_reset(state);
    // In slices, so that a large file is paged in and out as it is read.
    constexpr size_t slice = size_t{64} << 20;
    const auto bytes = map.bytes();
    for (size_t at = 0; at < bytes.size(); at += slice) {
        XXH3_64bits_update(state, bytes.data() + at, std::min(slice, bytes.size() - at));
    }
    const uint64_t h = XXH3_64bits_digest(state);
    XXH3_freeState(state);
    return fmt::format("{:016x}", h);
}

std::string stage_digest(const nlohmann::json & inputs) {
    const std::string s = inputs.dump();
    return fmt::format("{:016x}", XXH3_64bits(s.data(), s.size()));
}

std::string model_digest(const std::string & model_path, const std::string & cache_path) {
    struct stat st {};
    if (::stat(model_path.c_str(), &st) != 0) {
        fail("cannot open '{}': {}", model_path, std::strerror(errno));
    }
    const nlohmann::json seen = {{"size", static_cast<int64_t>(st.st_size)},
                                 {"mtime_ns", static_cast<int64_t>(st.st_mtim.tv_sec) * 1'000'000'000 + st.st_mtim.tv_nsec},
                                 {"inode", static_cast<int64_t>(st.st_ino)}};
    std::ifstream in(cache_path);
    if (in) {
        const nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
        if (j.is_object() && j.value("path", "") == model_path && j.value("seen", nlohmann::json()) == seen &&
            j.contains("digest") && j["digest"].is_string()) {
            return j["digest"].get<std::string>();
        }
    }
    const std::string digest = file_digest(model_path);
    write_file_atomic(cache_path, nlohmann::json{{"path", model_path}, {"seen", seen}, {"digest", digest}}.dump(2) + "\n");
    return digest;
}

std::string stage_changes(const std::string & record_path, const nlohmann::json & inputs) {
    std::ifstream in(record_path);
    if (!in) {
        return "no record of what made it";
    }
    const nlohmann::json before = nlohmann::json::parse(in, nullptr, false);
    if (!before.is_object()) {
        return "no record of what made it";
    }
    std::string changes;
    auto show = [](const nlohmann::json & v) {
        if (v.is_null()) {
            return std::string("(none)");
        }
        std::string s = v.is_string() ? v.get<std::string>() : v.dump();
        return s.size() > 60 ? s.substr(0, 57) + "..." : s;
    };
    for (const auto & [key, value] : inputs.items()) {
        const nlohmann::json old = before.contains(key) ? before[key] : nlohmann::json();
        if (old != value) {
            changes += fmt::format("{}{} {} → {}", changes.empty() ? "" : ", ", key, show(old), show(value));
        }
    }
    for (const auto & [key, value] : before.items()) {
        if (!inputs.contains(key)) {
            changes += fmt::format("{}{} {} → (none)", changes.empty() ? "" : ", ", key, show(value));
        }
    }
    return changes;
}

void stage_save(const std::string & record_path, const nlohmann::json & inputs) {
    write_file_atomic(record_path, inputs.dump(2) + "\n");
}

}  // namespace voodoo
