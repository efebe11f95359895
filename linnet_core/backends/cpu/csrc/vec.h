// The one place Linnet's CPU kernels touch an instruction set: a float vector `Vf` of kW lanes and the
// few operations the kernels use, for three families, chosen by the compiler's own macros (build.py
// compiles the same sources once per level with that level's flags):
//   AVX-512 (F/BW/VL, BF16, VNNI): 16 lanes, masked tails, vdpbf16ps, vpdpbusd; AMX's bf16 tiles where
//   the level has them;
//   AVX2 + FMA + F16C: 8 lanes, vpdpbusd where AVX-VNNI is present, vpmaddubsw otherwise;
//   ARM64 NEON: 4 lanes, sdot where the dot-product extension is present (i8mm's usdot where that
//   is), bfdot where bf16 is.
// Every kernel's arithmetic is written once against this header. Conversions to 16-bit types round
// to nearest even, as .to(dtype) does; the int8 block sums are exact on every level.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__) && \
    defined(__AVX512VNNI__)
#define LINNET_AVX512 1
#include <immintrin.h>
#if defined(__AMX_TILE__)
#include <sys/syscall.h>  // arch_prctl: the tiles' state
#include <unistd.h>
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LINNET_AVX2 1
#include <immintrin.h>
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define LINNET_NEON 1
#include <arm_neon.h>
#else
#error "Linnet's CPU kernels need AVX2 + FMA + F16C, AVX-512 or ARM64 NEON (build.py picks the flags)"
#endif

namespace linnet {

// ---------------------------------------------------------------------------------------------
// Float vectors: Vf holds kW float32 lanes.
#if LINNET_AVX512
using Vf = __m512;
constexpr int kW = 16;
constexpr int kRegs = 32;  // vector registers: the register tiles are sized to them
inline Vf zero() { return _mm512_setzero_ps(); }
inline Vf set1(float v) { return _mm512_set1_ps(v); }
inline Vf add(Vf a, Vf b) { return _mm512_add_ps(a, b); }
inline Vf sub(Vf a, Vf b) { return _mm512_sub_ps(a, b); }
inline Vf mul(Vf a, Vf b) { return _mm512_mul_ps(a, b); }
inline Vf div(Vf a, Vf b) { return _mm512_div_ps(a, b); }
inline Vf max(Vf a, Vf b) { return _mm512_max_ps(a, b); }
inline Vf fma(Vf a, Vf b, Vf c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c, one rounding
inline Vf abs(Vf a) { return _mm512_abs_ps(a); }
inline Vf floor(Vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
inline Vf round_even(Vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline float reduce_add(Vf a) { return _mm512_reduce_add_ps(a); }
inline float reduce_max(Vf a) { return _mm512_reduce_max_ps(a); }
inline Vf load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, Vf v) { _mm512_storeu_ps(p, v); }
inline uint32_t nan_bits(Vf a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
inline uint32_t equal_bits(Vf a, Vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
inline Vf below_to_zero(Vf x, Vf v, float limit) {  // v where x >= limit (or NaN), else 0
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(limit), _CMP_NLT_UQ), v);
}
inline Vf exp2_scale(Vf p, Vf n) { return _mm512_scalef_ps(p, n); }  // p * 2^n, n integral
inline Vf with_sign_of(Vf mag, Vf v) {  // |mag| >= 0 carrying v's sign bit
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(mag),
                                             _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN))));
}
inline Vf bf16_bits_to_f32(__m256i u16) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(u16), 16)); }
inline Vf load(const at::BFloat16* p) { return bf16_bits_to_f32(_mm256_loadu_si256((const __m256i*)p)); }
inline Vf load(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
inline void store(at::BFloat16* p, Vf v) { _mm256_storeu_si256((__m256i*)p, (__m256i)_mm512_cvtneps_pbh(v)); }
inline void store(at::Half* p, Vf v) {
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline Vf rounded(Vf v, const at::BFloat16*) { return bf16_bits_to_f32((__m256i)_mm512_cvtneps_pbh(v)); }
inline Vf rounded(Vf v, const at::Half*) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
// kW float lanes holding integral values in [-127, 127] -> int8 at p
inline void store_i8(int8_t* p, Vf v) { _mm_storeu_si128((__m128i*)p, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v))); }

