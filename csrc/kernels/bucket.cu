// Fused multi-tensor copy for gradient buckets: pack many tensors into one flat buffer (or
// unpack it) with a scale and a dtype cast fused in, in one launch per 120 tensors. Each block
// copies one fixed-size chunk of one tensor; a block finds its tensor by binary search over
// the segments' first_block. Tensors whose source and destination are 16-byte aligned move with
// 16-byte vector loads (the widest of the two element types sets the vector length), also in
// their last, partial chunk; the rest move element by element, loads batched ahead of stores.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "api.cuh"

namespace pynccl {
namespace kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

struct BucketParams {
  SegmentBatch batch;
  void* flat;
  double scale;
  bool to_flat;
  bool apply_scale;
};

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// Loads widen to the compute type, stores narrow with round-to-nearest-even (what torch's .to() does).
template <typename C> __device__ __forceinline__ C widen(float x) { return static_cast<C>(x); }
template <typename C> __device__ __forceinline__ C widen(double x) { return static_cast<C>(x); }
template <typename C> __device__ __forceinline__ C widen(__half x) { return static_cast<C>(__half2float(x)); }
template <typename C> __device__ __forceinline__ C widen(__nv_bfloat16 x) { return static_cast<C>(__bfloat162float(x)); }

template <typename D> struct Narrow;
template <> struct Narrow<float> {
  template <typename C> __device__ __forceinline__ static float from(C x) { return static_cast<float>(x); }
};
template <> struct Narrow<double> {
  template <typename C> __device__ __forceinline__ static double from(C x) { return static_cast<double>(x); }
};
template <> struct Narrow<__half> {
  // NOTE: from fp64 via fp32, as c10::Half(double) does, so results match torch bit for bit.
  template <typename C> __device__ __forceinline__ static __half from(C x) { return __float2half_rn(static_cast<float>(x)); }
};
template <> struct Narrow<__nv_bfloat16> {
  template <typename C> __device__ __forceinline__ static __nv_bfloat16 from(C x) {
    return __float2bfloat16_rn(static_cast<float>(x));
  }
};

template <typename Src, typename Dst>
using ComputeT = std::conditional_t<std::is_same<Src, double>::value || std::is_same<Dst, double>::value, double, float>;

template <typename Src, typename Dst>
__device__ __forceinline__ Dst convert(Src x, bool apply_scale, ComputeT<Src, Dst> scale) {
  if constexpr (std::is_same<Src, uint8_t>::value) {
    return x;  // kBytes: a raw copy
  } else {
    ComputeT<Src, Dst> c = widen<ComputeT<Src, Dst>>(x);
    if (apply_scale) c *= scale;
    return Narrow<Dst>::from(c);
  }
}

template <typename Src, typename Dst>
constexpr int vec_len() {
  return 16 / (sizeof(Src) > sizeof(Dst) ? sizeof(Src) : sizeof(Dst));
}

// Up to kUnroll 16-byte vectors per thread: all loads are issued before the first store, so a
// thread keeps kUnroll x 16 bytes in flight. num_vec <= kThreads * kUnroll (a chunk's vectors).
template <typename Src, typename Dst, int kVec>
__device__ __forceinline__ void copy_vectors(const Src* src, Dst* dst, int num_vec, bool apply_scale,
                                             ComputeT<Src, Dst> scale) {
  const auto* src_vec = reinterpret_cast<const Vec<Src, kVec>*>(src);
  auto* dst_vec = reinterpret_cast<Vec<Dst, kVec>*>(dst);
  Vec<Src, kVec> in[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int j = u * kThreads + static_cast<int>(threadIdx.x);
    if (j < num_vec) in[u] = src_vec[j];
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int j = u * kThreads + static_cast<int>(threadIdx.x);
    if (j < num_vec) {
      Vec<Dst, kVec> out;
#pragma unroll
      for (int k = 0; k < kVec; ++k) out.v[k] = convert<Src, Dst>(in[u].v[k], apply_scale, scale);
      dst_vec[j] = out;
    }
  }
}

// Elements [begin, end) of one chunk one at a time (unaligned tensors, and the last few elements
// of a tensor); loads batched ahead of stores as above, since src and dst may alias for the
// compiler and it would otherwise wait out a memory round trip per element.
template <typename Src, typename Dst, int kBatch>
__device__ __forceinline__ void copy_scalars(const Src* src, Dst* dst, int64_t begin, int64_t end, bool apply_scale,
                                             ComputeT<Src, Dst> scale) {
  for (int64_t base = begin; base < end; base += int64_t{kThreads} * kBatch) {
    Src in[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int64_t i = base + int64_t{k} * kThreads + threadIdx.x;
      if (i < end) in[k] = src[i];
    }
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int64_t i = base + int64_t{k} * kThreads + threadIdx.x;
      if (i < end) dst[i] = convert<Src, Dst>(in[k], apply_scale, scale);
    }
  }
}

