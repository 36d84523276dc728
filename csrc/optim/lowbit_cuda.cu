// CUDA kernel of fastamp::adam_lowbit_step_: Adam/AdamW with bfloat16 (stochastically rounded) or
// 8-bit block-quantized moments, on the multi-tensor engine, in the same three stream-ordered
// passes as adam_step_ (optim_cuda.cu's header). The element math is lowbit_math.h's and
// optim_math.h's, shared with the CPU kernels, so the emulated kernel is compared bit for bit.
//
// List layout: 0 params (T), 1 grads (T), 2 exp_avgs, 3 exp_avg_sqs (uint16 bits of bfloat16, or
// uint8 codes), [master_params (float32)], then, for 8-bit codes, the side lists exp_avg_absmax
// and exp_avg_sq_absmax (float32, one per 256-element block: MtaBlock::side_ptr).
//
// Memory access: 16-byte vectors per lane where the chunk's lists are all 16-byte aligned, as in
// the float32 kernels. Each warp takes tiles of 32 * G consecutive elements (G = 16 for 8-bit
// codes, 8 for bfloat16 state); a lane computes on groups of 4 consecutive elements 128 apart
// (group k: k*128 + 4*lane + j), one group at a time, so a float32 list is one coalesced 16-byte
// access per group (half params and grads: 8 bytes, as the float32-state kernels move them).
// The state lists (1-byte codes, 2-byte bfloat16) move between global memory and a per-warp
// buffer in shared memory as whole 16-byte vectors per lane (16 codes or 8 values), and the
// lanes read and write their groups there: a warp transpose, as cub's WARP_LOAD_TRANSPOSE. The
// one vector the chunk's end cuts moves element by element. Misaligned chunks take the scalar
// path: one element per lane per access, group k then holding k*128 + j*32 + lane (coalesced,
// and in the same quantization block as on the vector path). Every element's math, rounding key
// and block are the same on both paths, so the bits are too.
// 8-bit misaligned chunks instead take update_q8_scalar (one element per thread, the block maximum
// over the block's 8 warps): registers. The 8-bit kernel is bounded to 64 registers a thread
// (kMinBlocks: 2 blocks of 512 threads per SM, .ci/gpu_resources.py's occupancy floor); holding
// the scalar path's loads beside the vector path's in one loop made ptxas spill at that bound.
//
// 8-bit: a tile is two quantization blocks (groups 0-1 and 2-3); a block's new absmax is a max
// over one warp (shuffles), exact in any order, as on the CPU. The chunk's block scales are read
// into shared memory once per CUDA block and written back from it, in 16-byte vectors.
#include "common/torch_api.h"

#include "common/gpu.cuh"
#include "common/multi_tensor_apply_cuda.cuh"
#include "optim/lowbit_math.h"
#include "optim/optim_checks.h"
#include "optim/optim_cuda.cuh"
#include "optim/optim_math.h"

#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace fastamp {
namespace optim {
namespace {

static_assert(kQuantBlock == kMtaSideBlock, "the engine's side lists are the quantization blocks");
static_assert(kChunkElems % 512 == 0, "whole tiles per chunk, so a tile never straddles chunks");

constexpr int kWarps = kMtaThreads / 32;
using Word4 = gpu::Vec<uint32_t, 4>;  // a 16-byte vector, whatever the elements

// --- warp tiles ----------------------------------------------------------------------------------

/// Group k's element j of this lane, within the tile: see the header.
__device__ __forceinline__ int tile_elem(bool vec, int k, int j, int lane) {
  return vec ? k * 128 + 4 * lane + j : k * 128 + j * 32 + lane;
}

__device__ __forceinline__ bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

/// The unsigned integer of E's size.
template <typename E>
using Bits = std::conditional_t<sizeof(E) == 1, uint8_t, uint16_t>;

/// Element t (of 4 / sizeof(E)) of a little-endian 32-bit word, and back.
template <typename E>
__device__ __forceinline__ E word_elem(uint32_t w, int t) {
  const Bits<E> u = static_cast<Bits<E>>(w >> (8 * sizeof(E) * t));
  E e;
  std::memcpy(&e, &u, sizeof(E));
  return e;
}

template <typename E>
__device__ __forceinline__ uint32_t elem_word(E e, int t) {
  Bits<E> u;
  std::memcpy(&u, &e, sizeof(E));
  return static_cast<uint32_t>(u) << (8 * sizeof(E) * t);
}

/// A list of the parameter's width (float32, or the half params and grads) within a tile, one
/// group of 4 elements at a time, straight from and to global memory: on the vector path a group
/// is one access (16 bytes for float32; 8 for half, as the float32-state kernels move half
/// params), elements past the chunk's end one by one or not at all.
template <typename E>
struct DirectList {
  using Group = gpu::Vec<E, 4>;
  E* base;  // the tile's first element
  int live;
  bool vec;

