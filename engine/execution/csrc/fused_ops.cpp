// The decoder's elementwise work in one pass each (engine/execution/fused_ops.py has the torch
// reference of each kernel beside its caller; tests/test_fused_ops.py compares the two).
//
//   add_rms_norm_:  x += delta (optional), out = weight * rms_norm(x), float32 accumulation
//   rope_:          q and k rotated in place (transformers' rotate_half form)
//   silu_mul_:      gate_up[:, :I] = silu(gate) * up, in place
//
// Rounding. Each kernel rounds to the tensor's dtype where the torch reference does (after the
// add, after the normalisation, after each product of RoPE, after silu), so RoPE gives the
// reference's bits in every dtype and RMSNorm differs only by its sum of squares, which runs here
// in a fixed order: 16 lanes over the row, then a fixed tree over the lanes. That order depends
// on the row alone (not on the other rows, the thread count or the CPU's vector width), so every
// kernel is batch-invariant. Built with -ffp-contract=off: no multiply-add is fused behind our back;
// and -fno-trapping-math, which changes no result but lets GCC vectorise the selects of exp_any.

#include <torch/types.h>  // ATen's tensors only: torch/extension.h (all of torch's C++ API) took ~1.8x the compile
#include <torch/csrc/utils/pybind.h>  // pybind11 with at::Tensor's type caster
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>

namespace {

constexpr int kLanes = 16;  // partial sums per row: a fixed count, whatever the vector width

template <typename scalar_t>
inline float to_float(scalar_t v) { return static_cast<float>(v); }

// Round a float to the dtype and back: the value torch would hold between two operations.
template <typename scalar_t>
inline float round_to(float v) { return static_cast<float>(static_cast<scalar_t>(v)); }

// exp(x) to ~2 ulp over the whole float range (clamped to [-104, 88.7]): 2^n * 2^f with a
// degree-7 polynomial. Plain code, so the compiler vectorises the loops that call it.
inline float exp_any(float x) {
  x = x < -104.0f ? -104.0f : x;
  x = x > 88.7f ? 88.7f : x;
  const float t = x * 1.4426950408889634f;
  const float n = static_cast<float>(static_cast<int32_t>(t + std::copysign(0.5f, t)));  // round(t)
  const float f = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;  // x - n*ln2, two parts
  float p = 1.9875691500e-4f;
  p = p * f + 1.3981999507e-3f;
  p = p * f + 8.3334519073e-3f;
  p = p * f + 4.1665795894e-2f;
  p = p * f + 1.6666665459e-1f;
  p = p * f + 5.0000001201e-1f;
  p = p * (f * f) + (f + 1.0f);
  // 2^n as two factors, so that n down to -150 (denormal results) stays representable.
  const int32_t half = static_cast<int32_t>(n) / 2;
  const int32_t bits_a = (half + 127) << 23, bits_b = (static_cast<int32_t>(n) - half + 127) << 23;
  return p * __builtin_bit_cast(float, bits_a) * __builtin_bit_cast(float, bits_b);
}

template <typename scalar_t>
void add_rms_norm_rows(scalar_t* x, const scalar_t* delta, int64_t delta_row, int64_t delta_col,
                       const scalar_t* weight, scalar_t* out, int64_t hidden, float eps, int64_t begin, int64_t end) {
  for (int64_t row = begin; row < end; ++row) {
    scalar_t* xr = x + row * hidden;
    if (delta != nullptr) {
      const scalar_t* dr = delta + row * delta_row;
      if (delta_col == 1) {  // the loop the compiler vectorises
        for (int64_t j = 0; j < hidden; ++j) xr[j] = static_cast<scalar_t>(to_float(xr[j]) + to_float(dr[j]));
      } else {
        for (int64_t j = 0; j < hidden; ++j) xr[j] = static_cast<scalar_t>(to_float(xr[j]) + to_float(dr[j * delta_col]));
      }
    }
    float lanes[kLanes] = {0.0f};
    int64_t j = 0;
    for (; j + kLanes <= hidden; j += kLanes) {
      for (int l = 0; l < kLanes; ++l) {
        const float v = to_float(xr[j + l]);
        lanes[l] += v * v;
      }
    }
    for (int l = 0; j < hidden; ++j, ++l) {
      const float v = to_float(xr[j]);
      lanes[l] += v * v;
    }
    for (int width = kLanes / 2; width > 0; width /= 2) {
      for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
    }
    const float inv = 1.0f / std::sqrt(lanes[0] / static_cast<float>(hidden) + eps);
    scalar_t* orow = out + row * hidden;
    for (j = 0; j < hidden; ++j) {
      orow[j] = static_cast<scalar_t>(to_float(weight[j]) * round_to<scalar_t>(to_float(xr[j]) * inv));
    }
  }
}

// x [N, H] contiguous, updated in place by + delta [N, H] (any strides) when delta is given;
// out [N, H] contiguous gets weight [H] * rms_norm(x).
void add_rms_norm_(torch::Tensor x, c10::optional<torch::Tensor> delta, torch::Tensor weight, torch::Tensor out,
                   double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.is_contiguous() && weight.is_contiguous(),
              "add_rms_norm_: x, out and weight contiguous, x [N, H]");
  TORCH_CHECK(out.sizes() == x.sizes() && weight.numel() == x.size(1), "add_rms_norm_: shapes");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && out.scalar_type() == x.scalar_type(), "add_rms_norm_: dtypes");
  const bool has_delta = delta.has_value() && delta->defined();
  if (has_delta) {
    TORCH_CHECK(delta->sizes() == x.sizes() && delta->scalar_type() == x.scalar_type(), "add_rms_norm_: delta");
  }
  const int64_t rows = x.size(0), hidden = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, x.scalar_type(), "add_rms_norm_", [&] {
    const scalar_t* d = has_delta ? delta->data_ptr<scalar_t>() : nullptr;
    const int64_t d_row = has_delta ? delta->stride(0) : 0, d_col = has_delta ? delta->stride(1) : 0;
    at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / hidden), [&](int64_t begin, int64_t end) {
      add_rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), d, d_row, d_col, weight.data_ptr<scalar_t>(),
                                  out.data_ptr<scalar_t>(), hidden, static_cast<float>(eps), begin, end);
    });
  });
}

