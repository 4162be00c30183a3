// tinyknn: k-selection by one warp, with k a template parameter.
//
// WarpLists holds LISTS lists (one per query the warp serves), each the k best (key, position)
// pairs seen so far; smaller key is better. A list is spread over the 32 lanes: slot s of lane l is
// entry s * 32 + l, SLOTS = ceil(k / 32) slots per lane; slots past k hold -inf so they are never
// the worst. Every lane knows each list's threshold (its worst key) and where it sits. A candidate
// better than the threshold replaces the worst entry, then a warp argmax finds the new worst: once
// a list has filled this is rare (for data in random order about k * ln(n / k) times over n
// candidates), and it is always correct, whatever the order.
//
// Many candidates at once (a list's first tile, where every candidate beats the empty list's +inf):
// shared-memory lists of up to BULK_MAX_SLOTS slots a lane are rebuilt in one go instead. A bitwise
// radix select over the list and the candidates (one ballot per bit and value) finds the k-th best;
// the k best are written back and the threshold found once. That replaces dozens of serial
// insertions, each a chain of shuffles, by about 32 ballots per value.
//
// Storage: registers, indexed only by compile-time constants (so nothing goes to local memory), or
// shared memory (the same algorithm). For register lists (the scan kernel) the insertion code exists
// once per call site and takes the list number at run time (registers are picked by select chains),
// which keeps those kernels small and quick to compile. Shared-memory lists (the tiled kernel, whose
// early tiles pass candidates to most lists) get one copy per list with the list number a
// compile-time constant: about 3x the compile time, and measured faster (bench/NOTES_GPU.md).
//
// Every member function is warp-collective: all 32 lanes call it together (uniform control flow).
#pragma once
#include "distance.cuh"

