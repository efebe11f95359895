// The small ops between a step's matmuls, one call each, for the eager CPU step. At decode every
// tensor here is one token's (a few KB), so the time is PyTorch's per-op cost, not arithmetic: the
// emitted RMSNorm is 8 ATen ops (~16 us), rope 7 (~17 us), the cache write 3 (~11 us), ~1 ms of a
// 5.7 ms step at the 191M Qwen3's shape; and the greedy pick, which ATen reads one 16-bit value at
// a time. Each function computes what the generated module's helper of the same name computes,
// rounding to the tensors' dtype where its ATen ops round (so outputs are identical but for the
// order of RMSNorm's float32 sum).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "vec.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using namespace linnet;

template <typename T>
inline T* ptr(const torch::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }

// x as T holds it, in float32: what an ATen op on T tensors writes.
template <typename T>
inline float round_to(float x) { return to_f32(from_f32<T>(x)); }

// Where row i of x [..., D] begins, for any strides of the leading axes: a view of a fused
// projection's output (q split from one [.., 4096] row, as heads) reads in place.
struct Rows {
  int64_t n = 0, d = 0;
  std::vector<int64_t> sizes, strides;  // the leading axes
  int64_t offset(int64_t i) const {
    int64_t at = 0;
    for (int64_t a = (int64_t)sizes.size() - 1; a >= 0; --a) at += (i % sizes[a]) * strides[a], i /= sizes[a];
    return at;
  }
};

Rows rows_of(const torch::Tensor& x) {
  Rows r;
  r.d = x.size(-1);
  r.n = r.d ? x.numel() / r.d : 0;
  for (int64_t a = 0; a + 1 < x.dim(); ++a) r.sizes.push_back(x.size(a)), r.strides.push_back(x.stride(a));
  return r;
}

constexpr int LANES = 16;  // partial sums per row: 16 / kW vectors (one AVX-512 register)

// Lane l sums the squares of x[j] for j = l mod 16 in order, and the lanes are added 0..15: the
// order the scalar loop of an earlier version kept, so every level's vector loop rounds as it did.
template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, const Rows& r, float eps) {
  constexpr int V = LANES / kW;
  at::parallel_for(0, r.n, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      const T* xi = x + r.offset(i);
      T* oi = out + i * r.d;
      Vf squares[V];
      for (int v = 0; v < V; ++v) squares[v] = zero();
      int64_t j = 0;
      for (; j + LANES <= r.d; j += LANES)
        for (int v = 0; v < V; ++v) {
          const Vf x_v = load(xi + j + v * kW);
          squares[v] = add(squares[v], mul(x_v, x_v));
        }
      float lanes[LANES];
      for (int v = 0; v < V; ++v) store(lanes + v * kW, squares[v]);
      for (; j < r.d; ++j) {
        const float v = to_f32(xi[j]);
        lanes[j % LANES] += v * v;
      }
      float sum = 0.f;
      for (int l = 0; l < LANES; ++l) sum += lanes[l];
      const float scale = 1.f / std::sqrt(sum / static_cast<float>(r.d) + eps);
      const Vf scales = set1(scale);
      for (j = 0; j + kW <= r.d; j += kW)  // (x * scale) as T, times the weight in T
        store(oi + j, mul(load(w + j), rounded(mul(load(xi + j), scales), xi)));
      for (; j < r.d; ++j) oi[j] = from_f32<T>(to_f32(w[j]) * round_to<T>(to_f32(xi[j]) * scale));
    }
  });
}

}  // namespace

// x [..., D] (D contiguous, leading axes at any stride) with weight [D] -> [..., D] contiguous:
// x / rms(x) * weight, the statistics in float32, as the generated `rms_norm`; its ATen ops
// where the kernel does not apply (another weight dtype or shape).
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  const bool fits = x.dim() >= 1 && x.stride(-1) == 1 && weight.dim() == 1 && weight.size(0) == x.size(-1) &&
                    weight.is_contiguous() && weight.scalar_type() == x.scalar_type() &&
                    at::isFloatingType(x.scalar_type()) && x.scalar_type() != at::kDouble;
  if (!fits) {
    auto x32 = x.to(at::kFloat);
    x32 = x32 * at::rsqrt(x32.pow(2).mean(-1, true) + eps);
    return weight * x32.to(x.scalar_type());
  }
  const Rows r = rows_of(x);
  auto out = torch::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>)
      rms_norm_rows<scalar_t>(ptr<scalar_t>(x), ptr<scalar_t>(weight), ptr<scalar_t>(out), r, float(eps));
  });
  return out;
}

