// The float32 library's AVX2 build at one row of x: integer dot products on the blocks'
// bytes over x split as quant_split.h splits it (quant_linear.h's linear_split_one_row).

#pragma once

#include "quant_split.h"

namespace quant {

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

}  // namespace quant
