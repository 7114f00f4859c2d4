// class Communicator: owns one ncclComm_t, its stream, its event pool, its watchdog thread and
// its flight recorder. Collectives live in collectives.cpp / p2p.cpp and go through one
// OpScope each, which picks the stream (docs/design.md §2), records the op in the flight recorder
// and hands its completion event to the watchdog. Every NCCL call is made with in_flight_
// raised, so abort() (from any thread) never frees the comm under a running call: when a call
// is still inside NCCL, the abort is left to that call's way out (leave_call).
//
// NOTE: why a watchdog that knows the call before it enters NCCL (issue 20). Blocking
// communicators are the default (the cheapest enqueue), and a blocking NCCL call can wait on a
// peer with no limit (init, split, finalize, the first connection of a p2p pair or algorithm),
// holding the GIL. So each call writes {op, seq, start} into active_ first (three plain stores)
// and the watchdog checks it with the GPU events: past the timeout, by default the process ends
// (tear_down_process: flight record, one message, exit code 75, as torch's default
// TORCH_NCCL_ASYNC_ERROR_HANDLING does), since NCCL cannot be interrupted safely while a thread
// is inside it, and an aborted op's output must never reach the program as a result.
// on_timeout=raise (PYNCCL_ON_TIMEOUT=raise) uses non-blocking communicators instead: every
// wait is a poll on the calling thread, without the GIL, and a time-out aborts and raises.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "poll.h"
#include "work.h"

namespace pynccl {

struct CommOptions {
  double timeout_s = 600.0;
  bool blocking = true;    // ncclConfig_t.blocking; non-blocking lets every wait be a poll
  bool raise_on_timeout = false;  // on_timeout=raise: abort + CommTimeoutError; else end the process
  std::string name;        // shows up in errors, the flight record file and NCCL's logs
  int cga_cluster_size = -1;  // -1: NCCL's default
  int min_ctas = -1;
  int max_ctas = -1;
  int cta_policy = -1;     // ncclConfig_t.CTAPolicy (2 = ZERO: copy-engine collectives); -1: NCCL's default
};

// The exit status of a process the watchdog ends on a time-out: EX_TEMPFAIL of sysexits.h
// ("try again"), so that a launcher can tell it from a crash and restart the job.
constexpr int kTimeoutExitCode = 75;

// (blocking, raise_on_timeout) from the arguments, or where absent from PYNCCL_ON_TIMEOUT
// ("teardown", the default, or "raise") and PYNCCL_NCCL_NONBLOCKING=1. raise needs a
// non-blocking communicator (ValueError if blocking=True is asked with it).
std::pair<bool, bool> resolve_timeout_policy(const std::optional<std::string>& on_timeout,
                                             std::optional<bool> blocking);

// Writes `message` to stderr and ends the process with kTimeoutExitCode, with no cleanup: no
// Python, no lock, no NCCL call (another thread may be inside NCCL holding the GIL). watchdog.cpp.
[[noreturn]] void tear_down_process(const std::string& message);

enum class OpState : uint8_t { kEnqueued, kCompleted, kFailed, kTimedOut, kAborted, kCaptured, kUntracked };
const char* op_state_name(OpState state);

// One op in the flight recorder ring.
struct FlightEntry {
  uint64_t seq = 0;
  const char* op = nullptr;
  c10::ScalarType dtype = c10::kFloat;
  int64_t count = 0;       // elements this rank sends/contributes
  int peer = -1;           // root or peer, -1 when the op has none
  bool async_op = false;
  int64_t enqueue_us = 0;  // microseconds since the Unix epoch
  OpState state = OpState::kEnqueued;
};

// The flight record as JSON, and its file in $PYNCCL_FLIGHT_RECORDER_DIR (default: $TMPDIR or
// /tmp); the file's path, or "(flight record not written: why)". watchdog.cpp.
std::string flight_record_json(const std::string& name, int rank, int world_size, int device,
                               const std::string& reason, uint64_t seq, const std::vector<FlightEntry>& entries);
std::string write_flight_record_file(const std::string& name, int rank, const std::string& json);

// An op whose completion the watchdog waits for.
struct TrackedOp {
  uint64_t seq;
  const char* op;
  cudaEvent_t event;                      // owned here when work == nullptr, else by the WorkState
  std::chrono::steady_clock::time_point enqueued;
  std::shared_ptr<WorkState> work;        // async ops only
};

enum class CommState : int { kOk = 0, kAborted = 1, kDestroyed = 2, kStarting = 3 };

// Polls ncclCommGetAsyncError until `comm` leaves ncclInProgress (the GIL released meanwhile);
// returns its state, or ncclInProgress when `timeout_s` passed first, or ncclNumResults as soon as
// `*state_flag` leaves kOk (an abort waits for in-flight calls: this one must let it go ahead).
ncclResult_t wait_comm_ready(ncclComm_t comm, double timeout_s, const std::atomic<int>* state_flag = nullptr);
// steady_clock now, in ns (ActiveCall's clock).
int64_t now_ns();

// The NCCL call a thread is making on a communicator now; written before the call and cleared
// after (start_ns == 0: none), read by the watchdog. Relaxed stores; start_ns is published last.
// NOTE: one slot per communicator, since NCCL allows one thread at a time on a communicator.
struct ActiveCall {
  std::atomic<int64_t> start_ns{0};  // steady_clock, ns
  std::atomic<const char*> op{nullptr};
  std::atomic<uint64_t> seq{0};

