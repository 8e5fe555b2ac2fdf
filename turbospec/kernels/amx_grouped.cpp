// Few-row products with grouped low-bit weights on Intel AMX: y = x @ W^T, x bf16 [M, K], W held in 4, 6 or 8 bits.
//
// Why: torch's int4 kernel and our AVX-512 int8 kernel read each weight once but their arithmetic grows with the
// rows, so verifying k + 1 tokens costs about k + 1 decode steps; bf16 on AMX is flat in rows but reads 2 bytes
// per weight. Here a 16 x 32 block of weights is expanded to bf16 in L1 and multiplied by up to 16 activation
// rows in one AMX instruction: memory traffic of the packed form, arithmetic nearly flat from 1 to 16 rows.
//
// int4 (value = q * s + z per 32 inputs, q in 0..15) and int6 (value = (u - 32) * s per 16 inputs, u in 0..63:
// Q6_K and Q5_0): the expansion is a few bit operations per weight, because the bf16 with bits 0x4300 | u is
// exactly 128 + u. A tile product P = sum_k x_k (128 + u_k) covers one group, so per group
//   int4: y += s * P + (z - 128 s) * sum_k x_k        int6: y += s * P - 160 s * sum_k x_k
// from the stored tile (P is float32: the offset costs 7 of its 24 bits).
// int8 (value = q * s per 16 inputs, any signed byte: Q8_0): each weight is expanded to bf16(q * s), the dense
// bf16 weight itself up to the scale's float16 rounding.
//
// Decode reads every weight once per token, so bytes decide the speed (about 13-16 GB/s on the 2-core Xeon this
// was written on): scales and offsets are float16 (the file's own for Q4_0 / Q4_1 / Q8_0 / Q5_0, rounded for the
// products d * sc of the K-quants) and sit next to their weights. Weights are re-laid out once
// (models/packed.py): per block of 16 outputs and 32 inputs, one record: the 512 weights in AMX's B-tile order
// (row r holds inputs 2r and 2r + 1 of the 16 outputs, interleaved), then the block's scales.
//   int4: 256 bytes of nibbles (byte j of chunk c: element j of rows 2c low, 2c + 1 high), 16 s, 16 z   (320 B)
//   int6: the low nibbles as int4, then 128 bytes of high 2-bit pairs (byte j of chunk c: element j of rows
//         4c + i in bits 2i, 2i + 1), then 16 s of inputs 0..15 and 16 of inputs 16..31               (448 B)
//   int8: 512 int8 values, 16 s of inputs 0..15, 16 of inputs 16..31                                  (576 B)

// Registered as torch operators (turbospec::amx_int4_mm, ...), so the profiler names them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#define TS_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "records.h"

namespace {

constexpr int64_t kMaxRows = 16;

#if TS_AMX

bool detect_amx() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool tile = d & (1u << 24), bf16 = d & (1u << 22);
  if (!tile || !bf16) return false;
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !(a & (1u << 5))) return false;  // AVX512-BF16
  // Linux hands out the tile state only on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
  return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

bool amx_ready() {
  static const bool ready = detect_amx();
  return ready;
}

#define TS_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))

// Tiles. int4 / int8 (one product per 32 inputs): tmm0 activations (rows x 32 bf16), tmm1..3 weights of three
// blocks, tmm4..7 products (the GEMM path uses all four). int6 (one product per 16 inputs): tmm0 / tmm1 activations of inputs 0..15 /
// 16..31 (rows x 16 bf16), tmm2 / tmm3 the weights of one block's halves (8 x 32 bf16), tmm4..7 the products of
// two blocks' halves.
TS_TARGET void configure_tiles(int rows, bool half_groups) {
  // the 64-byte palette-1 layout: byte 0 palette, bytes 16 + 2t the bytes per row of tile t, byte 48 + t its rows
  alignas(64) uint8_t cfg[64] = {};
  cfg[0] = 1;
  for (int t = 0; t < 8; ++t) {
    const bool activations = half_groups ? t <= 1 : t == 0, weights = half_groups ? (t == 2 || t == 3) : t <= 3;
    cfg[16 + 2 * t] = (half_groups && activations) ? 32 : 64;
    cfg[48 + t] = activations ? rows : weights ? (half_groups ? 8 : 16) : rows;
  }
  // gcc does not see the intrinsic read the buffer and dropped the stores above: make them happen first
  asm volatile("" : : "r"(cfg) : "memory");
  _tile_loadconfig(cfg);
}

