// y [M, N] = x [M, K] @ w [N, K].T for 16-bit and float32 w, for the few token rows of a decode (or
// speculative) step. Decode is bound by reading w. One weight row at a time, as ggml does: each thread's rows are
// then one contiguous stream (8 rows at once, 8 streams a row apart, streamed ~20% slower here). A
// pass of several token rows also prefetches w into L2 a few KiB ahead: without it a pass of 5 rows
// over the 4B shape's gate/up weights cost 2.2x a pass of one (the loads waited on memory while the
// dot products ran), with it ~1.05x; a pass of one row streams as fast without it. Two accumulators
// per token row keep two dot products in flight. bfloat16: the ISA's pair dot product where it has
// one (vec.h's dot_bf16).
// float16: weights and x widened in registers and multiplied into float32 (ggml's f16 vec_dot does
// the same); widening x once per call instead, into a float32 copy, left a decode step's float16
// linears 12% slower than bfloat16's. float32: the plain fused multiply-add.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "dynamic_for.h"
#include "vec.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#if __has_include(<unistd.h>)
#include <unistd.h>  // sysconf: the L1's size
#endif

namespace {

using namespace linnet;

constexpr int64_t ROWS_PER_TASK = 64;  // rows of w per parallel task

struct Bf16 {  // x: bf16 [M, K]
  using W = uint16_t;
  static constexpr int64_t STEP = kBf16Step;
  static Vf dot(Vf acc, const uint16_t* w, const uint16_t* x) { return dot_bf16(acc, w, x); }
  static uint16_t round(float v) { return c10::BFloat16(v).x; }  // to nearest even, as .to(bfloat16)
};

struct F16 {  // x: float16 [M, K]
  using W = uint16_t;
  static constexpr int64_t STEP = kW;
  static Vf dot(Vf acc, const uint16_t* w, const uint16_t* x) {
    return fma(load((const at::Half*)w), load((const at::Half*)x), acc);
  }
  static uint16_t round(float v) { return from_f32<at::Half>(v).x; }
};

struct F32 {  // x: float32 [M, K]
  using W = float;
  static constexpr int64_t STEP = kW;
  static Vf dot(Vf acc, const float* w, const float* x) { return fma(load(w), load(x), acc); }
  static float round(float v) { return v; }
};

constexpr int64_t X_L1_BYTES = 24576;     // of x's token rows a pass keeps in L1 (32 KiB) beside w's stream
constexpr int64_t ROW_BLOCK = 8;          // weight rows whose accumulators a chunked pass holds

// The K-chunk a pass of M token rows takes: all of K for one row or where the M rows of x fit in L1,
// else what fits (a multiple of the two-step stride). Chunks change no row's sums: each accumulator
// still takes its steps in order, and the last step (K % 2S) falls in the last chunk.
template <class T>
int64_t chunk_of(int64_t K, int64_t M) {
  constexpr int64_t E = sizeof(typename T::W), S2 = 2 * T::STEP;
  if (M == 1 || M * K * E <= X_L1_BYTES) return K;
  return std::max(S2, X_L1_BYTES / (M * E) / S2 * S2);
}

// Rows [n0, n1) of w against M token rows, ROW_BLOCK rows at a time, chunk by chunk over K (a row's
// accumulators kept between chunks), each segment (row, chunk) prefetching the one `ahead` of it.
template <class T, int M>
void rows(const typename T::W* x, const typename T::W* w, int64_t K, int64_t N, int64_t n0, int64_t n1, typename T::W* y) {
  using W = typename T::W;
  constexpr int64_t S = T::STEP, STEP_BYTES = 2 * S * sizeof(W);
  const int64_t CK = chunk_of<T>(K, M), chunks = (K + CK - 1) / CK, seg = CK * (int64_t)sizeof(W);
  const int64_t ahead = std::clamp<int64_t>((kPrefetchBytes + seg / 2) / seg, 1, ROW_BLOCK);
  for (int64_t b = n0; b < n1; b += ROW_BLOCK) {
    const int64_t rb = std::min(ROW_BLOCK, n1 - b), total = chunks * rb;
    Vf acc[ROW_BLOCK][M][2];
    for (int64_t r = 0; r < rb; ++r)
      for (int m = 0; m < M; ++m) acc[r][m][0] = acc[r][m][1] = zero();
    for (int64_t i = 0; i < total; ++i) {  // chunk-major: the chunk's x stays in L1 across the block's rows
      const int64_t r = i % rb, k0 = i / rb * CK, k1 = std::min(K, k0 + CK), j = i + ahead;
      const W* wr = w + (b + r) * K;
      // the segment `ahead` of this one: this block's, or the next block's first chunk
      const W* pf = j < total ? w + (b + j % rb) * K + j / rb * CK : w + std::min(N - 1, b + rb + j - total) * K;
      Vf a0[M], a1[M];
      for (int m = 0; m < M; ++m) a0[m] = acc[r][m][0], a1[m] = acc[r][m][1];
      int64_t k = k0;
      for (; k + 2 * S <= k1; k += 2 * S) {
        if constexpr (M > 1)  // one row streams at memory speed behind the hardware's prefetcher alone (2% faster)
          for (int64_t byte = 0; byte < STEP_BYTES; byte += 64) prefetch_l2((const char*)(pf + (k - k0)) + byte);
        for (int m = 0; m < M; ++m) {
          a0[m] = T::dot(a0[m], wr + k, x + m * K + k);
          a1[m] = T::dot(a1[m], wr + k + S, x + m * K + k + S);
        }
      }
      for (; k < k1; k += S)  // K % (2 * S): a step or, on narrower vectors, a few
        for (int m = 0; m < M; ++m) a0[m] = T::dot(a0[m], wr + k, x + m * K + k);
      for (int m = 0; m < M; ++m) acc[r][m][0] = a0[m], acc[r][m][1] = a1[m];
    }
    for (int64_t r = 0; r < rb; ++r)
      for (int m = 0; m < M; ++m) y[m * N + b + r] = T::round(reduce_add(add(acc[r][m][0], acc[r][m][1])));
  }
}

template <class T, int M>
void gemv(const typename T::W* x, const typename T::W* w, int64_t K, int64_t N, typename T::W* y) {
  streaming_for(N, ROWS_PER_TASK, [&](int64_t n0, int64_t n1) { rows<T, M>(x, w, K, N, n0, n1, y); });
}

// Token rows one pass over w takes: each row keeps its own two accumulators (16 vectors at 8 rows,
// inside AVX-512's 32 registers), so a row's sums are the same whichever rows run beside it.
constexpr int64_t ROWS_PER_PASS = 8;

template <class T>
void gemv_rows(const typename T::W* x, const typename T::W* w, int64_t K, int64_t N, int64_t M, typename T::W* y) {
  switch (M) {
    case 1: return gemv<T, 1>(x, w, K, N, y);
    case 2: return gemv<T, 2>(x, w, K, N, y);
    case 3: return gemv<T, 3>(x, w, K, N, y);
    case 4: return gemv<T, 4>(x, w, K, N, y);
    case 5: return gemv<T, 5>(x, w, K, N, y);
    case 6: return gemv<T, 6>(x, w, K, N, y);
    case 7: return gemv<T, 7>(x, w, K, N, y);
    default: return gemv<T, 8>(x, w, K, N, y);
  }
}

// The product for x [..., K] of a few rows in w's dtype, computed in float32 and rounded once
// (written in that dtype here: a separate .to() cost ~6 us a call, 33 calls a 191M step). Each row's
// result is the one it gets alone, so a speculative step's rows are computed as decode computes them.
template <class T>
torch::Tensor run(const torch::Tensor& x, const torch::Tensor& w, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(x.scalar_type() == dtype && w.scalar_type() == dtype, name, ": ", dtype, " x and w");
  TORCH_CHECK(w.is_contiguous() && w.dim() == 2, name, ": contiguous 2-d w");
  const int64_t K = w.size(1), N = w.size(0), M = x.numel() / K;
  TORCH_CHECK(K % T::STEP == 0 && x.size(-1) == K && M >= 1, name, ": K % ", T::STEP, " == 0, at least 1 row");
  const auto xs = x.reshape({M, K}).contiguous();
  auto y = torch::empty({M, N}, x.options());
  const auto* xp = static_cast<const typename T::W*>(xs.data_ptr());
  const auto* wp = static_cast<const typename T::W*>(w.data_ptr());
  auto* yp = static_cast<typename T::W*>(y.data_ptr());
  for (int64_t m = 0; m < M; m += ROWS_PER_PASS)
    gemv_rows<T>(xp + m * K, wp, K, N, std::min(ROWS_PER_PASS, M - m), yp + m * N);
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

torch::Tensor gemv_f32(const torch::Tensor& x, const torch::Tensor& w) {
  return run<F32>(x, w, at::kFloat, "gemv_f32");
}

// y [M, N] = x [M, K] @ w [N, K].T for 16-bit w (float16; bfloat16 where the ISA has no bf16 dot
// product) and many token rows (prompts), as llama.cpp's tinyBLAS does: register tiles of RM token
// rows x RN weight rows, the weights widened in registers and multiplied into float32, so no widened
// copy of w is ever written. Threads take blocks of weight rows (each streams its own part of w
// once); within a block every token row's tile reuses the block's rows from L1/L2.
namespace {

// accumulators + token vectors + a weight vector fit the registers: 24 + 4 + 1 of 32, 12 + 3 + 1 of 16
constexpr int64_t TILE_M = kRegs == 32 ? 4 : 3, TILE_N = kRegs == 32 ? 6 : 4;
constexpr int64_t BLOCK_N = 48;  // weight rows a thread holds in cache while the token rows pass

template <typename W, int RM, int RN>
void tile(const float* x, const W* w, int64_t K, int64_t N, int64_t m0, int64_t n0, W* y) {
  Vf acc[RM][RN];
  for (int i = 0; i < RM; ++i)
    for (int j = 0; j < RN; ++j) acc[i][j] = zero();
  for (int64_t k = 0; k < K; k += kW) {  // RM token vectors held, one weight vector at a time: RM + 1 + RM x RN registers
    Vf xv[RM];
    for (int i = 0; i < RM; ++i) xv[i] = load(x + (m0 + i) * K + k);
    for (int j = 0; j < RN; ++j) {
      const Vf wv = load(w + (n0 + j) * K + k);
      for (int i = 0; i < RM; ++i) acc[i][j] = fma(xv[i], wv, acc[i][j]);
    }
  }
  for (int i = 0; i < RM; ++i)
    for (int j = 0; j < RN; ++j)  // rounded here, as .to(dtype) would (to nearest even)
      y[(m0 + i) * N + n0 + j] = from_f32<W>(reduce_add(acc[i][j]));
}

template <typename W, int RM>
void tile_n(const float* x, const W* w, int64_t K, int64_t N, int64_t m0, int64_t n0, int64_t rn, W* y) {
  switch (std::min(rn, TILE_N)) {  // the last weight rows of a block: 1..TILE_N
    case 1: return tile<W, RM, 1>(x, w, K, N, m0, n0, y);
    case 2: return tile<W, RM, 2>(x, w, K, N, m0, n0, y);
    case 3: return tile<W, RM, 3>(x, w, K, N, m0, n0, y);
    case 4: return tile<W, RM, 4>(x, w, K, N, m0, n0, y);
    case 5: return tile<W, RM, 5>(x, w, K, N, m0, n0, y);
    default: return tile<W, RM, 6>(x, w, K, N, m0, n0, y);
  }
}

template <typename W>
void tiles(const float* x, const W* w, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1, W* y) {
  for (int64_t m0 = 0; m0 < M; m0 += TILE_M)
    for (int64_t n = n0; n < n1; n += TILE_N) {
      const int64_t rn = std::min(TILE_N, n1 - n);
      switch (std::min(TILE_M, M - m0)) {
        case 1: tile_n<W, 1>(x, w, K, N, m0, n, rn, y); break;
        case 2: tile_n<W, 2>(x, w, K, N, m0, n, rn, y); break;
        case 3: tile_n<W, 3>(x, w, K, N, m0, n, rn, y); break;
        default: tile_n<W, 4>(x, w, K, N, m0, n, rn, y);
      }
    }
}

template <typename W>
torch::Tensor gemm_tiles(const torch::Tensor& x, const torch::Tensor& w, const char* name) {
  TORCH_CHECK(w.is_contiguous() && w.dim() == 2, name, ": contiguous 2-d w");
  const int64_t K = w.size(1), N = w.size(0), M = x.numel() / K;
  TORCH_CHECK(K % 16 == 0 && x.size(-1) == K, name, ": K % 16 == 0");
  const auto x32 = x.reshape({M, K}).to(at::kFloat).contiguous();
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x32.data_ptr<float>();
  const auto* wp = w.data_ptr<W>();
  auto* yp = y.data_ptr<W>();
  at::parallel_for(0, (N + BLOCK_N - 1) / BLOCK_N, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) tiles<W>(xp, wp, M, K, N, b * BLOCK_N, std::min(N, (b + 1) * BLOCK_N), yp);
  });
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return y.view(sizes);
}

}  // namespace

