// y = x @ W^T for bf16 x [M, K] and the tile-order records of amx_grouped.cpp (int4, int6, int8) on CPUs with AVX2
// but no AVX-512, with the activations quantised to int8 per row and group of 32 inputs, as llama.cpp's dot products
// do on such CPUs: weight format auto-q8act there (the float path is records_avx2.cpp).
//
// Why: `vpmaddubsw` multiplies 32 unsigned weight bytes by 32 signed activation bytes into 16 int16 pair sums in one
// instruction, so a few rows (verification, batches) cost less arithmetic than float32 FMAs on expanded weights.
//
// The arithmetic is records_dpbf16.cpp's int8-activation kernel to the bit: the same quantisation (scale
// max|x| / 127, round to nearest even), exact integer sums per group, then the same float32 operations in the same
// order, so a CPU with AVX512-VNNI gives the same outputs from either kernel. The records are read in their own
// order: each 32-byte chunk holds, per output, a 16-bit word of an input pair or quad; two such words per output are
// unpacked into one 32-bit lane of four inputs (`quads`), so each activation quad is broadcast once per row.
//   int4: word = inputs (4u, 4u+1) in the low nibbles, (4u+2, 4u+3) in the high ones, values 0..15
//   int6: as int4 (low 4 bits) plus two high bits per input from the pair chunk, values 0..63
//   int8: two words per input quad, signed bytes: |q| times the activation with q's sign (vpmaddubsw is
//         unsigned x signed; |q| <= 128 and |x| <= 127 keep each pair sum within int16)
// Pair sums are added in int16 while they cannot overflow (int4: the whole record, int6: 2, int8: none), then widened.
//
// Compiled through function attributes whatever the build's flags; runs where `avx2_records_available()`.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "records.h"

namespace {

constexpr int kPassRows = 4;         // activation rows per pass: their 8 sums fit the 16 registers (GCC spills at 5)
constexpr int kPrefetchAhead = 6;    // records ahead in the stream

#if TS_AVX2

#define UNROLL _Pragma("GCC unroll 16")
// A loop over a record's chunks is kept a loop: unrolled, GCC computes every chunk's products before adding them
// up and spills the registers.
#define ONE_AT_A_TIME _Pragma("GCC unroll 1")

// Per row and group of 32 inputs: the int8 activations, their scale, the halves' int32 sums; the same values as
// records_dpbf16.cpp's quantize_rows.
TS_AVX2_TARGET void quantize_rows(const uint16_t* x, int64_t rows, int64_t k, int8_t* xq, float* scale,
                                  int32_t* qsum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < k / 32; ++g) {
      const uint16_t* p = x + r * k + g * 32;
      __m256 v[4];
      for (int j = 0; j < 4; ++j)
        v[j] = _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * j))), 16));
      __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                               _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, m);
      float top = lanes[0];
      for (int j = 1; j < 8; ++j) top = lanes[j] > top ? lanes[j] : top;
      const float a = top > 0.f ? top / 127.f : 1.f;
      const __m256 inv = _mm256_set1_ps(1.f / a);
      alignas(32) int32_t q[32];
      for (int j = 0; j < 4; ++j)
        _mm256_store_si256(reinterpret_cast<__m256i*>(q + 8 * j), _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv)));
      int32_t half[2] = {0, 0};
      for (int j = 0; j < 32; ++j) {
        const int32_t c = q[j] > 127 ? 127 : q[j] < -128 ? -128 : q[j];  // saturate as vpmovsdb does
        xq[r * k + g * 32 + j] = static_cast<int8_t>(c);
        half[j / 16] += q[j];  // the VNNI kernel sums the unsaturated int32 values
      }
      scale[r * (k / 32) + g] = a;
      qsum[(r * (k / 32) + g) * 2] = half[0];
      qsum[(r * (k / 32) + g) * 2 + 1] = half[1];
    }
}

// Row i's activation quad (inputs j .. j + 3) in every 32-bit lane: one broadcast load.
TS_AVX2_TARGET inline __m256i quad(const int8_t* xq, int64_t j) {
  int32_t v;
  std::memcpy(&v, xq + j, sizeof v);
  return _mm256_set1_epi32(v);
}

// Two chunks of words (per output: bytes of inputs (a, a + 1), then of (a + 2, a + 3)) as two registers whose 32-bit
// lanes hold one output's input quad: outputs (0-3, 8-11) in q[0], (4-7, 12-15) in q[1] (unpacking stays within
// 128-bit halves). vpmaddubsw against a broadcast activation quad then gives each output two pair sums in its lane,
// and vpmaddwd with ones their int32 sum. The weight-side unpacking is shared by all rows; per row and quad it is
// one broadcast and one vpmaddubsw per 8 outputs.
TS_AVX2_TARGET inline void quads(__m256i first, __m256i second, __m256i (&q)[2]) {
  q[0] = _mm256_unpacklo_epi16(first, second);
  q[1] = _mm256_unpackhi_epi16(first, second);
}

