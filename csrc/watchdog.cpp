// The watchdog thread and the flight recorder of a Communicator, and what a time-out does.
// Every PYNCCL_WATCHDOG_POLL_MS (100 ms) the watchdog checks the call a thread is making into
// NCCL (active_), the end events of outstanding ops and ncclCommGetAsyncError. A call or op
// older than timeout_s, or an async error, makes it dump the flight record as JSON; then, by
// default, it ends the process (tear_down_process), and with on_timeout=raise it aborts the
// communicator and the next call from Python raises the stored error. It never runs Python
// and never drops a tensor: finished WorkStates go to a graveyard the Python thread empties,
// since releasing a tensor may need the GIL.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "check.h"
#include "communicator.h"
#include "nccl_api.h"

namespace pynccl {
namespace {

using Clock = std::chrono::steady_clock;

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

std::string file_safe(const std::string& s) {
  std::string out = s;
  for (char& c : out) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_' && c != '.') c = '_';
  }
  return out;
}

}  // namespace

const char* op_state_name(OpState state) {
  switch (state) {
    case OpState::kEnqueued: return "enqueued";
    case OpState::kCompleted: return "completed";
    case OpState::kFailed: return "failed";
    case OpState::kTimedOut: return "timed_out";
    case OpState::kAborted: return "aborted";
    case OpState::kCaptured: return "captured";
    case OpState::kUntracked: return "untracked";
  }
  return "?";
}

void Communicator::watchdog_loop() {
  watchdog_id_.store(std::this_thread::get_id());
  // NOTE: this thread's CUDA calls (cudaEventQuery) must not invalidate a CUDA graph that
  // another thread captures in the default global mode: relaxed mode exempts this thread.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  (void)cudaThreadExchangeStreamCaptureMode(&mode);
  (void)cudaSetDevice(device_);
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      watchdog_cv_.wait_for(lock, watchdog_poll_, [this] { return stop_watchdog_; });
      if (stop_watchdog_) return;
      for (auto& op : new_ops_) watch_list_.push_back(std::move(op));
      new_ops_.clear();
    }
    if (!watchdog_poll()) return;
  }
}

bool Communicator::watchdog_poll() {
  const auto now = Clock::now();
  const auto timeout = std::chrono::duration<double>(timeout_s());
  if (!options_.raise_on_timeout) {
    // NOTE: checked in every state: a thread inside NCCL is a hang whether or not the
    // communicator was aborted or is being destroyed meanwhile. With on_timeout=raise every
    // such call is a poll on its own thread, bounded there.
    const int64_t now_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(now.time_since_epoch()).count();
    const std::string overdue = active_.overdue(now_ns, timeout.count());
    if (!overdue.empty()) watchdog_fail("watchdog: " + overdue, /*is_timeout=*/true, active_.seq.load());
  }
  const int state = state_.load();
  if (state != static_cast<int>(CommState::kOk)) {
    // Starting (init), being destroyed (finalize), or aborted with a call still inside NCCL:
    // only that call is watched.
    return state == static_cast<int>(CommState::kStarting) || state == static_cast<int>(CommState::kDestroyed) ||
           active_.start_ns.load() != 0;
  }
  std::vector<uint64_t> completed;
  std::vector<cudaEvent_t> free_events;
  std::vector<std::shared_ptr<WorkState>> finished_work;
  std::string failure;
  bool is_timeout = false;
  uint64_t failed_seq = 0;
  size_t num_kept = 0;
  for (size_t i = 0; i < watch_list_.size(); ++i) {
    TrackedOp& op = watch_list_[i];
    const cudaError_t query = cudaEventQuery(op.event);
    if (query == cudaSuccess) {
      completed.push_back(op.seq);
      if (op.work) {
        finished_work.push_back(std::move(op.work));
      } else {
        free_events.push_back(op.event);
      }
      continue;
    }
    if (failure.empty()) {
      if (query != cudaErrorNotReady) {
        (void)cudaGetLastError();
        failure = std::string("watchdog: CUDA error while waiting for ") + op.op + " (seq " + std::to_string(op.seq) +
                  "): " + cudaGetErrorName(query) + ": " + cudaGetErrorString(query);
        failed_seq = op.seq;
      } else if (now - op.enqueued > timeout) {
        failure = std::string("watchdog: ") + op.op + " (seq " + std::to_string(op.seq) + ") did not complete within " +
                  seconds_text(timeout.count());
        failed_seq = op.seq;
        is_timeout = true;
      }
    }
    if (num_kept != i) watch_list_[num_kept] = std::move(op);
    ++num_kept;
  }
  watch_list_.resize(num_kept);
  if (!free_events.empty()) events_->put_many(free_events);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const uint64_t seq : completed) set_entry_state(seq, OpState::kCompleted);
    if (!finished_work.empty()) {
      for (auto& work : finished_work) graveyard_.push_back(std::move(work));
      graveyard_nonempty_.store(true, std::memory_order_relaxed);
    }
  }
  if (failure.empty()) {
    const InFlight in_flight(*this);  // NOTE: an abort on another thread waits for this call
    ncclResult_t async_state = ncclSuccess;
    if (state_.load() == static_cast<int>(CommState::kOk) && ncclCommGetAsyncError(comm_, &async_state) == ncclSuccess &&
        async_state != ncclSuccess && async_state != ncclInProgress) {
      const std::string last = ncclGetLastError(comm_);
      failure = std::string("watchdog: NCCL async error: ") + ncclGetErrorString(async_state) +
                (last.empty() ? "" : " (last NCCL error: " + last + ")");
      failed_seq = UINT64_MAX;
      // Name the op it hit, as a time-out does: the one a thread is inside NCCL for, else the oldest.
      const char* active_op = active_.start_ns.load() != 0 ? active_.op.load() : nullptr;
      if (active_op != nullptr || !watch_list_.empty()) {
        failed_seq = active_op != nullptr ? active_.seq.load() : watch_list_.front().seq;
        failure += std::string(" while ") + (active_op != nullptr ? active_op : watch_list_.front().op) + " (seq " +
                   std::to_string(failed_seq) + ") was unfinished";
      }
    }
  }
  if (failure.empty()) return true;
  watchdog_fail(failure, is_timeout, failed_seq);
  return false;
}

