// Linear layers over GGUF's quantized blocks, read as stored (engine/execution/quant/linear.py; its
// torch reference: the gguf package's dequantizer + torch.mm, quant/reference.py).
//
//   quant_linear(x, raw, type, K, out):  out[M, N] = x[M, K] (float32) @ W^T, W [N, K] held as raw
//       [N, row bytes] GGUF blocks of `type` (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K)
//   dequantize_rows(raw, type, K):       float32 [R, K] of raw [R, row bytes] (the embedding's rows)
//   dequantize_into(raw, type, out):     the same into out [R, K], float32 or bfloat16 (rounded to nearest even)
//   quant_gemv(x, raws, types, out):     one row in integer arithmetic (quant_gemv.cpp, bound here)
//
// Each 32 weights are decoded from their block into float32 (the gguf package's operations in its
// order, so dequantize_rows gives its bits; built with -ffp-contract=off) and multiplied into
// 16-lane float32 partial sums by fused multiply-adds: lane l takes k = l, l + 16, ... in order of
// k, then a fixed tree over the 16 lanes. Nothing in that order depends on M, on the rows that
// share the call, on the tiling or on the threads (they split the output columns, never K): a
// row's output has the same bits alone or in any batch. AVX-512 holds the 16 lanes in one
// register, AVX2 in two, plain code in an array, with the same operations (std::fma is exact), so
// every build gives the same bits too (tests/test_quant_linear.py builds each one this CPU runs).
//
// Memory: W is read once per call, each block decoded once per tile of kTileRows rows of x (the
// tile's partial sums stay in registers); x's rows are float32 and sit in L1/L2 for decode steps.

#include <torch/types.h>  // ATen's tensors only: torch/extension.h (all of torch's C++ API) took ~1.8x the compile
#include <torch/csrc/utils/pybind.h>  // pybind11 with at::Tensor's type caster
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

// GGML's type numbers (gguf.GGMLQuantizationType).
constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14;
constexpr int kTileRows = 4;  // rows of x per micro-tile
constexpr int kTileCols = 4;  // decoded weight rows per micro-tile (16 accumulators)

// ---- 16 float32 lanes (V16) and 16 bytes (B16) ----
#if defined(__AVX512F__)
struct V16 { __m512 v; };
inline V16 vzero() { return {_mm512_setzero_ps()}; }
inline V16 vset(float a) { return {_mm512_set1_ps(a)}; }
inline V16 vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void vstore(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
inline V16 vmul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 vadd(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 vsub(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V16 vfma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline __m256 halves(V16 a) {  // l_i + l_{i+8}
  return _mm256_add_ps(_mm512_castps512_ps256(a.v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1)));
}
inline V16 from_u8(__m128i b) { return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b))}; }
inline V16 from_i8(__m128i b) { return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b))}; }
#define PDSERVE_SIMD 1
#elif defined(__AVX2__) && defined(__FMA__)
struct V16 { __m256 lo, hi; };
inline V16 vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 vset(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
inline V16 vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void vstore(float* p, V16 a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
inline V16 vmul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 vadd(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 vsub(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V16 vfma(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline __m256 halves(V16 a) { return _mm256_add_ps(a.lo, a.hi); }
inline V16 from_u8(__m128i b) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)))};
}
inline V16 from_i8(__m128i b) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
}
#define PDSERVE_SIMD 1
#else
struct V16 { float l[16]; };
inline V16 vzero() { return V16{}; }
inline V16 vset(float a) { V16 v; for (float& l : v.l) l = a; return v; }
inline V16 vload(const float* p) { V16 v; std::memcpy(v.l, p, sizeof v.l); return v; }
inline void vstore(float* p, V16 a) { std::memcpy(p, a.l, sizeof a.l); }
#define PDSERVE_LANEWISE(name, expr) \
  inline V16 name(V16 a, V16 b) { for (int i = 0; i < 16; ++i) a.l[i] = expr; return a; }