#elif LINNET_AVX2
using Vf = __m256;
constexpr int kW = 8;
constexpr int kRegs = 16;
inline Vf zero() { return _mm256_setzero_ps(); }
inline Vf set1(float v) { return _mm256_set1_ps(v); }
inline Vf add(Vf a, Vf b) { return _mm256_add_ps(a, b); }
inline Vf sub(Vf a, Vf b) { return _mm256_sub_ps(a, b); }
inline Vf mul(Vf a, Vf b) { return _mm256_mul_ps(a, b); }
inline Vf div(Vf a, Vf b) { return _mm256_div_ps(a, b); }
inline Vf max(Vf a, Vf b) { return _mm256_max_ps(a, b); }
inline Vf fma(Vf a, Vf b, Vf c) { return _mm256_fmadd_ps(a, b, c); }
inline Vf abs(Vf a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
inline Vf floor(Vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
inline Vf round_even(Vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline float reduce_add(Vf a) {  // pairwise, as AVX-512's reduce: (0+4, 1+5, ...) then (.+2), (.+1)
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float reduce_max(Vf a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline Vf load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, Vf v) { _mm256_storeu_ps(p, v); }
inline uint32_t nan_bits(Vf a) { return _mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)); }
inline uint32_t equal_bits(Vf a, Vf b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ)); }
inline Vf below_to_zero(Vf x, Vf v, float limit) {
  return _mm256_and_ps(_mm256_cmp_ps(x, _mm256_set1_ps(limit), _CMP_NLT_UQ), v);
}
inline Vf exp2_scale(Vf p, Vf n) {  // p * 2^n: two exact powers of two (n clamped to [-252, 254]), each in range
  n = _mm256_min_ps(_mm256_max_ps(n, _mm256_set1_ps(-252.f)), _mm256_set1_ps(254.f));
  const __m256i ni = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(ni, 1);
  const auto pow2 = [](__m256i e) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23)); };
  return _mm256_mul_ps(_mm256_mul_ps(p, pow2(half)), pow2(_mm256_sub_epi32(ni, half)));
}
inline Vf with_sign_of(Vf mag, Vf v) { return _mm256_or_ps(mag, _mm256_and_ps(v, _mm256_set1_ps(-0.0f))); }
inline Vf bf16_bits_to_f32(__m128i u16) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(u16), 16)); }
inline __m128i f32_to_bf16_bits(Vf v) {  // to nearest even; NaN stays a (quiet) NaN
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
inline Vf load(const at::BFloat16* p) { return bf16_bits_to_f32(_mm_loadu_si128((const __m128i*)p)); }
inline Vf load(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
inline void store(at::BFloat16* p, Vf v) { _mm_storeu_si128((__m128i*)p, f32_to_bf16_bits(v)); }
inline void store(at::Half* p, Vf v) {
  _mm_storeu_si128((__m128i*)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline Vf rounded(Vf v, const at::BFloat16*) { return bf16_bits_to_f32(f32_to_bf16_bits(v)); }
inline Vf rounded(Vf v, const at::Half*) {
  return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline void store_i8(int8_t* p, Vf v) {
  const __m256i i = _mm256_cvtps_epi32(v);
  const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
  _mm_storel_epi64((__m128i*)p, _mm_packs_epi16(w, w));
}

#else  // NEON
using Vf = float32x4_t;
constexpr int kW = 4;
constexpr int kRegs = 32;
inline Vf zero() { return vdupq_n_f32(0.f); }
inline Vf set1(float v) { return vdupq_n_f32(v); }
inline Vf add(Vf a, Vf b) { return vaddq_f32(a, b); }
inline Vf sub(Vf a, Vf b) { return vsubq_f32(a, b); }
inline Vf mul(Vf a, Vf b) { return vmulq_f32(a, b); }
inline Vf div(Vf a, Vf b) { return vdivq_f32(a, b); }
inline Vf max(Vf a, Vf b) { return vmaxq_f32(a, b); }  // NaN-propagating, where x86's max takes b
inline Vf fma(Vf a, Vf b, Vf c) { return vfmaq_f32(c, a, b); }
inline Vf abs(Vf a) { return vabsq_f32(a); }
inline Vf floor(Vf a) { return vrndmq_f32(a); }
inline Vf round_even(Vf a) { return vrndnq_f32(a); }
inline float reduce_add(Vf a) { return vaddvq_f32(a); }
inline float reduce_max(Vf a) { return vmaxvq_f32(a); }
inline Vf load(const float* p) { return vld1q_f32(p); }
inline void store(float* p, Vf v) { vst1q_f32(p, v); }
inline uint32_t lane_bits(uint32x4_t m) {
  const uint32x4_t weights = {1, 2, 4, 8};
  return vaddvq_u32(vandq_u32(m, weights));
}
inline uint32_t nan_bits(Vf a) { return lane_bits(vmvnq_u32(vceqq_f32(a, a))); }
inline uint32_t equal_bits(Vf a, Vf b) { return lane_bits(vceqq_f32(a, b)); }
inline Vf below_to_zero(Vf x, Vf v, float limit) {  // x >= limit or x NaN: not (x < limit)
  return vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(v), vcltq_f32(x, vdupq_n_f32(limit))));
}
inline Vf exp2_scale(Vf p, Vf n) {  // as AVX2's
  n = vminq_f32(vmaxq_f32(n, vdupq_n_f32(-252.f)), vdupq_n_f32(254.f));
  const int32x4_t ni = vcvtnq_s32_f32(n), half = vshrq_n_s32(ni, 1);
  const auto pow2 = [](int32x4_t e) { return vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(e, vdupq_n_s32(127)), 23)); };
  return vmulq_f32(vmulq_f32(p, pow2(half)), pow2(vsubq_s32(ni, half)));
}
inline Vf with_sign_of(Vf mag, Vf v) { return vbslq_f32(vdupq_n_u32(0x80000000u), v, mag); }
inline Vf bf16_bits_to_f32(uint16x4_t u16) { return vreinterpretq_f32_u32(vshll_n_u16(u16, 16)); }
inline uint16x4_t f32_to_bf16_bits(Vf v) {
  const uint32x4_t u = vreinterpretq_u32_f32(v);
  const uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
  const uint32x4_t r = vaddq_u32(u, vaddq_u32(lsb, vdupq_n_u32(0x7FFF)));
  const uint32x4_t nan = vmvnq_u32(vceqq_f32(v, v));
  return vmovn_u32(vbslq_u32(nan, vorrq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(0x40)), vshrq_n_u32(r, 16)));
}
inline Vf load(const at::BFloat16* p) { return bf16_bits_to_f32(vld1_u16((const uint16_t*)p)); }
inline Vf load(const at::Half* p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t*)p))); }
inline void store(at::BFloat16* p, Vf v) { vst1_u16((uint16_t*)p, f32_to_bf16_bits(v)); }
inline void store(at::Half* p, Vf v) { vst1_u16((uint16_t*)p, vreinterpret_u16_f16(vcvt_f16_f32(v))); }
inline Vf rounded(Vf v, const at::BFloat16*) { return bf16_bits_to_f32(f32_to_bf16_bits(v)); }
inline Vf rounded(Vf v, const at::Half*) { return vcvt_f32_f16(vcvt_f16_f32(v)); }
inline void store_i8(int8_t* p, Vf v) {
  const int16x4_t h = vqmovn_s32(vcvtnq_s32_f32(v));
  const int8x8_t b = vqmovn_s16(vcombine_s16(h, h));
  int32_t four = vget_lane_s32(vreinterpret_s32_s8(b), 0);
  std::memcpy(p, &four, 4);
}
#endif