torch::Tensor gemm_f16(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == at::kHalf && w.scalar_type() == at::kHalf, "gemm_f16: float16 x and w");
  return gemm_tiles<at::Half>(x, w, "gemm_f16");
}

torch::Tensor gemm_bf16(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "gemm_bf16: bfloat16 x and w");
  return gemm_tiles<at::BFloat16>(x, w, "gemm_bf16");
}

// float16, float32 and bfloat16 weights (bfloat16 where the ISA has no bf16 dot product: 59.5 against
// 56.7 tok/s for the row layout's GEMV at 191M on an AVX2 EPYC; or one that spans two rows,
// pair_linear, linears.py) repacked once at load for the kernels below: w [N, K] ->
// [2 ceil(N / 8), K / 16, 4, 16], blocks of 4 rows interleaved 16 weights at a time (rows past N are
// zeros). Decode loads (widens) each 16 of x once for a block's 4 rows or a pair's 8 (kDecodeBlocks),
// where the row-at-a-time GEMV above does so once per row: +16% for float16 at Qwen3-4B's shapes on a
// Zen 3 (bench/half_gemv.py --shapes 4b), a plain read's speed. A prompt's register tile takes one block,
// a contiguous stream (blocks of 8, whose tiles read every other 128 bytes, ran them 10-15% slower on a
// Zen 3). Many rows of the unpacked layout at once (as tinyBLAS)
// ran decode 12-50% slower.
torch::Tensor huge_page_zeros(at::IntArrayRef sizes, at::ScalarType dtype);