void Communicator::watchdog_fail(const std::string& failure, bool is_timeout, uint64_t failed_seq) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& op : watch_list_) {
      set_entry_state(op.seq, op.seq == failed_seq ? (is_timeout ? OpState::kTimedOut : OpState::kFailed)
                                                   : OpState::kAborted);
    }
  }
  const std::string path = dump_flight_record(failure);
  if (!options_.raise_on_timeout) tear_down_process(describe() + ": " + failure + ". Flight record: " + path);
  fail(is_timeout, failure + "; the communicator was aborted. Flight record: " + path, /*caller_in_flight=*/false);
}

std::string ActiveCall::overdue(int64_t now_ns, double timeout_s) const {
  const int64_t started = start_ns.load(std::memory_order_acquire);
  if (started == 0 || static_cast<double>(now_ns - started) <= timeout_s * 1e9) return {};
  const char* op_name = op.load(std::memory_order_relaxed);
  const uint64_t op_seq = seq.load(std::memory_order_relaxed);
  // NOTE: read again: the call may have returned (or another begun) while op and seq were read.
  if (start_ns.load(std::memory_order_acquire) != started || op_name == nullptr) return {};
  return std::string(op_name) + " (seq " + std::to_string(op_seq) + ") did not complete within " + seconds_text(timeout_s) +
         ": this rank is still inside the NCCL call, waiting for a peer that did not arrive";
}

void tear_down_process(const std::string& message) {
  // NOTE: write(2) and _exit(2) only: no stdio lock, no atexit handler, no Python, no NCCL
  // call, any of which another thread (the one inside NCCL, holding the GIL) may be holding.
  const std::string text =
      "pynccl: " + message + "\npynccl: ending this process with exit code " + std::to_string(kTimeoutExitCode) +
      " so that no result of the unfinished op reaches the program (PYNCCL_ON_TIMEOUT=raise raises "
      "pynccl.CommTimeoutError instead); each rank's flight record names the op it was in.\n";
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(STDERR_FILENO, text.data() + done, text.size() - done);
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  ::_exit(kTimeoutExitCode);
}

std::pair<bool, bool> resolve_timeout_policy(const std::optional<std::string>& on_timeout,
                                             std::optional<bool> blocking) {
  const char* env_mode = std::getenv("PYNCCL_ON_TIMEOUT");
  const std::string mode = on_timeout ? *on_timeout
                           : (env_mode != nullptr && env_mode[0] != '\0') ? env_mode
                                                                          : "teardown";
  PYNCCL_CHECK_VALUE(mode == "teardown" || mode == "raise",
                     "on_timeout (PYNCCL_ON_TIMEOUT) must be 'teardown' or 'raise', got '", mode, "'");
  const bool raise = mode == "raise";
  const char* env_nonblocking = std::getenv("PYNCCL_NCCL_NONBLOCKING");
  const bool nonblocking_env = env_nonblocking != nullptr && std::string(env_nonblocking) == "1";
  const bool is_blocking = blocking ? *blocking : !(raise || nonblocking_env);
  PYNCCL_CHECK_VALUE(!(raise && is_blocking),
                     "on_timeout='raise' needs a non-blocking communicator (a thread inside a blocking NCCL "
                     "call cannot be interrupted), got blocking=True");
  return {is_blocking, raise};
}

std::optional<std::string> Communicator::get_async_error() {
  {
    std::lock_guard<std::mutex> lock(error_mutex_);
    if (!error_message_.empty()) return error_message_;
  }
  const InFlight in_flight(*this);
  if (state_.load() != static_cast<int>(CommState::kOk)) return std::nullopt;
  ncclResult_t state = ncclSuccess;
  if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess || state == ncclSuccess || state == ncclInProgress) {
    return std::nullopt;
  }
  const std::string last = ncclGetLastError(comm_);
  return std::string(ncclGetErrorString(state)) + (last.empty() ? "" : " (last NCCL error: " + last + ")");
}

