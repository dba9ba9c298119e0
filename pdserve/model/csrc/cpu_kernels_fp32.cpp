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
#include "attention_f32.h"

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

// ---------------------------------------------------------------------------------------
// Dense weights at 2 kLanes rows of x and more (16 on AVX2, 32 on AVX-512): the register
// tile above loads 4 x vectors for every 12 (AVX2) or 24 FMAs, and 16-128 rows of x (128
// KB-4 MB) live in L2 or beyond. Here x is first copied transposed into panels of 2 kLanes
// rows ([K][2 kLanes] floats; a last panel of kLanes rows where that covers the rest, rows
// past M zero), and a tile is one panel against kPanelWeights weight rows: each step along
// K loads the panel's 2 vectors and broadcasts one weight of each row for kPanelWeights x 2
// FMAs (AVX2: 12 accumulators + 2 x + 1 weight = 15 registers; AVX-512: 24 + 3 of 32).
// bench/linear_builds_ab.py --dtype float32 (AMX-class Xeon, 2026-12-05): 1.16-1.32x at 16
// and 32 rows on the AVX2 build, 1.15-1.31x at 32 and 64 on the AVX-512 one. At fewer rows
// half-empty panels lost (8 rows: 0.67-0.81x on AVX-512). The linear over blocks keeps the
// tile above: panels measured 0.96-1.08x there, within the noise (docs/benchmarks.md).
//
// Every output is one FMA chain along K (lane i of an accumulator is row i of the panel),
// then + bias: its sums do not depend on the other rows, but they are not the tile's (8 or
// 16 chains added at the end), so pd_linear_rows (--batch-invariant: one order for every
// row count) stays on the tile.

constexpr int kPanelWeights = kLanes == 16 ? 12 : 6;
constexpr int64_t kPanelMinRows = 2 * kLanes;

struct Panels {
  int64_t count = 0, wide = 0;  // panels; the first `wide` hold 2 kLanes rows, a last one kLanes
  std::unique_ptr<float, decltype(&free)> data{nullptr, &free};
  float* panel(int64_t p, int64_t K) const { return data.get() + p * K * 2 * kLanes; }
};

inline Panels pack_panels(const float* x, int64_t M, int64_t K) {
  Panels out;
  out.wide = M / (2 * kLanes) + (M % (2 * kLanes) > kLanes);
  out.count = out.wide + (out.wide * 2 * kLanes < M);
  out.data.reset(static_cast<float*>(aligned_alloc(64, out.count * K * 2 * kLanes * sizeof(float))));
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < out.count; p++) {
    const int64_t width = (p < out.wide ? 2 : 1) * kLanes, m0 = p * 2 * kLanes;
    float* dst = out.panel(p, K);
    for (int64_t i = 0; i < width; i++)
      for (int64_t k = 0; k < K; k++) dst[k * width + i] = m0 + i < M ? x[(m0 + i) * K + k] : 0.0f;
  }
  return out;
}

// Rows m0..m0+rows-1 of y (one panel's) at weight rows n0..n0+R-1 (at w, K floats apart).
template <int R, int V>
inline void panel_tile(const float* xt, const float* w, const float* bias, float* y, int64_t N,
                       int64_t K, int64_t n0, int64_t m0, int64_t rows) {
  F acc[R][V];
#pragma GCC unroll 16
  for (int r = 0; r < R; r++)
#pragma GCC unroll 2
    for (int v = 0; v < V; v++) acc[r][v] = vec::zero();
  for (int64_t k = 0; k < K; k++) {
    F xv[V];
#pragma GCC unroll 2
    for (int v = 0; v < V; v++) xv[v] = vec::load(xt + (k * V + v) * kLanes);
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
      const F b = vec::set1(w[r * K + k]);
#pragma GCC unroll 2
      for (int v = 0; v < V; v++) acc[r][v] = vec::fmadd(b, xv[v], acc[r][v]);
    }
  }
  alignas(64) float lanes[V * kLanes];
  for (int r = 0; r < R; r++) {
    for (int v = 0; v < V; v++) vec::store(lanes + v * kLanes, acc[r][v]);
    const float b = bias ? bias[n0 + r] : 0.0f;
    for (int64_t i = 0; i < rows; i++) y[(m0 + i) * N + n0 + r] = lanes[i] + b;
  }
}

