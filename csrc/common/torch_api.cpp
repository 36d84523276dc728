// The helpers of torch_api.h, on the stable ABI's C shim.
#include "common/torch_api.h"

#include <torch/csrc/inductor/aoti_torch/c/shim.h>

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

namespace {

// The shim's codes of the dtypes, device types and layout the checks meet, read once: the stable
// headers' own conversion compares a code with each candidate through a call into torch.
struct ShimCodes {
  int32_t f32 = aoti_torch_dtype_float32(), f64 = aoti_torch_dtype_float64(),
          f16 = aoti_torch_dtype_float16(), bf16 = aoti_torch_dtype_bfloat16(),
          i64 = aoti_torch_dtype_int64(), i32 = aoti_torch_dtype_int32(),
          u8 = aoti_torch_dtype_uint8(), b8 = aoti_torch_dtype_bool();
  int32_t cpu = aoti_torch_device_type_cpu(), cuda = aoti_torch_device_type_cuda();
  int32_t strided = aoti_torch_layout_strided();
};

const ShimCodes& codes() {
  static const ShimCodes c;
  return c;
}

ScalarType dtype_of_code(int32_t code) {
  const ShimCodes& c = codes();
  if (code == c.f32) return ScalarType::Float;
  if (code == c.bf16) return ScalarType::BFloat16;
  if (code == c.f16) return ScalarType::Half;
  if (code == c.f64) return ScalarType::Double;
  if (code == c.i64) return ScalarType::Long;
  if (code == c.i32) return ScalarType::Int;
  if (code == c.u8) return ScalarType::Byte;
  if (code == c.b8) return ScalarType::Bool;
  return torch::stable::detail::to<ScalarType>(torch::stable::detail::from(code));
}

DeviceType device_type_of_code(int32_t code) {
  const ShimCodes& c = codes();
  if (code == c.cpu) return DeviceType::CPU;
  if (code == c.cuda) return DeviceType::CUDA;
  return torch::stable::detail::to<DeviceType>(torch::stable::detail::from(code));
}

Layout layout_of_code(int32_t code) {
  if (code == codes().strided) return Layout::Strided;
  return torch::stable::detail::to<Layout>(torch::stable::detail::from(code));
}

void shim(AOTITorchError err, const char* what) {
  FASTAMP_CHECK(err == AOTI_TORCH_SUCCESS, "fastamp: torch's C shim failed in ", what);
}

bool dense_layout(int64_t dim, const int64_t* sizes, const int64_t* strides);

}  // namespace

TensorMeta meta_of(const Tensor& t) {
  TensorMeta m;
  AtenTensorHandle h = t.get();
  shim(aoti_torch_is_defined(h, &m.defined), "is_defined");
  if (!m.defined) return m;
  int32_t dtype = 0, device_type = 0, device_index = 0, layout = 0;
  int64_t* sizes = nullptr;
  int64_t* strides = nullptr;
  shim(aoti_torch_get_layout(h, &layout), "get_layout");
  m.layout = layout_of_code(layout);
  shim(aoti_torch_get_dtype(h, &dtype), "get_dtype");
  shim(aoti_torch_get_device_type(h, &device_type), "get_device_type");
  shim(aoti_torch_get_device_index(h, &device_index), "get_device_index");
  shim(aoti_torch_get_numel(h, &m.numel), "get_numel");
  shim(aoti_torch_get_dim(h, &m.dim), "get_dim");
  m.dtype = dtype_of_code(dtype);
  m.device_type = device_type_of_code(device_type);
  m.device_index = static_cast<int8_t>(device_index);
  shim(aoti_torch_get_sizes(h, &sizes), "get_sizes");
  m.size_data = sizes;
  if (m.layout != Layout::Strided) return m;  // no strides or storage to read
  shim(aoti_torch_get_strides(h, &strides), "get_strides");
  shim(aoti_torch_get_storage_offset(h, &m.storage_offset), "get_storage_offset");
  shim(aoti_torch_get_data_ptr(h, &m.data), "get_data_ptr");
  m.stride_data = strides;
  return m;
}

