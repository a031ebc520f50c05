// Rows times a weight-only quantized matrix on the CPU (model/quant.py's layout): the base
// linears of a decode step on a quantized base. See cpu_quant.py for how it is built and used.
//
// Layout (one for every scheme): codes q are unsigned, w = scale * q + min per group of `group`
// inputs of one output row, scales and mins float16 [N, K / group]. 8-bit codes are one byte each
// ([N, K]); 4-bit codes two to a byte ([N, K / 2]), byte j of each 64-input chunk holding input j
// in its low nibble and input j + 32 in its high one, so one 32-byte load and two masks give the
// chunk's 64 codes in order.
//
// Two kernels. `rows_f32` (the one served) takes the activations as they are: codes go to float,
// each 32-input block's dot product is scaled once. `rows` (int8_acts) quantizes the activations
// to int8 per block of 32 (d = max|x| / 127), as llama.cpp does, so a 64-input chunk is one VNNI
// dot product (vpdpbusd: unsigned codes x signed activations, 64 multiply-adds an instruction);
// it reads no faster at decode shapes and its rounding of x compounds over a real model's layers
// (bench/quant_kernels.py, bench/RESULTS.md). Both add the mins' share as the sum over groups of
// min * sum(x in group), with the float sums of x. A decode step's time is the time to read the
// weights: two output rows are read at once (two streams in flight), up to four activation rows
// share each chunk read, and torch's thread pool splits the output rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

namespace {

constexpr int64_t kChunk = 64;  // inputs per step: two 32-blocks of activation scales
constexpr int kMaxRows = 4;     // activation rows that share one read of a weight chunk
constexpr int kStreams = 2;     // output rows read at once

int64_t caps() {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
  return 1;
#else
  return 0;
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)

// The activations, quantized once per call and shared by every output row.
struct Acts {
  const int8_t* q;  // [M, K] int8 codes
  const float* d;   // [M, K / 64, 16]: lanes 0-7 the first 32-block's scale, 8-15 the second's
  const float* s;   // [M, K / group]: sum of x over each weight group
};

void quantize_acts(const float* x, int64_t m, int64_t k, int64_t group, int8_t* q, float* d, float* s,
                   bool codes) {
  const int64_t chunks = k / kChunk, groups = k / group;
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = x + r * k;
    for (int64_t b = 0; codes && b < k / 32; ++b) {
      const __m512 a = _mm512_loadu_ps(xr + b * 32), c = _mm512_loadu_ps(xr + b * 32 + 16);
      const float amax = std::max(_mm512_reduce_max_ps(_mm512_abs_ps(a)), _mm512_reduce_max_ps(_mm512_abs_ps(c)));
      const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      const __m512 iv = _mm512_set1_ps(inv);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + r * k + b * 32),
                       _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(a, iv))));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + r * k + b * 32 + 16),
                       _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(c, iv))));
      float* dr = d + (r * chunks + b / 2) * 16 + (b % 2) * 8;
      for (int i = 0; i < 8; ++i) dr[i] = scale;
    }
    for (int64_t g = 0; g < groups; ++g) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t i = 0; i < group; i += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(xr + g * group + i));
      s[r * groups + g] = _mm512_reduce_add_ps(acc);
    }
  }
}

template <int Bits>
inline __m512i load_codes(const uint8_t* row, int64_t c) {
  if constexpr (Bits == 8) {
    return _mm512_loadu_si512(row + c * kChunk);
  } else {
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c * 32));
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(packed, low), hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
}

inline float half(uint16_t h) { return _cvtsh_ss(h); }

