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
#include <cstring>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#define TS_DP 1
#include <immintrin.h>
#define TS_DP_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,f16c")))
#endif

#include "records.h"

namespace {

constexpr int kUnitRows[3] = {2, 4, 1};    // tile rows expanded together (one load of packed bytes)
constexpr int kScaleGroups[3] = {1, 2, 2};  // per record: int4 one group of 32 inputs, the others two of 16
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
// records of four blocks, as four streams, ran at half the speed on a Zen 4: 13 against 24 GB/s on one core, ad hoc).
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

template <int KIND, int R>
struct FloatPass {
  static constexpr PassFn fn = &block_pass<KIND, R>;
};


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

// ---- Activations in int8 (weight format auto-q8act): `vpdpbusd` multiplies 4 unsigned weight bytes by 4 signed
// activation bytes into one int32 lane, 64 products per instruction (vdpbf16ps: 32), so a few rows cost less
// arithmetic; llama.cpp's dot products work this way. Activations are quantised per row and group of 32 inputs to
// int8 with the scale max|x| / 127, a lossy step of its own: the float path above stays the default.
//
// A lane holds one output's 4 consecutive inputs. From the tile-order records (a 16-bit word per output and tile-
// row pair): int4 chunk c gives inputs 4c .. 4c + 3 as (w | w << 12) & 0x0F0F0F0F of the zero-extended word;
// int6 adds the two high bits from its pair chunk; int8 joins the words of rows 2c and 2c + 1 and flips the sign
// bit (q + 128, unsigned), corrected by 128 * sum of the group's quantised activations.

#define TS_VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c")))

bool vnni_ready() {
  static const bool ready = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
                            __builtin_cpu_supports("f16c") && std::getenv("TURBOSPEC_NO_VNNI") == nullptr;
  return ready;
}

TS_VNNI_TARGET inline __m512 halves_as_floats(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 16 floats to bf16, rounded to nearest even (integer arithmetic: VNNI CPUs may lack AVX512-BF16; no NaN here)
TS_VNNI_TARGET inline void store_bf16(uint16_t* p, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}

TS_VNNI_TARGET inline __m512i words_as_dwords(const uint8_t* p) {
  return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Lanes of unit u (int4: inputs 4u .. 4u + 3; int6: 8u .. 8u + 7 as two lanes; int8: 4u .. 4u + 3).
template <int KIND>
TS_VNNI_TARGET inline void quad_lanes(const uint8_t* record, int u, __m512i* lanes) {
  const __m512i nibbles = _mm512_set1_epi32(0x0F0F0F0F);
  if constexpr (KIND == kInt4) {
    const __m512i w = words_as_dwords(record + 32 * u);
    lanes[0] = _mm512_ternarylogic_epi32(w, _mm512_slli_epi32(w, 12), nibbles, 0xA8);  // (A | B) & C
  } else if constexpr (KIND == kInt6) {
    const __m512i n0 = words_as_dwords(record + 64 * u), n1 = words_as_dwords(record + 64 * u + 32);
    const __m512i pairs = words_as_dwords(record + 256 + 32 * u);
    const __m512i high = _mm512_set1_epi32(0x30303030), low_half = _mm512_set1_epi32(0x0000FFFF);
    // high bits of inputs 8u + (0, 1, 2, 3) sit at pair bits (0, 8, 2, 10), of 8u + (4 .. 7) at (4, 12, 6, 14)
    const __m512i hi_a = _mm512_ternarylogic_epi32(low_half, _mm512_slli_epi32(pairs, 4), _mm512_slli_epi32(pairs, 18),
                                                   0xCA);  // A ? B : C, bitwise
    const __m512i hi_b = _mm512_ternarylogic_epi32(low_half, pairs, _mm512_slli_epi32(pairs, 14), 0xCA);
    const __m512i lo_a = _mm512_ternarylogic_epi32(n0, _mm512_slli_epi32(n0, 12), nibbles, 0xA8);
    const __m512i lo_b = _mm512_ternarylogic_epi32(n1, _mm512_slli_epi32(n1, 12), nibbles, 0xA8);
    lanes[0] = _mm512_ternarylogic_epi32(lo_a, hi_a, high, 0xF8);  // A | (B & C)
    lanes[1] = _mm512_ternarylogic_epi32(lo_b, hi_b, high, 0xF8);
  } else {
    const __m512i a = words_as_dwords(record + 64 * u), b = words_as_dwords(record + 64 * u + 32);
    lanes[0] = _mm512_ternarylogic_epi32(a, _mm512_slli_epi32(b, 16), _mm512_set1_epi32(0x80808080), 0x56);  // (A|B)^C
  }
}

// Per row and group of 32 inputs: the int8 activations (round to nearest), their scale, the halves' int32 sums.
TS_VNNI_TARGET void quantize_rows(const uint16_t* x, int64_t rows, int64_t k, int8_t* xq, float* scale,
                                  int32_t* qsum) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < k / 32; ++g) {
      const uint16_t* p = x + r * k + g * 32;
      const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
      const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16))), 16));
      const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const float a = top > 0.f ? top / 127.f : 1.f;
      const __m512 inv = _mm512_set1_ps(1.f / a);
      const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + (r * k + g * 32)), _mm512_cvtsepi32_epi8(qlo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + (r * k + g * 32 + 16)), _mm512_cvtsepi32_epi8(qhi));
      scale[r * (k / 32) + g] = a;
      qsum[(r * (k / 32) + g) * 2] = _mm512_reduce_add_epi32(qlo);
      qsum[(r * (k / 32) + g) * 2 + 1] = _mm512_reduce_add_epi32(qhi);
    }
}

