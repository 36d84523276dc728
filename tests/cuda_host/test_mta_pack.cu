// Host-only check of mta_pack: every chunk of the plan is emitted exactly once, in plan order,
// with the right tensor, start, len, index and chunk_id, and the tables respect their limits.
#include "common/multi_tensor_apply_cuda.cuh"
#include <cstdio>
#include <random>
using namespace fastamp;
static long g_launches = 0, g_chunks = 0;

template <int Depth>
int run(std::mt19937_64& rng, int ntens, int64_t maxn, bool big) {
  std::vector<FlatTensor> l[Depth];
  std::uniform_int_distribution<int64_t> dn(1, maxn);
  const c10::ScalarType types[4] = {kFloat, kHalf, kBFloat16, kDouble};
  int64_t idx = 0;
  for (int i = 0; i < ntens; ++i) {
    int64_t n = (rng() % 7 == 0) ? (rng() % 3) * kChunkElems + 1 : dn(rng);
    if (big && i == ntens / 2) n = (int64_t(1) << 33) + 5;
    idx += 1 + rng() % 3;  // simulated dropped empties
    for (int d = 0; d < Depth; ++d)
      l[d].push_back(FlatTensor{reinterpret_cast<void*>(uintptr_t(0x1000 * (i + 1) + d)), n,
                                types[(i + d) % 4], idx});
  }
  std::array<const std::vector<FlatTensor>*, Depth> lists;
  for (int d = 0; d < Depth; ++d) lists[d] = &l[d];
  auto chunks = plan_chunks(l[0]);
  size_t next = 0;
  int launches = 0, errors = 0;
  fastamp::detail::mta_pack<Depth>(lists, [&](const MtaMeta<Depth>& m, int nb) {
    ++launches;
    if (nb < 1 || nb > kMtaMaxBlocks) { printf("bad nb %d\n", nb); ++errors; }
    if (m.first_chunk != (int64_t)next) { printf("bad first_chunk\n"); ++errors; }
    int maxslot = -1;
    for (int b = 0; b < nb; ++b) {
      const int slot = m.block_slot[b];
      if (slot < maxslot || slot > maxslot + 1) { printf("non-monotone slot\n"); ++errors; }
      maxslot = slot > maxslot ? slot : maxslot;
      if (slot >= MtaMeta<Depth>::kMaxTensors) { printf("slot overflow\n"); ++errors; }
      // The kernel's own arithmetic (mta_block), not a recomputation: an int32 product or a
      // truncated length there fails here on the tensors past 2^31 and 2^33 elements.
      const auto blk = fastamp::detail::mta_block(m, b);
      const Chunk& ch = chunks.at(next);
      const FlatTensor& t = l[0][ch.item];
      bool ok = blk.start == ch.start && blk.len == ch.len && blk.index == t.index &&
                blk.chunk_id == (int64_t)next;
      for (int d = 0; d < Depth; ++d)
        ok = ok && blk.data[d] == l[d][ch.item].data && (uint8_t)blk.dtype[d] == (uint8_t)l[d][ch.item].dtype;
      if (!ok) { printf("mismatch at chunk %zu\n", next); ++errors; }
      ++next;
    }
  });
  g_launches += launches; g_chunks += (long)chunks.size();
  if (next != chunks.size()) { printf("covered %zu of %zu\n", next, chunks.size()); ++errors; }
  return errors;
}

int main() {
  std::mt19937_64 rng(1);
  int errors = 0;
  printf("kMaxTensors D1=%d D2=%d D4=%d sizeof meta1=%zu meta4=%zu\n", MtaMeta<1>::kMaxTensors,
         MtaMeta<2>::kMaxTensors, MtaMeta<4>::kMaxTensors, sizeof(MtaMeta<1>), sizeof(MtaMeta<4>));
  for (int it = 0; it < 300; ++it) {
    int nt = int(rng() % 400);
    int64_t maxn = it % 3 == 0 ? 1000 : (it % 3 == 1 ? 300000 : 5000000);
    errors += run<1>(rng, nt, maxn, false);
    errors += run<2>(rng, nt, maxn, false);
    errors += run<4>(rng, nt, maxn, false);
  }
  errors += run<1>(rng, 10, 1000, true);  // one tensor over 2^33 elements
  // empty list: no emit
  std::vector<FlatTensor> empty;
  int emits = 0;
  fastamp::detail::mta_pack<1>({&empty}, [&](const MtaMeta<1>&, int) { ++emits; });
  errors += emits;
  printf("launches=%ld chunks=%ld errors=%d\n", g_launches, g_chunks, errors);
  return errors != 0;
}
