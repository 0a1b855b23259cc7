// arborspec's matrix kernels for GGUF weights: Y (m x n) = X (m x k) · Wᵀ, W (n x k) kept in its GGUF blocks.
//
// Built for small m (verifying a tree of 2-32 tokens): each weight block is loaded and unpacked once and applied to
// every row of X before the next block, so m rows cost one pass over the weights (memory time) plus m times the
// integer dot products (compute time), instead of m passes. Activations are quantized to 8 bits per block first, as
// llama.cpp does for these types (256-value blocks with a float scale and per-16 sums for the K-quants, 32-value
// blocks with a float16 scale for the 32-blocks), so results agree with its numerics; the dot products are exact
// integers and only the per-block scales are float.
//
// Block layouts (bytes), as GGUF files store them:
//   Q4_K (256 weights, 144 B): d f16, dmin f16, 12 B of packed 6-bit scales and mins for 8 sub-blocks of 32,
//        128 B of 4-bit values; w = d * scale[s] * q - dmin * min[s].
//   Q6_K (256 weights, 210 B): 128 B low 4 bits, 64 B high 2 bits, 16 int8 scales (one per 16 weights), d f16;
//        w = d * scale[g] * (q - 32).
//   Q5_0 (32 weights, 22 B): d f16, 4 B of 5th bits, 16 B of 4-bit values; w = d * (q - 16).
//   Q8_0 (32 weights, 34 B): d f16, 32 int8; w = d * q.
//   Q4_0 (32 weights, 18 B): d f16, 16 B of 4-bit values (low nibbles: weights 0..15, high: 16..31); w = d * (q - 8).
//   IQ4_NL (32 weights, 18 B): Q4_0's bytes, but each 4-bit value indexes a fixed non-linear table of 16 int8
//        (kIQ4NL below, llama.cpp's); w = d * table[q]. The lean draft's 4-bit types: the 0.5B draft requantized
//        to either reads 0.28 of the 1.5B target's bytes a step (0.40 as shipped); IQ4_NL kept greedy agreement
//        with the target at 0.900 / 0.690 on two text sets (shipped 0.906 / 0.707, Q4_0 0.884 / 0.671), docs/kernels.md.
//
// Three implementations of each: AVX-512 VNNI (the x16 layouts), AVX2 (256-bit integer multiply-adds) and a portable
// scalar one, which is also the fallback on CPUs without AVX2. Output columns are split across torch's thread pool (linear), or across threads the
// caller already runs (run_units: the forward step's one parallel region, forward.cpp).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "gguf_mm.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ARB_AVX2 1
#endif

// The AVX-512 VNNI code (the x16 layouts' kernels) runs where the build targets a CPU with AVX-512 F/BW/VL and VNNI,
// and in the emulated build (ARB_SIMDE: tests only, on any x86-64 CPU with AVX2), where SIMDe implements those
// intrinsics in portable code with the same integer results; the few conversions SIMDe 0.7 lacks are written out
// (see the helpers below). Timing never comes from the emulated build.
#if defined(ARB_SIMDE)
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#undef _mm512_madd_epi16  // SIMDe 0.7.4 names this alias with the masked form's four arguments
#define _mm512_madd_epi16(a, b) simde_mm512_madd_epi16(a, b)
#define ARB_VNNI 1
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(ARB_AVX2)
#define ARB_VNNI 1
#endif

// The torch operator namespace: the emulated build loads beside the native one, under another name.
#ifndef ARB_OPS
#define ARB_OPS arborspec_kernels
#endif
#define ARB_TORCH_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)

namespace {

using arborspec::IQ4_NL;
using arborspec::Q4_0;
using arborspec::Q4_K;
using arborspec::Q5_0;
using arborspec::Q6_K;
using arborspec::Q8_0;

constexpr int64_t kTile = 16;  // rows of X handled together (accumulators live on the stack)
constexpr int64_t kColumns = 16;  // columns per sweep over the row tiles (their weights stay in L2)

// 8-bit activations for the K-quants: 256 values, their scale, and sums of each 16 (for the mins / the -32 offset)
struct ActK {
  float d;
  int8_t qs[256];
  int16_t bsums[16];
  int16_t bsum32[8];  // sums of each 32 (the Q4_K sub-blocks), for the interleaved kernel's mins term
  int32_t offset16[16];  // -32 x the sums of each 16 (Q6_K's offset), where the x16 kernel's dot products start
};

// 8-bit activations for the 32-blocks: scale (rounded through float16 as the format stores it) and the sum of q
struct Act32 {
  float d;
  int32_t sum;
  int32_t offset8, offset16, offset128;  // -8, -16, -128 x sum: where the x16 kernels' dot products start (Q4_0,
                                         // Q5_0, Q8_0 and IQ4_NL)
  int8_t qs[32];
};

float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// ---------------------------------------------------------------------------------------------- activations

#ifdef ARB_AVX2
// round(x[i] * scale) for 32 values, clamped to 127, as int8 in order (the rounding mode is nearest-even, as
// nearbyint's); the packing instructions interleave 128-bit lanes, the final permute puts the values back in order.
inline void round_32(const float* x, float scale, int8_t* out) {
  const __m256 s = _mm256_set1_ps(scale);
  const __m256i top = _mm256_set1_epi32(127);
  __m256i v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), s)), top);
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permutevar8x32_epi32(packed, order));
}

// The sums of q's int8 values: of all 32 (sum_32), of each 16 of 256 (sums_16). Each 8 bytes biased to unsigned (x +
// 128) and summed by vpsadbw in registers. Why: the compiler's loops stored the 16 sums as two 16-byte halves and
// read them back as one 32-byte load, which cannot be forwarded from two stores: that stall and the search below
// made quantizing ~4% of the 1.5B target's CPU time at 16 rows (Zen 5, `perf annotate`).
inline __m256i biased_sums8(const int8_t* q) {  // 4 x u64: sums of bytes 0-7, 8-15, 16-23, 24-31, each + 8 x 128
  const __m256i v = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)), _mm256_set1_epi8(-128));
  return _mm256_sad_epu8(v, _mm256_setzero_si256());
}

inline int sum_32(const int8_t* q) {
  const __m256i s = biased_sums8(q);
  __m128i t = _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  t = _mm_add_epi64(t, _mm_unpackhi_epi64(t, t));
  return (int)_mm_cvtsi128_si64(t) - 32 * 128;
}

inline void sums_16(const int8_t* q, int* sums) {
  for (int c = 0; c < 8; ++c) {
    const __m256i s = biased_sums8(q + 32 * c);
    const __m256i pair = _mm256_add_epi64(s, _mm256_srli_si256(s, 8));  // u64 lanes 0 and 2: the two 16s
    sums[2 * c] = (int)_mm256_extract_epi64(pair, 0) - 16 * 128;
    sums[2 * c + 1] = (int)_mm256_extract_epi64(pair, 2) - 16 * 128;
  }
}

// the first i < count with |x[i]| == amax (8 at a time), or 0 where there is none (a NaN in x: no overrun)
inline int first_at(const float* x, float amax, int count) {
  const __m256 sign = _mm256_set1_ps(-0.f), m = _mm256_set1_ps(amax);
  for (int i = 0; i < count; i += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)), m, _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(hit);
  }
  return 0;
}

// the largest |x[i]|, i < count; NaN where an x[i] is NaN (max_ps alone would drop it, and a NaN activation turned
// into a finite product: a GGUF with a NaN scale gave finite garbage logits on native, an error elsewhere)
inline float abs_max(const float* x, int count) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
  for (int i = 0; i < count; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v));
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  if (_mm256_movemask_ps(nan)) return NAN;
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}
#else
inline void round_32(const float* x, float scale, int8_t* out) {
  for (int i = 0; i < 32; ++i) {
    const int v = (int)std::nearbyint(x[i] * scale);
    out[i] = (int8_t)(v > 127 ? 127 : v);
  }
}

inline float abs_max(const float* x, int count) {  // NaN where an x[i] is NaN, as the vector code
  float m = 0.f;
  for (int i = 0; i < count; ++i) {
    if (std::isnan(x[i])) return NAN;
    m = std::fmax(m, std::fabs(x[i]));
  }
  return m;
}

inline int sum_of(const int8_t* q, int count) {
  int sum = 0;
  for (int i = 0; i < count; ++i) sum += q[i];
  return sum;
}

inline int sum_32(const int8_t* q) { return sum_of(q, 32); }

inline void sums_16(const int8_t* q, int* sums) {
  for (int g = 0; g < 16; ++g) sums[g] = sum_of(q + 16 * g, 16);
}

inline int first_at(const float* x, float amax, int count) {
  for (int i = 0; i < count; ++i)
    if (std::fabs(x[i]) == amax) return i;
  return 0;
}
#endif

// One 256-block: d = max / -127 where max is the value of largest magnitude (sign kept: the first such value), q =
// round(x / d). A block holding a NaN: q = 0 and d = NaN, so every product with it is NaN, as the reference's.
void quantize_k(const float* x, ActK* out) {
  const float amax = abs_max(x, 256);
  if (amax == 0.f || std::isnan(amax)) {
    std::memset(out, 0, sizeof(ActK));
    out->d = amax;
    return;
  }
  const float iscale = -127.f / x[first_at(x, amax, 256)];
  for (int c = 0; c < 8; ++c) round_32(x + 32 * c, iscale, out->qs + 32 * c);
  int sums[16];
  sums_16(out->qs, sums);
  for (int g = 0; g < 16; ++g) out->bsums[g] = (int16_t)sums[g], out->offset16[g] = -32 * sums[g];
  for (int g = 0; g < 8; ++g) out->bsum32[g] = (int16_t)(sums[2 * g] + sums[2 * g + 1]);
  out->d = 1.f / iscale;
}

// One 32-block: d = amax / 127, q = round(x / d), d kept as float16. A block holding a NaN: q = 0 and d = NaN.
void quantize_32(const float* x, Act32* out) {
  const float amax = abs_max(x, 32);
  if (std::isnan(amax)) {
    std::memset(out, 0, sizeof(Act32));
    out->d = amax;
    return;
  }
  const float d = amax / 127.f;
  const float inv = d != 0.f ? 1.f / d : 0.f;
  round_32(x, inv, out->qs);
  const int sum = sum_32(out->qs);
  out->sum = sum;
  out->offset8 = -8 * sum;
  out->offset16 = -16 * sum;
  out->offset128 = -128 * sum;
  out->d = static_cast<float>(c10::Half(d));
}

bool k_quant(int64_t qtype) { return qtype == Q4_K || qtype == Q6_K; }

// the GGUF types the kernels cover
bool covered(int64_t qtype) {
  return qtype == Q4_K || qtype == Q6_K || qtype == Q5_0 || qtype == Q8_0 || qtype == Q4_0 || qtype == IQ4_NL;
}

// the 4-bit 32-blocks (Q4_0, IQ4_NL): d f16, then the 32 4-bit values as nibbles
bool nibbles_only(int64_t qtype) { return qtype == Q4_0 || qtype == IQ4_NL; }

// Weights per block in the file: 256 for the K-quants, 32 for the others.
int64_t file_block(int64_t qtype) { return k_quant(qtype) ? 256 : 32; }

// IQ4_NL's 16 weight values (llama.cpp's kvalues_iq4nl; gguf-py's IQ4_NL.kvalues), indexed by the 4-bit value
constexpr int8_t kIQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case Q4_K: return 144;
    case Q6_K: return 210;
    case Q5_0: return 22;
    case Q8_0: return 34;
    case Q4_0: return 18;
    case IQ4_NL: return 18;
  }
  return 0;
}

