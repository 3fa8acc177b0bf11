// y = x W^T for 4-bit (or 8-bit) weights: the linear layers of a decode step and, for float32 activations, of
// prefill too. Three implementations of one arithmetic, chosen by what the module was compiled for:
//   panel_bf16.h    bfloat16 activations on AVX-512 BF16 (vdpbf16ps)
//   panel_f32.h     float32 activations on any x86-64 with AVX2 + FMA (AVX-512: twice the lanes)
//   panel_scalar.h  float32 activations in plain C++, for every other CPU (ARM64 included)
// PyTorch's int4 op runs at about half the rate of a bf16 GEMM on the same shapes at 8-64 rows and at 1/30 of it
// with float32 activations; these unpack each weight once per call and reuse it for every row (bench/panel_gemm.py).
//
// Weight layout (repacked at load, formats/pack.py `pack_int4_panels`): panels of 16 output channels,
//   packed uint8 [N/16, K/8, 64]: 16 little-endian dwords a line, dword c holding channel c's inputs 8L..8L+7 as
//                u = q + 8 in [0, 15]: input 8L + 2i in bits 4i..4i+3, input 8L + 2i + 1 in bits 16+4i..19+4i
//   params  f32  [2, N/16, G, 16]: the group scales, then 136 + zero_point; symmetric weights: [1, N/16, G, 16],
//                the scales alone (the zero plane would be one constant, 136, and is 6% of a decode step's bytes)
// So one 64-byte load holds four pairs of inputs for the panel, and pair i is (line >> 4i) & 0x000F000F.
// Each group sums x * (bias + u) in float32 and adds scale * (acc - (bias + 8 + zp) * sum(x)) = scale * sum(x * (q - zp)):
// bias 128 on AVX-512 BF16 (OR-ing u into the bits of bfloat16 128.0 reads as 128 + u, one op a pair; products of
// two 8-bit mantissas are exact), bias 0 for float32 activations (u converted to float exactly).
// 8-bit weights (u = q + 128 in [0, 255]) are two such nibble planes, [N/16, K/8, 128]: the low nibbles' line, then
// the high nibbles' line; params hold 2304 + zp (bfloat16 reads the high nibbles with bias 0x4500 = 16 * (128 + h),
// so one accumulator takes x * (u + 2176)). An int8 head then reads half the bytes of the bf16 one.
// The same tiles serve a bfloat16 weight held as panels of pairs, bf16 [N/16, K/2, 16, 2] (one group, scale 1,
// zero 0): the lm_head, 2.5x oneDNN's bf16 GEMM at one row and 1.3x at 32.
// Weights are never rounded, and each output is computed the same way whatever the batch, so a row's result does
// not depend on its batch.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <utility>
#include <vector>

// Everything here has internal linkage: each ISA's build of the module is its own shared object, and two of them
// loaded in one process (the tests compare them) must not resolve each other's inline functions.
namespace {
namespace panel {

constexpr int64_t kPanel = 16;  // output channels per panel

template <typename X>  // X: uint16_t (bfloat16 bits) or float
struct Problem {
  const X* x;             // [M, K]
  const uint8_t* packed;  // int4 panels [N/16, K/8, 64] or int8 [N/16, K/8, 128]; null when the weight is
  const uint16_t* dense;  // bf16 panels [N/16, K/2, 16, 2] (else null)
  const float* xsum;      // [M, G] float32 sum of x over each group
  const float* scale;     // [N/16, G, 16]
  const float* zero;      // [N/16, G, 16]: 136 + zero_point (int4), 2304 + zero_point (int8), 0 (bf16); null: zero_const
  X* y;                   // [M, N]
  int64_t m, k, n, groups, group;
  float zero_const;       // every zero when `zero` is null (symmetric weights): symmetric_zero(bits)
};

// What params' zero plane holds above the float32 kernels' 8 + zp (int4) or 128 + zp (int8): the bfloat16 biases.
inline float zero_bias(int bits) { return bits == 8 ? 2176.f : bits == 4 ? 128.f : 0.f; }

// The zero plane of symmetric weights (zero point 0), which params then leave out.
inline float symmetric_zero(int bits) { return bits == 8 ? 2304.f : bits == 4 ? 136.f : 0.f; }

// The pair I (0..3) of line L's nibbles for channel dword d: u of inputs 8L + 2I and 8L + 2I + 1.
inline uint32_t even_nibble(uint32_t d, int i) { return (d >> (4 * i)) & 15u; }
inline uint32_t odd_nibble(uint32_t d, int i) { return (d >> (16 + 4 * i)) & 15u; }

}  // namespace panel
}  // namespace

#include "panel_bf16.h"
#include "panel_f32.h"
#include "panel_scalar.h"
