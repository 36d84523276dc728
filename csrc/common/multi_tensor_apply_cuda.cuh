/// @file multi_tensor_apply_cuda.cuh
/// CUDA driver of the multi-tensor-apply engine: runs a per-chunk functor over the chunks that
/// plan_chunks() (multi_tensor_apply.h) cuts a tensor list into, one CUDA block per chunk.
///
/// Tensor addresses, sizes and dtypes travel in the kernel's arguments, so one launch covers many
/// tensors with no host-to-device copy and no allocation. Each tensor carries a dtype tag and the
/// kernel dispatches on it per block (a branch uniform within the block), so a list that mixes
/// float32, float16, bfloat16 and float64 still takes one launch per argument-struct fill, not one
/// per dtype. When the argument struct is full (too many tensors or blocks) the driver launches
/// and continues with the rest, carrying over a tensor that is split across two launches.
///
/// Each block also learns the ordinal of its chunk in the whole plan (MtaBlock::chunk_id), the
/// index the CPU driver uses for the same chunk: a reduction that writes one partial per chunk and
/// combines partials in chunk order is deterministic, and matches the CPU chunking exactly.
///
/// Usage: an op is a trivially copyable functor with
///   template <typename T> __device__ void apply(const fastamp::MtaBlock<Depth>& blk) const;
/// called by all kMtaThreads threads of a block, with T the dtype of the block's list-0 tensor.
/// mta_read / mta_update run a per-element lambda over a chunk with 16-byte vector accesses.
#pragma once

#include "common/gpu.cuh"
#include "common/multi_tensor_apply.h"

#include "common/torch_api.h"

#include <array>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace fastamp {

/// Threads per block of every multi-tensor-apply launch. A constant (not a launch parameter) so
/// that the per-thread element order, and hence every reduction, depends on the sizes only.
constexpr int kMtaThreads = 512;

/// Elements of list 0 per element of a side list (see mta_pack): the 8-bit optimizer state keeps
/// one float32 scale per block of 256. kChunkElems is a multiple, so a block never straddles
/// chunks.
constexpr int kMtaSideBlock = 256;
static_assert(kChunkElems % kMtaSideBlock == 0, "a side block must not straddle two chunks");

/// Vectors each thread loads before it computes on any, so several 16-byte loads are in flight.
constexpr int kMtaIlp = 4;

/// Blocks (chunks) per launch, as in PyTorch's and apex's drivers: at 5 argument bytes per block
/// this leaves room for about 100 tensors per launch, so lists of many small tensors (biases,
/// norms) still need few launches, while a launch of large tensors covers 20M elements.
constexpr int kMtaMaxBlocks = 320;

/// Kernel-argument bytes the metadata may use. Kernel parameters are limited to 4 KiB on every
/// driver we support (32 KiB needs a CUDA 12.1+ driver, which CUDA minor-version compatibility
/// does not guarantee for a 12.x runtime), and the op functor needs the rest.
constexpr int kMtaMetaBytes = 3840;
constexpr int kMtaParamBytes = 4096;

/// Tensors per launch for `Depth` parallel lists: what is left of the budget after the per-block
/// maps, divided by the per-tensor bytes (Depth addresses and dtype tags, numel, list index).
template <int Depth>
constexpr int mta_max_tensors() {
  constexpr int kPerBlock = 4 + 1;  // block_chunk (int32) + block_slot (uint8)
  constexpr int kPerTensor = Depth * (8 + 1) + 8 + 4;
  constexpr int n = (kMtaMetaBytes - 16 - kPerBlock * kMtaMaxBlocks) / kPerTensor;
  return n > 255 ? 255 : n;  // block_slot is a uint8
}

/// Kernel-argument metadata of one launch. Largest members first, so there is no inner padding.
template <int Depth>
struct MtaMeta {
  static constexpr int kMaxTensors = mta_max_tensors<Depth>();
  void* data[Depth][kMaxTensors];
  int64_t numel[kMaxTensors];
  int64_t first_chunk;  ///< plan ordinal of this launch's block 0 (blocks are consecutive chunks)
  int32_t index[kMaxTensors];          ///< position of the tensor in the caller's list
  int32_t block_chunk[kMtaMaxBlocks];  ///< chunk index within its tensor
  uint8_t dtype[Depth][kMaxTensors];   ///< c10::ScalarType
  uint8_t block_slot[kMtaMaxBlocks];   ///< tensor slot in this launch
};

