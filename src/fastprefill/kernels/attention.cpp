// Causal attention on the CPU for fastprefill: one kernel for a whole prefill, a suffix over
// cached keys (a prefix-cache hit, a chunk of a chunked or paused prefill) and a decode step.
//
// Query row t of T sits at position P + t, P = N - T, and attends keys 0 .. P + t of N (the
// lower-right causal mask; T = N is a whole prefill, T = 1 a decode step). Given a boolean mask
// (B, 1, T, N) shared by the heads (LazyLLM's rows over a prefix or beside filled rows, a decode
// step over a pruned cache, a padded batch), row t attends exactly the keys its mask row allows
// instead, and a row it hides entirely gets zeros. For each batch row,
// KV head and block of query rows, the G query heads that share the KV head are stacked into one
// block of G * QB rows, so every key and value block is read once per group rather than once per
// head; each block's two products run on oneDNN's batch-reduce GEMM micro-kernels through
// at::native::cpublas::brgemm (bfloat16 dot products in VNNI layout where the CPU has them,
// float32 FMA otherwise), with an online softmax in float32 between them (flash attention).
// The keys are transposed for the first product (and bfloat16 values paired for the second; float32
// values are read in place): once per head up front where several row blocks share them (a
// prefill), block by block as the one task of a head reaches them otherwise (a decode step, a
// short suffix), so such a call reads the cache once instead of reading, writing and reading it.
//
// Shapes: q (B, H_q, T, d), k and v (B, H_kv, N, d), any strides with a unit last stride;
// H_q a multiple of H_kv; d even. Output (B, T, H_q, d), contiguous (the layout transformers'
// attention functions return). float32 and bfloat16; q, k, v of one dtype.
//
// This file is compiled twice by fastprefill.kernels (AVX-512 and AVX2 flags, so the softmax's and the packing's
// vector code matches the CPU), and the build matching the CPU is loaded at run time.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/cpu/vec/functional.h>

#include <algorithm>
#include <optional>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Keys per block, and the stacked query rows (G * QB) a block aims for (the defaults; a caller
// may pass others to tune).
constexpr int64_t kKeyBlockDefault = 256;
constexpr int64_t kRowTargetDefault = 384;

template <typename T> constexpr bool kVnni = std::is_same_v<T, at::BFloat16>;

// max without NaN propagation (at::vec::maximum spends two more instructions on it): a NaN score
// still reaches the output through exp.
inline Vec fast_max(const Vec& a, const Vec& b) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_max_ps(a, b));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec(_mm256_max_ps(a, b));
#else
  return at::vec::maximum(a, b);
#endif
}

// Store 2 * Vec::size() floats (the first `count` of them) as T: one AVX512-BF16 instruction for
// bfloat16 where the build has it (rounding to nearest even, as c10's conversion), else ATen's.
template <typename T>
inline void store_pair(const Vec& e0, const Vec& e1, T* out, int64_t count) {
  if constexpr (kVnni<T>) {
#if defined(__AVX512BF16__)
    const __m512i packed = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(e1, e0));
    if (count == 2 * Vec::size()) {
      _mm512_storeu_si512(out, packed);
    } else {
      _mm512_mask_storeu_epi16(out, (__mmask32)((uint64_t(1) << count) - 1), packed);
    }
#else
    at::vec::convert_from_float<T>(e0, e1).store(out, count);
#endif
  } else {
    if (count >= Vec::size()) {
      e0.store(out);
      e1.store(out + Vec::size(), count - Vec::size());
    } else {
      e0.store(out, count);
    }
  }
}

// The first byte of row r of a matrix whose rows are `stride` elements of T apart.
template <typename T>
inline const char* row_bytes(const T* base, int64_t stride, int64_t r) {
  return reinterpret_cast<const char*>(base + r * stride);
}

#if defined(CPU_CAPABILITY_AVX512)
// Transpose a 16 x 16 tile of 32-bit words in registers: r[i] holds row i, afterwards column i.
inline void transpose_16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {  // pairs of rows, word by word within each 128-bit lane
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // quads of rows: lane L of r[i + k] is column 4L + k of rows i .. i + 3
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int k = 0; k < 4; ++k) {  // gather lane L of the four quads: column 4L + k
    const __m512i v0 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x44);
    const __m512i v1 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x44);
    const __m512i v3 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xEE);
    t[k] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    t[4 + k] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    t[8 + k] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    t[12 + k] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}