  void set(const char* op_name, uint64_t op_seq, int64_t start) {
    op.store(op_name, std::memory_order_relaxed);
    seq.store(op_seq, std::memory_order_relaxed);
    start_ns.store(start, std::memory_order_release);
  }
  void clear() { start_ns.store(0, std::memory_order_release); }
  // "<op> (seq N) did not complete within T: ..." if the call has been inside NCCL for longer
  // than timeout_s at now_ns, else "". watchdog.cpp.
  std::string overdue(int64_t now_ns, double timeout_s) const;
};

class OpScope;

class Communicator : public std::enable_shared_from_this<Communicator> {
  struct PrivateTag {};

 public:
  // ncclCommInitRankConfig from a 128-byte unique id; bounded by options.timeout_s.
  Communicator(const std::string& unique_id, int world_size, int rank, int device, CommOptions options);
  // Wraps a comm made by split(); public only for std::make_shared.
  Communicator(PrivateTag, ncclComm_t comm, int world_size, int rank, int device, CommOptions options);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  int device() const { return device_; }
  // The cudaStream_t its ops run on (0 before start): no two live communicators share one.
  uintptr_t stream_handle() const { return comm_stream_ ? reinterpret_cast<uintptr_t>(comm_stream_->stream()) : 0; }
  const std::string& name() const { return options_.name; }
  uint64_t seq() const { return seq_.load(std::memory_order_relaxed); }
  double timeout_s() const { return timeout_s_.load(std::memory_order_relaxed); }
  void set_timeout_s(double timeout_s);
  bool track_sync_ops() const { return track_sync_ops_.load(std::memory_order_relaxed); }
  void set_track_sync_ops(bool track) { track_sync_ops_.store(track, std::memory_order_relaxed); }
  size_t flight_recorder_size() const;
  void set_flight_recorder_size(size_t size);

  // --- collectives (collectives.cpp); ranks are communicator-local --------------------------
  // `output` (optional, same device/dtype/numel, contiguous) makes the op out-of-place: one NCCL
  // call reads `tensor` and writes `output`, and `tensor` is left as it was. For reduce, only
  // the root's output is written; for broadcast, the root's tensor is read and every output written.
  std::shared_ptr<Work> all_reduce(const at::Tensor& tensor, int op, bool async_op, double premul_factor,
                                   const at::Tensor* output = nullptr);
  std::shared_ptr<Work> broadcast(const at::Tensor& tensor, int root, bool async_op,
                                  const at::Tensor* output = nullptr);
  std::shared_ptr<Work> reduce(const at::Tensor& tensor, int root, int op, bool async_op, double premul_factor,
                               const at::Tensor* output = nullptr);
  std::shared_ptr<Work> all_gather(const std::vector<at::Tensor>& outputs, const at::Tensor& input, bool async_op);
  std::shared_ptr<Work> all_gather_into_tensor(const at::Tensor& output, const at::Tensor& input, bool async_op);
  std::shared_ptr<Work> reduce_scatter(const at::Tensor& output, const std::vector<at::Tensor>& inputs, int op,
                                       bool async_op, double premul_factor);
  std::shared_ptr<Work> reduce_scatter_tensor(const at::Tensor& output, const at::Tensor& input, int op,
                                              bool async_op, double premul_factor);
  // A 1-element all_reduce, then a host wait bounded by timeout_s.
  void barrier();

