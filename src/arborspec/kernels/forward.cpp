// The native backend's decoding step in C++: one call runs a whole Qwen2 / Llama forward over the rows of a step
// (tree nodes, pending prompt tokens, several requests' rows side by side), layer loop and tree attention included.
//
// Why: in Python each layer cost a dozen torch calls, and tree attention one scaled_dot_product_attention call per
// row and layer plus a mask scan per row: 3.8 ms per verified row and 4.3 ms per forward outside the kernels for the
// 1.5B target on a Zen 4 (docs/kernels.md). Here a forward is the kernels plus a few microseconds of arithmetic per
// row and layer.
//
// Exactness: every row is computed alone. The kernels are row-independent (gguf_mm.cpp), and attention gives each
// row exactly its visible keys in cache order - the committed prefix [0, prefix) and then its tree ancestors and
// itself - through one code path, so a tree row's logits are bit for bit those of the same token decoded alone after
// its path was committed (the cache then holds the same key vectors, in the same order, at [0, prefix + depth]).
//
// The KV cache is owned by the Python session (backends/native_step.py) as two float32 tensors per
// sequence, keys and values of shape (layers, kv_heads, capacity, head_dim), so each head's keys are contiguous
// for attention; a forward writes its rows' keys and values at [length, length + rows) of their sequence's cache.
// Python checks every index before the call; the checks here are a second line (an error, never a crash).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "gguf_mm.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ARB_STEP_AVX2 1
#endif

// The 16-lane attention code: where the build targets AVX-512, and in the emulated build (ARB_SIMDE: tests only, on
// any x86-64 CPU with AVX2; kernels/build.py), where SIMDe implements the AVX-512 intrinsics in portable code.
#if defined(ARB_SIMDE) && defined(ARB_STEP_AVX2)
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#define ARB_STEP_AVX512 1
#elif defined(__AVX512F__) && defined(ARB_STEP_AVX2)
#define ARB_STEP_AVX512 1
#endif

#ifndef ARB_OPS  // the torch namespace: the emulated build loads beside the native one, under another name
#define ARB_OPS arborspec_kernels
#endif

