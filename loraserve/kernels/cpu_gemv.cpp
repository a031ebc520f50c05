// One row times a weight matrix on the CPU, at the memory's read bandwidth: the linears of a
// decode step that serves one sequence (`--max-batch-size 1`). See cpu_gemv.py for how it is
// built and when it is used.
//
// A one-row product reads every weight once and does two flops a weight: its speed is the rate
// at which the weight streams from memory. What limits that rate on one core is how many cache
// lines are in flight, so every kernel here reads several weight streams at once: 16 rows (f32,
// row-major), 16 rows (bf16, row-major, AVX512-BF16 dot products) or 16 input rows of a
// column-major weight (f32). Measured on the 2-core dev machine against torch's own one-row
// calls at Qwen3-0.6B shapes (medians of interleaved runs): 1.06x for f32 (MKL's GEMM on the
// column-major weight), 1.3x for bf16 (torch.mv). Each thread of torch's pool takes one
// contiguous share of the output.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <string>

namespace {

constexpr int64_t kF32Rows = 16;   // row-major f32: rows a thread reads at once
constexpr int64_t kF32Cols = 16;   // column-major f32: input rows a thread reads at once
constexpr int64_t kBf16Rows = 16;  // row-major bf16
// Rows ahead of the block being read (3 blocks) that the bf16 kernel prefetches, line by line as
// it reads: the hardware's prefetchers alone left one core at 11 GB/s on a 256 MB weight (f32:
// 17), 15 GB/s so; at SmolLM2's shapes, 2 threads, a step's linears 1.15x faster (interleaved).
// Past the weight's end a prefetch is dropped, never a fault. (f32 gained nothing from it.)
constexpr int64_t kBf16Ahead = 3 * kBf16Rows;
constexpr int64_t kTile = 8;       // row-major, several rows of x: weight rows per tile
// Rows of x up to which a row-major weight is read by `rows_multi` (once, for all rows):
// every decode batch of a default server. Measured against oneDNN's GEMM on its packed layout
// (SmolLM2's gate_up, 1 thread, interleaved): 1.20x at 1 row, 0.80-0.89x from 4 to 64 rows;
// oneDNN through at::linear, which re-packs the plain weight per call, did worse (0.52-0.84x).
// Past it (prefill) at::linear's blocking wins.
constexpr int64_t kMaxRows = 64;

// Split [0, n) into one share per thread, each a multiple of `align` but the last.
template <typename F>
void per_thread(int64_t n, int64_t align, const F& body) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n / align));
  const int64_t share = ((n + threads - 1) / threads + align - 1) / align * align;
  at::parallel_for(0, threads, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t begin = t * share, end = std::min(n, begin + share);
      if (begin < end) body(begin, end);
    }
  });
}

#if defined(__AVX512F__)
inline __mmask16 tail16(int64_t left) { return left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1); }

// Lane i of the result is the sum of a[i]'s 16 lanes: 16 horizontal sums in 15 adds and their
// shuffles (a transpose folded into the additions), where 16 `_mm512_reduce_add_ps` take ~4x the
// instructions. Measured at SmolLM2 shapes, one row, 2 threads (interleaved): with 16 rows per
// block, the tree made a step's linears 1.1-1.2x faster in f32 and bf16. The order of additions
// differs from a plain reduction only in rounding.
__attribute__((always_inline)) inline __m512 sum16(const __m512* a) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit chunk: pairs of vectors, lanes folded 4 -> 2
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // 2 -> 1: chunk j of c[i] holds vectors 4i..4i+3's sums over chunk j
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]));
    c[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  }
  // the four chunks of each c[i] summed: chunk i of the result is c[i]'s total
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xDD));
}

