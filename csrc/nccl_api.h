// What the NCCL library loaded at run time can do. The headers used at build time and the
// library found at run time can differ (docs/design.md §1), so features newer than our floor are
// gated on ncclGetVersion and their entry points are looked up in the loaded libnccl rather
// than linked: an extension built against 2.28 headers still imports on a 2.27 library.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <string>

namespace pynccl {

// Same encoding as NCCL_VERSION(X, Y, Z) in nccl.h.
constexpr int nccl_version_code(int major, int minor, int patch) {
  return (major <= 2 && minor <= 8) ? major * 1000 + minor * 100 + patch : major * 10000 + minor * 100 + patch;
}

// Oldest run-time library we accept: ncclCommSplit and ncclConfig_t.splitShare arrived in 2.18.
constexpr int kMinRuntimeVersion = nccl_version_code(2, 18, 0);
constexpr int kFp8Version = nccl_version_code(2, 24, 0);
constexpr int kNativeAlltoAllVersion = nccl_version_code(2, 28, 0);
constexpr int kRegisterVersion = nccl_version_code(2, 19, 0);    // ncclCommRegister / ncclCommDeregister
constexpr int kCtaPolicyVersion = nccl_version_code(2, 27, 0);   // ncclConfig_t.CTAPolicy
constexpr int kWindowVersion = nccl_version_code(2, 27, 0);      // ncclCommWindowRegister, symmetric kernels
constexpr int kCopyEngineVersion = nccl_version_code(2, 28, 0);  // CTAPolicy ZERO: copy-engine collectives

// ncclGetVersion of the loaded library (cached; throws pynccl::Error if it fails).
int nccl_runtime_version();
// "2.28.9" from 22809.
std::string nccl_version_string(int code);

using AlltoAllFn = ncclResult_t (*)(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                                    ncclComm_t comm, cudaStream_t stream);
using RootedFn = ncclResult_t (*)(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                                  int root, ncclComm_t comm, cudaStream_t stream);
using RegisterFn = ncclResult_t (*)(const ncclComm_t comm, void* buff, size_t size, void** handle);
using DeregisterFn = ncclResult_t (*)(const ncclComm_t comm, void* handle);
using MemAllocFn = ncclResult_t (*)(void** ptr, size_t size);
using MemFreeFn = ncclResult_t (*)(void* ptr);
// The window handle is an opaque pointer (ncclWindow_t); void* here so these compile against
// headers that predate it.
using WindowRegisterFn = ncclResult_t (*)(ncclComm_t comm, void* buff, size_t size, void** win, int win_flags);
using WindowDeregisterFn = ncclResult_t (*)(ncclComm_t comm, void* win);

// Entry points newer than our floor, or nullptr where the headers or the loaded library lack them.
struct OptionalNcclApi {
  AlltoAllFn alltoall = nullptr;  // ncclAlltoAll
  RootedFn gather = nullptr;      // ncclGather
  RootedFn scatter = nullptr;     // ncclScatter
  RegisterFn comm_register = nullptr;      // ncclCommRegister (NCCL >= 2.19)
  DeregisterFn comm_deregister = nullptr;  // ncclCommDeregister
  MemAllocFn mem_alloc = nullptr;          // ncclMemAlloc (NCCL >= 2.19)
  MemFreeFn mem_free = nullptr;            // ncclMemFree
  WindowRegisterFn window_register = nullptr;      // ncclCommWindowRegister (NCCL >= 2.27)
  WindowDeregisterFn window_deregister = nullptr;  // ncclCommWindowDeregister
};
const OptionalNcclApi& optional_nccl_api();

}  // namespace pynccl
