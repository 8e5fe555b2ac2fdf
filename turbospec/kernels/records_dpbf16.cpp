// y = x @ W^T for bf16 x [M, K] and grouped low-bit W in the tile-order records of amx_grouped.cpp (int4, int6,
// int8), on CPUs with AVX512-BF16 but no AMX (AMD Zen 4 / Zen 5, Intel Cooper Lake).
//
// Why: without AMX the packed weights ran torch's int4 kernel and our int8 kernel, whose arithmetic per weight is
// several instructions and grows with the rows: a decode step ran at about half the machine's streaming bandwidth
// and a 9-row verification cost several decode steps. Here each record (16 outputs x 32 inputs) is read once per
// call, expanded to bf16 in registers with one or two bit operations per 32 weights, and each expanded tile row
// (16 outputs x one input pair) meets the broadcast input pair of every activation row in one `vdpbf16ps`: 32
// multiply-adds per instruction, the weights never leave registers, so one row runs at memory speed and a few
// rows cost little more than one.
//
// The values are the records' own: int4 is 128 + q and int6 128 + u as bf16 (the bits 0x4300 | q are exactly
// 128 + q), int8 is q itself (any signed byte is exact in bf16); float32 sums per group are then scaled and the
// offset corrected as in amx_grouped.cpp:
//   int4: y += s * P + (z - 128 s) * sum x       int6: y += s * P - 160 s * sum x       int8: y += s * P
// with P the group's dot product and `sum x` the group's sum of activations (computed once per call).
//
// Each output of each row is summed by the same operations in the same order whatever the number of rows, how
// rows are split into passes, or how outputs are split between threads: tile rows alternate between two partial
// sums, added at the end of each scale group, then groups are added in input order. So a row's result does not
// depend on the other rows of the call (verifying k + 1 tokens gives the decode step's values for each).
//
// Compiled through function attributes whatever the build's flags; `dpbf16_records_available()` says whether this
// CPU runs it (TURBOSPEC_NO_DPBF16=1 says no, to measure the other paths on such a CPU).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#define TS_DP 1
#include <immintrin.h>
#define TS_DP_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,f16c")))
#endif

namespace {

enum Kind { kInt4 = 0, kInt6 = 1, kInt8 = 2 };
constexpr int64_t kRecordBytes[3] = {320, 448, 576};
constexpr int kUnitRows[3] = {2, 4, 1};    // tile rows expanded together (one load of packed bytes)
constexpr int kScaleGroups[3] = {1, 2, 2};  // per record: int4 one group of 32 inputs, the others two of 16
constexpr int64_t kTileN = 16;              // outputs per record
constexpr int64_t kTileK = 32;              // inputs per record
constexpr int kPassRows = 8;                // activation rows whose partial sums are live at once
constexpr int kPrefetchAhead = 6;           // records ahead in each stream

bool dp_ready() {
#if TS_DP
  static const bool ready = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
                            __builtin_cpu_supports("f16c") && std::getenv("TURBOSPEC_NO_DPBF16") == nullptr;
  return ready;
#else
  return false;
#endif
}

#if TS_DP

#define UNROLL _Pragma("GCC unroll 16")

TS_DP_TARGET inline __m512i bytes_as_words(const uint8_t* p) {
  return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

TS_DP_TARGET inline __m512 half_floats(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Unit u of a record as bf16 tile rows u * kUnitRows .. (each 16 outputs x an input pair, interleaved).
template <int KIND>
TS_DP_TARGET inline void expand_unit(const uint8_t* record, int u, __m512i* rows) {
  const __m512i bias = _mm512_set1_epi16(0x4300), low = _mm512_set1_epi16(0x000F);
  if constexpr (KIND == kInt4) {  // byte j of chunk u: element j of rows 2u (low nibble) and 2u + 1 (high)
    const __m512i w = bytes_as_words(record + 32 * u);
    rows[0] = _mm512_ternarylogic_epi32(w, low, bias, 0xEA);  // (w & 15) | bias
    rows[1] = _mm512_or_si512(_mm512_srli_epi16(w, 4), bias);
  } else if constexpr (KIND == kInt6) {  // rows 4u .. 4u + 3: two nibble chunks and one chunk of 2-bit pairs
    const __m512i two_bits = _mm512_set1_epi16(0x0030);
    const __m512i high = bytes_as_words(record + 256 + 32 * u);
    const __m512i n0 = bytes_as_words(record + 64 * u), n1 = bytes_as_words(record + 64 * u + 32);
    const __m512i h0 = _mm512_ternarylogic_epi32(_mm512_slli_epi16(high, 4), two_bits, bias, 0xEA);
    const __m512i h1 = _mm512_ternarylogic_epi32(_mm512_slli_epi16(high, 2), two_bits, bias, 0xEA);
    const __m512i h2 = _mm512_ternarylogic_epi32(high, two_bits, bias, 0xEA);
    const __m512i h3 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(high, 2), two_bits, bias, 0xEA);
    rows[0] = _mm512_ternarylogic_epi32(n0, low, h0, 0xEA);
    rows[1] = _mm512_or_si512(_mm512_srli_epi16(n0, 4), h1);
    rows[2] = _mm512_ternarylogic_epi32(n1, low, h2, 0xEA);
    rows[3] = _mm512_or_si512(_mm512_srli_epi16(n1, 4), h3);
  } else {  // row u: 32 signed bytes, widened to float32 and narrowed to bf16 (exact)
    const int8_t* row = reinterpret_cast<const int8_t*>(record) + 32 * u;
    const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row))));
    const __m512 b =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16))));
    rows[0] = (__m512i)_mm512_cvtne2ps_pbh(b, a);
  }
}

