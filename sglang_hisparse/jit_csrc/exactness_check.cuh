// In-server exactness check (a debug aid, SGLANG_HISPARSE_CHECK=1): launched
// right after a layer's swap-in, it verifies that every row attention is about
// to read holds the authoritative KV of the position the indexer selected.
//
// For real batch row b (r = req_pool_indices[b], L = seq_lens[b]) and top-k
// entry j (t = top_k_tokens[b, j], o = out[b, j]), valid iff
// 0 <= t < min(L, max_ctx):
//   - invalid entry: o must be -1                                   (kind 4)
//   - resident request: o == token_to_row[req_to_token[r, t]]       (kind 1)
//   - t == L - 1 (not written through yet): o == slot_locs[r, min(L - 1, HOT)],
//     and for plain rows, when the mapping is given, that row is also
//     token_to_row[req_to_token[r, L - 1]]                          (kind 2)
//   - otherwise the bytes of device row o equal those of host row
//     host_locs[r, t]                                               (kind 3);
//     o or the host row missing or out of range                     (kind 5)
// A speculative verify step (draft_tokens = n > 1) has n rows per request: row
// b is request b / n's, valid below its own length, and the rule of t == L - 1
// covers every position t >= S = seq_lens[first row of the request] - 1 (the
// tokens this step verifies), at slot t while S < HOT, else HOT + t - S.
// sglang_hisparse/kernels/exactness.py holds the torch reference of the same
// rules; the tests keep the two equal.
//
// Results accumulate in persistent device buffers: counters += {entries
// checked, mismatches}, and the first mismatch found is written once into
// `first` (an atomicCAS on its flag slot picks exactly one writer). No host
// sync, no allocation, and a grid that depends only on the batch size, so the
// check can be captured in a CUDA graph with the swap-in it follows.
//
// Work split: a block of 8 warps per (batch row, part); each warp checks one
// entry at a time, its 32 lanes loading the two rows together and comparing
// them with one vote.
#pragma once

#include <sgl_kernel/tensor.h>
#include <sgl_kernel/utils.cuh>
#include <sgl_kernel/utils.h>

#include <dlpack/dlpack.h>
#include <tvm/ffi/container/tensor.h>

#include <cstdint>

#include "kv_rows.cuh"
#include "launch_args.cuh"