#endif

#if defined(CPU_CAPABILITY_AVX2)
// Transpose an 8 x 8 tile of 32-bit words in registers: r[i] holds row i, afterwards column i.
inline void transpose_8x8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {  // pairs of rows, word by word within each 128-bit lane
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {  // quads of rows: lane L of u[i + k] is column 4L + k of rows i .. i + 3
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int k = 0; k < 4; ++k) {  // the low lanes of both quads: column k; the high lanes: column 4 + k
    r[k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x20);
    r[4 + k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x31);
  }
}
#endif

// Transpose `rows` rows of `words` 32-bit words (row r at src + r * stride elements of T) into
// out[word][row], `ld` words apart: 16 x 16 tiles in registers where the build has AVX-512,
// 8 x 8 tiles where it has AVX2, word by word for the rest.
template <typename T>
void transpose_words(const T* src, int64_t stride, int64_t rows, int64_t words, uint32_t* out, int64_t ld) {
  int64_t rt = 0, wt = 0;  // the rows and words the register tiles cover
#if defined(CPU_CAPABILITY_AVX512)
  rt = rows & ~int64_t(15);
  wt = words & ~int64_t(15);
  __m512i tile[16];
  for (int64_t r0 = 0; r0 < rt; r0 += 16)
    for (int64_t p0 = 0; p0 < wt; p0 += 16) {
      for (int i = 0; i < 16; ++i) tile[i] = _mm512_loadu_si512(row_bytes(src, stride, r0 + i) + 4 * p0);
      transpose_16x16(tile);
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(out + (p0 + i) * ld + r0, tile[i]);
    }
#elif defined(CPU_CAPABILITY_AVX2)
  rt = rows & ~int64_t(7);
  wt = words & ~int64_t(7);
  __m256 tile[8];
  for (int64_t r0 = 0; r0 < rt; r0 += 8)
    for (int64_t p0 = 0; p0 < wt; p0 += 8) {
      for (int i = 0; i < 8; ++i)
        tile[i] = _mm256_loadu_ps(reinterpret_cast<const float*>(row_bytes(src, stride, r0 + i) + 4 * p0));
      transpose_8x8(tile);
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(reinterpret_cast<float*>(out + (p0 + i) * ld + r0), tile[i]);
    }
#endif
  for (int64_t r = 0; r < rows; ++r) {
    const char* row = row_bytes(src, stride, r);
    for (int64_t p = r < rt ? wt : 0; p < words; ++p) std::memcpy(out + p * ld + r, row + 4 * p, 4);
  }
}

