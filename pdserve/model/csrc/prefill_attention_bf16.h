// Part of the bf16 library (cpu_kernels.cpp includes it last: it takes AmxProducts from
// amx_bf16.h): prefill attention over the paged cache.

#pragma once

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
