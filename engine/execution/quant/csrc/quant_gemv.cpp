// One row of activations against GGUF's Q4_0 / Q4_1 / Q8_0 blocks in integer arithmetic, as
// llama.cpp's CPU backend does for a decode step (engine/execution/quant/linear.py calls it for
// M = 1 outside batch-invariant mode; bound in quant_linear.cpp's module).
//
//   quant_gemv(x, raws, types, out):  out[1, N] = x[1, K] @ W^T, W the row segments raws[i] [N_i, row
//       bytes] of types[i], in output order; x and out float32 or bfloat16.
//
// x is quantized once per call, per 32 values (llama.cpp's Q8_0/Q8_1 activations): d = max|x| / 127,
// q = x / d rounded to nearest even, in int8. Each weight row's blocks are then multiplied by q in
// int32 (exact) and scaled in float32: two blocks at a time give 16 int32 lanes of 4 products each
// (QuantizedRow says which; vpdpbusd on AVX512-VNNI, vpmaddubsw + vpmaddwd on AVX2, a loop in plain
// code: the same integers), each lane accumulates lane * (d_w * d_x) by fused multiply-add in order
// of pairs, and the 16 lanes are summed by quant_linear.cpp's fixed tree. Q4_1's minimum adds
// m * d_x * (the block's sum of q), even and odd blocks' terms summed apart in order, then the two,
// then added to the tree's sum: the result is x' @ W^T, x' the dequantized int8 row (the reference,
// quant/reference.py gemv), up to float32 rounding. Every ISA
// build therefore gives the same bits (tests/test_quant_linear.py), and a row's output depends on
// nothing but x and W. Against llama.cpp (ggml's quantize_row_q8_0 / q8_1 and vec_dot): the same
// integers (q rounded to nearest, ties to even as its AVX code does); its d and d * sum(q) are
// rounded to float16, here they stay float32.
//
// Memory: each weight byte is read once per call, four rows at a time sharing each load of q;
// threads split the output rows (one at::parallel_for over all segments), never K.

#include <torch/types.h>  // ATen's tensors only: torch/extension.h (all of torch's C++ API) took ~1.8x the compile
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define PDSERVE_GEMV_512 1  // a pair of blocks per 512-bit register, vpdpbusd
#elif defined(__AVX2__) && defined(__FMA__)
#define PDSERVE_GEMV_256 1  // one block per 256-bit register, vpmaddubsw + vpmaddwd
#endif

