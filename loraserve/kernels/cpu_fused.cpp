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
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <type_traits>
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

// sum of a[i] * b[i] in float32 (`omp simd`: vector lanes, so summed in another order than a
// plain loop, as torch's reductions are)
template <typename A, typename B>
inline float dot(const A* a, const B* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += f(a[i]) * f(b[i]);
  return s;
}

// a[i] += w * v[i]
template <typename T>
inline void axpy(float* a, float w, const T* v, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) a[i] += w * f(v[i]);
}

// 1/sqrt(mean(x^2) + eps) of n values
template <typename T>
inline float inv_rms(const T* x, int64_t n, float eps) {
  return 1.f / std::sqrt(dot(x, x, n) / static_cast<float>(n) + eps);
}

#if defined(__AVX512F__)
// e^x on 16 lanes: x = n ln2 + r, |r| <= ln2/2, e^r by Cephes' expf polynomial (~1 ulp), scaled by
// 2^n. The clamps take the constant first, so a NaN lane stays NaN (MINPS/MAXPS return their
// second operand when either is NaN); past the clamps e^x is 0 or ~2.4e38, as for silu alike.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_set1_ps(88.37626f), x);
  x = _mm512_max_ps(_mm512_set1_ps(-103.97f), x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
// The bfloat16 bits of 16 floats in the low halves of the lanes, rounded as c10::BFloat16 rounds:
// to nearest even, a NaN to the quiet NaN 0x7FC0.
inline __m512i bf16_bits(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}
// v rounded to bfloat16 and widened back: what torch holds after a bfloat16 op produced v
inline __m512 round_bf16(__m512 v) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16)); }
inline void store16(c10::BFloat16* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(bf16_bits(v)));
}
#endif

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

// o = silu(g) * u over n values: bfloat16 rounds silu before the product, as torch does
template <typename T>
void silu_mul_row(const T* g, const T* u, T* o, int64_t n) {
  for (int64_t k = 0; k < n; ++k) {
    const float x = f(g[k]);
    o[k] = static_cast<T>(round_to<T>(x / (1.f + std::exp(-x))) * f(u[k]));
  }
}

#if defined(__AVX512F__)
// 16 lanes at a time (bfloat16: 20 us a SmolLM2 layer scalar, the exp's cost; ~1 us so)
template <typename T>
void silu_mul_vec(const T* g, const T* u, T* o, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t k = 0; k < n; k += 16) {
    const __mmask16 m = n - k >= 16 ? 0xFFFF : (__mmask16)((1u << (n - k)) - 1);
    const __m512 x = load16(g + k, m);
    __m512 silu = _mm512_div_ps(x, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
    if constexpr (std::is_same_v<T, c10::BFloat16>) silu = round_bf16(silu);
    store16(o + k, _mm512_mul_ps(silu, load16(u + k, m)), m);
  }
}
template <>
void silu_mul_row<float>(const float* g, const float* u, float* o, int64_t n) { silu_mul_vec(g, u, o, n); }
template <>
void silu_mul_row<c10::BFloat16>(const c10::BFloat16* g, const c10::BFloat16* u, c10::BFloat16* o, int64_t n) {
  silu_mul_vec(g, u, o, n);
}
#endif

// p[r * n + j] = sc * q_r . k_j for the rep query rows q [rep, dim] and the n cache rows
// k_j = kc[idx[j] * row + off ...][:dim]
template <typename T>
void scores_plain(const float* q, const T* kc, const int64_t* idx, int64_t row, int64_t off, int64_t dim,
                  int64_t rep, int64_t n, float sc, float* p) {
  for (int64_t j = 0; j < n; ++j) {
    const T* kr = kc + idx[j] * row + off;
    for (int64_t r = 0; r < rep; ++r) p[r * n + j] = dot(q + r * dim, kr, dim) * sc;
  }
}

template <typename T>
void scores(const float* q, const T* kc, const int64_t* idx, int64_t row, int64_t off, int64_t dim,
            int64_t rep, int64_t n, float sc, float* p) {
  scores_plain(q, kc, idx, row, off, dim, rep, n, sc, p);
}

