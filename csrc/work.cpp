// Work (async op handle) and EventPool. See work.h for the stream and lifetime rules.
#include "work.h"

#include <c10/cuda/CUDAStream.h>

#include "check.h"
#include "communicator.h"
#include "poll.h"

namespace pynccl {

EventPool::EventPool(int device, int num_preallocated) : device_(device) {
  for (int i = 0; i < num_preallocated; ++i) free_.push_back(create());
}

EventPool::~EventPool() {
  for (cudaEvent_t event : free_) (void)cudaEventDestroy(event);  // errors ignored: may run at exit
}

cudaEvent_t EventPool::create() {
  int previous = -1;
  PYNCCL_CHECK_CUDA(cudaGetDevice(&previous));
  if (previous != device_) PYNCCL_CHECK_CUDA(cudaSetDevice(device_));
  cudaEvent_t event = nullptr;
  const cudaError_t err = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
  if (previous != device_) (void)cudaSetDevice(previous);
  PYNCCL_CHECK_CUDA(err);
  return event;
}

cudaEvent_t EventPool::get() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!free_.empty()) {
      cudaEvent_t event = free_.back();
      free_.pop_back();
      return event;
    }
  }
  return create();
}

void EventPool::put(cudaEvent_t event) {
  std::lock_guard<std::mutex> lock(mutex_);
  free_.push_back(event);
}

void EventPool::put_many(const std::vector<cudaEvent_t>& events) {
  std::lock_guard<std::mutex> lock(mutex_);
  free_.insert(free_.end(), events.begin(), events.end());
}

bool wait_event(cudaEvent_t event, double timeout_s) {
  return poll_until(
      [event] {
        const cudaError_t query = cudaEventQuery(event);
        if (query != cudaSuccess && query != cudaErrorNotReady) PYNCCL_CHECK_CUDA(query);
        return query == cudaSuccess;
      },
      timeout_s);
}

Work::Work(std::shared_ptr<Communicator> comm, std::shared_ptr<WorkState> state)
    : comm_(std::move(comm)), state_(std::move(state)) {}

void Work::throw_if_comm_failed() const {
  bool failed = false;  // a Work of a communicator that failed (watchdog, timeout) raises that failure
  {
    std::lock_guard<std::mutex> lock(comm_->error_mutex_);
    failed = !comm_->error_message_.empty();
  }
  if (failed) comm_->throw_unusable(state_->op);
}

bool Work::wait(std::optional<double> /*timeout*/) {
  throw_if_comm_failed();
  const auto current = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(comm_->device()));
  PYNCCL_CHECK_CUDA(cudaStreamWaitEvent(current.stream(), state_->event, 0));
  state_->tensors.clear();  // NOTE: safe: later work on the current stream is ordered after the op
  return true;
}

bool Work::is_completed() {
  if (state_->captured) {
    throw Error(std::string("is_completed: ") + state_->op + " (seq " + std::to_string(state_->seq) +
                ") was captured in a CUDA graph; it completes with each replay, not on its own");
  }
  const cudaError_t query = cudaEventQuery(state_->event);
  if (query == cudaSuccess) return true;
  if (query == cudaErrorNotReady) return false;
  PYNCCL_CHECK_CUDA(query);
  return false;
}

bool Work::synchronize(std::optional<double> timeout_s) {
  if (state_->captured) {
    throw Error(std::string("synchronize: ") + state_->op + " (seq " + std::to_string(state_->seq) +
                ") was captured in a CUDA graph; synchronize the replay stream instead");
  }
  const double timeout = timeout_s.value_or(comm_->timeout_s());
  PYNCCL_CHECK_VALUE(timeout > 0, "synchronize: timeout_s must be > 0, got ", timeout);
  if (!wait_event(state_->event, timeout)) {
    comm_->timed_out(std::string("Work.synchronize: ") + state_->op + " (seq " + std::to_string(state_->seq) +
                         ") did not complete within " + seconds_text(timeout),
                     /*caller_in_flight=*/false, state_->seq);
  }
  // NOTE: an aborted communicator's kernels exit and its events complete: that is no success.
  throw_if_comm_failed();
  // NOTE: the tensors are not released here: this runs without the GIL (bindings.cpp), and
  // WorkState::tensors is only touched with it held. The binding calls release_tensors() next.
  return true;
}

void Work::release_tensors() { state_->tensors.clear(); }

}  // namespace pynccl