// y[r, n] for output rows [n0, n1) and activation rows [r0, r0 + Rows).
template <int Bits, int Rows>
void rows(const uint8_t* w, const uint16_t* sc, const uint16_t* mn, const Acts& a, float* y,
          int64_t n0, int64_t n1, int64_t n, int64_t k, int64_t group, int64_t r0) {
  const int64_t chunks = k / kChunk, groups = k / group, row_bytes = Bits == 8 ? k : k / 2;
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t o = n0; o < n1; o += kStreams) {
    const int streams = static_cast<int>(std::min<int64_t>(kStreams, n1 - o));
    __m512 acc[kStreams][Rows];
    for (int j = 0; j < kStreams; ++j)
      for (int i = 0; i < Rows; ++i) acc[j][i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t g0 = (c * kChunk) / group, g1 = (c * kChunk + 32) / group;
      __m512 dx[Rows];
      __m512i xq[Rows];
      for (int i = 0; i < Rows; ++i) {
        dx[i] = _mm512_loadu_ps(a.d + ((r0 + i) * chunks + c) * 16);
        xq[i] = _mm512_loadu_si512(a.q + (r0 + i) * k + c * kChunk);
      }
#pragma GCC unroll 2
      for (int j = 0; j < kStreams; ++j) {
        if (j >= streams) break;
        const int64_t row = o + j;
        const __m512i codes = load_codes<Bits>(w + row * row_bytes, c);
        const uint16_t* s = sc + row * groups;
        const __m512 sv = _mm512_insertf32x8(_mm512_set1_ps(half(s[g0])), _mm256_set1_ps(half(s[g1])), 1);
        for (int i = 0; i < Rows; ++i) {
          const __m512i dot = _mm512_dpbusd_epi32(zero, codes, xq[i]);
          acc[j][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(sv, dx[i]), acc[j][i]);
        }
      }
    }
    for (int j = 0; j < streams; ++j) {
      const uint16_t* m = mn + (o + j) * groups;
      for (int i = 0; i < Rows; ++i) {
        float t = _mm512_reduce_add_ps(acc[j][i]);
        const float* xs = a.s + (r0 + i) * groups;
        for (int64_t g = 0; g < groups; ++g) t += half(m[g]) * xs[g];
        y[(r0 + i) * n + o + j] = t;
      }
    }
  }
}

// w[r, :] = scale * q + min for rows [r0, r1): prefill's float weight, read once per call.
template <int Bits>
void dequantize_rows(const uint8_t* w, const uint16_t* sc, const uint16_t* mn, float* out, int64_t r0,
                     int64_t r1, int64_t k, int64_t group) {
  const int64_t chunks = k / kChunk, groups = k / group, row_bytes = Bits == 8 ? k : k / 2;
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t c = 0; c < chunks; ++c) {
      alignas(64) uint8_t codes[kChunk];
      _mm512_store_si512(codes, load_codes<Bits>(w + r * row_bytes, c));
      for (int part = 0; part < 4; ++part) {
        const int64_t g = (c * kChunk + part * 16) / group;
        const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
            _mm_load_si128(reinterpret_cast<const __m128i*>(codes + part * 16))));
        _mm512_storeu_ps(out + r * k + c * kChunk + part * 16,
                         _mm512_fmadd_ps(q, _mm512_set1_ps(half(sc[r * groups + g])),
                                         _mm512_set1_ps(half(mn[r * groups + g]))));
      }
    }
  }
}