#if defined(__AVX512F__)
// float32 or bfloat16 heads of 16k lanes (64 and 128, every supported model): each k row is
// loaded once into registers (widened to float32) and dotted with every query row of the group
template <typename T>
void scores_vec(const float* q, const T* kc, const int64_t* idx, int64_t row, int64_t off, int64_t dim,
                int64_t rep, int64_t n, float sc, float* p) {
  if (dim % 16 != 0 || dim > 256) {
    scores_plain(q, kc, idx, row, off, dim, rep, n, sc, p);
    return;
  }
  const int64_t lanes = dim / 16;
  for (int64_t j = 0; j < n; ++j) {
    const T* kr = kc + idx[j] * row + off;
    __m512 k[16];
    for (int64_t l = 0; l < lanes; ++l) k[l] = load16(kr + 16 * l, 0xFFFF);
    for (int64_t r = 0; r < rep; ++r) {
      const float* qr = q + r * dim;
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qr), k[0]);
      for (int64_t l = 1; l < lanes; ++l) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qr + 16 * l), k[l], acc);
      p[r * n + j] = _mm512_reduce_add_ps(acc) * sc;
    }
  }
}
template <>
void scores<float>(const float* q, const float* kc, const int64_t* idx, int64_t row, int64_t off,
                   int64_t dim, int64_t rep, int64_t n, float sc, float* p) {
  scores_vec(q, kc, idx, row, off, dim, rep, n, sc, p);
}
// (bfloat16 was the scalar loop: ~20 us of a SmolLM2 layer's attention at 100 positions)
template <>
void scores<c10::BFloat16>(const float* q, const c10::BFloat16* kc, const int64_t* idx, int64_t row, int64_t off,
                           int64_t dim, int64_t rep, int64_t n, float sc, float* p) {
  scores_vec(q, kc, idx, row, off, dim, rep, n, sc, p);
}
#endif

// acc[r] += sum over j of p[r * n + j] * v_j, v_j = vc[idx[j] * row + off ...][:dim]
template <typename T>
void weighted_sum_plain(const float* p, const T* vc, const int64_t* idx, int64_t row, int64_t off,
                        int64_t dim, int64_t rep, int64_t n, float* acc) {
  for (int64_t j = 0; j < n; ++j) {
    const T* vr = vc + idx[j] * row + off;
    for (int64_t r = 0; r < rep; ++r) axpy(acc + r * dim, p[r * n + j], vr, dim);
  }
}

template <typename T>
void weighted_sum(const float* p, const T* vc, const int64_t* idx, int64_t row, int64_t off, int64_t dim,
                  int64_t rep, int64_t n, float* acc) {
  weighted_sum_plain(p, vc, idx, row, off, dim, rep, n, acc);
}

#if defined(__AVX512F__)
// float32 or bfloat16 (widened), heads of 64 or 128 lanes: one query row at a time, its sum held
// in registers over all j
template <typename T>
void weighted_sum_vec(const float* p, const T* vc, const int64_t* idx, int64_t row, int64_t off, int64_t dim,
                      int64_t rep, int64_t n, float* acc) {
  if (dim != 64 && dim != 128) {
    weighted_sum_plain(p, vc, idx, row, off, dim, rep, n, acc);
    return;
  }
  for (int64_t r = 0; r < rep; ++r) {
    for (int64_t half = 0; half < dim; half += 64) {  // 4 registers of sums per pass
      __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t j = 0; j < n; ++j) {
        const T* vr = vc + idx[j] * row + off + half;
        const __m512 w = _mm512_set1_ps(p[r * n + j]);
        a0 = _mm512_fmadd_ps(w, load16(vr, 0xFFFF), a0);
        a1 = _mm512_fmadd_ps(w, load16(vr + 16, 0xFFFF), a1);
        a2 = _mm512_fmadd_ps(w, load16(vr + 32, 0xFFFF), a2);
        a3 = _mm512_fmadd_ps(w, load16(vr + 48, 0xFFFF), a3);
      }
      float* o = acc + r * dim + half;
      _mm512_storeu_ps(o, a0);
      _mm512_storeu_ps(o + 16, a1);
      _mm512_storeu_ps(o + 32, a2);
      _mm512_storeu_ps(o + 48, a3);
    }
  }
}
template <>
void weighted_sum<float>(const float* p, const float* vc, const int64_t* idx, int64_t row, int64_t off,
                         int64_t dim, int64_t rep, int64_t n, float* acc) {
  weighted_sum_vec(p, vc, idx, row, off, dim, rep, n, acc);
}
template <>
void weighted_sum<c10::BFloat16>(const float* p, const c10::BFloat16* vc, const int64_t* idx, int64_t row,
                                 int64_t off, int64_t dim, int64_t rep, int64_t n, float* acc) {
  weighted_sum_vec(p, vc, idx, row, off, dim, rep, n, acc);
}
#endif

