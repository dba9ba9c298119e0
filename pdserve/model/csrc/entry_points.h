// The entry points both kernel libraries export with the same code, written once over the
// library's element type: the element-wise ones (the norms, the activations, rotary + the
// KV write) and the one-call decode step. A library includes this after vec_x86.h,
// paged_decode.h and attention_f32.h, with in namespace `elem`:
//   using T = ...;                       the element type (bf16 or float)
//   vec::F load(const T*); void store(T*, vec::F);   kLanes elements, widened to / rounded
//                                        from float (bf16: round to nearest even)
//   float to_float(T);
// and defines, anywhere in the file, `elem::step_linear` and `pd_decode_attention` (its own
// kernels, declared below). Every kernel computes in float; shapes are checked on the
// Python side (rows of multiples of vec::kLanes).

#pragma once

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

namespace pointwise {

using elem::T;

// One row of pd_add_rms_norm (out may be x: each element is read before it is written).
// The residual sum is stored, then read back: in bf16 the stream keeps the rounded sum.
inline void rms_norm_row(T* x, const T* delta, const T* weight, T* out, int64_t H, float eps) {
  vec::F ss = vec::zero();
  for (int64_t i = 0; i < H; i += vec::kLanes) {
    vec::F v = elem::load(x + i);
    if (delta) {
      elem::store(x + i, vec::add(v, elem::load(delta + i)));
      v = elem::load(x + i);
    }
    ss = vec::fmadd(v, v, ss);
  }
  const vec::F scale = vec::set1(1.0f / sqrtf(vec::reduce_add(ss) / static_cast<float>(H) + eps));
  for (int64_t i = 0; i < H; i += vec::kLanes)
    elem::store(out + i, vec::mul(vec::mul(elem::load(x + i), scale), elem::load(weight + i)));
}

// out[t, i] = act(gate_up[t, i]) * gate_up[t, I + i].
template <typename Act>
void gated(const T* gate_up, T* out, int64_t rows, int64_t I, Act act) {
#pragma omp parallel for schedule(static) if (rows * I >= 16384)
  for (int64_t t = 0; t < rows; t++) {
    const T* g = gate_up + t * 2 * I;
    for (int64_t i = 0; i < I; i += vec::kLanes)
      elem::store(out + t * I + i, vec::mul(act(elem::load(g + i)), elem::load(g + I + i)));
  }
}

}  // namespace pointwise

