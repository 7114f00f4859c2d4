// Bounded host waits, shared by every place that waits on the host for NCCL or the GPU
// (non-blocking NCCL calls, Work.synchronize, barrier): one poll loop, one way to print seconds.
// The loop yields for the first polls (a short wait costs a few µs) and then naps with a
// doubling back-off capped at 1 ms (a long wait costs no CPU).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

namespace pynccl {

// Calls `done()` until it returns true (then true) or `timeout_s` has passed (then false).
template <typename Done>
bool poll_until(Done&& done, double timeout_s) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
  auto nap = std::chrono::microseconds(1);
  for (int num_polls = 0;; ++num_polls) {
    if (done()) return true;
    if (Clock::now() > deadline) return false;
    if (num_polls < 64) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::microseconds(1000));
    }
  }
}

// "10 s", "0.5 s": how every time-out message prints its limit.
inline std::string seconds_text(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.3g s", s);
  return buf;
}

}  // namespace pynccl
