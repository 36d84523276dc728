// The argument checks of the scaler ops (declared in scaler_checks.h), shared by their CPU and CUDA
// kernels and by the CUDA emulator build: everything is checked before anything is written.
#include "scaler/scaler_checks.h"

#include <cmath>
#include <cstdint>
#include <limits>

// Every refusal here is a RuntimeError (FASTAMP_CHECK), as
// torch._amp_foreach_non_finite_check_and_unscale_ and torch._amp_update_scale_ raise for the same
// misuse; an unsupported grad dtype is a NotImplementedError (FASTAMP_CHECK_NOT_IMPLEMENTED), as
// PyTorch's dtype dispatch says "not implemented for".
namespace fastamp {
namespace scaler {

StatsPlan check_grad_stats(TensorList grads, const Tensor& inv_scale, double norm_type) {
  constexpr const char* op = "fastamp::grad_stats";
  FASTAMP_CHECK(inv_scale.defined(), op, ": inv_scale is undefined");
  const auto dev = inv_scale.device();  // its scalar tensors place an op, so [] works too
  check_scalar_tensor(inv_scale, op, "inv_scale", dev, kFloat, true);
  FASTAMP_CHECK(!std::isnan(norm_type) && norm_type > 0.0, op,
                ": norm_type must be a positive number or inf, got ", norm_type);
  auto list =
      FlatTensorList::prepare(grads, op, "grads", dev, /*writable=*/false, FASTAMP_GRAD_DTYPES);
  return StatsPlan{std::move(list), norm_kind_of(norm_type), static_cast<float>(norm_type)};
}

FlatTensorList check_unscale(TensorList grads, const Tensor& found_inf, const Tensor& inv_scale,
                             const Tensor& tensor_found_inf) {
  constexpr const char* op = "fastamp::non_finite_check_and_unscale_";
  FASTAMP_CHECK(inv_scale.defined(), op, ": inv_scale is undefined");
  const auto dev = inv_scale.device();  // its scalar tensors place an op, so [] works too
  check_scalar_tensor(inv_scale, op, "inv_scale", dev, kFloat, true);
  check_scalar_tensor(found_inf, op, "found_inf", dev, kFloat, true);
  FASTAMP_CHECK(tensor_found_inf.defined() && tensor_found_inf.device() == dev, op,
                ": tensor_found_inf must be a tensor on ", dev);
  FASTAMP_CHECK(tensor_found_inf.scalar_type() == kBool, op, ": tensor_found_inf has dtype ",
                tensor_found_inf.scalar_type(), "; expected torch.bool");
  FASTAMP_CHECK(tensor_found_inf.dim() == 1 &&
                    tensor_found_inf.numel() == static_cast<int64_t>(grads.size()) &&
                    tensor_found_inf.is_contiguous(),
                op,
                ": tensor_found_inf must be a contiguous 1-D tensor of len(grads)=", grads.size(),
                " elements, got shape ", tensor_found_inf.sizes());
  const MetaList g = MetaList::read(grads);
  auto list = FlatTensorList::prepare(g, op, "grads", dev, /*writable=*/true, FASTAMP_GRAD_DTYPES);
  check_disjoint(op, {{"grads", &g}});
  return list;
}

FlatTensorList check_clip_unscale(TensorList grads, const Tensor& inv_scale,
                                  const Tensor& total_norm, double max_norm) {
  constexpr const char* op = "fastamp::clip_unscale_";
  FASTAMP_CHECK(inv_scale.defined(), op, ": inv_scale is undefined");
  const auto dev = inv_scale.device();  // its scalar tensors place an op, so [] works too
  check_scalar_tensor(inv_scale, op, "inv_scale", dev, kFloat, true);
  check_scalar_tensor(total_norm, op, "total_norm", dev, kFloat, true);
  FASTAMP_CHECK(!std::isnan(max_norm) && max_norm >= 0.0, op,
                ": max_norm must be a non-negative number, got ", max_norm);
  const MetaList g = MetaList::read(grads);
  auto list = FlatTensorList::prepare(g, op, "grads", dev, /*writable=*/true, FASTAMP_GRAD_DTYPES);
  check_disjoint(op, {{"grads", &g}});
  return list;
}

bool check_clip_coef(const Tensor& norm_pow_sum, double norm_type, double max_norm) {
  constexpr const char* op = "fastamp::clip_coef";
  FASTAMP_CHECK(norm_pow_sum.defined(), op, ": norm_pow_sum is undefined");
  check_scalar_tensor(norm_pow_sum, op, "norm_pow_sum", norm_pow_sum.device(), kFloat, true);
  FASTAMP_CHECK(norm_type == 1.0 || norm_type == 2.0 || (std::isinf(norm_type) && norm_type > 0.0),
                op, ": norm_type must be 1, 2 or inf, got ", norm_type,
                " (another norm's root is total.pow(1 / norm_type), left to torch)");
  FASTAMP_CHECK(!std::isnan(max_norm) && max_norm >= 0.0, op,
                ": max_norm must be a non-negative number, got ", max_norm);
  return norm_type == 2.0;
}

void check_record_overflow(const Tensor& flags_record, const Tensor& update_record,
                           const Tensor& flags, const Tensor& found_inf,
                           const Tensor& update_count) {
  constexpr const char* op = "fastamp::record_overflow_";
  FASTAMP_CHECK(flags_record.defined(), op, ": flags_record is undefined");
  const auto dev = flags_record.device();
  check_scalar_tensor(update_record, op, "update_record", dev, kLong, true);
  check_scalar_tensor(found_inf, op, "found_inf", dev, kFloat, true);
  check_scalar_tensor(update_count, op, "update_count", dev, kLong, true);
  for (const auto& [name, t] :
       {std::pair<const char*, const Tensor*>{"flags_record", &flags_record}, {"flags", &flags}}) {
    FASTAMP_CHECK(t->defined() && t->device() == dev, op, ": ", name, " must be a tensor on ", dev);
    FASTAMP_CHECK(t->scalar_type() == kBool, op, ": ", name, " has dtype ", t->scalar_type(),
                  "; expected torch.bool");
    FASTAMP_CHECK(t->dim() == 1 && t->is_contiguous(), op, ": ", name,
                  " must be a contiguous 1-D tensor, got shape ", t->sizes());
  }
  FASTAMP_CHECK(flags.numel() == flags_record.numel(), op, ": flags has ", flags.numel(),
                " elements and flags_record ", flags_record.numel(), "; expected the same number");
  // The records are written and flags read in one pass: no two of them may share an element
  // (the copy would read what it wrote, or both records would be written twice).
  const Tensor all[] = {flags_record, update_record, flags};
  const std::vector<int64_t> shared = find_shared_memory(TensorList(all, 3));
  constexpr const char* names[] = {"flags_record", "update_record", "flags"};
  FASTAMP_CHECK(shared.empty(), op, ": ", shared.empty() ? "" : names[shared[1]], " and ",
                shared.empty() ? "" : names[shared[0]],
                " must be different tensors that share no memory");
}

void check_update_scale(const Tensor& scale, const Tensor& growth_tracker,
                        const Tensor& hysteresis_tracker, const Tensor& found_inf,
                        double growth_factor, double backoff_factor, int64_t growth_interval,
                        int64_t hysteresis, double min_scale, double max_scale) {
  constexpr const char* op = "fastamp::update_scale_";
  FASTAMP_CHECK(scale.defined(), op, ": scale is undefined");
  const auto dev = scale.device();
  check_scalar_tensor(scale, op, "scale", dev, kFloat, true);
  check_scalar_tensor(growth_tracker, op, "growth_tracker", dev, kInt, true);
  check_scalar_tensor(hysteresis_tracker, op, "hysteresis_tracker", dev, kInt, true);
  check_scalar_tensor(found_inf, op, "found_inf", dev, kFloat, true);
  FASTAMP_CHECK(std::isfinite(growth_factor) && growth_factor > 0.0, op,
                ": growth_factor must be a positive finite number, got ", growth_factor);
  FASTAMP_CHECK(std::isfinite(backoff_factor) && backoff_factor > 0.0, op,
                ": backoff_factor must be a positive finite number, got ", backoff_factor);
  // The trackers are int32 tensors: a larger interval could never be reached, a larger
  // hysteresis could not be stored.
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  FASTAMP_CHECK(growth_interval >= 1 && growth_interval <= kInt32Max, op,
                ": growth_interval must be >= 1 and <= 2^31 - 1 (the growth tracker is "
                "int32), got ",
                growth_interval);
  FASTAMP_CHECK(hysteresis >= 1 && hysteresis <= kInt32Max, op,
                ": hysteresis must be >= 1 and <= 2^31 - 1 (the hysteresis tracker is int32), "
                "got ",
                hysteresis);
  // A min_scale past float32's range would back the scale off to inf.
  FASTAMP_CHECK(!std::isnan(min_scale) && min_scale >= 0.0 &&
                    min_scale <= static_cast<double>(std::numeric_limits<float>::max()),
                op, ": min_scale must be >= 0 and at most float32's largest value, got ",
                min_scale);
  FASTAMP_CHECK(!std::isnan(max_scale) && max_scale >= min_scale, op,
                ": max_scale must be >= min_scale (", min_scale, "), got ", max_scale);
  FASTAMP_CHECK(scale.data_ptr() != growth_tracker.data_ptr() &&
                    scale.data_ptr() != hysteresis_tracker.data_ptr() &&
                    growth_tracker.data_ptr() != hysteresis_tracker.data_ptr(),
                op, ": scale, growth_tracker and hysteresis_tracker must be distinct tensors");
}

}  // namespace scaler
}  // namespace fastamp