namespace {

// ---- exp, elementwise and the same for every element wherever it sits ------------------------------------------
// Why our own: std::exp costs ~5 ns a value, and SiLU alone takes 28 x 8960 of them per row of the 1.5B target
// (1.3 ms a row); ATen's vectorized exp handles a buffer's tail (and each thread's chunk's tail) with a different
// scalar formula, so a value's result would depend on where it sits, i.e. on which other rows share the forward.
// Here every value goes through the same lane code (a tail is padded), Cody-Waite reduction and a degree-6
// polynomial: within 2 ulp of expf over [-87, 88], 0 below, +inf above.

#ifdef ARB_STEP_AVX2
// 8 and 16 float lanes under one set of names, so that exp and SiLU are written once: each lane of either goes
// through the same IEEE operations, hence the same bits (16 lanes: where the build has AVX-512 and attention runs
// wide; at 4 rows of the 0.5B draft the 8-lane exp and SiLU loops took ~3% of a forward's CPU time, Zen 5).
struct Lanes8 {
  using V = __m256;
  static constexpr int n = 8;
  static V set(float a) { return _mm256_set1_ps(a); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V min(V a, V b) { return _mm256_min_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V fnmadd(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
  static V round(V a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V pow2(V n) {  // 2^n for whole n in [-126, 127]
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
};

#ifdef ARB_STEP_AVX512
struct Lanes16 {
  using V = __m512;
  static constexpr int n = 16;
  static V set(float a) { return _mm512_set1_ps(a); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V min(V a, V b) { return _mm512_min_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V fnmadd(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
  static V round(V a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // 2^n as Lanes8::pow2, its integer read from the bits of n + 1.5 * 2^23 (whose low bits are then n in two's
  // complement, the rest shifted out): SIMDe, which the emulated build uses, has no _mm512_cvtps_epi32
  static V pow2(V n) {
    const __m512i bits = _mm512_castps_si512(_mm512_add_ps(n, _mm512_set1_ps(12582912.f)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(127)), 23));
  }
};
#endif

template <class L>
inline typename L::V exp_lanes(typename L::V x) {
  // clamped, NaN kept: max_ps / min_ps return their second operand where either is NaN (a NaN attention score
  // came out as exp(-87.3), so a NaN key gave finite weights and finite garbage logits)
  x = L::min(L::set(88.7f), L::max(L::set(-87.3f), x));
  const typename L::V n = L::round(L::mul(x, L::set(1.44269504088896341f)));
  typename L::V r = L::fnmadd(n, L::set(0.693359375f), x);
  r = L::fnmadd(n, L::set(-2.12194440e-4f), r);
  typename L::V p = L::set(1.9875691500e-4f);
  p = L::fmadd(p, r, L::set(1.3981999507e-3f));
  p = L::fmadd(p, r, L::set(8.3334519073e-3f));
  p = L::fmadd(p, r, L::set(4.1665795894e-2f));
  p = L::fmadd(p, r, L::set(1.6666665459e-1f));
  p = L::fmadd(p, r, L::set(5.0000001201e-1f));
  p = L::fmadd(p, L::mul(r, r), L::add(r, L::set(1.f)));
  return L::mul(p, L::pow2(n));
}

// out[i] = f(x[i], y[i]) for i < count, L::n values at a time, a tail padded with zeros (y: a second input, or
// null for zeros; x and out may be the same)
template <class L, class F>
inline void each_lanes(const float* x, const float* y, float* out, int64_t count, F f) {
  int64_t i = 0;
  for (; i + L::n <= count; i += L::n) L::store(out + i, f(L::load(x + i), y ? L::load(y + i) : L::set(0.f)));
  if (i < count) {
    alignas(64) float tail[2][L::n] = {};
    std::copy(x + i, x + count, tail[0]);
    if (y) std::copy(y + i, y + count, tail[1]);
    L::store(tail[0], f(L::load(tail[0]), L::load(tail[1])));
    std::copy(tail[0], tail[0] + (count - i), out + i);
  }
}

template <class L>
void exp_shifted_lanes(const float* x, float shift, float* out, int64_t count) {
  const typename L::V s = L::set(shift);
  each_lanes<L>(x, nullptr, out, count, [&](typename L::V v, typename L::V) { return exp_lanes<L>(L::add(v, s)); });
}

// silu(g) * u = g / (1 + exp(-g + 0)) * u, the operations (and so the bits) of the scalar formula
template <class L>
void silu_mul_lanes(const float* gate, const float* up, float* out, int64_t count) {
  each_lanes<L>(gate, up, out, count, [](typename L::V g, typename L::V u) {
    const typename L::V e = exp_lanes<L>(L::add(L::mul(g, L::set(-1.f)), L::set(0.f)));
    return L::mul(L::div(g, L::add(L::set(1.f), e)), u);
  });
}

// out[i] = exp(x[i] + shift) for i < count (x and out may be the same), in 16 lanes where `wide`
void exp_shifted(bool wide, const float* x, float shift, float* out, int64_t count) {
#ifdef ARB_STEP_AVX512
  if (wide) return exp_shifted_lanes<Lanes16>(x, shift, out, count);
#endif
  (void)wide;
  exp_shifted_lanes<Lanes8>(x, shift, out, count);
}

// out[i] = silu(gate[i]) * up[i] for i < count, in 16 lanes where `wide`
void silu_mul_span(bool wide, const float* gate, const float* up, float* out, int64_t count) {
#ifdef ARB_STEP_AVX512
  if (wide) return silu_mul_lanes<Lanes16>(gate, up, out, count);
#endif
  (void)wide;
  silu_mul_lanes<Lanes8>(gate, up, out, count);
}

// the largest of x[0..count), NaNs skipped as std::max(top, x) skips them (max_ps(a, b) returns b where a is NaN);
// -inf where there is none. Why not std::max in a loop: its one chain of dependent vmaxss was ~25% of the layer loop's
// own time at n = 4 rows (0.5B draft, Zen 5, `perf annotate`).
float largest(const float* x, int64_t count) {
  __m256 a = _mm256_set1_ps(-INFINITY), b = a;
  int64_t i = 0;
  for (; i + 16 <= count; i += 16)
    a = _mm256_max_ps(_mm256_loadu_ps(x + i), a), b = _mm256_max_ps(_mm256_loadu_ps(x + i + 8), b);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(a, b));
  float top = -INFINITY;
  for (float v : lanes) top = std::max(top, v);
  for (; i < count; ++i) top = std::max(top, x[i]);
  return top;
}
#else
void exp_shifted(bool, const float* x, float shift, float* out, int64_t count) {
  for (int64_t i = 0; i < count; ++i) out[i] = std::exp(x[i] + shift);
}

void silu_mul_span(bool, const float* gate, const float* up, float* out, int64_t count) {
  for (int64_t i = 0; i < count; ++i) out[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
}

float largest(const float* x, int64_t count) {
  float top = -INFINITY;
  for (int64_t i = 0; i < count; ++i) top = std::max(top, x[i]);
  return top;
}
#endif

// Weight matrices applied to one input, their outputs side by side: q/k/v (one matrix where they share a block
// type), gate/up, or one matrix; a bias over all outputs, or none.
struct Product {
  std::vector<at::Tensor> data;
  std::vector<int64_t> layouts;
  int64_t k = 0;
  at::Tensor bias;  // (out,) float32, or undefined
  // for run(): matrix i's outputs are columns [columns[i], columns[i + 1]), its units [units[i], units[i + 1]),
  // its weights bytes[i]; which activation formats its matrices take (32-blocks, 256-blocks)
  std::vector<int64_t> columns{0}, units{0}, bytes;
  bool act32 = false, actk = false;

  // the checks quant_linear makes, and the tables above; after data, layouts, k and bias are set
  void prepare() {
    for (size_t i = 0; i < data.size(); ++i) {
      arborspec::check_weights(data[i], layouts[i], k);
      columns.push_back(columns.back() + arborspec::output_columns(data[i], layouts[i]));
      units.push_back(units.back() + arborspec::column_units(data[i], layouts[i]));
      bytes.push_back(data[i].numel());
      (arborspec::k_activations(layouts[i]) ? actk : act32) = true;
    }
    TORCH_CHECK(!bias.defined() || bias.numel() == width(), "bias of ", bias.numel(), " for ", width(), " outputs");
  }

  int64_t width() const { return columns.back(); }

  // the first unit of thread t's share of T: the units split at equal weight bytes, so each thread streams one
  // contiguous range of the weights (the hardware prefetcher's case; dynamically scheduled chunks of a product made
  // the 0.5B draft's forward 13-72% slower, Zen 4)
  int64_t split(int t, int T) const {
    int64_t total = 0;
    for (int64_t b : bytes) total += b;
    const int64_t target = total * t / T;
    int64_t before = 0;
    for (size_t i = 0; i < bytes.size(); ++i) {
      if (target < before + bytes[i]) {
        const int64_t count = units[i + 1] - units[i];
        return units[i] + ((target - before) * count + bytes[i] - 1) / bytes[i];
      }
      before += bytes[i];
    }
    return units.back();
  }

  // the columns of units [u0, u1) of y (m, width), from X quantized (act32_rows / actk_rows: its m rows in each
  // format the product takes), plus the bias; then added into `residual` (m, width) where given. Bias and residual
  // add to each value exactly as torch's add_ did (one float addition each).
  void run(int64_t u0, int64_t u1, const uint8_t* act32_rows, const uint8_t* actk_rows, int64_t m, float* y,
           float* residual) const {
    const int64_t ld = width();
    for (size_t i = 0; i < data.size(); ++i) {
      const int64_t a = std::max(u0, units[i]) - units[i], b = std::min(u1, units[i + 1]) - units[i];
      if (a >= b) continue;
      const bool kq = arborspec::k_activations(layouts[i]);
      arborspec::run_units(data[i], layouts[i], k, kq ? actk_rows : act32_rows, m, y + columns[i], ld, a, b);
      const int64_t c0 = columns[i] + a * arborspec::kUnitColumns;
      const int64_t c1 = std::min(columns[i + 1], columns[i] + b * arborspec::kUnitColumns);
      for (int64_t r = 0; r < m; ++r) {
        float* yr = y + r * ld;
        if (bias.defined()) {
          const float* pb = bias.data_ptr<float>();
          for (int64_t c = c0; c < c1; ++c) yr[c] += pb[c];
        }
        if (residual)
          for (int64_t c = c0; c < c1; ++c) residual[r * ld + c] += yr[c];
      }
    }
  }

  at::Tensor operator()(const at::Tensor& x) const {  // x (m, k) -> (m, out)
    at::Tensor y;
    if (data.size() == 1) {
      y = arborspec::quant_linear(data[0], layouts[0], k, x);
    } else {
      std::vector<at::Tensor> parts;
      for (size_t i = 0; i < data.size(); ++i) parts.push_back(arborspec::quant_linear(data[i], layouts[i], k, x));
      y = at::cat(parts, 1);
    }
    if (bias.defined()) y.add_(bias);
    return y;
  }
};

struct Layer {
  at::Tensor norm1, norm2;  // (hidden,)
  Product qkv, o, gate_up, down;
};

// 1 / sqrt(mean(x^2) + eps) over one row x (dim,)
float rms_inverse(const float* x, int64_t dim, double eps) {
  float lanes[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= dim; i += 16)
    for (int l = 0; l < 16; ++l) lanes[l] += x[i + l] * x[i + l];
  float sum = 0.f;
  for (int l = 0; l < 16; ++l) sum += lanes[l];
  for (; i < dim; ++i) sum += x[i] * x[i];
  return 1.f / std::sqrt(sum / (float)dim + (float)eps);
}

// y[j] = x[j] * inv * w[j] for j < count
void scale_span(const float* x, float inv, const float* w, float* y, int64_t count) {
  for (int64_t j = 0; j < count; ++j) y[j] = x[j] * inv * w[j];
}

// y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, for each row r of x (m, dim)
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  const int64_t m = x.size(0), dim = x.size(1);
  at::Tensor y = at::empty_like(x);
  const float *px = x.data_ptr<float>(), *pw = w.data_ptr<float>();
  float* py = y.data_ptr<float>();
  for (int64_t r = 0; r < m; ++r) scale_span(px + r * dim, rms_inverse(px + r * dim, dim, eps), pw, py + r * dim, dim);
  return y;
}

// Rotary embedding, halves layout (transformers' Qwen2 / Llama), in place on `heads` vectors of one row.
void rotate(float* v, int64_t heads, int64_t d, const float* cos, const float* sin) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* x = v + h * d;
    for (int64_t i = 0; i < half; ++i) {
      const float a = x[i], b = x[i + half];
      x[i] = a * cos[i] - b * sin[i];
      x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
  }
}

// ---- attention arithmetic: one (row, kv head) task's G query heads against its visible keys -------------------
// Each score is dot(q_h, k_j) * scale, the dot in two 8-lane accumulators (s0 over the even 8-float blocks of each
// 16, s1 over the odd ones, a last 8-float block into s0), summed as hsum8(s0 + s1); each output lane is the chain
// fma(p_j, v_j, .) over j in cache order, from 0. The code below computes several heads and keys at once (their
// accumulators in registers: a head's query is read once per key tile, a key once per head tile), which changes
// only the order in which independent chains advance, never a chain's own order: every score and output value is
// the same bit pattern however the tiles fall, so a row's attention does not depend on how many keys it sees or what
// else runs. The AVX-512 code keeps s0 and s1 as the two halves of one 16-lane register: the same bits again, so the
// 8- and 16-lane paths agree bit for bit (tests/backends/test_native_step.py runs both).
//
// Measured (1.5B target, Zen 4, 16 rows after a 200-token prefix, `perf record`): the first version, one dot at a
// time and a weighted sum whose accumulators the compiler kept on the stack, spent ~0.9 ms of CPU per row here.
#ifdef ARB_STEP_AVX2
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// out[i] = hsum8(t[i]) * scale for i < 8, eight at once through the same additions of the same pairs (hsum8 adds
// lanes i and i + 4, then i and i + 2, then 0 and 1): a third of the instructions of eight hsum8 calls
inline void hsum8x8(const __m256* t, float scale, float* out) {
  __m256 u[4];  // u[p] = [t[2p] lo + hi | t[2p + 1] lo + hi]
  for (int p = 0; p < 4; ++p)
    u[p] = _mm256_add_ps(_mm256_permute2f128_ps(t[2 * p], t[2 * p + 1], 0x20),
                         _mm256_permute2f128_ps(t[2 * p], t[2 * p + 1], 0x31));
  __m256 w[2];  // w[q] = [t[4q] lanes 0+2, 1+3, t[4q + 2] 0+2, 1+3 | the same for t[4q + 1], t[4q + 3]]
  for (int q = 0; q < 2; ++q)
    w[q] = _mm256_add_ps(_mm256_shuffle_ps(u[2 * q], u[2 * q + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(u[2 * q], u[2 * q + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));  // t 0, 2, 4, 6, 1, 3, 5, 7
  const __m256 ordered = _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_ps(out, _mm256_mul_ps(ordered, _mm256_set1_ps(scale)));
}

// s[h * stride + j] = hsum8(t[h NK + j]) * scale for the NH x NK dots of a tile
template <int NH, int NK>
inline void store_dots(const __m256* t, float scale, float* s, int64_t stride) {
  constexpr int N = NH * NK;
  for (int g = 0; g < N; g += 8) {
    __m256 group[8];
    for (int i = 0; i < 8; ++i) group[i] = g + i < N ? t[g + i] : _mm256_setzero_ps();
    alignas(32) float out[8];
    hsum8x8(group, scale, out);
    for (int i = 0; i < 8 && g + i < N; ++i) s[(g + i) / NK * stride + (g + i) % NK] = out[i];
  }
}

// s[h * stride + j] = dot(q + h d, k[j]) * scale, h < NH, j < NK
template <int NH, int NK>
inline void dots8(const float* q, const float* const* k, int64_t d, float scale, float* s, int64_t stride) {
  __m256 s0[NH][NK], s1[NH][NK];
  for (int h = 0; h < NH; ++h)
    for (int j = 0; j < NK; ++j) s0[h][j] = s1[h][j] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    __m256 k0[NK], k1[NK];
    for (int j = 0; j < NK; ++j) k0[j] = _mm256_loadu_ps(k[j] + i), k1[j] = _mm256_loadu_ps(k[j] + i + 8);
    for (int h = 0; h < NH; ++h) {
      const __m256 q0 = _mm256_loadu_ps(q + h * d + i), q1 = _mm256_loadu_ps(q + h * d + i + 8);
      for (int j = 0; j < NK; ++j) {
        s0[h][j] = _mm256_fmadd_ps(q0, k0[j], s0[h][j]);
        s1[h][j] = _mm256_fmadd_ps(q1, k1[j], s1[h][j]);
      }
    }
  }
  if (i < d)
    for (int h = 0; h < NH; ++h)
      for (int j = 0; j < NK; ++j)
        s0[h][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * d + i), _mm256_loadu_ps(k[j] + i), s0[h][j]);
  __m256 t[NH * NK];
  for (int h = 0; h < NH; ++h)
    for (int j = 0; j < NK; ++j) t[h * NK + j] = _mm256_add_ps(s0[h][j], s1[h][j]);
  store_dots<NH, NK>(t, scale, s, stride);
}

// o[h d + c] = (sum_j p[h * stride + j] v[j][c]) * inv[h] for c in [c0, c0 + 8 NC), h < NH
template <int NH, int NC>
inline void mix8(const float* p, int64_t stride, const float* const* v, int64_t count, int64_t c0, int64_t d,
                 const float* inv, float* o) {
  __m256 acc[NH][NC];
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < NC; ++c) acc[h][c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < count; ++j) {
    __m256 x[NC];
    for (int c = 0; c < NC; ++c) x[c] = _mm256_loadu_ps(v[j] + c0 + 8 * c);
    for (int h = 0; h < NH; ++h) {
      const __m256 pj = _mm256_broadcast_ss(p + h * stride + j);
      for (int c = 0; c < NC; ++c) acc[h][c] = _mm256_fmadd_ps(pj, x[c], acc[h][c]);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < NC; ++c)
      _mm256_storeu_ps(o + h * d + c0 + 8 * c, _mm256_mul_ps(acc[h][c], _mm256_set1_ps(inv[h])));
}
#endif

#ifdef ARB_STEP_AVX512
inline __m256 high8(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }

// the 128-bit quarters Q0..Q3 of (a, b) as one register: quarters 0-3 are a's, 4-7 b's
template <int Q0, int Q1, int Q2, int Q3>
inline __m512 quarters(__m512 a, __m512 b) {
  const __m512i idx = _mm512_setr_epi32(4 * Q0, 4 * Q0 + 1, 4 * Q0 + 2, 4 * Q0 + 3, 4 * Q1, 4 * Q1 + 1, 4 * Q1 + 2,
                                        4 * Q1 + 3, 4 * Q2, 4 * Q2 + 1, 4 * Q2 + 2, 4 * Q2 + 3, 4 * Q3, 4 * Q3 + 1,
                                        4 * Q3 + 2, 4 * Q3 + 3);
  return _mm512_permutex2var_ps(a, idx, b);
}

// s[h * stride + j] = hsum8(s0 + s1) * scale for the NH x NK (<= 16) accumulators acc[h NK + j] of a tile (lanes
// 0-7: s0, 8-15: s1), 16 at a time through the additions hsum8x8 makes, of the same pairs: (s0 + s1) of two
// accumulators side by side, lanes i + (i + 4), then i + (i + 2), then 0 + 1 in each 128-bit quarter. Why: with
// 64-wide heads a score is 4 FMAs, and summing each alone (an extract, an add, a third of hsum8x8, a scalar store)
// took more instructions than the FMAs.
template <int NH, int NK>
inline void store_dots16(const __m512* acc, float scale, float* s, int64_t stride) {
  constexpr int N = NH * NK;
  static_assert(N <= 16, "a tile of at most 16 scores");
  const __m512 zero = _mm512_setzero_ps();
  __m512 r[8];  // r[k] = [t_2k | t_2k+1], t = s0 + s1
  for (int k = 0; k < 8; ++k) {
    const __m512 a = 2 * k < N ? acc[2 * k] : zero, b = 2 * k + 1 < N ? acc[2 * k + 1] : zero;
    const __m512 s0 = quarters<0, 1, 4, 5>(a, b), s1 = quarters<2, 3, 6, 7>(a, b);  // (SIMDe's names are macros)
    r[k] = _mm512_add_ps(s0, s1);
  }
  __m512 u[4];  // quarter q of u[p]: t_4p+q's lanes i + (i + 4)
  for (int p = 0; p < 4; ++p) {
    const __m512 lo = quarters<0, 2, 4, 6>(r[2 * p], r[2 * p + 1]), hi = quarters<1, 3, 5, 7>(r[2 * p], r[2 * p + 1]);
    u[p] = _mm512_add_ps(lo, hi);
  }
  __m512 w[2];  // quarter q of w[x]: t_8x+q's and t_8x+4+q's lanes 0 + 2, 1 + 3
  for (int x = 0; x < 2; ++x)
    w[x] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * x], u[2 * x + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(u[2 * x], u[2 * x + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // element 4 q + m: the score of t_q+4m; reordered to t_0..t_15
  const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  alignas(64) float out[16];
  _mm512_store_ps(out, _mm512_mul_ps(_mm512_permutexvar_ps(order, z), _mm512_set1_ps(scale)));
  for (int h = 0; h < NH; ++h)
    for (int j = 0; j < NK; ++j) s[h * stride + j] = out[h * NK + j];
}

template <int NH, int NK>
inline void dots16(const float* q, const float* const* k, int64_t d, float scale, float* s, int64_t stride) {
  __m512 acc[NH][NK];  // lanes 0-7: s0, lanes 8-15: s1
  for (int h = 0; h < NH; ++h)
    for (int j = 0; j < NK; ++j) acc[h][j] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    __m512 kj[NK];
    for (int j = 0; j < NK; ++j) kj[j] = _mm512_loadu_ps(k[j] + i);
    for (int h = 0; h < NH; ++h) {
      const __m512 qh = _mm512_loadu_ps(q + h * d + i);
      for (int j = 0; j < NK; ++j) acc[h][j] = _mm512_fmadd_ps(qh, kj[j], acc[h][j]);
    }
  }
  if (i == d) return store_dots16<NH, NK>(&acc[0][0], scale, s, stride);
  __m256 t[NH * NK];
  for (int h = 0; h < NH; ++h)
    for (int j = 0; j < NK; ++j) {
      __m256 s0 = _mm512_castps512_ps256(acc[h][j]);
      if (i < d) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * d + i), _mm256_loadu_ps(k[j] + i), s0);
      t[h * NK + j] = _mm256_add_ps(s0, high8(acc[h][j]));
    }
  store_dots<NH, NK>(t, scale, s, stride);
}

template <int NH, int NC>
inline void mix16(const float* p, int64_t stride, const float* const* v, int64_t count, int64_t c0, int64_t d,
                  const float* inv, float* o) {
  __m512 acc[NH][NC];
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < NC; ++c) acc[h][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < count; ++j) {
    __m512 x[NC];
    for (int c = 0; c < NC; ++c) x[c] = _mm512_loadu_ps(v[j] + c0 + 16 * c);
    for (int h = 0; h < NH; ++h) {
      const __m512 pj = _mm512_set1_ps(p[h * stride + j]);
      for (int c = 0; c < NC; ++c) acc[h][c] = _mm512_fmadd_ps(pj, x[c], acc[h][c]);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < NC; ++c)
      _mm512_storeu_ps(o + h * d + c0 + 16 * c, _mm512_mul_ps(acc[h][c], _mm512_set1_ps(inv[h])));
}
#endif

// The tiles: scores for up to 2 (AVX2) / 4 (AVX-512) heads x 2 / 4 keys at a time, outputs for as many heads x 32 / 64
// lanes (the accumulators fit the 16 AVX2 / 32 AVX-512 registers); a group's heads split into tiles of equal size
// (7 heads: 4 + 3 in 16 lanes, 2 + 2 + 2 + 1 in 8), a smaller key tile for what is left.
inline int64_t head_tiles(bool wide, int64_t G) { return (G + (wide ? 3 : 1)) / (wide ? 4 : 2); }
inline int64_t tile_start(int64_t tile, int64_t tiles, int64_t G) {  // the first head of tile `tile`
  return tile * (G / tiles) + std::min(tile, G % tiles);
}
#ifdef ARB_STEP_AVX2
template <int NK>
inline void dots_heads(bool wide, int64_t nh, const float* q, const float* const* k, int64_t d, float scale, float* s,
                       int64_t stride) {
#ifdef ARB_STEP_AVX512
  if (wide) {
    switch (nh) {
      case 1: return dots16<1, NK>(q, k, d, scale, s, stride);
      case 2: return dots16<2, NK>(q, k, d, scale, s, stride);
      case 3: return dots16<3, NK>(q, k, d, scale, s, stride);
      default: return dots16<4, NK>(q, k, d, scale, s, stride);
    }
  }
#endif
  (void)wide;
  if (nh == 1) return dots8<1, NK>(q, k, d, scale, s, stride);
  return dots8<2, NK>(q, k, d, scale, s, stride);
}

// keys are prefetched this many ahead of the tile being read: the weights streaming through between two forwards
// evict the cache, so a row's first pass over a layer's keys reads memory (the FMAs reading the first lines of each
// key tile held ~50% of the score code's samples, `perf annotate`). 8 keys ahead, paired in one process against none
// (0.5B lean draft, Zen 5, 40 rounds): d(1) x0.96-0.99, d(4) x0.99; 16 ahead was no better.
constexpr int64_t kKeysAhead = 8;

// scores (G, stride): s[h * stride + j] = q_h · k_j * scale for the `count` keys k[0..count); the values v[j] are
// prefetched beside their keys, so the value rows stream from memory while the scores are computed (the cache is
// read from memory at every step, the weights having passed through since: the 0.5B draft's attention at n = 1,
// 200-400 cached tokens, took ~13% less time, Zen 4)
void scores(bool wide, const float* q, int64_t G, const float* const* k, const float* const* v, int64_t count,
            int64_t d, float scale, float* s, int64_t stride) {
  const int64_t tiles = head_tiles(wide, G), tile_keys = wide ? 4 : 2;
  for (int64_t j0 = 0; j0 < count; j0 += tile_keys) {  // a key tile stays in L1 while every head reads it
    const int64_t nk = std::min(tile_keys, count - j0);
    for (int64_t j = j0; j < j0 + nk; ++j)
      for (int64_t c = 0; c < d; c += 16) _mm_prefetch(reinterpret_cast<const char*>(v[j] + c), _MM_HINT_T0);
    for (int64_t j = j0 + kKeysAhead; j < std::min(count, j0 + kKeysAhead + nk); ++j)
      for (int64_t c = 0; c < d; c += 16) _mm_prefetch(reinterpret_cast<const char*>(k[j] + c), _MM_HINT_T0);
    for (int64_t tile = 0; tile < tiles; ++tile) {
      const int64_t h0 = tile_start(tile, tiles, G), nh = tile_start(tile + 1, tiles, G) - h0;
      const float* qh = q + h0 * d;
      float* sh = s + h0 * stride + j0;
      switch (nk) {
        case 1: dots_heads<1>(wide, nh, qh, k + j0, d, scale, sh, stride); break;
        case 2: dots_heads<2>(wide, nh, qh, k + j0, d, scale, sh, stride); break;
        case 3: dots_heads<3>(wide, nh, qh, k + j0, d, scale, sh, stride); break;
        default: dots_heads<4>(wide, nh, qh, k + j0, d, scale, sh, stride); break;
      }
    }
  }
}

template <int NH>
inline void mix_chunks(bool wide, const float* p, int64_t stride, const float* const* v, int64_t count, int64_t d,
                       const float* inv, float* o) {
  int64_t c0 = 0;
#ifdef ARB_STEP_AVX512
  if (wide) {
    for (; c0 + 64 <= d; c0 += 64) mix16<NH, 4>(p, stride, v, count, c0, d, inv, o);
    for (; c0 + 16 <= d; c0 += 16) mix16<NH, 1>(p, stride, v, count, c0, d, inv, o);
  }
#endif
  (void)wide;
  for (; c0 + 32 <= d; c0 += 32) mix8<NH, 4>(p, stride, v, count, c0, d, inv, o);
  for (; c0 < d; c0 += 8) mix8<NH, 1>(p, stride, v, count, c0, d, inv, o);
}

// o (G, d): o_h = (sum_j p[h * stride + j] v_j) * inv[h] over the `count` values v[0..count)
void mix(bool wide, const float* p, int64_t G, int64_t stride, const float* const* v, int64_t count, int64_t d,
         const float* inv, float* o) {
  const int64_t tiles = head_tiles(wide, G);
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const int64_t h0 = tile_start(tile, tiles, G), nh = tile_start(tile + 1, tiles, G) - h0;
    const float *ph = p + h0 * stride, *ih = inv + h0;
    float* oh = o + h0 * d;
    switch (nh) {
      case 1: mix_chunks<1>(wide, ph, stride, v, count, d, ih, oh); break;
      case 2: mix_chunks<2>(wide, ph, stride, v, count, d, ih, oh); break;
      case 3: mix_chunks<3>(wide, ph, stride, v, count, d, ih, oh); break;
      default: mix_chunks<4>(wide, ph, stride, v, count, d, ih, oh); break;
    }
  }
}
#else
// the portable reference: the same formulas, one value at a time
void scores(bool, const float* q, int64_t G, const float* const* k, const float* const*, int64_t count, int64_t d,
            float scale, float* s, int64_t stride) {
  for (int64_t h = 0; h < G; ++h)
    for (int64_t j = 0; j < count; ++j) {
      float sum = 0.f;
      for (int64_t i = 0; i < d; ++i) sum += q[h * d + i] * k[j][i];
      s[h * stride + j] = sum * scale;
    }
}

void mix(bool, const float* p, int64_t G, int64_t stride, const float* const* v, int64_t count, int64_t d,
         const float* inv, float* o) {
  for (int64_t h = 0; h < G; ++h) {
    float* oh = o + h * d;
    std::fill(oh, oh + d, 0.f);
    for (int64_t j = 0; j < count; ++j)
      for (int64_t i = 0; i < d; ++i) oh[i] += p[h * stride + j] * v[j][i];
    for (int64_t i = 0; i < d; ++i) oh[i] *= inv[h];
  }
}
#endif

// ---- one parallel region for a whole forward ---------------------------------------------------------------------
// Why: a forward of the 0.5B draft at one row is ~5 ms of 24 layers x 5 products, attention and a dozen small steps
// in between; one OpenMP fork / join per product (at::parallel_for) left the second thread spinning idle ~33% of the
// time and the first waiting at joins ~13% and running the steps between alone ~15% (`perf record`, Zen 4, 2 threads).
// Here every thread runs the whole layer loop: each product's units split in static contiguous ranges, the steps
// between split by blocks or kv heads, and a spin barrier wherever a step needs what another thread wrote (8 a
// layer). Against the fork / join loop, in one process, forwards interleaved (Zen 4, 2 threads, fast memory state):
// the 0.5B draft requantized to Q4_0 with a 65536-token head 4.5-4.7 -> 4.1-4.3 ms at one row (~8%), 6.2-6.6 ->
// 5.7-6.1 ms at four rows (~7%); the 1.5B target 16.1-16.4 -> 15.3-16.0 ms at one row (~4%). Tried and dropped:
// a thread done early taking the other's last units one by one from the end (d(1) ~10% slower: a claim per unit and
// a backward stream), prefetching the first 8-16 KB of the next product's share ahead of the step before it (no
// change), and prefetching into L2 the first 64 or 128 KB of each thread's share of the o product before attention
// (while attention computes, the memory bus is idle): 30 rounds alternating in one process, d(1) x0.98 / x0.96 and
// d(4) x0.99 / x1.00 by the median paired ratio, the fastest rounds the same (4.09-4.18 against 4.13 ms): within
// this host's noise.

// A sense-reversing spin barrier for the threads of one region (reusable at once: a thread's sense flips each wait).
// A wait spins ~20-40 us, then yields the core at every check: with more threads than free cores (another process
// busy, or threads > cores) a waiter would otherwise spin while the thread it waits for is off its core; spinning
// only, 3 threads on 2 cores took 780 ms a draft forward (the fork / join loop 11 ms). A wait here is typically
// a few microseconds (a product's two halves finishing apart).
class SpinBarrier {
 public:
  void wait(int threads, bool& sense) {
    sense = !sense;
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == threads - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      released_.store(sense, std::memory_order_release);
      return;
    }
    constexpr int kSpins = 1024;
    for (int spin = 0; released_.load(std::memory_order_acquire) != sense; ++spin) {
      if (spin >= kSpins) {
        std::this_thread::yield();
        continue;
      }
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    }
  }

 private:
  alignas(64) std::atomic<int> arrived_{0};
  alignas(64) std::atomic<bool> released_{false};
};

// A thread's place in the region: thread t of T, its share of a range, the barrier.
struct Team {
  int t, T;
  SpinBarrier* barrier;
  bool sense = false;

  void sync() {
    if (T > 1) barrier->wait(T, sense);
  }
  // [begin, end) of thread t's share of [0, count): at::parallel_for's static split
  std::pair<int64_t, int64_t> share(int64_t count) const {
    const int64_t chunk = (count + T - 1) / T, begin = std::min(count, (int64_t)t * chunk);
    return {begin, std::min(count, begin + chunk)};
  }
};

// One forward's rows, as the session described them (all int64 tensors checked by Python first).
struct Rows {
  int64_t n;
  std::vector<int64_t> seq;  // row -> which sequence (cache) it belongs to
  std::vector<int64_t> at;  // row -> where its key and value go in its cache
  // row r attends to the cache entries [0, prefix[r]) and then extra[offsets[r]:offsets[r + 1]], in cache order
  std::vector<int64_t> prefix, offsets;
  std::vector<int32_t> extra;
  int64_t count(int64_t r) const { return prefix[r] + offsets[r + 1] - offsets[r]; }
};

class Model : public torch::CustomClassHolder {
 public:
  Model(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double final_eps)
      : hidden_(hidden), heads_(heads), kv_heads_(kv_heads), d_(head_dim), eps_(eps), final_eps_(final_eps) {
    TORCH_CHECK(hidden > 0 && heads > 0 && kv_heads > 0 && head_dim > 0 && head_dim % 8 == 0 &&
                heads % kv_heads == 0, "bad model shape");
  }

  void add_layer(at::Tensor norm1, at::Tensor norm2) {
    Layer layer;
    layer.norm1 = as_vector(norm1, hidden_, "attention norm");
    layer.norm2 = as_vector(norm2, hidden_, "feed-forward norm");
    layers_.push_back(layer);
  }

  // part of layer `index` ("qkv", "o", "gate_up", "down"), or of the head ("head", index -1)
  void set_product(int64_t index, std::string which, std::vector<at::Tensor> data, std::vector<int64_t> layouts,
                   int64_t k, std::optional<at::Tensor> bias) {
    TORCH_CHECK(!data.empty() && data.size() == layouts.size(), "a product needs matrices and their layouts");
    for (auto& t : data) TORCH_CHECK(t.scalar_type() == at::kByte && t.dim() == 2 && t.is_contiguous(), "blocks: uint8 (rows, bytes)");
    Product p{std::move(data), std::move(layouts), k, at::Tensor()};
    if (bias && bias->defined()) p.bias = bias->to(at::kFloat).contiguous();
    p.prepare();
    if (which == "head") {
      head_ = p;
      return;
    }
    TORCH_CHECK(index >= 0 && index < (int64_t)layers_.size(), "no layer ", index);
    Layer& layer = layers_[index];
    if (which == "qkv") layer.qkv = p;
    else if (which == "o") layer.o = p;
    else if (which == "gate_up") layer.gate_up = p;
    else if (which == "down") layer.down = p;
    else TORCH_CHECK(false, "unknown product ", which);
  }

  void set_embedding(at::Tensor data, int64_t qtype, int64_t vocab) {
    TORCH_CHECK(data.scalar_type() == at::kByte && data.dim() == 2 && data.size(0) == vocab, "embedding blocks");
    embed_ = data.contiguous();
    embed_type_ = qtype;
  }

  void set_final_norm(at::Tensor w) { final_norm_ = as_vector(w, hidden_, "final norm"); }

  // A pruned head (backends/native.PrunedQuantHead): its output column j < K holds token ids[j]'s logit, columns from
  // K on are padding. forward then returns (k, vocab) logits, the lowest finite float at every other id. Here rather
  // than in Python: torch's new_full + scatter_ took 0.15 ms for one row and ~0.2 ms for four in a draft step.
  void set_head_ids(at::Tensor ids, int64_t vocab) {
    TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.numel() > 0, "head ids: int64 (K,)");
    ids = ids.contiguous();
    const int64_t* p = ids.data_ptr<int64_t>();
    for (int64_t j = 0; j < ids.numel(); ++j)
      TORCH_CHECK(p[j] >= 0 && p[j] < vocab && (j == 0 || p[j] > p[j - 1]), "head ids: ascending, inside the vocabulary");
    head_ids_ = ids;
    head_vocab_ = vocab;
  }

  // the vector width of attention, exp and SiLU: 16 (AVX-512 builds' default) or 8 (AVX2); both give the same bits
  void set_lanes(int64_t lanes) {
#ifdef ARB_STEP_AVX512
    TORCH_CHECK(lanes == 8 || lanes == 16, "attention runs in 8 or 16 lanes, not ", lanes);
#else
    TORCH_CHECK(lanes == 8, "this build's attention runs in 8 lanes only (no AVX-512), not ", lanes);
#endif
    wide_ = lanes == 16;
  }

  int64_t lanes() const { return wide_ ? 16 : 8; }

  // ids (n,), cos / sin (n, head_dim): rows of every sequence side by side. keys / values: each sequence's cache
  // (layers, kv_heads, capacity, head_dim); seq (n,): a row's sequence; at (n,): where its key / value go;
  // prefix (n,): it sees entries [0, prefix) of its cache, then extra[offsets[r]:offsets[r + 1]] (ascending, all
  // >= prefix); keep (k,): the rows whose logits are returned (k, vocab), in that order.
  at::Tensor forward(at::Tensor ids, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> keys,
                     std::vector<at::Tensor> values, at::Tensor seq, at::Tensor at, at::Tensor prefix,
                     at::Tensor offsets, at::Tensor extra, at::Tensor keep) {
    at::NoGradGuard no_grad;
    const Rows rows = describe(ids, cos, sin, keys, values, seq, at, prefix, offsets, extra);
    TORCH_CHECK(keep.scalar_type() == at::kLong && keep.dim() == 1 && keep.is_contiguous(), "keep: int64 (k,)");
    const int64_t* pk = keep.data_ptr<int64_t>();  // checked before the caches are written
    for (int64_t i = 0; i < keep.numel(); ++i) TORCH_CHECK(pk[i] >= 0 && pk[i] < rows.n, "kept row out of range");
    at::Tensor h = embed(ids);  // (n, hidden)
    layers_in_region(h, cos, sin, keys, values, rows);
    if (keep.numel() == 0) return at::empty({0, 0}, at::kFloat);
    at::Tensor logits = head_(rms_norm(h.index_select(0, keep).contiguous(), final_norm_, final_eps_));
    TORCH_CHECK(all_finite(logits), "non-finite logits (NaN or inf)");
    return head_ids_.defined() ? spread(logits) : logits;
  }

 private:
  int64_t hidden_, heads_, kv_heads_, d_;
  double eps_, final_eps_;
  std::vector<Layer> layers_;
  Product head_;
  at::Tensor head_ids_;  // a pruned head's token ids (K,), or undefined
  int64_t head_vocab_ = 0;
  at::Tensor embed_, final_norm_;
  int64_t embed_type_ = 0;
#ifdef ARB_STEP_AVX512
  bool wide_ = true;  // attention, exp and SiLU in 16 lanes (set_lanes(8): the 8-lane code, for the tests)
#else
  bool wide_ = false;
#endif

  static at::Tensor as_vector(const at::Tensor& w, int64_t size, const char* what) {
    TORCH_CHECK(w.dim() == 1 && w.size(0) == size, what, ": expected (", size, ",)");
    return w.to(at::kFloat).contiguous();
  }

  at::Tensor embed(const at::Tensor& ids) const {
    TORCH_CHECK(embed_.defined(), "the model has no embedding");
    at::Tensor h = at::empty({ids.size(0), hidden_}, at::kFloat);
    arborspec::dequantize_rows(embed_, embed_type_, hidden_, ids.data_ptr<int64_t>(), ids.size(0), h.data_ptr<float>());
    return h;
  }

  // ---- the layer loop in one parallel region (see SpinBarrier's comment for why) ---------------------------------

  // one forward's buffers, allocated before the region: a product's input X (n, k) before quantizing and its
  // quantized rows in either format, the products' outputs
  struct Buffers {
    at::Tensor x, act32, actk, qkv, att, y, gate_up;
  };

  // a thread's attention scratch: scores (G, count), totals, the visible keys and values
  struct Scratch {
    std::vector<float> score, inv;
    std::vector<const float*> kp, vp;
  };

  // h (n, hidden) through every layer; the caches get the rows' keys and values
  void layers_in_region(at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin,
                        const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                        const Rows& rows) const {
    if (layers_.empty()) return;
    const int64_t n = rows.n, inner = layers_[0].down.k, qkv_width = (heads_ + 2 * kv_heads_) * d_;
    for (const Layer& l : layers_)  // what the region's steps assume (a product of the wrong shape: an error here)
      TORCH_CHECK(l.qkv.k == hidden_ && l.qkv.width() == qkv_width && l.o.k == heads_ * d_ && l.o.width() == hidden_ &&
                  l.gate_up.k == hidden_ && l.gate_up.width() == 2 * inner && l.down.k == inner &&
                  l.down.width() == hidden_, "a layer's products do not fit the model's shape");
    const int64_t widest = std::max({hidden_, heads_ * d_, inner});
    Buffers b;
    b.x = at::empty({n * widest}, at::kFloat);
    b.act32 = at::empty({n * arborspec::activation_bytes(false, widest)}, at::kByte);
    b.actk = at::empty({n * arborspec::activation_bytes(true, widest)}, at::kByte);
    b.qkv = at::empty({n, qkv_width}, at::kFloat);
    b.att = at::empty({n, heads_ * d_}, at::kFloat);
    b.y = at::empty({n, hidden_}, at::kFloat);
    b.gate_up = at::empty({n, 2 * inner}, at::kFloat);
    SpinBarrier barrier;
    const int threads = at::get_num_threads();
#pragma omp parallel num_threads(threads)
    {
      Team team{omp_get_thread_num(), omp_get_num_threads(), &barrier};
      layers_thread(team, h.data_ptr<float>(), b, cos, sin, keys, values, rows);
    }
  }

  // one thread's part of every layer: a sync wherever the next step reads what another thread wrote
  void layers_thread(Team& team, float* h, Buffers& b, const at::Tensor& cos, const at::Tensor& sin,
                     const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                     const Rows& rows) const {
    Scratch scratch;
    for (size_t li = 0; li < layers_.size(); ++li) {
      const Layer& layer = layers_[li];
      normalize(team, h, layer.norm1, layer.qkv, b, rows.n);
      team.sync();
      product(team, layer.qkv, b, b.qkv.data_ptr<float>(), nullptr, rows.n);
      team.sync();
      attend(team, li, b, cos, sin, keys, values, rows, layer.o, scratch);
      team.sync();
      product(team, layer.o, b, b.y.data_ptr<float>(), h, rows.n);
      team.sync();
      normalize(team, h, layer.norm2, layer.gate_up, b, rows.n);
      team.sync();
      product(team, layer.gate_up, b, b.gate_up.data_ptr<float>(), nullptr, rows.n);
      team.sync();
      silu_quantize(team, layer.down, b, rows.n);
      team.sync();
      product(team, layer.down, b, b.y.data_ptr<float>(), h, rows.n);
      team.sync();
    }
  }

  // the values [j0, j1) of row r of X (n, k) quantized in every format product p takes (j0, j1 on its blocks)
  static void quantize(const Product& p, const float* xr, int64_t k, int64_t j0, int64_t j1, int64_t r, Buffers& b) {
    if (p.act32)
      arborspec::quantize_blocks(false, xr, j0 / 32, j1 / 32,
                                 b.act32.data_ptr<uint8_t>() + r * arborspec::activation_bytes(false, k));
    if (p.actk)
      arborspec::quantize_blocks(true, xr, j0 / 256, j1 / 256,
                                 b.actk.data_ptr<uint8_t>() + r * arborspec::activation_bytes(true, k));
  }

  // the block size product p's formats share: a thread's share of X is whole blocks of each
  static int64_t block_of(const Product& p) { return p.actk ? 256 : 32; }

  // rms_norm(h) (n, hidden) into X and quantized for p: each thread a share of the blocks (every thread computes
  // each row's norm from the whole row, the same bits)
  void normalize(Team& team, const float* h, const at::Tensor& w, const Product& p, Buffers& b, int64_t n) const {
    const int64_t unit = block_of(p);
    const auto [b0, b1] = team.share(hidden_ / unit);
    const int64_t j0 = b0 * unit, j1 = b1 * unit;
    float* x = b.x.data_ptr<float>();
    for (int64_t r = 0; r < n; ++r) {
      const float* hr = h + r * hidden_;
      scale_span(hr + j0, rms_inverse(hr, hidden_, eps_), w.data_ptr<float>() + j0, x + r * hidden_ + j0, j1 - j0);
      quantize(p, x + r * hidden_, hidden_, j0, j1, r, b);
    }
  }

  // this thread's units of p (its static share by weight bytes) into y, plus y into residual where given
  static void product(Team& team, const Product& p, Buffers& b, float* y, float* residual, int64_t n) {
    p.run(p.split(team.t, team.T), p.split(team.t + 1, team.T), b.act32.data_ptr<uint8_t>(),
          b.actk.data_ptr<uint8_t>(), n, y, residual);
  }

  // silu(gate) * up of the gate_up output (n, 2 I) into X (n, I), quantized for down: a share of the blocks each
  void silu_quantize(Team& team, const Product& down, Buffers& b, int64_t n) const {
    const int64_t inner = down.k, unit = block_of(down);
    const auto [b0, b1] = team.share(inner / unit);
    const int64_t j0 = b0 * unit, j1 = b1 * unit;
    const float* gu = b.gate_up.data_ptr<float>();
    float* x = b.x.data_ptr<float>();
    for (int64_t r = 0; r < n; ++r) {
      silu_mul_span(wide_, gu + r * 2 * inner + j0, gu + r * 2 * inner + inner + j0, x + r * inner + j0, j1 - j0);
      quantize(down, x + r * inner, inner, j0, j1, r, b);
    }
  }

  // rotary and the cache writes, then attention, one task per (kv head g, row r); the outputs quantized for o.
  // Tasks run kv head by kv head (t = g n + r), so a thread's rows share its heads' keys and values, read from memory
  // once and then from its cache (row by row, each of 2 threads read both heads' caches: the 0.5B draft's attention
  // at n = 4 took ~12% longer, Zen 4). A thread whose tasks cover whole kv heads (every row of them: KV a multiple
  // of the threads) reads only keys it wrote itself, and needs no sync in between.
  void attend(Team& team, size_t li, Buffers& b, const at::Tensor& cos, const at::Tensor& sin,
              const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values, const Rows& rows,
              const Product& o, Scratch& scratch) const {
    const int64_t n = rows.n, d = d_, H = heads_, KV = kv_heads_, G = H / KV, width = (H + 2 * KV) * d;
    const auto [t0, t1] = team.share(n * KV);
    float* pq = b.qkv.data_ptr<float>();
    const float *pc = cos.data_ptr<float>(), *psn = sin.data_ptr<float>();
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t g = t / n, r = t % n;
      float* row = pq + r * width;
      rotate(row + g * G * d, G, d, pc + r * d, psn + r * d);  // the group's query heads
      rotate(row + (H + g) * d, 1, d, pc + r * d, psn + r * d);  // its key head
      const int64_t cap = keys[rows.seq[r]].size(2), off = ((int64_t)li * KV + g) * cap * d + rows.at[r] * d;
      std::copy(row + (H + g) * d, row + (H + g + 1) * d, keys[rows.seq[r]].data_ptr<float>() + off);
      std::copy(row + (H + KV + g) * d, row + (H + KV + g + 1) * d, values[rows.seq[r]].data_ptr<float>() + off);
    }
    if (((n * KV + team.T - 1) / team.T) % n != 0) team.sync();
    // the outputs of a task are whole blocks of o's formats (G d a multiple of them): quantized by the task's thread
    const bool whole = (G * d) % block_of(o) == 0;
    float* out = b.att.data_ptr<float>();
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t g = t / n, r = t % n;
      attend_one(li, g, r, pq + r * width + g * G * d, keys, values, rows, scratch, out + r * H * d + g * G * d);
      if (whole) quantize(o, out + r * H * d, H * d, g * G * d, (g + 1) * G * d, r, b);
    }
    if (whole) return;
    team.sync();
    const int64_t unit = block_of(o);
    const auto [b0, b1] = team.share(H * d / unit);
    for (int64_t r = 0; r < n; ++r) quantize(o, out + r * H * d, H * d, b0 * unit, b1 * unit, r, b);
  }

  // one (kv head g, row r) task: q (G, d) the group's rotated query heads -> out (G, d)
  void attend_one(size_t li, int64_t g, int64_t r, const float* q, const std::vector<at::Tensor>& keys,
                  const std::vector<at::Tensor>& values, const Rows& rows, Scratch& s, float* out) const {
    const int64_t d = d_, KV = kv_heads_, G = heads_ / KV, count = rows.count(r), cap = keys[rows.seq[r]].size(2);
    const float* kh = keys[rows.seq[r]].data_ptr<float>() + ((int64_t)li * KV + g) * cap * d;
    const float* vh = values[rows.seq[r]].data_ptr<float>() + ((int64_t)li * KV + g) * cap * d;
    s.kp.resize(count);
    s.vp.resize(count);
    for (int64_t j = 0; j < rows.prefix[r]; ++j) s.kp[j] = kh + j * d, s.vp[j] = vh + j * d;
    for (int64_t e = rows.offsets[r], j = rows.prefix[r]; e < rows.offsets[r + 1]; ++e, ++j)
      s.kp[j] = kh + (int64_t)rows.extra[e] * d, s.vp[j] = vh + (int64_t)rows.extra[e] * d;
    s.score.resize(G * count);  // (G, count)
    s.inv.resize(G);
    const float scale = 1.f / std::sqrt((float)d);
    scores(wide_, q, G, s.kp.data(), s.vp.data(), count, d, scale, s.score.data(), count);
    for (int64_t h = 0; h < G; ++h) {
      float* sh = s.score.data() + h * count;
      exp_shifted(wide_, sh, -largest(sh, count), sh, count);
    }
    totals(s.score.data(), G, count, s.inv.data());
    for (int64_t h = 0; h < G; ++h) s.inv[h] = 1.f / s.inv[h];
    mix(wide_, s.score.data(), G, count, s.vp.data(), count, d, s.inv.data(), out);
  }

  // Every argument checked (indices within their caches); the visible entries of each row listed once, for all
  // layers and heads.
  Rows describe(const at::Tensor& ids, const at::Tensor& cos, const at::Tensor& sin, const std::vector<at::Tensor>& keys,
                const std::vector<at::Tensor>& values, const at::Tensor& seq, const at::Tensor& at,
                const at::Tensor& prefix, const at::Tensor& offsets, const at::Tensor& extra) const {
    const int64_t n = ids.size(0);
    for (const at::Tensor* t : {&ids, &seq, &at, &prefix, &offsets, &extra})
      TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->is_contiguous(), "row tables: int64 (n,)");
    TORCH_CHECK(n > 0 && seq.size(0) == n && at.size(0) == n && prefix.size(0) == n && offsets.size(0) == n + 1,
                "row tables of different lengths");
    for (const at::Tensor* t : {&cos, &sin})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(0) == n && t->size(1) == d_ &&
                  t->is_contiguous(), "rotary tables: float32 (n, head_dim)");
    TORCH_CHECK(keys.size() == values.size() && !keys.empty(), "one key and one value cache per sequence");
    const int64_t layers = (int64_t)layers_.size();
    for (size_t s = 0; s < keys.size(); ++s)
      for (const at::Tensor* t : {&keys[s], &values[s]})
        TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 4 && t->size(0) == layers && t->size(1) == kv_heads_ &&
                    t->size(3) == d_ && t->is_contiguous() && t->size(2) == keys[s].size(2),
                    "caches: float32 (layers, kv_heads, capacity, head_dim)");
    const int64_t vocab = embed_.size(0);
    const int64_t *pid = ids.data_ptr<int64_t>(), *ps = seq.data_ptr<int64_t>(), *pa = at.data_ptr<int64_t>();
    const int64_t *pp = prefix.data_ptr<int64_t>(), *po = offsets.data_ptr<int64_t>(), *pe = extra.data_ptr<int64_t>();
    TORCH_CHECK(po[0] == 0 && po[n] == extra.size(0), "extra offsets do not span the extra table");
    Rows rows{n, {}, {}, {}, {}, {}};
    rows.extra.reserve(extra.size(0));
    rows.offsets.push_back(0);
    for (int64_t r = 0; r < n; ++r) {
      TORCH_CHECK(pid[r] >= 0 && pid[r] < vocab, "token id ", pid[r], " outside the vocabulary of ", vocab);
      TORCH_CHECK(ps[r] >= 0 && ps[r] < (int64_t)keys.size(), "row ", r, " names no sequence");
      const int64_t capacity = keys[ps[r]].size(2);
      TORCH_CHECK(pa[r] >= 0 && pa[r] < capacity, "row ", r, " writes past its cache (", capacity, ")");
      TORCH_CHECK(pp[r] >= 0 && pp[r] <= capacity && po[r] <= po[r + 1] && po[r + 1] <= extra.size(0),
                  "row ", r, ": bad visible range");
      for (int64_t e = po[r]; e < po[r + 1]; ++e) {
        TORCH_CHECK(pe[e] >= pp[r] && pe[e] < capacity && (e == po[r] || pe[e] > pe[e - 1]),
                    "row ", r, ": extra entries must be ascending, past its prefix, inside its cache");
        rows.extra.push_back((int32_t)pe[e]);
      }
      TORCH_CHECK(pp[r] + po[r + 1] - po[r] > 0, "row ", r, " sees no key");
      rows.prefix.push_back(pp[r]);
      rows.offsets.push_back(po[r + 1]);
      rows.seq.push_back(ps[r]);
      rows.at.push_back(pa[r]);
    }
    // which entries a row may see (its own and its ancestors', never a later row's) is the session's rule, checked
    // there; here every index only has to lie inside its cache
    return rows;
  }

  // total[h] = p[h, 0] + p[h, 1] + ... in that order, up to 8 heads' sums advancing side by side (one head at a time,
  // each add waited ~4 cycles for the one before: ~10% of the layer loop's own time at n = 4, 0.5B draft, Zen 5)
  template <int NH>
  static void sums(const float* p, int64_t count, float* total) {
    float t[NH] = {};
    for (int64_t j = 0; j < count; ++j)
      for (int h = 0; h < NH; ++h) t[h] += p[h * count + j];
    for (int h = 0; h < NH; ++h) total[h] = t[h];
  }

  static void totals(const float* p, int64_t G, int64_t count, float* total) {
    for (int64_t h0 = 0; h0 < G; h0 += 8) {
      const float* ph = p + h0 * count;
      switch (std::min<int64_t>(8, G - h0)) {
        case 1: sums<1>(ph, count, total + h0); break;
        case 2: sums<2>(ph, count, total + h0); break;
        case 3: sums<3>(ph, count, total + h0); break;
        case 4: sums<4>(ph, count, total + h0); break;
        case 5: sums<5>(ph, count, total + h0); break;
        case 6: sums<6>(ph, count, total + h0); break;
        case 7: sums<7>(ph, count, total + h0); break;
        default: sums<8>(ph, count, total + h0); break;
      }
    }
  }

  // No logit is NaN or inf (their exponent bits are all ones). Here, while the logits are still in cache: in Python a
  // sum over the vocabulary took ~50 us a draft call, the weights streaming through having evicted everything
  // (0.5B draft, Zen 4, 2026-11-26).
  static bool all_finite(const at::Tensor& y) {
    const uint32_t* bits = reinterpret_cast<const uint32_t*>(y.data_ptr<float>());
    const int64_t rows = y.size(0), width = y.size(1);
    std::atomic<bool> ok{true};
    at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
      uint32_t bad = 0;
      for (int64_t i = r0 * width; i < r1 * width; ++i) bad |= (~bits[i] & 0x7f800000u) == 0;
      if (bad) ok = false;
    });
    return ok;
  }

  // small (k, K + padding) logits of the head's ids -> (k, vocab): each row filled with the lowest finite float, then
  // its kept columns written in place (the row still in cache); rows split over torch's threads
  at::Tensor spread(const at::Tensor& small) const {
    const int64_t k = small.size(0), kept = head_ids_.numel(), width = small.size(1), vocab = head_vocab_;
    TORCH_CHECK(width >= kept, "the head has fewer columns than its ids");
    at::Tensor out = at::empty({k, vocab}, at::kFloat);
    const float* ps = small.data_ptr<float>();
    const int64_t* ids = head_ids_.data_ptr<int64_t>();
    float* po = out.data_ptr<float>();
    at::parallel_for(0, k, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        float* row = po + r * vocab;
        std::fill(row, row + vocab, std::numeric_limits<float>::lowest());
        for (int64_t j = 0; j < kept; ++j) row[ids[j]] = ps[r * width + j];
      }
    });
    return out;
  }

};

}  // namespace

TORCH_LIBRARY_FRAGMENT(ARB_OPS, m) {
  m.class_<Model>("Model")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, double, double>())
      .def("add_layer", &Model::add_layer)
      .def("set_product", &Model::set_product)
      .def("set_embedding", &Model::set_embedding)
      .def("set_final_norm", &Model::set_final_norm)
      .def("set_head_ids", &Model::set_head_ids)
      .def("set_lanes", &Model::set_lanes)
      .def("lanes", &Model::lanes)
      .def("forward", &Model::forward);
}
