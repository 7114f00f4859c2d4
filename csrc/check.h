// One error header for the extension: a failed NCCL or CUDA call becomes a C++ exception
// carrying the call text, file:line, ncclGetErrorString and ncclGetLastError; bindings.cpp
// turns pynccl::Error into pynccl.errors.PyncclError and TimeoutError into CommTimeoutError.
// No torch headers here, so kernels' launch glue and the C++ tests can use it too.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <sstream>
#include <stdexcept>
#include <string>

namespace pynccl {

// An NCCL, CUDA or communication failure (Python: pynccl.errors.PyncclError).
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A bounded wait ran out; the communicator has been aborted (Python: CommTimeoutError).
class TimeoutError : public Error {
 public:
  using Error::Error;
};

// Bad input (Python: ValueError / TypeError), thrown by PYNCCL_CHECK_VALUE / _TYPE below.
// NOTE: our own classes rather than c10's TORCH_CHECK_VALUE/TYPE: bindings.cpp translates them
// itself, so argument errors never depend on torch_python's translator (a c10::Error crossing
// our module crashed under torch 2.11 on the GPU machine) and can be thrown without the GIL.
class ValueError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

class TypeError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// Streams every argument into one string (anything with operator<<: c10 dtypes, sizes, ...).
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}

[[noreturn]] inline void throw_nccl_error(ncclResult_t result, const char* call, const char* file, int line,
                                          ncclComm_t comm) {
  std::string msg = std::string("NCCL error in ") + call + " at " + file + ":" + std::to_string(line) + ": " +
                    ncclGetErrorString(result);
  // ncclGetLastError(NULL) returns the last error of this thread when no comm is known.
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && last[0] != '\0') msg += std::string(" (last NCCL error: ") + last + ")";
  throw Error(msg);
}

[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line) {
  // NOTE: cudaGetLastError() clears a non-sticky error so the next unrelated call does not see it.
  (void)cudaGetLastError();
  throw Error(std::string("CUDA error in ") + call + " at " + file + ":" + std::to_string(line) + ": " +
              cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
}

}  // namespace pynccl

#define PYNCCL_CHECK_NCCL(call)                                                          \
  do {                                                                                   \
    ncclResult_t pynccl_result_ = (call);                                                \
    if (__builtin_expect(pynccl_result_ != ncclSuccess, 0))                              \
      ::pynccl::throw_nccl_error(pynccl_result_, #call, __FILE__, __LINE__, nullptr);    \
  } while (0)

#define PYNCCL_CHECK_CUDA(call)                                                          \
  do {                                                                                   \
    cudaError_t pynccl_err_ = (call);                                                    \
    if (__builtin_expect(pynccl_err_ != cudaSuccess, 0))                                 \
      ::pynccl::throw_cuda_error(pynccl_err_, #call, __FILE__, __LINE__);                \
  } while (0)

// Argument checks: the message names what was expected and what was given.
#define PYNCCL_CHECK_VALUE(cond, ...)                                                    \
  do {                                                                                   \
    if (__builtin_expect(!(cond), 0)) throw ::pynccl::ValueError(::pynccl::concat(__VA_ARGS__)); \
  } while (0)

#define PYNCCL_CHECK_TYPE(cond, ...)                                                     \
  do {                                                                                   \
    if (__builtin_expect(!(cond), 0)) throw ::pynccl::TypeError(::pynccl::concat(__VA_ARGS__)); \
  } while (0)
