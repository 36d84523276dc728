/// @file torch_api.h
/// The one place the op layer meets torch: the LibTorch stable ABI (torch/csrc/stable,
/// torch/headeronly) and the few helpers fastamp builds on it. Nothing in csrc includes ATen or
/// c10's compiled parts, so the library calls into torch only through its stable C shim and one
/// binary loads on every torch from FASTAMP_TORCH_TARGET (set by CMakeLists.txt) up.
///
/// Errors: the stable ABI carries a C++ exception across as a RuntimeError, whatever its type
/// (and torch versions disagree on std::invalid_argument). A refusal that must reach Python as
/// TypeError, ValueError or NotImplementedError therefore starts its message with that class name
/// and a colon (FASTAMP_CHECK_TYPE / _VALUE / _NOT_IMPLEMENTED), and fastamp's Python op wrappers
/// (fastamp/_library.py: StableOps) raise that class with the rest of the message.
#pragma once

#include <torch/csrc/stable/device.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/DeviceType.h>
#include <torch/headeronly/core/Layout.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>
#include <torch/headeronly/util/HeaderOnlyArrayRef.h>

#include <cstdint>
#include <optional>
#include <ostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace fastamp {

using Tensor = torch::stable::Tensor;
/// A non-owning view of tensors (the op functions own them as a std::vector<Tensor>).
using TensorList = torch::headeronly::HeaderOnlyArrayRef<Tensor>;
using IntList = torch::headeronly::HeaderOnlyArrayRef<int64_t>;
using OptTensor = std::optional<Tensor>;
using ScalarType = c10::ScalarType;
using Device = torch::stable::Device;
using DeviceType = c10::DeviceType;
using Layout = c10::Layout;

constexpr ScalarType kFloat = ScalarType::Float;
constexpr ScalarType kDouble = ScalarType::Double;
constexpr ScalarType kHalf = ScalarType::Half;
constexpr ScalarType kBFloat16 = ScalarType::BFloat16;
constexpr ScalarType kLong = ScalarType::Long;
constexpr ScalarType kInt = ScalarType::Int;
constexpr ScalarType kByte = ScalarType::Byte;
constexpr ScalarType kBool = ScalarType::Bool;
constexpr Layout kStrided = Layout::Strided;

/// Bytes per element of the dtypes the op layer handles (0 for any other).
inline int64_t element_size(ScalarType t) {
  switch (t) {
    case ScalarType::Double:
    case ScalarType::Long:
      return 8;
    case ScalarType::Float:
    case ScalarType::Int:
      return 4;
    case ScalarType::Half:
    case ScalarType::BFloat16:
      return 2;
    case ScalarType::Byte:
    case ScalarType::Bool:
      return 1;
    default:
      return 0;
  }
}

/// "cpu", "cuda:0", ...: as torch prints a device.
std::string device_name(const Device& d);
/// "Strided", "Sparse", ...: as c10 prints a layout.
const char* layout_name(Layout l);

inline std::ostream& operator<<(std::ostream& os, const Device& d) {
  return os << device_name(d);
}
inline std::ostream& operator<<(std::ostream& os, Layout l) {
  return os << layout_name(l);
}
inline std::ostream& operator<<(std::ostream& os, IntList v) {
  os << "[";
  for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
  return os << "]";
}

namespace detail {
template <typename... A>
std::string concat(const A&... a) {
  std::ostringstream os;
  (void)(os << ... << a);
  return os.str();
}
}  // namespace detail