  __device__ __forceinline__ void read(int k, int lane, float (&x)[4]) const {
    if (vec && k * 128 + 4 * lane + 4 <= live) {
      const Group r = gpu::vec_load(reinterpret_cast<const Group*>(base + k * 128 + 4 * lane));
#pragma unroll
      for (int j = 0; j < 4; ++j) x[j] = static_cast<float>(r.v[j]);
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int e = tile_elem(vec, k, j, lane);
        x[j] = e < live ? static_cast<float>(base[e]) : 0.0f;
      }
    }
  }

  __device__ __forceinline__ void write(int k, int lane, const float (&x)[4]) const {
    Group r;
#pragma unroll
    for (int j = 0; j < 4; ++j) r.v[j] = static_cast<E>(x[j]);
    if (vec && k * 128 + 4 * lane + 4 <= live) {
      gpu::vec_store(reinterpret_cast<Group*>(base + k * 128 + 4 * lane), r);
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int e = tile_elem(vec, k, j, lane);
        if (e < live) base[e] = r.v[j];
      }
    }
  }
};

/// A 1- or 2-byte state list (8-bit codes, bfloat16 bits) within a tile of 32 * G elements. On
/// the vector path the tile moves between global and the warp's shared buffer `stage` in 16-byte
/// vectors per lane (vector q * 32 + lane; the one the chunk's end cuts element by element), and
/// the lanes read and write their groups there: a warp transpose. On the scalar path groups are
/// read and written in global memory directly.
template <int G, typename E>
struct StagedList {
  static_assert(sizeof(E) == 1 || sizeof(E) == 2, "1- or 2-byte elements");
  static constexpr int kVecs = G * static_cast<int>(sizeof(E)) / 16;  // per lane
  static constexpr int kPerVec = 16 / static_cast<int>(sizeof(E));
  static constexpr int kWords = static_cast<int>(sizeof(E));  // per group of 4
  static constexpr int kPerWord = 4 / static_cast<int>(sizeof(E));
  static_assert(kVecs >= 1 && G * sizeof(E) % 16 == 0, "whole 16-byte vectors per lane");

  E* base;
  int live;
  bool vec;
  uint32_t* stage;  // 32 * G * sizeof(E) bytes, this warp's

