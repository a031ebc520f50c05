// The small ops of a decode step, fused, on the CPU: what a step at one token pays per op, not
// per byte. See cpu_fused.py for how it is built and when the model calls it.
//
// At one token a layer's norms, rotary embedding, SwiGLU product and attention read a few KB
// each; in torch they are ~50 ops a layer (pow, mean, rsqrt, mul, roll, addcmul, slices, views,
// index_copy_, the K/V gather, SDPA), each a dispatch and most a parallel region that wakes
// every thread of the pool. Here each is one op that runs on the calling thread while its work
// is small (`kSerialWork`), and splits over torch's pool only when a batch makes it large.
//
// Arithmetic follows torch's formulas for the same dtype, rounding where they round (bfloat16:
// after the normalisation, after each product), so results equal torch's to the order of a sum.
// Built with -ffp-contract=off: a*b + c*d stays two rounded products and a rounded sum, as torch's
// vectorised kernels compute it, not a fused multiply-add (the rotary embedding is then bit-equal).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

namespace {

// Elements (or multiply-adds, for attention) below which an op runs on the calling thread: a
// parallel region costs a few microseconds of wake-up and barrier, more than this much work.
constexpr int64_t kSerialWork = 1 << 15;

template <typename F>
void rows_for(int64_t rows, int64_t work_per_row, const F& body) {
  const int64_t grain = std::max<int64_t>(1, kSerialWork / std::max<int64_t>(1, work_per_row));
  at::parallel_for(0, rows, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) body(r);
  });
}

template <typename T> inline float f(T v) { return static_cast<float>(v); }
// the value torch would hold after an op that produced `v` in dtype T
template <typename T> inline float round_to(float v) { return static_cast<float>(static_cast<T>(v)); }

void check_cpu(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, ": CPU tensors only");
  TORCH_CHECK(t.dim() == 0 || t.stride(-1) == 1, what, ": the last axis must be contiguous");
}

// 1/sqrt(mean(x^2) + eps) of n values
template <typename T>
inline float inv_rms(const T* x, int64_t n, float eps) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += f(x[i]) * f(x[i]);
  return 1.f / std::sqrt(s / static_cast<float>(n) + eps);
}

// out[i] = w[i] * (x[i] * r), as `rms_norm` in model/layers.py: float32 multiplies in float32;
// bfloat16 normalises in float32, rounds, then multiplies by the weight and rounds again.
template <typename T>
inline void norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  const float r = inv_rms(x, n, eps);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(f(w[i]) * round_to<T>(f(x[i]) * r));
}

// x [T, R, n] (rows of any stride, the last axis contiguous; a 2-D x is [T, n]), w [R, n] or [n]
// -> the normalised rows, contiguous, x's shape and dtype.
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w, double eps) {
  check_cpu(x_in, "rms_norm");
  TORCH_CHECK(x_in.dim() == 2 || x_in.dim() == 3, "rms_norm: x must be [T, n] or [T, R, n]");
  TORCH_CHECK(w.scalar_type() == x_in.scalar_type() && w.is_contiguous(), "rms_norm: w must be contiguous, x's dtype");
  const at::Tensor x = x_in.dim() == 2 ? x_in.unsqueeze(1) : x_in;
  const int64_t t = x.size(0), heads = x.size(1), n = x.size(2);
  TORCH_CHECK(w.numel() == n || w.numel() == heads * n, "rms_norm: w must be [n] or [R, n]");
  const int64_t w_step = w.numel() == n ? 0 : n;
  at::Tensor out = at::empty(x_in.sizes(), x_in.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t s0 = x.stride(0), s1 = x.stride(1);
    rows_for(t * heads, n, [&](int64_t r) {
      const int64_t i = r / heads, h = r % heads;
      norm_row(xp + i * s0 + h * s1, wp + h * w_step, op + r * n, n, static_cast<float>(eps));
    });
  });
  return out;
}

// (x + d, rms_norm(x + d, w)): a residual add and the next norm in one pass. x, d [T, n].
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& d,
                                                const at::Tensor& w, double eps) {
  check_cpu(x, "add_rms_norm");
  check_cpu(d, "add_rms_norm");
  TORCH_CHECK(x.dim() == 2 && d.sizes() == x.sizes() && d.scalar_type() == x.scalar_type(),
              "add_rms_norm: x and d must be [T, n] of one dtype");
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.is_contiguous() && w.numel() == x.size(1),
              "add_rms_norm: w must be [n], contiguous, x's dtype");
  const int64_t t = x.size(0), n = x.size(1);
  at::Tensor sum = at::empty({t, n}, x.options()), out = at::empty({t, n}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t *xp = x.data_ptr<scalar_t>(), *dp = d.data_ptr<scalar_t>(), *wp = w.data_ptr<scalar_t>();
    scalar_t *sp = sum.data_ptr<scalar_t>(), *op = out.data_ptr<scalar_t>();
    rows_for(t, n, [&](int64_t i) {
      scalar_t* s = sp + i * n;
      const scalar_t *xr = xp + i * x.stride(0), *dr = dp + i * d.stride(0);
      for (int64_t k = 0; k < n; ++k) s[k] = static_cast<scalar_t>(f(xr[k]) + f(dr[k]));
      norm_row(s, wp, op + i * n, n, static_cast<float>(eps));
    });
  });
  return {sum, out};
}

