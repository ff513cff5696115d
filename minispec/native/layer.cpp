// A Llama model's decoder layers for CPUs in one call, float32 or quantized: what models/llama.py's
// TransformerBlocks compute, products through qlinear.cpp's or flinear.cpp's kernel, attention through
// attention.cpp's; and RMSNorm alone, which the modules use too. Why: an eager decode step of a small
// model is mostly PyTorch's small operations between its products, each a few microseconds of dispatch.
//
// The same numbers as the modules, bit for bit: RMSNorm is this file's in both, silu is PyTorch's, and
// the rest is the modules' arithmetic in their order, each product rounded (no fused multiply-adds).
// Every row's norm, rotation and activation is a loop over that row alone: row invariance holds.

#include "native.h"

// PyTorch's elementwise operations round each product, which a fused multiply-add would not.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace minispec {
namespace {

constexpr int64_t PER_LINEAR = 5;  // qweight, scales, offsets, steps, bias
constexpr int64_t ELEMENTWISE_ROW_MULTIPLE = 64;  // kernels.py's

// y = w * (x * rsqrt(mean(x^2) + eps)) over one row of D floats, as RMSNorm computes it.
void rms_norm(const float* x, const float* w, float eps, int64_t D, float* y) {
  Vector part = {};
  int64_t i = 0;
  for (; i + LANES <= D; i += LANES) {
    Vector v;
    std::memcpy(&v, x + i, sizeof v);
    part += v * v;
  }
  float rest = 0.f;
  for (; i < D; ++i) rest += x[i] * x[i];
  float total = 0.f;  // the lanes in order: a fixed order for every row
  for (int64_t c = 0; c < LANES; ++c) total += part[c];
  const float inverse = 1.f / std::sqrt((total + rest) / static_cast<float>(D) + eps);
  for (i = 0; i < D; ++i) y[i] = w[i] * (x[i] * inverse);
}

// x [..., D] float32, weight [D] float32 -> RMSNorm of each row: models/base.py's RMSNorm on CPUs.
at::Tensor rms_norm_rows(const at::Tensor& input, const at::Tensor& w, double eps) {
  TORCH_CHECK(input.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && w.dim() == 1 &&
                  input.size(-1) == w.size(0) && w.is_contiguous(),
              "rms_norm: x [..., D] and weight [D] must be float32");
  const at::Tensor x = input.contiguous();
  const int64_t D = x.size(-1), M = D ? x.numel() / D : 0;
  at::Tensor y = at::empty_like(x);
  const float *in = x.data_ptr<float>(), *weight = w.data_ptr<float>();
  float* out = y.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, 65536 / D), [&](int64_t first, int64_t last) {
    for (int64_t m = first; m < last; ++m) rms_norm(in + m * D, weight, static_cast<float>(eps), D, out + m * D);
  });
  return y;
}

// A linear layer: quantized (qlinear's packed form, group > 0), or float32 (flinear's, group 0).
struct Linear {
  at::Tensor qweight;
  Optional scales, offsets, steps, bias;
  int64_t group, features;  // features: the output width before padding to the kernel's tiles
};

// Linear layer i of the layer whose tensors start at `first` in the flat list, with its group and width.
Linear linear_at(const c10::List<Optional>& tensors, int64_t first, int64_t i, int64_t group, int64_t features) {
  const int64_t at = first + i * PER_LINEAR;
  return {tensors.get(at).value(), tensors.get(at + 1), tensors.get(at + 2), tensors.get(at + 3),
          tensors.get(at + 4), group, features};
}

// x [M, K] -> [M, N (quantized: padded to tiles)], the first `features` columns with the bias added.
at::Tensor apply(const Linear& l, const at::Tensor& x) {
  if (l.group == 0) return flinear(x, l.qweight, l.bias, l.features);
  at::Tensor y = qlinear(x, l.qweight, *l.scales, l.offsets, l.steps, l.group);
  if (l.bias.has_value()) {
    const float* bias = l.bias->data_ptr<float>();
    float* out = y.data_ptr<float>();
    const int64_t M = y.size(0), N = y.size(1);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < l.features; ++n) out[m * N + n] += bias[n];
  }
  return y;
}