  // --- one DDP gradient bucket (bucket_reduce.cpp) ------------------------------------------
  // Packs grads into flat (x scale, cast) on pack_stream after the current stream, then a SUM
  // all-reduce of flat, async, after the pack. pack_stream: a cudaStream_t handle on this device.
  // split_all_reduce: the all-reduce as an in-place reduce-scatter then an in-place all-gather
  // (flat's size a multiple of the world size): on symmetric memory with CTAPolicy ZERO the
  // all-gather runs on the copy engines, so only the reduce-scatter holds SMs.
  // unpack_stream (a cudaStream_t handle, 0 = none): copies the reduced flat back into grads
  // there, after the collective, before the Work's event. chunks > 1 pipelines pack, collective
  // and unpack over that many slices of flat (aligned to 256 x world_size elements).
  // copy_pack (split_all_reduce only): the pack copies grads on the copy engines (cudaMemcpyAsync;
  // torch's copy kernel for a cast or a strided gradient; nothing for a gradient that is its slot
  // of flat already) without the scale, and each rank scales its reduced shard instead, before the
  // all-gather: every rank must pass the same copy_pack and scale.
  std::shared_ptr<Work> reduce_bucket(const std::vector<at::Tensor>& grads, const at::Tensor& flat, double scale,
                                      int64_t pack_stream, bool split_all_reduce = false, int64_t unpack_stream = 0,
                                      int64_t chunks = 1, const std::optional<at::Tensor>& scratch = std::nullopt,
                                      bool copy_pack = false);

  // --- NCCL user-buffer registration (buffer_registration.cpp) ------------------------------
  // ncclCommRegister of a tensor's bytes (NCCL >= 2.19): an opaque handle for deregister_buffer.
  int64_t register_buffer(const at::Tensor& tensor);
  void deregister_buffer(int64_t handle);  // a no-op once the communicator is aborted or destroyed

  // --- symmetric memory (symmetric_memory.cpp) ------------------------------------------------
  // Collective: num_bytes from ncclMemAlloc registered as an NCCL_WIN_COLL_SYMMETRIC window, as a
  // uint8 tensor whose deleter deregisters and frees it (NCCL >= 2.27). ValueError where this
  // communicator has no symmetric support (NCCL then registers no window).
  at::Tensor alloc_symmetric(int64_t num_bytes);
  // ncclCommWindowDeregister once the comm stream's work is done; a no-op once aborted or destroyed.
  void release_window(void* window);

  // --- point-to-point and the collectives built on it (p2p.cpp) -----------------------------
  std::shared_ptr<Work> all_to_all(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
                                   bool async_op);
  // Splits count rows of dim 0; empty splits mean equal chunks.
  std::shared_ptr<Work> all_to_all_single(const at::Tensor& output, const at::Tensor& input,
                                          const std::vector<int64_t>& output_splits,
                                          const std::vector<int64_t>& input_splits, bool async_op);
  std::shared_ptr<Work> gather(const at::Tensor& input, const std::vector<at::Tensor>& gather_list, int root,
                               bool async_op);
  std::shared_ptr<Work> scatter(const at::Tensor& output, const std::vector<at::Tensor>& scatter_list, int root,
                                bool async_op);
  std::shared_ptr<Work> send(const at::Tensor& tensor, int peer, bool async_op);
  std::shared_ptr<Work> recv(const at::Tensor& tensor, int peer, bool async_op);
  // (is_send, tensor, peer) in one ncclGroupStart/End on the communicator's stream.
  std::shared_ptr<Work> batch_isend_irecv(const std::vector<std::tuple<bool, at::Tensor, int64_t>>& ops);

  // --- life cycle (communicator.cpp) ---------------------------------------------------------
  // Collective over this communicator; nullptr on ranks that passed color < 0.
  std::shared_ptr<Communicator> split(int color, int key, std::optional<double> timeout_s, const std::string& name);
  void abort();    // local; idempotent
  void destroy();  // collective: ncclCommFinalize (bounded) + ncclCommDestroy; idempotent
  bool is_aborted() const;
  bool blocking() const { return options_.blocking; }
  int cta_policy() const { return options_.cta_policy; }  // in effect: 2 = ZERO (copy engines), -1 = NCCL's default
  const char* on_timeout() const { return options_.raise_on_timeout ? "raise" : "teardown"; }
  // `waiter` runs what is enqueued on it next only after everything already queued on
  // `producer` (an event of the pool, recorded and waited on; graph-capturable).
  void order_after(cudaStream_t waiter, cudaStream_t producer);
  std::optional<std::string> get_async_error();
  void check();    // throws the stored error, or the comm's async error
  std::vector<FlightEntry> flight_record() const;  // oldest first