// y[r] = W[r, :] . x for r in [r0, r1); W row-major [m, n].
void f32_rows(const float* w, const float* x, float* y, int64_t r0, int64_t r1, int64_t n) {
  int64_t r = r0;
  for (; r + kF32Rows <= r1; r += kF32Rows) {
    const float* wr = w + r * n;
    __m512 acc[kF32Rows];
    for (int i = 0; i < kF32Rows; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < n; k += 16) {
      const __mmask16 m = tail16(n - k);
      const __m512 xv = _mm512_maskz_loadu_ps(m, x + k);
#pragma GCC unroll 16
      for (int i = 0; i < kF32Rows; ++i)
        acc[i] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, wr + i * n + k), xv, acc[i]);
    }
    static_assert(kF32Rows == 16, "sum16 folds 16 accumulators");
    _mm512_storeu_ps(y + r, sum16(acc));
  }
  for (; r < r1; ++r) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t k = 0; k < n; k += 16) {
      const __mmask16 m = tail16(n - k);
      acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, w + r * n + k), _mm512_maskz_loadu_ps(m, x + k), acc);
    }
    y[r] = _mm512_reduce_add_ps(acc);
  }
}

// The element types the several-row kernel reads: how many weights one vector holds, how a
// (masked) vector is loaded, how it meets x (an FMA; bf16: AVX512-BF16's pairwise dot product into
// f32 lanes) and how a sum is stored (bf16: rounded once).
struct F32 {
  using T = float;
  using Out = float;
  using V = __m512;
  static constexpr int64_t kLanes = 16;
  static V load(const T* p, int64_t left) { return _mm512_maskz_loadu_ps(tail16(left), p); }
  static __m512 madd(__m512 acc, V w, V x) { return _mm512_fmadd_ps(w, x, acc); }
};
#if defined(__AVX512BF16__)
inline __mmask32 tail32(int64_t left) { return left >= 32 ? 0xFFFFFFFFu : (__mmask32)((1u << left) - 1); }
struct BF16 {
  using T = uint16_t;
  using Out = at::BFloat16;
  using V = __m512bh;
  static constexpr int64_t kLanes = 32;
  static V load(const T* p, int64_t left) { return (__m512bh)_mm512_maskz_loadu_epi16(tail32(left), p); }
  static __m512 madd(__m512 acc, V w, V x) { return _mm512_dpbf16_ps(acc, w, x); }
};
#endif

// y[b, r] = W[r, :] . x[b, :] for r in [r0, r0 + R), b in [b0, b0 + B); W row-major [m, n], x [M, n],
// y [M, m]. R weight rows stream from memory together and every one of them meets B rows of x
// while in registers: the weight is read once for B rows (R x B accumulators, R + 1 loads per
// R x B FMAs).
template <typename E, int R, int B>
inline void tile(const typename E::T* w, const typename E::T* x, typename E::Out* y, int64_t r0, int64_t b0,
                 int64_t n, int64_t m) {
  __m512 acc[R][B];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < B; ++j) acc[i][j] = _mm512_setzero_ps();
  const typename E::T* wr = w + r0 * n;
  const typename E::T* xb = x + b0 * n;
  for (int64_t k = 0; k < n; k += E::kLanes) {
    typename E::V xv[B];
#pragma GCC unroll 4
    for (int j = 0; j < B; ++j) xv[j] = E::load(xb + j * n + k, n - k);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const typename E::V wv = E::load(wr + i * n + k, n - k);
#pragma GCC unroll 4
      for (int j = 0; j < B; ++j) acc[i][j] = E::madd(acc[i][j], wv, xv[j]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < B; ++j) y[(b0 + j) * m + r0 + i] = typename E::Out(_mm512_reduce_add_ps(acc[i][j]));
}

// Rows [r0, r1) of y = x W^T for M rows of x: each block of weight rows meets every row of x
// (in tiles of 3, then the 1-2 left: 8 x 3 accumulators, 3 rows of x and one weight vector fit
// the 32 registers) before the next block is read, so the weight streams from memory once
// whatever M is; x stays in the core's caches. (Tiles of 8 x 2 whose 16 sums `sum16` folds at
// once were 1.15x slower at 32 rows in bf16: the multiply-adds bound a tile, not its sums.)
template <typename E, int R>
void rows_block(const typename E::T* w, const typename E::T* x, typename E::Out* y, int64_t r, int64_t n,
                int64_t m, int64_t M) {
  int64_t b = 0;
  for (; b + 3 <= M; b += 3) tile<E, R, 3>(w, x, y, r, b, n, m);
  switch (M - b) {
    case 2: tile<E, R, 2>(w, x, y, r, b, n, m); break;
    case 1: tile<E, R, 1>(w, x, y, r, b, n, m); break;
    default: break;
  }
}

