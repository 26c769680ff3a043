// Copy-only replay of a swap-in miss plan.
//
// Layers that share one indexer see the same top-k, and their hot buffers move
// in lockstep, so the anchor layer's plan (host row -> device row per miss)
// is valid for them too: only the bytes need to move. The plan is ragged
// (miss_count[b] entries in row b), so every block first turns the counts into
// offsets and then all warps of the grid walk the flattened (request, miss)
// space. A lone request with a burst of misses therefore still uses every warp.
//
// Two block shapes (template kThreads):
// * 512 threads, offsets in shared memory: the fastest replay of an idle GPU.
// * 32 threads (one warp), no shared memory, at most 32 registers per thread:
//   the "co-resident" replay. The IndexShare prefetch runs beside the
//   forward's GEMMs and attention, whose blocks take a whole SM's registers
//   (e.g. 384 threads x 168 registers = 64,512 of 65,536). A replay block
//   holds its SM until every miss has moved, so a 512-thread block shuts
//   those kernels out of its SM for the whole replay, while a 1,024-register
//   warp was meant to fit in what they leave. Each warp walks the per-request
//   counts itself (a prefetch batch is at most a few hundred requests).
//   Measured beside a compute stand-in on the H200 (2026-12-04), one warp
//   per SM hid 21-23% of the shorter side, 8 blocks of 512 threads 37-60%.
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

inline constexpr int kCopyThreads = 512;

struct CopyPlannedParams {
  const int64_t* miss_src;
  const int32_t* miss_dst;
  const int32_t* miss_count;
  const int32_t* num_real_reqs;
  const char* host_kv;
  char* device_kv;
  int64_t miss_src_stride;
  int64_t miss_dst_stride;
  int64_t host_kv_stride;
  int64_t device_kv_stride;
  int32_t bs;
  int32_t plan_width;
};

template <int kItemBytes, int kLayout>
__global__ void __launch_bounds__(kCopyThreads) copy_planned_kernel(const __grid_constant__ CopyPlannedParams p) {
  using IO = RowIO<kLayout, kItemBytes>;
  constexpr int kWarps = kCopyThreads / kWarp;
  extern __shared__ __align__(16) char smem[];
  int32_t* s_offsets = reinterpret_cast<int32_t*>(smem);  // [bs + 1]

  const int tid = threadIdx.x;
  const int lane = tid % kWarp;
  const int warp = tid / kWarp;
  const int real = max(0, min(p.num_real_reqs[0], p.bs));

  for (int b = tid; b < real; b += kCopyThreads) {
    s_offsets[b] = max(0, min(p.miss_count[b], p.plan_width));
  }
  __syncthreads();
  if (warp == 0) {
    // One warp scans the per-request miss counts; batches are at most a few
    // thousand rows. s_offsets[real] ends as the total.
    const int32_t total = warp_scan_exclusive(s_offsets, real, lane);
    if (lane == 0) s_offsets[real] = total;
  }
  __syncthreads();

  const int32_t total = s_offsets[real];
  const int32_t stride = gridDim.x * kWarps;
  for (int32_t f = blockIdx.x * kWarps + warp; f < total; f += stride) {
    // Last row whose first miss is <= f; empty rows share offsets and are skipped.
    int lo = 0, hi = real - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (s_offsets[mid] <= f) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    const int64_t b = lo;
    const int64_t m = f - s_offsets[lo];
    const int64_t src = p.miss_src[b * p.miss_src_stride + m];
    const int64_t dst = p.miss_dst[b * p.miss_dst_stride + m];
    typename IO::Staged staged;
    IO::load(staged, p.host_kv, p.host_kv_stride, src, lane);
    IO::store(staged, p.device_kv, p.device_kv_stride, dst, lane);
  }
}

