// Attention of short queries (decode, verification windows, draft trees: up to 16 queries per sequence) straight
// from the paged KV cache: out [B, Q, Hq, D] for q [B, Q, Hq, D], k/v cache [slots, Hkv, D], the context's cache
// slots [B, L] and a mask [B, Q, L] (causal, tree or sliding window: whatever the caller built).
//
// Why: the torch path gathers every context key and value into a new tensor per layer (index_select), then runs
// two small batched matmuls and a softmax, about ten operator calls per layer; for one qwen2.5-coder-1.5b decode at
// ~350 tokens of context on a Zen 4 that was ~10 ms of a ~50 ms step (28 layers), where the arithmetic is a few
// hundred microseconds. Here each (sequence, query head) is one task: its scores against every key read in place
// from the cache, an exact softmax in float32, then the weighted sum of the values, in one call for all layers'
// groups of this shape.
//
// Arithmetic in float32 (bf16 inputs widened exactly), the output rounded once to the input's dtype. Plain loops
// over 16-lane blocks that the compiler vectorises, cloned for AVX-512, AVX2 and any x86 CPU (the loader picks the
// clone by the CPU's features at run time).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TS_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define TS_CLONES
#endif

namespace {

constexpr int64_t kLanes = 16;       // the head dimension is taken in blocks of 16 (D % 16 == 0)
constexpr int64_t kMaxHeadDim = 512;

inline float widen(float v) { return v; }
inline float widen(at::BFloat16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline void narrow(float v, float* out) { *out = v; }
inline void narrow(float v, at::BFloat16* out) {  // round to nearest even, as torch's conversion does
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  if (std::isnan(v)) {
    out->x = 0x7FC0;
    return;
  }
  out->x = static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

// One query head of one sequence: Q query rows (q rows q_stride apart), L keys at `slots`, `mask` [Q, L].
// scores: Q * L floats, acc: Q * D floats of scratch.
template <typename T>
TS_CLONES void attend(const T* q, int64_t q_stride, const T* k_cache, const T* v_cache, int64_t slot_stride,
                      const int64_t* slots, const bool* mask, int64_t num_q, int64_t length, int64_t dim,
                      float scale, float* scores, float* acc, T* out, int64_t out_stride) {
  float qf[16 * kMaxHeadDim];
  float row[kMaxHeadDim];
  for (int64_t i = 0; i < num_q; ++i)
    for (int64_t d = 0; d < dim; ++d) qf[i * dim + d] = widen(q[i * q_stride + d]) * scale;
  const float minus_inf = -std::numeric_limits<float>::infinity();
  for (int64_t l = 0; l < length; ++l) {
    const T* key = k_cache + slots[l] * slot_stride;
    for (int64_t d = 0; d < dim; ++d) row[d] = widen(key[d]);
    for (int64_t i = 0; i < num_q; ++i) {
      if (!mask[i * length + l]) {
        scores[i * length + l] = minus_inf;
        continue;
      }
      float part[kLanes] = {};
      for (int64_t d0 = 0; d0 < dim; d0 += kLanes)
        for (int64_t j = 0; j < kLanes; ++j) part[j] += qf[i * dim + d0 + j] * row[d0 + j];
      float sum = 0.f;
      for (int64_t j = 0; j < kLanes; ++j) sum += part[j];
      scores[i * length + l] = sum;
    }
  }
  std::vector<float> total(num_q);
  for (int64_t i = 0; i < num_q; ++i) {
    float* s = scores + i * length;
    float top = minus_inf;
    for (int64_t l = 0; l < length; ++l) top = std::max(top, s[l]);
    float sum = 0.f;
    for (int64_t l = 0; l < length; ++l) {
      s[l] = s[l] == minus_inf ? 0.f : std::exp(s[l] - top);
      sum += s[l];
    }
    total[i] = sum;
    for (int64_t d = 0; d < dim; ++d) acc[i * dim + d] = 0.f;
  }
  for (int64_t l = 0; l < length; ++l) {
    const T* value = v_cache + slots[l] * slot_stride;
    for (int64_t d = 0; d < dim; ++d) row[d] = widen(value[d]);
    for (int64_t i = 0; i < num_q; ++i) {
      const float p = scores[i * length + l];
      if (p == 0.f) continue;
      for (int64_t d = 0; d < dim; ++d) acc[i * dim + d] += p * row[d];
    }
  }
  for (int64_t i = 0; i < num_q; ++i) {
    const float inv = total[i] > 0.f ? 1.f / total[i] : 0.f;
    for (int64_t d = 0; d < dim; ++d) narrow(acc[i * dim + d] * inv, out + i * out_stride + d);
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
#define TS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
#include <immintrin.h>

TS_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
TS_AVX512 inline __m512 load16(const at::BFloat16* p) {  // a bf16's bits shifted up 16 are the same float32
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// e^x for x <= 0 (softmax after subtracting the max): 2^(x log2 e) as 2^n * 2^f, f in [-0.5, 0.5] by a degree-6
// polynomial (relative error ~2e-7, below float32's rounding of the sums it feeds); e^-inf = 0.
TS_AVX512 inline __m512 exp_nonpositive(__m512 x) {
  const __m512 y = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-100.f)), _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(y, n), _mm512_set1_ps(0.6931471805599453f));  // in nats
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  const __m512 e = _mm512_scalef_ps(p, n);
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-100.f), _CMP_GT_OQ), e);
}