constexpr int kPrefetchAhead = 6;  // records ahead in each stream, into L1

// Past a stream's end this touches the next block's records (read soon after) or nothing: prefetches never fault.
template <int64_t BYTES>
TS_TARGET inline void prefetch_record(const uint8_t* p) {
  for (int64_t line = 0; line < BYTES; line += 64) _mm_prefetch(reinterpret_cast<const char*>(p + line), _MM_HINT_T0);
}

TS_TARGET inline __m512i load_bytes_as_words(const uint8_t* p) {
  return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

TS_TARGET inline __m512 load_half(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

TS_TARGET inline void store_bf16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}

// Per row and group of `group` (16 or 32) inputs, the float32 sum of the bf16 activations.
TS_TARGET void group_sums(const uint16_t* x, int64_t rows, int64_t k, int64_t group, float* out) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < k / group; ++g) {
      const uint16_t* p = x + r * k + g * group;
      __m512 sum = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
      if (group == 32)
        sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(
                                     _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16))), 16)));
      out[r * (k / group) + g] = _mm512_reduce_add_ps(sum);
    }
}

// int4 record -> 512 bf16 of 128 + q in tile order.
TS_TARGET inline void expand_int4(const uint8_t* src, uint16_t* dst) {
  const __m512i bias = _mm512_set1_epi16(0x4300), low = _mm512_set1_epi16(0x000F);
  for (int c = 0; c < 8; ++c) {
    const __m512i w = load_bytes_as_words(src + 32 * c);
    _mm512_store_si512(dst + 64 * c, _mm512_ternarylogic_epi32(w, low, bias, 0xEA));  // (w & 15) | bias
    _mm512_store_si512(dst + 64 * c + 32, _mm512_or_si512(_mm512_srli_epi16(w, 4), bias));
  }
}

// int6 record -> 512 bf16 of 128 + u in tile order (rows 0..7: inputs 0..15, rows 8..15: inputs 16..31).
TS_TARGET inline void expand_int6(const uint8_t* src, uint16_t* dst) {
  const __m512i bias = _mm512_set1_epi16(0x4300), low = _mm512_set1_epi16(0x000F);
  const __m512i two_bits = _mm512_set1_epi16(0x0030);
  for (int c = 0; c < 4; ++c) {  // rows 4c .. 4c + 3
    const __m512i high = load_bytes_as_words(src + 256 + 32 * c);
    const __m512i n0 = load_bytes_as_words(src + 64 * c), n1 = load_bytes_as_words(src + 64 * c + 32);
    // (nibble) | (high bits moved to bits 4, 5 and masked) | bias: ternary logic (A & B) | C then one OR
    const __m512i h0 = _mm512_or_si512(_mm512_and_si512(_mm512_slli_epi16(high, 4), two_bits), bias);
    const __m512i h1 = _mm512_or_si512(_mm512_and_si512(_mm512_slli_epi16(high, 2), two_bits), bias);
    const __m512i h2 = _mm512_or_si512(_mm512_and_si512(high, two_bits), bias);
    const __m512i h3 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(high, 2), two_bits), bias);
    _mm512_store_si512(dst + 128 * c, _mm512_ternarylogic_epi32(n0, low, h0, 0xEA));
    _mm512_store_si512(dst + 128 * c + 32, _mm512_or_si512(_mm512_srli_epi16(n0, 4), h1));
    _mm512_store_si512(dst + 128 * c + 64, _mm512_ternarylogic_epi32(n1, low, h2, 0xEA));
    _mm512_store_si512(dst + 128 * c + 96, _mm512_or_si512(_mm512_srli_epi16(n1, 4), h3));
  }
}

// int8 record -> 512 bf16(q * s).
TS_TARGET inline void expand_int8(const uint8_t* src, uint16_t* dst) {
  // lane l of a 16-float half row is output (half * 8 + l / 2): repeat each scale twice
  const __m512i pick_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i pick_hi = _mm512_add_epi32(pick_lo, _mm512_set1_epi32(8));
  for (int group = 0; group < 2; ++group) {
    const __m512 s = load_half(src + 512 + 32 * group);
    const __m512 s_lo = _mm512_permutexvar_ps(pick_lo, s), s_hi = _mm512_permutexvar_ps(pick_hi, s);
    for (int r = 8 * group; r < 8 * group + 8; ++r) {
      const int8_t* row = reinterpret_cast<const int8_t*>(src) + 32 * r;
      __m512 a = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                   _mm_loadu_si128(reinterpret_cast<const __m128i*>(row)))), s_lo);
      __m512 b = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                   _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16)))), s_hi);
      _mm512_store_si512(dst + 32 * r, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
  }
}