// stream [M, D] += y's first D columns (y [M, N >= D]: a product padded to the kernel's tiles).
void add_rows(float* stream, const at::Tensor& y, int64_t M, int64_t D) {
  const float* rows = y.data_ptr<float>();
  const int64_t N = y.size(1);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t i = 0; i < D; ++i) stream[m * D + i] += rows[m * N + i];
}

// One layer: its norms (attention_norm none for EAGLE-1's layer; hidden_norm for EAGLE-3's, whose x
// [B, T, 2D] is [embedding, state], each normed for attention, the state the residual: heads/eagle3.py),
// its linear layers, heads, cache [rows, n_kv_heads, S, head_dim] float32 and attention mask.
struct Layer {
  Optional attention_norm;
  at::Tensor ffn_norm;
  Optional hidden_norm;
  bool norm_before_residual;
  Linear qkv_proj, out_proj, gate_up, down;
  int64_t n_heads, n_kv_heads;
  at::Tensor k_cache, v_cache;
  at::Tensor mask;
};

// What a forward shares between its layers: cos, sin [T or B x T, head_dim] (llama.py's rope_tables at
// the tokens' positions); input_pos int64 [T] or [B, T], batch row b at cache row first_row + b; slots.
struct Forward {
  const at::Tensor& cos;
  const at::Tensor& sin;
  int64_t first_row;
  const at::Tensor& input_pos;
  const Optional& slots;
  double eps, scale;
};

