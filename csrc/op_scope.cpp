// OpScope: the bookkeeping every op shares around its NCCL calls (device guard, stream
// choice, in-flight count, the watchdog's view of the call in progress, flight record,
// watchdog hand-off). Kept lean: it is the hot path.
#include <c10/cuda/CUDAStream.h>

#include "check.h"
#include "communicator.h"

namespace pynccl {

OpScope::OpScope(Communicator& owner, const char* op, c10::ScalarType dtype, int64_t count, int peer, bool async_op)
    : owner_(owner), guard_(static_cast<c10::DeviceIndex>(owner.device_)), op_(op), dtype_(dtype), count_(count),
      peer_(peer), async_op_(async_op) {
  owner_.enter_call();
  try {
    owner_.check_usable(op);
    if (owner_.graveyard_nonempty_.load(std::memory_order_relaxed)) owner_.drain_graveyard();
    const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(owner_.device_));
    tracked_ = async_op_ || owner_.track_sync_ops();
    if (tracked_) {
      cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
      PYNCCL_CHECK_CUDA(cudaStreamIsCapturing(current.stream(), &status));
      capturing_ = status != cudaStreamCaptureStatusNone;
    }
    if (async_op_) {
      // The comm stream starts after everything already queued on the caller's stream.
      owner_.order_after(owner_.comm_stream_->stream(), current.stream());
      stream_ = *owner_.comm_stream_;
    } else {
      stream_ = current;
    }
    seq_ = owner_.seq_.fetch_add(1, std::memory_order_relaxed);
    enqueued_ = std::chrono::steady_clock::now();
  } catch (...) {
    owner_.leave_call();
    throw;
  }
  // NOTE: before any NCCL call of the op: a blocking call that never returns (a peer that never
  // arrives at the first connection) is still seen by the watchdog. Three stores, no lock.
  owner_.set_active(op_, seq_,
                    std::chrono::duration_cast<std::chrono::nanoseconds>(enqueued_.time_since_epoch()).count());
}

std::shared_ptr<Work> OpScope::finish() {
  const bool watch = tracked_ && !capturing_;  // events recorded during capture cannot be polled
  cudaEvent_t done = nullptr;
  if (async_op_ || watch) {
    done = owner_.events_->get();
    const cudaError_t err = cudaEventRecord(done, stream_->stream());
    if (err != cudaSuccess) {
      owner_.events_->put(done);
      PYNCCL_CHECK_CUDA(err);
    }
  }
  std::shared_ptr<WorkState> work;
  if (async_op_) {
    work = std::make_shared<WorkState>(seq_, op_, done, capturing_, owner_.events_);
    work->tensors = std::move(tensors_);
  }
  const OpState state = capturing_ ? OpState::kCaptured : (tracked_ ? OpState::kEnqueued : OpState::kUntracked);
  const int64_t enqueue_us =
      std::chrono::duration_cast<std::chrono::microseconds>(enqueued_.time_since_epoch()).count() +
      owner_.epoch_offset_us_;
  {
    std::lock_guard<std::mutex> lock(owner_.mutex_);
    owner_.ring_[seq_ % owner_.ring_.size()] = FlightEntry{seq_, op_, dtype_, count_, peer_, async_op_, enqueue_us, state};
    if (watch) owner_.new_ops_.push_back(TrackedOp{seq_, op_, done, enqueued_, work});
  }
  finished_ = true;
  if (!async_op_) return nullptr;
  return std::make_shared<Work>(owner_.shared_from_this(), std::move(work));
}

void Communicator::order_after(cudaStream_t waiter, cudaStream_t producer) {
  cudaEvent_t ready = events_->get();
  const cudaError_t record_err = cudaEventRecord(ready, producer);
  const cudaError_t wait_err = record_err == cudaSuccess ? cudaStreamWaitEvent(waiter, ready, 0) : cudaSuccess;
  events_->put(ready);  // NOTE: the wait captured the record; the event may be reused now
  PYNCCL_CHECK_CUDA(record_err);
  PYNCCL_CHECK_CUDA(wait_err);
}

void OpScope::record_entry(OpState state, int64_t enqueue_us) {
  std::lock_guard<std::mutex> lock(owner_.mutex_);
  owner_.ring_[seq_ % owner_.ring_.size()] = FlightEntry{seq_, op_, dtype_, count_, peer_, async_op_, enqueue_us, state};
}

OpScope::~OpScope() {
  if (!finished_) {
    // The op threw after it got a sequence number: leave a trace of it in the flight record
    // (failed, or timed_out when one of its calls stayed in progress past the timeout).
    try {
      record_entry(unfinished_state_, 0);
    } catch (...) {
    }
  }
  owner_.clear_active();
  owner_.leave_call();
}

}  // namespace pynccl
