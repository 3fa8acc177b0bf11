// Fused CPU ops for the decode step: each replaces a chain of small PyTorch ops whose per-call overhead
// (5-30 us each, ~10 per layer) dominates a single-stream token on CPU once the weights are 4-bit.
//
// Every op computes as the PyTorch chain it replaces: float32 math, rounding to the activation dtype
// wherever that chain rounds (HF transformers' order), so bf16 results match it to the last bit except
// where a float32 reduction's order differs. Built once per machine by quantkit/kernels/fused.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/csrc/utils/pybind.h>

#include "panel_gemm.h"
#include "panel_q8.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

namespace {

template <typename T>
inline float f(T x) { return static_cast<float>(x); }

// Rows are independent; parallelise only when there is enough work to pay for waking a thread.
inline int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(row_elems, 1)); }

// exp(x) for x in [-87, 88] (Cephes' expf polynomial: within 2 ulp), scalar and a vector at a time.
inline float fast_exp(float x) {
  x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  return p * __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
}

#ifdef QUANTKIT_VEC
inline vf vexp(vf x) {
  x = vmin(vmax(x, vset(-87.f)), vset(88.f));
  const vf n = vfloor(vfma(x, vset(1.44269504088896341f), vset(0.5f)));
  const vf r = vfma(n, vset(2.12194440e-4f), vfnma(n, vset(0.693359375f), x));
  vf p = vset(1.9875691500e-4f);
  p = vfma(p, r, vset(1.3981999507e-3f));
  p = vfma(p, r, vset(8.3334519073e-3f));
  p = vfma(p, r, vset(4.1665795894e-2f));
  p = vfma(p, r, vset(1.6666665459e-1f));
  p = vfma(p, r, vset(5.0000001201e-1f));
  p = vadd(vfma(vmul(p, r), r, r), vset(1.f));
  return vmul(p, vpow2(n));
}
#endif

// sum_j a[j] * b[j]
inline float dot(const float* a, const float* b, int64_t n) {
  float total = 0.f;
  int64_t j = 0;
#ifdef QUANTKIT_VEC
  vf acc = vzero();
  for (; j + kW <= n; j += kW) acc = vfma(vload(a + j), vload(b + j), acc);
  total = vsum(acc);
#endif
  for (; j < n; ++j) total += a[j] * b[j];
  return total;
}

// y += p * x
inline void axpy(float p, const float* x, float* y, int64_t n) {
  int64_t j = 0;
#ifdef QUANTKIT_VEC
  const vf pv = vset(p);
  for (; j + kW <= n; j += kW) vstore(y + j, vfma(pv, vload(x + j), vload(y + j)));
#endif
  for (; j < n; ++j) y[j] += p * x[j];
}

#ifdef QUANTKIT_VEC
// Head sizes 64 (SmolLM, Llama 3.2 1B, Qwen2 0.5B) and 128 (Qwen2.5 1.5B, Llama 3 8B): scores of one query head
// against m keys (rows at `stride`), four keys at a time so that one transpose-add reduces four dot products.
template <int D>
inline void scores_d(const float* q, const float* keys, int64_t stride, int64_t m, float* out, float mult) {
  constexpr int V = D / kW;
  vf qv[V];
  for (int v = 0; v < V; ++v) qv[v] = vload(q + kW * v);
  int64_t t = 0;
  for (; t + 4 <= m; t += 4) {
    vf a[4];
    for (int i = 0; i < 4; ++i) {
      const float* k = keys + (t + i) * stride;
      a[i] = vmul(qv[0], vload(k));
      for (int v = 1; v < V; ++v) a[i] = vfma(qv[v], vload(k + kW * v), a[i]);
    }
    _mm_storeu_ps(out + t, _mm_mul_ps(vsum4(a), _mm_set1_ps(mult)));
  }
  for (; t < m; ++t) out[t] = dot(q, keys + t * stride, D) * mult;
}

// acc (D floats) += sum_t p[t] * values[t], the accumulator held in registers across the keys.
template <int D>
inline void accumulate_d(const float* p, const float* values, int64_t stride, int64_t m, float* acc) {
  constexpr int V = D / kW;
  vf a[V];
  for (int v = 0; v < V; ++v) a[v] = vload(acc + kW * v);
  for (int64_t t = 0; t < m; ++t) {
    const float* x = values + t * stride;
    const vf pv = vset(p[t]);
    for (int v = 0; v < V; ++v) a[v] = vfma(pv, vload(x + kW * v), a[v]);
  }
  for (int v = 0; v < V; ++v) vstore(acc + kW * v, a[v]);
}
#endif

