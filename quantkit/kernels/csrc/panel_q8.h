// int4 panels against int8 activations: the decode GEMM of `activations="int8"` (llama.cpp's arithmetic for its
// 4-bit weights, which multiply 8-bit quantised activations). Float32 activations cost a float conversion per
// weight (panel_f32.h: ~6 weights a cycle a core on AVX2, below the memory's rate for one row); here a line of a
// panel (8 channels x 8 inputs in 32 bytes) is two masks, one shift and two vpmaddubsw (30 SmolLM2 layers at one
// row on a Zen 3: 6.6 -> 4.0 ms; four 1.5B layers 11.4 -> 5.3 ms, 18 GB/s).
//
// Each row's inputs are quantised per group (the weight's, at most Linear's Q8_GROUP): dx = max|x| / 127, x8 = round-half-even(x / dx) in [-127, 127].
// A group's products u * x8 (u = q + 8 in [0, 15]) sum exactly in int32; then
//   y += (scale * dx) * (sum(u * x8) - (8 + zp) * sum(x8))
// in float32, the bracket exact (integers below 2^24). Integer sums do not depend on their order, so the vector
// and portable loops below give the same bits, and a row's result does not depend on its batch.
//
// Layout (panel_gemm.h): dword c of a line holds channel c's inputs 0, 2, 4, 6 in bytes 0-1 (low, high nibble),
// 1, 3, 5, 7 in bytes 2-3. Masking the low nibbles gives bytes (in0, in4, in1, in5), the high ones (in2, in6, in3,
// in7): the activations are stored in that order per line (kOrder), so one broadcast dword meets each.

#pragma once

#include "panel_gemm.h"

#include <cmath>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {
namespace panel {
namespace q8 {

constexpr int kOrder[8] = {0, 4, 1, 5, 2, 6, 3, 7};  // position p of a line's activations holds input kOrder[p]

struct Problem {
  const int8_t* x;        // [M, K] quantised, each line's 8 in kOrder
  const float* dx;        // [M, G] the rows' group scales
  const float* xsum;      // [M, G] sum(x8) over each group (exact in float32)
  const uint8_t* packed;  // int4 panels [N/16, K/8, 64]
  const float* scale;     // [N/16, G, 16]
  const float* zero;      // [N/16, G, 16] 136 + zero point; null: zero_const
  float* y;               // [M, N]
  int64_t m, k, n, groups, group;
  float zero_const;
};

// x [M, K] float32 -> x8 in kOrder, dx and xsum per group (the inputs of Problem).
inline void quantize(const float* x, int64_t m, int64_t k, int64_t group, int8_t* x8, float* dx, float* xsum) {
  const int64_t groups = k / group;
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const float* in = x + r * k + g * group;
      float amax = 0.f;
      for (int64_t t = 0; t < group; ++t) amax = std::max(amax, std::fabs(in[t]));
      const float d = amax > 0.f ? amax / 127.f : 1.f;
      int sum = 0;
      for (int64_t t = 0; t < group; t += 8)
        for (int p = 0; p < 8; ++p) {
          const int v = static_cast<int>(std::nearbyint(in[t + kOrder[p]] / d));  // |v| <= 127
          x8[r * k + g * group + t + p] = static_cast<int8_t>(v);
          sum += v;
        }
      dx[r * groups + g] = d;
      xsum[r * groups + g] = static_cast<float>(sum);
    }
}

// The group epilogue for one channel's integer sum: one float rounding of (scale * dx), one of the FMA.
inline float finish(float out, int32_t acc, float scale, float dx, float zero, float xsum) {
  return std::fma(scale * dx, static_cast<float>(acc) - (zero - 128.f) * xsum, out);
}

namespace portable {

inline void run(const Problem& pb) {
  const int64_t lines = pb.group / 8;
  at::parallel_for(0, pb.n / kPanel, 1, [&](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end; ++panel)
      for (int64_t r = 0; r < pb.m; ++r)
        for (int64_t c = 0; c < kPanel; ++c) {
          float out = 0.f;
          for (int64_t g = 0; g < pb.groups; ++g) {
            int32_t acc = 0;
            for (int64_t line = g * lines; line < (g + 1) * lines; ++line) {
              uint32_t d;
              std::memcpy(&d, pb.packed + (panel * (pb.k / 8) + line) * 64 + 4 * c, 4);
              const int8_t* xl = pb.x + r * pb.k + 8 * line;
              for (int b = 0; b < 4; ++b) {  // byte b: low nibble meets position b, high nibble position 4 + b
                acc += static_cast<int32_t>((d >> (8 * b)) & 15u) * xl[b];
                acc += static_cast<int32_t>((d >> (8 * b + 4)) & 15u) * xl[4 + b];
              }
            }
            const int64_t at = (panel * pb.groups + g) * kPanel + c;
            out = finish(out, acc, pb.scale[at], pb.dx[r * pb.groups + g], pb.zero ? pb.zero[at] : pb.zero_const,
                         pb.xsum[r * pb.groups + g]);
          }
          pb.y[r * pb.n + panel * kPanel + c] = out;
        }
  });
}

}  // namespace portable

