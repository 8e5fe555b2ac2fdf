// One Llama / Qwen2 decoder layer in one call, for steps of a few rows (decodes and verification windows) whose
// linears all run packed records (amx_grouped.cpp / records_dpbf16.cpp) and whose attention runs the fused
// short-query kernel (short_attention.cpp).
//
// Why: a 1.5B model's decode step on a 2-core CPU spends ~30 ms in its products and, run layer by layer from
// Python, about 70 further operator calls per layer (views, slices, allocations, the norm, the rotary, the KV
// write, silu, mul, cat, add): ~2,000 calls a step at a few microseconds each from Python, 15-20% of the step.
// From C++ the same calls cost a fraction of that (no Python frames, no argument parsing, no nn.Module hooks).
//
// It computes exactly what models/llama.py's DecoderLayer computes on that path, calling the same operators in the
// same order (our kernels through the dispatcher, torch's through ATen), so the result is the same bits.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace {

using Product = at::Tensor(const at::Tensor&, const at::Tensor&);

// The typed handle of one of our record products ("turbospec::dpbf16_int4_mm", ...), looked up once per name.
const c10::TypedOperatorHandle<Product>& product_op(const std::string& name) {
  static std::unordered_map<std::string, c10::TypedOperatorHandle<Product>> handles;
  static std::mutex lock;
  std::lock_guard<std::mutex> guard(lock);
  auto it = handles.find(name);
  if (it == handles.end())
    it = handles.emplace(name, c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "").typed<Product>()).first;
  return it->second;
}

// x @ W^T for W held as parts (output rows in order), each run by its product; + bias when given.
at::Tensor linear(const at::Tensor& x, const std::vector<std::string>& ops, const at::TensorList data,
                  const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(!ops.empty() && ops.size() == data.size(), "decoder_layer: a linear needs one product per part");
  std::vector<at::Tensor> outs;
  outs.reserve(ops.size());
  for (size_t i = 0; i < ops.size(); ++i) outs.push_back(product_op(ops[i]).call(x, data[i]));
  at::Tensor y = outs.size() == 1 ? outs[0] : at::cat(outs, -1);
  return bias.has_value() ? at::add(y, bias->to(y.scalar_type())) : y;
}

