// y [M, N] = x [M, K] @ w [N, K].T for 16-bit w, for the one or two token rows of a decode step.
// Decode is bound by reading w. One weight row at a time, as ggml does: each thread's rows are then
// one contiguous stream, which the hardware prefetcher follows to a plain read's speed (8 rows at
// once, 8 streams a row apart, streamed ~20% slower here). Two accumulators per token row keep two
// dot products in flight. bfloat16: AVX-512 BF16's vdpbf16ps (ggml's bf16 vec_dot) straight from
// the bf16 weights. float16: weights and x widened by vcvtph2ps and multiplied into float32 (this
// CPU has no float16 dot product; ggml's f16 vec_dot does the same). Widening x once per call
// instead, into a float32 copy, left a decode step's float16 linears 12% slower than bfloat16's.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstring>

namespace {

constexpr int64_t ROWS_PER_TASK = 64;  // rows of w per parallel task

struct Bf16 {  // x: bf16 [M, K]; 32 weights per step
  using X = uint16_t;
  static constexpr int64_t STEP = 32;
  static __m512 dot(__m512 acc, const uint16_t* w, const uint16_t* x) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(w), (__m512bh)_mm512_loadu_si512(x));
  }
  static uint16_t round(float v) { return c10::BFloat16(v).x; }  // to nearest even, as .to(bfloat16)
};

struct F16 {  // x: float16 [M, K]; 16 weights per step, both widened in registers (ggml's vec_dot_f16)
  using X = uint16_t;
  static constexpr int64_t STEP = 16;
  static __m512 dot(__m512 acc, const uint16_t* w, const uint16_t* x) {
    return _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)w)),
                           _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)x)), acc);
  }
  static uint16_t round(float v) { return _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
};

template <class T, int M>
void rows(const typename T::X* x, const uint16_t* w, int64_t K, int64_t N, int64_t n0, int64_t n1, uint16_t* y) {
  constexpr int64_t S = T::STEP;
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* wr = w + n * K;
    __m512 acc[M][2];
    for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 2 * S <= K; k += 2 * S)
      for (int m = 0; m < M; ++m) {
        acc[m][0] = T::dot(acc[m][0], wr + k, x + m * K + k);
        acc[m][1] = T::dot(acc[m][1], wr + k + S, x + m * K + k + S);
      }
    if (k < K)  // K % (2 * S) == S
      for (int m = 0; m < M; ++m) acc[m][0] = T::dot(acc[m][0], wr + k, x + m * K + k);
    for (int m = 0; m < M; ++m) y[m * N + n] = T::round(_mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1])));
  }
}

template <class T, int M>
void gemv(const typename T::X* x, const uint16_t* w, int64_t K, int64_t N, uint16_t* y) {
  at::parallel_for(0, (N + ROWS_PER_TASK - 1) / ROWS_PER_TASK, 1, [&](int64_t t0, int64_t t1) {
    rows<T, M>(x, w, K, N, t0 * ROWS_PER_TASK, std::min(N, t1 * ROWS_PER_TASK), y);
  });
}

// The product for x [..., K] of one or two rows in w's dtype, computed in float32 and rounded once
// (written in that dtype here: a separate .to() cost ~6 us a call, 33 calls a 191M step).
template <class T>
torch::Tensor run(const torch::Tensor& x, const torch::Tensor& w, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(x.scalar_type() == dtype && w.scalar_type() == dtype, name, ": ", dtype, " x and w");
  TORCH_CHECK(w.is_contiguous() && w.dim() == 2, name, ": contiguous 2-d w");
  const int64_t K = w.size(1), N = w.size(0), M = x.numel() / K;
  TORCH_CHECK(K % T::STEP == 0 && x.size(-1) == K && (M == 1 || M == 2), name, ": K % ", T::STEP,
              " == 0, 1 or 2 rows");
  const auto xs = x.reshape({M, K}).contiguous();
  auto y = torch::empty({M, N}, x.options());
  const auto* xp = static_cast<const typename T::X*>(xs.data_ptr());
  const auto* wp = static_cast<const uint16_t*>(w.data_ptr());
  auto* yp = static_cast<uint16_t*>(y.data_ptr());
  if (M == 1) gemv<T, 1>(xp, wp, K, N, yp);
  else gemv<T, 2>(xp, wp, K, N, yp);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return y.view(sizes);
}

}  // namespace