// ---------------------------------------------------------------------------------------------
// The 16-bit GEMVs' dot products: acc += w[0, kDotStep) * x[0, kDotStep) in float32 lanes, both
// operands 16-bit. bfloat16 uses the ISA's pair dot product where it has one (AVX-512 BF16's
// vdpbf16ps as ggml's bf16 vec_dot, ARM's bfdot), else widens both (a shift) and multiplies.
#if LINNET_AVX512
constexpr bool kBf16Dot = true;  // the ISA multiplies bf16 pairs (oneDNN's bf16 GEMM runs at speed too)
constexpr int64_t kBf16Step = 32;
inline Vf dot_bf16(Vf acc, const uint16_t* w, const uint16_t* x) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(w), (__m512bh)_mm512_loadu_si512(x));
}
#elif LINNET_NEON && defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC)
constexpr bool kBf16Dot = true;
constexpr int64_t kBf16Step = 8;
inline Vf dot_bf16(Vf acc, const uint16_t* w, const uint16_t* x) {
  return vbfdotq_f32(acc, vreinterpretq_bf16_u16(vld1q_u16(w)), vreinterpretq_bf16_u16(vld1q_u16(x)));
}
#else
constexpr bool kBf16Dot = false;
constexpr int64_t kBf16Step = kW;
inline Vf dot_bf16(Vf acc, const uint16_t* w, const uint16_t* x) {
  return fma(load((const at::BFloat16*)w), load((const at::BFloat16*)x), acc);
}
#endif

