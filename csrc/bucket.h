// Fused bucket copies for DDP/ZeRO: pack many tensors into one flat buffer and back, with the
// 1/N scale and an optional dtype cast fused in, on the current stream (kernels/bucket.cu).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace pynccl {

// flat[offset_i : offset_i + n_i] = (tensors[i] * scale) cast to flat's dtype, tensors back to back.
void pack(const std::vector<at::Tensor>& tensors, const at::Tensor& flat, double scale);
// tensors[i] = (flat[offset_i : offset_i + n_i] * scale) cast to the tensors' dtype.
void unpack(const at::Tensor& flat, const std::vector<at::Tensor>& tensors, double scale);

}  // namespace pynccl
