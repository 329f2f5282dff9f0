// x [M, K] @ weight [N, K]^T -> out [M, N] in one fixed order per output: the batch-invariant GEMM
// (engine/execution/fused_ops.py invariant_linear; its torch reference, model.py tiled_linear).
//
// Every output is one dot product of a row of x and a row of weight, computed whole inside one
// micro-tile, in an order that depends on K alone; threads split the columns, never K. Nothing in
// that order depends on M, on which rows share the call, on the blocking or on the threads, so a
// row's output has the same bits alone or in any batch. Two kinds of micro-tile:
//
// - float32 lanes (FmaTiles; float32, float16, and bfloat16 without AVX512-BF16): 8 lanes of
//   float32 partial sums over K (lane l takes k = l, l + 8, ...; one fused multiply-add each, in
//   order of k), then a fixed tree over the lanes ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)), then the
//   last K % 8 terms in order. AVX2 + FMA where the CPU has them, plain code with the same
//   operations elsewhere (std::fma is exact, so the two give the same bits). 3 rows x 4 columns
//   (12 accumulators, 7 loads per 12 multiply-adds; the fastest of 4x3, 2x6, 3x4, 2x4 and 1x8
//   measured on AVX2, benchmarks/RESULTS.md).
// - bfloat16 dot products (Bf16DotTiles; bfloat16 on a CPU with AVX512-BF16, this build's
//   -march=native): vdpbf16ps, two products per float32 lane and instruction, 16 lanes per output,
//   4 rows x 4 columns (below). 2-3x the float32 lanes' rate; its bits differ from theirs (another
//   order), so a P and a D replica agree only on the same kind of CPU, as docs/sampling.md says.
//
// Blocking: the weight rows of a column block stay in L1 while the row block of x (L2) streams
// past them. The weights are read in place, [N, K] row-major as nn.Linear keeps them: nothing is packed.

#include <torch/types.h>  // ATen's tensors only: torch/extension.h (all of torch's C++ API) took ~1.8x the compile
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PDSERVE_AVX2 1
#endif

namespace {

constexpr int kLanes = 8;       // partial sums per output
constexpr int kTileRows = 3;    // rows of x per micro-tile
constexpr int kTileCols = 4;    // rows of weight (output columns) per micro-tile
constexpr int64_t kRowBlockBytes = 128 * 1024;  // x's rows of a block: L2
constexpr int64_t kColBlockBytes = 24 * 1024;   // weight's rows of a block: L1

#ifdef PDSERVE_AVX2
using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec load8(const float* p) { return _mm256_loadu_ps(p); }
inline Vec load8(const c10::BFloat16* p) {  // bfloat16 is float32's upper half
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline Vec load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline float reduce8(Vec v) {
  const __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // l_i + l_{i+4}
  const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));                                  // a0 + a2, a1 + a3
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));                               // b0 + b1
}
#else
struct Vec { float l[kLanes]; };
inline Vec vzero() { return Vec{}; }
inline Vec vfma(Vec a, Vec b, Vec c) {
  for (int i = 0; i < kLanes; ++i) c.l[i] = std::fma(a.l[i], b.l[i], c.l[i]);
  return c;
}
template <typename T>
inline Vec load8(const T* p) {
  Vec v;
  for (int i = 0; i < kLanes; ++i) v.l[i] = static_cast<float>(p[i]);
  return v;
}
inline float reduce8(Vec v) {
  float a[4];
  for (int i = 0; i < 4; ++i) a[i] = v.l[i] + v.l[i + 4];
  return (a[0] + a[2]) + (a[1] + a[3]);
}
#endif

// out[r, c] = x[r, :] . w[c, :] for R rows of x and C rows of w (R <= 3, C <= 4), whole K.
template <typename T, int R, int C>
void tile(const T* x, int64_t ldx, const T* w, int64_t ldw, T* out, int64_t ldo, int64_t K) {
  Vec acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vzero();
  const int64_t k_vec = K / kLanes * kLanes;
  for (int64_t k = 0; k < k_vec; k += kLanes) {
    Vec wv[C];
    for (int c = 0; c < C; ++c) wv[c] = load8(w + c * ldw + k);
    for (int r = 0; r < R; ++r) {
      const Vec xv = load8(x + r * ldx + k);
      for (int c = 0; c < C; ++c) acc[r][c] = vfma(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float sum = reduce8(acc[r][c]);
      for (int64_t k = k_vec; k < K; ++k)
        sum = std::fma(static_cast<float>(x[r * ldx + k]), static_cast<float>(w[c * ldw + k]), sum);
      out[r * ldo + c] = static_cast<T>(sum);
    }
}

template <typename T>
using TileFn = void (*)(const T*, int64_t, const T*, int64_t, T*, int64_t, int64_t);

// The float32-lane micro-tiles above: 3 x 4 outputs, any of the three dtypes.
struct FmaTiles {
  static constexpr int kRows = kTileRows, kCols = kTileCols;
  template <typename T, int R, int C>
  static void tile(const T* x, int64_t ldx, const T* w, int64_t ldw, T* out, int64_t ldo, int64_t K) {
    ::tile<T, R, C>(x, ldx, w, ldw, out, ldo, K);
  }
};

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PDSERVE_BF16_DOT 1
// bfloat16 on AVX512-BF16: 16 float32 lanes per output, each vdpbf16ps adding two products per
// lane (lane l: k = 32 j + 2 l and 32 j + 2 l + 1, j in order; the products of two bfloat16 are
// exact in float32). The last K % 32 values are loaded under a mask, zeros past K (they add
// nothing), so the order is still K's alone. Then the fixed tree over 16 lanes: s8_i = l_i +
// l_{i+8}, s4_i = s8_i + s8_{i+4}, s2_i = s4_i + s4_{i+2}, s2_0 + s2_1; one rounding to bfloat16.
inline float reduce16(__m512 v) {
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

// 4 x 4 outputs a micro-tile: 16 accumulators, 4 weight registers, one of x (of 32).
struct Bf16DotTiles {
  static constexpr int kRows = 4, kCols = 4;
  template <typename T, int R, int C>
  static void tile(const T* x, int64_t ldx, const T* w, int64_t ldw, T* out, int64_t ldo, int64_t K) {
    static_assert(std::is_same_v<T, c10::BFloat16>);
    __m512 acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
    const int64_t k_whole = K / 32 * 32;
    for (int64_t k = 0; k < k_whole; k += 32) {  // written out, not a lambda shared with the tail: the accumulators stay in registers
      __m512bh wv[C];
      for (int c = 0; c < C; ++c) wv[c] = (__m512bh)_mm512_loadu_si512(w + c * ldw + k);
      for (int r = 0; r < R; ++r) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * ldx + k);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
      }
    }
    if (k_whole < K) {
      const __mmask32 mask = static_cast<__mmask32>((uint64_t{1} << (K - k_whole)) - 1);
      __m512bh wv[C];
      for (int c = 0; c < C; ++c) wv[c] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + c * ldw + k_whole);
      for (int r = 0; r < R; ++r) {
        const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + r * ldx + k_whole);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) out[r * ldo + c] = static_cast<T>(reduce16(acc[r][c]));
  }
};
#endif