// acc[r] += s * P[r] + c * xsum[r]: one group's correction from its stored product tile.
template <int ROWS>
TS_TARGET inline void add_group(__m512* acc, const float* product, __m512 s, __m512 c, const float* xsum,
                                int64_t xsum_stride) {
  for (int r = 0; r < ROWS; ++r) {
    acc[r] = _mm512_fmadd_ps(s, _mm512_load_ps(product + 16 * r), acc[r]);
    acc[r] = _mm512_fmadd_ps(c, _mm512_set1_ps(xsum[r * xsum_stride]), acc[r]);
  }
}

// int4 / int8: up to 3 output blocks against `rows` activation rows, all K. `xsum`: per row and 32 inputs.
template <int ROWS, int BLOCKS, int KIND>
TS_TARGET void run_blocks(const uint16_t* x, int64_t k, const float* xsum, const uint8_t* w, int64_t nb0,
                          int64_t groups, uint16_t* y, int64_t n) {
  constexpr int64_t kBytes = kRecordBytes[KIND];
  constexpr bool kGrouped = KIND == kInt4;  // products corrected per group, else accumulated in the tiles
  alignas(64) uint16_t wbuf[BLOCKS][kTileK * kTileN];
  alignas(64) float cbuf[BLOCKS][kMaxRows * kTileN];
  __m512 acc[BLOCKS][ROWS];
  for (int b = 0; b < BLOCKS; ++b)
    for (int r = 0; r < ROWS; ++r) acc[b][r] = _mm512_setzero_ps();
  const uint8_t* stream[BLOCKS];
  for (int b = 0; b < BLOCKS; ++b) stream[b] = w + (nb0 + b) * groups * kBytes;
  if (!kGrouped) {
    _tile_zero(4);
    if (BLOCKS > 1) _tile_zero(5);
    if (BLOCKS > 2) _tile_zero(6);
  }
  for (int64_t g = 0; g < groups; ++g) {
    _tile_loadd(0, x + g * kTileK, k * 2);
    for (int b = 0; b < BLOCKS; ++b) {
      const uint8_t* record = stream[b] + g * kBytes;
      prefetch_record<kBytes>(record + kPrefetchAhead * kBytes);
      if (KIND == kInt4)
        expand_int4(record, wbuf[b]);
      else
        expand_int8(record, wbuf[b]);
    }
    // tile numbers must be constants: spell out the three blocks
    _tile_loadd(1, wbuf[0], 64);
    if (kGrouped) _tile_zero(4);
    _tile_dpbf16ps(4, 0, 1);
    if (BLOCKS > 1) {
      _tile_loadd(2, wbuf[1], 64);
      if (kGrouped) _tile_zero(5);
      _tile_dpbf16ps(5, 0, 2);
    }
    if (BLOCKS > 2) {
      _tile_loadd(3, wbuf[2], 64);
      if (kGrouped) _tile_zero(6);
      _tile_dpbf16ps(6, 0, 3);
    }
    if (kGrouped) {
      _tile_stored(4, cbuf[0], 64);
      if (BLOCKS > 1) _tile_stored(5, cbuf[1], 64);
      if (BLOCKS > 2) _tile_stored(6, cbuf[2], 64);
      for (int b = 0; b < BLOCKS; ++b) {
        const uint8_t* record = stream[b] + g * kBytes;
        const __m512 s = load_half(record + 256);
        const __m512 c = _mm512_fmadd_ps(_mm512_set1_ps(-128.f), s, load_half(record + 288));  // z - 128 s
        add_group<ROWS>(acc[b], cbuf[b], s, c, xsum + g, groups);
      }
    }
  }
  if (!kGrouped) {
    _tile_stored(4, cbuf[0], 64);
    if (BLOCKS > 1) _tile_stored(5, cbuf[1], 64);
    if (BLOCKS > 2) _tile_stored(6, cbuf[2], 64);
    for (int b = 0; b < BLOCKS; ++b)
      for (int r = 0; r < ROWS; ++r) acc[b][r] = _mm512_load_ps(cbuf[b] + 16 * r);
  }
  for (int b = 0; b < BLOCKS; ++b)
    for (int r = 0; r < ROWS; ++r) store_bf16(y + r * n + (nb0 + b) * kTileN, acc[b][r]);
}