// Two rows of d bfloat16 interleaved element by element (VNNI pairs): out[2e] = a[e],
// out[2e + 1] = b[e]; b null: zeros.
inline void interleave_rows(const at::BFloat16* a, const at::BFloat16* b, int64_t d, at::BFloat16* out) {
  int64_t e = 0;
#if defined(CPU_CAPABILITY_AVX512)
  alignas(64) static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                  8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t hi_idx[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                  24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  for (; e + 32 <= d; e += 32) {
    const __m512i va = _mm512_loadu_si512(a + e);
    const __m512i vb = b ? _mm512_loadu_si512(b + e) : _mm512_setzero_si512();
    _mm512_storeu_si512(out + 2 * e, _mm512_permutex2var_epi16(va, lo, vb));
    _mm512_storeu_si512(out + 2 * e + 32, _mm512_permutex2var_epi16(va, hi, vb));
  }
#endif
  for (; e < d; ++e) {
    out[2 * e] = a[e];
    out[2 * e + 1] = b ? b[e] : at::BFloat16(0);
  }
}

// The width of a packed key block of w keys: even in bfloat16 (VNNI pairs of keys), w in float32.
template <typename T>
constexpr int64_t packed_width(int64_t w) { return kVnni<T> ? (w + 1) & ~int64_t(1) : w; }

// Pack one block of w keys (and in bfloat16 its values) for the two products:
//   keys as B of S = Q K^T (d x wp): bfloat16 VNNI [d/2][wp][2], float32 [d][wp] (both a transpose
//   of 32-bit words: element pairs or elements);
//   bfloat16 values as B of O += P V (wp x d): VNNI [wp/2][d][2] (rows interleaved two by two).
//   float32 values are read where they are (row stride vs): nothing to pack.
// wp = packed_width(w); a bfloat16 block's odd last key is zeros (and masked: beyond every row).
template <typename T>
void pack_block(const T* k, const T* v, int64_t ks, int64_t vs, int64_t w, int64_t d, T* kb, T* vb) {
  const int64_t words = kVnni<T> ? d / 2 : d;
  const int64_t wp = packed_width<T>(w);
  uint32_t* k32 = reinterpret_cast<uint32_t*>(kb);
  transpose_words(k, ks, w, words, k32, wp);
  if constexpr (kVnni<T>) {
    if (wp > w)
      for (int64_t p = 0; p < words; ++p) k32[p * wp + w] = 0;
    for (int64_t c = 0; c < wp; c += 2) interleave_rows(v + c * vs, c + 1 < w ? v + (c + 1) * vs : nullptr, d, vb + c * d);
  }
}

// Pack one KV head's keys (and bfloat16 values) block by block, each block at j0 * d of kp (vp):
// for a query block task that several tasks of the head share (a prefill's row blocks). A head
// whose rows are one task (a decode step, a short suffix) packs each block as it reaches it instead
// (block()), so the cache is read once, not read, written and read again.
template <typename T>
void pack_head(const T* k, const T* v, int64_t ks, int64_t vs, int64_t n, int64_t d,
               T* kp, T* vp, int64_t key_block) {
  for (int64_t j0 = 0; j0 < n; j0 += key_block)
    pack_block<T>(k + j0 * ks, v + j0 * vs, ks, vs, std::min(key_block, n - j0), d, kp + j0 * d,
                  vp ? vp + j0 * d : nullptr);
}

// Where one head's keys and values come from: packed whole by pack_head (kp, vp non-null), or
// packed block by block into a task's buffers (kraw, vraw with their row strides). float32 values
// are always read in place (vraw).
template <typename T>
struct HeadKV {
  const T* kp;
  const T* vp;
  const T* kraw;
  const T* vraw;
  int64_t ks, vs;
};

// A task's working buffers, reused across its blocks.
template <typename T>
struct Scratch {
  std::vector<T> qbuf;       // the stacked query rows (G * QB, d)
  std::vector<float> s;      // scores of one key block (G * QB, wp)
  std::vector<T> pb;         // their probabilities, the second product's input
  std::vector<float> o, mx, sum, madd;  // output accumulators, running max and sum, a mask row's additive form
  std::vector<T> kbuf, vbuf;  // one key block (and bfloat16 value block) packed, where the head is not packed whole
};

// One stacked block: rows (g, t) for g < G, t in [t0, t1); key blocks up to the causal limit.
template <typename T>
void block(const T* q, int64_t qs_h, int64_t qs_t, const HeadKV<T>& kv,
           T* out, int64_t os_t, int64_t os_h,
           int64_t h0, int64_t g, int64_t t0, int64_t t1, int64_t p, int64_t n, int64_t d,
           float scale, int64_t key_block, const bool* mask, int64_t ms_t, Scratch<T>& sc) {
  alignas(64) float tail[2 * Vec::size()];
  const int64_t qb = t1 - t0;
  const int64_t m = g * qb;
  auto& [qbuf, s, pb, o, mx, sum, madd, kbuf, vbuf] = sc;
  qbuf.resize(m * d);
  s.resize(m * key_block + 2 * Vec::size());  // the softmax reads whole vector pairs past a row's end
  pb.resize(m * key_block);
  o.assign(m * d, 0.f);
  mx.assign(m, kNegInf);
  sum.assign(m, 0.f);
  if (!kv.kp) kbuf.resize(key_block * d);
  if (!kv.kp && kVnni<T>) vbuf.resize(key_block * d);
  for (int64_t j = 0; j < g; ++j)
    for (int64_t t = 0; t < qb; ++t)
      std::copy_n(q + (h0 + j) * qs_h + (t0 + t) * qs_t, d, qbuf.data() + (j * qb + t) * d);
  // keys the block's last row sees (with a mask: every key; the mask says which count)
  const int64_t last = mask ? n : std::min(n, p + t1);
  if (mask) madd.resize(key_block + 2 * Vec::size());
  const int64_t vec = Vec::size();
  for (int64_t j0 = 0; j0 < last; j0 += key_block) {
    const int64_t w = std::min(key_block, n - j0);
    const int64_t wp = packed_width<T>(w);  // the packed block's width
    // The columns computed: up to the last key any row of the block sees, rounded up to 32 (so that
    // few distinct micro-kernel shapes are made) and never past the packed block.
    const int64_t wc = std::min(wp, (std::min(key_block, last - j0) + 31) & ~int64_t(31));
    const T* kblk = kv.kp ? kv.kp + j0 * d : kbuf.data();
    if (!kv.kp) pack_block<T>(kv.kraw + j0 * kv.ks, kv.vraw + j0 * kv.vs, kv.ks, kv.vs, w, d, kbuf.data(), vbuf.data());
    // values: bfloat16 packed (VNNI, rows d apart), float32 in place (rows vs apart)
    const T* vblk = kVnni<T> ? (kv.kp ? kv.vp + j0 * d : vbuf.data()) : kv.vraw + j0 * kv.vs;
    const int64_t ldv = kVnni<T> ? d : kv.vs;
    at::native::cpublas::brgemm(m, wc, d, d, wp, wp, false, qbuf.data(), kblk, s.data(), kVnni<T>);
    for (int64_t r = 0; r < m; ++r) {
      float* sr = s.data() + r * wp;
      T* pr = pb.data() + r * wp;
      // keys [0, lim) are computed; with a mask, those it hides get -inf added (their p is 0)
      // (the real keys only: a packed block's last column may be padding)
      const int64_t lim = mask ? std::min(wc, n - j0) : std::max<int64_t>(0, std::min(wc, p + t0 + (r % qb) - j0 + 1));
      if (mask) {
        const bool* mrow = mask + (t0 + r % qb) * ms_t + j0;
        float* ma = madd.data();
        for (int64_t c2 = 0; c2 < lim; ++c2) ma[c2] = mrow[c2] ? 0.f : kNegInf;
        for (int64_t c2 = 0; c2 < lim; c2 += vec) {  // never past the row: the next row follows it
          const int64_t k2 = std::min(vec, lim - c2);
          (Vec::loadu(sr + c2, k2) + Vec::loadu(ma + c2, k2)).store(sr + c2, k2);
        }
      }
      float bmax = kNegInf;
      int64_t c = 0;
      {
        Vec vmax(kNegInf);
        for (; c + vec <= lim; c += vec) vmax = fast_max(vmax, Vec::loadu(sr + c));
        bmax = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return fast_max(a, b); }, vmax);
        for (; c < lim; ++c) bmax = std::max(bmax, sr[c]);
      }
      const float mnew = std::max(mx[r], lim > 0 ? bmax * scale : kNegInf);
      if (mnew == kNegInf) {  // nothing allowed yet in this row (cannot happen past key 0)
        std::fill_n(pr, wc, T(0));
        continue;
      }
      // p = exp(s * scale - mnew), summed and written to the second product's input in one pass;
      // the last partial pair of vectors goes through `tail`, its lanes past `lim` zeroed.
      const Vec vs(scale), vm(mnew);
      Vec acc0(0.f), acc1(0.f);  // two sums: one add chain per vector of the pair
      for (c = 0; c < lim; c += 2 * vec) {
        Vec e0 = at::vec::fmsub(Vec::loadu(sr + c), vs, vm).exp_u20();
        Vec e1 = at::vec::fmsub(Vec::loadu(sr + c + vec), vs, vm).exp_u20();
        const int64_t rest = lim - c;
        if (rest < 2 * vec) {
          e0.store(tail);
          e1.store(tail + vec);
          std::fill(tail + rest, tail + 2 * vec, 0.f);
          e0 = Vec::loadu(tail);
          e1 = Vec::loadu(tail + vec);
        }
        acc0 = acc0 + e0;
        acc1 = acc1 + e1;
        store_pair(e0, e1, pr + c, std::min<int64_t>(rest, 2 * vec));
      }
      Vec acc = acc0 + acc1;
      const float bsum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
      std::fill(pr + lim, pr + wc, T(0));
      const float alpha = std::exp(mx[r] - mnew);
      sum[r] = sum[r] * alpha + bsum;
      mx[r] = mnew;
      if (alpha != 1.f) {
        float* orow = o.data() + r * d;
        at::vec::map([alpha](Vec x) { return x * Vec(alpha); }, orow, orow, d);
      }
    }
    at::native::cpublas::brgemm(m, d, wc, wp, ldv, d, true, pb.data(), vblk, o.data(), kVnni<T>);
  }
  for (int64_t j = 0; j < g; ++j)
    for (int64_t t = 0; t < qb; ++t) {
      const int64_t r = j * qb + t;
      const float inv = sum[r] > 0.f ? 1.f / sum[r] : 0.f;  // a row its mask hides entirely: zeros
      float* orow = o.data() + r * d;
      at::vec::map([inv](Vec x) { return x * Vec(inv); }, orow, orow, d);
      at::vec::convert(orow, out + (t0 + t) * os_t + (h0 + j) * os_h, d);
    }
}