namespace {

constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;  // GGML's type numbers
constexpr int kRows = 4;                         // weight rows per pass over q
constexpr int kPrefetchRows = 2 * kRows;         // software prefetch distance, in rows (the hardware's lags on 4 streams)
constexpr int kMaxBlockBytes = 34;
const uint8_t kZeroBlock[kMaxBlockBytes] = {};   // the pad block of a row with an odd block count: w = 0, d = 0

template <int T> struct Layout;  // bytes per block of 32; offsets of d, m and the quants
template <> struct Layout<kQ4_0> { static constexpr int kBytes = 18, kQs = 2; };
template <> struct Layout<kQ4_1> { static constexpr int kBytes = 20, kQs = 4; };
template <> struct Layout<kQ8_0> { static constexpr int kBytes = 34, kQs = 2; };

// x quantized per 32 values, padded with a zero block to an even count (blocks), in two byte orders:
// natural (Q8_0's blocks hold k = 0..31 in order) and by pair for the 4-bit types, whose block holds
// k and k + 16 in one byte: pair p as [a 0..15, b 0..15, a 16..31, b 16..31] (a = block 2p, b = 2p + 1),
// the order its low nibbles then high nibbles give without moving bytes.
struct QuantizedRow {
  int64_t blocks = 0;
  std::vector<int8_t> q;            // [blocks, 32] natural order
  std::vector<int8_t> q4;           // [blocks / 2, 64] pair order
  std::vector<float> scales;        // [blocks / 2, 4]: d_a, s_a, d_b, s_b (s = d x the block's sum of q: Q4_1's min term)
  std::vector<int32_t> minus8;      // [blocks / 2, 16]: -8 x each Q4 lane's 4 q (Q4_0: w = nibble - 8)
  std::vector<int32_t> minus128;    // [blocks / 2, 16]: -128 x each Q8 lane's 4 q (Q8_0 on VNNI: w + 128 is unsigned)
};

template <typename X>
void quantize_row(const X* x, int64_t K, QuantizedRow& row) {
  const int64_t real = K / 32;
  row.blocks = real + real % 2;
  row.q.assign(row.blocks * 32, 0);
  row.q4.assign(row.blocks * 32, 0);
  row.scales.assign(row.blocks * 2, 0.0f);
  row.minus8.assign(row.blocks * 8, 0);
  row.minus128.assign(row.blocks * 8, 0);
  for (int64_t b = 0; b < real; ++b) {
    float v[32], amax = 0.0f;
    for (int k = 0; k < 32; ++k) {
      v[k] = static_cast<float>(x[32 * b + k]);
      amax = std::max(amax, std::fabs(v[k]));
    }
    const float d = amax / 127.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
    int8_t* q = row.q.data() + 32 * b;
    int32_t sum = 0;
    for (int k = 0; k < 32; ++k) {
      q[k] = static_cast<int8_t>(std::nearbyint(v[k] * inverse));  // |q| <= 127
      sum += q[k];
    }
    int8_t* q4 = row.q4.data() + 64 * (b / 2) + 16 * (b % 2);
    std::memcpy(q4, q, 16);
    std::memcpy(q4 + 32, q + 16, 16);
    row.scales[2 * b] = d;
    row.scales[2 * b + 1] = d * static_cast<float>(sum);
  }
  for (int64_t lane = 0; lane < row.blocks * 8; ++lane) {
    const int8_t *q = row.q.data() + 4 * lane, *q4 = row.q4.data() + 4 * lane;
    row.minus8[lane] = -8 * (q4[0] + q4[1] + q4[2] + q4[3]);
    row.minus128[lane] = -128 * (q[0] + q[1] + q[2] + q[3]);
  }
}

// A pair of blocks' header products [d_a x d_xa, m_a x s_a, d_b x d_xb, m_b x s_b] (m: Q4_1's
// minimum; for the other types the lanes 1 and 3 hold nothing used): the block's first 4 bytes as
// two float16, times the row's scales.
#if defined(PDSERVE_GEMV_512) || defined(PDSERVE_GEMV_256)
inline __m128 header_products(const uint8_t* a, const uint8_t* b, const float* scales) {
  int32_t ha, hb;
  std::memcpy(&ha, a, 4);
  std::memcpy(&hb, b, 4);
  const __m128 halves = _mm_cvtph_ps(_mm_insert_epi32(_mm_cvtsi32_si128(ha), hb, 1));  // [d_a, m_a, d_b, m_b]
  return _mm_mul_ps(halves, _mm_loadu_ps(scales));
}
#endif

// ---- per ISA: a pair's 16 int32 lanes (lane l: 4 consecutive q of the type's order, 16 l .. + 3
// within the pair's 64), 16 float32 accumulators, the fixed tree. In the 4-bit order lanes 0..3 and
// 8..11 are block a's, in Q8_0's 0..7. ----
#if defined(PDSERVE_GEMV_512)
using Acc = __m512;
inline Acc acc_zero() { return _mm512_setzero_ps(); }

template <int T>
inline __m512i pair_lanes(const uint8_t* a, const uint8_t* b, const QuantizedRow& row, int64_t pair) {
  if constexpr (T == kQ8_0) {  // (w + 128) . q - 128 sum(q): unsigned by signed, as vpdpbusd takes them
    const __m512i w = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + Layout<T>::kQs))),
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + Layout<T>::kQs)), 1);
    return _mm512_dpbusd_epi32(_mm512_loadu_si512(row.minus128.data() + 16 * pair),
                               _mm512_xor_si512(w, _mm512_set1_epi8(static_cast<char>(0x80))),
                               _mm512_loadu_si512(row.q.data() + 64 * pair));
  } else {
    const __m256i packed = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + Layout<T>::kQs))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + Layout<T>::kQs)), 1);  // [qs_a | qs_b]
    const __m256i mask = _mm256_set1_epi8(0x0F);
    const __m256i low = _mm256_and_si256(packed, mask), high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask);
    const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);  // the pair order
    const __m512i init = T == kQ4_0 ? _mm512_loadu_si512(row.minus8.data() + 16 * pair) : _mm512_setzero_si512();
    return _mm512_dpbusd_epi32(init, w, _mm512_loadu_si512(row.q4.data() + 64 * pair));
  }
}