namespace {

constexpr int64_t ROWS = 4, CHUNK = 16;  // rows per packed block, weights of a row together
constexpr int64_t PAIR = 2;  // the block count is even, so a decode pass may take two blocks at once

// Blocks a decode pass takes at once: two load each 16 of x once for 8 rows but read two streams of
// K x 4 weights each; one reads one stream, prefetched kPrefetchBytes ahead. On a Zen 5, both levels,
// in turns in one process (191M and Qwen3-4B shapes): one block ran 16-bit weights 1.21-1.45x as fast
// and float32 1.02-1.09x on 16 registers, but float32 0.92x on 32.
template <typename W>
constexpr int kDecodeBlocks = std::is_same_v<W, float> && kRegs == 32 ? PAIR : 1;

// The chunk kPrefetchBytes past `chunk` (a block's 4 rows x 16 weights) into L2, for a pass that streams
// the blocks from memory: without it a 5-token pass over the 4B shape's float16 weights took 1.9-2.1x a
// one-token pass on a Zen 5, with it 1.16x (the register tiles' FMAs keep too few loads in flight).
template <typename W>
inline void prefetch_chunk(const W* chunk, int64_t ahead = kPrefetchBytes) {
  for (int64_t o = 0; o < CHUNK * ROWS * (int64_t)sizeof(W); o += 64) prefetch_l2((const char*)chunk + ahead + o);
}

// M token rows x [M, K] (as the weights: float16 or float32) against passes [p0, p1) of B blocks: y [M, N].
template <typename W, int M, int B>
void packed_blocks(const W* x, const W* w, int64_t K, int64_t N, int64_t p0, int64_t p1, W* y) {
  constexpr int R = ROWS * B;
  for (int64_t p = p0; p < p1; ++p) {
    const W* first = w + p * K * R;
    Vf acc[M][R];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) acc[m][r] = zero();
    for (int64_t k = 0; k < K; k += CHUNK) {
      if constexpr (B == 1) prefetch_chunk<W>(first + k * ROWS);
      for (int64_t part = 0; part < CHUNK; part += kW) {
        Vf xv[M];
        for (int m = 0; m < M; ++m) xv[m] = load(x + m * K + k + part);
        const W* wk = first + k * ROWS + part;
        for (int r = 0; r < R; ++r) {  // row r: block r / ROWS of the pass, its row r % ROWS
          const Vf wv = load(wk + r / ROWS * K * ROWS + r % ROWS * CHUNK);
          for (int m = 0; m < M; ++m) acc[m][r] = fma(wv, xv[m], acc[m][r]);
        }
      }
    }
    for (int r = 0; r < R && p * R + r < N; ++r)
      for (int m = 0; m < M; ++m) y[m * N + p * R + r] = from_f32<W>(reduce_add(acc[m][r]));
  }
}