// Rotary embedding of x [T, R, D] (rows of any stride) with `RotaryEmbedding`'s tables cos and
// signed sin [T, 1, D] (contiguous): x*cos + roll(x, D/2)*sin, as `apply_rotary`; with
// `norm_w` [R, D] or [D], each row is first normalised as `rms_norm` does (Qwen3's q/k norms).
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                const c10::optional<at::Tensor>& norm_w, double eps) {
  check_cpu(x, "rope");
  TORCH_CHECK(x.dim() == 3 && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.numel() == x.size(0) * x.size(2) && sin.numel() == cos.numel(),
              "rope: x must be [T, R, D], cos and sin [T, 1, D] contiguous");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(), "rope: one dtype");
  const int64_t t = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  TORCH_CHECK(dim % 2 == 0, "rope: D must be even");
  const bool normed = norm_w.has_value() && norm_w->defined();
  if (normed)
    TORCH_CHECK(norm_w->scalar_type() == x.scalar_type() && norm_w->is_contiguous() &&
                    (norm_w->numel() == heads * dim || norm_w->numel() == dim),
                "rope: norm_w must be [R, D] or [D], contiguous, x's dtype");
  const int64_t w_step = normed && norm_w->numel() == dim ? 0 : dim;
  at::Tensor out = at::empty({t, heads, dim}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rope", [&] {
    const scalar_t *xp = x.data_ptr<scalar_t>(), *cp = cos.data_ptr<scalar_t>(), *sp = sin.data_ptr<scalar_t>();
    const scalar_t* wp = normed ? norm_w->data_ptr<scalar_t>() : nullptr;
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t s0 = x.stride(0), s1 = x.stride(1);
    rows_for(t * heads, dim, [&](int64_t r) {
      const int64_t i = r / heads, h = r % heads;
      const scalar_t* src = xp + i * s0 + h * s1;
      std::vector<scalar_t> tmp;
      if (normed) {
        tmp.resize(dim);
        norm_row(src, wp + h * w_step, tmp.data(), dim, static_cast<float>(eps));
        src = tmp.data();
      }
      const scalar_t *c = cp + i * dim, *s = sp + i * dim;
      scalar_t* o = op + r * dim;
      for (int64_t k = 0; k < dim; ++k) {
        const float rolled = f(src[k < half ? k + half : k - half]);
        o[k] = static_cast<scalar_t>(round_to<scalar_t>(f(src[k]) * f(c[k])) + rolled * f(s[k]));
      }
    });
  });
  return out;
}

// silu(g) * u: g, u [T, I] (rows of any stride: the halves of a fused gate/up output).
at::Tensor silu_mul(const at::Tensor& g, const at::Tensor& u) {
  check_cpu(g, "silu_mul");
  check_cpu(u, "silu_mul");
  TORCH_CHECK(g.dim() == 2 && u.sizes() == g.sizes() && u.scalar_type() == g.scalar_type(),
              "silu_mul: g and u must be [T, I] of one dtype");
  const int64_t t = g.size(0), n = g.size(1);
  at::Tensor out = at::empty({t, n}, g.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, g.scalar_type(), "silu_mul", [&] {
    const scalar_t *gp = g.data_ptr<scalar_t>(), *up = u.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    rows_for(t, n, [&](int64_t i) {
      const scalar_t *gr = gp + i * g.stride(0), *ur = up + i * u.stride(0);
      scalar_t* o = op + i * n;
      for (int64_t k = 0; k < n; ++k) {
        const float x = f(gr[k]);
        o[k] = static_cast<scalar_t>(round_to<scalar_t>(x / (1.f + std::exp(-x))) * f(ur[k]));
      }
    });
  });
  return out;
}