// Every query head's scores over a tile, and one head's accumulation, with the specialised head sizes; false for
// other sizes (or no vectors), which take the general loops.
inline bool tile_scores(int64_t d, const float* qf, const float* tile, int64_t row, int64_t m, int64_t hq, int64_t group,
                        float* scores, int64_t n, int64_t t0, float sm_scale, const float* kscale) {
#ifdef QUANTKIT_VEC
  if (d != 64 && d != 128) return false;
  for (int64_t h = 0; h < hq; ++h)
    (d == 64 ? scores_d<64> : scores_d<128>)(qf + h * d, tile + (h / group) * d, row, m, scores + h * n + t0, sm_scale * kscale[h / group]);
  return true;
#else
  return false;
#endif
}
inline bool tile_accumulate(int64_t d, const float* p, const float* values, int64_t row, int64_t m, float* acc) {
#ifdef QUANTKIT_VEC
  if (d != 64 && d != 128) return false;
  (d == 64 ? accumulate_d<64> : accumulate_d<128>)(p, values, row, m, acc);
  return true;
#else
  return false;
#endif
}

// x[j] = exp(x[j] - shift); returns their sum
inline float exp_shifted(float* x, int64_t n, float shift) {
  float total = 0.f;
  int64_t j = 0;
#ifdef QUANTKIT_VEC
  vf acc = vzero();
  const vf sv = vset(shift);
  for (; j + kW <= n; j += kW) {
    const vf e = vexp(vsub(vload(x + j), sv));
    vstore(x + j, e);
    acc = vadd(acc, e);
  }
  total = vsum(acc);
#endif
  for (; j < n; ++j) total += (x[j] = fast_exp(x[j] - shift));
  return total;
}

// x[j] = silu(x[j]) = x / (1 + exp(-x))
inline void silu_inplace(float* x, int64_t n) {
  int64_t j = 0;
#ifdef QUANTKIT_VEC
  for (; j + kW <= n; j += kW) {
    const vf v = vload(x + j);
    vstore(x + j, vdiv(v, vadd(vset(1.f), vexp(vsub(vzero(), v)))));
  }
#endif
  for (; j < n; ++j) x[j] = x[j] / (1.f + fast_exp(-x[j]));
}

// A cache row of n elements -> float times `scale` (1 unless FP8), in loops the compiler vectorises.
inline void read_row(const float* src, float* dst, int64_t n, float scale) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) dst[j] = src[j] * scale;
}
inline void read_row(const c10::BFloat16* src, float* dst, int64_t n, float scale) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) dst[j] = __builtin_bit_cast(float, static_cast<uint32_t>(bits[j]) << 16) * scale;
}
template <typename T>  // fp16, fp64
inline void read_row(const T* src, float* dst, int64_t n, float scale) {
  for (int64_t j = 0; j < n; ++j) dst[j] = f(src[j]) * scale;
}
// E4M3's sign, exponent and mantissa bits moved into float32's places read as the value times 2^-120 (bias 7
// vs 127; subnormals too, float32 has them): an exact multiply by 2^120, then the scale's one rounding. Shifts,
// no table gathers (as kernels/cpu.dequantize_fp8). The two NaN codes never reach the cache (stores saturate).
inline void read_row(const c10::Float8_e4m3fn* src, float* dst, int64_t n, float scale) {
  const uint8_t* codes = reinterpret_cast<const uint8_t*>(src);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t c = codes[j];
    dst[j] = __builtin_bit_cast(float, ((c & 0x7Fu) << 20) | ((c & 0x80u) << 24)) * 0x1p120f * scale;
  }
}

// out[i] = w * round(x[i] * rsqrt(mean(x[i]^2) + eps)), optionally after x[i] += r[i] (stored to sum): Llama's
// rounding. A float32 weight W on bf16/fp16 x is Gemma's: round(x[i] * rsqrt(..) * w), the product in float32 (its
// weight holds 1 + w already).
template <typename T, typename W = T>
void rms_norm_rows(const T* x, const T* r, T* sum, const W* w, T* out, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, grain(n), [&](int64_t b, int64_t e) {
    std::vector<float> h(n);
    for (int64_t i = b; i < e; ++i) {
      const T* xi = x + i * n;
      for (int64_t j = 0; j < n; ++j) h[j] = r ? f(T(f(xi[j]) + f(r[i * n + j]))) : f(xi[j]);
      if (sum)
        for (int64_t j = 0; j < n; ++j) sum[i * n + j] = T(h[j]);
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t j = 0; j < n; ++j) ss += h[j] * h[j];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
      T* oi = out + i * n;
      if constexpr (std::is_same_v<T, W>)
        for (int64_t j = 0; j < n; ++j) oi[j] = T(f(w[j]) * f(T(h[j] * inv)));
      else
        for (int64_t j = 0; j < n; ++j) oi[j] = T(h[j] * inv * w[j]);
    }
  });
}

