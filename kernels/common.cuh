// tinyknn: definitions shared by the GPU kernels (compiled by NVRTC) and the CPU library (g++/clang++).
//
// Under NVRTC (__CUDACC_RTC__) no system header is available: everything here is self-contained.
// The host compiler sees TINYKNN_HD as nothing and gets the same inline functions.
#pragma once

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define TINYKNN_HD __host__ __device__ __forceinline__
#define TINYKNN_DEVICE 1
#else
#define TINYKNN_HD inline
#define TINYKNN_DEVICE 0
#include <cstdint>
#include <cstring>
#include <limits>
#endif

namespace tinyknn {

#if TINYKNN_DEVICE
typedef unsigned short half_bits;   // float16 storage, converted with cvt.f32.f16 (no cuda_fp16.h needed)
typedef long long int64;
#else
typedef std::uint16_t half_bits;
typedef std::int64_t int64;
#endif

// +infinity without <cmath>: padding distance and "worst key" of the selection.
TINYKNN_HD float positive_infinity() {
#if TINYKNN_DEVICE
  return __int_as_float(0x7f800000);
#else
  return std::numeric_limits<float>::infinity();
#endif
}

// float16 bits -> float. The device uses the hardware conversion; the host a portable bit-exact one
// (the CPU library converts whole blocks with F16C where the CPU has it, see kernels/cpu/).
TINYKNN_HD float half_to_float(half_bits h) {
#if TINYKNN_DEVICE
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#else
  const std::uint32_t sign = (std::uint32_t)(h & 0x8000u) << 16;
  std::uint32_t exponent = (h >> 10) & 0x1fu;
  std::uint32_t mantissa = h & 0x3ffu;
  std::uint32_t bits;
  if (exponent == 0x1fu) {
    bits = sign | 0x7f800000u | (mantissa << 13);          // inf / NaN
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);  // normal: rebias 15 -> 127
  } else if (mantissa == 0) {
    bits = sign;                                            // +-0
  } else {                                                  // subnormal: normalise
    exponent = 113u;
    while ((mantissa & 0x400u) == 0) { mantissa <<= 1; --exponent; }
    bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

// bfloat16 storage: the upper 16 bits of a float32. A struct, so that overloads tell it from float16.
struct bf16_bits {
  unsigned short bits;
};

TINYKNN_HD float bf16_to_float(bf16_bits h) {
#if TINYKNN_DEVICE
  return __uint_as_float((unsigned)h.bits << 16);
#else
  const std::uint32_t bits = (std::uint32_t)h.bits << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

// Storage element -> float32 (exact for every storage type: float32, float16, bfloat16, int8, uint8).
TINYKNN_HD float to_float(float x) { return x; }
TINYKNN_HD float to_float(half_bits x) { return half_to_float(x); }
TINYKNN_HD float to_float(bf16_bits x) { return bf16_to_float(x); }
TINYKNN_HD float to_float(signed char x) { return (float)x; }
TINYKNN_HD float to_float(unsigned char x) { return (float)x; }

}  // namespace tinyknn
