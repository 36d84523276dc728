// CPU kernels of the GradScaler ops. The element math comes from scaler_math.h (shared with CUDA);
// this file only arranges it into chunked, vectorisable loops driven by multi_tensor_apply_cpu.h.
#include <torch/library.h>

#include "common/multi_tensor_apply_cpu.h"
#include "scaler/scaler_checks.h"
#include "scaler/scaler_math.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <vector>

namespace fastamp {
namespace scaler {
namespace {

// Lanes of independent accumulators. A fixed lane count keeps the summation order independent of
// the compiler's vector width (bitwise reproducible) while letting it vectorise the lane loop.
constexpr int kLanes = 16;

template <typename T>
using opmath_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <typename T, NormKind K>
void stats_chunk(const T* FASTAMP_RESTRICT x, int64_t n, float inv_scale, float p, float* acc_out,
                 bool* nonfinite_out) {
  using acc_t = opmath_t<T>;
  float acc[kLanes];
  acc_t probe[kLanes];
  for (int j = 0; j < kLanes; ++j) {
    acc[j] = 0.0f;
    probe[j] = acc_t(0);
  }
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const acc_t v = static_cast<acc_t>(x[i + j]);
      probe[j] += nonfinite_probe(v);
      const float u = static_cast<float>(unscale(v, inv_scale));
      acc[j] = norm_combine<K>(acc[j], norm_term<K>(u, p));
    }
  }
  for (int j = 0; i < n; ++i, ++j) {
    const acc_t v = static_cast<acc_t>(x[i]);
    probe[j] += nonfinite_probe(v);
    const float u = static_cast<float>(unscale(v, inv_scale));
    acc[j] = norm_combine<K>(acc[j], norm_term<K>(u, p));
  }
  float total = acc[0];
  acc_t probe_total = probe[0];
  for (int j = 1; j < kLanes; ++j) {
    total = norm_combine<K>(total, acc[j]);
    probe_total += probe[j];
  }
  *acc_out = total;
  *nonfinite_out = probe_total != acc_t(0);
}

template <typename T>
bool unscale_chunk(T* FASTAMP_RESTRICT x, int64_t n, float inv_scale) {
  using acc_t = opmath_t<T>;
  acc_t probe[kLanes];
  for (int j = 0; j < kLanes; ++j) probe[j] = acc_t(0);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const acc_t v = static_cast<acc_t>(x[i + j]);
      probe[j] += nonfinite_probe(v);
      x[i + j] = static_cast<T>(unscale(v, inv_scale));
    }
  }
  for (int j = 0; i < n; ++i, ++j) {
    const acc_t v = static_cast<acc_t>(x[i]);
    probe[j] += nonfinite_probe(v);
    x[i] = static_cast<T>(unscale(v, inv_scale));
  }
  acc_t probe_total = acc_t(0);
  for (int j = 0; j < kLanes; ++j) probe_total += probe[j];
  return probe_total != acc_t(0);
}

template <typename T>
void clip_unscale_chunk(T* FASTAMP_RESTRICT x, int64_t n, float inv_scale, float coef) {
  using acc_t = opmath_t<T>;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = static_cast<T>(unscale_clip(static_cast<acc_t>(x[i]), inv_scale, coef));
  }
}