  /// Global to shared (vector path); the caller then runs __syncwarp().
  __device__ __forceinline__ void load(int lane) const {
    if (!vec) return;
#pragma unroll
    for (int q = 0; q < kVecs; ++q) {
      const int first = (q * 32 + lane) * kPerVec;
      Word4 r;
      if (first + kPerVec <= live) {
        r = gpu::vec_load(reinterpret_cast<const Word4*>(base) + q * 32 + lane);
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) r.v[i] = 0u;
#pragma unroll
        for (int t = 0; t < kPerVec; ++t) {
          if (first + t < live) r.v[t / kPerWord] |= elem_word<E>(base[first + t], t % kPerWord);
        }
      }
      *reinterpret_cast<Word4*>(stage + 4 * (q * 32 + lane)) = r;
    }
  }

  /// Shared to global (vector path), after a __syncwarp() that follows every write().
  __device__ __forceinline__ void store(int lane) const {
    if (!vec) return;
#pragma unroll
    for (int q = 0; q < kVecs; ++q) {
      const int first = (q * 32 + lane) * kPerVec;
      const Word4 r = *reinterpret_cast<const Word4*>(stage + 4 * (q * 32 + lane));
      if (first + kPerVec <= live) {
        gpu::vec_store(reinterpret_cast<Word4*>(base) + q * 32 + lane, r);
      } else {
#pragma unroll
        for (int t = 0; t < kPerVec; ++t) {
          if (first + t < live) base[first + t] = word_elem<E>(r.v[t / kPerWord], t % kPerWord);
        }
      }
    }
  }

  __device__ __forceinline__ void read(int k, int lane, E (&x)[4]) const {
    if (vec) {
#pragma unroll
      for (int i = 0; i < kWords; ++i) {
        const uint32_t w = stage[(k * 32 + lane) * kWords + i];
#pragma unroll
        for (int t = 0; t < kPerWord; ++t) x[i * kPerWord + t] = word_elem<E>(w, t);
      }
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int e = tile_elem(false, k, j, lane);
        x[j] = e < live ? base[e] : E{};
      }
    }
  }

  __device__ __forceinline__ void write(int k, int lane, const E (&x)[4]) const {
    if (vec) {
#pragma unroll
      for (int i = 0; i < kWords; ++i) {
        uint32_t w = 0;
#pragma unroll
        for (int t = 0; t < kPerWord; ++t) w |= elem_word<E>(x[i * kPerWord + t], t);
        stage[(k * 32 + lane) * kWords + i] = w;
      }
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int e = tile_elem(false, k, j, lane);
        if (e < live) base[e] = x[j];
      }
    }
  }
};

/// The calling warp's staging buffers: `Lists` tiles of 32 * G elements of E.
template <int G, typename E, int Lists>
__device__ __forceinline__ uint32_t* warp_stage() {
  __shared__ Word4 stage[kWarps][Lists * G * 32 * static_cast<int>(sizeof(E)) / 16];
  return reinterpret_cast<uint32_t*>(stage[threadIdx.x / 32]);
}

/// What thread 0 of a block reads from global memory for the whole block (the tensor's step, the
/// shared scalars) and hands the others through shared memory: one request per block for each,
/// not one per warp.
struct BlockScalars {
  AdamCoefs c;   // Adam only
  float neg_lr;  // SGD only
  float inv;     // inverse loss scale (1 without)
  float coef;    // clip coefficient (1 without)
  uint32_t key;  // stochastic rounding key of this tensor at the new step
  bool first;    // SGD: the buffer gets the gradient
  bool skip;     // found_inf: the block leaves
};

/// Copies the n (<= 256) block scales of a chunk between global `g` and shared `s` by 256
/// threads (t = 0..255): 16-byte vectors where g is aligned, the partial last vector and
/// misaligned lists one by one.
template <bool kStore>
__device__ __forceinline__ void copy_scales(float* g, float* s, int n, int t) {
  using F4 = gpu::Vec<float, 4>;
  if (aligned16(g)) {
    const int nv = n / 4;
    if (t < nv) {
      if constexpr (kStore) {
        gpu::vec_store(reinterpret_cast<F4*>(g) + t, reinterpret_cast<const F4*>(s)[t]);
      } else {
        reinterpret_cast<F4*>(s)[t] = gpu::vec_load(reinterpret_cast<const F4*>(g) + t);
      }
    } else if (t == nv) {
      for (int i = 4 * nv; i < n; ++i) {
        if constexpr (kStore) {
          g[i] = s[i];
        } else {
          s[i] = g[i];
        }
      }
    }
  } else if (t < n) {
    if constexpr (kStore) {
      g[t] = s[t];
    } else {
      s[t] = g[t];
    }
  }
}

/// The block's copy of its chunk's exp_avg (0) or exp_avg_sq (1) block scales: one array for
/// every param dtype's instantiation of a kernel (a __shared__ array declared in apply<T> would be
/// one per T).
template <bool kInt8>
__device__ __forceinline__ float* block_scales(int which) {
  constexpr int kScales = kInt8 ? kChunkElems / kQuantBlock : 4;
  __shared__ gpu::Vec<float, 4> scales[2][kScales / 4];
  return reinterpret_cast<float*>(scales[which]);
}

