// Communicator::alloc_symmetric: device memory from ncclMemAlloc (CUDA VMM), registered as an
// NCCL_WIN_COLL_SYMMETRIC window, handed to Python as a uint8 tensor. Collectives whose send
// and receive buffers lie in such windows, at the same offsets on every rank, run NCCL's
// symmetric kernels (a few CTAs, fp32 accumulation for 16-bit types; NCCL >= 2.27) and, on a
// communicator with CTAPolicy ZERO, all-gathers run on the copy engines (no SM; NCCL >= 2.28).
//
// NOTE: registration is collective (every rank calls it, in the same order, with the same size);
// deregistration and the free are local: peers keep their mapping of our memory until they
// deregister it themselves (CUDA VMM reference counts), so a tensor may die on any rank at any time.
#include <ATen/ops/from_blob.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <iostream>

#include "check.h"
#include "communicator.h"
#include "nccl_api.h"
#include "poll.h"

namespace pynccl {
namespace {

// NCCL_WIN_COLL_SYMMETRIC, spelled here for headers older than 2.27 (nccl_api.cpp checks it).
constexpr int kWinCollSymmetric = 0x01;

// One allocation, shared by the tensor's deleter and nobody else.
struct SymmetricAllocation {
  void* ptr = nullptr;
  void* window = nullptr;
  int device = -1;
  std::weak_ptr<Communicator> owner;  // the window's communicator; expired or unusable: nothing to deregister
  std::shared_ptr<std::atomic<bool>> nccl_abort_running;  // the owner's: its abort still inside NCCL
};

// Waits (bounded) for the work queued so far on `stream`: memory is only freed after the GPU is
// done with it. False when `timeout_s` passed first.
bool drain_stream(cudaStream_t stream, double timeout_s) {
  cudaEvent_t event = nullptr;
  if (cudaEventCreateWithFlags(&event, cudaEventDisableTiming) != cudaSuccess) return false;
  bool done = cudaEventRecord(event, stream) == cudaSuccess &&
              poll_until([&] { return cudaEventQuery(event) != cudaErrorNotReady; }, timeout_s);
  (void)cudaEventDestroy(event);
  return done;
}

}  // namespace

at::Tensor Communicator::alloc_symmetric(int64_t num_bytes) {
  static const char* const kFn = "alloc_symmetric";
  PYNCCL_CHECK_VALUE(num_bytes > 0, kFn, ": num_bytes must be > 0, got ", num_bytes);
  const OptionalNcclApi& api = optional_nccl_api();
  PYNCCL_CHECK_VALUE(api.mem_alloc != nullptr && api.window_register != nullptr, kFn,
                     ": symmetric memory windows need NCCL >= 2.27 (headers and library); built with ",
                     nccl_version_string(NCCL_VERSION_CODE), ", running ", nccl_version_string(nccl_runtime_version()));
  check_usable(kFn);
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  void* ptr = nullptr;
  // ncclResult_t ncclMemAlloc(void** ptr, size_t size);
  PYNCCL_CHECK_NCCL(api.mem_alloc(&ptr, static_cast<size_t>(num_bytes)));
  void* window = nullptr;
  ncclResult_t result;
  {
    const InFlight in_flight(*this);
    if (state_.load() != static_cast<int>(CommState::kOk)) {
      (void)api.mem_free(ptr);
      throw_unusable(kFn);
    }
    // NOTE: collective, so it may wait on peers: the watchdog bounds it like any call into NCCL.
    set_active(kFn, seq(), now_ns());
    // ncclResult_t ncclCommWindowRegister(ncclComm_t comm, void* buff, size_t size, ncclWindow_t* win, int winFlags);
    result = api.window_register(comm_, ptr, static_cast<size_t>(num_bytes), &window, kWinCollSymmetric);
    if (result == ncclInProgress) result = wait_comm_ready(comm_, timeout_s(), &state_);
    clear_active();
  }
  if (result != ncclSuccess || window == nullptr) {
    (void)api.mem_free(ptr);
    PYNCCL_CHECK_NCCL(result == ncclNumResults ? ncclInvalidUsage : result);
    // NCCL returns success without a window where the communicator has no symmetric support:
    // the same answer on every rank (it is decided at init from the whole communicator).
    PYNCCL_CHECK_VALUE(false, kFn, ": NCCL registered no window on ", describe(),
                       ": this communicator has no symmetric-memory support (NCCL needs CUDA P2P between all ranks, "
                       "one node, cuMem allocations: NCCL_CUMEM_ENABLE, and NCCL_WIN_ENABLE not 0)");
  }
  auto allocation = std::make_shared<SymmetricAllocation>();
  allocation->ptr = ptr;
  allocation->window = window;
  allocation->device = device_;
  allocation->owner = weak_from_this();
  allocation->nccl_abort_running = nccl_abort_running_;
  const double drain_timeout_s = timeout_s();
  auto release = [allocation, drain_timeout_s](void*) {
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(allocation->device));
    if (allocation->nccl_abort_running->load()) {
      // NOTE: the window is still NCCL's until its abort (waiting for a CUDA graph) finishes.
      std::cerr << "pynccl: a symmetric buffer freed while its communicator's abort still waits in NCCL; "
                   "its memory is leaked rather than freed under NCCL\n";
      return;
    }
    if (auto comm = allocation->owner.lock()) comm->release_window(allocation->window);
    const auto device = static_cast<c10::DeviceIndex>(allocation->device);
    // NOTE: a tensor's storage dies when Python drops it, while kernels that read or write it may
    // still be queued (the caching allocator tracks that, ncclMemFree does not): wait for them.
    if (!drain_stream(c10::cuda::getCurrentCUDAStream(device).stream(), drain_timeout_s)) {
      std::cerr << "pynccl: a symmetric buffer's last kernels did not finish within " << seconds_text(drain_timeout_s)
                << "; its memory is leaked rather than freed under them\n";
      return;
    }
    // ncclResult_t ncclMemFree(void* ptr);
    (void)optional_nccl_api().mem_free(allocation->ptr);
  };
  return at::from_blob(ptr, {num_bytes}, release,
                       at::TensorOptions().dtype(at::kByte).device(at::kCUDA, static_cast<c10::DeviceIndex>(device_)));
}

void Communicator::release_window(void* window) {
  const WindowDeregisterFn fn = optional_nccl_api().window_deregister;
  if (fn == nullptr || window == nullptr) return;
  const InFlight in_flight(*this);
  // NOTE: an aborted or destroyed communicator took its windows with it (an abort that outlived its
  // wait does so when it finishes; the deleters leak the memory until then: nccl_abort_running_).
  if (state_.load() != static_cast<int>(CommState::kOk)) return;
  // Work queued on the communicator's stream may still use the window.
  if (comm_stream_) (void)drain_stream(comm_stream_->stream(), timeout_s());
  // ncclResult_t ncclCommWindowDeregister(ncclComm_t comm, ncclWindow_t win);
  (void)fn(comm_, window);
}

}  // namespace pynccl