// One warp per block: warp g takes flattened misses g, g + W, g + 2W, ...
// (W warps in the grid), walking the requests' counts in order.
template <int kItemBytes, int kLayout>
__global__ void __launch_bounds__(kWarp, 64) copy_planned_warp_kernel(const __grid_constant__ CopyPlannedParams p) {
  using IO = RowIO<kLayout, kItemBytes>;
  const int lane = threadIdx.x;
  const int real = max(0, min(p.num_real_reqs[0], p.bs));
  const int64_t warps = gridDim.x;
  const int64_t g = blockIdx.x;
  int64_t first = 0;  // flattened index of request b's first miss
  for (int b = 0; b < real; ++b) {
    const int64_t count = max(0, min(p.miss_count[b], p.plan_width));
    // This warp's first flattened index at or after `first`.
    int64_t f = first + ((g - first) % warps + warps) % warps;
    for (; f < first + count; f += warps) {
      const int64_t m = f - first;
      const int64_t src = p.miss_src[b * p.miss_src_stride + m];
      const int64_t dst = p.miss_dst[b * p.miss_dst_stride + m];
      typename IO::Staged staged;
      IO::load(staged, p.host_kv, p.host_kv_stride, src, lane);
      IO::store(staged, p.device_kv, p.device_kv_stride, dst, lane);
    }
    first += count;
  }
}

template <int kItemBytes, int kLayout, int kThreads>
struct CopyPlanned {
  static_assert(kThreads == kCopyThreads || kThreads == kWarp, "a replay block is 512 threads or one warp");

  static void
  run(tvm::ffi::TensorView miss_src,
      tvm::ffi::TensorView miss_dst,
      tvm::ffi::TensorView miss_count,
      tvm::ffi::TensorView num_real_reqs,
      tvm::ffi::TensorView host_kv,
      tvm::ffi::TensorView device_kv,
      int64_t num_blocks) {
    using namespace host;
    auto BS = SymbolicSize{"batch"};
    auto PW = SymbolicSize{"plan_width"};
    auto MS = SymbolicSize{"miss_src.stride(0)"};
    auto MD = SymbolicSize{"miss_dst.stride(0)"};
    auto cuda = SymbolicDevice{};
    cuda.set_options<kDLCUDA>();
    TensorMatcher({BS, PW}).with_strides({MS, 1}).with_dtype<int64_t>().with_device(cuda).verify(miss_src);
    TensorMatcher({BS, PW}).with_strides({MD, 1}).with_dtype<int32_t>().with_device(cuda).verify(miss_dst);
    TensorMatcher({BS}).with_dtype<int32_t>().with_device(cuda).verify(miss_count);
    TensorMatcher({1}).with_dtype<int32_t>().with_device(cuda).verify(num_real_reqs);
    const KvPools pools = KvPools::verify(host_kv, device_kv, cuda);
    RuntimeCheck(num_blocks >= 1 && num_blocks <= (1 << 20), "num_blocks out of range: ", num_blocks);
    const int64_t bs = BS.unwrap();
    RuntimeCheck(bs <= 12000, "copy_planned supports at most 12000 rows, got ", bs);
    if (bs == 0) return;

    CopyPlannedParams params{};
    params.miss_src = static_cast<const int64_t*>(miss_src.data_ptr());
    params.miss_dst = static_cast<const int32_t*>(miss_dst.data_ptr());
    params.miss_count = static_cast<const int32_t*>(miss_count.data_ptr());
    params.num_real_reqs = static_cast<const int32_t*>(num_real_reqs.data_ptr());
    params.host_kv = pools.host;
    params.device_kv = pools.device;
    params.miss_src_stride = MS.unwrap();
    params.miss_dst_stride = MD.unwrap();
    params.host_kv_stride = pools.host_stride;
    params.device_kv_stride = pools.device_stride;
    params.bs = static_cast<int32_t>(bs);
    params.plan_width = static_cast<int32_t>(PW.unwrap());

    if constexpr (kThreads == kWarp) {
      LaunchKernel(static_cast<uint32_t>(num_blocks), kWarp, cuda.unwrap())(
          copy_planned_warp_kernel<kItemBytes, kLayout>, params);
    } else {
      const size_t smem = sizeof(int32_t) * (bs + 1);
      LaunchKernel(static_cast<uint32_t>(num_blocks), kCopyThreads, cuda.unwrap(), smem)(
          copy_planned_kernel<kItemBytes, kLayout>, params);
    }
  }
};

}  // namespace hisparse_plugin