namespace {

// x * cos + rotate_half(x) * sin for j in [j0, j1), rotate_half(x)[j] = sign * x[j + shift]; each
// product rounded to T, as the ATen ops round.
template <typename T>
inline void rotate(const T* xi, const T* c, const T* s, T* oi, int64_t j0, int64_t j1, int64_t shift, float sign) {
  int64_t j = j0;
  const Vf signs = set1(sign);
  for (; j + kW <= j1; j += kW) {
    const Vf a = rounded(mul(load(xi + j), load(c + j)), xi);
    const Vf b = rounded(mul(mul(signs, load(xi + j + shift)), load(s + j)), xi);
    store(oi + j, add(a, b));
  }
  for (; j < j1; ++j) {
    const float a = round_to<T>(to_f32(xi[j]) * to_f32(c[j]));
    const float b = round_to<T>(sign * to_f32(xi[j + shift]) * to_f32(s[j]));
    oi[j] = from_f32<T>(a + b);
  }
}

template <typename T>
void rope_rows(const T* x, const T* cos, const T* sin, T* out, int64_t B, int64_t T_, int64_t heads, int64_t D,
               int64_t rot, const int64_t* strides) {
  const int64_t half = rot / 2;
  at::parallel_for(0, B * T_, 16, [&](int64_t i0, int64_t i1) {  // tokens: a prompt's split between threads
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / T_, t = i % T_;
      const T* c = cos + i * rot;
      const T* s = sin + i * rot;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xi = x + b * strides[0] + t * strides[1] + h * strides[2];
        T* oi = out + (i * heads + h) * D;
        rotate(xi, c, s, oi, 0, half, half, -1.f);
        rotate(xi, c, s, oi, half, rot, -half, 1.f);
        for (int64_t j = rot; j < D; ++j) oi[j] = xi[j];
      }
    }
  });
}

}  // namespace

// Rotate-half rope on the first rot features of each head, as the generated `apply_rope`:
// x [B, T, H, D] (heads and tokens at any stride, D contiguous), cos, sin [B, T, rot] -> contiguous;
// its ATen ops where the kernel does not apply.
torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t rot = cos.size(-1);
  const bool fits = x.dim() == 4 && x.stride(3) == 1 && cos.dim() == 3 && cos.size(0) == x.size(0) &&
                    cos.size(1) == x.size(1) && cos.sizes() == sin.sizes() && rot % 2 == 0 && rot <= x.size(3) &&
                    cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == x.scalar_type() &&
                    sin.scalar_type() == x.scalar_type() && x.scalar_type() != at::kDouble;
  if (!fits) {
    const auto c = cos.unsqueeze(2), s = sin.unsqueeze(2);  // [B, T, 1, rot]
    const auto x_rot = x.narrow(-1, 0, rot), x_pass = x.narrow(-1, rot, x.size(-1) - rot);
    const auto rotated = at::cat({-x_rot.narrow(-1, rot / 2, rot - rot / 2), x_rot.narrow(-1, 0, rot / 2)}, -1);
    const auto out = x_rot * c + rotated * s;
    return x_pass.size(-1) == 0 ? out : at::cat({out, x_pass}, -1);
  }
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2), D = x.size(3);
  auto out = torch::empty({B, T, H, D}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>)
      rope_rows<scalar_t>(ptr<scalar_t>(x), ptr<scalar_t>(cos), ptr<scalar_t>(sin), ptr<scalar_t>(out), B, T, H, D,
                          rot, x.strides().data());
  });
  return out;
}

