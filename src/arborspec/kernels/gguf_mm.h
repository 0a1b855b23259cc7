// The kernels' C++ entry points for other native code in this library (the forward step, kernels/forward.cpp).
//
// A weight matrix is held as kernels/matrix.py's QuantMatrix holds it: `data` (uint8, one row per weight row or per
// packed group of rows) and `layout`, an integer naming how its bytes are arranged: a GGUF type number for blocks in
// the file's row layout, or a packed layout below. Python and C++ agree on these numbers through kernels/build.py
// (`LAYOUTS`, read from `layouts()`), which matrix.py uses.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace arborspec {

// GGUF block types the kernels cover (their GGUF type numbers)
enum QType : int64_t { Q4_0 = 2, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q6_K = 14, IQ4_NL = 20 };

// Packed layouts: the same bits as the file's blocks, rearranged for the products (see gguf_mm.cpp)
enum Layout : int64_t {
  kQ4KByRows8 = 1000 + Q4_K,  // Q4_K, 8 rows interleaved ("q4_K x8"; AVX2)
  kQ6KByRows8 = 1000 + Q6_K,  // Q6_K, the same ("q6_K x8"; AVX2)
  // the 32-blocks, 8 rows interleaved, one 32-bit lane of a 256-bit register per row ("x8"; AVX2)
  kQ4_0ByRows8 = 1000 + Q4_0,
  kIQ4NLByRows8 = 1000 + IQ4_NL,
  kQ5_0ByRows8 = 1000 + Q5_0,
  kQ8_0ByRows8 = 1000 + Q8_0,
  // 16 rows interleaved, one 32-bit lane of a 512-bit register per row ("x16"; AVX-512 VNNI), every type
  kQ5_0ByRows16 = 2000 + Q5_0,
  kQ8_0ByRows16 = 2000 + Q8_0,
  kQ4KByRows16 = 2000 + Q4_K,
  kQ6KByRows16 = 2000 + Q6_K,
  kQ4_0ByRows16 = 2000 + Q4_0,
  kIQ4NLByRows16 = 2000 + IQ4_NL,
};

// y (m, n) float32 = x (m, k) float32 · Wᵀ, W (n, k) held as `w` in `layout`: the best path this build runs.
at::Tensor quant_linear(const at::Tensor& w, int64_t layout, int64_t k, const at::Tensor& x);

// ---- one product split over threads that already run (forward.cpp runs a whole forward in one parallel region,
// where at::parallel_for would run on one thread). The caller quantizes X once per block format and splits the
// output columns in units of kUnitColumns; every unit runs the same kernel calls as quant_linear, so an output value
// is the same bits whichever thread computes it and however the units are split.
constexpr int64_t kUnitColumns = 16;

// whether a layout's kernels take X in 256-value blocks (the K-quants) rather than 32-value ones
bool k_activations(int64_t layout);
int64_t activation_block(bool kq);  // 256 or 32 values
int64_t activation_bytes(bool kq, int64_t k);  // one row of X (k values), quantized
// blocks [b0, b1) of one row of X: x its first value, out its first quantized byte
void quantize_blocks(bool kq, const float* x, int64_t b0, int64_t b1, uint8_t* out);
// the checks quant_linear makes on a matrix (a one-line error), before any run_units
void check_weights(const at::Tensor& w, int64_t layout, int64_t k);
int64_t output_columns(const at::Tensor& w, int64_t layout);
int64_t column_units(const at::Tensor& w, int64_t layout);
// y[r * ldy + c] for every row r < m of X and the columns c of units [u0, u1); `act` holds the m rows of X quantized
// for this layout's block format (activation_bytes apart)
void run_units(const at::Tensor& w, int64_t layout, int64_t k, const uint8_t* act, int64_t m, float* y, int64_t ldy,
               int64_t u0, int64_t u1);

// Rows `ids` of a matrix in a file row layout (an embedding table), dequantized: out (len(ids), k) float32.
void dequantize_rows(const at::Tensor& w, int64_t qtype, int64_t k, const int64_t* ids, int64_t count, float* out);

}  // namespace arborspec