/// What one block works on: chunk `[start, start + len)` of the tensors at `data[d]`.
template <int Depth>
struct MtaBlock {
  void* data[Depth];
  c10::ScalarType dtype[Depth];
  int64_t start;     ///< first element of the chunk (64-bit: tensors may exceed 2^31 elements)
  int len;           ///< elements in the chunk, 1..kChunkElems
  int64_t index;     ///< position of the tensor in the caller's list
  int64_t chunk_id;  ///< ordinal of the chunk in plan_chunks() order, for per-chunk partials

  template <typename T>
  __device__ __forceinline__ T* ptr(int d) const {
    return static_cast<T*>(data[d]) + start;
  }

  /// List d's elements for this chunk when d is a side list (one element per kMtaSideBlock
  /// elements of list 0, e.g. the block scales of 8-bit optimizer state).
  template <typename T>
  __device__ __forceinline__ T* side_ptr(int d) const {
    return static_cast<T*>(data[d]) + start / kMtaSideBlock;
  }
};

namespace detail {

/// What block `b` of a launch works on, from the launch's metadata: the kernel's own index
/// arithmetic, host-callable so that tests/cuda_host checks it on tensors past 2^31 and 2^33
/// elements without a GPU or their memory.
template <int Depth>
__host__ __device__ __forceinline__ MtaBlock<Depth> mta_block(const MtaMeta<Depth>& meta, int b) {
  const int slot = meta.block_slot[b];
  MtaBlock<Depth> blk;
#pragma unroll
  for (int d = 0; d < Depth; ++d) {
    blk.data[d] = meta.data[d][slot];
    blk.dtype[d] = static_cast<c10::ScalarType>(meta.dtype[d][slot]);
  }
  blk.start = static_cast<int64_t>(meta.block_chunk[b]) * kChunkElems;
  const int64_t left = meta.numel[slot] - blk.start;
  blk.len = static_cast<int>(left < kChunkElems ? left : kChunkElems);
  blk.index = meta.index[slot];
  blk.chunk_id = meta.first_chunk + b;
  return blk;
}

/// The resident blocks per SM an Op's kernel must leave room for: its `kMinBlocks`, or 0 (no
/// bound: the same PTX as no second argument; an explicit 1 would let ptxas take 128 registers).
/// It is __launch_bounds__' second argument, so ptxas holds the kernel to
/// 65536 / (kMtaThreads * kMinBlocks) registers a thread (2: 64, the occupancy floor of
/// .ci/gpu_resources.py) instead of spending more on latency hiding.
template <typename Op, typename = void>
struct MtaMinBlocks : std::integral_constant<int, 0> {};
template <typename Op>
struct MtaMinBlocks<Op, std::void_t<decltype(Op::kMinBlocks)>>
    : std::integral_constant<int, Op::kMinBlocks> {};

template <int Depth, typename Op>
__global__ void __launch_bounds__(kMtaThreads, MtaMinBlocks<Op>::value)
    multi_tensor_apply_kernel(const MtaMeta<Depth> meta, const Op op) {
  const MtaBlock<Depth> blk = mta_block(meta, static_cast<int>(blockIdx.x));
  // The tag is the same for every thread of the block, so this switch never diverges.
  switch (blk.dtype[0]) {
    case c10::ScalarType::Float:
      op.template apply<float>(blk);
      break;
    case c10::ScalarType::Half:
      op.template apply<c10::Half>(blk);
      break;
    case c10::ScalarType::BFloat16:
      op.template apply<c10::BFloat16>(blk);
      break;
    case c10::ScalarType::Double:
      op.template apply<double>(blk);
      break;
    default:
      break;  // unreachable: the driver rejects other dtypes before launching
  }
}

/// List 0 selects the kernel's instantiation, so it must be a floating type; the other lists may
/// also hold uint8 (8-bit codes).
inline bool mta_supported_dtype(c10::ScalarType t, bool list0 = true) {
  return t == c10::ScalarType::Float || t == c10::ScalarType::Half ||
         t == c10::ScalarType::BFloat16 || t == c10::ScalarType::Double ||
         (!list0 && t == c10::ScalarType::Byte);
}

/// Host half of the driver: validates `lists`, then cuts their chunks into kernel-argument tables
/// and calls emit(meta, nblocks) for each table in plan order. It makes no CUDA call, so the
/// packing can be tested on machines without a GPU. Everything is checked before the first emit.
/// The last `Side` lists are side lists: item i holds ceil(numel_i / kMtaSideBlock) elements.
template <int Depth, typename Emit, int Side = 0>
void mta_pack(const std::array<const std::vector<FlatTensor>*, Depth>& lists, Emit&& emit) {
  static_assert(Side >= 0 && Side < Depth, "list 0 is never a side list");
  static_assert(Depth >= 1, "at least one tensor list");
  static_assert(sizeof(MtaMeta<Depth>) <= kMtaMetaBytes, "metadata exceeds its kernel-arg budget");
  constexpr int kMaxTensors = MtaMeta<Depth>::kMaxTensors;

  const std::vector<FlatTensor>& items = *lists[0];
  for (int d = 0; d < Depth; ++d) {
    const auto& l = *lists[static_cast<size_t>(d)];
    FASTAMP_ASSERT(l.size() == items.size(), "multi_tensor_apply: list ", d, " has ", l.size(),
                   " non-empty tensors, list 0 has ", items.size());
    const bool side = d >= Depth - Side;
    for (size_t i = 0; i < l.size(); ++i) {
      const int64_t want =
          side ? (items[i].numel + kMtaSideBlock - 1) / kMtaSideBlock : items[i].numel;
      FASTAMP_ASSERT(l[i].numel == want,
                     "multi_tensor_apply: numel mismatch between lists at item ", i);
      FASTAMP_ASSERT(mta_supported_dtype(l[i].dtype, d == 0),
                     "multi_tensor_apply: unsupported dtype ", l[i].dtype);
    }
  }
  for (const FlatTensor& t : items) {
    FASTAMP_ASSERT(t.index >= 0 && t.index <= std::numeric_limits<int32_t>::max());
    // block_chunk is an int32: 2^31 chunks of 64 Ki elements, i.e. 2^47 elements per tensor.
    FASTAMP_CHECK((t.numel - 1) / kChunkElems <= std::numeric_limits<int32_t>::max(),
                  "multi_tensor_apply: a tensor of ", t.numel,
                  " elements exceeds the supported 2^47 elements");
  }
  const std::vector<Chunk> chunks = plan_chunks(items, kChunkElems);
  if (chunks.empty()) return;

  MtaMeta<Depth> meta{};  // zeroed: the unused tail of the table is copied to the device too
  int ntensors = 0;
  int nblocks = 0;
  int32_t cur_item = -1;
  for (size_t c = 0; c < chunks.size(); ++c) {
    const Chunk& ch = chunks[c];
    bool new_tensor = ch.item != cur_item;
    if (nblocks == kMtaMaxBlocks || (new_tensor && ntensors == kMaxTensors)) {
      // nblocks > 0 here: every tensor in the table owns at least one block. Kernel arguments are
      // copied at launch, so the table can be refilled at once; a tensor cut by the flush is
      // entered again as slot 0 of the next table.
      emit(static_cast<const MtaMeta<Depth>&>(meta), nblocks);
      ntensors = 0;
      nblocks = 0;
      meta.first_chunk = static_cast<int64_t>(c);
      new_tensor = true;
    }
    if (new_tensor) {
      for (int d = 0; d < Depth; ++d) {
        const FlatTensor& t = (*lists[static_cast<size_t>(d)])[static_cast<size_t>(ch.item)];
        meta.data[d][ntensors] = t.data;
        meta.dtype[d][ntensors] = static_cast<uint8_t>(t.dtype);
      }
      const FlatTensor& t = items[static_cast<size_t>(ch.item)];
      meta.numel[ntensors] = t.numel;
      meta.index[ntensors] = static_cast<int32_t>(t.index);
      ++ntensors;
      cur_item = ch.item;
    }
    meta.block_slot[nblocks] = static_cast<uint8_t>(ntensors - 1);
    meta.block_chunk[nblocks] = static_cast<int32_t>(ch.start / kChunkElems);
    ++nblocks;
  }
  emit(static_cast<const MtaMeta<Depth>&>(meta), nblocks);  // the loop ran, so nblocks >= 1
}

}  // namespace detail

