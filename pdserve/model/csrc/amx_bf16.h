// Part of the bf16 library (cpu_kernels.cpp includes it after decode_attention_bf16.h
// and uses its bf16 helpers): the AMX linear, and AMX's products for prefill attention.

#pragma once

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
