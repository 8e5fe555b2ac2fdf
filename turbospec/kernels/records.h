// The tile-order records of amx_grouped.cpp (16 outputs x 32 inputs each), as every kernel that reads them sees
// them, and the driver shared by the two kernels that quantise the activations to int8 (records_dpbf16.cpp's
// AVX512-VNNI one, records_avx2_q8.cpp): the same checks, the same quantised activations, the same split of the rows
// into passes and of the output blocks between threads.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#define TS_AVX2 1
#include <immintrin.h>
#define TS_AVX2_TARGET __attribute__((target("avx2,fma,f16c")))
#endif

namespace {

// Whether this CPU runs the AVX2 record kernels (records_avx2.cpp, records_avx2_q8.cpp); TURBOSPEC_NO_AVX2_RECORDS=1
// says no, for side-by-side measurements.
inline bool avx2_ready() {
#if TS_AVX2
  static const bool ready = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                            __builtin_cpu_supports("f16c") && std::getenv("TURBOSPEC_NO_AVX2_RECORDS") == nullptr;
  return ready;
#else
  return false;
#endif
}

enum Kind { kInt4 = 0, kInt6 = 1, kInt8 = 2 };
constexpr int64_t kRecordBytes[3] = {320, 448, 576};
constexpr int64_t kTileN = 16;  // outputs per record
constexpr int64_t kTileK = 32;  // inputs per record

#if TS_AVX2
// Helpers of the AVX2 record kernels

TS_AVX2_TARGET inline __m256i load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// 16 float16 values (a record's scales or offsets) -> two registers of 8 floats
TS_AVX2_TARGET inline void halves(const uint8_t* p, __m256* lo, __m256* hi) {
  *lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  *hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
}

// 8 floats to bf16, rounded to nearest even (as records_dpbf16.cpp's store_bf16; no NaN here)
TS_AVX2_TARGET inline __m128i to_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
}
#endif

// A call's activations quantised per row and group of 32 inputs (scale max|x| / 127, round to nearest even).
struct Quantized {
  const int8_t* xq;     // [rows, K]
  const float* scale;   // [rows, K / 32]
  const int32_t* qsum;  // [rows, K / 32, 2]: sums of each group's halves
};

using QuantizeFn = void (*)(const uint16_t* x, int64_t rows, int64_t k, int8_t* xq, float* scale, int32_t* qsum);

// The quantised activations of one pass of R rows, group by group, so that a kernel instantiated for R finds each
// value at a constant offset from its group's start (an immediate in the instruction, no per-row address
// arithmetic, which was most of the instructions of a 9-row pass). Group g starts at g * Q8Layout<R>::kStride:
//   R x 32 int8 (row i's inputs at 32 i) | R float scales a | R x 2 four-byte offset terms, by the weights' kind:
//   int4: a * (q0 + q1) as float, twice; int6: a * q_h as float, h = 0, 1; int8: 128 * q_h as int32
// with q_h the int32 sum of the group's half h of quantised activations.
constexpr int64_t kQ8RowBytes = 32 + 4 + 8;

template <int R>
struct Q8Layout {
  static constexpr int64_t kStride = R * kQ8RowBytes;
  static const int8_t* x(const uint8_t* group, int i) { return reinterpret_cast<const int8_t*>(group + 32 * i); }
  static const float* scale(const uint8_t* group, int i) {
    return reinterpret_cast<const float*>(group + 32 * R + 4 * i);
  }
  static const uint8_t* offset(const uint8_t* group, int i, int h) { return group + 36 * R + 8 * i + 4 * h; }
};

// Lays out rows row0 .. row0 + count - 1 of `q` as Q8Layout<count> in `out` (groups * count * kQ8RowBytes bytes).
inline void lay_out_pass(const Quantized& q, int kind, int64_t k, int64_t row0, int64_t count, uint8_t* out) {
  const int64_t groups = k / 32;
  for (int64_t g = 0; g < groups; ++g) {
    uint8_t* group = out + g * count * kQ8RowBytes;
    for (int64_t i = 0; i < count; ++i) {
      const int64_t r = row0 + i, at = r * groups + g;
      std::memcpy(group + 32 * i, q.xq + r * k + g * 32, 32);
      const float a = q.scale[at];
      std::memcpy(group + 32 * count + 4 * i, &a, 4);
      for (int h = 0; h < 2; ++h) {
        uint8_t* dst = group + 36 * count + 8 * i + 4 * h;
        if (kind == kInt8) {
          const int32_t v = 128 * q.qsum[2 * at + h];
          std::memcpy(dst, &v, 4);
        } else {
          const int32_t sum = kind == kInt4 ? q.qsum[2 * at] + q.qsum[2 * at + 1] : q.qsum[2 * at + h];
          const float v = a * static_cast<float>(sum);
          std::memcpy(dst, &v, 4);
        }
      }
    }
  }
}

