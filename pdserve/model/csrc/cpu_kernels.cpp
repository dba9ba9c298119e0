// Fused bf16 kernels for the CPU decode path (x86-64 with AVX512-BF16).
//
// Built on first use by pdserve/model/cpu_kernels.py (g++ -O3 -march=native -fopenmp) and
// called through ctypes with raw pointers: no PyTorch headers, so a build takes about a
// second. OpenMP regions run on the process's libgomp, the same runtime (and threads) that
// PyTorch uses, so the kernels never oversubscribe the cores.
//
// Every kernel reads and writes bf16 and computes in fp32. Shapes are checked on the
// Python side; the kernels trust them.

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <vector>

#if !defined(__AVX512BF16__) || !defined(__AVX512F__)
#error "cpu_kernels.cpp needs AVX512-BF16 (the Python side checks before building)"
#endif

#define PD_VEC_AVX512  // the float math (exp, transposed sums) of vec_x86.h, on 16 lanes
#include "paged_decode.h"
#include "quant_linear.h"
#include "vec_x86.h"
#include "attention_f32.h"
#include "attention_int8.h"

typedef uint16_t bf16;
using quant::with_count;

namespace {

inline __m512 load16(const bf16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline void store16(bf16* p, __m512 v) {  // round to nearest even
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}

// 16 floats out as bf16 (a final output) or as they are (a part of a split sequence).
inline void put16(bf16* p, __m512 v) { store16(p, v); }
inline void put16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }

inline float to_f32(bf16 v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

inline bf16 to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<bf16>(u >> 16);
}

// 2^x for x <= 0 (-inf included: 0) to ~5e-5 relative: softmax weights that are then
// rounded to bf16 (2e-3), with log2(e) folded into the caller's scale. 8 ops to vec::exp's 13:
// the prefill attention kernel's softmax is most of its time (1.24-1.46x from this alone).
inline __m512 exp2_softmax(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);  // [-0.5, 0.5]: 2^f = e^(f ln2), Taylor to f^4
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.00961812911f), f, _mm512_set1_ps(0.0555041087f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.240226507f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.693147181f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// ---------------------------------------------------------------------------------------
// Small-M linear: y[M, N] = x[M, K] W[N, K]^T (+ bias), for small M (any) and K % 32 == 0.
//
// Memory-bound: every weight byte is read once per call. Each task takes R rows of W and
// all of x, accumulating 32-element dot products with vdpbf16ps (bf16 pairs multiplied
// exactly, summed in fp32), and prefetches the next rows. oneDNN reaches ~10 GB/s on these
// shapes here; this loop ~20 GB/s, so batch-1 decode reads its weights twice as fast.

constexpr int kRows = 4;

// The linears write bf16, or float32 for the logits (`pd_logits`): `put` stores either.
inline void put(bf16* y, float v) { *y = to_bf16(v); }
inline void put(float* y, float v) { *y = v; }

template <int MT, bool kPrefetch, typename Y>
inline void linear_tile(const bf16* x, const bf16* w, const bf16* bias, Y* y, int64_t N,
                        int64_t K, int64_t n0) {
  __m512 acc[MT][kRows];
  for (int m = 0; m < MT; m++)
    for (int r = 0; r < kRows; r++) acc[m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh wv[kRows];
    for (int r = 0; r < kRows; r++) {
      if (kPrefetch) _mm_prefetch(reinterpret_cast<const char*>(w + (r + kRows) * K + k), _MM_HINT_T0);
      wv[r] = (__m512bh)_mm512_loadu_si512(w + r * K + k);
    }
    for (int m = 0; m < MT; m++) {
      __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k);
      for (int r = 0; r < kRows; r++) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wv[r], xv);
    }
  }
  for (int m = 0; m < MT; m++)
    for (int r = 0; r < kRows; r++) {
      float s = _mm512_reduce_add_ps(acc[m][r]);
      if (bias) s += to_f32(bias[n0 + r]);
      put(y + m * N + n0 + r, s);
    }
}

inline float dot_row(const bf16* x, const bf16* w, int64_t K) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32)
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(w + k),
                           (__m512bh)_mm512_loadu_si512(x + k));
  return _mm512_reduce_add_ps(acc);
}

template <int MT, typename Y>
inline void linear_rows(const bf16* x, const bf16* w, const bf16* bias, Y* y, int64_t N,
                        int64_t K, int64_t n0, bool first_tile) {
  if (first_tile)
    linear_tile<MT, true>(x, w, bias, y, N, K, n0);
  else
    linear_tile<MT, false>(x, w, bias, y, N, K, n0);  // rows already in L1
}

// Every row of x against the kRows weight rows at wg (rows n0.. of y); `prefetch`: the
// first tile prefetches the next group's rows.
template <typename Y>
inline void linear_group(const bf16* x, const bf16* wg, const bf16* bias, Y* y, int64_t M,
                         int64_t N, int64_t K, int64_t n0, bool prefetch) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4)
    linear_rows<4>(x + m * K, wg, bias, y + m * N, N, K, n0, prefetch && m == 0);
  switch (M - m) {
    case 1: linear_rows<1>(x + m * K, wg, bias, y + m * N, N, K, n0, prefetch && m == 0); break;
    case 2: linear_rows<2>(x + m * K, wg, bias, y + m * N, N, K, n0, prefetch && m == 0); break;
    case 3: linear_rows<3>(x + m * K, wg, bias, y + m * N, N, K, n0, prefetch && m == 0); break;
    default: break;
  }
}

// One weight row (row n of y) against every row of x.
template <typename Y>
inline void linear_row(const bf16* x, const bf16* wn, const bf16* bias, Y* y, int64_t M,
                       int64_t N, int64_t K, int64_t n) {
  for (int64_t m = 0; m < M; m++) {
    float s = dot_row(x + m * K, wn, K);
    if (bias) s += to_f32(bias[n]);
    put(y + m * N + n, s);
  }
}

// y = x W^T (+ bias) for dense bf16 weights, any M: kRows weight rows at a time, each
// streamed once (from memory, prefetched) and used for every row of x.
template <typename Y>
void linear_small(const bf16* x, const bf16* w, const bf16* bias, Y* y, int64_t M, int64_t N,
                  int64_t K) {
  const int64_t groups = N / kRows;
#pragma omp parallel for schedule(static)
  for (int64_t g = 0; g < groups; g++)
    linear_group(x, w + g * kRows * K, bias, y, M, N, K, g * kRows, true);
  for (int64_t n = groups * kRows; n < N; n++)  // rows left over when N % kRows != 0
    linear_row(x, w + n * K, bias, y, M, N, K, n);
}

// 16 rows of K bf16 (row stride `stride`; rows past `rows` zero) as AMX B tiles, one per 32
// columns: out[kb][r][2 m + e] = x[m][32 kb + 2 r + e]. The AMX linear on blocks takes x
// so, prefill attention its queries.
inline void pack_b_tiles(const bf16* x, int64_t stride, int64_t rows, int64_t K, bf16* out) {
  for (int64_t kb = 0; kb < K / 32; kb++) {
    __m512i r[16];
    for (int64_t m = 0; m < 16; m++)
      r[m] = m < rows ? _mm512_loadu_si512(x + m * stride + 32 * kb) : _mm512_setzero_si512();
    attn_i8::transpose16(r);  // dword m of r[c]: pair c of row m
    for (int64_t c = 0; c < 16; c++) _mm512_store_si512(out + kb * 512 + c * 32, r[c]);
  }
}

