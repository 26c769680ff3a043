// Host-side checks of the tensors several HiSparse launchers take, so each
// family states only what is its own. (The Python wrappers check the same
// things first, with messages that name the argument.)
#pragma once

#include <sgl_kernel/tensor.h>
#include <sgl_kernel/utils.h>

#include <dlpack/dlpack.h>
#include <tvm/ffi/container/tensor.h>

#include <cstdint>

#include "kv_rows.cuh"

namespace hisparse_plugin {

// One layer's KV pools: uint8 [rows, row bytes], the same row bytes, the last
// dim contiguous; the device pool on `cuda`, the host pool pinned (or on the
// device). In the C4 layout a "row" of the tensor is a page of 64 tokens.
struct KvPools {
  const char* host;  // device-side view of the host pool
  char* device;
  int64_t host_stride;
  int64_t device_stride;
  int64_t host_rows;
  int64_t device_rows;

  static KvPools verify(tvm::ffi::TensorView host_kv, tvm::ffi::TensorView device_kv, host::SymbolicDevice& cuda) {
    using namespace host;
    auto HR = SymbolicSize{"host_rows"};
    auto DR = SymbolicSize{"device_rows"};
    auto RB = SymbolicSize{"row_bytes"};
    auto HKS = SymbolicSize{"host_kv.stride(0)"};
    auto DKS = SymbolicSize{"device_kv.stride(0)"};
    TensorMatcher({HR, RB}).with_strides({HKS, 1}).with_dtype<uint8_t>().verify(host_kv);
    TensorMatcher({DR, RB}).with_strides({DKS, 1}).with_dtype<uint8_t>().with_device(cuda).verify(device_kv);
    return KvPools{
        device_view_of_host(host_kv.data_ptr(), host_kv.device()),
        static_cast<char*>(device_kv.data_ptr()),
        HKS.unwrap(),
        DKS.unwrap(),
        HR.unwrap(),
        DR.unwrap(),
    };
  }
};

// What a swap-in resolves and returns for a batch: top_k_tokens and out int32
// [bs * rows_per_req, top_k] (rows contiguous), req_pool_indices int32 or
// int64 [bs], seq_lens int32 or int64 [bs * rows_per_req], num_real_reqs int32
// [1], all on `cuda`. `top_k` is a SymbolicSize or, for a kernel built for one
// top-k, that number. rows_per_req > 1 is a speculative verify step (one row
// per verified token).
struct Selection {
  const int32_t* top_k_tokens;
  int32_t* out;
  const void* req_pool_indices;
  const void* seq_lens;
  const int32_t* num_real_reqs;
  int64_t top_k_stride;
  int64_t out_stride;
  bool req64;
  bool seq64;

  template <typename TopK>
  static Selection verify(
      tvm::ffi::TensorView top_k_tokens,
      tvm::ffi::TensorView out,
      tvm::ffi::TensorView req_pool_indices,
      tvm::ffi::TensorView seq_lens,
      tvm::ffi::TensorView num_real_reqs,
      host::SymbolicSize& batch,
      TopK&& top_k,
      host::SymbolicDevice& cuda,
      int64_t rows_per_req = 1) {
    using namespace host;
    auto KS0 = SymbolicSize{"top_k_tokens.stride(0)"};
    auto OS0 = SymbolicSize{"out.stride(0)"};
    auto rows = SymbolicSize{"rows (requests x draft tokens)"};
    auto req_dtype = SymbolicDType{};
    auto seq_dtype = SymbolicDType{};
    TensorMatcher({rows, top_k}).with_strides({KS0, 1}).with_dtype<int32_t>().with_device(cuda).verify(top_k_tokens);
    TensorMatcher({rows, top_k}).with_strides({OS0, 1}).with_dtype<int32_t>().with_device(cuda).verify(out);
    TensorMatcher({batch}).with_dtype<int32_t, int64_t>(req_dtype).with_device(cuda).verify(req_pool_indices);
    TensorMatcher({rows}).with_dtype<int32_t, int64_t>(seq_dtype).with_device(cuda).verify(seq_lens);
    TensorMatcher({1}).with_dtype<int32_t>().with_device(cuda).verify(num_real_reqs);
    RuntimeCheck(rows.unwrap() == batch.unwrap() * rows_per_req, "top_k_tokens has ", rows.unwrap(),
                 " rows; expected ", batch.unwrap(), " requests x ", rows_per_req, " draft tokens");
    return Selection{
        static_cast<const int32_t*>(top_k_tokens.data_ptr()),
        static_cast<int32_t*>(out.data_ptr()),
        req_pool_indices.data_ptr(),
        seq_lens.data_ptr(),
        static_cast<const int32_t*>(num_real_reqs.data_ptr()),
        KS0.unwrap(),
        OS0.unwrap(),
        req_dtype.is_type<int64_t>(),
        seq_dtype.is_type<int64_t>(),
    };
  }
};

}  // namespace hisparse_plugin