template <bool kInt8, bool kMaster>
struct AdamLowbitOp {
  // The lists of a block, by name, in the order run_update forms them: params, grads, the
  // plan's state (LowbitPlan: the two moments' codes), master params, then the side lists.
  static constexpr int kParams = 0;
  static constexpr int kGrads = 1;
  static constexpr int kExpAvgCodes = 2;
  static constexpr int kExpAvgSqCodes = 3;
  static constexpr int kCodes = 4;  // lists before master/side
  static constexpr int kMasterList = kCodes;
  static constexpr int kSide = kInt8 ? 2 : 0;
  static constexpr int kDepth = kCodes + (kMaster ? 1 : 0) + kSide;
  static constexpr int kAbsmaxM = kCodes + (kMaster ? 1 : 0);
  /// 8-bit: 2 blocks of 512 threads per SM (multi_tensor_apply_kernel's launch bounds), so at most
  /// 64 registers a thread: unbounded, ptxas spends over 100 on the vector path's loads.
  static constexpr int kMinBlocks = kInt8 ? 2 : 0;
  /// Elements per lane per tile: 16 codes (one 16-byte vector) or 8 bfloat16 values.
  static constexpr int G = kInt8 ? 16 : 8;
  static constexpr int kTile = 32 * G;
  using S = std::conditional_t<kInt8, uint8_t, uint16_t>;  // a state element

  AdamHyper h;
  StepScalars s;
  const float* steps;  // old step of each param, by list position
  double lr;
  uint32_t seed;

  template <typename T>
  __device__ void apply(const MtaBlock<kDepth>& blk) const {
    if constexpr (!std::is_same_v<T, double>) {  // params are never float64 (the op's checks)
      __shared__ BlockScalars shared;
      if (threadIdx.x == 0) {
        shared.skip = step_skipped(s.found_inf);
        if (!shared.skip) {
          const double lr_v = s.lr != nullptr ? static_cast<double>(*s.lr) : lr;
          const float old = steps[blk.index];
          shared.c = adam_coefs(h, lr_v, static_cast<double>(old) + 1.0);
          shared.key =
              sr_key(seed, static_cast<uint32_t>(old + 1.0f), static_cast<uint32_t>(blk.index));
          shared.inv = s.inv_scale != nullptr ? *s.inv_scale : 1.0f;
          shared.coef = s.clip_coef != nullptr ? *s.clip_coef : 1.0f;
        }
      }
      __syncthreads();
      if (shared.skip) return;  // the same in every thread: the block leaves
      // Read where used, not copied: registers are the 8-bit kernel's limit.
      const BlockScalars& b = shared;
      // 8-bit: the chunk's block scales, old then new. Maxima are taken as the bit patterns of
      // |m| and v (max_bits: the CPU kernels' integer maximum, so a NaN that reached the state,
      // a NaN gradient stepped without a scaler, wins on both).
      float* const sm = block_scales<kInt8>(0);
      float* const sv = block_scales<kInt8>(1);
      const int t = static_cast<int>(threadIdx.x);
      const int nq = (blk.len + kQuantBlock - 1) / kQuantBlock;
      if constexpr (kInt8) {
        if (t < 256) {
          copy_scales<false>(blk.template side_ptr<float>(kAbsmaxM), sm, nq, t);
        } else {
          copy_scales<false>(blk.template side_ptr<float>(kAbsmaxM + 1), sv, nq, t - 256);
        }
        __syncthreads();
      }

      T* const p = blk.template ptr<T>(kParams);
      const T* const g = blk.template ptr<T>(kGrads);
      S* const m = blk.template ptr<S>(kExpAvgCodes);
      S* const v = blk.template ptr<S>(kExpAvgSqCodes);
      float* mp = nullptr;
      if constexpr (kMaster) mp = blk.template ptr<float>(kMasterList);
      bool vec = aligned16(p) && aligned16(g) && aligned16(m) && aligned16(v);
      if constexpr (kMaster) vec = vec && aligned16(mp);
      const int lane = t & 31;
      uint32_t* const stage = warp_stage<G, S, 2>();
      // 8-bit: the vector path's loop on its own (vec a constant), and misaligned chunks in
      // update_q8_scalar; one loop with both paths would hold both paths' addresses and loads at
      // once, over the 64 registers that 2 blocks of 512 threads per SM leave each thread.
      const auto tiles = [&](auto vec_c) {
        const bool kVec = vec_c;
        for (int base = (t >> 5) * kTile; base < blk.len; base += kWarps * kTile) {
          const int live = blk.len - base < kTile ? blk.len - base : kTile;
          const DirectList<T> pl{p + base, live, kVec};
          const DirectList<T> gl{const_cast<T*>(g) + base, live, kVec};
          const DirectList<float> ml{kMaster ? mp + base : nullptr, live, kVec};
          const StagedList<G, S> ms{m + base, live, kVec, stage};
          const StagedList<G, S> vs{v + base, live, kVec, stage + kTile * sizeof(S) / 4};
          ms.load(lane);
          vs.load(lane);
          if (kVec) __syncwarp();
          // One group (bfloat16) or block (8-bit) at a time: unrolled, the compiler would hold two
          // groups' loads and maxima at once, over the 64 registers that 2 blocks of 512 threads
          // per SM leave each thread.
          if constexpr (kInt8) {
#pragma unroll 1
            for (int half = 0; half < 2; ++half) {
              update_q8_block<T>(half, pl, gl, ml, ms, vs, sm + base / kQuantBlock,
                                 sv + base / kQuantBlock, lane, b);
            }
          } else {
#pragma unroll 1
            for (int k = 0; k < G / 4; ++k) {
              update_bf16_group<T>(k, blk.start + base, pl, gl, ml, ms, vs, lane, b);
            }
          }
          if (kVec) __syncwarp();
          ms.store(lane);
          vs.store(lane);
        }
      };
      if constexpr (kInt8) {
        if (vec) {
          tiles(std::true_type{});
        } else {
          update_q8_scalar<T>(blk, p, g, mp, sm, sv, b);
        }
      } else {
        tiles(vec);
      }
      if constexpr (kInt8) {
        __syncthreads();  // every warp's new scales are in shared memory
        if (t < 256) {
          copy_scales<true>(blk.template side_ptr<float>(kAbsmaxM), sm, nq, t);
        } else {
          copy_scales<true>(blk.template side_ptr<float>(kAbsmaxM + 1), sv, nq, t - 256);
        }
      }
    }
  }