// RuntimeError; TypeError / ValueError / NotImplementedError through the Python wrappers (above).
#define FASTAMP_THROW_IF(cond, prefix, ...)                                                  \
  do {                                                                                       \
    if (!(cond)) throw std::runtime_error(::fastamp::detail::concat(prefix, ##__VA_ARGS__)); \
  } while (0)
#define FASTAMP_CHECK(cond, ...) FASTAMP_THROW_IF(cond, "", ##__VA_ARGS__)
#define FASTAMP_CHECK_TYPE(cond, ...) FASTAMP_THROW_IF(cond, "TypeError: ", ##__VA_ARGS__)
#define FASTAMP_CHECK_VALUE(cond, ...) FASTAMP_THROW_IF(cond, "ValueError: ", ##__VA_ARGS__)
#define FASTAMP_CHECK_NOT_IMPLEMENTED(cond, ...) \
  FASTAMP_THROW_IF(cond, "NotImplementedError: ", ##__VA_ARGS__)
/// An internal invariant (a bug in fastamp, not in the caller's arguments).
#define FASTAMP_ASSERT(cond, ...) \
  FASTAMP_THROW_IF(cond, "fastamp internal error (please report): " #cond " ", ##__VA_ARGS__)

// --- tensor helpers, on the stable ABI ------------------------------------------------------

/// A new tensor of `sizes` on `device`: uninitialised, zero-filled or filled with `value`.
Tensor empty(IntList sizes, ScalarType dtype, const Device& device);
Tensor zeros(IntList sizes, ScalarType dtype, const Device& device);
Tensor full(IntList sizes, double value, ScalarType dtype, const Device& device);
/// A contiguous copy of `t` (on its device).
Tensor contiguous_copy(const Tensor& t);
/// dst.copy_(src).
void copy_into(Tensor& dst, const Tensor& src);
/// `t` on `device` (a copy when it is elsewhere), waiting for the copy when `blocking`.
Tensor to_device(const Tensor& t, const Device& device, bool non_blocking);

/// What the checks read of one tensor, fetched from torch's C shim once. Each property of a
/// stable-ABI Tensor is a call into torch (its dtype, device type and layout one more call per
/// candidate value), and the checks of a step over thousands of parameters read each property
/// several times: they read this instead. `size_data`/`stride_data` point into the tensor and stay
/// valid while it lives; `data`, `storage_offset` and `stride_data` are read for strided tensors
/// only.
struct TensorMeta {
  bool defined = false;
  void* data = nullptr;
  int64_t numel = 0;
  int64_t dim = 0;
  int64_t storage_offset = 0;
  const int64_t* size_data = nullptr;
  const int64_t* stride_data = nullptr;
  ScalarType dtype = ScalarType::Undefined;
  Layout layout = Layout::Strided;
  DeviceType device_type = DeviceType::CPU;
  int8_t device_index = -1;

  /// Empty for an undefined tensor; strides() also for a non-strided (sparse) one.
  IntList sizes() const {
    return size_data ? IntList(size_data, static_cast<size_t>(dim)) : IntList();
  }
  IntList strides() const {
    return stride_data ? IntList(stride_data, static_cast<size_t>(dim)) : IntList();
  }
  Device device() const { return Device(device_type, device_index); }
  bool on(const Device& d) const { return device_type == d.type() && device_index == d.index(); }
  int64_t element_size() const { return ::fastamp::element_size(dtype); }
  /// c10's is_non_overlapping_and_dense, from sizes and strides.
  bool dense() const;
  /// c10's is_contiguous() (row-major; dims of size 1 may have any stride).
  bool contiguous() const;
};

/// `t`'s TensorMeta (only `defined` is set for an undefined tensor).
TensorMeta meta_of(const Tensor& t);

/// `t`'s data pointer, or null for an undefined or non-strided tensor (3 calls into torch).
void* strided_data_ptr(const Tensor& t);

/// Whether `t` still has the TensorMeta `m` that meta_of(t) gave earlier (`sizes`/`strides`: copies
/// of its values then), reading 8 of meta_of's 12 properties: what set_data (`p.data = ...`),
/// resize_ or set_ may change on a tensor whose layout they cannot change. When it does, `m`'s
/// size and stride pointers are updated to the tensor's (their values are the same).
bool meta_still(const Tensor& t, TensorMeta& m, const std::vector<int64_t>& sizes,
                const std::vector<int64_t>& strides);

/// The start of `t`'s storage (data_ptr less the storage offset): equal for two views of one
/// storage.
const void* storage_base(const TensorMeta& m);

/// Runs f(begin, end) over [0, n) on torch's intra-op thread pool, `grain` items at least per
/// call.
template <typename F>
void parallel_for(int64_t n, int64_t grain, const F& f) {
  torch::stable::parallel_for(0, n, grain, f);
}

}  // namespace fastamp
