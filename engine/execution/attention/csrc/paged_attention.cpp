// Paged attention on the CPU that reads the KV pool in place (engine/execution/attention/cpu_paged.py).
//
// One kernel for every query row of a step: decode tokens and prefill chunks are both "groups" of
// consecutive query positions of one sequence (a decode is a group of one). Each query row attends
// to the keys of its own sequence, read block by block from the pool through the block table: no
// gathered copy, no padding, GQA without repeating K/V.
//
// Determinism. A row's arithmetic depends only on its own query, its position and the KV of its
// sequence, never on the other rows of the step or on how its prompt was chunked:
//   - keys are reduced in one fixed order: block by block, aligned to absolute positions (block b
//     holds positions [b*B, b*B+B)), with an online softmax per block;
//   - within a block, a score is a chain of fused multiply-adds over the head dim in order
//     d = 0..D-1, and the softmax sum and the V accumulation run over the block's keys in order;
//   - a block, or a key, that a row may not see is skipped for that row, leaving its state as is;
//   - there is no reduction across lanes (no horizontal sums), so vectorizing a loop or not, or
//     tiling rows differently, cannot change a row's bits.
// Built with -ffp-contract=off so that only the explicit std::fma calls fuse.

#include <torch/types.h>  // ATen's tensors only: torch/extension.h (all of torch's C++ API) took ~1.8x the compile
#include <torch/csrc/utils/pybind.h>  // pybind11 with at::Tensor's type caster
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <array>
#include <atomic>
#include <cstring>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int kMaxBlock = 64;   // largest block_size the kernel takes
constexpr int kQueryTile = 16;  // query positions per task: they share each K/V block they read
constexpr int kRowTile = 4;     // query rows scored together against a block's keys
constexpr int kTasksPerThread = 8;  // query tiles per thread above which a task takes all kv heads

// exp(x) for x <= 0 (softmax arguments), to ~1 ulp: 2^n * 2^f with f in [-0.5, 0.5] and a degree-7
// polynomial. Plain code the compiler vectorizes; the same code runs for every row.
inline float exp_nonpositive(float x) {
  x = x > -87.0f ? x : -87.0f;
  const float t = x * 1.4426950408889634f;
  const float n = static_cast<float>(static_cast<int32_t>(t - 0.5f));  // round(t) for t <= 0, by truncation
  const float f = std::fma(n, -0.693145751953125f, x) - n * 1.428606765330187e-06f;  // x - n*ln2, two parts
  float p = 1.9875691500e-4f;
  p = std::fma(p, f, 1.3981999507e-3f);
  p = std::fma(p, f, 8.3334519073e-3f);
  p = std::fma(p, f, 4.1665795894e-2f);
  p = std::fma(p, f, 1.6666665459e-1f);
  p = std::fma(p, f, 5.0000001201e-1f);
  p = std::fma(p, f * f, f + 1.0f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
// exp_nonpositive on 8 lanes: the same operations in the same order, so the same bits per lane
// (GCC leaves the scalar loop unvectorized).
inline __m256 exp_nonpositive8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));  // x > -87 ? x : -87 (no NaN reaches it)
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f));
  const __m256i n_int = _mm256_cvttps_epi32(_mm256_sub_ps(t, _mm256_set1_ps(0.5f)));
  const __m256 n = _mm256_cvtepi32_ps(n_int);
  const __m256 f = _mm256_sub_ps(_mm256_fmadd_ps(n, _mm256_set1_ps(-0.693145751953125f), x),
                                 _mm256_mul_ps(n, _mm256_set1_ps(1.428606765330187e-06f)));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(f, f), _mm256_add_ps(f, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(n_int, _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

inline float max_of(float a, float b) { return a > b ? a : b; }  // no NaN reaches it

template <typename scalar_t>
inline float to_float(scalar_t v) { return static_cast<float>(v); }

#if defined(__AVX512F__)
// 16 consecutive values as floats in one register (bf16: the bits shifted up; fp16: converted exactly).
template <typename scalar_t>
inline __m512 load16(const scalar_t* src) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return _mm512_loadu_ps(src);
  } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  }
}

// r[i] holds row i of a 16 x 16 tile; afterwards r[i] holds column i.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
    const __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}
#endif

#if defined(__AVX2__) && defined(__F16C__) && !defined(__AVX512F__)
// 8 consecutive values as floats in one register (bf16: the bits shifted up; fp16: converted exactly).
template <typename scalar_t>
inline __m256 load8(const scalar_t* src) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return _mm256_loadu_ps(src);
  } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  }
}

