// CUDA kernels of the GradScaler ops. The element math comes from scaler_math.h (shared with the
// CPU kernels); this file arranges it into per-chunk functors run by multi_tensor_apply_cuda.cuh.
// Every per-step scalar (inv_scale, total_norm, found_inf, scale) is read and written on the device
// through pointers, so none of these ops synchronises with the host.
//
// Every launch here goes through the engine except update_scale_kernel: one thread updating three
// scalars (scale, growth and hysteresis trackers) has no list to chunk; it is launched <<<1, 1>>>
// on the current stream, right after the stats that produce found_inf.
#include "common/torch_api.h"

#include "common/gpu.cuh"
#include "common/multi_tensor_apply_cuda.cuh"
#include "scaler/scaler_checks.h"
#include "scaler/scaler_cuda.cuh"
#include "scaler/scaler_math.h"

#include <tuple>
#include <type_traits>

namespace fastamp {
namespace scaler {
namespace {

// Marks tensor `index` and the whole list as non-finite. Every writer stores the same values, so
// concurrent plain stores from many threads and blocks are benign; nothing ever clears them.
__device__ __forceinline__ void flag_nonfinite(float* found_inf, bool* tensor_found_inf,
                                               int64_t index) {
  *found_inf = 1.0f;
  tensor_found_inf[index] = true;
}

// Read-only pass. Each block writes its chunk's norm partial to its own slot instead of an atomic
// add, so that combine_partials_kernel can sum them in a fixed order: the norm then does not
// depend on block scheduling. (bucket_cuda.cu's unpack computes its partials the same way.)
template <NormKind K>
struct StatsOp {
  const float* inv_scale;
  float p;
  float* partials;  // one slot per chunk of the plan
  float* found_inf;
  bool* tensor_found_inf;

  template <typename T>
  __device__ void apply(const MtaBlock<1>& blk) const {
    StatsAcc<K, T> st(*inv_scale, p);
    mta_read(blk.ptr<T>(0), blk.len, [&](T x) { st.add(x); });
    if (st.nonfinite()) flag_nonfinite(found_inf, tensor_found_inf, blk.index);
    const float total = mta_block_reduce<kMtaThreads>(st.acc, CombineFn<K>{}, 0.0f);
    if (threadIdx.x == 0) partials[blk.chunk_id] = total;
  }
};

// The non-finite test looks at the input, before unscaling, as PyTorch's kernel does, so found_inf
// means "backward produced an inf/NaN" on both backends.
struct UnscaleOp {
  const float* inv_scale;
  float* found_inf;
  bool* tensor_found_inf;

  template <typename T>
  __device__ void apply(const MtaBlock<1>& blk) const {
    using acc_t = opmath_t<T>;
    const float inv = *inv_scale;
    acc_t probe = acc_t(0);
    mta_update(blk.ptr<T>(0), blk.len, [&](T x) {
      const acc_t v = static_cast<acc_t>(x);
      probe += nonfinite_probe(v);
      return static_cast<T>(unscale(v, inv));
    });
    if (probe != acc_t(0)) flag_nonfinite(found_inf, tensor_found_inf, blk.index);
  }
};

struct ClipUnscaleOp {
  const float* inv_scale;
  const float* total_norm;
  float max_norm;

