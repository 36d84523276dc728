// The argument checks of the fused optimizer ops (declared in optim_checks.h), shared by their CPU
// and CUDA kernels and by the CUDA emulator build: everything is checked before anything is
// written.
#include "optim/optim_checks.h"

#include <string>

namespace fastamp {
namespace optim {
namespace {

void check_len(const char* op, const char* name, size_t len, size_t n) {
  FASTAMP_CHECK(len == n, op, ": ", name, " has ", len, " tensors; expected one per param (", n,
                ")");
}

/// The list-length checks every step op starts with: grads, each of `state`, state_steps and
/// (when given) master_params hold one tensor per param. Returns whether master params are given.
bool check_lengths(const char* op, TensorList params, TensorList grads,
                   const std::vector<std::pair<const char*, TensorList>>& state,
                   TensorList state_steps, TensorList master_params) {
  FASTAMP_CHECK(!params.empty() || grads.empty(), op, ": grads given without params");
  const size_t n = params.size();
  check_len(op, "grads", grads.size(), n);
  check_len(op, "state_steps", state_steps.size(), n);
  for (const auto& [name, list] : state) check_len(op, name, list.size(), n);
  const bool has_master = !master_params.empty();
  if (has_master) check_len(op, "master_params", master_params.size(), n);
  return has_master;
}

// `held`: the handle the lists but the grads come from (a `*_held_` op), or null.
StepPlan check_step(const char* op, TensorList params, TensorList grads,
                    const std::vector<std::pair<const char*, TensorList>>& state,
                    TensorList state_steps, TensorList master_params, const HeldLists* held) {
  const size_t n = params.size();
  const bool has_master = check_lengths(op, params, grads, state, state_steps, master_params);
  StepPlan plan;
  plan.has_master = has_master;
  if (n == 0) return plan;
  const Device dev = params[0].device();
  plan.device = dev;
  // Each list's tensors read from torch once, for every check below (held ones through the
  // handle's cache, which re-reads what can change).
  const auto read = [held](TensorList l) { return held ? held->read(l) : MetaList::read(l); };
  const MetaList P = read(params), G = MetaList::read(grads);
  const MetaList ST = read(state_steps), MP = read(master_params);
  std::vector<MetaList> S;
  for (const auto& named : state) S.push_back(read(named.second));
  for (size_t i = 0; i < n; ++i) {
    const TensorMeta& p = P[i];
    const TensorMeta& g = G[i];
    FASTAMP_CHECK(g.defined, op, ": grads[", i, "] is undefined (None)");
    FASTAMP_CHECK(g.sizes().equals(p.sizes()), op, ": grads[", i, "] has shape ", g.sizes(),
                  " but params[", i, "] has shape ", p.sizes());
    FASTAMP_CHECK(g.dtype == p.dtype, op, ": grads[", i, "] has dtype ", g.dtype, " but params[", i,
                  "] has dtype ", p.dtype);
    // Elementwise over flat memory: every tensor of param i must be dense with the param's strides
    // (contiguous or e.g. channels_last alike), so element k of each span is the same element.
    FASTAMP_CHECK(p.dense(), op, ": params[", i,
                  "] must be a dense tensor (contiguous or a permutation of it)");
    FASTAMP_CHECK(g.strides().equals(p.strides()), op, ": grads[", i, "] has strides ", g.strides(),
                  " but params[", i, "] has ", p.strides(), "; expected the same memory layout");
    const auto state_dtype = has_master ? kFloat : p.dtype;
    for (size_t k = 0; k < state.size(); ++k) {
      const char* name = state[k].first;
      const TensorMeta& s = S[k][i];
      FASTAMP_CHECK(s.defined && s.on(dev), op, ": ", name, "[", i, "] must be on ", dev);
      FASTAMP_CHECK(s.sizes().equals(p.sizes()) && s.strides().equals(p.strides()), op, ": ", name,
                    "[", i, "] must have the shape ", p.sizes(), " and strides ", p.strides(),
                    " of params[", i, "]");
      FASTAMP_CHECK(s.dtype == state_dtype, op, ": ", name, "[", i, "] has dtype ", s.dtype,
                    "; expected ", c10::toString(state_dtype));
    }
    const TensorMeta& st = ST[i];
    FASTAMP_CHECK(st.defined && st.on(dev) && st.numel == 1 && st.dtype == kFloat, op,
                  ": state_steps[", i, "] must be a one-element float32 tensor on ", dev);
    if (has_master) {
      const TensorMeta& mp = MP[i];
      FASTAMP_CHECK(mp.defined && mp.on(dev) && mp.dtype == kFloat &&
                        mp.sizes().equals(p.sizes()) && mp.strides().equals(p.strides()),
                    op, ": master_params[", i, "] must be a float32 tensor with the shape and ",
                    "strides of params[", i, "] on ", dev);
    }
  }
  // Everything written, across lists: a param passed again as a state tensor (or twice) would be
  // updated twice. Every written list is held in a `*_held_` op: when none of their tensors
  // changed since a call whose checks passed, they are still disjoint.
  if (held == nullptr || !held->unchanged()) {
    std::vector<std::pair<const char*, const MetaList*>> written = {{"params", &P},
                                                                    {"state_steps", &ST}};
    for (size_t k = 0; k < state.size(); ++k) written.emplace_back(state[k].first, &S[k]);
    if (has_master) written.emplace_back("master_params", &MP);
    check_disjoint(op, written);
  }
  const std::initializer_list<c10::ScalarType> dtypes = {kFloat, kHalf, kBFloat16};
  plan.params = FlatTensorList::prepare(P, op, "params", dev, true, dtypes);
  plan.grads = FlatTensorList::prepare(G, op, "grads", dev, false, dtypes);
  for (size_t k = 0; k < state.size(); ++k) {
    plan.state.push_back(FlatTensorList::prepare(S[k], op, state[k].first, dev, true, dtypes));
  }
  if (has_master) {
    plan.master = FlatTensorList::prepare(MP, op, "master_params", dev, true, {kFloat});
  }
  if (held != nullptr) held->mark_checked();
  return plan;
}

StepScalars check_scalars(const char* op, const Device& device, const StepTensors& t) {
  StepScalars s;
  const auto get = [&](const OptTensor& x, const char* name) -> const float* {
    if (!x.has_value() || !x->defined()) return nullptr;
    check_scalar_tensor(*x, op, name, device, kFloat, true);
    return x->mutable_data_ptr<float>();
  };
  s.lr = get(t.lr_tensor, "lr_tensor");
  s.inv_scale = get(t.inv_scale, "inv_scale");
  s.found_inf = get(t.found_inf, "found_inf");
  s.clip_coef = get(t.clip_coef, "clip_coef");
  return s;
}

}  // namespace

AdamPlan check_args(const AdamArgs& a) {
  constexpr const char* op = AdamArgs::kOp;
  std::vector<std::pair<const char*, TensorList>> state = {{"exp_avgs", a.exp_avgs},
                                                           {"exp_avg_sqs", a.exp_avg_sqs}};
  if (a.opt.amsgrad) state.emplace_back("max_exp_avg_sqs", a.max_exp_avg_sqs);
  AdamPlan plan{check_step(op, a.params, a.grads, state, a.state_steps, a.master_params, a.held)};
  if (!plan.empty()) plan.scalars = check_scalars(op, plan.device, a.tensors);
  return plan;
}

SgdPlan check_args(const SgdArgs& a) {
  constexpr const char* op = SgdArgs::kOp;
  const bool momentum = a.opt.momentum != 0.0;
  FASTAMP_CHECK(momentum || a.momentum_buffers.empty(), op,
                ": momentum_buffers must be empty when momentum == 0");
  std::vector<std::pair<const char*, TensorList>> state;
  if (momentum) state.emplace_back("momentum_buffers", a.momentum_buffers);
  SgdPlan plan{check_step(op, a.params, a.grads, state, a.state_steps, a.master_params, a.held)};
  if (!plan.empty()) plan.scalars = check_scalars(op, plan.device, a.tensors);
  return plan;
}

namespace {

using NamedLists = std::vector<std::pair<const char*, TensorList>>;

// What the low-precision steps check alike: per param its grad, contiguity (blocks and rounding
// counters are in memory order), each state tensor of `state` (dtype code_t, the param's shape),
// its step counter and master copy; then that nothing written aliases, and the flat lists.
void check_lowbit_lists(const char* op, StepPlan& plan, TensorList params, TensorList grads,
                        const NamedLists& state, c10::ScalarType code_t, TensorList state_steps,
                        TensorList master_params, NamedLists written) {
  const Device dev = plan.device;
  // Each list's tensors read from torch once, for every check below.
  const MetaList P = MetaList::read(params), G = MetaList::read(grads);
  const MetaList ST = MetaList::read(state_steps), MP = MetaList::read(master_params);
  std::vector<MetaList> S;
  for (const auto& named : state) S.push_back(MetaList::read(named.second));
  for (size_t i = 0; i < params.size(); ++i) {
    const TensorMeta& p = P[i];
    const TensorMeta& g = G[i];
    FASTAMP_CHECK(g.defined, op, ": grads[", i, "] is undefined (None)");
    FASTAMP_CHECK(g.sizes().equals(p.sizes()) && g.dtype == p.dtype, op, ": grads[", i,
                  "] has shape ", g.sizes(), " and dtype ", g.dtype, " but params[", i,
                  "] has shape ", p.sizes(), " and dtype ", p.dtype);
    FASTAMP_CHECK(p.contiguous() && g.contiguous(), op, ": params[", i, "] and grads[", i,
                  "] must be contiguous (the state's blocks and rounding counters are in memory "
                  "order)");
    for (size_t k = 0; k < state.size(); ++k) {
      const char* name = state[k].first;
      const TensorMeta& s = S[k][i];
      FASTAMP_CHECK(s.defined && s.on(dev) && s.dtype == code_t && s.sizes().equals(p.sizes()) &&
                        s.contiguous(),
                    op, ": ", name, "[", i, "] must be a contiguous ", c10::toString(code_t),
                    " tensor of the shape ", p.sizes(), " of params[", i, "] on ", dev,
                    " (every state tensor of one call in the same format)");
    }
    const TensorMeta& st = ST[i];
    FASTAMP_CHECK(st.defined && st.on(dev) && st.numel == 1 && st.dtype == kFloat, op,
                  ": state_steps[", i, "] must be a one-element float32 tensor on ", dev);
    if (plan.has_master) {
      const TensorMeta& mp = MP[i];
      FASTAMP_CHECK(mp.defined && mp.on(dev) && mp.dtype == kFloat &&
                        mp.sizes().equals(p.sizes()) && mp.contiguous(),
                    op, ": master_params[", i,
                    "] must be a contiguous float32 tensor of the shape of "
                    "params[",
                    i, "] on ", dev);
    }
  }
  std::vector<MetaList> extra;  // the written lists the caller checked (the block scales)
  for (const auto& named : written) extra.push_back(MetaList::read(named.second));
  std::vector<std::pair<const char*, const MetaList*>> all = {{"params", &P}, {"state_steps", &ST}};
  for (size_t k = 0; k < written.size(); ++k) all.emplace_back(written[k].first, &extra[k]);
  for (size_t k = 0; k < state.size(); ++k) all.emplace_back(state[k].first, &S[k]);
  if (plan.has_master) all.emplace_back("master_params", &MP);
  check_disjoint(op, all);
  const std::initializer_list<c10::ScalarType> dtypes = {kFloat, kHalf, kBFloat16};
  plan.params = FlatTensorList::prepare(P, op, "params", dev, true, dtypes);
  plan.grads = FlatTensorList::prepare(G, op, "grads", dev, false, dtypes);
  for (size_t k = 0; k < state.size(); ++k) {
    plan.state.push_back(FlatTensorList::prepare(S[k], op, state[k].first, dev, true, {code_t}));
  }
  if (plan.has_master) {
    plan.master = FlatTensorList::prepare(MP, op, "master_params", dev, true, {kFloat});
  }
}

}  // namespace

LowbitPlan check_args(const AdamLowbitArgs& a) {
  constexpr const char* op = AdamLowbitArgs::kOp;
  constexpr int64_t kBlock = 256;  // lowbit_math.h's kQuantBlock
  const TensorList params = a.params;
  const size_t n = params.size();
  const bool has_master =
      check_lengths(op, params, a.grads, {{"exp_avgs", a.exp_avgs}, {"exp_avg_sqs", a.exp_avg_sqs}},
                    a.state_steps, a.master_params);
  LowbitPlan plan;
  plan.has_master = has_master;
  if (n == 0) return plan;
  const Device dev = params[0].device();
  plan.device = dev;
  const c10::ScalarType code_t = a.exp_avgs[0].scalar_type();
  FASTAMP_CHECK(code_t == kBFloat16 || code_t == kByte, op, ": exp_avgs[0] has dtype ", code_t,
                "; expected bfloat16 (16-bit state) or uint8 (8-bit codes)");
  plan.int8 = code_t == kByte;
  NamedLists written;
  if (plan.int8) {
    check_len(op, "exp_avg_absmax", a.exp_avg_absmax.size(), n);
    check_len(op, "exp_avg_sq_absmax", a.exp_avg_sq_absmax.size(), n);
    for (size_t i = 0; i < n; ++i) {
      const int64_t blocks = (params[i].numel() + kBlock - 1) / kBlock;
      for (const auto& [name, list] :
           {std::pair<const char*, TensorList>{"exp_avg_absmax", a.exp_avg_absmax},
            {"exp_avg_sq_absmax", a.exp_avg_sq_absmax}}) {
        const Tensor& s = list[i];
        FASTAMP_CHECK(s.defined() && s.device() == dev && s.scalar_type() == kFloat &&
                          s.dim() == 1 && s.numel() == blocks && s.is_contiguous(),
                      op, ": ", name, "[", i, "] must be a contiguous float32 tensor of ", blocks,
                      " elements (one per 256-element block of params[", i, "]) on ", dev);
      }
    }
    written = {{"exp_avg_absmax", a.exp_avg_absmax}, {"exp_avg_sq_absmax", a.exp_avg_sq_absmax}};
  } else {
    FASTAMP_CHECK(a.exp_avg_absmax.empty() && a.exp_avg_sq_absmax.empty(), op,
                  ": exp_avg_absmax and exp_avg_sq_absmax must be empty with bfloat16 state (they "
                  "hold the block scales of 8-bit codes)");
  }
  check_lowbit_lists(op, plan, params, a.grads,
                     {{"exp_avgs", a.exp_avgs}, {"exp_avg_sqs", a.exp_avg_sqs}}, code_t,
                     a.state_steps, a.master_params, written);
  if (plan.int8) {
    plan.absmax.push_back(
        FlatTensorList::prepare(a.exp_avg_absmax, op, "exp_avg_absmax", dev, true, {kFloat}));
    plan.absmax.push_back(
        FlatTensorList::prepare(a.exp_avg_sq_absmax, op, "exp_avg_sq_absmax", dev, true, {kFloat}));
  }
  plan.scalars = check_scalars(op, dev, a.tensors);
  return plan;
}

SgdPlan check_args(const SgdLowbitArgs& a) {
  constexpr const char* op = SgdLowbitArgs::kOp;
  FASTAMP_CHECK(a.opt.momentum != 0.0, op,
                ": momentum is 0; without momentum SGD keeps no state (use "
                "fastamp::sgd_step_)");
  SgdPlan plan;
  plan.has_master = check_lengths(op, a.params, a.grads, {{"momentum_buffers", a.momentum_buffers}},
                                  a.state_steps, a.master_params);
  if (a.params.empty()) return plan;
  plan.device = a.params[0].device();
  check_lowbit_lists(op, plan, a.params, a.grads, {{"momentum_buffers", a.momentum_buffers}},
                     kBFloat16, a.state_steps, a.master_params, {});
  plan.scalars = check_scalars(op, plan.device, a.tensors);
  return plan;
}

}  // namespace optim
}  // namespace fastamp
