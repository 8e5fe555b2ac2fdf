// Small fused operators of a decoder layer, bf16 only: RMSNorm (optionally after the residual add) and the
// rotary embedding.
//
// Why: on the 2-core Xeon this was written on, each PyTorch operator call on a decode-sized tensor costs 3-9 us
// of dispatch, whatever its size (an add of one float: 1.5 us). The Python RMSNorm is 8 of them (about 40 us),
// the rotary 7 (about 40 us for q and k), and a 0.5B draft model runs 24 layers per token: these two alone were
// about 3 ms of a 40 ms forward (ad hoc timings). Here each is one call.
//
// Each computes what the Python code in models/layers.py computes, in the same roundings: RMSNorm in float32
// (x * 1 / sqrt(mean(x^2) + eps)), rounded to bf16, then times the bf16 weight and rounded again; the rotary in
// bf16 arithmetic, every product and sum rounded to bf16 as torch's bf16 operators do. Only the sum of squares
// is added in another order than torch's reduction, so a norm can round to the neighbouring bf16 of the Python one
// (about 1 value in 2000 in tests/test_fused_ops.py).
// Rows are independent (no result depends on the other rows of the call): the batch-invariant mode may use it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>

namespace {

// float <-> bf16 bits, round to nearest even (NaN stays NaN), written out so that the loops vectorise
inline float from_bits(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

inline uint16_t to_bits(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? static_cast<uint16_t>((u >> 16) | 0x40u) : static_cast<uint16_t>(rounded);
}

inline float round_bf16(float v) { return from_bits(to_bits(v)); }

// out row = bf16(w * bf16(x * inv_rms)); `x` one row of `d` values.
inline void norm_row(const uint16_t* x, const uint16_t* w, int64_t d, double eps, uint16_t* out) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < d; ++i) {
    const float v = from_bits(x[i]);
    sum += v * v;
  }
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(d) + static_cast<float>(eps));
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) out[i] = to_bits(from_bits(w[i]) * round_bf16(from_bits(x[i]) * inv));
}

inline const uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); }
inline uint16_t* bits_out(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); }

void check_norm_args(const at::Tensor& x, const at::Tensor& w, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, name, ": x must be bf16 [T, D]");
  TORCH_CHECK(w.dim() == 1 && w.scalar_type() == at::kBFloat16 && w.size(0) == x.size(1), name,
              ": weight must be bf16 [D]");
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w_in, double eps) {
  check_norm_args(x_in, w_in, "rms_norm");
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  at::Tensor out = at::empty_like(x);
  const int64_t d = x.size(1);
  const uint16_t* xp = bits(x);
  const uint16_t* wp = bits(w);
  uint16_t* op = bits_out(out);
  at::parallel_for(0, x.size(0), 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) norm_row(xp + r * d, wp, d, eps, op + r * d);
  });
  return out;
}

// (x + delta, rms_norm(x + delta)): the residual add of a layer and the norm after it, the sum rounded to bf16.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x_in, const at::Tensor& delta_in,
                                                const at::Tensor& w_in, double eps) {
  check_norm_args(x_in, w_in, "add_rms_norm");
  TORCH_CHECK(delta_in.sizes() == x_in.sizes() && delta_in.scalar_type() == at::kBFloat16,
              "add_rms_norm: delta must be bf16 of x's shape");
  const at::Tensor x = x_in.contiguous(), delta = delta_in.contiguous(), w = w_in.contiguous();
  at::Tensor sum = at::empty_like(x), out = at::empty_like(x);
  const int64_t d = x.size(1);
  const uint16_t* xp = bits(x);
  const uint16_t* dp = bits(delta);
  const uint16_t* wp = bits(w);
  uint16_t* sp = bits_out(sum);
  uint16_t* op = bits_out(out);
  at::parallel_for(0, x.size(0), 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) sp[r * d + i] = to_bits(from_bits(xp[r * d + i]) + from_bits(dp[r * d + i]));
      norm_row(sp + r * d, wp, d, eps, op + r * d);
    }
  });
  return {sum, out};
}

// Neox rotary of x [T, H, D] (any strides but a contiguous last dimension) with cos / sin [T, D / 2]:
// (x1 c - x2 s, x2 c + x1 s) over the two halves, in bf16 arithmetic. Returns a contiguous [T, H, D].
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos_in, const at::Tensor& sin_in) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kBFloat16 && x.stride(2) == 1, "rotary: x must be bf16 [T, H, D]");
  const int64_t t = x.size(0), h = x.size(1), d = x.size(2), half = d / 2;
  TORCH_CHECK(d % 2 == 0, "rotary: the head dimension must be even");
  const at::Tensor c = cos_in.reshape({t, half}).contiguous(), s = sin_in.reshape({t, half}).contiguous();
  TORCH_CHECK(c.scalar_type() == at::kBFloat16 && s.scalar_type() == at::kBFloat16, "rotary: tables must be bf16");
  at::Tensor out = at::empty({t, h, d}, x.options());
  const uint16_t* xp = bits(x);
  const uint16_t* cp = bits(c);
  const uint16_t* sp = bits(s);
  uint16_t* op = bits_out(out);
  const int64_t st = x.stride(0), sh = x.stride(1);
  at::parallel_for(0, t * h, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t row = i / h, head = i % h;
      const uint16_t* in = xp + row * st + head * sh;
      const uint16_t* cr = cp + row * half;
      const uint16_t* sr = sp + row * half;
      uint16_t* o = op + i * d;
#pragma omp simd
      for (int64_t j = 0; j < half; ++j) {
        const float x1 = from_bits(in[j]), x2 = from_bits(in[j + half]), cj = from_bits(cr[j]), sj = from_bits(sr[j]);
        o[j] = to_bits(round_bf16(x1 * cj) - round_bf16(x2 * sj));
        o[j + half] = to_bits(round_bf16(x2 * cj) + round_bf16(x1 * sj));
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(turbospec, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(turbospec, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary", &rotary);
}
