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

#include "common/tensor_list.h"
#include "common/torch_api.h"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace fastamp {

/// The lists of one handle, in the order they were held, and what the last call read of them.
///
/// A held tensor is checked again at every call, but through a cache: `read(list)` re-reads 8 of
/// each tensor's 12 properties (meta_still) and compares them with what the last call read,
/// instead of reading all 12 (meta_of). `unchanged()` says whether every held tensor read in this
/// call is as it was in a call whose checks all passed (`mark_checked()`): what depends only on
/// the held tensors together (that no two written tensors share memory) need not be decided again.
/// A call holds `guard()` from before its first read to after its last use of the cache.
class HeldLists {
 public:
  HeldLists(std::vector<Tensor> tensors, std::vector<size_t> offsets, std::vector<void*> addresses)
      : tensors_(std::move(tensors)),
        offsets_(std::move(offsets)),
        addresses_(std::move(addresses)),
        metas_(tensors_.size()),
        sizes_(tensors_.size()),
        strides_(tensors_.size()),
        known_(tensors_.size(), false) {}

  size_t size() const { return offsets_.size() - 1; }
  /// List `k` (a view valid while this object lives).
  TensorList list(size_t k) const {
    return TensorList(tensors_.data() + offsets_[k], offsets_[k + 1] - offsets_[k]);
  }

  /// The position (over all lists, in order) of the first tensor whose data pointer is not the
  /// one it had when held, or -1: one C call per tensor, no Python per tensor.
  int64_t first_moved() const;

  /// Locks the cache for one call (calls on one handle from two threads take turns).
  std::unique_lock<std::mutex> guard() const;
  /// MetaList::read(list) for a list of this handle (one of list(k)), through the cache; any other
  /// list is read in full.
  MetaList read(TensorList list) const;
  /// Every held tensor read since guard() as it was when the checks last passed.
  bool unchanged() const { return checked_ && same_; }
  /// The checks of this call passed over what it read.
  void mark_checked() const { checked_ = true; }

 private:
  std::vector<Tensor> tensors_;
  std::vector<size_t> offsets_;   ///< size() + 1 entries: list k is [offsets_[k], offsets_[k+1])
  std::vector<void*> addresses_;  ///< each tensor's data pointer when held (null: none readable)
  mutable std::mutex mutex_;
  mutable std::vector<TensorMeta> metas_;  ///< per tensor: what the last read found
  mutable std::vector<std::vector<int64_t>> sizes_, strides_;  ///< copies of its sizes, strides
  mutable std::vector<bool> known_;                            ///< metas_[i] read at least once
  mutable bool checked_ = false;  ///< the cached metas passed every check of a call (reset
                                  ///< whenever a read finds a tensor changed)
  mutable bool same_ = true;      ///< no tensor read since guard() changed
};

/// Holds `tensors` as lists of `lengths` (which must add up to tensors.size()); returns the handle.
int64_t hold_tensors(TensorList tensors, IntList lengths);

/// Drops the references of `handle` (an unknown handle is refused by name).
void release_tensors(int64_t handle);

/// HeldLists::first_moved() of `handle`: whether a held tensor was re-pointed (`p.data = ...`,
/// set_, a resize that reallocated) since it was held.
int64_t held_moved(int64_t handle);

/// The lists of `handle`, which must have `expected` lists (any number with `any_count`); shared,
/// so a release during the call cannot free them under it. `op` names the caller in errors.
std::shared_ptr<const HeldLists> held_lists(int64_t handle, size_t expected, const char* op,
                                            bool any_count = false);

}  // namespace fastamp
