// CUDA kernels of the gradient-bucket ops, on the multi-tensor engine: grad i and its slice of the
// bucket travel as item i of two parallel lists, so a launch covers many grads with no chunk table
// to copy to the device, and 16-byte accesses where both sides are aligned.
//
// The unpack computes its inf check and L2 partials with the scaler's StatsAcc over the grads in
// grad_stats' chunks and per-thread order, reduces them the same way and combines them with the
// same kernel: the norm DDP hands the scaler is bit-identical to grad_stats on the unpacked grads.
#include "common/torch_api.h"

#include "common/gpu.cuh"
#include "common/multi_tensor_apply_cuda.cuh"
#include "parallel/bucket_checks.h"
#include "scaler/scaler_cuda.cuh"

#include <array>
#include <vector>

namespace fastamp {
namespace parallel {
namespace {

using scaler::NormKind;

// The bucket's slots and the grads as two parallel engine lists, in the caller's grad order
// (empty grads are dropped, as FlatTensorList does).
struct SlotLists {
  std::vector<FlatTensor> grads;
  std::vector<FlatTensor> slices;
};

SlotLists slot_lists(const Tensor& bucket, const std::vector<Slot>& slots) {
  SlotLists l;
  const auto dt = bucket.scalar_type();
  char* base = static_cast<char*>(bucket.data_ptr());
  const auto elem = static_cast<int64_t>(bucket.element_size());
  for (size_t i = 0; i < slots.size(); ++i) {
    if (slots[i].numel == 0) continue;
    const auto idx = static_cast<int64_t>(i);
    l.grads.push_back(FlatTensor{slots[i].grad, slots[i].numel, dt, idx});
    l.slices.push_back(FlatTensor{base + slots[i].offset * elem, slots[i].numel, dt, idx});
  }
  return l;
}

// list 0: the bucket's slices (written), list 1: the grads.
struct PackOp {
  float scale;

  template <typename T>
  __device__ void apply(const MtaBlock<2>& blk) const {
    const float s = scale;
    mta_transform(blk.ptr<T>(1), blk.ptr<T>(0), blk.len,
                  [&](T x) { return static_cast<T>(static_cast<float>(x) * s); });
  }
};

// The end of a block's statistics: its inf/NaN flag (a benign race: every writer stores 1) and its
// chunk's L2 partial, reduced over the block as grad_stats reduces it, in the chunk's own slot.
template <typename T>
__device__ __forceinline__ void finish_stats(const scaler::StatsAcc<NormKind::kL2, T>& st,
                                             int64_t chunk_id, float* partials, float* found_inf) {
  if (st.nonfinite()) *found_inf = 1.0f;
  const float total =
      mta_block_reduce<kMtaThreads>(st.acc, scaler::CombineFn<NormKind::kL2>{}, 0.0f);
  if (threadIdx.x == 0) partials[chunk_id] = total;
}

// list 0: the grads (written), list 1: the bucket's slices.
struct UnpackOp {
  const float* inv_scale;
  float* partials;  // one slot per chunk of the grads
  float* found_inf;

  template <typename T>
  __device__ void apply(const MtaBlock<2>& blk) const {
    scaler::StatsAcc<NormKind::kL2, T> st(*inv_scale, 2.0f);
    mta_transform(blk.ptr<T>(1), blk.ptr<T>(0), blk.len, [&](T x) {
      st.add(x);
      return x;
    });
    finish_stats(st, blk.chunk_id, partials, found_inf);
  }
};

// list 0: the bucket's spans, divided in place (scale != 1) and measured as they are stored, in
// grad_stats' chunks and per-thread order: bit for bit grad_stats over the divided spans.
struct DivideStatsOp {
  float scale;
  bool divide;
  const float* inv_scale;
  float* partials;  // one slot per chunk of the spans
  float* found_inf;

