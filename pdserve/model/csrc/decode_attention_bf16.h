// Part of the bf16 library (cpu_kernels.cpp includes it after its small-M linear and
// uses its bf16 helpers): decode attention from the paged cache.

#pragma once

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

}  // extern "C"