template <typename E>
void rows_multi(const typename E::T* w, const typename E::T* x, typename E::Out* y, int64_t r0, int64_t r1,
                int64_t n, int64_t m, int64_t M) {
  int64_t r = r0;
  for (; r + kTile <= r1; r += kTile) rows_block<E, kTile>(w, x, y, r, n, m, M);
  for (; r < r1; ++r) rows_block<E, 1>(w, x, y, r, n, m, M);
}

// y[c0:c1] = x . Wt[:, c0:c1]; Wt row-major [n, m] (the column-major W of a [m, n] linear).
void f32_cols(const float* wt, const float* x, float* y, int64_t c0, int64_t c1, int64_t n, int64_t m) {
  for (int64_t c = c0; c < c1; c += 16) _mm512_mask_storeu_ps(y + c, tail16(c1 - c), _mm512_setzero_ps());
  int64_t k = 0;
  for (; k < n; k += kF32Cols) {
    const int64_t rows = std::min<int64_t>(kF32Cols, n - k);
    __m512 xv[kF32Cols];
    for (int i = 0; i < kF32Cols; ++i) xv[i] = _mm512_set1_ps(i < rows ? x[k + i] : 0.f);
    const float* wk = wt + k * m;
    for (int64_t c = c0; c < c1; c += 16) {
      const __mmask16 mk = tail16(c1 - c);
      __m512 acc = _mm512_maskz_loadu_ps(mk, y + c);
      if (rows == kF32Cols) {
#pragma GCC unroll 16
        for (int i = 0; i < kF32Cols; ++i) acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, wk + i * m + c), xv[i], acc);
      } else {
        for (int i = 0; i < rows; ++i) acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, wk + i * m + c), xv[i], acc);
      }
      _mm512_mask_storeu_ps(y + c, mk, acc);
    }
  }
}
#endif

#if defined(__AVX512BF16__)
// y[r] = W[r, :] . x for r in [r0, r1), summed in f32 and rounded once; W row-major bf16 [m, n].
void bf16_rows(const uint16_t* w, const uint16_t* x, at::BFloat16* y, int64_t r0, int64_t r1, int64_t n) {
  int64_t r = r0;
  for (; r + kBf16Rows <= r1; r += kBf16Rows) {
    const uint16_t* wr = w + r * n;
    __m512 acc[kBf16Rows];
    for (int i = 0; i < kBf16Rows; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < n; k += 32) {
      const __mmask32 m = tail32(n - k);
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + k);
#pragma GCC unroll 16
      for (int i = 0; i < kBf16Rows; ++i) {
        _mm_prefetch(reinterpret_cast<const char*>(wr + kBf16Ahead * n + i * n + k), _MM_HINT_T0);
        acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_maskz_loadu_epi16(m, wr + i * n + k), xv);
      }
    }
    static_assert(kBf16Rows == 16, "sum16 folds 16 accumulators");
    // rounded to nearest even, as at::BFloat16 rounds (a NaN stays a NaN)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r), (__m256i)_mm512_cvtneps_pbh(sum16(acc)));
  }
  for (; r < r1; ++r) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t k = 0; k < n; k += 32) {
      const __mmask32 m = tail32(n - k);
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(m, w + r * n + k),
                             (__m512bh)_mm512_maskz_loadu_epi16(m, x + k));
    }
    y[r] = at::BFloat16(_mm512_reduce_add_ps(acc));
  }
}
#endif

enum Caps : int64_t { kF32 = 1, kBf16 = 2 };

int64_t caps() {
  int64_t c = 0;
#if defined(__AVX512F__)
  c |= kF32;
#endif
#if defined(__AVX512BF16__)
  c |= kBf16;
#endif
  return c;
}

bool row_major(const at::Tensor& w) { return w.stride(1) == 1 && w.stride(0) == w.size(1); }