// RM token rows of x [M, K] (X: the weights' dtype, widened in registers, or a float32 copy; see
// kTokensAsFloat) against one block (rows n0..n0+3), over the slice [k0, k1) of K: RM x 4
// accumulators, for prompts. So 6 token rows fit 32 registers (3 fit 16) and each weight vector serves
// 6 FMAs (8 rows x 3 tokens ran ~5% slower than the unpacked tiles). Between slices the accumulators
// wait in `park` (row i's at park[i * stride]), as vectors: each output still sums in the decode
// GEMV's order, so a draft's check computes what plain decode does.
template <typename W, typename X, int RM>
void packed_tile(const X* x, const W* block, int64_t K, int64_t N, int64_t m0, int64_t n0, int64_t k0, int64_t k1,
                 Vf* park, int64_t stride, W* y, bool stream) {
  Vf acc[RM][ROWS];
  for (int i = 0; i < RM; ++i)
    for (int r = 0; r < ROWS; ++r) acc[i][r] = k0 == 0 ? zero() : park[i * stride + r];
  // One loop of kW steps (the chunk's offset computed): nested chunk and part loops were unrolled
  // together and the 16-register build then re-read x from memory at every FMA (f16 prompts ~30% slower).
  for (int64_t k = k0; k < k1; k += kW) {
    const W* wk = block + (k & ~(CHUNK - 1)) * ROWS + (k & (CHUNK - 1));
    if (stream && (k & (CHUNK - 1)) == 0) prefetch_chunk<W>(wk);
    Vf xv[RM];  // RM token vectors held, one weight vector at a time: RM + 1 + 4 RM registers
    for (int i = 0; i < RM; ++i) xv[i] = load(x + (m0 + i) * K + k);
    for (int r = 0; r < ROWS; ++r) {
      const Vf wv = load(wk + r * CHUNK);
      for (int i = 0; i < RM; ++i) acc[i][r] = fma(xv[i], wv, acc[i][r]);
    }
  }
  if (k1 < K) {
    for (int i = 0; i < RM; ++i)
      for (int r = 0; r < ROWS; ++r) park[i * stride + r] = acc[i][r];
    return;
  }
  for (int i = 0; i < RM; ++i)
    for (int r = 0; r < ROWS && n0 + r < N; ++r) y[(m0 + i) * N + n0 + r] = from_f32<W>(reduce_add(acc[i][r]));
}