// Each row of scores [rows, L] (masked keys at -inf) turned into its softmax in place.
TS_AVX512 void softmax_rows(float* scores, int64_t rows, int64_t length) {
  const float minus_inf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * length;
    __m512 top = _mm512_set1_ps(minus_inf);
    int64_t l = 0;
    for (; l + kLanes <= length; l += kLanes) top = _mm512_max_ps(top, _mm512_loadu_ps(s + l));
    float m = _mm512_reduce_max_ps(top);
    for (; l < length; ++l) m = std::max(m, s[l]);
    const __m512 mv = _mm512_set1_ps(m);
    __m512 total = _mm512_setzero_ps();
    for (l = 0; l + kLanes <= length; l += kLanes) {
      const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + l), mv));
      _mm512_storeu_ps(s + l, e);
      total = _mm512_add_ps(total, e);
    }
    if (l < length) {
      const __mmask16 tail = static_cast<__mmask16>((1u << (length - l)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(tail, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + l), mv)));
      _mm512_mask_storeu_ps(s + l, tail, e);
      total = _mm512_add_ps(total, e);
    }
    const float inv = 1.f / _mm512_reduce_add_ps(total);  // the max's own term is 1: never zero
    for (l = 0; l < length; ++l) s[l] *= inv;
  }
}

// Lane j of the result: the sum of the 16 lanes of v[j] (16 dot products' partial sums, one per key), by a
// transposing tree of adds: 45 shuffles and adds for 16 sums, where one horizontal sum each costs about 10.
TS_AVX512 inline __m512 reduce16(const float* v) {
  __m512 t[8], u[4];
  for (int j = 0; j < 8; ++j) {
    const __m512 a = _mm512_loadu_ps(v + 32 * j), b = _mm512_loadu_ps(v + 32 * j + 16);
    t[j] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // per 128 bits: a02 b02 a13 b13
  }
  for (int j = 0; j < 4; ++j) {
    const __m512d a = _mm512_castps_pd(t[2 * j]), b = _mm512_castps_pd(t[2 * j + 1]);
    u[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),  // per 128 bits: keys 4j..4j+3
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x44), _mm512_shuffle_f32x4(u[0], u[1], 0xEE));
  const __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x44), _mm512_shuffle_f32x4(u[2], u[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, 0x88), _mm512_shuffle_f32x4(x01, x23, 0xDD));
}

// Keys and values are read kAhead slots ahead of their use: the slots are scattered over the cache's blocks, and
// one decode query does too little work per key for the hardware prefetcher's lead to cover memory's latency.
constexpr int64_t kAhead = 8;

template <int B, typename T>
TS_AVX512 inline void prefetch_row(const T* p) {
  constexpr int64_t bytes = B * kLanes * sizeof(T);
  for (int64_t offset = 0; offset < bytes; offset += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p) + offset, _MM_HINT_T0);
}

