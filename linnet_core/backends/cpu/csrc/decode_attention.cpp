// Attention of one-token queries (decode) straight over the KV cache, for CPU sessions.
// The generic path gathers each row's keys and values (two copies), builds a mask and calls SDPA:
// ~0.6 ms a layer at Qwen3-4B's shapes, right after the weights stream has evicted every cache
// line. Here each (row, kv head) task reads its keys and values once, in place, for the G query
// heads that share them; float32 throughout but where SDPA's CPU kernel rounds to 16 bits (the
// softmax numerators that multiply the values), so both round alike. A cache held narrower than
// the queries (float16 beside float32 activations) is widened as it is read, as the generated
// lines' `.to(q.dtype)` widens it.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "vec.h"

#include <cmath>
#include <limits>
#include <vector>

namespace {

using namespace linnet;

// GB query heads (qf [GB, D], scaled) over n keys and values [n, D] in C -> out [GB, D] in T. Each key
// and value is loaded once for the GB heads, whose dot products and weighted sums stay in registers
// (a loop over the heads within each key, accumulating in memory, ran 2.4x slower). softcap > 0: each
// score becomes softcap * tanh(score / softcap) before the softmax (Gemma 2).
template <typename T, typename C, int GB>
void heads(const float* qf, const C* keys, const C* values, int64_t n, int64_t D, float softcap, float* scores,
           T* out) {
  for (int64_t s = 0; s < n; ++s) {  // scores [GB, n]
    const C* key = keys + s * D;
    // the value row into L2 while the scores run: the weighted sums below read the values a column
    // of lines at a time, each line a miss from DRAM otherwise (Zen 2 decode steps: 16-bit 9% faster, float32 3%)
    for (int64_t o = 0; o < D * (int64_t)sizeof(C); o += 64) prefetch_l2((const char*)(values + s * D) + o);
    Vf dot[GB];
    for (int g = 0; g < GB; ++g) dot[g] = zero();
    for (int64_t i = 0; i < D; i += kW) {
      const Vf k = load(key + i);
      for (int g = 0; g < GB; ++g) dot[g] = fma(load(qf + g * D + i), k, dot[g]);
    }
    for (int g = 0; g < GB; ++g) scores[g * n + s] = reduce_add(dot[g]);
  }
  if (softcap > 0.0f)
    for (int64_t i = 0; i < GB * n; ++i) scores[i] = softcap * std::tanh(scores[i] / softcap);
  float total[GB];
  const float lowest = -std::numeric_limits<float>::infinity();
  for (int g = 0; g < GB; ++g) {  // softmax numerators over the n keys, the sum kept apart
    float* row = scores + g * n;
    Vf top = set1(lowest);
    int64_t s = 0;
    for (; s + kW <= n; s += kW) top = max(top, load(row + s));
    float best = reduce_max(top);
    for (; s < n; ++s) best = std::max(best, row[s]);
    const Vf top_v = set1(best);
    Vf sum = zero();
    for (s = 0; s + kW <= n; s += kW) {
      const Vf e = exp(sub(load(row + s), top_v));
      sum = add(sum, e);
      store(row + s, rounded(e, (T*)nullptr));  // SDPA's CPU kernel multiplies values by numerators in T
    }
    if (s < n) {  // the last n % kW through one vector padded with -inf (numerators 0): the same exponential
      float last[kW];
      for (int64_t l = 0; l < kW; ++l) last[l] = s + l < n ? row[s + l] : lowest;
      const Vf e = exp(sub(load(last), top_v));
      sum = add(sum, e);
      store(last, rounded(e, (T*)nullptr));
      for (int64_t l = 0; s + l < n; ++l) row[s + l] = last[l];
    }
    total[g] = reduce_add(sum);
  }
  constexpr int64_t LINE = 2 * kW;  // two vectors of each value row at a time
  for (int64_t i = 0; i < D; i += LINE) {
    const bool pair = i + kW < D;
    Vf lo[GB], hi[GB];
    for (int g = 0; g < GB; ++g) lo[g] = hi[g] = zero();
    for (int64_t s = 0; s < n; ++s) {
      const C* value = values + s * D + i;
      const Vf v0 = load(value), v1 = pair ? load(value + kW) : v0;
      for (int g = 0; g < GB; ++g) {
        const Vf p = set1(scores[g * n + s]);
        lo[g] = fma(p, v0, lo[g]);
        hi[g] = fma(p, v1, hi[g]);
      }
    }
    for (int g = 0; g < GB; ++g) {
      const Vf sum = set1(total[g]);
      store(out + g * D + i, div(lo[g], sum));
      if (pair) store(out + g * D + i + kW, div(hi[g], sum));
    }
  }
}

template <typename T, typename C>
void attend(const T* q, const C* k_cache, const C* v_cache, const int64_t* slots, const int64_t* pos, T* out,
            int64_t B, int64_t H, int64_t KV, int64_t S, int64_t D, int64_t layer, int64_t rows, int64_t window,
            double scale, double softcap) {
  const float cap = static_cast<float>(softcap);
  const int64_t G = H / KV;  // query heads per kv head
  at::parallel_for(0, B * KV, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> qf(G * D), scores;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / KV, h = t % KV, p = pos[b];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0, n = p - lo + 1;
      // [S, D] keys and values of (layer, slot, kv head h), from position lo
      const int64_t base = ((layer * rows + slots[b]) * KV + h) * S * D + lo * D;
      const T* qb = q + (b * H + h * G) * D;  // [G, D]
      for (int64_t i = 0; i < G * D; i += kW)
        store(qf.data() + i, mul(load(qb + i), set1(static_cast<float>(scale))));
      scores.resize(4 * n);
      T* ob = out + (b * H + h * G) * D;
      for (int64_t g = 0; g < G; g += 4) {  // up to four heads at a time (registers: 8 sums a head)
        const float* qg = qf.data() + g * D;
        switch (std::min<int64_t>(4, G - g)) {
          case 1: heads<T, C, 1>(qg, k_cache + base, v_cache + base, n, D, cap, scores.data(), ob + g * D); break;
          case 2: heads<T, C, 2>(qg, k_cache + base, v_cache + base, n, D, cap, scores.data(), ob + g * D); break;
          case 3: heads<T, C, 3>(qg, k_cache + base, v_cache + base, n, D, cap, scores.data(), ob + g * D); break;
          default: heads<T, C, 4>(qg, k_cache + base, v_cache + base, n, D, cap, scores.data(), ob + g * D);
        }
      }
    }
  });
}

}  // namespace

