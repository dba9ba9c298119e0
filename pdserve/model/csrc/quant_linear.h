// Linear layers on weights kept in GGUF's block formats, shared by the bf16 and float32
// kernel libraries (each includes it and exports the entry points with its own element
// type). Weights stay as the file stores them, so a decode step reads 4.5-8.5 bits a
// weight instead of 16 or 32.
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
// Every product is the dequantized weights' product. The float32 libraries widen the
// blocks to float in registers and multiply x as it is, so a model on its blocks computes
// what the same model dequantized at load computes, up to the order of additions. The bf16
// library takes integer dot products on the blocks' integers instead (VNNI), with x split
// exactly enough to keep the answers (`split_x`: fixed point 2^-14 below each block's
// largest, against bf16's own 2^-9), and so does the float32 library's AVX2 build at one
// row of x (`linear_split_one_row`: the AVX2 class's batch-1 decode; the AVX-512 float32 build,
// the reference on development machines, always widens). llama.cpp quantizes x to one byte
// a block; that path was built here and dropped: the rounding flipped near-tied greedy
// tokens of the default model ("L'Etoile" for the capital of France).
//
// Two shapes of loop (each library's linear_quant picks by the rows of x):
// - few rows (decode): `linear_fused`, each weight block unpacked once in registers (widened
//   to float, or bytes for the bf16 library's integer dot products) and used for every row
//   of x, one weight row at a time in storage order;
// - more rows: `linear_dequantized`, a group of weight rows dequantized into an L1 buffer
//   and handed to the library's dense linear (the bf16 library on AMX instead dequantizes
//   16 rows into tile order for AMX tiles: cpu_kernels.cpp's linear_quant_amx).
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

// y[m, n] for MT (<= 4) rows of x (floats) and every weight row n: one weight row at a
// time, in storage order; each block is widened once and used for every row of x, with
// kVecs independent FMA chains a row.
template <typename T, int64_t kType, int MT, typename Y>
void fused_rows(const float* x, const uint8_t* w, const T* bias, Y* y, int64_t N, int64_t K) {
  const int64_t nb = K / kBlock;
#pragma omp parallel for schedule(dynamic, kRowChunk)
  for (int64_t n = 0; n < N; n++) {
    const uint8_t* row = w + n * row_bytes(kType, K);
    V acc[MT][kVecs];
    for (int m = 0; m < MT; m++)
      for (int i = 0; i < kVecs; i++) acc[m][i] = vzero();
    auto step = [&](int64_t b, const V* wv) {  // weights 32b.. against every row of x
      for (int m = 0; m < MT; m++)
        for (int i = 0; i < kVecs; i++)
          acc[m][i] = vfmadd(wv[i], vload(x + m * K + b * kBlock + kLanes * i), acc[m][i]);
    };
    if constexpr (is_k_quant(kType)) {
      for (int64_t sb = 0; sb < nb / 8; sb++) {
        prefetch_ahead(row + sb * block_bytes(kType), block_bytes(kType));
        k_subblocks<kType>(row + sb * block_bytes(kType), [&](int j, const V* wv) { step(8 * sb + j, wv); });
      }
    } else {
      for (int64_t b = 0; b < nb; b++) {
        if (b % 8 == 0) prefetch_ahead(row + b * block_bytes(kType), 8 * block_bytes(kType));
        V wv[kVecs];
        block_values<kType>(row, b, wv);
        step(b, wv);
      }
    }
    for (int m = 0; m < MT; m++) {
      for (int i = 1; i < kVecs; i++) acc[m][0] = vadd(acc[m][0], acc[m][i]);
      Elem<Y>::store(y + m * N + n, vsum(acc[m][0]) + (bias ? Elem<T>::load(bias + n) : 0.0f));
    }
  }
}

// x split in two signed bytes a weight (split_x, split_x_f32), a row's bytes: blocks in
// pairs, 128 bytes a pair.
inline int64_t split_row_bytes(int64_t K) { return 128 * ((K / kBlock + 1) / 2); }

// Where block b of row m of x starts in the split's bytes: blocks go in pairs, 128 bytes a
// pair (x1 of both, then x2 of both), so that one 512-bit load takes two blocks' x1.
inline int64_t split_offset(int64_t m, int64_t b, int64_t K) {
  return m * split_row_bytes(K) + 128 * (b / 2) + 32 * (b % 2);
}

// The split's scale for a block whose largest |x| is `largest`: s = 2^(e - 5), e its
// exponent, so 32 <= largest / s < 64, and 1 / s (both exact). False below 2^-121 or not
// finite: the block counts as zeros (`split_zeros`).
inline bool split_scale(float largest, float* s, float* inv) {
  uint32_t bits;
  memcpy(&bits, &largest, 4);
  const int e = static_cast<int>(bits >> 23);  // biased
  if (e < 6 || e > 250) return false;
  const uint32_t s_bits = static_cast<uint32_t>(e - 5) << 23, inv_bits = static_cast<uint32_t>(259 - e) << 23;
  memcpy(s, &s_bits, 4);
  memcpy(inv, &inv_bits, 4);
  return true;
}

// Block i of a split row as zeros: its bytes (x1 at out, x2 at out + 64), scale and sums.
inline void split_zeros(int8_t* out, int64_t i, float* scale, float* sum16, float* sum32) {
  memset(out, 0, 32);
  memset(out + 64, 0, 32);
  scale[i] = sum16[2 * i] = sum16[2 * i + 1] = sum32[i] = 0.0f;
}