// 24 accumulators + 6 token vectors + 1 weight vector of 32 registers; 12 + 3 + 1 of 16
constexpr int64_t PACKED_TILE_M = kRegs == 32 ? 6 : 3;
constexpr int64_t PACKED_BLOCKS_PER_TASK = 12;  // 48 weight rows a thread holds in cache while the token rows pass
// Whether 16-bit prompts' tiles read a float32 copy of x rather than widening it at every load. The
// 3 x 4 tiles of 16 registers widen 7 vectors per 12 FMAs that way, and the widening, not the FMAs,
// bounds them: on a Zen 2 (AVX2) the copy ran float16 prompts 1.5x as fast, bfloat16 1.35x (90 -> 136
// and 101 -> 136 GFLOP/s, bench/half_gemv.py). The 6 x 4 tiles of 32 registers keep x as stored.
constexpr bool kTokensAsFloat = kRegs == 16;

// A prompt's pass over a task's blocks can go through K in slices of PROMPT_SLICE_BYTES of each weight
// row, and through the token rows in groups of PROMPT_GROUP_TILES tiles, so that one slice of the task's
// blocks (192 KiB) stays in L2 while a group's rows pass. Only float32 in the 16-register build gained
// (4B shape, bench/half_gemv.py: Zen 2 117 -> 134 GFLOP/s, Zen 4's AVX2 build 143 -> 149); 16-bit
// weights and the AVX-512 build lost 2-8%, so they take K whole. Whether to slice is decided at run
// time: with it fixed at compile time, a Zen 5's AVX2 build ran float32 prompts at 171-185 GFLOP/s,
// decided at run time 206-223 either way (in turns in one process). Cores with a 48 KiB L1 take K
// whole; smaller ones slice, as the Zen 2 and Zen 4 measurements chose.
constexpr int64_t PROMPT_SLICE_BYTES = 4096, PROMPT_GROUP_TILES = 8, SLICE_BELOW_L1_BYTES = 48 * 1024;
template <typename W>
constexpr bool kSliceable = kRegs == 16 && std::is_same_v<W, float>;

// LINNET_PROMPT_SLICES=0/1 overrides the L1's choice (the tests take both ways on any CPU); where the C
// library cannot tell the L1's size, prompts slice.
bool slice_prompts() {
  if (const char* forced = std::getenv("LINNET_PROMPT_SLICES")) return forced[0] == '1';
  static const bool small_l1 = [] {
#ifdef _SC_LEVEL1_DCACHE_SIZE
    const long l1 = sysconf(_SC_LEVEL1_DCACHE_SIZE);  // glibc's, from the CPU's own report
#else
    const long l1 = 0;
#endif
    return l1 <= 0 || l1 < SLICE_BELOW_L1_BYTES;
  }();
  return small_l1;
}

