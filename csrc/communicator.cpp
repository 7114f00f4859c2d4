// Communicator life cycle: init from a unique id, split, abort, destroy. Each call that may
// wait on a peer is bounded by the timeout: registered with the watchdog (blocking
// communicators, the default) or polled here without the GIL (non-blocking ones, for
// on_timeout=raise). The watchdog and flight recorder are in watchdog.cpp.
#include <Python.h>  // NOTE: first, as Python requires; only for releasing the GIL while polling

#include "communicator.h"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <future>
#include <iostream>
#include <thread>
#include <utility>

#include "check.h"
#include "comm_config.h"
#include "comm_stream.h"
#include "nccl_api.h"

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 18, 0)
#error "pynccl needs NCCL >= 2.18 headers (ncclCommSplit, ncclConfig_t)"
#endif

namespace pynccl {
namespace {

using Clock = std::chrono::steady_clock;

std::atomic<int> g_num_comms{0};

// What wait_comm_ready returns when another thread started to abort the communicator.
constexpr ncclResult_t kAbortRequested = ncclNumResults;  // never a real result

// Releases the GIL for a wait if this thread holds it (the collectives' bindings keep it: the
// enqueue is cheaper so, and only a non-blocking call that returned ncclInProgress waits here).
class GilReleased {
 public:
  GilReleased() : saved_(Py_IsInitialized() && PyGILState_Check() ? PyEval_SaveThread() : nullptr) {}
  ~GilReleased() {
    if (saved_ != nullptr) PyEval_RestoreThread(saved_);
  }
  GilReleased(const GilReleased&) = delete;
  GilReleased& operator=(const GilReleased&) = delete;

