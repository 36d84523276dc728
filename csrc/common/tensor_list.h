/// @file tensor_list.h
/// Validation and flattening of tensor-list arguments for multi-tensor kernels.
///
/// Every op validates *all* of its arguments through these helpers before it writes anything, so a
/// bad argument leaves parameters, grads and scaler state untouched.
#pragma once

#include "common/torch_api.h"

#include <cstdint>
#include <initializer_list>
#include <utility>
#include <vector>

namespace fastamp {

/// One tensor of a list as the kernels see it: a dense span of `numel` elements at `data`.
/// Elementwise kernels and order-independent reductions do not care about the logical layout, so
/// any non-overlapping dense tensor (contiguous, channels_last, transposed...) is used in place.
struct FlatTensor {
  void* data;
  int64_t numel;
  ScalarType dtype;
  int64_t index;  ///< position in the caller's list (for per-tensor outputs)
};

/// A validated tensor list. Empty tensors are dropped from items() but keep their index.
/// A tensor-list argument with each tensor's TensorMeta, read from torch once: the checks of an op
/// (its own, check_disjoint's, FlatTensorList's) all read the same MetaList.
struct MetaList {
  TensorList tensors;
  std::vector<TensorMeta> metas;

  static MetaList read(TensorList tensors);
  size_t size() const { return metas.size(); }
  const TensorMeta& operator[](size_t i) const { return metas[i]; }
};

/// Tensors with gaps in memory (e.g. a strided slice) are staged through a contiguous temporary;
/// for writable lists, write_back() copies the temporaries back into the caller's tensors.
class FlatTensorList {
 public:
  /// @param op        op name for error messages ("fastamp::grad_stats")
  /// @param arg       argument name for error messages ("grads")
  /// @param device    device every tensor must be on
  /// @param writable  the op writes into these tensors (a view whose own elements overlap is
  ///                  rejected; memory shared *between* written tensors is check_disjoint's job,
  ///                  which the op runs once over everything it writes)
  /// @param allowed   accepted dtypes
  static FlatTensorList prepare(const MetaList& tensors, const char* op, const char* arg,
                                const Device& device, bool writable,
                                std::initializer_list<ScalarType> allowed);
  static FlatTensorList prepare(TensorList tensors, const char* op, const char* arg,
                                const Device& device, bool writable,
                                std::initializer_list<ScalarType> allowed) {
    return prepare(MetaList::read(tensors), op, arg, device, writable, allowed);
  }

  const std::vector<FlatTensor>& items() const { return items_; }
  int64_t list_size() const { return list_size_; }
  void write_back();

 private:
  std::vector<FlatTensor> items_;
  std::vector<std::pair<Tensor, Tensor>> staged_;  // (caller's tensor, temporary)
  int64_t list_size_ = 0;
};

/// Refuses written tensors that share memory with each other, within one list or across the
/// given lists (e.g. `[a, a]`, two overlapping slices, a param passed again as its own exp_avg):
/// each element would be updated twice. Tensors that share a storage without sharing elements
/// (disjoint slices, interleaved strided views, DDP's bucket views) are accepted.
void check_disjoint(const char* op,
                    const std::vector<std::pair<const char*, const MetaList*>>& lists);

/// The first pair [i, j] (i <= j) of `tensors` that share an element of memory, [i, i] when a
/// tensor's own elements overlap (expand(), as_strided()), or [] when every element of every
/// tensor has its own memory. Reads only sizes, strides and addresses. For callers that must
/// refuse such tensors before anything is written (the optimizers check all param groups first).
std::vector<int64_t> find_shared_memory(TensorList tensors);

/// Checks a one-element float32 tensor argument that carries a per-step scalar on the device.
/// A wrong dtype or size is a TypeError / ValueError, or with `as_runtime_error` a RuntimeError
/// (what PyTorch's amp ops raise: the scaler and optimizer ops match them).
void check_scalar_tensor(const Tensor& t, const char* op, const char* arg, const Device& device,
                         ScalarType dtype, bool as_runtime_error = false);

}  // namespace fastamp