template <typename W, typename X>
void packed_prompt(const X* xp, const W* wp, int64_t M, int64_t K, int64_t N, int64_t blocks, W* yp) {
  const int64_t tasks = (blocks + PACKED_BLOCKS_PER_TASK - 1) / PACKED_BLOCKS_PER_TASK;
  constexpr int64_t group = PROMPT_GROUP_TILES * PACKED_TILE_M, stride = PACKED_BLOCKS_PER_TASK * ROWS;
  const bool sliced = kSliceable<W> && slice_prompts();
  const int64_t slice = sliced ? PROMPT_SLICE_BYTES / int64_t(sizeof(W)) : K;
  dynamic_for(tasks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<Vf> park(sliced ? group * stride : 0);  // [group row][block of the task][its 4 rows]
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b0 = t * PACKED_BLOCKS_PER_TASK, b1 = std::min(blocks, b0 + PACKED_BLOCKS_PER_TASK);
      for (int64_t g0 = 0; g0 < M; g0 += group)
        for (int64_t k0 = 0; k0 < K; k0 += slice) {
          const int64_t k1 = std::min(K, k0 + slice);
          for (int64_t m0 = g0; m0 < std::min(M, g0 + group); m0 += PACKED_TILE_M)
            for (int64_t b = b0; b < b1 && b * ROWS < N; ++b) {
              const W* block = wp + b * K * ROWS;
              const bool stream = m0 == 0;  // the first tile reads the task's blocks from memory
              Vf* pk = sliced ? park.data() + ((m0 - g0) * PACKED_BLOCKS_PER_TASK + (b - b0)) * ROWS : nullptr;
              switch (std::min(PACKED_TILE_M, M - m0)) {
                case 1: packed_tile<W, X, 1>(xp, block, K, N, m0, b * ROWS, k0, k1, pk, stride, yp, stream); break;
                case 2: packed_tile<W, X, 2>(xp, block, K, N, m0, b * ROWS, k0, k1, pk, stride, yp, stream); break;
                case 3: packed_tile<W, X, 3>(xp, block, K, N, m0, b * ROWS, k0, k1, pk, stride, yp, stream); break;
                case 4: packed_tile<W, X, 4>(xp, block, K, N, m0, b * ROWS, k0, k1, pk, stride, yp, stream); break;
                case 5: packed_tile<W, X, 5>(xp, block, K, N, m0, b * ROWS, k0, k1, pk, stride, yp, stream); break;
                default: packed_tile<W, X, 6>(xp, block, K, N, m0, b * ROWS, k0, k1, pk, stride, yp, stream);
              }
            }
        }
    }
  });
}

// bfloat16 blocks by the pair dot product (vec.h's dot_two_rows), where the ISA has one that spans two
// rows: a tile of RM token rows x B blocks over all of K, one accumulator per token row and pair of
// weight rows, so a row's sums do not depend on the rows beside it. Decode, a speculative check and a
// batch's few rows take one block a pass (one stream, prefetched by the first tile); prompts take two
// (4 weight vectors serve 6 token rows each). In turns in one process on a Zen 5 (4B shapes, 2 layers,
// both in 2 MiB pages), against the row layout's GEMV: 1 token row 8.43 vs 8.56 ms, 5 rows 10.47 vs
// 11.95, 8 rows 11.25 vs 12.06; a 128-token prompt 781-787 GFLOP/s, oneDNN's bf16 GEMM 829-839.
constexpr int64_t PAIR_STREAM_ROWS = 12, PAIR_PROMPT_ROWS = 6;  // 24 accumulators of 32 registers
// Pairs of blocks a prompt task holds in L2 while its token tiles pass: 16 weight rows (up to 311 KiB
// at K = 9728); 48 rows ran the 4B shape's 128-token prompt at 748-751 GFLOP/s, 16 at 781-787.
constexpr int64_t PAIR_PROMPT_TASK = 2;
// How far ahead a pass of several token rows prefetches: in turns on a Zen 5 (4B shapes, two runs), 5
// rows 1.23-1.24x a one-row pass at 8 KiB, 1.16-1.17x at 4 KiB; 8 rows 1.31-1.34x and 1.22-1.25x.
constexpr int64_t PAIR_PREFETCH_BYTES = 4096;

template <int B, int RM>
void pair_tile(const uint16_t* x, const uint16_t* block, int64_t K, int64_t N, int64_t m0, int64_t n0, uint16_t* y,
               bool stream) {
  constexpr int H = 2 * B;  // pairs of weight rows
  Vf acc[RM][H];
  for (int i = 0; i < RM; ++i)
    for (int h = 0; h < H; ++h) acc[i][h] = zero();
  for (int64_t k = 0; k < K; k += CHUNK) {
    const uint16_t* wk = block + k * ROWS;
    if (stream)
      for (int b = 0; b < B; ++b) prefetch_chunk<uint16_t>(wk + b * K * ROWS, PAIR_PREFETCH_BYTES);
    for (int i = 0; i < RM; ++i) {
      const Bf16Twice xv = x16_twice(x + (m0 + i) * K + k);
      for (int h = 0; h < H; ++h) acc[i][h] = dot_two_rows(acc[i][h], wk + h / 2 * K * ROWS + h % 2 * 2 * CHUNK, xv);
    }
  }
  for (int i = 0; i < RM; ++i)
    for (int h = 0; h < H; ++h) {
      const int64_t n = n0 + 2 * h;
      if (n < N) y[(m0 + i) * N + n] = c10::BFloat16(sum_row_a(acc[i][h])).x;
      if (n + 1 < N) y[(m0 + i) * N + n + 1] = c10::BFloat16(sum_row_b(acc[i][h])).x;
    }
}

