// Work split between threads as they come free, as ggml's matmul takes its chunks: on a shared
// machine one core often runs slower than the other for minutes, and an even split (at::parallel_for's)
// then waits for it at every linear. A decode GEMV's rows taken this way streamed 2-11% faster on a
// Zen 3. Which thread computes a row changes nothing in it.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace linnet {

// f(begin, end) over [0, n) in chunks of `chunk` (the last shorter), each chunk once, in any order.
template <class F>
void dynamic_for(int64_t n, int64_t chunk, const F& f) {
  if (n <= 0) return;
  const int64_t chunks = (n + chunk - 1) / chunk;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), chunks), 1, [&](int64_t, int64_t) {
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;)
      f(c * chunk, std::min(n, (c + 1) * chunk));
  });
}

// As dynamic_for, but each take is a share of what is left (1 / (2 threads), at least `min_chunk`;
// OpenMP's "guided"), so a thread's weights are a few long streams that the hardware prefetcher
// follows, and the last takes are still small enough to even out a slow core. For decode, which
// streams every weight once: q4_0's groups of 8 rows taken 4 at a time (18 KiB at K = 1024) streamed
// 26 GB/s on a Zen 5, 52 GB/s taken this way.
template <class F>
void streaming_for(int64_t n, int64_t min_chunk, const F& f) {
  if (n <= 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (n + min_chunk - 1) / min_chunk);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    int64_t begin = next.load(std::memory_order_relaxed);
    while (begin < n) {
      const int64_t end = std::min(n, begin + std::max(min_chunk, (n - begin) / (2 * threads)));
      if (next.compare_exchange_weak(begin, end, std::memory_order_relaxed)) {  // else begin is reloaded
        f(begin, end);
        begin = next.load(std::memory_order_relaxed);
      }
    }
  });
}

}  // namespace linnet
