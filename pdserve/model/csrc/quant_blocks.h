// GGUF's block formats as the linear kernels read them (quant_linear.h): what a block
// holds and how a kernel step unpacks it, shared by the bf16 and float32 libraries.
//
// Formats (ggml's, scales in fp16), weight i of a block of 32:
//   Q8_0  {d; int8 q[32]}          w = d q[i]                          34 bytes
//   Q4_0  {d; uint8 qs[16]}        w = d (nibble(i) - 8)               18 bytes
//   Q4_1  {d; m; uint8 qs[16]}     w = d nibble(i) + m                 20 bytes
//   Q5_0  {d; qh[4]; qs[16]}       w = d (nibble(i) + 16 bit(i) - 16)  22 bytes
//   Q5_1  {d; m; qh[4]; qs[16]}    w = d (nibble(i) + 16 bit(i)) + m   24 bytes
// where nibble(i) = qs[i] & 15 for i < 16 and qs[i - 16] >> 4 above, bit(i) = bit i of qh.
// K-quants: super-blocks of 256 weights, 8 sub-blocks of 32 with 6-bit scales (Q4_K, Q5_K:
// w = d sc_j q - dmin m_j) or 16 of 16 with int8 scales (Q6_K: w = d sc (q - 32)); the
// layouts are at `k_quants` below. Every kernel walks a row 32 weights at a time; a K-quant
// super-block is 8 such steps, its scales unpacked once for all of them (`k_subblocks`:
// 1.3-1.8x faster than unpacking a sub-block's scales at each step).
//
// AVX2 + FMA + F16C intrinsics (x86-64-v3), 16 lanes where the build has AVX-512.

#pragma once

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <type_traits>
#include <vector>

namespace quant {

// ggml's type numbers
enum Type : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

constexpr int kBlock = 32;  // weights a kernel step takes (a K-quant's sub-block)

constexpr int64_t block_bytes(int64_t type) {
  switch (type) {
    case kQ8_0: return 34;
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ5_0: return 22;
    case kQ5_1: return 24;
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    case kQ6_K: return 210;
    default: return 0;
  }
}

constexpr int64_t block_weights(int64_t type) { return type >= kQ4_K ? 256 : kBlock; }

constexpr int64_t row_bytes(int64_t type, int64_t K) { return K / block_weights(type) * block_bytes(type); }

// The element types the libraries compute in: float, and bf16 carried as uint16_t.
template <typename T>
struct Elem;
template <>
struct Elem<float> {
  static inline float load(const float* p) { return *p; }
  static inline void store(float* p, float v) { *p = v; }
#if defined(__AVX512F__)
  static inline void storev(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
#else
  static inline void storev(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
#endif
};
template <>
struct Elem<uint16_t> {
  static inline float load(const uint16_t* p) {
    const uint32_t u = static_cast<uint32_t>(*p) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
  }
  static inline void store(uint16_t* p, float f) {  // round to nearest even
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFF + ((u >> 16) & 1);
    *p = static_cast<uint16_t>(u >> 16);
  }
  static inline void store8(uint16_t* p, __m256 v) {  // the same rounding, 8 lanes
    __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
#if defined(__AVX512BF16__)
  static inline void storev(uint16_t* p, __m512 v) {  // the same rounding, one instruction
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
  }
#elif defined(__AVX512F__)
  static inline void storev(uint16_t* p, __m512 v) {
    store8(p, _mm512_castps512_ps256(v));
    store8(p + 8, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  }
#else
  static inline void storev(uint16_t* p, __m256 v) { store8(p, v); }
#endif
};

inline float half(const uint8_t* p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

#if defined(__AVX512F__)
constexpr int kVecs = 2;  // float vectors a block fills
using V = __m512;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline V vfmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline float vsum(V v) { return _mm512_reduce_add_ps(v); }
#else
constexpr int kVecs = 4;
using V = __m256;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline V vfmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline float vsum(V v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif
constexpr int kLanes = kBlock / kVecs;

// 32 weights a * q + c as floats in kVecs registers, from two 16-byte halves of unsigned
// q with a scale and offset each: the formats after the first three.
inline void widen(const __m128i q[2], const float a[2], const float c[2], V out[kVecs]) {
#if defined(__AVX512F__)
  for (int h = 0; h < 2; h++)
    out[h] = _mm512_fmadd_ps(_mm512_set1_ps(a[h]), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q[h])),
                             _mm512_set1_ps(c[h]));
#else
  for (int h = 0; h < 2; h++)
    for (int i = 0; i < 2; i++)
      out[2 * h + i] = _mm256_fmadd_ps(
          _mm256_set1_ps(a[h]),
          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(i ? _mm_srli_si128(q[h], 8) : q[h])),
          _mm256_set1_ps(c[h]));
#endif
}

inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

// (v >> shift) & mask in every byte (shift < 8: bits a 16-bit shift brings in from the
// next byte are above the mask).
inline __m128i bits(__m128i v, int shift, int mask) {
  return _mm_and_si128(_mm_srli_epi16(v, shift), _mm_set1_epi8(static_cast<char>(mask)));
}

// 16 bits -> 16 bytes of 16 (bit set) or 0: Q5_0/Q5_1's fifth bits.
inline __m128i fifth_bits(uint16_t b) {
  const __m128i spread = _mm_shuffle_epi8(_mm_set1_epi16(static_cast<short>(b)),
                                          _mm_set_epi8(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0));
  const __m128i select = _mm_set_epi8(-128, 64, 32, 16, 8, 4, 2, 1, -128, 64, 32, 16, 8, 4, 2, 1);
  return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(spread, select), select), _mm_set1_epi8(16));
}

// Q4_K/Q5_K: the 8 sub-blocks' 6-bit scales and mins, as ggml packs them in 12 bytes
// (ggml's get_scale_min_k4), as 16 bytes: sub-block j's scale in byte j, its min in 8 + j.
// Bytes 0-3 of the 12 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; 4-7
// the same for the mins; 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7
// (high nibble). Vector code: unpacked bit by bit in scalar code this cost a fifth of a
// one-row Q4_K linear's time (bench/quant_linear_probe.py).
inline __m128i k4_scale_bytes(const uint8_t* packed) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed));  // 12 bytes used
  // low bits: scale j < 4 from byte j, j >= 4 from byte 4 + j; min j < 4 from 4 + j, j >= 4
  // from the high nibble of 4 + j
  const __m128i low = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
  const __m128i low_bits = _mm_and_si128(_mm_blend_epi32(low, _mm_srli_epi16(low, 4), 0x8),
                                         _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15));
  // top 2 bits of scale j >= 4 from byte j - 4, of min j >= 4 from byte j, moved to bits 4-5
  const __m128i top = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
  return _mm_or_si128(low_bits, _mm_srli_epi16(_mm_and_si128(top, _mm_set1_epi8(static_cast<char>(0xC0))), 2));
}