// x [B, T, D] float32 (EAGLE-3's [B, T, 2D]) -> the layer's output [B, T, D]. owned: nothing else reads
// x, so the residual adds go into it. The mask: additive float32 [R, P] or [B, R, P] (query_rows_mask).
at::Tensor layer_forward(const at::Tensor& x, const Layer& l, const Forward& f, bool owned) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat, "llama_layers: x must be float32 [B, T, D]");
  const int64_t B = x.size(0), T = x.size(1), M = B * T, D = l.hidden_norm.has_value() ? x.size(2) / 2 : x.size(2);
  TORCH_CHECK(!l.hidden_norm.has_value() || (l.attention_norm.has_value() && x.size(2) == 2 * D),
              "llama_layers: EAGLE-3's layer takes [embedding, state] and norms both");
  const int64_t heads = l.n_heads + 2 * l.n_kv_heads, group = l.n_heads / l.n_kv_heads;
  const int64_t hd = l.qkv_proj.features / heads, half = hd / 2;
  TORCH_CHECK(hd * heads == l.qkv_proj.features && hd % 2 == 0 && l.out_proj.features == D && l.down.features == D,
              "llama_layers: the projections do not match the heads");
  TORCH_CHECK(l.k_cache.scalar_type() == at::kFloat && l.k_cache.is_contiguous() && l.v_cache.is_contiguous() &&
                  l.k_cache.sizes() == l.v_cache.sizes() && l.k_cache.size(1) == l.n_kv_heads &&
                  l.k_cache.size(3) == hd && f.first_row + B <= l.k_cache.size(0),
              "llama_layers: the caches must be float32 [rows, n_kv_heads, S, head_dim], contiguous");
  TORCH_CHECK(f.cos.is_contiguous() && f.sin.is_contiguous() && f.cos.size(-1) == hd &&
                  f.cos.numel() == f.sin.numel() && (f.cos.numel() == T * hd || f.cos.numel() == M * hd),
              "llama_layers: cos and sin must be [T or B x T, head_dim], contiguous");
  TORCH_CHECK(f.input_pos.scalar_type() == at::kLong && f.input_pos.is_contiguous() &&
                  (f.input_pos.numel() == T || f.input_pos.numel() == M),
              "llama_layers: input_pos must be int64 [T] or [B, T]");
  const int64_t I = l.gate_up.features / 2;

  const at::Tensor input = x.reshape({M, x.size(2)});
  at::Tensor residual, attention_input;
  if (l.hidden_norm.has_value()) {
    const at::Tensor state = input.narrow(1, D, D), normed_state = rms_norm_rows(state, *l.hidden_norm, f.eps);
    attention_input = at::cat({rms_norm_rows(input.narrow(1, 0, D), *l.attention_norm, f.eps), normed_state}, 1);
    residual = (l.norm_before_residual ? normed_state : state).clone(at::MemoryFormat::Contiguous);
  } else {
    residual = owned && input.is_contiguous() ? input : input.clone(at::MemoryFormat::Contiguous);
    attention_input = l.attention_norm.has_value() ? rms_norm_rows(residual, *l.attention_norm, f.eps) : residual;
  }
  float* stream = residual.data_ptr<float>();

  // attention: q rotated into [B, n_kv_heads, group x T, hd] (as base.py's Attention), k and v into the cache
  const at::Tensor qkv = apply(l.qkv_proj, attention_input);
  at::Tensor q = at::empty({B, l.n_kv_heads, group * T, hd}, x.options());
  const float *projected = qkv.data_ptr<float>(), *cosines = f.cos.data_ptr<float>();
  const float* sines = f.sin.data_ptr<float>();
  const int64_t* positions = f.input_pos.data_ptr<int64_t>();
  float *queries = q.data_ptr<float>(), *keys = l.k_cache.data_ptr<float>(), *values = l.v_cache.data_ptr<float>();
  const int64_t S = l.k_cache.size(2), N = qkv.size(1);
  // query head h's row for token t, in q and in attention's output
  auto query_row = [&](int64_t b, int64_t h, int64_t t) {
    return ((b * l.n_kv_heads + h / group) * group * T + (h % group) * T + t) * hd;
  };
  for (int64_t m = 0; m < M; ++m) {
    const int64_t b = m / T, t = m % T;
    const float* row = projected + m * N;
    const float* c = cosines + (f.cos.numel() == T * hd ? t : m) * hd;
    const float* s = sines + (f.cos.numel() == T * hd ? t : m) * hd;
    const int64_t position = positions[f.input_pos.numel() == T ? t : m];
    TORCH_CHECK(0 <= position && position < S, "llama_layers: a position outside the cache");
    for (int64_t h = 0; h < l.n_heads + l.n_kv_heads; ++h) {
      const float* in = row + h * hd;
      float* out = h < l.n_heads
          ? queries + query_row(b, h, t)
          : keys + (((f.first_row + b) * l.n_kv_heads + h - l.n_heads) * S + position) * hd;
      // x1 cos - x2 sin, x2 cos + x1 sin: the halves swapped times the signed sines (llama.py's apply_rope)
      for (int64_t i = 0; i < hd; ++i) out[i] = in[i] * c[i] + in[(i + half) % hd] * s[i];
    }
    for (int64_t h = 0; h < l.n_kv_heads; ++h)
      std::memcpy(values + (((f.first_row + b) * l.n_kv_heads + h) * S + position) * hd,
                  row + (l.n_heads + l.n_kv_heads + h) * hd, hd * sizeof(float));
  }
  at::Tensor mask4 = l.mask.dim() == 2 ? l.mask.expand({B, l.n_kv_heads, l.mask.size(0), l.mask.size(1)})
                                     : l.mask.unsqueeze(1).expand({B, l.n_kv_heads, l.mask.size(1), l.mask.size(2)});
  const at::Tensor attended = attend(q, l.k_cache.narrow(0, f.first_row, B), l.v_cache.narrow(0, f.first_row, B),
                                     mask4, f.slots, f.scale);
  // back to [M, n_heads x hd], head h = j x group + g of K/V head j
  at::Tensor heads_out = at::empty({M, l.n_heads * hd}, x.options());
  const float* a = attended.data_ptr<float>();
  float* o = heads_out.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const int64_t b = m / T, t = m % T;
    for (int64_t h = 0; h < l.n_heads; ++h)
      std::memcpy(o + (m * l.n_heads + h) * hd, a + query_row(b, h, t), hd * sizeof(float));
  }
  add_rows(stream, apply(l.out_proj, heads_out), M, D);

  // SwiGLU: w2(silu(gate) * up), gate and up the two halves of w13's output
  const at::Tensor gu = apply(l.gate_up, rms_norm_rows(residual, l.ffn_norm, f.eps));
  // PyTorch's silu, its rows padded as kernels.elementwise pads them
  const int64_t pad = (ELEMENTWISE_ROW_MULTIPLE - I % ELEMENTWISE_ROW_MULTIPLE) % ELEMENTWISE_ROW_MULTIPLE;
  at::Tensor activated = pad ? at::silu(at::constant_pad_nd(gu.narrow(1, 0, I), {0, pad})).narrow(1, 0, I).contiguous()
                             : at::silu(gu.narrow(1, 0, I)).contiguous();
  const float* up = gu.data_ptr<float>() + I;
  float* act = activated.data_ptr<float>();
  const int64_t G = gu.size(1);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t i = 0; i < I; ++i) act[m * I + i] *= up[m * G + i];
  add_rows(stream, apply(l.down, activated), M, D);
  return residual.view({B, T, D});
}