template <typename T>
at::Tensor run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
               int64_t key_block, int64_t row_target, const at::Tensor& mask) {
  const int64_t b = q.size(0), hq = q.size(1), t = q.size(2), d = q.size(3);
  const int64_t hkv = k.size(1), n = k.size(2);
  const int64_t g = hq / hkv, p = n - t;
  const int64_t npad = (n + 1) & ~int64_t(1);
  const int64_t qb = std::max<int64_t>(1, std::min(t, row_target / g));
  const int64_t nq = (t + qb - 1) / qb;
  // Heads packed whole when several row-block tasks share them; else each task packs as it goes.
  const bool whole = nq > 1;
  auto out = at::empty({b, t, hq, d}, q.options());
  at::Tensor packed_k, packed_v;
  if (whole) packed_k = at::empty({b, hkv, npad * d}, q.options());
  if (whole && kVnni<T>) packed_v = at::empty({b, hkv, npad * d}, q.options());
  const T* qd = q.data_ptr<T>();
  const T* kd = k.data_ptr<T>();
  const T* vd = v.data_ptr<T>();
  T* od = out.data_ptr<T>();
  T* kpd = whole ? packed_k.data_ptr<T>() : nullptr;
  T* vpd = whole && kVnni<T> ? packed_v.data_ptr<T>() : nullptr;
  const bool* md = mask.defined() ? mask.data_ptr<bool>() : nullptr;
  const int64_t ms_b = md && mask.size(0) > 1 ? mask.stride(0) : 0;
  const int64_t ms_t = md && mask.size(2) > 1 ? mask.stride(2) : 0;
  auto raw_k = [&](int64_t i) { return kd + (i / hkv) * k.stride(0) + (i % hkv) * k.stride(1); };
  auto raw_v = [&](int64_t i) { return vd + (i / hkv) * v.stride(0) + (i % hkv) * v.stride(1); };
  if (whole) {
    at::parallel_for(0, b * hkv, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i)
        pack_head<T>(raw_k(i), raw_v(i), k.stride(2), v.stride(2), n, d, kpd + i * npad * d,
                     vpd ? vpd + i * npad * d : nullptr, key_block);
    });
  }
  // Tasks ordered light, heavy, light, heavy... (q block 0, nq-1, 1, nq-2, ...) so that the
  // contiguous ranges parallel_for hands each thread carry about equal causal work.
  at::parallel_for(0, b * hkv * nq, 1, [&](int64_t lo, int64_t hi) {
    Scratch<T> scratch;
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t head = i / nq, k2 = i % nq;
      const int64_t blk = (k2 % 2 == 0) ? k2 / 2 : nq - 1 - k2 / 2;
      const int64_t bi = head / hkv, h = head % hkv;
      const int64_t t0 = blk * qb, t1 = std::min(t, t0 + qb);
      const HeadKV<T> kv{whole ? kpd + head * npad * d : nullptr, vpd ? vpd + head * npad * d : nullptr,
                         raw_k(head), raw_v(head), k.stride(2), v.stride(2)};
      block<T>(qd + bi * q.stride(0), q.stride(1), q.stride(2), kv,
               od + bi * t * hq * d, hq * d, d, h * g, g, t0, t1, p, n, d, static_cast<float>(scale),
               key_block, md ? md + bi * ms_b : nullptr, ms_t, scratch);
    }
    at::native::cpublas::brgemm_release(kVnni<T>);
  });
  return out;
}

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                            int64_t key_block, int64_t row_target, const std::optional<at::Tensor>& mask_arg) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v must be 4-D (B, H, T, d)");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), "q, k, v of one dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
  TORCH_CHECK(k.sizes() == v.sizes(), "k and v must have one shape");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(3) == k.size(3), "q and k differ in batch or head size");
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "H_q must be a multiple of H_kv");
  at::Tensor mask;
  if (mask_arg.has_value() && mask_arg->defined()) {
    mask = *mask_arg;
    TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 4 && mask.device().is_cpu(),
                "mask must be a boolean CPU tensor (B, 1, T, N)");
    TORCH_CHECK((mask.size(0) == q.size(0) || mask.size(0) == 1) && mask.size(1) == 1 &&
                (mask.size(2) == q.size(2) || mask.size(2) == 1) && mask.size(3) == k.size(2),
                "mask must be (B, 1, T, N) (B and T may be 1: broadcast), one mask for every head");
    if (mask.stride(3) != 1) mask = mask.contiguous();
  } else {
    TORCH_CHECK(q.size(2) <= k.size(2), "more queries than keys");
  }
  TORCH_CHECK(q.size(3) % 2 == 0, "head size must be even");
  TORCH_CHECK(scale > 0, "scale must be positive");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "unit stride on the head dimension");
  TORCH_CHECK(key_block >= 16 && key_block % 16 == 0 && row_target >= 1, "key_block a multiple of 16, row_target >= 1");
  if (q.scalar_type() == at::kBFloat16) return run<at::BFloat16>(q, k, v, scale, key_block, row_target, mask);
  return run<float>(q, k, v, scale, key_block, row_target, mask);
}