// ---------------------------------------------------------------------------------------------
// bfloat16 weights packed in blocks of 4 rows x 16 (gemv.cpp's repack_rows8_float) by the pair dot
// product, where one instruction spans two rows' 16: AVX-512 BF16's 32 lanes of bf16 take 16 of x,
// twice, against 16 of row a and 16 of row b (float32 lanes 0-7 row a's pairs, 8-15 row b's).
#if LINNET_AVX512
constexpr bool kPackedBf16Dot = true;
using Bf16Twice = __m512bh;
inline Bf16Twice x16_twice(const uint16_t* x) {
  return (__m512bh)_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)x));
}
inline Vf dot_two_rows(Vf acc, const uint16_t* w, Bf16Twice x) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(w), x);
}
inline float sum_row_a(Vf acc) { return _mm512_mask_reduce_add_ps(0x00FF, acc); }
inline float sum_row_b(Vf acc) { return _mm512_mask_reduce_add_ps(0xFF00, acc); }
#else
constexpr bool kPackedBf16Dot = false;  // NEON's bfdot spans 8 bf16, one row's half chunk: the row GEMV there
using Bf16Twice = Vf;  // declared only, for code discarded by `if constexpr (kPackedBf16Dot)`
Bf16Twice x16_twice(const uint16_t* x);
Vf dot_two_rows(Vf acc, const uint16_t* w, Bf16Twice x);
float sum_row_a(Vf acc);
float sum_row_b(Vf acc);
#endif

// ---------------------------------------------------------------------------------------------
// AMX (Intel Xeon since Sapphire Rapids): eight tile registers and a bf16 tile dot product, for bf16
// prompts over the packed blocks (gemv.cpp's amx_linear). Every tile is 16 rows x 64 bytes: 0-3 the
// float32 sums of 16 token rows x 16 weight rows, 4-5 16 token rows x 32 of K, 6-7 16 pairs of K x
// 16 weight rows (each row's pair kept together, as TDPBF16PS takes them: the "VNNI" layout).
#if LINNET_AVX512 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define LINNET_AMX 1
constexpr bool kAmx = true;
// Linux gives a process the tiles' 8 KiB of state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM for
// XTILEDATA, feature 18); where it refuses (an older kernel, a hypervisor hiding it) prompts take the
// pair-dot tiles.
inline bool amx_usable() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}
// A thread's tile shapes (palette 1, all eight 16 x 64 bytes), before its first tile instruction.
inline void amx_begin() {
  alignas(64) uint8_t config[64] = {};
  config[0] = 1;
  for (int t = 0; t < 8; ++t) {
    const uint16_t bytes = 64;
    std::memcpy(config + 16 + 2 * t, &bytes, 2);
    config[48 + t] = 16;
  }
  _tile_loadconfig(config);
}
inline void amx_end() { _tile_release(); }
// c [32, 32] float32 (rows 32 apart) = a [32 token rows, 32 * steps] (rows lda apart) @ the weight panel
// b: per step of 32 of K two B tiles (weight rows 0-15, then 16-31), 1 KiB each, as vnni_tile writes.
inline void amx_bf16_32x32(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t steps, float* c) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(4, a + s * 32, lda * 2);
    _tile_loadd(5, a + 16 * lda + s * 32, lda * 2);
    _tile_loadd(6, b + s * 1024, 64);
    _tile_loadd(7, b + s * 1024 + 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, 128);
  _tile_stored(1, c + 16, 128);
  _tile_stored(2, c + 16 * 32, 128);
  _tile_stored(3, c + 16 * 32 + 16, 128);
}
// One B tile, out [16 pairs of K][16 weight rows][2], from 16 weight rows' 32 of K (row r's first 16
// at rows[r], its next 16 at rows[r] + next): a 16 x 16 transpose of the rows' 32-bit pairs.
inline void vnni_tile(const uint16_t* const* rows, int64_t next, uint16_t* out) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i)
    r[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)rows[i])),
                              _mm256_loadu_si256((const __m256i*)(rows[i] + next)), 1);
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane: rows i, i + 1 interleaved
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // r[i + c], lane L: rows i..i+3 of column 4L + c
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // column 4L + c: lane L of r[c], r[4 + c], r[8 + c], r[12 + c]
    const __m512i x0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), x1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
    const __m512i x2 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44), x3 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
    _mm512_storeu_si512(out + (0 + c) * 32, _mm512_shuffle_i32x4(x0, x2, 0x88));
    _mm512_storeu_si512(out + (4 + c) * 32, _mm512_shuffle_i32x4(x0, x2, 0xDD));
    _mm512_storeu_si512(out + (8 + c) * 32, _mm512_shuffle_i32x4(x1, x3, 0x88));
    _mm512_storeu_si512(out + (12 + c) * 32, _mm512_shuffle_i32x4(x1, x3, 0xDD));
  }
}
#else
constexpr bool kAmx = false;  // declared only, for code discarded by `if constexpr (kAmx)`
bool amx_usable();
void amx_begin();
void amx_end();
void amx_bf16_32x32(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t steps, float* c);
void vnni_tile(const uint16_t* const* rows, int64_t next, uint16_t* out);
#endif