torch::Tensor gemv_bf16(const torch::Tensor& x, const torch::Tensor& w) {
  return run<Bf16>(x, w, at::kBFloat16, "gemv_bf16");
}

torch::Tensor gemv_f16(const torch::Tensor& x, const torch::Tensor& w) {
  return run<F16>(x, w, at::kHalf, "gemv_f16");
}

// y [M, N] = x [M, K] @ w [N, K].T for float16 w and many token rows (prompts), as llama.cpp's
// tinyBLAS does: register tiles of RM token rows x RN weight rows, the weights widened in registers
// (vcvtph2ps) and multiplied into float32, so no widened copy of w is ever written. Threads take
// blocks of weight rows (each streams its own part of w once); within a block every token row's
// tile reuses the block's rows from L1/L2.
namespace {

constexpr int64_t TILE_M = 4, TILE_N = 6;  // 24 accumulators + 6 weights + 1 token vector of 32 registers
constexpr int64_t BLOCK_N = 48;             // weight rows a thread holds in cache while the token rows pass

template <int RM, int RN>
void tile(const float* x, const uint16_t* w, int64_t K, int64_t N, int64_t m0, int64_t n0, uint16_t* y) {
  __m512 acc[RM][RN];
  for (int i = 0; i < RM; ++i)
    for (int j = 0; j < RN; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    __m512 wv[RN];
    for (int j = 0; j < RN; ++j) wv[j] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(w + (n0 + j) * K + k)));
    for (int i = 0; i < RM; ++i) {
      const __m512 xv = _mm512_loadu_ps(x + (m0 + i) * K + k);
      for (int j = 0; j < RN; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < RM; ++i)
    for (int j = 0; j < RN; ++j)  // rounded to float16 here, as .to(float16) would (to nearest even)
      y[(m0 + i) * N + n0 + j] = F16::round(_mm512_reduce_add_ps(acc[i][j]));
}

template <int RM>
void tile_n(const float* x, const uint16_t* w, int64_t K, int64_t N, int64_t m0, int64_t n0, int64_t rn, uint16_t* y) {
  switch (rn) {  // the last weight rows of a block: 1..TILE_N
    case 1: return tile<RM, 1>(x, w, K, N, m0, n0, y);
    case 2: return tile<RM, 2>(x, w, K, N, m0, n0, y);
    case 3: return tile<RM, 3>(x, w, K, N, m0, n0, y);
    case 4: return tile<RM, 4>(x, w, K, N, m0, n0, y);
    case 5: return tile<RM, 5>(x, w, K, N, m0, n0, y);
    default: return tile<RM, 6>(x, w, K, N, m0, n0, y);
  }
}

void tiles(const float* x, const uint16_t* w, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1, uint16_t* y) {
  for (int64_t m0 = 0; m0 < M; m0 += TILE_M)
    for (int64_t n = n0; n < n1; n += TILE_N) {
      const int64_t rn = std::min(TILE_N, n1 - n);
      switch (std::min(TILE_M, M - m0)) {
        case 1: tile_n<1>(x, w, K, N, m0, n, rn, y); break;
        case 2: tile_n<2>(x, w, K, N, m0, n, rn, y); break;
        case 3: tile_n<3>(x, w, K, N, m0, n, rn, y); break;
        default: tile_n<4>(x, w, K, N, m0, n, rn, y);
      }
    }
}

}  // namespace