// The most rows of x that take the blocks in registers (linear_fused); more dequantize
// groups of weight rows for the dense loop. Where each wins (AVX512-BF16 class; a Llama-1B
// layer's linears, Q4_K_M mix): the float widening up to 4 rows; the integer dot products up
// to 7 (6 rows: 1.26x the dequantized path, 7: 1.22x; at 8 the accumulators, offsets and
// scales of 8 rows no longer fit the 32 registers: 0.84x).
constexpr int64_t kFusedMaxM = 4;
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr int64_t kFusedMaxMInt8 = 7;
#else
constexpr int64_t kFusedMaxMInt8 = kFusedMaxM;
#endif
template <typename T>
constexpr int64_t fused_max_rows() { return std::is_same_v<T, uint16_t> ? kFusedMaxMInt8 : kFusedMaxM; }

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
// The bf16 library (every CPU with AVX512-BF16 has AVX512-VNNI): integer dot products on
// the blocks' integers, every format. A block's q are unsigned bytes (Q8_0's int8 q + 128),
// w = a q + c, so a 32-weight step of a row contributes a * sum(q x) + c * sum(x); the
// second comes from sums of x taken once a call, the first from vpdpbusd (bytes times
// signed bytes, 32 products in 8 int32 lanes) on x split into two signed bytes a block, the
// sums of x taken of x as split, so the result is W x' for x' below:
//
//   x = s (x1 + x2 / 256), s a power of two with 32 <= max|x| / s < 64 over the block,
//   x1 = round(x / s) in [-64, 64], x2 = round(256 (x / s - x1)) in [-128, 127].
//
// That is x in fixed point with 13-14 bits below the block's largest: a bf16 x (8
// significant bits) within 2^-6 of its block's largest is kept exactly, a smaller one to
// 2^-14 of the largest (bf16 itself keeps 2^-9 of each x). The integer products are
// exact, so the result is the dequantized weights' product with x kept so, summed in
// another order; llama.cpp's one-byte x (2^-8 of the largest) flipped near-tied greedy
// tokens of the default model and is not used. Two vpdpbusd a step where llama.cpp takes
// one, and still faster than what it replaced (float widening; K-quants: q widened to
// bf16 by a table lookup for vdpbf16ps, bound by the shuffles). At one row, 2 threads,
// AVX512-BF16 class (bench/quant_linear_probe.py), Gweights/s before -> after: Q4_0 28.6
// -> 31, Q4_1 28 -> 31, Q5_0 18.5 -> 34, Q8_0 33 -> 34 (memory-bound), Q4_K 32.8 -> 46,
// Q5_K 27.5 -> 41, Q6_K 19.8 -> 32; llama.cpp ~43 on Q4_K.

// A K-quant super-block's q as 4 pairs of sub-blocks, 64 bytes a pair: pair p holds
// sub-block 2p's q in bytes 0-31 and 2p + 1's in 32-63 (weight l in byte l), the layouts
// at `k_quants`. Each pair comes from one load and a shift per 256-bit half (Q4_K/Q5_K:
// both halves are one 32-byte load's nibbles; Q6_K: the pair's low bits are one 64-byte
// load), never from two 256-bit halves put together: a one-row Q4_K linear 1.2x, Q6_K 1.4x.
template <int64_t kType>
inline void k_pairs(const uint8_t* blk, __m512i q[4]) {
  const __m512i low4 = _mm512_set1_epi8(15);
  auto broadcast32 = [](const uint8_t* p) {
    return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  };
  // shift counts for the 32-bit lanes of the pair's halves (bits a shift moves across bytes are masked)
  auto halves = [](int first, int second) {
    return _mm512_inserti64x4(_mm512_set1_epi32(first), _mm256_set1_epi32(second), 1);
  };
  if constexpr (kType == kQ6_K) {  // pairs (4n, 4n + 1), (4n + 2, 4n + 3): ql[64n..] and qh[32n..]
    const __m512i bits45 = _mm512_set1_epi8(0x30);
    for (int n = 0; n < 2; n++) {
      const __m512i ql = _mm512_loadu_si512(blk + 64 * n);
      const __m512i qh = broadcast32(blk + 128 + 32 * n);
      // qh's bits 2r, 2r + 1 for group r moved to bits 4-5
      const __m512i high01 = _mm512_and_si512(_mm512_sllv_epi32(qh, halves(4, 2)), bits45);
      const __m512i high23 = _mm512_and_si512(_mm512_srlv_epi32(qh, halves(0, 2)), bits45);
      q[2 * n] = _mm512_or_si512(_mm512_and_si512(ql, low4), high01);
      q[2 * n + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4), high23);
    }
  } else {  // pair p: qs[32p..32p + 31]'s low nibbles, then its high ones
    const uint8_t* qs = blk + (kType == kQ5_K ? 48 : 16);
    for (int p = 0; p < 4; p++) {
      q[p] = _mm512_and_si512(_mm512_srlv_epi32(broadcast32(qs + 32 * p), halves(0, 4)), low4);
      if constexpr (kType == kQ5_K) {  // bit j of qh[l], as 16, for sub-block j
        const __m512i bit = _mm512_and_si512(_mm512_srlv_epi32(broadcast32(blk + 16), halves(2 * p, 2 * p + 1)), _mm512_set1_epi8(1));
        q[p] = _mm512_or_si512(q[p], _mm512_slli_epi16(bit, 4));
      }
    }
  }
}

// x [M, K] split as above: per row m and 32-weight block b, the 32 bytes at
// split_offset(m, b) are x1 and the 32 at 64 past them x2; with i = m K / 32 + b,
// scale[i] = s / 256 (sum(q x) = scale * (256 sum(q x1) + sum(q x2))); sum16 [M, K / 16]
// and sum32 [M, K / 32] the sums of x over each 16 and 32 weights (the K-quants' offsets
// take halves, the others blocks).
inline void split_x(const uint16_t* x, int64_t M, int64_t K, int8_t* q, float* scale, float* sum16, float* sum32) {
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  const int rounding = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int64_t i = 0; i < M * K / kBlock; i++) {
    __m512 v[2];
    for (int h = 0; h < 2; h++) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + kBlock * i + 16 * h));
      v[h] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(v[0], abs_mask), _mm512_and_ps(v[1], abs_mask)));
    int8_t* out = q + split_offset(i / (K / kBlock), i % (K / kBlock), K);
    float s, inv;
    if (!split_scale(amax, &s, &inv)) {
      split_zeros(out, i, scale, sum16, sum32);
      continue;
    }
    scale[i] = s * (1.0f / 256);
    for (int h = 0; h < 2; h++) {
      const __m512 t = _mm512_mul_ps(v[h], _mm512_set1_ps(inv));
      __m512 t1 = _mm512_roundscale_ps(t, rounding);
      __m512 t2 = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(t, t1), _mm512_set1_ps(256.0f)), rounding);
      const __mmask16 tie = _mm512_cmp_ps_mask(t2, _mm512_set1_ps(128.0f), _CMP_EQ_OQ);  // x / s - x1 = 1/2
      t1 = _mm512_mask_add_ps(t1, tie, t1, _mm512_set1_ps(1.0f));
      t2 = _mm512_mask_mov_ps(t2, tie, _mm512_set1_ps(-128.0f));
      // the sum of x as kept (exact: 16 multiples of 2^-8 below 66)
      sum16[2 * i + h] = s * _mm512_reduce_add_ps(_mm512_fmadd_ps(t2, _mm512_set1_ps(1.0f / 256), t1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16 * h), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(t1)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 64 + 16 * h), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(t2)));
    }
    sum32[i] = sum16[2 * i] + sum16[2 * i + 1];
  }
}

