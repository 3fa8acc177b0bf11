// The panel GEMM on AVX-512 BF16 (vdpbf16ps): bfloat16 activations, the weights unpacked to bfloat16 (bias + u)
// and summed in float32. The layouts and the group arithmetic are panel_gemm.h's.

#pragma once

#include "panel_gemm.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace {
namespace panel {
namespace bf16 {

constexpr int kMaxRows = 12;    // rows per tile: 12 accumulators + 12 totals + operands fit in 32 registers

// Pair I of a packed line (four pairs of one panel) -> 32 bfloat16 (bias + u), each channel's two inputs adjacent,
// as vdpbf16ps pairs them. Bias 0x4300 reads as 128 + u; 0x4500 as 16 * (128 + u), the high nibbles of 8-bit weights.
template <int I>
inline __m512i nibbles(__m512i line, __m512i bias) {
  const __m512i v = I == 0 ? line : _mm512_srli_epi32(line, 4 * I);
  return _mm512_ternarylogic_epi32(v, _mm512_set1_epi32(0x000F000F), bias, 0xEA);  // (v & m) | bias
}

using Problem = panel::Problem<uint16_t>;  // x and y bfloat16 bits

// Pair p + I of R rows against P panels: b from the unpacked copy w (V vectors a pair), or from the packed lines
// (V = 2: an 8-bit weight's low nibbles, then its high ones times 16, into the same accumulator).
template <int R, int P, int V, int I>
inline void pair_step(const Problem& pb, const __m512i* w, const __m512i (&line)[P][V], int64_t p, const uint16_t* x,
                      __m512 (&acc)[R][P]) {
  __m512bh b[P][V];
  for (int j = 0; j < P; ++j)
    for (int v = 0; v < V; ++v)
      b[j][v] = (__m512bh)(w ? _mm512_load_si512(w + (j * (pb.k / 2) + p + I) * V + v)
                             : nibbles<I>(line[j][v], _mm512_set1_epi32(v ? 0x45004500 : 0x43004300)));
  for (int r = 0; r < R; ++r) {
    const __m512bh a = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + r * pb.k + 2 * (p + I)));
    for (int j = 0; j < P; ++j)
      for (int v = 0; v < V; ++v) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, b[j][v]);
  }
}

// R rows x P panels of y, from P panels unpacked beforehand into w ([P][K/2][V] vectors), or with w null straight
// from the packed weights (one row tile: unpacking next to the arithmetic overlaps it with the memory reads).
// One accumulator per (row, panel) per group, summed pair by pair in the same order whatever R and P.
template <int R, int P, int V>
void tile(const Problem& pb, const __m512i* w, int64_t row, int64_t panel) {
  const int64_t pairs = pb.group / 2, lines = pb.k / 8;
  __m512 out[R][P];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < P; ++j) out[r][j] = _mm512_setzero_ps();
  const uint16_t* x = pb.x + row * pb.k;
  for (int64_t g = 0; g < pb.groups; ++g) {
    __m512 acc[R][P];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < P; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int64_t p = g * pairs; p < (g + 1) * pairs; p += 4) {
      __m512i line[P][V];
      for (int j = 0; j < P && !w; ++j)
        for (int v = 0; v < V; ++v) line[j][v] = _mm512_loadu_si512(pb.packed + (((panel + j) * lines + p / 4) * V + v) * 64);
      pair_step<R, P, V, 0>(pb, w, line, p, x, acc);
      pair_step<R, P, V, 1>(pb, w, line, p, x, acc);
      pair_step<R, P, V, 2>(pb, w, line, p, x, acc);
      pair_step<R, P, V, 3>(pb, w, line, p, x, acc);
    }
    for (int j = 0; j < P; ++j) {
      const int64_t at = ((panel + j) * pb.groups + g) * kPanel;
      const __m512 s = _mm512_loadu_ps(pb.scale + at), z = pb.zero ? _mm512_loadu_ps(pb.zero + at) : _mm512_set1_ps(pb.zero_const);
      for (int r = 0; r < R; ++r) {
        const __m512 a = _mm512_fnmadd_ps(z, _mm512_set1_ps(pb.xsum[(row + r) * pb.groups + g]), acc[r][j]);
        out[r][j] = _mm512_fmadd_ps(s, a, out[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < P; ++j)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb.y + (row + r) * pb.n + (panel + j) * kPanel), (__m256i)_mm512_cvtneps_pbh(out[r][j]));
}

