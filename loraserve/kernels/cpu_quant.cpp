// Rows times a weight-only quantized matrix on the CPU (model/quant.py's layout): the base
// linears of a decode step on a quantized base. See cpu_quant.py for how it is built and used.
//
// Layout (one for every scheme): codes q are unsigned, w = scale * q + min per group of `group`
// inputs of one output row, scales and mins float16 [N, K / group]. 8-bit codes are one byte each
// ([N, K]); 4-bit codes two to a byte ([N, K / 2]), byte j of each 64-input chunk holding input j
// in its low nibble and input j + 32 in its high one, so one 32-byte load and two masks give the
// chunk's 64 codes in order.
//
// Three kernels. `table_rows` (the one served) takes the activations as they are and makes each
// weight in registers as `dequantize` does (a 4-bit code through a 16-entry table of its group's
// weights, one vpermps per 16 codes), so its product is the dequantized weight's up to the order
// of the float additions; it reads 4 output rows at once, each prefetched 8 KiB ahead. Its floor
// is the float fma per 16 weights and activation row: about 1 zmm fma a cycle on the dev
// machine's Zen 4 core, about 12 GB/s of int4 codes a core at one row in cache: about half the
// 2-thread memory rate, so both cores together should read near it. `rows_f32`, the float
// kernel it replaced, turns codes to float and scales each 32-input block's dot product once,
// with an integer division per chunk (kept for the bench's comparison: 1.4-2.3x slower in
// bench/RESULTS.md's session 11 runs). `rows`
// (int8_acts) quantizes the activations to int8 per block of 32 (d = max|x| / 127), as llama.cpp
// does, so a 64-input chunk is one VNNI dot product (vpdpbusd: unsigned codes x signed
// activations, 64 multiply-adds an instruction); its rounding of x compounds over a real model's
// layers (bench/quant_kernels.py, bench/RESULTS.md). The last two add the mins' share as the sum
// over groups of min * sum(x in group), with the float sums of x. Torch's thread pool splits the
// output rows among its threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

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

// The served kernel: each weight made in registers exactly as `dequantize` makes it (w = fma(q,
// scale, min), min included), then multiplied by the float activations. A 4-bit code becomes its
// weight in one vpermps on a 16-entry table of the group's weights (vpermps reads only the low 4
// bits of each index: a byte widened to 32 bits indexes with its low nibble, shifted right by 4
// with its high one, no mask); an 8-bit code by widening, a conversion and the fma. `Streams`
// output rows are read at once, each prefetched `ahead` bytes in front, and each weight vector
// meets `Rows` activation rows while in a register. Results are the dequantized weight's product
// up to the order of the float additions. The loop holds no division and no scalar float16
// conversion: a block's scales and mins are made float once (`block_scales`), and the group of
// each half-chunk is counted forward.

// sf[j][0][g] = scale, sf[j][1][g] = min of output row o + j, group g, as float.
template <int Streams>
void block_scales(const uint16_t* sc, const uint16_t* mn, int64_t o, int64_t groups, float* sf) {
  for (int j = 0; j < Streams; ++j)
    for (int part = 0; part < 2; ++part) {
      const uint16_t* src = (part ? mn : sc) + (o + j) * groups;
      float* dst = sf + (2 * j + part) * groups;
      for (int64_t g = 0; g < groups; g += 16) {
        const __mmask16 mk = groups - g >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (groups - g)) - 1);
        _mm512_mask_storeu_ps(dst + g, mk, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, src + g)));
      }
    }
}

inline __m512 group_table(const float* s, const float* m, int64_t g) {
  const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_fmadd_ps(q, _mm512_set1_ps(s[g]), _mm512_set1_ps(m[g]));
}

// The 64 weights of chunk c of one output row (inputs 0-15, 16-31, 32-47, 48-63); g0 and g1 the
// groups of its two halves (equal unless `Split`: a group that is no multiple of 64).
template <int Bits, bool Split>
inline void chunk_weights(const uint8_t* row, const float* s, const float* m, int64_t c, int64_t g0, int64_t g1,
                          __m512 wv[4]) {
  if constexpr (Bits == 4) {
    const uint8_t* p = row + c * 32;
    const __m512 ta = group_table(s, m, g0), tb = Split ? group_table(s, m, g1) : ta;
    const __m512i i0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512i i1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
    wv[0] = _mm512_permutexvar_ps(i0, ta);
    wv[1] = _mm512_permutexvar_ps(i1, ta);
    wv[2] = _mm512_permutexvar_ps(_mm512_srli_epi32(i0, 4), tb);
    wv[3] = _mm512_permutexvar_ps(_mm512_srli_epi32(i1, 4), tb);
  } else {
    const uint8_t* p = row + c * kChunk;
    const __m512 sa = _mm512_set1_ps(s[g0]), ma = _mm512_set1_ps(m[g0]);
    const __m512 sb = Split ? _mm512_set1_ps(s[g1]) : sa, mb = Split ? _mm512_set1_ps(m[g1]) : ma;
#pragma GCC unroll 4
    for (int part = 0; part < 4; ++part) {
      const __m512 q = _mm512_cvtepi32_ps(
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + part * 16))));
      wv[part] = _mm512_fmadd_ps(q, part < 2 ? sa : sb, part < 2 ? ma : mb);
    }
  }
}

