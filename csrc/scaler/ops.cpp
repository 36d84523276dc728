// Schemas of the GradScaler ops (each with what it reads and writes); the argument checks the
// kernels share are in scaler_checks.cpp, the kernels in scaler_cpu.cpp and scaler_cuda.cu.
#include "common/torch_api.h"

STABLE_TORCH_LIBRARY_FRAGMENT(fastamp, m) {
  // Fake (meta) kernels live in Python, so torch.compile can trace these ops without running them.

  // Read-only gradient statistics. Reads every element of `grads` (float32/16, bfloat16, float64,
  // mixed; all on inv_scale's device) once and writes nothing into them. Returns, as new tensors on
  // that device: found_inf (float32 [], 1.0 if any element is inf/NaN), norm_pow_sum (float32 [],
  // sum over elements of |g * inv_scale|^norm_type, or the max of |g * inv_scale| for
  // norm_type=inf, accumulated in fp32), and tensor_found_inf (bool [len(grads)], which tensors had
  // inf/NaN).
  m.def(
      "grad_stats(Tensor[] grads, Tensor inv_scale, float norm_type=2.0) -> "
      "(Tensor found_inf, Tensor norm_pow_sum, Tensor tensor_found_inf)");

  // In-place unscale with non-finite check: the job of
  // torch._amp_foreach_non_finite_check_and_unscale_ for mixed dtypes in one call (bfloat16
  // included on CUDA). Writes grads[i] *= inv_scale; sets found_inf to 1.0 and tensor_found_inf[i]
  // to true when grads[i] had an inf/NaN *before* unscaling; never clears either, so several calls
  // accumulate.
  m.def(
      "non_finite_check_and_unscale_(Tensor(a!)[] grads, Tensor(b!) found_inf, Tensor inv_scale, "
      "Tensor(c!) tensor_found_inf) -> ()");

  // Unscale and clip in one write pass: grads[i] = grads[i] * inv_scale * clip_coef, with
  // clip_coef = min(max_norm / (total_norm + 1e-6), 1) computed on the device from `total_norm`
  // (the unscaled total norm, e.g. from grad_stats). Reads inv_scale and total_norm; writes grads.
  m.def(
      "clip_unscale_(Tensor(a!)[] grads, Tensor inv_scale, Tensor total_norm, float max_norm) -> "
      "()");

  // The clip's two scalars from the norm's power sum, in one launch (instead of one per
  // elementwise op on a one-element tensor): total_norm = norm_pow_sum ** (1 / norm_type) (for
  // norm_type 2 its IEEE square root, correctly rounded as CUDA's torch.sqrt (torch's CPU build
  // takes MKL's, which can be one ulp off); for 1 and inf the sum or max itself) and clip_coef =
  // min(max_norm / (total_norm + 1e-6), 1), rounded as torch.nn.utils.clip_grad_norm_ rounds it
  // (a reciprocal, then a product). Reads norm_pow_sum (float32, one element: grad_stats' second
  // output, summed over devices or shards); returns both as new float32 [] tensors on its
  // device. norm_type must be 1, 2 or inf (the other roots are left to torch.pow).
  m.def(
      "clip_coef(Tensor norm_pow_sum, float norm_type, float max_norm) -> "
      "(Tensor total_norm, Tensor clip_coef)");

  // The overflow record of GradScaler.overflow_report, kept on the device in one launch (instead
  // of a compare and two torch.where per step): when found_inf > 0 (the step overflowed),
  // flags_record = flags (bool [n], which grads held inf/NaN) and update_record = update_count
  // (int64 [], the index of this update()); otherwise nothing is written. Reads flags, found_inf
  // (float32 []) and update_count.
  m.def(
      "record_overflow_(Tensor(a!) flags_record, Tensor(b!) update_record, Tensor flags, "
      "Tensor found_inf, Tensor update_count) -> ()");

  // Device-side dynamic loss-scale update: the job of torch._amp_update_scale_ plus optional
  // hysteresis and [min_scale, max_scale] bounds. Reads found_inf; updates scale (float32 []),
  // growth_tracker (int32 []) and hysteresis_tracker (int32 []) in place. With hysteresis=1,
  // min_scale=0, max_scale=inf it matches PyTorch exactly.
  m.def(
      "update_scale_(Tensor(a!) scale, Tensor(b!) growth_tracker, Tensor(c!) hysteresis_tracker, "
      "Tensor found_inf, float growth_factor, float backoff_factor, int growth_interval, "
      "int hysteresis, float min_scale, float max_scale) -> ()");
}
