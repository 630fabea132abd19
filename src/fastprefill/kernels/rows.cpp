// A decode step's few-row work on the CPU for fastprefill: its linear layers' matrix products and
// the RMSNorms between them.
//
// A decode step multiplies one row (or a couple, for a small decode batch) by every weight of the
// model, so its time is the time to read the weights once. oneDNN's products of one or two rows
// read a packed bfloat16 weight at about half of what two cores can stream here, and its float32
// ones (and MKL's) at about two thirds; these read the plain (N, K) weight row after row, so each
// thread walks one contiguous span of memory in order, and compute each output as one dot product
// plus the bias:
//   bfloat16: two AVX512-BF16 accumulators (vdpbf16ps) over K, added, reduced, rounded once to
//   bfloat16 (nearest even, as torch rounds);
//   float32: one accumulator of fused multiply-adds over K per output (ATen's vectors: AVX-512 or
//   AVX2, as the build), reduced; tiles of four input rows by three weight rows, so a product of
//   more rows (a short prompt's, a hit's suffix, a larger decode batch: up to kMaxFloatRows) reads
//   each weight row once per four input rows and keeps the FMA units busy.
//
// Each output row is computed by the same instructions in the same order whatever the other input
// rows are: a row's result does not depend on how many rows the call has (1 to kMaxRows in
// bfloat16, 1 to kMaxFloatRows in float32).
//
//   products(x (R, K), [w_i (N_i, K)], [b_i (N_i) or None]) -> (R, sum N_i): the layers' outputs
//       side by side (merged q, k and v projections read one input once, as one call); bfloat16
//       or float32 (x, weights and biases of one dtype);
//   swiglu(x (R, K), w_gate (I, K), b_gate, w_up (I, K), b_up) -> (R, I), bfloat16:
//       silu(x w_gate^T + b_gate), rounded to bfloat16, times (x w_up^T + b_up) in float32,
//       rounded: oneDNN's swish post-op and mul binary post-op, in the same order of roundings;
//   rms_norm(x (R, D), w (D), eps) -> (R, D), bfloat16: x / sqrt(mean(x^2) + eps) in float32,
//       rounded, times w, rounded (transformers' Llama / Qwen2 RMSNorm, its roundings in its order);
//   add_rms_norm(residual (R, D), x (R, D), w (D), eps) -> (residual + x rounded, rms_norm of that),
//       bfloat16: a decoder layer's residual add and the norm after it, in one call.
//
// The bfloat16 code is compiled in the AVX-512 variant only (-mavx512bf16); both variants have the
// float32 code, and fastprefill.kernels loads the one matching the CPU. Threads: ATen's
// parallel_for over the output columns.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/cpu/vec/functional.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kMaxRows = 4;        // bfloat16
constexpr int64_t kMaxFloatRows = 64;  // float32

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