template <int T>
inline Acc pair_fma(__m512i lanes, __m128 products, Acc acc) {  // lane l * its block's d_w x d_x
  const __m512i which = T == kQ8_0 ? _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0)
                                   : _mm512_set_epi32(2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0);
  const __m512 scale = _mm512_permutexvar_ps(which, _mm512_castps128_ps512(products));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(lanes), scale, acc);
}

inline float reduce(Acc a) {  // quant_linear.cpp's tree: l_i + l_{i+8}, then + 4, + 2, + 1
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

#elif defined(PDSERVE_GEMV_256)
struct Acc { __m256 lo, hi; };  // lanes 0..7, 8..15
inline Acc acc_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
struct PairLanes { __m256i lo, hi; };

inline __m256i dot_u8_s8(__m256i u, __m256i s) {  // 8 lanes of 4 products; vpmaddubsw's pairs stay below 2^15 here
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

template <int T>
inline PairLanes pair_lanes(const uint8_t* a, const uint8_t* b, const QuantizedRow& row, int64_t pair) {
  if constexpr (T == kQ8_0) {  // |w| . (q with w's sign)
    const __m256i wa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + Layout<T>::kQs));
    const __m256i wb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + Layout<T>::kQs));
    const __m256i* q = reinterpret_cast<const __m256i*>(row.q.data() + 64 * pair);
    return {dot_u8_s8(_mm256_abs_epi8(wa), _mm256_sign_epi8(_mm256_loadu_si256(q), wa)),
            dot_u8_s8(_mm256_abs_epi8(wb), _mm256_sign_epi8(_mm256_loadu_si256(q + 1), wb))};
  } else {
    const __m256i packed = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + Layout<T>::kQs))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + Layout<T>::kQs)), 1);
    const __m256i mask = _mm256_set1_epi8(0x0F);
    const __m256i* q = reinterpret_cast<const __m256i*>(row.q4.data() + 64 * pair);
    PairLanes lanes{dot_u8_s8(_mm256_and_si256(packed, mask), _mm256_loadu_si256(q)),
                    dot_u8_s8(_mm256_and_si256(_mm256_srli_epi16(packed, 4), mask), _mm256_loadu_si256(q + 1))};
    if constexpr (T == kQ4_0) {
      const __m256i* minus8 = reinterpret_cast<const __m256i*>(row.minus8.data() + 16 * pair);
      lanes.lo = _mm256_add_epi32(lanes.lo, _mm256_loadu_si256(minus8));
      lanes.hi = _mm256_add_epi32(lanes.hi, _mm256_loadu_si256(minus8 + 1));
    }
    return lanes;
  }
}

template <int T>
inline Acc pair_fma(PairLanes lanes, __m128 products, Acc acc) {
  const __m256 p = _mm256_castps128_ps256(products);
  __m256 lo, hi;
  if constexpr (T == kQ8_0) {
    lo = _mm256_permutevar8x32_ps(p, _mm256_set1_epi32(0));
    hi = _mm256_permutevar8x32_ps(p, _mm256_set1_epi32(2));
  } else {
    lo = hi = _mm256_permutevar8x32_ps(p, _mm256_set_epi32(2, 2, 2, 2, 0, 0, 0, 0));
  }
  return {_mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes.lo), lo, acc.lo),
          _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes.hi), hi, acc.hi)};
}

