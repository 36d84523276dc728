/// @file multi_tensor_apply.h
/// The planner shared by the CPU and CUDA multi-tensor-apply drivers.
///
/// A list of flat tensors is cut into fixed-size chunks. Chunk boundaries depend only on the tensor
/// sizes (never on the thread count), and reductions combine per-chunk partials in chunk order, so
/// results are bitwise reproducible across runs and thread counts.
#pragma once

#include "common/tensor_list.h"

#include <cstdint>
#include <vector>

namespace fastamp {

/// Elements per chunk. 64 Ki elements: large enough to amortise per-chunk work on CPU threads and
/// CUDA blocks, small enough to give thousands of chunks (load balance) at 10M+ parameters.
constexpr int64_t kChunkElems = 65536;

struct Chunk {
  int32_t item;   ///< index into FlatTensorList::items()
  int64_t start;  ///< first element (64-bit: tensors may exceed 2^31 elements)
  int64_t len;    ///< number of elements (<= chunk size)
};

inline std::vector<Chunk> plan_chunks(const std::vector<FlatTensor>& items,
                                      int64_t chunk = kChunkElems) {
  std::vector<Chunk> chunks;
  int64_t total = 0;
  for (const auto& it : items) total += (it.numel + chunk - 1) / chunk;
  chunks.reserve(static_cast<size_t>(total));
  for (size_t i = 0; i < items.size(); ++i) {
    for (int64_t s = 0; s < items[i].numel; s += chunk) {
      const int64_t len = items[i].numel - s < chunk ? items[i].numel - s : chunk;
      chunks.push_back(Chunk{static_cast<int32_t>(i), s, len});
    }
  }
  return chunks;
}

}  // namespace fastamp