// Two consecutive blocks of a 32-weight format as 64 unsigned bytes (the first block's
// weight l in byte l, the second's in 32 + l), w = a q + c; with `second` false the row's
// odd last block, bytes 32-63 zero. The blocks' bytes are put together before they are
// unpacked, so each unpacking op takes both (one shift and one mask for 64 nibbles).
template <int64_t kType>
inline __m512i pair_u8(const uint8_t* blk, bool second) {
  constexpr int bytes = static_cast<int>(block_bytes(kType));
  if constexpr (kType == kQ8_0) {
    const __m256i hi = second ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + bytes + 2)) : _mm256_set1_epi8(-128);
    const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2))), hi, 1);
    return _mm512_xor_si512(q, _mm512_set1_epi8(-128));
  } else {
    constexpr int at = kType == kQ4_0 ? 2 : kType == kQ4_1 ? 4 : kType == kQ5_0 ? 6 : 8;  // qs
    // nibbles: each block's qs in two 16-byte quarters, the second shifted down 4
    const __m256i first = _mm256_broadcastsi128_si256(load16(blk + at));
    const __m256i next = second ? _mm256_broadcastsi128_si256(load16(blk + bytes + at)) : _mm256_setzero_si256();
    const __m512i shift = _mm512_set_epi32(4, 4, 4, 4, 0, 0, 0, 0, 4, 4, 4, 4, 0, 0, 0, 0);
    __m512i q = _mm512_and_si512(_mm512_srlv_epi32(_mm512_inserti64x4(_mm512_castsi256_si512(first), next, 1), shift),
                                 _mm512_set1_epi8(15));
    if constexpr (kType == kQ5_0 || kType == kQ5_1) {  // bit l of each qh: 16 in byte l
      uint32_t qh[2] = {0, 0};
      memcpy(&qh[0], blk + at - 4, 4);
      if (second) memcpy(&qh[1], blk + bytes + at - 4, 4);
      uint64_t bits;
      memcpy(&bits, qh, 8);
      q = _mm512_or_si512(q, _mm512_and_si512(_mm512_movm_epi8(bits), _mm512_set1_epi8(16)));
    }
    return q;
  }
}

// The scales a and offsets c of 8 consecutive blocks of a 32-weight format, by one gather
// of their first 4 bytes (d, and m where the format has one): 8 scalar half conversions a
// block cost these formats more than the dot products.
// Blocks past `live` (a row's last, partial group) are not read and count as zeros.
template <int64_t kType>
inline void block_scales8(const uint8_t* blk, __mmask8 live, __m256* a, __m256* c) {
  constexpr int bytes = static_cast<int>(block_bytes(kType));
  const __m256i at = _mm256_setr_epi32(0, bytes, 2 * bytes, 3 * bytes, 4 * bytes, 5 * bytes, 6 * bytes, 7 * bytes);
  const __m256i head = _mm256_mmask_i32gather_epi32(_mm256_setzero_si256(), live, at, blk, 1);
  *a = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(head));
  constexpr float k = kType == kQ8_0 ? -128.0f : kType == kQ4_0 ? -8.0f : -16.0f;
  *c = kType == kQ4_1 || kType == kQ5_1 ? _mm256_cvtph_ps(_mm256_cvtepi32_epi16(_mm256_srli_epi32(head, 16)))
                                       : _mm256_mul_ps(*a, _mm256_set1_ps(k));
}

// A K-quant super-block's scales as vectors (k_scales' values, without its scalar unpacking:
// that cost 1.4x at one row): a[j] for sub-block j's weights (Q6_K: a[h] for 16 weights h),
// and the offsets c of the 16 halves returned.
template <int64_t kType>
inline __m512 k_scales16(const uint8_t* blk, float a[16]) {
  if constexpr (kType == kQ6_K) {
    const __m512 av = _mm512_mul_ps(_mm512_set1_ps(half(blk + 208)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load16(blk + 192))));
    _mm512_store_ps(a, av);
    return _mm512_mul_ps(av, _mm512_set1_ps(-32.0f));
  } else {
    const __m512i bytes = _mm512_cvtepu8_epi32(k4_scale_bytes(blk + 4));
    uint32_t d_dmin;  // d and dmin, both halves at once: d in lanes 0-7, -dmin in 8-15
    memcpy(&d_dmin, blk, 4);
    const __m512 dm = _mm512_xor_ps(
        _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                              _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(d_dmin))))),
        _mm512_castsi512_ps(_mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi32(INT32_MIN), 1)));
    const __m512 sm = _mm512_mul_ps(dm, _mm512_cvtepi32_ps(bytes));  // a[0..7], c[0..7]
    _mm512_store_ps(a, sm);
    return _mm512_permutexvar_ps(_mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8), sm);
  }
}

// y[m, n] for MT rows of x split by split_x: per row of W, two blocks a step (512 bits:
// block 2p's 32 q in bytes 0-31, 2p + 1's in 32-63, against both blocks' x in one load),
// each step dotted with every row of x. A 32-weight format's odd last block takes a step
// with bytes 32-63 zero. Below 4 rows of x, two accumulator chains a row (a step's FMA
// waits on the last but one); from 4, the rows' chains are enough.
template <int64_t kType, int MT, typename Y>
void fused_rows_i8(const int8_t* xq, const float* xscale, const float* xsum, const float* xsum32,
                   const uint8_t* w,
                   const uint16_t* bias, Y* y, int64_t N, int64_t K) {
  const int64_t nb = K / kBlock, x_bytes = split_row_bytes(K);
  constexpr int kChains = MT < 4 ? 2 : 1;
  // lanes 0-7 take scale j, 8-15 scale j + 1 (Q6_K: 4-lane quarters, scales 2j..2j + 3)
  const __m512i pair_lanes = kType == kQ6_K ? _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0)
                                            : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