PDSERVE_LANEWISE(vmul, a.l[i] * b.l[i])
PDSERVE_LANEWISE(vadd, a.l[i] + b.l[i])
PDSERVE_LANEWISE(vsub, a.l[i] - b.l[i])
#undef PDSERVE_LANEWISE
inline V16 vfma(V16 a, V16 b, V16 c) {
  for (int i = 0; i < 16; ++i) c.l[i] = std::fma(a.l[i], b.l[i], c.l[i]);
  return c;
}
#endif

#ifdef PDSERVE_SIMD
using B16 = __m128i;
inline B16 bload(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline B16 bits(B16 b, int shift, uint8_t mask) {  // (b >> shift) & mask per byte (the mask drops the neighbour's bits)
  return _mm_and_si128(_mm_srl_epi16(b, _mm_cvtsi32_si128(shift)), _mm_set1_epi8(static_cast<char>(mask)));
}
inline B16 bor_shl4(B16 a, B16 b) { return _mm_or_si128(a, _mm_slli_epi16(b, 4)); }  // a | b << 4, b < 16
#else
struct B16 { uint8_t b[16]; };
inline B16 bload(const uint8_t* p) { B16 v; std::memcpy(v.b, p, 16); return v; }
inline B16 bits(B16 v, int shift, uint8_t mask) { for (uint8_t& b : v.b) b = (b >> shift) & mask; return v; }
inline B16 bor_shl4(B16 a, B16 b) { for (int i = 0; i < 16; ++i) a.b[i] |= b.b[i] << 4; return a; }
inline V16 from_u8(B16 b) { V16 v; for (int i = 0; i < 16; ++i) v.l[i] = static_cast<float>(b.b[i]); return v; }
inline V16 from_i8(B16 b) {
  V16 v;
  for (int i = 0; i < 16; ++i) v.l[i] = static_cast<float>(static_cast<int8_t>(b.b[i]));
  return v;
}
#endif

// The fixed tree: s8_i = l_i + l_{i+8}, s4_i = s8_i + s8_{i+4}, s2_i = s4_i + s4_{i+2}, s2_0 + s2_1.
inline float reduce16(V16 a) {
#ifdef PDSERVE_SIMD
  const __m256 s8 = halves(a);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
#else
  float s8[8], s4[4];
  for (int i = 0; i < 8; ++i) s8[i] = a.l[i] + a.l[i + 8];
  for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
#endif
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(bits);  // exact, as the software conversion below
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// ---- the block types: values and bytes per block; sub-block s's 32 weights as w0 (k 0..15), w1 (16..31) ----
// Each decode is the gguf package's float32 operations in its order (quants.py dequantize_blocks).
template <int T> struct Block;

template <> struct Block<kQ4_0> {  // d (f16), 16 bytes of nibbles (low: k 0..15, high: 16..31): w = d * (q - 8)
  static constexpr int kValues = 32, kBytes = 18;
  static inline void decode(const uint8_t* b, int, V16& w0, V16& w1) {
    const V16 d = vset(half_at(b)), eight = vset(8.0f);
    const B16 qs = bload(b + 2);
    w0 = vmul(d, vsub(from_u8(bits(qs, 0, 0x0F)), eight));
    w1 = vmul(d, vsub(from_u8(bits(qs, 4, 0x0F)), eight));
  }
};

template <> struct Block<kQ4_1> {  // d, m (f16), 16 bytes of nibbles: w = d * q + m
  static constexpr int kValues = 32, kBytes = 20;
  static inline void decode(const uint8_t* b, int, V16& w0, V16& w1) {
    const V16 d = vset(half_at(b)), m = vset(half_at(b + 2));
    const B16 qs = bload(b + 4);
    w0 = vadd(vmul(d, from_u8(bits(qs, 0, 0x0F))), m);
    w1 = vadd(vmul(d, from_u8(bits(qs, 4, 0x0F))), m);
  }
};

template <> struct Block<kQ8_0> {  // d (f16), 32 int8: w = q * d
  static constexpr int kValues = 32, kBytes = 34;
  static inline void decode(const uint8_t* b, int, V16& w0, V16& w1) {
    const V16 d = vset(half_at(b));
    w0 = vmul(from_i8(bload(b + 2)), d);
    w1 = vmul(from_i8(bload(b + 18)), d);
  }
};

template <> struct Block<kQ4_K> {  // 256 values: d, dmin (f16), 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
  static constexpr int kValues = 256, kBytes = 144;
  // Sub-block s: w = (d * scale_s) * q - dmin * min_s; q the low nibbles of bytes 32 (s / 2) .. +31
  // for even s, their high nibbles for odd s.
  static inline void decode(const uint8_t* b, int s, V16& w0, V16& w1) {
    const uint8_t* sc = b + 4;
    int scale, min;
    if (s < 4) {
      scale = sc[s] & 0x3F;
      min = sc[s + 4] & 0x3F;
    } else {
      scale = (sc[s + 4] & 0x0F) | ((sc[s - 4] >> 2) & 0x30);
      min = (sc[s + 4] >> 4) | ((sc[s] >> 2) & 0x30);
    }
    const V16 d = vset(half_at(b) * static_cast<float>(scale)), dm = vset(half_at(b + 2) * static_cast<float>(min));
    const uint8_t* qs = b + 16 + 32 * (s / 2);
    const int shift = 4 * (s % 2);
    w0 = vsub(vmul(d, from_u8(bits(bload(qs), shift, 0x0F))), dm);
    w1 = vsub(vmul(d, from_u8(bits(bload(qs + 16), shift, 0x0F))), dm);
  }
};

template <> struct Block<kQ6_K> {  // 256 values: 128 bytes low nibbles, 64 bytes high 2 bits, 16 int8 scales, d (f16)
  static constexpr int kValues = 256, kBytes = 210;
  // Sub-block s = 4 h + t: low 4 bits from ql[64 h + 32 (t % 2) + j] (>> 4 when t >= 2), high 2
  // bits from qh[32 h + j] >> 2 t; w = (d * scale) * (q - 32), one scale per 16 values.
  static inline void decode(const uint8_t* b, int s, V16& w0, V16& w1) {
    const int h = s / 4, t = s % 4;
    const uint8_t* ql = b + 64 * h + 32 * (t % 2);
    const uint8_t* qh = b + 128 + 32 * h;
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_at(b + 208);
    const int low_shift = 4 * (t / 2), high_shift = 2 * t;
    const V16 offset = vset(32.0f);
    for (int half = 0; half < 2; ++half) {
      const B16 q = bor_shl4(bits(bload(ql + 16 * half), low_shift, 0x0F), bits(bload(qh + 16 * half), high_shift, 0x03));
      const V16 w = vmul(vset(d * static_cast<float>(scales[2 * s + half])), vsub(from_u8(q), offset));
      (half ? w1 : w0) = w;
    }
  }
};

// Weights k = 32 g .. 32 g + 31 of a row.
template <int T>
inline void decode32(const uint8_t* row, int64_t g, V16& w0, V16& w1) {
  constexpr int per_block = Block<T>::kValues / 32;
  Block<T>::decode(row + (g / per_block) * Block<T>::kBytes, static_cast<int>(g % per_block), w0, w1);
}

// A micro-tile: out[r, c] = x[r, :] . w[c, :] for R rows of x and C decoded weight rows (w: the
// column block's buffer, K values a row), whole K. float32 x: one fused multiply-add per weight.
template <int R, int C>
void tile(const float* x, int64_t ldx, const float* w, int64_t K, float* out, int64_t ldo) {
  V16 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vzero();
  for (int64_t k = 0; k < K; k += 32) {
    V16 w0[C], w1[C];
    for (int c = 0; c < C; ++c) w0[c] = vload(w + c * K + k), w1[c] = vload(w + c * K + k + 16);
    for (int r = 0; r < R; ++r) {
      const V16 x0 = vload(x + r * ldx + k), x1 = vload(x + r * ldx + k + 16);
      for (int c = 0; c < C; ++c) acc[r][c] = vfma(w1[c], x1, vfma(w0[c], x0, acc[r][c]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * ldo + c] = reduce16(acc[r][c]);
}

// Row i of the weight decoded into buf [K] float32.
template <int T>
void decode_row(const uint8_t* row, int64_t K, float* buf) {
  for (int64_t g = 0; g < K / 32; ++g) {
    V16 w0, w1;
    decode32<T>(row, g, w0, w1);
    vstore(buf + 32 * g, w0);
    vstore(buf + 32 * g + 16, w1);
  }
}

#ifdef __AVX512BF16__
#define PDSERVE_BF16_DOT 1
// bfloat16 x on AVX512-BF16: the decoded weights rounded to bfloat16 (to nearest even, as torch's
// cast of the dequantized weight) and multiplied in pairs by vdpbf16ps, lane l summing k = 2l,
// 2l + 1, then + 32, ... in float32: two weights per lane and instruction.
template <int R, int C>
void tile(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* w, int64_t K, float* out, int64_t ldo) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh wv[C];
    for (int c = 0; c < C; ++c) wv[c] = (__m512bh)_mm512_loadu_si512(w + c * K + k);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * ldx + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], wv[c], xv);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * ldo + c] = reduce16(V16{acc[r][c]});
}

// Q4_0 and Q4_1 by table: a block's 16 possible weights computed once, by decode's float32
// operations in its order on q = 0..15, rounded to bfloat16 as decode's are (so the same bits),
// then looked up by nibble (vpermw; low nibbles are k 0..15, high ones 16..31). Fewer operations
// per weight than decoding each one, which is what one row's step spends its time on.
template <int T>
inline __m512i nibble_table(const uint8_t* b) {
  const V16 q{_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)};
  V16 w;
  if constexpr (T == kQ4_0) w = vmul(vset(half_at(b)), vsub(q, vset(8.0f)));
  else w = vadd(vmul(vset(half_at(b)), q), vset(half_at(b + 2)));
  return _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(w.v));  // words 0..15: the table
}

