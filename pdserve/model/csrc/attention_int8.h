// Decode attention over the 8-bit KV cache by integer dot products (AVX512-VNNI), for the
// bf16 library. The float path (attention_f32.h) widens every key and value to float and
// took ~50 instructions per (token, kv head) at 3 query heads a kv head: slower than the
// bf16 cache it halves (8k keys, bf16 0.19 ms against int8 0.33 ms a layer), so the 8-bit
// cache bought room but no speed. Here:
//
// 1. Scores. Each query head is split in two signed bytes, q = s (q1 + q2 / 256), s a power
//    of two with 32 <= max|q| / s < 64 over the head (quant_linear.h's split of x, over a
//    head: a bf16 q within 2^-6 of the head's largest is kept exactly, a smaller one to
//    2^-14 of it). 16 keys are loaded and transposed so that one vector holds the same 4
//    dimensions of all 16 (key i in lane i): vpdpbusd sums 4 dimensions of 16 keys at
//    once and no horizontal sums are left (a gather per 4 dimensions instead was 4x
//    slower on Zen 4). vpdpbusd multiplies unsigned by signed bytes: keys are offset by 128
//    (k + 128 in 0..255) and 128 sum(q1) is subtracted after; the integer sums are exact.
// 2. Softmax in float over the whole row, as the bf16 cache's path.
// 3. Values. 16 tokens at a time, each query head's weight p_t times the token's value
//    scale is rounded to 16 bits against the 16's largest (2^-16 of it), two tokens'
//    values are interleaved as 16-bit pairs, and vpdpwssd adds both tokens' products into
//    32-bit lanes; the 16 tokens' integer sums then go to float (at most 8 pairs of
//    2 * 32767 * 128: no overflow).
//
// Needs block_size >= 16 (16 keys at a time share a block, so the gather's offsets are
// small); pd_decode_attention falls back to attention_f32.h below that.

#pragma once

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

namespace attn_i8 {

constexpr int64_t kMinBlock = 16;
constexpr int kMaxD = 256;

// One query head split as above; sum1/sum2 for the keys' +128.
struct SplitHead {
  alignas(64) int8_t q1[kMaxD];
  alignas(64) int8_t q2[kMaxD];
  float s;
  int32_t sum1, sum2;
};

template <typename ToFloat>
inline void split_head(const uint16_t* q, int D, ToFloat to_float, SplitHead* out) {
  float amax = 0.0f;
  for (int d = 0; d < D; d++) amax = fmaxf(amax, fabsf(to_float(q[d])));
  out->sum1 = out->sum2 = 0;
  if (!(amax > 0x1p-120f) || !isfinite(amax)) {  // zeros (or not finite): scores of 0
    memset(out->q1, 0, D);
    memset(out->q2, 0, D);
    out->s = 0.0f;
    return;
  }
  const int e = ilogbf(amax);  // 2^e <= amax < 2^(e + 1)
  const float inv = ldexpf(1.0f, 5 - e), s = ldexpf(1.0f, e - 5);
  out->s = s;
  for (int d = 0; d < D; d++) {
    const float t = to_float(q[d]) * inv;  // exact: a power of two
    float t1 = nearbyintf(t), t2 = nearbyintf((t - t1) * 256.0f);
    if (t2 == 128.0f) {  // t - t1 = 1/2: keep t2 in a signed byte
      t1 += 1.0f;
      t2 = -128.0f;
    }
    out->q1[d] = static_cast<int8_t>(t1);
    out->q2[d] = static_cast<int8_t>(t2);
    out->sum1 += out->q1[d];
    out->sum2 += out->q2[d];
  }
}

// 16 keys' offsets from the first (key i's, clamped to the sequence's last), in bytes.
inline __m512i key_offsets(int64_t n, int64_t s_tok) {
  const __m512i i = _mm512_min_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                     _mm512_set1_epi32(static_cast<int>(n - 1)));
  return _mm512_mullo_epi32(i, _mm512_set1_epi32(static_cast<int>(s_tok)));
}