  /// A misaligned 8-bit chunk: one element per thread and iteration (512 consecutive elements,
  /// two quantization blocks of 8 warps each); a block's new absmax is a max over its warps
  /// (shuffles, then the 8 warps' maxima in shared memory), exact in any order, as on the CPU.
  /// `sm`, `sv`: the chunk's block scales (shared memory), read before and written after the
  /// barrier.
  template <typename T>
  __device__ __forceinline__ void update_q8_scalar(const MtaBlock<kDepth>& blk, T* p, const T* g,
                                                   float* mp, float* sm, float* sv,
                                                   const BlockScalars& b) const {
    constexpr int kWarpsPerBlock = kQuantBlock / 32;
    __shared__ uint32_t warp_m[kWarps];
    __shared__ uint32_t warp_v[kWarps];
    S* const mq = blk.template ptr<S>(kExpAvgCodes);
    S* const vq = blk.template ptr<S>(kExpAvgSqCodes);
    const int t = static_cast<int>(threadIdx.x);
    const int lane = t & 31;
    const int warp = t >> 5;
    // Every thread runs every iteration (the barriers and shuffles need all of them); threads
    // past the chunk's end carry 0, the identity of these maxima.
    for (int base = 0; base < blk.len; base += kMtaThreads) {
      const int e = base + t;
      const bool live = e < blk.len;
      const int qb = e / kQuantBlock;  // block within the chunk
      float mi = 0.0f;
      float vi = 0.0f;
      if (live) {
        mi = decode_m8(mq[e]) * sm[qb];
        vi = decode_v8(vq[e]) * sv[qb];
        float pi = kMaster ? mp[e] : static_cast<float>(p[e]);
        float unused = 0.0f;
        adam_update(pi, prep_grad(static_cast<float>(g[e]), b.inv, b.coef, h.maximize), mi, vi,
                    unused, h, b.c);
        if constexpr (kMaster) mp[e] = pi;
        p[e] = static_cast<T>(pi);
      }
      uint32_t wm = live ? (float_bits(mi) & 0x7FFFFFFFu) : 0u;
      uint32_t wv = live ? (float_bits(vi) & 0x7FFFFFFFu) : 0u;
#pragma unroll
      for (int off = 16; off > 0; off /= 2) {
        wm = max_bits(__shfl_xor_sync(0xffffffffu, wm, off), wm);
        wv = max_bits(__shfl_xor_sync(0xffffffffu, wv, off), wv);
      }
      if (lane == 0) {
        warp_m[warp] = wm;
        warp_v[warp] = wv;
      }
      __syncthreads();  // every warp's maxima written, every thread's old scale read
      const int first = (warp / kWarpsPerBlock) * kWarpsPerBlock;
      uint32_t mbits = 0u;
      uint32_t vbits = 0u;
#pragma unroll
      for (int w = 0; w < kWarpsPerBlock; ++w) {
        mbits = max_bits(warp_m[first + w], mbits);
        vbits = max_bits(warp_v[first + w], vbits);
      }
      const float mmax = bits_float(canonical_max(mbits));
      const float vmax = bits_float(canonical_max(vbits));
      if (live) {
        mq[e] = encode_m8(mi * block_reciprocal(mmax));
        vq[e] = encode_v8(vi * block_reciprocal(vmax));
        if (e % kQuantBlock == 0) {  // the block's first element writes its scales
          sm[qb] = mmax;
          sv[qb] = vmax;
        }
      }
      __syncthreads();  // the next iteration overwrites warp_m / warp_v
    }
  }

