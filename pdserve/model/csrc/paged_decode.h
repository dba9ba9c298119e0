// What the bf16 (cpu_kernels.cpp) and float32 (cpu_kernels_fp32.cpp) kernel libraries share,
// independent of the element type and the ISA: the paged-cache addressing, how decode
// attention hands its tasks to the threads, and the one-call decode step's layer loop.
// Each library includes it and supplies its own per-task attention and per-op kernels.

#pragma once

#include <math.h>
#include <omp.h>
#include <stdint.h>

#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

namespace paged {

// The KV cache's formats (cpu_kernels.py passes the number): the library's own element
// type, or 8-bit values with a float32 scale per (token, kv head) (attention_f32.h).
enum KVFormat : int64_t { kKVDense = 0, kKVInt8 = 1 };

// A sequence's blocks are scattered over the cache, where the hardware prefetchers lose
// them: the first pass over K and over V prefetch the task's rows this many tokens ahead
// (16 to 128 measured alike, within noise, in bf16).
constexpr int64_t kPrefetchTokens = 32;

// One sequence's paged K/V from its token `first` on: row(t) is token first + t's K row (all
// kv heads); its V row is at + s_kv. Block sizes are powers of two: shifts, not 40-cycle
// divisions.
template <typename T>
struct PagedSeq {
  const T* kv;
  int64_t s_block, s_kv, s_tok;
  int block_shift;
  const int64_t* table;
  int64_t first = 0;
  inline const T* row(int64_t t) const {
    t += first;
    return kv + table[t >> block_shift] * s_block + (t & ((int64_t{1} << block_shift) - 1)) * s_tok;
  }
};

inline void prefetch_bytes(const void* row, int64_t bytes) {
  const char* p = static_cast<const char*>(row);
  for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch(p + c, 0, 3);
}

// Calls f(std::integral_constant<int, D>) for the head sizes the kernels are specialised
// for (32, 64, 128, 256); returns 0, or -1 for any other.
template <typename F>
int with_head_size(int64_t D, F f) {
  switch (D) {
    case 32: f(std::integral_constant<int, 32>{}); return 0;
    case 64: f(std::integral_constant<int, 64>{}); return 0;
    case 128: f(std::integral_constant<int, 128>{}); return 0;
    case 256: f(std::integral_constant<int, 256>{}); return 0;
    default: return -1;
  }
}

// Keys per task of a long sequence: a multiple of every block size (CacheConfig: <= 128).
constexpr int64_t kSplitTokens = 1024;

// Decode attention's tasks, on the process's OpenMP threads.
// - A task takes all of a sequence's kv heads when there are enough sequences to keep every
//   thread busy: a cache row holds all heads, so the sequence's KV then streams from memory
//   once and in order. With few sequences (batch 1), a task is one (sequence, kv head).
// - A sequence longer than `split_tokens` keys goes in parts of that many keys instead, each
//   a task of all its kv heads (whole cache rows, in order), whose outputs (normalized over
//   the part) and log-sum-exps go to float scratch and are merged after:
//   out = sum_p exp(lse_p - lse) o_p. At batch 1 one task per kv head left a thread idle for
//   a third of the time (3 kv heads on 2 threads) and read each row a head at a time. The
//   parts depend only on the sequence's length, so a row's result does not depend on its
//   batch (--batch-invariant).
// - A sliding layer (`window` > 0) attends to a sequence's last `window` keys only: its
//   tasks and parts start there (0: every key).
// - Longest tasks first: a task's time is about its length, and handing the long ones out
//   last can leave one thread finishing a long sequence while the other idles (12
//   sequences of mixed lengths: 1.10x from this order alone, bf16; output unchanged).
// attend(b, seq, L, hk0, nhk, scratch, part_out, part_lse): kv heads hk0.. of sequence b over
// seq's L keys (from seq.first); part_out null: the final output, else [H, D] floats and [H]
// log-sum-exps of the part (all heads). store(b, head, o): head `head` of sequence b's
// output from the merged floats o[D] (D <= 256).
template <typename T, typename Attend, typename Store>
void for_each_decode_part(const T* kv, int64_t s_block, int64_t s_kv, int64_t s_tok,
                          const int64_t* block_tables, int64_t max_blocks,
                          const int64_t* seq_lens, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                          int64_t block_size, int64_t split_tokens, int64_t window, Attend attend,
                          Store store) {
  struct Task {
    int64_t b, t0, len, hk0, nhk, part;  // part: its slot in the scratch, or -1
  };
  const int64_t heads_per_task = B >= 2 * omp_get_max_threads() ? Hkv : 1;
  const int shift = __builtin_ctzll(block_size);
  std::vector<Task> tasks;
  std::vector<int64_t> first_part(B, -1), num_parts(B, 0);
  int64_t parts = 0;
  for (int64_t b = 0; b < B; b++) {
    const int64_t end = seq_lens[b], start = window > 0 && end > window ? end - window : 0;
    if (end - start > split_tokens) {
      first_part[b] = parts;
      for (int64_t t0 = start; t0 < end; t0 += split_tokens, num_parts[b]++)
        tasks.push_back({b, t0, std::min(split_tokens, end - t0), 0, Hkv, parts++});
    } else {
      for (int64_t hk0 = 0; hk0 < Hkv; hk0 += heads_per_task)
        tasks.push_back({b, start, end - start, hk0, heads_per_task, -1});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& c) { return a.len > c.len; });
  std::vector<float> partial(parts * H * (D + 1));
  float* part_lse = partial.data() + parts * H * D;
#pragma omp parallel
  {
    std::vector<float> scratch;
#pragma omp for schedule(dynamic, 1)
    for (size_t i = 0; i < tasks.size(); i++) {
      const Task& t = tasks[i];
      const PagedSeq<T> seq{kv, s_block, s_kv, s_tok, shift, block_tables + t.b * max_blocks, t.t0};
      attend(t.b, seq, t.len, t.hk0, t.nhk, scratch, t.part < 0 ? nullptr : partial.data() + t.part * H * D,
             t.part < 0 ? nullptr : part_lse + t.part * H);
    }
  }
  if (!parts) return;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < B * H; i++) {
    const int64_t b = i / H, head = i % H;
    if (!num_parts[b]) continue;
    float top = -INFINITY;
    for (int64_t p = 0; p < num_parts[b]; p++) top = std::max(top, part_lse[(first_part[b] + p) * H + head]);
    float o[256] = {};
    float total = 0.0f;
    for (int64_t p = 0; p < num_parts[b]; p++) {
      const float w = expf(part_lse[(first_part[b] + p) * H + head] - top);
      const float* op = partial.data() + ((first_part[b] + p) * H + head) * D;
      for (int64_t d = 0; d < D; d++) o[d] += w * op[d];
      total += w;
    }
    for (int64_t d = 0; d < D; d++) o[d] /= total;
    store(b, head, o);
  }
}