template <int T>
void decode_row(const uint8_t* row, int64_t K, c10::BFloat16* buf) {
  if constexpr (T == kQ4_0 || T == kQ4_1) {
    constexpr int qs_offset = T == kQ4_0 ? 2 : 4;
    for (int64_t g = 0; g < K / 32; ++g) {
      const uint8_t* b = row + g * Block<T>::kBytes;
      const B16 qs = bload(b + qs_offset);
      const __m512i nibbles = _mm512_cvtepu8_epi16(_mm256_set_m128i(bits(qs, 4, 0x0F), bits(qs, 0, 0x0F)));
      _mm512_storeu_si512(buf + 32 * g, _mm512_permutexvar_epi16(nibbles, nibble_table<T>(b)));
    }
    return;
  }
  for (int64_t g = 0; g < K / 32; ++g) {
    V16 w0, w1;
    decode32<T>(row, g, w0, w1);
    _mm512_storeu_si512(buf + 32 * g, (__m512i)_mm512_cvtne2ps_pbh(w1.v, w0.v));  // [k 0..31] as bfloat16
  }
}
#endif

template <typename X>
using TileFn = void (*)(const X*, int64_t, const X*, int64_t, float*, int64_t);

// The micro-tile for the last rows and columns: R x C shrunk to rows x cols.
template <typename X, int R = kTileRows, int C = kTileCols>
TileFn<X> tile_for(int64_t rows, int64_t cols) {
  if constexpr (R > 1) {
    if (rows < R) return tile_for<X, R - 1, C>(rows, cols);
  }
  if constexpr (C > 1) {
    if (cols < C) return tile_for<X, R, C - 1>(rows, cols);
  }
  return tile<R, C>;
}