  /// The parameter as read: the float32 master when there is one (p is then its copy).
  template <typename T>
  __device__ __forceinline__ void read_param(int k, int lane, const DirectList<T>& pl,
                                             const DirectList<float>& ml, float (&x)[4]) const {
    if constexpr (kMaster) {
      ml.read(k, lane, x);
    } else {
      pl.read(k, lane, x);
    }
  }

  template <typename T>
  __device__ __forceinline__ void write_param(int k, int lane, const DirectList<T>& pl,
                                              const DirectList<float>& ml,
                                              const float (&x)[4]) const {
    if constexpr (kMaster) ml.write(k, lane, x);
    pl.write(k, lane, x);
  }

  /// Group k of a bfloat16-state tile whose first element is `first` in the tensor.
  template <typename T>
  __device__ __forceinline__ void update_bf16_group(int k, int64_t first, const DirectList<T>& pl,
                                                    const DirectList<T>& gl,
                                                    const DirectList<float>& ml,
                                                    const StagedList<G, S>& ms,
                                                    const StagedList<G, S>& vs, int lane,
                                                    const BlockScalars& b) const {
    float pr[4], gr[4];
    S mr[4], vr[4];
    read_param<T>(k, lane, pl, ml, pr);
    gl.read(k, lane, gr);
    ms.read(k, lane, mr);
    vs.read(k, lane, vr);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int e = tile_elem(pl.vec, k, j, lane);
      if (e >= pl.live) continue;
      float mi = bf16_bits_float(mr[j]);
      float vi = bf16_bits_float(vr[j]);
      float unused = 0.0f;
      adam_update(pr[j], prep_grad(gr[j], b.inv, b.coef, h.maximize), mi, vi, unused, h, b.c);
      const uint32_t r = sr_bits(b.key, first + e);
      mr[j] = bf16_stochastic(mi, r);
      vr[j] = bf16_stochastic(vi, r >> 16);
    }
    ms.write(k, lane, mr);
    vs.write(k, lane, vr);
    write_param<T>(k, lane, pl, ml, pr);
  }

  /// Quantization block `half` of an 8-bit tile (groups 2 * half and 2 * half + 1); `sm`, `sv`
  /// point at the tile's first block scale (shared memory).
  template <typename T>
  __device__ __forceinline__ void update_q8_block(int half, const DirectList<T>& pl,
                                                  const DirectList<T>& gl,
                                                  const DirectList<float>& ml,
                                                  const StagedList<G, S>& ms,
                                                  const StagedList<G, S>& vs, float* sm, float* sv,
                                                  int lane, const BlockScalars& b) const {
    float mi[8], vi[8];
    // Slots past the chunk's end carry 0, the identity of these maxima.
    uint32_t wm = 0u;
    uint32_t wv = 0u;
    const float scale_m = sm[half];
    const float scale_v = sv[half];
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      const int k = 2 * half + kk;
      float pr[4], gr[4];
      S mc[4], vc[4];
      read_param<T>(k, lane, pl, ml, pr);
      gl.read(k, lane, gr);
      ms.read(k, lane, mc);
      vs.read(k, lane, vc);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int i = 4 * kk + j;
        mi[i] = 0.0f;
        vi[i] = 0.0f;
        if (tile_elem(pl.vec, k, j, lane) >= pl.live) continue;
        mi[i] = decode_m8(mc[j]) * scale_m;
        vi[i] = decode_v8(vc[j]) * scale_v;
        float unused = 0.0f;
        adam_update(pr[j], prep_grad(gr[j], b.inv, b.coef, h.maximize), mi[i], vi[i], unused, h,
                    b.c);
        wm = max_bits(float_bits(mi[i]) & 0x7FFFFFFFu, wm);
        wv = max_bits(float_bits(vi[i]) & 0x7FFFFFFFu, wv);
      }
      write_param<T>(k, lane, pl, ml, pr);
    }
    // Every lane has read the old scales (they feed the shuffles), so lane 0 may overwrite them.