// The tasks above without splitting (the float32 library's kernels have no parts):
// attend(b, seq, L, hk0, nhk, scratch) for sequence b's kv heads hk0..hk0+nhk-1 over its L
// keys (all of them, or its window's).
template <typename T, typename Attend>
void for_each_decode_task(const T* kv, int64_t s_block, int64_t s_kv, int64_t s_tok,
                          const int64_t* block_tables, int64_t max_blocks,
                          const int64_t* seq_lens, int64_t B, int64_t Hkv, int64_t block_size,
                          int64_t window, Attend attend) {
  for_each_decode_part(
      kv, s_block, s_kv, s_tok, block_tables, max_blocks, seq_lens, B, 0, Hkv, 0, block_size,
      std::numeric_limits<int64_t>::max(), window,
      [&](int64_t b, const PagedSeq<T>& seq, int64_t L, int64_t hk0, int64_t nhk,
          std::vector<float>& scratch, float*, float*) { attend(b, seq, L, hk0, nhk, scratch); },
      [](int64_t, int64_t, const float*) {});
}

// ---------------------------------------------------------------------------------------
// Every decoder layer of a decode-only step, in one call. The per-op path makes ~9 calls a
// layer from Python (~270 a step for a 30-layer model), each costing ~15 microseconds of
// interpreter, ctypes and allocation time: at batch 1 on the default model that was a
// fifth of the step (bf16: 19.1 -> 14.9 ms a step). This runs the same kernels in the same
// order on the same values, so its output is bit-identical to the per-op path; it only
// removes the round trips.
//
// Per layer: h = add_rms_norm(x, delta); qkv = h Wqkv^T (+ b); [per-head q/k norms];
// rotary (the layer's tables) + KV write; attn = decode attention (the layer's window);
// o = attn Wo^T; [o = rms_norm(o)]; h = add_rms_norm(x, o); act = silu_mul or
// gelu_tanh_mul(h Wgu^T); delta = act Wdown^T; [delta = rms_norm(delta)]. The bracketed
// steps are the families' (family.py: Qwen3, Gemma 3), skipped where a layer has no such
// weight. x is the residual stream (updated in place); the last layer's delta is written
// to delta_out (the caller adds it before the final norm).

template <typename T>
struct DecodeLayer {  // the layout of cpu_kernels.py's PdLayer
  const T* input_norm;
  const void* qkv;  // the four weights: T, or blocks of the format in `types`
  const T* qkv_bias;  // may be null
  const void* o;
  const T* post_norm;
  const void* gate_up;
  const void* down;
  void* kv;  // this layer's cache (a KVFormat), addressed with the strides below
  // The four weights packed for a library's own linear (the bf16 one's AMX tiles), or
  // all null: the caller picks the table by the step's rows.
  const T* qkv_packed;
  const T* o_packed;
  const T* gate_up_packed;
  const T* down_packed;
  // The four weights' formats: 0 = dense T, else a quant::Type (quant_linear.h).
  int64_t qkv_type, o_type, gate_up_type, down_type;
  // The family's: per-head q/k norm weights, the attention's and the MLP's output norms
  // (each null where the layer has none), this layer's rotary tables [positions, D], its
  // sliding window (0: every key) and its activation (kSilu or kGeluTanh).
  const T* q_norm;
  const T* k_norm;
  const T* attn_out_norm;
  const T* mlp_out_norm;
  const float* cos;
  const float* sin;
  int64_t window, activation;
};