torch::Tensor gemm_f16(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == at::kHalf && w.scalar_type() == at::kHalf, "gemm_f16: float16 x and w");
  TORCH_CHECK(w.is_contiguous() && w.dim() == 2, "gemm_f16: contiguous 2-d w");
  const int64_t K = w.size(1), N = w.size(0), M = x.numel() / K;
  TORCH_CHECK(K % 16 == 0 && x.size(-1) == K, "gemm_f16: K % 16 == 0");
  const auto x32 = x.reshape({M, K}).to(at::kFloat).contiguous();
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x32.data_ptr<float>();
  const auto* wp = static_cast<const uint16_t*>(w.data_ptr());
  auto* yp = static_cast<uint16_t*>(y.data_ptr());
  at::parallel_for(0, (N + BLOCK_N - 1) / BLOCK_N, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) tiles(xp, wp, M, K, N, b * BLOCK_N, std::min(N, (b + 1) * BLOCK_N), yp);
  });
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return y.view(sizes);
}

// float16 weights repacked once at load for the kernels below: w [N, K] -> [ceil(N / 8), K / 16, 8, 16],
// 8 rows interleaved 16 weights at a time (rows past N are zeros). One pass reads 8 rows as one
// stream and widens each 16 of x once for all 8, where the row-at-a-time GEMV above widens x once
// per row: +16% at Qwen3-4B's shapes (bench/half_gemv.py --shapes 4b), a plain read's speed.
// Several rows of the unpacked layout at once (several streams, as tinyBLAS) ran 12-50% slower.
torch::Tensor huge_page_zeros(at::IntArrayRef sizes, at::ScalarType dtype);

namespace {

constexpr int64_t PACK = 8;  // rows per packed block

inline __m512 widen(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }

// M token rows x [M, K] (float16) against packed blocks [b0, b1): y [M, N] in float16.
template <int M>
void packed_blocks(const uint16_t* x, const uint16_t* w, int64_t K, int64_t N, int64_t b0, int64_t b1, uint16_t* y) {
  for (int64_t b = b0; b < b1; ++b) {
    const uint16_t* block = w + b * K * PACK;
    __m512 acc[M][PACK];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < PACK; ++r) acc[m][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      __m512 xv[M];
      for (int m = 0; m < M; ++m) xv[m] = widen(x + m * K + k);
      const uint16_t* wk = block + k * PACK;
      for (int r = 0; r < PACK; ++r) {
        const __m512 wv = widen(wk + r * 16);
        for (int m = 0; m < M; ++m) acc[m][r] = _mm512_fmadd_ps(wv, xv[m], acc[m][r]);
      }
    }
    for (int r = 0; r < PACK && b * PACK + r < N; ++r)
      for (int m = 0; m < M; ++m) y[m * N + b * PACK + r] = F16::round(_mm512_reduce_add_ps(acc[m][r]));
  }
}

// RM token rows of x32 [M, K] (float32, widened once) against 4 rows of a packed block (those from
// r0): RM x 4 accumulators, for prompts. Half a block a tile, so 6 token rows fit the registers and
// each widened weight vector serves 6 FMAs (8 rows x 3 tokens ran ~5% slower than the unpacked tiles).
template <int RM>
void packed_tile(const float* x, const uint16_t* block, int64_t K, int64_t N, int64_t m0, int64_t n0, int r0, uint16_t* y) {
  constexpr int RN = PACK / 2;
  __m512 acc[RM][RN];
  for (int i = 0; i < RM; ++i)
    for (int r = 0; r < RN; ++r) acc[i][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const uint16_t* wk = block + k * PACK + r0 * 16;
    __m512 wv[RN];
    for (int r = 0; r < RN; ++r) wv[r] = widen(wk + r * 16);
    for (int i = 0; i < RM; ++i) {
      const __m512 xv = _mm512_loadu_ps(x + (m0 + i) * K + k);
      for (int r = 0; r < RN; ++r) acc[i][r] = _mm512_fmadd_ps(xv, wv[r], acc[i][r]);
    }
  }
  for (int i = 0; i < RM; ++i)
    for (int r = 0; r < RN && n0 + r0 + r < N; ++r)
      y[(m0 + i) * N + n0 + r0 + r] = F16::round(_mm512_reduce_add_ps(acc[i][r]));
}

template <int RM>
void packed_tiles(const float* x, const uint16_t* block, int64_t K, int64_t N, int64_t m0, int64_t n0, uint16_t* y) {
  packed_tile<RM>(x, block, K, N, m0, n0, 0, y);
  if (n0 + PACK / 2 < N) packed_tile<RM>(x, block, K, N, m0, n0, PACK / 2, y);
}