#pragma omp parallel for schedule(dynamic, kRowChunk)
  for (int64_t n = 0; n < N; n++) {
    const uint8_t* row = w + n * row_bytes(kType, K);
    __m512 acc[MT][kChains];
    __m512 off[MT];  // c against the sums of x
    for (int m = 0; m < MT; m++) {
      for (int c = 0; c < kChains; c++) acc[m][c] = _mm512_setzero_ps();
      off[m] = _mm512_setzero_ps();
    }
    // blocks b, b + 1 (b even) against row m of x, lane i times scale[i] (a times x's scale)
    auto dot2 = [&](int m, int64_t b, __m512i q, __m512 scale) {
      const int8_t* xp = xq + m * x_bytes + 64 * b;  // split_offset(m, b, K), b even
      const __m512i high = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, _mm512_loadu_si512(xp));
      const __m512i d = _mm512_dpbusd_epi32(_mm512_slli_epi32(high, 8), q, _mm512_loadu_si512(xp + 64));
      acc[m][b / 2 % kChains] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), scale, acc[m][b / 2 % kChains]);
    };
    // blocks b, b + 1 against every row of x, their scales from lanes `first`.. of ax[m]
    auto step = [&](int64_t b, __m512i q, const __m512* ax, int first) {
      const __m512i lanes = _mm512_add_epi32(pair_lanes, _mm512_set1_epi32(first));
      for (int m = 0; m < MT; m++) dot2(m, b, q, _mm512_permutexvar_ps(lanes, ax[m]));
    };
    if constexpr (is_k_quant(kType)) {
      for (int64_t sb = 0; sb < nb / 8; sb++) {
        const uint8_t* blk = row + sb * block_bytes(kType);
        prefetch_ahead(blk, block_bytes(kType));
        alignas(64) float a[16];
        const __m512 cv = k_scales16<kType>(blk, a);
        __m512i q[4];
        k_pairs<kType>(blk, q);
        __m512 ax[MT];  // a times x's scale: a sub-block's (Q6_K: a half's) in lane j
        for (int m = 0; m < MT; m++) {
          const __m256 xs = _mm256_loadu_ps(xscale + m * nb + 8 * sb);
          ax[m] = kType == kQ6_K
              ? _mm512_mul_ps(_mm512_load_ps(a), _mm512_permutexvar_ps(_mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0), _mm512_castps256_ps512(xs)))
              : _mm512_castps256_ps512(_mm256_mul_ps(_mm256_load_ps(a), xs));
        }
        for (int p = 0; p < 4; p++) step(8 * sb + 2 * p, q[p], ax, kType == kQ6_K ? 4 * p : 2 * p);
        for (int m = 0; m < MT; m++) off[m] = _mm512_fmadd_ps(cv, _mm512_loadu_ps(xsum + m * (K / 16) + sb * 16), off[m]);
      }
    } else {
      // 8 blocks a step of scales; K = 32 (8 i + r) leaves r blocks to a last, partial group
      for (int64_t b0 = 0; b0 < nb; b0 += 8) {
        const int group = static_cast<int>(std::min<int64_t>(8, nb - b0));
        const uint8_t* blk = row + b0 * block_bytes(kType);
        prefetch_ahead(blk, group * block_bytes(kType));
        const __mmask8 live = static_cast<__mmask8>((1u << group) - 1);
        __m256 a, c;
        block_scales8<kType>(blk, live, &a, &c);
        __m512 ax[MT];  // a times x's scale, block j's in lane j
        for (int m = 0; m < MT; m++) {
          const int64_t i = m * nb + b0;
          ax[m] = _mm512_castps256_ps512(_mm256_mul_ps(a, _mm256_maskz_loadu_ps(live, xscale + i)));
          off[m] = _mm512_add_ps(off[m], _mm512_zextps256_ps512(_mm256_mul_ps(c, _mm256_maskz_loadu_ps(live, xsum32 + i))));
        }
        for (int j = 0; j < group; j += 2) {
          // the row's odd last block: bytes 32-63 of q zero (lanes 8-15 add 0 x a finite scale)
          step(b0 + j, pair_u8<kType>(blk + j * block_bytes(kType), j + 1 < group), ax, j);
        }
      }
    }
    for (int m = 0; m < MT; m++) {
      __m512 sum = off[m];
      for (int c = 0; c < kChains; c++) sum = _mm512_add_ps(sum, acc[m][c]);
      const float dots = _mm512_reduce_add_ps(sum);
      Elem<Y>::store(y + m * N + n, dots + (bias ? Elem<uint16_t>::load(bias + n) : 0.0f));
    }
  }
}

template <typename Y>
void linear_fused_i8(const uint16_t* x, const uint8_t* w, int64_t type, const uint16_t* bias, Y* y,
                     int64_t M, int64_t N, int64_t K) {
  static thread_local std::vector<int8_t> xq;  // the calling thread's
  static thread_local std::vector<float> xscale, xsum, xsum32;
  xq.resize(M * split_row_bytes(K));
  xscale.resize(M * K / kBlock);
  xsum.resize(M * K / 16);
  xsum32.resize(M * K / kBlock);
  split_x(x, M, K, xq.data(), xscale.data(), xsum.data(), xsum32.data());
  with_type(type, [&](auto type_tag) {
    constexpr int64_t kType = decltype(type_tag)::value;
    with_count<kFusedMaxMInt8>(M, [&](auto rows) {
      fused_rows_i8<kType, decltype(rows)::value>(xq.data(), xscale.data(), xsum.data(), xsum32.data(), w, bias, y, N, K);
    });
  });
}
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
// The float32 library's AVX2 build at one row of x (batch-1 decode on the AVX2 class):
// integer dot products on the blocks' bytes, as the bf16 library takes them with VNNI, with
// x split the same way (x = s (x1 + x2 / 256) a block, fixed point 2^-14 below the block's
// largest; see split_x). Widening each block to float took ~20 ops for 32 weights (4
// zero-extensions, 4 conversions, 4 FMAs for a q + c, 4 into the sums); here vpmaddubsw
// takes 32 bytes times 32 signed bytes a instruction, twice (x1 and x2), vpmaddwd sums the
// pairs (x1's times 256), and one conversion and one FMA apply the block's scale: ~12. The
// products are the dequantized weights' with x kept so, not with x as it is: the AVX2 build
// is the AVX2 class's default and this is its fastest path; the AVX-512 float32 build, the
// reference on development machines, keeps widening. More rows share each widened block
// and keep widening too. No saturation: vpmaddubsw adds two products of q <= 63 and
// |x2| <= 128 (2 x 63 x 128 < 2^15). Q8_0's q + 128 would saturate there, so Q8_0 takes x
// as 16-bit integers instead (256 x1 + x2, which fits: |x1| <= 65) and its signed q widened
// to 16 bits, by vpmaddwd: 5 ops for 32 weights.

