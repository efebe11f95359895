// y [M, N] = x [M, K] @ W.T in float32, W [N, K] held as GGUF blocks (q8_0 or q4_0; quant.py).
// Each block is dequantized in registers to exactly the float32 values quant.dequantize gives (an
// f16 scale times a small integer is exact in float32), so the kernel differs from a float32
// matmul over the dequantized weights only in summation order. Decode (a few token rows) streams
// the blocks once for all rows; larger steps dequantize a panel of rows into a buffer and call
// at::mm, the weights staying compressed in memory either way.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int64_t BLOCK = 32;
constexpr int64_t ROWS_PER_TASK = 32;  // weight rows per parallel task
constexpr int64_t PANEL_ROWS = 256;    // weight rows dequantized per at::mm call in larger steps
constexpr int MAX_GEMV_ROWS = 4;       // token rows the register kernel takes at once

enum Format : int64_t { Q8_0 = 0, Q4_0 = 1 };

inline int64_t block_bytes(int64_t fmt) { return fmt == Q8_0 ? 34 : 18; }

inline float scale_of(const uint8_t* blk) {
  uint16_t h;
  std::memcpy(&h, blk, 2);
  return _cvtsh_ss(h);
}

// One block's 32 weights as two float32 vectors (weights 0..15 and 16..31).
template <int64_t F>
inline void dequant_block(const uint8_t* blk, __m512& lo, __m512& hi) {
  const __m512 d = _mm512_set1_ps(scale_of(blk));
  if constexpr (F == Q8_0) {
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 2))));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 18))));
  } else {  // byte j: weight j in the low nibble, weight j + 16 in the high one; offset 8
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(blk + 2)));
    const __m512i eight = _mm512_set1_epi32(8);
    lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(bytes, _mm512_set1_epi32(0x0F)), eight));
    hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(bytes, 4), eight));
  }
  lo = _mm512_mul_ps(lo, d);
  hi = _mm512_mul_ps(hi, d);
}

// Rows [n0, n1) of y for M token rows, R weight rows per pass (M * R accumulators in registers).
template <int64_t F, int M, int R>
void gemv_rows(const float* x, const uint8_t* w, int64_t K, int64_t N, int64_t n0, int64_t n1, float* y) {
  const int64_t row_bytes = K / BLOCK * block_bytes(F);
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    __m512 acc[M][R];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < K / BLOCK; ++b) {
      __m512 lo[R], hi[R];
      for (int r = 0; r < R; ++r) {
        const uint8_t* blk = w + (n + r) * row_bytes + b * block_bytes(F);
        _mm_prefetch((const char*)(blk + R * row_bytes), _MM_HINT_T0);  // the next group's rows: streams
        dequant_block<F>(blk, lo[r], hi[r]);                             // too short for the prefetcher
      }
      for (int m = 0; m < M; ++m) {
        const __m512 x0 = _mm512_loadu_ps(x + m * K + b * BLOCK), x1 = _mm512_loadu_ps(x + m * K + b * BLOCK + 16);
        for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(hi[r], x1, _mm512_fmadd_ps(lo[r], x0, acc[m][r]));
      }
    }
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) y[m * N + n + r] = _mm512_reduce_add_ps(acc[m][r]);
  }
  if (n < n1) gemv_rows<F, M, 1>(x, w, K, N, n, n1, y);  // the last rows, one at a time
}

template <int64_t F, int M>
void gemv(const float* x, const uint8_t* w, int64_t K, int64_t N, float* y) {
  at::parallel_for(0, (N + ROWS_PER_TASK - 1) / ROWS_PER_TASK, 1, [&](int64_t t0, int64_t t1) {
    gemv_rows<F, M, (M > 2 ? 2 : 4)>(x, w, K, N, t0 * ROWS_PER_TASK, std::min(N, t1 * ROWS_PER_TASK), y);
  });
}

template <int64_t F>
void gemv_any(const float* x, const uint8_t* w, int64_t K, int64_t N, int64_t M, float* y) {
  switch (M) {
    case 1: return gemv<F, 1>(x, w, K, N, y);
    case 2: return gemv<F, 2>(x, w, K, N, y);
    case 3: return gemv<F, 3>(x, w, K, N, y);
    default: return gemv<F, 4>(x, w, K, N, y);
  }
}

// Rows [n0, n1) of W as float32 [n1 - n0, K] into out.
template <int64_t F>
void dequant_rows(const uint8_t* w, int64_t K, int64_t n0, int64_t n1, float* out) {
  const int64_t row_bytes = K / BLOCK * block_bytes(F);
  at::parallel_for(n0, n1, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t n = r0; n < r1; ++n)
      for (int64_t b = 0; b < K / BLOCK; ++b) {
        __m512 lo, hi;
        dequant_block<F>(w + n * row_bytes + b * block_bytes(F), lo, hi);
        _mm512_storeu_ps(out + (n - n0) * K + b * BLOCK, lo);
        _mm512_storeu_ps(out + (n - n0) * K + b * BLOCK + 16, hi);
      }
  });
}

template <int64_t F>
void panels(const torch::Tensor& x, const uint8_t* w, int64_t K, int64_t N, torch::Tensor& y) {
  auto panel = torch::empty({std::min(PANEL_ROWS, N), K}, x.options());
  for (int64_t n0 = 0; n0 < N; n0 += PANEL_ROWS) {
    const int64_t rows = std::min(PANEL_ROWS, N - n0);
    dequant_rows<F>(w, K, n0, n0 + rows, panel.data_ptr<float>());
    y.narrow(1, n0, rows).copy_(at::mm(x, panel.narrow(0, 0, rows).t()));
  }
}

}  // namespace

torch::Tensor quant_linear(const torch::Tensor& x, const torch::Tensor& w, int64_t fmt) {
  TORCH_CHECK(fmt == Q8_0 || fmt == Q4_0, "quant_linear: format 0 (q8_0) or 1 (q4_0)");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kByte && w.dim() == 2,
              "quant_linear: float32 x, uint8 blocks w [N, K / 32 * block bytes]");
  TORCH_CHECK(w.is_contiguous() && w.size(1) % block_bytes(fmt) == 0, "quant_linear: contiguous whole blocks");
  const int64_t N = w.size(0), K = w.size(1) / block_bytes(fmt) * BLOCK;
  TORCH_CHECK(x.size(-1) == K, "quant_linear: x has ", x.size(-1), " features, the weight ", K);
  const auto x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  auto y = torch::empty({M, N}, x.options());
  const auto* wp = w.data_ptr<uint8_t>();
  if (M <= 2 * MAX_GEMV_ROWS) {  // decode: the blocks streamed once per group of token rows
    for (int64_t m0 = 0; m0 < M; m0 += MAX_GEMV_ROWS) {
      const int64_t rows = std::min<int64_t>(MAX_GEMV_ROWS, M - m0);
      const float* xp = x2.data_ptr<float>() + m0 * K;
      float* yp = y.data_ptr<float>() + m0 * N;
      if (fmt == Q8_0) gemv_any<Q8_0>(xp, wp, K, N, rows, yp);
      else gemv_any<Q4_0>(xp, wp, K, N, rows, yp);
    }
  } else if (fmt == Q8_0) {
    panels<Q8_0>(x2, wp, K, N, y);
  } else {
    panels<Q4_0>(x2, wp, K, N, y);
  }
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return y.view(sizes);
}
