// y = x @ W^T for bf16 x [M, K] and the tile-order records of amx_grouped.cpp (int4, int6, int8) on CPUs with AVX2
// and FMA but neither AMX nor AVX512-BF16 (older AMD EPYC and Ryzen, Intel client parts): the activations stay as
// they are (widened to float32, exact), so this computes the file's model as the AMX and AVX512-BF16 kernels do.
//
// Why: without it the packed weights ran torch's int4 kernel, which measured slower on such CPUs than the dense bf16
// matmul, so the crossover kept most linears dense and a decode step of a 1.5B model read 2.6x the file's bytes.
// Here each record (16 outputs x 32 inputs) is read once per call; each 16-bit word of a chunk holds one output's
// nibbles for an input quad, so a shift and a mask give 8 outputs' weights for one input, converted to float32
// (exact) and multiplied by that input's broadcast activation in one FMA per row.
//
// Per group of inputs (int4: 32, int6 and int8: 16) P = sum of stored value times x, then
//   int4: y += s * P + z * sum x        int6: y += s * P - 32 s * sum x        int8: y += s * P
// (int4 values q = 0..15 for q s + z, int6 u = 0..63 for (u - 32) s, int8 q signed for q s), `sum x` the group's sum
// of activations, computed once per call. Each row's sums run in the same order (two chains per 8 outputs, inputs
// in turn) whatever the call's other rows, so a verification row's result is its decode step's bits.
//
// Compiled through function attributes whatever the build's flags; runs where `avx2_records_available()`
// (records.h: TURBOSPEC_NO_AVX2_RECORDS=1 says no). records_avx2_q8.cpp is the int8-activation variant.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "records.h"

namespace {

// activation rows per pass: their 4 float32 sums each fit the registers (int4 keeps its 4 shuffle controls there too)
constexpr int kPassRows = 3;
constexpr int kPassRowsInt4 = 2;
constexpr int kPrefetchAhead = 6;   // records ahead in the stream
constexpr int kGroupInputs[3] = {32, 16, 16};

#if TS_AVX2

#define UNROLL _Pragma("GCC unroll 16")

// 8 outputs' stored values for one input: (word >> shift) & mask, as exact floats (int8: sign-extended byte)
template <int KIND, int SHIFT>
TS_AVX2_TARGET inline __m256 value(__m256i words) {
  if constexpr (KIND == kInt8) {  // signed byte at bits SHIFT .. SHIFT + 7 of a zero-extended word
    return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(words, 24 - SHIFT), 24));
  } else {
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(words, SHIFT), _mm256_set1_epi32(0xF)));
  }
}

// int6: an input's two high bits (at bit B of its pair word) moved to bits 4-5
template <int B>
TS_AVX2_TARGET inline __m256i high_bits(__m256i pairs) {
  const __m256i moved = B >= 4 ? _mm256_srli_epi32(pairs, B - 4) : _mm256_slli_epi32(pairs, 4 - B);
  return _mm256_and_si256(moved, _mm256_set1_epi32(0x30));
}

// int6: input j of an 8-input chunk (low nibbles in words n[0], n[1]; high bits in `pairs`), as exact floats
template <int J>
TS_AVX2_TARGET inline __m256 value6(const __m256i (&n)[2], __m256i pairs) {
  constexpr int kShift[4] = {0, 8, 4, 12};
  constexpr int kHigh[8] = {0, 8, 2, 10, 4, 12, 6, 14};  // pair bits of inputs 8u + j
  const __m256i low = _mm256_and_si256(_mm256_srli_epi32(n[J / 4], kShift[J % 4]), _mm256_set1_epi32(0xF));
  return _mm256_cvtepi32_ps(_mm256_or_si256(low, high_bits<kHigh[J]>(pairs)));
}