 private:
  friend class OpScope;
  friend class Work;

  void start();  // stream, event pool, flight recorder, watchdog
  // Stops the watchdog of a constructor that throws (the destructor does not run then).
  void stop_on_throw() noexcept;
  std::shared_ptr<Work> all_reduce_impl(const char* fn, const at::Tensor& tensor, int op, bool async_op,
                                        double premul_factor, const at::Tensor* output);
  void check_usable(const char* fn) const {
    if (__builtin_expect(state_.load(std::memory_order_acquire) != static_cast<int>(CommState::kOk), 0))
      throw_unusable(fn);
  }
  [[noreturn]] void throw_unusable(const char* fn) const;
  // Turns a non-success result of an NCCL call of `scope`'s op on comm_ into an exception;
  // ncclInProgress is polled to completion first (non-blocking comms), bounded by the timeout.
  // A time-out names the op and its seq as the watchdog does, and dumps the flight record.
  void finish_nccl_call(ncclResult_t result, const char* call, const char* file, int line, OpScope& scope);
  // Records `message` as this communicator's error (first one wins), stops the watchdog unless
  // called from it, and aborts. Any thread.
  void fail(bool is_timeout, const std::string& message, bool caller_in_flight);
  // A bounded wait for `what` ("all_reduce (seq 3) did not complete within 10 s") ran out on
  // the calling thread: dumps the flight record; then ends the process (default), or aborts
  // the communicator and throws TimeoutError (on_timeout=raise). `seq`: the op's flight entry
  // is marked timed_out first (UINT64_MAX: none).
  [[noreturn]] void timed_out(const std::string& what, bool caller_in_flight, uint64_t seq = UINT64_MAX);
  // Marks the communicator aborted and calls ncclCommAbort once no call is in flight (besides
  // the caller's own); with one still inside NCCL, leaves the ncclCommAbort to its leave_call()
  // and returns false.
  bool abort_nccl(bool caller_in_flight);
  void abort_now();  // ncclCommAbort + comm_ = nullptr; lifecycle_mutex_ held, abort claimed
  void enter_call() { in_flight_.fetch_add(1); }
  void leave_call() {
    if (__builtin_expect(in_flight_.fetch_sub(1) == 1 && abort_pending_.load(), 0)) finish_deferred_abort();
  }
  void finish_deferred_abort();
  // Keeps in_flight_ raised for a call on comm_ that is not an op (split, get_async_error, the
  // watchdog's ncclCommGetAsyncError).
  struct InFlight {
    explicit InFlight(Communicator& owner) : owner(owner) { owner.enter_call(); }
    ~InFlight() { owner.leave_call(); }
    InFlight(const InFlight&) = delete;
    InFlight& operator=(const InFlight&) = delete;
    Communicator& owner;
  };
  // Registers a call into NCCL for the watchdog (see ActiveCall); clear_active() after.
  void set_active(const char* op, uint64_t seq, int64_t start_ns) { active_.set(op, seq, start_ns); }
  void clear_active() { active_.clear(); }
  void stop_watchdog();
  void release_tracked();  // after the watchdog stopped: drop what it was watching (any thread, mutex_ inside)
  void drain_graveyard();
  std::string describe() const;  // "communicator 'name' (rank r of n, cuda:d)"

  // watchdog.cpp
  void watchdog_loop();
  bool watchdog_poll();  // false once the communicator failed or was aborted
  // A failure the watchdog found: marks the flight entries, dumps the record, then ends the
  // process (default) or aborts the communicator (on_timeout=raise).
  void watchdog_fail(const std::string& failure, bool is_timeout, uint64_t failed_seq);
  std::string dump_flight_record(const std::string& reason);
  void set_entry_state(uint64_t seq, OpState state);  // mutex_ held

  const int world_size_;
  const int rank_;
  const int device_;
  CommOptions options_;
  ncclComm_t comm_ = nullptr;
  std::optional<c10::cuda::CUDAStream> comm_stream_;
  std::shared_ptr<EventPool> events_;
  bool use_native_alltoall_ = true;  // PYNCCL_NATIVE_ALLTOALL=0 forces the grouped p2p path
  int64_t epoch_offset_us_ = 0;      // system_clock - steady_clock, for enqueue_us