constexpr int64_t TENSORS_PER_LAYER = 3 + 4 * PER_LINEAR;  // attention_norm, ffn_norm, hidden_norm, 4 linears
constexpr int64_t NUMBERS_PER_LAYER = 12;  // norm_before_residual, 4 groups, 4 widths, n_heads, n_kv_heads, mask

// Every layer of a stack in one call (native/layers.py lays them out): per layer TENSORS_PER_LAYER tensors,
// its k and v caches, NUMBERS_PER_LAYER numbers (the last: which of `masks` it reads). taps: the layers
// whose input state is returned too, in increasing order. -> [the last layer's output, the tapped states].
std::vector<at::Tensor> llama_layers(const at::Tensor& x, const c10::List<Optional>& tensors, at::TensorList caches,
                                     at::IntArrayRef numbers, double eps, const at::Tensor& cos, const at::Tensor& sin,
                                     int64_t first_row, const at::Tensor& input_pos, at::TensorList masks,
                                     const Optional& slots, double scale, at::IntArrayRef taps) {
  const int64_t layers = static_cast<int64_t>(caches.size()) / 2;
  TORCH_CHECK(static_cast<int64_t>(tensors.size()) == layers * TENSORS_PER_LAYER &&
                  static_cast<int64_t>(numbers.size()) == layers * NUMBERS_PER_LAYER,
              "llama_layers: the tensors, caches and numbers do not describe the same layers");
  const Forward f{cos, sin, first_row, input_pos, slots, eps, scale};
  std::vector<at::Tensor> out{x};
  size_t tap = 0;
  for (int64_t i = 0; i < layers; ++i) {
    const bool tapped = tap < taps.size() && taps[tap] == i;
    if (tapped) out.push_back(out[0]), ++tap;
    const int64_t t = i * TENSORS_PER_LAYER;
    const int64_t* n = numbers.data() + i * NUMBERS_PER_LAYER;
    TORCH_CHECK(0 <= n[11] && n[11] < static_cast<int64_t>(masks.size()), "llama_layers: a layer's mask is missing");
    const Layer l{tensors.get(t), tensors.get(t + 1).value(), tensors.get(t + 2), n[0] != 0,
                  linear_at(tensors, t + 3, 0, n[1], n[5]), linear_at(tensors, t + 3, 1, n[2], n[6]),
                  linear_at(tensors, t + 3, 2, n[3], n[7]), linear_at(tensors, t + 3, 3, n[4], n[8]),
                  n[9], n[10], caches[2 * i], caches[2 * i + 1], masks[n[11]]};
    out[0] = layer_forward(out[0], l, f, i > 0 && !tapped);  // a tapped state is returned as it is
  }
  if (tap < taps.size() && taps[tap] == layers) out.push_back(out[0]);
  return out;
}

}  // namespace
}  // namespace minispec

TORCH_LIBRARY_FRAGMENT(minispec_native, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("llama_layers(Tensor x, Tensor?[] tensors, Tensor(a!)[] caches, int[] numbers, float eps, Tensor cos, "
        "Tensor sin, int first_row, Tensor input_pos, Tensor[] masks, Tensor? slots, float scale, int[] taps) "
        "-> Tensor[]");
}

TORCH_LIBRARY_IMPL(minispec_native, CPU, m) {
  m.impl("rms_norm", &minispec::rms_norm_rows);
  m.impl("llama_layers", &minispec::llama_layers);
}
