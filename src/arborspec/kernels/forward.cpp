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
// The KV cache is owned by the Python session (backends: models/native_step.py) as two float32 tensors per
// sequence, keys and values of shape (layers, kv_heads, capacity, head_dim), so each head's keys are contiguous
// for attention; a forward writes its rows' keys and values at [length, length + rows) of their sequence's cache.
// Python checks every index before the call; the checks here are a second line (an error, never a crash).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "gguf_mm.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ARB_STEP_AVX2 1
#endif

namespace {

// ---- exp, elementwise and the same for every element wherever it sits ------------------------------------------
// Why our own: std::exp costs ~5 ns a value, and SiLU alone takes 28 x 8960 of them per row of the 1.5B target
// (1.3 ms a row); ATen's vectorized exp handles a buffer's tail (and each thread's chunk's tail) with a different
// scalar formula, so a value's result would depend on where it sits, i.e. on which other rows share the forward.
// Here every value goes through the same 8-lane code (a tail is padded), Cody-Waite reduction and a degree-6
// polynomial: within 2 ulp of expf over [-87, 88], 0 below, +inf above.

#ifdef ARB_STEP_AVX2
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// out[i] = exp(x[i] + shift) for i < count (x and out may be the same)
void exp_shifted(const float* x, float shift, float* out, int64_t count) {
  const __m256 s = _mm256_set1_ps(shift);
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) _mm256_storeu_ps(out + i, exp8(_mm256_add_ps(_mm256_loadu_ps(x + i), s)));
  if (i < count) {
    alignas(32) float tail[8] = {0};
    std::copy(x + i, x + count, tail);
    _mm256_store_ps(tail, exp8(_mm256_add_ps(_mm256_load_ps(tail), s)));
    std::copy(tail, tail + (count - i), out + i);
  }
}
#else
void exp_shifted(const float* x, float shift, float* out, int64_t count) {
  for (int64_t i = 0; i < count; ++i) out[i] = std::exp(x[i] + shift);
}
#endif

// Weight matrices applied to one input, their outputs side by side: q/k/v (one matrix where they share a block
// type), gate/up, or one matrix; a bias over all outputs, or none.
struct Product {
  std::vector<at::Tensor> data;
  std::vector<int64_t> layouts;
  int64_t k = 0;
  at::Tensor bias;  // (out,) float32, or undefined

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

// y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, for each row r of x (m, dim)
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  const int64_t m = x.size(0), dim = x.size(1);
  at::Tensor y = at::empty_like(x);
  const float* px = x.data_ptr<float>();
  const float* pw = w.data_ptr<float>();
  float* py = y.data_ptr<float>();
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = px + r * dim;
    float lanes[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= dim; i += 16)
      for (int l = 0; l < 16; ++l) lanes[l] += xr[i + l] * xr[i + l];
    float sum = 0.f;
    for (int l = 0; l < 16; ++l) sum += lanes[l];
    for (; i < dim; ++i) sum += xr[i] * xr[i];
    const float inv = 1.f / std::sqrt(sum / (float)dim + (float)eps);
    for (int64_t j = 0; j < dim; ++j) py[r * dim + j] = xr[j] * inv * pw[j];
  }
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

// q · k and o = sum_j p[j] v[vis[j]] over one head's keys and values (rows of d floats): one code path for every
// row, so a row's attention does not depend on where its keys sit or what else runs.
#ifdef ARB_STEP_AVX2
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

float dot(const float* a, const float* b, int64_t d) {  // d a multiple of 8
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
  }
  if (i < d) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
  return hsum8(_mm256_add_ps(s0, s1));
}

void weighted_sum(const float* p, const float* vh, const int32_t* vis, int64_t count, int64_t d, float* o) {
  for (int64_t i0 = 0; i0 < d; i0 += 64) {  // 8 registers of the output at a time, over every key
    const int64_t regs = std::min<int64_t>(8, (d - i0) / 8);
    __m256 acc[8];
    for (int u = 0; u < regs; ++u) acc[u] = _mm256_setzero_ps();
    for (int64_t j = 0; j < count; ++j) {
      const float* v = vh + (int64_t)vis[j] * d + i0;
      const __m256 pj = _mm256_set1_ps(p[j]);
      for (int u = 0; u < regs; ++u) acc[u] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 8 * u), acc[u]);
    }
    for (int u = 0; u < regs; ++u) _mm256_storeu_ps(o + i0 + 8 * u, acc[u]);
  }
}
#else
float dot(const float* a, const float* b, int64_t d) {
  float s = 0.f;
  for (int64_t i = 0; i < d; ++i) s += a[i] * b[i];
  return s;
}

