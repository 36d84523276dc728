// The argument checks of the fused optimizer ops (declared in optim_checks.h), shared by their CPU
// and CUDA kernels and by the CUDA emulator build: everything is checked before anything is written.
#include "optim/optim_checks.h"

#include <string>

namespace fastamp {
namespace optim {
namespace {

StepPlan check_step(const char* op, at::TensorList params, at::TensorList grads,
                    const std::vector<std::pair<const char*, at::TensorList>>& state,
                    at::TensorList state_steps, at::TensorList master_params) {
  TORCH_CHECK(!params.empty() || grads.empty(), op, ": grads given without params");
  const size_t n = params.size();
  const auto same_len = [&](const char* name, size_t len) {
    TORCH_CHECK(len == n, op, ": ", name, " has ", len, " tensors; expected one per param (",
                      n, ")");
  };
  same_len("grads", grads.size());
  same_len("state_steps", state_steps.size());
  for (const auto& [name, list] : state) same_len(name, list.size());
  const bool has_master = !master_params.empty();
  if (has_master) same_len("master_params", master_params.size());
  StepPlan plan;
  plan.has_master = has_master;
  if (n == 0) return plan;
  const c10::Device dev = params[0].device();
  plan.device = dev;
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    const at::Tensor& g = grads[i];
    TORCH_CHECK(g.defined(), op, ": grads[", i, "] is undefined (None)");
    TORCH_CHECK(g.sizes() == p.sizes(), op, ": grads[", i, "] has shape ", g.sizes(),
                      " but params[", i, "] has shape ", p.sizes());
    TORCH_CHECK(g.scalar_type() == p.scalar_type(), op, ": grads[", i, "] has dtype ",
                     g.scalar_type(), " but params[", i, "] has dtype ", p.scalar_type());
    // Elementwise over flat memory: every tensor of param i must be dense with the param's strides
    // (contiguous or e.g. channels_last alike), so element k of each span is the same element.
    TORCH_CHECK(p.is_non_overlapping_and_dense(), op, ": params[", i,
                "] must be a dense tensor (contiguous or a permutation of it)");
    TORCH_CHECK(g.strides() == p.strides(), op, ": grads[", i, "] has strides ", g.strides(),
                " but params[", i, "] has ", p.strides(), "; expected the same memory layout");
    const auto state_dtype = has_master ? at::kFloat : p.scalar_type();
    for (const auto& [name, list] : state) {
      const at::Tensor& s = list[i];
      TORCH_CHECK(s.defined() && s.device() == dev, op, ": ", name, "[", i, "] must be on ", dev);
      TORCH_CHECK(s.sizes() == p.sizes() && s.strides() == p.strides(), op, ": ", name,
                        "[", i, "] must have the shape ", p.sizes(), " and strides ", p.strides(),
                        " of params[", i, "]");
      TORCH_CHECK(s.scalar_type() == state_dtype, op, ": ", name, "[", i, "] has dtype ",
                       s.scalar_type(), "; expected ", c10::toString(state_dtype));
    }
    const at::Tensor& st = state_steps[i];
    TORCH_CHECK(st.defined() && st.device() == dev && st.numel() == 1 &&
                    st.scalar_type() == at::kFloat,
                op, ": state_steps[", i, "] must be a one-element float32 tensor on ", dev);
    if (has_master) {
      const at::Tensor& mp = master_params[i];
      TORCH_CHECK(mp.defined() && mp.device() == dev && mp.scalar_type() == at::kFloat &&
                      mp.sizes() == p.sizes() && mp.strides() == p.strides(),
                  op, ": master_params[", i, "] must be a float32 tensor with the shape and ",
                  "strides of params[", i, "] on ", dev);
    }
  }
  // Everything written, across lists: a param passed again as a state tensor (or twice) would be
  // updated twice.
  std::vector<std::pair<const char*, at::TensorList>> written = {{"params", params},
                                                                 {"state_steps", state_steps}};
  written.insert(written.end(), state.begin(), state.end());
  if (has_master) written.emplace_back("master_params", master_params);
  check_disjoint(op, written);
  const std::initializer_list<c10::ScalarType> dtypes = {at::kFloat, at::kHalf, at::kBFloat16};
  plan.params = FlatTensorList::prepare(params, op, "params", dev, true, dtypes);
  plan.grads = FlatTensorList::prepare(grads, op, "grads", dev, false, dtypes);
  for (const auto& [name, list] : state) {
    plan.state.push_back(FlatTensorList::prepare(list, op, name, dev, true, dtypes));
  }
  if (has_master) {
    plan.master = FlatTensorList::prepare(master_params, op, "master_params", dev, true, {at::kFloat});
  }
  return plan;
}

StepScalars check_scalars(const char* op, const c10::Device& device,
                          const c10::optional<at::Tensor>& lr_tensor,
                          const c10::optional<at::Tensor>& inv_scale,
                          const c10::optional<at::Tensor>& found_inf,
                          const c10::optional<at::Tensor>& clip_coef) {
  StepScalars s;
  const auto get = [&](const c10::optional<at::Tensor>& t, const char* name) -> const float* {
    if (!t.has_value() || !t->defined()) return nullptr;
    check_scalar_tensor(*t, op, name, device, at::kFloat, true);
    return t->data_ptr<float>();
  };
  s.lr = get(lr_tensor, "lr_tensor");
  s.inv_scale = get(inv_scale, "inv_scale");
  s.found_inf = get(found_inf, "found_inf");
  s.clip_coef = get(clip_coef, "clip_coef");
  return s;
}

}  // namespace

StepPlan check_adam_step(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                         at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                         at::TensorList state_steps, at::TensorList master_params, bool amsgrad,
                         const c10::optional<at::Tensor>& lr_tensor,
                         const c10::optional<at::Tensor>& inv_scale,
                         const c10::optional<at::Tensor>& found_inf,
                         const c10::optional<at::Tensor>& clip_coef) {
  constexpr const char* op = "fastamp::adam_step_";
  std::vector<std::pair<const char*, at::TensorList>> state = {{"exp_avgs", exp_avgs},
                                                               {"exp_avg_sqs", exp_avg_sqs}};
  if (amsgrad) state.emplace_back("max_exp_avg_sqs", max_exp_avg_sqs);
  StepPlan plan = check_step(op, params, grads, state, state_steps, master_params);
  if (!plan.empty()) {
    plan.scalars = check_scalars(op, plan.device, lr_tensor, inv_scale, found_inf, clip_coef);
  }
  return plan;
}

StepPlan check_sgd_step(at::TensorList params, at::TensorList grads,
                        at::TensorList momentum_buffers, at::TensorList state_steps,
                        at::TensorList master_params, double momentum,
                        const c10::optional<at::Tensor>& lr_tensor,
                        const c10::optional<at::Tensor>& inv_scale,
                        const c10::optional<at::Tensor>& found_inf,
                        const c10::optional<at::Tensor>& clip_coef) {
  constexpr const char* op = "fastamp::sgd_step_";
  TORCH_CHECK(momentum != 0.0 || momentum_buffers.empty(), op,
                    ": momentum_buffers must be empty when momentum == 0");
  std::vector<std::pair<const char*, at::TensorList>> state;
  if (momentum != 0.0) state.emplace_back("momentum_buffers", momentum_buffers);
  StepPlan plan = check_step(op, params, grads, state, state_steps, master_params);
  if (!plan.empty()) {
    plan.scalars = check_scalars(op, plan.device, lr_tensor, inv_scale, found_inf, clip_coef);
  }
  return plan;
}

}  // namespace optim
}  // namespace fastamp