// x's dtype, with w of that dtype (Llama's rounding) or float32 (Gemma's); r and sum optional.
void rms_norm_dispatch(const at::Tensor& x, const at::Tensor* r, at::Tensor* sum, const at::Tensor& w, at::Tensor& out, double eps) {
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && (!r || r->is_contiguous()), "rms_norm: contiguous tensors");
  TORCH_CHECK((!r || (r->sizes() == x.sizes() && r->scalar_type() == x.scalar_type())), "rms_norm: x and r of one shape and dtype");
  TORCH_CHECK(w.scalar_type() == x.scalar_type() || w.scalar_type() == at::kFloat, "rms_norm: w of x's dtype or float32");
  const int64_t n = x.size(-1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* rp = r ? r->data_ptr<scalar_t>() : nullptr;
    scalar_t* sp = sum ? sum->data_ptr<scalar_t>() : nullptr;
    if (w.scalar_type() == x.scalar_type())
      rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), rp, sp, w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.numel() / n, n,
                              static_cast<float>(eps));
    else
      rms_norm_rows<scalar_t, float>(x.data_ptr<scalar_t>(), rp, sp, w.data_ptr<float>(), out.data_ptr<scalar_t>(), x.numel() / n,
                                     n, static_cast<float>(eps));
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  auto out = at::empty_like(x);
  rms_norm_dispatch(x, nullptr, nullptr, w, out, eps);
  return out;
}

// (x + r, rms_norm(x + r)): the residual add and the next norm in one pass.
std::vector<at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& r, const at::Tensor& w, double eps) {
  auto sum = at::empty_like(x), out = at::empty_like(x);
  rms_norm_dispatch(x, &r, &sum, w, out, eps);
  return {sum, out};
}

// In place on the first `heads` heads of x [T, H, D]: x*cos + rotate_half(x)*sin, each product rounded as HF's chain
// rounds it; cos/sin [T, D] with the two halves repeated.
void rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "rope_: x [T, H, D] with contiguous rows");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == x.scalar_type(), "rope_: cos/sin [T, D] in x's dtype");
  const int64_t t = x.size(0), d = x.size(2), half = d / 2, stride = x.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope_", [&] {
    scalar_t* base = x.data_ptr<scalar_t>();
    const scalar_t* c = cos.data_ptr<scalar_t>();
    const scalar_t* s = sin.data_ptr<scalar_t>();
    at::parallel_for(0, t * heads, grain(d), [&](int64_t b, int64_t e) {
      std::vector<float> v(d);
      for (int64_t i = b; i < e; ++i) {
        const int64_t tok = i / heads;
        scalar_t* row = base + tok * stride + (i % heads) * d;
        const scalar_t* ci = c + tok * d;
        const scalar_t* si = s + tok * d;
        for (int64_t j = 0; j < d; ++j) v[j] = f(row[j]);
        for (int64_t j = 0; j < d; ++j) {
          const float rot = j < half ? -v[j + half] : v[j - half];
          row[j] = scalar_t(f(scalar_t(v[j] * f(ci[j]))) + f(scalar_t(rot * f(si[j]))));
        }
      }
    });
  });
}