// 8 blocks of 256 threads fill an SM (<= 32 registers a thread); raw bytes (broadcasts of
// module state, not on the step's path) take 64 and spill below that.
template <typename Src>
constexpr int min_blocks_per_sm() {
  return std::is_same<Src, uint8_t>::value ? 4 : 8;
}

template <typename Src, typename Dst>
__global__ void __launch_bounds__(kThreads, min_blocks_per_sm<Src>()) bucket_copy_kernel(const __grid_constant__ BucketParams p) {
  constexpr int kVec = vec_len<Src, Dst>();
  constexpr int kChunkVecs = kThreads * kUnroll;
  constexpr int64_t kChunk = int64_t{kChunkVecs} * kVec;
  const int64_t block = blockIdx.x;
  int lo = 0;
  int hi = p.batch.num_segments - 1;
  while (lo < hi) {  // last segment whose first_block <= block
    const int mid = (lo + hi + 1) / 2;
    if (p.batch.segments[mid].first_block <= block) lo = mid; else hi = mid - 1;
  }
  const Segment& seg = p.batch.segments[lo];
  int64_t begin = (block - seg.first_block) * kChunk;
  const int64_t end = begin + kChunk < seg.numel ? begin + kChunk : seg.numel;
  const Src* src = p.to_flat ? static_cast<const Src*>(seg.tensor) : static_cast<const Src*>(p.flat) + seg.flat_offset;
  Dst* dst = p.to_flat ? static_cast<Dst*>(p.flat) + seg.flat_offset : static_cast<Dst*>(seg.tensor);
  const auto scale = static_cast<ComputeT<Src, Dst>>(p.scale);
  const bool aligned = reinterpret_cast<uintptr_t>(src) % (sizeof(Src) * kVec) == 0 &&
                       reinterpret_cast<uintptr_t>(dst) % (sizeof(Dst) * kVec) == 0;
  if (aligned) {
    // Every chunk but a tensor's last is whole vectors; the last one's vectors go the same
    // way (a bias of a few KB is one partial chunk), leaving fewer than kVec elements.
    const int num_vec = static_cast<int>((end - begin) / kVec);
    if (num_vec == kChunkVecs) {
      copy_vectors<Src, Dst, kVec>(src + begin, dst + begin, kChunkVecs, p.apply_scale, scale);
    } else {
      copy_vectors<Src, Dst, kVec>(src + begin, dst + begin, num_vec, p.apply_scale, scale);
    }
    begin += int64_t{num_vec} * kVec;
  }
  copy_scalars<Src, Dst, kUnroll>(src, dst, begin, end, p.apply_scale, scale);
}

template <typename Src, typename Dst>
cudaError_t launch(BucketParams& params, cudaStream_t stream) {
  constexpr int64_t kChunk = int64_t{kThreads} * vec_len<Src, Dst>() * kUnroll;
  int64_t num_blocks = 0;
  for (int i = 0; i < params.batch.num_segments; ++i) {
    Segment& seg = params.batch.segments[i];
    seg.first_block = num_blocks;
    num_blocks += (seg.numel + kChunk - 1) / kChunk;
  }
  if (num_blocks == 0) return cudaSuccess;
  if (num_blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  bucket_copy_kernel<Src, Dst><<<static_cast<unsigned>(num_blocks), kThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

template <typename Tensor>
cudaError_t dispatch_flat(BucketParams& params, ElemType flat_type, cudaStream_t stream) {
  // Src is what is read: the tensor when packing, flat when unpacking.
  switch (flat_type) {
#define PYNCCL_CASE(kind, T) \
  case ElemType::kind:       \
    return params.to_flat ? launch<Tensor, T>(params, stream) : launch<T, Tensor>(params, stream);
    PYNCCL_CASE(kFloat32, float)
    PYNCCL_CASE(kFloat16, __half)
    PYNCCL_CASE(kBFloat16, __nv_bfloat16)
    PYNCCL_CASE(kFloat64, double)
#undef PYNCCL_CASE
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t launch_bucket_copy(const SegmentBatch& batch, void* flat, ElemType tensor_type, ElemType flat_type, bool to_flat,
                               double scale, cudaStream_t stream) {
  BucketParams params;
  params.batch = batch;
  params.flat = flat;
  params.scale = scale;
  params.to_flat = to_flat;
  params.apply_scale = scale != 1.0;
  if (tensor_type == ElemType::kBytes || flat_type == ElemType::kBytes) {
    if (tensor_type != flat_type || params.apply_scale) return cudaErrorInvalidValue;
    return launch<uint8_t, uint8_t>(params, stream);
  }
  switch (tensor_type) {
    case ElemType::kFloat32: return dispatch_flat<float>(params, flat_type, stream);
    case ElemType::kFloat16: return dispatch_flat<__half>(params, flat_type, stream);
    case ElemType::kBFloat16: return dispatch_flat<__nv_bfloat16>(params, flat_type, stream);
    case ElemType::kFloat64: return dispatch_flat<double>(params, flat_type, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace kernels
}  // namespace pynccl
