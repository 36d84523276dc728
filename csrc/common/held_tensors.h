/// @file held_tensors.h
/// Tensor lists held by the library between calls, so that a step plan boxes only what changes
/// every step (its grads) and not the params and state it reads and writes (see
/// python/fastamp/optim/_plan.py).
///
/// `fastamp::hold_tensors(tensors, lengths)` keeps references to `tensors` cut into lists of
/// `lengths` and returns a handle; the `*_held_` step ops take the handle in place of those lists;
/// `fastamp::release_tensors(handle)` drops the references. A held tensor is the caller's own
/// tensor (not a copy): `p.data = ...` on a held param is seen by the next call, which checks
/// every held tensor again as the list-taking op would.
#pragma once

#include "common/torch_api.h"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace fastamp {

/// The lists of one handle, in the order they were held.
class HeldLists {
 public:
  HeldLists(std::vector<Tensor> tensors, std::vector<size_t> offsets)
      : tensors_(std::move(tensors)), offsets_(std::move(offsets)) {}

  size_t size() const { return offsets_.size() - 1; }
  /// List `k` (a view valid while this object lives).
  TensorList list(size_t k) const {
    return TensorList(tensors_.data() + offsets_[k], offsets_[k + 1] - offsets_[k]);
  }

 private:
  std::vector<Tensor> tensors_;
  std::vector<size_t> offsets_;  ///< size() + 1 entries: list k is [offsets_[k], offsets_[k+1])
};

/// Holds `tensors` as lists of `lengths` (which must add up to tensors.size()); returns the handle.
int64_t hold_tensors(TensorList tensors, IntList lengths);

/// Drops the references of `handle` (an unknown handle is refused by name).
void release_tensors(int64_t handle);

/// The lists of `handle`, which must have `expected` lists; shared, so a release during the call
/// cannot free them under it. `op` names the caller in errors.
std::shared_ptr<const HeldLists> held_lists(int64_t handle, size_t expected, const char* op);

}  // namespace fastamp
