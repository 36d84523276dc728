// CPU kernel of the tensor digest.
#include "common/torch_api.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "checkpoint/digest_checks.h"
#include "checkpoint/digest_cpu_kernels.h"
#include "checkpoint/digest_math.h"
#include "common/cpu_capability.h"

namespace fastamp {
namespace checkpoint {
namespace {

uint64_t digest_bytes(const uint8_t* p, int64_t nbytes) {
  const int64_t nwords = (nbytes + 7) / 8;
  // Sums of per-range partials: addition mod 2^64 is exact and commutes, so the thread count
  // cannot change the result.
  const int64_t grain = 1 << 16;
  std::vector<uint64_t> sums(static_cast<size_t>((nwords + grain - 1) / grain), 0);
  const int64_t whole = nbytes / 8;  // words read with a fixed 8-byte load; a last partial one
#if defined(__x86_64__) || defined(_M_X64)
  auto words = cpu_use_avx512() ? &digest_words_avx512
               : cpu_use_avx2() ? &digest_words_avx2
                                : &digest_words_default;
#else
  auto words = &digest_words_default;
#endif
  parallel_for(static_cast<int64_t>(sums.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c) {
      const int64_t end = std::min(nwords, (c + 1) * grain);
      uint64_t s = words(p, c * grain, std::min(end, whole));
      if (end > whole) {  // the zero-padded last word
        uint64_t w = 0;
        std::memcpy(&w, p + whole * 8, static_cast<size_t>(nbytes - whole * 8));
        s += digest_term(w, static_cast<uint64_t>(whole));
      }
      sums[static_cast<size_t>(c)] = s;
    }
  });
  uint64_t total = 0;
  for (uint64_t s : sums) total += s;
  return digest_finish(total, static_cast<uint64_t>(nbytes));
}

Tensor tensor_digest_cpu(TensorList tensors) {
  const auto dense = check_digest(tensors, Device(DeviceType::CPU));
  Tensor out = empty({static_cast<int64_t>(tensors.size())}, kLong, Device(DeviceType::CPU));
  int64_t* o = out.mutable_data_ptr<int64_t>();
  for (size_t i = 0; i < dense.size(); ++i) {
    const uint64_t d =
        digest_bytes(static_cast<const uint8_t*>(dense[i].data_ptr()),
                     dense[i].numel() * static_cast<int64_t>(dense[i].element_size()));
    std::memcpy(&o[i], &d, sizeof(d));
  }
  return out;
}

}  // namespace
}  // namespace checkpoint
}  // namespace fastamp

STABLE_TORCH_LIBRARY_IMPL(fastamp, CPU, m) {
  m.impl("tensor_digest", TORCH_BOX(&fastamp::checkpoint::tensor_digest_cpu));
}
