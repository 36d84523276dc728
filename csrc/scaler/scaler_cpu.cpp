// CPU kernels of the GradScaler ops. The element math comes from scaler_math.h (shared with CUDA);
// the per-chunk loops live in scaler_cpu_kernels.inc, compiled per instruction set; this file
// validates, plans chunks, runs them in parallel and combines per-chunk results in chunk order.
#include "common/torch_api.h"

#include "common/cpu_capability.h"
#include "common/multi_tensor_apply_cpu.h"
#include "scaler/scaler_checks.h"
#include "scaler/scaler_cpu_kernels.h"

#include <algorithm>
#include "scaler/scaler_math.h"

#include <vector>

namespace fastamp {
namespace scaler {
namespace {

template <NormKind K>
float combine_partials(const std::vector<float>& partials) {
  float total = 0.0f;
  for (float v : partials) total = norm_combine<K>(total, v);
  return total;
}

inline char* chunk_base(const FlatTensor& t, const Chunk& ch) {
  return static_cast<char*>(t.data) + ch.start * static_cast<int64_t>(element_size(t.dtype));
}

// Sets tensor_found_inf[i] for tensors with a non-finite chunk; returns whether any had one.
bool scatter_flags(const std::vector<FlatTensor>& items, const std::vector<Chunk>& chunks,
                   const std::vector<uint8_t>& chunk_bad, Tensor& tensor_found_inf) {
  bool* flags = tensor_found_inf.mutable_data_ptr<bool>();
  bool any = false;
  for (size_t c = 0; c < chunks.size(); ++c) {
    if (chunk_bad[c]) {
      flags[items[static_cast<size_t>(chunks[c].item)].index] = true;
      any = true;
    }
  }
  return any;
}

std::tuple<Tensor, Tensor, Tensor> grad_stats_cpu(TensorList grads, const Tensor& inv_scale,
                                                  double norm_type) {
  StatsPlan plan = check_grad_stats(grads, inv_scale, norm_type);
  const Device dev = inv_scale.device();
  Tensor found_inf = zeros({}, kFloat, dev);
  Tensor pow_sum = zeros({}, kFloat, dev);
  Tensor tensor_found_inf = zeros({plan.grads.list_size()}, kBool, dev);

  const auto& items = plan.grads.items();
  const auto chunks = plan_chunks(items);
  std::vector<float> partials(chunks.size(), 0.0f);
  std::vector<uint8_t> chunk_bad(chunks.size(), 0);
  const float inv = *inv_scale.mutable_data_ptr<float>();  // a CPU tensor: no device sync
  const float p = plan.p;
  const int32_t kind = static_cast<int32_t>(plan.kind);
  const CpuKernels& k = cpu_kernels();
  cpu_for_each_chunk(chunks, [&](int64_t c, const Chunk& ch) {
    const FlatTensor& t = items[static_cast<size_t>(ch.item)];
    bool bad = false;
    k.stats(t.dtype, kind, chunk_base(t, ch), ch.len, inv, p, &partials[static_cast<size_t>(c)],
            &bad);
    chunk_bad[static_cast<size_t>(c)] = bad ? 1 : 0;
  });
  const float total = plan.kind == NormKind::kInf ? combine_partials<NormKind::kInf>(partials)
                                                  : combine_partials<NormKind::kL2>(partials);
  const bool any = scatter_flags(items, chunks, chunk_bad, tensor_found_inf);
  *found_inf.mutable_data_ptr<float>() = any ? 1.0f : 0.0f;
  *pow_sum.mutable_data_ptr<float>() = total;
  return {found_inf, pow_sum, tensor_found_inf};
}

void non_finite_check_and_unscale_cpu(TensorList grads, Tensor& found_inf, const Tensor& inv_scale,
                                      Tensor& tensor_found_inf) {
  FlatTensorList list = check_unscale(grads, found_inf, inv_scale, tensor_found_inf);
  const auto& items = list.items();
  const auto chunks = plan_chunks(items);
  std::vector<uint8_t> chunk_bad(chunks.size(), 0);
  const float inv = *inv_scale.mutable_data_ptr<float>();
  const CpuKernels& k = cpu_kernels();
  cpu_for_each_chunk(chunks, [&](int64_t c, const Chunk& ch) {
    const FlatTensor& t = items[static_cast<size_t>(ch.item)];
    chunk_bad[static_cast<size_t>(c)] = k.unscale(t.dtype, chunk_base(t, ch), ch.len, inv) ? 1 : 0;
  });
  list.write_back();
  if (scatter_flags(items, chunks, chunk_bad, tensor_found_inf)) {
    *found_inf.mutable_data_ptr<float>() = 1.0f;
  }
}

void clip_unscale_cpu(TensorList grads, const Tensor& inv_scale, const Tensor& total_norm,
                      double max_norm) {
  FlatTensorList list = check_clip_unscale(grads, inv_scale, total_norm, max_norm);
  const auto& items = list.items();
  const auto chunks = plan_chunks(items);
  const float inv = *inv_scale.mutable_data_ptr<float>();
  const float coef = clip_coef(*total_norm.mutable_data_ptr<float>(), static_cast<float>(max_norm));
  const CpuKernels& k = cpu_kernels();
  cpu_for_each_chunk(chunks, [&](int64_t, const Chunk& ch) {
    const FlatTensor& t = items[static_cast<size_t>(ch.item)];
    k.clip_unscale(t.dtype, chunk_base(t, ch), ch.len, inv, coef);
  });
  list.write_back();
}

std::tuple<Tensor, Tensor> clip_coef_cpu(const Tensor& norm_pow_sum, double norm_type,
                                         double max_norm) {
  const bool l2 = check_clip_coef(norm_pow_sum, norm_type, max_norm);
  const Device dev = norm_pow_sum.device();
  Tensor total_norm = empty({}, kFloat, dev);
  Tensor coef = empty({}, kFloat, dev);
  const float total = norm_root(*norm_pow_sum.mutable_data_ptr<float>(), l2);
  *total_norm.mutable_data_ptr<float>() = total;
  *coef.mutable_data_ptr<float>() = clip_coef(total, static_cast<float>(max_norm));
  return {total_norm, coef};
}

void record_overflow_cpu(Tensor& flags_record, Tensor& update_record, const Tensor& flags,
                         const Tensor& found_inf, const Tensor& update_count) {
  check_record_overflow(flags_record, update_record, flags, found_inf, update_count);
  if (!(*found_inf.mutable_data_ptr<float>() > 0.0f)) return;
  const bool* src = flags.mutable_data_ptr<bool>();
  bool* dst = flags_record.mutable_data_ptr<bool>();
  std::copy(src, src + flags.numel(), dst);
  *update_record.mutable_data_ptr<int64_t>() = *update_count.mutable_data_ptr<int64_t>();
}

void update_scale_cpu(Tensor& scale, Tensor& growth_tracker, Tensor& hysteresis_tracker,
                      const Tensor& found_inf, double growth_factor, double backoff_factor,
                      int64_t growth_interval, int64_t hysteresis, double min_scale,
                      double max_scale) {
  check_update_scale(scale, growth_tracker, hysteresis_tracker, found_inf, growth_factor,
                     backoff_factor, growth_interval, hysteresis, min_scale, max_scale);
  update_scale(scale.mutable_data_ptr<float>(), growth_tracker.mutable_data_ptr<int32_t>(),
               hysteresis_tracker.mutable_data_ptr<int32_t>(), *found_inf.mutable_data_ptr<float>(),
               growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale);
}

}  // namespace

const CpuKernels& cpu_kernels() {
#if defined(__x86_64__) || defined(_M_X64)
  if (cpu_use_avx2()) return cpu_kernels_avx2();
#endif
  return cpu_kernels_default();
}

}  // namespace scaler
}  // namespace fastamp

STABLE_TORCH_LIBRARY_IMPL(fastamp, CPU, m) {
  m.impl("grad_stats", TORCH_BOX(&fastamp::scaler::grad_stats_cpu));
  m.impl("non_finite_check_and_unscale_",
         TORCH_BOX(&fastamp::scaler::non_finite_check_and_unscale_cpu));
  m.impl("clip_unscale_", TORCH_BOX(&fastamp::scaler::clip_unscale_cpu));
  m.impl("clip_coef", TORCH_BOX(&fastamp::scaler::clip_coef_cpu));
  m.impl("record_overflow_", TORCH_BOX(&fastamp::scaler::record_overflow_cpu));
  m.impl("update_scale_", TORCH_BOX(&fastamp::scaler::update_scale_cpu));
}