// Output columns [begin, end): kTileCols weight rows at a time are decoded once into a buffer (L1)
// and multiplied into every row of x, kTileRows rows per micro-tile.
template <int T, typename X>
void linear_columns(const X* x, int64_t ldx, const uint8_t* raw, int64_t row_bytes, float* out, int64_t ldo,
                    int64_t M, int64_t K, int64_t begin, int64_t end) {
  std::vector<X> buf(kTileCols * K);  // [kTileCols, K]
  for (int64_t c0 = begin; c0 < end; c0 += kTileCols) {
    const int64_t cols = std::min<int64_t>(kTileCols, end - c0);
    for (int64_t c = 0; c < cols; ++c) decode_row<T>(raw + (c0 + c) * row_bytes, K, buf.data() + c * K);
    for (int64_t r = 0; r < M; r += kTileRows) {
      const int64_t rows = std::min<int64_t>(kTileRows, M - r);
      if (rows == kTileRows && cols == kTileCols)
        tile<kTileRows, kTileCols>(x + r * ldx, ldx, buf.data(), K, out + r * ldo + c0, ldo);
      else
        tile_for<X>(rows, cols)(x + r * ldx, ldx, buf.data(), K, out + r * ldo + c0, ldo);
    }
  }
}

template <int T>
void dequantize_range(const uint8_t* raw, int64_t row_bytes, float* out, int64_t K, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) decode_row<T>(raw + i * row_bytes, K, out + i * K);
}