// The same product with the activations as they are (float32): the codes go to float and each
// 32-input block's dot product is scaled once. About twice the instructions of `rows` per weight,
// but no rounding of x: the result is the dequantized weight's product to float rounding.
template <int Bits, int Rows>
void rows_f32(const uint8_t* w, const uint16_t* sc, const uint16_t* mn, const float* x, const float* xs,
              float* y, int64_t n0, int64_t n1, int64_t n, int64_t k, int64_t group, int64_t r0) {
  const int64_t chunks = k / kChunk, groups = k / group, row_bytes = Bits == 8 ? k : k / 2;
  for (int64_t o = n0; o < n1; o += kStreams) {
    const int streams = static_cast<int>(std::min<int64_t>(kStreams, n1 - o));
    __m512 acc[kStreams][Rows];
    for (int j = 0; j < kStreams; ++j)
      for (int i = 0; i < Rows; ++i) acc[j][i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
#pragma GCC unroll 2
      for (int j = 0; j < kStreams; ++j) {
        if (j >= streams) break;
        const int64_t row = o + j;
        const __m512i codes = load_codes<Bits>(w + row * row_bytes, c);
        const uint16_t* s = sc + row * groups;
        for (int half_block = 0; half_block < 2; ++half_block) {
          const float scale = half(s[(c * kChunk + half_block * 32) / group]);
          const __m512 qa = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(codes, 2 * half_block)));
          const __m512 qb = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(codes, 2 * half_block + 1)));
          const __m512 sv = _mm512_set1_ps(scale);
          for (int i = 0; i < Rows; ++i) {
            const float* xr = x + (r0 + i) * k + c * kChunk + half_block * 32;
            const __m512 dot = _mm512_fmadd_ps(qb, _mm512_loadu_ps(xr + 16), _mm512_mul_ps(qa, _mm512_loadu_ps(xr)));
            acc[j][i] = _mm512_fmadd_ps(dot, sv, acc[j][i]);
          }
        }
      }
    }
    for (int j = 0; j < streams; ++j) {
      const uint16_t* m = mn + (o + j) * groups;
      for (int i = 0; i < Rows; ++i) {
        float t = _mm512_reduce_add_ps(acc[j][i]);
        const float* xsr = xs + (r0 + i) * groups;
        for (int64_t g = 0; g < groups; ++g) t += half(m[g]) * xsr[g];
        y[(r0 + i) * n + o + j] = t;
      }
    }
  }
}

template <int Bits>
void all_rows_f32(const uint8_t* w, const uint16_t* sc, const uint16_t* mn, const float* x, const float* xs,
                  float* y, int64_t n0, int64_t n1, int64_t m, int64_t n, int64_t k, int64_t group) {
  for (int64_t r = 0; r < m; r += kMaxRows) {
    switch (std::min<int64_t>(kMaxRows, m - r)) {
      case 1: rows_f32<Bits, 1>(w, sc, mn, x, xs, y, n0, n1, n, k, group, r); break;
      case 2: rows_f32<Bits, 2>(w, sc, mn, x, xs, y, n0, n1, n, k, group, r); break;
      case 3: rows_f32<Bits, 3>(w, sc, mn, x, xs, y, n0, n1, n, k, group, r); break;
      default: rows_f32<Bits, 4>(w, sc, mn, x, xs, y, n0, n1, n, k, group, r); break;
    }
  }
}