// Scores of `rows` scaled query rows qf [rows, 16 B] against L keys, the head dimension (B blocks of 16) known at
// compile time: each key is widened once into registers for all the rows, a row's product with it is left as 16
// lanes in `part` [rows, 16, 16], and every 16 keys one reduce16 per row turns them into 16 scores. Masked keys
// get -inf (row r belongs to query (r0 + r) / group).
template <int B, typename T>
TS_AVX512 void scores_fixed(const float* qf, int64_t rows, int64_t r0, int64_t group, const T* k_cache,
                            int64_t slot_stride, const int64_t* slots, const bool* mask, int64_t length, float* part,
                            float* scores) {
  constexpr int64_t dim = B * kLanes;
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t l0 = 0; l0 < length; l0 += kLanes) {
    const int64_t n = std::min(kLanes, length - l0);
    for (int64_t j = 0; j < kLanes; ++j) {
      if (j >= n) {
        for (int64_t r = 0; r < rows; ++r) _mm512_storeu_ps(part + (r * kLanes + j) * kLanes, _mm512_setzero_ps());
        continue;
      }
      const T* key = k_cache + slots[l0 + j] * slot_stride;
      if (l0 + j + kAhead < length) prefetch_row<B, T>(k_cache + slots[l0 + j + kAhead] * slot_stride);
      __m512 k[B];
      for (int c = 0; c < B; ++c) k[c] = load16(key + c * kLanes);
      for (int64_t r = 0; r < rows; ++r) {
        const float* qr = qf + r * dim;
        __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(qr), k[0]);
        for (int c = 1; c < B; ++c) sum = _mm512_fmadd_ps(_mm512_loadu_ps(qr + c * kLanes), k[c], sum);
        _mm512_storeu_ps(part + (r * kLanes + j) * kLanes, sum);
      }
    }
    const __mmask16 tail = static_cast<__mmask16>((1u << n) - 1);
    for (int64_t r = 0; r < rows; ++r) {
      const __m128i allowed = _mm_maskz_loadu_epi8(tail, mask + ((r0 + r) / group) * length + l0);
      const __mmask16 keep = _mm_test_epi8_mask(allowed, allowed);
      const __m512 sums = _mm512_mask_mov_ps(minus_inf, keep, reduce16(part + r * kLanes * kLanes));
      _mm512_mask_storeu_ps(scores + r * length + l0, tail, sums);
    }
  }
}

