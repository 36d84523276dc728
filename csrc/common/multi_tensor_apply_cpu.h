/// @file multi_tensor_apply_cpu.h
/// CPU driver: runs a per-chunk functor over the planned chunks with torch's parallel_for. The
/// functor dispatches each chunk on its tensor's dtype, so one call handles lists of mixed dtypes.
#pragma once

#include "common/multi_tensor_apply.h"

#include "common/torch_api.h"

#include <vector>

namespace fastamp {

/// Calls f(chunk_index, chunk) for every chunk, in parallel. One chunk is one unit of work: chunks
/// are 64 Ki elements, so a grain of 1 chunk already amortises the scheduling cost.
template <typename F>
void cpu_for_each_chunk(const std::vector<Chunk>& chunks, const F& f) {
  parallel_for(static_cast<int64_t>(chunks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) f(c, chunks[static_cast<size_t>(c)]);
  });
}

}  // namespace fastamp