// p = softmax(p) over n values, in place
inline void softmax(float* p, int64_t n) {
  const float mx = *std::max_element(p, p + n);
  float total = 0.f;
  int64_t j = 0;
#if defined(__AVX512F__)
  __m512 sum = _mm512_setzero_ps();
  for (; j + 16 <= n; j += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(p + j), _mm512_set1_ps(mx)));
    _mm512_storeu_ps(p + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  total = _mm512_reduce_add_ps(sum);
#endif
  for (; j < n; ++j) total += (p[j] = std::exp(p[j] - mx));
  const float inv = 1.f / total;
  for (j = 0; j < n; ++j) p[j] *= inv;
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
      silu_mul_row(gr, ur, o, n);
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
      scores(qf.data(), kcp, idx, row, g * dim, dim, rep, n, sc, p.data());
      for (int64_t r = 0; r < rep; ++r) softmax(p.data() + r * n, n);
      weighted_sum(p.data(), vcp, idx, row, g * dim, dim, rep, n, acc.data());
      for (int64_t r = 0; r < rep; ++r) {
        scalar_t* o = op + (i * heads + g * rep + r) * dim;
        for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<scalar_t>(acc[r * dim + d]);
      }
    });
  });
  return out;
}

// Attention from a fused q/k/v projection's output, qkv [B, (Hq + 2 Hkv) D] (rows of any stride):
// its q and k heads normalised (norm_w, Qwen3) and rotated as `rope` does, then `decode_attention`
// with v its last Hkv heads; returns [B, Hq * D], the o projection's input. One call where the
// model made seven (slices and views of qkv, rope, the attention, the reshape). qkv is not changed.
at::Tensor qkv_attention(const at::Tensor& qkv, int64_t heads, int64_t kv_heads, const at::Tensor& cos,
                         const at::Tensor& sin, const c10::optional<at::Tensor>& norm_w, double eps,
                         const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& slots,
                         const at::Tensor& kv_index, const at::Tensor& lens, int64_t window, double scale) {
  check_cpu(qkv, "qkv_attention");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && heads > 0 && kv_heads > 0 && kc.dim() == 3,
              "qkv_attention: qkv must be [B, (Hq + 2 Hkv) * D] with unit column stride");
  const int64_t b = qkv.size(0), dim = kc.size(2);
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * dim, "qkv_attention: qkv's width is not (Hq + 2 Hkv) * D");
  const int64_t row = qkv.stride(0);
  const at::Tensor qk = qkv.as_strided({b, heads + kv_heads, dim}, {row, dim, 1});
  const at::Tensor v = qkv.as_strided({b, kv_heads, dim}, {row, dim, 1}, qkv.storage_offset() + (heads + kv_heads) * dim);
  const at::Tensor turned = rope(qk, cos, sin, norm_w, eps);  // [B, Hq + Hkv, D], contiguous
  const at::Tensor out = decode_attention(turned.narrow(1, 0, heads), turned.narrow(1, heads, kv_heads), v, kc, vc,
                                          slots, kv_index, lens, window, scale);
  return out.view({b, heads * dim});
}

// silu(g) * u from a fused gate/up output gu [T, 2I]: g its first I columns, u the rest.
at::Tensor silu_mul_halves(const at::Tensor& gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.size(1) % 2 == 0, "silu_mul_halves: gu must be [T, 2I]");
  const int64_t n = gu.size(1) / 2;
  return silu_mul(gu.narrow(1, 0, n), gu.narrow(1, n, n));
}