// Rows r[i] (16 dwords each) transposed in place: afterwards dword i of r[c] is dword c of
// row i (4 stages of 16 shuffles).
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; i++) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; i++) {  // lane L of r[4i + j]: rows 4i..4i+3, dword 4L + j
    r[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i + 0], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i + 0], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int j = 0; j < 4; j++) {
    const __m512i u0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44), u1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xEE);
    const __m512i u2 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44), u3 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xEE);
    t[j] = _mm512_shuffle_i32x4(u0, u2, 0x88);
    t[4 + j] = _mm512_shuffle_i32x4(u0, u2, 0xDD);
    t[8 + j] = _mm512_shuffle_i32x4(u1, u3, 0x88);
    t[12 + j] = _mm512_shuffle_i32x4(u1, u3, 0xDD);
  }
  for (int i = 0; i < 16; i++) r[i] = t[i];
}

// Pass 1 for NG query heads (qs) of the kv head at byte `head` of each row:
// s_g[t] = scale * q_g . k_t for t < L (rows to a multiple of 16). 16 keys' 64-byte
// pieces are loaded whole and transposed (key i in lane i: dword c of the piece), so
// vpdpbusd takes 4 dimensions of 16 keys an instruction and no horizontal sums remain.
template <int D, int NG>
void score_heads(const SplitHead* qs, const paged::PagedSeq<int8_t>& seq, int64_t L, int64_t head,
                 float scale, float* s, int64_t ls, int64_t prefetch_bytes, int64_t prefetch_at) {
  constexpr int kPieces = (D + 63) / 64, kDwords = D < 64 ? D / 4 : 16;
  constexpr __mmask64 kLoad = D < 64 ? (__mmask64{1} << D) - 1 : ~__mmask64{0};
  const __m512i offset = _mm512_set1_epi32(static_cast<int>(0x80808080u));
  __m512 gscale[NG];
  __m512i corr1[NG], corr2[NG];
  for (int g = 0; g < NG; g++) {
    gscale[g] = _mm512_set1_ps(scale * qs[g].s * (1.0f / 256));
    corr1[g] = _mm512_set1_epi32(128 * qs[g].sum1);
    corr2[g] = _mm512_set1_epi32(128 * qs[g].sum2);
  }
  for (int64_t t0 = 0; t0 < L; t0 += 16) {
    if (prefetch_bytes)
      for (int64_t t = t0 + paged::kPrefetchTokens; t < t0 + paged::kPrefetchTokens + 16 && t < L; t++)
        paged::prefetch_bytes(seq.row(t) + prefetch_at, prefetch_bytes);
    const int64_t n = std::min<int64_t>(16, L - t0);
    const int8_t* base = seq.row(t0) + head;
    __m512i a1[NG], a2[NG];
    for (int g = 0; g < NG; g++) a1[g] = a2[g] = _mm512_setzero_si512();
    for (int piece = 0; piece < kPieces; piece++) {
      __m512i k[16];
      for (int i = 0; i < 16; i++)
        k[i] = _mm512_maskz_loadu_epi8(kLoad, base + std::min<int64_t>(i, n - 1) * seq.s_tok + 64 * piece);
      transpose16(k);
      for (int c = 0; c < kDwords; c++) {
        const __m512i kc = _mm512_xor_si512(k[c], offset);
        for (int g = 0; g < NG; g++) {
          int32_t w1, w2;
          memcpy(&w1, qs[g].q1 + 64 * piece + 4 * c, 4);
          memcpy(&w2, qs[g].q2 + 64 * piece + 4 * c, 4);
          a1[g] = _mm512_dpbusd_epi32(a1[g], kc, _mm512_set1_epi32(w1));
          a2[g] = _mm512_dpbusd_epi32(a2[g], kc, _mm512_set1_epi32(w2));
        }
      }
    }
    const __m512 kscale = _mm512_i32gather_ps(key_offsets(n, seq.s_tok), base + D, 1);
    for (int g = 0; g < NG; g++) {
      const __m512 d1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(a1[g], corr1[g]));
      const __m512 d2 = _mm512_cvtepi32_ps(_mm512_sub_epi32(a2[g], corr2[g]));
      const __m512 dot = _mm512_fmadd_ps(d1, _mm512_set1_ps(256.0f), d2);  // exact sums, one rounding
      _mm512_storeu_ps(s + g * ls + t0, _mm512_mul_ps(_mm512_mul_ps(dot, kscale), gscale[g]));
    }
  }
}

