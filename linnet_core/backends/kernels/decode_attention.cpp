// Attention of one-token queries (decode) straight over the KV cache, for CPU sessions.
// The generic path gathers each row's keys and values (two copies), builds a mask and calls SDPA:
// ~0.6 ms a layer at Qwen3-4B's shapes, right after the weights stream has evicted every cache
// line. Here each (row, kv head) task reads its keys and values once, in place, for the G query
// heads that share them; float32 throughout but where SDPA's CPU kernel rounds to 16 bits (the
// softmax numerators that multiply the values), so both round alike.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

// 16 elements as float32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(at::BFloat16* p, __m512 v) {  // round to nearest even, as .to(bfloat16)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}
inline void store16(at::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

// x as T holds it (what a 16-bit GEMM input sees), back in float32.
template <typename T>
inline float rounded(float x) { return static_cast<float>(static_cast<T>(x)); }

template <typename T>
void attend(const T* q, const T* k_cache, const T* v_cache, const int64_t* slots, const int64_t* pos, T* out,
            int64_t B, int64_t H, int64_t KV, int64_t S, int64_t D, int64_t layer, int64_t rows, int64_t window,
            double scale) {
  const int64_t G = H / KV;  // query heads per kv head
  at::parallel_for(0, B * KV, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> qf(G * D), acc(G * D), total(G), scores;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / KV, h = t % KV, p = pos[b];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0, n = p - lo + 1;
      // [S, D] keys and values of (layer, slot, kv head h)
      const int64_t base = ((layer * rows + slots[b]) * KV + h) * S * D;
      const T* keys = k_cache + base;
      const T* values = v_cache + base;
      const T* qb = q + (b * H + h * G) * D;  // [G, D]
      for (int64_t i = 0; i < G * D; i += 16)
        store16(qf.data() + i, _mm512_mul_ps(load16(qb + i), _mm512_set1_ps(static_cast<float>(scale))));
      scores.assign(G * n, 0.f);  // [G, n]
      for (int64_t s = 0; s < n; ++s) {
        const T* key = keys + (lo + s) * D;
        for (int64_t g = 0; g < G; ++g) {
          __m512 dot = _mm512_setzero_ps();
          for (int64_t i = 0; i < D; i += 16) dot = _mm512_fmadd_ps(load16(qf.data() + g * D + i), load16(key + i), dot);
          scores[g * n + s] = _mm512_reduce_add_ps(dot);
        }
      }
      std::fill(total.begin(), total.end(), 0.f);
      for (int64_t g = 0; g < G; ++g) {  // softmax numerators over the n keys, the sum kept apart
        float* row = scores.data() + g * n;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t s = 0; s < n; ++s) top = std::max(top, row[s]);
        for (int64_t s = 0; s < n; ++s) {
          const float e = std::exp(row[s] - top);
          total[g] += e;
          row[s] = rounded<T>(e);  // SDPA's CPU kernel multiplies values by numerators in T
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t s = 0; s < n; ++s) {
        const T* value = values + (lo + s) * D;
        for (int64_t i = 0; i < D; i += 16) {
          const __m512 v = load16(value + i);
          for (int64_t g = 0; g < G; ++g) {
            float* a = acc.data() + g * D + i;
            _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(scores[g * n + s]), v, _mm512_loadu_ps(a)));
          }
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t i = 0; i < D; i += 16) {
          float* a = acc.data() + g * D + i;
          _mm512_storeu_ps(a, _mm512_div_ps(_mm512_loadu_ps(a), _mm512_set1_ps(total[g])));
        }
      T* ob = out + (b * H + h * G) * D;
      for (int64_t i = 0; i < G * D; i += 16) store16(ob + i, load16(acc.data() + i));
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
