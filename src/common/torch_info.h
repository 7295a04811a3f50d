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

/// LibTorch's intra-op threads for a `--threads n` flag: n when positive; else OMP_NUM_THREADS when it is set to a
/// positive number (LibTorch's own rule, which set_num_threads would otherwise override: torchrun sets it to 1 for
/// each of several ranks on one host, and ctest's runs of the tests set it to 1, so that processes sharing the cores
/// do not each start a thread per core: OpenMP's threads then wait on each other, 3-7× slower, docs/BENCHMARKS.md);
/// else resolve_threads(0), the cores this process may run on.
int torch_thread_count(int n);

/// Sets LibTorch's intra-op thread count to torch_thread_count(n) (Debian's LibTorch 1.13 starts with 1 thread).
/// Returns the count set.
int set_torch_threads(int n);

}  // namespace voodoo