// ---------------------------------------------------------------------------------------------
// Eight weight rows at once, for the block-quantized linear (quant_linear.cpp): F8 holds a float32
// lane per row, S8 an int32 lane per row, Q8 the 32-byte chunks of a repacked block (chunk c: bytes
// [4c, 4c + 4) of each row's quants, rows in order). A block's sums over its 32 weights are exact
// integers on every level: sums_q4 / sums_q8 return sum_j value(row, j) * x[j] + corr where the
// stored quants are their value + 8 (q4_0 nibbles) or + 128 (q8_0, the sign bit flipped) and corr
// is -offset * sum(x) (levels that multiply signed values leave corr out for q8_0).
// Lanes<G>: the linear's view of G groups of 8 rows in one register (G = 1 on every level; G = 2 where
// LINNET_WIDE_GROUPS), so one kernel body serves both widths. Loads take the groups' blocks at p and
// p + stride.
template <int G>
struct Lanes;
#if LINNET_AVX512 || LINNET_AVX2
using F8 = __m256;
using S8 = __m256i;
struct Q8 { __m256i c[8]; };
inline F8 f8_zero() { return _mm256_setzero_ps(); }
inline F8 f8_set1(float v) { return _mm256_set1_ps(v); }
inline F8 f8_mul(F8 a, F8 b) { return _mm256_mul_ps(a, b); }
inline F8 f8_fma(F8 a, F8 b, F8 c) { return _mm256_fmadd_ps(a, b, c); }
inline F8 f8_halves(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
inline F8 f8_from(S8 v) { return _mm256_cvtepi32_ps(v); }
inline void f8_store(float* p, F8 v, int64_t n) {  // the first n lanes
  if (n >= 8) return _mm256_storeu_ps(p, v);
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, v);
  std::memcpy(p, tmp, n * sizeof(float));
}
inline Q8 load_q4(const uint8_t* q) {  // 4 chunks of nibbles: low ones weights 4c.., high ones 16 + 4c..
  Q8 w;
  for (int c = 0; c < 4; ++c) {
    const __m256i packed = _mm256_loadu_si256((const __m256i*)(q + 32 * c));
    w.c[c] = _mm256_and_si256(packed, _mm256_set1_epi8(0x0F));
    w.c[c + 4] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), _mm256_set1_epi8(0x0F));
  }
  return w;
}
#if LINNET_AVX512
// Sixteen rows at once, two groups of 8 side by side in a 512-bit register (lanes 0-7 the first
// group's rows, 8-15 the second's): each lane computes what Lanes<1>'s does, with half the instructions.
#define LINNET_WIDE_GROUPS 1  // Lanes<2> exists on this level
using Sw = __m512i;
struct Qw { __m512i c[8]; };
inline __m512i join(const uint8_t* p0, const uint8_t* p1) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)p0)),
                            _mm256_loadu_si256((const __m256i*)p1), 1);
}
template <>
struct Lanes<2> {
  using F = __m512;
  using S = Sw;
  using Q = Qw;
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F from(S v) { return _mm512_cvtepi32_ps(v); }
  static void store(float* p, F v, int64_t n) {  // the first n lanes
    _mm512_mask_storeu_ps(p, n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1), v);
  }
  static F halves(const uint8_t* p, int64_t stride) {
    const __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)p)),
                                              _mm_loadu_si128((const __m128i*)(p + stride)), 1);
    return _mm512_cvtph_ps(h);
  }
  static Q quants4(const uint8_t* p, int64_t stride) {
    Q w;
    for (int c = 0; c < 4; ++c) {
      const __m512i packed = join(p + 32 * c, p + stride + 32 * c);
      w.c[c] = _mm512_and_si512(packed, _mm512_set1_epi8(0x0F));
      w.c[c + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), _mm512_set1_epi8(0x0F));
    }
    return w;
  }
  static Q quants8(const uint8_t* p, int64_t stride) {
    Q w;
    for (int c = 0; c < 8; ++c) w.c[c] = join(p + 32 * c, p + stride + 32 * c);
    return w;
  }
};
template <bool Q4>
inline Sw sums(const Qw& w, const int8_t* x, int32_t corr) {
  const int32_t* x4 = (const int32_t*)x;
  Sw s = _mm512_set1_epi32(corr);
  for (int c = 0; c < 8; ++c) s = _mm512_dpbusd_epi32(s, w.c[c], _mm512_set1_epi32(x4[c]));
  return s;
}
#endif
#if LINNET_AVX512 || defined(__AVXVNNI__)
inline S8 dpbusd(S8 acc, __m256i u8, __m256i s8) {
#if LINNET_AVX512
  return _mm256_dpbusd_epi32(acc, u8, s8);
#else
  return _mm256_dpbusd_avx_epi32(acc, u8, s8);
#endif
}
inline Q8 load_q8(const uint8_t* q) {  // u8, 128 above each value: VNNI's unsigned operand as stored
  Q8 w;
  for (int c = 0; c < 8; ++c) w.c[c] = _mm256_loadu_si256((const __m256i*)(q + 32 * c));
  return w;
}
template <bool Q4>
inline S8 sums(const Q8& w, const int8_t* x, int32_t corr) {
  const int32_t* x4 = (const int32_t*)x;  // 4 activations per 32-bit word
  S8 s = _mm256_set1_epi32(corr);
  for (int c = 0; c < 8; ++c) s = dpbusd(s, w.c[c], _mm256_set1_epi32(x4[c]));
  return s;
}
#else  // AVX2 alone: vpmaddubsw (u8 x s8 pairs into int16) and vpmaddwd, as ggml's mul_sum_i8_pairs
inline Q8 load_q8(const uint8_t* q) {  // signed values (the stored sign bit flipped back)
  Q8 w;
  for (int c = 0; c < 8; ++c)
    w.c[c] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(q + 32 * c)), _mm256_set1_epi8((char)0x80));
  return w;
}
template <bool Q4>
inline S8 sums(const Q8& w, const int8_t* x, int32_t corr) {
  const int32_t* x4 = (const int32_t*)x;
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (Q4) {  // nibbles (< 16) x int8: 8 chunks of pair sums stay within int16 (8 * 2 * 15 * 127)
    __m256i s16 = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w.c[c], _mm256_set1_epi32(x4[c])));
    return _mm256_add_epi32(_mm256_madd_epi16(s16, ones), _mm256_set1_epi32(corr));
  } else {  // |w| (-128 reads as 128 unsigned) times x carrying w's sign: a pair is at most 2 * 128 * 127
    __m256i s = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {
      const __m256i xb = _mm256_set1_epi32(x4[c]);
      s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w.c[c], w.c[c]),
                                                                     _mm256_sign_epi8(xb, w.c[c])), ones));
    }
    return s;
  }
}
#endif

