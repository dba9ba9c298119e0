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
// The rest of the library, each part after what it uses: decode attention from the paged
// cache, the step's linear and the block formats' entry points (below), the AMX linear,
// prefill attention. One translation unit: the parts share the helpers above.

#include "decode_attention_bf16.h"

extern "C" {

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

#include "amx_bf16.h"
#include "prefill_attention_bf16.h"