// int6: up to 2 output blocks, one product per 16 inputs. `xsum`: per row and 16 inputs.
template <int ROWS, int BLOCKS>
TS_TARGET void run_blocks_int6(const uint16_t* x, int64_t k, const float* xsum, const uint8_t* w, int64_t nb0,
                               int64_t groups, uint16_t* y, int64_t n) {
  constexpr int64_t kBytes = kRecordBytes[kInt6];
  alignas(64) uint16_t wbuf[BLOCKS][kTileK * kTileN];
  alignas(64) float cbuf[2 * BLOCKS][kMaxRows * kTileN];
  __m512 acc[BLOCKS][ROWS];
  for (int b = 0; b < BLOCKS; ++b)
    for (int r = 0; r < ROWS; ++r) acc[b][r] = _mm512_setzero_ps();
  const uint8_t* stream[BLOCKS];
  for (int b = 0; b < BLOCKS; ++b) stream[b] = w + (nb0 + b) * groups * kBytes;
  const __m512 minus160 = _mm512_set1_ps(-160.f);
  for (int64_t g = 0; g < groups; ++g) {
    _tile_loadd(0, x + g * kTileK, k * 2);
    _tile_loadd(1, x + g * kTileK + 16, k * 2);
    for (int b = 0; b < BLOCKS; ++b) {
      const uint8_t* record = stream[b] + g * kBytes;
      prefetch_record<kBytes>(record + kPrefetchAhead * kBytes);
      expand_int6(record, wbuf[b]);
    }
    _tile_loadd(2, wbuf[0], 64);
    _tile_loadd(3, wbuf[0] + 256, 64);
    _tile_zero(4);
    _tile_zero(5);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(5, 1, 3);
    _tile_stored(4, cbuf[0], 64);
    _tile_stored(5, cbuf[1], 64);
    if (BLOCKS > 1) {
      _tile_loadd(2, wbuf[1], 64);
      _tile_loadd(3, wbuf[1] + 256, 64);
      _tile_zero(6);
      _tile_zero(7);
      _tile_dpbf16ps(6, 0, 2);
      _tile_dpbf16ps(7, 1, 3);
      _tile_stored(6, cbuf[2], 64);
      _tile_stored(7, cbuf[3], 64);
    }
    for (int b = 0; b < BLOCKS; ++b) {
      const uint8_t* record = stream[b] + g * kBytes;
      for (int half = 0; half < 2; ++half) {
        const __m512 s = load_half(record + 384 + 32 * half);
        add_group<ROWS>(acc[b], cbuf[2 * b + half], s, _mm512_mul_ps(minus160, s), xsum + 2 * g + half, 2 * groups);
      }
    }
  }
  for (int b = 0; b < BLOCKS; ++b)
    for (int r = 0; r < ROWS; ++r) store_bf16(y + r * n + (nb0 + b) * kTileN, acc[b][r]);
}

// More than 16 rows (prefill, batches): a plain AMX GEMM. Each output block's weights are expanded once per call,
// over all K, to the dense bf16 values (scale and offset applied in float32, then rounded: the dense weight up to
// that rounding) in an L2-resident buffer, then every 16-row block of x (padded to whole blocks) runs against
// it with the sums kept in tiles over all K. The weights stream from memory once per call, not once per 16 rows.

// 512 words of 128 + u in tile order -> bf16(s * (128 + u) + c) per output; `lanes` repeats each output's
// (s, c) over its two lanes. Rows [row0, row1) use the given (s, c).
TS_TARGET inline void apply_scales(uint16_t* words, int row0, int row1, __m512 s, __m512 c) {
  const __m512i pick_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i pick_hi = _mm512_add_epi32(pick_lo, _mm512_set1_epi32(8));
  const __m512 s_lo = _mm512_permutexvar_ps(pick_lo, s), s_hi = _mm512_permutexvar_ps(pick_hi, s);
  const __m512 c_lo = _mm512_permutexvar_ps(pick_lo, c), c_hi = _mm512_permutexvar_ps(pick_hi, c);
  for (int r = row0; r < row1; ++r) {
    const __m256i* row = reinterpret_cast<const __m256i*>(words + 32 * r);
    // a bf16's bits shifted up 16 are the same number in float32
    const __m512 a = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_load_si256(row)), 16));
    const __m512 b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_load_si256(row + 1)), 16));
    _mm512_store_si512(words + 32 * r,
                       (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(b, s_hi, c_hi), _mm512_fmadd_ps(a, s_lo, c_lo)));
  }
}

