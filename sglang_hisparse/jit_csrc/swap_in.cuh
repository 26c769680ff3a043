// HiSparse swap-in: one launch per sparse layer resolves each request's top-k
// positions against its GPU hot buffer, pulls the misses from pinned host
// memory into LRU victim slots, and publishes the device row of every
// selected token in top-k order.
//
// The exact semantics (including tie-breaking) are defined by
// sglang_hisparse/kernels/reference.py; this kernel must agree with it bit for
// bit. In short, for a request whose sequence no longer fits the buffer:
//   - a selected position held by LRU slot p is a hit (served in place);
//   - position seq_len-1 is always served from slot HOT (the newest-token page);
//   - the other distinct positions, in first-occurrence top-k order, are misses
//     and take the non-hit slots in LRU order (least recent first);
//   - new LRU = untouched non-hit slots (old order) + miss slots (assignment
//     order) + hit slots (old order).
// A request marked resident (its whole KV is on the device, see the
// coordinator) skips all of this: each position goes through the request's
// logical slot (req_to_token) to its device row (token_to_row).
//
// Speculative verify (kDraftTokens = n > 1): a request has n consecutive
// batch rows, one per verified token, and its block resolves their n * top_k
// entries as one union (entry j = row j / top_k, index j % top_k): a position
// several rows select is owned by its first occurrence, read from one slot,
// copied once, and no miss evicts a slot another row reads. The positions
// this step verifies (>= the committed length S = seq_lens[first row] - 1)
// sit at slot HOT + position - S. n = 1 is the decode step: the union is the
// row, and the n-only code (row lengths, verified slots) compiles away. (Its
// PTX is not byte-identical to the decode-only kernel's: it computes each
// entry's validity once, 7519 lines against 7559; re-time it on a GPU.)
//
// Work split. One block per request leaves a lone request with one block's
// warps of copies in flight: far too few rows to cover the latency of PCIe
// reads, so the link idles. Here a request gets `gridDim.x` blocks. Every
// block resolves the request on its own (the inputs are small and L2-resident,
// so the redundancy costs no latency) and therefore knows the whole plan
// without waiting for any other block. A miss is copied by the block chosen by
// where its top-k entry sits (lane + 32 * k, taken modulo the split), which
// spreads each block's share over all of its warps and lets a warp start
// reading its first row from host memory as soon as the misses are known,
// before the ranking that picks the destination. The hot buffer state may be
// rewritten only after every block has read it, so the last block to arrive
// at a per-row counter commits it (the counter wraps to zero by itself, which
// keeps graph replays consistent). No block ever waits for another, so the
// grid needs no co-residency guarantee.
//
// Latency of one call is roughly: two dependent global reads (request index,
// then the LRU row and the slot table, issued together), the shared-memory
// resolve, then for each miss its host row index and the host read, which
// overlap the ranking and the output writes. Loads issued early but consumed
// late are not free here: they hold the block's memory queue, and the
// shared-memory atomics of the resolve wait behind them (on an H200, reading
// every candidate's host row index up front cost 0.7-3 us at 0% miss).
//
// Starting host reads before the resolve does not pay either (tried on an
// H200). A shared-memory bitmap of the positions the slots hold
// proves most misses right after the inserts, so each warp could start its
// first host read ~4 us earlier at batch 1. Issued as register loads, those
// reads stalled the rest of the resolve until the link had drained them
// (~43 us at 100% miss). Issued as TMA bulk copies into per-warp shared
// stages, the resolve ran on, but its global reads still waited behind them.
// The net was at most ~1 us faster with misses and ~1 us slower at 0% miss
// (batch 8: 10.9 vs 9.6 us), so neither is used. What bounds the miss-heavy
// small-batch points is the gather itself: a copy-only replay of the same
// rows (bench_kernels.py, "gather") moves them at ~87% of the DMA ceiling.
//
// Template axes. kTopK, kHot, kItemBytes, kLayout, kThreads, kHashScale and
// kDraftTokens shape the serving kernel. kRecordPlan (write the miss plan that
// copy_planned.cuh replays), kSkipIO (resolve without moving bytes: the
// SGLANG_HISPARSE_SKIP_IO timing probe) and kProbe (phase stamps, probe.cuh)
// are separate variants, built only when asked for, so the serving variant
// carries none of their code.
#pragma once

#include <sgl_kernel/tensor.h>
#include <sgl_kernel/utils.cuh>
#include <sgl_kernel/utils.h>

#include <dlpack/dlpack.h>
#include <tvm/ffi/container/tensor.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "kv_rows.cuh"
#include "launch_args.cuh"
#include "probe.cuh"