template <NormKind K>
float combine_partials(const std::vector<float>& partials) {
  float total = 0.0f;
  for (float v : partials) total = norm_combine<K>(total, v);
  return total;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> grad_stats_cpu(at::TensorList grads,
                                                              const at::Tensor& inv_scale,
                                                              double norm_type) {
  StatsPlan plan = check_grad_stats(grads, inv_scale, norm_type);
  const auto opts = inv_scale.options();
  at::Tensor found_inf = at::zeros({}, opts.dtype(at::kFloat));
  at::Tensor pow_sum = at::zeros({}, opts.dtype(at::kFloat));
  at::Tensor tensor_found_inf =
      at::zeros({plan.grads.list_size()}, opts.dtype(at::kBool));

  const auto& items = plan.grads.items();
  const auto chunks = plan_chunks(items);
  std::vector<float> partials(chunks.size(), 0.0f);
  std::vector<uint8_t> chunk_bad(chunks.size(), 0);
  const float inv = inv_scale.item<float>();  // a CPU tensor: reading it is not a device sync
  const float p = plan.p;
  const NormKind kind = plan.kind;

  cpu_for_each_chunk(chunks, [&](int64_t c, const Chunk& ch) {
    const FlatTensor& t = items[static_cast<size_t>(ch.item)];
    bool bad = false;
    FASTAMP_DISPATCH_GRAD_TYPES(t.dtype, "fastamp::grad_stats", [&] {
      const scalar_t* x = static_cast<const scalar_t*>(t.data) + ch.start;
      switch (kind) {
        case NormKind::kL2:
          stats_chunk<scalar_t, NormKind::kL2>(x, ch.len, inv, p, &partials[c], &bad);
          break;
        case NormKind::kInf:
          stats_chunk<scalar_t, NormKind::kInf>(x, ch.len, inv, p, &partials[c], &bad);
          break;
        case NormKind::kL1:
          stats_chunk<scalar_t, NormKind::kL1>(x, ch.len, inv, p, &partials[c], &bad);
          break;
        case NormKind::kLp:
          stats_chunk<scalar_t, NormKind::kLp>(x, ch.len, inv, p, &partials[c], &bad);
          break;
      }
    });
    chunk_bad[static_cast<size_t>(c)] = bad ? 1 : 0;
  });

  float total = 0.0f;
  switch (kind) {
    case NormKind::kInf: total = combine_partials<NormKind::kInf>(partials); break;
    default: total = combine_partials<NormKind::kL2>(partials); break;
  }
  bool* flags = tensor_found_inf.data_ptr<bool>();
  bool any = false;
  for (size_t c = 0; c < chunks.size(); ++c) {
    if (chunk_bad[c]) {
      flags[items[static_cast<size_t>(chunks[c].item)].index] = true;
      any = true;
    }
  }
  found_inf.fill_(any ? 1.0f : 0.0f);
  pow_sum.fill_(total);
  return {found_inf, pow_sum, tensor_found_inf};
}

void non_finite_check_and_unscale_cpu(at::TensorList grads, at::Tensor& found_inf,
                                      const at::Tensor& inv_scale, at::Tensor& tensor_found_inf) {
  FlatTensorList list = check_unscale(grads, found_inf, inv_scale, tensor_found_inf);
  const auto& items = list.items();
  const auto chunks = plan_chunks(items);
  std::vector<uint8_t> chunk_bad(chunks.size(), 0);
  const float inv = inv_scale.item<float>();

  cpu_for_each_chunk(chunks, [&](int64_t c, const Chunk& ch) {
    const FlatTensor& t = items[static_cast<size_t>(ch.item)];
    bool bad = false;
    FASTAMP_DISPATCH_GRAD_TYPES(t.dtype, "fastamp::non_finite_check_and_unscale_", [&] {
      bad = unscale_chunk(static_cast<scalar_t*>(t.data) + ch.start, ch.len, inv);
    });
    chunk_bad[static_cast<size_t>(c)] = bad ? 1 : 0;
  });
  list.write_back();

  bool* flags = tensor_found_inf.data_ptr<bool>();
  bool any = false;
  for (size_t c = 0; c < chunks.size(); ++c) {
    if (chunk_bad[c]) {
      flags[items[static_cast<size_t>(chunks[c].item)].index] = true;
      any = true;
    }
  }
  if (any) *found_inf.data_ptr<float>() = 1.0f;
}

void clip_unscale_cpu(at::TensorList grads, const at::Tensor& inv_scale,
                      const at::Tensor& total_norm, double max_norm) {
  FlatTensorList list = check_clip_unscale(grads, inv_scale, total_norm, max_norm);
  const auto& items = list.items();
  const auto chunks = plan_chunks(items);
  const float inv = inv_scale.item<float>();
  const float coef = clip_coef(total_norm.item<float>(), static_cast<float>(max_norm));
  cpu_for_each_chunk(chunks, [&](int64_t, const Chunk& ch) {
    const FlatTensor& t = items[static_cast<size_t>(ch.item)];
    FASTAMP_DISPATCH_GRAD_TYPES(t.dtype, "fastamp::clip_unscale_", [&] {
      clip_unscale_chunk(static_cast<scalar_t*>(t.data) + ch.start, ch.len, inv, coef);
    });
  });
  list.write_back();
}

void update_scale_cpu(at::Tensor& scale, at::Tensor& growth_tracker, at::Tensor& hysteresis_tracker,
                      const at::Tensor& found_inf, double growth_factor, double backoff_factor,
                      int64_t growth_interval, int64_t hysteresis, double min_scale,
                      double max_scale) {
  check_update_scale(scale, growth_tracker, hysteresis_tracker, found_inf, growth_factor,
                     backoff_factor, growth_interval, hysteresis, min_scale, max_scale);
  update_scale(scale.data_ptr<float>(), growth_tracker.data_ptr<int32_t>(),
               hysteresis_tracker.data_ptr<int32_t>(), *found_inf.data_ptr<float>(), growth_factor,
               backoff_factor, growth_interval, hysteresis, min_scale, max_scale);
}

}  // namespace
}  // namespace scaler
}  // namespace fastamp

TORCH_LIBRARY_IMPL(fastamp, CPU, m) {
  m.impl("grad_stats", &fastamp::scaler::grad_stats_cpu);
  m.impl("non_finite_check_and_unscale_", &fastamp::scaler::non_finite_check_and_unscale_cpu);
  m.impl("clip_unscale_", &fastamp::scaler::clip_unscale_cpu);
  m.impl("update_scale_", &fastamp::scaler::update_scale_cpu);
}