extern "C" {

// x = x + delta (when delta is given), then out = x * rsqrt(mean(x^2) + eps) * weight.
// Rows of H elements.
void pd_add_rms_norm(elem::T* x, const elem::T* delta, const elem::T* weight, elem::T* out,
                     int64_t T, int64_t H, float eps) {
#pragma omp parallel for schedule(static) if (T > 1)
  for (int64_t t = 0; t < T; t++)
    pointwise::rms_norm_row(x + t * H, delta ? delta + t * H : nullptr, weight, out + t * H, H, eps);
}

// Qwen3's and Gemma 3's per-head norms: each q head and each k head of a fused
// qkv[T, H + 2 Hkv, D] buffer normalized in place (as pd_add_rms_norm normalizes a row).
void pd_head_norms(elem::T* qkv, int64_t T, int64_t H, int64_t Hkv, int64_t D,
                   const elem::T* q_norm, const elem::T* k_norm, float eps) {
  const int64_t heads = H + Hkv, width = (H + 2 * Hkv) * D;
#pragma omp parallel for schedule(static) if (T * heads >= 64)
  for (int64_t i = 0; i < T * heads; i++) {
    elem::T* row = qkv + (i / heads) * width + (i % heads) * D;
    pointwise::rms_norm_row(row, nullptr, i % heads < H ? q_norm : k_norm, row, D, eps);
  }
}

// SwiGLU: silu(gate) * up.
void pd_silu_mul(const elem::T* gate_up, elem::T* out, int64_t T, int64_t I) {
  pointwise::gated(gate_up, out, T, I, [](vec::F g) {
    return vec::div(g, vec::add(vec::set1(1.0f), vec::exp(vec::sub(vec::zero(), g))));
  });
}

// GeGLU (Gemma's MLP): gelu_tanh(gate) * up.
void pd_gelu_tanh_mul(const elem::T* gate_up, elem::T* out, int64_t T, int64_t I) {
  pointwise::gated(gate_up, out, T, I, [](vec::F g) { return vec::gelu_tanh(g); });
}

// Rotary (rotate-half form) applied in place to the query and key heads of a fused
// qkv[T, H + 2 Hkv, D] buffer, then the rotated keys and the values written to their
// cache slots. cos/sin are float tables [max_positions, D] (each half repeats the other).
// The cache, in a paged::KVFormat, is addressed by strides (in its elements): block, K/V
// plane, token; heads are contiguous within a token. D % (2 kLanes) == 0.
void pd_rotary_write_kv(elem::T* qkv, int64_t T, int64_t H, int64_t Hkv, int64_t D,
                        const float* cos, const float* sin, const int64_t* positions, void* kv,
                        int64_t kv_format, int64_t s_block, int64_t s_kv, int64_t s_tok,
                        const int64_t* slot_blocks, const int64_t* slot_offsets) {
  const int64_t half = D / 2, width = (H + 2 * Hkv) * D;
#pragma omp parallel for schedule(static) if (T > 1)
  for (int64_t t = 0; t < T; t++) {
    elem::T* row = qkv + t * width;
    const float* c = cos + positions[t] * D;
    const float* s = sin + positions[t] * D;
    for (int64_t h = 0; h < H + Hkv; h++) {
      elem::T* x = row + h * D;
      for (int64_t i = 0; i < half; i += vec::kLanes) {
        const vec::F x1 = elem::load(x + i), x2 = elem::load(x + half + i);
        const vec::F c1 = vec::load(c + i), s1 = vec::load(s + i);
        elem::store(x + i, vec::fmsub(x1, c1, vec::mul(x2, s1)));
        elem::store(x + half + i, vec::fmadd(x2, c1, vec::mul(x1, s1)));
      }
    }
    const int64_t slot = slot_blocks[t] * s_block + slot_offsets[t] * s_tok;
    if (kv_format == paged::kKVInt8) {
      attn::store_kv_int8(row + H * D, row + (H + Hkv) * D, static_cast<int8_t*>(kv) + slot,
                          s_kv, Hkv, D, elem::to_float);
    } else {
      elem::T* dst = static_cast<elem::T*>(kv) + slot;
      memcpy(dst, row + H * D, Hkv * D * sizeof(elem::T));                // keys
      memcpy(dst + s_kv, row + (H + Hkv) * D, Hkv * D * sizeof(elem::T));  // values
    }
  }
}

// Decode attention (each library's own kernels), and the linear a one-call step runs its
// weights on (dense, packed for the library's own tiles, or in GGUF blocks); with
// `batch_invariant`, the loop that sums each row one way at every row count.
int pd_decode_attention(const elem::T* q, int64_t q_stride, const void* kv, int64_t kv_format,
                        int64_t s_block, int64_t s_kv, int64_t s_tok,
                        const int64_t* block_tables, int64_t max_blocks,
                        const int64_t* seq_lens, elem::T* out, int64_t B, int64_t H,
                        int64_t Hkv, int64_t D, int64_t block_size, float scale, int64_t window);

}  // extern "C"

namespace elem {
using StepLinear = void (*)(const T* x, const void* w, const T* packed, int64_t type,
                            const T* bias, T* y, int64_t M, int64_t N, int64_t K);
StepLinear step_linear(bool batch_invariant);
}  // namespace elem

extern "C" {

// Every layer of a decode-only step in one call (paged_decode.h). A layer table's packed
// weights are the library's own tiles (bf16: AMX) or all null; the caller picks the table
// by the step's rows.
int pd_decode_layers(const paged::DecodeLayer<elem::T>* layers, int64_t num_layers,
                     elem::T* x, elem::T* delta_out, int64_t T, int64_t hidden, int64_t H,
                     int64_t Hkv, int64_t D, int64_t inter, float eps, float scale,
                     const int64_t* positions, int64_t kv_format, int64_t s_block,
                     int64_t s_kv, int64_t s_tok, const int64_t* slot_blocks,
                     const int64_t* slot_offsets, const int64_t* block_tables,
                     int64_t max_blocks, const int64_t* seq_lens, int64_t block_size,
                     int64_t batch_invariant) {
  const paged::StepKernels<elem::T> kernels{
      pd_add_rms_norm,     elem::step_linear(batch_invariant), pd_rotary_write_kv,
      pd_decode_attention, pd_silu_mul, pd_gelu_tanh_mul, pd_head_norms};
  return paged::decode_layers(kernels, layers, num_layers, x, delta_out, T, hidden, H, Hkv, D,
                              inter, eps, scale, positions, kv_format, s_block, s_kv, s_tok,
                              slot_blocks, slot_offsets, block_tables, max_blocks, seq_lens,
                              block_size);
}

}  // extern "C"
