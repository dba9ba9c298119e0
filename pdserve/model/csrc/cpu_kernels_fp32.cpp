// Fused float32 kernels for the CPU decode path, written once against the vector
// operations of vec_x86.h: AVX2 + FMA (8 lanes; every x86-64 CPU since about 2015) or
// AVX-512 (16 lanes). The float32 twin of cpu_kernels.cpp (bf16 on AVX512-BF16 / AMX),
// with the same entry points and the same structure:
// - a small-M linear that streams each weight from memory once per call;
// - residual add + RMSNorm, SiLU * up, rotary + KV-cache write, each one pass;
// - decode attention read in place from the paged cache;
// - every layer of a decode-only step in one call.
//
// Built on first use by pdserve/model/cpu_kernels.py and called through ctypes with raw
// pointers. Activations, weights, the KV cache and every accumulation are float32, so the
// output matches PyTorch's float32 path up to the order of additions. Shapes are checked
// on the Python side; the kernels trust them.

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "paged_decode.h"
#include "quant_linear.h"
#include "vec_x86.h"

using vec::F;
using vec::kLanes;

namespace {

// ---------------------------------------------------------------------------------------
// Small-M linear: y[M, N] = x[M, K] W[N, K]^T (+ bias), K % kLanes == 0, weights as they
// are stored (no packing).
//
// A register tile is MT rows of x against R rows of W (kTileRows x kTileWeights at most):
// each step along K loads the R weight vectors once and each x vector once, and does the
// MT x R FMAs (on AVX2, 12 accumulators + 3 weights + 1 x = all 16 registers). A task is
// one group of R weight rows against every row of x: its first tile streams the group from
// memory (prefetching the next group's rows), the other tiles find it in L1. Each weight
// byte is thus read from memory once per call, whatever M is; oneDNN/MKL instead repack
// the weights on every call at these shapes.

constexpr int kR = vec::kTileWeights;
constexpr int kFloatsPerLine = 64 / sizeof(float);

template <int MT, int R, bool kPrefetch>
inline void linear_tile(const float* x, const float* w, const float* bias, float* y,
                        int64_t N, int64_t K, int64_t n0) {
  F acc[MT][R];
  for (int m = 0; m < MT; m++)
    for (int r = 0; r < R; r++) acc[m][r] = vec::zero();
  for (int64_t k = 0; k < K; k += kLanes) {
    F wv[R];
    for (int r = 0; r < R; r++) {
      if (kPrefetch && k % kFloatsPerLine == 0) vec::prefetch(w + (r + R) * K + k);
      wv[r] = vec::load(w + r * K + k);
    }
    for (int m = 0; m < MT; m++) {
      const F xv = vec::load(x + m * K + k);
      for (int r = 0; r < R; r++) acc[m][r] = vec::fmadd(wv[r], xv, acc[m][r]);
    }
  }
  for (int m = 0; m < MT; m++)
    for (int r = 0; r < R; r++)
      y[m * N + n0 + r] = vec::reduce_add(acc[m][r]) + (bias ? bias[n0 + r] : 0.0f);
}

// Every row of x against the R weight rows at wg, which are rows n0..n0+R-1 of y.
template <int R>
inline void linear_group(const float* x, const float* wg, const float* bias, float* y,
                         int64_t M, int64_t N, int64_t K, int64_t n0, bool prefetch) {
  constexpr int MT = vec::kTileRows;
  int64_t m = 0;
  if (M >= MT) {  // the first tile brings the group in from memory
    if (prefetch)
      linear_tile<MT, R, true>(x, wg, bias, y, N, K, n0);
    else
      linear_tile<MT, R, false>(x, wg, bias, y, N, K, n0);
    m = MT;
  }
  for (; m + MT <= M; m += MT) linear_tile<MT, R, false>(x + m * K, wg, bias, y + m * N, N, K, n0);
  static_assert(MT == 4, "the tail below handles 1-3 rows");
  const float *xm = x + m * K;
  float* ym = y + m * N;
  const bool first = m == 0 && prefetch;
  switch (M - m) {
    case 1: first ? linear_tile<1, R, true>(xm, wg, bias, ym, N, K, n0)
                  : linear_tile<1, R, false>(xm, wg, bias, ym, N, K, n0); break;
    case 2: first ? linear_tile<2, R, true>(xm, wg, bias, ym, N, K, n0)
                  : linear_tile<2, R, false>(xm, wg, bias, ym, N, K, n0); break;
    case 3: first ? linear_tile<3, R, true>(xm, wg, bias, ym, N, K, n0)
                  : linear_tile<3, R, false>(xm, wg, bias, ym, N, K, n0); break;
    default: break;
  }
}

// Weight rows in groups of R, the groups split between the threads.
template <int R>
void linear_groups(const float* x, const float* w, const float* bias, float* y, int64_t M,
                   int64_t N, int64_t K) {
  const int64_t groups = N / R;
#pragma omp parallel for schedule(static)
  for (int64_t g = 0; g < groups; g++)
    linear_group<R>(x, w + g * R * K, bias, y, M, N, K, g * R, g + 1 < groups);
  for (int64_t n = groups * R; n < N; n++)  // rows left over when N % R != 0
    linear_group<1>(x, w + n * K, bias, y, M, N, K, n, false);
}

// One row of x (batch-1 decode) is bound by how fast the weights stream in, not by the
// FMAs. One weight row at a time, in storage order, with kChainsM1 independent FMA chains
// along K: each thread then reads a single sequential stream, which the hardware
// prefetchers follow best. The default model's decode-step weights (538 MB, 2 threads,
// AVX2 forced on a 2-core AVX512-BF16 EPYC whose copy bandwidth is ~80 GB/s):
// 6.6-6.8 ms (79-81 GB/s), against 7.7-8.3 ms for 8 rows interleaved and 8.4-9.0 ms with
// software prefetch added to either (bench/linear_m1_probe.cpp).
constexpr int kChainsM1 = 4;

void linear_m1(const float* x, const float* w, const float* bias, float* y, int64_t N,
               int64_t K) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; n++) {
    const float* wn = w + n * K;
    F acc[kChainsM1];
    for (int c = 0; c < kChainsM1; c++) acc[c] = vec::zero();
    int64_t k = 0;
    for (; k + kChainsM1 * kLanes <= K; k += kChainsM1 * kLanes)
      for (int c = 0; c < kChainsM1; c++)
        acc[c] = vec::fmadd(vec::load(wn + k + c * kLanes), vec::load(x + k + c * kLanes), acc[c]);
    for (; k < K; k += kLanes) acc[0] = vec::fmadd(vec::load(wn + k), vec::load(x + k), acc[0]);
    for (int c = 1; c < kChainsM1; c++) acc[0] = vec::add(acc[0], acc[c]);
    y[n] = vec::reduce_add(acc[0]) + (bias ? bias[n] : 0.0f);
  }
}

