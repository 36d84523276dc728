// Schemas of the checkpoint ops (each with what it reads and writes) and the digest's no-kernel
// fallback; the RNG snapshot/restore is in checkpoint_rng.cpp, the digest kernels in
// checkpoint_cpu.cpp and checkpoint_cuda.cu.
#include <torch/library.h>

#include <ATen/ATen.h>

namespace fastamp {
namespace checkpoint {
namespace {

// tensor_digest([]) has no tensor to dispatch on: its digest list is empty. A non-empty call
// lands here only on a device with no fastamp kernel, which is refused by name.
at::Tensor tensor_digest_no_kernel(at::TensorList tensors) {
  // Sparse tensors dispatch here too (there is no Sparse* kernel): say so, not "no kernel".
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK(tensors[i].layout() == at::kStrided, "fastamp::tensor_digest: tensors[", i,
                "] has layout ", tensors[i].layout(),
                "; expected dense (strided) tensors: a digest covers a tensor's elements in "
                "memory. Digest a sparse tensor's parts (t.coalesce()._indices() and "
                "._values()) or t.to_dense()");
  }
  TORCH_CHECK(tensors.empty(), "fastamp::tensor_digest: no kernel for tensors on ",
              tensors[0].device(), " in this build");
  return at::empty({0}, at::kLong);
}

}  // namespace
}  // namespace checkpoint
}  // namespace fastamp

TORCH_LIBRARY_FRAGMENT(fastamp, m) {
  m.set_python_module("fastamp.checkpoint._ops");

  // Snapshot of the default CPU generator and of every *initialised* CUDA device's default
  // generator, in one call: [cpu_state, cuda:0 state, cuda:1 state, ...] as CPU uint8 tensors; a
  // device never initialised gets an empty tensor. Reads global RNG state; writes nothing.
  m.def("rng_get_state() -> Tensor[]");

  // Restores a snapshot taken by rng_get_state (empty entries are skipped). Validates every entry
  // before restoring any generator, and leaves every generator as it was if one rejects its
  // state. Writes global RNG state only.
  m.def("rng_set_state(Tensor[] states) -> ()");

  // One 64-bit digest per tensor of its bytes in memory order (int64 [len(tensors)], on the
  // tensors' device): equal bytes give equal digests. Reads the tensors; writes nothing into them.
  m.def("tensor_digest(Tensor[] tensors) -> Tensor");
}

// The digest's entry here only answers calls no backend kernel takes (the empty list).
TORCH_LIBRARY_IMPL(fastamp, CompositeExplicitAutograd, m) {
  m.impl("tensor_digest", &fastamp::checkpoint::tensor_digest_no_kernel);
}
