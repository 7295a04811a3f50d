// The test binary's main: the CLI's allocator settings first (keep_freed_memory_in_heap), so that the tests that run
// the pipeline in this process allocate as `voodoo` does; then GoogleTest.
#include "common/heap.h"

#include <gtest/gtest.h>

int main(int argc, char ** argv) {
    voodoo::keep_freed_memory_in_heap();
    testing::InitGoogleTest(&argc, argv);
    return RUN_ALL_TESTS();
}
