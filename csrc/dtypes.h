// torch dtype -> ncclDataType_t and the reduction enum shared with pynccl/comm/reduce_op.py.
// Complex tensors travel as pairs of reals; bool travels as uint8 (SUM/PRODUCT become MAX/MIN,
// i.e. logical or/and, as torch.distributed does). fp8 needs NCCL >= 2.24 in the headers and
// in the loaded library.
#pragma once

#include <c10/core/ScalarType.h>
#include <nccl.h>

#include "check.h"
#include "nccl_api.h"

namespace pynccl {

template <>
struct Text<c10::ScalarType> {
  static std::string of(c10::ScalarType dtype) { return c10::toString(dtype); }
};

// NOTE: the values are pynccl.ReduceOp's (pynccl/comm/reduce_op.py), which are torch's
// c10d::ReduceOp::RedOpType values; keep the three in sync.
enum class ReduceOp : int {
  kSum = 0, kAvg = 1, kProduct = 2, kMin = 3, kMax = 4, kBand = 5, kBor = 6, kBxor = 7, kPremulSum = 8
};
constexpr int kNumReduceOps = 9;

inline const char* reduce_op_name(int op) {
  static const char* kNames[kNumReduceOps] = {"SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR",
                                              "PREMUL_SUM"};
  return (op >= 0 && op < kNumReduceOps) ? kNames[op] : "?";
}

struct NcclType {
  ncclDataType_t type;
  int64_t num_per_element;  // NCCL elements per tensor element: 2 for complex
};

inline const char* supported_dtypes_text() {
  return "float32, float16, bfloat16, float64, int8, uint8, int32, int64, uint32, uint64, bool, complex64, "
         "complex128, float8_e4m3fn, float8_e5m2";
}

// Raises TypeError naming the function and the dtype when NCCL cannot carry `dtype`.
inline NcclType to_nccl_type(const char* fn, c10::ScalarType dtype) {
  switch (dtype) {
    case c10::kFloat: return {ncclFloat32, 1};
    case c10::kHalf: return {ncclFloat16, 1};
    case c10::kBFloat16: return {ncclBfloat16, 1};
    case c10::kDouble: return {ncclFloat64, 1};
    case c10::kChar: return {ncclInt8, 1};
    case c10::kByte: return {ncclUint8, 1};
    case c10::kBool: return {ncclUint8, 1};
    case c10::kInt: return {ncclInt32, 1};
    case c10::kLong: return {ncclInt64, 1};
    case c10::kUInt32: return {ncclUint32, 1};
    case c10::kUInt64: return {ncclUint64, 1};
    case c10::kComplexFloat: return {ncclFloat32, 2};
    case c10::kComplexDouble: return {ncclFloat64, 2};
    case c10::kFloat8_e4m3fn:
    case c10::kFloat8_e5m2: {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 24, 0)
      const int runtime = nccl_runtime_version();
      PYNCCL_CHECK_TYPE(runtime >= kFp8Version, fn, ": ", dtype, " needs NCCL >= 2.24 at run time, but this process "
                       "loaded NCCL ", nccl_version_string(runtime));
      return {dtype == c10::kFloat8_e4m3fn ? ncclFloat8e4m3 : ncclFloat8e5m2, 1};
#else
      PYNCCL_CHECK_TYPE(false, fn, ": ", dtype, " needs NCCL >= 2.24, but pynccl._C was built against NCCL ",
                       nccl_version_string(NCCL_VERSION_CODE), " headers; rebuild against a newer NCCL");
#endif
    }
    default:
      PYNCCL_CHECK_TYPE(false, fn, ": dtype ", dtype, " is not supported by the nccl backend (supported: ",
                       supported_dtypes_text(), ")");
  }
  return {ncclFloat32, 1};  // unreachable: every failing branch above throws
}

inline bool is_floating_for_reduce(c10::ScalarType dtype) {
  return c10::isFloatingType(dtype) || c10::isComplexType(dtype);
}

}  // namespace pynccl
