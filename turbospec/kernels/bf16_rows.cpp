// y = x @ W^T (+ bias) for bf16 x [M, K] and bf16 W [N, K]: products accumulated in float32, rounded to bf16
// once, as torch's own bf16 matmul does.
//
// Why our own: on CPUs without bf16 arithmetic (AVX2, AVX-512 without AVX512_BF16) torch's bf16 matmul costs
// about one single-row product per row (1536x8960 on an AVX2 EPYC, 2026-12-02: 1.78 ms at 1 row, 14.9 at 9, 420 at
// 256; benchmarks/results/bf16_rows.md), so verifying a draft of 8 tokens cost 8 decode steps and speculation could
// not win there. Here each weight row is read once per chunk of activation rows and widened to float32 in
// registers (a bf16 value is the top half of a float32), then multiplied into up to 6 rows at once: few-row calls
// stay bound by reading the weights, like a one-row call, and many-row calls run near the CPU's FMA peak.
//
// Each output is summed in the same order whatever M is, how the rows are tiled or how threads split the
// outputs (8 lanes, each over its inputs of every 16-input block in turn: even input, then odd; lanes added in a
// fixed order; then the inputs past the last full block): a row's result does not depend on the other rows of the
// call or on the thread count.
//
// Compiled for AVX2 + FMA through function attributes, whatever the build's flags; `bf16_rows_available()` says
// whether this CPU can run it (the Python side decides where it runs: kernels/__init__.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#define TURBOSPEC_AVX2 __attribute__((target("avx2,fma")))
#endif

namespace {

// Tiles of weight rows x activation rows, accumulators in registers (AVX2 has 16): 4 x up to 3 rows (4 weight
// streams keep a one-row call reading memory at full speed), 2 x 4-6 rows (each widened weight vector feeds
// 4-6 multiply-adds, so widening costs less of the arithmetic).
constexpr int kOutTile = 4;
constexpr int kMaxRows = 6;
constexpr int64_t kChunk = 24;  // activation rows kept (as float32) in L2 while a thread's weight rows stream by

#if defined(__x86_64__)
TURBOSPEC_AVX2 inline float lane_sum(__m256 v) {
  // a fixed order: (lo + hi) halves, then pairs, then the last two
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

inline float bf16_value(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// OUTS weight rows against ROWS activation rows; out[r * out_stride + o]. 16 bf16 weights are one load: shifted
// left they are the even inputs' float32 values, masked the odd ones', so x comes with each block of 16 inputs
// reordered evens first (`interleave_x`). k16: the inputs handled that way (a multiple of 16); the rest one by one.
template <int OUTS, int ROWS>
TURBOSPEC_AVX2 void tile(const float* x, int64_t x_stride, const uint16_t* w, int64_t w_stride, int64_t k_size,
                         int64_t k16, float* out, int64_t out_stride) {
  __m256 acc[OUTS][ROWS];
  for (int o = 0; o < OUTS; ++o)
    for (int r = 0; r < ROWS; ++r) acc[o][r] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t k = 0; k < k16; k += 16) {
    __m256 even[OUTS], odd[OUTS];
    for (int o = 0; o < OUTS; ++o) {
      __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + o * w_stride + k));
      even[o] = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
      odd[o] = _mm256_castsi256_ps(_mm256_and_si256(raw, high));
    }
    for (int r = 0; r < ROWS; ++r) {
      __m256 xe = _mm256_loadu_ps(x + r * x_stride + k), xo = _mm256_loadu_ps(x + r * x_stride + k + 8);
      for (int o = 0; o < OUTS; ++o)
        acc[o][r] = _mm256_fmadd_ps(odd[o], xo, _mm256_fmadd_ps(even[o], xe, acc[o][r]));
    }
  }
  for (int o = 0; o < OUTS; ++o)
    for (int r = 0; r < ROWS; ++r) {
      float sum = lane_sum(acc[o][r]);
      for (int64_t k = k16; k < k_size; ++k) sum += bf16_value(w[o * w_stride + k]) * x[r * x_stride + k];
      out[r * out_stride + o] = sum;
    }
}

using TileFn = void (*)(const float*, int64_t, const uint16_t*, int64_t, int64_t, int64_t, float*, int64_t);

template <int OUTS>
constexpr TileFn row_tiles[kMaxRows] = {tile<OUTS, 1>, tile<OUTS, 2>, tile<OUTS, 3>,
                                        tile<OUTS, 4>, tile<OUTS, 5>, tile<OUTS, 6>};

const TileFn* const tiles[kOutTile] = {row_tiles<1>, row_tiles<2>, row_tiles<3>, row_tiles<4>};
#endif

// x [M, K] as float32, each block of 16 inputs reordered: its 8 even inputs, then its 8 odd ones.
at::Tensor interleave_x(const at::Tensor& x, int64_t k16) {
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor blocks =
      xf.narrow(1, 0, k16).reshape({x.size(0), k16 / 16, 8, 2}).transpose(2, 3).reshape({x.size(0), k16});
  if (k16 == x.size(1)) return blocks.contiguous();
  return at::cat({blocks, xf.narrow(1, k16, x.size(1) - k16)}, 1).contiguous();
}

bool available() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

at::Tensor bf16_rows_mm(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(available(), "bf16_rows_mm needs a CPU with AVX2 and FMA");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "bf16_rows_mm: x [M, K] and w [N, K] expected");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "bf16_rows_mm takes bf16");
#if defined(__x86_64__)
  const int64_t m_size = x.size(0), k_size = x.size(1), n_size = w.size(0), k16 = k_size & ~int64_t{15};
  const at::Tensor xf = interleave_x(x, k16);
  // weight rows may be strided (a slice of a wider weight's inputs: tensor parallelism's groups), not their values
  const at::Tensor wc = w.stride(1) == 1 ? w : w.contiguous();
  const int64_t w_stride = wc.stride(0);
  at::Tensor out = at::empty({m_size, n_size}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  float* op = out.data_ptr<float>();
  const int64_t blocks = (n_size + kOutTile - 1) / kOutTile;
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t m0 = 0; m0 < m_size; m0 += kChunk) {
      const int64_t chunk = std::min(kChunk, m_size - m0);
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t n0 = b * kOutTile;
        const int64_t block = std::min<int64_t>(kOutTile, n_size - n0);
        for (int64_t r0 = 0; r0 < chunk;) {
          // 6 rows at a time while more than 6 remain, then the rest in one tile
          const int64_t rows = chunk - r0 > kMaxRows ? kMaxRows : chunk - r0;
          const int64_t out_step = rows <= 3 ? kOutTile : 2;
          for (int64_t o0 = 0; o0 < block; o0 += out_step) {
            const int64_t outs = std::min(out_step, block - o0);
            tiles[outs - 1][rows - 1](xp + (m0 + r0) * k_size, k_size, wp + (n0 + o0) * w_stride, w_stride,
                                      k_size, k16, op + (m0 + r0) * n_size + n0 + o0, n_size);
          }
          r0 += rows;
        }
      }
    }
  });
  if (bias.has_value()) out.add_(bias->to(at::kFloat));
  return out.to(at::kBFloat16);
#else
  return at::Tensor();
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(turbospec, m) {
  m.def("bf16_rows_available() -> bool");
  m.def("bf16_rows_mm(Tensor x, Tensor w, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(turbospec, CPU, m) { m.impl("bf16_rows_mm", &bf16_rows_mm); }

TORCH_LIBRARY_IMPL(turbospec, CatchAll, m) { m.impl("bf16_rows_available", &available); }