#pragma unroll
    for (int off = 16; off > 0; off /= 2) {
      wm = max_bits(__shfl_xor_sync(0xffffffffu, wm, off), wm);
      wv = max_bits(__shfl_xor_sync(0xffffffffu, wv, off), wv);
    }
    const float mmax = bits_float(canonical_max(wm));
    const float vmax = bits_float(canonical_max(wv));
    if (lane == 0 && half * kQuantBlock < pl.live) {
      sm[half] = mmax;
      sv[half] = vmax;
    }
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      S mc[4], vc[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        mc[j] = encode_m8(mi[4 * kk + j] * block_reciprocal(mmax));
        vc[j] = encode_v8(vi[4 * kk + j] * block_reciprocal(vmax));
      }
      ms.write(2 * half + kk, lane, mc);
      vs.write(2 * half + kk, lane, vc);
    }
  }
};

// SGD with a bfloat16 momentum buffer: sgd_update per element, the buffer rounded stochastically
// (the low half of sr_bits, as the CPU kernel). Lists: params, grads, buffers, [master]. Tiles of
// 8 elements per lane, as the bfloat16 Adam state.
template <bool kMaster>
struct SgdLowbitOp {
  // The lists of a block, by name: params, grads, the bfloat16 momentum buffers, master params.
  static constexpr int kParams = 0;
  static constexpr int kGrads = 1;
  static constexpr int kMomentumBuffers = 2;
  static constexpr int kMasterList = 3;
  static constexpr int kDepth = kMasterList + (kMaster ? 1 : 0);
  static constexpr int G = 8;
  static constexpr int kTile = 32 * G;

  SgdHyper h;
  StepScalars s;
  const float* steps;  // old update count of each param (0: the buffer gets the gradient)
  double lr;
  uint32_t seed;