// A Q5_0/Q5_1 block {d; [m;] qh[4]; qs[16]}: its q as two 16-byte halves, with the scale a
// and offset c (w = a q + c).
template <int64_t kType>
inline void q5_block(const uint8_t* blk, __m128i q[2], float a[2], float c[2]) {
  const int at = kType == kQ5_1 ? 4 : 2;
  uint32_t qh;
  memcpy(&qh, blk + at, 4);
  const __m128i qs = load16(blk + at + 4);
  q[0] = _mm_or_si128(bits(qs, 0, 15), fifth_bits(qh & 0xFFFF));
  q[1] = _mm_or_si128(bits(qs, 4, 15), fifth_bits(qh >> 16));
  a[0] = a[1] = half(blk);
  c[0] = c[1] = kType == kQ5_1 ? half(blk + 2) : -16.0f * a[0];
}

// A K-quant super-block's scales, computed once for its 8 sub-blocks: sub-block j's halves
// h are w = a[j][h] q + c[j][h].
template <int64_t kType>
inline void k_scales(const uint8_t* blk, float a[8][2], float c[8][2]) {
  // 16 bytes as 16 floats times `scale`, 8 at a time (the scalar loop's products)
  auto scaled = [](__m128i bytes, bool is_signed, float scale, float* out) {
    for (int i = 0; i < 2; i++) {
      const __m128i eight = i ? _mm_srli_si128(bytes, 8) : bytes;
      const __m256i ints = is_signed ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight);
      _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(ints)));
    }
  };
  if constexpr (kType == kQ6_K) {  // int8 scales[16] at 192, one per 16 weights; d at 208
    scaled(load16(blk + 192), true, half(blk + 208), &a[0][0]);
    scaled(load16(blk + 192), true, -32.0f * half(blk + 208), &c[0][0]);
  } else {  // d, dmin, then 6-bit scales and mins packed in 12 bytes: one a pair of halves
    const __m128i sm = k4_scale_bytes(blk + 4);
    scaled(_mm_shuffle_epi8(sm, _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7)), false, half(blk), &a[0][0]);
    scaled(_mm_shuffle_epi8(sm, _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15)), false,
           -half(blk + 2), &c[0][0]);
  }
}

