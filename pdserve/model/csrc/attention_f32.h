// Decode attention in float math over a paged KV cache of either format:
// - FloatKV: float32 K/V (the float32 library's cache);
// - Int8KV: the 8-bit cache (`--kv-cache-dtype int8`) of either library. Each (token, kv
//   head) is D int8 values and then its float32 scale, so a head's row is D + 4 bytes and
//   a block carries its own scales: a P/D transfer of the block's bytes moves them too.
//   Values are round(x / scale) with scale = max|x| / 127 (0 for an all-zero head), the
//   same arithmetic as pdserve/model/kv_format.py, so both paths store identical bytes.
// Queries and outputs are float32 here; the bf16 library converts at the edges.
//
// One query token per sequence; keys and values are read in place through the block table.
// q[b] starts at q + b * q_stride with H heads of D; out is [B, H, D] contiguous. A task is
// one sequence and a range of its kv heads (paged_decode.h hands them out). Three passes:
// 1. scores of every (kv head, query head) of the task, kLanes keys at a time: the keys'
//    row addresses are looked up once for all heads, and each head's kLanes dot-product
//    vectors are summed by one transpose-and-add instead of kLanes horizontal sums (an
//    8-bit key's scale multiplies its finished dot product);
// 2. per query head, exp(score - max) and its sum (an exact softmax over the whole row);
// 3. each value row accumulated into as many query heads as the registers hold, over a
//    slice of at most 8 vectors of dimensions (an 8-bit value's scale folds into its
//    softmax weight); the sum is divided out at the end.
// The first pass over K and over V prefetch the task's rows kPrefetchTokens ahead.
//
// Needs vec_x86.h and paged_decode.h included first.

#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <vector>

