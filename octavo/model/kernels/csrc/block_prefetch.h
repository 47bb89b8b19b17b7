// Prefetching a KV block while the one before it is computed (the decode kernels). Blocks sit
// anywhere in the pool, so the hardware prefetcher cannot run ahead across them; software has
// to. How matters: a whole block's prefetches issued at once (2 x block_bytes / 64 of them,
// 384 for a 16-token fp32 block of 3 KV heads x 64) fill the core's miss queues and stall the
// loads of the block being read, which left a decode step of `mixed` reading its K/V at 20 GB/s
// on a Zen 5 core pair. Spread over the block's computation, a slice after each query head's
// scores, the same prefetches keep a steady stream: 31 GB/s there, and bf16 2.4x faster
// (BENCHMARKS.md section 8). They fill L2, not L1 (prefetcht1): on an Intel Xeon with AMX
// that read a step's fp32 K/V 1.06-1.08x faster than into L1 (prefetcht0), bf16
// 1.02-1.05x, at 1 and 2 threads, while the NTA hint halved the speed.
#pragma once

#include <cstdint>

namespace octavo {

class BlockPrefetch {
 public:
  // block_bytes: one block of K (and of V); slices: how many times some() is called per block
  BlockPrefetch(int64_t block_bytes, int64_t slices)
      : lines_((block_bytes + 63) / 64),
        per_slice_((2 * lines_ + slices - 1) / (slices > 0 ? slices : 1)) {}

  // the block to prefetch next: its K and V
  void start(const void* k, const void* v) {
    k_ = static_cast<const char*>(k);
    v_ = static_cast<const char*>(v);
    next_ = 0;
  }

  // the next slice of that block's lines (nothing once it is all requested)
  void some() {
    for (int64_t i = 0; i < per_slice_ && next_ < 2 * lines_; ++i, ++next_)
      __builtin_prefetch(next_ < lines_ ? k_ + 64 * next_ : v_ + 64 * (next_ - lines_), 0, 2);
  }

 private:
  int64_t lines_, per_slice_;
  const char* k_ = nullptr;
  const char* v_ = nullptr;
  int64_t next_ = 1 << 30;  // >= 2 * lines_: nothing pending
};

}  // namespace octavo
