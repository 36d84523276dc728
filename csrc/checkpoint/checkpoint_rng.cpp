// The RNG snapshot/restore ops: host-side, so one implementation serves CPU-only and CUDA builds
// (CUDA generators are reached through ATen's CUDA hooks). They have no tensor arguments to
// dispatch on, so they are registered for every backend at once.
#include <torch/library.h>

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>

#include <vector>

namespace fastamp {
namespace checkpoint {
namespace {

int64_t num_cuda_devices() {
  const auto& hooks = at::detail::getCUDAHooks();
  return hooks.hasCUDA() ? static_cast<int64_t>(hooks.deviceCount()) : 0;
}

// A device whose CUDA context was never created has a generator nobody drew from; touching it
// would create the context (and cost memory on that GPU), so such devices are skipped.
bool cuda_device_initialized(int64_t i) {
  return at::detail::getCUDAHooks().hasPrimaryContext(static_cast<c10::DeviceIndex>(i));
}

std::vector<at::Tensor> rng_get_state() {
  std::vector<at::Tensor> out;
  out.push_back(at::detail::getDefaultCPUGenerator().get_state());
  const int64_t n = num_cuda_devices();
  for (int64_t i = 0; i < n; ++i) {
    if (cuda_device_initialized(i)) {
      at::Generator gen = at::globalContext().defaultGenerator(
          c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i)));
      std::lock_guard<std::mutex> lock(gen.mutex());
      out.push_back(gen.get_state());
    } else {
      out.push_back(at::empty({0}, at::kByte));  // "not initialised: nothing to restore"
    }
  }
  return out;
}

void rng_set_state(at::TensorList states) {
  constexpr const char* op = "fastamp::rng_set_state";
  TORCH_CHECK_VALUE(!states.empty(), op,
                    ": states is empty; expected the list returned by "
                    "fastamp::rng_get_state (CPU state first, then one entry per CUDA device)");
  const int64_t n = num_cuda_devices();
  TORCH_CHECK_VALUE(static_cast<int64_t>(states.size()) <= n + 1, op, ": states has ",
                    states.size(), " entries but this process sees ", n,
                    " CUDA device(s); expected at most ", n + 1);
  for (size_t i = 0; i < states.size(); ++i) {
    TORCH_CHECK_TYPE(states[i].defined() && states[i].scalar_type() == at::kByte &&
                         states[i].device().is_cpu() && states[i].layout() == at::kStrided,
                     op, ": states[", i, "] must be a CPU uint8 tensor (a generator state)");
  }
  // The generators check the size and content of their state themselves. So that a bad entry
  // after a good one leaves no generator restored, the current states are kept and put back
  // before the error is reported.
  // With one entry (the CPU generator: a process without CUDA, the checkpoint's every recompute)
  // there is nothing to roll back: a generator refuses a bad state before changing anything.
  const std::vector<at::Tensor> previous =
      states.size() > 1 ? rng_get_state() : std::vector<at::Tensor>();
  const auto restore = [](at::TensorList s, size_t i) {
    at::Generator gen = i == 0 ? at::detail::getDefaultCPUGenerator()
                               : at::globalContext().defaultGenerator(
                                     c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i - 1)));
    // A fresh copy, not the caller's tensor, unless it already is plain bytes: the CPU generator
    // misreads a state that is a view at a storage offset (torch 2.13 rejects offsets 1-7 as
    // "Invalid mt19937 state" and crashes on offset 8), and a strided one is not raw bytes at all.
    const at::Tensor state = (s[i].is_contiguous() && s[i].storage_offset() == 0)
                                 ? s[i]
                                 : s[i].clone(at::MemoryFormat::Contiguous);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state);
  };
  for (size_t i = 0; i < states.size(); ++i) {
    if (i > 0 && states[i].numel() == 0) continue;
    try {
      restore(states, i);
    } catch (const c10::Error& e) {
      for (size_t j = 0; j < i; ++j) {
        if (j == 0 || previous[j].numel() > 0) restore(previous, j);
      }
      TORCH_CHECK_VALUE(false, op, ": states[", i, "] is not a valid ", i == 0 ? "CPU" : "CUDA",
                        " generator state (", e.msg(), "); no generator was changed");
    }
  }
}

}  // namespace
}  // namespace checkpoint
}  // namespace fastamp

TORCH_LIBRARY_IMPL(fastamp, CompositeExplicitAutograd, m) {
  m.impl("rng_get_state", &fastamp::checkpoint::rng_get_state);
  m.impl("rng_set_state", &fastamp::checkpoint::rng_set_state);
}