// A block format's type with this bit set (the Python side sets it where AMX runs): rows
// past the fused loop's take AMX tiles (`linear_quant_amx`) instead of the dense loop.
constexpr int64_t kAmxTiles = 1 << 8;

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
template <typename Y>
void linear_quant_amx(const bf16* x, const uint8_t* w, int64_t type, const bf16* bias, Y* y,
                      int64_t M, int64_t N, int64_t K);
#endif

// Weights in a GGUF block format (quant_linear.h's linear): groups of kRows rows dequantized
// for the dense linear above when x has more rows than the fused loop takes (or, with
// kAmxTiles, for AMX tiles).
template <typename Y>
int linear_quant(const bf16* x, const uint8_t* w, int64_t type, const bf16* bias, Y* y,
                 int64_t M, int64_t N, int64_t K) {
  const bool amx = type & kAmxTiles;
  type &= ~kAmxTiles;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (amx && M > quant::fused_max_rows<bf16>() && quant::block_bytes(type)) {
    linear_quant_amx(x, w, type, bias, y, M, N, K);
    return 0;
  }
#else
  (void)amx;
#endif
  return quant::linear<bf16, kRows>(x, w, type, bias, y, M, N, K, [&](const bf16* wg, int64_t n0, int64_t rows) {
    if (rows == kRows)
      linear_group(x, wg, bias, y, M, N, K, n0, false);
    else
      for (int64_t r = 0; r < rows; r++) linear_row(x, wg + r * K, bias, y, M, N, K, n0 + r);
  });
}

}  // namespace

extern "C" {

void pd_linear_small(const bf16* x, const bf16* w, const bf16* bias, bf16* y, int64_t M,
                     int64_t N, int64_t K) {
  linear_small(x, w, bias, y, M, N, K);
}

// The small-M loop sums each row in one order whatever M is: it is batch-invariant as it
// stands (the float32 library's pd_linear_rows differs from its pd_linear_small).
void pd_linear_rows(const bf16* x, const bf16* w, const bf16* bias, bf16* y, int64_t M,
                    int64_t N, int64_t K) {
  pd_linear_small(x, w, bias, y, M, N, K);
}

}  // extern "C"

namespace elem {  // entry_points.h's element I/O: bf16, widened to float
using T = bf16;
inline __m512 load(const bf16* p) { return load16(p); }
inline void store(bf16* p, __m512 v) { store16(p, v); }
inline float to_float(bf16 v) { return to_f32(v); }
}  // namespace elem
#include "entry_points.h"

// ---------------------------------------------------------------------------------------
// Decode attention straight from the paged cache: one query token per sequence, keys and
// values read in place through the block table (no gather into a scratch copy).
// q[b] starts at q + b * q_stride with H heads of D; out is [B, H, D] contiguous.
//
// A task is one sequence and a range of its kv heads (paged_decode.h hands them out).
// Three passes over the sequence:
// 1. scores of every (kv head, query head) of the task, 16 keys at a time: the 16 keys'
//    row addresses are looked up once and used by every head; each head's 16 dot-product
//    vectors are reduced by one transpose-and-add, not 16 horizontal sums;
// 2. per head, exp(score - max) and its sum (an exact softmax over the whole row);
// 3. each value row loaded and widened to fp32 once per kv head, then accumulated into
//    all of that head's query heads (up to 16 independent FMA chains in registers); the
//    softmax sum is divided out at the end.
// The first pass over K and over V prefetch the task's rows kPrefetchTokens ahead. The
// old per-head loop (two passes per query head, an address lookup per key per head, 4 FMA
// chains) read the mixed benchmark's KV at ~7.6 GB/s; this one at 13-17 GB/s
// from memory, 22 GB/s from cache (docs/benchmarks.md). Scoring is now the larger half.

namespace {

using PagedSeq = paged::PagedSeq<bf16>;
using paged::kPrefetchTokens;

// The task's heads [hk0, hk0 + nhk) of one row: bytes = nhk * D * 2. (A name of its own:
// accumulate_values has a parameter called prefetch_bytes.)
inline void prefetch_heads(const bf16* row, int64_t bytes) { paged::prefetch_bytes(row, bytes); }

// Pass 1: s[(h * G + g) * ls + t] = scale * q_{hk0 + h, g} . k_t for t < L (rows to a
// multiple of 16; the padding holds scores of a repeated last key, never read).
template <int D>
void score_task(const bf16* q, const PagedSeq& seq, int64_t L, int64_t hk0, int64_t nhk,
                int64_t G, float scale, float* s, int64_t ls) {
  constexpr int kChunks = D / 32;
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t t0 = 0; t0 < L; t0 += 16) {
    const bf16* key[16];
    for (int i = 0; i < 16; i++) {
      const int64_t t = t0 + 4 * (i % 4) + i / 4;  // the order transpose_add_shuffled leaves
      key[i] = seq.row(t < L ? t : L - 1) + hk0 * D;
    }
    for (int64_t t = t0 + kPrefetchTokens; t < t0 + kPrefetchTokens + 16 && t < L; t++)
      prefetch_heads(seq.row(t) + hk0 * D, nhk * D * 2);
    for (int64_t h = 0; h < nhk; h++) {
      for (int64_t g = 0; g < G; g++) {
        const bf16* qh = q + ((hk0 + h) * G + g) * D;
        __m512bh qv[kChunks];
        for (int c = 0; c < kChunks; c++) qv[c] = (__m512bh)_mm512_loadu_si512(qh + 32 * c);
        __m512 part[16];
        for (int i = 0; i < 16; i++) {
          __m512 a = _mm512_setzero_ps();
          for (int c = 0; c < kChunks; c++)
            a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(key[i] + h * D + 32 * c),
                                 qv[c]);
          part[i] = a;
        }
        _mm512_storeu_ps(s + (h * G + g) * ls + t0, _mm512_mul_ps(vec::transpose_add_shuffled(part), vscale));
      }
    }
  }
}

// Pass 2: s[t] = exp(s[t] - max) for t < L; returns 1 / their sum.
inline float exp_row(float* s, int64_t L, float* max_out = nullptr) {
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  for (int64_t t = 0; t < L; t += 16) {
    const __mmask16 m = L - t >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (L - t)) - 1);
    vmax = _mm512_mask_max_ps(vmax, m, vmax, _mm512_loadu_ps(s + t));
  }
  const float top = _mm512_reduce_max_ps(vmax);
  if (max_out) *max_out = top;
  const __m512 mx = _mm512_set1_ps(top);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t t = 0; t < L; t += 16) {
    const __mmask16 m = L - t >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (L - t)) - 1);
    __m512 e = _mm512_maskz_mov_ps(m, vec::exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + t), mx)));
    _mm512_mask_storeu_ps(s + t, m, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  return 1.0f / _mm512_reduce_add_ps(vsum);
}

// Pass 2 for a task's rows: inv[r] = 1 / row r's sum; lse, for a part of a split sequence,
// gets each row's log-sum-exp.
inline void exp_rows(float* s, int64_t ls, int64_t rows, int64_t L, float* inv, float* lse) {
  for (int64_t r = 0; r < rows; r++) {
    float top;
    inv[r] = exp_row(s + r * ls, L, &top);
    if (lse) lse[r] = top - logf(inv[r]);
  }
}

