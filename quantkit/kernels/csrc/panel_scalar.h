// The panel GEMM for float32 activations in portable C++: correct on any CPU the compiler targets (ARM64 included),
// and the path every machine can test. Each panel is unpacked to float32 u (exact) and each group summed input by
// input in plain loops the compiler may vectorise across the 16 channels; the group arithmetic is panel_gemm.h's.

#pragma once

#include "panel_gemm.h"

#include <cstring>

namespace {
namespace panel {
namespace scalar {

using Problem = panel::Problem<float>;

inline uint32_t dword(const uint8_t* p) {
  uint32_t d;
  std::memcpy(&d, p, 4);
  return d;  // little-endian hosts (x86-64, ARM64 as Linux runs it)
}

// Panel `panel` as float32 u into w [K][16]; bits 4, 8 or 16 (bf16 pairs).
inline void unpack(const Problem& pb, int bits, int64_t panel, float* w) {
  for (int64_t line = 0; line < pb.k / 8; ++line)
    for (int64_t c = 0; c < kPanel; ++c)
      for (int i = 0; i < 4; ++i) {
        const int64_t t = 8 * line + 2 * i;
        float even, odd;
        if (bits == 16) {
          const uint16_t* pair = pb.dense + ((panel * (pb.k / 2) + t / 2) * kPanel + c) * 2;
          even = __builtin_bit_cast(float, static_cast<uint32_t>(pair[0]) << 16);
          odd = __builtin_bit_cast(float, static_cast<uint32_t>(pair[1]) << 16);
        } else {
          const int v = bits == 8 ? 2 : 1;
          const uint8_t* at = pb.packed + (panel * (pb.k / 8) + line) * v * 64 + 4 * c;
          uint32_t e = even_nibble(dword(at), i), o = odd_nibble(dword(at), i);
          if (bits == 8) {
            e += 16 * even_nibble(dword(at + 64), i);
            o += 16 * odd_nibble(dword(at + 64), i);
          }
          even = static_cast<float>(e);
          odd = static_cast<float>(o);
        }
        w[t * kPanel + c] = even;
        w[(t + 1) * kPanel + c] = odd;
      }
}

inline void run(const Problem& pb, int bits) {
  const int64_t panels = pb.n / kPanel;
  const float bias = zero_bias(bits);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w(pb.k * kPanel);
    for (int64_t panel = begin; panel < end; ++panel) {
      unpack(pb, bits, panel, w.data());
      for (int64_t row = 0; row < pb.m; ++row) {
        const float* x = pb.x + row * pb.k;
        float out[kPanel] = {};
        for (int64_t g = 0; g < pb.groups; ++g) {
          float acc[kPanel] = {};
          for (int64_t t = g * pb.group; t < (g + 1) * pb.group; ++t)
            for (int64_t c = 0; c < kPanel; ++c) acc[c] += x[t] * w[t * kPanel + c];
          const int64_t at = (panel * pb.groups + g) * kPanel;
          const float xs = pb.xsum[row * pb.groups + g];
          for (int64_t c = 0; c < kPanel; ++c) out[c] += pb.scale[at + c] * (acc[c] - ((pb.zero ? pb.zero[at + c] : pb.zero_const) - bias) * xs);
        }
        std::memcpy(pb.y + row * pb.n + panel * kPanel, out, sizeof(out));
      }
    }
  });
}

// The dense weight, transposed: wt [K, N] float32 or bfloat16 = (u - (8 + zp)) * scale (see panel_f32.h's).
template <typename Out>
inline void dequant_t(const Problem& pb, int bits, Out* wt) {
  const float bias = zero_bias(bits);
  at::parallel_for(0, pb.n / kPanel, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w(pb.k * kPanel);
    for (int64_t panel = begin; panel < end; ++panel) {
      unpack(pb, bits, panel, w.data());
      for (int64_t t = 0; t < pb.k; ++t)
        for (int64_t c = 0; c < kPanel; ++c) {
          const int64_t at = (panel * pb.groups + t / pb.group) * kPanel + c;
          wt[t * pb.n + panel * kPanel + c] = static_cast<Out>((w[t * kPanel + c] - ((pb.zero ? pb.zero[at] : pb.zero_const) - bias)) * pb.scale[at]);
        }
    }
  });
}

}  // namespace scalar
}  // namespace panel
}  // namespace