// The 6-bit scale and min of sub-block j of a Q4_K block (packed 12 bytes: 8 scales and 8 mins).
void q4k_scale_min(const uint8_t* s, int j, int* scale, int* min) {
  if (j < 4) {
    *scale = s[j] & 63;
    *min = s[j + 4] & 63;
  } else {
    *scale = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    *min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// A Q4_K block's 256 4-bit values in order (q), and its 8 sub-block scales and mins.
void unpack_q4k(const uint8_t* blk, int* q, int* sc, int* mn) {
  for (int s = 0; s < 8; ++s) q4k_scale_min(blk + 4, s, &sc[s], &mn[s]);
  for (int h = 0; h < 4; ++h)
    for (int l = 0; l < 32; ++l) {
      q[64 * h + l] = blk[16 + 32 * h + l] & 0x0F;
      q[64 * h + 32 + l] = blk[16 + 32 * h + l] >> 4;
    }
}

// A Q6_K block's 256 values 0..63 in order (the file stores 4 low bits and 2 high bits apart), and the inverse.
void unpack_q6k(const uint8_t* blk, int* q) {
  const uint8_t *ql = blk, *qh = blk + 128;
  for (int h = 0; h < 2; ++h)
    for (int l = 0; l < 32; ++l) {
      const uint8_t lo0 = ql[64 * h + l], lo1 = ql[64 * h + 32 + l], hi = qh[32 * h + l];
      q[128 * h + l] = (lo0 & 0x0F) | ((hi & 3) << 4);
      q[128 * h + 32 + l] = (lo1 & 0x0F) | (((hi >> 2) & 3) << 4);
      q[128 * h + 64 + l] = (lo0 >> 4) | (((hi >> 4) & 3) << 4);
      q[128 * h + 96 + l] = (lo1 >> 4) | (((hi >> 6) & 3) << 4);
    }
}

void pack_q6k(const int* q, uint8_t* blk) {
  uint8_t *ql = blk, *qh = blk + 128;
  for (int h = 0; h < 2; ++h)
    for (int l = 0; l < 32; ++l) {
      const int* v = q + 128 * h + l;
      ql[64 * h + l] = (uint8_t)((v[0] & 0x0F) | ((v[64] & 0x0F) << 4));
      ql[64 * h + 32 + l] = (uint8_t)((v[32] & 0x0F) | ((v[96] & 0x0F) << 4));
      qh[32 * h + l] = (uint8_t)((v[0] >> 4) | ((v[32] >> 4) << 2) | ((v[64] >> 4) << 4) | ((v[96] >> 4) << 6));
    }
}

// The arguments every kernel gets: weights of columns [c0, c1), activations of rows [r0, r1) (r1 - r0 <= kTile).
struct Job {
  const uint8_t* w;  // (n, row_bytes)
  int64_t row_bytes;
  const void* act;  // (m, blocks) ActK or Act32
  int64_t blocks;  // activation blocks per row
  float* y;  // (m, n)
  int64_t n;
};

// ---------------------------------------------------------------------------------------------- scalar kernels

void q4k_scalar(const Job& j, int64_t c0, int64_t c1, int64_t r0, int64_t r1) {
  const ActK* act = static_cast<const ActK*>(j.act);
  for (int64_t c = c0; c < c1; ++c) {
    float acc[kTile] = {0};
    for (int64_t b = 0; b < j.blocks; ++b) {
      const uint8_t* blk = j.w + c * j.row_bytes + b * 144;
      const float d = half(blk), dmin = half(blk + 2);
      int q[256], sc[8], mn[8];
      unpack_q4k(blk, q, sc, mn);
      for (int64_t r = r0; r < r1; ++r) {
        const ActK& a = act[r * j.blocks + b];
        int sumi = 0, summ = 0;
        for (int s = 0; s < 8; ++s) {
          int dot = 0;
          for (int l = 0; l < 32; ++l) dot += q[32 * s + l] * a.qs[32 * s + l];
          sumi += sc[s] * dot;
          summ += mn[s] * (a.bsums[2 * s] + a.bsums[2 * s + 1]);
        }
        acc[r - r0] += a.d * d * (float)sumi - a.d * dmin * (float)summ;
      }
    }
    for (int64_t r = r0; r < r1; ++r) j.y[r * j.n + c] = acc[r - r0];
  }
}

void q6k_scalar(const Job& j, int64_t c0, int64_t c1, int64_t r0, int64_t r1) {
  const ActK* act = static_cast<const ActK*>(j.act);
  for (int64_t c = c0; c < c1; ++c) {
    float acc[kTile] = {0};
    for (int64_t b = 0; b < j.blocks; ++b) {
      const uint8_t* blk = j.w + c * j.row_bytes + b * 210;
      const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
      const float d = half(blk + 208);
      int q[256];  // unsigned 0..63; the -32 offset is applied through the activation sums
      unpack_q6k(blk, q);
      for (int64_t r = r0; r < r1; ++r) {
        const ActK& a = act[r * j.blocks + b];
        int sumi = 0;
        for (int g = 0; g < 16; ++g) {
          int dot = 0;
          for (int l = 0; l < 16; ++l) dot += q[16 * g + l] * a.qs[16 * g + l];
          sumi += sc[g] * (dot - 32 * a.bsums[g]);
        }
        acc[r - r0] += a.d * d * (float)sumi;
      }
    }
    for (int64_t r = r0; r < r1; ++r) j.y[r * j.n + c] = acc[r - r0];
  }
}

// A Q4_0 / IQ4_NL block's 32 4-bit values in order (weights 0..15 in the low nibbles, 16..31 in the high).
void nibbles_32(const uint8_t* blk, int* u) {
  for (int l = 0; l < 16; ++l) {
    u[l] = blk[2 + l] & 0x0F;
    u[l + 16] = blk[2 + l] >> 4;
  }
}

// The 32-blocks (Q5_0, Q8_0, Q4_0, IQ4_NL), one float16 scale; `q` gets the block's integer weights (signed)
void unpack_32(int64_t qtype, const uint8_t* blk, int* q) {
  if (qtype == Q8_0) {
    for (int l = 0; l < 32; ++l) q[l] = static_cast<int8_t>(blk[2 + l]);
    return;
  }
  if (nibbles_only(qtype)) {
    nibbles_32(blk, q);
    for (int l = 0; l < 32; ++l) q[l] = qtype == Q4_0 ? q[l] - 8 : kIQ4NL[q[l]];
    return;
  }
  uint32_t qh;
  std::memcpy(&qh, blk + 2, 4);
  for (int l = 0; l < 16; ++l) {
    q[l] = ((blk[6 + l] & 0x0F) | (((qh >> l) & 1) << 4)) - 16;
    q[l + 16] = ((blk[6 + l] >> 4) | (((qh >> (l + 16)) & 1) << 4)) - 16;
  }
}

void q32_scalar(int64_t qtype, const Job& j, int64_t c0, int64_t c1, int64_t r0, int64_t r1) {
  const Act32* act = static_cast<const Act32*>(j.act);
  const int64_t bytes = block_bytes(qtype);
  for (int64_t c = c0; c < c1; ++c) {
    float acc[kTile] = {0};
    for (int64_t b = 0; b < j.blocks; ++b) {
      const uint8_t* blk = j.w + c * j.row_bytes + b * bytes;
      const float d = half(blk);
      int q[32];
      unpack_32(qtype, blk, q);
      for (int64_t r = r0; r < r1; ++r) {
        const Act32& a = act[r * j.blocks + b];
        int dot = 0;
        for (int l = 0; l < 32; ++l) dot += q[l] * a.qs[l];
        acc[r - r0] += a.d * d * (float)dot;
      }
    }
    for (int64_t r = r0; r < r1; ++r) j.y[r * j.n + c] = acc[r - r0];
  }
}

// ---------------------------------------------------------------------------------------------- AVX2 kernels
#ifdef ARB_AVX2

float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256i load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }

// every cache line of a block (the 32-block kernels, whose blocks are a few lines each)
inline void prefetch_block(const uint8_t* p, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) prefetch(p + line);
}

// Part `part` of `parts` of a block's cache lines (the K-quant kernels call it once per sub-block, so a block two
// ahead is requested a few lines at a time between the arithmetic). Why not all of it at the block's start: that
// burst of 37 (Q4_K) or 53 (Q6_K) prefetches held up the demand loads behind it. On a Zen 4 host (2 threads,
// 2026-11-27) spreading them took the 1.5B target's forward from t(1) 39 / t(4) 50-61 / t(8) 87-102 ms to 31 / 34 /
// 48 ms, in alternating processes; its Q6_K head alone ran 9.0 -> 3.3-5.0 ms at M = 1 and 17.2 -> 7.8 ms at M = 8
// (prefetching 1, 3 or 4 blocks ahead instead of 2, into L2 instead of L1, or not at all did no better).
// The AVX2 build's q4_K x8 / q6_K x8 (on the same host's cores, benchmarks/avx2_x8.py --part target, alternating
// processes): t(1) 38.5-41.4 -> 21.3-22.2 ms, t(4) 49.5-51.3 -> 40.6-41.9, t(8) 71.5-77.5 -> 68.0-68.8.
inline void prefetch_part(const uint8_t* p, int64_t bytes, int part, int parts) {
  const int64_t lines = (bytes + 63) / 64;
  for (int64_t line = lines * part / parts; line < lines * (part + 1) / parts; ++line)
    prefetch(p + 64 * line);
}

inline float half_avx(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// pick[s]: a byte shuffle that broadcasts int16 lane s of a 128-bit half to the whole half (s = 0..7); pair[s]:
// int16 lane 2s to the low half and lane 2s + 1 to the high half (s = 0..3), for Q6_K's two scales a register.
struct Shuffles {
  __m256i pick[8], pair[4];
  Shuffles() {
    for (int s = 0; s < 8; ++s) pick[s] = _mm256_set1_epi16((int16_t)((2 * s + 1) << 8 | (2 * s)));
    for (int s = 0; s < 4; ++s)
      pair[s] = _mm256_setr_m128i(_mm_set1_epi16((int16_t)((4 * s + 1) << 8 | (4 * s))),
                                  _mm_set1_epi16((int16_t)((4 * s + 3) << 8 | (4 * s + 2))));
  }
};
const Shuffles kShuffles;

// Q4_K's 12 bytes of packed 6-bit scales and mins -> 16 bytes: the 8 scales, then the 8 mins.
inline __m128i q4k_scales(const uint8_t* s) {
  uint32_t a, b, c;
  std::memcpy(&a, s, 4);
  std::memcpy(&b, s + 4, 4);
  std::memcpy(&c, s + 8, 4);
  const uint32_t sc_lo = a & 0x3f3f3f3f, mn_lo = b & 0x3f3f3f3f;
  const uint32_t sc_hi = (c & 0x0f0f0f0f) | (((a >> 6) & 0x03030303) << 4);
  const uint32_t mn_hi = ((c >> 4) & 0x0f0f0f0f) | (((b >> 6) & 0x03030303) << 4);
  return _mm_setr_epi32((int)sc_lo, (int)sc_hi, (int)mn_lo, (int)mn_hi);
}

// Q4_K: per block, the 256 4-bit values become 8 registers of 32 bytes (sub-blocks in order) and the 8 scales 8
// int16 broadcasts, once; every row then costs 8 u8 x s8 multiply-adds, 8 scaled pair sums and the mins term.
void q4k_avx2(const Job& j, int64_t c0, int64_t c1, int64_t r0, int64_t r1) {
  const ActK* act = static_cast<const ActK*>(j.act);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m128i dup_mins = _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
  for (int64_t c = c0; c < c1; ++c) {
    __m256 acc[kTile];
    for (int64_t r = r0; r < r1; ++r) acc[r - r0] = _mm256_setzero_ps();
    for (int64_t b = 0; b < j.blocks; ++b) {
      const uint8_t* blk = j.w + c * j.row_bytes + b * 144;
      const float d = half_avx(blk), dmin = half_avx(blk + 2);
      const __m128i packed = q4k_scales(blk + 4);
      const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(packed));  // 8 scales as int16, twice
      // each min twice: it weighs the two 16-sums of its 32-value sub-block
      const __m256i mins = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(packed, dup_mins));
      __m256i wv[8], scale[8];
      for (int s = 0; s < 8; ++s) scale[s] = _mm256_shuffle_epi8(sc16, kShuffles.pick[s]);
      for (int h = 0; h < 4; ++h) {
        const __m256i raw = load(blk + 16 + 32 * h);
        wv[2 * h] = _mm256_and_si256(raw, low4);
        wv[2 * h + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
      }
      for (int64_t r = r0; r < r1; ++r) {
        const ActK& a = act[r * j.blocks + b];
        __m256i sum = _mm256_setzero_si256();
        for (int s = 0; s < 8; ++s) {
          const __m256i p = _mm256_maddubs_epi16(wv[s], load(a.qs + 32 * s));  // (16,) int16 pair sums
          sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p, scale[s]));  // (8,) int32, scaled
        }
        const __m256i msum = _mm256_madd_epi16(load(a.bsums), mins);
        __m256 f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(a.d * d), acc[r - r0]);
        acc[r - r0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_set1_ps(-a.d * dmin), f);
      }
    }
    for (int64_t r = r0; r < r1; ++r) j.y[r * j.n + c] = hsum(acc[r - r0]);
  }
}

// Q6_K: the 6-bit values (0..63, offset 32 applied through the activation sums) become 8 registers; each register
// holds two groups of 16 with their own int8 scales, applied by one pair-sum multiply.
void q6k_avx2(const Job& j, int64_t c0, int64_t c1, int64_t r0, int64_t r1) {
  const ActK* act = static_cast<const ActK*>(j.act);
  const __m256i low4 = _mm256_set1_epi8(0x0F), low2 = _mm256_set1_epi8(3);
  for (int64_t c = c0; c < c1; ++c) {
    __m256 acc[kTile];
    for (int64_t r = r0; r < r1; ++r) acc[r - r0] = _mm256_setzero_ps();
    for (int64_t b = 0; b < j.blocks; ++b) {
      const uint8_t* blk = j.w + c * j.row_bytes + b * 210;
      for (int line = 0; line < 256; line += 64) prefetch(blk + 4 * 210 + line);
      const float d = half_avx(blk + 208);
      const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));  // 16 int8 scales
      const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
      const __m256i sc_lo = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(sc16));  // scales 0..7, twice
      const __m256i sc_hi = _mm256_broadcastsi128_si256(_mm256_extracti128_si256(sc16, 1));  // scales 8..15
      __m256i wv[8], scale[8];
      for (int s = 0; s < 8; ++s) scale[s] = _mm256_shuffle_epi8(s < 4 ? sc_lo : sc_hi, kShuffles.pair[s % 4]);
      for (int h = 0; h < 2; ++h) {
        const __m256i l0 = load(blk + 64 * h), l1 = load(blk + 64 * h + 32), hi = load(blk + 128 + 32 * h);
        const auto high = [&](int shift) {
          return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hi, shift), low2), 4);
        };
        wv[4 * h + 0] = _mm256_or_si256(_mm256_and_si256(l0, low4), high(0));
        wv[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, low4), high(2));
        wv[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4), high(4));
        wv[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4), high(6));
      }
      for (int64_t r = r0; r < r1; ++r) {
        const ActK& a = act[r * j.blocks + b];
        __m256i sum = _mm256_setzero_si256();
        for (int s = 0; s < 8; ++s) {
          const __m256i p = _mm256_maddubs_epi16(wv[s], load(a.qs + 32 * s));
          sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p, scale[s]));
        }
        const __m256i offset = _mm256_slli_epi32(_mm256_madd_epi16(load(a.bsums), sc16), 5);  // 32 x scaled sums
        sum = _mm256_sub_epi32(sum, offset);
        acc[r - r0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(a.d * d), acc[r - r0]);
      }
    }
    for (int64_t r = r0; r < r1; ++r) j.y[r * j.n + c] = hsum(acc[r - r0]);
  }
}

// The 32 bits of `bits` as 32 bytes, 0xFF where the bit is set (byte i <- bit i).
__m256i expand_bits(uint32_t bits) {
  const __m256i pick = _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202,
                                          0x0303030303030303);
  const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201ULL);
  const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), pick);
  return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}

// A 32-block as signed bytes (Q5_0: the 4 low bits, the 5th from its bit field, minus 16; Q4_0: the 4 bits minus 8;
// IQ4_NL: the table's value, by a byte shuffle of the 4 bits).
inline __m256i signed_32(int64_t qtype, const uint8_t* blk) {
  if (qtype == Q8_0) return load(blk + 2);
  if (nibbles_only(qtype)) {
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
    const __m256i nib = _mm256_setr_m128i(_mm_and_si128(q, low4), _mm_and_si128(_mm_srli_epi16(q, 4), low4));
    if (qtype == Q4_0) return _mm256_sub_epi8(nib, _mm256_set1_epi8(8));
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4NL)));
    return _mm256_shuffle_epi8(table, nib);
  }
  uint32_t qh;
  std::memcpy(&qh, blk + 2, 4);
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 6));
  const __m256i nib = _mm256_setr_m128i(_mm_and_si128(q, low4), _mm_and_si128(_mm_srli_epi16(q, 4), low4));
  const __m256i w = _mm256_or_si256(nib, _mm256_and_si256(expand_bits(qh), _mm256_set1_epi8(0x10)));
  return _mm256_sub_epi8(w, _mm256_set1_epi8(16));
}