// acc [RB rows, blocks c0 .. c0 + CB) += probabilities [RB, L] x values [L, those blocks], the accumulators held in
// registers over all L keys (each value block widened once for the RB rows). A key whose probability is zero for
// all RB rows is skipped, so what a masked slot holds never reaches the output.
template <int CB, int RB, typename T>
TS_AVX512 void values_block(const float* probs, int64_t length, const T* v_cache, int64_t slot_stride,
                            const int64_t* slots, int64_t c0, float* acc, int64_t dim) {
  __m512 a[RB][CB];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < CB; ++c) a[r][c] = _mm512_setzero_ps();
  for (int64_t l = 0; l < length; ++l) {
    const T* value = v_cache + slots[l] * slot_stride + c0 * kLanes;
    if (l + kAhead < length) prefetch_row<CB, T>(v_cache + slots[l + kAhead] * slot_stride + c0 * kLanes);
    bool attended = false;  // a key no row attends (padding: slot 0, another request's) is never read: 0 x NaN
    for (int r = 0; r < RB; ++r) attended |= probs[r * length + l] != 0.f;
    if (!attended) continue;
    __m512 p[RB];
    for (int r = 0; r < RB; ++r) p[r] = _mm512_set1_ps(probs[r * length + l]);
    for (int c = 0; c < CB; ++c) {
      const __m512 v = load16(value + c * kLanes);
      for (int r = 0; r < RB; ++r) a[r][c] = _mm512_fmadd_ps(p[r], v, a[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < CB; ++c) _mm512_storeu_ps(acc + r * dim + (c0 + c) * kLanes, a[r][c]);
}

// acc [rows, 16 B] = probabilities [rows, L] x values [L, 16 B]: column strips of at most 8 blocks, rows in
// register blocks that keep about 24 of the 32 vector registers as accumulators.
template <int B, typename T>
TS_AVX512 void values_fixed(const float* probs, int64_t rows, int64_t length, const T* v_cache, int64_t slot_stride,
                            const int64_t* slots, float* acc) {
  constexpr int CB = B < 8 ? B : 8;
  constexpr int RB = 24 / CB;
  constexpr int64_t dim = B * kLanes;
  for (int64_t c0 = 0; c0 < B; c0 += CB) {
    int64_t r = 0;
    for (; r + RB <= rows; r += RB)
      values_block<CB, RB, T>(probs + r * length, length, v_cache, slot_stride, slots, c0, acc + r * dim, dim);
    for (; r < rows; ++r)
      values_block<CB, 1, T>(probs + r * length, length, v_cache, slot_stride, slots, c0, acc + r * dim, dim);
  }
}

// The rows [r0, r1) of one KV head's query rows (row r: query r / group of head h0 + r % group) against its L keys:
// every key and value is widened once for all the rows that share it. Head dimensions of 32, 64, 128 and 256 take
// the register-blocked phases above; others a loop over 16-lane blocks. scratch: R * L scores, R * D
// accumulators, R * D scaled queries, and R * 256 partial sums.
template <typename T>
TS_AVX512 void attend_kv_head(const T* q, int64_t q_stride, int64_t group, const T* k_cache, const T* v_cache,
                              int64_t slot_stride, const int64_t* slots, const bool* mask, int64_t r0, int64_t r1,
                              int64_t length, int64_t dim, float scale, float* qf, float* scores, float* acc,
                              float* part, T* out) {
  const int64_t rows = r1 - r0, blocks = dim / kLanes;
  const float minus_inf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = r0 + r;
    const T* src = q + (row / group) * q_stride + (row % group) * dim;
    for (int64_t c = 0; c < blocks; ++c)
      _mm512_storeu_ps(qf + r * dim + c * kLanes, _mm512_mul_ps(load16(src + c * kLanes), _mm512_set1_ps(scale)));
  }
  const auto fixed = [&](auto b) {
    constexpr int B = decltype(b)::value;
    scores_fixed<B, T>(qf, rows, r0, group, k_cache, slot_stride, slots, mask, length, part, scores);
    softmax_rows(scores, rows, length);
    values_fixed<B, T>(scores, rows, length, v_cache, slot_stride, slots, acc);
  };
  switch (blocks) {
    case 2: fixed(std::integral_constant<int, 2>{}); break;
    case 4: fixed(std::integral_constant<int, 4>{}); break;
    case 8: fixed(std::integral_constant<int, 8>{}); break;
    case 16: fixed(std::integral_constant<int, 16>{}); break;
    default: {
      for (int64_t l = 0; l < length; ++l) {
        const T* key = k_cache + slots[l] * slot_stride;
        for (int64_t r = 0; r < rows; ++r) {
          if (!mask[((r0 + r) / group) * length + l]) {
            scores[r * length + l] = minus_inf;
            continue;
          }
          __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(qf + r * dim), load16(key));
          for (int64_t c = 1; c < blocks; ++c)
            sum = _mm512_fmadd_ps(_mm512_loadu_ps(qf + r * dim + c * kLanes), load16(key + c * kLanes), sum);
          scores[r * length + l] = _mm512_reduce_add_ps(sum);
        }
      }
      softmax_rows(scores, rows, length);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < blocks; ++c) _mm512_storeu_ps(acc + r * dim + c * kLanes, _mm512_setzero_ps());
      for (int64_t l = 0; l < length; ++l) {
        const T* value = v_cache + slots[l] * slot_stride;
        for (int64_t r = 0; r < rows; ++r) {
          const float p = scores[r * length + l];
          if (p == 0.f) continue;
          const __m512 pv = _mm512_set1_ps(p);
          for (int64_t c = 0; c < blocks; ++c) {
            float* a = acc + r * dim + c * kLanes;
            _mm512_storeu_ps(a, _mm512_fmadd_ps(pv, load16(value + c * kLanes), _mm512_loadu_ps(a)));
          }
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = r0 + r;
    T* dst = out + (row / group) * q_stride + (row % group) * dim;
    for (int64_t d = 0; d < dim; ++d) narrow(acc[r * dim + d], dst + d);
  }
}

bool has_avx512() {  // TURBOSPEC_NO_AVX512 (TURBOSPEC_CPU_PATH=avx2): the portable loop, as a CPU without it runs
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") &&
                          std::getenv("TURBOSPEC_NO_AVX512") == nullptr;
  return yes;
}
#else
bool has_avx512() { return false; }
#endif

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
         const at::Tensor& mask, double scale, at::Tensor& out) {
  const int64_t batch = q.size(0), num_q = q.size(1), q_heads = q.size(2), dim = q.size(3);
  const int64_t kv_heads = k_cache.size(1), length = slots.size(1), group = q_heads / kv_heads;
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const bool* mp = mask.data_ptr<bool>();
  T* op = out.data_ptr<T>();
  const int64_t q_stride = q_heads * dim, slot_stride = kv_heads * dim;
#if defined(__x86_64__) && defined(__GNUC__)
  if (has_avx512()) {
    // a task: some of one (sequence, KV head)'s query rows; at least two tasks per thread where rows allow
    const int64_t rows = group * num_q, heads = batch * kv_heads;
    const int64_t chunks = std::min(rows, std::max<int64_t>(1, (2 * at::get_num_threads() + heads - 1) / heads));
    const int64_t per_chunk = (rows + chunks - 1) / chunks;
    at::parallel_for(0, heads * chunks, 1, [&](int64_t t0, int64_t t1) {
      std::vector<float> qf(per_chunk * dim), scores(per_chunk * length), acc(per_chunk * dim),
          part(per_chunk * kLanes * kLanes);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t b = t / (kv_heads * chunks), h = (t / chunks) % kv_heads, chunk = t % chunks;
        const int64_t r0 = chunk * per_chunk, r1 = std::min(rows, r0 + per_chunk);
        if (r0 >= r1) continue;
        const int64_t offset = (b * num_q * q_heads + h * group) * dim;
        attend_kv_head<T>(qp + offset, q_stride, group, kp + h * dim, vp + h * dim, slot_stride, sp + b * length,
                          mp + b * num_q * length, r0, r1, length, dim, static_cast<float>(scale), qf.data(),
                          scores.data(), acc.data(), part.data(), op + offset);
      }
    });
    return;
  }
#endif
  at::parallel_for(0, batch * q_heads, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores(num_q * length), acc(num_q * dim);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / q_heads, h = t % q_heads, offset = (b * num_q * q_heads + h) * dim;
      attend<T>(qp + offset, q_stride, kp + (h / group) * dim, vp + (h / group) * dim, slot_stride,
                sp + b * length, mp + b * num_q * length, num_q, length, dim, static_cast<float>(scale),
                scores.data(), acc.data(), op + offset, q_stride);
    }
  });
}