// Pass 3 for NG query heads of kv head hk: out_g = inv_g * sum_t p_g[t] v_t. A 64-byte
// load of 32 bf16 values widens to fp32 in two ALU ops without shuffles: the even elements
// shifted up 16 bits, the odd ones with the low 16 bits masked off (accumulated apart,
// interleaved back once at the end).
template <int D, int NG, typename O>
void accumulate_values(const float* p, int64_t ls, const float* inv, const PagedSeq& seq,
                       int64_t L, int64_t hk, O* out, int64_t prefetch_bytes,
                       int64_t hk0) {
  constexpr int kPairs = D / 32;
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 even[NG][kPairs], odd[NG][kPairs];
  for (int g = 0; g < NG; g++)
    for (int c = 0; c < kPairs; c++) even[g][c] = odd[g][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < L; t++) {
    if (prefetch_bytes && t + kPrefetchTokens < L)
      prefetch_heads(seq.row(t + kPrefetchTokens) + seq.s_kv + hk0 * D, prefetch_bytes);
    const bf16* v = seq.row(t) + seq.s_kv + hk * D;
    __m512 ve[kPairs], vo[kPairs];
    for (int c = 0; c < kPairs; c++) {
      const __m512i raw = _mm512_loadu_si512(v + 32 * c);
      ve[c] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
      vo[c] = _mm512_castsi512_ps(_mm512_and_si512(raw, high));
    }
    for (int g = 0; g < NG; g++) {
      const __m512 pg = _mm512_set1_ps(p[g * ls + t]);
      for (int c = 0; c < kPairs; c++) {
        even[g][c] = _mm512_fmadd_ps(pg, ve[c], even[g][c]);
        odd[g][c] = _mm512_fmadd_ps(pg, vo[c], odd[g][c]);
      }
    }
  }
  const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
  for (int g = 0; g < NG; g++) {
    const __m512 sc = _mm512_set1_ps(inv[g]);
    for (int c = 0; c < kPairs; c++) {
      const __m512 e = _mm512_mul_ps(even[g][c], sc), o = _mm512_mul_ps(odd[g][c], sc);
      put16(out + g * D + 32 * c, _mm512_permutex2var_ps(e, lo, o));
      put16(out + g * D + 32 * c + 16, _mm512_permutex2var_ps(e, hi, o));
    }
  }
}

// One task: kv heads hk0.. of a sequence over its first L keys; out [H, D] of the sequence
// (bf16, or floats for a part: then lse [H] gets each query head's log-sum-exp).
template <int D, typename O>
void attend_task(const bf16* q, const PagedSeq& seq, int64_t L, int64_t hk0, int64_t nhk,
                 int64_t G, float scale, std::vector<float>& scratch, O* out, float* lse) {
  const int64_t ls = (L + 15) / 16 * 16;
  const int64_t rows = nhk * G;
  if (static_cast<int64_t>(scratch.size()) < rows * (ls + 1)) scratch.resize(rows * (ls + 1));
  float* s = scratch.data();
  float* inv = s + rows * ls;
  score_task<D>(q, seq, L, hk0, nhk, G, scale, s, ls);
  exp_rows(s, ls, rows, L, inv, lse ? lse + hk0 * G : nullptr);
  constexpr int kMaxHeads = D <= 64 ? 4 : D == 128 ? 2 : 1;  // <= 16 accumulators
  for (int64_t h = 0; h < nhk; h++) {
    const int64_t hk = hk0 + h;
    for (int64_t g0 = 0; g0 < G; g0 += kMaxHeads) {
      const int64_t r = h * G + g0;
      const int64_t pf = h == 0 && g0 == 0 ? nhk * D * 2 : 0;  // first pass prefetches
      O* o = out + (hk * G + g0) * D;
      with_count<kMaxHeads>(std::min<int64_t>(kMaxHeads, G - g0), [&](auto count) {
        accumulate_values<D, decltype(count)::value>(s + r * ls, ls, inv + r, seq, L, hk, o, pf, hk0);
      });
    }
  }
}

// One task of decode attention over the 8-bit cache by integer dot products
// (attention_int8.h): the task's query heads split once, then the three passes per kv head.
template <int D, typename O>
void attend_task_int8(const bf16* q, const paged::PagedSeq<int8_t>& seq, int64_t L, int64_t hk0,
                      int64_t nhk, int64_t G, float scale, std::vector<float>& scratch, O* out,
                      float* lse) {
  constexpr int64_t kHeadBytes = D + 4;  // D values and the float32 scale
  const int64_t ls = (L + 15) / 16 * 16, rows = nhk * G;
  if (static_cast<int64_t>(scratch.size()) < rows * (ls + 1)) scratch.resize(rows * (ls + 1));
  float* s = scratch.data();
  float* inv = s + rows * ls;
  static thread_local std::vector<attn_i8::SplitHead> heads;
  heads.resize(rows);
  for (int64_t r = 0; r < rows; r++) attn_i8::split_head(q + (hk0 * G + r) * D, D, to_f32, &heads[r]);
  const int64_t task_bytes = nhk * kHeadBytes, at = hk0 * kHeadBytes;  // the first pass prefetches
  for (int64_t h = 0; h < nhk; h++) {
    for (int64_t g0 = 0; g0 < G; g0 += 8) {
      const int64_t r = h * G + g0, pf = h == 0 && g0 == 0 ? task_bytes : 0;
      with_count<8>(std::min<int64_t>(8, G - g0), [&](auto count) {
        attn_i8::score_heads<D, decltype(count)::value>(&heads[r], seq, L, (hk0 + h) * kHeadBytes, scale,
                                                        s + r * ls, ls, pf, at);
      });
    }
  }
  exp_rows(s, ls, rows, L, inv, lse ? lse + hk0 * G : nullptr);
  constexpr int kMaxHeads = D <= 64 ? 4 : D == 128 ? 2 : 1;  // <= 16 accumulators
  for (int64_t h = 0; h < nhk; h++) {
    const int64_t hk = hk0 + h;
    for (int64_t g0 = 0; g0 < G; g0 += kMaxHeads) {
      const int64_t r = h * G + g0, pf = h == 0 && g0 == 0 ? task_bytes : 0;
      O* o = out + (hk * G + g0) * D;
      with_count<kMaxHeads>(std::min<int64_t>(kMaxHeads, G - g0), [&](auto count) {
        attn_i8::accumulate_heads<D, decltype(count)::value>(
            s + r * ls, ls, inv + r, seq, L, hk * kHeadBytes, pf, at, [&](int g, const float* v) {
              for (int d = 0; d < D; d += 16) put16(o + g * D + d, _mm512_loadu_ps(v + d));
            });
      });
    }
  }
}

// A task's kernel for each cache: the bf16 cache's attend_task, the 8-bit one's
// attend_task_int8 (attention_int8.h).
struct Bf16Attend {
  using Cache = bf16;
  template <int D, typename O>
  static void run(const bf16* q, const PagedSeq& seq, int64_t L, int64_t hk0, int64_t nhk, int64_t G,
                  float scale, std::vector<float>& scratch, O* out, float* lse) {
    attend_task<D>(q, seq, L, hk0, nhk, G, scale, scratch, out, lse);
  }
};