void Communicator::check() {
  {
    std::lock_guard<std::mutex> lock(error_mutex_);
    if (!error_message_.empty()) {
      const std::string msg = "check: " + describe() + " was aborted: " + error_message_;
      if (error_is_timeout_) throw TimeoutError(msg);
      throw Error(msg);
    }
  }
  if (const auto error = get_async_error()) {
    const std::string msg = "NCCL async error: " + *error;
    fail(/*is_timeout=*/false, msg, /*caller_in_flight=*/false);
    throw Error("check: " + describe() + " was aborted: " + msg);
  }
}

void Communicator::set_entry_state(uint64_t seq, OpState state) {
  FlightEntry& entry = ring_[seq % ring_.size()];
  if (entry.op != nullptr && entry.seq == seq) entry.state = state;
}

std::vector<FlightEntry> Communicator::flight_record() const {
  std::vector<FlightEntry> entries;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& entry : ring_) {
      if (entry.op != nullptr) entries.push_back(entry);
    }
  }
  std::sort(entries.begin(), entries.end(), [](const FlightEntry& a, const FlightEntry& b) { return a.seq < b.seq; });
  return entries;
}

size_t Communicator::flight_recorder_size() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return ring_.size();
}

void Communicator::set_flight_recorder_size(size_t size) {
  PYNCCL_CHECK_VALUE(size >= 1, "flight_recorder_size must be >= 1, got ", size);
  const std::vector<FlightEntry> entries = flight_record();
  std::lock_guard<std::mutex> lock(mutex_);
  ring_.assign(size, FlightEntry{});
  for (const auto& entry : entries) ring_[entry.seq % size] = entry;  // the newest win
}

std::string flight_record_json(const std::string& name, int rank, int world_size, int device,
                               const std::string& reason, uint64_t seq, const std::vector<FlightEntry>& entries) {
  std::string json = "{\"group\": " + json_string(name) + ", \"rank\": " + std::to_string(rank) +
                     ", \"world_size\": " + std::to_string(world_size) + ", \"device\": " + std::to_string(device) +
                     ", \"reason\": " + json_string(reason) +
                     ", \"nccl_version\": " + json_string(nccl_version_string(nccl_runtime_version())) +
                     ", \"seq\": " + std::to_string(seq) + ", \"entries\": [";
  bool first = true;
  for (const auto& e : entries) {
    json += std::string(first ? "" : ", ") + "{\"seq\": " + std::to_string(e.seq) + ", \"op\": " + json_string(e.op) +
            ", \"dtype\": " + json_string(c10::toString(e.dtype)) + ", \"count\": " + std::to_string(e.count) +
            ", \"peer\": " + std::to_string(e.peer) + ", \"async_op\": " + (e.async_op ? "true" : "false") +
            ", \"enqueue_time_us\": " + std::to_string(e.enqueue_us) +
            ", \"state\": " + json_string(op_state_name(e.state)) + "}";
    first = false;
  }
  return json + "]}\n";
}

std::string write_flight_record_file(const std::string& name, int rank, const std::string& json) {
  // NOTE: plain stdio and POSIX calls, no iostreams or std::filesystem (see Text in check.h).
  const char* dir_env = std::getenv("PYNCCL_FLIGHT_RECORDER_DIR");
  const char* tmp_env = std::getenv("TMPDIR");
  const std::string dir = (dir_env != nullptr && dir_env[0] != '\0')   ? dir_env
                          : (tmp_env != nullptr && tmp_env[0] != '\0') ? tmp_env
                                                                       : "/tmp";
  for (size_t pos = 1; pos <= dir.size(); ++pos) {  // mkdir -p
    if (pos == dir.size() || dir[pos] == '/') (void)::mkdir(dir.substr(0, pos).c_str(), 0755);
  }
  const std::string path = dir + "/pynccl_flight_" + file_safe(name) + "_rank" + std::to_string(rank) + "_pid" +
                           std::to_string(getpid()) + ".json";
  // Written to a temporary name, then renamed: a reader never sees half a file.
  const std::string tmp_path = path + ".tmp";
  FILE* file = std::fopen(tmp_path.c_str(), "w");
  if (file == nullptr) return "(flight record not written: " + tmp_path + ": " + std::strerror(errno) + ")";
  const bool written = std::fwrite(json.data(), 1, json.size(), file) == json.size();
  const bool closed = std::fclose(file) == 0;
  if (!written || !closed || std::rename(tmp_path.c_str(), path.c_str()) != 0) {
    return "(flight record not written: " + path + ": " + std::strerror(errno) + ")";
  }
  return path;
}

std::string Communicator::dump_flight_record(const std::string& reason) {
  try {
    return write_flight_record_file(
        options_.name, rank_,
        flight_record_json(options_.name, rank_, world_size_, device_, reason, seq(), flight_record()));
  } catch (const std::exception& e) {
    return std::string("(flight record not written: ") + e.what() + ")";
  }
}

}  // namespace pynccl