#else  // NEON: pairs of 4-lane registers
struct F8 { float32x4_t lo, hi; };
struct S8 { int32x4_t lo, hi; };
struct Q8 { int8x16_t c[8][2]; };  // q4_0's nibbles (0..15); q8_0's values, or as stored (+128) for usdot
inline F8 f8_zero() { return {vdupq_n_f32(0.f), vdupq_n_f32(0.f)}; }
inline F8 f8_set1(float v) { return {vdupq_n_f32(v), vdupq_n_f32(v)}; }
inline F8 f8_mul(F8 a, F8 b) { return {vmulq_f32(a.lo, b.lo), vmulq_f32(a.hi, b.hi)}; }
inline F8 f8_fma(F8 a, F8 b, F8 c) { return {vfmaq_f32(c.lo, a.lo, b.lo), vfmaq_f32(c.hi, a.hi, b.hi)}; }
inline F8 f8_halves(const uint8_t* p) {
  const float16x8_t h = vreinterpretq_f16_u8(vld1q_u8(p));
  return {vcvt_f32_f16(vget_low_f16(h)), vcvt_high_f32_f16(h)};
}
inline F8 f8_from(S8 v) { return {vcvtq_f32_s32(v.lo), vcvtq_f32_s32(v.hi)}; }
inline void f8_store(float* p, F8 v, int64_t n) {
  float tmp[8];
  vst1q_f32(tmp, v.lo);
  vst1q_f32(tmp + 4, v.hi);
  std::memcpy(p, tmp, std::min<int64_t>(n, 8) * sizeof(float));
}
inline Q8 load_q4(const uint8_t* q) {
  Q8 w;
  for (int c = 0; c < 4; ++c)
    for (int h = 0; h < 2; ++h) {
      const uint8x16_t packed = vld1q_u8(q + 32 * c + 16 * h);
      w.c[c][h] = vreinterpretq_s8_u8(vandq_u8(packed, vdupq_n_u8(0x0F)));
      w.c[c + 4][h] = vreinterpretq_s8_u8(vshrq_n_u8(packed, 4));
    }
  return w;
}
#if defined(__ARM_FEATURE_MATMUL_INT8)
inline Q8 load_q8(const uint8_t* q) {  // u8, 128 above each value: usdot's unsigned operand as stored
  Q8 w;
  for (int c = 0; c < 8; ++c)
    for (int h = 0; h < 2; ++h) w.c[c][h] = vreinterpretq_s8_u8(vld1q_u8(q + 32 * c + 16 * h));
  return w;
}
#else
inline Q8 load_q8(const uint8_t* q) {
  Q8 w;
  for (int c = 0; c < 8; ++c)
    for (int h = 0; h < 2; ++h) w.c[c][h] = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(q + 32 * c + 16 * h), vdupq_n_u8(0x80)));
  return w;
}
#endif
inline int32x4_t dot4(int32x4_t acc, int8x16_t w, int8x16_t x) {  // lane r += 4 products of row r
#if defined(__ARM_FEATURE_DOTPROD)
  return vdotq_s32(acc, w, x);
#else  // products into int16, pairs summed (at most 2 * 128 * 127), then pairs of pairs into int32
  const int16x8_t lo = vmull_s8(vget_low_s8(w), vget_low_s8(x)), hi = vmull_high_s8(w, x);
  return vpadalq_s16(acc, vpaddq_s16(lo, hi));
#endif
}
template <bool Q4>
inline S8 sums(const Q8& w, const int8_t* x, int32_t corr) {
  const int32_t* x4 = (const int32_t*)x;
#if defined(__ARM_FEATURE_MATMUL_INT8)  // i8mm's usdot: u8 x s8 as VNNI, both formats as stored, corr always
  const int32x4_t start = vdupq_n_s32(corr);
  S8 s{start, start};
  for (int c = 0; c < 8; ++c) {
    const int8x16_t xb = vreinterpretq_s8_s32(vdupq_n_s32(x4[c]));
    s.lo = vusdotq_s32(s.lo, vreinterpretq_u8_s8(w.c[c][0]), xb);
    s.hi = vusdotq_s32(s.hi, vreinterpretq_u8_s8(w.c[c][1]), xb);
  }
#else
  const int32x4_t start = vdupq_n_s32(Q4 ? corr : 0);  // q8_0's values are signed already
  S8 s{start, start};
  for (int c = 0; c < 8; ++c) {
    const int8x16_t xb = vreinterpretq_s8_s32(vdupq_n_s32(x4[c]));
    s.lo = dot4(s.lo, w.c[c][0], xb);
    s.hi = dot4(s.hi, w.c[c][1], xb);
  }
#endif
  return s;
}
#endif

