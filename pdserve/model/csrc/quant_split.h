// x split in two signed bytes a weight, and the integer dot products of the blocks' bytes
// with it (quant_linear.h's products where the build has them): the bf16 library's VNNI
// path at up to kFusedMaxMInt8 rows of x. The AVX2 one-row path is quant_split_avx2.h.

#pragma once

#include "quant_blocks.h"

namespace quant {

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

}  // namespace quant