// One decode step's attention for B sequences of one new token each, over the paged cache:
// writes each token's k/v [B, Hkv, D] to its cache slot (`slots` [B]), then query head h of
// sequence b attends to context positions [lo, lens[b]) of its own, read through `kv_index`
// [B, C] (cache slot of each position), lo = lens[b] - window when window > 0, else 0; K/V head
// h / (Hq / Hkv) (GQA). q [B, Hq, D] (rows of any stride). Scores, softmax and the weighted sum
// in float32; the result [B, Hq, D] in q's dtype. kc, vc [S, Hkv, D] contiguous.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& slots,
                            const at::Tensor& kv_index, const at::Tensor& lens, int64_t window,
                            double scale) {
  for (const auto* t : {&q, &k, &v}) check_cpu(*t, "decode_attention");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && kc.dim() == 3 &&
                  kc.sizes() == vc.sizes() && kc.is_contiguous() && vc.is_contiguous(),
              "decode_attention: q [B, Hq, D], k/v [B, Hkv, D], caches [S, Hkv, D] contiguous");
  const auto dt = q.scalar_type();
  TORCH_CHECK(k.scalar_type() == dt && v.scalar_type() == dt && kc.scalar_type() == dt &&
                  vc.scalar_type() == dt, "decode_attention: one dtype");
  const int64_t b = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = kc.size(1);
  TORCH_CHECK(k.size(0) == b && k.size(1) == kv_heads && k.size(2) == dim && kc.size(2) == dim &&
                  heads % kv_heads == 0, "decode_attention: head shapes disagree");
  TORCH_CHECK(slots.scalar_type() == at::kLong && kv_index.scalar_type() == at::kLong &&
                  lens.scalar_type() == at::kLong && slots.numel() == b && lens.numel() == b &&
                  slots.is_contiguous() && kv_index.is_contiguous() && lens.is_contiguous() &&
                  kv_index.numel() % std::max<int64_t>(b, 1) == 0,
              "decode_attention: slots [B], kv_index [B, C], lens [B], int64, contiguous");
  const int64_t ctx = b ? kv_index.numel() / b : 0, rows = kc.size(0), rep = heads / kv_heads;
  const int64_t *sl = slots.data_ptr<int64_t>(), *kvi = kv_index.data_ptr<int64_t>(), *ln = lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i) {
    TORCH_CHECK(sl[i] >= 0 && sl[i] < rows && ln[i] >= 1 && ln[i] <= ctx, "decode_attention: slot or length out of range");
  }
  for (int64_t i = 0; i < b * ctx; ++i) TORCH_CHECK(kvi[i] >= 0 && kvi[i] < rows, "decode_attention: kv_index out of range");
  at::Tensor out = at::empty({b, heads, dim}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, dt, "decode_attention", [&] {
    scalar_t *kcp = kc.data_ptr<scalar_t>(), *vcp = vc.data_ptr<scalar_t>();
    const scalar_t *qp = q.data_ptr<scalar_t>(), *kp = k.data_ptr<scalar_t>(), *vp = v.data_ptr<scalar_t>();
    const int64_t row = kv_heads * dim;
    for (int64_t i = 0; i < b; ++i) {
      for (int64_t h = 0; h < kv_heads; ++h) {
        std::copy_n(kp + i * k.stride(0) + h * k.stride(1), dim, kcp + sl[i] * row + h * dim);
        std::copy_n(vp + i * v.stride(0) + h * v.stride(1), dim, vcp + sl[i] * row + h * dim);
      }
    }
    scalar_t* op = out.data_ptr<scalar_t>();
    const float sc = static_cast<float>(scale);
    rows_for(b * kv_heads, ctx * dim * rep, [&](int64_t task) {
      const int64_t i = task / kv_heads, g = task % kv_heads;
      const int64_t end = ln[i], lo = window > 0 ? std::max<int64_t>(0, end - window) : 0, n = end - lo;
      std::vector<float> qf(rep * dim), p(rep * n), acc(rep * dim, 0.f);
      for (int64_t r = 0; r < rep; ++r) {
        const scalar_t* qr = qp + i * q.stride(0) + (g * rep + r) * q.stride(1);
        for (int64_t d = 0; d < dim; ++d) qf[r * dim + d] = f(qr[d]);
      }
      const int64_t* idx = kvi + i * ctx + lo;
      for (int64_t j = 0; j < n; ++j) {
        const scalar_t* kr = kcp + idx[j] * row + g * dim;
        for (int64_t r = 0; r < rep; ++r) {
          float s = 0.f;
          for (int64_t d = 0; d < dim; ++d) s += qf[r * dim + d] * f(kr[d]);
          p[r * n + j] = s * sc;
        }
      }
      for (int64_t r = 0; r < rep; ++r) {
        float* pr = p.data() + r * n;
        const float mx = *std::max_element(pr, pr + n);
        float total = 0.f;
        for (int64_t j = 0; j < n; ++j) total += (pr[j] = std::exp(pr[j] - mx));
        for (int64_t j = 0; j < n; ++j) pr[j] /= total;
      }
      for (int64_t j = 0; j < n; ++j) {
        const scalar_t* vr = vcp + idx[j] * row + g * dim;
        for (int64_t r = 0; r < rep; ++r) {
          const float w = p[r * n + j];
          float* a = acc.data() + r * dim;
          for (int64_t d = 0; d < dim; ++d) a[d] += w * f(vr[d]);
        }
      }
      for (int64_t r = 0; r < rep; ++r) {
        scalar_t* o = op + (i * heads + g * rep + r) * dim;
        for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<scalar_t>(acc[r * dim + d]);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(loraserve_fused, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor d, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("rope(Tensor x, Tensor cos, Tensor sin, Tensor? norm_w, float eps) -> Tensor");
  m.def("silu_mul(Tensor g, Tensor u) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kc, Tensor(b!) vc, Tensor slots, "
        "Tensor kv_index, Tensor lens, int window, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(loraserve_fused, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope", &rope);
  m.impl("silu_mul", &silu_mul);
  m.impl("decode_attention", &decode_attention);
}
