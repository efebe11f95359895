// y [M, N] = x [M, K] @ W.T, W [N, K] GGUF q8_0 / q4_0 blocks (quant.py), computed as llama.cpp
// computes it: the activations rounded to int8 blocks of 32 (a float32 scale amax / 127, half away
// from zero: quant.int8_blocks gives the same values), each block's products summed in int32 by the
// ISA's int8 dot product (vec.h: VNNI's or i8mm's u8 x s8, AVX2's vpmaddubsw, ARM's sdot), then
// scaled by both blocks' scales in float32. The int32 sums are exact, so the result differs from a
// float32 matmul of the rounded activations and the dequantized weights only in the summation order.
//
// The weights are repacked once at load (`repack_rows8`, as llama.cpp's CPU_REPACK buffers do): 8 rows
// interleaved per block, so one 32-byte vector holds 4 weights of each of the 8 rows and a dot product
// lane is a row. A block then costs a few vector ops for 8 rows and no horizontal sums; row-at-a-time
// q4_0 was compute-bound at 22 GB/s on this machine class, this streams what a plain read of memory
// does. q8_0's quants are stored 128 above their value (the sign bit flipped) so both formats feed
// VNNI's u8 operand straight from memory and subtract the offset once per block, as q4_0's nibbles
// (8 above) always did: a third fewer vector ops a block than signing each operand, and ~10% faster
// over a decode step's weights. The stored blocks are the same on every level. One register kernel
// serves decode and prompts: each group of 8 rows is run against every token row while its blocks
// sit in L1; on AVX-512 (vec.h's wide groups) a pass of PAIR_MIN_ROWS token rows or more takes two
// groups at once (group_dot's G = 2, vec.h's Lanes<2>).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "dynamic_for.h"
#include "vec.h"

torch::Tensor huge_page_zeros(at::IntArrayRef sizes, at::ScalarType dtype);

namespace {

constexpr int64_t BLOCK = 32;
constexpr int64_t ROWS = 8;    // weight rows interleaved in a group (one dot-product lane each)
// token rows per register pass: with 32 wide registers 8 accumulators beside a block's 8 chunks, so a
// prompt decodes each block's quants once per 8 token rows; 4 with 16 (and on NEON, whose chunks take 16)
constexpr int MAX_M = linnet::kW == 16 ? 8 : 4;
constexpr int64_t MIN_GROUPS_PER_TASK = 8;  // a thread's least take (streaming_for): 36 KiB of q4_0 at K = 1024
// Token rows from which a pass takes two groups (AVX-512): fewer (decode, a check of k <= 4 drafts)
// keep one group. On a Zen 5, in turns, weights streamed from memory, 3-5 rows ran 1.1-1.5x as fast
// in one group (the 4B MLP's shape, q4_0: 5 rows 0.46 against 0.49 ms, 4 rows 0.36 against 0.58);
// from 6 rows the 191M's shapes ran 1.3x as fast in pairs (q4_0, 6 rows: 0.057 against 0.074 ms).
constexpr int64_t PAIR_MIN_ROWS = 6;

enum Format : int64_t { Q8_0 = 0, Q4_0 = 1 };

inline int64_t block_bytes(int64_t fmt) { return fmt == Q8_0 ? 34 : 18; }
inline int64_t quant_bytes(int64_t fmt) { return block_bytes(fmt) - 2; }
inline int32_t quant_offset(int64_t fmt) { return fmt == Q8_0 ? 128 : 8; }  // stored = value + offset

// The activations as int8 blocks: q [M, K], scales d [M, nb], and -offset * each block's sum,
// corr [M, nb], where the block's dot product with weights stored `offset` above their value starts.
struct Acts {
  const int8_t* q;
  const float* d;
  const int32_t* corr;
  int64_t K;
};

using namespace linnet;

void quantize_acts(const float* x, int64_t blocks, int32_t offset, int8_t* q, float* d, int32_t* corr) {
  at::parallel_for(0, blocks, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {  // row m's block b is i = m * nb + b: rows are contiguous
      const float* xb = x + i * BLOCK;
      Vf top = zero();
      for (int64_t j = 0; j < BLOCK; j += kW) top = max(top, abs(load(xb + j)));
      const float scale = reduce_max(top) / 127.0f;
      const Vf inv = set1(scale == 0.0f ? 0.0f : 1.0f / scale);
      int8_t* qb = q + i * BLOCK;
      for (int64_t j = 0; j < BLOCK; j += kW) store_i8(qb + j, round_half_away(mul(load(xb + j), inv)));
      int32_t sum = 0;
      for (int64_t j = 0; j < BLOCK; ++j) sum += qb[j];
      d[i] = scale;
      corr[i] = -offset * sum;
    }
  });
}