  template <typename T>
  __device__ void apply(const MtaBlock<kDepth>& blk) const {
    if constexpr (!std::is_same_v<T, double>) {
      __shared__ BlockScalars shared;
      if (threadIdx.x == 0) {
        shared.skip = step_skipped(s.found_inf);
        if (!shared.skip) {
          const float old = steps[blk.index];
          shared.first = old == 0.0f;
          shared.key =
              sr_key(seed, static_cast<uint32_t>(old + 1.0f), static_cast<uint32_t>(blk.index));
          shared.neg_lr = static_cast<float>(-(s.lr != nullptr ? static_cast<double>(*s.lr) : lr));
          shared.inv = s.inv_scale != nullptr ? *s.inv_scale : 1.0f;
          shared.coef = s.clip_coef != nullptr ? *s.clip_coef : 1.0f;
        }
      }
      __syncthreads();
      if (shared.skip) return;
      const BlockScalars b = shared;
      T* const p = blk.template ptr<T>(kParams);
      const T* const g = blk.template ptr<T>(kGrads);
      uint16_t* const buf = blk.template ptr<uint16_t>(kMomentumBuffers);
      float* mp = nullptr;
      if constexpr (kMaster) mp = blk.template ptr<float>(kMasterList);
      bool vec = aligned16(p) && aligned16(g) && aligned16(buf);
      if constexpr (kMaster) vec = vec && aligned16(mp);
      const int lane = static_cast<int>(threadIdx.x) & 31;
      uint32_t* const stage = warp_stage<G, uint16_t, 1>();
      for (int base = (static_cast<int>(threadIdx.x) >> 5) * kTile; base < blk.len;
           base += kWarps * kTile) {
        const int live = blk.len - base < kTile ? blk.len - base : kTile;
        const DirectList<T> pl{p + base, live, vec};
        const DirectList<T> gl{const_cast<T*>(g) + base, live, vec};
        const DirectList<float> ml{kMaster ? mp + base : nullptr, live, vec};
        const StagedList<G, uint16_t> bs{buf + base, live, vec, stage};
        bs.load(lane);
        if (vec) __syncwarp();
#pragma unroll
        for (int k = 0; k < G / 4; ++k) {
          float pr[4], gr[4];
          uint16_t br[4];
          if constexpr (kMaster) {
            ml.read(k, lane, pr);
          } else {
            pl.read(k, lane, pr);
          }
          gl.read(k, lane, gr);
          bs.read(k, lane, br);
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int e = tile_elem(vec, k, j, lane);
            if (e >= live) continue;
            float bi = bf16_bits_float(br[j]);
            sgd_update(pr[j], prep_grad(gr[j], b.inv, b.coef, h.maximize), bi, b.neg_lr, h,
                       b.first);
            br[j] = bf16_stochastic(bi, sr_bits(b.key, blk.start + base + e));
          }
          bs.write(k, lane, br);
          if constexpr (kMaster) ml.write(k, lane, pr);
          pl.write(k, lane, pr);
        }
        if (vec) __syncwarp();
        bs.store(lane);
      }
    }
  }
};

void sgd_lowbit_step_cuda(const SgdLowbitArgs& args) {
  const StepPlan plan = check_args(args);
  if (plan.empty()) return;
  const StepScalars& dev = plan.scalars;
  const SgdHyper h = args.opt.hyper();
  const double lr = args.opt.lr;
  const auto seed = static_cast<uint32_t>(args.seed);
  run_step(SgdLowbitArgs::kOp, plan, args.state_steps, dev, [&](const float* old_steps) {
    with_bool(plan.has_master, [&](auto master) {
      using Op = SgdLowbitOp<decltype(master)::value>;
      run_update(plan, Op{h, dev, old_steps, lr, seed});
    });
  });
}

void adam_lowbit_step_cuda(const AdamLowbitArgs& args) {
  const LowbitPlan plan = check_args(args);
  if (plan.empty()) return;
  const StepScalars& dev = plan.scalars;
  const AdamHyper h = args.opt.hyper();
  const double lr = args.opt.lr;
  const auto seed = static_cast<uint32_t>(args.seed);
  run_step(AdamLowbitArgs::kOp, plan, args.state_steps, dev, [&](const float* old_steps) {
    with_bools(plan.int8, plan.has_master, [&](auto int8, auto master) {
      using Op = AdamLowbitOp<decltype(int8)::value, decltype(master)::value>;
      run_update<Op::kSide>(plan, Op{h, dev, old_steps, lr, seed}, plan.absmax);
    });
  });
}

}  // namespace
}  // namespace optim
}  // namespace fastamp

FASTAMP_CUDA_KERNELS(m) {
  namespace o = fastamp::optim;
  m.impl("adam_lowbit_step_", TORCH_BOX(&o::adam_lowbit_step_op<o::adam_lowbit_step_cuda>));
  m.impl("sgd_lowbit_step_", TORCH_BOX(&o::sgd_lowbit_step_op<o::sgd_lowbit_step_cuda>));
  m.impl("adam_lowbit_step_held_",
         TORCH_BOX(&o::adam_lowbit_step_held_op<o::adam_lowbit_step_cuda>));
  m.impl("sgd_lowbit_step_held_", TORCH_BOX(&o::sgd_lowbit_step_held_op<o::sgd_lowbit_step_cuda>));
}