std::vector<std::string> split_names(const std::string& joined) {
  std::vector<std::string> names;
  size_t start = 0;
  while (start <= joined.size()) {
    const size_t end = joined.find(',', start);
    names.push_back(joined.substr(start, end == std::string::npos ? std::string::npos : end - start));
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return names;
}

template <typename Signature>
c10::TypedOperatorHandle<Signature> ours(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// products: the four linears' part products, "name,name|name|...": qkv | o | gate_up | down.
// weights: the parts' records in that order. groups: the step's attention groups, with their cache slots [B, L] and
// mask [B, Q, L]; a group is either the contiguous slice [start, start + B * Q) of the rows (its gather and scatter
// empty) or, when its sequences' query counts differ, padded: gather [B * Q] names the row each query reads (padding
// repeats a sequence's last row) and scatter [2, n] maps the padded outputs kept (row 0) to the rows they fill (row 1).
at::Tensor decoder_layer(const at::Tensor& x, const at::Tensor& input_norm, const at::Tensor& mlp_norm, double eps,
                         const std::string& products, at::TensorList weights, const c10::optional<at::Tensor>& qkv_bias,
                         const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& slot_mapping, at::IntArrayRef group_starts, at::TensorList group_gathers,
                         at::TensorList group_scatters, at::TensorList group_slots, at::TensorList group_masks,
                         double scale) {
  static const auto rms_norm = ours<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("turbospec::rms_norm");
  static const auto add_rms_norm =
      ours<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>(
          "turbospec::add_rms_norm");
  static const auto rotary =
      ours<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>("turbospec::rotary");
  static const auto attention = ours<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                const at::Tensor&, const at::Tensor&, double)>(
      "turbospec::short_query_attention");

  // "a,b|c|d|e" -> the four linears' product names, and where each one's records start in `weights`
  std::vector<std::vector<std::string>> names;
  {
    size_t start = 0;
    for (int i = 0; i < 4; ++i) {
      const size_t end = products.find('|', start);
      TORCH_CHECK((end == std::string::npos) == (i == 3), "decoder_layer: products must name four linears");
      names.push_back(split_names(products.substr(start, end == std::string::npos ? std::string::npos : end - start)));
      start = end + 1;
    }
  }
  size_t used = 0;
  std::vector<at::TensorList> parts;
  for (const auto& n : names) {
    TORCH_CHECK(used + n.size() <= weights.size(), "decoder_layer: fewer weights than products");
    parts.push_back(weights.slice(used, n.size()));
    used += n.size();
  }
  TORCH_CHECK(used == weights.size(), "decoder_layer: more weights than products");
  const size_t num_groups = group_slots.size();
  TORCH_CHECK(group_starts.size() == num_groups && group_gathers.size() == num_groups &&
                  group_scatters.size() == num_groups && group_masks.size() == num_groups,
              "decoder_layer: one start, gather, scatter, slot table and mask per attention group");

  const int64_t rows = x.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  // attention
  const at::Tensor qkv = linear(rms_norm.call(x, input_norm, eps), names[0], parts[0], qkv_bias);
  const at::Tensor qk = rotary.call(qkv.narrow(1, 0, q_size + kv_size).view({rows, num_heads + num_kv_heads, head_dim}),
                                    cos, sin);
  const at::Tensor q = qk.narrow(1, 0, num_heads), k = qk.narrow(1, num_heads, num_kv_heads);
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({rows, num_kv_heads, head_dim});
  at::Tensor kc = k_cache, vc = v_cache;
  kc.index_copy_(0, slot_mapping, k);
  vc.index_copy_(0, slot_mapping, v);
  at::Tensor attended = at::empty({rows, q_size}, q.options());
  for (size_t g = 0; g < num_groups; ++g) {
    const int64_t batch = group_slots[g].size(0), queries = group_masks[g].size(1), start = group_starts[g];
    const bool padded = group_gathers[g].numel() > 0;
    const at::Tensor qg = (padded ? q.index_select(0, group_gathers[g]) : q.narrow(0, start, batch * queries))
                              .view({batch, queries, num_heads, head_dim});
    const at::Tensor og =
        attention.call(qg, k_cache, v_cache, group_slots[g], group_masks[g], scale).reshape({batch * queries, q_size});
    if (padded) {
      attended.index_copy_(0, group_scatters[g][1], og.index_select(0, group_scatters[g][0]));
    } else {
      attended.narrow(0, start, batch * queries).copy_(og);
    }
  }
  const at::Tensor o = linear(attended, names[1], parts[1], c10::nullopt);
  // MLP
  auto [residual, h] = add_rms_norm.call(x, o, mlp_norm, eps);
  const at::Tensor gate_up = linear(h, names[2], parts[2], c10::nullopt);
  const int64_t half = gate_up.size(1) / 2;
  const at::Tensor act = at::mul(at::silu(gate_up.narrow(1, 0, half)), gate_up.narrow(1, half, half));
  return at::add(residual, linear(act, names[3], parts[3], c10::nullopt));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(turbospec, m) {
  m.def("decoder_layer(Tensor x, Tensor input_norm, Tensor mlp_norm, float eps, str products, Tensor[] weights, "
        "Tensor? qkv_bias, Tensor cos, Tensor sin, int num_heads, int num_kv_heads, int head_dim, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor slot_mapping, int[] group_starts, Tensor[] group_gathers, Tensor[] group_scatters, "
        "Tensor[] group_slots, Tensor[] group_masks, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(turbospec, CPU, m) { m.impl("decoder_layer", &decoder_layer); }
