// Communicator::reduce_bucket: one DDP gradient bucket enqueued in one call (the CUDA path of
// pynccl/ddp_reducer.py with a built-in SUM hook), so that backward's hook pays one Python->C++
// crossing per bucket instead of a stream switch, events, a pack and a collective call.
//
//   pack stream:   waits for the caller's stream; packs grads into flat (scale and cast fused)
//   comm stream:   waits for the pack stream; all-reduces flat (SUM), async; or, split, a
//                  reduce-scatter then an all-gather (copy engines on symmetric memory)
//
// Nothing here blocks the host. The returned Work's wait() orders the caller's stream after the
// all-reduce (and so after the pack); the caller keeps grads alive until then.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "bucket.h"
#include "check.h"
#include "communicator.h"
#include "dtypes.h"
#include "op_helpers.h"

namespace pynccl {

std::shared_ptr<Work> Communicator::reduce_bucket(const std::vector<at::Tensor>& grads, const at::Tensor& flat,
                                                  double scale, int64_t pack_stream, bool split_all_reduce) {
  static const char* const kFn = "reduce_bucket";
  // Every check before anything is enqueued.
  const BucketCopy pack(kFn, grads, flat, scale, /*to_flat=*/true);
  PYNCCL_CHECK_VALUE(pack_stream != 0, kFn,
                    ": pack_stream must be a side stream (torch.cuda.Stream.cuda_stream), not the legacy default "
                    "stream (0)");
  PYNCCL_CHECK_VALUE(!split_all_reduce || flat.numel() % world_size_ == 0, kFn, ": split_all_reduce needs flat's ",
                     flat.numel(), " elements to be a multiple of world_size(", world_size_, ")");
  check_usable(kFn);
  const auto device = static_cast<c10::DeviceIndex>(device_);
  c10::cuda::CUDAGuard guard(device);
  const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(device);
  const c10::cuda::CUDAStream packer =
      c10::cuda::getStreamFromExternal(reinterpret_cast<cudaStream_t>(pack_stream), device);

  // The pack stream starts after everything already queued on the caller's stream (the grads).
  order_after(packer.stream(), caller.stream());
  pack.launch(packer.stream());

  c10::cuda::CUDAStreamGuard on_packer(packer);  // the all-reduce is ordered after the pack
  if (!split_all_reduce) {
    return all_reduce_impl(kFn, flat, static_cast<int>(ReduceOp::kSum), /*async_op=*/true, 1.0, nullptr);
  }
  const TensorArg t = check_tensor(kFn, "flat", flat, device_);
  const size_t chunk = t.count / static_cast<size_t>(world_size_);
  void* const mine = static_cast<char*>(t.ptr) + chunk * static_cast<size_t>(rank_) * (t.num_bytes / t.count);
  OpScope scope(*this, kFn, t.dtype, t.numel, -1, /*async_op=*/true);
  // NOTE: two calls, not one NCCL group: the all-gather reads what the reduce-scatter wrote, and
  // only stream order guarantees that.
  // ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount,
  //                                ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
  PYNCCL_CHECK_NCCL_OP(scope, ncclReduceScatter(t.ptr, mine, chunk, t.type, ncclSum, comm_, scope.stream()));
  // ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype,
  //                            ncclComm_t comm, cudaStream_t stream);
  PYNCCL_CHECK_NCCL_OP(scope, ncclAllGather(mine, t.ptr, chunk, t.type, comm_, scope.stream()));
  scope.keep_alive(flat);
  return scope.finish();
}

}  // namespace pynccl