// Sub-block J's q as two 16-byte halves (J a constant: every shift an immediate).
// Q4_K {d; dmin; scales[12]; qs[128]} and Q5_K {...; qh[32]; qs[128]}: sub-blocks 2p and
// 2p+1 are the low and high nibbles of qs[32p..32p+31]; Q5_K's fifth bit of weight l of
// sub-block J is bit J of qh[l]. Q6_K {ql[128]; qh[64]; scales[16]; d}: in half n = J / 4
// of the super-block, group r = J % 4 takes nibble r / 2 of ql[64n + 32(r % 2) + l] and bits
// 2r, 2r+1 of qh[32n + l].
template <int64_t kType, int J>
inline void k_quants(const uint8_t* blk, __m128i q[2]) {
  const __m128i low4 = _mm_set1_epi8(15);
  for (int h = 0; h < 2; h++) {
    if constexpr (kType == kQ6_K) {
      constexpr int n = J / 4, r = J % 4;
      const __m128i low = _mm_and_si128(_mm_srli_epi16(load16(blk + 64 * n + 32 * (r % 2) + 16 * h), 4 * (r / 2)), low4);
      const __m128i high = _mm_and_si128(_mm_srli_epi16(load16(blk + 128 + 32 * n + 16 * h), 2 * r), _mm_set1_epi8(3));
      q[h] = _mm_or_si128(low, _mm_slli_epi16(high, 4));
    } else {
      const uint8_t* qs = blk + (kType == kQ5_K ? 48 : 16) + 32 * (J / 2);
      q[h] = _mm_and_si128(_mm_srli_epi16(load16(qs + 16 * h), 4 * (J % 2)), low4);
      if constexpr (kType == kQ5_K) {
        const __m128i fifth = _mm_and_si128(_mm_srli_epi16(load16(blk + 16 + 16 * h), J), _mm_set1_epi8(1));
        q[h] = _mm_or_si128(q[h], _mm_slli_epi16(fifth, 4));
      }
    }
  }
}

template <int64_t kType, int J, typename F>
inline void k_subblocks_from(const uint8_t* blk, const float a[8][2], const float c[8][2], F& f) {
  if constexpr (J < 8) {
    __m128i q[2];
    V wv[kVecs];
    k_quants<kType, J>(blk, q);
    widen(q, a[J], c[J], wv);
    f(J, wv);
    k_subblocks_from<kType, J + 1>(blk, a, c, f);
  }
}

// f(j, weights) for the 8 sub-blocks j of a K-quant super-block in order, their 32 weights
// as floats in kVecs registers: the scales unpacked once, each sub-block's code unrolled.
template <int64_t kType, typename F>
inline void k_subblocks(const uint8_t* blk, F&& f) {
  float a[8][2], c[8][2];
  k_scales<kType>(blk, a, c);
  // broadcasts from memory, as in k_block_bf16: the float path's K-quants at one row 1.25x
  // (Q6_K) to 1.39x (Q4_K) faster with the vector k_scales, the same sums
  asm volatile("" : : "r"(a), "r"(c) : "memory");
  k_subblocks_from<kType, 0>(blk, a, c, f);
}

constexpr bool is_k_quant(int64_t type) { return block_weights(type) > kBlock; }

// Weights 32b..32b+31 of a row in a 32-weight format as floats, in kVecs registers: 16 at
// a time with AVX-512 (a third of AVX2's instructions), else 8. (K-quants: k_subblocks.)
template <int64_t kType>
inline void block_values(const uint8_t* row, int64_t b, V out[kVecs]) {
  const uint8_t* blk = row + b * block_bytes(kType);
  if constexpr (kType == kQ5_0 || kType == kQ5_1) {
    __m128i q[2];
    float a[2], c[2];
    q5_block<kType>(blk, q, a, c);
    widen(q, a, c, out);
    return;
  }
#if defined(__AVX512F__)
  const __m512 d = _mm512_set1_ps(half(blk));
  __m512i q[2];
  if constexpr (kType == kQ8_0) {
    for (int i = 0; i < 2; i++)
      q[i] = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2 + 16 * i)));
  } else {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (kType == kQ4_1 ? 4 : 2)));
    const __m128i low = _mm_set1_epi8(0x0F);
    q[0] = _mm512_cvtepu8_epi32(_mm_and_si128(raw, low));
    q[1] = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), low));
  }
  const __m512 m = kType == kQ4_1   ? _mm512_set1_ps(half(blk + 2))
                   : kType == kQ4_0 ? _mm512_mul_ps(d, _mm512_set1_ps(-8.0f))
                                    : _mm512_setzero_ps();
  for (int i = 0; i < 2; i++) out[i] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(q[i]), m);