// pair_tile<B, rm> for a run-time rm in [1, RM]
template <int B, int RM>
void pair_tile_of(int64_t rm, const uint16_t* x, const uint16_t* block, int64_t K, int64_t N, int64_t m0, int64_t n0,
                  uint16_t* y, bool stream) {
  if constexpr (RM > 1)
    if (rm < RM) return pair_tile_of<B, RM - 1>(rm, x, block, K, N, m0, n0, y, stream);
  pair_tile<B, RM>(x, block, K, N, m0, n0, y, stream);
}

// A template, so that a level without the pair dot (vec.h only declares its helpers there) never builds it.
template <typename W>
void pair_linear(const W* x, const W* w, int64_t M, int64_t K, int64_t N, int64_t blocks, W* y) {
  const auto* xp = reinterpret_cast<const uint16_t*>(x);
  const auto* wp = reinterpret_cast<const uint16_t*>(w);
  auto* yp = reinterpret_cast<uint16_t*>(y);
  if (M <= PAIR_STREAM_ROWS) {
    streaming_for(blocks, ROWS_PER_TASK / ROWS, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1 && b * ROWS < N; ++b)
        pair_tile_of<1, PAIR_STREAM_ROWS>(M, xp, wp + b * K * ROWS, K, N, 0, b * ROWS, yp, true);
    });
    return;
  }
  dynamic_for(blocks / PAIR, PAIR_PROMPT_TASK, [&](int64_t p0, int64_t p1) {
    for (int64_t m0 = 0; m0 < M; m0 += PAIR_PROMPT_ROWS)  // the task's blocks stay in L2 for the later tiles
      for (int64_t p = p0; p < p1 && p * PAIR * ROWS < N; ++p)
        pair_tile_of<PAIR, PAIR_PROMPT_ROWS>(std::min(PAIR_PROMPT_ROWS, M - m0), xp, wp + p * PAIR * K * ROWS, K, N,
                                             m0, p * PAIR * ROWS, yp, m0 == 0);
  });
}

// bfloat16 prompts on AMX (vec.h's tiles) over the same packed blocks as decode: each task turns a panel of 32
// weight rows into tiles (vnni_tile: a transpose, ~1 instruction per 16 weights) and multiplies every
// 32 token rows against it, the panel's 2 KiB per 32 of K held in L2 (608 KiB at K = 9728). Where the
// blocks stayed mapped for oneDNN's AMX GEMM instead, decode ran the row GEMV, 0.85x the packed one.
constexpr int64_t AMX_ROWS = 32;  // token rows and weight rows per tile pass (2 x 2 tiles of 16)

template <typename W>
void amx_linear(const W* x, const W* w, int64_t M, int64_t K, int64_t N, int64_t blocks, W* y) {
  const auto* xp = reinterpret_cast<const uint16_t*>(x);
  const auto* wp = reinterpret_cast<const uint16_t*>(w);
  auto* yp = reinterpret_cast<uint16_t*>(y);
  const int64_t tiled = (M + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS, steps = K / 32;
  std::vector<uint16_t> padded;  // token rows past M as zeros: a tile always loads 16
  if (tiled != M) {
    padded.assign(tiled * K, 0);
    std::memcpy(padded.data(), xp, M * K * sizeof(uint16_t));
    xp = padded.data();
  }
  static const uint16_t zeros[(ROWS + 1) * CHUNK] = {};  // weight rows past the packed blocks (vnni_tile reads 2 x 16)
  dynamic_for((N + AMX_ROWS - 1) / AMX_ROWS, 1, [&](int64_t p0, int64_t p1) {
    thread_local std::vector<uint16_t> panel;
    panel.resize(std::max<size_t>(panel.size(), steps * 2 * 512));
    alignas(64) float c[AMX_ROWS * AMX_ROWS];
    amx_begin();
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * AMX_ROWS;
      const uint16_t* rows[AMX_ROWS];  // each weight row's first 16 of K
      for (int64_t r = 0; r < AMX_ROWS; ++r) {
        const int64_t n = n0 + r;
        rows[r] = n / ROWS < blocks ? wp + n / ROWS * K * ROWS + n % ROWS * CHUNK : nullptr;
      }
      for (int64_t s = 0; s < steps; ++s)
        for (int64_t t = 0; t < 2; ++t) {
          const uint16_t* at[16];
          for (int64_t i = 0; i < 16; ++i) {
            const uint16_t* row = rows[t * 16 + i];
            at[i] = row ? row + 2 * s * CHUNK * ROWS : zeros;
          }
          vnni_tile(at, CHUNK * ROWS, panel.data() + (2 * s + t) * 512);
        }
      for (int64_t m0 = 0; m0 < M; m0 += AMX_ROWS) {
        amx_bf16_32x32(xp + m0 * K, K, panel.data(), steps, c);
        for (int64_t i = 0; i < std::min(AMX_ROWS, M - m0); ++i)
          for (int64_t j = 0; j < std::min(AMX_ROWS, N - n0); ++j)
            yp[(m0 + i) * N + n0 + j] = c10::BFloat16(c[i * AMX_ROWS + j]).x;
      }
    }
    amx_end();
  });
}