  std::atomic<double> timeout_s_;
  std::atomic<bool> track_sync_ops_{true};
  std::atomic<uint64_t> seq_{0};
  std::atomic<int> in_flight_{0};
  std::atomic<int> state_{static_cast<int>(CommState::kStarting)};
  std::atomic<bool> abort_pending_{false};  // abort asked for; ncclCommAbort once in_flight_ drains
  std::atomic<bool> abort_claimed_{false};  // the one thread that calls ncclCommAbort took it
  // True while an ncclCommAbort that outlived abort_now's wait still runs (abort_bounded): shared
  // with the symmetric buffers' deleters, which then leak their memory rather than free it under NCCL.
  std::shared_ptr<std::atomic<bool>> nccl_abort_running_ = std::make_shared<std::atomic<bool>>(false);
  ActiveCall active_;

  mutable std::mutex error_mutex_;
  std::string error_message_;  // why the communicator was aborted, if not by abort()
  bool error_is_timeout_ = false;

  // mutex_ guards the flight ring, the ops handed to the watchdog and the graveyard.
  mutable std::mutex mutex_;
  std::vector<FlightEntry> ring_;
  std::vector<TrackedOp> new_ops_;
  std::vector<std::shared_ptr<WorkState>> graveyard_;  // released on the Python thread, not the watchdog
  std::atomic<bool> graveyard_nonempty_{false};

  std::mutex lifecycle_mutex_;       // abort/destroy: comm_ is retired under it
  std::mutex lifecycle_join_mutex_;  // joining the watchdog
  std::condition_variable watchdog_cv_;
  bool stop_watchdog_ = false;  // mutex_
  std::thread watchdog_;
  std::atomic<std::thread::id> watchdog_id_{};  // set by the watchdog itself: "am I the watchdog?"
  // The watchdog's own while it runs (read there without a lock); after the join, taken by
  // release_tracked() under mutex_, since abort() and destroy() may run at once on two threads.
  std::vector<TrackedOp> watch_list_;
  std::chrono::milliseconds watchdog_poll_{100};

  at::Tensor barrier_buffer_;
};

// One op's bookkeeping around its NCCL calls: device guard, stream choice, in-flight count,
// flight record and watchdog hand-off. Construct, make the NCCL calls on stream(), finish().
class OpScope {
 public:
  OpScope(Communicator& owner, const char* op, c10::ScalarType dtype, int64_t count, int peer, bool async_op);
  ~OpScope();
  OpScope(const OpScope&) = delete;
  OpScope& operator=(const OpScope&) = delete;

  cudaStream_t stream() const { return stream_->stream(); }
  const c10::cuda::CUDAStream& cuda_stream() const { return *stream_; }
  bool capturing() const { return capturing_; }
  // Async ops: keeps `t` alive until Work.wait() (or completion, if the Work is dropped).
  void keep_alive(const at::Tensor& t) {
    if (async_op_) tensors_.push_back(t);
  }
  // Records the end event, the flight entry and the watchdog hand-off; the Work if async.
  std::shared_ptr<Work> finish();
  // A non-success result of one of this op's NCCL calls (PYNCCL_CHECK_NCCL_OP): waits out
  // ncclInProgress (bounded) or throws.
  void check_nccl(ncclResult_t result, const char* call, const char* file, int line) {
    owner_.finish_nccl_call(result, call, file, line, *this);
  }

 private:
  friend class Communicator;  // finish_nccl_call marks a timed-out op

  void record_entry(OpState state, int64_t enqueue_us);  // the op's flight entry; takes owner_.mutex_
  Communicator& owner_;
  c10::cuda::CUDAGuard guard_;
  const char* op_;
  c10::ScalarType dtype_;
  int64_t count_;
  int peer_;
  bool async_op_;
  bool tracked_ = false;    // the watchdog will see this op (async, or track_sync_ops)
  bool capturing_ = false;  // the caller's stream is capturing a CUDA graph
  bool finished_ = false;
  OpState unfinished_state_ = OpState::kFailed;  // the flight entry's state if finish() is never reached
  uint64_t seq_ = 0;
  std::chrono::steady_clock::time_point enqueued_;
  std::optional<c10::cuda::CUDAStream> stream_;
  std::vector<at::Tensor> tensors_;
};

}  // namespace pynccl

// For the NCCL calls of one op (its OpScope `scope`) on the communicator: handles ncclInProgress,
// and errors name the op and its seq.
#define PYNCCL_CHECK_NCCL_OP(scope, call)                                                \
  do {                                                                                   \
    ncclResult_t pynccl_result_ = (call);                                                \
    if (__builtin_expect(pynccl_result_ != ncclSuccess, 0))                              \
      (scope).check_nccl(pynccl_result_, #call, __FILE__, __LINE__);                     \
  } while (0)