 private:
  PyThreadState* saved_;
};

}  // namespace

ncclResult_t wait_comm_ready(ncclComm_t comm, double timeout_s, const std::atomic<int>* state_flag) {
  ncclResult_t state = ncclInProgress;
  const GilReleased no_gil;
  const bool settled = poll_until(
      [&] {
        ncclResult_t async_state = ncclSuccess;
        // ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError);
        const ncclResult_t result = ncclCommGetAsyncError(comm, &async_state);
        state = result != ncclSuccess ? result : async_state;
        if (state != ncclInProgress) return true;
        if (state_flag == nullptr || state_flag->load() == static_cast<int>(CommState::kOk)) return false;
        state = kAbortRequested;
        return true;
      },
      timeout_s);
  return settled ? state : ncclInProgress;
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

Communicator::Communicator(const std::string& unique_id, int world_size, int rank, int device, CommOptions options)
    : world_size_(world_size), rank_(rank), device_(device), options_(std::move(options)),
      timeout_s_(options_.timeout_s) {
  // NOTE: runs without the GIL; PYNCCL_CHECK_* throw pynccl's own exceptions (see check.h).
  PYNCCL_CHECK_VALUE(unique_id.size() == sizeof(ncclUniqueId), "Communicator: unique_id must be ",
                     sizeof(ncclUniqueId), " bytes (from get_unique_id()), got ", unique_id.size());
  PYNCCL_CHECK_VALUE(world_size >= 1, "Communicator: world_size must be >= 1, got ", world_size);
  PYNCCL_CHECK_VALUE(rank >= 0 && rank < world_size, "Communicator: rank ", rank, " is out of range for world_size ",
                     world_size);
  PYNCCL_CHECK_VALUE(options_.timeout_s > 0, "Communicator: timeout_s must be > 0, got ", options_.timeout_s);
  if (options_.name.empty()) options_.name = "comm" + std::to_string(g_num_comms.fetch_add(1));

  const int runtime = nccl_runtime_version();
  if (runtime < kMinRuntimeVersion) {
    throw Error("Communicator: pynccl needs NCCL >= " + nccl_version_string(kMinRuntimeVersion) +
                " at run time, but this process loaded NCCL " + nccl_version_string(runtime));
  }
  int num_devices = 0;
  const cudaError_t err = cudaGetDeviceCount(&num_devices);
  if (err != cudaSuccess || num_devices == 0) {
    (void)cudaGetLastError();
    throw Error(std::string("Communicator: the nccl backend needs a CUDA GPU, but none is usable here (") +
                (err != cudaSuccess ? std::string("cudaGetDeviceCount: ") + cudaGetErrorName(err) + ": " +
                                          cudaGetErrorString(err)
                                    : std::string("cudaGetDeviceCount found 0 devices")) +
                "); use the gloo backend on machines without a GPU");
  }
  PYNCCL_CHECK_VALUE(device >= 0 && device < num_devices, "Communicator: device ", device,
                     " is out of range: this process sees ", num_devices, " CUDA device(s)");

  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  ncclUniqueId id;
  std::memcpy(&id, unique_id.data(), sizeof(id));
  ncclConfig_t config = make_config(options_);
  start();  // NOTE: the watchdog first: it bounds the (blocking by default) init below
  try {
    ncclComm_t comm = nullptr;
    set_active("init", 0, now_ns());
    // ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank,
    //                                     ncclConfig_t* config);
    ncclResult_t result = ncclCommInitRankConfig(&comm, world_size, id, rank, &config);
    if (comm != nullptr && (result == ncclInProgress || (result == ncclSuccess && !options_.blocking))) {
      result = wait_comm_ready(comm, options_.timeout_s);
    }
    clear_active();
    if (result != ncclSuccess) {
      const std::string last = comm != nullptr ? ncclGetLastError(comm) : ncclGetLastError(nullptr);
      if (comm != nullptr) (void)ncclCommAbort(comm);
      if (result == ncclInProgress) {
        timed_out("init (ncclCommInitRankConfig) did not complete within " + seconds_text(options_.timeout_s) +
                      " (did every rank call it with the same unique id?)",
                  /*caller_in_flight=*/false);
      }
      throw Error(describe() + ": ncclCommInitRankConfig failed: " + ncclGetErrorString(result) +
                  (last.empty() ? "" : " (last NCCL error: " + last + ")"));
    }
    comm_ = comm;
  } catch (...) {
    stop_on_throw();
    throw;
  }
  state_.store(static_cast<int>(CommState::kOk));
}

Communicator::Communicator(PrivateTag, ncclComm_t comm, int world_size, int rank, int device, CommOptions options)
    : world_size_(world_size), rank_(rank), device_(device), options_(std::move(options)), comm_(comm),
      timeout_s_(options_.timeout_s) {
  try {
    start();
  } catch (...) {
    (void)ncclCommAbort(comm_);  // NOTE: the destructor does not run for a throwing constructor
    comm_ = nullptr;
    stop_on_throw();
    throw;
  }
  state_.store(static_cast<int>(CommState::kOk));
}

void Communicator::stop_on_throw() noexcept {
  try {
    stop_watchdog();
  } catch (...) {
  }
}

void Communicator::start() {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  // PYNCCL_COMM_STREAM_HIGH_PRIORITY=0: the communicator's stream at normal priority (torch's default).
  const bool high_priority = env_int("PYNCCL_COMM_STREAM_HIGH_PRIORITY", 1) != 0;
  comm_stream_ = unshared_stream(high_priority, device_);
  events_ = std::make_shared<EventPool>(device_, /*num_preallocated=*/16);
  ring_.resize(static_cast<size_t>(std::max(1, env_int("PYNCCL_FLIGHT_RECORDER_SIZE", 64))));
  use_native_alltoall_ = env_int("PYNCCL_NATIVE_ALLTOALL", 1) != 0;
  watchdog_poll_ = std::chrono::milliseconds(std::max(1, env_int("PYNCCL_WATCHDOG_POLL_MS", 100)));
  epoch_offset_us_ = std::chrono::duration_cast<std::chrono::microseconds>(
                         std::chrono::system_clock::now().time_since_epoch()).count() -
                     std::chrono::duration_cast<std::chrono::microseconds>(Clock::now().time_since_epoch()).count();
  watchdog_ = std::thread([this] { watchdog_loop(); });
}

Communicator::~Communicator() {
  // NOTE: never a collective here (DESIGN.md §4): a communicator dropped without destroy()
  // is aborted, which is local. Errors are swallowed: destructors never throw.
  try {
    stop_watchdog();
    {
      std::lock_guard<std::mutex> lock(lifecycle_mutex_);
      if (comm_ != nullptr && !abort_claimed_.exchange(true)) abort_now();
    }
    release_tracked();
    if (comm_stream_) release_stream(device_, comm_stream_->stream());
  } catch (...) {
  }
}

std::string Communicator::describe() const {
  return "communicator '" + options_.name + "' (rank " + std::to_string(rank_) + " of " + std::to_string(world_size_) +
         ", cuda:" + std::to_string(device_) + ")";
}

void Communicator::set_timeout_s(double timeout_s) {
  PYNCCL_CHECK_VALUE(timeout_s > 0, "timeout_s must be > 0, got ", timeout_s);
  timeout_s_.store(timeout_s);
}

void Communicator::throw_unusable(const char* fn) const {
  const std::string prefix = std::string(fn) + ": " + describe();
  if (state_.load() == static_cast<int>(CommState::kDestroyed)) throw Error(prefix + " was destroyed");
  std::lock_guard<std::mutex> lock(error_mutex_);
  if (error_message_.empty()) throw Error(prefix + " was aborted (abort() was called)");
  if (error_is_timeout_) throw TimeoutError(prefix + " was aborted: " + error_message_);
  throw Error(prefix + " was aborted: " + error_message_);
}

void Communicator::finish_nccl_call(ncclResult_t result, const char* call, const char* file, int line,
                                    OpScope& scope) {
  if (result == ncclInProgress) {
    const double timeout = timeout_s();
    result = wait_comm_ready(comm_, timeout, &state_);
    if (result == ncclSuccess) return;
    if (result == kAbortRequested) throw_unusable(scope.op_);
    if (result == ncclInProgress) {
      scope.unfinished_state_ = OpState::kTimedOut;
      scope.record_entry(OpState::kTimedOut, 0);  // so the dump names the op
      // NOTE: worded as the watchdog's, Work.synchronize's and barrier's time-outs: "<op> (seq N)".
      timed_out(std::string(scope.op_) + " (seq " + std::to_string(scope.seq_) + ") did not complete within " +
                    seconds_text(timeout) + ": " + call + " was still in progress",
                /*caller_in_flight=*/true);
    }
  }
  try {
    throw_nccl_error(result, call, file, line, comm_);
  } catch (const Error& e) {  // NOTE: named as a time-out is: which op, which communicator
    throw Error(describe() + ": " + scope.op_ + " (seq " + std::to_string(scope.seq_) + "): " + e.what());
  }
}

void Communicator::fail(bool is_timeout, const std::string& message, bool caller_in_flight) {
  {
    std::lock_guard<std::mutex> lock(error_mutex_);
    if (error_message_.empty()) {
      error_message_ = message;
      error_is_timeout_ = is_timeout;
    }
  }
  stop_watchdog();  // a no-op on the watchdog thread itself
  (void)abort_nccl(caller_in_flight);
}

void Communicator::timed_out(const std::string& what, bool caller_in_flight, uint64_t seq) {
  if (seq != UINT64_MAX) {
    std::lock_guard<std::mutex> lock(mutex_);
    set_entry_state(seq, OpState::kTimedOut);
  }
  const std::string path = dump_flight_record(what);
  if (!options_.raise_on_timeout) tear_down_process(describe() + ": " + what + ". Flight record: " + path);
  const std::string message = what + "; the communicator was aborted. Flight record: " + path;
  fail(/*is_timeout=*/true, message, caller_in_flight);
  throw TimeoutError(describe() + ": " + message);
}

bool Communicator::abort_nccl(bool caller_in_flight) {
  std::lock_guard<std::mutex> lock(lifecycle_mutex_);
  int expected = static_cast<int>(CommState::kOk);
  state_.compare_exchange_strong(expected, static_cast<int>(CommState::kAborted));
  if (comm_ == nullptr || abort_claimed_.load()) return true;
  abort_pending_.store(true);
  // NOTE: state_ is set before in_flight_ is read, and calls raise in_flight_ before reading
  // state_, so once in_flight_ drains no call can still be inside NCCL with comm_. A polling
  // call (non-blocking) sees state_ and leaves within one poll; a call blocked inside NCCL may
  // never leave: then the abort is its leave_call()'s (and its time-out the watchdog's).
  const int self = caller_in_flight ? 1 : 0;
  if (!poll_until([&] { return in_flight_.load() <= self; }, 1.0)) return false;
  if (!abort_claimed_.exchange(true)) abort_now();
  return true;
}

void Communicator::finish_deferred_abort() {
  if (abort_claimed_.exchange(true)) return;
  std::lock_guard<std::mutex> lock(lifecycle_mutex_);
  abort_now();
}

namespace {

// How long an abort waits for ncclCommAbort before it returns anyway.
constexpr double kTeardownWaitS = 10.0;

// ncclCommAbort(comm) (a communicator nobody else uses any more) on a thread of its own, waited
// for at most kTeardownWaitS. NCCL's abort does not return while a CUDA graph that captured the
// communicator's collectives is alive (commDestroySync polls until no graph references it:
// NVIDIA/nccl src/init.cc), and an abort must not hang its caller (a watchdog's time-out, an error
// path, a destructor). Past the wait it finishes in the background, once the graphs are
// destroyed, and a line on stderr says so. `running` is true until it returns (on that thread).
// (A destroy's finalize waits for the graphs too, bounded by the group's timeout; the
// ncclCommDestroy after it does not wait for them.)
// NOTE: reached from leave_call() inside noexcept destructors too: nothing here may throw. Where no
// thread can be started, the abort runs here, unbounded, as before.
void abort_bounded(ncclComm_t comm, int device, const char* what,
                   const std::shared_ptr<std::atomic<bool>>& running) noexcept {
  std::future<void> done;
  try {
    auto finished = std::make_shared<std::promise<void>>();
    done = finished->get_future();
    running->store(true);
    std::thread([comm, device, finished, running] {
      (void)cudaSetDevice(device);
      // ncclResult_t ncclCommAbort(ncclComm_t comm);
      (void)ncclCommAbort(comm);
      running->store(false);
      finished->set_value();
    }).detach();
  } catch (...) {
    running->store(false);
    (void)ncclCommAbort(comm);
    return;
  }
  if (done.wait_for(std::chrono::duration<double>(kTeardownWaitS)) == std::future_status::ready) return;
  try {
    std::cerr << "pynccl: " << what << " has not returned after " << kTeardownWaitS
              << " s: NCCL waits for every CUDA graph that captured this communicator's collectives to be "
                 "destroyed (drop them: del graph; gc.collect()); it finishes in the background then\n";
  } catch (...) {
  }
}

}  // namespace

void Communicator::abort_now() {
  if (comm_ == nullptr) return;
  ncclComm_t comm = std::exchange(comm_, nullptr);
  std::string what = "ncclCommAbort";
  try {
    what += " of " + describe();
  } catch (...) {
  }
  abort_bounded(comm, device_, what.c_str(), nccl_abort_running_);
}

void Communicator::stop_watchdog() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_watchdog_ = true;
  }
  watchdog_cv_.notify_all();
  if (std::this_thread::get_id() == watchdog_id_.load()) return;
  std::lock_guard<std::mutex> lock(lifecycle_join_mutex_);
  if (watchdog_.joinable()) watchdog_.join();
}

