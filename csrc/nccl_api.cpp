// Run-time version of NCCL and the entry points newer than our floor, resolved from the very
// libnccl we are linked to (dladdr on a linked symbol), never from a second copy.
#include "nccl_api.h"

#include <dlfcn.h>

#include <type_traits>

#include "check.h"

namespace pynccl {

int nccl_runtime_version() {
  static const int version = [] {
    int v = 0;
    PYNCCL_CHECK_NCCL(ncclGetVersion(&v));
    return v;
  }();
  return version;
}

std::string nccl_version_string(int code) {
  const bool old = code < 10000;
  const int major = old ? code / 1000 : code / 10000;
  const int minor = old ? (code % 1000) / 100 : (code % 10000) / 100;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(code % 100);
}

#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
static_assert(std::is_same<decltype(&ncclAlltoAll), AlltoAllFn>::value, "ncclAlltoAll prototype changed");
static_assert(std::is_same<decltype(&ncclGather), RootedFn>::value, "ncclGather prototype changed");
static_assert(std::is_same<decltype(&ncclScatter), RootedFn>::value, "ncclScatter prototype changed");
#endif

#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 19, 0)
static_assert(std::is_same<decltype(&ncclCommRegister), RegisterFn>::value, "ncclCommRegister prototype changed");
static_assert(std::is_same<decltype(&ncclCommDeregister), DeregisterFn>::value, "ncclCommDeregister prototype changed");
static_assert(std::is_same<decltype(&ncclMemAlloc), MemAllocFn>::value, "ncclMemAlloc prototype changed");
static_assert(std::is_same<decltype(&ncclMemFree), MemFreeFn>::value, "ncclMemFree prototype changed");
#endif
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 27, 0)
// ncclResult_t ncclCommWindowRegister(ncclComm_t comm, void* buff, size_t size, ncclWindow_t* win, int winFlags);
// ncclResult_t ncclCommWindowDeregister(ncclComm_t comm, ncclWindow_t win);
static_assert(std::is_pointer<ncclWindow_t>::value, "ncclWindow_t is no longer a pointer");
static_assert(NCCL_WIN_COLL_SYMMETRIC == 0x01, "NCCL_WIN_COLL_SYMMETRIC changed");
static_assert(NCCL_CTA_POLICY_ZERO == 0x02, "NCCL_CTA_POLICY_ZERO changed");
#endif

const OptionalNcclApi& optional_nccl_api() {
  static const OptionalNcclApi api = [] {
    OptionalNcclApi out;
    Dl_info info{};
    if (dladdr(reinterpret_cast<void*>(&ncclGetVersion), &info) == 0 || info.dli_fname == nullptr) return out;
    // NOTE: RTLD_NOLOAD: only a handle to the library already mapped, never a second copy.
    void* lib = dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) return out;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 19, 0)
    if (nccl_runtime_version() >= kRegisterVersion) {
      out.comm_register = reinterpret_cast<RegisterFn>(dlsym(lib, "ncclCommRegister"));
      out.comm_deregister = reinterpret_cast<DeregisterFn>(dlsym(lib, "ncclCommDeregister"));
      out.mem_alloc = reinterpret_cast<MemAllocFn>(dlsym(lib, "ncclMemAlloc"));
      out.mem_free = reinterpret_cast<MemFreeFn>(dlsym(lib, "ncclMemFree"));
    }
#endif
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 27, 0)
    if (nccl_runtime_version() >= kWindowVersion) {
      out.window_register = reinterpret_cast<WindowRegisterFn>(dlsym(lib, "ncclCommWindowRegister"));
      out.window_deregister = reinterpret_cast<WindowDeregisterFn>(dlsym(lib, "ncclCommWindowDeregister"));
    }
#endif
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
    if (nccl_runtime_version() >= kNativeAlltoAllVersion) {
      out.alltoall = reinterpret_cast<AlltoAllFn>(dlsym(lib, "ncclAlltoAll"));
      out.gather = reinterpret_cast<RootedFn>(dlsym(lib, "ncclGather"));
      out.scatter = reinterpret_cast<RootedFn>(dlsym(lib, "ncclScatter"));
    }
#endif
    return out;
  }();
  return api;
}

}  // namespace pynccl