// bfloat16 rows: the float32 decode rounded to nearest even (torch's cast of the dequantized weight;
// the bfloat16 kernel's own decode_row where the CPU has AVX512-BF16, the same bits).
template <int T>
void dequantize_range(const uint8_t* raw, int64_t row_bytes, c10::BFloat16* out, int64_t K, int64_t begin,
                      int64_t end) {
#ifdef PDSERVE_BF16_DOT
  for (int64_t i = begin; i < end; ++i) decode_row<T>(raw + i * row_bytes, K, out + i * K);
#else
  std::vector<float> buf(K);
  for (int64_t i = begin; i < end; ++i) {
    decode_row<T>(raw + i * row_bytes, K, buf.data());
    for (int64_t k = 0; k < K; ++k) out[i * K + k] = c10::BFloat16(buf[k]);
  }
#endif
}

template <typename F>
void by_type(int64_t type, F&& f) {
  switch (type) {
    case kQ4_0: f(std::integral_constant<int, kQ4_0>{}); break;
    case kQ4_1: f(std::integral_constant<int, kQ4_1>{}); break;
    case kQ8_0: f(std::integral_constant<int, kQ8_0>{}); break;
    case kQ4_K: f(std::integral_constant<int, kQ4_K>{}); break;
    case kQ6_K: f(std::integral_constant<int, kQ6_K>{}); break;
    default: TORCH_CHECK(false, "quant_linear: GGML type ", type, " has no kernel (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K)");
  }
}

void check_raw(const torch::Tensor& raw, int64_t type, int64_t K) {
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.is_contiguous(),
              "quant_linear: raw blocks [N, row bytes], uint8, contiguous");
  by_type(type, [&](auto t) {
    constexpr int T = decltype(t)::value;
    TORCH_CHECK(K % Block<T>::kValues == 0 && raw.size(1) == K / Block<T>::kValues * Block<T>::kBytes,
                "quant_linear: K = ", K, " is not ", raw.size(1), " bytes of whole blocks of type ", type);
  });
}

}  // namespace

bool has_bf16_dot() {
#ifdef PDSERVE_BF16_DOT
  return true;
#else
  return false;
#endif
}