// The 32-blocks for R rows of X: one 32-block is one register, and R accumulators (two per row, for alternate
// blocks, so consecutive blocks do not wait on each other's multiply-add) stay in registers for the whole column.
// u8 x s8 multiply-adds need an unsigned side: |w| times sign(w) x a.
template <int R>
void q32_rows(int64_t qtype, const Job& j, int64_t c, int64_t r0) {
  const Act32* act = static_cast<const Act32*>(j.act);
  const int64_t bytes = block_bytes(qtype);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  const uint8_t* row = j.w + c * j.row_bytes;
  for (int64_t b = 0; b < j.blocks; ++b) {
    const uint8_t* blk = row + b * bytes;
    prefetch(blk + 8 * bytes);
    const float d = half_avx(blk);
    const __m256i w = signed_32(qtype, blk);
    const __m256i wabs = _mm256_sign_epi8(w, w);
    for (int i = 0; i < R; ++i) {
      const Act32& a = act[(r0 + i) * j.blocks + b];
      const __m256i p = _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(load(a.qs), w));  // (16,) int16
      acc[i][b & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones)), _mm256_set1_ps(a.d * d),
                                      acc[i][b & 1]);
    }
  }
  for (int i = 0; i < R; ++i) j.y[(r0 + i) * j.n + c] = hsum(_mm256_add_ps(acc[i][0], acc[i][1]));
}

void q32_avx2(int64_t qtype, const Job& j, int64_t c0, int64_t c1, int64_t r0, int64_t r1) {
  for (int64_t c = c0; c < c1; ++c) {
    int64_t r = r0;
    for (; r + 4 <= r1; r += 4) q32_rows<4>(qtype, j, c, r);
    switch (r1 - r) {
      case 3: q32_rows<3>(qtype, j, c, r); break;
      case 2: q32_rows<2>(qtype, j, c, r); break;
      case 1: q32_rows<1>(qtype, j, c, r); break;
    }
  }
}

#endif  // ARB_AVX2

// ---- Q4_K interleaved by 8 columns ("q4_K x8") -----------------------------------------------------------------
// Why: in the row layout every 32 weights of every row cost two multiply instructions (the u8 x s8 product and the
// scaled pair sum), so a few rows make the kernel compute-bound on AVX2. With 8 columns side by side, 4 weights of
// each column in one 32-bit lane, one broadcast of 4 activation bytes serves 8 columns, and the 16-bit products of a
// whole 32-weight sub-block can be summed before the one scaled widening (8 x 2 x 15 x 127 < 32767): about 9 instead
// of 16 multiplies per 256 weights and row. The repacked group is the same bits, rearranged (+2.8% bytes):
//   d[8], dmin[8] (float16), scales[8 sub-blocks][8 columns], mins[4 pairs][8 columns][2] (uint8),
//   qs[8 sub-blocks][4 chunks][8 columns][4 bytes]: in chunk q of sub-block s, byte i of column c holds weight
//   32 s + 8 q + i (low nibble) and 32 s + 8 q + 4 + i (high nibble).
constexpr int64_t kGroup = 8;
constexpr int64_t kGroupBytes = 16 + 16 + 64 + 64 + 1024;

void repack_q4k_group(const uint8_t* src, int64_t row_bytes, int64_t block, uint8_t* out) {
  for (int c = 0; c < kGroup; ++c) {
    const uint8_t* blk = src + c * row_bytes + block * 144;
    std::memcpy(out + 2 * c, blk, 2);
    std::memcpy(out + 16 + 2 * c, blk + 2, 2);
    int sc[8], mn[8], q[256];
    unpack_q4k(blk, q, sc, mn);
    for (int s = 0; s < 8; ++s) {
      out[32 + 8 * s + c] = (uint8_t)sc[s];
      out[96 + 16 * (s / 2) + 2 * c + (s % 2)] = (uint8_t)mn[s];
    }
    for (int s = 0; s < 8; ++s)
      for (int ch = 0; ch < 4; ++ch)
        for (int i = 0; i < 4; ++i) {
          const int w = 32 * s + 8 * ch + i;
          out[160 + ((s * 4 + ch) * kGroup + c) * 4 + i] = (uint8_t)(q[w] | (q[w + 4] << 4));
        }
  }
}

// Scalar form of the interleaved kernel: the same sums from the repacked bytes (the reference for the AVX2 one and
// the fallback on CPUs without AVX2).
void q4k8_scalar(const Job& j, int64_t g0, int64_t g1, int64_t r0, int64_t r1) {
  const ActK* act = static_cast<const ActK*>(j.act);
  for (int64_t g = g0; g < g1; ++g) {
    float acc[kTile][kGroup] = {{0}};
    for (int64_t b = 0; b < j.blocks; ++b) {
      const uint8_t* grp = j.w + g * j.row_bytes + b * kGroupBytes;
      for (int c = 0; c < kGroup; ++c) {
        const float d = half(grp + 2 * c), dmin = half(grp + 16 + 2 * c);
        for (int64_t r = r0; r < r1; ++r) {
          const ActK& a = act[r * j.blocks + b];
          int sumi = 0, summ = 0;
          for (int s = 0; s < 8; ++s) {
            int dot = 0;
            for (int ch = 0; ch < 4; ++ch)
              for (int i = 0; i < 4; ++i) {
                const uint8_t v = grp[160 + ((s * 4 + ch) * kGroup + c) * 4 + i];
                dot += (v & 0x0F) * a.qs[32 * s + 8 * ch + i] + (v >> 4) * a.qs[32 * s + 8 * ch + 4 + i];
              }
            sumi += grp[32 + 8 * s + c] * dot;
            summ += grp[96 + 16 * (s / 2) + 2 * c + (s % 2)] * a.bsum32[s];
          }
          acc[r - r0][c] += a.d * d * (float)sumi - a.d * dmin * (float)summ;
        }
      }
    }
    for (int64_t r = r0; r < r1; ++r)
      for (int c = 0; c < kGroup; ++c) j.y[r * j.n + g * kGroup + c] = acc[r - r0][c];
  }
}

#ifdef ARB_AVX2
inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// m[0] + ... + m[N - 1] (16- or 32-bit lanes) added as a tree, a chain of log2(N) dependent adds instead of N - 1: the
// same integers (no partial sum overflows where the whole does not), but the q4_K x8 kernel ran 7-25% faster at
// M = 2..8 (M = 1 unchanged; cache-resident, Zen 4 cores, AVX2-only build, alternating runs): a row's serial chain
// of 7 adds had bounded it. The 32-blocks' x8 kernels stayed within the runs' noise.
template <int N, bool Wide = false>
inline __m256i tree_sum(__m256i* m) {
  for (int n = N; n > 1; n /= 2)
    for (int i = 0; i < n / 2; ++i)
      m[i] = Wide ? _mm256_add_epi32(m[2 * i], m[2 * i + 1]) : _mm256_add_epi16(m[2 * i], m[2 * i + 1]);
  return m[0];
}

// One q4_K x8 block for `rows` (<= R) rows of X (`act`: the first row's activation block, `stride` blocks between
// rows), added to acc[0..rows).
template <int R>
inline void q4k8_rows(const uint8_t* grp, const ActK* act, int64_t stride, __m256* acc, int rows = R) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(grp)));  // (8 columns,)
  const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(grp + 16)));
  __m256i isum[R];
  for (int r = 0; r < rows; ++r) isum[r] = _mm256_setzero_si256();
  for (int s = 0; s < 8; ++s) {
    prefetch_part(grp + 2 * kGroupBytes, kGroupBytes, s, 8);
    const __m128i sc8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(grp + 32 + 8 * s));
    const __m256i scale = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(sc8, sc8));  // each column's scale twice
    __m256i w[8];
    for (int ch = 0; ch < 4; ++ch) {
      const __m256i v = load(grp + 160 + (s * 4 + ch) * 32);
      w[2 * ch] = _mm256_and_si256(v, low4);
      w[2 * ch + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    }
    for (int r = 0; r < rows; ++r) {
      const int8_t* aq = act[r * stride].qs + 32 * s;
      __m256i m[8];  // (8 columns x 2,) int16 each
      for (int i = 0; i < 8; ++i) m[i] = _mm256_maddubs_epi16(w[i], bcast4(aq + 4 * i));
      isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(tree_sum<8>(m), scale));  // (8 columns,) int32
    }
  }
  for (int r = 0; r < rows; ++r) {
    const ActK& a = act[r * stride];
    __m256i msum = _mm256_setzero_si256();
    for (int pr = 0; pr < 4; ++pr) {
      const __m256i mins = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(grp + 96 + 16 * pr)));
      int32_t pair;
      std::memcpy(&pair, a.bsum32 + 2 * pr, 4);
      msum = _mm256_add_epi32(msum, _mm256_madd_epi16(mins, _mm256_set1_epi32(pair)));
    }
    const __m256 ad = _mm256_set1_ps(a.d);
    const __m256 f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, ad), acc[r]);
    acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dmin, ad), f);
  }
}
#endif

// ---- the 32-blocks interleaved by 8 rows ("x8"): Q4_0, IQ4_NL, Q5_0, Q8_0 on AVX2 ------------------------------
// Why: the row layout's AVX2 code (q32_rows) pays, per 32 weights and row of X, a u8 x s8 multiply, a widening
// multiply, an int -> float conversion and a float multiply-add with its own scale: compute-bound at ~2.1x the memory
// roofline already at M = 1, so a 4-bit draft ran no faster than the shipped Q5_0 / Q8_0 one. With 8 rows of W side
// by side, 4 consecutive weights of each row in one 32-bit lane, one broadcast of 4 activation bytes serves 8 rows,
// and the float work (conversion, the 8 rows' scales x the row's, one multiply-add) is paid once per block for 8 rows.
// The 4-bit and 5-bit types are kept unsigned (Q4_0 0..15, Q5_0 0..31: the file's own values, offset 8 / 16 removed
// through the activation block's sum, as the x16 layouts do), so the 16-bit products of a whole block add up before
// one widening (8 chunks x 2 x 15 x 127 = 30480, Q5_0 4 x 2 x 31 x 127 = 31496: under 32767): 9 (Q5_0 10) multiplies
// per 8 rows x 32 weights and row instead of 16. IQ4_NL and Q8_0 are signed (up to |127|, |128|): a pair of 16-bit
// products may reach 32512, so each chunk is widened alone and multiplied as |w| x (sign(w) x a), the row layout's
// trick: the same 16 multiplies, but the float work and the loads of the activations shared by 8 rows. Measured on
// the 0.5B draft's products (Zen 4, AVX2-only build, benchmarks/avx2_x8.py): Q4_0 1.98x / 2.63x faster than the row
// layout at M = 1 / 4 (1.03x the memory floor at M = 1), Q5_0 1.90x / 2.67x, IQ4_NL 1.81x / 1.84x, Q8_0 1.06x / 1.92x.
// A chunk t (0..7) of a block is weights 4t..4t+3 of the 8 rows: 32 bytes, byte 4c + i <- row c, weight 4t + i.
// The bytes are the file's bits, rearranged (the same size, per 8 rows):
//   Q4_0, IQ4_NL (144 B): d[8] f16, 4 x 32 B of nibbles: chunk 2p in the low nibbles of bytes 16 + 32p.., chunk
//        2p + 1 in the high ones; the file's 4-bit values (Q4_0: q + 8; IQ4_NL: table indices).
//   Q5_0 (176 B): d[8], the nibbles as Q4_0's (the low 4 bits of q + 16), then 32 B of 5th bits: bit t of byte
//        144 + 4c + i is the 5th bit of row c's weight 4t + i (so one 16-bit shift and a mask give a chunk's).
//   Q8_0 (272 B): d[8], 8 chunks of the file's int8.
constexpr int kRows8 = 8;
constexpr int kLayout8 = 1000;  // layout = kLayout8 + GGUF type (gguf_mm.h; Q4_K's is q4_K x8 above)
// how far ahead the kernel prefetches (bytes): 4 blocks ahead (as x16) left M = 1 at ~1.2x the memory floor and the
// 4864-wide rows' M = 4 1.8x the 896-wide ones' (same volume); 16 and 32 blocks ahead cut the whole draft's M = 1
// by 15-20% and that gap to ~1.1x (Zen 4, AVX2-only build, benchmarks/avx2_x8.py)
constexpr int64_t kAhead8 = 4096;

constexpr int64_t x8_bytes(int64_t qtype) {
  return qtype == Q8_0 ? 272 : qtype == Q5_0 ? 176 : 144;
}

// The file's unsigned integer of row c, weight w of one x8 block (Q4_0 / IQ4_NL: the 4-bit value; Q5_0: q + 16;
// Q8_0: the byte), and its inverse (`blk` zeroed first).
int x8_get(int64_t qtype, const uint8_t* blk, int c, int w) {
  const int t = w / 4, at = 4 * c + w % 4;
  if (qtype == Q8_0) return blk[16 + 32 * t + at];
  const uint8_t byte = blk[16 + 32 * (t / 2) + at];
  int u = t % 2 ? byte >> 4 : byte & 0x0F;
  if (qtype == Q5_0) u |= ((blk[144 + at] >> t) & 1) << 4;
  return u;
}

void x8_set(int64_t qtype, uint8_t* blk, int c, int w, int u) {
  const int t = w / 4, at = 4 * c + w % 4;
  if (qtype == Q8_0) {
    blk[16 + 32 * t + at] = (uint8_t)u;
    return;
  }
  blk[16 + 32 * (t / 2) + at] |= (uint8_t)((u & 0x0F) << (t % 2 ? 4 : 0));
  if (qtype == Q5_0) blk[144 + at] |= (uint8_t)(((u >> 4) & 1) << t);
}

// the signed integer weight a stored value stands for
int x8_weight(int64_t qtype, int u) {
  switch (qtype) {
    case Q4_0: return u - 8;
    case IQ4_NL: return kIQ4NL[u];
    case Q5_0: return u - 16;
    default: return static_cast<int8_t>(u);  // Q8_0
  }
}

// Block `b` of 8 file rows (src, row_bytes apart) -> one x8 block, and back.
void repack_x8_block(int64_t qtype, const uint8_t* src, int64_t row_bytes, int64_t b, uint8_t* out) {
  std::memset(out, 0, x8_bytes(qtype));
  for (int c = 0; c < kRows8; ++c) {
    const uint8_t* blk = src + c * row_bytes + b * block_bytes(qtype);
    std::memcpy(out + 2 * c, blk, 2);
    int u[32];
    if (nibbles_only(qtype)) {
      nibbles_32(blk, u);
    } else if (qtype == Q5_0) {
      unpack_32(qtype, blk, u);
      for (int w = 0; w < 32; ++w) u[w] += 16;
    } else {
      for (int w = 0; w < 32; ++w) u[w] = blk[2 + w];
    }
    for (int w = 0; w < 32; ++w) x8_set(qtype, out, c, w, u[w]);
  }
}

