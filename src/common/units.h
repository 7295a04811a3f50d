#pragma once

#include <fmt/format.h>

#include <string>

namespace voodoo {

/// Bytes in one MiB (2^20), the unit of the file sizes in every report and table.
inline constexpr double k_mib = 1024.0 * 1024.0;

/// Bytes for a person: "1.25 GiB", "3.40 MiB", "0.5 KiB" (binary units, as `ls -h` and our tables print them).
inline std::string bytes_text(double b) {
    if (b >= 1024.0 * k_mib) {
        return fmt::format("{:.2f} GiB", b / (1024.0 * k_mib));
    }
    if (b >= k_mib) {
        return fmt::format("{:.2f} MiB", b / k_mib);
    }
    return fmt::format("{:.1f} KiB", b / 1024.0);
}

}  // namespace voodoo