enum Activation : int64_t { kSilu = 0, kGeluTanh = 1 };

// One library's kernels, as the layer loop calls them (its extern "C" entry points).
template <typename T>
struct StepKernels {
  void (*add_rms_norm)(T* x, const T* delta, const T* weight, T* out, int64_t rows,
                       int64_t hidden, float eps);
  // y = x w^T (+ bias) for w dense (type 0, or `packed`) or in a quant::Type.
  void (*linear)(const T* x, const void* w, const T* packed, int64_t type, const T* bias,
                 T* y, int64_t M, int64_t N, int64_t K);
  // The cache (kv, its strides) in a KVFormat.
  void (*rotary_write_kv)(T* qkv, int64_t rows, int64_t H, int64_t Hkv, int64_t D,
                          const float* cos, const float* sin, const int64_t* positions,
                          void* kv, int64_t kv_format, int64_t s_block, int64_t s_kv,
                          int64_t s_tok, const int64_t* slot_blocks,
                          const int64_t* slot_offsets);
  int (*decode_attention)(const T* q, int64_t q_stride, const void* kv, int64_t kv_format,
                          int64_t s_block, int64_t s_kv, int64_t s_tok,
                          const int64_t* block_tables, int64_t max_blocks,
                          const int64_t* seq_lens, T* out, int64_t B, int64_t H, int64_t Hkv,
                          int64_t D, int64_t block_size, float scale, int64_t window);
  void (*silu_mul)(const T* gate_up, T* out, int64_t rows, int64_t I);
  void (*gelu_tanh_mul)(const T* gate_up, T* out, int64_t rows, int64_t I);
  void (*head_norms)(T* qkv, int64_t rows, int64_t H, int64_t Hkv, int64_t D, const T* q_norm,
                     const T* k_norm, float eps);
};

template <typename T>
int decode_layers(const StepKernels<T>& k, const DecodeLayer<T>* layers, int64_t num_layers,
                  T* x, T* delta_out, int64_t rows, int64_t hidden, int64_t H, int64_t Hkv,
                  int64_t D, int64_t inter, float eps, float scale,
                  const int64_t* positions, int64_t kv_format,
                  int64_t s_block, int64_t s_kv, int64_t s_tok, const int64_t* slot_blocks,
                  const int64_t* slot_offsets, const int64_t* block_tables, int64_t max_blocks,
                  const int64_t* seq_lens, int64_t block_size) {
  if (D != 32 && D != 64 && D != 128 && D != 256) return -1;
  const int64_t width = (H + 2 * Hkv) * D;
  std::vector<T> h(rows * hidden), qkv(rows * width), attn(rows * H * D),
      gu(rows * 2 * inter), act(rows * inter), o(rows * hidden);
  for (int64_t l = 0; l < num_layers; l++) {
    const DecodeLayer<T>& w = layers[l];
    k.add_rms_norm(x, l ? delta_out : nullptr, w.input_norm, h.data(), rows, hidden, eps);
    k.linear(h.data(), w.qkv, w.qkv_packed, w.qkv_type, w.qkv_bias, qkv.data(), rows, width,
             hidden);
    if (w.q_norm) k.head_norms(qkv.data(), rows, H, Hkv, D, w.q_norm, w.k_norm, eps);
    k.rotary_write_kv(qkv.data(), rows, H, Hkv, D, w.cos, w.sin, positions, w.kv, kv_format,
                      s_block, s_kv, s_tok, slot_blocks, slot_offsets);
    k.decode_attention(qkv.data(), width, w.kv, kv_format, s_block, s_kv, s_tok, block_tables,
                       max_blocks, seq_lens, attn.data(), rows, H, Hkv, D, block_size, scale,
                       w.window);
    k.linear(attn.data(), w.o, w.o_packed, w.o_type, nullptr, o.data(), rows, hidden, H * D);
    if (w.attn_out_norm) k.add_rms_norm(o.data(), nullptr, w.attn_out_norm, o.data(), rows, hidden, eps);
    k.add_rms_norm(x, o.data(), w.post_norm, h.data(), rows, hidden, eps);
    k.linear(h.data(), w.gate_up, w.gate_up_packed, w.gate_up_type, nullptr, gu.data(), rows,
             2 * inter, hidden);
    (w.activation == kGeluTanh ? k.gelu_tanh_mul : k.silu_mul)(gu.data(), act.data(), rows, inter);
    k.linear(act.data(), w.down, w.down_packed, w.down_type, nullptr, delta_out, rows, hidden,
             inter);
    if (w.mlp_out_norm)
      k.add_rms_norm(delta_out, nullptr, w.mlp_out_norm, delta_out, rows, hidden, eps);
  }
  return 0;
}

}  // namespace paged
