// Float32, bfloat16 and float16 values in and out of AVX-512 registers, for the kernels that run on
// each of the three (decode attention, the step's small ops). Every conversion to a 16-bit type
// rounds to nearest even, as .to(dtype) does.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstdint>

namespace linnet {

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
inline void store16(at::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}
inline void store16(at::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

// 16 floats as T holds them, back in float32 (what an ATen op on T tensors writes).
inline __m512 rounded(__m512 v, const float*) { return v; }
inline __m512 rounded(__m512 v, const at::BFloat16*) {
  const __m512i wide = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 rounded(__m512 v, const at::Half*) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

// One element. c10::Half converts in portable bit arithmetic outside ATen's own AVX builds (~3 ns
// each: a float16 RMSNorm of 2560 features took 9 us, bfloat16's 2); F16C does it in one instruction.
inline float to_f32(float v) { return v; }
inline float to_f32(at::BFloat16 v) { return static_cast<float>(v); }
inline float to_f32(at::Half v) { return _cvtsh_ss(v.x); }

template <typename T>
inline T from_f32(float v) { return static_cast<T>(v); }
template <>
inline at::Half from_f32<at::Half>(float v) {
  return at::Half(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT), at::Half::from_bits());
}

// e^x, 16 at once where std::exp takes one: 2^n * p(r) with r = x - n ln2 in [-ln2/2, ln2/2] and p
// of degree 7 (relative error ~1e-8, under a float32 ulp); below -104 the result is 0 as expf's
// underflow, above ~88.7 it is inf; NaN stays NaN.
inline __m512 exp16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln2 in two parts: n * hi is exact
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  const __mmask16 kept = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-104.f), _CMP_NLT_UQ);
  return _mm512_maskz_mov_ps(kept, _mm512_scalef_ps(p, n));
}

// The first min(left, 16) lanes.
inline __mmask16 tail(int64_t left) { return left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1); }

}  // namespace linnet
