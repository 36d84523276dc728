// Schemas of the checkpoint ops (each with what it reads and writes) and the digest's no-kernel
// fallback; the digest kernels are in
// checkpoint_cpu.cpp and checkpoint_cuda.cu.
#include "common/torch_api.h"

namespace fastamp {
namespace checkpoint {
namespace {

// tensor_digest([]) has no tensor to dispatch on: its digest list is empty. A non-empty call
// lands here only on a device with no fastamp kernel, which is refused by name.
Tensor tensor_digest_no_kernel(TensorList tensors) {
  // Sparse tensors dispatch here too (there is no Sparse* kernel): say so, not "no kernel".
  for (size_t i = 0; i < tensors.size(); ++i) {
    FASTAMP_CHECK(tensors[i].layout() == kStrided, "fastamp::tensor_digest: tensors[", i,
                  "] has layout ", tensors[i].layout(),
                  "; expected dense (strided) tensors: a digest covers a tensor's elements in "
                  "memory. Digest a sparse tensor's parts (t.coalesce()._indices() and "
                  "._values()) or t.to_dense()");
  }
  FASTAMP_CHECK(tensors.empty(), "fastamp::tensor_digest: no kernel for tensors on ",
                tensors[0].device(), " in this build");
  return empty({0}, kLong, Device(DeviceType::CPU));
}

}  // namespace
}  // namespace checkpoint
}  // namespace fastamp

STABLE_TORCH_LIBRARY_FRAGMENT(fastamp, m) {
  // (rng_get_state and rng_set_state, the checkpoint's RNG snapshot, are defined in
  // python/fastamp/checkpoint/_ops.py: generators are not part of the stable ABI.)

  // One 64-bit digest per tensor of its bytes in memory order (int64 [len(tensors)], on the
  // tensors' device): equal bytes give equal digests. Reads the tensors; writes nothing into them.
  m.def("tensor_digest(Tensor[] tensors) -> Tensor");
}

// The digest's entry here only answers calls no backend kernel takes (the empty list).
STABLE_TORCH_LIBRARY_IMPL(fastamp, CompositeExplicitAutograd, m) {
  m.impl("tensor_digest", TORCH_BOX(&fastamp::checkpoint::tensor_digest_no_kernel));
}