struct Int8Attend {
  using Cache = int8_t;
  template <int D, typename O>
  static void run(const bf16* q, const paged::PagedSeq<int8_t>& seq, int64_t L, int64_t hk0, int64_t nhk,
                  int64_t G, float scale, std::vector<float>& scratch, O* out, float* lse) {
    attend_task_int8<D>(q, seq, L, hk0, nhk, G, scale, scratch, out, lse);
  }
};

// Decode attention over the paged cache by Attend's tasks, long sequences split over the
// threads and merged (paged_decode.h); 0, or -1 for a head size without a specialisation.
template <typename Attend>
int decode_attention_paged(const bf16* q, int64_t q_stride, const typename Attend::Cache* cache,
                           int64_t s_block, int64_t s_kv, int64_t s_tok, const int64_t* block_tables,
                           int64_t max_blocks, const int64_t* seq_lens, bf16* out, int64_t B, int64_t H,
                           int64_t Hkv, int64_t D, int64_t block_size, float scale, int64_t window) {
  const int64_t G = H / Hkv;
  return paged::with_head_size(D, [&](auto head_size) {
    constexpr int kD = decltype(head_size)::value;
    paged::for_each_decode_part(
        cache, s_block, s_kv, s_tok, block_tables, max_blocks, seq_lens, B, H, Hkv, D, block_size,
        paged::kSplitTokens, window,
        [&](int64_t b, const paged::PagedSeq<typename Attend::Cache>& seq, int64_t L, int64_t hk0, int64_t nhk,
            std::vector<float>& scratch, float* part, float* lse) {
          if (part)
            Attend::template run<kD>(q + b * q_stride, seq, L, hk0, nhk, G, scale, scratch, part, lse);
          else
            Attend::template run<kD>(q + b * q_stride, seq, L, hk0, nhk, G, scale, scratch, out + b * H * D,
                                     static_cast<float*>(nullptr));
        },
        [&](int64_t b, int64_t head, const float* o) {  // a split sequence's merged head
          for (int64_t d = 0; d < D; d += 16) store16(out + (b * H + head) * D + d, _mm512_loadu_ps(o + d));
        });
  });
}

}  // namespace

extern "C" {

// The 8-bit cache's decode attention (attention_f32.h) computes in float: q is widened
// first and the output rounded to bf16 after, ~(B H D) values each, noise beside the cache.
static int decode_attention_int8(const bf16* q, int64_t q_stride, const int8_t* kv,
                                 int64_t s_block, int64_t s_kv, int64_t s_tok,
                                 const int64_t* block_tables, int64_t max_blocks,
                                 const int64_t* seq_lens, bf16* out, int64_t B, int64_t H,
                                 int64_t Hkv, int64_t D, int64_t block_size, float scale,
                                 int64_t window) {
  std::vector<float> qf(B * H * D), of(B * H * D);
  for (int64_t b = 0; b < B; b++)
    for (int64_t i = 0; i < H * D; i++) qf[b * H * D + i] = to_f32(q[b * q_stride + i]);
  const int status = attn::decode_attention<attn::Int8KV>(
      qf.data(), H * D, kv, s_block, s_kv, s_tok, block_tables, max_blocks, seq_lens,
      of.data(), B, H, Hkv, D, block_size, scale, window);
  for (int64_t i = 0; i < B * H * D; i++) out[i] = to_bf16(of[i]);
  return status;
}

// Returns 0, or -1 for a head size without a specialisation (32, 64, 128, 256 exist).
// block_size must be a power of two (CacheConfig enforces it). The cache is in a
// paged::KVFormat. `window` > 0: each sequence's last `window` keys only (a sliding layer).
int pd_decode_attention(const bf16* q, int64_t q_stride, const void* kv, int64_t kv_format,
                        int64_t s_block, int64_t s_kv, int64_t s_tok,
                        const int64_t* block_tables, int64_t max_blocks,
                        const int64_t* seq_lens, bf16* out, int64_t B, int64_t H,
                        int64_t Hkv, int64_t D, int64_t block_size, float scale, int64_t window) {
  if (kv_format == paged::kKVInt8 && block_size >= attn_i8::kMinBlock)
    return decode_attention_paged<Int8Attend>(q, q_stride, static_cast<const int8_t*>(kv), s_block, s_kv, s_tok,
                                              block_tables, max_blocks, seq_lens, out, B, H, Hkv, D,
                                              block_size, scale, window);
  if (kv_format == paged::kKVInt8)  // blocks of fewer than 16 tokens
    return decode_attention_int8(q, q_stride, static_cast<const int8_t*>(kv), s_block, s_kv,
                                 s_tok, block_tables, max_blocks, seq_lens, out, B, H, Hkv, D,
                                 block_size, scale, window);
  return decode_attention_paged<Bf16Attend>(q, q_stride, static_cast<const bf16*>(kv), s_block, s_kv, s_tok,
                                            block_tables, max_blocks, seq_lens, out, B, H, Hkv, D,
                                            block_size, scale, window);
}

// The one-call step's linear (entry_points.h's pd_decode_layers): a layer table's packed
// weights are the AMX linear's tiles, or all null: then every linear takes the small-M
// kernel.

void pd_linear_amx(const bf16* x, const bf16* packed, const bf16* bias, bf16* y, int64_t M,
                   int64_t N, int64_t K);

static void step_linear(const bf16* x, const void* w, const bf16* packed, int64_t type,
                        const bf16* bias, bf16* y, int64_t M, int64_t N, int64_t K) {
  if (type)
    linear_quant(x, static_cast<const uint8_t*>(w), type, bias, y, M, N, K);
  else if (packed)
    pd_linear_amx(x, packed, bias, y, M, N, K);
  else
    pd_linear_small(x, static_cast<const bf16*>(w), bias, y, M, N, K);
}

}  // extern "C"

// One loop sums a row at every row count here (the caller picks AMX or not for the whole
// step): a batch-invariant step needs nothing of its own.
elem::StepLinear elem::step_linear(bool) { return ::step_linear; }

extern "C" {

// Weights in a GGUF block format (quant_linear.h); -1 for a format without a kernel.
int pd_linear_quant(const bf16* x, const uint8_t* w, int64_t type, const bf16* bias, bf16* y,
                    int64_t M, int64_t N, int64_t K) {
  return linear_quant(x, w, type, bias, y, M, N, K);
}

// The LM head, in float32: x [M, K] times the weight as the model keeps it (dense bf16 when
// `type` is 0, else a GGUF block format), any M. Logits rounded to bf16 sit 0.06-0.125
// apart at the default model's magnitudes (8-16), coarser than the gap between the first
// two candidates of many greedy choices: the rounding, not the model, would pick. Returns
// -1 for a format without a kernel.
int pd_logits(const bf16* x, const void* w, int64_t type, const bf16* bias, float* y, int64_t M,
              int64_t N, int64_t K) {
  if (type == 0) {
    linear_small(x, static_cast<const bf16*>(w), bias, y, M, N, K);
    return 0;
  }
  return linear_quant(x, static_cast<const uint8_t*>(w), type, bias, y, M, N, K);
}

int pd_dequantize(const uint8_t* w, int64_t type, bf16* out, int64_t N, int64_t K) {
  return quant::dequantize(w, type, out, N, K);
}


}  // extern "C"