// The micro-tile for the last rows and columns of a block: R x C shrunk to rows x cols.
template <typename Tiles, typename T, int R = Tiles::kRows, int C = Tiles::kCols>
TileFn<T> tile_for(int rows, int cols) {
  if constexpr (R > 1) {
    if (rows < R) return tile_for<Tiles, T, R - 1, C>(rows, cols);
  }
  if constexpr (C > 1) {
    if (cols < C) return tile_for<Tiles, T, R, C - 1>(rows, cols);
  }
  return Tiles::template tile<T, R, C>;
}

// Columns [col_begin, col_end) of out, every row: blocks of x's rows (L2) against blocks of
// weight rows (L1), micro-tiles inside.
template <typename Tiles, typename T>
void columns(const T* x, int64_t ldx, const T* w, T* out, int64_t M, int64_t N, int64_t K,
             int64_t col_begin, int64_t col_end) {
  constexpr int R = Tiles::kRows, C = Tiles::kCols;
  const int64_t row_bytes = K * static_cast<int64_t>(sizeof(T));
  const int64_t row_block = std::max<int64_t>(R, kRowBlockBytes / row_bytes / R * R);
  const int64_t col_block = std::max<int64_t>(C, kColBlockBytes / row_bytes / C * C);
  for (int64_t m0 = 0; m0 < M; m0 += row_block) {
    const int64_t m1 = std::min(M, m0 + row_block);
    for (int64_t n0 = col_begin; n0 < col_end; n0 += col_block) {
      const int64_t n1 = std::min(col_end, n0 + col_block);
      for (int64_t r = m0; r < m1; r += R) {
        const int rows = static_cast<int>(std::min<int64_t>(R, m1 - r));
        const T* x_rows = x + r * ldx;
        T* out_rows = out + r * N;
        int64_t c = n0;
        if (rows == R)  // whole micro-tiles called directly (inlined), the edges through tile_for
          for (; c + C <= n1; c += C)
            Tiles::template tile<T, R, C>(x_rows, ldx, w + c * K, K, out_rows + c, N, K);
        for (; c < n1; c += C) {
          const int cols = static_cast<int>(std::min<int64_t>(C, n1 - c));
          tile_for<Tiles, T>(rows, cols)(x_rows, ldx, w + c * K, K, out_rows + c, N, K);
        }
      }
    }
  }
}

}  // namespace

bool invariant_linear_bf16_dot() {
#ifdef PDSERVE_BF16_DOT
  return true;
#else
  return false;
#endif
}

torch::Tensor invariant_linear(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "invariant_linear: x [M, K] and weight [N, K]");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "invariant_linear: x and weight in one dtype");
  TORCH_CHECK(x.stride(1) == 1 && weight.is_contiguous(), "invariant_linear: rows of x and weight contiguous");
  const int64_t M = x.size(0), N = weight.size(0), K = x.size(1);
  auto out = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  // Threads split the columns: a share of at least ~64K multiply-adds each, in whole micro-tiles.
  const int64_t grain = std::max<int64_t>(kTileCols, (65536 / std::max<int64_t>(1, M * K) + 1) * kTileCols);
  auto run = [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    const T* xp = reinterpret_cast<const T*>(x.data_ptr());
    const T* wp = reinterpret_cast<const T*>(weight.data_ptr());
    T* op = reinterpret_cast<T*>(out.data_ptr());
    at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
#ifdef PDSERVE_BF16_DOT
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        columns<Bf16DotTiles>(xp, x.stride(0), wp, op, M, N, K, begin, end);
        return;
      }
#endif
      columns<FmaTiles>(xp, x.stride(0), wp, op, M, N, K, begin, end);
    });
  };
  switch (x.scalar_type()) {
    case at::ScalarType::Float: run(static_cast<float*>(nullptr)); break;
    case at::ScalarType::BFloat16: run(static_cast<c10::BFloat16*>(nullptr)); break;
    case at::ScalarType::Half: run(static_cast<c10::Half*>(nullptr)); break;
    default: TORCH_CHECK(false, "invariant_linear: float32, bfloat16 or float16, not ", x.scalar_type());
  }
  return out;
}