template <int KIND>
TS_TARGET inline void expand_dense(const uint8_t* record, uint16_t* dst) {
  if (KIND == kInt8) return expand_int8(record, dst);
  if (KIND == kInt4) {
    expand_int4(record, dst);
    const __m512 s = load_half(record + 256);
    apply_scales(dst, 0, 16, s, _mm512_fmadd_ps(_mm512_set1_ps(-128.f), s, load_half(record + 288)));
  } else {
    expand_int6(record, dst);
    for (int half = 0; half < 2; ++half) {
      const __m512 s = load_half(record + 384 + 32 * half);
      apply_scales(dst, 8 * half, 8 * half + 8, s, _mm512_mul_ps(_mm512_set1_ps(-160.f), s));
    }
  }
}

// One 16-row block of x against up to four expanded output blocks: tmm0 the activations, tmm1 / tmm2 the weights
// (taken in turn, so a load does not wait for the product still reading the other), tmm4..7 the sums.
template <int BLOCKS>
TS_TARGET void gemm_row_block(const uint16_t* x, int64_t k, const uint16_t* buf, int64_t groups, uint16_t* y,
                              int64_t n, int64_t col0) {
  alignas(64) float cbuf[kMaxRows * kTileN];
  _tile_zero(4);
  if (BLOCKS > 1) _tile_zero(5);
  if (BLOCKS > 2) _tile_zero(6);
  if (BLOCKS > 3) _tile_zero(7);
  for (int64_t g = 0; g < groups; ++g) {
    _tile_loadd(0, x + g * kTileK, k * 2);
    _tile_loadd(1, buf + g * 512, 64);
    _tile_dpbf16ps(4, 0, 1);
    if (BLOCKS > 1) {
      _tile_loadd(2, buf + (groups + g) * 512, 64);
      _tile_dpbf16ps(5, 0, 2);
    }
    if (BLOCKS > 2) {
      _tile_loadd(1, buf + (2 * groups + g) * 512, 64);
      _tile_dpbf16ps(6, 0, 1);
    }
    if (BLOCKS > 3) {
      _tile_loadd(2, buf + (3 * groups + g) * 512, 64);
      _tile_dpbf16ps(7, 0, 2);
    }
  }
  for (int b = 0; b < BLOCKS; ++b) {
    switch (b) {
      case 0: _tile_stored(4, cbuf, 64); break;
      case 1: _tile_stored(5, cbuf, 64); break;
      case 2: _tile_stored(6, cbuf, 64); break;
      default: _tile_stored(7, cbuf, 64); break;
    }
    for (int r = 0; r < kMaxRows; ++r) store_bf16(y + r * n + col0 + b * kTileN, _mm512_load_ps(cbuf + 16 * r));
  }
}

template <int KIND>
TS_TARGET void run_blocks_gemm(const uint16_t* x, int64_t k, const uint8_t* w, int64_t nb0, int blocks,
                               int64_t groups, int64_t row_blocks, uint16_t* buf, uint16_t* y, int64_t n) {
  constexpr int64_t kBytes = kRecordBytes[KIND];
  for (int b = 0; b < blocks; ++b) {
    const uint8_t* stream = w + (nb0 + b) * groups * kBytes;
    for (int64_t g = 0; g < groups; ++g) {
      prefetch_record<kBytes>(stream + (g + kPrefetchAhead) * kBytes);
      expand_dense<KIND>(stream + g * kBytes, buf + (b * groups + g) * 512);
    }
  }
  for (int64_t rb = 0; rb < row_blocks; ++rb) {
    const uint16_t* xb = x + rb * kMaxRows * k;
    uint16_t* yb = y + rb * kMaxRows * n;
    switch (blocks) {
      case 1: gemm_row_block<1>(xb, k, buf, groups, yb, n, nb0 * kTileN); break;
      case 2: gemm_row_block<2>(xb, k, buf, groups, yb, n, nb0 * kTileN); break;
      case 3: gemm_row_block<3>(xb, k, buf, groups, yb, n, nb0 * kTileN); break;
      default: gemm_row_block<4>(xb, k, buf, groups, yb, n, nb0 * kTileN); break;
    }
  }
}

