// The helpers of torch_api.h, on the stable ABI's C shim.
#include "common/torch_api.h"

#include <algorithm>
#include <utility>

namespace fastamp {

std::string device_name(const Device& d) {
  std::string name;
  switch (d.type()) {
    case DeviceType::CPU:
      name = "cpu";
      break;
    case DeviceType::CUDA:
      name = "cuda";
      break;
    case DeviceType::Meta:
      name = "meta";
      break;
    default:
      name = "device type " + std::to_string(static_cast<int>(d.type()));
  }
  if (d.has_index()) name += ":" + std::to_string(static_cast<int>(d.index()));
  return name;
}

const char* layout_name(Layout l) {
  switch (l) {
    case Layout::Strided:
      return "Strided";
    case Layout::Sparse:
      return "Sparse";
    case Layout::SparseCsr:
      return "SparseCsr";
    case Layout::Mkldnn:
      return "Mkldnn";
    case Layout::SparseCsc:
      return "SparseCsc";
    case Layout::SparseBsr:
      return "SparseBsr";
    case Layout::SparseBsc:
      return "SparseBsc";
    case Layout::Jagged:
      return "Jagged";
    default:
      return "an unknown layout";
  }
}

Tensor empty(IntList sizes, ScalarType dtype, const Device& device) {
  return torch::stable::empty(sizes, dtype, kStrided, device);
}

Tensor zeros(IntList sizes, ScalarType dtype, const Device& device) {
  Tensor t = empty(sizes, dtype, device);
  torch::stable::zero_(t);
  return t;
}

Tensor full(IntList sizes, double value, ScalarType dtype, const Device& device) {
  Tensor t = empty(sizes, dtype, device);
  torch::stable::fill_(t, value);
  return t;
}

Tensor contiguous_copy(const Tensor& t) {
  return torch::stable::contiguous(t);
}

void copy_into(Tensor& dst, const Tensor& src) {
  torch::stable::copy_(dst, src);
}

Tensor to_device(const Tensor& t, const Device& device, bool non_blocking) {
  return torch::stable::to(t, device, non_blocking);
}

bool is_non_overlapping_and_dense(const Tensor& t) {
  const int64_t dim = t.dim();
  if (dim == 0 || t.numel() == 0) return true;
  const IntList sizes = t.sizes();
  const IntList strides = t.strides();
  // Contiguous in some order of the dims: walking the dims from the smallest stride, each stride
  // equals the number of elements below it (dims of size 1 may have any stride).
  std::vector<int64_t> order(static_cast<size_t>(dim));
  for (int64_t d = 0; d < dim; ++d) order[static_cast<size_t>(d)] = d;
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    if (sizes[a] < 2) return false;  // sizes 0 and 1 go last
    if (sizes[b] < 2) return true;
    return strides[a] < strides[b];
  });
  int64_t expected = 1;
  for (int64_t d : order) {
    if (sizes[d] == 1) continue;
    if (strides[d] != expected) return false;
    expected *= sizes[d];
  }
  return true;
}

const void* storage_base(const Tensor& t) {
  return static_cast<const char*>(t.data_ptr()) -
         t.storage_offset() * static_cast<int64_t>(t.element_size());
}

}  // namespace fastamp