void* strided_data_ptr(const Tensor& t) {
  AtenTensorHandle h = t.get();
  bool defined = false;
  shim(aoti_torch_is_defined(h, &defined), "is_defined");
  if (!defined) return nullptr;
  int32_t layout = 0;
  shim(aoti_torch_get_layout(h, &layout), "get_layout");
  if (layout_of_code(layout) != Layout::Strided) return nullptr;
  void* data = nullptr;
  shim(aoti_torch_get_data_ptr(h, &data), "get_data_ptr");
  return data;
}

bool meta_still(const Tensor& t, TensorMeta& m, const std::vector<int64_t>& sizes,
                const std::vector<int64_t>& strides) {
  if (!m.defined || m.layout != Layout::Strided) return false;  // read those in full
  AtenTensorHandle h = t.get();
  void* data = nullptr;
  int64_t dim = 0, offset = 0;
  int32_t dtype = 0, device_type = 0, device_index = 0;
  shim(aoti_torch_get_data_ptr(h, &data), "get_data_ptr");
  shim(aoti_torch_get_dim(h, &dim), "get_dim");
  shim(aoti_torch_get_storage_offset(h, &offset), "get_storage_offset");
  shim(aoti_torch_get_dtype(h, &dtype), "get_dtype");
  shim(aoti_torch_get_device_type(h, &device_type), "get_device_type");
  shim(aoti_torch_get_device_index(h, &device_index), "get_device_index");
  if (data != m.data || dim != m.dim || offset != m.storage_offset ||
      dtype_of_code(dtype) != m.dtype || device_type_of_code(device_type) != m.device_type ||
      static_cast<int8_t>(device_index) != m.device_index) {
    return false;
  }
  int64_t* size_data = nullptr;
  int64_t* stride_data = nullptr;
  shim(aoti_torch_get_sizes(h, &size_data), "get_sizes");
  shim(aoti_torch_get_strides(h, &stride_data), "get_strides");
  const auto n = static_cast<size_t>(dim);
  if (sizes.size() != n || strides.size() != n ||
      !std::equal(sizes.begin(), sizes.end(), size_data) ||
      !std::equal(strides.begin(), strides.end(), stride_data)) {
    return false;
  }
  m.size_data = size_data;
  m.stride_data = stride_data;
  return true;
}

bool TensorMeta::dense() const {
  if (numel == 0 || dim == 0) return true;
  return stride_data != nullptr && dense_layout(dim, size_data, stride_data);
}

bool TensorMeta::contiguous() const {
  if (numel == 0 || dim == 0) return true;
  if (stride_data == nullptr) return false;
  int64_t expected = 1;
  for (int64_t d = dim - 1; d >= 0; --d) {
    if (size_data[d] == 1) continue;
    if (stride_data[d] != expected) return false;
    expected *= size_data[d];
  }
  return true;
}

namespace {

bool dense_layout(int64_t dim, const int64_t* sizes, const int64_t* strides) {
  // Row-major contiguous, the common case, without sorting.
  int64_t expected = 1;
  bool contiguous = true;
  for (int64_t d = dim - 1; d >= 0 && contiguous; --d) {
    if (sizes[d] == 1) continue;
    contiguous = strides[d] == expected;
    expected *= sizes[d];
  }
  if (contiguous) return true;
  // Contiguous in some other order of the dims: walking the dims from the smallest stride, each
  // stride equals the number of elements below it (dims of size 1 may have any stride).
  std::vector<int64_t> order(static_cast<size_t>(dim));
  for (int64_t d = 0; d < dim; ++d) order[static_cast<size_t>(d)] = d;
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    if (sizes[a] < 2) return false;  // sizes 0 and 1 go last
    if (sizes[b] < 2) return true;
    return strides[a] < strides[b];
  });
  expected = 1;
  for (int64_t d : order) {
    if (sizes[d] == 1) continue;
    if (strides[d] != expected) return false;
    expected *= sizes[d];
  }
  return true;
}

}  // namespace

const void* storage_base(const TensorMeta& m) {
  return static_cast<const char*>(m.data) - m.storage_offset * m.element_size();
}

}  // namespace fastamp
