// The reducing and gathering collectives and barrier. Every op: checks (op_helpers.h) before
// NCCL, one OpScope (stream, flight record, watchdog), the NCCL call(s), finish(). List forms
// write straight into the caller's tensors through a group of rooted calls, so every rank
// takes the same path whatever its tensors' addresses.
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <cstring>

#include "communicator.h"
#include "op_helpers.h"

namespace pynccl {
namespace {

constexpr ncclRedOp_t kPremulMarker = ncclNumOps;  // "create a PreMulSum op for this call"

// Validates `op` for `dtype`: ValueError for an unknown op or a float-only op on integers.
ncclRedOp_t builtin_op(const char* fn, int op, c10::ScalarType dtype) {
  PYNCCL_CHECK_VALUE(op >= 0 && op < kNumReduceOps, fn, ": op must be a pynccl.ReduceOp (0..", kNumReduceOps - 1,
                    "), got ", op);
  const auto reduce_op = static_cast<ReduceOp>(op);
  PYNCCL_CHECK_VALUE(reduce_op != ReduceOp::kBand && reduce_op != ReduceOp::kBor && reduce_op != ReduceOp::kBxor, fn,
                     ": ReduceOp.", reduce_op_name(op), " is not supported by NCCL (nor by torch's nccl backend); "
                     "use the gloo backend for bitwise reductions");
  if (reduce_op == ReduceOp::kAvg || reduce_op == ReduceOp::kPremulSum) {
    PYNCCL_CHECK_VALUE(is_floating_for_reduce(dtype), fn, ": ReduceOp.", reduce_op_name(op),
                      " needs a floating-point tensor, got ", dtype);
  }
  if (c10::isComplexType(dtype)) {
    PYNCCL_CHECK_VALUE(reduce_op == ReduceOp::kSum || reduce_op == ReduceOp::kAvg || reduce_op == ReduceOp::kPremulSum,
                      fn, ": ReduceOp.", reduce_op_name(op), " is not defined for complex tensors (", dtype, ")");
  }
  switch (reduce_op) {
    case ReduceOp::kSum: return dtype == c10::kBool ? ncclMax : ncclSum;  // bool: logical or
    case ReduceOp::kProduct: return dtype == c10::kBool ? ncclMin : ncclProd;  // bool: logical and
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kMin: return ncclMin;
    case ReduceOp::kAvg: return ncclAvg;
    case ReduceOp::kPremulSum: return kPremulMarker;
    case ReduceOp::kBand:
    case ReduceOp::kBor:
    case ReduceOp::kBxor: break;  // refused above
  }
  return ncclSum;
}

// The op handed to NCCL. A PREMUL_SUM op is created for the call, with the factor as a host
// immediate of the tensor's type, and destroyed once enqueued (allowed by NCCL; also under
// graph capture, which bakes the factor into the graph).
class ScopedRedOp {
 public:
  ScopedRedOp(ncclRedOp_t builtin, double factor, c10::ScalarType dtype, ncclDataType_t type, ncclComm_t comm,
              const Communicator& owner)
      : op_(builtin), owner_(owner) {
    if (builtin != kPremulMarker) return;
    alignas(8) unsigned char scalar[8] = {};
    switch (dtype) {
      case c10::kFloat:
      case c10::kComplexFloat: store(scalar, static_cast<float>(factor)); break;
      case c10::kDouble:
      case c10::kComplexDouble: store(scalar, factor); break;
      case c10::kHalf: store(scalar, c10::Half(static_cast<float>(factor))); break;
      case c10::kBFloat16: store(scalar, c10::BFloat16(static_cast<float>(factor))); break;
      case c10::kFloat8_e4m3fn: store(scalar, c10::Float8_e4m3fn(static_cast<float>(factor))); break;
      case c10::kFloat8_e5m2: store(scalar, c10::Float8_e5m2(static_cast<float>(factor))); break;
      default: PYNCCL_CHECK_VALUE(false, "ReduceOp.PREMUL_SUM needs a floating-point tensor, got ", dtype);
    }
    // ncclResult_t ncclRedOpCreatePreMulSum(ncclRedOp_t *op, void *scalar, ncclDataType_t datatype,
    //                                       ncclScalarResidence_t residence, ncclComm_t comm);
    PYNCCL_CHECK_NCCL(ncclRedOpCreatePreMulSum(&op_, scalar, type, ncclScalarHostImmediate, comm));
    comm_ = comm;
  }
  ~ScopedRedOp() {
    // NOTE: a call that timed out aborts (and frees) the communicator before this runs;
    // ncclCommAbort has freed the op with it, and comm_ is dangling then.
    // ncclResult_t ncclRedOpDestroy(ncclRedOp_t op, ncclComm_t comm);
    if (comm_ != nullptr && !owner_.is_aborted()) (void)ncclRedOpDestroy(op_, comm_);
  }
  ScopedRedOp(const ScopedRedOp&) = delete;
  ScopedRedOp& operator=(const ScopedRedOp&) = delete;
  ncclRedOp_t get() const { return op_; }