template <int Bits>
void all_rows(const uint8_t* w, const uint16_t* sc, const uint16_t* mn, const Acts& a, float* y,
              int64_t n0, int64_t n1, int64_t m, int64_t n, int64_t k, int64_t group) {
  for (int64_t r = 0; r < m; r += kMaxRows) {
    switch (std::min<int64_t>(kMaxRows, m - r)) {
      case 1: rows<Bits, 1>(w, sc, mn, a, y, n0, n1, n, k, group, r); break;
      case 2: rows<Bits, 2>(w, sc, mn, a, y, n0, n1, n, k, group, r); break;
      case 3: rows<Bits, 3>(w, sc, mn, a, y, n0, n1, n, k, group, r); break;
      default: rows<Bits, 4>(w, sc, mn, a, y, n0, n1, n, k, group, r); break;
    }
  }
}
#endif

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const at::Tensor& mins, int64_t bits, int64_t group, bool int8_acts) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "quant_linear: x must be float32 [M, K]");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 2,
              "quant_linear: codes must be contiguous uint8 [N, K or K/2]");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && mins.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  mins.is_contiguous(), "quant_linear: scales and mins must be contiguous float16");
  const int64_t m = x.size(0), k = x.size(1), n = codes.size(0);
  TORCH_CHECK(bits == 4 || bits == 8, "quant_linear: bits must be 4 or 8");
  TORCH_CHECK(k % kChunk == 0 && group % 32 == 0 && k % group == 0,
              "quant_linear: K must be a multiple of 64 and of the group, the group of 32");
  TORCH_CHECK(codes.size(1) == (bits == 8 ? k : k / 2) && scales.size(0) == n && scales.size(1) == k / group &&
                  mins.sizes() == scales.sizes(), "quant_linear: codes, scales and mins disagree with x");
  at::Tensor y = at::empty({m, n}, x.options());
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
  const at::Tensor xc = x.contiguous();
  at::Tensor q = at::empty({int8_acts ? m : 0, k}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({int8_acts ? m : 0, k / kChunk, 16}, x.options());
  at::Tensor s = at::empty({m, k / group}, x.options());
  quantize_acts(xc.data_ptr<float>(), m, k, group, q.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<float>(),
                int8_acts);
  const Acts a{q.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<float>()};
  const auto* w = codes.data_ptr<uint8_t>();
  const auto* sc = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const auto* mn = reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>());
  float* yv = y.data_ptr<float>();
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n / 16));
  const int64_t share = ((n + threads - 1) / threads + 15) / 16 * 16;
  at::parallel_for(0, threads, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t n0 = t * share, n1 = std::min(n, n0 + share);
      if (n0 >= n1) continue;
      if (int8_acts) {
        if (bits == 8) all_rows<8>(w, sc, mn, a, yv, n0, n1, m, n, k, group);
        else all_rows<4>(w, sc, mn, a, yv, n0, n1, m, n, k, group);
      } else {
        if (bits == 8) all_rows_f32<8>(w, sc, mn, xc.data_ptr<float>(), a.s, yv, n0, n1, m, n, k, group);
        else all_rows_f32<4>(w, sc, mn, xc.data_ptr<float>(), a.s, yv, n0, n1, m, n, k, group);
      }
    }
  });
  return y;
#else
  TORCH_CHECK(false, std::string("quant_linear: this build has no kernel (caps ") + std::to_string(caps()) + ")");
  return y;
#endif
}

at::Tensor quant_dequantize(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                            int64_t bits, int64_t k, int64_t group) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && scales.scalar_type() == at::kHalf &&
                  mins.scalar_type() == at::kHalf && scales.is_contiguous() && mins.is_contiguous(),
              "quant_dequantize: uint8 codes and float16 scales and mins, contiguous");
  const int64_t n = codes.size(0);
  TORCH_CHECK((bits == 4 || bits == 8) && k % kChunk == 0 && group % 32 == 0 && k % group == 0 &&
                  codes.size(1) == (bits == 8 ? k : k / 2) && scales.size(0) == n && scales.size(1) == k / group,
              "quant_dequantize: codes, scales and mins disagree with K and the group");
  at::Tensor out = at::empty({n, k}, scales.options().dtype(at::kFloat));
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
  const auto* w = codes.data_ptr<uint8_t>();
  const auto* sc = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const auto* mn = reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>());
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t lo, int64_t hi) {
    if (bits == 8) dequantize_rows<8>(w, sc, mn, o, lo, hi, k, group);
    else dequantize_rows<4>(w, sc, mn, o, lo, hi, k, group);
  });
  return out;
#else
  TORCH_CHECK(false, std::string("quant_dequantize: this build has no kernel (caps ") + std::to_string(caps()) + ")");
  return out;
#endif
}

}  // namespace

TORCH_LIBRARY(loraserve_quant, m) {
  m.def("dequantize(Tensor codes, Tensor scales, Tensor mins, int bits, int k, int group) -> Tensor");
  m.def("quant_linear(Tensor x, Tensor codes, Tensor scales, Tensor mins, int bits, int group, bool int8_acts) -> Tensor");
  m.def("caps() -> int");
}

TORCH_LIBRARY_IMPL(loraserve_quant, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("dequantize", &quant_dequantize);
}

TORCH_LIBRARY_IMPL(loraserve_quant, CompositeExplicitAutograd, m) { m.impl("caps", &caps); }