void Communicator::release_tracked() {
  // NOTE: abort() and destroy() (or two abort()s) may run at once on two threads, both after the
  // watchdog's join: each takes the lists under mutex_, so one gets the ops and the other none.
  // No NCCL or CUDA call is made under the lock.
  std::vector<TrackedOp> ops;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ops = std::exchange(watch_list_, {});
    for (auto& op : new_ops_) ops.push_back(std::move(op));
    new_ops_.clear();
  }
  std::vector<cudaEvent_t> events;
  for (const auto& op : ops) {
    if (!op.work) events.push_back(op.event);
  }
  events_->put_many(events);
  ops.clear();  // drops WorkStates (and their tensors) on this thread
  drain_graveyard();
}

void Communicator::drain_graveyard() {
  std::vector<std::shared_ptr<WorkState>> dead;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    dead.swap(graveyard_);
    graveyard_nonempty_.store(false, std::memory_order_relaxed);
  }
  // dead goes out of scope here, outside mutex_: a tensor's last release may need the GIL.
}

void Communicator::abort() {
  // NOTE: with a call still inside NCCL on another thread, that call aborts on its way out and
  // the watchdog keeps bounding it; otherwise the communicator is gone here.
  if (!abort_nccl(/*caller_in_flight=*/false)) return;
  stop_watchdog();
  release_tracked();
}

