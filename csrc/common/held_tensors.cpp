// The registry behind held_tensors.h: handles to tensor lists, under one mutex (a lookup per
// call, not per tensor).
#include "common/held_tensors.h"

#include <mutex>
#include <unordered_map>

namespace fastamp {
namespace {

struct Registry {
  std::mutex mutex;
  std::unordered_map<int64_t, std::shared_ptr<const HeldLists>> lists;
  int64_t next = 1;
};

Registry& registry() {
  // Never destroyed: a Python finalizer may release a handle while the process exits.
  static Registry* r = new Registry();
  return *r;
}

}  // namespace

int64_t hold_tensors(TensorList tensors, IntList lengths) {
  std::vector<size_t> offsets{0};
  offsets.reserve(lengths.size() + 1);
  for (size_t k = 0; k < lengths.size(); ++k) {
    FASTAMP_CHECK_VALUE(lengths[k] >= 0, "fastamp::hold_tensors: lengths[", k, "] is ", lengths[k],
                        "; expected a count >= 0");
    offsets.push_back(offsets.back() + static_cast<size_t>(lengths[k]));
  }
  FASTAMP_CHECK_VALUE(offsets.back() == tensors.size(), "fastamp::hold_tensors: lengths add up to ",
                      offsets.back(), " but ", tensors.size(),
                      " tensors were given; expected the same count");
  std::vector<void*> addresses;
  addresses.reserve(tensors.size());
  for (const Tensor& t : tensors) addresses.push_back(strided_data_ptr(t));
  auto held = std::make_shared<const HeldLists>(std::vector<Tensor>(tensors.begin(), tensors.end()),
                                                std::move(offsets), std::move(addresses));
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  const int64_t handle = r.next++;
  r.lists.emplace(handle, std::move(held));
  return handle;
}

void release_tensors(int64_t handle) {
  std::shared_ptr<const HeldLists> dropped;  // destroyed after the lock is released
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.lists.find(handle);
  FASTAMP_CHECK_VALUE(it != r.lists.end(), "fastamp::release_tensors: no tensors are held under ",
                      "handle ", handle, " (released already, or never returned by hold_tensors)");
  dropped = std::move(it->second);
  r.lists.erase(it);
}

int64_t HeldLists::first_moved() const {
  for (size_t i = 0; i < tensors_.size(); ++i) {
    if (strided_data_ptr(tensors_[i]) != addresses_[i]) return static_cast<int64_t>(i);
  }
  return -1;
}

int64_t held_moved(int64_t handle) {
  return held_lists(handle, 0, "fastamp::held_moved", /*any_count=*/true)->first_moved();
}

std::unique_lock<std::mutex> HeldLists::guard() const {
  std::unique_lock<std::mutex> lock(mutex_);
  same_ = true;
  return lock;
}

MetaList HeldLists::read(TensorList list) const {
  size_t first = tensors_.size();
  for (size_t k = 0; k < size(); ++k) {
    if (list.data() == tensors_.data() + offsets_[k] &&
        list.size() == offsets_[k + 1] - offsets_[k]) {
      first = offsets_[k];
      break;
    }
  }
  if (first == tensors_.size() || list.empty()) return MetaList::read(list);
  MetaList out{list, {}};
  out.metas.reserve(list.size());
  for (size_t j = 0; j < list.size(); ++j) {
    const size_t i = first + j;
    if (!(known_[i] && meta_still(tensors_[i], metas_[i], sizes_[i], strides_[i]))) {
      TensorMeta& m = metas_[i] = meta_of(tensors_[i]);
      const auto n = static_cast<size_t>(m.dim);
      sizes_[i].assign(m.size_data, m.size_data + (m.size_data ? n : 0));
      strides_[i].assign(m.stride_data, m.stride_data + (m.stride_data ? n : 0));
      known_[i] = true;
      same_ = false;
      checked_ = false;
    }
    out.metas.push_back(metas_[i]);
  }
  return out;
}

std::shared_ptr<const HeldLists> held_lists(int64_t handle, size_t expected, const char* op,
                                            bool any_count) {
  std::shared_ptr<const HeldLists> held;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.lists.find(handle);
    FASTAMP_CHECK_VALUE(it != r.lists.end(), op, ": held is ", handle,
                        ", which holds no tensors (released, or never returned by "
                        "fastamp::hold_tensors)");
    held = it->second;
  }
  FASTAMP_CHECK_VALUE(any_count || held->size() == expected, op, ": held ", handle, " holds ",
                      held->size(), " tensor lists; expected ", expected);
  return held;
}

}  // namespace fastamp

#if defined(FASTAMP_CUDA_EMULATOR)
// The emulator library's own registry, for the held variants of its mirrored step ops (the
// schemas are fastamp's, copied by the test harness into fastamp_emu).
STABLE_TORCH_LIBRARY_IMPL(fastamp_emu, CompositeExplicitAutograd, m) {
  m.impl("hold_tensors", TORCH_BOX(&fastamp::hold_tensors));
  m.impl("release_tensors", TORCH_BOX(&fastamp::release_tensors));
  m.impl("held_moved", TORCH_BOX(&fastamp::held_moved));
}
#endif