// One record against R rows: out[16 i ..] += its contribution. `acts`: this record's group of the pass's activations
// (Q8Layout<R>). The offsets meet the quantised activations' sums too, so a row's result is the exact dot product of
// its int8 activations with the file's weights, times the scales.
template <int KIND, int R>
TS_VNNI_TARGET inline void record_pass_q8(const uint8_t* record, const uint8_t* acts, float* out) {
  using L = Q8Layout<R>;
  constexpr int kGroups = kScaleGroups[KIND];
  constexpr int kUnits = KIND == kInt6 ? 4 : 8, kGroupUnits = kUnits / kGroups, kLanes = KIND == kInt6 ? 2 : 1;
  UNROLL for (int h = 0; h < kGroups; ++h) {
    // integer sums are exact in any order: two chains per row hide vpdpbusd's latency for up to 3 rows, one does
    // from 4 (the 16 rows of a pass then fit the registers)
    constexpr int kChains = R >= 4 ? 1 : 2;
    __m512i part[R][kChains];
    UNROLL for (int i = 0; i < R; ++i)
      UNROLL for (int c = 0; c < kChains; ++c) part[i][c] = _mm512_setzero_si512();
    UNROLL for (int u = h * kGroupUnits; u < (h + 1) * kGroupUnits; ++u) {
      __m512i lanes[kLanes];
      quad_lanes<KIND>(record, u, lanes);
      UNROLL for (int j = 0; j < kLanes; ++j) {
        const int quad = u * kLanes + j;  // inputs 4 quad .. 4 quad + 3
        UNROLL for (int i = 0; i < R; ++i) {
          int32_t xv;
          std::memcpy(&xv, L::x(acts, i) + 4 * quad, sizeof xv);
          part[i][quad % kChains] = _mm512_dpbusd_epi32(part[i][quad % kChains], lanes[j], _mm512_set1_epi32(xv));
        }
      }
    }
    __m512 s, c = _mm512_setzero_ps();
    if constexpr (KIND == kInt4) {
      s = halves_as_floats(record + 256);
      c = halves_as_floats(record + 288);  // q s + z
    } else if constexpr (KIND == kInt6) {
      s = halves_as_floats(record + 384 + 32 * h);
      c = _mm512_mul_ps(_mm512_set1_ps(-32.f), s);  // (u - 32) s
    } else {
      s = halves_as_floats(record + 512 + 32 * h);  // (u - 128) s, u = q + 128
    }
    UNROLL for (int i = 0; i < R; ++i) {
      __m512i sum = part[i][0];
      if constexpr (kChains == 2) sum = _mm512_add_epi32(sum, part[i][1]);
      const uint8_t* offset = L::offset(acts, i, h);
      if constexpr (KIND == kInt8) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(offset)));
      __m512 o = _mm512_load_ps(out + 16 * i);
      o = _mm512_fmadd_ps(_mm512_mul_ps(s, _mm512_set1_ps(*L::scale(acts, i))), _mm512_cvtepi32_ps(sum), o);
      if constexpr (KIND != kInt8) o = _mm512_fmadd_ps(c, _mm512_set1_ps(*reinterpret_cast<const float*>(offset)), o);
      _mm512_store_ps(out + 16 * i, o);
    }
  }
}