// One record against R activation rows: out[16 i ..] += the record's contribution for row i. `pairs` is row 0's
// first input pair of this record (x as uint32 bf16 pairs), `xsum` row 0's first group sum of this record.
template <int KIND, int R>
TS_DP_TARGET inline void record_pass(const uint8_t* record, const uint32_t* pairs, int64_t pair_stride,
                                     const float* xsum, int64_t xsum_stride, float* out) {
  constexpr int kRows = kUnitRows[KIND], kGroups = kScaleGroups[KIND], kUnits = 16 / kRows;
  constexpr int kGroupUnits = kUnits / kGroups;
  UNROLL for (int h = 0; h < kGroups; ++h) {
    __m512 part[R][2];  // two partial sums per row, tile rows taken in turn: R x 2 chains of vdpbf16ps in flight
    UNROLL for (int i = 0; i < R; ++i) part[i][0] = part[i][1] = _mm512_setzero_ps();
    UNROLL for (int u = h * kGroupUnits; u < (h + 1) * kGroupUnits; ++u) {
      __m512i rows[kRows];
      expand_unit<KIND>(record, u, rows);
      UNROLL for (int j = 0; j < kRows; ++j) {
        const int r = u * kRows + j;
        UNROLL for (int i = 0; i < R; ++i) {
          const __m512bh xp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[i * pair_stride + r]));
          part[i][r & 1] = _mm512_dpbf16_ps(part[i][r & 1], (__m512bh)rows[j], xp);
        }
      }
    }
    __m512 s, c = _mm512_setzero_ps();
    if constexpr (KIND == kInt4) {
      s = half_floats(record + 256);
      c = _mm512_fmadd_ps(_mm512_set1_ps(-128.f), s, half_floats(record + 288));  // z - 128 s
    } else if constexpr (KIND == kInt6) {
      s = half_floats(record + 384 + 32 * h);
      c = _mm512_mul_ps(_mm512_set1_ps(-160.f), s);  // (u - 32) s = (128 + u) s - 160 s
    } else {
      s = half_floats(record + 512 + 32 * h);
    }
    UNROLL for (int i = 0; i < R; ++i) {
      __m512 o = _mm512_load_ps(out + 16 * i);
      o = _mm512_fmadd_ps(s, _mm512_add_ps(part[i][0], part[i][1]), o);
      if constexpr (KIND != kInt8) o = _mm512_fmadd_ps(c, _mm512_set1_ps(xsum[i * xsum_stride + h]), o);
      _mm512_store_ps(out + 16 * i, o);
    }
  }
}

// Output block nb over all K, for R activation rows starting at x; y rows in bf16. One block at a time: each
// thread then reads one sequential stream of records, which the hardware prefetchers follow (interleaving the
// records of four blocks, as four streams, ran at half the speed on a Zen 5: 13 against 24 GB/s on one core).
template <int KIND, int R>
TS_DP_TARGET void block_pass(const uint16_t* x, int64_t k, const float* xsum, int64_t xsum_stride,
                             const uint8_t* w, int64_t nb, int64_t groups, uint16_t* y, int64_t n) {
  constexpr int64_t kBytes = kRecordBytes[KIND];
  alignas(64) float sums[R * kTileN] = {};
  const uint8_t* stream = w + nb * groups * kBytes;
  const uint32_t* pairs = reinterpret_cast<const uint32_t*>(x);  // pair p: inputs 2p, 2p + 1
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* record = stream + g * kBytes;
    // past the end this touches the next block (read soon after) or nothing: prefetches never fault
    for (int64_t line = 0; line < kBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(record + kPrefetchAhead * kBytes + line), _MM_HINT_T0);
    record_pass<KIND, R>(record, pairs + g * 16, k / 2, xsum == nullptr ? nullptr : xsum + g * kScaleGroups[KIND],
                         xsum_stride, sums);
  }
  UNROLL for (int i = 0; i < R; ++i)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i * n + nb * kTileN),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(sums + 16 * i)));
}