template <>
struct Lanes<1> {  // one group: a register's lanes are its 8 rows
  using F = F8;
  using S = S8;
  using Q = Q8;
  static F zero() { return f8_zero(); }
  static F set1(float v) { return f8_set1(v); }
  static F mul(F a, F b) { return f8_mul(a, b); }
  static F fma(F a, F b, F c) { return f8_fma(a, b, c); }
  static F from(S v) { return f8_from(v); }
  static void store(float* p, F v, int64_t n) { f8_store(p, v, n); }
  static F halves(const uint8_t* p, int64_t) { return f8_halves(p); }
  static Q quants4(const uint8_t* p, int64_t) { return load_q4(p); }
  static Q quants8(const uint8_t* p, int64_t) { return load_q8(p); }
};

// The level this file was compiled for, as build.py names it (checked at load against the one asked for).
inline const char* level_name() {
#if LINNET_AMX
  return "avx512-amx";
#elif LINNET_AVX512
  return "avx512";
#elif LINNET_AVX2 && defined(__AVXVNNI__)
  return "avx2-vnni";
#elif LINNET_AVX2
  return "avx2";
#elif defined(__ARM_FEATURE_MATMUL_INT8) && defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC)
  return "neon-i8mm";
#elif defined(__ARM_FEATURE_DOTPROD) && defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC)
  return "neon-dotprod-bf16";
#elif defined(__ARM_FEATURE_DOTPROD)
  return "neon-dotprod";
#else
  return "neon";
#endif
}