 private:
  template <typename T>
  static void store(unsigned char* dst, T value) {
    static_assert(sizeof(T) <= 8, "scalar too large");
    std::memcpy(dst, &value, sizeof(T));
  }
  ncclRedOp_t op_;
  ncclComm_t comm_ = nullptr;
  const Communicator& owner_;
};

}  // namespace

std::shared_ptr<Work> Communicator::all_reduce(const at::Tensor& tensor, int op, bool async_op, double premul_factor,
                                             const at::Tensor* output) {
  return all_reduce_impl("all_reduce", tensor, op, async_op, premul_factor, output);
}

std::shared_ptr<Work> Communicator::all_reduce_impl(const char* fn, const at::Tensor& tensor, int op, bool async_op,
                                                    double premul_factor, const at::Tensor* output) {
  const TensorArg t = check_tensor(fn, "tensor", tensor, device_);
  void* const recv = output == nullptr ? t.ptr : check_output(fn, *output, t, device_).ptr;
  const ncclRedOp_t builtin = builtin_op(fn, op, t.dtype);
  OpScope scope(*this, fn, t.dtype, t.numel, -1, async_op);
  const ScopedRedOp red(builtin, premul_factor, t.dtype, t.type, comm_, *this);
  // ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
  //                            ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
  PYNCCL_CHECK_NCCL_OP(scope, ncclAllReduce(t.ptr, recv, t.count, t.type, red.get(), comm_, scope.stream()));
  scope.keep_alive(tensor);
  if (output != nullptr) scope.keep_alive(*output);
  return scope.finish();
}

std::shared_ptr<Work> Communicator::broadcast(const at::Tensor& tensor, int root, bool async_op,
                                            const at::Tensor* output) {
  const TensorArg t = check_tensor("broadcast", "tensor", tensor, device_);
  void* const recv = output == nullptr ? t.ptr : check_output("broadcast", *output, t, device_).ptr;
  check_rank("broadcast", "root", root, world_size_);
  OpScope scope(*this, "broadcast", t.dtype, t.numel, root, async_op);
  // ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
  //                            int root, ncclComm_t comm, cudaStream_t stream);
  PYNCCL_CHECK_NCCL_OP(scope, ncclBroadcast(t.ptr, recv, t.count, t.type, root, comm_, scope.stream()));
  scope.keep_alive(tensor);
  if (output != nullptr) scope.keep_alive(*output);
  return scope.finish();
}

std::shared_ptr<Work> Communicator::reduce(const at::Tensor& tensor, int root, int op, bool async_op,
                                           double premul_factor, const at::Tensor* output) {
  const TensorArg t = check_tensor("reduce", "tensor", tensor, device_);
  // NOTE: checked on every rank (one contract), though NCCL writes recvbuff only on the root.
  void* const recv = output == nullptr ? t.ptr : check_output("reduce", *output, t, device_).ptr;
  check_rank("reduce", "root", root, world_size_);
  const ncclRedOp_t builtin = builtin_op("reduce", op, t.dtype);
  OpScope scope(*this, "reduce", t.dtype, t.numel, root, async_op);
  const ScopedRedOp red(builtin, premul_factor, t.dtype, t.type, comm_, *this);
  // ncclResult_t ncclReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
  //                         ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream);
  PYNCCL_CHECK_NCCL_OP(scope, ncclReduce(t.ptr, recv, t.count, t.type, red.get(), root, comm_, scope.stream()));
  scope.keep_alive(tensor);
  if (output != nullptr) scope.keep_alive(*output);
  return scope.finish();
}

std::shared_ptr<Work> Communicator::all_gather(const std::vector<at::Tensor>& outputs, const at::Tensor& input,
                                               bool async_op) {
  const TensorArg in = check_tensor("all_gather", "input", input, device_);
  const std::vector<TensorArg> outs =
      check_tensor_list("all_gather", "output_list", outputs, device_, world_size_, "input", in);
  OpScope scope(*this, "all_gather", in.dtype, in.numel, -1, async_op);
  {
    // NOTE: one broadcast per rank, all in one group: every rank takes this path, and rank r's
    // data lands in outputs[r] directly, wherever the caller's tensors live.
    NcclGroup group;
    for (int r = 0; r < world_size_; ++r) {
      PYNCCL_CHECK_NCCL_OP(scope, ncclBroadcast(in.ptr, outs[r].ptr, in.count, in.type, r, comm_, scope.stream()));
    }
    PYNCCL_CHECK_NCCL_OP(scope, group.end());
  }
  scope.keep_alive(input);
  for (const auto& t : outputs) scope.keep_alive(t);
  return scope.finish();
}

std::shared_ptr<Work> Communicator::all_gather_into_tensor(const at::Tensor& output, const at::Tensor& input,
                                                           bool async_op) {
  const char* fn = "all_gather_into_tensor";
  const TensorArg in = check_tensor(fn, "input", input, device_);
  const TensorArg out = check_tensor(fn, "output", output, device_);
  check_same_dtype(fn, "output", out, "input", in);
  PYNCCL_CHECK_VALUE(out.numel == in.numel * world_size_, fn, ": output has ", out.numel,
                    " elements, expected world_size(", world_size_, ") \u00d7 input(", in.numel,
                    ") = ", in.numel * world_size_);
  OpScope scope(*this, fn, in.dtype, in.numel, -1, async_op);
  // ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype,
  //                            ncclComm_t comm, cudaStream_t stream);
  PYNCCL_CHECK_NCCL_OP(scope, ncclAllGather(in.ptr, out.ptr, in.count, in.type, comm_, scope.stream()));
  scope.keep_alive(input);
  scope.keep_alive(output);
  return scope.finish();
}

std::shared_ptr<Work> Communicator::reduce_scatter(const at::Tensor& output, const std::vector<at::Tensor>& inputs,
                                                   int op, bool async_op, double premul_factor) {
  const TensorArg out = check_tensor("reduce_scatter", "output", output, device_);
  const std::vector<TensorArg> ins =
      check_tensor_list("reduce_scatter", "input_list", inputs, device_, world_size_, "output", out);
  const ncclRedOp_t builtin = builtin_op("reduce_scatter", op, out.dtype);
  OpScope scope(*this, "reduce_scatter", out.dtype, out.numel * world_size_, -1, async_op);
  const ScopedRedOp red(builtin, premul_factor, out.dtype, out.type, comm_, *this);
  {
    // NOTE: one reduce per rank in one group; only root r writes its recvbuff, so `output`
    // receives exactly the reduction of everyone's inputs[rank].
    NcclGroup group;
    for (int r = 0; r < world_size_; ++r) {
      PYNCCL_CHECK_NCCL_OP(
          scope, ncclReduce(ins[r].ptr, out.ptr, out.count, out.type, red.get(), r, comm_, scope.stream()));
    }
    PYNCCL_CHECK_NCCL_OP(scope, group.end());
  }
  scope.keep_alive(output);
  for (const auto& t : inputs) scope.keep_alive(t);
  return scope.finish();
}

std::shared_ptr<Work> Communicator::reduce_scatter_tensor(const at::Tensor& output, const at::Tensor& input, int op,
                                                          bool async_op, double premul_factor) {
  const char* fn = "reduce_scatter_tensor";
  const TensorArg out = check_tensor(fn, "output", output, device_);
  const TensorArg in = check_tensor(fn, "input", input, device_);
  check_same_dtype(fn, "input", in, "output", out);
  PYNCCL_CHECK_VALUE(in.numel == out.numel * world_size_, fn, ": input has ", in.numel,
                    " elements, expected world_size(", world_size_, ") \u00d7 output(", out.numel,
                    ") = ", out.numel * world_size_);
  const ncclRedOp_t builtin = builtin_op(fn, op, out.dtype);
  OpScope scope(*this, fn, out.dtype, in.numel, -1, async_op);
  const ScopedRedOp red(builtin, premul_factor, out.dtype, out.type, comm_, *this);
  // ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount,
  //                                ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
  PYNCCL_CHECK_NCCL_OP(scope,
                         ncclReduceScatter(in.ptr, out.ptr, out.count, out.type, red.get(), comm_, scope.stream()));
  scope.keep_alive(output);
  scope.keep_alive(input);
  return scope.finish();
}

void Communicator::barrier() {
  check_usable("barrier");
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  const auto current = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_));
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  PYNCCL_CHECK_CUDA(cudaStreamIsCapturing(current.stream(), &status));
  if (status != cudaStreamCaptureStatusNone) {
    throw Error("barrier: " + describe() + ": cannot run while the current stream is capturing a CUDA graph "
                "(barrier blocks the host)");
  }
  if (!barrier_buffer_.defined()) {
    barrier_buffer_ = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, device_));
  }
  all_reduce_impl("barrier", barrier_buffer_, static_cast<int>(ReduceOp::kSum), /*async_op=*/false, 1.0, nullptr);
  const uint64_t seq = this->seq() - 1;
  cudaEvent_t done = events_->get();
  bool completed = false;
  try {
    PYNCCL_CHECK_CUDA(cudaEventRecord(done, current.stream()));
    completed = wait_event(done, timeout_s());
  } catch (...) {
    events_->put(done);
    throw;
  }
  events_->put(done);
  if (completed) return;
  timed_out("barrier (seq " + std::to_string(seq) + ") did not complete within " + seconds_text(timeout_s()),
            /*caller_in_flight=*/false, seq);
}

}  // namespace pynccl