// Rotary position embedding as transformers' eager apply_rotary_pos_emb computes it, in one pass:
// out = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1) over the halves of each head,
// every product and the sum rounded to the dtype as eager's separate operations round them (the
// result is bit for bit eager's), written head-major for the cache and attention.
//   x (B, T, H * d), unit last stride (a column slice of a merged product is fine); cos, sin
//   (B or 1, T, d) of x's dtype. Returns (B, H, T, d), contiguous.
template <typename T>
inline float round_to(float v) { return static_cast<float>(static_cast<T>(v)); }

template <typename T>
void rotary_row(const T* x, const T* c, const T* sn, T* out, int64_t d) {
  const int64_t half = d / 2;
  using bVec = at::vec::Vectorized<T>;
  int64_t i = 0;
  if constexpr (kVnni<T>) {
    const int64_t bv = bVec::size();  // 32 bfloat16
    for (; i + bv <= half; i += bv) {
      auto [x1a, x1b] = at::vec::convert_to_float<T>(bVec::loadu(x + i));
      auto [x2a, x2b] = at::vec::convert_to_float<T>(bVec::loadu(x + half + i));
      auto [c1a, c1b] = at::vec::convert_to_float<T>(bVec::loadu(c + i));
      auto [c2a, c2b] = at::vec::convert_to_float<T>(bVec::loadu(c + half + i));
      auto [s1a, s1b] = at::vec::convert_to_float<T>(bVec::loadu(sn + i));
      auto [s2a, s2b] = at::vec::convert_to_float<T>(bVec::loadu(sn + half + i));
      auto rnd = [](const Vec& a, const Vec& b) { return at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(a, b)); };
      auto [p1a, p1b] = rnd(x1a * c1a, x1b * c1b);                   // x1 * cos1
      auto [r1a, r1b] = rnd(Vec(0.f) - x2a * s1a, Vec(0.f) - x2b * s1b);  // (-x2) * sin1
      auto [p2a, p2b] = rnd(x2a * c2a, x2b * c2b);                   // x2 * cos2
      auto [r2a, r2b] = rnd(x1a * s2a, x1b * s2b);                   // x1 * sin2
      at::vec::convert_from_float<T>(p1a + r1a, p1b + r1b).store(out + i);
      at::vec::convert_from_float<T>(p2a + r2a, p2b + r2b).store(out + half + i);
    }
  } else {
    const int64_t fv = Vec::size();
    for (; i + fv <= half; i += fv) {
      const Vec x1 = Vec::loadu(x + i), x2 = Vec::loadu(x + half + i);
      const Vec p1 = x1 * Vec::loadu(c + i), r1 = (Vec(0.f) - x2) * Vec::loadu(sn + i);
      const Vec p2 = x2 * Vec::loadu(c + half + i), r2 = x1 * Vec::loadu(sn + half + i);
      (p1 + r1).store(out + i);
      (p2 + r2).store(out + half + i);
    }
  }
  for (; i < half; ++i) {
    const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[half + i]);
    out[i] = static_cast<T>(round_to<T>(x1 * static_cast<float>(c[i])) + round_to<T>(-x2 * static_cast<float>(sn[i])));
    out[half + i] = static_cast<T>(round_to<T>(x2 * static_cast<float>(c[half + i])) +
                                   round_to<T>(x1 * static_cast<float>(sn[half + i])));
  }
}

