// Communicator::reduce_bucket: one DDP gradient bucket enqueued in one call (the CUDA path of
// pynccl/ddp/reducer.py with a built-in SUM hook), so that backward's hook pays one Python->C++
// crossing per bucket instead of a stream switch, events, a pack and a collective call.
//
//   pack stream:   waits for the caller's stream; packs grads into flat (scale and cast fused);
//                  or, copy_pack, copies them on the copy engines unscaled (no SM beside backward)
//                  and each rank scales its reduced shard between the reduce-scatter and the
//                  all-gather (a kernel over 1/world of the bytes, on the comm stream)
//   comm stream:   waits for the pack stream; all-reduces flat (SUM), async; or, split, a
//                  reduce-scatter then an all-gather (copy engines on symmetric memory); or,
//                  split with `scratch`, the reduce-scatter as an all-to-all into scratch (copy
//                  engines on symmetric memory) and one local sum of the world slices it holds
//   unpack stream: (optional) waits for the collective; copies flat back into grads (scale 1),
//                  so that the caller's end of backward only joins streams (issue 26)
//
// With chunks > 1 the three stages run as a pipeline over slices of flat: chunk k's pack,
// collective and unpack each start as soon as the stage before them finished chunk k, so chunk
// k's unpack overlaps chunk k+1's collective (meant for a big last bucket, whose collective and
// unpack are otherwise exposed after backward). Every element is still reduced once, by SUM.
//
// The all-to-all form (issue 26, session 15; comm_path "copy_engine_a2a"): in profiles on 4xH100
// a 28 MB bucket's symmetric reduce-scatter (ReduceScatter_LD) ran 1.2 ms beside backward's GEMMs
// (0.07 ms for the copy-engine all-gather of the same bytes) and the GEMMs ran +2.1 ms a step. Here
// the copy engines move the bytes with no SM and the sum is one short memory-bound kernel that
// waits for no peer; each rank sums its own shard in rank order (deterministic), then the
// all-gather hands every rank the same values. Measured no faster in the step than the symmetric
// reduce-scatter (benchmarks/RESULTS.md), so it is an option, not the default.
//
// Nothing here blocks the host. The returned Work's wait() orders the caller's stream after the
// collective and the unpack (the comm stream joins the unpack stream before the Work's event);
// the Work keeps flat and, with an unpack, grads alive until then.
#include <ATen/ops/sum.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <optional>

#include "bucket.h"
#include "check.h"
#include "communicator.h"
#include "dtypes.h"
#include "nccl_api.h"
#include "op_helpers.h"