// One scale group (int4: 32 inputs, int6 and int8: 16) of one record against R rows: the exact integer sums of
// each row's int8 activations times the weights, in quads' output order (sum[i][0]: outputs 0-3, 8-11; sum[i][1]:
// 4-7, 12-15).
template <int KIND, int R>
TS_AVX2_TARGET inline void group_sums(const uint8_t* record, int h, const uint8_t* acts, __m256i (&sum)[R][2]) {
  using L = Q8Layout<R>;
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  if constexpr (KIND == kInt4) {
    // int16 pair sums over all 8 chunks: at most 8 * 2 * 15 * 128 = 30720 per lane half
    __m256i acc[R][2];
    UNROLL for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
    ONE_AT_A_TIME for (int u = 0; u < 8; ++u) {  // inputs 4u .. 4u + 3
      const __m256i w = load(record + 32 * u);
      __m256i q[2];
      quads(_mm256_and_si256(w, nibble), _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble), q);
      UNROLL for (int i = 0; i < R; ++i) {
        const __m256i x = quad(L::x(acts, i), 4 * u);
        UNROLL for (int e = 0; e < 2; ++e) acc[i][e] = _mm256_add_epi16(acc[i][e], _mm256_maddubs_epi16(q[e], x));
      }
    }
    UNROLL for (int i = 0; i < R; ++i)
      UNROLL for (int e = 0; e < 2; ++e) sum[i][e] = _mm256_madd_epi16(acc[i][e], ones);
  } else {
    UNROLL for (int i = 0; i < R; ++i) sum[i][0] = sum[i][1] = _mm256_setzero_si256();
    if constexpr (KIND == kInt6) {
      const __m256i top = _mm256_set1_epi8(0x30);
      ONE_AT_A_TIME for (int u = 2 * h; u < 2 * h + 2; ++u) {  // inputs 8u .. 8u + 7
        const __m256i n0 = load(record + 64 * u), n1 = load(record + 64 * u + 32), p = load(record + 256 + 32 * u);
        // words of input pairs (8u, 8u + 1) .. (8u + 6, 8u + 7): each input's two high bits (pair bits 0, 2, 4, 6 of
        // each byte: inputs 8u + (0, 2, 4, 6) in the low byte, 8u + (1, 3, 5, 7) in the high one) moved to bits 4-5
        const __m256i w[4] = {
            _mm256_or_si256(_mm256_and_si256(n0, nibble), _mm256_and_si256(_mm256_slli_epi16(p, 4), top)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(n0, 4), nibble),
                            _mm256_and_si256(_mm256_slli_epi16(p, 2), top)),
            _mm256_or_si256(_mm256_and_si256(n1, nibble), _mm256_and_si256(p, top)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(n1, 4), nibble),
                            _mm256_and_si256(_mm256_srli_epi16(p, 2), top))};
        __m256i lo[2], hi[2];  // input quads 8u .. 8u + 3 and 8u + 4 .. 8u + 7
        quads(w[0], w[1], lo);
        quads(w[2], w[3], hi);
        UNROLL for (int i = 0; i < R; ++i) {
          const __m256i xlo = quad(L::x(acts, i), 8 * u), xhi = quad(L::x(acts, i), 8 * u + 4);
          UNROLL for (int e = 0; e < 2; ++e)  // two pair sums of at most 2 * 63 * 127 each fit int16
            sum[i][e] = _mm256_add_epi32(
                sum[i][e], _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo[e], xlo),
                                                              _mm256_maddubs_epi16(hi[e], xhi)),
                                             ones));
        }
      }
    } else {
      ONE_AT_A_TIME for (int u = 4 * h; u < 4 * h + 4; ++u) {  // inputs 4u .. 4u + 3: chunks of (4u, 4u + 1), (4u + 2, 4u + 3)
        __m256i q[2];
        quads(load(record + 64 * u), load(record + 64 * u + 32), q);
        const __m256i magnitude[2] = {_mm256_abs_epi8(q[0]), _mm256_abs_epi8(q[1])};
        UNROLL for (int i = 0; i < R; ++i) {
          const __m256i x = quad(L::x(acts, i), 4 * u);
          UNROLL for (int e = 0; e < 2; ++e)  // |q| x with q's sign: a pair sum of at most 2 * 128 * 127
            sum[i][e] = _mm256_add_epi32(
                sum[i][e], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude[e], _mm256_sign_epi8(x, q[e])), ones));
        }
      }
    }
  }
}

// A record's 16 float16 scales or offsets in quads' output order: (0-3, 8-11), (4-7, 12-15)
TS_AVX2_TARGET inline void quad_order(const uint8_t* p, __m256 (&v)[2]) {
  __m256 lo, hi;
  halves(p, &lo, &hi);
  v[0] = _mm256_permute2f128_ps(lo, hi, 0x20);
  v[1] = _mm256_permute2f128_ps(lo, hi, 0x31);
}

