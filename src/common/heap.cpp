#include "common/heap.h"

#include <malloc.h>

namespace voodoo {

void keep_freed_memory_in_heap() {
    mallopt(M_MMAP_THRESHOLD, 32 << 20);
    mallopt(M_TRIM_THRESHOLD, 1 << 30);
    mallopt(M_TOP_PAD, 64 << 20);
}

}  // namespace voodoo
