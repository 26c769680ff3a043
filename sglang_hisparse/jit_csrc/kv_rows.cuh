// KV row layouts, the warp-wide row copy and compare, and the warp scan shared
// by every HiSparse kernel family (swap-in, plan replay, exactness check).
//
// A "row" is one token's KV bytes. The host pool and the device pool share the
// layout; only their base pointers and strides differ. A warp moves one row:
// `load` issues every read of the row before `store` issues the first write,
// so a row costs one host round trip per warp rather than one per vector.
#pragma once

#include <sgl_kernel/utils.cuh>

#include <cstdint>

namespace hisparse_plugin {

inline constexpr int kWarp = 32;

// Row layout ids; the Python side passes the same integers.
inline constexpr int kLayoutRows = 0;     // rows of ITEM_BYTES, fixed row stride
inline constexpr int kLayoutDsv4C4 = 1;   // DeepSeek-V4 page-padded "C4" pages

// DeepSeek-V4 C4 page: 64 value runs, then 64 scale runs, then padding so the
// page size is a multiple of 576 bytes (FlashMLA addresses pages in 576 B units).
namespace c4 {
inline constexpr int64_t kTokensPerPage = 64;
inline constexpr int64_t kValueBytes = 576;
inline constexpr int64_t kScaleBytes = 8;
inline constexpr int64_t kScaleOffset = kValueBytes * kTokensPerPage;
inline constexpr int64_t kPageBytes =
    ((kValueBytes + kScaleBytes) * kTokensPerPage + kValueBytes - 1) / kValueBytes * kValueBytes;
static_assert(kPageBytes == 37440);
static_assert(kValueBytes % 16 == 0 && kPageBytes % 16 == 0 && kScaleOffset % 16 == 0);
}  // namespace c4

// Host memory is only ever read here, so the read-only path is safe and keeps
// these one-shot lines out of L1.
SGL_DEVICE uint4 load_ro(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

SGL_DEVICE uint2 load_ro(const uint2* p) {
  uint2 v;
  asm("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}

SGL_DEVICE uint1 load_ro(const uint1* p) {
  uint1 v;
  asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v.x) : "l"(p));
  return v;
}

SGL_DEVICE bool same_vec(const uint4& a, const uint4& b) {
  return a.x == b.x && a.y == b.y && a.z == b.z && a.w == b.w;
}
SGL_DEVICE bool same_vec(const uint2& a, const uint2& b) { return a.x == b.x && a.y == b.y; }
SGL_DEVICE bool same_vec(const uint1& a, const uint1& b) { return a.x == b.x; }

template <int kBytes>
struct VecOf;
template <>
struct VecOf<16> {
  using type = uint4;
};
template <>
struct VecOf<8> {
  using type = uint2;
};
template <>
struct VecOf<4> {
  using type = uint1;
};

// Widest vector that tiles a row exactly; the launcher checks that both pools'
// base pointers and strides are multiples of it.
template <int kItemBytes>
inline constexpr int kRowVecBytes = (kItemBytes % 16 == 0) ? 16 : (kItemBytes % 8 == 0) ? 8 : 4;

template <int kLayout, int kItemBytes>
struct RowIO;

// Plain rows: row i lives at base + i * stride.
template <int kItemBytes>
struct RowIO<kLayoutRows, kItemBytes> {
  static_assert(kItemBytes > 0 && kItemBytes % 4 == 0, "row bytes must be a positive multiple of 4");
  static constexpr int kVecBytes = kRowVecBytes<kItemBytes>;
  using Vec = typename VecOf<kVecBytes>::type;
  static constexpr int kVecs = kItemBytes / kVecBytes;
  static constexpr int kPerLane = (kVecs + kWarp - 1) / kWarp;

  struct Staged {
    Vec v[kPerLane];
  };

  SGL_DEVICE static void load(Staged& st, const char* base, int64_t stride, int64_t row, int lane) {
    const Vec* src = reinterpret_cast<const Vec*>(base + row * stride);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int c = i * kWarp + lane;
      if (kVecs % kWarp == 0 || c < kVecs) st.v[i] = load_ro(src + c);
    }
  }

  // Whether this lane's share of two loaded rows is equal (a warp compares
  // whole rows with __all_sync over it).
  SGL_DEVICE static bool same(const Staged& x, const Staged& y, int lane) {
    bool eq = true;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int c = i * kWarp + lane;
      if (kVecs % kWarp == 0 || c < kVecs) eq = eq && same_vec(x.v[i], y.v[i]);
    }
    return eq;
  }