TS_TARGET void run_range_gemm(int kind, const uint16_t* x, int64_t k, const uint8_t* w, int64_t nb0, int64_t nb1,
                              int64_t groups, int64_t row_blocks, uint16_t* y, int64_t n) {
  configure_tiles(kMaxRows, false);
  constexpr int kBlocks = 4;
  // kept per thread: a fresh megabyte per call would be page-faulted in every time
  static thread_local std::vector<uint16_t> storage;
  storage.resize(std::max<size_t>(storage.size(), kBlocks * groups * 512 + 32));
  uint16_t* buf = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t(63));
  for (int64_t nb = nb0; nb < nb1; nb += kBlocks) {
    const int blocks = static_cast<int>(std::min<int64_t>(kBlocks, nb1 - nb));
    if (kind == kInt4) run_blocks_gemm<kInt4>(x, k, w, nb, blocks, groups, row_blocks, buf, y, n);
    else if (kind == kInt6) run_blocks_gemm<kInt6>(x, k, w, nb, blocks, groups, row_blocks, buf, y, n);
    else run_blocks_gemm<kInt8>(x, k, w, nb, blocks, groups, row_blocks, buf, y, n);
  }
  _tile_release();
}

// Few rows (decode, draft steps, a draft model's two-token catch-up): AVX512-BF16 dot products instead of tiles.
// A tile row (16 outputs x an input pair) times the broadcast pair of x is one vdpbf16ps, so the expanded weights
// never leave L1 and no product tile is stored and read back per group. Its arithmetic grows by 16 dot products
// per row and 512 weights, the tiles' hardly at all, so it pays only for very few rows: ad hoc timings on the
// 2-core Xeon this was written on (cold weights, 2 threads) put one row here at memory speed (18-23 GB/s, the
// tiles slower), two rows of int6 at 0.75-0.8x the tiles' time (two int4 rows equal, whose tiles need half as
// many products) and five rows at 1.7-2x the tiles'. Each row is computed by the same operations in the same
// order whatever the other rows, so a row's result does not depend on how many rows share the call.
constexpr int kVectorRows[3] = {1, 2, 1};  // per kind: int4, int6, int8
constexpr int kChunk = 4;  // rows whose sums are live at once (4 per row: 16 of the 32 vector registers)

// COUNT (<= kChunk) rows against one expanded block: out[r] (16 outputs) += this group's contribution. COUNT is
// a constant so that the sums stay in registers.
template <int KIND, int COUNT>
TS_TARGET inline void rows_against_block(const uint16_t* wbuf, const uint8_t* record, const uint32_t* pairs,
                                         int64_t pair_stride, const float* xsum, int64_t xsum_stride, float* out) {
  // two sums per half and row (tile rows taken in turn) so each multiply-add does not wait for the one before
  __m512 part[COUNT][2][2];
  for (int c = 0; c < COUNT; ++c)
    for (int h = 0; h < 2; ++h) part[c][h][0] = part[c][h][1] = _mm512_setzero_ps();
  for (int r = 0; r < 16; ++r) {
    const __m512i row = _mm512_load_si512(wbuf + 32 * r);
#pragma GCC unroll 4
    for (int c = 0; c < COUNT; ++c) {
      const __m512i xp = _mm512_set1_epi32(static_cast<int>(pairs[c * pair_stride + r]));
      part[c][r / 8][r & 1] = _mm512_dpbf16_ps(part[c][r / 8][r & 1], (__m512bh)row, (__m512bh)xp);
    }
  }
#pragma GCC unroll 4
  for (int c = 0; c < COUNT; ++c) {
    const __m512 lo = _mm512_add_ps(part[c][0][0], part[c][0][1]), hi = _mm512_add_ps(part[c][1][0], part[c][1][1]);
    __m512 o = _mm512_load_ps(out + 16 * c);
    if (KIND == kInt8) {  // scales already in the weights
      o = _mm512_add_ps(o, _mm512_add_ps(lo, hi));
    } else if (KIND == kInt4) {  // one group of 32
      const __m512 sv = load_half(record + 256);
      const __m512 cv = _mm512_fmadd_ps(_mm512_set1_ps(-128.f), sv, load_half(record + 288));
      o = _mm512_fmadd_ps(sv, _mm512_add_ps(lo, hi), o);
      o = _mm512_fmadd_ps(cv, _mm512_set1_ps(xsum[c * xsum_stride]), o);
    } else {  // two groups of 16: rows 0..7 and 8..15
      const __m512 sa = load_half(record + 384), sb = load_half(record + 416);
      o = _mm512_fmadd_ps(sa, lo, o);
      o = _mm512_fmadd_ps(sb, hi, o);
      const __m512 minus160 = _mm512_set1_ps(-160.f);
      o = _mm512_fmadd_ps(_mm512_mul_ps(minus160, sa), _mm512_set1_ps(xsum[c * xsum_stride]), o);
      o = _mm512_fmadd_ps(_mm512_mul_ps(minus160, sb), _mm512_set1_ps(xsum[c * xsum_stride + 1]), o);
    }
    _mm512_store_ps(out + 16 * c, o);
  }
}

