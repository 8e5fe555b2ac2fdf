// y = x @ W^T for W held as int8 values with one float32 scale per 16 consecutive inputs of a row:
// W[n, k] = q[n, k] * s[n, k / 16]. Q8_0 (32 int8s, one scale) and Q6_K (6-bit values, one scale per 16)
// both fit this exactly, which is why the group is 16. Built for few-row steps (decode, drafts): each
// weight row is read once from memory and reused, from L1, for every activation row.

// Registered as the torch operator turbospec::grouped_int8_mm (not a pybind function): it then shows in the torch
// profiler under its own name, and calls from Python release the GIL like any torch op.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kGroup = 16;

#if defined(__AVX512F__)
// ROWS activation rows against one weight row; ROWS is a template argument so the accumulators stay in
// registers. A multiply-add waits for the previous one into the same accumulator (4 cycles), so with fewer than
// four rows each row gets several accumulators (groups taken in turn): one accumulator made a one-row call
// latency-bound (1536x8960: 0.75 -> 0.51 ms, benchmarks/results/int8_kernel_ab/int8_kernel_ab.md).
template <int ROWS>
inline void dot_rows(const float* x, int64_t x_stride, const int8_t* q, const float* s, int64_t groups,
                     float* out, int64_t out_stride) {
  constexpr int kChains = ROWS >= 4 ? 1 : 4 / ROWS;
  __m512 acc[ROWS][kChains];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < kChains; ++c) acc[r][c] = _mm512_setzero_ps();
  int64_t g = 0;
  for (; g + kChains <= groups; g += kChains) {
    for (int c = 0; c < kChains; ++c) {
      __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (g + c) * kGroup));
      __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw)), _mm512_set1_ps(s[g + c]));
      for (int r = 0; r < ROWS; ++r)
        acc[r][c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + r * x_stride + (g + c) * kGroup), acc[r][c]);
    }
  }
  for (; g < groups; ++g) {  // groups not a multiple of the chains
    __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + g * kGroup));
    __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw)), _mm512_set1_ps(s[g]));
    for (int r = 0; r < ROWS; ++r)
      acc[r][0] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + r * x_stride + g * kGroup), acc[r][0]);
  }
  for (int r = 0; r < ROWS; ++r) {
    __m512 sum = acc[r][0];
    for (int c = 1; c < kChains; ++c) sum = _mm512_add_ps(sum, acc[r][c]);
    out[r * out_stride] = _mm512_reduce_add_ps(sum);
  }
}
#else
template <int ROWS>
inline void dot_rows(const float* x, int64_t x_stride, const int8_t* q, const float* s, int64_t groups,
                     float* out, int64_t out_stride) {
  float acc[ROWS] = {};
  for (int64_t g = 0; g < groups; ++g) {
    float w[kGroup];
    for (int i = 0; i < kGroup; ++i) w[i] = static_cast<float>(q[g * kGroup + i]) * s[g];
    for (int r = 0; r < ROWS; ++r) {
      const float* xr = x + r * x_stride + g * kGroup;
      float part = 0.f;
      for (int i = 0; i < kGroup; ++i) part += w[i] * xr[i];
      acc[r] += part;
    }
  }
  for (int r = 0; r < ROWS; ++r) out[r * out_stride] = acc[r];
}
#endif

void dot_block(const float* x, int64_t x_stride, int64_t rows, const int8_t* q, const float* s, int64_t groups,
               float* out, int64_t out_stride) {
  switch (rows) {
    case 1: return dot_rows<1>(x, x_stride, q, s, groups, out, out_stride);
    case 2: return dot_rows<2>(x, x_stride, q, s, groups, out, out_stride);
    case 3: return dot_rows<3>(x, x_stride, q, s, groups, out, out_stride);
    default: return dot_rows<4>(x, x_stride, q, s, groups, out, out_stride);
  }
}

}  // namespace

at::Tensor grouped_int8_mm(const at::Tensor& x_in, const at::Tensor& q_in, const at::Tensor& s_in) {
  TORCH_CHECK(x_in.dim() == 2 && q_in.dim() == 2 && s_in.dim() == 2, "grouped_int8_mm: 2-D tensors expected");
  TORCH_CHECK(q_in.scalar_type() == at::kChar, "grouped_int8_mm: weights must be int8");
  TORCH_CHECK(s_in.scalar_type() == at::kFloat, "grouped_int8_mm: scales must be float32");
  const int64_t rows = x_in.size(0), k = x_in.size(1), n = q_in.size(0);
  TORCH_CHECK(q_in.size(1) == k && k % kGroup == 0, "grouped_int8_mm: weight is [N, K] with K a multiple of 16");
  TORCH_CHECK(s_in.size(0) == n && s_in.size(1) == k / kGroup, "grouped_int8_mm: scales are [N, K / 16]");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const at::Tensor q = q_in.contiguous();
  const at::Tensor s = s_in.contiguous();
  at::Tensor y = at::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = s.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t groups = k / kGroup;
  at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t j = n0; j < n1; ++j) {
      for (int64_t r0 = 0; r0 < rows; r0 += 4) {
        dot_block(xp + r0 * k, k, std::min<int64_t>(4, rows - r0), qp + j * k, sp + j * groups, groups,
                  yp + r0 * n + j, n);
      }
    }
  });
  return y;
}

TORCH_LIBRARY(turbospec, m) {
  m.def("grouped_int8_mm(Tensor x, Tensor q, Tensor scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(turbospec, CPU, m) {
  m.impl("grouped_int8_mm", &grouped_int8_mm);
}