constexpr int64_t PACKED_TILE_M = 6;  // 24 accumulators + 4 weight vectors + 1 token vector of 32 registers
constexpr int64_t PACKED_BLOCKS_PER_TASK = 6;  // 48 weight rows a thread holds in cache while the token rows pass

}  // namespace

torch::Tensor repack_f16_rows8(const torch::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kHalf && w.dim() == 2 && w.is_contiguous() && w.size(1) % 16 == 0,
              "repack_f16_rows8: contiguous float16 [N, K] with K % 16 == 0");
  const int64_t N = w.size(0), K = w.size(1), blocks = (N + PACK - 1) / PACK;
  auto out = huge_page_zeros({blocks, K / 16, PACK, 16}, at::kHalf);
  const auto* src = static_cast<const uint16_t*>(w.data_ptr());
  auto* dst = static_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t r = 0; r < PACK && b * PACK + r < N; ++r)
        for (int64_t k = 0; k < K; k += 16)
          std::memcpy(dst + (b * K + k) * PACK + r * 16, src + (b * PACK + r) * K + k, 16 * sizeof(uint16_t));
  });
  return out;
}

// x [..., K] (float16) @ W.T, W [N, K] as repack_f16_rows8 holds it -> [..., N] float16, computed in float32.
torch::Tensor packed_half_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t N) {
  TORCH_CHECK(x.scalar_type() == at::kHalf && packed.scalar_type() == at::kHalf && packed.dim() == 4 &&
                  packed.size(2) == PACK && packed.size(3) == 16 && packed.is_contiguous(),
              "packed_half_linear: float16 x and blocks from repack_f16_rows8");
  const int64_t K = x.size(-1), M = x.numel() / K, blocks = packed.size(0);
  TORCH_CHECK(packed.size(1) * 16 == K && (N + PACK - 1) / PACK == blocks, "packed_half_linear: blocks of another shape");
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y.view(sizes);
  const auto* wp = static_cast<const uint16_t*>(packed.data_ptr());
  auto* yp = static_cast<uint16_t*>(y.data_ptr());
  if (M <= 2) {  // decode: each thread streams its share of the blocks once
    const auto xs = x.reshape({M, K}).contiguous();
    const auto* xp = static_cast<const uint16_t*>(xs.data_ptr());
    at::parallel_for(0, blocks, ROWS_PER_TASK / PACK, [&](int64_t b0, int64_t b1) {
      if (M == 1) packed_blocks<1>(xp, wp, K, N, b0, b1, yp);
      else packed_blocks<2>(xp, wp, K, N, b0, b1, yp);
    });
    return y.view(sizes);
  }
  const auto x32 = x.reshape({M, K}).to(at::kFloat).contiguous();
  const float* xp = x32.data_ptr<float>();
  const int64_t tasks = (blocks + PACKED_BLOCKS_PER_TASK - 1) / PACKED_BLOCKS_PER_TASK;
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b0 = t * PACKED_BLOCKS_PER_TASK, b1 = std::min(blocks, b0 + PACKED_BLOCKS_PER_TASK);
      for (int64_t m0 = 0; m0 < M; m0 += PACKED_TILE_M)
        for (int64_t b = b0; b < b1; ++b) {
          const uint16_t* block = wp + b * K * PACK;
          switch (std::min(PACKED_TILE_M, M - m0)) {
            case 1: packed_tiles<1>(xp, block, K, N, m0, b * PACK, yp); break;
            case 2: packed_tiles<2>(xp, block, K, N, m0, b * PACK, yp); break;
            case 3: packed_tiles<3>(xp, block, K, N, m0, b * PACK, yp); break;
            case 4: packed_tiles<4>(xp, block, K, N, m0, b * PACK, yp); break;
            case 5: packed_tiles<5>(xp, block, K, N, m0, b * PACK, yp); break;
            default: packed_tiles<6>(xp, block, K, N, m0, b * PACK, yp);
          }
        }
    }
  });
  return y.view(sizes);
}