// All 8 sub-blocks' q of a K-quant super-block, 32 bytes each (sub-block j's weight l in
// byte l of q[j]), from 256-bit loads: the layouts at `k_quants` (k_pairs' AVX2 sibling).
template <int64_t kType>
inline void k_quants32(const uint8_t* blk, __m256i q[8]) {
  const __m256i low4 = _mm256_set1_epi8(15);
  auto load = [](const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); };
  if constexpr (kType == kQ6_K) {
    const __m256i bits45 = _mm256_set1_epi8(0x30);
    for (int n = 0; n < 2; n++) {
      const __m256i ql0 = load(blk + 64 * n), ql1 = load(blk + 64 * n + 32);
      const __m256i qh = load(blk + 128 + 32 * n);
      // bits shift, shift + 1 of qh's bytes moved to bits 4-5 (one shift: what crosses a byte is masked)
      auto high = [&](int shift) {
        return _mm256_and_si256(shift <= 4 ? _mm256_slli_epi16(qh, 4 - shift) : _mm256_srli_epi16(qh, shift - 4), bits45);
      };
      q[4 * n + 0] = _mm256_or_si256(_mm256_and_si256(ql0, low4), high(0));
      q[4 * n + 1] = _mm256_or_si256(_mm256_and_si256(ql1, low4), high(2));
      q[4 * n + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4), high(4));
      q[4 * n + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4), high(6));
    }
  } else {
    const uint8_t* qs = blk + (kType == kQ5_K ? 48 : 16);
    for (int p = 0; p < 4; p++) {
      const __m256i v = load(qs + 32 * p);
      q[2 * p] = _mm256_and_si256(v, low4);
      q[2 * p + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    }
    if constexpr (kType == kQ5_K) {
      const __m256i qh = load(blk + 16), one = _mm256_set1_epi8(1);
      for (int j = 0; j < 8; j++) {
        const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(j)), one);
        q[j] = _mm256_or_si256(q[j], _mm256_slli_epi16(bit, 4));
      }
    }
  }
}

// x [K] (float) as split_x leaves a row of bf16 x: x1/x2 bytes at split_offset(0, b),
// scale[b] = s / 256, sum16 and sum32 of x as kept; and, where `wide` is not null, the
// same x as 16-bit integers 256 x1 + x2, block b's at wide + 32 b (for Q8_0).
inline void split_x_f32(const float* x, int64_t K, int8_t* q, float* scale, float* sum16, float* sum32,
                        int16_t* wide) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const int rounding = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  // 4 vectors of int32 (32 values) to 32 bytes in order (packs work within 128-bit lanes)
  auto to_bytes = [](const __m256i v[4]) {
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  };
  for (int64_t b = 0; b < K / kBlock; b++) {
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
      v[i] = _mm256_loadu_ps(x + kBlock * b + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], abs_mask));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    int8_t* out = q + split_offset(0, b, K);
    float s, inv;
    if (!split_scale(_mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4))), &s, &inv)) {
      split_zeros(out, b, scale, sum16, sum32);
      if (wide) memset(wide + kBlock * b, 0, kBlock * sizeof(int16_t));
      continue;
    }
    scale[b] = s * (1.0f / 256);
    __m256i x1[4], x2[4];
    __m256 kept[4];
    for (int i = 0; i < 4; i++) {
      const __m256 t = _mm256_mul_ps(v[i], _mm256_set1_ps(inv));
      __m256 t1 = _mm256_round_ps(t, rounding);
      __m256 t2 = _mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(t, t1), _mm256_set1_ps(256.0f)), rounding);
      const __m256 tie = _mm256_cmp_ps(t2, _mm256_set1_ps(128.0f), _CMP_EQ_OQ);  // x / s - x1 = 1/2
      t1 = _mm256_add_ps(t1, _mm256_and_ps(tie, _mm256_set1_ps(1.0f)));
      t2 = _mm256_blendv_ps(t2, _mm256_set1_ps(-128.0f), tie);
      x1[i] = _mm256_cvtps_epi32(t1);
      x2[i] = _mm256_cvtps_epi32(t2);
      kept[i] = _mm256_fmadd_ps(t2, _mm256_set1_ps(1.0f / 256), t1);  // x / s as kept (exact)
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), to_bytes(x1));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 64), to_bytes(x2));
    for (int h = 0; wide && h < 2; h++) {  // 16 values a vector (packs work within 128-bit lanes)
      auto joined = [&](int i) { return _mm256_add_epi32(_mm256_slli_epi32(x1[i], 8), x2[i]); };
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(joined(2 * h), joined(2 * h + 1)), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(wide + kBlock * b + 16 * h), packed);
    }
    for (int h = 0; h < 2; h++)  // exact: 16 multiples of 2^-8 below 66
      sum16[2 * b + h] = s * vsum(_mm256_add_ps(kept[2 * h], kept[2 * h + 1]));
    sum32[b] = sum16[2 * b] + sum16[2 * b + 1];
  }
}