#else
  const __m256 d = _mm256_set1_ps(half(blk));
  if constexpr (kType == kQ8_0) {
    for (int i = 0; i < 4; i++) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * i));
      out[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    }
  } else {
    const __m256 m = kType == kQ4_1 ? _mm256_set1_ps(half(blk + 2))
                                    : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (kType == kQ4_1 ? 4 : 2)));
    const __m128i low = _mm_set1_epi8(0x0F);
    const __m128i nib[2] = {_mm_and_si128(raw, low), _mm_and_si128(_mm_srli_epi16(raw, 4), low)};
    for (int i = 0; i < 4; i++) {
      const __m128i q = i % 2 ? _mm_srli_si128(nib[i / 2], 8) : nib[i / 2];
      out[i] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), m);
    }
  }
#endif
}

template <typename T>
inline void store_block(const V v[kVecs], T* out) {
  for (int i = 0; i < kVecs; i++) Elem<T>::storev(out + kLanes * i, v[i]);
}

// Calls f(std::integral_constant<int, N>{}) for 1 <= n <= kMax: a kernel specialised on a
// small count (rows of x, heads, tiles) called with the count it got.
template <int kMax, typename F>
inline void with_count(int64_t n, F&& f) {
  if constexpr (kMax > 1) {
    if (n < kMax) {
      with_count<kMax - 1>(n, f);
      return;
    }
  }
  f(std::integral_constant<int, kMax>{});
}

// f(std::integral_constant<int64_t, type>{}) for a format with kernels (block_bytes != 0).
template <typename F>
inline void with_type(int64_t type, F&& f) {
  switch (type) {
    case kQ8_0: f(std::integral_constant<int64_t, kQ8_0>{}); break;
    case kQ4_0: f(std::integral_constant<int64_t, kQ4_0>{}); break;
    case kQ4_1: f(std::integral_constant<int64_t, kQ4_1>{}); break;
    case kQ5_0: f(std::integral_constant<int64_t, kQ5_0>{}); break;
    case kQ5_1: f(std::integral_constant<int64_t, kQ5_1>{}); break;
    case kQ4_K: f(std::integral_constant<int64_t, kQ4_K>{}); break;
    case kQ5_K: f(std::integral_constant<int64_t, kQ5_K>{}); break;
    case kQ6_K: f(std::integral_constant<int64_t, kQ6_K>{}); break;
  }
}

// Asks for the weight bytes kPrefetchAhead past [p, p + bytes) (past a row's end: the next
// row's, which follows it), into L2. Long rows need it: x as split_x leaves it is 2.5 bytes
// a weight, read again for every weight row, and at K = 8192-14336 (an MLP's down
// projection) those 20-36 KB take most of L1 or more, and the hardware prefetcher alone no
// longer kept the weights coming: K = 8192 17-18 GB/s against 25-26 at K = 2048
// (AVX512-BF16 class, one row of x, Q4_K/Q6_K). Into L2, not L1: prefetched into L1
// (`_MM_HINT_T0` or `_MM_HINT_NTA`) the lines were evicted by x's refills before their use
// at K = 14336 (21-22 GB/s); into L2 (`_MM_HINT_T1`; T2 the same here) 30-33, and K = 8192
// 29-31, K = 2048 unchanged. (Walking long rows in spans of x, two weight rows a step to
// share x's loads, splitting K over the threads, or prefetching x measured no better; two
// neighbouring rows interleaved halved the speed.)
constexpr int64_t kPrefetchAhead = 4096;

inline void prefetch_ahead(const uint8_t* p, int64_t bytes) {
  for (int64_t l = 0; l < bytes; l += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchAhead + l), _MM_HINT_T1);
}

// The few-row loops hand out weight rows kRowChunk at a time, to whichever thread is free
// (each chunk one sequential stream). An even split (schedule(static)) left the thread
// that finished first waiting at the end of every linear: the two cores of a shared VM
// rarely run at one speed. With chunks, libgomp's waits fell from 14% of a Llama-1B-shape
// Q4_0 decode's samples to 4% (perf, AMX class) and from 17% to 12% of the default model's
// with the AVX2 path forced, whose 1,500 tokens took 23.9 s against 27.7; 16-row chunks
// measured no better than 64.
constexpr int kRowChunk = 64;

}  // namespace quant
