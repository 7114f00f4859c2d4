// Which CUDA stream a communicator's ops run on (comm_stream.h).
#include "comm_stream.h"

#include <map>
#include <mutex>
#include <set>

#include "check.h"

namespace pynccl {
namespace {

// The streams of the live communicators, per device. torch's stream pool hands out 32 streams per
// priority round-robin (shared with torch.cuda.Stream() and other libraries), so two communicators
// made 32·k draws apart would share a stream: their collectives would run in one queue, and a
// communicator kept apart so that its ops never wait behind another's (ZeRO-3's reduce-scatters
// behind a peer's deferred reduce, while the all-gathers must go on) would deadlock.
std::mutex& live_streams_mutex() {
  static std::mutex m;
  return m;
}
std::map<int, std::multiset<cudaStream_t>>& live_streams() {
  static std::map<int, std::multiset<cudaStream_t>> s;
  return s;
}

}  // namespace

c10::cuda::CUDAStream unshared_stream(bool high_priority, int device) {
  std::lock_guard<std::mutex> lock(live_streams_mutex());
  auto& taken = live_streams()[device];
  for (int i = 0; i < 32; ++i) {
    auto s = c10::cuda::getStreamFromPool(high_priority, static_cast<c10::DeviceIndex>(device));
    if (taken.count(s.stream()) == 0) {
      taken.insert(s.stream());
      return s;
    }
  }
  int least = 0, greatest = 0;
  PYNCCL_CHECK_CUDA(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  cudaStream_t raw = nullptr;
  PYNCCL_CHECK_CUDA(cudaStreamCreateWithPriority(&raw, cudaStreamNonBlocking, high_priority ? greatest : least));
  taken.insert(raw);
  return c10::cuda::getStreamFromExternal(raw, static_cast<c10::DeviceIndex>(device));
}

void release_stream(int device, cudaStream_t s) {
  std::lock_guard<std::mutex> lock(live_streams_mutex());
  auto& taken = live_streams()[device];
  auto it = taken.find(s);
  if (it != taken.end()) taken.erase(it);
}

}  // namespace pynccl
