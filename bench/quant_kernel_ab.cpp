// Two versions of the bf16 library's few-row block kernels (quant_linear.h's fused_rows_i8)
// timed against each other in one process, alternating call by call, and their outputs
// compared: on the shared 2-core VMs, runs of one version vary by 1.5x from minute to
// minute, so separate runs of old and new cannot tell a 10% change; alternating calls in
// one process can. Single-threaded in L2 by default (the kernel's own speed); `big` runs
// 2 threads on matrices past the L3 (what a decode step sees).
//
//   git show HEAD:pdserve/model/csrc/quant_linear.h > /tmp/old_quant_linear.h
//   g++ -O3 -march=native -fopenmp -std=c++17 -DOLD='"/tmp/old_quant_linear.h"' \
//       bench/quant_kernel_ab.cpp -o /tmp/ab
//   OMP_NUM_THREADS=1 /tmp/ab        # or: OMP_NUM_THREADS=2 /tmp/ab big
//
// Prints Gweights/s of each, new/old, and the largest difference of their outputs (0 when a
// change keeps the products and the order of the sums). Needs AVX512-BF16 and VNNI.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <type_traits>
#include <vector>

#ifndef OLD
#error "-DOLD='\"path/to/old/quant_linear.h\"'"
#endif
namespace old_version {
#include OLD
}
#include "../pdserve/model/csrc/quant_linear.h"

using namespace quant;

// Random blocks with finite scales (random bytes would make some fp16 scales NaN).
template <int64_t kType>
std::vector<uint8_t> random_rows(int64_t N, int64_t K, std::mt19937& g) {
  std::vector<uint8_t> w(N * row_bytes(kType, K));
  for (auto& b : w) b = static_cast<uint8_t>(g());
  const int64_t bytes = block_bytes(kType);
  for (int64_t i = 0; i < static_cast<int64_t>(w.size()) / bytes; i++) {
    uint8_t* blk = w.data() + i * bytes;
    const uint16_t d = _cvtss_sh(0.01f * (1 + (g() % 100) / 100.0f), 0), m = _cvtss_sh(0.005f, 0);
    if (kType == kQ6_K) {
      memcpy(blk + 208, &d, 2);
    } else {
      memcpy(blk, &d, 2);
      if (kType != kQ4_0 && kType != kQ8_0 && kType != kQ5_0) memcpy(blk + 2, &m, 2);
    }
  }
  return w;
}

template <int64_t kType, int MT>
void compare(const char* name, int64_t N, int64_t K, int reps) {
  std::mt19937 g(1);
  const std::vector<uint8_t> w = random_rows<kType>(N, K, g);
  std::vector<uint16_t> x(MT * K);
  std::normal_distribution<float> normal;
  for (auto& v : x) Elem<uint16_t>::store(&v, normal(g));
  const int64_t nb = K / kBlock;
  std::vector<int8_t> xq(MT * split_row_bytes(K));
  std::vector<float> xscale(MT * nb), sum16(MT * K / 16), sum32(MT * nb);
  split_x(x.data(), MT, K, xq.data(), xscale.data(), sum16.data(), sum32.data());
  std::vector<float> y_old(MT * N), y_new(MT * N);
  double best[2] = {1e9, 1e9};
  for (int r = 0; r < reps; r++) {
    for (int version = 0; version < 2; version++) {
      const auto start = std::chrono::steady_clock::now();
      if (version == 0)
        old_version::quant::fused_rows_i8<kType, MT, float>(xq.data(), xscale.data(), sum16.data(), sum32.data(),
                                                             w.data(), nullptr, y_old.data(), N, K);
      else
        fused_rows_i8<kType, MT, float>(xq.data(), xscale.data(), sum16.data(), sum32.data(), w.data(), nullptr,
                                        y_new.data(), N, K);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      best[version] = std::min(best[version], s);
    }
  }
  double diff = 0;
  for (int64_t i = 0; i < MT * N; i++) diff = std::max(diff, static_cast<double>(std::fabs(y_new[i] - y_old[i])));
  printf("%-5s rows %d  %6ld x %-6ld old %5.1f  new %5.1f Gweights/s  new/old %.2fx  max diff %.3g\n", name, MT, N, K,
         N * K / best[0] / 1e9, N * K / best[1] / 1e9, best[0] / best[1], diff);
}

int main(int argc, char** argv) {
  if (argc > 1 && strcmp(argv[1], "big") == 0) {  // 300-600 MB a matrix: past the L3
    compare<kQ4_K, 1>("q4_k", 524288, 2048, 6);
    compare<kQ4_K, 1>("q4_k", 32768, 14336, 6);
    compare<kQ6_K, 1>("q6_k", 524288, 2048, 6);
    compare<kQ4_0, 1>("q4_0", 524288, 2048, 6);
    compare<kQ8_0, 1>("q8_0", 131072, 4096, 6);
    compare<kQ4_K, 4>("q4_k", 524288, 2048, 6);
    return 0;
  }
  const int reps = 1000;  // 256 x 4096: 0.6-1.1 MB, in L2
  compare<kQ4_K, 1>("q4_k", 256, 4096, reps);
  compare<kQ5_K, 1>("q5_k", 256, 4096, reps);
  compare<kQ6_K, 1>("q6_k", 256, 4096, reps);
  compare<kQ4_0, 1>("q4_0", 256, 4096, reps);
  compare<kQ4_1, 1>("q4_1", 256, 4096, reps);
  compare<kQ5_0, 1>("q5_0", 256, 4096, reps);
  compare<kQ5_1, 1>("q5_1", 256, 4000, reps);  // 125 blocks: an odd last one
  compare<kQ8_0, 1>("q8_0", 256, 4096, reps);
  compare<kQ4_K, 2>("q4_k", 256, 4096, reps);
  compare<kQ4_K, 4>("q4_k", 256, 4096, reps);
  compare<kQ4_K, 7>("q4_k", 256, 4096, reps);
  compare<kQ6_K, 4>("q6_k", 256, 4096, reps);
  compare<kQ4_0, 4>("q4_0", 256, 4000, reps);
  compare<kQ4_0, 7>("q4_0", 256, 4000, reps);
}