// y[r0 + i, o + j] for j < Streams, i < Rows; sf from block_scales. One activation row keeps two
// accumulators a stream (two chains of fmas, not one of four).
template <int Bits, bool Split, int Rows, int Streams>
void table_block(const uint8_t* w, const float* sf, const float* x, float* y, int64_t o, int64_t n, int64_t k,
                 int64_t group, int64_t r0, int64_t ahead) {
  constexpr int kAcc = Rows == 1 ? 2 : 1;
  const int64_t chunks = k / kChunk, groups = k / group, row_bytes = Bits == 8 ? k : k / 2;
  __m512 acc[Streams][Rows][kAcc];
#pragma GCC unroll 8
  for (int j = 0; j < Streams; ++j)
#pragma GCC unroll 4
    for (int i = 0; i < Rows; ++i)
#pragma GCC unroll 2
      for (int a = 0; a < kAcc; ++a) acc[j][i][a] = _mm512_setzero_ps();
  const float* xr = x + r0 * k;
  int64_t g0 = 0, g1 = 0, end0 = group, end1 = group;  // the halves' groups and where each ends
  for (int64_t c = 0; c < chunks; ++c) {
    while (c * kChunk >= end0) ++g0, end0 += group;
    if (Split)
      while (c * kChunk + 32 >= end1) ++g1, end1 += group;
#pragma GCC unroll 8
    for (int j = 0; j < Streams; ++j) {
      const uint8_t* row = w + (o + j) * row_bytes;
      if (ahead) _mm_prefetch(reinterpret_cast<const char*>(row + c * (kChunk * Bits / 8) + ahead), _MM_HINT_T0);
      __m512 wv[4];
      const float* s = sf + 2 * j * groups;
      chunk_weights<Bits, Split>(row, s, s + groups, c, g0, Split ? g1 : g0, wv);
#pragma GCC unroll 4
      for (int i = 0; i < Rows; ++i)
#pragma GCC unroll 4
        for (int part = 0; part < 4; ++part)
          acc[j][i][part % kAcc] =
              _mm512_fmadd_ps(wv[part], _mm512_loadu_ps(xr + i * k + c * kChunk + part * 16), acc[j][i][part % kAcc]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < Streams; ++j)
#pragma GCC unroll 4
    for (int i = 0; i < Rows; ++i) {
      __m512 t = acc[j][i][0];
      if (kAcc == 2) t = _mm512_add_ps(t, acc[j][i][kAcc - 1]);
      y[(r0 + i) * n + o + j] = _mm512_reduce_add_ps(t);
    }
}

// Output rows [n0, n1) for all m activation rows: each block of Streams output rows meets every
// activation row (4 at a time) before the next block is read, so the weights stream from memory
// once whatever m is.
template <int Bits, bool Split, int Streams>
void table_rows(const uint8_t* w, const uint16_t* sc, const uint16_t* mn, const float* x, float* y, int64_t n0,
                int64_t n1, int64_t m, int64_t n, int64_t k, int64_t group, int64_t ahead) {
  std::vector<float> scratch(2 * Streams * (k / group));
  float* sf = scratch.data();
  const auto block = [&](auto streams, int64_t o) {
    constexpr int S = decltype(streams)::value;
    block_scales<S>(sc, mn, o, k / group, sf);
    int64_t r = 0;
    for (; r + kMaxRows <= m; r += kMaxRows) table_block<Bits, Split, kMaxRows, S>(w, sf, x, y, o, n, k, group, r, ahead);
    switch (m - r) {
      case 1: table_block<Bits, Split, 1, S>(w, sf, x, y, o, n, k, group, r, ahead); break;
      case 2: table_block<Bits, Split, 2, S>(w, sf, x, y, o, n, k, group, r, ahead); break;
      case 3: table_block<Bits, Split, 3, S>(w, sf, x, y, o, n, k, group, r, ahead); break;
      default: break;
    }
  };
  int64_t o = n0;
  for (; o + Streams <= n1; o += Streams) block(std::integral_constant<int, Streams>{}, o);
  for (; o < n1; ++o) block(std::integral_constant<int, 1>{}, o);
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

// Which kernel multiplies (quant_linear_kernel's `kernel`): the served one, the float kernel it
// replaced (bench/quant_kernels.py compares them), the int8-activation one.
enum Kernel : int64_t { kTable = 0, kFloatV1 = 1, kInt8Acts = 2 };
// The table kernel as served: output rows read at once and bytes of each prefetched in front of its
// reads (a layer's rows lie end to end, so far ahead is the rows that follow). Chosen by
// bench/quant_kernels.py --streams 2 4 8 --ahead 0 ... 16384 (bench/RESULTS.md, session 11): no
// prefetch or 256-1024 bytes read 10-25% slower than 4-16 KiB, which were alike; 4 streams and
// 8 KiB were at the top within noise, and 4 streams computed faster than 2 on one core.
constexpr int64_t kServedStreams = 4, kAhead = 8192;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
template <int Bits>
void table_all(const uint8_t* w, const uint16_t* sc, const uint16_t* mn, const float* x, float* y, int64_t n0,
               int64_t n1, int64_t m, int64_t n, int64_t k, int64_t group, int64_t streams, int64_t ahead) {
  const bool split = group % kChunk != 0;
  switch (streams) {
    case 2: split ? table_rows<Bits, true, 2>(w, sc, mn, x, y, n0, n1, m, n, k, group, ahead)
                  : table_rows<Bits, false, 2>(w, sc, mn, x, y, n0, n1, m, n, k, group, ahead); break;
    case 8: split ? table_rows<Bits, true, 8>(w, sc, mn, x, y, n0, n1, m, n, k, group, ahead)
                  : table_rows<Bits, false, 8>(w, sc, mn, x, y, n0, n1, m, n, k, group, ahead); break;
    default: split ? table_rows<Bits, true, 4>(w, sc, mn, x, y, n0, n1, m, n, k, group, ahead)
                   : table_rows<Bits, false, 4>(w, sc, mn, x, y, n0, n1, m, n, k, group, ahead); break;
  }
}
#endif

at::Tensor product(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                   int64_t bits, int64_t group, int64_t kernel, int64_t streams, int64_t ahead) {
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
  TORCH_CHECK(kernel >= kTable && kernel <= kInt8Acts, "quant_linear: unknown kernel ", kernel);
  at::Tensor y = at::empty({m, n}, x.options());
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
  const at::Tensor xc = x.contiguous();
  const bool int8_acts = kernel == kInt8Acts, sums = kernel != kTable;
  at::Tensor q = at::empty({int8_acts ? m : 0, k}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({int8_acts ? m : 0, k / kChunk, 16}, x.options());
  at::Tensor s = at::empty({sums ? m : 0, k / group}, x.options());
  if (sums) quantize_acts(xc.data_ptr<float>(), m, k, group, q.data_ptr<int8_t>(), d.data_ptr<float>(),
                          s.data_ptr<float>(), int8_acts);
  const Acts a{q.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<float>()};
  const auto* w = codes.data_ptr<uint8_t>();
  const auto* sc = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const auto* mn = reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>());
  const float* xv = xc.data_ptr<float>();
  float* yv = y.data_ptr<float>();
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n / 16));
  const int64_t share = ((n + threads - 1) / threads + 15) / 16 * 16;
  at::parallel_for(0, threads, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t n0 = t * share, n1 = std::min(n, n0 + share);
      if (n0 >= n1) continue;
      if (kernel == kTable) {
        if (bits == 8) table_all<8>(w, sc, mn, xv, yv, n0, n1, m, n, k, group, streams, ahead);
        else table_all<4>(w, sc, mn, xv, yv, n0, n1, m, n, k, group, streams, ahead);
      } else if (int8_acts) {
        if (bits == 8) all_rows<8>(w, sc, mn, a, yv, n0, n1, m, n, k, group);
        else all_rows<4>(w, sc, mn, a, yv, n0, n1, m, n, k, group);
      } else {
        if (bits == 8) all_rows_f32<8>(w, sc, mn, xv, a.s, yv, n0, n1, m, n, k, group);
        else all_rows_f32<4>(w, sc, mn, xv, a.s, yv, n0, n1, m, n, k, group);
      }
    }
  });
  return y;
#else
  TORCH_CHECK(false, std::string("quant_linear: this build has no kernel (caps ") + std::to_string(caps()) + ")");
  return y;
#endif
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const at::Tensor& mins, int64_t bits, int64_t group, bool int8_acts) {
  return product(x, codes, scales, mins, bits, group, int8_acts ? kInt8Acts : kTable, kServedStreams, kAhead);
}

at::Tensor quant_linear_kernel(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                               const at::Tensor& mins, int64_t bits, int64_t group, int64_t kernel, int64_t streams,
                               int64_t ahead) {
  return product(x, codes, scales, mins, bits, group, kernel, streams, ahead);
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
  m.def("quant_linear_kernel(Tensor x, Tensor codes, Tensor scales, Tensor mins, int bits, int group, int kernel, "
        "int streams, int ahead) -> Tensor");
  m.def("caps() -> int");
}

TORCH_LIBRARY_IMPL(loraserve_quant, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_linear_kernel", &quant_linear_kernel);
  m.impl("dequantize", &quant_dequantize);
}

TORCH_LIBRARY_IMPL(loraserve_quant, CompositeExplicitAutograd, m) { m.impl("caps", &caps); }
