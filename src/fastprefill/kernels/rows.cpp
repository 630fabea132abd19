// A decode step's few-row work on the CPU for fastprefill: its linear layers' matrix products and
// the RMSNorms between them.
//
// A decode step multiplies one row (or a couple, for a small decode batch) by every weight of the
// model, so its time is the time to read the weights once. oneDNN's products of one or two rows
// read a packed bfloat16 weight at about half of what two cores can stream here; these read the
// plain (N, K) weight row after row, so each thread walks one contiguous span of memory in order,
// and compute each output as one dot product: two AVX512-BF16 accumulators (vdpbf16ps) over K,
// added, reduced, plus the bias, rounded once to bfloat16 (nearest even, as torch rounds).
//
// Each output row is computed by the same instructions in the same order whatever the other input
// rows are: a row's result does not depend on how many rows the call has (1 to kMaxRows).
//
//   products(x (R, K), [w_i (N_i, K)], [b_i (N_i) or None]) -> (R, sum N_i): the layers' outputs
//       side by side (merged q, k and v projections read one input once, as one call);
//   swiglu(x (R, K), w_gate (I, K), b_gate, w_up (I, K), b_up) -> (R, I):
//       silu(x w_gate^T + b_gate), rounded to bfloat16, times (x w_up^T + b_up) in float32,
//       rounded: oneDNN's swish post-op and mul binary post-op, in the same order of roundings;
//   rms_norm(x (R, D), w (D), eps) -> (R, D): x / sqrt(mean(x^2) + eps) in float32, rounded, times w,
//       rounded (transformers' Llama / Qwen2 RMSNorm, its roundings in its order);
//   add_rms_norm(residual (R, D), x (R, D), w (D), eps) -> (residual + x rounded, rms_norm of that):
//       a decoder layer's residual add and the norm after it, in one call.
//
// bfloat16 only; compiled in the AVX-512 variant with -mavx512bf16 (fastprefill.kernels loads it
// where the CPU has AVX512-BF16). Threads: ATen's parallel_for over the output columns.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kMaxRows = 4;

inline float from_bf16(uint16_t v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t to_bf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

#if defined(__AVX512BF16__)
// out[m] = sum_k x[m, k] w[k] for the R rows of x (row stride K), float32 sums.
template <int R>
inline void dots(const uint16_t* x, const uint16_t* w, int64_t K, float* out) {
  __m512 even[R], odd[R];
  for (int m = 0; m < R; ++m) even[m] = odd[m] = _mm512_setzero_ps();
  const int64_t k64 = K / 64 * 64;
  int64_t k = 0;
  for (; k < k64; k += 64) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + k), w1 = (__m512bh)_mm512_loadu_si512(w + k + 32);
    for (int m = 0; m < R; ++m) {
      even[m] = _mm512_dpbf16_ps(even[m], (__m512bh)_mm512_loadu_si512(x + m * K + k), w0);
      odd[m] = _mm512_dpbf16_ps(odd[m], (__m512bh)_mm512_loadu_si512(x + m * K + k + 32), w1);
    }
  }
  for (; k < K; k += 32) {  // a 32-wide step, the last one masked
    const __mmask32 mask = K - k >= 32 ? ~__mmask32(0) : __mmask32((1u << (K - k)) - 1);
    const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + k);
    for (int m = 0; m < R; ++m)
      even[m] = _mm512_dpbf16_ps(even[m], (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k), wv);
  }
  for (int m = 0; m < R; ++m) out[m] = _mm512_reduce_add_ps(_mm512_add_ps(even[m], odd[m]));
}
#endif

// One layer's weight and bias: rows [start, start + n) of the merged output.
struct Part {
  const uint16_t* w;
  const uint16_t* b;
  int64_t start, n;
};

