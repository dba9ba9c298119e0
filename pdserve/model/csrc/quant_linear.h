// Linear layers on weights kept in GGUF's block formats, shared by the bf16 and float32
// kernel libraries (each includes it and exports the entry points with its own element
// type). Weights stay as the file stores them, so a decode step reads 4.5-8.5 bits a
// weight instead of 16 or 32.
//
// Formats (ggml's, 32 weights a block, scales in fp16), weight i of a block:
//   Q8_0  {d; int8 q[32]}          w = d q[i]                          34 bytes
//   Q4_0  {d; uint8 qs[16]}        w = d (nibble(i) - 8)               18 bytes
//   Q4_1  {d; m; uint8 qs[16]}     w = d nibble(i) + m                 20 bytes
// where nibble(i) = qs[i] & 15 for i < 16 and qs[i - 16] >> 4 above.
//
// Every product is the dequantized weights' product: the blocks are widened to float in
// registers and multiplied by x as it is (float, or bf16 widened), so a model on its
// blocks computes what the same model dequantized at load computes, up to the order of
// additions. llama.cpp instead quantizes x to 8 bits per block and takes integer dot
// products. That path was built and measured here (1.5-2x faster at 1-2 rows of x), and
// dropped: the activation rounding flips near-tied greedy tokens (the default model then
// answers "L'Etoile" for the capital of France, as bf16 rounding did).
//
// Two shapes of loop (each library's linear_quant picks by the rows of x):
// - few rows (decode): `linear_fused`, each weight block widened once in registers and
//   used for every row of x, one weight row at a time in storage order;
// - more rows: `linear_dequantized`, a group of weight rows dequantized into an L1 buffer
//   and handed to the library's dense linear.
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

enum Type : int64_t { kQ8_0 = 8, kQ4_0 = 2, kQ4_1 = 3 };  // ggml's type numbers

constexpr int kBlock = 32;

inline int64_t block_bytes(int64_t type) {
  switch (type) {
    case kQ8_0: return 34;
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    default: return 0;
  }
}

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

// One block's 32 weights as floats, in kVecs registers: 16 at a time with AVX-512 (a third
// of AVX2's instructions), else 8.
template <int64_t kType>
inline void block_values(const uint8_t* blk, V out[kVecs]) {
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

template <int64_t kType, typename T>
inline void dequantize_block(const uint8_t* blk, T* out) {
  V v[kVecs];
  block_values<kType>(blk, v);
  for (int i = 0; i < kVecs; i++) Elem<T>::storev(out + kLanes * i, v[i]);
}

// y[m, n] for MT (<= 4) rows of x (floats) and every weight row n: one weight row at a
// time, in storage order (one sequential stream a thread); each block is widened once and
// used for every row of x, with kVecs independent FMA chains a row.
template <typename T, int64_t kType, int MT, typename Y>
void fused_rows(const float* x, const uint8_t* w, const T* bias, Y* y, int64_t N, int64_t K) {
  constexpr int64_t kBytes = kType == kQ8_0 ? 34 : kType == kQ4_0 ? 18 : 20;
  const int64_t nb = K / kBlock;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; n++) {
    const uint8_t* row = w + n * nb * kBytes;
    V acc[MT][kVecs];
    for (int m = 0; m < MT; m++)
      for (int i = 0; i < kVecs; i++) acc[m][i] = vzero();
    for (int64_t b = 0; b < nb; b++) {
      V wv[kVecs];
      block_values<kType>(row + b * kBytes, wv);
      for (int m = 0; m < MT; m++)
        for (int i = 0; i < kVecs; i++)
          acc[m][i] = vfmadd(wv[i], vload(x + m * K + b * kBlock + kLanes * i), acc[m][i]);
    }
    for (int m = 0; m < MT; m++) {
      for (int i = 1; i < kVecs; i++) acc[m][0] = vadd(acc[m][0], acc[m][i]);
      Elem<Y>::store(y + m * N + n, vsum(acc[m][0]) + (bias ? Elem<T>::load(bias + n) : 0.0f));
    }
  }
}

