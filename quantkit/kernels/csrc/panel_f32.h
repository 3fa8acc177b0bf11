// The panel GEMM for float32 activations on x86-64 with AVX2 + FMA (Haswell, Zen 1-3 and every later x86) or
// AVX-512: CPUs without native bfloat16 dot products, where bf16 activations would be emulated. Written once over
// vec.h's vectors (8 channels a vector on AVX2, a whole 16-channel panel on AVX-512: half the instructions a byte,
// which single-row decode is bound by when the weights are in cache). Layouts and group arithmetic are
// panel_gemm.h's; here each nibble becomes a float32 u exactly (shift, mask, convert) and FMAs sum x * u over a
// group, so the weights are never rounded.
//
// One row (single-stream decode) reads the packed bytes straight into the arithmetic, so unpacking overlaps the
// memory reads; more rows first unpack a panel into a float32 copy in L2, shared by every row tile (prefill runs at
// the FMA rate). Both paths feed each accumulator the same products in the same order: batch-invariant.

#pragma once

#include "panel_gemm.h"
#include "vec.h"

#ifdef QUANTKIT_VEC

namespace {
namespace panel {
namespace f32 {

using Problem = panel::Problem<float>;
constexpr int kMaxRows = 4;  // rows per tile: up to 8 accumulators + operands in 16 AVX2 registers
constexpr int H = kPanel / kW;  // vectors a panel: 2 on AVX2, 1 on AVX-512
#ifndef QK_AHEAD
#define QK_AHEAD 8
#endif
constexpr int64_t kAhead = QK_AHEAD;  // lines prefetched ahead in each panel

// V: 1 int4 panels, 2 int8 (two nibble planes), 0 bf16 pairs. What the float32 weights below read as above u,
// against the zero plane's bfloat16 bias: int4 keeps it (128 + u, below), int8 reads u itself (2176 removed).
template <int V>
constexpr float kBias = V == 2 ? 2176.f : 0.f;

// u of inputs 8L + 2I (even) and 8L + 2I + 1 (odd) for the kW channels of vector h of a panel, as float32.
// int4: the pair's two nibbles OR-ed into the bits of two bfloat16 128.0 halves (one op on AVX-512) read as
// 128 + u once each half is moved into a float's top bits (a shift, a mask): 3-4 ops for two vectors, where
// shift-mask-convert takes 5-6; x * (128 + u) sums in float32 with the 136 + zp of the zero plane as the bf16
// kernel's do (a product of a float and an 8-bit integer: one rounding, as x * u's).
template <int V, int I>
inline void pair_u(const Problem& pb, int64_t panel, int64_t line, int h, vf& even, vf& odd) {
  const vi high = vseti(static_cast<int>(0xFFFF0000u));
  if constexpr (V == 0) {  // bf16 pairs [K/2, 16, 2]: pair 4L + I, a dword (even bits, odd bits) per channel
    const vi d = vloadi(pb.dense + ((panel * (pb.k / 2) + 4 * line + I) * kPanel + kW * h) * 2);
    even = vasf(vsll<16>(d));
    odd = vasf(vandi(d, high));
  } else if constexpr (V == 1) {
    const vi d = vandor(vsrl<4 * I>(vloadi(pb.packed + (panel * (pb.k / 8) + line) * 64 + 4 * kW * h)), vseti(0x000F000F),
                        vseti(0x43004300));
    even = vasf(vsll<16>(d));
    odd = vasf(vandi(d, high));
  } else {  // int8: the low nibbles' line, then the high nibbles': u = lo + 16 * hi, converted exactly
    const vi m = vseti(15), m4 = vseti(0xF0);
    const uint8_t* at = pb.packed + (panel * (pb.k / 8) + line) * 128 + 4 * kW * h;
    const vi lo = vloadi(at), hi = vloadi(at + 64);
    const vi e = vori(vandi(vsrl<4 * I>(lo), m), vandi(I ? vsrl<(I ? 4 * I - 4 : 0)>(hi) : vsll<4>(hi), m4));
    const vi o = vori(I == 3 ? vsrl<28>(lo) : vandi(vsrl<16 + 4 * I>(lo), m), vandi(vsrl<12 + 4 * I>(hi), m4));
    even = vcvt(e);
    odd = vcvt(o);
  }
}

// Inputs 8L + 2I, 8L + 2I + 1 of R rows (x, at stride k) against P panels: the weights from the packed ones
// (Direct), or from the float32 copy w ([P][K][16]).
template <int R, int P, int V, int I, bool Direct>
inline void pair_step(const Problem& pb, const float* __restrict w, int64_t line, int64_t panel, const float* __restrict x,
                      int64_t k, vf (&acc)[R][P][H]) {
  const int64_t t = 8 * line + 2 * I;
  auto weights = [&](int j, int h, vf& even, vf& odd) {
    if constexpr (Direct) {
      pair_u<V, I>(pb, panel + j, line, h, even, odd);
    } else {
      even = vload(w + (j * k + t) * kPanel + kW * h);
      odd = vload(w + (j * k + t + 1) * kPanel + kW * h);
    }
  };
  // AVX2's 16 registers: 2 R broadcasts + 2 weights + 2 R P accumulators for few rows; 4 P weights + 2 broadcasts
  // + 2 R P accumulators for more.
  if constexpr (R <= 2) {
    vf xe[R], xo[R];
    for (int r = 0; r < R; ++r) {
      xe[r] = vbcast(x + r * k + t);
      xo[r] = vbcast(x + r * k + t + 1);
    }
    for (int j = 0; j < P; ++j)
      for (int h = 0; h < H; ++h) {
        vf even, odd;
        weights(j, h, even, odd);
        for (int r = 0; r < R; ++r) acc[r][j][h] = vfma(xo[r], odd, vfma(xe[r], even, acc[r][j][h]));
      }
  } else {
    vf even[P][H], odd[P][H];
    for (int j = 0; j < P; ++j)
      for (int h = 0; h < H; ++h) weights(j, h, even[j][h], odd[j][h]);
    for (int r = 0; r < R; ++r) {
      const vf xe = vbcast(x + r * k + t), xo = vbcast(x + r * k + t + 1);
      for (int j = 0; j < P; ++j)
        for (int h = 0; h < H; ++h) acc[r][j][h] = vfma(xo, odd[j][h], vfma(xe, even[j][h], acc[r][j][h]));
    }
  }
}

// R rows x P panels of y; one accumulator per (row, panel vector) per group.
template <int R, int P, int V, bool Direct>
void tile(const Problem& pb, const float* w, int64_t row, int64_t panel) {
  vf out[R][P][H];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < P; ++j)
      for (int h = 0; h < H; ++h) out[r][j][h] = vzero();
  const int64_t k = pb.k, lines = pb.group / 8;
  const float* x = pb.x + row * k;
  if constexpr (Direct && V != 0)  // the first lines of each panel, requested together
    for (int j = 0; j < P; ++j)
      for (int64_t line = 0; line < kAhead; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(pb.packed + ((panel + j) * (k / 8) + line) * V * 64), _MM_HINT_T0);
  for (int64_t g = 0; g < pb.groups; ++g) {
    vf acc[R][P][H];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < P; ++j)
        for (int h = 0; h < H; ++h) acc[r][j][h] = vzero();
    for (int64_t line = g * lines; line < (g + 1) * lines; ++line) {
      if constexpr (Direct && V != 0)  // each panel is a short stream (K/8 lines): ahead of the hardware prefetcher
        for (int j = 0; j < P; ++j) _mm_prefetch(reinterpret_cast<const char*>(pb.packed + ((panel + j) * (k / 8) + line + kAhead) * V * 64), _MM_HINT_T0);
      pair_step<R, P, V, 0, Direct>(pb, w, line, panel, x, k, acc);
      pair_step<R, P, V, 1, Direct>(pb, w, line, panel, x, k, acc);
      pair_step<R, P, V, 2, Direct>(pb, w, line, panel, x, k, acc);
      pair_step<R, P, V, 3, Direct>(pb, w, line, panel, x, k, acc);
    }
    for (int j = 0; j < P; ++j)
      for (int h = 0; h < H; ++h) {
        const int64_t at = ((panel + j) * pb.groups + g) * kPanel + kW * h;
        const vf s = vload(pb.scale + at), z = vsub(pb.zero ? vload(pb.zero + at) : vset(pb.zero_const), vset(kBias<V>));
        for (int r = 0; r < R; ++r) out[r][j][h] = vfma(s, vfnma(z, vset(pb.xsum[(row + r) * pb.groups + g]), acc[r][j][h]), out[r][j][h]);
      }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < P; ++j)
      for (int h = 0; h < H; ++h) vstore(pb.y + (row + r) * pb.n + (panel + j) * kPanel + kW * h, out[r][j][h]);
}

// Panel `panel` as float32 u into w [K][16] (the same values pair_u gives the direct path).
template <int V>
void unpack(const Problem& pb, int64_t panel, float* w) {
  for (int64_t line = 0; line < pb.k / 8; ++line)
    for (int h = 0; h < H; ++h) {
      vf e[4], o[4];
      pair_u<V, 0>(pb, panel, line, h, e[0], o[0]);
      pair_u<V, 1>(pb, panel, line, h, e[1], o[1]);
      pair_u<V, 2>(pb, panel, line, h, e[2], o[2]);
      pair_u<V, 3>(pb, panel, line, h, e[3], o[3]);
      for (int i = 0; i < 4; ++i) {
        vstore(w + (8 * line + 2 * i) * kPanel + kW * h, e[i]);
        vstore(w + (8 * line + 2 * i + 1) * kPanel + kW * h, o[i]);
      }
    }
}

using TileFn = void (*)(const Problem&, const float*, int64_t, int64_t);

template <int P, int V, bool Direct, size_t... R>
constexpr std::array<TileFn, sizeof...(R)> tiles(std::index_sequence<R...>) {
  return {&tile<static_cast<int>(R) + 1, P, V, Direct>...};
}

// Panels per tile by rows: 2 R P accumulators stay within 8 AVX2 registers.
inline int panels_for(int rows) { return rows <= 1 ? 4 : rows <= 2 ? 2 : 1; }

template <int V>
void run_v(const Problem& pb) {
  static const auto t1 = tiles<1, V, true>(std::make_index_sequence<kMaxRows>{});
  static const auto t2 = tiles<2, V, true>(std::make_index_sequence<kMaxRows>{});
  static const auto t4 = tiles<4, V, true>(std::make_index_sequence<kMaxRows>{});
  static const auto copied = tiles<1, V, false>(std::make_index_sequence<kMaxRows>{});
  const int64_t panels = pb.n / kPanel;
  const bool direct = pb.m <= kMaxRows;  // one row tile: straight from the packed weights, no copy
  const int64_t per_task = direct ? 4 : 1;
  // Larger inputs in blocks of rows that stay in L2 (~256 KiB) while every panel passes over them; a panel's
  // float32 copy (64 K bytes) is made again per block, a few percent of the block's arithmetic.
  const int64_t block = std::max<int64_t>(4 * kMaxRows, 262144 / (4 * pb.k) / kMaxRows * kMaxRows);
  for (int64_t row0 = 0; row0 < pb.m; row0 += block) {
    const int64_t row_end = std::min(pb.m, row0 + block);
    at::parallel_for(0, (panels + per_task - 1) / per_task, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> w(direct ? 0 : pb.k * kPanel);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t first = task * per_task, count = std::min(per_task, panels - first);
        if (!direct) unpack<V>(pb, first, w.data());
        for (int64_t row = row0; row < row_end; row += kMaxRows) {
          const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, row_end - row));
          int64_t j = 0;
          for (const int p : {4, 2, 1}) {
            if (p > panels_for(rows)) continue;
            const auto& fns = !direct ? copied : p == 4 ? t4 : p == 2 ? t2 : t1;
            for (; j + p <= count; j += p) fns[rows - 1](pb, direct ? nullptr : w.data(), row, first + j);
          }
        }
      }
    });
  }
}