  template <typename T>
  __device__ void apply(const MtaBlock<1>& blk) const {
    scaler::StatsAcc<NormKind::kL2, T> st(*inv_scale, 2.0f);
    if (divide) {
      const float s = scale;
      mta_transform(blk.ptr<T>(0), blk.ptr<T>(0), blk.len, [&](T x) {
        const T y = static_cast<T>(static_cast<float>(x) * s);
        st.add(y);
        return y;
      });
    } else {
      mta_read(blk.ptr<T>(0), blk.len, [&](T x) { st.add(x); });
    }
    finish_stats(st, blk.chunk_id, partials, found_inf);
  }
};

void bucket_pack_cuda(Tensor& bucket, TensorList grads, IntList offsets, double scale) {
  gpu::check_device(bucket.device(), "fastamp::bucket_pack_", "bucket");
  const auto slots = check_bucket("fastamp::bucket_pack_", bucket, grads, offsets);
  gpu::DeviceGuard guard(bucket.device());
  const SlotLists l = slot_lists(bucket, slots);
  cuda_multi_tensor_apply<2>({&l.slices, &l.grads}, bucket.device(),
                             PackOp{static_cast<float>(scale)});
}

std::tuple<Tensor, Tensor> bucket_unpack_cuda(const Tensor& bucket, TensorList grads,
                                              IntList offsets, const Tensor& inv_scale) {
  gpu::check_device(bucket.device(), "fastamp::bucket_unpack_", "bucket");
  const auto slots = check_bucket_unpack(bucket, grads, offsets, inv_scale);
  gpu::DeviceGuard guard(bucket.device());
  const Device dev = bucket.device();
  Tensor found = zeros({}, kFloat, dev);
  Tensor pow_sum = zeros({}, kFloat, dev);
  const SlotLists l = slot_lists(bucket, slots);
  const int64_t n = scaler::count_chunks(l.grads);
  if (n == 0) return {found, pow_sum};
  // Every slot is written by exactly one block before the combining kernel reads it.
  Tensor partials = empty({n}, kFloat, dev);
  cuda_multi_tensor_apply<2>(
      {&l.grads, &l.slices}, bucket.device(),
      UnpackOp{inv_scale.mutable_data_ptr<float>(), partials.mutable_data_ptr<float>(),
               found.mutable_data_ptr<float>()});
  scaler::launch_combine<NormKind::kL2>(partials.mutable_data_ptr<float>(), n,
                                        pow_sum.mutable_data_ptr<float>(), bucket.device());
  return {found, pow_sum};
}

std::tuple<Tensor, Tensor> bucket_divide_stats_cuda(Tensor& bucket, IntList lengths, double divisor,
                                                    const Tensor& inv_scale) {
  gpu::check_device(bucket.device(), "fastamp::bucket_divide_stats_", "bucket");
  const auto spans = check_bucket_spans(bucket, lengths, divisor, inv_scale);
  gpu::DeviceGuard guard(bucket.device());
  const Device dev = bucket.device();
  Tensor found = zeros({}, kFloat, dev);
  Tensor pow_sum = zeros({}, kFloat, dev);
  std::vector<FlatTensor> items;
  const auto dt = bucket.scalar_type();
  for (size_t i = 0; i < spans.size(); ++i) {
    if (spans[i].numel == 0) continue;
    items.push_back(FlatTensor{spans[i].grad, spans[i].numel, dt, static_cast<int64_t>(i)});
  }
  const int64_t n = scaler::count_chunks(items);
  if (n == 0) return {found, pow_sum};
  // Every slot is written by exactly one block before the combining kernel reads it.
  Tensor partials = empty({n}, kFloat, dev);
  cuda_multi_tensor_apply(
      items, dev,
      DivideStatsOp{static_cast<float>(1.0 / divisor), divisor != 1.0,
                    inv_scale.mutable_data_ptr<float>(), partials.mutable_data_ptr<float>(),
                    found.mutable_data_ptr<float>()});
  scaler::launch_combine<NormKind::kL2>(partials.mutable_data_ptr<float>(), n,
                                        pow_sum.mutable_data_ptr<float>(), dev);
  return {found, pow_sum};
}

}  // namespace
}  // namespace parallel
}  // namespace fastamp

FASTAMP_CUDA_KERNELS(m) {
  m.impl("bucket_pack_", TORCH_BOX(&fastamp::parallel::bucket_pack_cuda));
  m.impl("bucket_unpack_", TORCH_BOX(&fastamp::parallel::bucket_unpack_cuda));
  m.impl("bucket_divide_stats_", TORCH_BOX(&fastamp::parallel::bucket_divide_stats_cuda));
}