void quant_linear(const torch::Tensor& x, const torch::Tensor& raw, int64_t type, torch::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "quant_linear: x [M, K], rows contiguous");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.scalar_type() == at::kFloat || (bf16 && has_bf16_dot()),
              "quant_linear: x in float32 (or bfloat16 where the CPU has AVX512-BF16), not ", x.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), N = raw.size(0);
  check_raw(raw, type, K);
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.size(0) == M && out.size(1) == N &&
              out.stride(1) == 1, "quant_linear: out [M, N] float32, rows contiguous");
  if (M == 0 || N == 0) return;
  const uint8_t* wp = raw.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldo = out.stride(0), row_bytes = raw.size(1);
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, M * K));  // >= ~32K multiply-adds a share
  by_type(type, [&](auto t) {
    constexpr int T = decltype(t)::value;
    at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
#ifdef PDSERVE_BF16_DOT
      if (bf16) {
        linear_columns<T>(reinterpret_cast<const c10::BFloat16*>(x.data_ptr()), ldx, wp, row_bytes, op, ldo, M, K, begin, end);
        return;
      }
#endif
      linear_columns<T>(x.data_ptr<float>(), ldx, wp, row_bytes, op, ldo, M, K, begin, end);
    });
  });
}

void dequantize_into(const torch::Tensor& raw, int64_t type, torch::Tensor out) {
  TORCH_CHECK(out.dim() == 2 && out.size(0) == raw.size(0) && out.is_contiguous() &&
              (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "dequantize_into: out [R, K] float32 or bfloat16, contiguous");
  const int64_t K = out.size(1);
  check_raw(raw, type, K);
  const uint8_t* wp = raw.data_ptr<uint8_t>();
  by_type(type, [&](auto t) {
    constexpr int T = decltype(t)::value;
    at::parallel_for(0, raw.size(0), std::max<int64_t>(1, 65536 / std::max<int64_t>(1, K)), [&](int64_t begin, int64_t end) {
      if (out.scalar_type() == at::kFloat)
        dequantize_range<T>(wp, raw.size(1), out.data_ptr<float>(), K, begin, end);
      else
        dequantize_range<T>(wp, raw.size(1), reinterpret_cast<c10::BFloat16*>(out.data_ptr()), K, begin, end);
    });
  });
}

torch::Tensor dequantize_rows(const torch::Tensor& raw, int64_t type, int64_t K) {
  auto out = torch::empty({raw.size(0), K}, raw.options().dtype(at::kFloat));
  dequantize_into(raw, type, out);
  return out;
}

void quant_gemv(const torch::Tensor& x, const std::vector<torch::Tensor>& raws, const std::vector<int64_t>& types,
                torch::Tensor out);  // quant_gemv.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Each kernel runs without the GIL, as torch's own ops do: the replica's event loop (Serve's calls,
  // the output channels) and other Python threads run while it computes.
  m.def("quant_gemv", &quant_gemv, "out[1, N] = x[1, K] @ W^T, x quantized to int8 per 32 (Q4_0, Q4_1, Q8_0 segments)",
        py::call_guard<py::gil_scoped_release>());
  m.def("quant_linear", &quant_linear, "out[M, N] = x[M, K] @ dequantized(raw)^T, float32 (GGUF blocks)",
        py::call_guard<py::gil_scoped_release>());
  m.def("has_bf16_dot", &has_bf16_dot, "whether quant_linear takes bfloat16 x (AVX512-BF16 build)");
  m.def("dequantize_rows", &dequantize_rows, "raw [R, row bytes] GGUF blocks -> float32 [R, K]",
        py::call_guard<py::gil_scoped_release>());
  m.def("dequantize_into", &dequantize_into, "raw [R, row bytes] GGUF blocks -> out [R, K] float32 or bfloat16",
        py::call_guard<py::gil_scoped_release>());
}
