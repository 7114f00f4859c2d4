// Communicator::register_buffer / deregister_buffer: NCCL user-buffer registration, so that
// collectives on memory DDP reuses every step (its gradient buckets) may skip NCCL's staging
// copies. Entry points are looked up at run time (nccl_api.h): our floor, 2.18, lacks them.
#include "check.h"
#include "communicator.h"
#include "nccl_api.h"

namespace pynccl {
namespace {

// Raised for the duration of an NCCL call on comm_, so that abort() waits for it.
struct InFlightCall {
  explicit InFlightCall(std::atomic<int>& count) : count(count) { count.fetch_add(1); }
  ~InFlightCall() { count.fetch_sub(1); }
  std::atomic<int>& count;
};

}  // namespace

int64_t Communicator::register_buffer(const at::Tensor& tensor) {
  static const char* const kFn = "register_buffer";
  PYNCCL_CHECK_VALUE(tensor.is_cuda() && tensor.get_device() == device_, kFn, ": expected a tensor on cuda:", device_,
                     ", got one on ", tensor.device().str());
  PYNCCL_CHECK_VALUE(tensor.is_contiguous(), kFn, ": expected a contiguous tensor");
  const RegisterFn fn = optional_nccl_api().comm_register;
  PYNCCL_CHECK_VALUE(fn != nullptr, kFn, ": ncclCommRegister needs NCCL >= 2.19 (headers and library); built with ",
                     nccl_version_string(NCCL_VERSION_CODE), ", running ", nccl_version_string(nccl_runtime_version()));
  if (tensor.numel() == 0) return 0;
  check_usable(kFn);
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  InFlightCall in_flight(in_flight_);
  check_usable(kFn);
  void* handle = nullptr;
  // ncclResult_t ncclCommRegister(const ncclComm_t comm, void* buff, size_t size, void** handle);
  ncclResult_t result = fn(comm_, tensor.data_ptr(), tensor.numel() * tensor.element_size(), &handle);
  // A non-blocking communicator may still be registering: poll it (bounded by the timeout).
  if (result == ncclInProgress) result = wait_comm_ready(comm_, timeout_s());
  PYNCCL_CHECK_NCCL(result);
  return reinterpret_cast<int64_t>(handle);
}

void Communicator::deregister_buffer(int64_t handle) {
  const DeregisterFn fn = optional_nccl_api().comm_deregister;
  if (fn == nullptr || handle == 0) return;
  InFlightCall in_flight(in_flight_);
  // NOTE: an aborted or destroyed communicator took its registrations with it.
  if (state_.load() != static_cast<int>(CommState::kOk)) return;
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  // ncclResult_t ncclCommDeregister(const ncclComm_t comm, void* handle);
  PYNCCL_CHECK_NCCL(fn(comm_, reinterpret_cast<void*>(handle)));
}

}  // namespace pynccl