  template <typename T>
  __device__ void apply(const MtaBlock<1>& blk) const {
    using acc_t = opmath_t<T>;
    const float inv = *inv_scale;
    // Each block derives the coefficient itself: one extra division per block is cheaper than a
    // separate launch, and it is the same IEEE division as the CPU's clip_coef.
    const float coef = clip_coef(*total_norm, max_norm);
    mta_update(blk.ptr<T>(0), blk.len,
               [&](T x) { return static_cast<T>(unscale_clip(static_cast<acc_t>(x), inv, coef)); });
  }
};

// One thread: the clip's two scalars (fastamp::clip_coef), as clip_coef_cpu computes them.
__global__ void clip_coef_kernel(const float* norm_pow_sum, bool l2, float max_norm,
                                 float* total_norm, float* coef) {
  const float total = norm_root(*norm_pow_sum, l2);
  *total_norm = total;
  *coef = clip_coef(total, max_norm);
}

// One block: the overflow record (fastamp::record_overflow_), written only when found_inf > 0.
constexpr int kRecordThreads = 256;
__global__ void record_overflow_kernel(bool* flags_record, int64_t* update_record,
                                       const bool* flags, int64_t n, const float* found_inf,
                                       const int64_t* update_count) {
  if (!(*found_inf > 0.0f)) return;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) flags_record[i] = flags[i];
  if (threadIdx.x == 0) *update_record = *update_count;
}

__global__ void update_scale_kernel(float* scale, int32_t* growth_tracker,
                                    int32_t* hysteresis_tracker, const float* found_inf,
                                    double growth_factor, double backoff_factor,
                                    int64_t growth_interval, int64_t hysteresis, double min_scale,
                                    double max_scale) {
  update_scale(scale, growth_tracker, hysteresis_tracker, *found_inf, growth_factor, backoff_factor,
               growth_interval, hysteresis, min_scale, max_scale);
}

template <NormKind K>
void launch_grad_stats(const std::vector<FlatTensor>& items, const Device& device,
                       const StatsOp<K>& op, int64_t nchunks, float* norm_out) {
  cuda_multi_tensor_apply(items, device, op);
  launch_combine<K>(op.partials, nchunks, norm_out, device);
}

std::tuple<Tensor, Tensor, Tensor> grad_stats_cuda(TensorList grads, const Tensor& inv_scale,
                                                   double norm_type) {
  StatsPlan plan = check_grad_stats(grads, inv_scale, norm_type);
  const Device device = inv_scale.device();
  gpu::check_device(device, "fastamp::grad_stats", "inv_scale");
  gpu::DeviceGuard guard(device);
  const Device dev = inv_scale.device();
  Tensor found_inf = zeros({}, kFloat, dev);
  Tensor pow_sum = zeros({}, kFloat, dev);
  Tensor tensor_found_inf = zeros({plan.grads.list_size()}, kBool, dev);

  const auto& items = plan.grads.items();
  const int64_t nchunks = count_chunks(items);
  if (nchunks == 0) return {found_inf, pow_sum, tensor_found_inf};

  // Every slot is written by exactly one block before the finalize kernel reads it.
  Tensor partials = empty({nchunks}, kFloat, dev);
  float* part = partials.mutable_data_ptr<float>();
  const float* inv = inv_scale.mutable_data_ptr<float>();
  float* found = found_inf.mutable_data_ptr<float>();
  bool* flags = tensor_found_inf.mutable_data_ptr<bool>();
  float* norm_out = pow_sum.mutable_data_ptr<float>();
  visit_norm_kind(plan.kind, [&](auto k) {
    constexpr NormKind K = decltype(k)::value;
    launch_grad_stats(items, device, StatsOp<K>{inv, plan.p, part, found, flags}, nchunks,
                      norm_out);
  });
  return {found_inf, pow_sum, tensor_found_inf};
}

void non_finite_check_and_unscale_cuda(TensorList grads, Tensor& found_inf, const Tensor& inv_scale,
                                       Tensor& tensor_found_inf) {
  FlatTensorList list = check_unscale(grads, found_inf, inv_scale, tensor_found_inf);
  const Device device = inv_scale.device();
  gpu::check_device(device, "fastamp::non_finite_check_and_unscale_", "inv_scale");
  gpu::DeviceGuard guard(device);
  cuda_multi_tensor_apply(
      list.items(), device,
      UnscaleOp{inv_scale.mutable_data_ptr<float>(), found_inf.mutable_data_ptr<float>(),
                tensor_found_inf.mutable_data_ptr<bool>()});
  // Copies staged (non-dense) grads back, stream-ordered after the kernel.
  list.write_back();
}

void clip_unscale_cuda(TensorList grads, const Tensor& inv_scale, const Tensor& total_norm,
                       double max_norm) {
  FlatTensorList list = check_clip_unscale(grads, inv_scale, total_norm, max_norm);
  const Device device = inv_scale.device();
  gpu::check_device(device, "fastamp::clip_unscale_", "inv_scale");
  gpu::DeviceGuard guard(device);
  cuda_multi_tensor_apply(
      list.items(), device,
      ClipUnscaleOp{inv_scale.mutable_data_ptr<float>(), total_norm.mutable_data_ptr<float>(),
                    static_cast<float>(max_norm)});
  list.write_back();
}

std::tuple<Tensor, Tensor> clip_coef_cuda(const Tensor& norm_pow_sum, double norm_type,
                                          double max_norm) {
  const bool l2 = check_clip_coef(norm_pow_sum, norm_type, max_norm);
  const Device device = norm_pow_sum.device();
  gpu::check_device(device, "fastamp::clip_coef", "norm_pow_sum");
  gpu::DeviceGuard guard(device);
  Tensor total_norm = empty({}, kFloat, device);
  Tensor coef = empty({}, kFloat, device);
  gpu::launch("clip_coef_kernel", &clip_coef_kernel, dim3(1), dim3(1), gpu::current_stream(device),
              static_cast<const float*>(norm_pow_sum.mutable_data_ptr<float>()), l2,
              static_cast<float>(max_norm), total_norm.mutable_data_ptr<float>(),
              coef.mutable_data_ptr<float>());
  return {total_norm, coef};
}

void record_overflow_cuda(Tensor& flags_record, Tensor& update_record, const Tensor& flags,
                          const Tensor& found_inf, const Tensor& update_count) {
  check_record_overflow(flags_record, update_record, flags, found_inf, update_count);
  const Device device = flags_record.device();
  gpu::check_device(device, "fastamp::record_overflow_", "flags_record");
  gpu::DeviceGuard guard(device);
  gpu::launch("record_overflow_kernel", &record_overflow_kernel, dim3(1), dim3(kRecordThreads),
              gpu::current_stream(device), flags_record.mutable_data_ptr<bool>(),
              update_record.mutable_data_ptr<int64_t>(),
              static_cast<const bool*>(flags.mutable_data_ptr<bool>()), flags.numel(),
              static_cast<const float*>(found_inf.mutable_data_ptr<float>()),
              static_cast<const int64_t*>(update_count.mutable_data_ptr<int64_t>()));
}

void update_scale_cuda(Tensor& scale, Tensor& growth_tracker, Tensor& hysteresis_tracker,
                       const Tensor& found_inf, double growth_factor, double backoff_factor,
                       int64_t growth_interval, int64_t hysteresis, double min_scale,
                       double max_scale) {
  check_update_scale(scale, growth_tracker, hysteresis_tracker, found_inf, growth_factor,
                     backoff_factor, growth_interval, hysteresis, min_scale, max_scale);
  const Device device = scale.device();
  gpu::check_device(device, "fastamp::update_scale_", "scale");
  gpu::DeviceGuard guard(device);
  gpu::launch("update_scale_kernel", &update_scale_kernel, dim3(1), dim3(1),
              gpu::current_stream(device), scale.mutable_data_ptr<float>(),
              growth_tracker.mutable_data_ptr<int32_t>(),
              hysteresis_tracker.mutable_data_ptr<int32_t>(),
              static_cast<const float*>(found_inf.mutable_data_ptr<float>()), growth_factor,
              backoff_factor, growth_interval, hysteresis, min_scale, max_scale);
}

}  // namespace
}  // namespace scaler
}  // namespace fastamp

FASTAMP_CUDA_KERNELS(m) {
  m.impl("grad_stats", TORCH_BOX(&fastamp::scaler::grad_stats_cuda));
  m.impl("non_finite_check_and_unscale_",
         TORCH_BOX(&fastamp::scaler::non_finite_check_and_unscale_cuda));
  m.impl("clip_unscale_", TORCH_BOX(&fastamp::scaler::clip_unscale_cuda));
  m.impl("clip_coef", TORCH_BOX(&fastamp::scaler::clip_coef_cuda));
  m.impl("record_overflow_", TORCH_BOX(&fastamp::scaler::record_overflow_cuda));
  m.impl("update_scale_", TORCH_BOX(&fastamp::scaler::update_scale_cuda));
}