// ---------------------------------------------------------------------------------------
// AMX linear: y[M, N] = x[M, K] W^T (+ bias), W pre-packed into 16x32 VNNI tiles
// (pd_amx_pack layout, done once per weight in Python): for n-tile j and k-block kb,
// tile[j][kb][r][2c + e] = W[16 j + c][32 kb + 2 r + e].
//
// x is cut into 16-row slices (a short last one is copied into a zero-padded slice, so
// every tile has 16 rows and one tile configuration serves all shapes). The threads split
// the n-tiles, two at a time, and multiply each weight tile against four slices at once
// (four accumulators). Up to kChunkRows rows that is one pass over the weights: a batch of
// decodes costs about what batch 1 does, where oneDNN repacks the weights on every call at
// these shapes and reads them at ~8 GB/s. Longer x is taken kChunkRows at a time (the
// chunk stays in L2 while the weights stream past). Against oneDNN on the default model's
// layer shapes (2 cores, quiet machine): 1.7x at 64 rows, 2.1x at 128, but 0.9x at 512 and
// 0.6x at 2048, where oneDNN reaches ~2.3 TFLOP/s and this ~1.5 (its x tiles come from
// L2, where a tile load is ~3x slower than from L1; packing x into contiguous tiles first
// made it slower, not faster). So the Python side sends up to AMX_MAX_M rows here and
// prefill-sized GEMMs to oneDNN.

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)

namespace {

constexpr int64_t kChunkRows = 256;

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-6, each 16 rows of 64 bytes. The linear uses 0-3 as accumulators (one per slice
// of x), 4 and 5 for x slices (alternating, so a load need not wait for the multiply still
// reading the other), 6 for the weight tile; prefill attention the same way round.
inline void configure_tiles() {
  TileConfig cfg;
  memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int i = 0; i < 7; i++) {
    cfg.rows[i] = 16;
    cfg.colsb[i] = 64;
  }
  _tile_loadconfig(&cfg);
}

// The accumulator tiles 0..S-1, each 16 x 16 floats, at c + 256 q in memory.
template <int S>
inline void sums_zero() {
  _tile_zero(0);
  if (S > 1) _tile_zero(1);
  if (S > 2) _tile_zero(2);
  if (S > 3) _tile_zero(3);
}
template <int S>
inline void sums_load(const float* c) {
  _tile_loadd(0, c, 64);
  if (S > 1) _tile_loadd(1, c + 256, 64);
  if (S > 2) _tile_loadd(2, c + 512, 64);
  if (S > 3) _tile_loadd(3, c + 768, 64);
}
template <int S>
inline void sums_store(float* c) {
  _tile_stored(0, c, 64);
  if (S > 1) _tile_stored(1, c + 256, 64);
  if (S > 2) _tile_stored(2, c + 512, 64);
  if (S > 3) _tile_stored(3, c + 768, 64);
}

// S slices of x (row stride K) against n-tile `wt`: c_out[s] = slice s times the tile.
template <int S>
void amx_ntile(const bf16* const* slices, const bf16* wt, int64_t K, float* c_out) {
  sums_zero<S>();
  const int64_t xs = K * 2;  // bytes between rows of x
  for (int64_t kb = 0; kb < K / 32; kb++) {
    // The weights stream from memory, and the prefetchers do not run far enough ahead of
    // tile loads: asking for the tile 4 k-steps ahead made a whole decode step's GEMMs
    // 1.06-1.3x faster at 32-128 rows (alternating, one process), no change at 8-16. Past
    // the last tile it touches the next n-tile's (a prefetch never faults).
    const char* ahead = reinterpret_cast<const char*>(wt + (kb + 4) * 512);
    for (int line = 0; line < 1024; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    _tile_loadd(6, wt + kb * 512, 64);
    _tile_loadd(4, slices[0] + kb * 32, xs);
    _tile_dpbf16ps(0, 4, 6);
    if (S > 1) { _tile_loadd(5, slices[1] + kb * 32, xs); _tile_dpbf16ps(1, 5, 6); }
    if (S > 2) { _tile_loadd(4, slices[2] + kb * 32, xs); _tile_dpbf16ps(2, 4, 6); }
    if (S > 3) { _tile_loadd(5, slices[3] + kb * 32, xs); _tile_dpbf16ps(3, 5, 6); }
  }
  sums_store<S>(c_out);
}

}  // namespace

extern "C" {

// Ask Linux for the AMX tile state (once per process). 0 on success.
int pd_amx_init(void) {
  const long kReqXcompPerm = 0x1023, kXfeatureTileData = 18;
  return static_cast<int>(syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureTileData));
}

void pd_linear_amx(const bf16* x, const bf16* packed, const bf16* bias, bf16* y, int64_t M,
                   int64_t N, int64_t K) {
  const int64_t full = M / 16 * 16;
  std::vector<bf16> tail(M > full ? 16 * K : 0, 0);  // the short last slice, zero-padded
  if (M > full) memcpy(tail.data(), x + full * K, (M - full) * K * sizeof(bf16));
  const int64_t num_slices = (M + 15) / 16, chunk_slices = kChunkRows / 16;
#pragma omp parallel
  {
    configure_tiles();
    alignas(64) float c[2 * 4 * 256];
    for (int64_t s0 = 0; s0 < num_slices; s0 += chunk_slices) {
      const int64_t s1 = s0 + chunk_slices < num_slices ? s0 + chunk_slices : num_slices;
      // Two n-tiles a task where N allows: each row of y then gets whole 64-byte lines
      // (16 columns alone are half a line, and a store to a line not yet in cache reads it
      // first: that cost ~30% at prefill sizes).
#pragma omp for schedule(static)
      for (int64_t jp = 0; jp < (N / 16 + 1) / 2; jp++) {
        const int64_t j = 2 * jp, tiles = N / 16 - j < 2 ? 1 : 2;
        __m512 b[2];
        for (int64_t t = 0; t < 2; t++)
          b[t] = bias && t < tiles ? load16(bias + 16 * (j + t)) : _mm512_setzero_ps();
        for (int64_t s = s0; s < s1; s += 4) {
          const int64_t ns = s1 - s < 4 ? s1 - s : 4;
          const bf16* slices[4];
          for (int64_t q = 0; q < ns; q++)
            slices[q] = 16 * (s + q) < full ? x + 16 * (s + q) * K : tail.data();
          for (int64_t t = 0; t < tiles; t++) {
            const bf16* wt = packed + (j + t) * 16 * K;
            float* ct = c + t * 1024;
            with_count<4>(ns, [&](auto n) { amx_ntile<decltype(n)::value>(slices, wt, K, ct); });
          }
          const int64_t m0 = 16 * s, rows = M - m0 < 16 * ns ? M - m0 : 16 * ns;
          for (int64_t m = 0; m < rows; m++) {  // c holds slice q's row r at (16 q + r) * 16
            const __m512 lo = _mm512_add_ps(_mm512_loadu_ps(c + m * 16), b[0]);
            bf16* dst = y + (m0 + m) * N + 16 * j;
            if (tiles == 2) {
              const __m512 hi = _mm512_add_ps(_mm512_loadu_ps(c + 1024 + m * 16), b[1]);
              _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
            } else {
              store16(dst, lo);
            }
          }
        }
      }
    }
    _tile_release();
  }
}

}  // extern "C"