// k, v [B, T, KV, D] into caches [L, rows, KV, S, D] of `layer`, token (b, t) at row rows[b, t],
// position pos[b, t], as the generated `write_cache`; its indexed write where the kernel does not apply.
// float32 k and v into a float16 cache round to nearest even, as `.to(k_cache.dtype)` does.
void write_cache(const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& pos, const torch::Tensor& rows,
                 torch::Tensor& k_cache, torch::Tensor& v_cache, int64_t layer) {
  const bool fits = k_cache.dim() == 5 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                    v_cache.is_contiguous() && k.dim() == 4 && k.sizes() == v.sizes() &&
                    k.size(2) == k_cache.size(2) && k.size(3) == k_cache.size(4) && k.stride(3) == 1 &&
                    v.stride(3) == 1 && v.scalar_type() == k.scalar_type() &&
                    v_cache.scalar_type() == k_cache.scalar_type();
  const bool narrow = k.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kHalf && k.size(3) % kW == 0;
  if (!fits || (k.scalar_type() != k_cache.scalar_type() && !narrow)) {
    const auto layers = at::full_like(pos, layer);
    using at::indexing::Slice;
    k_cache.index_put_({layers, rows, Slice(), pos}, k.to(k_cache.scalar_type()));
    v_cache.index_put_({layers, rows, Slice(), pos}, v.to(v_cache.scalar_type()));
    return;
  }
  const int64_t L = k_cache.size(0), R = k_cache.size(1), KV = k_cache.size(2), S = k_cache.size(3),
                D = k_cache.size(4);
  TORCH_CHECK(0 <= layer && layer < L, "write_cache: layer out of range");
  const int64_t B = k.size(0), T = k.size(1);
  auto pos_c = pos.to(at::kLong).expand({B, T}).contiguous();
  auto rows_c = rows.to(at::kLong).expand({B, T}).contiguous();
  const int64_t* pp = pos_c.data_ptr<int64_t>();
  const int64_t* rp = rows_c.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * T; ++i)
    TORCH_CHECK(0 <= rp[i] && rp[i] < R && 0 <= pp[i] && pp[i] < S, "write_cache: row or position out of range");
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  const int64_t es = k.element_size(), ces = k_cache.element_size();
  const auto put = [&](char* dst, const char* src) {  // one head's D values
    if (!narrow) return (void)std::memcpy(dst, src, D * es);
    for (int64_t j = 0; j < D; j += kW) store((at::Half*)dst + j, load((const float*)src + j));
  };
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t i = b * T + t;
      for (int64_t h = 0; h < KV; ++h) {
        const int64_t at = (((layer * R + rp[i]) * KV + h) * S + pp[i]) * D * ces;
        put(kc + at, kp + (b * k.stride(0) + t * k.stride(1) + h * k.stride(2)) * es);
        put(vc + at, vp + (b * v.stride(0) + t * v.stride(1) + h * v.stride(2)) * es);
      }
    }
}

namespace {

// silu of the first r.d values of each row of x, times the next r.d (`gated`: the gate and up halves
// of one row), or alone; silu rounded to T before the product, as F.silu(gate) * up rounds.
template <typename T>
void silu_rows(const T* x, T* out, const Rows& r, bool gated) {
  for (int64_t i = 0; i < r.n; ++i) {
    const T* xi = x + r.offset(i);
    const T* ui = xi + r.d;
    T* oi = out + i * r.d;
    int64_t j = 0;
    for (; j + kW <= r.d; j += kW) {
      const Vf v = load(xi + j);
      const Vf s = div(v, add(set1(1.f), exp(neg(v))));
      store(oi + j, gated ? mul(rounded(s, xi), load(ui + j)) : s);
    }
    for (; j < r.d; ++j) {
      const float v = to_f32(xi[j]), s = v / (1.f + std::exp(-v));
      oi[j] = from_f32<T>(gated ? round_to<T>(s) * to_f32(ui[j]) : s);
    }
  }
}

}  // namespace

