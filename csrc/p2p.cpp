// Point-to-point ops and the collectives made of them: send/recv, batch_isend_irecv,
// all_to_all(_single), gather, scatter. NCCL >= 2.28 has native AlltoAll/Gather/Scatter; we use
// them only where every rank is sure to choose the same path (a rank's choice may depend on the
// run-time version and on its arguments' shapes, never on where its tensors happen to live).
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>

#include <numeric>

#include "communicator.h"
#include "nccl_api.h"
#include "op_helpers.h"

namespace pynccl {
namespace {

// ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer,
//                       ncclComm_t comm, cudaStream_t stream);
// ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer,
//                       ncclComm_t comm, cudaStream_t stream);

// Rows of dim 0 and elements per row; a 0-d tensor has no rows to split.
std::pair<int64_t, int64_t> rows_of(const char* fn, const char* what, const at::Tensor& t) {
  PYNCCL_CHECK_VALUE(t.dim() >= 1, fn, ": ", what, " must have at least one dimension to split, got a 0-d tensor");
  int64_t row_numel = 1;
  for (int64_t d = 1; d < t.dim(); ++d) row_numel *= t.size(d);
  return {t.size(0), row_numel};
}

// Split sizes in rows: the given ones (checked), or equal chunks when `splits` is empty.
std::vector<int64_t> resolve_splits(const char* fn, const char* what, const std::vector<int64_t>& splits,
                                    int64_t num_rows, int world_size) {
  if (splits.empty()) {
    PYNCCL_CHECK_VALUE(num_rows % world_size == 0, fn, ": ", what, " has ", num_rows,
                      " rows in dim 0, which world_size(", world_size, ") does not divide; pass split sizes");
    return std::vector<int64_t>(world_size, num_rows / world_size);
  }
  PYNCCL_CHECK_VALUE(static_cast<int>(splits.size()) == world_size, fn, ": ", what, "_split_sizes has ", splits.size(),
                    " entries, expected world_size(", world_size, ")");
  for (const int64_t s : splits) PYNCCL_CHECK_VALUE(s >= 0, fn, ": ", what, "_split_sizes has a negative entry ", s);
  const int64_t total = std::accumulate(splits.begin(), splits.end(), int64_t{0});
  PYNCCL_CHECK_VALUE(total == num_rows, fn, ": ", what, "_split_sizes sum to ", total, ", but ", what, " has ", num_rows,
                    " rows in dim 0");
  return splits;
}

}  // namespace

std::shared_ptr<Work> Communicator::send(const at::Tensor& tensor, int peer, bool async_op) {
  const TensorArg t = check_tensor("send", "tensor", tensor, device_);
  check_rank("send", "peer", peer, world_size_);
  PYNCCL_CHECK_VALUE(peer != rank_, "send: peer ", peer, " is this rank; a send to yourself needs its recv in the same "
                    "batch_isend_irecv");
  OpScope scope(*this, "send", t.dtype, t.numel, peer, async_op);
  PYNCCL_CHECK_NCCL_OP(scope, ncclSend(t.ptr, t.count, t.type, peer, comm_, scope.stream()));
  scope.keep_alive(tensor);
  return scope.finish();
}

std::shared_ptr<Work> Communicator::recv(const at::Tensor& tensor, int peer, bool async_op) {
  const TensorArg t = check_tensor("recv", "tensor", tensor, device_);
  check_rank("recv", "peer", peer, world_size_);
  PYNCCL_CHECK_VALUE(peer != rank_, "recv: peer ", peer, " is this rank; a recv from yourself needs its send in the "
                    "same batch_isend_irecv");
  OpScope scope(*this, "recv", t.dtype, t.numel, peer, async_op);
  PYNCCL_CHECK_NCCL_OP(scope, ncclRecv(t.ptr, t.count, t.type, peer, comm_, scope.stream()));
  scope.keep_alive(tensor);
  return scope.finish();
}

std::shared_ptr<Work> Communicator::batch_isend_irecv(const std::vector<std::tuple<bool, at::Tensor, int64_t>>& ops) {
  const char* fn = "batch_isend_irecv";
  PYNCCL_CHECK_VALUE(!ops.empty(), fn, ": ops is empty");
  std::vector<TensorArg> args;
  args.reserve(ops.size());
  int64_t total = 0;
  for (size_t i = 0; i < ops.size(); ++i) {
    args.push_back(check_tensor(fn, "ops.tensor", std::get<1>(ops[i]), device_, static_cast<int64_t>(i)));
    check_rank(fn, "peer", std::get<2>(ops[i]), world_size_);
    total += args.back().numel;
  }
  // NOTE: NCCL pairs the n-th send to a peer with the n-th recv from it. To this rank both are in
  // this batch: an unpaired one never completes, or (seen at world size 1) NCCL completes the
  // recv with nothing received. Refused here, before NCCL sees it.
  std::vector<size_t> self_sends;
  std::vector<size_t> self_recvs;
  for (size_t i = 0; i < ops.size(); ++i) {
    if (std::get<2>(ops[i]) == rank_) (std::get<0>(ops[i]) ? self_sends : self_recvs).push_back(args[i].num_bytes);
  }
  PYNCCL_CHECK_VALUE(self_sends == self_recvs, fn, ": ", self_sends.size(), " send(s) to this rank (", rank_, ") and ",
                    self_recvs.size(), " recv(s) from it; each send to yourself needs a recv of the same size, in the "
                    "same order, in the same batch");
  OpScope scope(*this, fn, args[0].dtype, total, ops.size() == 1 ? static_cast<int>(std::get<2>(ops[0])) : -1,
                /*async_op=*/true);
  {
    NcclGroup group;
    for (size_t i = 0; i < ops.size(); ++i) {
      const int peer = static_cast<int>(std::get<2>(ops[i]));
      if (std::get<0>(ops[i])) {
        PYNCCL_CHECK_NCCL_OP(scope, ncclSend(args[i].ptr, args[i].count, args[i].type, peer, comm_, scope.stream()));
      } else {
        PYNCCL_CHECK_NCCL_OP(scope, ncclRecv(args[i].ptr, args[i].count, args[i].type, peer, comm_, scope.stream()));
      }
    }
    PYNCCL_CHECK_NCCL_OP(scope, group.end());
  }
  for (const auto& op : ops) scope.keep_alive(std::get<1>(op));
  return scope.finish();
}

std::shared_ptr<Work> Communicator::all_to_all(const std::vector<at::Tensor>& outputs,
                                               const std::vector<at::Tensor>& inputs, bool async_op) {
  const char* fn = "all_to_all";
  PYNCCL_CHECK_VALUE(static_cast<int>(inputs.size()) == world_size_, fn, ": input_list has ", inputs.size(),
                    " tensors, expected world_size(", world_size_, ")");
  PYNCCL_CHECK_VALUE(static_cast<int>(outputs.size()) == world_size_, fn, ": output_list has ", outputs.size(),
                    " tensors, expected world_size(", world_size_, ")");
  std::vector<TensorArg> ins;
  std::vector<TensorArg> outs;
  int64_t total = 0;
  for (int r = 0; r < world_size_; ++r) {
    ins.push_back(check_tensor(fn, "input_list", inputs[r], device_, r));
    outs.push_back(check_tensor(fn, "output_list", outputs[r], device_, r));
    check_same_dtype(fn, arg_name("input_list", r), ins[r], "input_list[0]", ins[0]);
    check_same_dtype(fn, arg_name("output_list", r), outs[r], "input_list[0]", ins[0]);
    total += ins[r].numel;
  }
  OpScope scope(*this, fn, ins[0].dtype, total, -1, async_op);
  {
    // NOTE: sizes may differ per peer (inputs[r] on this rank must match outputs[rank] on r).
    NcclGroup group;
    for (int r = 0; r < world_size_; ++r) {
      PYNCCL_CHECK_NCCL_OP(scope, ncclSend(ins[r].ptr, ins[r].count, ins[r].type, r, comm_, scope.stream()));
      PYNCCL_CHECK_NCCL_OP(scope, ncclRecv(outs[r].ptr, outs[r].count, outs[r].type, r, comm_, scope.stream()));
    }
    PYNCCL_CHECK_NCCL_OP(scope, group.end());
  }
  for (const auto& t : inputs) scope.keep_alive(t);
  for (const auto& t : outputs) scope.keep_alive(t);
  return scope.finish();
}

std::shared_ptr<Work> Communicator::all_to_all_single(const at::Tensor& output, const at::Tensor& input,
                                                      const std::vector<int64_t>& output_splits,
                                                      const std::vector<int64_t>& input_splits, bool async_op) {
  const char* fn = "all_to_all_single";
  const TensorArg in = check_tensor(fn, "input", input, device_);
  const TensorArg out = check_tensor(fn, "output", output, device_);
  check_same_dtype(fn, "output", out, "input", in);
  const auto [in_rows, in_row_numel] = rows_of(fn, "input", input);
  const auto [out_rows, out_row_numel] = rows_of(fn, "output", output);
  PYNCCL_CHECK_VALUE(in_row_numel == out_row_numel, fn, ": output rows have ", out_row_numel,
                    " elements, input rows have ", in_row_numel, "; they must match");
  const bool equal = input_splits.empty() && output_splits.empty();
  if (equal) {
    PYNCCL_CHECK_VALUE(out.numel == in.numel, fn, ": without split sizes, output must have as many elements as input, "
                      "got output ", out.numel, " and input ", in.numel);
  }
  const std::vector<int64_t> in_splits = resolve_splits(fn, "input", input_splits, in_rows, world_size_);
  const std::vector<int64_t> out_splits = resolve_splits(fn, "output", output_splits, out_rows, world_size_);
  const AlltoAllFn native = use_native_alltoall_ ? optional_nccl_api().alltoall : nullptr;

  OpScope scope(*this, fn, in.dtype, in.numel, -1, async_op);
  const size_t per_element = c10::isComplexType(in.dtype) ? 2 : 1;  // complex travels as pairs of reals
  const size_t row_count = per_element * static_cast<size_t>(in_row_numel);  // NCCL elements per row
  const size_t row_bytes = static_cast<size_t>(in_row_numel) * input.element_size();
  if (equal && native != nullptr) {
    // NOTE: every rank passed no splits, so every rank takes this path.
    // ncclResult_t ncclAlltoAll(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
    //                           ncclComm_t comm, cudaStream_t stream);
    PYNCCL_CHECK_NCCL_OP(scope, native(in.ptr, out.ptr, row_count * in_splits[0], in.type, comm_, scope.stream()));
  } else {
    NcclGroup group;
    size_t in_offset = 0;
    size_t out_offset = 0;
    for (int r = 0; r < world_size_; ++r) {
      const char* send_ptr = static_cast<const char*>(in.ptr) + in_offset * row_bytes;
      char* recv_ptr = static_cast<char*>(out.ptr) + out_offset * row_bytes;
      PYNCCL_CHECK_NCCL_OP(scope, ncclSend(send_ptr, row_count * in_splits[r], in.type, r, comm_, scope.stream()));
      PYNCCL_CHECK_NCCL_OP(scope, ncclRecv(recv_ptr, row_count * out_splits[r], in.type, r, comm_, scope.stream()));
      in_offset += in_splits[r];
      out_offset += out_splits[r];
    }
    PYNCCL_CHECK_NCCL_OP(scope, group.end());
  }
  scope.keep_alive(input);
  scope.keep_alive(output);
  return scope.finish();
}

std::shared_ptr<Work> Communicator::gather(const at::Tensor& input, const std::vector<at::Tensor>& gather_list,
                                           int root, bool async_op) {
  const char* fn = "gather";
  const TensorArg in = check_tensor(fn, "input", input, device_);
  check_rank(fn, "root", root, world_size_);
  const bool is_root = rank_ == root;
  std::vector<TensorArg> outs;
  if (is_root) {
    outs = check_tensor_list(fn, "gather_list", gather_list, device_, world_size_, "input", in);
  } else {
    PYNCCL_CHECK_VALUE(gather_list.empty(), fn, ": gather_list must be empty on non-root ranks (rank ", rank_,
                      ", root ", root, "), got ", gather_list.size(), " tensors");
  }
  const RootedFn native = use_native_alltoall_ ? optional_nccl_api().gather : nullptr;
  OpScope scope(*this, fn, in.dtype, in.numel, root, async_op);
  if (native != nullptr) {
    void* recv_ptr = nullptr;
    at::Tensor staging;  // the root's contiguous receive buffer when gather_list is not one already
    if (is_root && back_to_back(outs)) {
      recv_ptr = outs[0].ptr;
    } else if (is_root) {
      // NOTE: allocated with the op's stream current, so the caching allocator orders its reuse after the op.
      c10::cuda::CUDAStreamGuard stream_guard(scope.cuda_stream());
      staging = at::empty({in.numel * world_size_}, input.options());
      recv_ptr = staging.data_ptr();
    }
    // ncclResult_t ncclGather(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
    //                         int root, ncclComm_t comm, cudaStream_t stream);
    PYNCCL_CHECK_NCCL_OP(scope, native(in.ptr, recv_ptr, in.count, in.type, root, comm_, scope.stream()));
    if (staging.defined()) {
      for (int r = 0; r < world_size_; ++r) {
        PYNCCL_CHECK_CUDA(cudaMemcpyAsync(outs[r].ptr, static_cast<char*>(recv_ptr) + r * in.num_bytes, in.num_bytes,
                                          cudaMemcpyDeviceToDevice, scope.stream()));
      }
    }
  } else {
    NcclGroup group;
    if (is_root) {
      for (int r = 0; r < world_size_; ++r) {
        PYNCCL_CHECK_NCCL_OP(scope, ncclRecv(outs[r].ptr, outs[r].count, in.type, r, comm_, scope.stream()));
      }
    }
    PYNCCL_CHECK_NCCL_OP(scope, ncclSend(in.ptr, in.count, in.type, root, comm_, scope.stream()));
    PYNCCL_CHECK_NCCL_OP(scope, group.end());
  }
  scope.keep_alive(input);
  for (const auto& t : gather_list) scope.keep_alive(t);
  return scope.finish();
}

std::shared_ptr<Work> Communicator::scatter(const at::Tensor& output, const std::vector<at::Tensor>& scatter_list,
                                            int root, bool async_op) {
  const char* fn = "scatter";
  const TensorArg out = check_tensor(fn, "output", output, device_);
  check_rank(fn, "root", root, world_size_);
  const bool is_root = rank_ == root;
  std::vector<TensorArg> ins;
  if (is_root) {
    ins = check_tensor_list(fn, "scatter_list", scatter_list, device_, world_size_, "output", out);
  } else {
    PYNCCL_CHECK_VALUE(scatter_list.empty(), fn, ": scatter_list must be empty on non-root ranks (rank ", rank_,
                      ", root ", root, "), got ", scatter_list.size(), " tensors");
  }
  const RootedFn native = use_native_alltoall_ ? optional_nccl_api().scatter : nullptr;
  OpScope scope(*this, fn, out.dtype, out.numel, root, async_op);
  if (native != nullptr) {
    const void* send_ptr = nullptr;
    at::Tensor staging;
    if (is_root && back_to_back(ins)) {
      send_ptr = ins[0].ptr;
    } else if (is_root) {
      c10::cuda::CUDAStreamGuard stream_guard(scope.cuda_stream());
      staging = at::empty({out.numel * world_size_}, output.options());
      for (int r = 0; r < world_size_; ++r) {
        PYNCCL_CHECK_CUDA(cudaMemcpyAsync(static_cast<char*>(staging.data_ptr()) + r * out.num_bytes, ins[r].ptr,
                                          out.num_bytes, cudaMemcpyDeviceToDevice, scope.stream()));
      }
      send_ptr = staging.data_ptr();
    }
    // ncclResult_t ncclScatter(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
    //                          int root, ncclComm_t comm, cudaStream_t stream);
    PYNCCL_CHECK_NCCL_OP(scope, native(send_ptr, out.ptr, out.count, out.type, root, comm_, scope.stream()));
  } else {
    NcclGroup group;
    if (is_root) {
      for (int r = 0; r < world_size_; ++r) {
        PYNCCL_CHECK_NCCL_OP(scope, ncclSend(ins[r].ptr, ins[r].count, out.type, r, comm_, scope.stream()));
      }
    }
    PYNCCL_CHECK_NCCL_OP(scope, ncclRecv(out.ptr, out.count, out.type, root, comm_, scope.stream()));
    PYNCCL_CHECK_NCCL_OP(scope, group.end());
  }
  scope.keep_alive(output);
  for (const auto& t : scatter_list) scope.keep_alive(t);
  return scope.finish();
}

}  // namespace pynccl