// y += (x @ a^T) @ b for a few rows: one adapter's LoRA delta on a decode step. x [n, in] and
// y [n, out] (rows of any stride: y may be a column slice of a fused q/k/v output), a [r, in],
// b [r, out] contiguous, one dtype. The rank-r middle and each output's sum in float32; y is
// rounded once (bfloat16: as the widened float32 GEMMs of `torch_backend` round it).
void lora_addmm_(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b) {
  check_cpu(y, "lora_addmm_");
  check_cpu(x, "lora_addmm_");
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && a.dim() == 2 && b.dim() == 2 && a.is_contiguous() &&
                  b.is_contiguous() && x.size(0) == y.size(0) && a.size(1) == x.size(1) &&
                  b.size(0) == a.size(0) && b.size(1) == y.size(1),
              "lora_addmm_: x [n, in], y [n, out], a [r, in], b [r, out] (a, b contiguous)");
  const auto dt = x.scalar_type();
  TORCH_CHECK(y.scalar_type() == dt && a.scalar_type() == dt && b.scalar_type() == dt, "lora_addmm_: one dtype");
  const int64_t n = x.size(0), in = x.size(1), out = y.size(1), r = a.size(0);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, dt, "lora_addmm_", [&] {
    const scalar_t *xp = x.data_ptr<scalar_t>(), *ap = a.data_ptr<scalar_t>(), *bp = b.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    std::vector<float> h(r), acc(out);
    for (int64_t i = 0; i < n; ++i) {
      const scalar_t* xr = xp + i * x.stride(0);
      for (int64_t k = 0; k < r; ++k) h[k] = dot(xr, ap + k * in, in);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t k = 0; k < r; ++k) axpy(acc.data(), h[k], bp + k * out, out);
      scalar_t* yr = yp + i * y.stride(0);
      for (int64_t o = 0; o < out; ++o) yr[o] = static_cast<scalar_t>(f(yr[o]) + acc[o]);
    }
  });
}

// Each row of a step's logits [B, V] (float32, unit column stride) screened and picked in one
// read: the index of its first largest value, as torch.argmax picks it (ties: the lowest index;
// -0.0 and 0.0 are equal), or -1 where any value is not finite (NaN or Inf: the exponent bits
// all set): nothing is picked from such a row. The engine's step
// took ~0.5 ms of a 20-26 ms SmolLM2 step for this in torch ops (a sum, an isfinite, an index
// copy and an argmax, each a pass and most a parallel region).
at::Tensor screen_logits(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.scalar_type() == at::kFloat &&
                  (logits.size(1) <= 1 || logits.stride(1) == 1),
              "screen_logits: logits must be a CPU float32 [B, V] with unit column stride");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  at::Tensor picked = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* lp = logits.data_ptr<float>();
  int64_t* pp = picked.data_ptr<int64_t>();
  rows_for(rows, vocab, [&](int64_t r) {
    const float* x = lp + r * logits.stride(0);
    bool bad = false;
    float top = -std::numeric_limits<float>::infinity();
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512i exponent = _mm512_set1_epi32(0x7F800000);
    __m512 vtop = _mm512_set1_ps(top);
    __mmask16 vbad = 0;
    for (; i + 16 <= vocab; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + i);
      vbad |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), exponent), exponent);
      vtop = _mm512_max_ps(vtop, v);
    }
    bad = vbad != 0;
    top = _mm512_reduce_max_ps(vtop);
#endif
    for (; i < vocab; ++i) {
      bad |= !std::isfinite(x[i]);
      top = std::max(top, x[i]);
    }
    int64_t at = -1;
    if (!bad) {
      at = 0;  // an empty row picks 0, as nothing else could
      int64_t j = 0;
#if defined(__AVX512F__)
      const __m512 vt = _mm512_set1_ps(top);
      for (; j + 16 <= vocab; j += 16) {
        const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + j), vt, _CMP_EQ_OQ);
        if (eq) break;
      }
#endif
      for (; j < vocab; ++j) {
        if (x[j] == top) {
          at = j;
          break;
        }
      }
    }
    pp[r] = at;
  });
  return picked;
}

