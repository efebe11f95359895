// Attention of one-token queries (decode) straight over the KV cache, for CPU sessions.
// The generic path gathers each row's keys and values (two copies), builds a mask and calls SDPA:
// ~0.6 ms a layer at Qwen3-4B's shapes, right after the weights stream has evicted every cache
// line. Here each (row, kv head) task reads its keys and values once, in place, for the G query
// heads that share them; float32 throughout but where SDPA's CPU kernel rounds to 16 bits (the
// softmax numerators that multiply the values), so both round alike.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "simd.h"

#include <limits>
#include <vector>

namespace {

using linnet::exp16;
using linnet::load16;
using linnet::rounded;
using linnet::store16;
using linnet::tail;

// GB query heads (qf [GB, D], scaled) over n keys and values [n, D] -> out [GB, D] in T. Each key
// and value is loaded once for the GB heads, whose dot products and weighted sums stay in registers
// (a loop over the heads within each key, accumulating in memory, ran 2.4x slower).
template <typename T, int GB>
void heads(const float* qf, const T* keys, const T* values, int64_t n, int64_t D, float* scores, T* out) {
  for (int64_t s = 0; s < n; ++s) {  // scores [GB, n]
    const T* key = keys + s * D;
    __m512 dot[GB];
    for (int g = 0; g < GB; ++g) dot[g] = _mm512_setzero_ps();
    for (int64_t i = 0; i < D; i += 16) {
      const __m512 k = load16(key + i);
      for (int g = 0; g < GB; ++g) dot[g] = _mm512_fmadd_ps(load16(qf + g * D + i), k, dot[g]);
    }
    for (int g = 0; g < GB; ++g) scores[g * n + s] = _mm512_reduce_add_ps(dot[g]);
  }
  float total[GB];
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int g = 0; g < GB; ++g) {  // softmax numerators over the n keys, the sum kept apart
    float* row = scores + g * n;
    __m512 top = lowest;
    for (int64_t s = 0; s < n; s += 16) top = _mm512_max_ps(top, _mm512_mask_loadu_ps(lowest, tail(n - s), row + s));
    const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t s = 0; s < n; s += 16) {
      const __mmask16 m = tail(n - s);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + s), max));
      sum = _mm512_mask_add_ps(sum, m, sum, e);
      _mm512_mask_storeu_ps(row + s, m, rounded(e, (T*)nullptr));  // SDPA's CPU kernel multiplies values by numerators in T
    }
    total[g] = _mm512_reduce_add_ps(sum);
  }
  for (int64_t i = 0; i < D; i += 32) {  // a cache line of each value row at a time: two vectors a head
    const bool pair = i + 16 < D;
    __m512 lo[GB], hi[GB];
    for (int g = 0; g < GB; ++g) lo[g] = hi[g] = _mm512_setzero_ps();
    for (int64_t s = 0; s < n; ++s) {
      const T* value = values + s * D + i;
      const __m512 v0 = load16(value), v1 = pair ? load16(value + 16) : v0;
      for (int g = 0; g < GB; ++g) {
        const __m512 p = _mm512_set1_ps(scores[g * n + s]);
        lo[g] = _mm512_fmadd_ps(p, v0, lo[g]);
        hi[g] = _mm512_fmadd_ps(p, v1, hi[g]);
      }
    }
    for (int g = 0; g < GB; ++g) {
      const __m512 sum = _mm512_set1_ps(total[g]);
      store16(out + g * D + i, _mm512_div_ps(lo[g], sum));
      if (pair) store16(out + g * D + i + 16, _mm512_div_ps(hi[g], sum));
    }
  }
}

template <typename T>
void attend(const T* q, const T* k_cache, const T* v_cache, const int64_t* slots, const int64_t* pos, T* out,
            int64_t B, int64_t H, int64_t KV, int64_t S, int64_t D, int64_t layer, int64_t rows, int64_t window,
            double scale) {
  const int64_t G = H / KV;  // query heads per kv head
  at::parallel_for(0, B * KV, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> qf(G * D), scores;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / KV, h = t % KV, p = pos[b];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0, n = p - lo + 1;
      // [S, D] keys and values of (layer, slot, kv head h), from position lo
      const int64_t base = ((layer * rows + slots[b]) * KV + h) * S * D + lo * D;
      const T* qb = q + (b * H + h * G) * D;  // [G, D]
      for (int64_t i = 0; i < G * D; i += 16)
        store16(qf.data() + i, _mm512_mul_ps(load16(qb + i), _mm512_set1_ps(static_cast<float>(scale))));
      scores.resize(4 * n);
      T* ob = out + (b * H + h * G) * D;
      for (int64_t g = 0; g < G; g += 4) {  // up to four heads at a time (registers: 8 sums a head)
        const float* qg = qf.data() + g * D;
        switch (std::min<int64_t>(4, G - g)) {
          case 1: heads<T, 1>(qg, k_cache + base, v_cache + base, n, D, scores.data(), ob + g * D); break;
          case 2: heads<T, 2>(qg, k_cache + base, v_cache + base, n, D, scores.data(), ob + g * D); break;
          case 3: heads<T, 3>(qg, k_cache + base, v_cache + base, n, D, scores.data(), ob + g * D); break;
          default: heads<T, 4>(qg, k_cache + base, v_cache + base, n, D, scores.data(), ob + g * D);
        }
      }
    }
  });
}

}  // namespace

// q [B, H, D]; caches [L, rows, KV, S, D]; slots, pos [B] -> [B, H, D]: query b (at position pos[b])
// over keys 0..pos[b] of cache row slots[b] (the last `window` of them when window > 0).
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                               int64_t layer, const torch::Tensor& slots, const torch::Tensor& pos, int64_t window,
                               double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 5 && k_cache.sizes() == v_cache.sizes(), "decode_attention: shapes");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "decode_attention: one dtype");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "decode_attention: contiguous");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t L = k_cache.size(0), rows = k_cache.size(1), KV = k_cache.size(2), S = k_cache.size(3);
  TORCH_CHECK(k_cache.size(4) == D && D % 16 == 0 && H % KV == 0 && 0 <= layer && layer < L,
              "decode_attention: head size a multiple of 16, heads a multiple of kv heads");
  auto slots_c = slots.to(at::kLong).contiguous(), pos_c = pos.to(at::kLong).contiguous();
  TORCH_CHECK(slots_c.numel() == B && pos_c.numel() == B, "decode_attention: one slot and position per row");
  const int64_t* sp = slots_c.data_ptr<int64_t>();
  const int64_t* pp = pos_c.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(0 <= sp[b] && sp[b] < rows && 0 <= pp[b] && pp[b] < S, "decode_attention: slot or position out of range");
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "decode_attention: float64 is not supported");
    } else {
      attend<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), sp, pp,
                       out.data_ptr<scalar_t>(), B, H, KV, S, D, layer, rows, window, scale);
    }
  });
  return out;
}
