/// @file optim_math.h
/// Element math of the fused optimizers, shared by the CPU and CUDA kernels.
///
/// The arithmetic follows PyTorch's single-tensor (foreach=False, non-capturable) implementations
/// operation by operation, in fp32 with per-step coefficients computed in double, so the fused
/// kernels agree with torch.optim to rounding. The gradient arrives still loss-scaled: it is
/// unscaled and clipped in registers (g * inv_scale * clip_coef), never written back.
#pragma once

#include "common/amp_math.h"
#include "common/macros.h"

#include <cmath>
#include <cstdint>
#include <type_traits>

#ifndef FASTAMP_CPU_NS
#define FASTAMP_CPU_NS cap_default
#endif

namespace fastamp {
namespace optim {

// Plain data, outside the per-ISA inline namespace so every build of the kernels shares the types.
/// Adam/AdamW hyperparameters as the kernels use them. PyTorch computes `1 - beta` in double and
/// rounds once to fp32 (Python scalars), which is not the same float as 1.0f - float(beta); so the
/// host fills these in double (adam_hyper) and the kernels only read them.
struct AdamHyper {
  float beta2;
  float one_minus_beta1;
  float one_minus_beta2;
  float weight_decay;
  float eps;
  bool amsgrad;
  bool decoupled;  ///< AdamW
  bool maximize;
  double beta1_d;  ///< for the bias corrections, in double like PyTorch's Python floats
  double beta2_d;
  double weight_decay_d;
};

/// Scalars of the step about to be taken (`step` = the new step count), from device values.
struct AdamCoefs {
  float neg_step_size;  ///< -lr / (1 - beta1^step)
  float bc2_sqrt;       ///< sqrt(1 - beta2^step)
  float decay;          ///< 1 - lr * weight_decay (AdamW)
};

/// SGD hyperparameters, rounded as PyTorch rounds its Python scalars.
struct SgdHyper {
  float weight_decay;
  float momentum;
  float one_minus_dampening;
  bool nesterov;
  bool maximize;
};

// Functions live in a per-ISA inline namespace (see scaler_math.h for why).
inline namespace FASTAMP_CPU_NS {

/// The loss-scaled gradient made ready for the update rule: unscale and clip (the scaler's own
/// unscale_clip, common/amp_math.h), then maximize.
template <class F = float>
FASTAMP_HOST_DEVICE inline F prep_grad(F g, float inv, float coef, bool maximize) {
  const F u = unscale_clip(g, inv, coef);
  return maximize ? -u : u;
}

inline AdamHyper adam_hyper(double beta1, double beta2, double weight_decay, double eps,
                            bool amsgrad, bool decoupled, bool maximize) {
  AdamHyper h;
  h.beta2 = static_cast<float>(beta2);
  h.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  h.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  h.weight_decay = static_cast<float>(weight_decay);
  h.eps = static_cast<float>(eps);
  h.amsgrad = amsgrad;
  h.decoupled = decoupled;
  h.maximize = maximize;
  h.beta1_d = beta1;
  h.beta2_d = beta2;
  h.weight_decay_d = weight_decay;
  return h;
}

FASTAMP_HOST_DEVICE inline AdamCoefs adam_coefs(const AdamHyper& h, double lr, double step) {
  AdamCoefs c;
  const double bc1 = 1.0 - std::pow(h.beta1_d, step);
  const double bc2 = 1.0 - std::pow(h.beta2_d, step);
  c.neg_step_size = static_cast<float>(-(lr / bc1));
  c.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  c.decay = static_cast<float>(1.0 - lr * h.weight_decay_d);
  return c;
}

/// torch.lerp's formula (the branch keeps it exact at weight 1). kSide 1 / 2 fixes the branch
/// taken (w < 0.5 / w >= 0.5) at compile time, for loops whose w is a constant: an element loop
/// with no branch vectorises.
template <int kSide = 0, class F = float>
FASTAMP_HOST_DEVICE inline F lerp(F a, F b, float w) {
  if constexpr (kSide == 1) {
    return a + w * (b - a);
  } else if constexpr (kSide == 2) {
    return b - (b - a) * (1.0f - w);
  } else {
    return w < 0.5f ? a + w * (b - a) : b - (b - a) * (1.0f - w);
  }
}

/// IEEE square root of a float, or lane-wise of a SIMD vector of floats (the CPU kernels' GCC
/// vector types, common/cpu_simd.h; the loop compiles to one sqrtps).
template <class F>
FASTAMP_HOST_DEVICE inline F fsqrt(F x) {
#if !defined(__CUDACC__)
  if constexpr (!std::is_floating_point_v<F>) {
    F r;
    for (int i = 0; i < static_cast<int>(sizeof(F) / sizeof(float)); ++i)
      r[i] = __builtin_sqrtf(x[i]);
    return r;
  } else
#endif
  {
    return std::sqrt(x);
  }
}

/// One Adam/AdamW element update with the weight-decay mode and amsgrad fixed at compile time
/// (kDecay: 0 none, 1 L2 (Adam), 2 decoupled (AdamW)), so an element loop has no branch on them
/// and vectorises. `p` is the fp32 (master) parameter, `g` the prepared gradient; vmax is read and
/// written only with amsgrad. F is float, or a SIMD vector of floats on the CPU (the same
/// operations lane by lane, so the same bits).
template <int kDecay, bool kAmsgrad, int kLerp = 0, class F = float>
FASTAMP_HOST_DEVICE inline void adam_update_fixed(F& p, F g, F& m, F& v, F& vmax,
                                                  const AdamHyper& h, const AdamCoefs& c) {
  if constexpr (kDecay == 2) {
    p = p * c.decay;  // param.mul_(1 - lr * weight_decay)
  } else if constexpr (kDecay == 1) {
    g = g + h.weight_decay * p;  // grad.add(param, alpha=weight_decay)
  }
  m = lerp<kLerp>(m, g, h.one_minus_beta1);       // exp_avg.lerp_(grad, 1 - beta1)
  v = v * h.beta2 + (h.one_minus_beta2 * g) * g;  // mul_(beta2).addcmul_(g, g, 1 - beta2)
  F vhat = v;
  if constexpr (kAmsgrad) {
    vmax = vmax > v ? vmax : v;  // torch.maximum (NaN never reaches here: skipped)
    vhat = vmax;
  }
  const F denom = fsqrt(vhat) / c.bc2_sqrt + h.eps;
  p = p + (c.neg_step_size * m) / denom;  // param.addcdiv_(exp_avg, denom, -step_size)
}

/// The weight-decay mode of adam_update_fixed for these hyperparameters.
inline int adam_decay_mode(const AdamHyper& h) {
  return h.weight_decay == 0.0f ? 0 : (h.decoupled ? 2 : 1);
}

/// One Adam/AdamW element update, the flags read at run time (the same arithmetic).
FASTAMP_HOST_DEVICE inline void adam_update(float& p, float g, float& m, float& v, float& vmax,
                                            const AdamHyper& h, const AdamCoefs& c) {
  if (h.weight_decay != 0.0f) {
    if (h.decoupled) {
      h.amsgrad ? adam_update_fixed<2, true>(p, g, m, v, vmax, h, c)
                : adam_update_fixed<2, false>(p, g, m, v, vmax, h, c);
    } else {
      h.amsgrad ? adam_update_fixed<1, true>(p, g, m, v, vmax, h, c)
                : adam_update_fixed<1, false>(p, g, m, v, vmax, h, c);
    }
  } else {
    h.amsgrad ? adam_update_fixed<0, true>(p, g, m, v, vmax, h, c)
              : adam_update_fixed<0, false>(p, g, m, v, vmax, h, c);
  }
}

inline SgdHyper sgd_hyper(double weight_decay, double momentum, double dampening, bool nesterov,
                          bool maximize) {
  return SgdHyper{static_cast<float>(weight_decay), static_cast<float>(momentum),
                  static_cast<float>(1.0 - dampening), nesterov, maximize};
}

/// One SGD element update (torch.optim.SGD). `first` is true on the momentum buffer's first
/// update, when PyTorch sets buf = grad instead of blending.
FASTAMP_HOST_DEVICE inline void sgd_update(float& p, float g, float& buf, float neg_lr,
                                           const SgdHyper& h, bool first) {
  if (h.weight_decay != 0.0f) g = g + h.weight_decay * p;
  if (h.momentum != 0.0f) {
    buf = first ? g : buf * h.momentum + h.one_minus_dampening * g;
    g = h.nesterov ? g + h.momentum * buf : buf;
  }
  p = p + neg_lr * g;  // param.add_(grad, alpha=-lr)
}

}  // namespace FASTAMP_CPU_NS
}  // namespace optim
}  // namespace fastamp