// Rows R0 .. ROWS - 1, kChunk at a time.
template <int KIND, int ROWS, int R0 = 0>
TS_TARGET inline void chunks_against_block(const uint16_t* wbuf, const uint8_t* record, const uint32_t* pairs,
                                           int64_t pair_stride, const float* xsum, int64_t xsum_stride, float* out) {
  if constexpr (R0 < ROWS) {
    constexpr int kCount = ROWS - R0 < kChunk ? ROWS - R0 : kChunk;
    rows_against_block<KIND, kCount>(wbuf, record, pairs + R0 * pair_stride, pair_stride,
                                     xsum == nullptr ? nullptr : xsum + R0 * xsum_stride, xsum_stride, out + 16 * R0);
    chunks_against_block<KIND, ROWS, R0 + kCount>(wbuf, record, pairs, pair_stride, xsum, xsum_stride, out);
  }
}

template <int BLOCKS, int KIND, int ROWS>
TS_TARGET void run_blocks_rows(const uint16_t* x, int64_t k, const float* xsum, const uint8_t* w,
                               int64_t nb0, int64_t groups, uint16_t* y, int64_t n) {
  constexpr int64_t kBytes = kRecordBytes[KIND];
  constexpr int64_t kSumsPerGroup = KIND == kInt6 ? 2 : 1;  // xsum entries per 32 inputs
  alignas(64) uint16_t wbuf[kTileK * kTileN];
  alignas(64) float out[BLOCKS][ROWS * kTileN] = {};
  const uint32_t* pairs = reinterpret_cast<const uint32_t*>(x);  // x as bf16 pairs: pair p is inputs 2p, 2p + 1
  const int64_t pair_stride = k / 2, xsum_stride = groups * kSumsPerGroup;
  for (int64_t g = 0; g < groups; ++g) {
    for (int b = 0; b < BLOCKS; ++b) {
      const uint8_t* record = w + ((nb0 + b) * groups + g) * kBytes;
      prefetch_record<kBytes>(record + kPrefetchAhead * kBytes);
      if (KIND == kInt4) expand_int4(record, wbuf);
      else if (KIND == kInt6) expand_int6(record, wbuf);
      else expand_int8(record, wbuf);
      chunks_against_block<KIND, ROWS>(wbuf, record, pairs + g * 16, pair_stride,
                                       xsum == nullptr ? nullptr : xsum + g * kSumsPerGroup, xsum_stride, out[b]);
    }
  }
  for (int b = 0; b < BLOCKS; ++b)
    for (int r = 0; r < ROWS; ++r)
      store_bf16(y + r * n + (nb0 + b) * kTileN, _mm512_load_ps(out[b] + 16 * r));
}

template <int ROWS, int KIND>
TS_TARGET void run_range_rows(const uint16_t* x, int64_t k, const float* xsum, const uint8_t* w, int64_t nb0,
                              int64_t nb1, int64_t groups, uint16_t* y, int64_t n) {
  int64_t nb = nb0;
  for (; nb + 2 <= nb1; nb += 2) run_blocks_rows<2, KIND, ROWS>(x, k, xsum, w, nb, groups, y, n);
  for (; nb < nb1; ++nb) run_blocks_rows<1, KIND, ROWS>(x, k, xsum, w, nb, groups, y, n);
}

template <int ROWS, int KIND>
TS_TARGET void run_range(const uint16_t* x, int64_t k, const float* xsum, const uint8_t* w, int64_t nb0,
                         int64_t nb1, int64_t groups, uint16_t* y, int64_t n) {
  configure_tiles(ROWS, KIND == kInt6);
  int64_t nb = nb0;
  if (KIND == kInt6) {
    for (; nb + 2 <= nb1; nb += 2) run_blocks_int6<ROWS, 2>(x, k, xsum, w, nb, groups, y, n);
    for (; nb < nb1; ++nb) run_blocks_int6<ROWS, 1>(x, k, xsum, w, nb, groups, y, n);
  } else {
    for (; nb + 3 <= nb1; nb += 3) run_blocks<ROWS, 3, KIND>(x, k, xsum, w, nb, groups, y, n);
    for (; nb < nb1; ++nb) run_blocks<ROWS, 1, KIND>(x, k, xsum, w, nb, groups, y, n);
  }
  _tile_release();
}

