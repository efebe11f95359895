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

}  // namespace linnet