TS_AVX2_TARGET inline __m256i words(const uint8_t* p) {
  return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// acc[i][e][c] += w * x[i][input]: rows i, the half e of the outputs, chain c
template <int R>
TS_AVX2_TARGET inline void fma_rows(__m256 w, const float* x, int64_t x_stride, int input, int e, int c,
                                    __m256 (&acc)[R][2][2]) {
  UNROLL for (int i = 0; i < R; ++i)
    acc[i][e][c] = _mm256_fmadd_ps(w, _mm256_broadcast_ss(x + i * x_stride + input), acc[i][e][c]);
}

// One record against R rows: out[16 i ..] += its contribution. x: row 0's float32 activations of this record,
// xsum: row 0's first group sum of this record (x_stride and xsum_stride between rows).
template <int KIND, int R>
TS_AVX2_TARGET inline void record_pass(const uint8_t* record, const float* x, int64_t x_stride, const float* xsum,
                                       int64_t xsum_stride, float* out) {
  constexpr int kGroups = KIND == kInt4 ? 1 : 2;
  UNROLL for (int h = 0; h < kGroups; ++h) {
    // both halves of the outputs at once: four FMA chains per row hide the FMA's latency for a single row
    __m256 acc[R][2][2];
    UNROLL for (int i = 0; i < R; ++i)
      UNROLL for (int e = 0; e < 2; ++e) acc[i][e][0] = acc[i][e][1] = _mm256_setzero_ps();
    UNROLL for (int e = 0; e < 2; ++e) {  // outputs 8e .. 8e + 7
      if constexpr (KIND == kInt4) {  // (int4_record_pass)
      } else if constexpr (KIND == kInt6) {  // chunk u: inputs 8u .. 8u + 7, nibbles as int4's in two words
        UNROLL for (int u = 2 * h; u < 2 * h + 2; ++u) {
          const __m256i n[2] = {words(record + 64 * u + 16 * e), words(record + 64 * u + 32 + 16 * e)};
          const __m256i pairs = words(record + 256 + 32 * u + 16 * e);
          fma_rows<R>(value6<0>(n, pairs), x, x_stride, 8 * u, e, 0, acc);
          fma_rows<R>(value6<1>(n, pairs), x, x_stride, 8 * u + 1, e, 1, acc);
          fma_rows<R>(value6<2>(n, pairs), x, x_stride, 8 * u + 2, e, 0, acc);
          fma_rows<R>(value6<3>(n, pairs), x, x_stride, 8 * u + 3, e, 1, acc);
          fma_rows<R>(value6<4>(n, pairs), x, x_stride, 8 * u + 4, e, 0, acc);
          fma_rows<R>(value6<5>(n, pairs), x, x_stride, 8 * u + 5, e, 1, acc);
          fma_rows<R>(value6<6>(n, pairs), x, x_stride, 8 * u + 6, e, 0, acc);
          fma_rows<R>(value6<7>(n, pairs), x, x_stride, 8 * u + 7, e, 1, acc);
        }
      } else {  // chunk pair u: inputs 4u, 4u + 1 (bytes of the first word), 4u + 2, 4u + 3 (of the second)
        UNROLL for (int u = 4 * h; u < 4 * h + 4; ++u) {
          const __m256i a = words(record + 64 * u + 16 * e), b = words(record + 64 * u + 32 + 16 * e);
          fma_rows<R>(value<KIND, 0>(a), x, x_stride, 4 * u, e, 0, acc);
          fma_rows<R>(value<KIND, 8>(a), x, x_stride, 4 * u + 1, e, 1, acc);
          fma_rows<R>(value<KIND, 0>(b), x, x_stride, 4 * u + 2, e, 0, acc);
          fma_rows<R>(value<KIND, 8>(b), x, x_stride, 4 * u + 3, e, 1, acc);
        }
      }
    }
    UNROLL for (int e = 0; e < 2; ++e) {
      const uint8_t* scales = record + (KIND == kInt4 ? 256 : KIND == kInt6 ? 384 + 32 * h : 512 + 32 * h);
      const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + 16 * e)));
      __m256 c = _mm256_setzero_ps();
      if constexpr (KIND == kInt6) c = _mm256_mul_ps(_mm256_set1_ps(-32.f), s);
      UNROLL for (int i = 0; i < R; ++i) {
        __m256 o = _mm256_load_ps(out + 16 * i + 8 * e);
        o = _mm256_fmadd_ps(s, _mm256_add_ps(acc[i][e][0], acc[i][e][1]), o);
        if constexpr (KIND == kInt6) o = _mm256_fmadd_ps(c, _mm256_set1_ps(xsum[i * xsum_stride + h]), o);
        _mm256_store_ps(out + 16 * i + 8 * e, o);
      }
    }
  }
}