template <int R>
void products_span(const uint16_t* x, const std::vector<Part>& parts, uint16_t* y, int64_t K, int64_t N,
                   int64_t n0, int64_t n1) {
#if defined(__AVX512BF16__)
  size_t p = 0;
  while (n0 >= parts[p].start + parts[p].n) ++p;
  float v[R];
  for (int64_t n = n0; n < n1; ++n) {
    if (n >= parts[p].start + parts[p].n) ++p;
    const Part& part = parts[p];
    const int64_t row = n - part.start;
    dots<R>(x, part.w + row * K, K, v);
    const float bias = part.b ? from_bf16(part.b[row]) : 0.f;
    for (int m = 0; m < R; ++m) y[m * N + n] = to_bf16(v[m] + bias);
  }
#endif
}

template <int R>
void swiglu_span(const uint16_t* x, const Part& gate, const Part& up, uint16_t* y, int64_t K, int64_t I,
                 int64_t n0, int64_t n1) {
#if defined(__AVX512BF16__)
  float g[R], u[R];
  for (int64_t n = n0; n < n1; ++n) {
    dots<R>(x, gate.w + n * K, K, g);
    dots<R>(x, up.w + n * K, K, u);
    const float bg = gate.b ? from_bf16(gate.b[n]) : 0.f, bu = up.b ? from_bf16(up.b[n]) : 0.f;
    for (int m = 0; m < R; ++m) {
      const float a = g[m] + bg;
      const float gated = from_bf16(to_bf16(a / (1.f + std::exp(-a))));
      y[m * I + n] = to_bf16((u[m] + bu) * gated);
    }
  }
#endif
}

// Calls fn.template operator()<R>() for the runtime row count R in 1..kMaxRows.
template <typename F>
void by_rows(int64_t rows, F&& fn) {
  switch (rows) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 3: fn(std::integral_constant<int, 3>{}); break;
    default: fn(std::integral_constant<int, 4>{}); break;
  }
}

const uint16_t* data(const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); }

void check_supported() {
#if !defined(__AVX512BF16__)
  TORCH_CHECK(false, "this build of fastprefill's few-row products has no AVX512-BF16 code");
#endif
}

torch::Tensor check_input(const torch::Tensor& x, int64_t K) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16, "x must be a bfloat16 CPU tensor");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "x's last dimension (", x.size(-1), ") must be the weights' K (", K, ")");
  const int64_t rows = K ? x.numel() / K : 0;
  TORCH_CHECK(rows >= 1 && rows <= kMaxRows, "few-row products take 1 to ", kMaxRows, " input rows, got ", rows);
  return x.contiguous().view({rows, K});
}

Part check_part(const torch::Tensor& w, const std::optional<torch::Tensor>& b, int64_t K, int64_t start) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.is_contiguous(),
              "each weight must be a contiguous 2-D bfloat16 CPU tensor (N, K)");
  TORCH_CHECK(w.size(1) == K, "every weight must have K = ", K, " columns, got ", w.size(1));
  if (b) {
    TORCH_CHECK(b->scalar_type() == at::kBFloat16 && b->dim() == 1 && b->size(0) == w.size(0) && b->is_contiguous(),
                "a bias must be a contiguous bfloat16 vector of the weight's N (", w.size(0), ")");
  }
  return Part{data(w), b ? data(*b) : nullptr, start, w.size(0)};
}

torch::Tensor products(const torch::Tensor& x, const std::vector<torch::Tensor>& weights,
                       const std::vector<std::optional<torch::Tensor>>& biases) {
  check_supported();
  TORCH_CHECK(!weights.empty() && weights.size() == biases.size(), "one bias (or None) per weight");
  const int64_t K = weights[0].size(-1);
  const torch::Tensor rows = check_input(x, K);
  std::vector<Part> parts;
  int64_t N = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    parts.push_back(check_part(weights[i], biases[i], K, N));
    N += weights[i].size(0);
  }
  torch::Tensor y = torch::empty({rows.size(0), N}, x.options());
  const uint16_t* xp = data(rows);
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  by_rows(rows.size(0), [&](auto r) {
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { products_span<decltype(r)::value>(xp, parts, yp, K, N, n0, n1); });
  });
  return y;
}

