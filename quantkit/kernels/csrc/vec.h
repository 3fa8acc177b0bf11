// float32 (and int32) vectors of the widest kind the module is compiled for, so each fused op and the float32 panel
// GEMM are written once: 16 lanes on AVX-512 (F + DQ), 8 on AVX2 + FMA; none otherwise (QUANTKIT_VEC undefined: the
// scalar loops run).

#pragma once

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define QUANTKIT_VEC 16

namespace {
using vf = __m512;
constexpr int kW = 16;
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf vset(float x) { return _mm512_set1_ps(x); }
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }    // a * b + c
inline vf vfnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
inline vf vfloor(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
inline vf vpow2(vf n) {  // 2^n for integral n in [-126, 127]
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
using vi = __m512i;
inline vi vloadi(const void* p) { return _mm512_loadu_si512(p); }
inline vi vseti(int x) { return _mm512_set1_epi32(x); }
template <int N>
inline vi vsrl(vi a) { return N ? _mm512_srli_epi32(a, N) : a; }
template <int N>
inline vi vsll(vi a) { return N ? _mm512_slli_epi32(a, N) : a; }
inline vi vandi(vi a, vi b) { return _mm512_and_si512(a, b); }
inline vi vori(vi a, vi b) { return _mm512_or_si512(a, b); }
inline vi vandor(vi a, vi m, vi b) { return _mm512_ternarylogic_epi32(a, m, b, 0xEA); }  // (a & m) | b, one op
inline vf vcvt(vi a) { return _mm512_cvtepi32_ps(a); }
inline vf vasf(vi a) { return _mm512_castsi512_ps(a); }
inline vf vbcast(const float* p) { return _mm512_set1_ps(*p); }
// bfloat16 bits of each lane, rounded to nearest even as c10::BFloat16 rounds (finite values), stored as 16 lanes
inline void vstore_bf16(uint16_t* p, vf v) {
  const vi b = _mm512_castps_si512(v);
  const vi r = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1))));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
}
// The four vectors' sums: one transpose-add instead of four reductions.
inline __m128 vsum4(const vf (&a)[4]) {
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(r), _mm512_extractf32x8_ps(r, 1));  // [sum 0..3] per 128-bit lane
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
}  // namespace

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QUANTKIT_VEC 8

namespace {
using vf = __m256;
constexpr int kW = 8;
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf vset(float x) { return _mm256_set1_ps(x); }
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vfnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
inline vf vfloor(vf a) { return _mm256_floor_ps(a); }
inline vf vpow2(vf n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline float vsum(vf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
using vi = __m256i;
inline vi vloadi(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline vi vseti(int x) { return _mm256_set1_epi32(x); }
template <int N>
inline vi vsrl(vi a) { return N ? _mm256_srli_epi32(a, N) : a; }
template <int N>
inline vi vsll(vi a) { return N ? _mm256_slli_epi32(a, N) : a; }
inline vi vandi(vi a, vi b) { return _mm256_and_si256(a, b); }
inline vi vori(vi a, vi b) { return _mm256_or_si256(a, b); }
inline vi vandor(vi a, vi m, vi b) { return _mm256_or_si256(_mm256_and_si256(a, m), b); }
inline vf vcvt(vi a) { return _mm256_cvtepi32_ps(a); }
inline vf vasf(vi a) { return _mm256_castsi256_ps(a); }
inline vf vbcast(const float* p) { return _mm256_broadcast_ss(p); }
inline void vstore_bf16(uint16_t* p, vf v) {
  const vi b = _mm256_castps_si256(v);
  const vi r = _mm256_srli_epi32(
      _mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1)))), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
inline __m128 vsum4(const vf (&a)[4]) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));  // [sums of halves 0..3] per lane
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}
}  // namespace
#endif
