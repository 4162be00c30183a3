// tinyknn: distance loops of the GPU kernels, templated on metric, storage type and dimension.
//
// Layout: a stored row is DIM elements followed by zeros up to a whole number of 16-byte chunks
// (RowLayout::STRIDE elements), so every row starts 16-byte aligned and is read with 16-byte loads.
// Queries are float32 padded with zeros to the same STRIDE (in elements). Zeros add nothing to l2
// (0 - 0) nor to inner products, so the loops run over whole chunks without a tail.
//
// Summation order: each lane sums its chunks in two partial sums (even and odd elements), the lanes
// that share a row are added pairwise (a butterfly), all in float32. The tests check the result
// against float64 with a bound of dim * 2^-24 relative to the sum of magnitudes.
#pragma once
#include "metrics.cuh"

#define TINYKNN_D __device__ __forceinline__

namespace tinyknn {

constexpr unsigned FULL_WARP = 0xffffffffu;

template <class T, int DIM>
struct RowLayout {
  static_assert(DIM >= 1, "DIM must be positive");
  static constexpr int PER_CHUNK = 16 / (int)sizeof(T);                 // elements per 16-byte chunk
  static constexpr int CHUNKS = (DIM + PER_CHUNK - 1) / PER_CHUNK;      // chunks per row
  static constexpr int STRIDE = CHUNKS * PER_CHUNK;                     // elements per padded row
};

__host__ __device__ constexpr int align16(int nbytes) { return (nbytes + 15) / 16 * 16; }
__host__ __device__ constexpr int padded_k(int k) { return k <= 32 ? 32 : (k + 31) / 32 * 32; }
__host__ __device__ constexpr bool is_pow2(int n) { return n > 0 && (n & (n - 1)) == 0; }

// A 16-byte chunk of storage elements, unpacked to floats.
template <class T> struct Chunk;

template <> struct Chunk<float> {
  static constexpr int N = 4;
  TINYKNN_D static void unpack(const uint4& raw, float (&x)[N]) {
    x[0] = __uint_as_float(raw.x);
    x[1] = __uint_as_float(raw.y);
    x[2] = __uint_as_float(raw.z);
    x[3] = __uint_as_float(raw.w);
  }
};

template <> struct Chunk<half_bits> {
  static constexpr int N = 8;
  TINYKNN_D static void unpack(const uint4& raw, float (&x)[N]) {
    const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      x[2 * i] = half_to_float((half_bits)(words[i] & 0xffffu));
      x[2 * i + 1] = half_to_float((half_bits)(words[i] >> 16));
    }
  }
};

template <> struct Chunk<bf16_bits> {
  static constexpr int N = 8;
  TINYKNN_D static void unpack(const uint4& raw, float (&x)[N]) {
    const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      x[2 * i] = __uint_as_float(words[i] << 16);
      x[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
    }
  }
};

// 8-bit integers: 16 to a chunk, each exactly a float.
template <class Byte> struct ByteChunk {
  static constexpr int N = 16;
  TINYKNN_D static void unpack(const uint4& raw, float (&x)[N]) {
    const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int b = 0; b < 4; ++b) x[4 * i + b] = (float)(Byte)((words[i] >> (8 * b)) & 0xffu);
    }
  }
};
template <> struct Chunk<signed char> : ByteChunk<signed char> {};
template <> struct Chunk<unsigned char> : ByteChunk<unsigned char> {};

TINYKNN_D uint4 zero_chunk() { return make_uint4(0u, 0u, 0u, 0u); }

// The 16-byte chunks part, part + G, ... (CPL of them) of stored row `row`, zeros where the row is not
// valid or the chunk lies past the row: the G lanes of a row load it together.
template <class T, int DIM, int G, int CPL>
TINYKNN_D void load_row_chunks(const T* __restrict__ data, int row, bool valid, int part, uint4 (&raw)[CPL]) {
  using Layout = RowLayout<T, DIM>;
  const uint4* row_chunks = reinterpret_cast<const uint4*>(data) + (long long)row * Layout::CHUNKS;
#pragma unroll
  for (int i = 0; i < CPL; ++i) {
    const int c = part + i * G;
    raw[i] = (valid && (CPL * G == Layout::CHUNKS || c < Layout::CHUNKS)) ? __ldg(row_chunks + c) : zero_chunk();
  }
}

// Accumulates one stored chunk against the matching float32 query elements (16-byte aligned,
// usually shared memory) into two partial sums.
template <class Metric, class T>
TINYKNN_D void accumulate_chunk(float& even, float& odd, const uint4& raw, const float* query) {
  float x[Chunk<T>::N];
  Chunk<T>::unpack(raw, x);
#pragma unroll
  for (int e = 0; e < Chunk<T>::N; e += 4) {
    const float4 q = *reinterpret_cast<const float4*>(query + e);
    even = Metric::accumulate(even, q.x, x[e]);
    odd = Metric::accumulate(odd, q.y, x[e + 1]);
    even = Metric::accumulate(even, q.z, x[e + 2]);
    odd = Metric::accumulate(odd, q.w, x[e + 3]);
  }
}

// Sum over groups of G consecutive lanes (G a power of two); every lane of a group gets the sum.
template <int G>
TINYKNN_D float sum_over_lanes(float value) {
#pragma unroll
  for (int offset = G / 2; offset > 0; offset /= 2) value += __shfl_xor_sync(FULL_WARP, value, offset);
  return value;
}

// 1 / |q| of a float32 row of `n` elements by one warp (every lane gets it).
TINYKNN_D float warp_inverse_norm(const float* row, int n, int lane) {
  float sum = 0.0f;
  for (int e = lane; e < n; e += 32) sum += row[e] * row[e];
  return inverse_norm(sum_over_lanes<32>(sum));
}

TINYKNN_D unsigned dynamic_smem_bytes() {
  unsigned bytes;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
  return bytes;
}

// A launch with less dynamic shared memory than the kernel's layout is a host bug: stop loudly.
TINYKNN_D void require_dynamic_smem(unsigned bytes) {
  if (dynamic_smem_bytes() < bytes) __trap();
}

}  // namespace tinyknn