namespace hisparse_plugin {

inline constexpr int kCheckThreads = 256;

// Mismatch kinds (first[kKind]); kernels/exactness.py names them.
struct CheckKind {
  enum : int { kNone = 0, kResident = 1, kNewest = 2, kBytes = 3, kInvalidNotMinusOne = 4, kMissingRow = 5 };
};

// Slots of the first-mismatch record (int64 [kSlots]).
struct FirstMismatch {
  enum : int {
    kFlag = 0,      // 0 until a mismatch is recorded
    kReq = 1,       // req_pool_indices[b]
    kLayer = 2,     // layer_id of the launch
    kBatchRow = 3,  // b
    kPosition = 4,  // t
    kOut = 5,       // out[b, j]
    kExpected = 6,  // host row (kinds 3, 5) or the expected device row (kinds 1, 2)
    kKind = 7,
    kSlots = 8,
  };
};

struct ExactnessParams {
  Selection sel;  // top_k_tokens, out (read only here), req_pool_indices, seq_lens, num_real_reqs
  KvPools kv;     // rows in tokens (C4: pages x 64)
  const int32_t* slot_locs;
  const int64_t* host_locs;
  const int32_t* resident;      // per request slot; nullptr: none resident
  const int32_t* req_to_token;  // [R, r2t_width]; nullptr: mapping not given
  const int64_t* token_to_row;  // [t2r_size]
  unsigned long long* counters;
  unsigned long long* first;
  int64_t top_k;
  int64_t slot_locs_stride;
  int64_t slot_width;
  int64_t host_locs_stride;
  int64_t max_ctx;
  int64_t r2t_stride;
  int64_t r2t_width;
  int64_t t2r_size;
  int64_t hot;
  int64_t layer_id;
  int64_t draft_tokens;  // rows per request (1: decode)
};

SGL_DEVICE int64_t load_index_of(const void* p, bool is64, int64_t i) {
  return is64 ? static_cast<const int64_t*>(p)[i] : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
}

// The device row the request's mapping gives position t, or -1 if there is none.
SGL_DEVICE int64_t mapped_row(const ExactnessParams& p, int64_t req, int64_t t) {
  if (t < 0 || t >= p.r2t_width) return -1;
  const int64_t logical = p.req_to_token[req * p.r2t_stride + t];
  if (logical < 0 || logical >= p.t2r_size) return -1;
  return p.token_to_row[logical];
}

SGL_DEVICE void record_first(
    const ExactnessParams& p, int64_t req, int64_t row, int64_t t, int64_t o, int64_t expected, int kind) {
  if (atomicCAS(p.first + FirstMismatch::kFlag, 0ull, 1ull) != 0ull) return;
  auto put = [&](int slot, int64_t v) { p.first[slot] = static_cast<unsigned long long>(v); };
  put(FirstMismatch::kReq, req);
  put(FirstMismatch::kLayer, p.layer_id);
  put(FirstMismatch::kBatchRow, row);
  put(FirstMismatch::kPosition, t);
  put(FirstMismatch::kOut, o);
  put(FirstMismatch::kExpected, expected);
  put(FirstMismatch::kKind, kind);
}

template <int kItemBytes, int kLayout>
__global__ void __launch_bounds__(kCheckThreads) exactness_check_kernel(const __grid_constant__ ExactnessParams p) {
  using IO = RowIO<kLayout, kItemBytes>;
  constexpr int kWarps = kCheckThreads / kWarp;
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  const int64_t row = blockIdx.y;
  const int64_t group = row / p.draft_tokens;  // the request
  if (group >= p.sel.num_real_reqs[0]) return;  // CUDA-graph padding

  const int64_t req = load_index_of(p.sel.req_pool_indices, p.sel.req64, group);
  const int64_t seq_len = load_index_of(p.sel.seq_lens, p.sel.seq64, row);
  const int64_t limit = seq_len < p.max_ctx ? seq_len : p.max_ctx;
  const bool resident = p.resident != nullptr && p.resident[req] != 0;
  // The newest position (decode) or the first this step verifies: S.
  const int64_t newest =
      load_index_of(p.sel.seq_lens, p.sel.seq64, group * p.draft_tokens) - 1;
  // The row a position >= S must read: its slot's, which the attention write
  // path also mapped.
  auto newest_row_of = [&](int64_t t, bool& mapped) -> int64_t {
    const int64_t slot = newest < p.hot ? t : p.hot + t - newest;
    const int64_t r = slot >= 0 && slot < p.slot_width ? p.slot_locs[req * p.slot_locs_stride + slot] : -1;
    mapped = true;
    if constexpr (kLayout == kLayoutRows) {
      if (p.req_to_token != nullptr) mapped = mapped_row(p, req, t) == r;
    }
    return r;
  };
  const int32_t* top_k = p.sel.top_k_tokens + row * p.sel.top_k_stride;
  const int32_t* out = p.sel.out + row * p.sel.out_stride;
  const int64_t* host_locs = p.host_locs + req * p.host_locs_stride;

  unsigned long long checked = 0, bad = 0;
  const int64_t step = int64_t(gridDim.x) * kWarps;
  for (int64_t j = int64_t(blockIdx.x) * kWarps + warp; j < p.top_k; j += step) {
    // Warp-uniform from here on: every lane reads the same entry.
    const int64_t t = top_k[j];
    const int64_t o = out[j];
    int kind = CheckKind::kNone;
    int64_t expected = -1;
    if (!(t >= 0 && t < limit)) {
      if (o != -1) kind = CheckKind::kInvalidNotMinusOne;
    } else if (resident) {
      expected = mapped_row(p, req, t);
      if (expected < 0 || o != expected) kind = CheckKind::kResident;
    } else if (t >= newest) {
      bool mapped;
      expected = newest_row_of(t, mapped);
      if (expected < 0 || o != expected || !mapped) kind = CheckKind::kNewest;
    } else {
      expected = host_locs[t];
      if (o < 0 || o >= p.kv.device_rows || expected < 0 || expected >= p.kv.host_rows) {
        kind = CheckKind::kMissingRow;
      } else {
        typename IO::Staged want, got;
        IO::load(want, p.kv.host, p.kv.host_stride, expected, lane);
        IO::load(got, p.kv.device, p.kv.device_stride, o, lane);
        if (!__all_sync(0xffffffffu, IO::same(want, got, lane))) kind = CheckKind::kBytes;
      }
    }
    ++checked;
    if (kind != CheckKind::kNone) {
      ++bad;
      if (lane == 0) record_first(p, req, row, t, o, expected, kind);
    }
  }
  if (lane == 0 && checked > 0) {
    atomicAdd(p.counters, checked);
    if (bad > 0) atomicAdd(p.counters + 1, bad);
  }
}

template <int kItemBytes, int kLayout>
struct ExactnessCheck {
  static void
  run(tvm::ffi::TensorView top_k_tokens,
      tvm::ffi::TensorView out,
      tvm::ffi::TensorView req_pool_indices,
      tvm::ffi::TensorView seq_lens,
      tvm::ffi::TensorView num_real_reqs,
      tvm::ffi::TensorView slot_locs,
      tvm::ffi::TensorView host_locs,
      tvm::ffi::TensorView host_kv,
      tvm::ffi::TensorView device_kv,
      tvm::ffi::TensorView resident,
      tvm::ffi::TensorView req_to_token,
      tvm::ffi::TensorView token_to_row,
      tvm::ffi::TensorView counters,
      tvm::ffi::TensorView first,
      int64_t hot,
      int64_t layer_id,
      int64_t blocks_per_row,
      int64_t draft_tokens) {
    using namespace host;
    auto BS = SymbolicSize{"batch"};
    auto K = SymbolicSize{"top_k"};
    auto R = SymbolicSize{"max_reqs"};
    auto W = SymbolicSize{"slot_table_width"};
    auto LS0 = SymbolicSize{"slot_locs.stride(0)"};
    auto HS0 = SymbolicSize{"host_locs.stride(0)"};
    auto CTX = SymbolicSize{"max_ctx"};
    auto cuda = SymbolicDevice{};
    cuda.set_options<kDLCUDA>();

    ExactnessParams params{};
    RuntimeCheck(draft_tokens >= 1, "draft_tokens must be >= 1, got ", draft_tokens);
    params.sel =
        Selection::verify(top_k_tokens, out, req_pool_indices, seq_lens, num_real_reqs, BS, K, cuda, draft_tokens);
    params.kv = KvPools::verify(host_kv, device_kv, cuda);
    TensorMatcher({R, W}).with_strides({LS0, 1}).with_dtype<int32_t>().with_device(cuda).verify(slot_locs);
    TensorMatcher({-1, CTX}).with_strides({HS0, 1}).with_dtype<int64_t>().with_device(cuda).verify(host_locs);
    TensorMatcher({2}).with_dtype<int64_t>().with_device(cuda).verify(counters);
    TensorMatcher({FirstMismatch::kSlots}).with_dtype<int64_t>().with_device(cuda).verify(first);
    RuntimeCheck(hot >= 1, "hot_buffer_size must be >= 1, got ", hot);
    RuntimeCheck(blocks_per_row >= 1 && blocks_per_row <= 65535, "blocks_per_row out of range: ", blocks_per_row);
    const int64_t bs = BS.unwrap() * draft_tokens;  // batch rows
    RuntimeCheck(bs <= 65535, "the check supports at most 65535 batch rows, got ", bs);

    if (req_to_token.size(0) > 0) {
      auto R2 = SymbolicSize{"req_to_token.stride(0)"};
      auto R2W = SymbolicSize{"req_to_token.size(1)"};
      auto T2R = SymbolicSize{"token_to_row.size(0)"};
      TensorMatcher({R, R2W}).with_strides({R2, 1}).with_dtype<int32_t>().with_device(cuda).verify(req_to_token);
      TensorMatcher({T2R}).with_dtype<int64_t>().with_device(cuda).verify(token_to_row);
      params.req_to_token = static_cast<const int32_t*>(req_to_token.data_ptr());
      params.token_to_row = static_cast<const int64_t*>(token_to_row.data_ptr());
      params.r2t_stride = R2.unwrap();
      params.r2t_width = R2W.unwrap();
      params.t2r_size = T2R.unwrap();
    }
    if (resident.size(0) > 0) {
      RuntimeCheck(params.req_to_token != nullptr, "resident needs req_to_token and token_to_row");
      TensorMatcher({R}).with_dtype<int32_t>().with_device(cuda).verify(resident);
      params.resident = static_cast<const int32_t*>(resident.data_ptr());
    }
    if (bs == 0) return;

    const int64_t tokens_per_row = kLayout == kLayoutDsv4C4 ? c4::kTokensPerPage : 1;
    params.kv.host_rows *= tokens_per_row;
    params.kv.device_rows *= tokens_per_row;
    params.slot_locs = static_cast<const int32_t*>(slot_locs.data_ptr());
    params.host_locs = static_cast<const int64_t*>(host_locs.data_ptr());
    params.counters = static_cast<unsigned long long*>(counters.data_ptr());
    params.first = static_cast<unsigned long long*>(first.data_ptr());
    params.top_k = K.unwrap();
    params.slot_locs_stride = LS0.unwrap();
    params.slot_width = W.unwrap();
    params.host_locs_stride = HS0.unwrap();
    params.max_ctx = CTX.unwrap();
    params.hot = hot;
    params.layer_id = layer_id;
    params.draft_tokens = draft_tokens;

    LaunchKernel(
        dim3(static_cast<uint32_t>(blocks_per_row), static_cast<uint32_t>(bs)), kCheckThreads, cuda.unwrap())(
        exactness_check_kernel<kItemBytes, kLayout>, params);
  }
};

}  // namespace hisparse_plugin