using PassFn = void (*)(const uint16_t*, int64_t, const float*, int64_t, const uint8_t*, int64_t, int64_t,
                        uint16_t*, int64_t);

template <int KIND, int... R>
PassFn pass_fn(int rows, std::integer_sequence<int, R...>) {
  static constexpr PassFn fns[] = {&block_pass<KIND, R + 1>...};
  return fns[rows - 1];
}

PassFn pick_pass(int kind, int rows) {
  const auto counts = std::make_integer_sequence<int, kPassRows>{};
  return kind == kInt4 ? pass_fn<kInt4>(rows, counts) : kind == kInt6 ? pass_fn<kInt6>(rows, counts)
                                                                       : pass_fn<kInt8>(rows, counts);
}

// Per row and group of `group` (16 or 32) inputs, the float32 sum of the bf16 activations, summed in a fixed order.
TS_DP_TARGET void group_sums(const uint16_t* x, int64_t rows, int64_t k, int64_t group, float* out) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < k / group; ++g) {
      const uint16_t* p = x + r * k + g * group;
      __m512 sum = _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
      if (group == 32)
        sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(
                                     _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16))),
                                     16)));
      out[r * (k / group) + g] = _mm512_reduce_add_ps(sum);
    }
}

#endif  // TS_DP

const char* const kNames[3] = {"dpbf16_int4_mm", "dpbf16_int6_mm", "dpbf16_int8_mm"};

at::Tensor records_mm(const at::Tensor& x_in, const at::Tensor& w, int kind) {
  const char* name = kNames[kind];
  TORCH_CHECK(dp_ready(), name, ": this CPU (or its kernel) does not offer AVX512-BF16");
  TORCH_CHECK(x_in.dim() == 2, name, ": x must be [M, K]");
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kByte && w.size(2) == kRecordBytes[kind], name,
              ": packed weight must be uint8 [N / 16, K / 32, ", kRecordBytes[kind], "]");
  const int64_t rows = x_in.size(0), k = x_in.size(1), blocks = w.size(0), groups = w.size(1), n = blocks * kTileN;
  TORCH_CHECK(k == groups * kTileK, name, ": x has ", k, " inputs, the weight ", groups * kTileK);
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16, name, ": activations must be bfloat16");
  at::Tensor y = at::empty({rows, n}, x_in.options());
  if (rows == 0) return y;
#if TS_DP
  const at::Tensor x = x_in.contiguous(), wc = w.contiguous();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const uint8_t* wp = wc.data_ptr<uint8_t>();
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t group = kind == kInt4 ? 32 : 16, xsum_stride = k / group;
  std::vector<float> xsum(kind == kInt8 ? 0 : rows * xsum_stride);
  if (kind != kInt8) group_sums(xp, rows, k, group, xsum.data());
  // rows in passes of at most kPassRows, as even as possible (9 rows: 4 + 5, each with enough sums in flight)
  const int64_t passes = (rows + kPassRows - 1) / kPassRows;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb)
      for (int64_t p = 0, row0 = 0; p < passes; ++p) {  // a block's later passes read its records from cache
        const int64_t count = (rows - row0) / (passes - p);
        const float* sums = xsum.empty() ? nullptr : xsum.data() + row0 * xsum_stride;
        pick_pass(kind, static_cast<int>(count))(xp + row0 * k, k, sums, xsum_stride, wp, nb, groups, yp + row0 * n, n);
        row0 += count;
      }
  });
#endif
  return y;
}

at::Tensor dpbf16_int4_mm(const at::Tensor& x, const at::Tensor& w) { return records_mm(x, w, kInt4); }
at::Tensor dpbf16_int6_mm(const at::Tensor& x, const at::Tensor& w) { return records_mm(x, w, kInt6); }
at::Tensor dpbf16_int8_mm(const at::Tensor& x, const at::Tensor& w) { return records_mm(x, w, kInt8); }

bool dpbf16_records_available() { return dp_ready(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(turbospec, m) {
  m.def("dpbf16_records_available() -> bool");
  m.def("dpbf16_int4_mm(Tensor x, Tensor w) -> Tensor");
  m.def("dpbf16_int6_mm(Tensor x, Tensor w) -> Tensor");
  m.def("dpbf16_int8_mm(Tensor x, Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(turbospec, CPU, m) {
  m.impl("dpbf16_int4_mm", &dpbf16_int4_mm);
  m.impl("dpbf16_int6_mm", &dpbf16_int6_mm);
  m.impl("dpbf16_int8_mm", &dpbf16_int8_mm);
}

TORCH_LIBRARY_IMPL(turbospec, CatchAll, m) { m.impl("dpbf16_records_available", &dpbf16_records_available); }