// Output block nb over all K for one pass (activations as Q8Layout<rows>), written to y (bf16, row stride n).
using PassQ8Fn = void (*)(const uint8_t* acts, const uint8_t* w, int64_t nb, int64_t groups, uint16_t* y, int64_t n);

// The checks every record product makes of its operands; returns y [M, N] (bf16, uninitialised).
inline at::Tensor records_output(const char* name, const at::Tensor& x, const at::Tensor& w, int kind) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, name, ": x must be bfloat16 [M, K]");
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kByte && w.size(2) == kRecordBytes[kind], name,
              ": packed weight must be uint8 [N / 16, K / 32, ", kRecordBytes[kind], "]");
  TORCH_CHECK(x.size(1) == w.size(1) * kTileK, name, ": x has ", x.size(1), " inputs, the weight ",
              w.size(1) * kTileK);
  return at::empty({x.size(0), w.size(0) * kTileN}, x.options());
}

// A call's rows in passes of at most `pass_rows`, as even as possible (9 rows in passes of 8: 4 + 5): (first row, rows).
inline std::vector<std::pair<int64_t, int>> split_passes(int64_t rows, int64_t pass_rows) {
  std::vector<std::pair<int64_t, int>> passes;
  const int64_t count = (rows + pass_rows - 1) / pass_rows;
  for (int64_t p = 0, row0 = 0; p < count; ++p) {
    const int64_t size = (rows - row0) / (count - p);
    passes.emplace_back(row0, static_cast<int>(size));
    row0 += size;
  }
  return passes;
}

// The output blocks shared between threads, one block at a time (each thread reads one sequential stream of
// records); each block's rows in the passes of split_passes, the later passes reading the block's records from
// cache. pass(nb, first row, rows) runs one pass. The split never changes a row's own arithmetic, so a row's result
// does not depend on the call's other rows.
template <typename Pass>
inline void for_each_pass(int64_t rows, int64_t blocks, int64_t pass_rows, const Pass& pass) {
  const auto passes = split_passes(rows, pass_rows);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb)
      for (const auto& [row0, count] : passes) pass(nb, row0, count);
  });
}

// A kernel's pass for `rows` (1..MaxRows) rows of `kind`: Pass<kind, rows>::fn, each an instantiation whose row
// count is a compile-time constant (its sums stay in registers).
template <typename Fn, template <int, int> class Pass, int... R>
Fn pass_from_table(int kind, int rows, std::integer_sequence<int, R...>) {
  static constexpr Fn fns[3][sizeof...(R)] = {
      {Pass<kInt4, R + 1>::fn...}, {Pass<kInt6, R + 1>::fn...}, {Pass<kInt8, R + 1>::fn...}};
  return fns[kind][rows - 1];
}

template <typename Fn, template <int, int> class Pass, int MaxRows>
Fn pick_pass(int kind, int rows) {
  return pass_from_table<Fn, Pass>(kind, rows, std::make_integer_sequence<int, MaxRows>{});
}

// y = x @ W^T with x quantised by `quantize`, in passes of at most `pass_rows` rows run by `pick(kind, rows)`.
inline void run_q8_passes(const at::Tensor& x_in, const at::Tensor& w, int kind, at::Tensor& y, int pass_rows,
                          QuantizeFn quantize, PassQ8Fn (*pick)(int, int)) {
  const int64_t rows = x_in.size(0), k = x_in.size(1), blocks = w.size(0), groups = w.size(1), n = blocks * kTileN;
  if (rows == 0) return;
  const at::Tensor x = x_in.contiguous(), wc = w.contiguous();
  std::vector<int8_t> xq(rows * k);
  std::vector<float> scale(rows * groups);
  std::vector<int32_t> qsum(rows * groups * 2);
  quantize(reinterpret_cast<const uint16_t*>(x.data_ptr()), rows, k, xq.data(), scale.data(), qsum.data());
  const Quantized quantized{xq.data(), scale.data(), qsum.data()};
  std::vector<uint8_t> laid(rows * groups * kQ8RowBytes);  // pass p's layout starts at row0 * groups * kQ8RowBytes
  for (const auto& [row0, count] : split_passes(rows, pass_rows))
    lay_out_pass(quantized, kind, k, row0, count, laid.data() + row0 * groups * kQ8RowBytes);
  const uint8_t* wp = wc.data_ptr<uint8_t>();
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  for_each_pass(rows, blocks, pass_rows, [&](int64_t nb, int64_t row0, int count) {
    pick(kind, count)(laid.data() + row0 * groups * kQ8RowBytes, wp, nb, groups, yp + row0 * n, n);
  });
}

}  // namespace