// A repacked block of a group: the 8 rows' f16 scales (16 bytes), then the quants as 32-byte chunks,
// chunk c holding bytes [4c, 4c + 4) of each row's quants in row order. q4_0's chunk c gives weights
// 4c..4c+3 (low nibbles) and 16+4c..16+4c+3 (high nibbles); q8_0's chunk c weights 4c..4c+3.
// MM, the token rows, is a template argument: with a run-time count the accumulators live on the
// stack, and decode (MM = 1) ran ~7% slower a step than with them in registers. G groups at once (g and
// the next, gstride on, whose outputs follow g's in y), each lane computing what one group's does: a
// prompt's passes are bound by the vector ops, not memory, and with G = 2 each op does two groups' work
// (on a Zen 5 a 128-token prompt at the 4B MLP's shape took 6.2 ms in q4_0, 10.3 a group at a time;
// q8_0 7.2 and 10.9).
template <int64_t F, int MM, int G>
inline void group_dot(const Acts& a, int64_t m0, const uint8_t* g, int64_t gstride, int64_t nb, float* y,
                      int64_t N, int64_t valid) {
  using L = Lanes<G>;
  constexpr int64_t gbytes = ROWS * (F == Q8_0 ? 34 : 18);
  typename L::F acc[MM];
  for (int m = 0; m < MM; ++m) acc[m] = L::zero();
  for (int64_t b = 0; b < nb; ++b, g += gbytes) {
    // past a group's end: the next's. One token row too: on a Zen 5, q4_0 streamed 10-20% faster so.
    for (int64_t o = 0; o < gbytes; o += 64)
      for (int i = 0; i < G; ++i) prefetch_l2(g + i * gstride + kPrefetchBytes + o);
    const typename L::F wd = L::halves(g, gstride);  // the rows' scales
    const typename L::Q w = F == Q4_0 ? L::quants4(g + 16, gstride) : L::quants8(g + 16, gstride);
    for (int m = 0; m < MM; ++m) {
      const int64_t i = (m0 + m) * nb + b;
      const typename L::S s = sums<F == Q4_0>(w, a.q + i * BLOCK, a.corr[i]);
      acc[m] = L::fma(L::from(s), L::mul(wd, L::set1(a.d[i])), acc[m]);
    }
  }
  for (int m = 0; m < MM; ++m) L::store(y + (m0 + m) * N, acc[m], valid);  // a last group padded past N
}

template <int64_t F, int G>
inline void group_rows(const Acts& a, int64_t m0, int mm, const uint8_t* g, int64_t gstride, int64_t nb, float* y,
                       int64_t N, int64_t valid) {
  switch (mm) {
    case 1: return group_dot<F, 1, G>(a, m0, g, gstride, nb, y, N, valid);
    case 2: return group_dot<F, 2, G>(a, m0, g, gstride, nb, y, N, valid);
    case 3: return group_dot<F, 3, G>(a, m0, g, gstride, nb, y, N, valid);
    case 4: return group_dot<F, 4, G>(a, m0, g, gstride, nb, y, N, valid);
  }
  if constexpr (MAX_M == 8) {
    switch (mm) {
      case 5: return group_dot<F, 5, G>(a, m0, g, gstride, nb, y, N, valid);
      case 6: return group_dot<F, 6, G>(a, m0, g, gstride, nb, y, N, valid);
      case 7: return group_dot<F, 7, G>(a, m0, g, gstride, nb, y, N, valid);
      case 8: return group_dot<F, 8, G>(a, m0, g, gstride, nb, y, N, valid);
    }
  }
}

template <int64_t F>
void matmul(const Acts& a, int64_t M, const uint8_t* w, int64_t N, float* y) {
  const int64_t nb = a.K / BLOCK, groups = (N + ROWS - 1) / ROWS, gstride = nb * ROWS * block_bytes(F);
  streaming_for(groups, MIN_GROUPS_PER_TASK, [&](int64_t g0, int64_t g1) {
    int64_t grp = g0;
#if LINNET_WIDE_GROUPS
    if (M >= PAIR_MIN_ROWS)
      for (; grp + 1 < g1; grp += 2)
        for (int64_t m0 = 0; m0 < M; m0 += MAX_M)
          group_rows<F, 2>(a, m0, (int)std::min<int64_t>(MAX_M, M - m0), w + grp * gstride, gstride, nb,
                           y + grp * ROWS, N, std::min(2 * ROWS, N - grp * ROWS));
#endif
    for (; grp < g1; ++grp)
      for (int64_t m0 = 0; m0 < M; m0 += MAX_M)
        group_rows<F, 1>(a, m0, (int)std::min<int64_t>(MAX_M, M - m0), w + grp * gstride, gstride, nb,
                         y + grp * ROWS, N, std::min(ROWS, N - grp * ROWS));
  });
}

}  // namespace