// y[n] for one row of x split as above: each block's 32 q as bytes, dotted with x1 and x2.
template <int64_t kType, typename T, typename Y>
void split_row(const int8_t* xq, const int16_t* x_wide, const float* xscale, const float* xsum16, const float* xsum32,
               const uint8_t* w, const T* bias, Y* y, int64_t N, int64_t K) {
  const int64_t nb = K / kBlock;
#pragma omp parallel for schedule(dynamic, kRowChunk)
  for (int64_t n = 0; n < N; n++) {
    const uint8_t* row = w + n * row_bytes(kType, K);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    __m256 off = _mm256_setzero_ps();  // the offsets c against the sums of x
    // block b's q (weight l in byte l) against x; lane i (weights 4i..4i + 3) times scale[i]
    auto dot = [&](int64_t b, __m256i q, __m256 scale) {
      const int8_t* xp = xq + split_offset(0, b, K);
      const __m256i high = _mm256_maddubs_epi16(q, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp)));
      const __m256i low = _mm256_maddubs_epi16(q, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + 64)));
      const __m256i d = _mm256_add_epi32(_mm256_madd_epi16(high, _mm256_set1_epi16(256)),
                                         _mm256_madd_epi16(low, _mm256_set1_epi16(1)));
      acc[b % 2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), scale, acc[b % 2]);
    };
    if constexpr (is_k_quant(kType)) {
      for (int64_t sb = 0; sb < nb / 8; sb++) {
        const uint8_t* blk = row + sb * block_bytes(kType);
        prefetch_ahead(blk, block_bytes(kType));
        const __m256 xs = _mm256_loadu_ps(xscale + 8 * sb);
        // a times x's scale, sub-block j's in ax[j] (Q6_K: half h's in ax[2j + h]); the
        // offsets c against the sums of x
        alignas(32) float ax[16];
        if constexpr (kType == kQ6_K) {  // int8 scales[16] at 192, d at 208: a = d scale, c = -32 a
          const __m128i scales = load16(blk + 192);
          for (int i = 0; i < 2; i++) {
            const __m256i ints = _mm256_cvtepi8_epi32(i ? _mm_srli_si128(scales, 8) : scales);
            const __m256 av = _mm256_mul_ps(_mm256_set1_ps(half(blk + 208)), _mm256_cvtepi32_ps(ints));
            const __m256i halves = i ? _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7) : _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
            _mm256_store_ps(ax + 8 * i, _mm256_mul_ps(av, _mm256_permutevar8x32_ps(xs, halves)));
            off = _mm256_fmadd_ps(_mm256_mul_ps(av, _mm256_set1_ps(-32.0f)), _mm256_loadu_ps(xsum16 + 16 * sb + 8 * i), off);
          }
        } else {  // a = d scale_j, c = -dmin min_j
          const __m128i sm = k4_scale_bytes(blk + 4);
          const __m256 av = _mm256_mul_ps(_mm256_set1_ps(half(blk)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm)));
          const __m256 cv = _mm256_mul_ps(_mm256_set1_ps(-half(blk + 2)),
                                          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8))));
          _mm256_store_ps(ax, _mm256_mul_ps(av, xs));
          off = _mm256_fmadd_ps(cv, _mm256_loadu_ps(xsum32 + 8 * sb), off);
        }
        asm volatile("" : : "r"(ax) : "memory");  // broadcasts from memory, as in k_block_bf16
        __m256i q[8];
        k_quants32<kType>(blk, q);
        for (int j = 0; j < 8; j++)
          dot(8 * sb + j, q[j],
              kType == kQ6_K ? _mm256_set_m128(_mm_broadcast_ss(ax + 2 * j + 1), _mm_broadcast_ss(ax + 2 * j))
                             : _mm256_broadcast_ss(ax + j));
      }
    } else {
      constexpr int bytes = static_cast<int>(block_bytes(kType));
      constexpr int at = kType == kQ4_0 ? 2 : kType == kQ4_1 ? 4 : kType == kQ5_0 ? 6 : 8;  // qs (not Q8_0)
      // 8 blocks a step of scales: their d (and m) converted together, a times x's scale
      // kept for broadcasts from memory; a row's last, partial group reads zeros past it
      // (x's buffers are padded with zeros)
      for (int64_t b0 = 0; b0 < nb; b0 += 8) {
        const int group = static_cast<int>(std::min<int64_t>(8, nb - b0));
        const uint8_t* blk0 = row + b0 * bytes;
        prefetch_ahead(blk0, group * bytes);
        // one gather of the 8 blocks' first 4 bytes (d, and m or 2 bytes of q); blocks past
        // the row's end are not read (masked) and count as zeros
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i head = _mm256_mask_i32gather_epi32(
            _mm256_setzero_si256(), reinterpret_cast<const int*>(blk0), _mm256_mullo_epi32(lane, _mm256_set1_epi32(bytes)),
            _mm256_cmpgt_epi32(_mm256_set1_epi32(group), lane), 1);
        auto halves = [&](int second) {  // 16 bits of each lane (the first or second half) as floats
          const __m256i pick = second ? _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1, 2, 3, 6, 7,
                                                         10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1)
                                      : _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1, 0, 1, 4, 5,
                                                         8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
          const __m256i packed = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(head, pick), 0x08);  // qwords 0, 2
          return _mm256_cvtph_ps(_mm256_castsi256_si128(packed));
        };
        const __m256 av = halves(0);
        const __m256 cv = kType == kQ4_1 || kType == kQ5_1 ? halves(1)
                          : kType == kQ8_0                 ? _mm256_setzero_ps()  // w = d q
                                                           : _mm256_mul_ps(av, _mm256_set1_ps(kType == kQ4_0 ? -8.0f : -16.0f));
        alignas(32) float ax[8];
        _mm256_store_ps(ax, _mm256_mul_ps(av, _mm256_loadu_ps(xscale + b0)));
        off = _mm256_fmadd_ps(cv, _mm256_loadu_ps(xsum32 + b0), off);
        asm volatile("" : : "r"(ax) : "memory");  // broadcasts from memory, as in k_block_bf16
        for (int j = 0; j < group; j++) {
          const uint8_t* blk = blk0 + j * bytes;
          if constexpr (kType == kQ8_0) {  // signed q in 16 bits against x as 16-bit integers
            const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
            const __m256i* xw = reinterpret_cast<const __m256i*>(x_wide + kBlock * (b0 + j));
            const __m256i d = _mm256_add_epi32(
                _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(q)), _mm256_loadu_si256(xw)),
                _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1)), _mm256_loadu_si256(xw + 1)));
            acc[j % 2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_broadcast_ss(ax + j), acc[j % 2]);
            continue;
          }
          // nibbles: qs in both halves, the upper one shifted down 4
          __m256i q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_broadcastsi128_si256(load16(blk + at)),
                                                         _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
                                       _mm256_set1_epi8(15));
          if constexpr (kType == kQ5_0 || kType == kQ5_1) {  // bit l of qh: 16 in byte l
            int32_t qh;
            memcpy(&qh, blk + at - 4, 4);
            // byte l takes byte l / 8 of qh, all its bits but bit l % 8 set: all ones iff bit l is
            const __m256i spread = _mm256_shuffle_epi8(
                _mm256_set1_epi32(qh), _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
            const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7FBFDFEFF7FBFDFE)),
                                                  _mm256_set1_epi64x(-1));
            q = _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(16)));
          }
          dot(b0 + j, q, _mm256_broadcast_ss(ax + j));
        }
      }
    }
    const float dots = vsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), off));
    Elem<Y>::store(y + n, dots + (bias ? Elem<T>::load(bias + n) : 0.0f));
  }
}