// One projection of a planned layer, through the op its module's forward calls (`decode_plan._native`):
// kind 0 a plain weight on loraserve_cpu::vec_linear (cpu_gemv.cpp), its bias added after as
// `VectorLinear` adds it; 1 a quantized one on loraserve_quant::quant_linear (cpu_quant.cpp:
// codes, scales, mins); 2 at::linear (an `nn.Linear`'s F.linear). A bias absent is an empty
// tensor. The two kernels are looked up by name in the dispatcher, once per process (their
// libraries are loaded: the plan asks for this loop only where its modules would call them).
at::Tensor project(const at::Tensor& x, at::TensorList w, int64_t& next, int64_t kind, int64_t bits, int64_t group) {
  if (kind == 1) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("loraserve_quant::quant_linear", "")
                               .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                 const at::Tensor&, int64_t, int64_t, bool)>();
    next += 3;
    return op.call(x, w[next - 3], w[next - 2], w[next - 1], bits, group, false);
  }
  TORCH_CHECK(kind == 0 || kind == 2, "decode_layers: unknown projection kind ", kind);
  const at::Tensor& weight = w[next];
  const at::Tensor& bias = w[next + 1];
  next += 2;
  const bool biased = bias.numel() > 0;
  if (kind == 2) return biased ? at::linear(x, weight, bias) : at::linear(x, weight);
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("loraserve_cpu::vec_linear", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  const at::Tensor y = op.call(x, weight);
  return biased ? y + bias : y;
}

// One adapter's deltas at a site: `count` (lo, hi) column ranges of y (hi < 0: all of y), each
// y[:, lo:hi] += (x a^T) b with the next (a, b) of `lora`, as the wrappers add them (`DecodePlan.run`).
void add_deltas(const at::Tensor& y, const at::Tensor& x, at::TensorList lora, int64_t& next_t,
                at::IntArrayRef meta, int64_t& next_m) {
  const int64_t count = meta[next_m++];
  for (int64_t c = 0; c < count; ++c) {
    const int64_t lo = meta[next_m++], hi = meta[next_m++];
    const at::Tensor cols = hi < 0 ? y : y.narrow(1, lo, hi - lo);
    lora_addmm_(cols, x, lora[next_t], lora[next_t + 1]);
    next_t += 2;
  }
}