#if defined(__AVX2__)
namespace avx2 {

constexpr int kMaxRows = 4;
constexpr int64_t kAhead = 8;  // lines prefetched ahead in each panel

inline int32_t dword_at(const int8_t* p) {
  int32_t d;
  std::memcpy(&d, p, 4);
  return d;
}

// R rows x P panels: int32 accumulators per (row, panel, half) over a group, then the float epilogue.
template <int R, int P>
void tile(const Problem& pb, int64_t row, int64_t panel) {
  const __m256i nib = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  const int64_t k = pb.k, lines = pb.group / 8;
  __m256 out[R][P][2];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < P; ++j) out[r][j][0] = out[r][j][1] = _mm256_setzero_ps();
  for (int j = 0; j < P; ++j)
    for (int64_t line = 0; line < kAhead; ++line)
      _mm_prefetch(reinterpret_cast<const char*>(pb.packed + ((panel + j) * (k / 8) + line) * 64), _MM_HINT_T0);
  for (int64_t g = 0; g < pb.groups; ++g) {
    __m256i acc[R][P][2];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < P; ++j) acc[r][j][0] = acc[r][j][1] = _mm256_setzero_si256();
    for (int64_t line = g * lines; line < (g + 1) * lines; ++line) {
      __m256i xl[R], xh[R];
      for (int r = 0; r < R; ++r) {
        const int8_t* at = pb.x + (row + r) * k + 8 * line;
        xl[r] = _mm256_set1_epi32(dword_at(at));
        xh[r] = _mm256_set1_epi32(dword_at(at + 4));
      }
      for (int j = 0; j < P; ++j) {
        const uint8_t* w = pb.packed + ((panel + j) * (k / 8) + line) * 64;
        _mm_prefetch(reinterpret_cast<const char*>(w + kAhead * 64), _MM_HINT_T0);
        for (int h = 0; h < 2; ++h) {
          const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * h));
          const __m256i lo = _mm256_and_si256(d, nib), hi = _mm256_and_si256(_mm256_srli_epi16(d, 4), nib);
          for (int r = 0; r < R; ++r) {
            const __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl[r]), _mm256_maddubs_epi16(hi, xh[r]));
            acc[r][j][h] = _mm256_add_epi32(acc[r][j][h], _mm256_madd_epi16(s, ones));
          }
        }
      }
    }
    for (int j = 0; j < P; ++j)
      for (int h = 0; h < 2; ++h) {
        const int64_t at = ((panel + j) * pb.groups + g) * kPanel + 8 * h;
        const __m256 s = _mm256_loadu_ps(pb.scale + at);
        const __m256 z = _mm256_sub_ps(pb.zero ? _mm256_loadu_ps(pb.zero + at) : _mm256_set1_ps(pb.zero_const), _mm256_set1_ps(128.f));
        for (int r = 0; r < R; ++r) {
          const int64_t rg = (row + r) * pb.groups + g;
          const __m256 t = _mm256_fnmadd_ps(z, _mm256_set1_ps(pb.xsum[rg]), _mm256_cvtepi32_ps(acc[r][j][h]));  // exact
          out[r][j][h] = _mm256_fmadd_ps(_mm256_mul_ps(s, _mm256_set1_ps(pb.dx[rg])), t, out[r][j][h]);
        }
      }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < P; ++j)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(pb.y + (row + r) * pb.n + (panel + j) * kPanel + 8 * h, out[r][j][h]);
}

using TileFn = void (*)(const Problem&, int64_t, int64_t);

template <int P, size_t... R>
constexpr std::array<TileFn, sizeof...(R)> tiles(std::index_sequence<R...>) {
  return {&tile<static_cast<int>(R) + 1, P>...};
}

inline void run(const Problem& pb) {
  static const auto t1 = tiles<1>(std::make_index_sequence<kMaxRows>{});
  static const auto t2 = tiles<2>(std::make_index_sequence<kMaxRows>{});
  static const auto t4 = tiles<4>(std::make_index_sequence<kMaxRows>{});
  // each task's panels (K x 32 bytes) stay in L2 while every row tile passes over them; fewer panels a task where
  // four would leave the threads unevenly loaded (SmolLM2's o_proj: 36 panels, 9 tasks of 4 on 2 threads)
  const int64_t panels = pb.n / kPanel, threads = at::get_num_threads();
  int64_t per_task = 4;
  while (per_task > 1 && ((panels + per_task - 1) / per_task) % threads) per_task /= 2;
  at::parallel_for(0, (panels + per_task - 1) / per_task, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t first = task * per_task, count = std::min(per_task, panels - first);
      for (int64_t row = 0; row < pb.m; row += kMaxRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, pb.m - row));
        const int most = rows <= 1 ? 4 : rows <= 2 ? 2 : 1;  // 2 R P accumulators within 8 registers
        int64_t j = 0;
        for (const int p : {4, 2, 1}) {
          if (p > most) continue;
          const auto& fns = p == 4 ? t4 : p == 2 ? t2 : t1;
          for (; j + p <= count; j += p) fns[rows - 1](pb, row, first + j);
        }
      }
    }
  });
}

}  // namespace avx2
#endif

inline void run(const Problem& pb, bool portable) {
#if defined(__AVX2__)
  if (!portable) return avx2::run(pb);
#endif
  portable::run(pb);
}

}  // namespace q8
}  // namespace panel
}  // namespace