// y[m * ldy + j] = sum_k x[m, k] w_j[k] for a tile of MR rows of x (row stride K) by NR weight
// rows w_j, float32: one accumulator of fused multiply-adds per output, over K's vectors in order,
// the last partial vector zero-filled, then reduced. Every output is computed by the same
// instructions in the same order whatever the tile's size or place, so a row's result does not
// depend on the other rows. 4 x 3 accumulators, three weight vectors and one input vector fill
// AVX2's sixteen registers.
//
// While it computes, it asks for the next block's weight rows (next[0 .. n_next), each K long) one
// cache line at a time, so reading them from memory overlaps this block's arithmetic (a product of
// more than four rows runs several tiles on one block's weights, which the hardware's own
// prefetchers do not read ahead of). Prefetches change no result.
template <int MR, int NR>
inline void tile(const float* x, int64_t K, const float* const* w, float* y, int64_t ldy, const float* const* next,
                 int n_next) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t V = Vec::size();
  constexpr int64_t kLine = 64 / sizeof(float);
  Vec acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NR; ++j) acc[m][j] = Vec(0.f);
  int64_t k = 0;
  for (; k + V <= K; k += V) {
    if (k % kLine == 0)
      for (int j = 0; j < n_next; ++j) __builtin_prefetch(next[j] + k, 0, 3);
    Vec wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = Vec::loadu(w[j] + k);
    for (int m = 0; m < MR; ++m) {
      const Vec xv = Vec::loadu(x + m * K + k);
      for (int j = 0; j < NR; ++j) acc[m][j] = at::vec::fmadd(xv, wv[j], acc[m][j]);
    }
  }
  if (k < K) {
    const int64_t count = K - k;
    Vec wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = Vec::loadu(w[j] + k, count);
    for (int m = 0; m < MR; ++m) {
      const Vec xv = Vec::loadu(x + m * K + k, count);
      for (int j = 0; j < NR; ++j) acc[m][j] = at::vec::fmadd(xv, wv[j], acc[m][j]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NR; ++j)
      y[m * ldy + j] = at::vec::vec_reduce_all<float>([](Vec& p, Vec& q) { return p + q; }, acc[m][j]);
}

// tile<MR, NR> over all R rows of x: blocks of four rows, then the rest; each tile prefetches the
// next block's weight rows (next, n_next of them; the later tiles find most lines already there).
template <int NR>
inline void tile_rows(const float* x, int64_t R, int64_t K, const float* const* w, float* y, int64_t ldy,
                      const float* const* next, int n_next) {
  int64_t m = 0;
  for (; m + 4 <= R; m += 4) tile<4, NR>(x + m * K, K, w, y + m * ldy, ldy, next, n_next);
  switch (R - m) {
    case 3: tile<3, NR>(x + m * K, K, w, y + m * ldy, ldy, next, n_next); break;
    case 2: tile<2, NR>(x + m * K, K, w, y + m * ldy, ldy, next, n_next); break;
    case 1: tile<1, NR>(x + m * K, K, w, y + m * ldy, ldy, next, n_next); break;
    default: break;
  }
}

// One layer's weight and bias: rows [start, start + n) of the merged output.
template <typename T>
struct Part {
  const T* w;
  const T* b;
  int64_t start, n;
};

// The rows of the block of output columns starting at n, below the span's end n1: three, or one
// near n1 (none at or past it). Writes their weight rows (and biases, if asked) and returns how
// many; p walks forward over the parts.
int block_rows(const std::vector<Part<float>>& parts, size_t& p, int64_t n, int64_t n1, int64_t K, const float** w,
               float* bias) {
  const int nr = n + 3 <= n1 ? 3 : (n < n1 ? 1 : 0);
  for (int j = 0; j < nr; ++j) {
    while (n + j >= parts[p].start + parts[p].n) ++p;
    const int64_t row = n + j - parts[p].start;
    w[j] = parts[p].w + row * K;
    if (bias) bias[j] = parts[p].b ? parts[p].b[row] : 0.f;
  }
  return nr;
}

// The float32 products of output columns [n0, n1): blocks of three weight rows (a block may take
// rows of two layers), each against all R rows of x, the layer's bias added after; the next
// block's weight rows are prefetched during each block.
void float_products_span(const float* x, int64_t R, const std::vector<Part<float>>& parts, float* y, int64_t K,
                         int64_t N, int64_t n0, int64_t n1) {
  size_t p = 0;
  while (n0 >= parts[p].start + parts[p].n) ++p;
  const float* w[3];
  const float* next[3];
  float bias[3];
  for (int64_t n = n0; n < n1;) {
    const int nr = block_rows(parts, p, n, n1, K, w, bias);
    size_t q = p;
    const int n_next = block_rows(parts, q, n + nr, n1, K, next, nullptr);
    if (nr == 3) tile_rows<3>(x, R, K, w, y + n, N, next, n_next);
    else tile_rows<1>(x, R, K, w, y + n, N, next, n_next);
    for (int64_t m = 0; m < R; ++m)
      for (int j = 0; j < nr; ++j) y[m * N + n + j] += bias[j];
    n += nr;
  }
}

#if defined(__AVX512BF16__)
// The bfloat16 products of output columns [n0, n1) for R rows of x, one column at a time.
template <int R>
void products_span(const uint16_t* x, const std::vector<Part<uint16_t>>& parts, uint16_t* y, int64_t K, int64_t N,
                   int64_t n0, int64_t n1) {
  size_t p = 0;
  while (n0 >= parts[p].start + parts[p].n) ++p;
  float v[R];
  for (int64_t n = n0; n < n1; ++n) {
    if (n >= parts[p].start + parts[p].n) ++p;
    const Part<uint16_t>& part = parts[p];
    const int64_t row = n - part.start;
    dots<R>(x, part.w + row * K, K, v);
    const float bias = part.b ? from_bf16(part.b[row]) : 0.f;
    for (int m = 0; m < R; ++m) y[m * N + n] = to_bf16(v[m] + bias);
  }
}
#endif

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

template <int R>
void swiglu_span(const uint16_t* x, const Part<uint16_t>& gate, const Part<uint16_t>& up, uint16_t* y, int64_t K,
                 int64_t I, int64_t n0, int64_t n1) {
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

const uint16_t* data(const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); }

// The dtype of a call's tensors: bfloat16 (this build must have its code) or float32.
void check_dtype(const torch::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "x must be a bfloat16 or float32 CPU tensor");
#if !defined(__AVX512BF16__)
  TORCH_CHECK(x.scalar_type() != at::kBFloat16,
              "this build of fastprefill's few-row products has no AVX512-BF16 code: float32 only");
#endif
}