void unpack_x8_block(int64_t qtype, const uint8_t* in, uint8_t* dst, int64_t row_bytes, int64_t b) {
  for (int c = 0; c < kRows8; ++c) {
    uint8_t* blk = dst + c * row_bytes + b * block_bytes(qtype);
    std::memcpy(blk, in + 2 * c, 2);
    int u[32];
    for (int w = 0; w < 32; ++w) u[w] = x8_get(qtype, in, c, w);
    if (qtype == Q8_0) {
      for (int w = 0; w < 32; ++w) blk[2 + w] = (uint8_t)u[w];
    } else if (nibbles_only(qtype)) {
      for (int l = 0; l < 16; ++l) blk[2 + l] = (uint8_t)(u[l] | (u[l + 16] << 4));
    } else {  // Q5_0
      uint32_t qh = 0;
      for (int l = 0; l < 16; ++l) {
        blk[6 + l] = (uint8_t)((u[l] & 0x0F) | ((u[l + 16] & 0x0F) << 4));
        qh |= (uint32_t)(u[l] >> 4) << l | (uint32_t)(u[l + 16] >> 4) << (l + 16);
      }
      std::memcpy(blk + 2, &qh, 4);
    }
  }
}

// Scalar form of the x8 kernel, reading the packed bytes (the reference the AVX2 code is held to, and what a build
// without AVX2 runs on this layout): per block and row of W the integer dot product, times the two scales.
void x8_scalar(int64_t qtype, const Job& j, int64_t g0, int64_t g1, int64_t r0, int64_t r1) {
  const Act32* act = static_cast<const Act32*>(j.act);
  const int64_t bytes = x8_bytes(qtype);
  for (int64_t g = g0; g < g1; ++g) {
    float acc[kTile][kRows8] = {{0}};
    for (int64_t b = 0; b < j.blocks; ++b) {
      const uint8_t* blk = j.w + g * j.row_bytes + b * bytes;
      for (int c = 0; c < kRows8; ++c) {
        const float d = half(blk + 2 * c);
        int q[32];
        for (int w = 0; w < 32; ++w) q[w] = x8_weight(qtype, x8_get(qtype, blk, c, w));
        for (int64_t r = r0; r < r1; ++r) {
          const Act32& a = act[r * j.blocks + b];
          int dot = 0;
          for (int l = 0; l < 32; ++l) dot += q[l] * a.qs[l];
          acc[r - r0][c] += a.d * d * (float)dot;
        }
      }
    }
    for (int64_t r = r0; r < r1; ++r)
      for (int c = 0; c < kRows8; ++c) j.y[r * j.n + g * kRows8 + c] = acc[r - r0][c];
  }
}

#ifdef ARB_AVX2
// x8 for group g and `rows` (<= R) rows of X from r0: per block the 8 chunk registers and the 8 rows' scales are
// made once, then each row costs 8 broadcasts of 4 activation bytes, 8 u8 x s8 multiply-adds, their widening
// (unsigned types: one for the block; signed: one per chunk), and one conversion and multiply-add in float. R = 1
// keeps the row's accumulator in a register across the blocks (with a loop over the rows it lives on the stack:
// Q4_0 x8 at M = 1 ran 92 -> 122 G multiply-adds a second so).
template <int64_t qtype, int R>
void q32x8_group(const Job& j, int64_t g, int64_t r0, int rows = R) {
  const Act32* act = static_cast<const Act32*>(j.act);
  constexpr int64_t bytes = x8_bytes(qtype);
  constexpr bool is_signed = qtype == IQ4_NL || qtype == Q8_0;
  const __m256i low4 = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10), ones = _mm256_set1_epi16(1);
  const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4NL)));
  __m256 acc[R];
  for (int r = 0; r < rows; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < j.blocks; ++b) {
    const uint8_t* blk = j.w + g * j.row_bytes + b * bytes;
    prefetch_block(blk + kAhead8, bytes);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));  // (8 rows,)
    __m256i w[8];  // unsigned types: the stored values; signed: |w|
    __m256i s[8];  // signed types: w (its sign goes to the activations)
    if constexpr (qtype == Q8_0) {
      for (int t = 0; t < 8; ++t) {
        s[t] = load(blk + 16 + 32 * t);
        w[t] = _mm256_abs_epi8(s[t]);  // -128 -> 0x80, read as 128 unsigned
      }
    } else {
      for (int p = 0; p < 4; ++p) {
        const __m256i v = load(blk + 16 + 32 * p);
        w[2 * p] = _mm256_and_si256(v, low4);
        w[2 * p + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      }
      if constexpr (qtype == Q5_0) {
        const __m256i high = load(blk + 144);  // bit t of each byte: chunk t's 5th bit
        for (int t = 0; t < 8; ++t) {
          const __m256i at4 = t <= 4 ? _mm256_slli_epi16(high, 4 - t) : _mm256_srli_epi16(high, t - 4);
          w[t] = _mm256_or_si256(w[t], _mm256_and_si256(at4, bit4));
        }
      }
      if constexpr (qtype == IQ4_NL)
        for (int t = 0; t < 8; ++t) {
          s[t] = _mm256_shuffle_epi8(table, w[t]);
          w[t] = _mm256_abs_epi8(s[t]);
        }
    }
    for (int r = 0; r < rows; ++r) {
      const Act32& a = act[(r0 + r) * j.blocks + b];
      __m256i dot;  // (8 rows,) int32
      __m256i m[8];  // per chunk: (8 rows x 2,) int16 products, or (signed types) (8 rows,) int32
      if constexpr (is_signed) {
        for (int t = 0; t < 8; ++t)
          m[t] = _mm256_madd_epi16(_mm256_maddubs_epi16(w[t], _mm256_sign_epi8(bcast4(a.qs + 4 * t), s[t])), ones);
        dot = tree_sum<8, true>(m);
      } else {
        for (int t = 0; t < 8; ++t) m[t] = _mm256_maddubs_epi16(w[t], bcast4(a.qs + 4 * t));
        if constexpr (qtype == Q5_0) {  // each half's 16-bit sums alone (4 x 2 x 31 x 127 < 32767)
          dot = _mm256_add_epi32(_mm256_madd_epi16(tree_sum<4>(m), ones),
                                 _mm256_madd_epi16(tree_sum<4>(m + 4), ones));
          dot = _mm256_add_epi32(dot, _mm256_set1_epi32(a.offset16));
        } else {  // Q4_0
          dot = _mm256_add_epi32(_mm256_madd_epi16(tree_sum<8>(m), ones), _mm256_set1_epi32(a.offset8));
        }
      }
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, _mm256_set1_ps(a.d)), acc[r]);
    }
  }
  for (int r = 0; r < rows; ++r) _mm256_storeu_ps(j.y + (r0 + r) * j.n + g * kRows8, acc[r]);
}

template <int64_t qtype>
void q32x8_avx2(const Job& j, int64_t g0, int64_t g1, int64_t r0, int64_t r1) {
  for (int64_t g = g0; g < g1; ++g) {
    if (r1 - r0 == 1)
      q32x8_group<qtype, 1>(j, g, r0);
    else
      q32x8_group<qtype, kTile>(j, g, r0, (int)(r1 - r0));
  }
}

void x8_avx2(int64_t qtype, const Job& j, int64_t g0, int64_t g1, int64_t r0, int64_t r1) {
  switch (qtype) {
    case Q4_0: return q32x8_avx2<Q4_0>(j, g0, g1, r0, r1);
    case IQ4_NL: return q32x8_avx2<IQ4_NL>(j, g0, g1, r0, r1);
    case Q5_0: return q32x8_avx2<Q5_0>(j, g0, g1, r0, r1);
    default: return q32x8_avx2<Q8_0>(j, g0, g1, r0, r1);
  }
}
#endif

// ---- Q6_K interleaved by 8 rows ("q6_K x8") --------------------------------------------------------------------
// Why: the 1.5B target's head and half its down and v products are Q6_K, and on AVX2 its row layout (q6k_avx2) pays a
// scaled pair sum for every u8 x s8 multiply; cache-resident it ran 49 / 91 / 80 G multiply-adds a second at M = 1 /
// 4 / 8 against Q4_K x8's 92 / 171 / 197 (Zen 4 cores, AVX2-only build, 2 threads), so the target's extra rows were
// dear on AVX2 (t(4) = 2.1 t(1)). As q4_K x8: 8 rows side by side, 4 consecutive weights of each row in one 32-bit
// lane, one broadcast of 4 activation bytes for 8 rows. The values stay unsigned (0..63, the -32 offset applied
// through the activation's 16-sums, once per block and row), so two u8 x s8 products of a 16-weight group add up in
// 16 bits before the scaled widening (2 x 2 x 63 x 127 = 32004 < 32767): one scaled widening per two multiplies
// instead of one per multiply. The bytes are the file's bits rearranged (the same size, 1680 B per 8 rows):
//   d[8] f16, scale[8 pairs of groups][8 rows][2] i8 (group 2p, 2p + 1 of each row side by side), then
//   low[32][32 B]: register p holds chunk 2p in the low nibbles, chunk 2p + 1 in the high ones (chunk t: weights
//       4t..4t+3 of the 8 rows, byte 4c + i <- row c, weight 4t + i),
//   high[16][32 B]: register g holds the 2 high bits of chunks 4g..4g+3 (bits 2s, 2s + 1 <- chunk 4g + s).
constexpr int64_t kQ6Group = 16 + 128 + 1024 + 512;
constexpr int64_t kQ6Low = 144, kQ6High = 144 + 1024;

int q6k8_get(const uint8_t* grp, int c, int w) {
  const int t = w / 4, at = 4 * c + w % 4;
  const int low = (grp[kQ6Low + 32 * (t / 2) + at] >> (4 * (t % 2))) & 0x0F;
  return low | ((grp[kQ6High + 32 * (t / 4) + at] >> (2 * (t % 4))) & 3) << 4;
}

int q6k8_scale(const uint8_t* grp, int c, int g) {
  return static_cast<int8_t>(grp[16 + 16 * (g / 2) + 2 * c + g % 2]);
}

// Block b of 8 file rows (src, row_bytes apart) -> one q6_K x8 block, and back.
void repack_q6k_group(const uint8_t* src, int64_t row_bytes, int64_t b, uint8_t* out) {
  std::memset(out, 0, kQ6Group);
  for (int c = 0; c < kRows8; ++c) {
    const uint8_t* blk = src + c * row_bytes + b * 210;
    std::memcpy(out + 2 * c, blk + 208, 2);
    for (int g = 0; g < 16; ++g) out[16 + 16 * (g / 2) + 2 * c + g % 2] = blk[192 + g];
    int q[256];
    unpack_q6k(blk, q);
    for (int w = 0; w < 256; ++w) {
      const int t = w / 4, at = 4 * c + w % 4;
      out[kQ6Low + 32 * (t / 2) + at] |= (uint8_t)((q[w] & 0x0F) << (4 * (t % 2)));
      out[kQ6High + 32 * (t / 4) + at] |= (uint8_t)((q[w] >> 4) << (2 * (t % 4)));
    }
  }
}

void unpack_q6k_group(const uint8_t* grp, uint8_t* dst, int64_t row_bytes, int64_t b) {
  for (int c = 0; c < kRows8; ++c) {
    uint8_t* blk = dst + c * row_bytes + b * 210;
    int q[256];
    for (int w = 0; w < 256; ++w) q[w] = q6k8_get(grp, c, w);
    pack_q6k(q, blk);
    for (int g = 0; g < 16; ++g) blk[192 + g] = (uint8_t)q6k8_scale(grp, c, g);
    std::memcpy(blk + 208, grp + 2 * c, 2);
  }
}

// Scalar form over the packed bytes (the reference for the AVX2 code, and what runs without AVX2): q6k_scalar's sums.
void q6k8_scalar(const Job& j, int64_t g0, int64_t g1, int64_t r0, int64_t r1) {
  const ActK* act = static_cast<const ActK*>(j.act);
  for (int64_t g = g0; g < g1; ++g) {
    float acc[kTile][kRows8] = {{0}};
    for (int64_t b = 0; b < j.blocks; ++b) {
      const uint8_t* grp = j.w + g * j.row_bytes + b * kQ6Group;
      for (int c = 0; c < kRows8; ++c) {
        int q[256];
        for (int w = 0; w < 256; ++w) q[w] = q6k8_get(grp, c, w);
        for (int64_t r = r0; r < r1; ++r) {
          const ActK& a = act[r * j.blocks + b];
          int sumi = 0;
          for (int gq = 0; gq < 16; ++gq) {
            int dot = 0;
            for (int l = 0; l < 16; ++l) dot += q[16 * gq + l] * a.qs[16 * gq + l];
            sumi += q6k8_scale(grp, c, gq) * (dot - 32 * a.bsums[gq]);
          }
          acc[r - r0][c] += a.d * half(grp + 2 * c) * (float)sumi;
        }
      }
    }
    for (int64_t r = r0; r < r1; ++r)
      for (int c = 0; c < kRows8; ++c) j.y[r * j.n + g * kRows8 + c] = acc[r - r0][c];
  }
}