// One tensor [N, H, D] (any strides) rotated in place by cos/sin [N, D] (contiguous rows; both
// halves equal, the first read): x1' = x1*c - x2*s, x2' = x2*c + x1*s, each product rounded.
template <typename scalar_t, bool kUnit>
void rope_rows(torch::Tensor& t, const scalar_t* cos, const scalar_t* sin, int64_t table_row, int64_t begin,
               int64_t end) {
  const int64_t heads = t.size(1), half = t.size(2) / 2;
  const int64_t s_row = t.stride(0), s_head = t.stride(1), s_dim = kUnit ? 1 : t.stride(2);
  scalar_t* base = t.data_ptr<scalar_t>();
  for (int64_t row = begin; row < end; ++row) {
    const scalar_t* c = cos + row * table_row;
    const scalar_t* s = sin + row * table_row;
    for (int64_t h = 0; h < heads; ++h) {
      scalar_t* x1 = base + row * s_row + h * s_head;
      scalar_t* x2 = x1 + half * s_dim;
      for (int64_t j = 0; j < half; ++j) {
        const float a = to_float(x1[j * s_dim]), b = to_float(x2[j * s_dim]);
        const float cj = to_float(c[j]), sj = to_float(s[j]);
        x1[j * s_dim] = static_cast<scalar_t>(round_to<scalar_t>(a * cj) - round_to<scalar_t>(b * sj));
        x2[j * s_dim] = static_cast<scalar_t>(round_to<scalar_t>(b * cj) + round_to<scalar_t>(a * sj));
      }
    }
  }
}

void rope_(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2), "rope_: q, k [N, H, D]");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == q.size(0) && cos.size(1) == q.size(2) && cos.stride(1) == 1 &&
              sin.sizes() == cos.sizes() && sin.strides() == cos.strides(), "rope_: cos, sin [N, D], rows contiguous");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && cos.scalar_type() == q.scalar_type() &&
              sin.scalar_type() == q.scalar_type(), "rope_: dtypes");
  const int64_t rows = q.size(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, q.scalar_type(), "rope_", [&] {
    const scalar_t* c = cos.data_ptr<scalar_t>();
    const scalar_t* s = sin.data_ptr<scalar_t>();
    at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / ((q.size(1) + k.size(1)) * q.size(2))),
                     [&](int64_t begin, int64_t end) {
      (q.stride(2) == 1 ? rope_rows<scalar_t, true> : rope_rows<scalar_t, false>)(q, c, s, cos.stride(0), begin, end);
      (k.stride(2) == 1 ? rope_rows<scalar_t, true> : rope_rows<scalar_t, false>)(k, c, s, cos.stride(0), begin, end);
    });
  });
}

// gate_up [N, 2I] (any strides): gate_up[:, :I] = silu(gate) * up, silu rounded to the dtype first.
// kUnit: the column stride is 1 (the compiler vectorises the loop only when it knows it).
template <typename scalar_t, bool kUnit>
void silu_mul_rows(scalar_t* base, int64_t s_row, int64_t s_col, int64_t inter, int64_t begin, int64_t end) {
  if constexpr (kUnit) s_col = 1;
  for (int64_t row = begin; row < end; ++row) {
    scalar_t* gate = base + row * s_row;
    const scalar_t* up = gate + inter * s_col;
    for (int64_t j = 0; j < inter; ++j) {
      const float g = to_float(gate[j * s_col]);
      const float silu = round_to<scalar_t>(g / (1.0f + exp_any(-g)));
      gate[j * s_col] = static_cast<scalar_t>(silu * to_float(up[j * s_col]));
    }
  }
}

void silu_mul_(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_mul_: gate_up [N, 2I]");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, gate_up.scalar_type(), "silu_mul_", [&] {
    at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / inter), [&](int64_t begin, int64_t end) {
      auto rows_fn = gate_up.stride(1) == 1 ? silu_mul_rows<scalar_t, true> : silu_mul_rows<scalar_t, false>;
      rows_fn(gate_up.data_ptr<scalar_t>(), gate_up.stride(0), gate_up.stride(1), inter, begin, end);
    });
  });
}

}  // namespace

torch::Tensor invariant_linear(const torch::Tensor& x, const torch::Tensor& weight);  // invariant_linear.cpp
bool invariant_linear_bf16_dot();  // invariant_linear.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Each kernel runs without the GIL, as torch's own ops do: the replica's event loop (Serve's calls,
  // the output channels) and other Python threads run while it computes.
  m.def("add_rms_norm_", &add_rms_norm_, "x += delta; out = weight * rms_norm(x) (see the file's header)",
        py::call_guard<py::gil_scoped_release>());
  m.def("rope_", &rope_, "RoPE on q and k in place",
        py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul_", &silu_mul_, "gate_up[:, :I] = silu(gate) * up in place",
        py::call_guard<py::gil_scoped_release>());
  m.def("invariant_linear", &invariant_linear, "x @ weight^T in one fixed order per output (invariant_linear.cpp)",
        py::call_guard<py::gil_scoped_release>());
  m.def("invariant_linear_bf16_dot", &invariant_linear_bf16_dot,
        "whether invariant_linear multiplies bfloat16 by vdpbf16ps (an AVX512-BF16 build)");
}
