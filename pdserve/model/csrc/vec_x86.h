// The float vector operations the portable fp32 kernels (cpu_kernels_fp32.cpp) are written
// against, for x86-64: AVX2 + FMA (8 lanes), or AVX-512 (16 lanes) when the build defines
// PD_VEC_AVX512. A port to another ISA (Arm NEON: 4 lanes, float32x4_t, vfmaq_f32, ...)
// provides the same names and constants in a header of its own; nothing else changes.
//
// Register budgets are per ISA: AVX2 has 16 vector registers, AVX-512 32. The kernels
// size their register tiles from the constants below, not from the lane count.

#pragma once

#include <immintrin.h>
#include <stdint.h>

namespace vec {

#if defined(PD_VEC_AVX512)

#if !defined(__AVX512F__)
#error "PD_VEC_AVX512 needs an AVX-512 build (-march=x86-64-v4)"
#endif

constexpr int kLanes = 16;
constexpr int kTileRows = 4;      // linear: rows of x per register tile
constexpr int kTileWeights = 6;   // linear: weight rows per register tile (24 accumulators)
constexpr int kAccumulators = 24;  // decode attention's value pass
using F = __m512;

inline F zero() { return _mm512_setzero_ps(); }
inline F set1(float v) { return _mm512_set1_ps(v); }
inline F load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, F v) { _mm512_storeu_ps(p, v); }
// 16 int8 values widened to float.
inline F load_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline F add(F a, F b) { return _mm512_add_ps(a, b); }
inline F sub(F a, F b) { return _mm512_sub_ps(a, b); }
inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
inline F div(F a, F b) { return _mm512_div_ps(a, b); }
inline F max(F a, F b) { return _mm512_max_ps(a, b); }
inline F min(F a, F b) { return _mm512_min_ps(a, b); }
inline F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }  // a b + c
inline F fmsub(F a, F b, F c) { return _mm512_fmsub_ps(a, b, c); }  // a b - c
inline F round(F x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline float reduce_add(F v) { return _mm512_reduce_add_ps(v); }
inline float reduce_max(F v) { return _mm512_reduce_max_ps(v); }
// 2^n for integral n in [-126, 127].
inline F pow2i(F n) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}

// Lane i of the result = the sum of all lanes of x[j], where j = 4 (i % 4) + i / 4: the
// order the shuffle network leaves them in. Callers that can store their inputs in that
// order (the bf16 decode attention does) skip transpose_add's permute.
inline F transpose_add_shuffled(const F* x) {
  __m512 y[8], z[4];
  for (int k = 0; k < 8; k++)
    y[k] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * k], x[2 * k + 1], 0x44),
                         _mm512_shuffle_f32x4(x[2 * k], x[2 * k + 1], 0xEE));
  for (int k = 0; k < 4; k++)
    z[k] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * k], y[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(y[2 * k], y[2 * k + 1], 0xDD));
  const __m512 w0 = _mm512_add_ps(_mm512_unpacklo_ps(z[0], z[1]), _mm512_unpackhi_ps(z[0], z[1]));
  const __m512 w1 = _mm512_add_ps(_mm512_unpacklo_ps(z[2], z[3]), _mm512_unpackhi_ps(z[2], z[3]));
  const __m512d a = _mm512_castps_pd(w0), b = _mm512_castps_pd(w1);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                       _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
}

// Lane i of the result = the sum of all lanes of x[i], for i < kLanes.
inline F transpose_add(const F* x) {
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, transpose_add_shuffled(x));
}

#else  // AVX2 + FMA

#if !defined(__AVX2__) || !defined(__FMA__)
#error "the fp32 kernels need AVX2 and FMA (-march=x86-64-v3)"
#endif

constexpr int kLanes = 8;
constexpr int kTileRows = 4;      // 4 x 3 accumulators + 3 weight vectors + 1 x vector = 16
constexpr int kTileWeights = 3;
constexpr int kAccumulators = 12;
using F = __m256;

inline F zero() { return _mm256_setzero_ps(); }
inline F set1(float v) { return _mm256_set1_ps(v); }
inline F load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, F v) { _mm256_storeu_ps(p, v); }
// 8 int8 values widened to float.
inline F load_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline F add(F a, F b) { return _mm256_add_ps(a, b); }
inline F sub(F a, F b) { return _mm256_sub_ps(a, b); }
inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
inline F div(F a, F b) { return _mm256_div_ps(a, b); }
inline F max(F a, F b) { return _mm256_max_ps(a, b); }
inline F min(F a, F b) { return _mm256_min_ps(a, b); }
inline F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
inline F fmsub(F a, F b, F c) { return _mm256_fmsub_ps(a, b, c); }
inline F round(F x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline float reduce_add(F v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float reduce_max(F v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline F pow2i(F n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}

// Lane i of the result = the sum of all lanes of x[i], for i < 8: three rounds of
// horizontal adds, then the two 128-bit halves of each sum added.
inline F transpose_add(const F* x) {
  const __m256 a01 = _mm256_hadd_ps(x[0], x[1]), a23 = _mm256_hadd_ps(x[2], x[3]);
  const __m256 a45 = _mm256_hadd_ps(x[4], x[5]), a67 = _mm256_hadd_ps(x[6], x[7]);
  const __m256 b0 = _mm256_hadd_ps(a01, a23), b4 = _mm256_hadd_ps(a45, a67);
  // b0 = [x0 x1 x2 x3 (low halves) | x0 x1 x2 x3 (high halves)], b4 the same for x4..x7.
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b4, 0x20), _mm256_permute2f128_ps(b0, b4, 0x31));
}

#endif

// e^x per lane: x = n ln2 + r with |r| <= ln2 / 2, a degree-6 polynomial for e^r, times
// 2^n. Relative error ~2e-7 (float's own resolution); -inf and anything below -87 give
// ~1e-38, which softmax and SiLU treat as 0.
inline F exp(F x) {
  x = max(x, set1(-87.0f));
  x = min(x, set1(88.0f));
  const F n = round(mul(x, set1(1.44269504088896341f)));
  F r = fmadd(n, set1(-0.693359375f), x);  // ln2 in two parts: the first is exact in n
  r = fmadd(n, set1(2.12194440e-4f), r);
  F p = set1(1.0f / 720);
  p = fmadd(p, r, set1(1.0f / 120));
  p = fmadd(p, r, set1(1.0f / 24));
  p = fmadd(p, r, set1(1.0f / 6));
  p = fmadd(p, r, set1(0.5f));
  p = fmadd(p, r, set1(1.0f));
  p = fmadd(p, r, set1(1.0f));
  return mul(p, pow2i(n));
}

// GeLU's tanh form (Gemma's gelu_pytorch_tanh): 0.5 x (1 + tanh u) with u = sqrt(2/pi)
// (x + 0.044715 x^3), computed as x sigmoid(2u), the same value without tanh's
// cancellation near 0.
inline F gelu_tanh(F x) {
  const F x3 = mul(mul(x, x), x);
  const F two_u = mul(set1(2.0f * 0.7978845608028654f), fmadd(x3, set1(0.044715f), x));
  return div(x, add(set1(1.0f), exp(sub(zero(), two_u))));
}

inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }

}  // namespace vec