#if defined(__AVX512F__)
// y = x W^T for 2..kMaxRows rows of x over a row-major weight, read once (`rows_multi`).
template <typename E>
at::Tensor several_rows(const at::Tensor& x, const at::Tensor& weight) {
  const int64_t m = weight.size(0), n = weight.size(1), rows = x.size(0);
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({rows, m}, x.options());
  const auto* w = reinterpret_cast<const typename E::T*>(weight.data_ptr());
  const auto* xv = reinterpret_cast<const typename E::T*>(xc.data_ptr());
  auto* yv = reinterpret_cast<typename E::Out*>(y.data_ptr());
  per_thread(m, kTile, [&](int64_t lo, int64_t hi) { rows_multi<E>(w, xv, yv, lo, hi, n, m, rows); });
  return y;
}
#endif
bool col_major(const at::Tensor& w) { return w.stride(0) == 1 && w.stride(1) == w.size(0); }

// x [M, n] @ weight[m, n].T -> [M, m]. One row: weight row-major (f32 or bf16) or column-major
// (f32). Several rows: a row-major f32 or bf16 weight up to kMaxRows rows is read once for all
// of them (`rows_multi`); any other case goes to at::linear, so a caller (and a compiled graph)
// may send every batch size here.
at::Tensor vec_linear(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "vec_linear: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "vec_linear: x must be [rows, in] and weight [out, in]");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "vec_linear: x and weight dtypes differ");
  const int64_t m = weight.size(0), n = weight.size(1), rows = x.size(0);
  if (rows != 1) {
    if (rows >= 2 && rows <= kMaxRows && row_major(weight)) {
#if defined(__AVX512F__)
      if (x.scalar_type() == at::kFloat) return several_rows<F32>(x, weight);
#endif
#if defined(__AVX512BF16__)
      if (x.scalar_type() == at::kBFloat16) return several_rows<BF16>(x, weight);
#endif
    }
    return at::linear(x, weight);
  }
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({1, m}, x.options());
#if defined(__AVX512F__)
  if (x.scalar_type() == at::kFloat && row_major(weight)) {
    const float *w = weight.data_ptr<float>(), *xv = xc.data_ptr<float>();
    float* yv = y.data_ptr<float>();
    per_thread(m, kF32Rows, [&](int64_t lo, int64_t hi) { f32_rows(w, xv, yv, lo, hi, n); });
    return y;
  }
  if (x.scalar_type() == at::kFloat && col_major(weight)) {
    const float *w = weight.data_ptr<float>(), *xv = xc.data_ptr<float>();
    float* yv = y.data_ptr<float>();
    per_thread(m, 16, [&](int64_t lo, int64_t hi) { f32_cols(w, xv, yv, lo, hi, n, m); });
    return y;
  }
#endif
#if defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16 && row_major(weight)) {
    const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
    const auto* xv = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
    at::BFloat16* yv = y.data_ptr<at::BFloat16>();
    per_thread(m, kBf16Rows, [&](int64_t lo, int64_t hi) { bf16_rows(w, xv, yv, lo, hi, n); });
    return y;
  }
#endif
  // The message is made of plain strings: c10's stream operators for dtypes and IntArrayRef are
  // inline templates; on the H200 image (torch 2.11, its own compiler) this call crashed the test
  // process, which the dev machine never reproduced. Plain strings leave nothing to mismatch.
  const std::string why = std::string("vec_linear: no kernel for ") + c10::toString(x.scalar_type()) +
                          " with weight strides [" + std::to_string(weight.stride(0)) + ", " +
                          std::to_string(weight.stride(1)) + "] on this build (caps " + std::to_string(caps()) + ")";
  TORCH_CHECK(false, why);
}

}  // namespace

TORCH_LIBRARY(loraserve_cpu, m) {
  m.def("vec_linear(Tensor x, Tensor weight) -> Tensor");
  m.def("caps() -> int");
}

TORCH_LIBRARY_IMPL(loraserve_cpu, CPU, m) { m.impl("vec_linear", &vec_linear); }

TORCH_LIBRARY_IMPL(loraserve_cpu, CompositeExplicitAutograd, m) { m.impl("caps", &caps); }