/// Runs `op` over every chunk of `Depth` parallel tensor lists (item i of every list has the same
/// numel, but for the last `Side` lists: see mta_pack; list 0's dtype selects the kernel
/// instantiation) on the current stream of `device`. Launches nothing when the lists hold no
/// elements. Never synchronises with the host.
template <int Depth, typename Op, int Side = 0>
void cuda_multi_tensor_apply(const std::array<const std::vector<FlatTensor>*, Depth>& lists,
                             const Device& device, const Op& op) {
  static_assert(std::is_trivially_copyable_v<Op>, "the op is passed by value as a kernel argument");
  static_assert(sizeof(MtaMeta<Depth>) + sizeof(Op) <= kMtaParamBytes,
                "metadata + op exceed the 4 KiB kernel-argument limit; make the op smaller");
  FASTAMP_ASSERT(device.type() == gpu::kDeviceType, "multi_tensor_apply: ", device, " is not a ",
                 gpu::kDeviceName, " device");
  gpu::DeviceGuard guard(device);
  const gpu::Stream stream = gpu::current_stream(device);
  const auto emit = [&](const MtaMeta<Depth>& meta, int nblocks) {
    gpu::launch("multi_tensor_apply_kernel", &detail::multi_tensor_apply_kernel<Depth, Op>,
                dim3(static_cast<unsigned>(nblocks)), dim3(kMtaThreads), stream, meta, op);
  };
  detail::mta_pack<Depth, const decltype(emit)&, Side>(lists, emit);
}