template <int KIND, int R>
TS_VNNI_TARGET void block_pass_q8(const uint8_t* acts, const uint8_t* w, int64_t nb, int64_t groups, uint16_t* y,
                                  int64_t n) {
  constexpr int64_t kBytes = kRecordBytes[KIND];
  alignas(64) float sums[R * kTileN] = {};
  const uint8_t* stream = w + nb * groups * kBytes;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* record = stream + g * kBytes;
    for (int64_t line = 0; line < kBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(record + kPrefetchAhead * kBytes + line), _MM_HINT_T0);
    record_pass_q8<KIND, R>(record, acts + g * Q8Layout<R>::kStride, sums);
  }
  UNROLL for (int i = 0; i < R; ++i) store_bf16(y + i * n + nb * kTileN, _mm512_load_ps(sums + 16 * i));
}

constexpr int kPassRowsQ8 = 16;  // rows per pass of the int8-activation kernel (one int32 sum per row from 4 rows)

template <int KIND, int R>
struct Q8Pass {
  static constexpr PassQ8Fn fn = &block_pass_q8<KIND, R>;
};

#endif  // TS_DP

const char* const kNames[3] = {"dpbf16_int4_mm", "dpbf16_int6_mm", "dpbf16_int8_mm"};

at::Tensor records_mm(const at::Tensor& x_in, const at::Tensor& w, int kind) {
  const char* name = kNames[kind];
  TORCH_CHECK(dp_ready(), name, ": this CPU (or its kernel) does not offer AVX512-BF16");
  at::Tensor y = records_output(name, x_in, w, kind);
  const int64_t rows = x_in.size(0), k = x_in.size(1), blocks = w.size(0), groups = w.size(1), n = blocks * kTileN;
  if (rows == 0) return y;
#if TS_DP
  const at::Tensor x = x_in.contiguous(), wc = w.contiguous();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const uint8_t* wp = wc.data_ptr<uint8_t>();
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t group = kind == kInt4 ? 32 : 16, xsum_stride = k / group;
  std::vector<float> xsum(kind == kInt8 ? 0 : rows * xsum_stride);
  if (kind != kInt8) group_sums(xp, rows, k, group, xsum.data());
  for_each_pass(rows, blocks, kPassRows, [&](int64_t nb, int64_t row0, int count) {
    const float* sums = xsum.empty() ? nullptr : xsum.data() + row0 * xsum_stride;
    pick_pass<PassFn, FloatPass, kPassRows>(kind, count)(xp + row0 * k, k, sums, xsum_stride, wp, nb, groups,
                                                         yp + row0 * n, n);
  });
#endif
  return y;
}

const char* const kQ8Names[3] = {"q8_int4_mm", "q8_int6_mm", "q8_int8_mm"};

at::Tensor records_q8_mm(const at::Tensor& x, const at::Tensor& w, int kind) {
  const char* name = kQ8Names[kind];
#if TS_DP
  TORCH_CHECK(vnni_ready(), name, ": this CPU does not offer AVX512-VNNI");
#else
  TORCH_CHECK(false, name, ": this CPU does not offer AVX512-VNNI");
#endif
  at::Tensor y = records_output(name, x, w, kind);
#if TS_DP
  run_q8_passes(x, w, kind, y, kPassRowsQ8, &quantize_rows, &pick_pass<PassQ8Fn, Q8Pass, kPassRowsQ8>);
#endif
  return y;
}

at::Tensor q8_int4_mm(const at::Tensor& x, const at::Tensor& w) { return records_q8_mm(x, w, kInt4); }
at::Tensor q8_int6_mm(const at::Tensor& x, const at::Tensor& w) { return records_q8_mm(x, w, kInt6); }
at::Tensor q8_int8_mm(const at::Tensor& x, const at::Tensor& w) { return records_q8_mm(x, w, kInt8); }

bool q8_records_available() {
#if TS_DP
  return vnni_ready();
#else
  return false;
#endif
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
  m.def("q8_records_available() -> bool");
  m.def("q8_int4_mm(Tensor x, Tensor w) -> Tensor");
  m.def("q8_int6_mm(Tensor x, Tensor w) -> Tensor");
  m.def("q8_int8_mm(Tensor x, Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(turbospec, CPU, m) {
  m.impl("dpbf16_int4_mm", &dpbf16_int4_mm);
  m.impl("dpbf16_int6_mm", &dpbf16_int6_mm);
  m.impl("dpbf16_int8_mm", &dpbf16_int8_mm);
  m.impl("q8_int4_mm", &q8_int4_mm);
  m.impl("q8_int6_mm", &q8_int6_mm);
  m.impl("q8_int8_mm", &q8_int8_mm);
}

TORCH_LIBRARY_IMPL(turbospec, CatchAll, m) {
  m.impl("dpbf16_records_available", &dpbf16_records_available);
  m.impl("q8_records_available", &q8_records_available);
}