template <typename W>
torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t N) {
  const int64_t K = x.size(-1), M = x.numel() / K, blocks = packed.size(0);
  constexpr int64_t R = ROWS * PAIR, B = kDecodeBlocks<W>;
  TORCH_CHECK(packed.size(1) * CHUNK == K && (N + R - 1) / R * PAIR == blocks, "packed linear: blocks of another shape");
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y.view(sizes);
  const W* wp = packed.data_ptr<W>();
  W* yp = y.data_ptr<W>();
  const auto xs = x.reshape({M, K}).contiguous();
  const W* xp = xs.data_ptr<W>();
  if constexpr (std::is_same_v<W, at::BFloat16> && kAmx) {
    if (M > PAIR_STREAM_ROWS && K % 32 == 0 && amx_usable()) {
      amx_linear<W>(xp, wp, M, K, N, blocks, yp);
      return y.view(sizes);
    }
  }
  if constexpr (std::is_same_v<W, at::BFloat16> && kPackedBf16Dot) {
    pair_linear<W>(xp, wp, M, K, N, blocks, yp);
    return y.view(sizes);
  }
  if (M <= 2) {  // decode: each thread streams its share of the blocks once
    streaming_for(blocks / B, ROWS_PER_TASK / (ROWS * B), [&](int64_t p0, int64_t p1) {
      if (M == 1) packed_blocks<W, 1, B>(xp, wp, K, N, p0, p1, yp);
      else packed_blocks<W, 2, B>(xp, wp, K, N, p0, p1, yp);
    });
    return y.view(sizes);
  }
  if constexpr (kTokensAsFloat && !std::is_same_v<W, float>) {
    const auto x32 = xs.to(at::kFloat);
    packed_prompt<W, float>(x32.data_ptr<float>(), wp, M, K, N, blocks, yp);
  } else {
    packed_prompt<W, W>(xp, wp, M, K, N, blocks, yp);
  }
  return y.view(sizes);
}

}  // namespace

// w [N, K] (float16, float32, or bfloat16 where the ISA has no bf16 dot product; K % 16 == 0) ->
// [2 ceil(N / 8), K / 16, 4, 16]: blocks of 4 rows interleaved (a copy)
torch::Tensor repack_rows8_float(const torch::Tensor& w) {
  const auto dtype = w.scalar_type();
  TORCH_CHECK((dtype == at::kHalf || dtype == at::kFloat || dtype == at::kBFloat16) && w.dim() == 2 &&
                  w.is_contiguous() && w.size(1) % CHUNK == 0,
              "repack_rows8_float: contiguous float16, bfloat16 or float32 [N, K] with K % 16 == 0");
  constexpr int64_t R = ROWS * PAIR;
  const int64_t N = w.size(0), K = w.size(1), blocks = (N + R - 1) / R * PAIR, es = w.element_size();
  auto out = huge_page_zeros({blocks, K / CHUNK, ROWS, CHUNK}, w.scalar_type());
  const auto* src = static_cast<const char*>(w.data_ptr());
  auto* dst = static_cast<char*>(out.data_ptr());
  at::parallel_for(0, blocks, 32, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t r = 0; r < ROWS && b * ROWS + r < N; ++r)
        for (int64_t k = 0; k < K; k += CHUNK)
          std::memcpy(dst + ((b * K + k) * ROWS + r * CHUNK) * es, src + ((b * ROWS + r) * K + k) * es, CHUNK * es);
  });
  return out;
}

// x [..., K] (the weights' dtype) @ W.T, W [N, K] as repack_rows8_float holds it -> [..., N] in that
// dtype, computed in float32.
torch::Tensor packed_float_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t N) {
  TORCH_CHECK(x.scalar_type() == packed.scalar_type() && packed.dim() == 4 && packed.size(2) == ROWS &&
                  packed.size(3) == CHUNK && packed.is_contiguous(),
              "packed_float_linear: x in the weights' dtype, blocks from repack_rows8_float");
  if (x.scalar_type() == at::kHalf) return packed_linear<at::Half>(x, packed, N);
  if (x.scalar_type() == at::kBFloat16) return packed_linear<at::BFloat16>(x, packed, N);
  TORCH_CHECK(x.scalar_type() == at::kFloat, "packed_float_linear: float16, bfloat16 or float32");
  return packed_linear<float>(x, packed, N);
}