namespace attn {

using vec::F;
using vec::kLanes;

struct FloatKV {
  using Elem = float;
  static constexpr bool kScaled = false;
  static constexpr int64_t head_stride(int64_t D) { return D; }
  static F load(const float* p) { return vec::load(p); }
  static float scale(const float*, int64_t) { return 1.0f; }
};

struct Int8KV {
  using Elem = int8_t;
  static constexpr bool kScaled = true;
  static constexpr int64_t head_stride(int64_t D) { return D + 4; }
  static F load(const int8_t* p) { return vec::load_i8(p); }
  static float scale(const int8_t* head, int64_t D) {
    float s;
    memcpy(&s, head + D, sizeof s);
    return s;
  }
};

// Quantizes one head (D values, read through to_float) into dst: D int8 values, then the
// float32 scale.
template <typename T, typename ToFloat>
inline void quantize_head(const T* x, int8_t* dst, int64_t D, ToFloat to_float) {
  float amax = 0.0f;
  for (int64_t i = 0; i < D; i++) amax = fmaxf(amax, fabsf(to_float(x[i])));
  const float scale = amax / 127.0f;
  for (int64_t i = 0; i < D; i++) {
    const float q = scale > 0.0f ? nearbyintf(to_float(x[i]) / scale) : 0.0f;
    dst[i] = static_cast<int8_t>(fminf(fmaxf(q, -127.0f), 127.0f));
  }
  memcpy(dst + D, &scale, sizeof scale);
}

// Stores a token's Hkv heads of keys and of values (rows of T) in the 8-bit cache slot.
template <typename T, typename ToFloat>
inline void store_kv_int8(const T* keys, const T* values, int8_t* slot, int64_t s_kv,
                          int64_t Hkv, int64_t D, ToFloat to_float) {
  const int64_t hs = Int8KV::head_stride(D);
  for (int64_t h = 0; h < Hkv; h++) {
    quantize_head(keys + h * D, slot + h * hs, D, to_float);
    quantize_head(values + h * D, slot + s_kv + h * hs, D, to_float);
  }
}

template <typename KV>
using Seq = paged::PagedSeq<typename KV::Elem>;

using paged::kPrefetchTokens;
using paged::prefetch_bytes;

// kLanes dot products q . row_i over D, summed across lanes by one transpose-and-add.
template <int D, typename E, typename Load>
inline F dot_rows(const float* q, const E* const* rows, Load load) {
  F part[kLanes];
  for (int i = 0; i < kLanes; i++) part[i] = vec::zero();
  for (int c = 0; c < D; c += kLanes) {
    const F qv = vec::load(q + c);
    for (int i = 0; i < kLanes; i++) part[i] = vec::fmadd(load(rows[i] + c), qv, part[i]);
  }
  return vec::transpose_add(part);
}

// Pass 1: s[(h * G + g) * ls + t] = scale * q_{hk0 + h, g} . k_t for t < L (rows padded
// to ls, a multiple of kLanes; the padding is overwritten by pass 2). 8-bit keys shared by
// several query heads are widened to float once, into an L1 tile, not once per head.
template <typename KV, int D>
void score_task(const float* q, const Seq<KV>& seq, int64_t L, int64_t hk0, int64_t nhk,
                int64_t G, float scale, float* s, int64_t ls) {
  constexpr int64_t HS = KV::head_stride(D);
  const F vscale = vec::set1(scale);
  alignas(64) float tile[KV::kScaled ? kLanes * D : 1];
  const float* widened[kLanes];
  for (int i = 0; i < kLanes; i++) widened[i] = tile + (KV::kScaled ? i * D : 0);
  for (int64_t t0 = 0; t0 < L; t0 += kLanes) {
    const typename KV::Elem* key[kLanes];
    for (int i = 0; i < kLanes; i++) key[i] = seq.row(t0 + i < L ? t0 + i : L - 1) + hk0 * HS;
    for (int64_t t = t0 + kPrefetchTokens; t < t0 + kPrefetchTokens + kLanes && t < L; t++)
      prefetch_bytes(seq.row(t) + hk0 * HS, nhk * HS * sizeof(typename KV::Elem));
    for (int64_t h = 0; h < nhk; h++) {
      const typename KV::Elem* kh[kLanes];
      for (int i = 0; i < kLanes; i++) kh[i] = key[i] + h * HS;
      F kscale = vscale;
      bool widen = false;
      if constexpr (KV::kScaled) {
        float ks[kLanes];
        for (int i = 0; i < kLanes; i++) ks[i] = KV::scale(kh[i], D);
        kscale = vec::mul(vec::load(ks), vscale);
        widen = G > 1;
        if (widen)
          for (int i = 0; i < kLanes; i++)
            for (int c = 0; c < D; c += kLanes) vec::store(tile + i * D + c, KV::load(kh[i] + c));
      }
      for (int64_t g = 0; g < G; g++) {
        const float* qh = q + ((hk0 + h) * G + g) * D;
        const F dots = widen ? dot_rows<D>(qh, widened, vec::load) : dot_rows<D>(qh, kh, KV::load);
        vec::store(s + (h * G + g) * ls + t0, vec::mul(dots, kscale));
      }
    }
  }
}

// Pass 2: s[t] = exp(s[t] - max) over the row's first L scores (the padding becomes ~0);
// returns 1 / their sum.
inline float exp_row(float* s, int64_t L, int64_t ls) {
  for (int64_t t = L; t < ls; t++) s[t] = -INFINITY;
  F vmax = vec::set1(-INFINITY);
  for (int64_t t = 0; t < ls; t += kLanes) vmax = vec::max(vmax, vec::load(s + t));
  const F mx = vec::set1(vec::reduce_max(vmax));
  F vsum = vec::zero();
  for (int64_t t = 0; t < ls; t += kLanes) {
    const F e = vec::exp(vec::sub(vec::load(s + t), mx));
    vec::store(s + t, e);
    vsum = vec::add(vsum, e);
  }
  return 1.0f / vec::reduce_add(vsum);
}

// Pass 3 for NG query heads of kv head hk, dimensions d0..d0+DS-1:
// out_g[d] = inv_g * sum_t p_g[t] v_t[d].
template <typename KV, int DS, int NG>
void accumulate_values(const float* p, int64_t ls, const float* inv, const Seq<KV>& seq,
                       int64_t L, int64_t hk, int64_t D, int64_t d0, float* out,
                       int64_t prefetch, int64_t hk0) {
  constexpr int kV = DS / kLanes;
  const int64_t hs = KV::head_stride(D);
  F acc[NG][kV];
  for (int g = 0; g < NG; g++)
    for (int c = 0; c < kV; c++) acc[g][c] = vec::zero();
  for (int64_t t = 0; t < L; t++) {
    if (prefetch && t + kPrefetchTokens < L)
      prefetch_bytes(seq.row(t + kPrefetchTokens) + seq.s_kv + hk0 * hs, prefetch);
    const typename KV::Elem* head = seq.row(t) + seq.s_kv + hk * hs;
    const float vscale = KV::scale(head, D);
    F vv[kV];
    for (int c = 0; c < kV; c++) vv[c] = KV::load(head + d0 + c * kLanes);
    for (int g = 0; g < NG; g++) {
      const F pg = vec::set1(KV::kScaled ? p[g * ls + t] * vscale : p[g * ls + t]);
      for (int c = 0; c < kV; c++) acc[g][c] = vec::fmadd(pg, vv[c], acc[g][c]);
    }
  }
  for (int g = 0; g < NG; g++) {
    const F sc = vec::set1(inv[g]);
    for (int c = 0; c < kV; c++) vec::store(out + g * D + d0 + c * kLanes, vec::mul(acc[g][c], sc));
  }
}

// accumulate_values for n <= NG heads (a template per count, picked at run time).
template <typename KV, int DS, int NG>
void accumulate_heads(int64_t n, const float* p, int64_t ls, const float* inv,
                      const Seq<KV>& seq, int64_t L, int64_t hk, int64_t D, int64_t d0,
                      float* out, int64_t prefetch, int64_t hk0) {
  if constexpr (NG > 1) {
    if (n < NG) {
      accumulate_heads<KV, DS, NG - 1>(n, p, ls, inv, seq, L, hk, D, d0, out, prefetch, hk0);
      return;
    }
  }
  accumulate_values<KV, DS, NG>(p, ls, inv, seq, L, hk, D, d0, out, prefetch, hk0);
}

template <typename KV, int D>
void attend_task(const float* q, const Seq<KV>& seq, int64_t L, int64_t hk0, int64_t nhk,
                 int64_t G, float scale, std::vector<float>& scratch, float* out) {
  const int64_t ls = (L + kLanes - 1) / kLanes * kLanes, rows = nhk * G;
  if (static_cast<int64_t>(scratch.size()) < rows * (ls + 1)) scratch.resize(rows * (ls + 1));
  float* s = scratch.data();
  float* inv = s + rows * ls;
  score_task<KV, D>(q, seq, L, hk0, nhk, G, scale, s, ls);
  for (int64_t r = 0; r < rows; r++) inv[r] = exp_row(s + r * ls, L, ls);
  constexpr int DS = D < 8 * kLanes ? D : 8 * kLanes;  // at most 8 vectors a slice
  constexpr int kHeads = vec::kAccumulators / (DS / kLanes);
  constexpr int NG = kHeads < 1 ? 1 : kHeads;
  const int64_t row_bytes = nhk * KV::head_stride(D) * sizeof(typename KV::Elem);
  for (int64_t h = 0; h < nhk; h++) {
    const int64_t hk = hk0 + h;
    for (int64_t d0 = 0; d0 < D; d0 += DS) {
      for (int64_t g0 = 0; g0 < G; g0 += NG) {
        const int64_t n = G - g0 < NG ? G - g0 : NG, r = h * G + g0;
        const int64_t pf = h == 0 && d0 == 0 && g0 == 0 ? row_bytes : 0;
        accumulate_heads<KV, DS, NG>(n, s + r * ls, ls, inv + r, seq, L, hk, D, d0,
                                     out + (hk * G + g0) * D, pf, hk0);
      }
    }
  }
}

// The whole decode attention (see the top of the file); 0, or -1 for a head size without
// a specialisation (32, 64, 128, 256 exist). Strides are in KV::Elem.
template <typename KV>
int decode_attention(const float* q, int64_t q_stride, const typename KV::Elem* kv,
                     int64_t s_block, int64_t s_kv, int64_t s_tok, const int64_t* block_tables,
                     int64_t max_blocks, const int64_t* seq_lens, float* out, int64_t B,
                     int64_t H, int64_t Hkv, int64_t D, int64_t block_size, float scale,
                     int64_t window) {
  const int64_t G = H / Hkv;
  return paged::with_head_size(D, [&](auto head_size) {
    constexpr int kD = decltype(head_size)::value;
    paged::for_each_decode_task(
        kv, s_block, s_kv, s_tok, block_tables, max_blocks, seq_lens, B, Hkv, block_size, window,
        [&](int64_t b, const Seq<KV>& seq, int64_t L, int64_t hk0, int64_t nhk,
            std::vector<float>& scratch) {
          attend_task<KV, kD>(q + b * q_stride, seq, L, hk0, nhk, G, scale, scratch, out + b * H * D);
        });
  });
}

}  // namespace attn