// x as (rows, K), contiguous: 1 to max_rows rows of K.
torch::Tensor check_input(const torch::Tensor& x, int64_t K, int64_t max_rows = kMaxRows) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "x's last dimension (", x.size(-1), ") must be the weights' K (", K, ")");
  const int64_t rows = K ? x.numel() / K : 0;
  TORCH_CHECK(rows >= 1 && rows <= max_rows, "few-row ", x.scalar_type() == at::kFloat ? "float32" : "bfloat16",
              " products take 1 to ", max_rows, " input rows, got ", rows);
  return x.contiguous().view({rows, K});
}

template <typename T>
Part<T> check_part(const torch::Tensor& w, const std::optional<torch::Tensor>& b, at::ScalarType dtype, int64_t K,
                   int64_t start) {
  const char* name = dtype == at::kFloat ? "float32" : "bfloat16";
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == dtype && w.dim() == 2 && w.is_contiguous(),
              "each weight must be a contiguous 2-D ", name, " CPU tensor (N, K), as x is");
  TORCH_CHECK(w.size(1) == K, "every weight must have K = ", K, " columns, got ", w.size(1));
  if (b) {
    TORCH_CHECK(b->scalar_type() == dtype && b->dim() == 1 && b->size(0) == w.size(0) && b->is_contiguous(),
                "a bias must be a contiguous ", name, " vector of the weight's N (", w.size(0), ")");
  }
  return Part<T>{reinterpret_cast<const T*>(w.data_ptr()), b ? reinterpret_cast<const T*>(b->data_ptr()) : nullptr,
                 start, w.size(0)};
}

template <typename T>
std::vector<Part<T>> parts_of(const std::vector<torch::Tensor>& weights,
                              const std::vector<std::optional<torch::Tensor>>& biases, at::ScalarType dtype, int64_t K,
                              int64_t& N) {
  std::vector<Part<T>> parts;
  N = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    parts.push_back(check_part<T>(weights[i], biases[i], dtype, K, N));
    N += weights[i].size(0);
  }
  return parts;
}