template <typename T>
at::Tensor rotary_impl(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads) {
  const int64_t b = x.size(0), t = x.size(1), d = x.size(2) / heads;
  auto out = at::empty({b, heads, t, d}, x.options());
  const T* xd = x.data_ptr<T>();
  const T* cd = cos.data_ptr<T>();
  const T* sd = sin.data_ptr<T>();
  T* od = out.data_ptr<T>();
  const int64_t xs_b = x.stride(0), xs_t = x.stride(1);
  const int64_t cs_b = cos.size(0) > 1 ? cos.stride(0) : 0, cs_t = cos.stride(1);
  const int64_t ss_b = sin.size(0) > 1 ? sin.stride(0) : 0, ss_t = sin.stride(1);
  at::parallel_for(0, b * t, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t bi = i / t, ti = i % t;
      const T* xr = xd + bi * xs_b + ti * xs_t;
      const T* cr = cd + bi * cs_b + ti * cs_t;
      const T* sr = sd + bi * ss_b + ti * ss_t;
      for (int64_t h = 0; h < heads; ++h)
        rotary_row<T>(xr + h * d, cr, sr, od + ((bi * heads + h) * t + ti) * d, d);
    }
  });
  return out;
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads) {
  TORCH_CHECK(x.dim() == 3 && cos.dim() == 3 && sin.dim() == 3, "x (B, T, H*d), cos and sin (B, T, d)");
  TORCH_CHECK(x.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.scalar_type() == cos.scalar_type() && x.scalar_type() == sin.scalar_type(), "x, cos, sin of one dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
  TORCH_CHECK(heads > 0 && x.size(2) % heads == 0 && (x.size(2) / heads) % 2 == 0, "H*d must split into heads of even size");
  const int64_t d = x.size(2) / heads;
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(2) == d && cos.size(1) == x.size(1) &&
              (cos.size(0) == x.size(0) || cos.size(0) == 1), "cos and sin must be (B or 1, T, d)");
  TORCH_CHECK(x.stride(2) == 1 && cos.stride(2) == 1 && sin.stride(2) == 1, "unit stride on the last dimension");
  if (x.scalar_type() == at::kBFloat16) return rotary_impl<at::BFloat16>(x, cos, sin, heads);
  return rotary_impl<float>(x, cos, sin, heads);
}

// How many threads ATen's parallel_for, as compiled into this extension, runs `tasks` one-task
// chunks on: torch's intra-op thread count when the build has OpenMP, 1 when the pragma was lost.
int64_t threads_used(int64_t tasks) {
  std::set<std::thread::id> ids;
  std::mutex lock;
  at::parallel_for(0, tasks, 1, [&](int64_t, int64_t) {
    std::lock_guard<std::mutex> guard(lock);
    ids.insert(std::this_thread::get_id());
  });
  return static_cast<int64_t>(ids.size());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("causal_attention", &causal_attention,
        "attention of q (B,H_q,T,d) over k/v (B,H_kv,N,d) -> (B,T,H_q,d): causal for the last T of N "
        "positions, or where a boolean mask (B,1,T,N) is True",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("scale"), py::arg("key_block") = kKeyBlockDefault,
        py::arg("row_target") = kRowTargetDefault, py::arg("mask") = py::none());
  m.def("rotary", &rotary, "x (B,T,H*d) rotated as transformers' eager rotary, bit for bit -> (B,H,T,d)",
        py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("heads"));
  m.def("threads_used", &threads_used, "threads parallel_for runs `tasks` one-task chunks on", py::arg("tasks"));
}