// Weights in a GGUF block format (quant_linear.h's linear): groups of kR rows dequantized
// for the dense linear above when x has more rows than the fused loop takes.
int linear_quant(const float* x, const uint8_t* w, int64_t type, const float* bias, float* y,
                 int64_t M, int64_t N, int64_t K) {
  return quant::linear<float, kR>(x, w, type, bias, y, M, N, K, [&](const float* wg, int64_t n0, int64_t rows) {
    if (rows == kR)
      linear_group<kR>(x, wg, bias, y, M, N, K, n0, false);
    else
      for (int64_t r = 0; r < rows; r++) linear_group<1>(x, wg + r * K, bias, y, M, N, K, n0 + r, false);
  });
}

}  // namespace

extern "C" {

void pd_linear_small(const float* x, const float* w, const float* bias, float* y, int64_t M,
                     int64_t N, int64_t K) {
  if (M == 1)
    linear_m1(x, w, bias, y, N, K);
  else
    linear_groups<kR>(x, w, bias, y, M, N, K);
}

// Weights in a GGUF block format (quant_linear.h); -1 for a format without a kernel.
int pd_linear_quant(const float* x, const uint8_t* w, int64_t type, const float* bias,
                    float* y, int64_t M, int64_t N, int64_t K) {
  return linear_quant(x, w, type, bias, y, M, N, K);
}

int pd_dequantize(const uint8_t* w, int64_t type, float* out, int64_t N, int64_t K) {
  return quant::dequantize(w, type, out, N, K);
}

// ---------------------------------------------------------------------------------------
// x = x + delta (when delta is given), then out = x * rsqrt(mean(x^2) + eps) * weight.
// Rows of H elements, H % kLanes == 0.

void pd_add_rms_norm(float* x, const float* delta, const float* weight, float* out, int64_t T,
                     int64_t H, float eps) {
#pragma omp parallel for schedule(static) if (T > 1)
  for (int64_t t = 0; t < T; t++) {
    float* xr = x + t * H;
    F ss = vec::zero();
    for (int64_t i = 0; i < H; i += kLanes) {
      F v = vec::load(xr + i);
      if (delta) {
        v = vec::add(v, vec::load(delta + t * H + i));
        vec::store(xr + i, v);
      }
      ss = vec::fmadd(v, v, ss);
    }
    const F scale = vec::set1(1.0f / sqrtf(vec::reduce_add(ss) / static_cast<float>(H) + eps));
    for (int64_t i = 0; i < H; i += kLanes)
      vec::store(out + t * H + i, vec::mul(vec::mul(vec::load(xr + i), scale), vec::load(weight + i)));
  }
}

// ---------------------------------------------------------------------------------------
// out[t, i] = silu(gate_up[t, i]) * gate_up[t, I + i]; I % kLanes == 0.

void pd_silu_mul(const float* gate_up, float* out, int64_t T, int64_t I) {
#pragma omp parallel for schedule(static) if (T * I >= 16384)
  for (int64_t t = 0; t < T; t++) {
    const float* g = gate_up + t * 2 * I;
    for (int64_t i = 0; i < I; i += kLanes) {
      const F gv = vec::load(g + i);
      const F silu = vec::div(gv, vec::add(vec::set1(1.0f), vec::exp(vec::sub(vec::zero(), gv))));
      vec::store(out + t * I + i, vec::mul(silu, vec::load(g + I + i)));
    }
  }
}

// ---------------------------------------------------------------------------------------
// Rotary (rotate-half form) applied in place to the query and key heads of a fused
// qkv[T, H + 2 Hkv, D] buffer, then the rotated keys and the values written to their
// cache slots. cos/sin are tables [max_positions, D] (each half repeats the other). The
// cache is addressed by strides (in elements): block, K/V plane, token; heads are
// contiguous within a token. D % (2 kLanes) == 0.

void pd_rotary_write_kv(float* qkv, int64_t T, int64_t H, int64_t Hkv, int64_t D,
                        const float* cos, const float* sin, const int64_t* positions,
                        float* kv, int64_t s_block, int64_t s_kv, int64_t s_tok,
                        const int64_t* slot_blocks, const int64_t* slot_offsets) {
  const int64_t half = D / 2, width = (H + 2 * Hkv) * D;
#pragma omp parallel for schedule(static) if (T > 1)
  for (int64_t t = 0; t < T; t++) {
    float* row = qkv + t * width;
    const float* c = cos + positions[t] * D;
    const float* s = sin + positions[t] * D;
    for (int64_t h = 0; h < H + Hkv; h++) {
      float* x = row + h * D;
      for (int64_t i = 0; i < half; i += kLanes) {
        const F x1 = vec::load(x + i), x2 = vec::load(x + half + i);
        const F c1 = vec::load(c + i), s1 = vec::load(s + i);
        vec::store(x + i, vec::fmsub(x1, c1, vec::mul(x2, s1)));
        vec::store(x + half + i, vec::fmadd(x2, c1, vec::mul(x1, s1)));
      }
    }
    float* slot = kv + slot_blocks[t] * s_block + slot_offsets[t] * s_tok;
    memcpy(slot, row + H * D, Hkv * D * sizeof(float));                // keys
    memcpy(slot + s_kv, row + (H + Hkv) * D, Hkv * D * sizeof(float));  // values
  }
}

}  // extern "C"