// One record against R rows: out[16 i ..] (in quads' output order) += its contribution, as records_dpbf16.cpp's
// record_pass_q8 computes each output.
template <int KIND, int R>
TS_AVX2_TARGET inline void record_pass(const uint8_t* record, const uint8_t* acts, float* out) {
  using L = Q8Layout<R>;
  constexpr int kGroups = KIND == kInt4 ? 1 : 2;
  UNROLL for (int h = 0; h < kGroups; ++h) {
    __m256i sum[R][2];
    group_sums<KIND, R>(record, h, acts, sum);
    __m256 s[2], c[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    if constexpr (KIND == kInt4) {
      quad_order(record + 256, s);
      quad_order(record + 288, c);  // q s + z
    } else if constexpr (KIND == kInt6) {
      quad_order(record + 384 + 32 * h, s);
      c[0] = _mm256_mul_ps(_mm256_set1_ps(-32.f), s[0]);  // (u - 32) s
      c[1] = _mm256_mul_ps(_mm256_set1_ps(-32.f), s[1]);
    } else {
      quad_order(record + 512 + 32 * h, s);
    }
    UNROLL for (int i = 0; i < R; ++i) {
      const __m256 a = _mm256_broadcast_ss(L::scale(acts, i));
      UNROLL for (int e = 0; e < 2; ++e) {
        __m256 o = _mm256_load_ps(out + 16 * i + 8 * e);
        o = _mm256_fmadd_ps(_mm256_mul_ps(s[e], a), _mm256_cvtepi32_ps(sum[i][e]), o);
        if constexpr (KIND != kInt8)
          o = _mm256_fmadd_ps(c[e], _mm256_broadcast_ss(reinterpret_cast<const float*>(L::offset(acts, i, h))), o);
        _mm256_store_ps(out + 16 * i + 8 * e, o);
      }
    }
  }
}

// Output block nb over all K for R rows: one sequential stream of records, which the prefetchers follow.
template <int KIND, int R>
TS_AVX2_TARGET void block_pass(const uint8_t* acts, const uint8_t* w, int64_t nb, int64_t groups, uint16_t* y,
                               int64_t n) {
  constexpr int64_t kBytes = kRecordBytes[KIND];
  alignas(32) float sums[R * kTileN] = {};
  const uint8_t* stream = w + nb * groups * kBytes;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* record = stream + g * kBytes;
    for (int64_t line = 0; line < kBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(record + kPrefetchAhead * kBytes + line), _MM_HINT_T0);
    record_pass<KIND, R>(record, acts + g * Q8Layout<R>::kStride, sums);
  }
  UNROLL for (int i = 0; i < R; ++i) {  // (0-3, 8-11), (4-7, 12-15) -> 0-7, 8-15
    const __m256 a = _mm256_load_ps(sums + 16 * i), b = _mm256_load_ps(sums + 16 * i + 8);
    __m128i* dst = reinterpret_cast<__m128i*>(y + i * n + nb * kTileN);
    _mm_storeu_si128(dst, to_bf16(_mm256_permute2f128_ps(a, b, 0x20)));
    _mm_storeu_si128(dst + 1, to_bf16(_mm256_permute2f128_ps(a, b, 0x31)));
  }
}

template <int KIND, int R>
struct Q8Pass {
  static constexpr PassQ8Fn fn = &block_pass<KIND, R>;
};

#endif  // TS_AVX2

const char* const kNames[3] = {"avx2q8_int4_mm", "avx2q8_int6_mm", "avx2q8_int8_mm"};

at::Tensor records_avx2_q8_mm(const at::Tensor& x, const at::Tensor& w, int kind) {
  const char* name = kNames[kind];
  TORCH_CHECK(avx2_ready(), name, ": this CPU (or its kernel) does not offer AVX2, FMA and F16C");
  at::Tensor y = records_output(name, x, w, kind);
#if TS_AVX2
  run_q8_passes(x, w, kind, y, kPassRows, &quantize_rows, &pick_pass<PassQ8Fn, Q8Pass, kPassRows>);
#endif
  return y;
}

at::Tensor avx2q8_int4_mm(const at::Tensor& x, const at::Tensor& w) { return records_avx2_q8_mm(x, w, kInt4); }
at::Tensor avx2q8_int6_mm(const at::Tensor& x, const at::Tensor& w) { return records_avx2_q8_mm(x, w, kInt6); }
at::Tensor avx2q8_int8_mm(const at::Tensor& x, const at::Tensor& w) { return records_avx2_q8_mm(x, w, kInt8); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(turbospec, m) {
  m.def("avx2q8_int4_mm(Tensor x, Tensor w) -> Tensor");
  m.def("avx2q8_int6_mm(Tensor x, Tensor w) -> Tensor");
  m.def("avx2q8_int8_mm(Tensor x, Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(turbospec, CPU, m) {
  m.impl("avx2q8_int4_mm", &avx2q8_int4_mm);
  m.impl("avx2q8_int6_mm", &avx2q8_int6_mm);
  m.impl("avx2q8_int8_mm", &avx2q8_int8_mm);
}
