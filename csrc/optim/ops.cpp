// Schemas of the fused optimizer ops, and their argument checks (shared by CPU and CUDA).
#include <torch/library.h>

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

namespace {

// Kernels for calls that reach no backend kernel. A step over empty lists with no optional tensor
// has no tensor to dispatch on, and the dispatcher would say only "no fallback function is
// registered"; a step over no params is a no-op, as it is on every backend. A non-empty call
// lands here only on a device with no fastamp kernel, which is refused by name.
void adam_step_no_kernel(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                         at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                         at::TensorList state_steps, at::TensorList master_params, double,
                         const c10::optional<at::Tensor>& lr_tensor, double, double, double,
                         double, bool amsgrad, bool, bool,
                         const c10::optional<at::Tensor>& inv_scale,
                         const c10::optional<at::Tensor>& found_inf,
                         const c10::optional<at::Tensor>& clip_coef) {
  const StepPlan plan = check_adam_step(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                                        state_steps, master_params, amsgrad, lr_tensor, inv_scale,
                                        found_inf, clip_coef);
  TORCH_CHECK(plan.empty(), "fastamp::adam_step_: no kernel for params on ", plan.device,
              " in this build");
}

void sgd_step_no_kernel(at::TensorList params, at::TensorList grads,
                        at::TensorList momentum_buffers, at::TensorList state_steps,
                        at::TensorList master_params, double,
                        const c10::optional<at::Tensor>& lr_tensor, double, double momentum,
                        double, bool, bool, const c10::optional<at::Tensor>& inv_scale,
                        const c10::optional<at::Tensor>& found_inf,
                        const c10::optional<at::Tensor>& clip_coef) {
  const StepPlan plan = check_sgd_step(params, grads, momentum_buffers, state_steps,
                                       master_params, momentum, lr_tensor, inv_scale, found_inf,
                                       clip_coef);
  TORCH_CHECK(plan.empty(), "fastamp::sgd_step_: no kernel for params on ", plan.device,
              " in this build");
}

std::vector<int64_t> shared_memory_pair(at::TensorList tensors) {
  return find_shared_memory(tensors);
}

}  // namespace
}  // namespace optim
}  // namespace fastamp

TORCH_LIBRARY_FRAGMENT(fastamp, m) {
  m.set_python_module("fastamp.optim._ops");

  // Fused Adam/AdamW step over one param group. Reads grads (loss-scaled) and, when given, the
  // device scalars inv_scale, found_inf, clip_coef and lr_tensor. Unless found_inf != 0 it
  // updates, per element, params (or master_params, then params = cast(master)), exp_avgs,
  // exp_avg_sqs and (amsgrad) max_exp_avg_sqs with the gradient g * inv_scale * clip_coef, and
  // adds 1 to each state_steps entry; with found_inf != 0 nothing is written at all. State tensors
  // have the params' dtype, or float32 with master_params.
  m.def(
      "adam_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
      "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] state_steps, "
      "Tensor(f!)[] master_params, float lr, Tensor? lr_tensor, float beta1, float beta2, "
      "float weight_decay, float eps, bool amsgrad, bool decoupled_weight_decay, bool maximize, "
      "Tensor? inv_scale, Tensor? found_inf, Tensor? clip_coef) -> ()");

  // Fused SGD step over one param group (torch.optim.SGD semantics). momentum_buffers is empty
  // when momentum == 0. state_steps counts the updates each param has had (0 means its momentum
  // buffer is still unset, as PyTorch's None); it is incremented unless found_inf != 0, in which
  // case nothing is written.
  m.def(
      "sgd_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, "
      "Tensor(c!)[] state_steps, Tensor(d!)[] master_params, float lr, Tensor? lr_tensor, "
      "float weight_decay, float momentum, float dampening, bool nesterov, bool maximize, "
      "Tensor? inv_scale, Tensor? found_inf, Tensor? clip_coef) -> ()");

  // The first pair [i, j] (i <= j) of `tensors` that share an element of memory ([i, i]: the
  // tensor's own elements overlap, as after expand()), or [] when none does. Reads only sizes,
  // strides and addresses (no data, no sync); the same on every device. The optimizers run it
  // over the params of all their groups before stepping any group.
  m.def("shared_memory_pair(Tensor[] tensors) -> int[]");
}

TORCH_LIBRARY_IMPL(fastamp, CompositeExplicitAutograd, m) {
  m.impl("shared_memory_pair", &fastamp::optim::shared_memory_pair);
  m.impl("adam_step_", &fastamp::optim::adam_step_no_kernel);
  m.impl("sgd_step_", &fastamp::optim::sgd_step_no_kernel);
}