namespace hisparse_plugin {

inline constexpr int32_t kEmptyKey = -1;
inline constexpr uint32_t kMissTag = 0x80000000u;

// Fibonacci hashing: positions selected by the indexer are often runs of
// neighbours, and the top bits of the product spread runs evenly.
template <int kBits>
SGL_DEVICE uint32_t hash_home(int32_t key) {
  return (static_cast<uint32_t>(key) * 2654435769u) >> (32 - kBits);
}

template <typename T>
SGL_DEVICE int64_t load_index(const void* p, int64_t i) {
  return static_cast<int64_t>(static_cast<const T*>(p)[i]);
}

struct SwapInParams {
  const int32_t* top_k_tokens;
  int32_t* out_locs;
  const void* req_pool_indices;
  const void* seq_lens;
  const int32_t* num_real_reqs;
  int32_t* slot_tokens;
  const int32_t* slot_locs;
  int16_t* lru;
  const int64_t* host_locs;
  const char* host_kv;
  char* device_kv;
  int64_t* miss_src;
  int32_t* miss_dst;
  int32_t* miss_count;
  uint32_t* arrivals;
  const int32_t* resident;      // per request slot, nullptr when residency is off
  const int32_t* req_to_token;  // [R, r2t_stride] logical slot of each position
  const int64_t* token_to_row;  // logical slot -> device row
  unsigned long long* tally;  // += {valid entries, misses} of real rows; nullptr: not counted
  unsigned long long* probe;  // phase timestamps (probe.cuh); read only by kProbe variants
  int64_t r2t_stride;
  int64_t top_k_stride;
  int64_t out_stride;
  int64_t slot_tokens_stride;
  int64_t slot_locs_stride;
  int64_t lru_stride;
  int64_t host_locs_stride;
  int64_t max_ctx;
  int64_t host_kv_stride;
  int64_t device_kv_stride;
  int64_t miss_src_stride;
  int64_t miss_dst_stride;
};

// kHashScale: hash buckets per top-k entry, rounded up to a power of two. The
// table's load factor sets the probe lengths of both the inserts and the slot
// lookups, which dominate the resolve: on an H200 (top_k 2048, buffer 4096) a
// 0%-miss call takes 12.3 / 9.1 / 8.7 us at batch 1 with 2 / 4 / 8 buckets per
// entry. (Packing key and owner into one 64-bit entry, or testing hits by LRU
// position through a dependent slot-table read, gained nothing on top.) The
// launcher picks the widest scale whose table fits shared memory.
// kEntries: a request's top-k entries (draft tokens x top_k in a verify step).
template <int kEntries, int kHot, int kHashScale>
struct SwapInSmem {
  static_assert(kHashScale >= 1 && kHashScale <= 16, "hash scale must be in [1, 16]");
  static constexpr int kHashBits = [] {
    int b = 1;
    while ((1 << b) < kHashScale * kEntries) ++b;
    return b;
  }();
  static constexpr int kHashSize = 1 << kHashBits;
  static constexpr int kBufChunks = (kHot + kWarp - 1) / kWarp;
  static constexpr int kTopKChunks = (kEntries + kWarp - 1) / kWarp;