// r[i] holds row i of an 8 x 8 tile; afterwards r[i] holds column i.
inline void transpose8(__m256 r[8]) {
  __m256 t[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x20);
    t[i + 4] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x31);
  }
  for (int i = 0; i < 8; ++i) r[i] = t[i];
}
#endif

// keys_t[d * block_size + j] = float(k[j * stride + d]) for j < block_size, d < head_dim: a block's
// keys with the head dim outermost, so that a score's chain over d runs across 16 keys at once.
// Pure data movement: every path gives the same floats.
template <typename scalar_t>
void transpose_keys(const scalar_t* __restrict__ k, int64_t stride, int64_t block_size, int64_t head_dim,
                    float* __restrict__ keys_t) {
#if defined(__AVX512F__)
  if (block_size == 16 && head_dim % 16 == 0) {
    __m512 tile[16];
    for (int64_t d0 = 0; d0 < head_dim; d0 += 16) {
      for (int j = 0; j < 16; ++j) tile[j] = load16(k + j * stride + d0);
      transpose16(tile);
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(keys_t + (d0 + i) * 16, tile[i]);
    }
    return;
  }
#elif defined(__AVX2__) && defined(__F16C__)
  if (block_size == 16 && head_dim % 8 == 0) {  // two 8 x 8 tiles per 8 dims: keys 0-7, then keys 8-15
    __m256 tile[8];
    for (int64_t d0 = 0; d0 < head_dim; d0 += 8)
      for (int j0 = 0; j0 < 16; j0 += 8) {
        for (int j = 0; j < 8; ++j) tile[j] = load8(k + (j0 + j) * stride + d0);
        transpose8(tile);
        for (int i = 0; i < 8; ++i) _mm256_storeu_ps(keys_t + (d0 + i) * 16 + j0, tile[i]);
      }
    return;
  }
#endif
  for (int64_t j = 0; j < block_size; ++j)
    for (int64_t d = 0; d < head_dim; ++d) keys_t[d * block_size + j] = to_float(k[j * stride + d]);
}