#ifdef ARB_AVX2
// One q6_K x8 block for `rows` (<= R) rows of X (`act`: the first row's activation block, `stride` blocks between
// rows), added to acc[0..rows). Per 16-weight group the 4 chunk registers and the scales are made once; each row
// then costs 4 broadcasts, 4 u8 x s8 multiply-adds, 2 16-bit adds and 2 scaled widenings; the offset once per block:
// 8 scaled widenings of the 16-sums. Cache-resident (1536 x 1536, 2 threads, Zen 4 cores on the AVX2-only build):
// 87 / 119 / 166 / 202 G multiply-adds a second at M = 1 / 2 / 4 / 8, against the row layout's 51 / 75 / 98 / 117.
template <int R>
inline void q6k8_rows(const uint8_t* grp, const ActK* act, int64_t stride, __m256* acc, int rows = R) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), high2 = _mm256_set1_epi8(0x30);
  // byte shuffles: each row's int16 0 (group 2p) / 1 (group 2p + 1) of its pair, twice
  const __m256i even = _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13, 0, 1, 0, 1, 4, 5, 4, 5, 8,
                                        9, 8, 9, 12, 13, 12, 13);
  const __m256i odd = _mm256_add_epi8(even, _mm256_set1_epi8(2));
  __m256i isum[R];
  for (int r = 0; r < rows; ++r) isum[r] = _mm256_setzero_si256();
  for (int p = 0; p < 8; ++p) {
    prefetch_part(grp + 2 * kQ6Group, kQ6Group, p, 8);
    // (8 rows x (scale of group 2p, of 2p + 1)) int16
    const __m256i pair = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(grp + 16 + 16 * p)));
    for (int h = 0; h < 2; ++h) {
      const int gq = 2 * p + h;
      const __m256i scale = _mm256_shuffle_epi8(pair, h ? odd : even);  // each row's scale of group gq, twice
      const __m256i l0 = load(grp + kQ6Low + 64 * gq), l1 = load(grp + kQ6Low + 64 * gq + 32);
      const __m256i hi = load(grp + kQ6High + 32 * gq);
      const __m256i w0 = _mm256_or_si256(_mm256_and_si256(l0, low4),
                                         _mm256_and_si256(_mm256_slli_epi16(hi, 4), high2));
      const __m256i w1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                                         _mm256_and_si256(_mm256_slli_epi16(hi, 2), high2));
      const __m256i w2 = _mm256_or_si256(_mm256_and_si256(l1, low4), _mm256_and_si256(hi, high2));
      const __m256i w3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                                         _mm256_and_si256(_mm256_srli_epi16(hi, 2), high2));
      for (int r = 0; r < rows; ++r) {
        const int8_t* aq = act[r * stride].qs + 16 * gq;
        const __m256i p0 = _mm256_add_epi16(_mm256_maddubs_epi16(w0, bcast4(aq)),
                                            _mm256_maddubs_epi16(w1, bcast4(aq + 4)));
        const __m256i p1 = _mm256_add_epi16(_mm256_maddubs_epi16(w2, bcast4(aq + 8)),
                                            _mm256_maddubs_epi16(w3, bcast4(aq + 12)));
        isum[r] = _mm256_add_epi32(isum[r],
                                   _mm256_add_epi32(_mm256_madd_epi16(p0, scale), _mm256_madd_epi16(p1, scale)));
      }
    }
  }
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(grp)));  // (8 rows,)
  for (int r = 0; r < rows; ++r) {
    const ActK& a = act[r * stride];
    __m256i offset = _mm256_setzero_si256();  // (8 rows,) sum over groups of scale x 16-sum
    for (int p = 0; p < 8; ++p) {
      const __m256i pair = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(grp + 16 + 16 * p)));
      int32_t sums;
      std::memcpy(&sums, a.bsums + 2 * p, 4);
      offset = _mm256_add_epi32(offset, _mm256_madd_epi16(pair, _mm256_set1_epi32(sums)));
    }
    const __m256i sumi = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(offset, 5));
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_mul_ps(d, _mm256_set1_ps(a.d)), acc[r]);
  }
}

// The K-quants' 8-row kernels (q4_K x8, q6_K x8) for groups [g0, g1), rows [r0, r1) of X (at most kTile): per block,
// read two blocks ahead (M = 1 15% faster for the 1.5B's matrices: 43 -> 37 ms; a few lines per sub-block, see
// prefetch_part), then one row with its sums and
// accumulator in registers, or the rows in a loop with theirs on the stack (faster than passes of 2-4 rows in
// registers, each of which unpacks the weights again: q6_K x8 at M = 8 198 against 157 G multiply-adds a second).
template <int64_t qtype, int R>
inline void k8_rows(const uint8_t* grp, const ActK* act, int64_t stride, __m256* acc, int rows = R) {
  if constexpr (qtype == Q4_K)
    q4k8_rows<R>(grp, act, stride, acc, rows);
  else
    q6k8_rows<R>(grp, act, stride, acc, rows);
}

template <int64_t qtype>
void k8_avx2(const Job& j, int64_t g0, int64_t g1, int64_t r0, int64_t r1) {
  constexpr int64_t bytes = qtype == Q4_K ? kGroupBytes : kQ6Group;
  const ActK* act = static_cast<const ActK*>(j.act);
  for (int64_t g = g0; g < g1; ++g) {
    __m256 acc[kTile];
    for (int64_t r = r0; r < r1; ++r) acc[r - r0] = _mm256_setzero_ps();
    for (int64_t b = 0; b < j.blocks; ++b) {
      const uint8_t* grp = j.w + g * j.row_bytes + b * bytes;
      const ActK* first = act + r0 * j.blocks + b;
      if (r1 - r0 == 1)
        k8_rows<qtype, 1>(grp, first, j.blocks, acc);
      else
        k8_rows<qtype, kTile>(grp, first, j.blocks, acc, (int)(r1 - r0));
    }
    for (int64_t r = r0; r < r1; ++r) _mm256_storeu_ps(j.y + r * j.n + g * kRows8, acc[r - r0]);
  }
}
#endif

// ---- 16 rows interleaved ("x16"), every block type: the AVX-512 VNNI layouts ----------------------------------
// Why: a 512-bit register holds 4 consecutive weights of each of 16 rows of W (one 32-bit lane per row), and one
// `vpdpbusd` multiplies them by 4 activation bytes broadcast to every lane, widens and accumulates: 64 weights a row
// of X per instruction (AVX2 needs two multiplies for 32), and each sub-block's scales are applied to its sums once,
// for all 16 rows, by one integer multiply. The weights enter as unsigned bytes (the instruction is u8 x s8): a
// type whose integers are signed is stored with an offset (Q6_K +32, Q5_0 +16, Q8_0 +128, Q4_0 +8; IQ4_NL's table
// values +128, looked up by a byte shuffle of the stored 4-bit indices) removed through the activation blocks' sums, so every path computes the same exact integer dot products. The column-interleaved
// prototype of this design ran the whole 1.5B's volume at the memory floor for M = 1 and t(4) = 1.11 t(1) on Zen 4.
//
// A chunk j of a block is weights 4j..4j+3 of each of the 16 rows: 64 values, value 4c + i <- row c, weight 4j + i.
// 4-bit values are stored two chunks to 64 bytes (chunk 2p in the low nibbles of bytes 64p.., 2p + 1 in the high);
// a 5th / 6th bit as a 64-bit mask per chunk (bit 4c + i), which the kernel adds by one masked byte add. The bytes
// are the file's bits rearranged, per 16 rows the file's bytes (Q4_K: +2.8%, a byte per 6-bit scale and min):
//   Q4_K (256-block, 2368 B): d[16] f16, dmin[16] f16, scale[8 sub-blocks][16] u8, min[4 pairs][16 rows][2] u8,
//        64 chunks of nibbles (8 per 32-weight sub-block).
//   Q6_K (256-block, 3360 B): d[16] f16, scale[16 groups][16] i8, 64 chunks of nibbles (4 per 16-weight group),
//        then per chunk its bit-4 and bit-5 masks (16 B). Weights 0..63 (+32).
//   Q5_0 (32-block, 352 B): d[16] f16, 8 chunks of nibbles, per chunk its bit-4 mask (8 B). Weights 0..31 (+16).
//   Q8_0 (32-block, 544 B): d[16] f16, 8 chunks of bytes q + 128 (q ^ 0x80).
//   Q4_0 (32-block, 288 B): d[16] f16, 8 chunks of nibbles, the file's 4-bit values (0..15, the +8 offset).
//   IQ4_NL (32-block, 288 B): d[16] f16, 8 chunks of nibbles, the file's 4-bit table indices; the kernel's weights
//        are table[index] + 128 (1..241).
constexpr int kRows16 = 16;
constexpr int kLayout16 = 2000;  // layout = kLayout16 + GGUF type (gguf_mm.h)

struct X16 {
  int64_t bytes;  // per block of 16 rows
  int weights;  // per block and row (256 or 32)
  int nibbles;  // offset of the 4-bit chunks (Q8_0: of its byte chunks)
  int masks;  // offset of the bit masks (0: none)
  int offset;  // what was added to the type's integers to make them unsigned
};

X16 x16_format(int64_t qtype) {
  switch (qtype) {
    case Q4_K: return {2368, 256, 320, 0, 0};
    case Q6_K: return {3360, 256, 288, 2336, 32};
    case Q5_0: return {352, 32, 32, 288, 16};
    case Q4_0: return {288, 32, 32, 0, 8};
    case IQ4_NL: return {288, 32, 32, 0, 128};
    default: return {544, 32, 32, 0, 128};  // Q8_0
  }
}

// The stored unsigned integer of row c, weight w (0 .. weights - 1) of one x16 block (store_x16_row, below, writes
// them). For IQ4_NL that is the 4-bit table index; x16_value gives the weight the kernels multiply by (+ the offset)
// for every type.
int x16_get(int64_t qtype, const uint8_t* blk, int c, int w) {
  const X16 f = x16_format(qtype);
  const int j = w / 4, at = 4 * c + w % 4;
  if (qtype == Q8_0) return blk[f.nibbles + 64 * j + at];
  const uint8_t byte = blk[f.nibbles + 64 * (j / 2) + at];
  int u = j % 2 ? byte >> 4 : byte & 0x0F;
  if (qtype == Q5_0) u |= ((blk[f.masks + 8 * j + at / 8] >> (at % 8)) & 1) << 4;
  if (qtype == Q6_K) {
    u |= ((blk[f.masks + 16 * j + at / 8] >> (at % 8)) & 1) << 4;
    u |= ((blk[f.masks + 16 * j + 8 + at / 8] >> (at % 8)) & 1) << 5;
  }
  return u;
}

int x16_value(int64_t qtype, int u) { return qtype == IQ4_NL ? kIQ4NL[u] + 128 : u; }

// Q4_K's 8 scales and 8 mins (6 bits each) back into its 12 packed bytes.
void pack_q4k_scales(const int* sc, const int* mn, uint8_t* p) {
  for (int i = 0; i < 4; ++i) {
    p[i] = (uint8_t)((sc[i] & 63) | ((sc[i + 4] >> 4) << 6));
    p[i + 4] = (uint8_t)((mn[i] & 63) | ((mn[i + 4] >> 4) << 6));
    p[i + 8] = (uint8_t)((sc[i + 4] & 15) | ((mn[i + 4] & 15) << 4));
  }
}

// Row c's stored integers u[0 .. weights) into an x16 block (`out` zeroed first), x16_get's inverse: a byte (two
// weights) or a 4-bit piece of a mask (four) at a time. Why: weight by weight (an OR into a byte per weight),
// repacking the default pair took 2.6 s of its 7.2 s load; byte by byte 1.0 s (loads 4.7 -> 2.9 s for the 1.5B
// target, 2.5 -> 2.0 s for the draft; Zen 4, alternating runs).
void store_x16_row(int64_t qtype, const X16& f, int c, const int* u, uint8_t* out) {
  if (qtype == Q8_0) {
    for (int j = 0; j < f.weights / 4; ++j)
      for (int i = 0; i < 4; ++i) out[f.nibbles + 64 * j + 4 * c + i] = (uint8_t)u[4 * j + i];
    return;
  }
  for (int p = 0; p < f.weights / 8; ++p)  // chunks 2p (low nibbles) and 2p + 1 (high)
    for (int i = 0; i < 4; ++i)
      out[f.nibbles + 64 * p + 4 * c + i] = (uint8_t)((u[8 * p + i] & 0x0F) | ((u[8 * p + 4 + i] & 0x0F) << 4));
  if (!f.masks) return;
  const int stride = qtype == Q6_K ? 16 : 8, shift = 4 * (c % 2);  // bits 4c .. 4c + 3 of a chunk's mask
  for (int j = 0; j < f.weights / 4; ++j) {
    int bit4 = 0, bit5 = 0;
    for (int i = 0; i < 4; ++i) {
      bit4 |= ((u[4 * j + i] >> 4) & 1) << i;
      bit5 |= ((u[4 * j + i] >> 5) & 1) << i;
    }
    out[f.masks + stride * j + c / 2] |= (uint8_t)(bit4 << shift);
    if (qtype == Q6_K) out[f.masks + stride * j + 8 + c / 2] |= (uint8_t)(bit5 << shift);
  }
}

// Block `b` of 16 file rows (src, row_bytes apart) -> one x16 block.
void repack_x16_block(int64_t qtype, const uint8_t* src, int64_t row_bytes, int64_t b, uint8_t* out) {
  const X16 f = x16_format(qtype);
  std::memset(out, 0, f.bytes);
  for (int c = 0; c < kRows16; ++c) {
    const uint8_t* blk = src + c * row_bytes + b * block_bytes(qtype);
    int u[256];
    if (qtype == Q4_K) {
      int sc[8], mn[8];
      unpack_q4k(blk, u, sc, mn);
      std::memcpy(out + 2 * c, blk, 2);
      std::memcpy(out + 32 + 2 * c, blk + 2, 2);
      for (int s = 0; s < 8; ++s) {
        out[64 + 16 * s + c] = (uint8_t)sc[s];
        out[192 + 32 * (s / 2) + 2 * c + s % 2] = (uint8_t)mn[s];
      }
    } else if (qtype == Q6_K) {
      unpack_q6k(blk, u);
      std::memcpy(out + 2 * c, blk + 208, 2);
      for (int g = 0; g < 16; ++g) out[32 + 16 * g + c] = blk[192 + g];
    } else if (nibbles_only(qtype)) {
      nibbles_32(blk, u);  // stored as they are (Q4_0: already q + 8; IQ4_NL: the table indices)
      std::memcpy(out + 2 * c, blk, 2);
    } else {
      unpack_32(qtype, blk, u);
      for (int w = 0; w < 32; ++w) u[w] += f.offset;
      std::memcpy(out + 2 * c, blk, 2);
    }
    store_x16_row(qtype, f, c, u, out);
  }
}

// One x16 block -> block `b` of its 16 file rows (dst, row_bytes apart): repack_x16_block's inverse.
void unpack_x16_block(int64_t qtype, const uint8_t* in, uint8_t* dst, int64_t row_bytes, int64_t b) {
  const X16 f = x16_format(qtype);
  for (int c = 0; c < kRows16; ++c) {
    uint8_t* blk = dst + c * row_bytes + b * block_bytes(qtype);
    int u[256];
    for (int w = 0; w < f.weights; ++w) u[w] = x16_get(qtype, in, c, w);
    if (qtype == Q4_K) {
      int sc[8], mn[8];
      for (int s = 0; s < 8; ++s) {
        sc[s] = in[64 + 16 * s + c];
        mn[s] = in[192 + 32 * (s / 2) + 2 * c + s % 2];
      }
      std::memcpy(blk, in + 2 * c, 2);
      std::memcpy(blk + 2, in + 32 + 2 * c, 2);
      pack_q4k_scales(sc, mn, blk + 4);
      for (int h = 0; h < 4; ++h)
        for (int l = 0; l < 32; ++l) blk[16 + 32 * h + l] = (uint8_t)(u[64 * h + l] | (u[64 * h + 32 + l] << 4));
    } else if (qtype == Q6_K) {
      pack_q6k(u, blk);
      for (int g = 0; g < 16; ++g) blk[192 + g] = in[32 + 16 * g + c];
      std::memcpy(blk + 208, in + 2 * c, 2);
    } else if (qtype == Q8_0) {
      std::memcpy(blk, in + 2 * c, 2);
      for (int w = 0; w < 32; ++w) blk[2 + w] = (uint8_t)(u[w] ^ 0x80);
    } else if (nibbles_only(qtype)) {
      std::memcpy(blk, in + 2 * c, 2);
      for (int l = 0; l < 16; ++l) blk[2 + l] = (uint8_t)(u[l] | (u[l + 16] << 4));
    } else {  // Q5_0
      std::memcpy(blk, in + 2 * c, 2);
      uint32_t qh = 0;
      for (int l = 0; l < 16; ++l) {
        blk[6 + l] = (uint8_t)((u[l] & 0x0F) | ((u[l + 16] & 0x0F) << 4));
        qh |= (uint32_t)(u[l] >> 4) << l | (uint32_t)(u[l + 16] >> 4) << (l + 16);
      }
      std::memcpy(blk + 2, &qh, 4);
    }
  }
}