bool Communicator::is_aborted() const { return state_.load() == static_cast<int>(CommState::kAborted); }

void Communicator::destroy() {
  std::unique_lock<std::mutex> lock(lifecycle_mutex_);
  const bool abort_deferred = abort_pending_.load() && !abort_claimed_.load();
  state_.store(static_cast<int>(CommState::kDestroyed));
  if (comm_ == nullptr || abort_claimed_.load() || abort_deferred) {  // aborted, or destroyed twice: nothing collective left
    lock.unlock();
    if (abort_deferred) return;  // a call still inside NCCL aborts on its way out; the watchdog keeps bounding it
    stop_watchdog();
    release_tracked();
    return;
  }
  const double timeout = timeout_s();
  if (!poll_until([this] { return in_flight_.load() == 0; }, timeout)) {
    abort_pending_.store(true);  // the call still in flight aborts on its way out
    if (in_flight_.load() == 0 && !abort_claimed_.exchange(true)) abort_now();
    throw Error("destroy: " + describe() + ": a call on another thread stayed inside NCCL for " +
                seconds_text(timeout) + "; the communicator is aborted when it returns");
  }
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  // NOTE: the watchdog runs on until finalize returns: it bounds a blocking finalize too.
  set_active("destroy", seq(), now_ns());
  // ncclResult_t ncclCommFinalize(ncclComm_t comm);
  ncclResult_t result = ncclCommFinalize(comm_);
  if (result == ncclInProgress || (result == ncclSuccess && !options_.blocking)) result = wait_comm_ready(comm_, timeout);
  clear_active();
  abort_claimed_.store(true);  // comm_ is retired below, whatever happens
  if (result != ncclSuccess) {
    const std::string last = ncclGetLastError(comm_);
    abort_now();
    lock.unlock();
    stop_watchdog();
    release_tracked();
    if (result == ncclInProgress) {
      timed_out("destroy (ncclCommFinalize) did not complete within " + seconds_text(timeout) +
                    " (did every rank call destroy?)",
                /*caller_in_flight=*/false);
    }
    throw Error("destroy: ncclCommFinalize on " + describe() + " failed: " + ncclGetErrorString(result) +
                (last.empty() ? "" : " (last NCCL error: " + last + ")") + "; the communicator was aborted");
  }
  // ncclResult_t ncclCommDestroy(ncclComm_t comm);
  result = ncclCommDestroy(comm_);
  comm_ = nullptr;
  lock.unlock();
  stop_watchdog();
  release_tracked();
  if (result != ncclSuccess) throw_nccl_error(result, "ncclCommDestroy(comm_)", __FILE__, __LINE__, nullptr);
}