// int4 (the bulk of a Q4_K_M model's bytes), one record against R rows. A chunk's byte pairs hold each output's input
// quad as nibbles, so two masks give a plane of (4u, 4u + 1) and one of (4u + 2, 4u + 3); `vpshufb` moves one
// nibble per output into bits 16-19 of a 32-bit lane, and the exponent bits 0x43000000 make that lane the float
// 128 + q exactly (no conversion instruction). Shuffles stay within 128-bit halves, so the sums hold outputs
// (0-3, 8-11) and (4-7, 12-15): `sums` keeps that order for the whole block (put right when stored). Per group:
//   y += s * sum (128 + q) x + (z - 128 s) * sum x
template <int R>
TS_AVX2_TARGET inline void int4_record_pass(const uint8_t* record, const float* x, int64_t x_stride, const float* xsum,
                                            int64_t xsum_stride, float* out) {
  const __m256i nibble = _mm256_set1_epi8(0x0F), exponent = _mm256_set1_epi32(0x43000000);
  // byte 2 of lane d takes byte 2d (+ 1: the pair's second input) of the half's first (e = 0) or last four outputs;
  // -128 zeroes a byte
  const __m256i ctrl[2][2] = {
      {_mm256_setr_epi8(-128, -128, 0, -128, -128, -128, 2, -128, -128, -128, 4, -128, -128, -128, 6, -128, -128, -128, 0, -128, -128, -128, 2, -128, -128, -128, 4, -128, -128, -128, 6, -128),
       _mm256_setr_epi8(-128, -128, 1, -128, -128, -128, 3, -128, -128, -128, 5, -128, -128, -128, 7, -128, -128, -128, 1, -128, -128, -128, 3, -128, -128, -128, 5, -128, -128, -128, 7, -128)},
      {_mm256_setr_epi8(-128, -128, 8, -128, -128, -128, 10, -128, -128, -128, 12, -128, -128, -128, 14, -128, -128, -128, 8, -128, -128, -128, 10, -128, -128, -128, 12, -128, -128, -128, 14, -128),
       _mm256_setr_epi8(-128, -128, 9, -128, -128, -128, 11, -128, -128, -128, 13, -128, -128, -128, 15, -128, -128, -128, 9, -128, -128, -128, 11, -128, -128, -128, 13, -128, -128, -128, 15, -128)}};
  __m256 acc[R][2][2];
  UNROLL for (int i = 0; i < R; ++i)
    UNROLL for (int e = 0; e < 2; ++e) acc[i][e][0] = acc[i][e][1] = _mm256_setzero_ps();
  UNROLL for (int u = 0; u < 8; ++u) {
    const __m256i v = load(record + 32 * u);
    const __m256i planes[2] = {_mm256_and_si256(v, nibble), _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble)};
    UNROLL for (int j = 0; j < 4; ++j)  // input 4u + j: plane j / 2, the pair's input j % 2
      UNROLL for (int e = 0; e < 2; ++e)
        fma_rows<R>(_mm256_castsi256_ps(_mm256_or_si256(_mm256_shuffle_epi8(planes[j / 2], ctrl[e][j % 2]), exponent)),
                    x, x_stride, 4 * u + j, e, j % 2, acc);
  }
  __m256 s_lo, s_hi, z_lo, z_hi;
  halves(record + 256, &s_lo, &s_hi);
  halves(record + 288, &z_lo, &z_hi);
  UNROLL for (int e = 0; e < 2; ++e) {  // e = 0: outputs 0-3, 8-11; e = 1: 4-7, 12-15
    const __m256 s = _mm256_permute2f128_ps(s_lo, s_hi, e ? 0x31 : 0x20);
    const __m256 c = _mm256_fnmadd_ps(_mm256_set1_ps(128.f), s, _mm256_permute2f128_ps(z_lo, z_hi, e ? 0x31 : 0x20));
    UNROLL for (int i = 0; i < R; ++i) {
      __m256 o = _mm256_load_ps(out + 16 * i + 8 * e);
      o = _mm256_fmadd_ps(s, _mm256_add_ps(acc[i][e][0], acc[i][e][1]), o);
      o = _mm256_fmadd_ps(c, _mm256_set1_ps(xsum[i * xsum_stride]), o);
      _mm256_store_ps(out + 16 * i + 8 * e, o);
    }
  }
}

// Output block nb over all K for R rows: one sequential stream of records, which the prefetchers follow.
template <int KIND, int R>
TS_AVX2_TARGET void block_pass(const float* x, int64_t k, const float* xsum, int64_t xsum_stride, const uint8_t* w,
                               int64_t nb, int64_t groups, uint16_t* y, int64_t n) {
  constexpr int64_t kBytes = kRecordBytes[KIND];
  constexpr int kGroupsPerRecord = KIND == kInt4 ? 1 : 2;
  alignas(32) float sums[R * kTileN] = {};
  const uint8_t* stream = w + nb * groups * kBytes;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* record = stream + g * kBytes;
    for (int64_t line = 0; line < kBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(record + kPrefetchAhead * kBytes + line), _MM_HINT_T0);
    if constexpr (KIND == kInt4)
      int4_record_pass<R>(record, x + g * kTileK, k, xsum + g, xsum_stride, sums);
    else
      record_pass<KIND, R>(record, x + g * kTileK, k, xsum + g * kGroupsPerRecord, xsum_stride, sums);
  }
  UNROLL for (int i = 0; i < R; ++i) {
    __m256 row[2] = {_mm256_load_ps(sums + 16 * i), _mm256_load_ps(sums + 16 * i + 8)};
    if constexpr (KIND == kInt4) {  // (0-3, 8-11), (4-7, 12-15) -> 0-7, 8-15
      const __m256 a = row[0], b = row[1];
      row[0] = _mm256_permute2f128_ps(a, b, 0x20);
      row[1] = _mm256_permute2f128_ps(a, b, 0x31);
    }
    UNROLL for (int e = 0; e < 2; ++e)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i * n + nb * kTileN + 8 * e), to_bf16(row[e]));
  }
}