using TileFn = void (*)(const Problem&, const __m512i*, int64_t, int64_t);

template <int P, int V, size_t... R>
constexpr std::array<TileFn, sizeof...(R)> tiles(std::index_sequence<R...>) {
  return {&tile<static_cast<int>(R) + 1, P, V>...};
}

// Panels per tile by rows: few rows need several panels' accumulators in flight to hide vdpbf16ps latency.
inline int panels_for(int rows) { return rows <= 2 ? 4 : rows <= 6 ? 2 : 1; }

// Where tiles read panel `first + j` from: the bf16 weight itself, the unpacked copy, or (null) the packed bytes.
template <int V>
inline const __m512i* source(const Problem& pb, const std::vector<__m512i>& w, int64_t first, int64_t j, bool direct) {
  const int64_t half = pb.k / 2;
  if (pb.dense) return reinterpret_cast<const __m512i*>(pb.dense) + (first + j) * half;
  return direct ? nullptr : w.data() + j * half * V;
}

// V vectors a pair: 1 for int4 and bf16 weights, 2 for int8 (its two nibbles).
template <int V>
inline void run_v(const Problem& pb) {
  static const auto t1 = tiles<1, V>(std::make_index_sequence<kMaxRows>{});
  static const auto t2 = tiles<2, V>(std::make_index_sequence<kMaxRows>{});
  static const auto t4 = tiles<4, V>(std::make_index_sequence<kMaxRows>{});
  const int64_t panels = pb.n / kPanel, half = pb.k / 2;
  const bool direct = pb.dense == nullptr && pb.m <= kMaxRows;  // one row tile: no unpacked copy
  const int64_t per_task = panels >= 128 || (direct && pb.m <= 2) ? 4 : 2;  // panels unpacked together, shared by all row tiles
  // Prefill-sized inputs in blocks of rows that stay in L2 (~256 KiB) while every panel passes over them;
  // the weights are unpacked again per block, a few percent of its work.
  const int64_t block = std::max<int64_t>(kMaxRows, 262144 / (2 * pb.k) / kMaxRows * kMaxRows);
  for (int64_t row0 = 0; row0 < pb.m; row0 += block) {
    const int64_t row_end = std::min(pb.m, row0 + block);
    at::parallel_for(0, (panels + per_task - 1) / per_task, 1, [&](int64_t begin, int64_t end) {
      std::vector<__m512i> w(direct || pb.dense ? 0 : per_task * half * V);
      const __m512i bias[2] = {_mm512_set1_epi32(0x43004300), _mm512_set1_epi32(0x45004500)};
      for (int64_t task = begin; task < end; ++task) {
        const int64_t first = task * per_task, count = std::min(per_task, panels - first);
        for (int64_t j = 0; j < count && !direct && !pb.dense; ++j) {
          const uint8_t* src = pb.packed + (first + j) * half * kPanel * V;  // K/8 groups of V lines of 64 bytes
          __m512i* dst = w.data() + j * half * V;
          for (int64_t p = 0; p < half; p += 4)
            for (int v = 0; v < V; ++v) {
              const __m512i line = _mm512_loadu_si512(src + (p / 4 * V + v) * 64);
              dst[p * V + v] = nibbles<0>(line, bias[v]);
              dst[(p + 1) * V + v] = nibbles<1>(line, bias[v]);
              dst[(p + 2) * V + v] = nibbles<2>(line, bias[v]);
              dst[(p + 3) * V + v] = nibbles<3>(line, bias[v]);
            }
        }
        for (int64_t row = row0; row < row_end; row += kMaxRows) {
          const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, row_end - row));
          int64_t j = 0;
          for (const int p : {4, 2, 1}) {
            if (p > panels_for(rows)) continue;
            const auto& fns = p == 4 ? t4 : p == 2 ? t2 : t1;
            for (; j + p <= count; j += p) fns[rows - 1](pb, source<V>(pb, w, first, j, direct), row, first + j);
          }
        }
      }
    });
  }
}

inline void run(const Problem& pb, int bits) {
  if (bits == 8)
    run_v<2>(pb);
  else
    run_v<1>(pb);
}

}  // namespace bf16
}  // namespace panel
}  // namespace
#endif