// Asks the caches for the K and V rows of the next block while this one is computed: blocks lie
// anywhere in the pool, so the hardware prefetcher cannot guess them, and a decode row reads every
// block of its context once (memory-bound: benchmarks/RESULTS.md). A hint only: no value changes.
template <typename scalar_t>
inline void prefetch_block(const scalar_t* k_cache, const scalar_t* v_cache, int32_t block, int64_t block_size,
                           int64_t slot_stride, int64_t head_offset, int64_t head_dim) {
  constexpr int64_t kPerLine = 64 / sizeof(scalar_t);  // values per 64-byte cache line
  const int64_t base = static_cast<int64_t>(block) * block_size * slot_stride + head_offset;
  for (int64_t j = 0; j < block_size; ++j)
    for (int64_t d = 0; d < head_dim; d += kPerLine) {
      __builtin_prefetch(k_cache + base + j * slot_stride + d);
      __builtin_prefetch(v_cache + base + j * slot_stride + d);
    }
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// The scores of kRowTile (4) query rows [4, D] against a block of 16 keys transposed [D, 16], into
// scores [4, 16]: the generic loop's chains (one FMA per d, in order) in eight named registers. Left
// to itself GCC kept one of the eight on the stack, and the store and reload sat in its chain.
inline void score_tile16(const float* __restrict__ query, int64_t head_dim, const float* __restrict__ keys_t,
                         float* __restrict__ scores) {
  static_assert(kRowTile == 4, "score_tile16 scores four rows");
  __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
  for (int64_t d = 0; d < head_dim; ++d) {
    const __m256 lo = _mm256_loadu_ps(keys_t + d * 16), hi = _mm256_loadu_ps(keys_t + d * 16 + 8);
    __m256 q = _mm256_broadcast_ss(query + d);
    a0 = _mm256_fmadd_ps(q, lo, a0), b0 = _mm256_fmadd_ps(q, hi, b0);
    q = _mm256_broadcast_ss(query + head_dim + d);
    a1 = _mm256_fmadd_ps(q, lo, a1), b1 = _mm256_fmadd_ps(q, hi, b1);
    q = _mm256_broadcast_ss(query + 2 * head_dim + d);
    a2 = _mm256_fmadd_ps(q, lo, a2), b2 = _mm256_fmadd_ps(q, hi, b2);
    q = _mm256_broadcast_ss(query + 3 * head_dim + d);
    a3 = _mm256_fmadd_ps(q, lo, a3), b3 = _mm256_fmadd_ps(q, hi, b3);
  }
  _mm256_storeu_ps(scores, a0), _mm256_storeu_ps(scores + 8, b0);
  _mm256_storeu_ps(scores + 16, a1), _mm256_storeu_ps(scores + 24, b1);
  _mm256_storeu_ps(scores + 32, a2), _mm256_storeu_ps(scores + 40, b2);
  _mm256_storeu_ps(scores + 48, a3), _mm256_storeu_ps(scores + 56, b3);
}
#endif

// acc[r] += probs[r] @ V for the kRowTile rows from ``first_row``, which all see the block's every key:
// kRowTile rows x 16 dims of accumulators held in registers while the keys go by, so each value row
// is loaded once per tile, not once per row. Per accumulator, the chain over keys j = 0..B-1 is the
// row-by-row loop's.
template <int kBlock>
void accumulate_tile(const float* __restrict__ probs, int64_t block_size_arg, const float* __restrict__ values,
                     int64_t values_stride, float* __restrict__ acc, int64_t head_dim, int64_t first_row) {
  constexpr int kDims = 16;
  const int64_t block_size = kBlock ? kBlock : block_size_arg;
  probs += first_row * block_size;
  acc += first_row * head_dim;
  int64_t d0 = 0;
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  for (; d0 + kDims <= head_dim; d0 += kDims) {  // the loop below in eight named registers (see score_tile16)
    float* a = acc + d0;
    __m256 a0 = _mm256_loadu_ps(a), b0 = _mm256_loadu_ps(a + 8);
    __m256 a1 = _mm256_loadu_ps(a + head_dim), b1 = _mm256_loadu_ps(a + head_dim + 8);
    __m256 a2 = _mm256_loadu_ps(a + 2 * head_dim), b2 = _mm256_loadu_ps(a + 2 * head_dim + 8);
    __m256 a3 = _mm256_loadu_ps(a + 3 * head_dim), b3 = _mm256_loadu_ps(a + 3 * head_dim + 8);
    for (int64_t j = 0; j < block_size; ++j) {
      const float* vj = values + j * values_stride + d0;
      const __m256 lo = _mm256_loadu_ps(vj), hi = _mm256_loadu_ps(vj + 8);
      __m256 p = _mm256_broadcast_ss(probs + j);
      a0 = _mm256_fmadd_ps(p, lo, a0), b0 = _mm256_fmadd_ps(p, hi, b0);
      p = _mm256_broadcast_ss(probs + block_size + j);
      a1 = _mm256_fmadd_ps(p, lo, a1), b1 = _mm256_fmadd_ps(p, hi, b1);
      p = _mm256_broadcast_ss(probs + 2 * block_size + j);
      a2 = _mm256_fmadd_ps(p, lo, a2), b2 = _mm256_fmadd_ps(p, hi, b2);
      p = _mm256_broadcast_ss(probs + 3 * block_size + j);
      a3 = _mm256_fmadd_ps(p, lo, a3), b3 = _mm256_fmadd_ps(p, hi, b3);
    }
    _mm256_storeu_ps(a, a0), _mm256_storeu_ps(a + 8, b0);
    _mm256_storeu_ps(a + head_dim, a1), _mm256_storeu_ps(a + head_dim + 8, b1);
    _mm256_storeu_ps(a + 2 * head_dim, a2), _mm256_storeu_ps(a + 2 * head_dim + 8, b2);
    _mm256_storeu_ps(a + 3 * head_dim, a3), _mm256_storeu_ps(a + 3 * head_dim + 8, b3);
  }
#endif
  for (; d0 + kDims <= head_dim; d0 += kDims) {
    float tile[kRowTile][kDims];
    for (int rr = 0; rr < kRowTile; ++rr)
      for (int e = 0; e < kDims; ++e) tile[rr][e] = acc[rr * head_dim + d0 + e];
    for (int64_t j = 0; j < block_size; ++j) {
      const float* vj = values + j * values_stride + d0;
      for (int rr = 0; rr < kRowTile; ++rr) {
        const float p = probs[rr * block_size + j];
        for (int e = 0; e < kDims; ++e) tile[rr][e] = std::fma(p, vj[e], tile[rr][e]);
      }
    }
    for (int rr = 0; rr < kRowTile; ++rr)
      for (int e = 0; e < kDims; ++e) acc[rr * head_dim + d0 + e] = tile[rr][e];
  }
  for (int rr = 0; rr < kRowTile; ++rr)  // a head dim that is not a multiple of 16: its last dims
    for (int64_t j = 0; j < block_size; ++j)
      for (int64_t d = d0; d < head_dim; ++d)
        acc[rr * head_dim + d] = std::fma(probs[rr * block_size + j], values[j * values_stride + d], acc[rr * head_dim + d]);
}

struct Task {
  int64_t group;
  int64_t first;       // first query of the group in this task
  int64_t count;       // queries in this task
  int64_t head_begin;  // kv heads [head_begin, head_end)
  int64_t head_end;
};

// kBlock, kHeadDim: the block size and head dim fixed at compile time for the common shapes (0: read
// from the arguments). Fixed trip counts let the compiler keep a row tile's scores and a row's
// accumulator in registers; the operations and their order are the same either way.
// A task's KV heads are visited head by head inside each block: the block's rows of those heads
// are one stretch of memory, read in order.
template <typename scalar_t, int kBlock, int kHeadDim>
void attend_task(const Task& task, const scalar_t* __restrict__ q, const scalar_t* __restrict__ k_cache,
                 const scalar_t* __restrict__ v_cache, scalar_t* __restrict__ out, const int32_t* __restrict__ tables,
                 int64_t table_stride, const int64_t* __restrict__ group_row,
                 const int64_t* __restrict__ group_pos, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim_arg,
                 int64_t block_size_arg, int64_t window, float scale) {
  const int64_t block_size = kBlock ? kBlock : block_size_arg;
  const int64_t head_dim = kHeadDim ? kHeadDim : head_dim_arg;
  const int64_t group_size = num_heads / num_kv_heads;
  const int64_t heads = task.head_end - task.head_begin;
  const int64_t rows = task.count * group_size;  // query rows per kv head: (query position, head of the group)
  const int64_t tiled_rows = (rows + kRowTile - 1) / kRowTile * kRowTile;  // the last tile padded with zero rows
  const int64_t slot_stride = num_kv_heads * head_dim;
  const int32_t* table = tables + task.group * table_stride;  // one table row per group
  const int64_t first_pos = group_pos[task.group] + task.first;
  const int64_t last_pos = first_pos + task.count - 1;

  // Per kv head h of the task: query [tiled_rows, D] at h * tiled_rows * D, acc [rows, D] at h * rows * D,
  // running max and sum [rows] at h * rows.
  std::vector<float> query(heads * tiled_rows * head_dim, 0.0f), acc(heads * rows * head_dim, 0.0f);
  std::vector<float> running_max(heads * rows, -std::numeric_limits<float>::infinity()), running_sum(heads * rows, 0.0f);
  std::vector<float> scores(tiled_rows * block_size);  // [rows, B] this block's scores, for one head
  // [D, B] keys transposed; [B, D] values as floats (unused in float32, read in place)
  std::vector<float> keys_t(head_dim * block_size), values(std::is_same_v<scalar_t, float> ? 0 : block_size * head_dim);
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t token = group_row[task.group] + task.first + r / group_size;
      const int64_t head = (task.head_begin + h) * group_size + r % group_size;
      const scalar_t* src = q + (token * num_heads + head) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) query[(h * tiled_rows + r) * head_dim + d] = to_float(src[d]);
    }

  const int64_t lowest_key = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
  std::vector<std::array<int64_t, 2>> visible(rows);  // [lo, hi): the keys of this block each row sees
  for (int64_t block = lowest_key / block_size; block <= last_pos / block_size; ++block) {
    const int64_t block_start = block * block_size;
    if (block < last_pos / block_size) prefetch_block(k_cache, v_cache, table[block + 1], block_size, slot_stride,
                                                      task.head_begin * head_dim, heads * head_dim);
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t base = static_cast<int64_t>(table[block]) * block_size * slot_stride + (task.head_begin + h) * head_dim;
      const float* head_query = &query[h * tiled_rows * head_dim];
      float* head_acc = &acc[h * rows * head_dim];
      float* head_max = &running_max[h * rows];
      float* head_sum = &running_sum[h * rows];
      transpose_keys(k_cache + base, slot_stride, block_size, head_dim, keys_t.data());
      // Row j of the block's values, as floats: read in place in float32, converted once per block otherwise.
      const float* block_values;
      int64_t values_stride;
      if constexpr (std::is_same_v<scalar_t, float>) {
        block_values = v_cache + base;
        values_stride = slot_stride;
      } else {
        for (int64_t j = 0; j < block_size; ++j) {
          const scalar_t* v_row = v_cache + base + j * slot_stride;
          for (int64_t d = 0; d < head_dim; ++d) values[j * head_dim + d] = to_float(v_row[d]);
        }
        block_values = values.data();
        values_stride = head_dim;
      }
      // Every row's score against every key of the block, kRowTile rows at a time (independent chains
      // that keep the FMA units busy); a score is a chain of FMAs over d = 0..D-1. Keys a row may not
      // see are scored too and then ignored.
      for (int64_t r0 = 0; r0 < tiled_rows; r0 += kRowTile) {
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
        if constexpr (kBlock == 16) {
          score_tile16(head_query + r0 * head_dim, head_dim, keys_t.data(), &scores[r0 * block_size]);
          continue;
        }
#endif
        float tile[kRowTile][kBlock ? kBlock : kMaxBlock] = {};
        for (int64_t d = 0; d < head_dim; ++d) {
          const float* kd = &keys_t[d * block_size];
          for (int rr = 0; rr < kRowTile; ++rr) {
            const float qd = head_query[(r0 + rr) * head_dim + d];
            for (int64_t j = 0; j < block_size; ++j) tile[rr][j] = std::fma(qd, kd[j], tile[rr][j]);
          }
        }
        for (int rr = 0; rr < kRowTile; ++rr)
          for (int64_t j = 0; j < block_size; ++j) scores[(r0 + rr) * block_size + j] = tile[rr][j];
      }
      // Softmax of each row's visible scores, in place in ``scores`` (its probabilities), and the
      // row's accumulator rescaled; then acc += probs @ V: kRowTile rows at a time where they all see
      // the whole block (a long prefill's rows, but on the diagonal and at a window's edge), row by row
      // otherwise. Both run each accumulator's chain over the visible keys in order, so the same bits.
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t pos = first_pos + r / group_size;
        const int64_t first_key = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
        const int64_t lo = std::max<int64_t>(first_key - block_start, 0);
        const int64_t hi = std::min<int64_t>(pos - block_start + 1, block_size);  // visible keys: [lo, hi)
        visible[r] = {lo, hi};
        if (lo >= hi) continue;  // the row sees nothing in this block
        float* sr = &scores[r * block_size];
        float block_max = -std::numeric_limits<float>::infinity();
        for (int64_t j = lo; j < hi; ++j) {
          sr[j] *= scale;
          block_max = max_of(block_max, sr[j]);
        }
        const float new_max = max_of(head_max[r], block_max);
        const float rescale = exp_nonpositive(head_max[r] - new_max);  // 0 on the row's first block
        head_max[r] = new_max;
        int64_t j = lo;
#if defined(__AVX2__) && defined(__FMA__)
        for (; j + 8 <= hi; j += 8)
          _mm256_storeu_ps(sr + j, exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(sr + j), _mm256_set1_ps(new_max))));
