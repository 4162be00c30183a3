// SIMD vectors through GCC/Clang vector extensions: the width follows what -march=native enables
// (16 lanes with AVX-512, 8 with AVX, 4 otherwise), so one source serves every CPU.
// -DTINYKNN_FORCE_LANES=4|8|16 forces a width: GCC and Clang lower wider vectors to two or four native
// operations, so a 16-lane (AVX-512-shaped) build runs on any x86-64 CPU; tests use it to check the
// panel width of an AVX-512 build on a machine without AVX-512.
#pragma once
#include <cstdint>
#include <cstring>

#include "../common.cuh"

#if defined(__AVX__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace tinyknn {

#if defined(__AVX512F__)
#define TK_NATIVE_LANES 16
#elif defined(__AVX__)
#define TK_NATIVE_LANES 8
#else
#define TK_NATIVE_LANES 4
#endif

#if defined(TINYKNN_FORCE_LANES)
#if TINYKNN_FORCE_LANES != 4 && TINYKNN_FORCE_LANES != 8 && TINYKNN_FORCE_LANES != 16
#error "TINYKNN_FORCE_LANES must be 4, 8 or 16"
#endif
#define TK_LANES TINYKNN_FORCE_LANES
#else
#define TK_LANES TK_NATIVE_LANES
#endif

constexpr int kLanes = TK_LANES;
typedef float Vec __attribute__((vector_size(4 * TK_LANES)));

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// kLanes float16 values widened to float32 (F16C where the CPU has it).
inline Vec load(const half_bits* p) {
#if defined(__F16C__) && TK_LANES == 8 && TK_NATIVE_LANES >= 8
  return (Vec)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(__AVX512F__) && TK_LANES == 16
  return (Vec)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
  Vec v;
  for (int l = 0; l < kLanes; ++l) v[l] = half_to_float(p[l]);
  return v;
#endif
}

// kLanes bfloat16, int8 or uint8 values widened to float32 (exact).
template <class Narrow>
inline Vec load_widened(const Narrow* p) {
  Vec v;
  for (int l = 0; l < kLanes; ++l) v[l] = to_float(p[l]);
  return v;
}
inline Vec load(const bf16_bits* p) {
#if defined(__AVX2__) && TK_LANES == 8 && TK_NATIVE_LANES >= 8
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return (Vec)_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
#elif defined(__AVX512F__) && TK_LANES == 16
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return (Vec)_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
#else
  return load_widened(p);
#endif
}
inline Vec load(const signed char* p) {
#if defined(__AVX2__) && TK_LANES == 8 && TK_NATIVE_LANES >= 8
  return (Vec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX512F__) && TK_LANES == 16
  return (Vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  return load_widened(p);
#endif
}
inline Vec load(const unsigned char* p) {
#if defined(__AVX2__) && TK_LANES == 8 && TK_NATIVE_LANES >= 8
  return (Vec)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX512F__) && TK_LANES == 16
  return (Vec)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  return load_widened(p);
#endif
}

inline void store(float* p, Vec v) { std::memcpy(p, &v, sizeof v); }

inline Vec broadcast(float x) { return x - Vec{}; }

// Whether any lane of a < b holds.
inline bool any_less(Vec a, Vec b) {
#if TK_LANES == 8 && TK_NATIVE_LANES >= 8 && defined(__AVX__)
  return _mm256_movemask_ps(_mm256_cmp_ps((__m256)a, (__m256)b, _CMP_LT_OQ)) != 0;
#elif TK_LANES == 16 && defined(__AVX512F__)
  return _mm512_cmp_ps_mask((__m512)a, (__m512)b, _CMP_LT_OQ) != 0;
#else
  const auto below = a < b;
  bool any = false;
  for (int l = 0; l < kLanes; ++l) any |= below[l] != 0;
  return any;
#endif
}

inline float horizontal_sum(Vec v) {
  float sum = 0.0f;
  for (int l = 0; l < kLanes; ++l) sum += v[l];
  return sum;
}

// float16 bits -> float32 for n elements: F16C eight at a time where the CPU has it.
inline void convert(const half_bits* source, float* target, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(target + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(source + i))));
  }
#endif
  for (; i < n; ++i) target[i] = half_to_float(source[i]);
}

inline void convert(const float* source, float* target, int64_t n) { std::memcpy(target, source, n * sizeof(float)); }

// bfloat16, int8, uint8 -> float32 (exact), a vector at a time.
template <class Narrow>
inline void convert(const Narrow* source, float* target, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(target + i, load(source + i));
  for (; i < n; ++i) target[i] = to_float(source[i]);
}

inline const char* simd_description() {
#if TK_LANES != TK_NATIVE_LANES
#if TK_LANES == 16
  return "forced 16 lanes (TINYKNN_FORCE_LANES, on native vectors of fewer)";
#elif TK_LANES == 8
  return "forced 8 lanes (TINYKNN_FORCE_LANES)";
#else
  return "forced 4 lanes (TINYKNN_FORCE_LANES)";
#endif
#elif defined(__AVX512F__)
  return "AVX-512 (16 lanes)";
#elif defined(__AVX2__) && defined(__FMA__)
  return "AVX2+FMA (8 lanes)";
#elif defined(__AVX__)
  return "AVX (8 lanes)";
#else
  return "128-bit vectors (4 lanes)";
#endif
}

inline const char* f16_description() {
#if defined(__F16C__)
  return "float16 via F16C";
#else
  return "float16 via portable conversion";
#endif
}

}  // namespace tinyknn
