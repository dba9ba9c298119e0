// Linear layers on weights kept in GGUF's block formats, shared by the bf16 and float32
// kernel libraries (each includes it and exports the entry points with its own element
// type). Weights stay as the file stores them, so a decode step reads 4.5-8.5 bits a
// weight instead of 16 or 32.
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
// The pieces: quant_blocks.h (the formats), quant_split.h and quant_split_avx2.h (x split
// for integer dot products), this file (the two loops and the dequantizing entry points).

#pragma once

#include "quant_split_avx2.h"

namespace quant {

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
