#pragma once

namespace voodoo {

/// Bytes in one MiB (2^20), the unit of the file sizes in every report and table.
inline constexpr double k_mib = 1024.0 * 1024.0;

}  // namespace voodoo
