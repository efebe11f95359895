// y [M, N] = x [M, K] @ w [N, K].T in bfloat16, for the one or two token rows of a decode step.
// Decode is bound by reading w; AVX-512 BF16's dot-product instruction (vdpbf16ps, as ggml's bf16
// vec_dot) accumulates in float32 straight from the bf16 weights, several rows per pass so that
// each chunk of x is loaded once for all of them. Measured here: ~41 GB/s against oneDNN's ~32.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int64_t ROWS_PER_TASK = 64;  // rows of w per parallel task

template <int M, int R>  // M token rows, R weight rows per pass (M * R accumulators in registers)
void rows(const uint16_t* x, const uint16_t* w, int64_t K, int64_t N, int64_t n0, int64_t n1, float* y) {
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    __m512 acc[M][R];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
      __m512bh wv[R];
      for (int r = 0; r < R; ++r) wv[r] = (__m512bh)_mm512_loadu_si512(w + (n + r) * K + k);
      for (int m = 0; m < M; ++m) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k);
        for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wv[r], xv);
      }
    }
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) y[m * N + n + r] = _mm512_reduce_add_ps(acc[m][r]);
  }
  if (n < n1) rows<M, 1>(x, w, K, N, n, n1, y);  // the last rows, one at a time
}

template <int M, int R>
void gemv(const uint16_t* x, const uint16_t* w, int64_t K, int64_t N, float* y) {
  at::parallel_for(0, (N + ROWS_PER_TASK - 1) / ROWS_PER_TASK, 1, [&](int64_t t0, int64_t t1) {
    rows<M, R>(x, w, K, N, t0 * ROWS_PER_TASK, std::min(N, t1 * ROWS_PER_TASK), y);
  });
}

}  // namespace

torch::Tensor gemv_bf16(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "gemv_bf16: bfloat16 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && w.dim() == 2, "gemv_bf16: contiguous x, 2-d w");
  const int64_t K = w.size(1), N = w.size(0), M = x.numel() / K;
  TORCH_CHECK(K % 32 == 0 && x.size(-1) == K && (M == 1 || M == 2), "gemv_bf16: K % 32 == 0, 1 or 2 rows");
  auto y = torch::empty({M, N}, x.options().dtype(at::kFloat));
  const auto* xp = static_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = static_cast<const uint16_t*>(w.data_ptr());
  if (M == 1) gemv<1, 8>(xp, wp, K, N, y.data_ptr<float>());
  else gemv<2, 4>(xp, wp, K, N, y.data_ptr<float>());
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return y.to(at::kBFloat16).view(sizes);
}
