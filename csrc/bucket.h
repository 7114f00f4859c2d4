// Fused bucket copies for DDP/ZeRO: pack many tensors into one flat buffer and back, with the
// 1/N scale and an optional dtype cast fused in (kernels/bucket.cu).
#pragma once

#include <ATen/core/Tensor.h>
#include <cuda_runtime_api.h>

#include <vector>

namespace pynccl {

// flat[offset_i : offset_i + n_i] = (tensors[i] * scale) cast to flat's dtype, tensors back to back.
void pack(const std::vector<at::Tensor>& tensors, const at::Tensor& flat, double scale);
// tensors[i] = (flat[offset_i : offset_i + n_i] * scale) cast to the tensors' dtype.
void unpack(const at::Tensor& flat, const std::vector<at::Tensor>& tensors, double scale);

// One validated pack (to_flat) or unpack, launched later on a stream of the caller's choosing.
// Holds references: `tensors` and `flat` must outlive it. The constructor raises
// ValueError/TypeError (naming `fn`) before anything is launched.
class BucketCopy {
 public:
  BucketCopy(const char* fn, const std::vector<at::Tensor>& tensors, const at::Tensor& flat, double scale,
             bool to_flat);
  // Enqueues the copy on `stream` (one launch per 120 tensors). A tensor that already is its
  // segment of flat, with scale 1 and the same dtype, is skipped: the copy would be the identity.
  void launch(cudaStream_t stream) const { launch_as(stream, to_flat_, scale_); }
  // The copy the other way, scale 1: the unpack of what a pack wrote (the checks are the same).
  void launch_back(cudaStream_t stream) const { launch_as(stream, !to_flat_, 1.0); }

 private:
  void launch_as(cudaStream_t stream, bool to_flat, double scale) const;
  const std::vector<at::Tensor>& tensors_;
  const at::Tensor& flat_;
  double scale_;
  bool to_flat_;
  int tensor_type_;  // kernels::ElemType
  int flat_type_;
};

}  // namespace pynccl