// Weights in blocks on AMX tiles, for rows of x past the fused loop's (linear_quant with
// kAmxTiles). Each thread dequantizes 16 weight rows at a time into a bf16 buffer in tile
// order, a tile product's A side as it stands (16 rows of 32 k, each tile's 1 KB in a row:
// tiles loaded from K-long rows made the 32-row linear up to 1.5x slower), and multiplies
// it with x packed once per call into VNNI tiles (the B side, `pack_b_tiles`): C = W x^T,
// 16 outputs x 16 rows of x, transposed on the way out. Each weight is
// dequantized once per call whatever M, and the products run on the tiles, where the dense
// AVX512-BF16 loop the blocks otherwise go to takes 32 products an instruction. The sums
// are the dequantized weights' bf16 products in fp32, as on that path, in tile order.
// Dequantizing is most of the time (perf: 60-65% at 32 rows of Q4_K; 8 rows cost ~80% of
// 32). Tried and dropped: dequantizing 256-weight chunks of the 16 rows so that the buffer
// stays in L1, with the sums kept in tiles between chunks (1.2-1.5x slower: 16 rows read a
// chunk at a time are 16 interleaved streams, where whole rows are one).
namespace {

// 16 weight rows as tiles (wt[kb][n][32]) against S packed slices of x (`slice` elements
// apart): c_out[256 q + 16 n + m] = sum_k W[n][k] x_q[m][k].
template <int S>
void amx_wtile(const bf16* wt, int64_t K, const bf16* xp, int64_t slice, float* c_out) {
  sums_zero<S>();
  for (int64_t kb = 0; kb < K / 32; kb++) {
    _tile_loadd(6, wt + kb * 512, 64);
    _tile_loadd(4, xp + kb * 512, 64);
    _tile_dpbf16ps(0, 6, 4);
    if (S > 1) { _tile_loadd(5, xp + slice + kb * 512, 64); _tile_dpbf16ps(1, 6, 5); }
    if (S > 2) { _tile_loadd(4, xp + 2 * slice + kb * 512, 64); _tile_dpbf16ps(2, 6, 4); }
    if (S > 3) { _tile_loadd(5, xp + 3 * slice + kb * 512, 64); _tile_dpbf16ps(3, 6, 5); }
  }
  sums_store<S>(c_out);
}

template <typename Y>
void linear_quant_amx(const bf16* x, const uint8_t* w, int64_t type, const bf16* bias, Y* y,
                      int64_t M, int64_t N, int64_t K) {
  const int64_t slices = (M + 15) / 16, slice = K / 32 * 512, stride = quant::row_bytes(type, K);
  std::unique_ptr<bf16, decltype(&free)> packed(
      static_cast<bf16*>(aligned_alloc(64, slices * slice * sizeof(bf16))), &free);
  bf16* xp = packed.get();
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t s = 0; s < slices; s++)
      pack_b_tiles(x + 16 * s * K, K, std::min<int64_t>(16, M - 16 * s), K, xp + s * slice);
    configure_tiles();
    std::unique_ptr<bf16, decltype(&free)> buffer(
        static_cast<bf16*>(aligned_alloc(64, 16 * K * sizeof(bf16))), &free);
    bf16* wt = buffer.get();
    alignas(64) float c[4 * 256];
#pragma omp for schedule(static)
    for (int64_t j = 0; j < (N + 15) / 16; j++) {
      const int64_t n0 = 16 * j, rows = std::min<int64_t>(16, N - n0);
      for (int64_t r = 0; r < 16; r++) {
        if (r < rows)
          quant::dequantize_row(w + (n0 + r) * stride, type, K, wt + 32 * r, 512);
        else
          for (int64_t kb = 0; kb < K / 32; kb++) memset(wt + kb * 512 + 32 * r, 0, 64);
      }
      __m512 b = _mm512_setzero_ps();
      if (bias) {
        alignas(64) float bv[16] = {};
        for (int64_t r = 0; r < rows; r++) bv[r] = to_f32(bias[n0 + r]);
        b = _mm512_load_ps(bv);
      }
      for (int64_t s = 0; s < slices; s += 4) {
        const int64_t ns = std::min<int64_t>(4, slices - s);
        const bf16* xs = xp + s * slice;
        with_count<4>(ns, [&](auto n) { amx_wtile<decltype(n)::value>(wt, K, xs, slice, c); });
        for (int64_t q = 0; q < ns; q++) {
          __m512i t[16];
          for (int64_t n = 0; n < 16; n++) t[n] = _mm512_load_si512(c + 256 * q + 16 * n);
          attn_i8::transpose16(t);  // lane n of t[m]: output n0 + n of row m
          const int64_t m0 = 16 * (s + q), ms = std::min<int64_t>(16, M - m0);
          for (int64_t m = 0; m < ms; m++) {
            const __m512 v = _mm512_add_ps(_mm512_castsi512_ps(t[m]), b);
            Y* dst = y + (m0 + m) * N + n0;
            if (rows == 16) {
              put16(dst, v);
            } else {
              alignas(64) float out[16];
              _mm512_store_ps(out, v);
              for (int64_t r = 0; r < rows; r++) put(dst + r, out[r]);
            }
          }
        }
      }
    }
    _tile_release();
  }
}

}  // namespace

// AMX's two products of prefill attention (below): S^T in four 16-key tiles, O^T four
// 16-dimension tiles at a time.
namespace {

struct AmxProducts {
  static void begin() { configure_tiles(); }
  static void end() { _tile_release(); }
  static void scores(const bf16* qt, const bf16* kb0, int64_t D, float* st) {
    sums_zero<4>();
    for (int64_t db = 0; db < D / 32; db++) {  // S^T = K Q^T, 16 keys per accumulator
      _tile_loadd(6, qt + db * 512, 64);
      _tile_loadd(4, kb0 + 0 * 16 * D + 32 * db, D * 2); _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(5, kb0 + 1 * 16 * D + 32 * db, D * 2); _tile_dpbf16ps(1, 5, 6);
      _tile_loadd(4, kb0 + 2 * 16 * D + 32 * db, D * 2); _tile_dpbf16ps(2, 4, 6);
      _tile_loadd(5, kb0 + 3 * 16 * D + 32 * db, D * 2); _tile_dpbf16ps(3, 5, 6);
    }
    sums_store<4>(st);
  }
  static void values(const bf16* pt_hi, const bf16* pt_lo, const bf16* pv, int64_t keys_padded, int64_t key0,
                     int64_t D, float* ot) {
    for (const bf16* pt : {pt_hi, pt_lo})
    for (int64_t dg = 0; dg < D / 16; dg += 4) {
      sums_load<4>(ot + 16 * 16 * dg);
      for (int64_t kb = 0; kb < 2; kb++) {
        _tile_loadd(6, pt + kb * 512, 64);
        const bf16* vt = pv + 16 * dg * keys_padded + key0 + 32 * kb;
        const int64_t vs = keys_padded * 2, next = 16 * keys_padded;  // bytes, elements
        _tile_loadd(4, vt, vs); _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(5, vt + next, vs); _tile_dpbf16ps(1, 5, 6);
        _tile_loadd(4, vt + 2 * next, vs); _tile_dpbf16ps(2, 4, 6);
        _tile_loadd(5, vt + 3 * next, vs); _tile_dpbf16ps(3, 5, 6);
      }
      sums_store<4>(ot + 16 * 16 * dg);
    }
  }
};

}  // namespace