torch::Tensor repack_rows8(const torch::Tensor& w, int64_t fmt) {
  TORCH_CHECK(fmt == Q8_0 || fmt == Q4_0, "repack_rows8: format 0 (q8_0) or 1 (q4_0)");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.size(1) % block_bytes(fmt) == 0,
              "repack_rows8: uint8 blocks [N, K / 32 * block bytes]");
  const auto src = w.contiguous();
  const int64_t N = src.size(0), bb = block_bytes(fmt), qb = quant_bytes(fmt), nb = src.size(1) / bb;
  const int64_t groups = (N + ROWS - 1) / ROWS;
  auto out = huge_page_zeros({groups, nb * ROWS * bb}, at::kByte);  // padding rows: scale 0, quants 0
  const uint8_t* s = src.data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t grp = g0; grp < g1; ++grp)
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* dst = o + (grp * nb + b) * ROWS * bb;
        for (int64_t r = 0; r < ROWS && grp * ROWS + r < N; ++r) {
          const uint8_t* blk = s + (grp * ROWS + r) * src.size(1) + b * bb;
          std::memcpy(dst + 2 * r, blk, 2);
          for (int64_t c = 0; c < qb / 4; ++c) std::memcpy(dst + 16 + 32 * c + 4 * r, blk + 2 + 4 * c, 4);
        }
        if (fmt == Q8_0)  // int8 w -> u8 w + 128: flip each quant's sign bit
          for (int64_t j = 16; j < ROWS * bb; ++j) dst[j] ^= 0x80;
      }
  });
  return out;
}

// Rows `ids` [...] of a token table held as plain GGUF blocks [V, K / 32 * block bytes], as float32
// [..., K]: exactly quant.dequantize's values (an f16 scale times a small integer is exact).
torch::Tensor dequant_rows(const torch::Tensor& blocks, const torch::Tensor& ids, int64_t fmt) {
  TORCH_CHECK(fmt == Q8_0 || fmt == Q4_0, "dequant_rows: format 0 (q8_0) or 1 (q4_0)");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous() &&
              blocks.size(1) % block_bytes(fmt) == 0, "dequant_rows: contiguous uint8 blocks [V, K / 32 * block bytes]");
  const auto flat = ids.reshape({-1}).to(at::kLong).contiguous();
  const int64_t V = blocks.size(0), nb = blocks.size(1) / block_bytes(fmt), K = nb * BLOCK, n = flat.numel();
  auto out = torch::empty({n, K}, blocks.options().dtype(at::kFloat));
  const int64_t* idp = flat.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(idp[i] >= 0 && idp[i] < V, "dequant_rows: id ", idp[i], " outside the table");
  float* o = out.data_ptr<float>();
  const uint8_t* base = blocks.data_ptr<uint8_t>();
  for (int64_t i = 0; i < n; ++i)
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = base + idp[i] * blocks.size(1) + b * block_bytes(fmt);
      at::Half h;
      std::memcpy(&h, blk, 2);
      const float d = to_f32(h);
      float* row = o + i * K + b * BLOCK;
      if (fmt == Q8_0) {
        for (int64_t j = 0; j < BLOCK; ++j) row[j] = static_cast<float>(static_cast<int8_t>(blk[2 + j])) * d;
      } else {  // byte j: weight j in the low nibble, weight j + 16 in the high one; offset 8
        for (int64_t j = 0; j < BLOCK / 2; ++j) {
          row[j] = static_cast<float>((blk[2 + j] & 0x0F) - 8) * d;
          row[j + BLOCK / 2] = static_cast<float>((blk[2 + j] >> 4) - 8) * d;
        }
      }
    }
  auto sizes = ids.sizes().vec();
  sizes.push_back(K);
  return out.view(sizes);
}