// Scalar form of the x16 kernels, reading the packed bytes: the same integer sums, in plain loops (the reference
// the VNNI code is held to, and what a build without VNNI runs on these layouts).
void x16_scalar(int64_t qtype, const Job& j, int64_t g, int64_t r0, int64_t r1) {
  const X16 f = x16_format(qtype);
  float acc[kTile][kRows16] = {{0}};
  for (int64_t b = 0; b < j.blocks; ++b) {
    const uint8_t* blk = j.w + g * j.row_bytes + b * f.bytes;
    for (int c = 0; c < kRows16; ++c) {
      const float d = half(blk + 2 * c);
      int u[256];
      for (int w = 0; w < f.weights; ++w) u[w] = x16_value(qtype, x16_get(qtype, blk, c, w));
      for (int64_t r = r0; r < r1; ++r) {
        float& out = acc[r - r0][c];
        if (qtype == Q4_K) {
          const ActK& a = static_cast<const ActK*>(j.act)[r * j.blocks + b];
          int sumi = 0, summ = 0;
          for (int s = 0; s < 8; ++s) {
            int dot = 0;
            for (int l = 0; l < 32; ++l) dot += u[32 * s + l] * a.qs[32 * s + l];
            sumi += blk[64 + 16 * s + c] * dot;
            summ += blk[192 + 32 * (s / 2) + 2 * c + s % 2] * a.bsum32[s];
          }
          out += a.d * d * (float)sumi - a.d * half(blk + 32 + 2 * c) * (float)summ;
        } else if (qtype == Q6_K) {
          const ActK& a = static_cast<const ActK*>(j.act)[r * j.blocks + b];
          int sumi = 0;
          for (int gq = 0; gq < 16; ++gq) {
            int dot = 0;
            for (int l = 0; l < 16; ++l) dot += u[16 * gq + l] * a.qs[16 * gq + l];
            sumi += static_cast<int8_t>(blk[32 + 16 * gq + c]) * (dot - 32 * a.bsums[gq]);
          }
          out += a.d * d * (float)sumi;
        } else {
          const Act32& a = static_cast<const Act32*>(j.act)[r * j.blocks + b];
          int dot = 0;
          for (int l = 0; l < 32; ++l) dot += u[l] * a.qs[l];
          out += a.d * d * (float)(dot - f.offset * a.sum);
        }
      }
    }
  }
  for (int64_t r = r0; r < r1; ++r)
    for (int c = 0; c < kRows16; ++c) j.y[r * j.n + g * kRows16 + c] = acc[r - r0][c];
}

#ifdef ARB_VNNI
// Loads and conversions (the emulated build writes out the ones SIMDe 0.7 lacks, in plain C++: exact either way)
inline __m512i load64(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline __m512i bcast4(const int8_t* p, int64_t at) {
  int32_t v;
  std::memcpy(&v, p + at, 4);
  return _mm512_set1_epi32(v);
}
inline __mmask64 mask_at(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return (__mmask64)v;
}
#ifdef ARB_SIMDE
template <typename T>
inline __m512i widen16(const T* p) {  // 16 bytes -> 16 int32
  alignas(64) int32_t v[16];
  for (int i = 0; i < 16; ++i) v[i] = p[i];
  return _mm512_load_si512(v);
}
inline __m512i widen_u8_i16(const uint8_t* p) {  // 32 bytes -> 32 int16
  alignas(64) int16_t v[32];
  for (int i = 0; i < 32; ++i) v[i] = p[i];
  return _mm512_load_si512(v);
}
inline __m512 to_float(__m512i x) {
  alignas(64) int32_t v[16];
  alignas(64) float o[16];
  _mm512_store_si512(v, x);
  for (int i = 0; i < 16; ++i) o[i] = (float)v[i];
  return _mm512_load_ps(o);
}
inline __m512 halves16(const uint8_t* p) {
  alignas(64) float o[16];
  for (int i = 0; i < 16; ++i) o[i] = half(p + 2 * i);
  return _mm512_load_ps(o);
}
#else
template <typename T>
inline __m512i widen16(const T* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (std::is_signed_v<T>) return _mm512_cvtepi8_epi32(v);
  return _mm512_cvtepu8_epi32(v);
}
inline __m512i widen_u8_i16(const uint8_t* p) {
  return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 to_float(__m512i x) { return _mm512_cvtepi32_ps(x); }
inline __m512 halves16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

constexpr int kRowsVnni = 8;  // rows of X a kernel call keeps in registers (accumulators + one chunk's weights)

// Q4_K x16, R rows of X from r0, one group of 16 rows of W: per 32-weight sub-block, 8 weight registers unpacked
// once, then per row 8 dot instructions and one multiply by the 16 scales; the mins term per block and row.
template <int R>
void q4k16_vnni(const Job& j, int64_t g, int64_t r0) {
  const ActK* act = static_cast<const ActK*>(j.act) + r0 * j.blocks;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < j.blocks; ++b) {
    const uint8_t* blk = j.w + g * j.row_bytes + b * 2368;
    __m512i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    for (int s = 0; s < 8; ++s) {
      prefetch_part(blk + 2 * 2368, 2368, s, 8);
      const __m512i scale = widen16(blk + 64 + 16 * s);  // (16 rows,) int32
      __m512i w[8];
      for (int p = 0; p < 4; ++p) {
        const __m512i v = load64(blk + 320 + 64 * (4 * s + p));
        w[2 * p] = _mm512_and_si512(v, low4);
        w[2 * p + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* aq = act[r * j.blocks + b].qs + 32 * s;
        __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], bcast4(aq, 0));
        for (int i = 1; i < 8; ++i) dot = _mm512_dpbusd_epi32(dot, w[i], bcast4(aq, 4 * i));
        isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(dot, scale));
      }
    }
    const __m512 d = halves16(blk), dmin = halves16(blk + 32);
    __m512i mins[4];  // (16 rows x 2 sub-blocks,) int16: the mins of sub-blocks 2p and 2p + 1
    for (int p = 0; p < 4; ++p) mins[p] = widen_u8_i16(blk + 192 + 32 * p);
    for (int r = 0; r < R; ++r) {
      const ActK& a = act[r * j.blocks + b];
      __m512i msum = _mm512_setzero_si512();
      for (int p = 0; p < 4; ++p) {  // min(2p) x sum(2p) + min(2p+1) x sum(2p+1), per row of W
        int32_t pair;
        std::memcpy(&pair, a.bsum32 + 2 * p, 4);
        msum = _mm512_add_epi32(msum, _mm512_madd_epi16(mins[p], _mm512_set1_epi32(pair)));
      }
      const __m512 ad = _mm512_set1_ps(a.d);
      const __m512 f = _mm512_fmadd_ps(to_float(isum[r]), _mm512_mul_ps(d, ad), acc[r]);
      acc[r] = _mm512_fnmadd_ps(to_float(msum), _mm512_mul_ps(dmin, ad), f);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(j.y + (r0 + r) * j.n + g * kRows16, acc[r]);
}

// Q6_K x16: per 16-weight group, 4 weight registers (nibbles, then bits 4 and 5 by masked adds) unpacked once; per
// row the dot starts at -32 x the activations' 16-sum (the offset), 4 dot instructions, one multiply by the scales.
template <int R>
void q6k16_vnni(const Job& j, int64_t g, int64_t r0) {
  const ActK* act = static_cast<const ActK*>(j.act) + r0 * j.blocks;
  const __m512i low4 = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(16), bit5 = _mm512_set1_epi8(32);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < j.blocks; ++b) {
    const uint8_t* blk = j.w + g * j.row_bytes + b * 3360;
    __m512i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    for (int gq = 0; gq < 16; ++gq) {
      prefetch_part(blk + 2 * 3360, 3360, gq, 16);
      const __m512i scale = widen16(reinterpret_cast<const int8_t*>(blk + 32 + 16 * gq));
      __m512i w[4];
      for (int p = 0; p < 2; ++p) {
        const __m512i v = load64(blk + 288 + 64 * (2 * gq + p));
        w[2 * p] = _mm512_and_si512(v, low4);
        w[2 * p + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
      for (int t = 0; t < 4; ++t) {
        const uint8_t* m = blk + 2336 + 16 * (4 * gq + t);
        w[t] = _mm512_mask_add_epi8(w[t], mask_at(m), w[t], bit4);
        w[t] = _mm512_mask_add_epi8(w[t], mask_at(m + 8), w[t], bit5);
      }
      for (int r = 0; r < R; ++r) {
        const ActK& a = act[r * j.blocks + b];
        __m512i dot = _mm512_set1_epi32(a.offset16[gq]);  // a broadcast from memory
        for (int t = 0; t < 4; ++t) dot = _mm512_dpbusd_epi32(dot, w[t], bcast4(a.qs, 16 * gq + 4 * t));
        isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(dot, scale));
      }
    }
    const __m512 d = halves16(blk);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_fmadd_ps(to_float(isum[r]), _mm512_mul_ps(d, _mm512_set1_ps(act[r * j.blocks + b].d)), acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(j.y + (r0 + r) * j.n + g * kRows16, acc[r]);
}

// IQ4_NL's table + 128 (unsigned, 1..241) in each 128-bit lane, for the byte shuffle that looks weights up
inline __m512i iq4nl_table128() {
  alignas(64) uint8_t t[64];
  for (int i = 0; i < 64; ++i) t[i] = (uint8_t)(kIQ4NL[i % 16] + 128);
  return _mm512_load_si512(t);
}

// How many 32-blocks ahead the 32-block kernels prefetch (4.5 KB of Q4_0 / IQ4_NL, as far as Q4_K's two blocks):
// at 4 blocks (1.1 KB, ~40 ns of reading at M = 4) the loads came too late once the arithmetic of several rows
// slowed the stream, and the 0.5B q4_0 draft's matrices took 1.21x their M = 1 time at M = 4 (the down products:
// 1.5x, their 4864-wide rows' activations filling L1); at 16 blocks 1.03x, M = 1 unchanged (Zen 4, 2 threads;
// 8 blocks 1.15x, 32 or 64 no better than 16). Calls of 5-8 rows read further ahead: at M = 8, 24 blocks gave
// 1.13-1.14x the M = 1 time against 1.24-1.26x at 16 (M = 4 was 3% slower at 24, so it keeps 16).
constexpr int64_t kAhead32 = 16, kAhead32Wide = 24;

// The 32-blocks x16: a 32-block of 16 rows is 8 weight registers (Q5_0: nibbles and the 5th bit by a masked add;
// Q4_0: the nibbles; IQ4_NL: the nibbles' table values, one byte shuffle each); per row the dot starts at -offset x
// the block's activation sum, 8 dot instructions, and the float scales (16 rows x the row's) multiply once.
template <int64_t qtype, int R>
void q32x16_vnni(const Job& j, int64_t g, int64_t r0) {
  const Act32* act = static_cast<const Act32*>(j.act) + r0 * j.blocks;
  const X16 f = x16_format(qtype);
  const __m512i low4 = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(16);
  const __m512i table = qtype == IQ4_NL ? iq4nl_table128() : _mm512_setzero_si512();
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < j.blocks; ++b) {
    const uint8_t* blk = j.w + g * j.row_bytes + b * f.bytes;
    prefetch_block(blk + (R > 4 ? kAhead32Wide : kAhead32) * f.bytes, f.bytes);
    __m512i w[8];
    if constexpr (qtype == Q8_0) {
      for (int t = 0; t < 8; ++t) w[t] = load64(blk + 32 + 64 * t);
    } else {
      for (int p = 0; p < 4; ++p) {
        const __m512i v = load64(blk + 32 + 64 * p);
        w[2 * p] = _mm512_and_si512(v, low4);
        w[2 * p + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
      if constexpr (qtype == Q5_0)
        for (int t = 0; t < 8; ++t) w[t] = _mm512_mask_add_epi8(w[t], mask_at(blk + 288 + 8 * t), w[t], bit4);
      if constexpr (qtype == IQ4_NL)
        for (int t = 0; t < 8; ++t) w[t] = _mm512_shuffle_epi8(table, w[t]);
    }
    const __m512 d = halves16(blk);
    for (int r = 0; r < R; ++r) {
      const Act32& a = act[r * j.blocks + b];
      const int32_t start = qtype == Q5_0 ? a.offset16 : qtype == Q4_0 ? a.offset8 : a.offset128;
      __m512i dot = _mm512_set1_epi32(start);  // a broadcast from memory
      for (int t = 0; t < 8; ++t) dot = _mm512_dpbusd_epi32(dot, w[t], bcast4(a.qs, 4 * t));
      acc[r] = _mm512_fmadd_ps(to_float(dot), _mm512_mul_ps(d, _mm512_set1_ps(a.d)), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(j.y + (r0 + r) * j.n + g * kRows16, acc[r]);
}

template <int R>
void x16_vnni_rows(int64_t qtype, const Job& j, int64_t g, int64_t r0) {
  switch (qtype) {
    case Q4_K: return q4k16_vnni<R>(j, g, r0);
    case Q6_K: return q6k16_vnni<R>(j, g, r0);
    case Q5_0: return q32x16_vnni<Q5_0, R>(j, g, r0);
    case Q4_0: return q32x16_vnni<Q4_0, R>(j, g, r0);
    case IQ4_NL: return q32x16_vnni<IQ4_NL, R>(j, g, r0);
    default: return q32x16_vnni<Q8_0, R>(j, g, r0);
  }
}

// rows [r0, r1) in calls of up to kRowsVnni rows
void x16_vnni(int64_t qtype, const Job& j, int64_t g, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; r += kRowsVnni) {
    switch (std::min<int64_t>(kRowsVnni, r1 - r)) {
      case 1: x16_vnni_rows<1>(qtype, j, g, r); break;
      case 2: x16_vnni_rows<2>(qtype, j, g, r); break;
      case 3: x16_vnni_rows<3>(qtype, j, g, r); break;
      case 4: x16_vnni_rows<4>(qtype, j, g, r); break;
      case 5: x16_vnni_rows<5>(qtype, j, g, r); break;
      case 6: x16_vnni_rows<6>(qtype, j, g, r); break;
      case 7: x16_vnni_rows<7>(qtype, j, g, r); break;
      default: x16_vnni_rows<8>(qtype, j, g, r); break;
    }
  }
}
#endif  // ARB_VNNI


// ---------------------------------------------------------------------------------------------- dispatch

void run_tile(int64_t qtype, bool scalar, const Job& j, int64_t c0, int64_t c1, int64_t r0, int64_t r1) {
#ifdef ARB_AVX2
  if (!scalar) {
    switch (qtype) {
      case Q4_K: return q4k_avx2(j, c0, c1, r0, r1);
      case Q6_K: return q6k_avx2(j, c0, c1, r0, r1);
      default: return q32_avx2(qtype, j, c0, c1, r0, r1);
    }
  }
#endif
  switch (qtype) {
    case Q4_K: return q4k_scalar(j, c0, c1, r0, r1);
    case Q6_K: return q6k_scalar(j, c0, c1, r0, r1);
    default: return q32_scalar(qtype, j, c0, c1, r0, r1);
  }
}

void check_args(const at::Tensor& w, int64_t qtype, int64_t k, const at::Tensor& x) {
  TORCH_CHECK(covered(qtype), "no kernel for GGUF type ", qtype);
  const int64_t block = k_quant(qtype) ? 256 : 32;
  TORCH_CHECK(k > 0 && k % block == 0, "row length ", k, " is not a multiple of the block of ", block);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "weights: contiguous uint8 (n, row_bytes)");
  TORCH_CHECK(w.size(1) == k / block * block_bytes(qtype), "weights: ", w.size(1), " bytes a row, expected ",
              k / block * block_bytes(qtype));
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "activations: contiguous float32 (m, ", k, ")");
}

// X (m, k) quantized to 8-bit blocks: a byte tensor holding m x (k / block) ActK or Act32 records.
at::Tensor quantize_rows(const at::Tensor& x, int64_t qtype) {
  const int64_t m = x.size(0), k = x.size(1);
  const bool kq = k_quant(qtype);
  at::Tensor out = at::empty({m * arborspec::activation_bytes(kq, k)}, x.options().dtype(at::kByte));
  // the rows are contiguous: all m rows' blocks as one run of blocks
  arborspec::quantize_blocks(kq, x.data_ptr<float>(), 0, m * k / arborspec::activation_block(kq),
                             out.data_ptr<uint8_t>());
  return out;
}

// What every product starts with: X (m, k) checked and quantized for `qtype`, Y (m, n) allocated, the kernels' Job
// over W's `rows` (its file rows, or its packed groups) of `row_bytes`.
struct Product {
  at::Tensor act, y;
  Job job;
};

Product start_product(const uint8_t* w, int64_t row_bytes, int64_t n, int64_t qtype, int64_t k, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "activations: contiguous float32 (m, ", k, ")");
  Product p{quantize_rows(x, qtype), at::empty({x.size(0), n}, x.options()), {}};
  p.job = Job{w, row_bytes, p.act.data_ptr<uint8_t>(), k / file_block(qtype), p.y.data_ptr<float>(), n};
  return p;
}

// the file layout's sweeps [s0, s1) of kColumns columns (n in all), every tile of kTile rows of X (m in all)
void file_sweeps(int64_t qtype, bool scalar, const Job& job, int64_t n, int64_t m, int64_t s0, int64_t s1) {
  for (int64_t s = s0; s < s1; ++s) {
    const int64_t c0 = s * kColumns, c1 = std::min(n, c0 + kColumns);
    for (int64_t r0 = 0; r0 < m; r0 += kTile) run_tile(qtype, scalar, job, c0, c1, r0, std::min(m, r0 + kTile));
  }
}

at::Tensor matmul(const at::Tensor& w, int64_t qtype, int64_t k, const at::Tensor& x, bool scalar) {
  check_args(w, qtype, k, x);
  const int64_t m = x.size(0), n = w.size(0);
  const Product p = start_product(w.data_ptr<uint8_t>(), w.size(1), n, qtype, k, x);
  const int64_t sweeps = (n + kColumns - 1) / kColumns;
  at::parallel_for(0, sweeps, 1, [&](int64_t s0, int64_t s1) { file_sweeps(qtype, scalar, p.job, n, m, s0, s1); });
  return p.y;
}

// ---- the group loops every interleaved layout shares ---------------------------------------------------------------

// W (n, row_bytes) in the file's layout, n a multiple of `rows` -> (n / rows, blocks x `bytes`): `pack(group's first
// row, row_bytes, block, out)` writes block b of each group of `rows` weight rows.
template <typename Pack>
at::Tensor repack_groups(const at::Tensor& w, int64_t rows, int64_t blocks, int64_t bytes, const char* name,
                         Pack pack) {
  const int64_t n = w.size(0), row_bytes = w.size(1);
  TORCH_CHECK(n % rows == 0, name, " layout: ", n, " rows is not a multiple of ", rows);
  at::Tensor out = at::empty({n / rows, blocks * bytes}, w.options());
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, n / rows, 16, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < blocks; ++b)
        pack(src + g * rows * row_bytes, row_bytes, b, dst + (g * blocks + b) * bytes);
  });
  return out;
}