template <typename T, typename Y>
void linear_split_one_row(const float* x, const uint8_t* w, int64_t type, const T* bias, Y* y, int64_t N, int64_t K) {
  static thread_local std::vector<int8_t> xq;  // the calling thread's
  static thread_local std::vector<int16_t> x_wide;
  static thread_local std::vector<float> xscale, xsum16, xsum32;
  xq.resize(split_row_bytes(K));
  x_wide.resize(type == kQ8_0 ? K : 0);
  // + 8 zeros past the row's blocks: split_row reads scales and sums 8 blocks at a time
  // (split_x_f32 writes every block's)
  for (auto* v : {&xscale, &xsum32}) {
    v->resize(K / kBlock + 8);
    std::fill(v->end() - 8, v->end(), 0.0f);
  }
  xsum16.resize(K / 16);
  split_x_f32(x, K, xq.data(), xscale.data(), xsum16.data(), xsum32.data(), type == kQ8_0 ? x_wide.data() : nullptr);
  with_type(type, [&](auto type_tag) {
    constexpr int64_t kType = decltype(type_tag)::value;
    split_row<kType>(xq.data(), x_wide.data(), xscale.data(), xsum16.data(), xsum32.data(), w, bias, y, N, K);
  });
}
#endif

// y[M, N] = x[M, K] W^T (+ bias), M <= fused_max_rows<T>(), W in format `type` (block_bytes(type)
// != 0), K % 32 == 0. y in T, or float (the bf16 library's logits).
template <typename T, typename Y>
void linear_fused(const T* x, const uint8_t* w, int64_t type, const T* bias, Y* y, int64_t M,
                  int64_t N, int64_t K) {
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
  if constexpr (std::is_same_v<T, uint16_t>) {
    linear_fused_i8(x, w, type, bias, y, M, N, K);
    return;
  }
#endif
#if defined(__AVX2__) && !defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    if (M == 1) {
      linear_split_one_row(x, w, type, bias, y, N, K);
      return;
    }
  }
#endif
  const float* xf;
  static thread_local std::vector<float> x_float;  // the calling thread's
  if constexpr (std::is_same_v<T, float>) {
    xf = x;
  } else {
    x_float.resize(M * K);
    for (int64_t i = 0; i < M * K; i++) x_float[i] = Elem<T>::load(x + i);
    xf = x_float.data();
  }
  auto run = [&](auto type_tag) {
    constexpr int64_t kType = decltype(type_tag)::value;
    with_count<kFusedMaxM>(M, [&](auto rows) { fused_rows<T, kType, decltype(rows)::value>(xf, w, bias, y, N, K); });
  };
  with_type(type, run);
}

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
// 32 weights of kBits bits (each q in a byte) as bf16 by a table: the 2^kBits values a q can
// take, a q + c for q = 0, 1, ..., computed by fmas and rounded once each, then every weight
// looked up by its q (`vpermw`, 32 entries). The same fma and rounding a weight as widening
// each (block_values, the loop below), so the same bf16, for about half the vector ops: the
// per-weight widening to int32, conversion, fma and rounding were most of a dequantized
// row's time (AMX class; bench/linear_builds_ab.py).
template <int kBits>
inline __m512i table_lookup(float a, float c, __m256i q) {
  static_assert(kBits == 4 || kBits == 5, "vpermw looks up 32 entries");
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 av = _mm512_set1_ps(a), cv = _mm512_set1_ps(c);
  const __m512 low = _mm512_fmadd_ps(av, iota, cv);
  __m512i table;
  if constexpr (kBits == 4) {
    table = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(low));
  } else {
    const __m512 high = _mm512_fmadd_ps(av, _mm512_add_ps(iota, _mm512_set1_ps(16.0f)), cv);
    table = (__m512i)_mm512_cvtne2ps_pbh(high, low);
  }
  return _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(q), table);
}

