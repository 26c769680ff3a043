// Timing probe of the swap-in kernel: a benchmark aid (scripts/bench_kernels.py
// --breakdown), compiled in only by the variant built with kProbe = true. The
// serving variant instantiates PhaseProbe<false>, whose calls are empty, so it
// holds no stamping code at all.
//
// Block (0, 0)'s thread 0 stamps %globaltimer at each phase boundary, and
// every block folds its entry and exit time into a grid-wide min / max.
// sglang_hisparse/kernels/bench.py mirrors the slots (PROBE_*).
#pragma once

#include <sgl_kernel/utils.cuh>

namespace hisparse_plugin {

// Slots of the probe buffer (int64 [kSlots]), in ns:
struct Probe {
  enum : int {
    kEntry = 0,      // block (0, 0) starts
    kHashReady = 1,  // top-k entries read, hash table cleared
    kHashed = 2,     // candidates inserted
    kOwners = 3,     // slot -> owning entry resolved
    kClaimed = 4,    // hits claimed, evictable counts known
    kMissKnown = 5,  // misses known, first host read issued
    kRanked = 6,     // scans done
    kPlaced = 7,     // LRU regrouped, misses numbered
    kPublished = 8,  // thread 0's outputs written
    kCopied = 9,     // this block's copies issued and joined
    kExit = 10,      // state committed (or not the last block)
    kEarlyExit = 11, // padding / resident / short-sequence path
    kGridEntry = 14, // min over blocks (initialise to UINT64_MAX)
    kGridExit = 15,  // max over blocks (initialise to 0)
    kSlots = 16,
  };
};

SGL_DEVICE unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

template <bool kEnabled>
struct PhaseProbe;

// Serving: no probe.
template <>
struct PhaseProbe<false> {
  SGL_DEVICE PhaseProbe(unsigned long long*, int) {}
  SGL_DEVICE void mark(int) const {}
  SGL_DEVICE void grid_entry() const {}
  SGL_DEVICE void grid_exit() const {}
};

template <>
struct PhaseProbe<true> {
  unsigned long long* slots;
  bool stamping;     // one stamping thread per block
  bool first_block;  // block (0, 0)'s stamping thread

  SGL_DEVICE PhaseProbe(unsigned long long* probe, int tid)
      : slots(probe), stamping(tid == 0), first_block(tid == 0 && blockIdx.x == 0 && blockIdx.y == 0) {}

  SGL_DEVICE void mark(int slot) const {
    if (first_block) slots[slot] = global_ns();
  }
  SGL_DEVICE void grid_entry() const {
    if (stamping) atomicMin(slots + Probe::kGridEntry, global_ns());
  }
  SGL_DEVICE void grid_exit() const {
    if (stamping) atomicMax(slots + Probe::kGridExit, global_ns());
  }
};

}  // namespace hisparse_plugin