// q [B, H, D]; caches [L, rows, KV, S, D] in q's dtype, or float16 beside float32 q; slots, pos [B]
// -> [B, H, D]: query b (at position pos[b]) over keys 0..pos[b] of cache row slots[b] (the last
// `window` of them when window > 0), the scores soft-capped where softcap > 0.
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                               int64_t layer, const torch::Tensor& slots, const torch::Tensor& pos, int64_t window,
                               double scale, double softcap) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 5 && k_cache.sizes() == v_cache.sizes(), "decode_attention: shapes");
  const bool narrow = q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kHalf;
  TORCH_CHECK((q.scalar_type() == k_cache.scalar_type() || narrow) && k_cache.scalar_type() == v_cache.scalar_type(),
              "decode_attention: one dtype, or a float16 cache beside float32 queries");
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
  if (narrow) {
    attend<float, at::Half>(q.data_ptr<float>(), k_cache.data_ptr<at::Half>(), v_cache.data_ptr<at::Half>(), sp, pp,
                            out.data_ptr<float>(), B, H, KV, S, D, layer, rows, window, scale, softcap);
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "decode_attention: float64 is not supported");
    } else {
      attend<scalar_t, scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                                 sp, pp, out.data_ptr<scalar_t>(), B, H, KV, S, D, layer, rows, window, scale,
                                 softcap);
    }
  });
  return out;
}
