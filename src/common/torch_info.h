// What the linked LibTorch is and can use; kept in one translation unit so that only it pays for
// LibTorch's headers.
#pragma once

#include <string>
#include <vector>

namespace voodoo {

/// LibTorch's version ("1.13.0", "2.11.0").
std::string torch_version();

/// "cuda:N name, X GiB" for every CUDA device LibTorch sees; empty on a CPU build or machine.
std::vector<std::string> torch_cuda_devices();

/// The BLAS library LibTorch's CPU matmul actually runs on: the shared objects named *blas* mapped
/// into this process after one matmul (their real paths, so Debian's alternatives are resolved).
std::vector<std::string> torch_blas_libraries();

/// LibTorch's intra-op thread count.
int torch_threads();

}  // namespace voodoo

namespace voodoo {

/// Sets LibTorch's intra-op thread count to n, or to the number of cores when n ≤ 0 (Debian's
/// LibTorch 1.13 starts with 1 thread). Returns the count set.
int set_torch_threads(int n);

}  // namespace voodoo