  static constexpr size_t kKeys = 0;                                        // int32 [H]
  static constexpr size_t kVals = kKeys + sizeof(int32_t) * kHashSize;      // int32 [H]
  static constexpr size_t kResolved = kVals + sizeof(int32_t) * kHashSize;  // uint32 [K]
  static constexpr size_t kMissTok = kResolved + sizeof(uint32_t) * kEntries;  // int32 [K]
  static constexpr size_t kBufCnt = kMissTok + sizeof(int32_t) * kEntries;     // int32 [B / 32]
  static constexpr size_t kMissCnt = kBufCnt + sizeof(int32_t) * kBufChunks;      // int32 [K / 32]
  static constexpr size_t kScalars = kMissCnt + sizeof(int32_t) * kTopKChunks;    // int32 [4]
  // The slot owners are last read before the LRU is regrouped (a barrier
  // apart), so the regrouped LRU reuses their space.
  static constexpr size_t kSlotOwner = kScalars + sizeof(int32_t) * 4;            // int16 [B]
  static constexpr size_t kOrder = kSlotOwner;                                    // int16 [B]
  static constexpr size_t kBytes = kSlotOwner + sizeof(int16_t) * kHot;
  static_assert(kBytes <= 227 * 1024, "top_k / hot_buffer_size exceed a block's shared memory");
};

template <
    int kTopK,
    int kHot,
    int kItemBytes,
    int kLayout,
    bool kRecordPlan,
    bool kSkipIO,
    int kThreads,
    int kHashScale,
    bool kProbe,
    int kDraftTokens,
    typename SeqT,
    typename ReqT>
__global__ void __launch_bounds__(kThreads, 1) swap_in_kernel(const __grid_constant__ SwapInParams p) {
  // A request's entries: its rows' top-k, one union (see the header).
  constexpr int kEntries = kDraftTokens * kTopK;
  constexpr int kWarps = kThreads / kWarp;
  constexpr int kTopKPerThread = (kEntries + kThreads - 1) / kThreads;
  constexpr int kBufPerThread = (kHot + kThreads - 1) / kThreads;
  using Smem = SwapInSmem<kEntries, kHot, kHashScale>;
  using IO = RowIO<kLayout, kItemBytes>;
  static_assert(kDraftTokens >= 1 && kDraftTokens <= 8, "draft tokens must be in [1, 8]");
  static_assert(kTopK >= 1 && kEntries <= kHot, "draft_tokens x top_k must be in [1, hot_buffer_size]");
  static_assert(kHot <= 32767, "lru slots are int16");
  static_assert(kThreads % kWarp == 0 && kThreads >= 2 * kWarp && kThreads <= 1024, "bad block size");
  static_assert(kTopKPerThread <= 32 && kBufPerThread <= 32, "per-thread flags are kept in 32-bit masks");

  const int tid = threadIdx.x;
  // Benchmark-only phase stamps; empty calls unless kProbe (probe.cuh).
  const PhaseProbe<kProbe> probe(p.probe, tid);
  probe.mark(Probe::kEntry);
  probe.grid_entry();
  const int lane = tid % kWarp;
  const int warp = tid / kWarp;
  const uint32_t lanes_below = (1u << lane) - 1u;
  const int split = gridDim.x;
  const int part = blockIdx.x;
  const int64_t row = blockIdx.y;  // the request (its first batch row: row * kDraftTokens)
  const int64_t first_row = row * kDraftTokens;
  // Entry j's row in the request and its top-k index (j itself when n = 1).
  auto row_of = [](int j) { return kDraftTokens == 1 ? 0 : j / kTopK; };
  auto col_of = [](int j) { return kDraftTokens == 1 ? j : j % kTopK; };

  // Independent reads first: every later address depends on one of them, so
  // the chains of dependent loads start together. Entries are striped
  // (entry j = k * kThreads + tid); this block publishes the outputs of the
  // 32-entry chunks c with c % split == part, on every path.
  int32_t tok[kTopKPerThread];
#pragma unroll
  for (int k = 0; k < kTopKPerThread; ++k) {
    const int j = k * kThreads + tid;
    tok[k] = j < kEntries ? p.top_k_tokens[(first_row + row_of(j)) * p.top_k_stride + col_of(j)] : -1;
  }
  const int32_t num_real = p.num_real_reqs[0];
  const int64_t req = load_index<ReqT>(p.req_pool_indices, row);
  int64_t row_len[kDraftTokens];  // each row's length (the indexer's)
#pragma unroll
  for (int r = 0; r < kDraftTokens; ++r) row_len[r] = load_index<SeqT>(p.seq_lens, first_row + r);
  const int64_t seq_len = row_len[0];
  auto publishes = [&](int k) { return (k * kWarps + warp) % split == part && k * kThreads + tid < kEntries; };
  // Where entry k's output goes: its row, its top-k index.
  auto out_at = [&](int k) -> int32_t& {
    const int j = k * kThreads + tid;
    return p.out_locs[(first_row + row_of(j)) * p.out_stride + col_of(j)];
  };

  // CUDA-graph padding rows: invalid output, no state change.
  if (row >= num_real) {
#pragma unroll
    for (int k = 0; k < kTopKPerThread; ++k) {
      if (publishes(k)) out_at(k) = -1;
    }
    if constexpr (kRecordPlan) {
      if (part == 0 && tid == 0) p.miss_count[row] = 0;
    }
    probe.mark(Probe::kEarlyExit);
    probe.grid_exit();
    return;
  }

  // An entry is valid in [0, min(its row's length, max_ctx)).
  uint32_t valid_bits = 0;
#pragma unroll
  for (int k = 0; k < kTopKPerThread; ++k) {
    int64_t len = row_len[0];
    if constexpr (kDraftTokens > 1) {
      const int r_of = row_of(k * kThreads + tid);
#pragma unroll
      for (int r = 1; r < kDraftTokens; ++r) len = r_of == r ? row_len[r] : len;
    }
    const int64_t limit = len < p.max_ctx ? len : p.max_ctx;
    valid_bits |= uint32_t(tok[k] >= 0 && tok[k] < limit) << k;
  }
  const int32_t* slot_locs = p.slot_locs + req * p.slot_locs_stride;

  // Valid entries, for the hit/miss tally (block-uniform: p.tally and part are).
  if (p.tally != nullptr && part == 0) {
    int valid = 0;
#pragma unroll
    for (int k = 0; k < kTopKPerThread; ++k) valid += __syncthreads_count(valid_bits >> k & 1u);
    if (tid == 0 && valid > 0) atomicAdd(p.tally, static_cast<unsigned long long>(valid));
  }

  // Resident request: translate positions, nothing to resolve or copy.
  if (p.resident != nullptr && p.resident[req] != 0) {
    const int32_t* r2t = p.req_to_token + req * p.r2t_stride;
#pragma unroll
    for (int k = 0; k < kTopKPerThread; ++k) {
      if (publishes(k)) {
        const bool valid = valid_bits >> k & 1u;
        out_at(k) = valid ? static_cast<int32_t>(p.token_to_row[r2t[tok[k]]]) : -1;
      }
    }
    if constexpr (kRecordPlan) {
      if (part == 0 && tid == 0) p.miss_count[row] = 0;
    }
    probe.mark(Probe::kEarlyExit);
    probe.grid_exit();
    return;
  }

  // Short sequence (S = seq_len - 1 < HOT): every token sits at slot ==
  // position, the verified ones too. No IO, no LRU change.
  if (seq_len <= kHot) {
#pragma unroll
    for (int k = 0; k < kTopKPerThread; ++k) {
      if (publishes(k)) out_at(k) = (valid_bits >> k & 1u) ? slot_locs[tok[k]] : -1;
    }
    if constexpr (kRecordPlan) {
      if (part == 0 && tid == 0) p.miss_count[row] = 0;
    }
    probe.mark(Probe::kEarlyExit);
    probe.grid_exit();
    return;
  }

  extern __shared__ __align__(16) char smem[];
  int32_t* s_keys = reinterpret_cast<int32_t*>(smem + Smem::kKeys);
  int32_t* s_vals = reinterpret_cast<int32_t*>(smem + Smem::kVals);
  // Per owning top-k index: 0 = unresolved, (p + 1) << 16 | slot = hit at
  // LRU position p, kMissTag | m = miss number m.
  uint32_t* s_resolved = reinterpret_cast<uint32_t*>(smem + Smem::kResolved);
  int32_t* s_miss_tok = reinterpret_cast<int32_t*>(smem + Smem::kMissTok);
  int32_t* s_buf_cnt = reinterpret_cast<int32_t*>(smem + Smem::kBufCnt);
  int32_t* s_miss_cnt = reinterpret_cast<int32_t*>(smem + Smem::kMissCnt);
  int32_t* s_scalars = reinterpret_cast<int32_t*>(smem + Smem::kScalars);
  // Old LRU slots regrouped: [0, E) non-hits in LRU order, [E, HOT) hits in LRU order.
  int16_t* s_order = reinterpret_cast<int16_t*>(smem + Smem::kOrder);
  // Per slot: the top-k index owning the position it holds, or -1.
  int16_t* s_slot_owner = reinterpret_cast<int16_t*>(smem + Smem::kSlotOwner);
  int32_t& s_evictable = s_scalars[0];
  int32_t& s_misses = s_scalars[1];
  int32_t& s_newest_loc = s_scalars[2];
  int32_t& s_is_last = s_scalars[3];

  // The newest token (decode), or the first position this step verifies.
  const int32_t newest = static_cast<int32_t>(seq_len - 1);

  // ---- Phase A: every global read of the resolve is issued here. The LRU
  // row and the slot table are read independently (by position and by slot),
  // so a hit test waits for one memory round trip instead of two.
  int32_t slot[kBufPerThread];  // LRU position i * kThreads + tid -> slot
  int32_t held[kBufPerThread];  // slot i * kThreads + tid -> position it holds
  {
    const int16_t* lru_in = p.lru + req * p.lru_stride;
    const int32_t* slot_tokens_in = p.slot_tokens + req * p.slot_tokens_stride;
#pragma unroll
    for (int i = 0; i < kBufPerThread; ++i) {
      const int at = i * kThreads + tid;
      slot[i] = at < kHot ? static_cast<int32_t>(lru_in[at]) : 0;
      held[i] = at < kHot ? slot_tokens_in[at] : kEmptyKey;
    }
  }
  uint32_t cand_bits = 0;    // valid, not the newest token
  uint32_t newest_bits = 0;  // valid and the newest token (or a verified one: >= newest)
#pragma unroll
  for (int k = 0; k < kTopKPerThread; ++k) {
    const bool valid = valid_bits >> k & 1u;
    const bool is_newest = valid && (kDraftTokens == 1 ? tok[k] == newest : tok[k] >= newest);
    cand_bits |= uint32_t(valid && !is_newest) << k;
    newest_bits |= uint32_t(is_newest) << k;
  }
  if (tid == 0) s_newest_loc = slot_locs[kHot];

  for (int h = tid; h < Smem::kHashSize; h += kThreads) {
    s_keys[h] = kEmptyKey;
    s_vals[h] = INT32_MAX;
  }
  for (int j = tid; j < kEntries; j += kThreads) s_resolved[j] = 0;
  __syncthreads();
  probe.mark(Probe::kHashReady);

  // Hash every candidate; the value converges to the first top-k index that
  // names the position, which is the occurrence that owns it.
  int32_t home[kTopKPerThread];
#pragma unroll
  for (int k = 0; k < kTopKPerThread; ++k) {
    home[k] = -1;
    if (cand_bits >> k & 1u) {
      uint32_t h = hash_home<Smem::kHashBits>(tok[k]);
      while (true) {
        const int32_t prev = atomicCAS(&s_keys[h], kEmptyKey, tok[k]);
        if (prev == kEmptyKey || prev == tok[k]) break;
        h = (h + 1) & (Smem::kHashSize - 1);
      }
      atomicMin(&s_vals[h], k * kThreads + tid);
      home[k] = static_cast<int32_t>(h);
    }
  }
  __syncthreads();
  probe.mark(Probe::kHashed);

  // ---- Phase B1: which slots hold a selected position (by slot) ...
  int32_t owner[kTopKPerThread];  // owning top-k index of each candidate
#pragma unroll
  for (int k = 0; k < kTopKPerThread; ++k) owner[k] = home[k] >= 0 ? s_vals[home[k]] : -1;
#pragma unroll
  for (int i = 0; i < kBufPerThread; ++i) {
    const int s = i * kThreads + tid;
    if (s >= kHot) continue;
    int32_t found = -1;
    if (held[i] >= 0) {
      uint32_t h = hash_home<Smem::kHashBits>(held[i]);
      while (true) {
        const int32_t key = s_keys[h];
        if (key == held[i]) {
          found = s_vals[h];
          break;
        }
        if (key == kEmptyKey) break;
        h = (h + 1) & (Smem::kHashSize - 1);
      }
    }
    s_slot_owner[s] = static_cast<int16_t>(found);
  }
  __syncthreads();
  probe.mark(Probe::kOwners);

  // ... and, walking the LRU order, hits claim their top-k entry.
  uint32_t hit_bits = 0;
#pragma unroll
  for (int i = 0; i < kBufPerThread; ++i) {
    const int pos = i * kThreads + tid;
    const int32_t j = pos < kHot ? s_slot_owner[slot[i]] : -1;
    const bool hit = j >= 0;
    if (hit) {
      // If a position were ever held twice, the most recent copy serves it.
      atomicMax(&s_resolved[j], (uint32_t(pos + 1) << 16) | uint32_t(slot[i]));
    }
    hit_bits |= uint32_t(hit) << i;
    const uint32_t evict_mask = __ballot_sync(0xffffffffu, pos < kHot && !hit);
    const int chunk = i * kWarps + warp;
    if (lane == 0 && chunk < Smem::kBufChunks) s_buf_cnt[chunk] = __popc(evict_mask);
  }
  __syncthreads();
  probe.mark(Probe::kClaimed);

  // ---- Phase B2: owning candidates that no slot claimed are misses. Which
  // block copies a miss depends only on where its entry sits, so each warp
  // can start reading its first row from host memory right away, while the
  // ranking below (which decides the destination) is still running.
  uint32_t miss_bits = 0;
  uint32_t tasks[kTopKPerThread];  // per k: lanes whose miss this warp copies
  int64_t src_row[kTopKPerThread];  // host row of the lane's own copy
  const int64_t* host_locs = p.host_locs + req * p.host_locs_stride;
#pragma unroll
  for (int k = 0; k < kTopKPerThread; ++k) {
    const int j = k * kThreads + tid;
    const bool miss = (cand_bits >> k & 1u) && owner[k] == j && s_resolved[j] == 0;
    miss_bits |= uint32_t(miss) << k;
    const uint32_t mask = __ballot_sync(0xffffffffu, miss);
    const int chunk = k * kWarps + warp;
    if (lane == 0 && chunk < Smem::kTopKChunks) s_miss_cnt[chunk] = __popc(mask);
    tasks[k] = __ballot_sync(0xffffffffu, miss && (lane + kWarp * k) % split == part);
    // Host rows are looked up for this block's own copies only: reading them
    // for every candidate up front costs a scattered load per candidate in
    // every block, which queues ahead of the resolve's own memory traffic.
    src_row[k] = (tasks[k] >> lane & 1u) ? host_locs[tok[k]] : 0;
  }

  // First task of this warp (warp-uniform): read its row now.
  int first_k = -1;
  int first_lane = 0;
  int64_t first_src = 0;
#pragma unroll
  for (int k = 0; k < kTopKPerThread; ++k) {
    if (first_k < 0 && tasks[k] != 0) {
      first_k = k;
      first_lane = __ffs(tasks[k]) - 1;
      tasks[k] &= tasks[k] - 1;
      first_src = __shfl_sync(0xffffffffu, src_row[k], first_lane);
    }
  }
  typename IO::Staged staged;
  if constexpr (!kSkipIO) {
    if (first_k >= 0) IO::load(staged, p.host_kv, p.host_kv_stride, first_src, lane);
  }
  __syncthreads();
  probe.mark(Probe::kMissKnown);

  // ---- Phase B3: rank non-hit slots (LRU order) and misses (top-k order).
  if (warp == 0) {
    const int32_t total = warp_scan_exclusive(s_buf_cnt, Smem::kBufChunks, lane);
    if (lane == 0) s_evictable = total;
  } else if (warp == 1) {
    const int32_t total = warp_scan_exclusive(s_miss_cnt, Smem::kTopKChunks, lane);
    if (lane == 0) s_misses = total;
  }
  __syncthreads();
  probe.mark(Probe::kRanked);

  const int32_t evictable = s_evictable;
  // More misses than free slots only happens if the slot table holds a
  // position twice; the surplus misses resolve to -1 in that case.
  const int32_t misses = min(s_misses, evictable);

  // ---- Phase B4: place slots and misses at their ranks.
#pragma unroll
  for (int i = 0; i < kBufPerThread; ++i) {
    const int pos = i * kThreads + tid;
    const bool hit = hit_bits >> i & 1u;
    const uint32_t evict_mask = __ballot_sync(0xffffffffu, pos < kHot && !hit);
    if (pos < kHot) {
      const int32_t before = s_buf_cnt[i * kWarps + warp] + __popc(evict_mask & lanes_below);
      s_order[hit ? evictable + (pos - before) : before] = static_cast<int16_t>(slot[i]);
    }
  }
#pragma unroll
  for (int k = 0; k < kTopKPerThread; ++k) {
    const bool miss = miss_bits >> k & 1u;
    const uint32_t mask = __ballot_sync(0xffffffffu, miss);
    if (miss) {
      const int32_t m = s_miss_cnt[k * kWarps + warp] + __popc(mask & lanes_below);
      s_resolved[k * kThreads + tid] = kMissTag | uint32_t(m);
      if (m < misses) s_miss_tok[m] = tok[k];
    }
  }
  __syncthreads();
  probe.mark(Probe::kPlaced);

  // This block has consumed everything it reads from the slot table and LRU.
  if (tid == 0) {
    if (split > 1) {
      __threadfence();
      const uint32_t before = atomicInc(&p.arrivals[row], uint32_t(split - 1));
      s_is_last = before == uint32_t(split - 1);
      __threadfence();
    } else {
      s_is_last = 1;
    }
  }

  // ---- Phase C: finish the prefetched row, publishing this block's outputs
  // while its host read is still in flight; then the remaining copies.
  auto dst_of = [&](int j) -> int32_t {
    const int32_t m = static_cast<int32_t>(s_resolved[j] & ~kMissTag);
    return m < misses ? slot_locs[s_order[m]] : -1;
  };
  auto record = [&](int j, int64_t src, int32_t dst) {
    if constexpr (kRecordPlan) {
      const int64_t m = s_resolved[j] & ~kMissTag;
      if (lane == 0 && dst >= 0) {
        p.miss_src[row * p.miss_src_stride + m] = src;
        p.miss_dst[row * p.miss_dst_stride + m] = dst;
      }
    }
  };
  int32_t first_dst = -1;
  if (first_k >= 0) first_dst = dst_of(first_k * kThreads + warp * kWarp + first_lane);

#pragma unroll
  for (int k = 0; k < kTopKPerThread; ++k) {
    if (!publishes(k)) continue;
    int32_t loc = -1;
    if (newest_bits >> k & 1u) {
      if constexpr (kDraftTokens == 1) {
        loc = s_newest_loc;
      } else {
        loc = slot_locs[kHot + tok[k] - newest];
      }
    } else if (cand_bits >> k & 1u) {
      const uint32_t r = s_resolved[owner[k]];
      if (r & kMissTag) {
        const int32_t mm = static_cast<int32_t>(r & ~kMissTag);
        loc = mm < misses ? slot_locs[s_order[mm]] : -1;
      } else {
        loc = slot_locs[r & 0xffffu];
      }
    }
    out_at(k) = loc;
  }
  if constexpr (kRecordPlan) {
    if (part == 0 && tid == 0) p.miss_count[row] = misses;
  }
  if (p.tally != nullptr && part == 0 && tid == 0 && misses > 0) {
    atomicAdd(p.tally + 1, static_cast<unsigned long long>(misses));
  }
  probe.mark(Probe::kPublished);

  if (first_k >= 0 && first_dst >= 0) {
    if constexpr (!kSkipIO) IO::store(staged, p.device_kv, p.device_kv_stride, first_dst, lane);
    record(first_k * kThreads + warp * kWarp + first_lane, first_src, first_dst);
  }
#pragma unroll
  for (int k = 0; k < kTopKPerThread; ++k) {
    while (tasks[k] != 0) {
      const int sel = __ffs(tasks[k]) - 1;
      tasks[k] &= tasks[k] - 1;
      const int64_t src = __shfl_sync(0xffffffffu, src_row[k], sel);
      const int j = k * kThreads + warp * kWarp + sel;
      if constexpr (!kSkipIO) IO::load(staged, p.host_kv, p.host_kv_stride, src, lane);
      const int32_t dst = dst_of(j);
      if (dst >= 0) {
        if constexpr (!kSkipIO) IO::store(staged, p.device_kv, p.device_kv_stride, dst, lane);
        record(j, src, dst);
      }
    }
  }

  // ---- Phase D: the last block to arrive rewrites the slot table and LRU.
  __syncthreads();
  probe.mark(Probe::kCopied);
  if (s_is_last) {
    int32_t* slot_tokens_out = p.slot_tokens + req * p.slot_tokens_stride;
    int16_t* lru_out = p.lru + req * p.lru_stride;
    const int32_t untouched = evictable - misses;
    for (int i = tid; i < kHot; i += kThreads) {
      const int src = i < untouched ? i + misses : (i < evictable ? i - untouched : i);
      lru_out[i] = s_order[src];
    }
    for (int i = tid; i < misses; i += kThreads) slot_tokens_out[s_order[i]] = s_miss_tok[i];
  }
  probe.mark(Probe::kExit);
  probe.grid_exit();
}

template <
    int kTopK,
    int kHot,
    int kItemBytes,
    int kLayout,
    bool kRecordPlan,
    bool kSkipIO,
    int kThreads,
    int kHashScale,
    bool kProbe,
    int kDraftTokens = 1>
struct SwapIn {
  static constexpr size_t kSmemBytes = SwapInSmem<kDraftTokens * kTopK, kHot, kHashScale>::kBytes;