// silu(gate) * up for gu [T, 2I] = [gate | up] -> [T, I]; silu rounded before the product, as HF's MLP does.
template <typename T>
void silu_mul_rows(const T* g, T* o, int64_t t, int64_t inter) {
  at::parallel_for(0, t, grain(inter), [&](int64_t b, int64_t e) {
    std::vector<float> gate_buf(inter), up_buf(inter);
    float* gate = gate_buf.data();
    float* up = up_buf.data();
    for (int64_t i = b; i < e; ++i) {
      read_row(g + i * 2 * inter, gate, inter, 1.f);
      read_row(g + i * 2 * inter + inter, up, inter, 1.f);
      silu_inplace(gate, inter);
      for (int64_t j = 0; j < inter; ++j) o[i * inter + j] = T(f(T(gate[j])) * up[j]);
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gu) {
  TORCH_CHECK(gu.is_contiguous() && gu.dim() == 2 && gu.size(1) % 2 == 0, "silu_mul: contiguous [T, 2I]");
  const int64_t t = gu.size(0), inter = gu.size(1) / 2;
  auto out = at::empty({t, inter}, gu.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gu.scalar_type(), "silu_mul", [&] {
    silu_mul_rows<scalar_t>(gu.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), t, inter);
  });
  return out;
}

// Store each sequence's new key/value (FP8: x / scale saturated at 448, as reference.quantize_fp8), then attend its
// single query over its `lengths[s]` keys, reading the paged blocks in place.
//
// The keys are taken in chunks of kChunkTokens (flash-decoding): a task is one chunk of one sequence, all its heads,
// and leaves per query head its scores' max, the sum of their exponentials and the unnormalised sum of values; the
// chunks are then combined in order. The chunks do not depend on the batch or the thread count, so neither does a
// sequence's output, and a single stream's attention spreads over every core with contiguous token rows to stream
// (split by KV heads it was 3 tasks on 2 threads on SmolLM2, each reading 1/3 of every row).
constexpr int64_t kChunkTokens = 64;
constexpr int64_t kThreadTokens = 256;  // KV-head tokens below which one thread takes several chunks: waking
                                        // a thread costs more than a short chunk

template <typename T, typename C>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& kc, at::Tensor& vc,
                           const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& lengths, const at::Tensor& ks,
                           const at::Tensor& vs, at::Tensor& out) {
  const int64_t s_n = q.size(0), hq = q.size(1), d = q.size(2), hk = kc.size(2), block = kc.size(1);
  const int64_t group = hq / hk, max_blocks = tables.size(1);
  const float* kscale = ks.data_ptr<float>();
  const float* vscale = vs.data_ptr<float>();
  C* kcache = kc.data_ptr<C>();
  C* vcache = vc.data_ptr<C>();
  if (k.numel()) {  // the store: one slot per sequence
    const int64_t* slot = slots.data_ptr<int64_t>();
    const T* kp = k.data_ptr<T>();
    const T* vp = v.data_ptr<T>();
    for (int64_t s = 0; s < s_n; ++s)
      for (int64_t h = 0; h < hk; ++h)
        for (int64_t j = 0; j < d; ++j) {
          const int64_t dst = (slot[s] * hk + h) * d + j;
          const float kv[2] = {f(kp[s * k.stride(0) + h * k.stride(1) + j * k.stride(2)]),
                               f(vp[s * v.stride(0) + h * v.stride(1) + j * v.stride(2)])};
          if constexpr (std::is_same_v<C, c10::Float8_e4m3fn>) {
            kcache[dst] = C(std::clamp(kv[0] / kscale[h], -448.f, 448.f));
            vcache[dst] = C(std::clamp(kv[1] / vscale[h], -448.f, 448.f));
          } else {
            kcache[dst] = C(kv[0]);
            vcache[dst] = C(kv[1]);
          }
        }
  }
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t* len = lengths.data_ptr<int64_t>();
  const float sm_scale = 1.f / std::sqrt(static_cast<float>(d));
  const int64_t row = hk * d;  // one token's keys (or values): contiguous in its block
  const int64_t chunk = std::max<int64_t>(1, kChunkTokens / block) * block;
  std::vector<int64_t> first(s_n + 1, 0);  // each sequence's first task
  for (int64_t s = 0; s < s_n; ++s) first[s + 1] = first[s] + (std::max<int64_t>(len[s], 1) + chunk - 1) / chunk;
  const int64_t tasks = first[s_n], stride = d + 2;
  std::vector<float> part(tasks * hq * stride);  // per task and query head: max, sum of exponentials, values [d]
  at::parallel_for(0, tasks, std::max<int64_t>(1, kThreadTokens / (chunk * hk)), [&](int64_t b, int64_t e) {
    // a block's rows are contiguous per token: read in place (float32 cache) or converted into `tile`; FP8 scales
    // (per KV head) multiply the scores and the output instead of every element
    std::vector<float> qf(hq * d), tile(block * row), scores(hq * chunk);
    int64_t s = std::upper_bound(first.begin(), first.end(), b) - first.begin() - 1;
    for (int64_t task = b; task < e; ++task) {
      while (task >= first[s + 1]) ++s;
      const int64_t t_begin = (task - first[s]) * chunk, n = std::min(len[s] - t_begin, chunk);
      auto rows = [&](const C* cache, int64_t t0, int64_t m) -> const float* {
        const C* base = cache + table[s * max_blocks + (t_begin + t0) / block] * block * row;
        if constexpr (std::is_same_v<C, float>) return base;
        read_row(base, tile.data(), m * row, 1.f);
        return tile.data();
      };
      for (int64_t h = 0; h < hq; ++h)
        for (int64_t j = 0; j < d; ++j) qf[h * d + j] = f(qp[s * q.stride(0) + h * q.stride(1) + j]);
      for (int64_t t0 = 0; t0 < n; t0 += block) {
        const int64_t m = std::min(n - t0, block);
        const float* keys = rows(kcache, t0, m);
        if (tile_scores(d, qf.data(), keys, row, m, hq, group, scores.data(), chunk, t0, sm_scale, kscale)) continue;
        for (int64_t t = 0; t < m; ++t)
          for (int64_t h = 0; h < hq; ++h)
            scores[h * chunk + t0 + t] = dot(qf.data() + h * d, keys + t * row + (h / group) * d, d) * (sm_scale * kscale[h / group]);
      }
      float* mine = part.data() + task * hq * stride;
      for (int64_t h = 0; h < hq; ++h) {  // the chunk's softmax, unnormalised
        float* sh = scores.data() + h * chunk;
        float mx = -INFINITY;
        for (int64_t t = 0; t < n; ++t) mx = std::max(mx, sh[t]);
        mine[h * stride] = mx;
        mine[h * stride + 1] = exp_shifted(sh, n, mx);
        std::fill(mine + h * stride + 2, mine + (h + 1) * stride, 0.f);
      }
      for (int64_t t0 = 0; t0 < n; t0 += block) {
        const int64_t m = std::min(n - t0, block);
        const float* values = rows(vcache, t0, m);
        for (int64_t h = 0; h < hq; ++h) {
          float* acc = mine + h * stride + 2;
          if (tile_accumulate(d, scores.data() + h * chunk + t0, values + (h / group) * d, row, m, acc)) continue;
          for (int64_t t = 0; t < m; ++t) axpy(scores[h * chunk + t0 + t], values + t * row + (h / group) * d, acc, d);
        }
      }
    }
  });
  for (int64_t s = 0; s < s_n; ++s)  // the chunks combined in order: sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c
    for (int64_t h = 0; h < hq; ++h) {
      float mx = -INFINITY, total = 0.f;
      for (int64_t c = first[s]; c < first[s + 1]; ++c) mx = std::max(mx, part[(c * hq + h) * stride]);
      std::vector<float> acc(d, 0.f);
      for (int64_t c = first[s]; c < first[s + 1]; ++c) {
        const float* p = part.data() + (c * hq + h) * stride;
        const float w = fast_exp(p[0] - mx);
        total += w * p[1];
        axpy(w, p + 2, acc.data(), d);
      }
      const float norm = vscale[h / group] / total;
      for (int64_t j = 0; j < d; ++j) op[(s * hq + h) * d + j] = T(acc[j] * norm);
    }
}

// q [S, Hq, D] (rows may be strided); k, v [S, Hk, D] new keys/values (or empty: already stored); caches [blocks, block_size, Hk, D];
// slots [S], tables [S, max_blocks], lengths [S] int64; ks, vs [Hk] float32 (ones for an unscaled cache) -> [S, Hq, D].
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor kc, at::Tensor vc,
                            const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& lengths, const at::Tensor& ks,
                            const at::Tensor& vs) {
  TORCH_CHECK(q.stride(2) == 1 && kc.is_contiguous() && vc.is_contiguous() && tables.is_contiguous(), "decode_attention: contiguous q rows, caches, tables");
  TORCH_CHECK(tables.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong && slots.scalar_type() == at::kLong, "decode_attention: int64 indices");
  TORCH_CHECK(ks.scalar_type() == at::kFloat && vs.scalar_type() == at::kFloat && ks.numel() == kc.size(2), "decode_attention: float32 scales per KV head");
  TORCH_CHECK(q.size(1) % kc.size(2) == 0 && q.size(2) == kc.size(3), "decode_attention: head shapes");
  TORCH_CHECK(k.numel() == 0 || (k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type()), "decode_attention: k/v in q's dtype");
  auto out = at::empty(q.sizes(), q.options());
  const auto cache = kc.scalar_type();
  const bool fp8 = cache == at::kFloat8_e4m3fn;
  // float32 compute over a bf16/fp16 cache (--dtype fp32 --kv-cache-dtype bf16: half the KV memory without native bf16)
  const bool narrow = q.scalar_type() == at::kFloat && (cache == at::kBFloat16 || cache == at::kHalf);
  TORCH_CHECK(fp8 || narrow || cache == q.scalar_type(), "decode_attention: cache in q's dtype, bf16/fp16 under float32, or float8_e4m3fn");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    if (fp8)
      decode_attention_impl<scalar_t, c10::Float8_e4m3fn>(q, k, v, kc, vc, slots, tables, lengths, ks, vs, out);
    else if (cache == q.scalar_type())
      decode_attention_impl<scalar_t, scalar_t>(q, k, v, kc, vc, slots, tables, lengths, ks, vs, out);
    else if constexpr (std::is_same_v<scalar_t, float>) {
      if (cache == at::kBFloat16)
        decode_attention_impl<float, c10::BFloat16>(q, k, v, kc, vc, slots, tables, lengths, ks, vs, out);
      else
        decode_attention_impl<float, c10::Half>(q, k, v, kc, vc, slots, tables, lengths, ks, vs, out);
    }
  });
  return out;
}