// A K-quant super-block's 256 weights as bf16, unpacked as the integer kernels unpack them
// (all 8 sub-blocks' q by 256-bit ops, the scales by vector code): the same a q + c as
// k_subblocks', 1.3x faster for the linears of more than 7 rows (bench/quant_linear_probe.py
// --rows 32, Q4_K).
template <int64_t kType>
inline void k_block_bf16(const uint8_t* blk, uint16_t* out, int64_t stride) {
  alignas(64) float a[16], c[16];
  _mm512_store_ps(c, k_scales16<kType>(blk, a));
  // Each scale below is broadcast from memory (a load, no vector ALU op). Without this
  // barrier GCC keeps a and c in registers and broadcasts each by a permute whose index it
  // builds first: ~50 more vector ops a super-block; Q4_K dequantized 1.33x faster with it,
  // the same bytes (bench/quant_kernel_ab.cpp's way, one thread, AMX class).
  asm volatile("" : : "r"(a), "r"(c) : "memory");
  __m512i q[4];
  k_pairs<kType>(blk, q);
  if constexpr (kType == kQ6_K) {  // 64 values, a scale per 16 weights: widened
    for (int p = 0; p < 4; p++) {
      const __m128i quarters[4] = {_mm512_castsi512_si128(q[p]), _mm512_extracti32x4_epi32(q[p], 1),
                                   _mm512_extracti32x4_epi32(q[p], 2), _mm512_extracti32x4_epi32(q[p], 3)};
      for (int i = 0; i < 4; i++) {  // weights 16 i.. of the pair: sub-block j = 2p + i / 2, half h = i % 2
        const int j = 2 * p + i / 2, h = i % 2;
        const __m512 w = _mm512_fmadd_ps(_mm512_set1_ps(a[2 * j + h]),
                                         _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(quarters[i])),
                                         _mm512_set1_ps(c[2 * j + h]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + stride * j + 16 * h), (__m256i)_mm512_cvtneps_pbh(w));
      }
    }
  } else {  // Q4_K, Q5_K: by a table
    for (int p = 0; p < 4; p++)
      for (int i = 0; i < 2; i++) {  // sub-block j = 2p + i: bytes 32i.. of the pair
        const int j = 2 * p + i;
        const __m256i q32 = i ? _mm512_extracti64x4_epi64(q[p], 1) : _mm512_castsi512_si256(q[p]);
        _mm512_storeu_si512(out + stride * j, table_lookup<kType == kQ4_K ? 4 : 5>(a[j], c[2 * j], q32));
      }
  }
}
#endif

// A weight row's K weights in T; each block of 32 at out + b * stride (kBlock: the row as
// it is; 16 kBlock: the AMX linear's tiles of 16 rows).
template <typename T>
inline void dequantize_row(const uint8_t* row, int64_t type, int64_t K, T* out, int64_t stride = kBlock) {
  with_type(type, [&](auto type_tag) {
    constexpr int64_t kType = decltype(type_tag)::value;
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
    if constexpr (is_k_quant(kType) && std::is_same_v<T, uint16_t>) {
      for (int64_t sb = 0; sb < K / 256; sb++)
        k_block_bf16<kType>(row + sb * block_bytes(kType), out + 8 * sb * stride, stride);
      return;
    } else if constexpr (kType != kQ8_0 && std::is_same_v<T, uint16_t>) {
      constexpr int64_t bytes = block_bytes(kType);
      const int64_t nb = K / kBlock;
      for (int64_t b = 0; b < nb; b += 2) {  // two blocks' q as fused_rows_i8 unpacks them
        const uint8_t* blk = row + b * bytes;
        const __m512i q = pair_u8<kType>(blk, b + 1 < nb);
        for (int64_t h = 0; h < 2 && b + h < nb; h++) {  // block_values' a and c
          const float a = half(blk + h * bytes);
          const float c = kType == kQ4_1 || kType == kQ5_1 ? half(blk + h * bytes + 2)
                                                           : a * (kType == kQ4_0 ? -8.0f : -16.0f);
          const __m256i qb = h ? _mm512_extracti64x4_epi64(q, 1) : _mm512_castsi512_si256(q);
          _mm512_storeu_si512(out + (b + h) * stride, table_lookup<kType == kQ4_0 || kType == kQ4_1 ? 4 : 5>(a, c, qb));
        }
      }
      return;
    }
#endif
    if constexpr (is_k_quant(kType)) {
      for (int64_t sb = 0; sb < K / 256; sb++)
        k_subblocks<kType>(row + sb * block_bytes(kType), [&](int j, const V* v) { store_block(v, out + (8 * sb + j) * stride); });
    } else {
      for (int64_t b = 0; b < K / kBlock; b++) {
        V v[kVecs];
        block_values<kType>(row, b, v);
        store_block(v, out + b * stride);
      }
    }
  });
}

// More rows: widening each block for every row of x adds up. Instead each thread dequantizes a group of R weight rows into an L1-resident
// buffer of T and hands it to `group(buffer, n0, rows)`: the library's own dense linear on
// those rows (the same code the dense model runs, so the product equals the dequantized
// model's). The weights are still read from memory at 4.5-8.5 bits a weight.
template <typename T, int R, typename Group>
void linear_dequantized(const uint8_t* w, int64_t type, int64_t N, int64_t K, Group group) {
  const int64_t stride = row_bytes(type, K);
#pragma omp parallel
  {
    // 64-byte aligned: 64-byte loads from a malloc'd (16-aligned) buffer split across
    // cache lines three times in four, which cost the float32 tiles 1.3x.
    const size_t bytes = (R * K * sizeof(T) + 63) / 64 * 64;
    std::unique_ptr<T, decltype(&free)> buffer(static_cast<T*>(aligned_alloc(64, bytes)), &free);
#pragma omp for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += R) {
      const int64_t rows = std::min<int64_t>(R, N - n0);
      for (int64_t r = 0; r < rows; r++)
        dequantize_row(w + (n0 + r) * stride, type, K, buffer.get() + r * K);
      group(buffer.get(), n0, rows);
    }
  }
}

// y[M, N] = x[M, K] W^T (+ bias) for W in format `type`; -1 for a format without a kernel.
// Up to fused_max_rows<T>() rows of x take each block in registers; more rows dequantize groups of
// R weight rows and hand them to `dense_group(group, n0, rows)`, the calling library's
// dense linear on those rows.
template <typename T, int R, typename Y, typename DenseGroup>
int linear(const T* x, const uint8_t* w, int64_t type, const T* bias, Y* y, int64_t M,
           int64_t N, int64_t K, DenseGroup dense_group) {
  if (!block_bytes(type)) return -1;
  if (M == 0) return 0;
  if (M <= fused_max_rows<T>())
    linear_fused(x, w, type, bias, y, M, N, K);
  else
    linear_dequantized<T, R>(w, type, N, K, dense_group);
  return 0;
}

// out[N, K] = W dequantized (rows of a table: prefill-sized linears, embedding lookups).
template <typename T>
int dequantize(const uint8_t* w, int64_t type, T* out, int64_t N, int64_t K) {
  const int64_t bytes = row_bytes(type, K);
  if (!bytes) return -1;
#pragma omp parallel for schedule(static) if (N * K >= (1 << 16))
  for (int64_t n = 0; n < N; n++) dequantize_row(w + n * bytes, type, K, out + n * K);
  return 0;
}

}  // namespace quant