// The inverse: (groups, blocks x `bytes`) -> (groups x rows, row_bytes); `unpack(block in, group's first row out,
// row_bytes, block)`.
template <typename Unpack>
at::Tensor unpack_groups(const at::Tensor& packed, int64_t rows, int64_t blocks, int64_t bytes, int64_t row_bytes,
                         Unpack unpack) {
  const int64_t groups = packed.size(0);
  at::Tensor out = at::empty({groups * rows, row_bytes}, packed.options());
  const uint8_t* src = packed.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < blocks; ++b)
        unpack(src + (g * blocks + b) * bytes, dst + g * rows * row_bytes, row_bytes, b);
  });
  return out;
}

// The 8-row layouts' product loop (q4_K x8, x8): the groups in sweeps of kColumns columns, whose weights stay in L2
// while every tile of kTile rows of X passes over them; `run(g0, g1, r0, r1)` computes one sweep x tile.
constexpr int64_t kPerSweep8 = kColumns / 8;  // groups of 8 rows of W a sweep

template <typename Run>
void sweeps8(int64_t groups, int64_t m, int64_t s0, int64_t s1, Run run) {
  for (int64_t s = s0; s < s1; ++s) {
    const int64_t g0 = s * kPerSweep8, g1 = std::min(groups, g0 + kPerSweep8);
    for (int64_t r0 = 0; r0 < m; r0 += kTile) run(g0, g1, r0, std::min(m, r0 + kTile));
  }
}

template <typename Run>
void sweep_groups8(int64_t groups, int64_t m, Run run) {
  const int64_t sweeps = (groups + kPerSweep8 - 1) / kPerSweep8;
  at::parallel_for(0, sweeps, 1, [&](int64_t s0, int64_t s1) { sweeps8(groups, m, s0, s1, run); });
}

// Block b of one q4_K x8 group back into its 8 rows of the file's layout (repack_q4k_group's inverse).
void unpack_q4k_group(const uint8_t* grp, uint8_t* dst, int64_t row_bytes, int64_t b) {
  for (int c = 0; c < kGroup; ++c) {
    uint8_t* blk = dst + c * row_bytes + b * 144;
    std::memcpy(blk, grp + 2 * c, 2);
    std::memcpy(blk + 2, grp + 16 + 2 * c, 2);
    int sc[8], mn[8], q[256];
    for (int s = 0; s < 8; ++s) {
      sc[s] = grp[32 + 8 * s + c];
      mn[s] = grp[96 + 16 * (s / 2) + 2 * c + (s % 2)];
    }
    uint8_t* p = blk + 4;  // pack 8 scales and 8 mins of 6 bits back into 12 bytes
    for (int i = 0; i < 4; ++i) {
      p[i] = (uint8_t)((sc[i] & 63) | ((sc[i + 4] >> 4) << 6));
      p[i + 4] = (uint8_t)((mn[i] & 63) | ((mn[i + 4] >> 4) << 6));
      p[i + 8] = (uint8_t)((sc[i + 4] & 15) | ((mn[i + 4] & 15) << 4));
    }
    for (int s = 0; s < 8; ++s)
      for (int ch = 0; ch < 4; ++ch)
        for (int i = 0; i < 4; ++i) {
          const uint8_t v = grp[160 + ((s * 4 + ch) * kGroup + c) * 4 + i];
          q[32 * s + 8 * ch + i] = v & 0x0F;
          q[32 * s + 8 * ch + 4 + i] = v >> 4;
        }
    for (int h = 0; h < 4; ++h)
      for (int l = 0; l < 32; ++l) blk[16 + 32 * h + l] = (uint8_t)(q[64 * h + l] | (q[64 * h + 32 + l] << 4));
  }
}

// ---- the 8-row layouts (q4_K x8, q6_K x8, the 32-blocks' x8): repack, unpack, product -----------------------------

int64_t rows8_qtype(int64_t layout) {
  const int64_t qtype = layout - kLayout8;
  TORCH_CHECK(covered(qtype), "no 8-row layout numbered ", layout);
  return qtype;
}

// bytes of one packed block of 8 rows (256 weights a row for the K-quants, 32 for the others)
int64_t rows8_bytes(int64_t qtype) {
  return qtype == Q4_K ? kGroupBytes : qtype == Q6_K ? kQ6Group : x8_bytes(qtype);
}

void check_rows8(const at::Tensor& packed, int64_t qtype, int64_t k) {
  const int64_t block = file_block(qtype);
  TORCH_CHECK(k > 0 && k % block == 0, "row length ", k, " is not a multiple of the block of ", block);
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
              packed.size(1) == k / block * rows8_bytes(qtype),
              "8-row groups: contiguous uint8 (groups, ", k / block * rows8_bytes(qtype), ")");
}

// W (n, row_bytes) in the file's layout, n a multiple of 8 -> (n / 8, blocks x group bytes), and back.
at::Tensor repack_rows8(const at::Tensor& w, int64_t qtype, int64_t k) {
  check_args(w, qtype, k, at::empty({0, k}, at::kFloat));
  return repack_groups(w, kRows8, k / file_block(qtype), rows8_bytes(qtype), "8-row",
                       [qtype](const uint8_t* src, int64_t row_bytes, int64_t b, uint8_t* out) {
                         if (qtype == Q4_K) return repack_q4k_group(src, row_bytes, b, out);
                         if (qtype == Q6_K) return repack_q6k_group(src, row_bytes, b, out);
                         repack_x8_block(qtype, src, row_bytes, b, out);
                       });
}

at::Tensor unpack_rows8(const at::Tensor& packed, int64_t qtype, int64_t k) {
  check_rows8(packed, qtype, k);
  const int64_t blocks = k / file_block(qtype);
  return unpack_groups(packed, kRows8, blocks, rows8_bytes(qtype), blocks * block_bytes(qtype),
                       [qtype](const uint8_t* in, uint8_t* dst, int64_t row_bytes, int64_t b) {
                         if (qtype == Q4_K) return unpack_q4k_group(in, dst, row_bytes, b);
                         if (qtype == Q6_K) return unpack_q6k_group(in, dst, row_bytes, b);
                         unpack_x8_block(qtype, in, dst, row_bytes, b);
                       });
}

// groups [g0, g1) x rows [r0, r1) of X: the AVX2 kernel where the build has it, else the scalar one
void rows8_tile(int64_t qtype, bool scalar, const Job& job, int64_t g0, int64_t g1, int64_t r0, int64_t r1) {
#ifdef ARB_AVX2
  if (!scalar) {
    if (qtype == Q4_K) return k8_avx2<Q4_K>(job, g0, g1, r0, r1);
    if (qtype == Q6_K) return k8_avx2<Q6_K>(job, g0, g1, r0, r1);
    return x8_avx2(qtype, job, g0, g1, r0, r1);
  }
#endif
  (void)scalar;
  if (qtype == Q4_K) return q4k8_scalar(job, g0, g1, r0, r1);
  if (qtype == Q6_K) return q6k8_scalar(job, g0, g1, r0, r1);
  x8_scalar(qtype, job, g0, g1, r0, r1);
}

// Y (m, 8 x groups) from 8-row groups and X (m, k).
at::Tensor matmul_rows8(const at::Tensor& packed, int64_t qtype, int64_t k, const at::Tensor& x, bool scalar) {
  check_rows8(packed, qtype, k);
  const int64_t groups = packed.size(0);
  const Product p = start_product(packed.data_ptr<uint8_t>(), packed.size(1), groups * kRows8, qtype, k, x);
  sweep_groups8(groups, x.size(0), [&](int64_t g0, int64_t g1, int64_t r0, int64_t r1) {
    rows8_tile(qtype, scalar, p.job, g0, g1, r0, r1);
  });
  return p.y;
}

// ---- x16 layouts: repack, unpack, product ------------------------------------------------------------------------

int64_t x16_qtype(int64_t layout) {
  const int64_t qtype = layout - kLayout16;
  TORCH_CHECK(covered(qtype), "no x16 layout numbered ", layout);
  return qtype;
}

void check_x16(const at::Tensor& packed, int64_t qtype, int64_t k) {
  const int64_t block = file_block(qtype);
  TORCH_CHECK(k > 0 && k % block == 0, "row length ", k, " is not a multiple of the block of ", block);
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
              packed.size(1) == k / block * x16_format(qtype).bytes,
              "x16 groups: contiguous uint8 (groups, ", k / block * x16_format(qtype).bytes, ")");
}

// W (n, row_bytes) in the file's layout, n a multiple of 16 -> (n / 16, blocks x group bytes).
at::Tensor repack_x16(const at::Tensor& w, int64_t qtype, int64_t k) {
  check_args(w, qtype, k, at::empty({0, k}, at::kFloat));
  return repack_groups(w, kRows16, k / file_block(qtype), x16_format(qtype).bytes, "x16",
                       [qtype](const uint8_t* src, int64_t row_bytes, int64_t b, uint8_t* out) {
                         repack_x16_block(qtype, src, row_bytes, b, out);
                       });
}