using PassFn = void (*)(const float*, int64_t, const float*, int64_t, const uint8_t*, int64_t, int64_t, uint16_t*,
                        int64_t);

template <int KIND, int R>
struct FloatPass {
  static constexpr PassFn fn = &block_pass<KIND, R>;
};

// bf16 rows -> float32 (exact), and per row and group the float32 sum of the group's activations in a fixed order
TS_AVX2_TARGET void widen_rows(const uint16_t* x, int64_t rows, int64_t k, int64_t group, float* xf, float* xsum) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < k / group; ++g) {
      __m256 sum = _mm256_setzero_ps();
      for (int64_t j = 0; j < group; j += 8) {
        const int64_t at = r * k + g * group + j;
        const __m256 v = _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + at))), 16));
        _mm256_storeu_ps(xf + at, v);
        sum = _mm256_add_ps(sum, v);
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, sum);
      xsum[r * (k / group) + g] = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
                                  ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    }
}

#endif  // TS_AVX2

const char* const kNames[3] = {"avx2_int4_mm", "avx2_int6_mm", "avx2_int8_mm"};

at::Tensor records_avx2_mm(const at::Tensor& x_in, const at::Tensor& w, int kind) {
  const char* name = kNames[kind];
  TORCH_CHECK(avx2_ready(), name, ": this CPU (or its kernel) does not offer AVX2, FMA and F16C");
  at::Tensor y = records_output(name, x_in, w, kind);
  const int64_t rows = x_in.size(0), k = x_in.size(1), blocks = w.size(0), groups = w.size(1), n = blocks * kTileN;
  if (rows == 0) return y;
#if TS_AVX2
  const at::Tensor x = x_in.contiguous(), wc = w.contiguous();
  const int64_t group = kGroupInputs[kind], xsum_stride = k / group;
  std::vector<float> xf(rows * k), xsum(rows * xsum_stride);
  widen_rows(reinterpret_cast<const uint16_t*>(x.data_ptr()), rows, k, group, xf.data(), xsum.data());
  const uint8_t* wp = wc.data_ptr<uint8_t>();
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  for_each_pass(rows, blocks, kind == kInt4 ? kPassRowsInt4 : kPassRows, [&](int64_t nb, int64_t row0, int count) {
    pick_pass<PassFn, FloatPass, kPassRows>(kind, count)(xf.data() + row0 * k, k, xsum.data() + row0 * xsum_stride,
                                                         xsum_stride, wp, nb, groups, yp + row0 * n, n);
  });
#endif
  return y;
}

at::Tensor avx2_int4_mm(const at::Tensor& x, const at::Tensor& w) { return records_avx2_mm(x, w, kInt4); }
at::Tensor avx2_int6_mm(const at::Tensor& x, const at::Tensor& w) { return records_avx2_mm(x, w, kInt6); }
at::Tensor avx2_int8_mm(const at::Tensor& x, const at::Tensor& w) { return records_avx2_mm(x, w, kInt8); }

bool avx2_records_available() { return avx2_ready(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(turbospec, m) {
  m.def("avx2_records_available() -> bool");
  m.def("avx2_int4_mm(Tensor x, Tensor w) -> Tensor");
  m.def("avx2_int6_mm(Tensor x, Tensor w) -> Tensor");
  m.def("avx2_int8_mm(Tensor x, Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(turbospec, CPU, m) {
  m.impl("avx2_int4_mm", &avx2_int4_mm);
  m.impl("avx2_int6_mm", &avx2_int6_mm);
  m.impl("avx2_int8_mm", &avx2_int8_mm);
}

TORCH_LIBRARY_IMPL(turbospec, CatchAll, m) { m.impl("avx2_records_available", &avx2_records_available); }