torch::Tensor float_products(const torch::Tensor& x, const std::vector<torch::Tensor>& weights,
                             const std::vector<std::optional<torch::Tensor>>& biases) {
  const int64_t K = weights[0].size(-1);
  const torch::Tensor rows = check_input(x, K, kMaxFloatRows);
  int64_t N = 0;
  const auto parts = parts_of<float>(weights, biases, at::kFloat, K, N);
  torch::Tensor y = torch::empty({rows.size(0), N}, x.options());
  const float* xp = rows.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    float_products_span(xp, rows.size(0), parts, yp, K, N, n0, n1);
  });
  return y;
}

#if defined(__AVX512BF16__)
torch::Tensor bf16_products(const torch::Tensor& x, const std::vector<torch::Tensor>& weights,
                            const std::vector<std::optional<torch::Tensor>>& biases) {
  const int64_t K = weights[0].size(-1);
  const torch::Tensor rows = check_input(x, K);
  int64_t N = 0;
  const auto parts = parts_of<uint16_t>(weights, biases, at::kBFloat16, K, N);
  torch::Tensor y = torch::empty({rows.size(0), N}, x.options());
  const uint16_t* xp = data(rows);
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  by_rows(rows.size(0), [&](auto r) {
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { products_span<decltype(r)::value>(xp, parts, yp, K, N, n0, n1); });
  });
  return y;
}
#endif

torch::Tensor products(const torch::Tensor& x, const std::vector<torch::Tensor>& weights,
                       const std::vector<std::optional<torch::Tensor>>& biases) {
  check_dtype(x);
  TORCH_CHECK(!weights.empty() && weights.size() == biases.size(), "one bias (or None) per weight");
  if (x.scalar_type() == at::kFloat) return float_products(x, weights, biases);
#if defined(__AVX512BF16__)
  return bf16_products(x, weights, biases);
#else
  TORCH_CHECK(false, "unreachable: check_dtype refuses bfloat16 in this build");
#endif
}

void check_bf16(const torch::Tensor& x, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16, what, " takes bfloat16 CPU tensors only");
  check_dtype(x);
}

torch::Tensor swiglu(const torch::Tensor& x, const torch::Tensor& gate_w, const std::optional<torch::Tensor>& gate_b,
                     const torch::Tensor& up_w, const std::optional<torch::Tensor>& up_b) {
  check_bf16(x, "swiglu");
  const int64_t K = gate_w.size(-1), I = gate_w.size(0);
  TORCH_CHECK(up_w.sizes() == gate_w.sizes(), "the gate and up weights must have one shape (I, K)");
  const torch::Tensor rows = check_input(x, K);
  const auto gate = check_part<uint16_t>(gate_w, gate_b, at::kBFloat16, K, 0);
  const auto up = check_part<uint16_t>(up_w, up_b, at::kBFloat16, K, 0);
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
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16, "x must be a bfloat16 CPU tensor");
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
  m.def("products", &products, "x (R,K) times each weight (N_i,K), plus its bias -> (R, sum N_i), bfloat16 (R <= 4) or float32 (R <= 64)",
        py::arg("x"), py::arg("weights"), py::arg("biases"));
  m.def("swiglu", &swiglu, "silu(x w_gate^T + b_gate) * (x w_up^T + b_up) -> (R, I), bfloat16, R <= 4",
        py::arg("x"), py::arg("gate_w"), py::arg("gate_b"), py::arg("up_w"), py::arg("up_b"));
  m.def("rms_norm", &rms_norm, "RMSNorm of x (R,D) with weight (D) -> (R,D), bfloat16, R <= 4",
        py::arg("x"), py::arg("weight"), py::arg("eps"));
  m.def("add_rms_norm", &add_rms_norm, "(residual + x, RMSNorm(residual + x)), each (R,D), bfloat16, R <= 4",
        py::arg("residual"), py::arg("x"), py::arg("weight"), py::arg("eps"));
  m.attr("max_rows") = kMaxRows;
  m.attr("max_float_rows") = kMaxFloatRows;
}