// A hint to bring the line at p into L2 ahead of use (prefetcht1 on x86, PRFM PLDL2KEEP on ARM): a
// pass of several token rows, busy with their dot products, keeps its weight stream flowing with it.
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }
constexpr int64_t kPrefetchBytes = 8192;  // how far ahead of a stream (5 and 16 KiB ran slower here)
// One stream (a decode pass of one token row) is left to the hardware's prefetcher: with a hint
// 8 KiB ahead the packed GEMV's steps ran 11% slower at float32 and 6-10% at float16 on a Zen 2
// (one process stepping both builds in turn), and the row GEMV's 2% slower on a Zen 4.

inline Vf rounded(Vf v, const float*) { return v; }
inline Vf neg(Vf a) { return sub(zero(), a); }

// The value as T holds it, as a float (one element). Half goes through the vector path's own
// conversion: c10::Half's portable bit arithmetic is ~3 ns an element outside ATen's own builds.
inline float to_f32(float v) { return v; }
inline float to_f32(at::BFloat16 v) { return static_cast<float>(v); }
#if LINNET_NEON
inline float to_f32(at::Half v) { return static_cast<float>(vget_lane_f16(vreinterpret_f16_u16(vdup_n_u16(v.x)), 0)); }
#else
inline float to_f32(at::Half v) { return _cvtsh_ss(v.x); }
#endif

template <typename T>
inline T from_f32(float v) { return static_cast<T>(v); }  // to nearest even, as .to(dtype)
template <>
inline at::Half from_f32<at::Half>(float v) {
#if LINNET_NEON
  return at::Half(vget_lane_u16(vreinterpret_u16_f16(vcvt_f16_f32(vdupq_n_f32(v))), 0), at::Half::from_bits());
#else
  return at::Half(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), at::Half::from_bits());
#endif
}

// e^x, kW at once where std::exp takes one: 2^n * p(r) with r = x - n ln2 in [-ln2/2, ln2/2] and p
// of degree 7 (relative error ~1e-8, under a float32 ulp); below -104 the result is 0 as expf's
// underflow, above ~88.7 it is inf; NaN stays NaN.
inline Vf exp(Vf x) {
  const Vf n = round_even(mul(x, set1(1.44269504088896341f)));
  Vf r = sub(x, mul(n, set1(0.693359375f)));  // ln2 in two parts: n * hi is exact
  r = sub(r, mul(n, set1(-2.12194440e-4f)));
  Vf p = set1(1.f / 5040);
  for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = fma(p, r, set1(c));
  return below_to_zero(x, exp2_scale(p, n), -104.f);
}

// round(v) half away from zero, as C's roundf: floor(|v|) + floor(2 * frac), with v's sign
inline Vf round_half_away(Vf v) {
  const Vf a = abs(v), f = floor(a), frac = sub(a, f);
  return with_sign_of(add(f, floor(add(frac, frac))), v);
}

}  // namespace linnet
