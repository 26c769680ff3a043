// Benchmark-only: a synthetic top-k trace in place of the indexer's choice
// (SGLANG_HISPARSE_SYNTHETIC_TOPK). Random weights select with little
// step-to-step locality, so host IO on them is a worst case; this trace has a
// controllable one. It is a pure function of (request slot, layer, sequence
// length), so it needs no state, replays inside CUDA graphs and is the same
// for every configuration given the same requests.
//
// Entry j of a row (request slot r, sequence length L, layer l), S = top_k -
// recent older entries:
//   j <  recent: the position L - 1 - j (the newest tokens), -1 when negative;
//   j >= recent: i = j - recent holds a position that stays put for `period`
//     steps. Entry j's epochs start at phase(j) = mix(seed, layer, j) % period,
//     so 1/period of the entries move each step. In epoch e = (L + phase) /
//     period, begun at length Le = e * period - phase (<= L), the entry holds
//     i + S * m, m = (M * max_d u_d) >> 24 with M = ceil((Le - recent - i) / S)
//     and u_d = mix(seed, layer, r, j, e, d) >> 8 for d < bias: a position
//     below Le - recent (older than the window) that is i modulo S, so no
//     two entries ever name one position (kernels that assume distinct
//     entries, e.g. 0.5.13's own swap-in, can take the trace). The maximum of
//     `bias` uniforms leans towards recent positions (bias 1: none). -1 when
//     Le - recent <= i.
// Integer arithmetic only, so the torch version in
// kernels/synthetic_top_k.py produces the same bits.
#pragma once

#include <sgl_kernel/tensor.h>
#include <sgl_kernel/utils.cuh>
#include <sgl_kernel/utils.h>

#include <dlpack/dlpack.h>
#include <tvm/ffi/container/tensor.h>

#include <cstdint>

namespace hisparse_plugin {

// lowbias32 (Wellons): a full-avalanche 32-bit mix.
__device__ __forceinline__ uint32_t synthetic_mix(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

struct SyntheticTopKParams {
  const void* req_pool_indices;
  const void* seq_lens;
  int32_t* out;
  int64_t out_stride;
  int32_t top_k;
  uint32_t layer_key;  // mix(seed ^ mix(layer)), folded on the host
  int32_t period;
  int32_t recent;
  int32_t bias;
  bool req64;
  bool seq64;
};

__device__ __forceinline__ int64_t synthetic_load(const void* p, int64_t i, bool is64) {
  return is64 ? static_cast<const int64_t*>(p)[i] : static_cast<const int32_t*>(p)[i];
}

template <int kThreads>
__global__ void __launch_bounds__(kThreads) synthetic_top_k_kernel(const __grid_constant__ SyntheticTopKParams p) {
  const int64_t b = blockIdx.x;
  const int64_t L = synthetic_load(p.seq_lens, b, p.seq64);
  const uint32_t req = static_cast<uint32_t>(synthetic_load(p.req_pool_indices, b, p.req64));
  const uint32_t req_key = synthetic_mix(p.layer_key ^ req);
  int32_t* row = p.out + b * p.out_stride;
  for (int j = threadIdx.x; j < p.top_k; j += kThreads) {
    int64_t pos;
    if (j < p.recent) {
      pos = L - 1 - j;
    } else {
      const uint32_t entry_key = synthetic_mix(req_key ^ static_cast<uint32_t>(j));
      const int64_t phase = synthetic_mix(p.layer_key ^ static_cast<uint32_t>(j) ^ 0x9e3779b9U) % p.period;
      const int64_t epoch = (L + phase) / p.period;
      const int64_t span = epoch * p.period - phase - p.recent;
      const int64_t stride = p.top_k - p.recent;  // > 0: j >= recent here
      const int64_t i = j - p.recent;
      uint32_t u = 0;
      const uint32_t epoch_key = synthetic_mix(entry_key ^ static_cast<uint32_t>(epoch));
      for (int d = 0; d < p.bias; ++d) {
        u = max(u, synthetic_mix(epoch_key ^ static_cast<uint32_t>(d)) >> 8);
      }
      const int64_t rows = span > i ? (span - i + stride - 1) / stride : 0;
      pos = rows > 0 ? i + stride * ((rows * static_cast<int64_t>(u)) >> 24) : -1;
    }
    row[j] = pos >= 0 ? static_cast<int32_t>(pos) : -1;
  }
}

// kThreads: threads per request row (a template parameter only so that the
// loader's `Class<args>::run` naming applies).
template <int kThreads>
struct SyntheticTopK {
  static void
  run(tvm::ffi::TensorView req_pool_indices,
      tvm::ffi::TensorView seq_lens,
      tvm::ffi::TensorView out,
      int64_t layer_key,
      int64_t period,
      int64_t recent,
      int64_t bias) {
    using namespace host;
    auto BS = SymbolicSize{"batch"};
    auto K = SymbolicSize{"top_k"};
    auto OS = SymbolicSize{"out.stride(0)"};
    auto cuda = SymbolicDevice{};
    auto req_dtype = SymbolicDType{};
    auto seq_dtype = SymbolicDType{};
    cuda.set_options<kDLCUDA>();
    TensorMatcher({BS, K}).with_strides({OS, 1}).with_dtype<int32_t>().with_device(cuda).verify(out);
    TensorMatcher({BS}).with_dtype<int32_t, int64_t>(req_dtype).with_device(cuda).verify(req_pool_indices);
    TensorMatcher({BS}).with_dtype<int32_t, int64_t>(seq_dtype).with_device(cuda).verify(seq_lens);
    RuntimeCheck(period >= 1 && recent >= 0 && bias >= 1 && bias <= 16, "bad synthetic trace parameters");
    const int64_t bs = BS.unwrap();
    if (bs == 0) return;
    SyntheticTopKParams params{};
    params.req_pool_indices = req_pool_indices.data_ptr();
    params.seq_lens = seq_lens.data_ptr();
    params.out = static_cast<int32_t*>(out.data_ptr());
    params.out_stride = OS.unwrap();
    params.top_k = static_cast<int32_t>(K.unwrap());
    params.layer_key = static_cast<uint32_t>(layer_key);
    params.period = static_cast<int32_t>(period);
    params.recent = static_cast<int32_t>(recent);
    params.bias = static_cast<int32_t>(bias);
    params.req64 = req_dtype.is_type<int64_t>();
    params.seq64 = seq_dtype.is_type<int64_t>();
    LaunchKernel(static_cast<uint32_t>(bs), kThreads, cuda.unwrap())(synthetic_top_k_kernel<kThreads>, params);
  }
};

}  // namespace hisparse_plugin