extern "C" {
int pd_amx_available(void) { return 1; }
}

#else

extern "C" {
int pd_amx_init(void) { return -1; }
void pd_linear_amx(const bf16*, const bf16*, const bf16*, bf16*, int64_t, int64_t, int64_t) {}
int pd_amx_available(void) { return 0; }
}

#endif

// Prefill attention: one chunk of n query tokens at positions ctx..ctx+n-1 attends
// causally over keys 0..ctx+n-1, all read from the paged cache (the chunk's own K/V were
// written there by pd_rotary_write_kv). Flash-style: 16 queries against 64 keys at a time,
// an online softmax in fp32, P V accumulated in fp32, key blocks past the queries skipped.
// P goes to the bf16 products as two bf16 halves, P = hi + lo (to ~2^-17): with P rounded
// once (2^-9) the output was 11% further from the exact attention than bf16's own rounding
// of it, and that was enough to flip the default model's near-tied "Paris" on the
// AVX512-BF16 class; with both halves its mean error equals the rounding's (1.024e-3 on
// random heads, SDPA in bf16 1.146e-3), for 1.5x the products.
//
// Everything is computed transposed, queries along the 16 lanes of a vector: S^T = K Q^T
// and O^T += V^T P^T. Then the softmax's running max and sum are per-lane vector ops over
// a block's 64 key rows, with no horizontal reductions or per-row scalar work; that was
// 60% of the time with queries as rows (the exponentials cost as much as the multiplies at
// head size 64). Each kv head's keys are first copied into a dense [keys][D] array (the
// A operand of S^T) and its values transposed into [D][keys] (the A operand of O^T), both
// zero-padded to a multiple of 64 keys; every (query head, 16-query block) is then a task.
// The two products are AMX tiles (AmxProducts) or, without AMX, vdpbf16ps on the same
// layouts (Bf16Products: one key's, or one value dimension's, bf16 pair broadcast against
// 16 queries' pairs); everything else is shared.

namespace {

constexpr int64_t kKeyBlock = 64;

// Head h of a cache row as bf16: the bf16 cache's values, or the 8-bit cache's values times
// their scale rounded to bf16 (kv_format.dequantize's arithmetic, as SDPA's gather did).
inline void head_values(const bf16* row, int64_t h, int64_t D, bf16* out) { memcpy(out, row + h * D, D * sizeof(bf16)); }
inline void head_values(const int8_t* row, int64_t h, int64_t D, bf16* out) {
  const int8_t* head = row + h * attn::Int8KV::head_stride(D);
  const float scale = attn::Int8KV::scale(head, D);
  for (int64_t d = 0; d < D; d++) out[d] = to_bf16(static_cast<float>(head[d]) * scale);
}

// Keys t0..t0+63 of kv head h into pk ([keys][D]) and pv ([D][keys_padded]); zeros past L.
template <typename Cache>
inline void pack_kv_block(const paged::PagedSeq<Cache>& seq, int64_t h, int64_t D, int64_t L, int64_t t0,
                          int64_t keys_padded, bf16* pk, bf16* pv) {
  alignas(64) bf16 v[256];
  for (int64_t t = t0; t < t0 + kKeyBlock; t++) {
    if (t >= L) {
      memset(pk + t * D, 0, D * sizeof(bf16));
      for (int64_t d = 0; d < D; d++) pv[d * keys_padded + t] = 0;
      continue;
    }
    head_values(seq.row(t), h, D, pk + t * D);
    head_values(seq.row(t) + seq.s_kv, h, D, v);
    for (int64_t d = 0; d < D; d++) pv[d * keys_padded + t] = v[d];
  }
}

// The two products by AVX512-BF16 dot products, on AmxProducts' layouts: qt holds, per
// pair of dimensions, 16 queries' pairs (one vector); pt per pair of keys, 16 queries'
// pairs. A key's (or a value dimension's) pair is broadcast against them, 16 accumulators
// (keys, or dimensions) at a time: 32 multiply-adds an instruction, no horizontal sums.
struct Bf16Products {
  static void begin() {}
  static void end() {}
  // st[key][query] = K[key0 + key] . q_query for the block's 64 keys (kb0 = K[key0]).
  static void scores(const bf16* qt, const bf16* kb0, int64_t D, float* st) {
    const uint32_t* q2 = reinterpret_cast<const uint32_t*>(qt);
    for (int64_t k0 = 0; k0 < kKeyBlock; k0 += 16) {
      const uint32_t* k2 = reinterpret_cast<const uint32_t*>(kb0 + k0 * D);
      __m512 acc[16];
      for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
      for (int64_t p = 0; p < D / 2; p++) {
        const __m512bh qv = (__m512bh)_mm512_load_si512(q2 + 16 * p);
        for (int i = 0; i < 16; i++)
          acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32(static_cast<int>(k2[i * D / 2 + p])), qv);
      }
      for (int i = 0; i < 16; i++) _mm512_store_ps(st + 16 * (k0 + i), acc[i]);
    }
  }
  // ot[d][query] += sum over the block's keys of V^T[d][key] (P_hi + P_lo)^T[key][query]:
  // each value pair broadcast once for both halves of P.
  static void values(const bf16* pt_hi, const bf16* pt_lo, const bf16* pv, int64_t keys_padded, int64_t key0,
                     int64_t D, float* ot) {
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      __m512 acc[16];
      for (int i = 0; i < 16; i++) acc[i] = _mm512_load_ps(ot + 16 * (d0 + i));
      const bf16* v = pv + d0 * keys_padded + key0;
      for (int64_t j = 0; j < kKeyBlock / 2; j++) {
        const __m512bh hi = (__m512bh)_mm512_load_si512(pt_hi + 32 * j), lo = (__m512bh)_mm512_load_si512(pt_lo + 32 * j);
        for (int i = 0; i < 16; i++) {
          uint32_t pair;
          memcpy(&pair, v + i * keys_padded + 2 * j, 4);
          const __m512bh vv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
          acc[i] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[i], vv, lo), vv, hi);
        }
      }
      for (int i = 0; i < 16; i++) _mm512_store_ps(ot + 16 * (d0 + i), acc[i]);
    }
  }
};