at::Tensor short_query_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& slots_in, const at::Tensor& mask_in, double scale) {
  TORCH_CHECK(q_in.dim() == 4, "short_query_attention: q must be [B, Q, Hq, D]");
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "short_query_attention: k/v caches must be contiguous [slots, Hkv, D] of one shape");
  const int64_t batch = q_in.size(0), num_q = q_in.size(1), q_heads = q_in.size(2), dim = q_in.size(3);
  TORCH_CHECK(k_cache.size(2) == dim && q_heads % k_cache.size(1) == 0,
              "short_query_attention: head dims differ or query heads are not a multiple of kv heads");
  TORCH_CHECK(dim % kLanes == 0 && dim <= kMaxHeadDim && num_q <= 16,
              "short_query_attention: head dim must be a multiple of 16 up to 512, queries at most 16");
  TORCH_CHECK(q_in.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "short_query_attention: q and the caches must share a dtype");
  TORCH_CHECK(slots_in.dim() == 2 && slots_in.size(0) == batch && slots_in.scalar_type() == at::kLong,
              "short_query_attention: slots must be int64 [B, L]");
  const int64_t length = slots_in.size(1);
  TORCH_CHECK(mask_in.dim() == 3 && mask_in.size(0) == batch && mask_in.size(1) == num_q && mask_in.size(2) == length &&
                  mask_in.scalar_type() == at::kBool,
              "short_query_attention: mask must be bool [B, Q, L]");
  const at::Tensor q = q_in.contiguous(), slots = slots_in.contiguous(), mask = mask_in.contiguous();
  at::Tensor out = at::empty_like(q);
  if (q.numel() == 0) return out;
  if (q.scalar_type() == at::kBFloat16)
    run<at::BFloat16>(q, k_cache, v_cache, slots, mask, scale, out);
  else if (q.scalar_type() == at::kFloat)
    run<float>(q, k_cache, v_cache, slots, mask, scale, out);
  else
    TORCH_CHECK(false, "short_query_attention: bfloat16 or float32 only, got ", q.scalar_type());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(turbospec, m) {
  m.def("short_query_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor mask, float scale) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(turbospec, CPU, m) { m.impl("short_query_attention", &short_query_attention); }