// --- panel GEMM: int4 layers and the lm_head (panel_gemm.h) -------------------------------------------------------

// The instruction set this build's kernels use, as quantkit names it (describe() reports it).
std::string isa() {
#if defined(__AVX512BF16__)
  return "avx512-bf16";
#elif defined(QUANTKIT_VEC) && QUANTKIT_VEC == 16
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "scalar";
#endif
}

// The activation dtypes panel_gemm takes here: float32 always (AVX2 or the portable loops), bfloat16 only with
// native bf16 dot products.
std::vector<std::string> panel_dtypes() {
#if defined(__AVX512BF16__)
  return {"float32", "bfloat16"};
#else
  return {"float32"};
#endif
}

inline bool panel_gemm_supports(at::ScalarType dtype) {
  return dtype == at::kFloat
#if defined(__AVX512BF16__)
         || dtype == at::kBFloat16
#endif
      ;
}

template <typename X>
std::vector<float> group_sums(const X* x, int64_t rows, int64_t group) {  // float32 sum of x over each group
  std::vector<float> out(rows);
  for (int64_t i = 0; i < rows; ++i) {
    float s = 0.f;
    for (int64_t c = 0; c < group; ++c) {
      if constexpr (std::is_same_v<X, float>)
        s += x[i * group + c];
      else
        s += __builtin_bit_cast(float, static_cast<uint32_t>(x[i * group + c]) << 16);
    }
    out[i] = s;
  }
  return out;
}