namespace pynccl {
namespace {

// Chunk boundaries are multiples of this many elements times the world size: the split
// collective needs multiples of the world size, and aligned slices keep NCCL's vector paths.
constexpr int64_t kChunkAlignElements = 256;

// The parts of `grads` (laid back to back from element 0 of flat) that fall in [lo, hi), as
// flat views of the grads; a tensor cut by a boundary contributes a slice.
std::vector<at::Tensor> grads_in_range(const std::vector<at::Tensor>& grads, int64_t lo, int64_t hi) {
  std::vector<at::Tensor> parts;
  int64_t offset = 0;
  for (const auto& g : grads) {
    const int64_t n = g.numel();
    const int64_t begin = std::max(lo, offset);
    const int64_t end = std::min(hi, offset + n);
    if (begin < end) {
      parts.push_back(begin == offset && end == offset + n ? g : g.view({-1}).narrow(0, begin - offset, end - begin));
    }
    offset += n;
    if (offset >= hi) break;
  }
  return parts;
}

// copy_pack's pack of `parts` (back to back from element 0 of `slice`) on `stream`: a copy-engine
// copy per gradient, torch's copy kernel where the dtype differs or the gradient is strided, nothing
// where the gradient already is its slot (a bucket view). No scale: the caller scales the shard.
void pack_on_copy_engines(const std::vector<at::Tensor>& parts, const at::Tensor& slice, cudaStream_t stream,
                          c10::DeviceIndex device) {
  int64_t offset = 0;
  for (const auto& g : parts) {
    const int64_t n = g.numel();
    const at::Tensor dst = slice.narrow(0, offset, n);
    offset += n;
    if (n == 0 || g.data_ptr() == dst.data_ptr()) continue;
    if (g.scalar_type() == slice.scalar_type() && g.is_contiguous()) {
      C10_CUDA_CHECK(cudaMemcpyAsync(dst.data_ptr(), g.data_ptr(), static_cast<size_t>(n) * g.element_size(),
                                     cudaMemcpyDeviceToDevice, stream));
    } else {
      const c10::cuda::CUDAStreamGuard on_stream(c10::cuda::getStreamFromExternal(stream, device));
      dst.view(g.sizes()).copy_(g);
    }
  }
}

}  // namespace

std::shared_ptr<Work> Communicator::reduce_bucket(const std::vector<at::Tensor>& grads, const at::Tensor& flat,
                                                  double scale, int64_t pack_stream, bool split_all_reduce,
                                                  int64_t unpack_stream, int64_t chunks,
                                                  const std::optional<at::Tensor>& scratch, bool copy_pack) {
  static const char* const kFn = "reduce_bucket";
  // Every check before anything is enqueued (the unpack's are the pack's: same tensors, casts back).
  const BucketCopy pack_all(kFn, grads, flat, scale, /*to_flat=*/true);
  PYNCCL_CHECK_VALUE(pack_stream != 0, kFn,
                    ": pack_stream must be a side stream (torch.cuda.Stream.cuda_stream), not the legacy default "
                    "stream (0)");
  PYNCCL_CHECK_VALUE(chunks >= 1, kFn, ": chunks must be >= 1, got ", chunks);
  PYNCCL_CHECK_VALUE(!copy_pack || split_all_reduce, kFn, ": copy_pack (the shard scaled between the reduce-scatter "
                     "and the all-gather) needs split_all_reduce=True");
  PYNCCL_CHECK_VALUE(!split_all_reduce || flat.numel() % world_size_ == 0, kFn, ": split_all_reduce needs flat's ",
                     flat.numel(), " elements to be a multiple of world_size(", world_size_, ")");
  const TensorArg t = check_tensor(kFn, "flat", flat, device_);
  const bool all_to_all = scratch.has_value() && scratch->defined();
  if (all_to_all) {
    PYNCCL_CHECK_VALUE(split_all_reduce, kFn, ": scratch (the all-to-all form of the reduce-scatter) needs "
                       "split_all_reduce=True");
    PYNCCL_CHECK_VALUE(optional_nccl_api().alltoall != nullptr, kFn, ": scratch needs ncclAlltoAll (NCCL >= 2.28), "
                       "the loaded library is ", nccl_version_string(nccl_runtime_version()));
    check_tensor(kFn, "scratch", *scratch, device_);
    PYNCCL_CHECK_TYPE(scratch->scalar_type() == flat.scalar_type(), kFn, ": scratch has dtype ",
                      scratch->scalar_type(), ", flat has ", flat.scalar_type(), "; they must match");
    PYNCCL_CHECK_VALUE(scratch->numel() >= std::min<int64_t>(flat.numel(), kChunkAlignElements * world_size_), kFn,
                       ": scratch has ", scratch->numel(), " elements; it needs at least min(flat's ", flat.numel(),
                       ", 256 x world_size = ", kChunkAlignElements * world_size_, ")");
  }
  check_usable(kFn);
  const auto device = static_cast<c10::DeviceIndex>(device_);
  c10::cuda::CUDAGuard guard(device);
  const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(device);
  const cudaStream_t packer =
      c10::cuda::getStreamFromExternal(reinterpret_cast<cudaStream_t>(pack_stream), device).stream();
  const cudaStream_t unpacker =
      unpack_stream == 0
          ? nullptr
          : c10::cuda::getStreamFromExternal(reinterpret_cast<cudaStream_t>(unpack_stream), device).stream();

  // The pack stream starts after everything already queued on the caller's stream (the grads).
  order_after(packer, caller.stream());
  OpScope scope(*this, kFn, t.dtype, t.numel, -1, /*async_op=*/true);
  const cudaStream_t comm = scope.stream();
  const int64_t align = kChunkAlignElements * world_size_;
  const int64_t numel = flat.numel();
  int64_t step = chunks == 1 ? numel : std::max(align, (numel / chunks + align - 1) / align * align);
  if (all_to_all && step > scratch->numel()) {
    step = std::max(align, scratch->numel() / align * align);  // a bigger bucket goes through scratch in slices
  }
  const int64_t elem_count = t.numel == 0 ? 1 : static_cast<int64_t>(t.count) / t.numel;  // NCCL elements per element
  const size_t elem_bytes = static_cast<size_t>(flat.element_size());
  for (int64_t lo = 0; lo < numel || lo == 0; lo += step) {
    const int64_t hi = std::min(numel, lo + step);
    const bool whole = lo == 0 && hi == numel;
    const at::Tensor slice = whole ? flat : flat.narrow(0, lo, hi - lo);
    const std::vector<at::Tensor> parts = whole ? std::vector<at::Tensor>() : grads_in_range(grads, lo, hi);
    std::optional<BucketCopy> part_copy;  // a slice of the bucket: its own (new) tensor views
    const BucketCopy& copy = whole ? pack_all : part_copy.emplace(kFn, parts, slice, scale, /*to_flat=*/true);
    if (copy_pack) {
      pack_on_copy_engines(whole ? grads : parts, slice, packer, device);
    } else {
      copy.launch(packer);
    }
    order_after(comm, packer);  // this chunk's collective after its pack
    char* const base = static_cast<char*>(t.ptr) + static_cast<size_t>(lo) * elem_bytes;
    const size_t count = static_cast<size_t>((hi - lo) * elem_count);
    if (!split_all_reduce) {
      // ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
      //                            ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
      PYNCCL_CHECK_NCCL_OP(scope, ncclAllReduce(base, base, count, t.type, ncclSum, comm_, comm));
    } else {
      const size_t chunk = count / static_cast<size_t>(world_size_);
      void* const mine = base + chunk * static_cast<size_t>(rank_) * (t.num_bytes / t.count);
      // NOTE: two calls, not one NCCL group: the all-gather reads what the reduce-scatter wrote,
      // and only stream order guarantees that.
      if (all_to_all) {
        // ncclResult_t ncclAlltoAll(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
        //                           ncclComm_t comm, cudaStream_t stream);
        PYNCCL_CHECK_NCCL_OP(scope, optional_nccl_api().alltoall(base, scratch->data_ptr(), chunk, t.type, comm_, comm));
        // scratch now holds every rank's copy of this rank's shard, rank after rank: their sum
        // (in rank order; fp32 accumulation for 16-bit types) is the reduced shard.
        const int64_t shard = (hi - lo) / world_size_;
        at::Tensor out = slice.narrow(0, shard * rank_, shard);
        const c10::cuda::CUDAStreamGuard on_comm(c10::cuda::getStreamFromExternal(comm, device));
        const int64_t rank_dim[] = {0};
        at::sum_out(out, scratch->narrow(0, 0, hi - lo).view({world_size_, shard}), at::IntArrayRef(rank_dim));
        if (copy_pack && scale != 1.0) out.mul_(scale);
      } else {
        // ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount,
        //                                ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
        //                                cudaStream_t stream);
        PYNCCL_CHECK_NCCL_OP(scope, ncclReduceScatter(base, mine, chunk, t.type, ncclSum, comm_, comm));
        if (copy_pack && scale != 1.0) {
          // the pack left the scale out: this rank's reduced shard takes it (as every rank's does)
          const int64_t shard = (hi - lo) / world_size_;
          const c10::cuda::CUDAStreamGuard on_comm(c10::cuda::getStreamFromExternal(comm, device));
          slice.narrow(0, shard * rank_, shard).mul_(scale);
        }
      }
      // ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype,
      //                            ncclComm_t comm, cudaStream_t stream);
      PYNCCL_CHECK_NCCL_OP(scope, ncclAllGather(mine, base, chunk, t.type, comm_, comm));
    }
    if (unpacker != nullptr) {
      order_after(unpacker, comm);  // this chunk's unpack after its collective
      copy.launch_back(unpacker);
    }
    if (hi == numel) break;
  }
  if (unpacker != nullptr) {
    order_after(comm, unpacker);  // the Work's event (recorded on comm) covers the unpacks
    for (const auto& g : grads) scope.keep_alive(g);
  }
  scope.keep_alive(flat);
  if (all_to_all) scope.keep_alive(*scratch);
  return scope.finish();
}

}  // namespace pynccl