/// Single-list form of cuda_multi_tensor_apply.
template <typename Op>
void cuda_multi_tensor_apply(const std::vector<FlatTensor>& items, const Device& device,
                             const Op& op) {
  cuda_multi_tensor_apply<1, Op>({&items}, device, op);
}

// --- per-chunk helpers, called by all threads of a block -------------------------------------

/// Elements of T per 16-byte vector.
template <typename T>
constexpr int kMtaVec = 16 / static_cast<int>(sizeof(T));

template <typename T>
using MtaVec = gpu::Vec<T, kMtaVec<T>>;

// mta_chunk_loop is also compiled for the host, whose compiler does not know `#pragma unroll`.
#if defined(__CUDA_ARCH__)
#define FASTAMP_MTA_UNROLL _Pragma("unroll")
#else
#define FASTAMP_MTA_UNROLL
#endif

namespace detail {

/// Thread t owns vector slots t, t + kMtaThreads, ... of the chunk (slot i = elements
/// [i*V, i*V + V)), visited in increasing order and, within a slot, element by element. The order
/// is the same whether a slot is read with one 16-byte load (aligned, full) or element by element
/// (misaligned base, or the chunk's ragged end), so reductions do not depend on alignment.
/// Reads src; with kWrite stores f(x) to dst (which may be src, or another chunk of the same
/// size); without, calls f(x) only. Every loop over j is unrolled with a predicate instead of a
/// variable bound: a variable index into r[] would move it from registers to local memory.
/// Host-callable with an explicit `tid` so that tests can check coverage and order without a GPU.
template <bool kWrite, typename T, typename F>
__host__ __device__ __forceinline__ void mta_chunk_loop(const T* src, T* dst, int n, F& f,
                                                        int tid) {
  constexpr int V = kMtaVec<T>;
  bool aligned = (reinterpret_cast<uintptr_t>(src) % 16) == 0;
  if constexpr (kWrite) aligned = aligned && (reinterpret_cast<uintptr_t>(dst) % 16) == 0;
  const int nvec = (n + V - 1) / V;
  for (int base = tid; base < nvec; base += kMtaThreads * kMtaIlp) {
    MtaVec<T> r[kMtaIlp];
    int valid[kMtaIlp];
    FASTAMP_MTA_UNROLL
    for (int k = 0; k < kMtaIlp; ++k) {
      const int i = base + k * kMtaThreads;
      const int left = n - i * V;
      valid[k] = left <= 0 ? 0 : (left < V ? left : V);
      if (aligned && valid[k] == V) {
        r[k] = gpu::vec_load(reinterpret_cast<const MtaVec<T>*>(src) + i);
      } else {
        FASTAMP_MTA_UNROLL
        for (int j = 0; j < V; ++j) {
          if (j < valid[k]) r[k].v[j] = src[i * V + j];
        }
      }
    }
    FASTAMP_MTA_UNROLL
    for (int k = 0; k < kMtaIlp; ++k) {
      const int i = base + k * kMtaThreads;
      FASTAMP_MTA_UNROLL
      for (int j = 0; j < V; ++j) {
        if (j < valid[k]) {
          if constexpr (kWrite) {
            r[k].v[j] = f(r[k].v[j]);
          } else {
            f(r[k].v[j]);
          }
        }
      }
      if constexpr (kWrite) {
        if (aligned && valid[k] == V) {
          gpu::vec_store(reinterpret_cast<MtaVec<T>*>(dst) + i, r[k]);
        } else {
          FASTAMP_MTA_UNROLL
          for (int j = 0; j < V; ++j) {
            if (j < valid[k]) dst[i * V + j] = r[k].v[j];
          }
        }
      }
    }
  }
}

}  // namespace detail