// x * sigmoid(x) of 16-bit x [..., D] (D contiguous, leading axes at any stride: the gate half of a
// fused projection reads in place) -> contiguous, as F.silu computes it (x / (1 + e^-x) in float32,
// rounded once: the polynomial exp's last-bit differences from ATen's vanish in that rounding);
// F.silu for float32 and where the kernel does not apply. ATen's took 8-9 us for 9728 values, this ~5.
torch::Tensor silu(const torch::Tensor& x) {
  const auto dtype = x.scalar_type();
  if (x.dim() == 0 || x.stride(-1) != 1 || (dtype != at::kHalf && dtype != at::kBFloat16)) return at::silu(x);
  const Rows r = rows_of(x);
  auto out = torch::empty(x.sizes(), x.options());
  AT_DISPATCH_REDUCED_FLOATING_TYPES(dtype, "silu", [&] { silu_rows<scalar_t>(ptr<scalar_t>(x), ptr<scalar_t>(out), r, false); });
  return out;
}

// silu(gate) * up of gate_up [..., 2F] (gate the first half of each row, up the second; rows at any
// stride) -> [..., F], as the generated `silu_mul`: one call where the emitted lines are a split,
// silu and a product; 16-bit as `silu` above, ATen's ops for float32.
torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  const auto dtype = gate_up.scalar_type();
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, "silu_mul: the last axis holds two halves");
  const int64_t F = gate_up.size(-1) / 2;
  if (gate_up.stride(-1) != 1 || (dtype != at::kHalf && dtype != at::kBFloat16))
    return at::silu(gate_up.narrow(-1, 0, F)) * gate_up.narrow(-1, F, F);
  Rows r = rows_of(gate_up);
  r.d = F;
  auto sizes = gate_up.sizes().vec();
  sizes.back() = F;
  auto out = torch::empty(sizes, gate_up.options());
  AT_DISPATCH_REDUCED_FLOATING_TYPES(dtype, "silu_mul", [&] {
    silu_rows<scalar_t>(ptr<scalar_t>(gate_up), ptr<scalar_t>(out), r, true);
  });
  return out;
}

// (x + y, rms_norm(x + y)) as the generated `add_rms_norm`: a residual add and the norm after it in
// one call; the sum rounded to the dtype before the norm reads it, as the two ops round.
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& y,
                                                      const torch::Tensor& weight, double eps) {
  auto sum = at::add(x, y);
  return {sum, rms_norm(sum, weight, eps)};
}

namespace {

// Two passes: the largest value (or whether there is a NaN: ATen's argmax takes the first NaN as the
// largest), then the first element holding it, 16 at a time.
template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  bool nan = false;
  Vf top = set1(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + kW <= n && !nan; i += kW) {
    const Vf v = load(x + i);
    nan = nan_bits(v) != 0;
    top = max(top, v);
  }
  float best = reduce_max(top);
  for (; i < n && !nan; ++i) {
    const float v = to_f32(x[i]);
    nan = std::isnan(v);
    best = std::max(best, v);
  }
  const Vf wanted = set1(best);
  for (i = 0; i + kW <= n; i += kW) {
    const Vf v = load(x + i);
    const uint32_t hit = nan ? nan_bits(v) : equal_bits(v, wanted);
    if (hit) return i + __builtin_ctz(hit);
  }
  for (; i < n; ++i) {
    const float v = to_f32(x[i]);
    if (nan ? std::isnan(v) : v == best) return i;
  }
  return 0;
}

}  // namespace

// The index of the largest of x [..., V] along V, the first on ties (and the first NaN), as
// Tensor.argmax(dim=-1): ATen's CPU argmax reads 16-bit values one at a time (~120 us at V = 32000).
torch::Tensor argmax(const torch::Tensor& x) {
  if (x.dim() == 0 || x.size(-1) == 0 || x.stride(-1) != 1 || x.scalar_type() == at::kDouble ||
      !at::isFloatingType(x.scalar_type()))
    return x.argmax(-1);
  const Rows r = rows_of(x);
  auto sizes = x.sizes().vec();
  sizes.pop_back();
  auto out = torch::empty(sizes, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "argmax", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>)
      for (int64_t i = 0; i < r.n; ++i) o[i] = argmax_row(ptr<scalar_t>(x) + r.offset(i), r.d);
  });
  return out;
}