// params f32 [1 or 2, N/16, groups, 16] (scales, then the zero plane when there is one) for `panels` weight panels:
// checked, and the zero plane's start (null for symmetric weights, whose zero is panel::symmetric_zero(bits)).
const float* panel_zero_plane(const at::Tensor& params, int64_t panels, int64_t groups, const char* op) {
  TORCH_CHECK(params.is_contiguous() && params.scalar_type() == at::kFloat && params.dim() == 4 &&
                  (params.size(0) == 1 || params.size(0) == 2) && params.size(1) == panels && params.size(2) == groups &&
                  params.size(3) == panel::kPanel,
              op, ": params do not match the weight");
  return params.size(0) == 2 ? params.data_ptr<float>() + params.numel() / 2 : nullptr;
}

// x [M, K] (bfloat16 where supported, float32) -> [M, N] in x's dtype, with w either int4 panels uint8 [N/16, K/8, 64]
// (int8: [N/16, K/8, 128]) and params f32 [2, N/16, K/group, 16] (scales, then 136 + zero points for int4, 2304 + zero
// points for int8; [1, ...], the scales alone, for symmetric weights), or bf16 panels [N/16, K/2, 16, 2] and params
// [1, N/16, 1, 16] (ones).
at::Tensor panel_gemm_impl(const at::Tensor& x_, const at::Tensor& w, const at::Tensor& params, int64_t group, bool portable) {
  TORCH_CHECK(x_.dim() == 2 && panel_gemm_supports(x_.scalar_type()), "panel_gemm: x must be 2-D float32 (or bfloat16 on AVX-512 BF16)");
  const bool dense = w.scalar_type() == at::kBFloat16;
  const at::Tensor x = x_.contiguous();
  const int64_t m = x.size(0), k = x.size(1), groups = k / group;
  const int bits = dense ? 16 : w.size(2) == 8 * panel::kPanel ? 8 : 4;
  TORCH_CHECK(w.is_contiguous() && w.size(1) * (dense ? 2 : 8) == k && w.size(2) == (dense ? 1 : bits) * panel::kPanel &&
                  group % 8 == 0 && k % group == 0 && (!dense || groups == 1),
              "panel_gemm: weight layout does not match x");
  const float* zero = panel_zero_plane(params, w.size(0), groups, "panel_gemm");
  const float* pp = params.data_ptr<float>();
  at::Tensor y = at::empty({m, w.size(0) * panel::kPanel}, x.options());
  const float zero_const = panel::symmetric_zero(bits);
  const uint8_t* packed = dense ? nullptr : w.data_ptr<uint8_t>();
  const uint16_t* dw = dense ? reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()) : nullptr;
  if (x.scalar_type() == at::kFloat) {
    const float* xp = x.data_ptr<float>();
    const std::vector<float> xsum = group_sums(xp, m * groups, group);
    const panel::Problem<float> pb{xp, packed, dw, xsum.data(), pp, zero, y.data_ptr<float>(), m, k, y.size(1), groups, group, zero_const};
#ifdef QUANTKIT_VEC
    if (!portable) {
      panel::f32::run(pb, bits);
      return y;
    }
#endif
    panel::scalar::run(pb, bits);
    return y;
  }
#if defined(__AVX512BF16__)
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const std::vector<float> xsum = dense ? std::vector<float>(m * groups) : group_sums(xp, m * groups, group);  // bf16 weights: zeros 0
  panel::bf16::run({xp, packed, dw, xsum.data(), pp, zero, reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), m, k,
                    y.size(1), groups, group, zero_const}, bits);
#endif
  return y;
}

at::Tensor panel_gemm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& params, int64_t group) {
  return panel_gemm_impl(x, w, params, group, false);
}

// x [M, K] float32 against int4 panels with int8 activations (panel_q8.h): x quantised per weight group, then
// integer products. `portable`: the plain loops whatever the build (the same bits).
at::Tensor panel_gemm_q8_impl(const at::Tensor& x_, const at::Tensor& w, const at::Tensor& params, int64_t group, bool portable) {
  TORCH_CHECK(x_.dim() == 2 && x_.scalar_type() == at::kFloat, "panel_gemm_q8: x must be 2-D float32");
  const at::Tensor x = x_.contiguous();
  const int64_t m = x.size(0), k = x.size(1), groups = k / group;
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == at::kByte && w.dim() == 3 && w.size(1) * 8 == k &&
                  w.size(2) == 4 * panel::kPanel && group % 8 == 0 && k % group == 0,
              "panel_gemm_q8: int4 panels [N/16, K/8, 64] matching x");
  const float* zero = panel_zero_plane(params, w.size(0), groups, "panel_gemm_q8");
  at::Tensor y = at::empty({m, w.size(0) * panel::kPanel}, x.options());
  std::vector<int8_t> x8(m * k);
  std::vector<float> dx(m * groups), xsum(m * groups);
  panel::q8::quantize(x.data_ptr<float>(), m, k, group, x8.data(), dx.data(), xsum.data());
  panel::q8::run({x8.data(), dx.data(), xsum.data(), w.data_ptr<uint8_t>(), params.data_ptr<float>(), zero, y.data_ptr<float>(), m, k,
                  y.size(1), groups, group, panel::symmetric_zero(4)},
                 portable);
  return y;
}