std::shared_ptr<Communicator> Communicator::split(int color, int key, std::optional<double> timeout_s,
                                                  const std::string& name) {
  check_usable("split");
  const double timeout = timeout_s.value_or(this->timeout_s());
  PYNCCL_CHECK_VALUE(timeout > 0, "split: timeout_s must be > 0, got ", timeout);
  CommOptions child = options_;
  child.timeout_s = timeout;
  child.name = !name.empty() ? name : options_.name + ".split" + std::to_string(color);
  ncclConfig_t config = make_config(child);
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  const InFlight in_flight(*this);
  check_usable("split");
  ncclComm_t new_comm = nullptr;
  set_active("split", seq(), now_ns());
  // ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t* config);
  ncclResult_t result = ncclCommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &new_comm, &config);
  if (result == ncclInProgress || (result == ncclSuccess && !options_.blocking)) {
    // NOTE: a non-blocking split progresses on the parent; the child exists only where color >= 0.
    result = wait_comm_ready(comm_, timeout, &state_);
    if (result == ncclSuccess && new_comm != nullptr) result = wait_comm_ready(new_comm, timeout, &state_);
  }
  clear_active();
  if (result != ncclSuccess) {
    if (new_comm != nullptr) (void)ncclCommAbort(new_comm);
    if (result == kAbortRequested) throw_unusable("split");
    if (result == ncclInProgress) {
      timed_out("split (new_group '" + child.name + "', color " + std::to_string(color) +
                    ") did not complete within " + seconds_text(timeout),
                /*caller_in_flight=*/true);
    }
    throw_nccl_error(result, "ncclCommSplit", __FILE__, __LINE__, comm_);
  }
  if (new_comm == nullptr) return nullptr;
  int new_size = 0;
  int new_rank = 0;
  try {
    PYNCCL_CHECK_NCCL(ncclCommCount(new_comm, &new_size));
    PYNCCL_CHECK_NCCL(ncclCommUserRank(new_comm, &new_rank));
  } catch (...) {
    (void)ncclCommAbort(new_comm);  // nothing owns the child yet: do not leak it
    throw;
  }
  // NOTE: from here the child Communicator owns new_comm; its constructor aborts it if start() throws.
  return std::make_shared<Communicator>(PrivateTag{}, new_comm, new_size, new_rank, device_, std::move(child));
}

}  // namespace pynccl