constexpr int64_t kFusedMaxM = 4;

// y[M, N] = x[M, K] W^T (+ bias), M <= kFusedMaxM, W in format `type` (block_bytes(type)
// != 0), K % 32 == 0. y in T, or float (the bf16 library's logits).
template <typename T, typename Y>
void linear_fused(const T* x, const uint8_t* w, int64_t type, const T* bias, Y* y, int64_t M,
                  int64_t N, int64_t K) {
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
    switch (M) {
      case 1: fused_rows<T, kType, 1>(xf, w, bias, y, N, K); break;
      case 2: fused_rows<T, kType, 2>(xf, w, bias, y, N, K); break;
      case 3: fused_rows<T, kType, 3>(xf, w, bias, y, N, K); break;
      case 4: fused_rows<T, kType, 4>(xf, w, bias, y, N, K); break;
    }
  };
  switch (type) {
    case kQ8_0: run(std::integral_constant<int64_t, kQ8_0>{}); break;
    case kQ4_0: run(std::integral_constant<int64_t, kQ4_0>{}); break;
    case kQ4_1: run(std::integral_constant<int64_t, kQ4_1>{}); break;
  }
}

template <typename T>
inline void dequantize_row(const uint8_t* row, int64_t type, int64_t K, T* out) {
  const int64_t bytes = block_bytes(type);
  for (int64_t b = 0; b < K / kBlock; b++) {
    switch (type) {
      case kQ8_0: dequantize_block<kQ8_0>(row + b * bytes, out + b * kBlock); break;
      case kQ4_0: dequantize_block<kQ4_0>(row + b * bytes, out + b * kBlock); break;
      case kQ4_1: dequantize_block<kQ4_1>(row + b * bytes, out + b * kBlock); break;
    }
  }
}

// More rows: widening each block for every row of x adds up. Instead each thread dequantizes a group of R weight rows into an L1-resident
// buffer of T and hands it to `group(buffer, n0, rows)`: the library's own dense linear on
// those rows (the same code the dense model runs, so the product equals the dequantized
// model's). The weights are still read from memory at 4.5-8.5 bits a weight.
template <typename T, int R, typename Group>
void linear_dequantized(const uint8_t* w, int64_t type, int64_t N, int64_t K, Group group) {
  const int64_t row_bytes = K / kBlock * block_bytes(type);
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
        dequantize_row(w + (n0 + r) * row_bytes, type, K, buffer.get() + r * K);
      group(buffer.get(), n0, rows);
    }
  }
}

// y[M, N] = x[M, K] W^T (+ bias) for W in format `type`; -1 for a format without a kernel.
// Up to kFusedMaxM rows of x widen each block in registers; more rows dequantize groups of
// R weight rows and hand them to `dense_group(group, n0, rows)`, the calling library's
// dense linear on those rows.
template <typename T, int R, typename Y, typename DenseGroup>
int linear(const T* x, const uint8_t* w, int64_t type, const T* bias, Y* y, int64_t M,
           int64_t N, int64_t K, DenseGroup dense_group) {
  if (!block_bytes(type)) return -1;
  if (M <= kFusedMaxM)
    linear_fused(x, w, type, bias, y, M, N, K);
  else
    linear_dequantized<T, R>(w, type, N, K, dense_group);
  return 0;
}

// out[N, K] = W dequantized (rows of a table: prefill-sized linears, embedding lookups).
template <typename T>
int dequantize(const uint8_t* w, int64_t type, T* out, int64_t N, int64_t K) {
  const int64_t row_bytes = K / kBlock * block_bytes(type);
  if (!row_bytes) return -1;
#pragma omp parallel for schedule(static) if (N * K >= (1 << 16))
  for (int64_t n = 0; n < N; n++) dequantize_row(w + n * row_bytes, type, K, out + n * K);
  return 0;
}

}  // namespace quant