// One (query head, 16-query block) task: queries at positions first_pos.. (rows of them
// real; the other lanes compute on zero queries and are not stored).
template <typename Products>
void prefill_block(const bf16* q, int64_t q_stride, const bf16* pk, const bf16* pv,
                   int64_t keys_padded, bf16* out, int64_t out_stride, int64_t rows,
                   int64_t first_pos, int64_t D, float scale) {
  alignas(64) bf16 qt[8 * 512];         // Q^T as B tiles: [D/32][16 dim pairs][16 queries][2]
  alignas(64) float st[kKeyBlock * 16];  // S^T: [key][query]
  alignas(64) bf16 pt[2 * 512];         // P^T as B tiles: [32 keys][16 key pairs][16][2]
  alignas(64) bf16 pt_lo[2 * 512];      // what rounding P^T to pt left, in pt's layout
  alignas(64) float ot[256 * 16];        // O^T: [D][query]
  pack_b_tiles(q, q_stride, rows, D, qt);
  memset(ot, 0, sizeof(float) * D * 16);
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i qpos = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(first_pos)), lane);
  // Interleaves two 16-key rows of bf16 (a in the low half, b in the high) into pairs.
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
  // Softmax in base 2: exp(scale (s - max)) = 2^(scale log2(e) (s - max)).
  const __m512 vscale = _mm512_set1_ps(scale * 1.44269504088896341f);
  __m512 row_max = _mm512_set1_ps(-INFINITY), row_sum = _mm512_setzero_ps();
  const int64_t num_key_blocks = (first_pos + rows - 1) / kKeyBlock + 1;
  for (int64_t kblk = 0; kblk < num_key_blocks; kblk++) {
    const int64_t key0 = kblk * kKeyBlock;
    const bf16* kb0 = pk + key0 * D;
    Products::scores(qt, kb0, D, st);
    // Online softmax, 16 queries per vector. A key is visible to a query at or after it.
    const bool all_visible = key0 + kKeyBlock - 1 <= first_pos;
    __m512 mx = row_max;  // of the unscaled scores (scale > 0 keeps the order)
    for (int64_t j = 0; j < kKeyBlock; j++) {
      const __mmask16 vis = all_visible ? 0xffff
          : _mm512_cmpge_epi32_mask(qpos, _mm512_set1_epi32(static_cast<int>(key0 + j)));
      mx = _mm512_mask_max_ps(mx, vis, mx, _mm512_load_ps(st + 16 * j));
    }
    // On the first block row_max is -inf and alpha underflows to ~1e-38; it scales zeros.
    const __m512 alpha = exp2_softmax(_mm512_mul_ps(_mm512_sub_ps(row_max, mx), vscale));
    row_max = mx;
    const __m512 shift = _mm512_mul_ps(mx, vscale);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < kKeyBlock; j += 2) {
      __m512 e[2];
      for (int64_t i = 0; i < 2; i++) {
        const __mmask16 vis = all_visible ? 0xffff
            : _mm512_cmpge_epi32_mask(qpos, _mm512_set1_epi32(static_cast<int>(key0 + j + i)));
        const __m512 x = _mm512_fmsub_ps(_mm512_load_ps(st + 16 * (j + i)), vscale, shift);
        e[i] = _mm512_maskz_mov_ps(vis, exp2_softmax(x));
        sum = _mm512_add_ps(sum, e[i]);
      }
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]);  // keys j | j + 1
      _mm512_store_si512(pt + (j / 32) * 512 + (j % 32) * 16, _mm512_permutexvar_epi16(pairs, both));
      // what the rounding to bf16 left, for a second product (P = hi + lo to ~2^-17)
      const __m512 hi0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(both)), 16));
      const __m512 hi1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(both, 1)), 16));
      const __m512i low = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(e[1], hi1), _mm512_sub_ps(e[0], hi0));
      _mm512_store_si512(pt_lo + (j / 32) * 512 + (j % 32) * 16, _mm512_permutexvar_epi16(pairs, low));
    }
    row_sum = _mm512_fmadd_ps(row_sum, alpha, sum);
    if (_mm512_cmpneq_ps_mask(alpha, _mm512_set1_ps(1.f)))
      for (int64_t d = 0; d < D; d++) _mm512_store_ps(ot + 16 * d, _mm512_mul_ps(_mm512_load_ps(ot + 16 * d), alpha));
    Products::values(pt, pt_lo, pv, keys_padded, key0, D, ot);  // O^T += V^T (P_hi + P_lo)^T
  }
  alignas(64) float inv[16];
  _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), row_sum));
  const __m512i column = _mm512_mullo_epi32(lane, _mm512_set1_epi32(16));
  for (int64_t c = 0; c < rows; c++)
    for (int64_t d = 0; d < D; d += 16)
      store16(out + c * out_stride + d,
              _mm512_mul_ps(_mm512_i32gather_ps(column, ot + 16 * d + c, 4), _mm512_set1_ps(inv[c])));
}

template <typename Products>
void prefill_attention(const bf16* q, int64_t q_stride, const void* kv, int64_t kv_format, int64_t s_block,
                       int64_t s_kv, int64_t s_tok, const int64_t* block_table,
                       int64_t block_size, int64_t n, int64_t ctx, bf16* out, int64_t H,
                       int64_t Hkv, int64_t D, float scale) {
  const int64_t L = ctx + n, key_blocks = (L + kKeyBlock - 1) / kKeyBlock;
  // V^T rows one cache line longer than the keys: at a power-of-two stride the 16 rows of
  // a tile would share two L1 sets.
  const int64_t keys_padded = key_blocks * kKeyBlock + 32, packed = keys_padded * D;
  std::vector<bf16> pk(Hkv * packed), pv(Hkv * packed);
  const int64_t q_blocks = (n + 15) / 16, G = H / Hkv;
  const int shift = __builtin_ctzll(block_size);
  const paged::PagedSeq<bf16> dense{static_cast<const bf16*>(kv), s_block, s_kv, s_tok, shift, block_table};
  const paged::PagedSeq<int8_t> int8{static_cast<const int8_t*>(kv), s_block, s_kv, s_tok, shift, block_table};
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < Hkv * key_blocks; i++) {
      const int64_t h = i / key_blocks;
      const int64_t t0 = (i % key_blocks) * kKeyBlock;
      if (kv_format == paged::kKVInt8)
        pack_kv_block(int8, h, D, L, t0, keys_padded, pk.data() + h * packed, pv.data() + h * packed);
      else
        pack_kv_block(dense, h, D, L, t0, keys_padded, pk.data() + h * packed, pv.data() + h * packed);
    }
    Products::begin();
    // Longest blocks (most keys) first, so the dynamic schedule ends evenly.
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < H * q_blocks; i++) {
      const int64_t qb = q_blocks - 1 - i / H, head = i % H, hk = head / G;
      const int64_t t0 = 16 * qb, rows = n - t0 < 16 ? n - t0 : 16;
      prefill_block<Products>(q + t0 * q_stride + head * D, q_stride, pk.data() + hk * packed,
                    pv.data() + hk * packed, keys_padded, out + t0 * H * D + head * D, H * D,
                    rows, ctx + t0, D, scale);
    }
    Products::end();
  }
}

}  // namespace

extern "C" {

// q [n, q_stride] rows (head h at column h D), out [n, H D], the cache in a paged::KVFormat
// (the 8-bit one dequantized as it is packed); `amx`: on AMX tiles (the
// library must have them: pd_amx_init), else by AVX512-BF16 dot products. Returns 0, or
// -1 for a head size other than 64, 128, 256.
int pd_prefill_attention(const bf16* q, int64_t q_stride, const void* kv, int64_t kv_format, int64_t s_block,
                         int64_t s_kv, int64_t s_tok, const int64_t* block_table,
                         int64_t block_size, int64_t n, int64_t ctx, bf16* out, int64_t H,
                         int64_t Hkv, int64_t D, float scale, int64_t amx) {
  if (D != 64 && D != 128 && D != 256) return -1;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (amx) {
    prefill_attention<AmxProducts>(q, q_stride, kv, kv_format, s_block, s_kv, s_tok, block_table, block_size, n, ctx, out, H, Hkv, D, scale);
    return 0;
  }
#else
  if (amx) return -1;
#endif
  prefill_attention<Bf16Products>(q, q_stride, kv, kv_format, s_block, s_kv, s_tok, block_table, block_size, n, ctx, out, H, Hkv, D, scale);
  return 0;
}

}  // extern "C"