void weighted_sum(const float* p, const float* vh, const int32_t* vis, int64_t count, int64_t d, float* o) {
  std::fill(o, o + d, 0.f);
  for (int64_t j = 0; j < count; ++j)
    for (int64_t i = 0; i < d; ++i) o[i] += p[j] * vh[(int64_t)vis[j] * d + i];
}
#endif

// One forward's rows, as the session described them (all int64 tensors checked by Python first).
struct Rows {
  int64_t n;
  std::vector<int64_t> seq;  // row -> which sequence (cache) it belongs to
  std::vector<int64_t> at;  // row -> where its key and value go in its cache
  std::vector<std::vector<int32_t>> visible;  // row -> the cache entries it attends to, in cache order
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

  // ids (n,), cos / sin (n, head_dim): rows of every sequence side by side. keys / values: each sequence's cache
  // (layers, kv_heads, capacity, head_dim); seq (n,): a row's sequence; at (n,): where its key / value go;
  // prefix (n,): it sees entries [0, prefix) of its cache, then extra[offsets[r]:offsets[r + 1]] (ascending, all
  // >= prefix); keep (k,): the rows whose logits are returned (k, vocab), in that order.
  at::Tensor forward(at::Tensor ids, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> keys,
                     std::vector<at::Tensor> values, at::Tensor seq, at::Tensor at, at::Tensor prefix,
                     at::Tensor offsets, at::Tensor extra, at::Tensor keep) {
    at::NoGradGuard no_grad;
    const Rows rows = describe(ids, cos, sin, keys, values, seq, at, prefix, offsets, extra);
    at::Tensor h = embed(ids);  // (n, hidden)
    for (size_t li = 0; li < layers_.size(); ++li) {
      const Layer& layer = layers_[li];
      h.add_(layer.o(attention(li, layer.qkv(rms_norm(h, layer.norm1, eps_)), cos, sin, keys, values, rows)));
      h.add_(layer.down(silu_mul(layer.gate_up(rms_norm(h, layer.norm2, eps_)))));
    }
    TORCH_CHECK(keep.scalar_type() == at::kLong && keep.dim() == 1, "keep: int64 (k,)");
    if (keep.numel() == 0) return at::empty({0, 0}, at::kFloat);
    const int64_t* pk = keep.data_ptr<int64_t>();
    for (int64_t i = 0; i < keep.numel(); ++i) TORCH_CHECK(pk[i] >= 0 && pk[i] < rows.n, "kept row out of range");
    return head_(rms_norm(h.index_select(0, keep).contiguous(), final_norm_, final_eps_));
  }

