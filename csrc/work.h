// Work: the handle of an op started with async_op=True, and the event pool it draws from.
// The op ran on the communicator's stream; wait() makes the caller's current stream wait on
// its end event (no host block) and only then lets go of the tensors, so no record_stream is
// needed (docs/design.md §2). The watchdog holds the same WorkState until the event completes, so
// a Work dropped without wait() still keeps its tensors alive for as long as the GPU uses them.
#pragma once

#include <ATen/core/Tensor.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

namespace pynccl {

class Communicator;

// cudaEvent_t's of one device, created with cudaEventDisableTiming and reused, so the hot path
// never creates or destroys an event. Thread-safe; shared by the communicator and its Works.
class EventPool {
 public:
  EventPool(int device, int num_preallocated);
  ~EventPool();
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;

  cudaEvent_t get();
  void put(cudaEvent_t event);
  void put_many(const std::vector<cudaEvent_t>& events);

 private:
  cudaEvent_t create();

  const int device_;
  std::mutex mutex_;
  std::vector<cudaEvent_t> free_;
};

// What an async op leaves behind; shared by the Python-visible Work and the watchdog.
struct WorkState {
  WorkState(uint64_t seq, const char* op, cudaEvent_t event, bool captured, std::shared_ptr<EventPool> pool)
      : seq(seq), op(op), event(event), captured(captured), pool(std::move(pool)) {}
  ~WorkState() { pool->put(event); }

  const uint64_t seq;
  const char* const op;
  const cudaEvent_t event;  // recorded on the communicator's stream after the op
  const bool captured;      // enqueued while the stream was capturing a CUDA graph
  const std::shared_ptr<EventPool> pool;
  // NOTE: guarded by the GIL: only touched by bindings that hold it (Work.wait, release_tensors)
  // and by the last owner's destructor; the watchdog never reads it. Every other field is const.
  std::vector<at::Tensor> tensors;
};

// Host-polls `event` until it completes or timeout_s passes: true when it completed.
bool wait_event(cudaEvent_t event, double timeout_s);

class Work {
 public:
  Work(std::shared_ptr<Communicator> comm, std::shared_ptr<WorkState> state);

  // The current CUDA stream waits for the op; no host block. `timeout` is accepted for
  // torch.distributed compatibility: the watchdog enforces the communicator's timeout.
  bool wait(std::optional<double> timeout);
  // Non-blocking query of the op's end event.
  bool is_completed();
  // Host-blocking wait, bounded by timeout_s (default: the communicator's timeout); on
  // timeout, as every time-out (Communicator::timed_out): the process ends, or with
  // on_timeout=raise the communicator is aborted and pynccl::TimeoutError is thrown. Runs without
  // the GIL, so it leaves the tensors alone: call release_tensors() after it, with the GIL held.
  bool synchronize(std::optional<double> timeout_s);
  // Lets go of the op's tensors once it is known complete. GIL held (see WorkState::tensors).
  void release_tensors();

  uint64_t seq() const { return state_->seq; }
  const char* op() const { return state_->op; }

 private:
  // Raises the communicator's failure (watchdog time-out, abort) as this op's error.
  void throw_if_comm_failed() const;

  std::shared_ptr<Communicator> comm_;
  std::shared_ptr<WorkState> state_;
};

}  // namespace pynccl
