// The multiply-add ceiling probe of benchmarks/machine_speed.py (--ceiling): per thread, twelve
// accumulators (machine_speed.CHAINS) each updated by a fused multiply-add per iteration; the
// empty asm statement keeps them in registers and stops the compiler from folding the chains
// together (they start from different values), so every iteration issues twelve vector FMAs and
// nothing else. Built with the flags of this CPU's kernel variant
// (fastprefill.kernels.compile_source): AVX-512 or AVX2.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <chrono>
#include <mutex>
#include <set>
#include <thread>
#include <tuple>
#include <vector>
#if defined(__AVX512F__)
using V = __m512;
static inline V set1(float x) { return _mm512_set1_ps(x); }
static inline V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
static inline float total(V v) { return _mm512_reduce_add_ps(v); }
constexpr int64_t kLanes = 16;
#else
using V = __m256;
static inline V set1(float x) { return _mm256_set1_ps(x); }
static inline V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
static inline float total(V v) { alignas(32) float o[8]; _mm256_store_ps(o, v); float s = 0; for (float x : o) s += x; return s; }
constexpr int64_t kLanes = 8;
#endif

static float chains(int64_t iters) {
  V m = set1(0.999f), a = set1(1e-3f);
  V c0 = set1(0), c1 = set1(1), c2 = set1(2), c3 = set1(3), c4 = set1(4), c5 = set1(5),
    c6 = set1(6), c7 = set1(7), c8 = set1(8), c9 = set1(9), c10 = set1(10), c11 = set1(11);
  for (int64_t i = 0; i < iters; ++i) {
    c0 = fma(c0, m, a); c1 = fma(c1, m, a); c2 = fma(c2, m, a); c3 = fma(c3, m, a);
    c4 = fma(c4, m, a); c5 = fma(c5, m, a); c6 = fma(c6, m, a); c7 = fma(c7, m, a);
    c8 = fma(c8, m, a); c9 = fma(c9, m, a); c10 = fma(c10, m, a); c11 = fma(c11, m, a);
    __asm__ volatile("" : "+v"(c0), "+v"(c1), "+v"(c2), "+v"(c3), "+v"(c4), "+v"(c5),
                          "+v"(c6), "+v"(c7), "+v"(c8), "+v"(c9), "+v"(c10), "+v"(c11));
  }
  return total(c0) + total(c1) + total(c2) + total(c3) + total(c4) + total(c5) +
         total(c6) + total(c7) + total(c8) + total(c9) + total(c10) + total(c11);
}

// `threads` tasks of `iters` iterations each on ATen's parallel_for: (seconds, the number of
// distinct threads that ran them).
std::tuple<double, int64_t> run(int64_t iters, int64_t threads) {
  std::vector<float> sink(threads);
  std::set<std::thread::id> ran;
  std::mutex lock;
  auto t0 = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t lo, int64_t hi) {
    { std::lock_guard<std::mutex> g(lock); ran.insert(std::this_thread::get_id()); }
    for (int64_t t = lo; t < hi; ++t) sink[t] = chains(iters);
  });
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  volatile float keep = 0; for (float x : sink) keep = keep + x;
  return {s, int64_t(ran.size())};
}
int64_t lanes() { return kLanes; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("run", &run, "(seconds, threads used) of `threads` tasks of `iters` iterations each",
        py::arg("iters"), py::arg("threads"));
  m.def("lanes", &lanes, "float32 lanes per vector");
}