inline float reduce(Acc a) {
  const __m256 s8 = _mm256_add_ps(a.lo, a.hi);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

#else
struct Acc { float l[16]; };
inline Acc acc_zero() { return Acc{}; }
struct PairLanes { int32_t l[16]; };
struct Products { float p[4]; };

inline Products header_products(const uint8_t* a, const uint8_t* b, const float* scales) {
  uint16_t bits[4];
  std::memcpy(bits, a, 4);
  std::memcpy(bits + 2, b, 4);
  Products products;
  for (int i = 0; i < 4; ++i)  // exact, as vcvtph2ps
    products.p[i] = static_cast<float>(c10::Half(bits[i], c10::Half::from_bits())) * scales[i];
  return products;
}

// The pair's i-th value (i < 64) in the type's order, as the integer its quant stands for.
template <int T>
inline int weight_at(const uint8_t* a, const uint8_t* b, int i) {
  if constexpr (T == kQ8_0) return static_cast<int8_t>((i < 32 ? a : b)[Layout<T>::kQs + i % 32]);
  const uint8_t* qs = ((i % 32) < 16 ? a : b) + Layout<T>::kQs;
  const int nibble = i < 32 ? qs[i % 16] & 0x0F : qs[i % 16] >> 4;
  return T == kQ4_0 ? nibble - 8 : nibble;
}

template <int T>
inline PairLanes pair_lanes(const uint8_t* a, const uint8_t* b, const QuantizedRow& row, int64_t pair) {
  const int8_t* q = (T == kQ8_0 ? row.q.data() : row.q4.data()) + 64 * pair;
  PairLanes lanes{};
  for (int i = 0; i < 64; ++i) lanes.l[i / 4] += weight_at<T>(a, b, i) * q[i];
  return lanes;
}

template <int T>
inline Acc pair_fma(const PairLanes& lanes, const Products& products, Acc acc) {
  for (int l = 0; l < 16; ++l) {
    const bool of_a = T == kQ8_0 ? l < 8 : (l % 8) < 4;
    acc.l[l] = std::fma(static_cast<float>(lanes.l[l]), products.p[of_a ? 0 : 2], acc.l[l]);
  }
  return acc;
}

inline float reduce(const Acc& a) {
  float s8[8], s4[4];
  for (int i = 0; i < 8; ++i) s8[i] = a.l[i] + a.l[i + 8];
  for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}
#endif

// Q4_1's minimum terms, block a's and block b's summed apart, in order of pairs.
struct MinTerms {
#if defined(PDSERVE_GEMV_512) || defined(PDSERVE_GEMV_256)
  __m128 sums = _mm_setzero_ps();
  inline void add(__m128 products) { sums = _mm_add_ps(sums, products); }
  inline float total() {
    float lanes[4];
    _mm_storeu_ps(lanes, sums);
    return lanes[1] + lanes[3];
  }
#else
  float even = 0.0f, odd = 0.0f;
  inline void add(const Products& products) { even += products.p[1], odd += products.p[3]; }
  inline float total() const { return even + odd; }
#endif
};

// out[r] for weight rows first, first + row_bytes, ... (R of them): whole K.
template <int T, int R>
void dot_rows(const uint8_t* first, int64_t row_bytes, int64_t real_blocks, const QuantizedRow& x, float* out) {
  constexpr int bytes = Layout<T>::kBytes;
  Acc acc[R];
  MinTerms mins[R];
  for (int r = 0; r < R; ++r) acc[r] = acc_zero();
  for (int64_t pair = 0; pair < x.blocks / 2; ++pair) {
    const bool padded = 2 * pair + 1 >= real_blocks;
    const float* scales = x.scales.data() + 4 * pair;
    for (int r = 0; r < R; ++r) {
      const uint8_t* a = first + r * row_bytes + 2 * pair * bytes;
      const uint8_t* b = padded ? kZeroBlock : a + bytes;
#if defined(PDSERVE_GEMV_512) || defined(PDSERVE_GEMV_256)
      _mm_prefetch(reinterpret_cast<const char*>(a + kPrefetchRows * row_bytes), _MM_HINT_T0);  // the next tiles'
#endif
      const auto products = header_products(a, b, scales);
      acc[r] = pair_fma<T>(pair_lanes<T>(a, b, x, pair), products, acc[r]);
      if constexpr (T == kQ4_1) mins[r].add(products);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = T == kQ4_1 ? reduce(acc[r]) + mins[r].total() : reduce(acc[r]);
}

template <typename F>
void by_type(int64_t type, F&& f) {
  switch (type) {
    case kQ4_0: f(std::integral_constant<int, kQ4_0>{}); break;
    case kQ4_1: f(std::integral_constant<int, kQ4_1>{}); break;
    case kQ8_0: f(std::integral_constant<int, kQ8_0>{}); break;
    default: TORCH_CHECK(false, "quant_gemv: GGML type ", type, " has no integer kernel (Q4_0, Q4_1, Q8_0)");
  }
}

// Rows [begin, end) of one segment into out (float32 or bfloat16, rounded to nearest even as torch's cast).
template <int T, typename O>
void segment_rows(const uint8_t* raw, int64_t row_bytes, int64_t real_blocks, const QuantizedRow& x, O* out,
                  int64_t begin, int64_t end) {
  float values[kRows];
  for (int64_t i = begin; i < end; i += kRows) {
    const uint8_t* first = raw + i * row_bytes;
    const int64_t rows = std::min<int64_t>(kRows, end - i);
    switch (rows) {
      case 4: dot_rows<T, 4>(first, row_bytes, real_blocks, x, values); break;
      case 3: dot_rows<T, 3>(first, row_bytes, real_blocks, x, values); break;
      case 2: dot_rows<T, 2>(first, row_bytes, real_blocks, x, values); break;
      default: dot_rows<T, 1>(first, row_bytes, real_blocks, x, values);
    }
    for (int64_t r = 0; r < rows; ++r) out[i + r] = static_cast<O>(values[r]);
  }
}

}  // namespace

void quant_gemv(const torch::Tensor& x, const std::vector<torch::Tensor>& raws, const std::vector<int64_t>& types,
                torch::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.stride(1) == 1 &&
              (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "quant_gemv: x [1, K], contiguous, float32 or bfloat16");
  TORCH_CHECK(raws.size() == types.size() && !raws.empty(), "quant_gemv: one type per segment");
  const int64_t K = x.size(1);
  int64_t N = 0;
  std::vector<int64_t> starts;  // each segment's first output column
  for (size_t s = 0; s < raws.size(); ++s) {
    const auto& raw = raws[s];
    TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.is_contiguous(),
                "quant_gemv: raw blocks [N, row bytes], uint8, contiguous");
    by_type(types[s], [&](auto t) {
      constexpr int T = decltype(t)::value;
      TORCH_CHECK(K % 32 == 0 && raw.size(1) == K / 32 * Layout<T>::kBytes, "quant_gemv: K = ", K, " is not ",
                  raw.size(1), " bytes of whole blocks of type ", types[s]);
    });
    starts.push_back(N);
    N += raw.size(0);
  }
  TORCH_CHECK(out.dim() == 2 && out.size(0) == 1 && out.size(1) == N && out.is_contiguous() &&
              (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "quant_gemv: out [1, N], contiguous, float32 or bfloat16");
  static thread_local QuantizedRow row;  // reused: no allocation per call once K is seen
  if (x.scalar_type() == at::kFloat)
    quantize_row(x.data_ptr<float>(), K, row);
  else
    quantize_row(reinterpret_cast<const c10::BFloat16*>(x.data_ptr()), K, row);
  const QuantizedRow& xq = row;
  const int64_t grain = std::max<int64_t>(kRows, 65536 / K);  // >= ~64K weights a share
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    for (size_t s = 0; s < raws.size(); ++s) {
      const int64_t lo = std::max(begin, starts[s]), hi = std::min(end, starts[s] + raws[s].size(0));
      if (lo >= hi) continue;
      const uint8_t* raw = raws[s].data_ptr<uint8_t>();
      const int64_t row_bytes = raws[s].size(1);
      by_type(types[s], [&](auto t) {
        constexpr int T = decltype(t)::value;
        if (out.scalar_type() == at::kFloat)
          segment_rows<T>(raw, row_bytes, K / 32, xq, out.data_ptr<float>() + starts[s], lo - starts[s], hi - starts[s]);
        else
          segment_rows<T>(raw, row_bytes, K / 32, xq, reinterpret_cast<c10::BFloat16*>(out.data_ptr()) + starts[s],
                          lo - starts[s], hi - starts[s]);
      });
    }
  });
}