#endif
        for (; j < hi; ++j) sr[j] = exp_nonpositive(sr[j] - new_max);
        float block_sum = 0.0f;
        for (int64_t j = lo; j < hi; ++j) block_sum += sr[j];
        head_sum[r] = std::fma(head_sum[r], rescale, block_sum);
        float* ar = &head_acc[r * head_dim];
        for (int64_t d = 0; d < head_dim; ++d) ar[d] *= rescale;
      }
      for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
        bool whole = r0 + kRowTile <= rows;
        for (int64_t r = r0; whole && r < r0 + kRowTile; ++r) whole = visible[r][0] == 0 && visible[r][1] == block_size;
        if (whole) {
          accumulate_tile<kBlock>(scores.data(), block_size, block_values, values_stride, head_acc, head_dim, r0);
          continue;
        }
        for (int64_t r = r0; r < std::min(rows, r0 + kRowTile); ++r) {
          const float* pr = &scores[r * block_size];
          float* __restrict__ ar = &head_acc[r * head_dim];
          for (int64_t j = visible[r][0]; j < visible[r][1]; ++j) {
            const float p = pr[j];
            const float* vj = block_values + j * values_stride;
            for (int64_t d = 0; d < head_dim; ++d) ar[d] = std::fma(p, vj[d], ar[d]);
          }
        }
      }
    }
  }
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t token = group_row[task.group] + task.first + r / group_size;
      const int64_t head = (task.head_begin + h) * group_size + r % group_size;
      scalar_t* dst = out + (token * num_heads + head) * head_dim;
      const float inv = 1.0f / running_sum[h * rows + r];
      for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[(h * rows + r) * head_dim + d] * inv);
    }
}

