// A decode work item's KV heads (paged_decode.cpp): all of a sequence's, or where a step has
// fewer sequences than threads, a range of them, so that every thread has work (a batch-1
// decode on 2 threads left one of them idle through every layer's attention). Each query head's
// result is computed the same way either way: the split changes no bit of the output.
#pragma once

#include "block_prefetch.h"

#include <cstdint>

namespace octavo {

struct KvHeads {
  int64_t begin, end;

  // the prefetcher for these heads' part of a block ([block_size, num_kv_heads, head_dim] K
  // and V): the whole block when they are all the heads, else their slice of every slot
  template <typename T>
  BlockPrefetch prefetch(int64_t block_size, int64_t num_kv_heads, int64_t head_dim,
                         int64_t slices) const {
    const int64_t row_bytes = num_kv_heads * head_dim * static_cast<int64_t>(sizeof(T));
    if (begin == 0 && end == num_kv_heads) return BlockPrefetch(block_size * row_bytes, slices);
    const int64_t head_bytes = head_dim * static_cast<int64_t>(sizeof(T));
    return BlockPrefetch(block_size, row_bytes, begin * head_bytes, (end - begin) * head_bytes,
                         slices);
  }
};

}  // namespace octavo