at::Tensor panel_gemm_q8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& params, int64_t group) {
  return panel_gemm_q8_impl(x, w, params, group, false);
}

at::Tensor panel_gemm_q8_scalar(const at::Tensor& x, const at::Tensor& w, const at::Tensor& params, int64_t group) {
  return panel_gemm_q8_impl(x, w, params, group, true);
}

// Checkpoint words int32 [N, K/8] (compressed-tensors 4-bit: inputs 8L..8L+7 at nibbles 0..7) -> the int4 panel
// layout uint8 [N/16, K/8, 64] (panel_gemm.h) in one pass: formats/pack.py's int4_panels_from_words (the reference,
// tested equal), whose tensor ops take ten passes over the weights at load.
at::Tensor panel_pack_int4(const at::Tensor& words) {
  TORCH_CHECK(words.dim() == 2 && words.scalar_type() == at::kInt && words.size(0) % panel::kPanel == 0,
              "panel_pack_int4: int32 [N, K/8] with N a multiple of 16");
  const at::Tensor w = words.contiguous();
  const int64_t n = w.size(0), lines = w.size(1);
  at::Tensor out = at::empty({n / panel::kPanel, lines, 4 * panel::kPanel}, w.options().dtype(at::kByte));
  const uint32_t* src = reinterpret_cast<const uint32_t*>(w.data_ptr<int32_t>());
  uint32_t* dst = reinterpret_cast<uint32_t*>(out.data_ptr<uint8_t>());
  at::parallel_for(0, n / panel::kPanel, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t c = 0; c < panel::kPanel; ++c) {
        const uint32_t* row = src + (p * panel::kPanel + c) * lines;
        for (int64_t l = 0; l < lines; ++l) {
          uint32_t x = row[l];
          uint32_t t = (x ^ (x >> 4)) & 0x00F000F0u;  // nibbles 1<->2, 5<->6
          x ^= t ^ (t << 4);
          t = (x ^ (x >> 8)) & 0x0000FF00u;  // bytes 1<->2: nibbles 0 2 4 6 1 3 5 7
          x ^= t ^ (t << 8);
          dst[(p * lines + l) * panel::kPanel + c] = x;
        }
      }
  });
  return out;
}

template <typename Out>
void dequant_into(const panel::Problem<float>& pb, int bits, Out* wt) {
#ifdef QUANTKIT_VEC
  panel::f32::dequant_t(pb, bits, wt);
#else
  panel::scalar::dequant_t(pb, bits, wt);
#endif
}

// int4 or int8 panels and their params -> the dense weight transposed, [K, N] (see panel_f32.h): float32, or into
// `out` (float32 or bfloat16 [K, N]: a buffer the caller keeps, since a fresh one pays its page faults every call).
at::Tensor panel_dequant_t(const at::Tensor& w, const at::Tensor& params, int64_t group, c10::optional<at::Tensor> out) {
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == at::kByte && w.dim() == 3, "panel_dequant_t: int4/int8 panels");
  const int bits = w.size(2) == 8 * panel::kPanel ? 8 : 4;
  const int64_t k = w.size(1) * 8, n = w.size(0) * panel::kPanel, groups = k / group;
  TORCH_CHECK(k % group == 0, "panel_dequant_t: group size does not divide the inputs");
  const float* zero = panel_zero_plane(params, w.size(0), groups, "panel_dequant_t");
  at::Tensor wt = out ? *out : at::empty({k, n}, params.options());
  TORCH_CHECK(wt.is_contiguous() && wt.dim() == 2 && wt.size(0) == k && wt.size(1) == n &&
                  (wt.scalar_type() == at::kFloat || wt.scalar_type() == at::kBFloat16),
              "panel_dequant_t: out must be a contiguous float32 or bfloat16 [K, N]");
  const panel::Problem<float> pb{nullptr, w.data_ptr<uint8_t>(), nullptr, nullptr, params.data_ptr<float>(), zero, nullptr, 0, k, n, groups, group,
                                 panel::symmetric_zero(bits)};
  if (wt.scalar_type() == at::kBFloat16)
    dequant_into(pb, bits, wt.data_ptr<at::BFloat16>());
  else
    dequant_into(pb, bits, wt.data_ptr<float>());
  return wt;
}