// out, q: [N, Hq, D]; k_cache, v_cache: [S, Hkv, D] with S = blocks * block_size; tables: [G, MB] int32,
// group g's block table in row g; group_row / group_pos / group_len: [G] int64 — for each group of
// consecutive queries of one sequence, its first row of q, the position of that row, and its number of rows.
void paged_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                     torch::Tensor tables, torch::Tensor group_row,
                     torch::Tensor group_pos, torch::Tensor group_len, int64_t block_size, int64_t window,
                     double scale) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_attention: q, out and the caches must be contiguous");
  TORCH_CHECK(tables.scalar_type() == torch::kInt32 && tables.is_contiguous(), "paged_attention: int32 tables");
  TORCH_CHECK(block_size >= 1 && block_size <= kMaxBlock, "paged_attention: block_size must be in [1, 64]");
  const int64_t num_heads = q.size(1), head_dim = q.size(2), num_kv_heads = k_cache.size(1);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "paged_attention: query heads must be a multiple of kv heads");
  const int64_t num_groups = group_len.size(0);
  const int64_t* lengths = group_len.data_ptr<int64_t>();
  // A task takes every kv head of its query tile when there are tasks enough to keep each thread
  // busy (kTasksPerThread), one head otherwise; the choice moves no row's arithmetic.
  int64_t tiles = 0;
  for (int64_t g = 0; g < num_groups; ++g) tiles += (lengths[g] + kQueryTile - 1) / kQueryTile;
  const int64_t heads_per_task = tiles >= kTasksPerThread * at::get_num_threads() ? num_kv_heads : 1;
  std::vector<Task> tasks;
  for (int64_t h = 0; h < num_kv_heads; h += heads_per_task)
    for (int64_t g = 0; g < num_groups; ++g)
      for (int64_t first = 0; first < lengths[g]; first += kQueryTile)
        tasks.push_back({g, first, std::min<int64_t>(kQueryTile, lengths[g] - first), h, h + heads_per_task});
  // Longest contexts first, then handed out one at a time: tasks differ in cost by their context length.
  const int64_t* positions = group_pos.data_ptr<int64_t>();
  std::stable_sort(tasks.begin(), tasks.end(), [&](const Task& a, const Task& b) {
    return positions[a.group] + a.first + a.count > positions[b.group] + b.first + b.count;
  });
  std::atomic<int64_t> next{0};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, q.scalar_type(),
                                  "paged_attention", [&] {
    const auto* q_ptr = q.data_ptr<scalar_t>();
    const auto* k_ptr = k_cache.data_ptr<scalar_t>();
    const auto* v_ptr = v_cache.data_ptr<scalar_t>();
    auto* out_ptr = out.data_ptr<scalar_t>();
    const int64_t num_tasks = static_cast<int64_t>(tasks.size());
    // The common shapes compiled with fixed sizes (see attend_task), any other with sizes read at run time.
    auto task_fn = &attend_task<scalar_t, 0, 0>;
    if (block_size == 16 && head_dim == 64) task_fn = &attend_task<scalar_t, 16, 64>;
    if (block_size == 16 && head_dim == 128) task_fn = &attend_task<scalar_t, 16, 128>;
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      for (int64_t t = next++; t < num_tasks; t = next++)
        task_fn(tasks[t], q_ptr, k_ptr, v_ptr, out_ptr, tables.data_ptr<int32_t>(), tables.size(1),
                group_row.data_ptr<int64_t>(), positions, num_heads,
                num_kv_heads, head_dim, block_size, window, static_cast<float>(scale));
    });
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Each kernel runs without the GIL, as torch's own ops do: the replica's event loop (Serve's calls,
  // the output channels) and other Python threads run while it computes.
  m.def("paged_attention", &paged_attention, "Paged attention over the KV pool, in place (see the file's header)",
        py::call_guard<py::gil_scoped_release>());
}