// The decoder layers of a decode step, in C++: `DecodePlan.run`'s loop, the same ops in the same
// order (so the same numbers), without ~8 Python calls a layer (~1.5 ms of a SmolLM2 step).
//   x [T, H] the embeddings; first_w / first_eps the first layer's input norm.
//   weights, proj: per layer its q/k/v, o, gate/up and down projections, each (kind, bits, group)
//     in proj with its 2 (weight, bias) or 3 (quantized) tensors in weights, in order (`project`).
//   norms: per layer the q/k norm weight (an empty tensor where none), the post-attention norm's
//     and the next norm's (the next layer's input norm, the final norm after the last layer).
//   meta: per layer heads, kv_heads, window; eps: per layer the q/k norm's, post's, next's.
//   k_layers, v_layers, cos, sin, slots, kv_index, lens, scale: the step's attention
//     (`qkv_attention`'s arguments).
//   lora, lora_meta: each adapter delta (a, b) in the plan's order and, per layer, for q/k/v,
//     o, gate/up, down: a count and count (lo, hi) column ranges (hi < 0: the whole output);
//     both empty: no deltas this step.
// Returns the final norm's output [T, H].
at::Tensor decode_layers(const at::Tensor& x0, const at::Tensor& first_w, double first_eps, at::TensorList weights,
                         at::IntArrayRef proj, at::TensorList norms, at::IntArrayRef meta, at::ArrayRef<double> eps,
                         at::TensorList k_layers, at::TensorList v_layers, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& slots, const at::Tensor& kv_index, const at::Tensor& lens, double scale,
                         at::TensorList lora, at::IntArrayRef lora_meta) {
  const int64_t layers = static_cast<int64_t>(k_layers.size());
  TORCH_CHECK(static_cast<int64_t>(v_layers.size()) == layers && static_cast<int64_t>(proj.size()) == 12 * layers &&
                  static_cast<int64_t>(norms.size()) == 3 * layers && static_cast<int64_t>(meta.size()) == 3 * layers &&
                  static_cast<int64_t>(eps.size()) == 3 * layers,
              "decode_layers: per-layer lists disagree with the layer count");
  const bool deltas = !lora_meta.empty();
  at::Tensor x = x0, h = rms_norm(x0, first_w, first_eps);
  int64_t wi = 0, li = 0, mi = 0;
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t* pj = proj.data() + 12 * l;
    const at::Tensor& qk_norm = norms[3 * l];
    const c10::optional<at::Tensor> norm_w = qk_norm.defined() && qk_norm.numel() ? c10::optional<at::Tensor>(qk_norm)
                                                                                   : c10::nullopt;
    at::Tensor y = project(h, weights, wi, pj[0], pj[1], pj[2]);
    if (deltas) add_deltas(y, h, lora, li, lora_meta, mi);
    const at::Tensor a = qkv_attention(y, meta[3 * l], meta[3 * l + 1], cos, sin, norm_w, eps[3 * l], k_layers[l],
                                       v_layers[l], slots, kv_index, lens, meta[3 * l + 2], scale);
    y = project(a, weights, wi, pj[3], pj[4], pj[5]);
    if (deltas) add_deltas(y, a, lora, li, lora_meta, mi);
    std::tie(x, h) = add_rms_norm(x, y, norms[3 * l + 1], eps[3 * l + 1]);
    y = project(h, weights, wi, pj[6], pj[7], pj[8]);
    if (deltas) add_deltas(y, h, lora, li, lora_meta, mi);
    const at::Tensor m = silu_mul_halves(y);
    y = project(m, weights, wi, pj[9], pj[10], pj[11]);
    if (deltas) add_deltas(y, m, lora, li, lora_meta, mi);
    std::tie(x, h) = add_rms_norm(x, y, norms[3 * l + 2], eps[3 * l + 2]);
  }
  TORCH_CHECK(wi == static_cast<int64_t>(weights.size()) && li == static_cast<int64_t>(lora.size()) &&
                  mi == static_cast<int64_t>(lora_meta.size()),
              "decode_layers: weights or deltas left over");
  return h;
}

}  // namespace

TORCH_LIBRARY(loraserve_fused, m) {
  m.def("lora_addmm_(Tensor(a!) y, Tensor x, Tensor a, Tensor b) -> ()");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor d, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("rope(Tensor x, Tensor cos, Tensor sin, Tensor? norm_w, float eps) -> Tensor");
  m.def("silu_mul(Tensor g, Tensor u) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kc, Tensor(b!) vc, Tensor slots, "
        "Tensor kv_index, Tensor lens, int window, float scale) -> Tensor");
  m.def("qkv_attention(Tensor qkv, int heads, int kv_heads, Tensor cos, Tensor sin, Tensor? norm_w, float eps, "
        "Tensor(a!) kc, Tensor(b!) vc, Tensor slots, Tensor kv_index, Tensor lens, int window, float scale) -> Tensor");
  m.def("silu_mul_halves(Tensor gu) -> Tensor");
  m.def("screen_logits(Tensor logits) -> Tensor");
  m.def("decode_layers(Tensor x, Tensor first_w, float first_eps, Tensor[] weights, int[] proj, Tensor[] norms, "
        "int[] meta, float[] eps, Tensor(a!)[] k_layers, Tensor(b!)[] v_layers, Tensor cos, Tensor sin, Tensor slots, "
        "Tensor kv_index, Tensor lens, float scale, Tensor[] lora, int[] lora_meta) -> Tensor");
}

TORCH_LIBRARY_IMPL(loraserve_fused, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("decode_layers", &decode_layers);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope", &rope);
  m.impl("silu_mul", &silu_mul);
  m.impl("decode_attention", &decode_attention);
  m.impl("lora_addmm_", &lora_addmm_);
  m.impl("qkv_attention", &qkv_attention);
  m.impl("silu_mul_halves", &silu_mul_halves);
  m.impl("screen_logits", &screen_logits);
}
