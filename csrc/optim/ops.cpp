// Schemas of the fused optimizer ops (each with what it reads and writes) and their
// device-independent registrations; the C++ op functions that pack each schema's arguments into
// one struct are in optim_args.h, the argument checks in optim_checks.cpp, the kernels in
// optim_cpu.cpp, optim_cuda.cu and lowbit_cuda.cu.
#include "common/torch_api.h"

#include "common/held_tensors.h"
#include "optim/optim_checks.h"

namespace fastamp {
namespace optim {
namespace {

// The kernel of calls that reach no backend kernel. A step over empty lists with no optional
// tensor has no tensor to dispatch on, and the dispatcher would say only "no fallback function is
// registered"; a step over no params is a no-op, as it is on every backend. A non-empty call
// lands here only on a device with no fastamp kernel, which is refused by name.
template <typename Args>
void no_kernel(const Args& args) {
  const auto plan = check_args(args);
  FASTAMP_CHECK(plan.empty(), Args::kOp, ": no kernel for params on ", plan.device,
                " in this build");
}

std::vector<int64_t> shared_memory_pair(TensorList tensors) {
  return find_shared_memory(tensors);
}

}  // namespace
}  // namespace optim
}  // namespace fastamp

STABLE_TORCH_LIBRARY_FRAGMENT(fastamp, m) {
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

  // Adam/AdamW step with low-precision moments, fused as adam_step_ (one pass; with found_inf != 0
  // nothing is written and state_steps hold). exp_avgs / exp_avg_sqs are either bfloat16, written
  // with stochastic rounding keyed by (seed, new step, list position, element index), or uint8
  // codes of 256-element blocks whose float32 scales are exp_avg_absmax / exp_avg_sq_absmax (one
  // per block; empty lists with bfloat16 state); see csrc/optim/lowbit_math.h for the formats.
  // Reads grads and the optional device scalars; writes params (or master_params, then params),
  // the moments, their scales and state_steps. No amsgrad.
  m.def(
      "adam_lowbit_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
      "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] exp_avg_absmax, Tensor(e!)[] exp_avg_sq_absmax, "
      "Tensor(f!)[] state_steps, Tensor(g!)[] master_params, int seed, float lr, "
      "Tensor? lr_tensor, float beta1, float beta2, float weight_decay, float eps, "
      "bool decoupled_weight_decay, bool maximize, Tensor? inv_scale, Tensor? found_inf, "
      "Tensor? clip_coef) -> ()");

  // SGD step with momentum (momentum != 0) whose buffers are bfloat16, fused as sgd_step_ (one
  // pass; with found_inf != 0 nothing is written and state_steps hold). The new buffer is
  // rounded to bfloat16 stochastically, keyed by (seed, new update count, list position, element
  // index) as adam_lowbit_step_'s exp_avg. state_steps counts each param's updates (0: the buffer
  // gets the gradient itself, as PyTorch's first momentum step).
  m.def(
      "sgd_lowbit_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, "
      "Tensor(c!)[] state_steps, Tensor(d!)[] master_params, int seed, float lr, "
      "Tensor? lr_tensor, float weight_decay, float momentum, float dampening, bool nesterov, "
      "bool maximize, Tensor? inv_scale, Tensor? found_inf, Tensor? clip_coef) -> ()");

  // The first pair [i, j] (i <= j) of `tensors` that share an element of memory ([i, i]: the
  // tensor's own elements overlap, as after expand()), or [] when none does. Reads only sizes,
  // strides and addresses (no data, no sync); the same on every device. The optimizers run it
  // over the params of all their groups before stepping any group.
  m.def("shared_memory_pair(Tensor[] tensors) -> int[]");

  // Keeps references to `tensors`, cut into consecutive lists of `lengths` (which add up to
  // len(tensors)), and returns a handle for the *_held_ ops below; reads and writes no data. The
  // references are dropped by release_tensors(handle). A step plan holds its params and state
  // once, so that each step boxes only its grads (common/held_tensors.h).
  m.def("hold_tensors(Tensor[] tensors, int[] lengths) -> int");
  m.def("release_tensors(int held) -> ()");
  // The position (over all its lists, in order) of the first tensor of `held` whose data pointer
  // is not the one it had when held, or -1; reads no data. What flat buffers check every step
  // (their params and grads still views of the buffers) at one C call per tensor.
  m.def("held_moved(int held) -> int");

  // The step ops with every list but the grads held: `held` (from hold_tensors) holds the lists
  // of the op of the same name without `_held`, in its schema's order (adam_step_: params,
  // exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, master_params). Reads, writes and checks
  // exactly what that op would with those lists; the held tensors are the caller's own, so the
  // write counters of what they write are the caller's to bump (the schema cannot list them).
  m.def(
      "adam_step_held_(int held, Tensor[] grads, float lr, Tensor? lr_tensor, float beta1, "
      "float beta2, float weight_decay, float eps, bool amsgrad, bool decoupled_weight_decay, "
      "bool maximize, Tensor? inv_scale, Tensor? found_inf, Tensor? clip_coef) -> ()");
  m.def(
      "sgd_step_held_(int held, Tensor[] grads, float lr, Tensor? lr_tensor, "
      "float weight_decay, float momentum, float dampening, bool nesterov, bool maximize, "
      "Tensor? inv_scale, Tensor? found_inf, Tensor? clip_coef) -> ()");
  m.def(
      "adam_lowbit_step_held_(int held, Tensor[] grads, int seed, float lr, Tensor? lr_tensor, "
      "float beta1, float beta2, float weight_decay, float eps, bool decoupled_weight_decay, "
      "bool maximize, Tensor? inv_scale, Tensor? found_inf, Tensor? clip_coef) -> ()");
  m.def(
      "sgd_lowbit_step_held_(int held, Tensor[] grads, int seed, float lr, Tensor? lr_tensor, "
      "float weight_decay, float momentum, float dampening, bool nesterov, bool maximize, "
      "Tensor? inv_scale, Tensor? found_inf, Tensor? clip_coef) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(fastamp, CompositeExplicitAutograd, m) {
  m.impl("shared_memory_pair", TORCH_BOX(&fastamp::optim::shared_memory_pair));
  namespace o = fastamp::optim;
  m.impl("adam_step_", TORCH_BOX(&o::adam_step_op<o::no_kernel<o::AdamArgs>>));
  m.impl("sgd_step_", TORCH_BOX(&o::sgd_step_op<o::no_kernel<o::SgdArgs>>));
  m.impl("adam_lowbit_step_", TORCH_BOX(&o::adam_lowbit_step_op<o::no_kernel<o::AdamLowbitArgs>>));
  m.impl("sgd_lowbit_step_", TORCH_BOX(&o::sgd_lowbit_step_op<o::no_kernel<o::SgdLowbitArgs>>));
  m.impl("hold_tensors", TORCH_BOX(&fastamp::hold_tensors));
  m.impl("release_tensors", TORCH_BOX(&fastamp::release_tensors));
  m.impl("held_moved", TORCH_BOX(&fastamp::held_moved));
  m.impl("adam_step_held_", TORCH_BOX(&o::adam_step_held_op<o::no_kernel<o::AdamArgs>>));
  m.impl("sgd_step_held_", TORCH_BOX(&o::sgd_step_held_op<o::no_kernel<o::SgdArgs>>));
  m.impl("adam_lowbit_step_held_",
         TORCH_BOX(&o::adam_lowbit_step_held_op<o::no_kernel<o::AdamLowbitArgs>>));
  m.impl("sgd_lowbit_step_held_",
         TORCH_BOX(&o::sgd_lowbit_step_held_op<o::no_kernel<o::SgdLowbitArgs>>));
}