// ---------------------------------------------------------------------------------------
// Decode attention straight from the paged cache: one query token per sequence, keys and
// values read in place through the block table. q[b] starts at q + b * q_stride with H
// heads of D; out is [B, H, D] contiguous.
//
// A task is one sequence and a range of its kv heads (paged_decode.h hands them out).
// Three passes, as in the bf16 kernel:
// 1. scores of every (kv head, query head) of the task, kLanes keys at a time: the keys'
//    row addresses are looked up once for all heads, and each head's kLanes dot-product
//    vectors are summed by one transpose-and-add instead of kLanes horizontal sums;
// 2. per query head, exp(score - max) and its sum (an exact softmax over the whole row);
// 3. each value row accumulated into as many query heads as the registers hold, over a
//    slice of at most 8 vectors of dimensions; the sum is divided out at the end.
// The first pass over K and over V prefetch the task's rows kPrefetchTokens ahead.

namespace {

using PagedSeq = paged::PagedSeq<float>;
using paged::kPrefetchTokens;
using paged::prefetch_bytes;

// Pass 1: s[(h * G + g) * ls + t] = scale * q_{hk0 + h, g} . k_t for t < L (rows padded
// to ls, a multiple of kLanes; the padding is overwritten by pass 2).
template <int D>
void score_task(const float* q, const PagedSeq& seq, int64_t L, int64_t hk0, int64_t nhk,
                int64_t G, float scale, float* s, int64_t ls) {
  const F vscale = vec::set1(scale);
  for (int64_t t0 = 0; t0 < L; t0 += kLanes) {
    const float* key[kLanes];
    for (int i = 0; i < kLanes; i++) key[i] = seq.row(t0 + i < L ? t0 + i : L - 1) + hk0 * D;
    for (int64_t t = t0 + kPrefetchTokens; t < t0 + kPrefetchTokens + kLanes && t < L; t++)
      prefetch_bytes(seq.row(t) + hk0 * D, nhk * D * sizeof(float));
    for (int64_t h = 0; h < nhk; h++) {
      for (int64_t g = 0; g < G; g++) {
        const float* qh = q + ((hk0 + h) * G + g) * D;
        F part[kLanes];
        for (int i = 0; i < kLanes; i++) part[i] = vec::zero();
        for (int c = 0; c < D; c += kLanes) {
          const F qv = vec::load(qh + c);
          for (int i = 0; i < kLanes; i++)
            part[i] = vec::fmadd(vec::load(key[i] + h * D + c), qv, part[i]);
        }
        vec::store(s + (h * G + g) * ls + t0, vec::mul(vec::transpose_add(part), vscale));
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
template <int DS, int NG>
void accumulate_values(const float* p, int64_t ls, const float* inv, const PagedSeq& seq,
                       int64_t L, int64_t hk, int64_t D, int64_t d0, float* out,
                       int64_t prefetch, int64_t hk0) {
  constexpr int kV = DS / kLanes;
  F acc[NG][kV];
  for (int g = 0; g < NG; g++)
    for (int c = 0; c < kV; c++) acc[g][c] = vec::zero();
  for (int64_t t = 0; t < L; t++) {
    if (prefetch && t + kPrefetchTokens < L)
      prefetch_bytes(seq.row(t + kPrefetchTokens) + seq.s_kv + hk0 * D, prefetch);
    const float* v = seq.row(t) + seq.s_kv + hk * D + d0;
    F vv[kV];
    for (int c = 0; c < kV; c++) vv[c] = vec::load(v + c * kLanes);
    for (int g = 0; g < NG; g++) {
      const F pg = vec::set1(p[g * ls + t]);
      for (int c = 0; c < kV; c++) acc[g][c] = vec::fmadd(pg, vv[c], acc[g][c]);
    }
  }
  for (int g = 0; g < NG; g++) {
    const F sc = vec::set1(inv[g]);
    for (int c = 0; c < kV; c++) vec::store(out + g * D + d0 + c * kLanes, vec::mul(acc[g][c], sc));
  }
}

// accumulate_values for n <= NG heads (a template per count, picked at run time).
template <int DS, int NG>
void accumulate_heads(int64_t n, const float* p, int64_t ls, const float* inv,
                      const PagedSeq& seq, int64_t L, int64_t hk, int64_t D, int64_t d0,
                      float* out, int64_t prefetch, int64_t hk0) {
  if constexpr (NG > 1) {
    if (n < NG) {
      accumulate_heads<DS, NG - 1>(n, p, ls, inv, seq, L, hk, D, d0, out, prefetch, hk0);
      return;
    }
  }
  accumulate_values<DS, NG>(p, ls, inv, seq, L, hk, D, d0, out, prefetch, hk0);
}

template <int D>
void attend_task(const float* q, const PagedSeq& seq, int64_t L, int64_t hk0, int64_t nhk,
                 int64_t G, float scale, std::vector<float>& scratch, float* out) {
  const int64_t ls = (L + kLanes - 1) / kLanes * kLanes, rows = nhk * G;
  if (static_cast<int64_t>(scratch.size()) < rows * (ls + 1)) scratch.resize(rows * (ls + 1));
  float* s = scratch.data();
  float* inv = s + rows * ls;
  score_task<D>(q, seq, L, hk0, nhk, G, scale, s, ls);
  for (int64_t r = 0; r < rows; r++) inv[r] = exp_row(s + r * ls, L, ls);
  constexpr int DS = D < 8 * kLanes ? D : 8 * kLanes;  // at most 8 vectors a slice
  constexpr int kHeads = vec::kAccumulators / (DS / kLanes);
  constexpr int NG = kHeads < 1 ? 1 : kHeads;
  for (int64_t h = 0; h < nhk; h++) {
    const int64_t hk = hk0 + h;
    for (int64_t d0 = 0; d0 < D; d0 += DS) {
      for (int64_t g0 = 0; g0 < G; g0 += NG) {
        const int64_t n = G - g0 < NG ? G - g0 : NG, r = h * G + g0;
        const int64_t pf = h == 0 && d0 == 0 && g0 == 0 ? nhk * D * sizeof(float) : 0;
        accumulate_heads<DS, NG>(n, s + r * ls, ls, inv + r, seq, L, hk, D, d0,
                                 out + (hk * G + g0) * D, pf, hk0);
      }
    }
  }
}

}  // namespace

extern "C" {

// Returns 0, or -1 for a head size without a specialisation (32, 64, 128, 256 exist).
// block_size must be a power of two (CacheConfig enforces it).
int pd_decode_attention(const float* q, int64_t q_stride, const float* kv, int64_t s_block,
                        int64_t s_kv, int64_t s_tok, const int64_t* block_tables,
                        int64_t max_blocks, const int64_t* seq_lens, float* out, int64_t B,
                        int64_t H, int64_t Hkv, int64_t D, int64_t block_size, float scale) {
  const int64_t G = H / Hkv;
  return paged::with_head_size(D, [&](auto head_size) {
    constexpr int kD = decltype(head_size)::value;
    paged::for_each_decode_task(
        kv, s_block, s_kv, s_tok, block_tables, max_blocks, seq_lens, B, Hkv, block_size,
        [&](int64_t b, const PagedSeq& seq, int64_t hk0, int64_t nhk, std::vector<float>& scratch) {
          attend_task<kD>(q + b * q_stride, seq, seq_lens[b], hk0, nhk, G, scale, scratch,
                          out + b * H * D);
        });
  });
}

// Every layer of a decode-only step in one call (paged_decode.h); the packed-weight
// pointers stay null here.
static void step_linear(const float* x, const void* w, const float*, int64_t type,
                        const float* bias, float* y, int64_t M, int64_t N, int64_t K) {
  if (type)
    linear_quant(x, static_cast<const uint8_t*>(w), type, bias, y, M, N, K);
  else
    pd_linear_small(x, static_cast<const float*>(w), bias, y, M, N, K);
}

int pd_decode_layers(const paged::DecodeLayer<float>* layers, int64_t num_layers, float* x,
                     float* delta_out, int64_t T, int64_t hidden, int64_t H, int64_t Hkv,
                     int64_t D, int64_t inter, float eps, float scale, const float* cos,
                     const float* sin, const int64_t* positions, int64_t s_block,
                     int64_t s_kv, int64_t s_tok, const int64_t* slot_blocks,
                     const int64_t* slot_offsets, const int64_t* block_tables,
                     int64_t max_blocks, const int64_t* seq_lens, int64_t block_size) {
  static const paged::StepKernels<float> kernels{pd_add_rms_norm, step_linear,
                                                 pd_rotary_write_kv, pd_decode_attention,
                                                 pd_silu_mul};
  return paged::decode_layers(kernels, layers, num_layers, x, delta_out, T, hidden, H, Hkv, D,
                              inter, eps, scale, cos, sin, positions, s_block, s_kv, s_tok,
                              slot_blocks, slot_offsets, block_tables, max_blocks, seq_lens,
                              block_size);
}

}  // extern "C"