inline void vstore_out(float* p, vf v) { vstore(p, v); }
inline void vstore_out(at::BFloat16* p, vf v) { vstore_bf16(reinterpret_cast<uint16_t*>(p), v); }

// The dense weight, transposed: wt [K, N] = (u - (8 + zp)) * scale, as the reference dequantises it ((q - zp)
// exact, one rounding; bfloat16: rounded once more, as a dequantised checkpoint is), for prefill-sized inputs where
// oneDNN's GEMM on it beats the tiles (sgemm for float32; AMX for bfloat16).
template <int V, typename Out>
void dequant_t_v(const Problem& pb, Out* wt) {
  at::parallel_for(0, pb.n / kPanel, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w(pb.k * kPanel);
    for (int64_t panel = begin; panel < end; ++panel) {
      unpack<V>(pb, panel, w.data());
      for (int64_t t = 0; t < pb.k; ++t)
        for (int h = 0; h < H; ++h) {
          const int64_t at = (panel * pb.groups + t / pb.group) * kPanel + kW * h;
          const vf z = vsub(pb.zero ? vload(pb.zero + at) : vset(pb.zero_const), vset(kBias<V>));
          vstore_out(wt + t * pb.n + panel * kPanel + kW * h, vmul(vsub(vload(w.data() + t * kPanel + kW * h), z), vload(pb.scale + at)));
        }
    }
  });
}

template <typename Out>
inline void dequant_t(const Problem& pb, int bits, Out* wt) {
  if (bits == 8)
    dequant_t_v<2>(pb, wt);
  else
    dequant_t_v<1>(pb, wt);
}

inline void run(const Problem& pb, int bits) {
  if (bits == 16)
    run_v<0>(pb);
  else if (bits == 8)
    run_v<2>(pb);
  else
    run_v<1>(pb);
}

}  // namespace f32
}  // namespace panel
}  // namespace
#endif