// Pass 3 for NG query heads of the kv head at byte `head` of each V row:
// out_g = inv_g * sum_t p_g[t] v_t (p: the softmax numerators, rows of ls).
template <int D, int NG, typename Store>
void accumulate_heads(const float* p, int64_t ls, const float* inv, const paged::PagedSeq<int8_t>& seq,
                      int64_t L, int64_t head, int64_t prefetch_bytes, int64_t prefetch_at, Store store) {
  constexpr int kVecs = D / 16;  // 32-bit lanes of the accumulators: 16 dimensions a vector
  alignas(64) float accf[NG][D];
  for (int g = 0; g < NG; g++)
    for (int d = 0; d < D; d++) accf[g][d] = 0.0f;
  for (int64_t t0 = 0; t0 < L; t0 += 16) {
    const int64_t n = std::min<int64_t>(16, L - t0);
    const __mmask16 live = static_cast<__mmask16>(n == 16 ? 0xFFFF : (1u << n) - 1);
    const int8_t* base = seq.row(t0) + seq.s_kv + head;
    if (prefetch_bytes)
      for (int64_t t = t0 + paged::kPrefetchTokens; t < t0 + paged::kPrefetchTokens + 16 && t < L; t++)
        paged::prefetch_bytes(seq.row(t) + seq.s_kv + prefetch_at, prefetch_bytes);
    const __m512i at = key_offsets(n, seq.s_tok);
    const __m512 vscale = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, at, base + D, 1);
    alignas(64) int16_t wq[NG][16];
    float cs[NG];
    bool any = false;
    for (int g = 0; g < NG; g++) {
      const __m512 w = _mm512_mul_ps(_mm512_maskz_loadu_ps(live, p + g * ls + t0), vscale);
      const float wmax = _mm512_reduce_max_ps(w);  // >= 0
      cs[g] = wmax * (1.0f / 32767);
      const __m512 r = wmax > 0.0f ? _mm512_mul_ps(w, _mm512_set1_ps(32767.0f / wmax)) : _mm512_setzero_ps();
      _mm256_store_si256(reinterpret_cast<__m256i*>(wq[g]), _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(r)));
      any |= wmax > 0.0f;
    }
    if (!any) continue;
    __m512i acc[NG][kVecs];
    for (int g = 0; g < NG; g++)
      for (int c = 0; c < kVecs; c++) acc[g][c] = _mm512_setzero_si512();
    for (int64_t j = 0; j < n; j += 2) {
      const int8_t* va = base + j * seq.s_tok;
      const int8_t* vb = base + std::min<int64_t>(j + 1, n - 1) * seq.s_tok;  // weight 0 past n
      __m512i pair[NG];
      for (int g = 0; g < NG; g++) {
        int32_t w;
        memcpy(&w, wq[g] + j, 4);
        pair[g] = _mm512_set1_epi32(w);
      }
      for (int c = 0; c < D / 32; c++) {
        const __m512i a = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(va + 32 * c)));
        const __m512i b = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vb + 32 * c)));
        const __m512i lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
        for (int g = 0; g < NG; g++) {
          acc[g][2 * c] = _mm512_dpwssd_epi32(acc[g][2 * c], lo, pair[g]);
          acc[g][2 * c + 1] = _mm512_dpwssd_epi32(acc[g][2 * c + 1], hi, pair[g]);
        }
      }
    }
    // unpacklo/hi work per 128-bit lane: dword 4k + i of chunk c's lo is dimension
    // 32c + 8k + i, of its hi 32c + 8k + 4 + i. Sums in that order, put right at the end.
    for (int g = 0; g < NG; g++) {
      const __m512 sc = _mm512_set1_ps(cs[g]);
      for (int c = 0; c < kVecs; c++) {
        float* f = accf[g] + 16 * c;
        _mm512_store_ps(f, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[g][c]), sc, _mm512_load_ps(f)));
      }
    }
  }
  for (int g = 0; g < NG; g++) {
    alignas(64) float o[D];
    for (int c = 0; c < D / 32; c++)
      for (int k = 0; k < 4; k++)
        for (int i = 0; i < 4; i++) {
          o[32 * c + 8 * k + i] = accf[g][32 * c + 4 * k + i] * inv[g];
          o[32 * c + 8 * k + 4 + i] = accf[g][32 * c + 16 + 4 * k + i] * inv[g];
        }
    store(g, o);
  }
}

}  // namespace attn_i8