torch::Tensor quant_linear(const torch::Tensor& x, const torch::Tensor& w, int64_t fmt, int64_t out_features) {
  TORCH_CHECK(fmt == Q8_0 || fmt == Q4_0, "quant_linear: format 0 (q8_0) or 1 (q4_0)");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(),
              "quant_linear: float32 x, blocks w from repack_rows8");
  const int64_t N = out_features, K = x.size(-1), nb = K / BLOCK;
  TORCH_CHECK(K % BLOCK == 0 && w.size(0) == (N + ROWS - 1) / ROWS && w.size(1) == nb * ROWS * block_bytes(fmt),
              "quant_linear: x has ", K, " features, the repacked weight ", w.sizes());
  const auto x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  auto q = torch::empty({M, K}, x.options().dtype(at::kChar));
  auto d = torch::empty({M, nb}, x.options());
  auto corr = torch::empty({M, nb}, x.options().dtype(at::kInt));
  quantize_acts(x2.data_ptr<float>(), M * nb, quant_offset(fmt), q.data_ptr<int8_t>(), d.data_ptr<float>(),
                corr.data_ptr<int32_t>());
  const Acts acts{q.data_ptr<int8_t>(), d.data_ptr<float>(), corr.data_ptr<int32_t>(), K};
  auto y = torch::empty({M, N}, x.options());
  if (fmt == Q8_0) matmul<Q8_0>(acts, M, w.data_ptr<uint8_t>(), N, y.data_ptr<float>());
  else matmul<Q4_0>(acts, M, w.data_ptr<uint8_t>(), N, y.data_ptr<float>());
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return y.view(sizes);
}

// Independent GEMVs in one parallel pass: job j multiplies row rows[j] of x [M, K] (float32, quantized
// to int8 blocks once here) by ws[j] (repack_rows8's blocks of `fmt`, N rows) into row j of the result
// [jobs, N]. A mixture of experts' decode step runs its chosen experts' small matrices so: one fork and
// join for all of them, where a call each paid one per matrix (q4_0 at Qwen3-30B-A3B's experts on a
// Zen 5: 24 calls of 0.9 MB streamed ~50 GB/s).
torch::Tensor quant_gemv_many(const torch::Tensor& x, const std::vector<torch::Tensor>& ws,
                              const std::vector<int64_t>& rows, int64_t fmt, int64_t N) {
  TORCH_CHECK(fmt == Q8_0 || fmt == Q4_0, "quant_gemv_many: format 0 (q8_0) or 1 (q4_0)");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && ws.size() == rows.size(),
              "quant_gemv_many: float32 x [M, K], one row index per weight");
  const auto x2 = x.contiguous();
  const int64_t M = x2.size(0), K = x2.size(1), nb = K / BLOCK, bb = block_bytes(fmt);
  const int64_t groups = (N + ROWS - 1) / ROWS, gstride = nb * ROWS * bb, J = ws.size();
  TORCH_CHECK(K % BLOCK == 0, "quant_gemv_many: ", K, " features are not whole blocks");
  std::vector<const uint8_t*> w(J);
  for (int64_t j = 0; j < J; ++j) {
    TORCH_CHECK(ws[j].scalar_type() == at::kByte && ws[j].is_contiguous() && ws[j].dim() == 2 &&
                    ws[j].size(0) == groups && ws[j].size(1) == gstride && rows[j] >= 0 && rows[j] < M,
                "quant_gemv_many: weight ", j, " is not ", N, " rows of ", K, " repacked, or its row is outside x");
    w[j] = ws[j].data_ptr<uint8_t>();
  }
  auto q = torch::empty({M, K}, x.options().dtype(at::kChar));
  auto d = torch::empty({M, nb}, x.options());
  auto corr = torch::empty({M, nb}, x.options().dtype(at::kInt));
  quantize_acts(x2.data_ptr<float>(), M * nb, quant_offset(fmt), q.data_ptr<int8_t>(), d.data_ptr<float>(),
                corr.data_ptr<int32_t>());
  auto y = torch::empty({J, N}, x.options());
  float* yp = y.data_ptr<float>();
  streaming_for(J * groups, MIN_GROUPS_PER_TASK, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t j = i / groups, grp = i % groups, r = rows[j];
      const Acts a{q.data_ptr<int8_t>() + r * K, d.data_ptr<float>() + r * nb, corr.data_ptr<int32_t>() + r * nb, K};
      const int64_t valid = std::min(ROWS, N - grp * ROWS);
      const uint8_t* g = w[j] + grp * gstride;
      float* out = yp + j * N + grp * ROWS;
      if (fmt == Q8_0) group_rows<Q8_0, 1>(a, 0, 1, g, gstride, nb, out, N, valid);
      else group_rows<Q4_0, 1>(a, 0, 1, g, gstride, nb, out, N, valid);
    }
  });
  return y;
}