// Every panel against the R weight rows at w (rows n0.. of y).
template <int R>
inline void panel_group(const Panels& xt, const float* w, const float* bias, float* y, int64_t M,
                        int64_t N, int64_t K, int64_t n0) {
  for (int64_t p = 0; p < xt.count; p++) {
    const int64_t m0 = p * 2 * kLanes, rows = std::min<int64_t>(M - m0, 2 * kLanes);
    if (p < xt.wide)
      panel_tile<R, 2>(xt.panel(p, K), w, bias, y, N, K, n0, m0, rows);
    else
      panel_tile<R, 1>(xt.panel(p, K), w, bias, y, N, K, n0, m0, rows);
  }
}

// Weight rows in groups of kPanelWeights split between the threads (a last short group a
// row at a time), each read from memory by its first panel and from cache by the others.
void linear_panels(const float* x, const float* w, const float* bias, float* y, int64_t M,
                   int64_t N, int64_t K) {
  const Panels xt = pack_panels(x, M, K);
  const int64_t groups = (N + kPanelWeights - 1) / kPanelWeights;
#pragma omp parallel for schedule(static)
  for (int64_t g = 0; g < groups; g++) {
    const int64_t n0 = g * kPanelWeights;
    if (n0 + kPanelWeights <= N)
      panel_group<kPanelWeights>(xt, w + n0 * K, bias, y, M, N, K, n0);
    else
      for (int64_t n = n0; n < N; n++) panel_group<1>(xt, w + n * K, bias, y, M, N, K, n);
  }
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
  else if (M < kPanelMinRows)
    linear_groups<kR>(x, w, bias, y, M, N, K);
  else
    linear_panels(x, w, bias, y, M, N, K);
}

// The same product with every row in the register-tile loop, one row too: each row's
// sums then follow one order whatever M is (batch-invariant mode; linear_m1 sums a lone
// row along four FMA chains instead).
void pd_linear_rows(const float* x, const float* w, const float* bias, float* y, int64_t M,
                    int64_t N, int64_t K) {
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

}  // extern "C"

namespace elem {  // entry_points.h's element I/O: float as it is
using T = float;
inline F load(const float* p) { return vec::load(p); }
inline void store(float* p, F v) { vec::store(p, v); }
inline float to_float(float v) { return v; }
}  // namespace elem
#include "entry_points.h"

extern "C" {

// Decode attention straight from the paged cache (attention_f32.h), in a paged::KVFormat;
// `window` > 0: each sequence's last `window` keys only (a sliding layer).
// Returns 0, or -1 for a head size without a specialisation (32, 64, 128, 256 exist).
// block_size must be a power of two (CacheConfig enforces it).
int pd_decode_attention(const float* q, int64_t q_stride, const void* kv, int64_t kv_format,
                        int64_t s_block, int64_t s_kv, int64_t s_tok,
                        const int64_t* block_tables, int64_t max_blocks,
                        const int64_t* seq_lens, float* out, int64_t B, int64_t H,
                        int64_t Hkv, int64_t D, int64_t block_size, float scale, int64_t window) {
  if (kv_format == paged::kKVInt8)
    return attn::decode_attention<attn::Int8KV>(
        q, q_stride, static_cast<const int8_t*>(kv), s_block, s_kv, s_tok, block_tables,
        max_blocks, seq_lens, out, B, H, Hkv, D, block_size, scale, window);
  return attn::decode_attention<attn::FloatKV>(
      q, q_stride, static_cast<const float*>(kv), s_block, s_kv, s_tok, block_tables,
      max_blocks, seq_lens, out, B, H, Hkv, D, block_size, scale, window);
}

}  // extern "C"

// The one-call step's linear (entry_points.h's pd_decode_layers); the packed-weight pointers
// stay null here. `batch_invariant`: the dense linears on pd_linear_rows, the loop a
// batch-invariant step's per-op linears take too.
template <void (*Dense)(const float*, const float*, const float*, float*, int64_t, int64_t, int64_t)>
static void linear_on(const float* x, const void* w, const float*, int64_t type,
                      const float* bias, float* y, int64_t M, int64_t N, int64_t K) {
  if (type)
    linear_quant(x, static_cast<const uint8_t*>(w), type, bias, y, M, N, K);
  else
    Dense(x, static_cast<const float*>(w), bias, y, M, N, K);
}

elem::StepLinear elem::step_linear(bool batch_invariant) {
  return batch_invariant ? linear_on<pd_linear_rows> : linear_on<pd_linear_small>;
}