using RangeFn = void (*)(const uint16_t*, int64_t, const float*, const uint8_t*, int64_t, int64_t, int64_t,
                         uint16_t*, int64_t);

// rows 1 .. kVectorRows[KIND]: the vector path; more: tiles
template <int KIND, int... R>
RangeFn pick(int rows, std::integer_sequence<int, R...>) {
  static constexpr RangeFn fns[] = {(R < kVectorRows[KIND] ? &run_range_rows<R + 1, KIND> : &run_range<R + 1, KIND>)...};
  return fns[rows - 1];
}

RangeFn range_fn(int kind, int rows) {
  const auto counts = std::make_integer_sequence<int, kMaxRows>{};
  return kind == kInt4 ? pick<kInt4>(rows, counts) : kind == kInt6 ? pick<kInt6>(rows, counts)
                                                                   : pick<kInt8>(rows, counts);
}

#else
bool amx_ready() { return false; }
#endif  // TS_AMX

const char* const kNames[3] = {"amx_int4_mm", "amx_int6_mm", "amx_int8_mm"};

at::Tensor grouped_mm(const at::Tensor& x_in, const at::Tensor& w, int kind) {
  const char* name = kNames[kind];
  TORCH_CHECK(amx_ready(), name, ": this CPU (or its kernel) does not offer AMX-BF16");
  TORCH_CHECK(x_in.dim() == 2, name, ": x must be [M, K]");
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kByte && w.size(2) == kRecordBytes[kind], name,
              ": packed weight must be uint8 [N / 16, K / 32, ", kRecordBytes[kind], "]");
  const int64_t rows = x_in.size(0), k = x_in.size(1), blocks = w.size(0), groups = w.size(1), n = blocks * kTileN;
  TORCH_CHECK(k == groups * kTileK, name, ": x has ", k, " inputs, the weight ", groups * kTileK);
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16, name, ": activations must be bfloat16");
  if (rows == 0) return at::empty({0, n}, x_in.options());
  // more than one row block: pad x to whole blocks of 16 rows (the tiles then read whole blocks)
  const int64_t row_blocks = (rows + kMaxRows - 1) / kMaxRows;
  const bool many = row_blocks > 1;
  at::Tensor x = x_in.contiguous();
  if (many && rows % kMaxRows) x = at::constant_pad_nd(x, {0, 0, 0, row_blocks * kMaxRows - rows}, 0);
  const at::Tensor wc = w.contiguous();
  at::Tensor y = at::empty({x.size(0), n}, x.options());
#if TS_AMX
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const uint8_t* wp = wc.data_ptr<uint8_t>();
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  std::vector<float> xsum;  // few rows, int4 / int6: the per-group activation sums of the correction
  if (kind != kInt8 && !many) {
    const int64_t group = kind == kInt4 ? 32 : 16;
    xsum.resize(rows * (k / group));
    group_sums(xp, rows, k, group, xsum.data());
  }
  const float* xs = xsum.empty() ? nullptr : xsum.data();
  at::parallel_for(0, blocks, 6, [&](int64_t b0, int64_t b1) {
    if (many)
      run_range_gemm(kind, xp, k, wp, b0, b1, groups, row_blocks, yp, n);
    else
      range_fn(kind, static_cast<int>(rows))(xp, k, xs, wp, b0, b1, groups, yp, n);
  });
#endif
  return many ? y.narrow(0, 0, rows) : y;
}

at::Tensor amx_int4_mm(const at::Tensor& x, const at::Tensor& w) { return grouped_mm(x, w, kInt4); }
at::Tensor amx_int6_mm(const at::Tensor& x, const at::Tensor& w) { return grouped_mm(x, w, kInt6); }
at::Tensor amx_int8_mm(const at::Tensor& x, const at::Tensor& w) { return grouped_mm(x, w, kInt8); }

bool amx_available() { return amx_ready(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(turbospec, m) {
  m.def("amx_available() -> bool");
  m.def("amx_int4_mm(Tensor x, Tensor w) -> Tensor");
  m.def("amx_int6_mm(Tensor x, Tensor w) -> Tensor");
  m.def("amx_int8_mm(Tensor x, Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(turbospec, CPU, m) {
  m.impl("amx_int4_mm", &amx_int4_mm);
  m.impl("amx_int6_mm", &amx_int6_mm);
  m.impl("amx_int8_mm", &amx_int8_mm);
}

TORCH_LIBRARY_IMPL(turbospec, CatchAll, m) {
  m.impl("amx_available", &amx_available);
}
