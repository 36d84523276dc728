/// @file scaler_checks.h
/// Argument validation of the scaler ops, shared by the CPU and CUDA kernels so both reject bad
/// input identically, and always before anything is written.
#pragma once

#include "common/tensor_list.h"
#include "scaler/scaler_math.h"

#include "common/torch_api.h"

namespace fastamp {
namespace scaler {

/// Gradient dtypes every scaler op accepts, mixed freely within one list.
#define FASTAMP_GRAD_DTYPES {kFloat, kHalf, kBFloat16, kDouble}

struct StatsPlan {
  FlatTensorList grads;
  NormKind kind;
  float p;
};

StatsPlan check_grad_stats(TensorList grads, const Tensor& inv_scale, double norm_type);

FlatTensorList check_unscale(TensorList grads, const Tensor& found_inf, const Tensor& inv_scale,
                             const Tensor& tensor_found_inf);

FlatTensorList check_clip_unscale(TensorList grads, const Tensor& inv_scale,
                                  const Tensor& total_norm, double max_norm);

/// Whether the norm's root is a square root (norm_type 2); refuses a norm_type other than 1, 2
/// or inf, a max_norm that is negative or NaN, and a norm_pow_sum that is not one float32.
bool check_clip_coef(const Tensor& norm_pow_sum, double norm_type, double max_norm);

/// The checks of fastamp::record_overflow_: the records, flags and scalars on one device, the
/// flags and their record contiguous bool vectors of one length, the scalars one element each.
void check_record_overflow(const Tensor& flags_record, const Tensor& update_record,
                           const Tensor& flags, const Tensor& found_inf,
                           const Tensor& update_count);

void check_update_scale(const Tensor& scale, const Tensor& growth_tracker,
                        const Tensor& hysteresis_tracker, const Tensor& found_inf,
                        double growth_factor, double backoff_factor, int64_t growth_interval,
                        int64_t hysteresis, double min_scale, double max_scale);

}  // namespace scaler
}  // namespace fastamp
