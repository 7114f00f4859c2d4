// One error header for the extension: a failed NCCL or CUDA call becomes a C++ exception
// carrying the call text, file:line, ncclGetErrorString and ncclGetLastError; bindings.cpp
// turns pynccl::Error into pynccl.errors.PyncclError and TimeoutError into CommTimeoutError.
// No torch headers here, so kernels' launch glue and the C++ tests can use it too.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdio>
#include <stdexcept>
#include <string>
#include <type_traits>

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
// NOTE: our own classes and messages rather than TORCH_CHECK_VALUE/TYPE, whose c10::str message
// goes through std::ostringstream: see Text below. bindings.cpp translates these itself.
class ValueError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

class TypeError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// Text of one part of a message, specialised per type (dtypes.h and op_helpers.h add the torch
// types). NOTE: _C formats nothing through iostreams. Built on the GPU image (/opt/gcc/bin/g++,
// not the compiler of the libstdc++ the process loads), every message that put a number through
// a std::ostringstream (ours, or c10::str in TORCH_CHECK) segfaulted, while string-only ones and
// std::to_string/snprintf worked.
template <typename T, typename Enable = void>
struct Text;  // no primary definition: a type without a specialisation fails to compile

template <>
struct Text<std::string> {
  static std::string of(const std::string& v) { return v; }
};
template <>
struct Text<const char*> {
  static std::string of(const char* v) { return v != nullptr ? v : "(null)"; }
};
template <>
struct Text<char*> {
  static std::string of(const char* v) { return v != nullptr ? v : "(null)"; }
};
template <>
struct Text<bool> {
  static std::string of(bool v) { return v ? "true" : "false"; }
};
template <typename T>
struct Text<T, std::enable_if_t<std::is_integral<T>::value && !std::is_same<T, bool>::value>> {
  static std::string of(T v) {
    return std::is_signed<T>::value ? std::to_string(static_cast<long long>(v))
                                    : std::to_string(static_cast<unsigned long long>(v));
  }
};
template <typename T>
struct Text<T, std::enable_if_t<std::is_floating_point<T>::value>> {
  static std::string of(T v) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%g", static_cast<double>(v));
    return buf;
  }
};

// Concatenates the text of every argument.
template <typename... Args>
std::string concat(const Args&... args) {
  std::string out;
  ((out += Text<std::decay_t<Args>>::of(args)), ...);
  return out;
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