/// Calls f(x) for each element x of the chunk [p, p + n) owned by this thread (see
/// detail::mta_chunk_loop for the fixed order). Reads with 16-byte loads where p is 16-byte
/// aligned.
template <typename T, typename F>
__device__ __forceinline__ void mta_read(const T* p, int n, F&& f) {
  detail::mta_chunk_loop<false, T>(p, static_cast<T*>(nullptr), n, f,
                                   static_cast<int>(threadIdx.x));
}

/// Replaces each element x of the chunk [p, p + n) owned by this thread with f(x), with 16-byte
/// loads and stores where p is 16-byte aligned.
template <typename T, typename F>
__device__ __forceinline__ void mta_update(T* p, int n, F&& f) {
  detail::mta_chunk_loop<true, T>(p, p, n, f, static_cast<int>(threadIdx.x));
}

/// Writes dst[e] = f(src[e]) for each element of the chunk owned by this thread, in the same
/// per-thread order as mta_read over src (so a reduction inside f sums exactly as mta_read's
/// would), with 16-byte accesses where both chunks are 16-byte aligned.
template <typename T, typename F>
__device__ __forceinline__ void mta_transform(const T* src, T* dst, int n, F&& f) {
  detail::mta_chunk_loop<true, T>(src, dst, n, f, static_cast<int>(threadIdx.x));
}

namespace detail {

// One scratch array per (size, type), not one per combine lambda: every instantiation of a kernel
// that reduces shares it.
template <int N, typename T>
__device__ __forceinline__ T* mta_reduce_scratch() {
  __shared__ T vals[N];
  return vals;
}

}  // namespace detail

/// Reduces one value per thread over a block of `Threads` threads with `combine`, in a fixed
/// tree order (deterministic). The result is valid in thread 0 only. Every thread of the block
/// must call it, at most once per kernel (its shared scratch is not guarded for reuse).
template <int Threads, typename T, typename F>
__device__ __forceinline__ T mta_block_reduce(T v, F combine, T identity) {
  static_assert(Threads % 32 == 0 && Threads <= 1024, "whole warps, at most 1024 threads");
  constexpr int kWarps = Threads / 32;
  T* warp_vals = detail::mta_reduce_scratch<kWarps, T>();
#pragma unroll
  for (int off = 16; off > 0; off /= 2) v = combine(v, __shfl_down_sync(0xffffffffu, v, off));
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  if (lane == 0) warp_vals[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kWarps ? warp_vals[lane] : identity;
#pragma unroll
    for (int off = 16; off > 0; off /= 2) v = combine(v, __shfl_down_sync(0xffffffffu, v, off));
  }
  return v;
}

}  // namespace fastamp
