// Launchers of the fused bucket kernels (bucket.cu). No torch headers on this side: the glue
// in csrc/bucket.cpp validates tensors and fills these plain structs. One launch copies up to
// kMaxSegmentsPerLaunch tensors; their addresses travel as kernel parameters (no H2D copy),
// which keeps the launch graph-capturable.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace pynccl {
namespace kernels {

// Element types the kernels convert between; kBytes is a raw copy (no cast, no scale).
enum class ElemType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat64 = 3, kBytes = 4 };

struct Segment {
  void* tensor;         // the tensor's data (contiguous)
  int64_t numel;        // elements (bytes for kBytes)
  int64_t flat_offset;  // where it starts in flat, in flat's elements (bytes for kBytes)
  int64_t first_block;  // filled by the launcher
};

// NOTE: 120 segments x 32 bytes + header stays under the 4 KiB kernel-parameter limit.
constexpr int kMaxSegmentsPerLaunch = 120;

struct SegmentBatch {
  Segment segments[kMaxSegmentsPerLaunch];
  int num_segments = 0;
};

// to_flat (pack):     flat[offset + i] = flat_type(tensor[i] * scale)
// !to_flat (unpack):  tensor[i] = tensor_type(flat[offset + i] * scale)
// The product is computed in fp32, or fp64 when either side is fp64; scale == 1 skips it.
// Returns the launch's cudaError_t (cudaSuccess, or the error of cudaGetLastError()).
cudaError_t launch_bucket_copy(const SegmentBatch& batch, void* flat, ElemType tensor_type, ElemType flat_type,
                               bool to_flat, double scale, cudaStream_t stream);

}  // namespace kernels
}  // namespace pynccl
