// Glue of the fused bucket kernels: validates tensors (ValueError/TypeError) and fills the
// kernels' plain segment batches; the kernels themselves include no torch header.
#include "bucket.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "check.h"
#include "kernels/api.cuh"
#include "op_helpers.h"  // message text of dtypes and sizes

namespace pynccl {
namespace {

using kernels::ElemType;

ElemType elem_type(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::kFloat: return ElemType::kFloat32;
    case c10::kHalf: return ElemType::kFloat16;
    case c10::kBFloat16: return ElemType::kBFloat16;
    case c10::kDouble: return ElemType::kFloat64;
    default: return ElemType::kBytes;
  }
}

void check_dense_cuda(const char* fn, const std::string& what, const at::Tensor& t) {
  PYNCCL_CHECK_TYPE(t.defined(), fn, ": ", what, " must be a tensor, got None");
  PYNCCL_CHECK_VALUE(t.is_cuda(), fn, ": ", what, " must be a CUDA tensor, got a tensor on ", t.device().str());
  PYNCCL_CHECK_VALUE(t.layout() == c10::kStrided && t.is_contiguous(), fn, ": ", what,
                    " must be contiguous (non-contiguous tensors are rejected), got sizes ", t.sizes(), " and strides ",
                    t.strides());
}

}  // namespace

BucketCopy::BucketCopy(const char* fn, const std::vector<at::Tensor>& tensors, const at::Tensor& flat, double scale,
                       bool to_flat)
    : tensors_(tensors), flat_(flat), scale_(scale), to_flat_(to_flat) {
  check_dense_cuda(fn, "flat", flat);
  const c10::ScalarType dtype = !tensors.empty() && tensors[0].defined() ? tensors[0].scalar_type() : flat.scalar_type();
  int64_t total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::string what = "tensors[" + std::to_string(i) + "]";
    check_dense_cuda(fn, what, tensors[i]);
    PYNCCL_CHECK_VALUE(tensors[i].get_device() == flat.get_device(), fn, ": ", what, " is on ",
                      tensors[i].device().str(), ", but flat is on ", flat.device().str());
    PYNCCL_CHECK_TYPE(tensors[i].scalar_type() == dtype, fn, ": ", what, " has dtype ", tensors[i].scalar_type(),
                     ", expected ", dtype, " (the dtype of tensors[0]); one call takes one dtype");
    total += tensors[i].numel();
  }
  const ElemType tensor_type = elem_type(dtype);
  const ElemType flat_type = elem_type(flat.scalar_type());
  if (dtype != flat.scalar_type()) {
    PYNCCL_CHECK_TYPE(tensor_type != ElemType::kBytes && flat_type != ElemType::kBytes, fn, ": cannot cast between ",
                     dtype, " and ", flat.scalar_type(), " (casts are between float32, float16, bfloat16 and float64)");
  }
  if (scale != 1.0) {
    PYNCCL_CHECK_VALUE(tensor_type != ElemType::kBytes, fn, ": scale ", scale, " needs floating-point tensors, got ",
                      dtype);
  }
  PYNCCL_CHECK_VALUE(total <= flat.numel(), fn, ": tensors hold ", total, " elements in total, but flat has ",
                    flat.numel());
  tensor_type_ = static_cast<int>(tensor_type);
  flat_type_ = static_cast<int>(flat_type);
}

void BucketCopy::launch_as(cudaStream_t stream, bool to_flat, double scale) const {
  const auto tensor_type = static_cast<ElemType>(tensor_type_);
  const auto flat_type = static_cast<ElemType>(flat_type_);
  const int64_t unit = tensor_type == ElemType::kBytes ? static_cast<int64_t>(flat_.element_size()) : 1;
  const bool identity_if_aliased = scale == 1.0 && tensor_type == flat_type;
  char* const flat_bytes = static_cast<char*>(flat_.data_ptr());
  const int64_t flat_elem = static_cast<int64_t>(flat_.element_size());
  kernels::SegmentBatch batch;
  int64_t offset = 0;  // in flat's elements
  auto flush = [&] {
    if (batch.num_segments == 0) return;
    PYNCCL_CHECK_CUDA(kernels::launch_bucket_copy(batch, flat_.data_ptr(), tensor_type, flat_type, to_flat, scale,
                                                  stream));
    batch.num_segments = 0;
  };
  for (const auto& t : tensors_) {
    const int64_t numel = t.numel();
    void* const data = t.data_ptr();
    if (numel > 0 && !(identity_if_aliased && data == flat_bytes + offset * flat_elem)) {
      // kBytes: sizes and offsets in bytes (same dtype on both sides).
      batch.segments[batch.num_segments++] = kernels::Segment{data, numel * unit, offset * unit, 0};
      if (batch.num_segments == kernels::kMaxSegmentsPerLaunch) flush();
    }
    offset += numel;
  }
  flush();
}

namespace {

void copy_on_current_stream(const char* fn, const std::vector<at::Tensor>& tensors, const at::Tensor& flat,
                            double scale, bool to_flat) {
  const BucketCopy copy(fn, tensors, flat, scale, to_flat);
  c10::cuda::CUDAGuard guard(flat.device());
  copy.launch(c10::cuda::getCurrentCUDAStream(flat.get_device()).stream());
}

}  // namespace

void pack(const std::vector<at::Tensor>& tensors, const at::Tensor& flat, double scale) {
  copy_on_current_stream("pack", tensors, flat, scale, /*to_flat=*/true);
}

void unpack(const at::Tensor& flat, const std::vector<at::Tensor>& tensors, double scale) {
  copy_on_current_stream("unpack", tensors, flat, scale, /*to_flat=*/false);
}

}  // namespace pynccl