torch::Tensor swiglu(const torch::Tensor& x, const torch::Tensor& gate_w, const std::optional<torch::Tensor>& gate_b,
                     const torch::Tensor& up_w, const std::optional<torch::Tensor>& up_b) {
  check_supported();
  const int64_t K = gate_w.size(-1), I = gate_w.size(0);
  TORCH_CHECK(up_w.sizes() == gate_w.sizes(), "the gate and up weights must have one shape (I, K)");
  const torch::Tensor rows = check_input(x, K);
  const Part gate = check_part(gate_w, gate_b, K, 0), up = check_part(up_w, up_b, K, 0);
  torch::Tensor y = torch::empty({rows.size(0), I}, x.options());
  const uint16_t* xp = data(rows);
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  by_rows(rows.size(0), [&](auto r) {
    at::parallel_for(0, I, 16, [&](int64_t n0, int64_t n1) { swiglu_span<decltype(r)::value>(xp, gate, up, yp, K, I, n0, n1); });
  });
  return y;
}

// out = rms_norm(x) * w for one row of D elements (float32 statistics; roundings as the module's).
void norm_row(const uint16_t* x, const uint16_t* w, float eps, int64_t D, uint16_t* out) {
  float sum = 0.f;
  for (int64_t i = 0; i < D; ++i) {
    const float v = from_bf16(x[i]);
    sum += v * v;
  }
  const float scale = 1.f / std::sqrt(sum / float(D) + eps);
  for (int64_t i = 0; i < D; ++i) out[i] = to_bf16(from_bf16(w[i]) * from_bf16(to_bf16(from_bf16(x[i]) * scale)));
}

torch::Tensor check_norm(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kBFloat16 && w.dim() == 1 && w.is_contiguous(),
              "the norm's weight must be a contiguous bfloat16 CPU vector");
  return check_input(x, w.size(0));
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  const torch::Tensor rows = check_norm(x, w);
  const int64_t D = w.size(0);
  torch::Tensor out = torch::empty_like(rows);
  for (int64_t r = 0; r < rows.size(0); ++r)
    norm_row(data(rows) + r * D, data(w), float(eps), D, reinterpret_cast<uint16_t*>(out.data_ptr()) + r * D);
  return out.view(x.sizes());
}

std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& residual, const torch::Tensor& x,
                                                      const torch::Tensor& w, double eps) {
  TORCH_CHECK(residual.sizes() == x.sizes(), "the residual and the added rows must have one shape");
  const torch::Tensor a = check_norm(residual, w), b = check_norm(x, w);
  const int64_t D = w.size(0);
  torch::Tensor sum = torch::empty_like(a), out = torch::empty_like(a);
  uint16_t* sp = reinterpret_cast<uint16_t*>(sum.data_ptr());
  for (int64_t i = 0; i < a.numel(); ++i) sp[i] = to_bf16(from_bf16(data(a)[i]) + from_bf16(data(b)[i]));
  for (int64_t r = 0; r < a.size(0); ++r)
    norm_row(sp + r * D, data(w), float(eps), D, reinterpret_cast<uint16_t*>(out.data_ptr()) + r * D);
  return {sum.view(x.sizes()), out.view(x.sizes())};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("products", &products, "x (R,K) times each weight (N_i,K), plus its bias -> (R, sum N_i), bfloat16, R <= 4",
        py::arg("x"), py::arg("weights"), py::arg("biases"));
  m.def("swiglu", &swiglu, "silu(x w_gate^T + b_gate) * (x w_up^T + b_up) -> (R, I), bfloat16, R <= 4",
        py::arg("x"), py::arg("gate_w"), py::arg("gate_b"), py::arg("up_w"), py::arg("up_b"));
  m.def("rms_norm", &rms_norm, "RMSNorm of x (R,D) with weight (D) -> (R,D), bfloat16, R <= 4",
        py::arg("x"), py::arg("weight"), py::arg("eps"));
  m.def("add_rms_norm", &add_rms_norm, "(residual + x, RMSNorm(residual + x)), each (R,D), bfloat16, R <= 4",
        py::arg("residual"), py::arg("x"), py::arg("weight"), py::arg("eps"));
  m.attr("max_rows") = kMaxRows;
}