  SGL_DEVICE static void store(const Staged& st, char* base, int64_t stride, int64_t row, int lane) {
    Vec* dst = reinterpret_cast<Vec*>(base + row * stride);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int c = i * kWarp + lane;
      if (kVecs % kWarp == 0 || c < kVecs) dst[c] = st.v[i];
    }
  }
};

// C4 pages: a token is a 576 B value run and an 8 B scale run that are not
// adjacent, so one warp moves both pieces in the same pass. `stride` is the
// page stride in bytes and `row` a token index in the pool.
template <int kItemBytes>
struct RowIO<kLayoutDsv4C4, kItemBytes> {
  static_assert(kItemBytes == c4::kValueBytes + c4::kScaleBytes, "C4 rows are 576 B value + 8 B scale");
  static constexpr int kValueVecs = c4::kValueBytes / 16;  // 36: lanes 0..3 take a second vector
  static constexpr int kScaleLane = kWarp - 1;            // a lane with only one value vector

  struct Staged {
    uint4 a, b;
    uint2 s;
  };

  SGL_DEVICE static const char* page_of(const char* base, int64_t stride, int64_t row) {
    return base + (row / c4::kTokensPerPage) * stride;
  }

  SGL_DEVICE static void load(Staged& st, const char* base, int64_t stride, int64_t row, int lane) {
    const char* page = page_of(base, stride, row);
    const int64_t slot = row % c4::kTokensPerPage;
    const uint4* value = reinterpret_cast<const uint4*>(page + slot * c4::kValueBytes);
    st.a = load_ro(value + lane);
    if (lane + kWarp < kValueVecs) st.b = load_ro(value + lane + kWarp);
    if (lane == kScaleLane) {
      st.s = load_ro(reinterpret_cast<const uint2*>(page + c4::kScaleOffset + slot * c4::kScaleBytes));
    }
  }

  SGL_DEVICE static bool same(const Staged& x, const Staged& y, int lane) {
    bool eq = same_vec(x.a, y.a);
    if (lane + kWarp < kValueVecs) eq = eq && same_vec(x.b, y.b);
    if (lane == kScaleLane) eq = eq && same_vec(x.s, y.s);
    return eq;
  }

  SGL_DEVICE static void store(const Staged& st, char* base, int64_t stride, int64_t row, int lane) {
    char* page = const_cast<char*>(page_of(base, stride, row));
    const int64_t slot = row % c4::kTokensPerPage;
    uint4* value = reinterpret_cast<uint4*>(page + slot * c4::kValueBytes);
    value[lane] = st.a;
    if (lane + kWarp < kValueVecs) value[lane + kWarp] = st.b;
    if (lane == kScaleLane) {
      *reinterpret_cast<uint2*>(page + c4::kScaleOffset + slot * c4::kScaleBytes) = st.s;
    }
  }
};

// Host pools arrive as CPU (pinned) tensors; kernels need the device-side
// alias of that allocation. Under UVA it is normally the same address, but
// asking the runtime also covers cudaHostRegister'ed memory. If the runtime
// declines, the UVA identity is the best remaining answer; the Python wrapper
// has already checked that the memory is pinned.
inline const char* device_view_of_host(const void* ptr, DLDevice device) {
  if (device.device_type != kDLCPU && device.device_type != kDLCUDAHost) {
    return static_cast<const char*>(ptr);
  }
  void* dev = nullptr;
  if (cudaHostGetDevicePointer(&dev, const_cast<void*>(ptr), 0) != cudaSuccess || dev == nullptr) {
    (void)cudaGetLastError();  // do not leave a sticky error for the launch check
    return static_cast<const char*>(ptr);
  }
  return static_cast<const char*>(dev);
}

// Exclusive prefix sum of data[0..n) by one warp, in place; returns the total.
// Each lane owns a contiguous run, so only 5 shuffles are on the critical path.
SGL_DEVICE int32_t warp_scan_exclusive(int32_t* data, int n, int lane) {
  const int per = (n + kWarp - 1) / kWarp;
  const int begin = min(lane * per, n);
  const int end = min(begin + per, n);
  int32_t own = 0;
  for (int i = begin; i < end; ++i) own += data[i];
  int32_t incl = own;
#pragma unroll
  for (int d = 1; d < kWarp; d <<= 1) {
    const int32_t up = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += up;
  }
  int32_t run = incl - own;
  for (int i = begin; i < end; ++i) {
    const int32_t v = data[i];
    data[i] = run;
    run += v;
  }
  return __shfl_sync(0xffffffffu, incl, kWarp - 1);
}

}  // namespace hisparse_plugin
