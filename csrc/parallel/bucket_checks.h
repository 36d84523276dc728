/// @file bucket_checks.h
/// Argument checks of the gradient-bucket ops, shared by CPU and CUDA; run before any write.
#pragma once

#include "common/torch_api.h"

#include "common/tensor_list.h"

#include <cmath>
#include <vector>

namespace fastamp {
namespace parallel {

/// One gradient's slice of the bucket: elements [offset, offset + numel).
struct Slot {
  void* grad;
  int64_t offset;
  int64_t numel;
};

/// A bucket: a defined, contiguous 1-D float32/float16/bfloat16 tensor. Returns its metadata.
inline TensorMeta check_bucket_tensor(const char* op, const Tensor& bucket_tensor) {
  const TensorMeta bucket = meta_of(bucket_tensor);
  FASTAMP_CHECK(
      bucket.defined && bucket.layout == kStrided && bucket.dim == 1 && bucket.contiguous(), op,
      ": bucket must be a contiguous 1-D tensor, got shape ", bucket.sizes());
  const auto dt = bucket.dtype;
  FASTAMP_CHECK_TYPE(dt == kFloat || dt == kHalf || dt == kBFloat16, op, ": bucket has dtype ", dt,
                     "; expected float32, float16 or bfloat16");
  return bucket;
}

/// Validates a bucket (1-D, contiguous, float32/16/bf16), its grads (same dtype and device,
/// contiguous) and their offsets (in bounds, not overlapping), and returns the slots.
inline std::vector<Slot> check_bucket(const char* op, const Tensor& bucket_tensor,
                                      const MetaList& grads, IntList offsets) {
  const TensorMeta bucket = check_bucket_tensor(op, bucket_tensor);
  const auto dt = bucket.dtype;
  FASTAMP_CHECK_VALUE(offsets.size() == grads.size(), op, ": ", grads.size(), " grads but ",
                      offsets.size(), " offsets; expected one offset per grad");
  const Device dev = bucket.device();
  std::vector<Slot> slots;
  slots.reserve(grads.size());
  int64_t prev_end = 0;
  for (size_t i = 0; i < grads.size(); ++i) {
    const TensorMeta& g = grads[i];
    FASTAMP_CHECK(g.defined, op, ": grads[", i, "] is undefined (None)");
    FASTAMP_CHECK(g.on(dev), op, ": grads[", i, "] is on ", g.device(), " but the bucket is on ",
                  dev);
    FASTAMP_CHECK_TYPE(g.dtype == dt, op, ": grads[", i, "] has dtype ", g.dtype,
                       " but the bucket has ", dt, "; buckets hold one dtype");
    FASTAMP_CHECK(g.layout == kStrided && g.contiguous(), op, ": grads[", i,
                  "] must be contiguous");
    // offsets[i] <= numel - g.numel, not offsets[i] + g.numel <= numel: the sum of a huge
    // offset and the size can overflow int64 (undefined behaviour, and a wrapped sum would pass).
    FASTAMP_CHECK_VALUE(offsets[i] >= prev_end && offsets[i] <= bucket.numel - g.numel, op,
                        ": grads[", i, "] at offset ", offsets[i], " (", g.numel,
                        " elements) overlaps the previous slot or runs past the bucket's ",
                        bucket.numel, " elements; offsets must increase");
    // A grad that is a view of the bucket would be read while the bucket is written (pack) or
    // written from it (unpack), so the result would depend on the order of the chunks. The one
    // exception is a grad that is exactly its own slot: each element then maps onto itself.
    if (g.numel > 0 && bucket.numel > 0) {
      const auto item = static_cast<uintptr_t>(bucket.element_size());
      const auto b0 = reinterpret_cast<uintptr_t>(bucket.data);
      const auto b1 = b0 + static_cast<uintptr_t>(bucket.numel) * item;
      const auto g0 = reinterpret_cast<uintptr_t>(g.data);
      const auto g1 = g0 + static_cast<uintptr_t>(g.numel) * item;
      const bool shares = g0 < b1 && b0 < g1;
      FASTAMP_CHECK(!shares || g0 == b0 + static_cast<uintptr_t>(offsets[i]) * item, op, ": grads[",
                    i,
                    "] is a view of the bucket (it shares memory with bucket "
                    "elements other than its own slot at offset ",
                    offsets[i],
                    "), so the result would depend on the order of the copies. Expected grads "
                    "with their own storage: pass grad.clone()");
    }
    prev_end = offsets[i] + g.numel;
    slots.push_back(Slot{g.data, offsets[i], g.numel});
  }
  return slots;
}

inline std::vector<Slot> check_bucket(const char* op, const Tensor& bucket, TensorList grads,
                                      IntList offsets) {
  return check_bucket(op, bucket, MetaList::read(grads), offsets);
}

/// check_bucket, plus the unpack's inv_scale (a one-element float32 tensor on the bucket's device).
inline std::vector<Slot> check_bucket_unpack(const Tensor& bucket, TensorList grad_list,
                                             IntList offsets, const Tensor& inv_scale) {
  constexpr const char* op = "fastamp::bucket_unpack_";
  const MetaList grads = MetaList::read(grad_list);
  auto slots = check_bucket(op, bucket, grads, offsets);
  check_scalar_tensor(inv_scale, op, "inv_scale", bucket.device(), kFloat);
  check_disjoint(op, {{"grads", &grads}});
  return slots;
}

/// The spans of bucket_divide_stats_: a contiguous 1-D float32/16/bf16 bucket cut into consecutive
/// spans of `lengths` elements that cover it exactly; a finite, positive divisor; inv_scale a
/// one-element float32 tensor on the bucket's device.
inline std::vector<Slot> check_bucket_spans(const Tensor& bucket_tensor, IntList lengths,
                                            double divisor, const Tensor& inv_scale) {
  constexpr const char* op = "fastamp::bucket_divide_stats_";
  const TensorMeta bucket = check_bucket_tensor(op, bucket_tensor);
  FASTAMP_CHECK_VALUE(std::isfinite(divisor) && divisor > 0.0, op,
                      ": divisor must be a finite, "
                      "positive number (the world size, or 1 to only measure), got ",
                      divisor);
  check_scalar_tensor(inv_scale, op, "inv_scale", bucket.device(), kFloat);
  std::vector<Slot> spans;
  spans.reserve(lengths.size());
  char* base = static_cast<char*>(bucket.data);
  const auto item = static_cast<int64_t>(bucket.element_size());
  int64_t offset = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    // lengths[i] <= numel - offset, not offset + lengths[i] <= numel: no int64 overflow.
    FASTAMP_CHECK_VALUE(lengths[i] >= 0 && lengths[i] <= bucket.numel - offset, op, ": lengths[", i,
                        "] is ", lengths[i], " but only ", bucket.numel - offset,
                        " elements of the bucket are left; expected non-negative lengths that sum "
                        "to the bucket's ",
                        bucket.numel, " elements");
    spans.push_back(Slot{base + offset * item, offset, lengths[i]});
    offset += lengths[i];
  }
  FASTAMP_CHECK_VALUE(offset == bucket.numel, op, ": lengths sum to ", offset,
                      " elements but the bucket has ", bucket.numel,
                      "; expected one length per grad, covering the bucket");
  return spans;
}

}  // namespace parallel
}  // namespace fastamp
