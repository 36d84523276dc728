// Control ops of the CUDA emulator library (namespace fastamp_emu): the launch order and the
// launch statistics the tests read. The emulated fastamp kernels register themselves (through
// FASTAMP_CUDA_KERNELS in each .cu file) as CPU kernels of fastamp_emu::<op>.
#include <torch/library.h>

#include "emu/runtime.h"

#include <string>
#include <tuple>

namespace fastamp {
namespace emu {
namespace {

void set_order_op(const std::string& order, int64_t seed) {
  Order o;
  if (order == "ascending") {
    o = Order::kAscending;
  } else if (order == "descending") {
    o = Order::kDescending;
  } else if (order == "random") {
    o = Order::kRandom;
  } else {
    TORCH_CHECK_VALUE(false, "fastamp_emu::set_order: order is '", order,
                      "'; expected 'ascending', 'descending' or 'random'");
  }
  set_order(o, static_cast<uint64_t>(seed));
}

std::tuple<int64_t, int64_t, int64_t, int64_t> stats_op() {
  const Stats s = stats();
  return {s.launches, s.blocks, s.threads, s.switches};
}

std::tuple<int64_t, int64_t, int64_t, int64_t> vector_traffic_op() {
  const VectorTraffic v = vector_traffic();
  return {v.loads, v.stores, v.load_bytes, v.store_bytes};
}

void set_traffic_trace_op(bool on) {
  set_traffic_trace(on);
}

/// The traced launches: their kernel names, and per launch ten counts, loads then stores, each
/// (requests, bytes, sectors, ideal sectors, unique sectors).
std::tuple<std::vector<std::string>, std::vector<int64_t>> traffic_op() {
  std::vector<std::string> names;
  std::vector<int64_t> counts;
  for (const LaunchTraffic& l : traffic()) {
    names.push_back(l.kernel);
    for (const AccessCounts* c : {&l.load, &l.store}) {
      counts.insert(counts.end(),
                    {c->requests, c->bytes, c->sectors, c->ideal_sectors, c->unique_sectors});
    }
  }
  return {names, counts};
}

std::vector<std::string> launched_kernels_op() {
  return launched_kernels();
}

}  // namespace
}  // namespace emu
}  // namespace fastamp

TORCH_LIBRARY_FRAGMENT(fastamp_emu, m) {
  // Sets the order in which every later launch starts its blocks and its threads.
  m.def("set_order(str order, int seed=0) -> ()", &fastamp::emu::set_order_op);
  // (launches, blocks, threads, fiber switches) since the last reset_stats().
  m.def("stats() -> (int, int, int, int)", &fastamp::emu::stats_op);
  m.def("reset_stats() -> ()", &fastamp::emu::reset_stats);
  // (vector loads, vector stores, bytes loaded, bytes stored) since the last reset_stats().
  m.def("vector_traffic() -> (int, int, int, int)", &fastamp::emu::vector_traffic_op);
  // Global-memory traffic tracing for later launches (emu/traffic.h), and its per-launch counts
  // since the last reset_stats().
  m.def("set_traffic_trace(bool on) -> ()", &fastamp::emu::set_traffic_trace_op);
  m.def("traffic_instrumented() -> bool", &fastamp::emu::traffic_instrumented);
  m.def("traffic() -> (str[], int[])", &fastamp::emu::traffic_op);
  // The sectors (address / 32) the traced launches loaded, or stored, since reset_stats().
  m.def("traffic_footprint(bool store) -> int[]", &fastamp::emu::footprint);
  // Names of every kernel launched since the library was loaded (for the coverage test).
  m.def("launched_kernels() -> str[]", &fastamp::emu::launched_kernels_op);
}