at::Tensor unpack_x16(const at::Tensor& packed, int64_t qtype, int64_t k) {
  check_x16(packed, qtype, k);
  const int64_t blocks = k / file_block(qtype);
  return unpack_groups(packed, kRows16, blocks, x16_format(qtype).bytes, blocks * block_bytes(qtype),
                       [qtype](const uint8_t* in, uint8_t* dst, int64_t row_bytes, int64_t b) {
                         unpack_x16_block(qtype, in, dst, row_bytes, b);
                       });
}

// groups [g0, g1) of an x16 matrix, all m rows of X
void x16_groups(int64_t qtype, bool scalar, const Job& job, int64_t m, int64_t g0, int64_t g1) {
  (void)scalar;
  for (int64_t g = g0; g < g1; ++g) {
#ifdef ARB_VNNI
    if (!scalar) {
      x16_vnni(qtype, job, g, 0, m);
      continue;
    }
#endif
    for (int64_t r0 = 0; r0 < m; r0 += kTile) x16_scalar(qtype, job, g, r0, std::min(m, r0 + kTile));
  }
}

// Y (m, 16 x groups) from x16 groups and X (m, k): the VNNI kernels where the build has them, else the scalar ones.
at::Tensor matmul_x16(const at::Tensor& packed, int64_t qtype, int64_t k, const at::Tensor& x, bool scalar) {
  check_x16(packed, qtype, k);
  const int64_t m = x.size(0), groups = packed.size(0);
  const Product p = start_product(packed.data_ptr<uint8_t>(), packed.size(1), groups * kRows16, qtype, k, x);
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) { x16_groups(qtype, scalar, p.job, m, g0, g1); });
  return p.y;
}

// ---- any layout, by number (what matrix.py calls) -----------------------------------------------------------------

at::Tensor repack(const at::Tensor& w, int64_t layout, int64_t k) {
  if (layout >= kLayout8 && layout < kLayout16) return repack_rows8(w, rows8_qtype(layout), k);
  return repack_x16(w, x16_qtype(layout), k);
}

at::Tensor unpack(const at::Tensor& packed, int64_t layout, int64_t k) {
  if (layout >= kLayout8 && layout < kLayout16) return unpack_rows8(packed, rows8_qtype(layout), k);
  return unpack_x16(packed, x16_qtype(layout), k);
}

// y = x · Wᵀ for W in `layout` (a GGUF type: the file's rows; or a packed layout); `scalar` runs the portable code.
at::Tensor linear(const at::Tensor& w, int64_t layout, int64_t k, const at::Tensor& x, bool scalar) {
  if (layout >= kLayout8 && layout < kLayout16) return matmul_rows8(w, rows8_qtype(layout), k, x, scalar);
  if (layout >= kLayout16) return matmul_x16(w, x16_qtype(layout), k, x, scalar);
  return matmul(w, layout, k, x, scalar);
}


// The activations as the kernels see them (q x d, float32 (m, k)): for tests against the reference quantizer.
at::Tensor dequantized_activations(const at::Tensor& x, int64_t qtype) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "activations: float32 (m, k)");
  const int64_t m = x.size(0), k = x.size(1), block = k_quant(qtype) ? 256 : 32;
  TORCH_CHECK(k % block == 0, "row length ", k, " is not a multiple of ", block);
  const at::Tensor act = quantize_rows(x, qtype);
  at::Tensor out = at::empty({m, k}, x.options());
  float* po = out.data_ptr<float>();
  const uint8_t* pa = act.data_ptr<uint8_t>();
  for (int64_t i = 0; i < m * k / block; ++i) {
    for (int64_t l = 0; l < block; ++l) {
      if (block == 256) {
        const ActK& a = reinterpret_cast<const ActK*>(pa)[i];
        po[i * block + l] = a.d * a.qs[l];
      } else {
        const Act32& a = reinterpret_cast<const Act32*>(pa)[i];
        po[i * block + l] = a.d * a.qs[l];
      }
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------- rooflines
// What the benchmark divides by: the memory read rate (a streaming sum over a buffer larger than the caches, on
// torch's threads like the kernels) and the u8 x s8 multiply-add rate (independent chains of the instruction every
// kernel is built on; 32 multiply-adds each).

int64_t stream_sum(const at::Tensor& buffer) {
  const int64_t words = buffer.numel() / 8;
  const uint64_t* p = reinterpret_cast<const uint64_t*>(buffer.data_ptr<uint8_t>());
  return at::parallel_reduce(0, words / 16, 1 << 12, (int64_t)0, [&](int64_t a, int64_t b, int64_t acc) {
    uint64_t total = 0;
#ifdef ARB_AVX2
    __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
    for (int64_t i = a; i < b; ++i) {  // 128 bytes a step
      s0 = _mm256_add_epi64(s0, load(p + 16 * i));
      s1 = _mm256_add_epi64(s1, load(p + 16 * i + 4));
      s2 = _mm256_add_epi64(s2, load(p + 16 * i + 8));
      s3 = _mm256_add_epi64(s3, load(p + 16 * i + 12));
    }
    alignas(32) uint64_t lanes[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_add_epi64(_mm256_add_epi64(s0, s1), _mm256_add_epi64(s2, s3)));
    total = lanes[0] + lanes[1] + lanes[2] + lanes[3];
#else
    for (int64_t i = 16 * a; i < 16 * b; ++i) total += p[i];
#endif
    return acc + (int64_t)total;
  }, std::plus<int64_t>());
}

// Runs `iterations` x 8 independent u8 x s8 multiply-add instructions per thread (each multiply_add_width() products:
// vpdpbusd's 64 where the build has VNNI, vpmaddubsw's 32 otherwise); returns a checksum so nothing is elided.
int64_t multiply_add_loop(int64_t iterations) {
#if defined(ARB_VNNI) && !defined(ARB_SIMDE)
  return at::parallel_reduce(0, at::get_num_threads(), 1, (int64_t)0, [&](int64_t a, int64_t b, int64_t acc) {
    for (int64_t t = a; t < b; ++t) {
      const __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8((char)(t + 1));
      __m512i c[8];
      for (int i = 0; i < 8; ++i) c[i] = _mm512_set1_epi32(i);
      for (int64_t it = 0; it < iterations; ++it)
        for (int i = 0; i < 8; ++i) c[i] = _mm512_dpbusd_epi32(c[i], w, x);
      for (int i = 0; i < 8; ++i) acc += _mm_cvtsi128_si32(_mm512_castsi512_si128(c[i]));
    }
    return acc;
  }, std::plus<int64_t>());
#elif defined(ARB_AVX2)
  return at::parallel_reduce(0, at::get_num_threads(), 1, (int64_t)0, [&](int64_t a, int64_t b, int64_t acc) {
    for (int64_t t = a; t < b; ++t) {
      __m256i w = _mm256_set1_epi8(3), x = _mm256_set1_epi8((char)(t + 1));
      __m256i c[8];
      for (int i = 0; i < 8; ++i) c[i] = _mm256_set1_epi16((int16_t)i);
      for (int64_t it = 0; it < iterations; ++it)
        for (int i = 0; i < 8; ++i) c[i] = _mm256_maddubs_epi16(c[i], x);
      for (int i = 0; i < 8; ++i) acc += _mm256_extract_epi16(c[i], 0) + _mm256_extract_epi16(w, 0);
    }
    return acc;
  }, std::plus<int64_t>());
#else
  return iterations;
#endif
}

int64_t multiply_add_width() {
#if defined(ARB_VNNI) && !defined(ARB_SIMDE)
  return 64;
#else
  return 32;
#endif
}

std::string isa() {
#if defined(ARB_VNNI)
  return "avx512vnni";
#elif defined(ARB_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

at::Tensor layouts() {  // the layout numbers matrix.py uses, in the order of its names (build.py's LAYOUTS)
  using namespace arborspec;
  return at::tensor(std::vector<int64_t>{kQ4KByRows8, kQ4KByRows16, kQ6KByRows16, kQ5_0ByRows16, kQ8_0ByRows16,
                                        kQ4_0ByRows16, kIQ4NLByRows16, kQ4_0ByRows8, kIQ4NLByRows8, kQ5_0ByRows8,
                                        kQ8_0ByRows8, kQ6KByRows8},
                    at::kLong);
}

}  // namespace

namespace arborspec {

at::Tensor quant_linear(const at::Tensor& w, int64_t layout, int64_t k, const at::Tensor& x) {
  return linear(w, layout, k, x, false);
}

// ---- one product's output columns in units, for threads that already run (forward.cpp) ------------------------

namespace {
int64_t layout_qtype(int64_t layout) {
  if (layout >= kLayout16) return x16_qtype(layout);
  if (layout >= kLayout8) return rows8_qtype(layout);
  return layout;
}
}  // namespace

bool k_activations(int64_t layout) { return k_quant(layout_qtype(layout)); }

int64_t activation_block(bool kq) { return kq ? 256 : 32; }

int64_t activation_bytes(bool kq, int64_t k) {
  return k / activation_block(kq) * (int64_t)(kq ? sizeof(ActK) : sizeof(Act32));
}

void quantize_blocks(bool kq, const float* x, int64_t b0, int64_t b1, uint8_t* out) {
  for (int64_t b = b0; b < b1; ++b) {
    if (kq)
      quantize_k(x + b * 256, reinterpret_cast<ActK*>(out) + b);
    else
      quantize_32(x + b * 32, reinterpret_cast<Act32*>(out) + b);
  }
}

void check_weights(const at::Tensor& w, int64_t layout, int64_t k) {
  if (layout >= kLayout16) return check_x16(w, x16_qtype(layout), k);
  if (layout >= kLayout8) return check_rows8(w, rows8_qtype(layout), k);
  check_args(w, layout, k, at::empty({0, k}, at::kFloat));
}

int64_t output_columns(const at::Tensor& w, int64_t layout) {
  if (layout >= kLayout8 && layout < kLayout16) return w.size(0) * kRows8;
  if (layout >= kLayout16) return w.size(0) * kRows16;
  return w.size(0);
}

int64_t column_units(const at::Tensor& w, int64_t layout) {
  return (output_columns(w, layout) + kUnitColumns - 1) / kUnitColumns;
}

// units are kColumns (16) columns: a file-layout sweep, an 8-row layout's sweep of two groups, an x16 group; each
// unit runs through the very calls linear() makes for it (the same tiles of rows), so its values are the same bits
void run_units(const at::Tensor& w, int64_t layout, int64_t k, const uint8_t* act, int64_t m, float* y, int64_t ldy,
               int64_t u0, int64_t u1) {
  static_assert(kUnitColumns == kColumns && kColumns == kRows16 && kPerSweep8 * 8 == kColumns, "unit of 16 columns");
  const int64_t qtype = layout_qtype(layout);
  const Job job{w.data_ptr<uint8_t>(), w.size(1), act, k / file_block(qtype), y, ldy};
  if (layout >= kLayout16) {
    x16_groups(qtype, false, job, m, u0, u1);
  } else if (layout >= kLayout8) {
    sweeps8(w.size(0), m, u0, u1, [&](int64_t g0, int64_t g1, int64_t r0, int64_t r1) {
      rows8_tile(qtype, false, job, g0, g1, r0, r1);
    });
  } else {
    file_sweeps(qtype, false, job, w.size(0), m, u0, u1);
  }
}

void dequantize_rows(const at::Tensor& w, int64_t qtype, int64_t k, const int64_t* ids, int64_t count, float* out) {
  check_args(w, qtype, k, at::empty({0, k}, at::kFloat));
  const int64_t n = w.size(0), row_bytes = w.size(1);
  const uint8_t* base = w.data_ptr<uint8_t>();
  for (int64_t r = 0; r < count; ++r) {
    TORCH_CHECK(ids[r] >= 0 && ids[r] < n, "token id ", ids[r], " is outside the table's ", n, " rows");
    const uint8_t* row = base + ids[r] * row_bytes;
    float* o = out + r * k;
    if (qtype == Q4_K) {
      for (int64_t b = 0; b < k / 256; ++b) {
        const uint8_t* blk = row + b * 144;
        const float d = half(blk), dmin = half(blk + 2);
        int q[256], sc[8], mn[8];
        unpack_q4k(blk, q, sc, mn);
        for (int i = 0; i < 256; ++i) o[256 * b + i] = d * sc[i / 32] * q[i] - dmin * mn[i / 32];
      }
    } else if (qtype == Q6_K) {
      for (int64_t b = 0; b < k / 256; ++b) {
        const uint8_t* blk = row + b * 210;
        const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
        const float d = half(blk + 208);
        int q[256];
        unpack_q6k(blk, q);
        for (int i = 0; i < 256; ++i) o[256 * b + i] = d * sc[i / 16] * (q[i] - 32);
      }
    } else {
      const int64_t bytes = block_bytes(qtype);
      for (int64_t b = 0; b < k / 32; ++b) {
        const uint8_t* blk = row + b * bytes;
        const float d = half(blk);
        int q[32];
        unpack_32(qtype, blk, q);
        for (int i = 0; i < 32; ++i) o[32 * b + i] = d * q[i];
      }
    }
  }
}

}  // namespace arborspec

namespace {

// rows `ids` (long) of a file-layout matrix, dequantized (len(ids), k): for tests of dequantize_rows
at::Tensor embedding_rows(const at::Tensor& w, int64_t qtype, int64_t k, const at::Tensor& ids) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.is_contiguous(), "ids: contiguous int64 (count,)");
  at::Tensor out = at::empty({ids.size(0), k}, at::kFloat);
  arborspec::dequantize_rows(w, qtype, k, ids.data_ptr<int64_t>(), ids.size(0), out.data_ptr<float>());
  return out;
}

}  // namespace

ARB_TORCH_LIBRARY(ARB_OPS, m) {
  m.def("layouts() -> Tensor", &layouts);
  m.def("embedding_rows(Tensor w, int qtype, int k, Tensor ids) -> Tensor", &embedding_rows);
  m.def("matmul(Tensor w, int qtype, int k, Tensor x, bool scalar) -> Tensor", &matmul);
  m.def("dequantized_activations(Tensor x, int qtype) -> Tensor", &dequantized_activations);
  m.def("isa() -> str", &isa);
  m.def("stream_sum(Tensor buffer) -> int", &stream_sum);
  m.def("multiply_add_loop(int iterations) -> int", &multiply_add_loop);
  m.def("multiply_add_width() -> int", &multiply_add_width);
  m.def("repack(Tensor w, int layout, int k) -> Tensor", &repack);
  m.def("unpack(Tensor packed, int layout, int k) -> Tensor", &unpack);
  m.def("linear(Tensor w, int layout, int k, Tensor x, bool scalar) -> Tensor", &linear);
}