namespace tinyknn {

// ---- keys as ordered integers: a <= b as floats exactly when ordered_bits(a) <= ordered_bits(b) ----
TINYKNN_D unsigned ordered_bits(float key) {
  const unsigned u = __float_as_uint(key);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
TINYKNN_D float from_ordered_bits(unsigned u) {
  return __uint_as_float((u & 0x80000000u) ? (u & 0x7fffffffu) : ~u);
}

template <int K, int LISTS, bool IN_REGISTERS>
class WarpLists {
 public:
  static constexpr int SLOTS = (K + 31) / 32;
  static constexpr int LIST_SLOTS = SLOTS * 32;   // shared floats (and ints) per list
  static constexpr int BULK_MAX_SLOTS = 4;        // rebuilt lists keep their slots in registers meanwhile
  static constexpr bool BULK = !IN_REGISTERS && SLOTS <= BULK_MAX_SLOTS;
  static constexpr int BULK_MIN_CANDIDATES = 8;   // from this many pending candidates a rebuild is cheaper

  // Empty lists. keys/positions: LISTS * LIST_SLOTS shared slots for this warp (unused in registers).
  TINYKNN_D void init(float* keys, int* positions) {
    lane_ = threadIdx.x & 31;
    shared_keys_ = keys;
    shared_positions_ = positions;
#pragma unroll
    for (int l = 0; l < LISTS; ++l) {
#pragma unroll
      for (int s = 0; s < SLOTS; ++s) {
        set_fixed(l, s, s * 32 + lane_ < K ? positive_infinity() : -positive_infinity(), -1);
      }
      threshold_[l][0] = positive_infinity();
      worst_[l][0] = 0;   // entry 0 (slot 0 of lane 0) is always a real, empty entry
    }
  }

  // keys[l][j] is this lane's candidate for list l at position first + j (+inf offers nothing).
  // Returns a warp-uniform mask of the lists that changed (bit l: list l took a candidate).
  template <int N>
  TINYKNN_D unsigned offer(const float (&keys)[LISTS][N], int first) {
    unsigned waiting = 0;   // lists with a candidate below their threshold (tested with fixed indices)
#pragma unroll
    for (int l = 0; l < LISTS; ++l) {
      bool any = false;
#pragma unroll
      for (int j = 0; j < N; ++j) any |= keys[l][j] < threshold_[l][0];
      if (__any_sync(FULL_WARP, any)) waiting |= 1u << l;
    }
    unsigned changed = 0;
    if constexpr (!IN_REGISTERS) {
      // Shared lists (the tiled kernel, where candidates pass the bounds on most early tiles): the
      // list number stays a compile-time constant, so no select chain picks keys or thresholds.
#pragma unroll
      for (int l = 0; l < LISTS; ++l) {
        if (!((waiting >> l) & 1u)) continue;
        if constexpr (BULK) {
          if (pending(l, keys[l]) >= BULK_MIN_CANDIDATES) {
            int positions[N];
#pragma unroll
            for (int j = 0; j < N; ++j) positions[j] = first + j;
            rebuild(l, keys[l], positions);
            changed |= 1u << l;
            continue;
          }
        }
#pragma unroll
        for (int j = 0; j < N; ++j) {
          if (offer_to(l, keys[l][j], first + j)) changed |= 1u << l;
        }
      }
      return changed;
    }
#pragma unroll 1
    while (waiting) {       // register lists: one copy of the insertion code, the list picked at run time
      const int l = __ffs(waiting) - 1;
      waiting &= waiting - 1;
      float mine[N];
#pragma unroll
      for (int j = 0; j < N; ++j) {
        mine[j] = keys[0][j];
#pragma unroll
        for (int i = 1; i < LISTS; ++i) mine[j] = i == l ? keys[i][j] : mine[j];
      }
#pragma unroll 1
      for (int j = 0; j < N; ++j) {
        float key = mine[0];
#pragma unroll
        for (int i = 1; i < N; ++i) key = i == j ? mine[i] : key;
        if (offer_to(l, key, first + j)) changed |= 1u << l;
      }
    }
    return changed;
  }

  // Each lane offers one candidate to list l (l may be a run-time value); true if the list changed.
  TINYKNN_D bool offer_to(int l, float key, int position) {
    unsigned pending = __ballot_sync(FULL_WARP, key < threshold(l));
    bool changed = false;
    while (pending) {
      const int source = __ffs(pending) - 1;
      pending &= pending - 1;
      const float candidate = __shfl_sync(FULL_WARP, key, source);
      const int candidate_position = __shfl_sync(FULL_WARP, position, source);
      if (candidate < threshold(l)) {
        insert(l, candidate, candidate_position);
        changed = true;
      }
    }
    return changed;
  }

  // Offers to list l the k entries of a list written by store() at keys/positions.
  TINYKNN_D void offer_stored(int l, const float* keys, const int* positions) {
    if constexpr (BULK) {
      float stored_keys[SLOTS];
      int stored_positions[SLOTS];
#pragma unroll
      for (int s = 0; s < SLOTS; ++s) {
        const int entry = s * 32 + lane_;
        stored_keys[s] = entry < K ? keys[entry] : positive_infinity();
        stored_positions[s] = entry < K ? positions[entry] : -1;
      }
      if (pending(l, stored_keys) >= BULK_MIN_CANDIDATES) {
        rebuild(l, stored_keys, stored_positions);
        return;
      }
    }
#pragma unroll 1
    for (int s = 0; s < SLOTS; ++s) {
      const int entry = s * 32 + lane_;
      const bool real = entry < K;
      offer_to(l, real ? keys[entry] : positive_infinity(), real ? positions[entry] : -1);
    }
  }

  // Writes list l (a compile-time index in practice): entry j (j < k) to keys[j], positions[j].
  template <class Position>
  TINYKNN_D void store(int l, float* keys, Position* positions) const {
#pragma unroll
    for (int s = 0; s < SLOTS; ++s) {
      const int entry = s * 32 + lane_;
      if (entry < K) {
        keys[entry] = key(l, s);
        positions[entry] = (Position)position(l, s);
      }
    }
  }

  TINYKNN_D float threshold(int l) const { return pick(threshold_, l, 0); }

 private:
  // values[l][s] with l a run-time value: a select chain, so the array stays in registers.
  template <class V, int N>
  TINYKNN_D static V pick(const V (&values)[LISTS][N], int l, int s) {
    V value = values[0][s];
#pragma unroll
    for (int i = 1; i < LISTS; ++i) value = i == l ? values[i][s] : value;
    return value;
  }

  // Slot s of list l on this lane (s compile-time for register lists).
  TINYKNN_D float key(int l, int s) const {
    if constexpr (IN_REGISTERS) return pick(keys_, l, s);
    else return shared_keys_[l * LIST_SLOTS + s * 32 + lane_];
  }
  TINYKNN_D int position(int l, int s) const {
    if constexpr (IN_REGISTERS) return pick(positions_, l, s);
    else return shared_positions_[l * LIST_SLOTS + s * 32 + lane_];
  }
  // l and s compile-time constants.
  TINYKNN_D void set_fixed(int l, int s, float key, int position) {
    if constexpr (IN_REGISTERS) {
      keys_[l][s] = key;
      positions_[l][s] = position;
    } else {
      shared_keys_[l * LIST_SLOTS + s * 32 + lane_] = key;
      shared_positions_[l * LIST_SLOTS + s * 32 + lane_] = position;
    }
  }

  // How many of the warp's candidates (N a lane) beat list l's threshold.
  template <int N>
  TINYKNN_D int pending(int l, const float (&keys)[N]) const {
    const float limit = threshold(l);
    int count = 0;
#pragma unroll
    for (int j = 0; j < N; ++j) count += __popc(__ballot_sync(FULL_WARP, keys[j] < limit));
    return count;
  }

  // List l (shared memory) becomes the K best of itself and the candidates below its threshold.
  template <int N>
  TINYKNN_D void rebuild(int l, const float (&keys)[N], const int (&positions)[N]) {
    const float limit = threshold(l);
    float old_keys[SLOTS];
    int old_positions[SLOTS];
    unsigned old_bits[SLOTS], new_bits[N];
    bool old_in[SLOTS], new_in[N];
#pragma unroll
    for (int s = 0; s < SLOTS; ++s) {
      old_in[s] = s * 32 + lane_ < K;
      old_keys[s] = old_in[s] ? shared_keys_[l * LIST_SLOTS + s * 32 + lane_] : positive_infinity();
      old_positions[s] = old_in[s] ? shared_positions_[l * LIST_SLOTS + s * 32 + lane_] : -1;
      old_bits[s] = ordered_bits(old_keys[s]);
    }
#pragma unroll
    for (int j = 0; j < N; ++j) {
      new_in[j] = keys[j] < limit;   // the rest could never enter (and +inf ones must not)
      new_bits[j] = ordered_bits(keys[j]);
    }
    // The K-th smallest ordered key, bit by bit from the top; `remaining` ends as how many of the
    // values equal to it belong to the K best.
    unsigned kth = 0;
    int remaining = K;
#pragma unroll 1
    for (int bit = 31; bit >= 0; --bit) {
      const unsigned high = ~0u << bit;
      int count = 0;
#pragma unroll
      for (int s = 0; s < SLOTS; ++s) count += __popc(__ballot_sync(FULL_WARP, old_in[s] && (old_bits[s] & high) == kth));
#pragma unroll
      for (int j = 0; j < N; ++j) count += __popc(__ballot_sync(FULL_WARP, new_in[j] && (new_bits[j] & high) == kth));
      if (count < remaining) {
        remaining -= count;
        kth |= 1u << bit;
      }
    }
    __syncwarp();   // every lane has read the old list
    const unsigned lanes_below = (1u << lane_) - 1;
    int below_taken = 0, equal_seen = 0;
    auto place = [&](bool in, unsigned bits, float key, int position) {
      const bool below = in && bits < kth, equal = in && bits == kth;
      const unsigned below_mask = __ballot_sync(FULL_WARP, below), equal_mask = __ballot_sync(FULL_WARP, equal);
      int entry = -1;
      if (below) entry = below_taken + __popc(below_mask & lanes_below);
      if (equal) {
        const int e = equal_seen + __popc(equal_mask & lanes_below);
        if (e < remaining) entry = K - remaining + e;
      }
      if (entry >= 0) {
        shared_keys_[l * LIST_SLOTS + entry] = key;
        shared_positions_[l * LIST_SLOTS + entry] = position;
      }
      below_taken += __popc(below_mask);
      equal_seen += __popc(equal_mask);
    };
#pragma unroll
    for (int s = 0; s < SLOTS; ++s) place(old_in[s], old_bits[s], old_keys[s], old_positions[s]);
#pragma unroll
    for (int j = 0; j < N; ++j) place(new_in[j], new_bits[j], keys[j], positions[j]);
    __syncwarp();
    find_worst(l);
  }

  TINYKNN_D void insert(int l, float key, int position) {
    const int worst = pick(worst_, l, 0);
    if (lane_ == (worst & 31)) {
      const int slot = worst >> 5;
      if constexpr (IN_REGISTERS) {
#pragma unroll
        for (int i = 0; i < LISTS; ++i)
#pragma unroll
          for (int s = 0; s < SLOTS; ++s)
            if (i == l && s == slot) set_fixed(i, s, key, position);
      } else {
        shared_keys_[l * LIST_SLOTS + worst] = key;
        shared_positions_[l * LIST_SLOTS + worst] = position;
      }
    }
    if constexpr (!IN_REGISTERS) __syncwarp();
    find_worst(l);
  }

  // The largest key of list l and where it sits; ties go to the lowest entry so that every lane
  // reaches the same answer.
  TINYKNN_D void find_worst(int l) {
    float worst_key = key(l, 0);
    int worst_slot = 0;
#pragma unroll (IN_REGISTERS ? SLOTS : 1)
    for (int s = 1; s < SLOTS; ++s) {
      const float k = key(l, s);
      if (k > worst_key) {
        worst_key = k;
        worst_slot = s;
      }
    }
    int where = worst_slot * 32 + lane_;
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      const float other_key = __shfl_xor_sync(FULL_WARP, worst_key, offset);
      const int other_where = __shfl_xor_sync(FULL_WARP, where, offset);
      if (other_key > worst_key || (other_key == worst_key && other_where < where)) {
        worst_key = other_key;
        where = other_where;
      }
    }
#pragma unroll
    for (int i = 0; i < LISTS; ++i) {
      if (i == l) {
        threshold_[i][0] = worst_key;
        worst_[i][0] = where;
      }
    }
  }

  float keys_[LISTS][IN_REGISTERS ? SLOTS : 1];
  int positions_[LISTS][IN_REGISTERS ? SLOTS : 1];
  float* shared_keys_;
  int* shared_positions_;
  float threshold_[LISTS][1];   // [..][1] so that pick() serves them too
  int worst_[LISTS][1];
  int lane_;
};

// ---- a bound shared by every block that serves one query ---------------------------------------
// Each list that holds k real candidates publishes its threshold (its k-th best key); the true k-th
// best key of the query is no larger, so a candidate whose key is not below the smallest published
// threshold can never be needed (ties at the bound: k candidates at least as good exist already).
// Stored as ~ordered_bits(key) and max-accumulated, so that 0 (a zeroed buffer) means "none yet".
TINYKNN_D float read_bound(const unsigned* bound) {
  const unsigned stored = __ldcg(bound);
  return stored ? from_ordered_bits(~stored) : positive_infinity();
}
TINYKNN_D void publish_bound(unsigned* bound, float threshold) {
  if (threshold < positive_infinity()) atomicMax(bound, ~ordered_bits(threshold));
}

// ---- block-wide radix select --------------------------------------------------------------------
// Warp 0 of a radix select's pass: the digit (bin of histogram[0..255]) where the running count reaches
// `remaining` goes to histogram[256], the count of the bins before it to histogram[257]. 8 bins a lane.
TINYKNN_D void find_digit(unsigned* histogram, unsigned remaining) {
  const int lane = threadIdx.x & 31;
  unsigned counts[8], sum = 0;
#pragma unroll
  for (int b = 0; b < 8; ++b) {
    counts[b] = histogram[lane * 8 + b];
    sum += counts[b];
  }
  unsigned inclusive = sum;
#pragma unroll
  for (int offset = 1; offset < 32; offset *= 2) {
    const unsigned other = __shfl_up_sync(FULL_WARP, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  const unsigned before = inclusive - sum;
  if (before < remaining && remaining <= inclusive) {
    unsigned below = before;
    int digit = lane * 8;
#pragma unroll
    for (int b = 0; b < 8; ++b) {
      if (below + counts[b] >= remaining) break;
      below += counts[b];
      ++digit;
    }
    histogram[256] = digit;
    histogram[257] = below;
  }
}

// The ordered bits of the k-th smallest of n keys (k <= n) and how many keys equal to it belong to
// the k smallest (the rest are strictly smaller). Four passes of 8 bits over the keys (read from
// global memory, usually L2); histogram counts are aggregated per warp (__match_any_sync) so that
// keys sharing their top bits do not serialise on one shared counter. `histogram` holds 256 + 2
// unsigned ints of shared memory. Every thread of the block calls it; ends with a __syncthreads().
TINYKNN_D unsigned block_select(const float* keys, long long n, int k, unsigned* histogram, int& ties) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, threads = blockDim.x;
  unsigned prefix = 0;
  int remaining = k;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += threads) histogram[i] = 0;
    __syncthreads();
    const unsigned high = shift == 24 ? 0u : 0xffffffffu << (shift + 8);
    for (long long base = (long long)warp * 32; base < n; base += threads) {
      const long long i = base + lane;
      unsigned digit = 256;   // no bin: outside the keys or not under the prefix
      if (i < n) {
        const unsigned u = ordered_bits(keys[i]);
        if ((u & high) == prefix) digit = (u >> shift) & 255u;
      }
      const unsigned peers = __match_any_sync(FULL_WARP, digit);
      if (digit < 256 && lane == __ffs(peers) - 1) atomicAdd(&histogram[digit], (unsigned)__popc(peers));
    }
    __syncthreads();
    if (warp == 0) find_digit(histogram, (unsigned)remaining);
    __syncthreads();
    prefix |= histogram[256] << shift;
    remaining -= (int)histogram[257];
  }
  __syncthreads();   // every thread has read histogram[256..257] before anyone reuses them
  ties = remaining;
  return prefix;
}

// Sorts n (a power of two) (key, position) pairs in shared memory by key, ascending, with all the
// block's threads (bitonic network). Ends with a __syncthreads().
TINYKNN_D void block_sort(float* keys, int* positions, int n) {
  for (int size = 2; size <= n; size *= 2) {
    for (int stride = size / 2; stride > 0; stride /= 2) {
      for (int i = threadIdx.x; i < n / 2; i += blockDim.x) {
        const int low = 2 * i - (i & (stride - 1));
        const int high = low + stride;
        const bool ascending = (low & size) == 0;
        const float a = keys[low], b = keys[high];
        const int pa = positions[low], pb = positions[high];
        const bool out_of_order = a > b || (a == b && pa > pb);
        if (out_of_order == ascending) {
          keys[low] = b;
          keys[high] = a;
          positions[low] = pb;
          positions[high] = pa;
        }
      }
      __syncthreads();
    }
  }
}

}  // namespace tinyknn
