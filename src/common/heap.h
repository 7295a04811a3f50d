#pragma once

namespace voodoo {

/// Keeps the memory LibTorch frees in glibc's heap instead of handing it back to the OS (mallopt(3)): blocks under
/// 32 MiB come from the heap (M_MMAP_THRESHOLD at glibc's 64-bit maximum, DEFAULT_MMAP_THRESHOLD_MAX), the heap's top
/// is trimmed only past 1 GiB free (M_TRIM_THRESHOLD) and grows 64 MiB at a time (M_TOP_PAD). By default glibc maps
/// big blocks afresh at each allocation and unmaps them at free, so every training step page-faulted its activations in
/// again (3.5× slower training on stories260K, docs/BENCHMARKS.md). Blocks of 32 MiB or more are still mapped: the
/// CPU's loss chunk stays under that (default_loss_chunk). Every program that computes with LibTorch on the CPU calls
/// this first (the CLI's main, the test binary, the distributed test worker), so that tests run what users run.
void keep_freed_memory_in_heap();

}  // namespace voodoo