 private:
  int64_t hidden_, heads_, kv_heads_, d_;
  double eps_, final_eps_;
  std::vector<Layer> layers_;
  Product head_;
  at::Tensor embed_, final_norm_;
  int64_t embed_type_ = 0;

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
    Rows rows{n, {}, {}, {}};
    rows.visible.resize(n);
    for (int64_t r = 0; r < n; ++r) {
      TORCH_CHECK(pid[r] >= 0 && pid[r] < vocab, "token id ", pid[r], " outside the vocabulary of ", vocab);
      TORCH_CHECK(ps[r] >= 0 && ps[r] < (int64_t)keys.size(), "row ", r, " names no sequence");
      const int64_t capacity = keys[ps[r]].size(2);
      TORCH_CHECK(pa[r] >= 0 && pa[r] < capacity, "row ", r, " writes past its cache (", capacity, ")");
      TORCH_CHECK(pp[r] >= 0 && pp[r] <= capacity && po[r] <= po[r + 1], "row ", r, ": bad visible range");
      std::vector<int32_t>& vis = rows.visible[r];
      vis.reserve(pp[r] + po[r + 1] - po[r]);
      for (int64_t j = 0; j < pp[r]; ++j) vis.push_back((int32_t)j);
      for (int64_t e = po[r]; e < po[r + 1]; ++e) {
        TORCH_CHECK(pe[e] >= pp[r] && pe[e] < capacity && (vis.empty() || pe[e] > vis.back()),
                    "row ", r, ": extra entries must be ascending, past its prefix, inside its cache");
        vis.push_back((int32_t)pe[e]);
      }
      TORCH_CHECK(!vis.empty(), "row ", r, " sees no key");
      rows.seq.push_back(ps[r]);
      rows.at.push_back(pa[r]);
    }
    // which entries a row may see (its own and its ancestors', never a later row's) is the session's rule, checked
    // there; here every index only has to lie inside its cache
    return rows;
  }

  // qkv (n, (H + 2 KV) d) of layer li -> attention output (n, H d); writes the rows' keys and values to the caches.
  at::Tensor attention(size_t li, at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin,
                       const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                       const Rows& rows) const {
    const int64_t n = rows.n, d = d_, H = heads_, KV = kv_heads_, width = (H + 2 * KV) * d;
    TORCH_CHECK(qkv.size(1) == width, "q/k/v width ", qkv.size(1), ", expected ", width);
    qkv = qkv.contiguous();
    float* pq = qkv.data_ptr<float>();
    const float *pc = cos.data_ptr<float>(), *psn = sin.data_ptr<float>();
    for (int64_t r = 0; r < n; ++r) {  // rotary on q and k, then k and v into the cache
      float* row = pq + r * width;
      rotate(row, H + KV, d, pc + r * d, psn + r * d);
      float* kc = keys[rows.seq[r]].data_ptr<float>();
      float* vc = values[rows.seq[r]].data_ptr<float>();
      const int64_t cap = keys[rows.seq[r]].size(2);
      for (int64_t g = 0; g < KV; ++g) {
        const int64_t off = ((int64_t)li * KV + g) * cap * d + rows.at[r] * d;
        std::copy(row + (H + g) * d, row + (H + g + 1) * d, kc + off);
        std::copy(row + (H + KV + g) * d, row + (H + KV + g + 1) * d, vc + off);
      }
    }
    at::Tensor out = at::empty({n, H * d}, at::kFloat);
    float* po = out.data_ptr<float>();
    const float scale = 1.f / std::sqrt((float)d);
    // one task per row and kv head: its G query heads read each key once (GQA: 6 query heads a kv head in the
    // 1.5B target, 7 in the 0.5B draft); every score and sum is computed exactly as for one head alone
    const int64_t G = H / KV;
    at::parallel_for(0, n * KV, 1, [&](int64_t t0, int64_t t1) {
      std::vector<float> score;
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t r = t / KV, g = t % KV;
        const std::vector<int32_t>& vis = rows.visible[r];
        const int64_t count = (int64_t)vis.size(), cap = keys[rows.seq[r]].size(2);
        const float* kh = keys[rows.seq[r]].data_ptr<float>() + ((int64_t)li * KV + g) * cap * d;
        const float* vh = values[rows.seq[r]].data_ptr<float>() + ((int64_t)li * KV + g) * cap * d;
        const float* q = pq + r * width + g * G * d;  // (G, d): the group's query heads
        score.resize(G * count);  // (G, count)
        for (int64_t j = 0; j < count; ++j) {
          const float* key = kh + (int64_t)vis[j] * d;
          for (int64_t h = 0; h < G; ++h) score[h * count + j] = dot(q + h * d, key, d) * scale;
        }
        for (int64_t h = 0; h < G; ++h) {
          float* sh = score.data() + h * count;
          float top = -INFINITY;
          for (int64_t j = 0; j < count; ++j) top = std::max(top, sh[j]);
          exp_shifted(sh, -top, sh, count);
          float total = 0.f;
          for (int64_t j = 0; j < count; ++j) total += sh[j];
          float* o = po + r * H * d + (g * G + h) * d;
          weighted_sum(sh, vh, vis.data(), count, d, o);
          const float inv = 1.f / total;
          for (int64_t i = 0; i < d; ++i) o[i] *= inv;
        }
      }
    });
    return out;
  }

  // gate_up (m, 2 I) -> silu(gate) * up (m, I), rows split over torch's threads
  static at::Tensor silu_mul(const at::Tensor& gu) {
    const int64_t m = gu.size(0), inner = gu.size(1) / 2;
    at::Tensor out = at::empty({m, inner}, at::kFloat);
    const float* pg = gu.data_ptr<float>();
    float* po = out.data_ptr<float>();
    constexpr int64_t kChunk = 1024;  // a chunk of one row: exp of -gate, then the products
    const int64_t chunks = (inner + kChunk - 1) / kChunk;
    // a row of the 1.5B target is ~10 us of work here: no thread hand-off (~5-10 us) below 16 chunks
    at::parallel_for(0, m * chunks, 16, [&](int64_t t0, int64_t t1) {
      float e[kChunk];
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t r = t / chunks, i0 = (t % chunks) * kChunk, count = std::min(kChunk, inner - i0);
        const float* g = pg + r * 2 * inner + i0;
        const float* u = g + inner;
        float* o = po + r * inner + i0;
        for (int64_t i = 0; i < count; ++i) e[i] = -g[i];
        exp_shifted(e, 0.f, e, count);
        for (int64_t i = 0; i < count; ++i) o[i] = g[i] / (1.f + e[i]) * u[i];
      }
    });
    return out;
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(arborspec_kernels, m) {
  m.class_<Model>("Model")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, double, double>())
      .def("add_layer", &Model::add_layer)
      .def("set_product", &Model::set_product)
      .def("set_embedding", &Model::set_embedding)
      .def("set_final_norm", &Model::set_final_norm)
      .def("forward", &Model::forward);
}