  template <typename SeqT, typename ReqT>
  static void launch(const SwapInParams& params, int64_t bs, int64_t split, DLDevice device) {
    auto kernel = swap_in_kernel<
        kTopK, kHot, kItemBytes, kLayout, kRecordPlan, kSkipIO, kThreads, kHashScale, kProbe, kDraftTokens, SeqT, ReqT>;
    // Opting in to >48 KiB of dynamic shared memory is per device and per kernel.
    static std::atomic<uint64_t> opted_in{0};
    const uint64_t bit = uint64_t(1) << (device.device_id & 63);
    if (!(opted_in.load(std::memory_order_relaxed) & bit)) {
      host::RuntimeDeviceCheck(
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmemBytes)));
      opted_in.fetch_or(bit, std::memory_order_relaxed);
    }
    host::LaunchKernel(dim3(static_cast<uint32_t>(split), static_cast<uint32_t>(bs)), kThreads, device, kSmemBytes)(
        kernel, params);
  }

  static void
  run(tvm::ffi::TensorView top_k_tokens,
      tvm::ffi::TensorView req_pool_indices,
      tvm::ffi::TensorView seq_lens,
      tvm::ffi::TensorView num_real_reqs,
      tvm::ffi::TensorView slot_tokens,
      tvm::ffi::TensorView slot_locs,
      tvm::ffi::TensorView lru,
      tvm::ffi::TensorView host_locs,
      tvm::ffi::TensorView host_kv,
      tvm::ffi::TensorView device_kv,
      tvm::ffi::TensorView top_k_device_locs,
      tvm::ffi::TensorView miss_src,
      tvm::ffi::TensorView miss_dst,
      tvm::ffi::TensorView miss_count,
      tvm::ffi::TensorView arrivals,
      tvm::ffi::TensorView resident,
      tvm::ffi::TensorView req_to_token,
      tvm::ffi::TensorView token_to_row,
      tvm::ffi::TensorView tally,
      tvm::ffi::TensorView probe,
      int64_t split) {
    using namespace host;
    auto BS = SymbolicSize{"batch"};
    auto R = SymbolicSize{"max_reqs"};
    auto W = SymbolicSize{"slot_table_width"};
    auto RS0 = SymbolicSize{"slot_tokens.stride(0)"};
    auto LS0 = SymbolicSize{"slot_locs.stride(0)"};
    auto US0 = SymbolicSize{"lru.stride(0)"};
    auto HS0 = SymbolicSize{"host_locs.stride(0)"};
    auto CTX = SymbolicSize{"max_ctx"};
    auto cuda = SymbolicDevice{};
    cuda.set_options<kDLCUDA>();

    const Selection sel = Selection::verify(
        top_k_tokens, top_k_device_locs, req_pool_indices, seq_lens, num_real_reqs, BS, kTopK, cuda, kDraftTokens);
    TensorMatcher({R, W}).with_strides({RS0, 1}).with_dtype<int32_t>().with_device(cuda).verify(slot_tokens);
    TensorMatcher({R, W}).with_strides({LS0, 1}).with_dtype<int32_t>().with_device(cuda).verify(slot_locs);
    TensorMatcher({R, kHot}).with_strides({US0, 1}).with_dtype<int16_t>().with_device(cuda).verify(lru);
    TensorMatcher({-1, CTX}).with_strides({HS0, 1}).with_dtype<int64_t>().with_device(cuda).verify(host_locs);
    const KvPools pools = KvPools::verify(host_kv, device_kv, cuda);
    TensorMatcher({-1}).with_dtype<uint32_t, int32_t>().with_device(cuda).verify(arrivals);
    RuntimeCheck(W.unwrap() >= kHot + kDraftTokens,
                 "slot table width must exceed hot_buffer_size by the draft tokens (slots HOT.. hold the newest)");
    RuntimeCheck(split >= 1 && split <= 65535, "split must be in [1, 65535], got ", split);
    const int64_t bs = BS.unwrap();
    RuntimeCheck(split == 1 || arrivals.size(0) >= bs, "arrivals workspace is smaller than the batch");

    SwapInParams params{};
    if constexpr (kRecordPlan) {
      auto MS = SymbolicSize{"miss_src.stride(0)"};
      auto MD = SymbolicSize{"miss_dst.stride(0)"};
      auto PW = SymbolicSize{"plan_width"};
      TensorMatcher({-1, PW}).with_strides({MS, 1}).with_dtype<int64_t>().with_device(cuda).verify(miss_src);
      TensorMatcher({-1, PW}).with_strides({MD, 1}).with_dtype<int32_t>().with_device(cuda).verify(miss_dst);
      TensorMatcher({-1}).with_dtype<int32_t>().with_device(cuda).verify(miss_count);
      RuntimeCheck(miss_src.size(0) >= bs && miss_count.size(0) >= bs, "miss plan has fewer rows than the batch");
      RuntimeCheck(PW.unwrap() >= kDraftTokens * kTopK, "miss plan must hold draft_tokens x top_k entries per request");
      params.miss_src = static_cast<int64_t*>(miss_src.data_ptr());
      params.miss_dst = static_cast<int32_t*>(miss_dst.data_ptr());
      params.miss_count = static_cast<int32_t*>(miss_count.data_ptr());
      params.miss_src_stride = MS.unwrap();
      params.miss_dst_stride = MD.unwrap();
    }
    if (resident.size(0) > 0) {
      auto R2 = SymbolicSize{"req_to_token.stride(0)"};
      TensorMatcher({R}).with_dtype<int32_t>().with_device(cuda).verify(resident);
      TensorMatcher({R, -1}).with_strides({R2, 1}).with_dtype<int32_t>().with_device(cuda).verify(req_to_token);
      TensorMatcher({-1}).with_dtype<int64_t>().with_device(cuda).verify(token_to_row);
      params.resident = static_cast<const int32_t*>(resident.data_ptr());
      params.req_to_token = static_cast<const int32_t*>(req_to_token.data_ptr());
      params.token_to_row = static_cast<const int64_t*>(token_to_row.data_ptr());
      params.r2t_stride = R2.unwrap();
    }
    if (tally.size(0) > 0) {
      TensorMatcher({2}).with_dtype<int64_t>().with_device(cuda).verify(tally);
      params.tally = static_cast<unsigned long long*>(tally.data_ptr());
    }
    if constexpr (kProbe) {
      TensorMatcher({Probe::kSlots}).with_dtype<int64_t>().with_device(cuda).verify(probe);
      params.probe = static_cast<unsigned long long*>(probe.data_ptr());
    }
    if (bs == 0) return;

    params.top_k_tokens = sel.top_k_tokens;
    params.out_locs = sel.out;
    params.req_pool_indices = sel.req_pool_indices;
    params.seq_lens = sel.seq_lens;
    params.num_real_reqs = sel.num_real_reqs;
    params.slot_tokens = static_cast<int32_t*>(slot_tokens.data_ptr());
    params.slot_locs = static_cast<const int32_t*>(slot_locs.data_ptr());
    params.lru = static_cast<int16_t*>(lru.data_ptr());
    params.host_locs = static_cast<const int64_t*>(host_locs.data_ptr());
    params.host_kv = pools.host;
    params.device_kv = pools.device;
    params.arrivals = static_cast<uint32_t*>(arrivals.data_ptr());
    params.top_k_stride = sel.top_k_stride;
    params.out_stride = sel.out_stride;
    params.slot_tokens_stride = RS0.unwrap();
    params.slot_locs_stride = LS0.unwrap();
    params.lru_stride = US0.unwrap();
    params.host_locs_stride = HS0.unwrap();
    params.max_ctx = CTX.unwrap();
    params.host_kv_stride = pools.host_stride;
    params.device_kv_stride = pools.device_stride;

    const DLDevice device = cuda.unwrap();
    const bool seq64 = sel.seq64;
    const bool req64 = sel.req64;
    if (seq64 && req64) {
      launch<int64_t, int64_t>(params, bs, split, device);
    } else if (seq64) {
      launch<int64_t, int32_t>(params, bs, split, device);
    } else if (req64) {
      launch<int32_t, int64_t>(params, bs, split, device);
    } else {
      launch<int32_t, int32_t>(params, bs, split, device);
    }
  }
};

}  // namespace hisparse_plugin
