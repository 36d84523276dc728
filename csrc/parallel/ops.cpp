// Schemas of the gradient-bucket ops used by fastamp.parallel.DistributedDataParallel.
#include "common/torch_api.h"

STABLE_TORCH_LIBRARY_FRAGMENT(fastamp, m) {
  // Copies each grads[i] into bucket[offsets[i] : offsets[i] + grads[i].numel()], multiplied by
  // `scale` in the same pass (1/world_size before a sum all-reduce). Reads grads; writes only those
  // bucket slices. One dtype per bucket.
  m.def("bucket_pack_(Tensor(a!) bucket, Tensor[] grads, int[] offsets, float scale) -> ()");

  // The reverse copy after the all-reduce, fused with what fastamp.GradScaler and clip_grad_norm_
  // need: found_inf (float32 [], 1.0 if any copied element is inf/NaN) and norm_pow_sum (float32
  // [], sum of (x * inv_scale)^2 in fp32). Reads the bucket; writes grads; returns the two new
  // tensors.
  m.def(
      "bucket_unpack_(Tensor bucket, Tensor(a!)[] grads, int[] offsets, Tensor inv_scale) -> "
      "(Tensor found_inf, Tensor norm_pow_sum)");

  // What fastamp.parallel.DistributedDataParallel's comm hook does to each reduced bucket, in one
  // pass: divides the flat bucket in place, x = x * (1 / divisor) rounded to its dtype (skipped
  // for divisor 1), and measures it for fastamp.GradScaler: found_inf (float32 [], 1.0 if any
  // element is inf/NaN) and norm_pow_sum (float32 [], sum of (x * inv_scale)^2 in fp32), with the
  // bucket read as consecutive spans of `lengths` elements (one per grad, summing to its size)
  // in grad_stats' chunks: bit for bit fastamp::grad_stats over the spans after the division.
  // Writes the bucket (when divisor != 1); returns the two new tensors.
  m.def(
      "bucket_divide_stats_(Tensor(a!) bucket, int[] lengths, float divisor, Tensor inv_scale) "
      "-> (Tensor found_inf, Tensor norm_pow_sum)");
}