// The portable loops on any build, whatever the vector path: the tests check each against the reference.
at::Tensor panel_gemm_scalar(const at::Tensor& x, const at::Tensor& w, const at::Tensor& params, int64_t group) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "panel_gemm_scalar: x must be float32");
  return panel_gemm_impl(x, w, params, group, true);
}

// --- the whole decode step's layer loop --------------------------------------------------------------------
// For a batch of single-token sequences the Python loop over layers costs ~1/4 of a CPU step on its own (a
// dozen calls a layer through the interpreter); Decoder runs the same calls from C++.

// A linear layer as the runtime holds it: PyTorch's packed int4 or int8 op, or a dense weight; optional bias.
struct Linear {
  // 0 PyTorch's int4 (w packed, s scales_zeros, group), 1 int8 (w int8, s scale per row), 2 dense (w [out, in]),
  // 3 panel_gemm (w int4 or bf16 panels, s params, group), 4 panel_gemm_q8 (w int4 panels, int8 activations)
  int64_t mode;
  at::Tensor w, s;
  int64_t group;
  c10::optional<at::Tensor> bias;

  at::Tensor operator()(const at::Tensor& x) const {  // x [t, in] -> [t, out]
    at::Tensor y = mode == 0   ? at::_weight_int4pack_mm_for_cpu(x, w, group, s)
                   : mode == 1 ? at::_weight_int8pack_mm(x, w, s)
                   : mode == 3 ? panel_gemm(x, w, s, group)
                   : mode == 4 ? panel_gemm_q8(x, w, s, group)
                               : at::mm(x, w.t());
    return bias ? y.add_(*bias) : y;
  }
};

struct Layer {
  Linear qkv, o, gate_up, down;
  at::Tensor input_norm, post_norm;
};

class Decoder {
 public:
  Decoder(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps) : heads_(heads), kv_heads_(kv_heads), d_(head_dim), eps_(eps) {}

  void add_layer(Linear qkv, Linear o, Linear gate_up, Linear down, at::Tensor input_norm, at::Tensor post_norm) {
    layers_.push_back({qkv, o, gate_up, down, input_norm, post_norm});
  }

  // x [S, hidden] the batch's embeddings -> the last layer's output [S, hidden], as the Python layers compute it.
  at::Tensor forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots, const at::Tensor& tables,
                     const at::Tensor& lengths, const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
                     const std::vector<at::Tensor>& k_scales, const std::vector<at::Tensor>& v_scales) const {
    const int64_t t = x.size(0);
    at::Tensor h = rms_norm(x, layers_[0].input_norm, eps_), out;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      at::Tensor qkv = l.qkv(h).view({t, heads_ + 2 * kv_heads_, d_});
      rope_(qkv, cos, sin, heads_ + kv_heads_);
      at::Tensor a = decode_attention(qkv.narrow(1, 0, heads_), qkv.narrow(1, heads_, kv_heads_), qkv.narrow(1, heads_ + kv_heads_, kv_heads_),
                                      k_caches[i], v_caches[i], slots, tables, lengths, k_scales[i], v_scales[i]);
      auto xh = add_rms_norm(x, l.o(a.view({t, -1})), l.post_norm, eps_);
      out = l.down(silu_mul(l.gate_up(xh[1])));
      if (i + 1 < layers_.size()) {  // the residual add folded into the next layer's input norm
        auto next = add_rms_norm(xh[0], out, layers_[i + 1].input_norm, eps_);
        x = next[0];
        h = next[1];
      } else {
        x = xh[0] + out;
      }
    }
    return x;
  }

 private:
  std::vector<Layer> layers_;
  int64_t heads_, kv_heads_, d_;
  double eps_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm", &add_rms_norm);
  m.def("rope_", &rope_);
  m.def("silu_mul", &silu_mul);
  m.def("decode_attention", &decode_attention);
  m.def("isa", &isa);
  m.def("panel_dtypes", &panel_dtypes);
  m.def("panel_gemm", &panel_gemm);
  m.def("panel_gemm_scalar", &panel_gemm_scalar);
  m.def("panel_gemm_q8", &panel_gemm_q8);
  m.def("panel_gemm_q8_scalar", &panel_gemm_q8_scalar);
  m.def("panel_dequant_t", &panel_dequant_t, py::arg("w"), py::arg("params"), py::arg("group"), py::arg("out") = py::none());
  m.def("panel_pack_int4", &panel_pack_int4);
  py::class_<Linear>(m, "Linear").def(py::init<int64_t, at::Tensor, at::Tensor, int64_t, c10::optional<at::Tensor>>());
  py::class_<Decoder>(m, "Decoder")
      .def(py::init<int64_t, int64_t, int64_t, double>())
      .def("add_layer", &Decoder::add_layer)
      .def("forward", &Decoder::forward);
}
