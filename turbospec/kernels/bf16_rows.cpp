// y = x @ W^T (+ bias) for bf16 x [M, K] and bf16 W [N, K]: products accumulated in float32, rounded to bf16
// once, as torch's own bf16 matmul does.
//
// Why our own: on CPUs without bf16 arithmetic (AVX2, AVX-512 without AVX512_BF16) torch's bf16 matmul costs
// about one single-row product per row (1536x8960 on an AVX2 EPYC, 2026-12-02: 1.78 ms at 1 row, 14.9 at 9, 420 at
// 256; benchmarks/results/bf16_rows/bf16_rows.md), so verifying a draft of 8 tokens cost 8 decode steps and speculation could
// not win there. Here each weight row is read once per chunk of activation rows and widened to float32 in
// registers (a bf16 value is the top half of a float32), then multiplied into up to 6 rows at once: few-row calls
// stay bound by reading the weights, like a one-row call, and many-row calls run near the CPU's FMA peak.
//
// Each output is summed in the same order whatever M is, how the rows are tiled or how threads split the
// outputs (8 lanes, each over its inputs of every 16-input block in turn: even input, then odd; lanes added in a
// fixed order; then the inputs past the last full block): a row's result does not depend on the other rows of the
// call or on the thread count.
//
// CPUs with AVX512_BF16 but no AMX (AMD Zen 4, 2026-12-03) take a second path: torch's bf16 product does not
// stream the weights once for a few rows there either (17920x1536, qwen2.5-coder-1.5b's gate/up: 2.45 ms at 9 rows
// against 0.73 for one row with this path; benchmarks/results/bf16_rows/bf16_rows_avx512bf16.md). `vdpbf16ps` multiplies 32 bf16 weights by 32
// bf16 inputs into 16 float32 sums in one instruction, so x stays bf16 (no widening) and a 4 x 6 tile of sums fits
// in the 32 registers. Same guarantee: each output is summed over 32-input blocks in order (the tail masked into
// the last block), then its 16 lanes reduced in a fixed order, whatever M, the tiling or the threads. The two
// paths round differently (vdpbf16ps adds its two products before the sum), so a CPU always takes the same one.
//
// Compiled for AVX2 + FMA (and AVX512_BF16) through function attributes, whatever the build's flags;
// `bf16_rows_available()` says whether this CPU can run it (the Python side decides where it runs:
// kernels/__init__.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#define TURBOSPEC_AVX2 __attribute__((target("avx2,fma")))
#define TURBOSPEC_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))
#endif

namespace {

// The tiles' loops over their (compile-time) outputs and rows, unrolled before GCC decides where the sums live:
// left to its later unrolling, it kept every sum in a register and stored it to the stack on every block as well.
#define UNROLL _Pragma("GCC unroll 8")

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
  UNROLL for (int o = 0; o < OUTS; ++o)
    UNROLL for (int r = 0; r < ROWS; ++r) acc[o][r] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t k = 0; k < k16; k += 16) {
    __m256 even[OUTS], odd[OUTS];
    UNROLL for (int o = 0; o < OUTS; ++o) {
      __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + o * w_stride + k));
      even[o] = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
      odd[o] = _mm256_castsi256_ps(_mm256_and_si256(raw, high));
    }
    UNROLL for (int r = 0; r < ROWS; ++r) {
      __m256 xe = _mm256_loadu_ps(x + r * x_stride + k), xo = _mm256_loadu_ps(x + r * x_stride + k + 8);
      UNROLL for (int o = 0; o < OUTS; ++o)
        acc[o][r] = _mm256_fmadd_ps(odd[o], xo, _mm256_fmadd_ps(even[o], xe, acc[o][r]));
    }
  }
  UNROLL for (int o = 0; o < OUTS; ++o)
    UNROLL for (int r = 0; r < ROWS; ++r) {
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

// The AVX512_BF16 tile: OUTS weight rows against ROWS bf16 activation rows; out[r * out_stride + o]. One loop
// (the last block's missing inputs masked to zeros, which add nothing), so the sums stay in registers.
template <int OUTS, int ROWS>
TURBOSPEC_AVX512BF16 void tile_dpbf16(const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t w_stride,
                                      int64_t k_size, float* out, int64_t out_stride) {
  __m512 acc[OUTS][ROWS];
  UNROLL for (int o = 0; o < OUTS; ++o)
    UNROLL for (int r = 0; r < ROWS; ++r) acc[o][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_size; k += 32) {
    const __mmask32 mask =
        k + 32 <= k_size ? ~__mmask32{0} : static_cast<__mmask32>((uint64_t{1} << (k_size - k)) - 1);
    __m512bh wv[OUTS];
    UNROLL for (int o = 0; o < OUTS; ++o) {
      wv[o] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + o * w_stride + k);
      // the next tile's weight rows (the same line of each): without it the loads and the sums took turns
      // rather than overlapping (ad hoc, when it was written: 4 rows of 17920x1536 cost 1.6x one row, then 0.9x;
      // a prefetch past the end cannot fault)
      _mm_prefetch(reinterpret_cast<const char*>(w + (o + OUTS) * w_stride + k), _MM_HINT_T0);
    }
    UNROLL for (int r = 0; r < ROWS; ++r) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + r * x_stride + k);
      UNROLL for (int o = 0; o < OUTS; ++o) acc[o][r] = _mm512_dpbf16_ps(acc[o][r], wv[o], xv);
    }
  }
  UNROLL for (int o = 0; o < OUTS; ++o)
    UNROLL for (int r = 0; r < ROWS; ++r) out[r * out_stride + o] = _mm512_reduce_add_ps(acc[o][r]);
}

using DpTileFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, float*, int64_t);

template <int OUTS>
constexpr DpTileFn dp_row_tiles[kMaxRows] = {tile_dpbf16<OUTS, 1>, tile_dpbf16<OUTS, 2>, tile_dpbf16<OUTS, 3>,
                                             tile_dpbf16<OUTS, 4>, tile_dpbf16<OUTS, 5>, tile_dpbf16<OUTS, 6>};

const DpTileFn* const dp_tiles[kOutTile] = {dp_row_tiles<1>, dp_row_tiles<2>, dp_row_tiles<3>, dp_row_tiles<4>};
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

bool has_dpbf16() {
#if defined(__x86_64__)
  static const bool yes = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
                          std::getenv("TURBOSPEC_NO_DPBF16") == nullptr;
  return yes;
#else
  return false;
#endif
}

// Both paths' loop over tiles: threads split the outputs in blocks of kOutTile, rows go in chunks of kChunk (kept
// in cache while a thread's weight rows stream by), then in tiles of up to kMaxRows.
// tile(first row, rows, first output, outputs) computes one tile.
template <typename Tile>
void for_each_tile(int64_t m_size, int64_t n_size, const Tile& tile) {
  const int64_t blocks = (n_size + kOutTile - 1) / kOutTile;
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t m0 = 0; m0 < m_size; m0 += kChunk) {
      const int64_t chunk = std::min(kChunk, m_size - m0);
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t n0 = b * kOutTile;
        for (int64_t r0 = 0; r0 < chunk; r0 += kMaxRows)
          tile(m0 + r0, std::min<int64_t>(kMaxRows, chunk - r0), n0, std::min<int64_t>(kOutTile, n_size - n0));
      }
    }
  });
}

// The AVX512_BF16 path of bf16_rows_mm: x [M, K] bf16 contiguous, float32 out [M, N].
void dpbf16_mm(const at::Tensor& x, const uint16_t* wp, int64_t w_stride, int64_t n_size, float* op) {
#if defined(__x86_64__)
  const int64_t k_size = x.size(1);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  for_each_tile(x.size(0), n_size, [&](int64_t m, int64_t rows, int64_t n0, int64_t outs) {
    dp_tiles[outs - 1][rows - 1](xp + m * k_size, k_size, wp + n0 * w_stride, w_stride, k_size, op + m * n_size + n0,
                                 n_size);
  });
#endif
}

// The AVX2 path of bf16_rows_mm: x widened to float32 (interleaved per 16-input block), float32 out [M, N].
void widened_mm(const at::Tensor& x, const uint16_t* wp, int64_t w_stride, int64_t n_size, float* op) {
#if defined(__x86_64__)
  const int64_t k_size = x.size(1), k16 = k_size & ~int64_t{15};
  const at::Tensor xf = interleave_x(x, k16);
  const float* xp = xf.data_ptr<float>();
  for_each_tile(x.size(0), n_size, [&](int64_t m, int64_t rows, int64_t n0, int64_t block) {
    const int64_t out_step = rows <= 3 ? kOutTile : 2;  // AVX2's 16 registers: 4 x 3 or 2 x 6 sums
    for (int64_t o0 = 0; o0 < block; o0 += out_step) {
      const int64_t outs = std::min(out_step, block - o0);
      tiles[outs - 1][rows - 1](xp + m * k_size, k_size, wp + (n0 + o0) * w_stride, w_stride, k_size, k16,
                                op + m * n_size + n0 + o0, n_size);
    }
  });
#endif
}

at::Tensor bf16_rows_mm(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                        bool widened) {
  TORCH_CHECK(available(), "bf16_rows_mm needs a CPU with AVX2 and FMA");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "bf16_rows_mm: x [M, K] and w [N, K] expected");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "bf16_rows_mm takes bf16");
  // weight rows may be strided (a slice of a wider weight's inputs: tensor parallelism's groups), not their values
  const at::Tensor wc = w.stride(1) == 1 ? w : w.contiguous();
  at::Tensor out = at::empty({x.size(0), w.size(0)}, x.options().dtype(at::kFloat));
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  if (has_dpbf16() && !widened)  // (widened: the AVX2 path on any CPU, for the tests)
    dpbf16_mm(x.contiguous(), wp, wc.stride(0), w.size(0), out.data_ptr<float>());
  else
    widened_mm(x, wp, wc.stride(0), w.size(0), out.data_ptr<float>());
  if (bias.has_value()) out.add_(bias->to(at::kFloat));
  return out.to(at::kBFloat16);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(turbospec, m) {
  m.def("bf16_rows_available() -> bool");
  m.def("bf16_rows_dpbf16() -> bool");
  m.def("bf16_rows_mm(Tensor x, Tensor w, Tensor? bias, bool widened=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(turbospec, CPU, m) { m.impl("bf16_rows_mm", &bf16_rows_mm); }

TORCH_LIBRARY_IMPL(turbospec, CatchAll, m) {
  m.impl("bf16_rows_available", &available);
  m.impl("bf16_rows_dpbf16", &has_dpbf16);
}
