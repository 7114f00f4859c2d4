// Input checks shared by every op family (collectives.cpp, p2p.cpp) and the NCCL group guard.
// Checks run before NCCL sees anything and raise ValueError/TypeError (PYNCCL_CHECK_VALUE/TYPE)
// naming what was expected and what was given; the fast path is a handful of inline tests.
#pragma once

#include <ATen/core/Tensor.h>
#include <nccl.h>

#include <string>
#include <vector>

#include "check.h"
#include "dtypes.h"

namespace pynccl {

template <>
struct Text<c10::IntArrayRef> {
  static std::string of(c10::IntArrayRef values) {
    std::string out = "[";
    for (size_t i = 0; i < values.size(); ++i) out += (i ? ", " : "") + std::to_string(values[i]);
    return out + "]";
  }
};

template <>
struct Text<c10::Layout> {
  static std::string of(c10::Layout layout) {
    switch (layout) {
      case c10::kStrided: return "Strided";
      case c10::kSparse: return "Sparse";
      case c10::kSparseCsr: return "SparseCsr";
      case c10::kMkldnn: return "Mkldnn";
      default: return "non-strided layout " + std::to_string(static_cast<int>(layout));
    }
  }
};

// A validated tensor argument, in NCCL's units.
struct TensorArg {
  void* ptr;
  size_t count;  // NCCL elements (2 per complex element)
  ncclDataType_t type;
  c10::ScalarType dtype;
  int64_t numel;
  size_t num_bytes;
};

inline std::string arg_name(const char* what, int64_t index) {
  return index < 0 ? std::string(what) : std::string(what) + "[" + std::to_string(index) + "]";
}

[[noreturn]] inline void throw_tensor_error(const char* fn, const char* what, int64_t index, const at::Tensor& t,
                                            int device) {
  const std::string name = arg_name(what, index);
  const std::string which = name == "tensor" ? "" : " (" + name + ")";
  PYNCCL_CHECK_TYPE(t.defined(), fn, ": ", name, " must be a tensor, got None");
  PYNCCL_CHECK_VALUE(t.is_cuda() && t.get_device() == device, fn, ": expected a CUDA tensor on cuda:", device,
                    " for the nccl backend, got a tensor on ", t.device().str(), which);
  PYNCCL_CHECK_VALUE(t.layout() == c10::kStrided, fn, ": ", name, " must be a dense (strided) tensor, got layout ",
                    t.layout());
  PYNCCL_CHECK_VALUE(false, fn, ": ", name, " must be contiguous (non-contiguous tensors are rejected; call "
                    ".contiguous() first), got sizes ", t.sizes(), " and strides ", t.strides());
  throw Error("unreachable");  // every check above fails for a tensor that reached here
}

inline TensorArg check_tensor(const char* fn, const char* what, const at::Tensor& t, int device, int64_t index = -1) {
  if (__builtin_expect(!t.defined() || !t.is_cuda() || t.get_device() != device || t.layout() != c10::kStrided ||
                           !t.is_contiguous(),
                       0)) {
    throw_tensor_error(fn, what, index, t, device);
  }
  const c10::ScalarType dtype = t.scalar_type();
  const NcclType nccl = to_nccl_type(fn, dtype);
  const int64_t numel = t.numel();
  return TensorArg{t.data_ptr(), static_cast<size_t>(numel * nccl.num_per_element), nccl.type, dtype, numel,
                   static_cast<size_t>(numel) * t.element_size()};
}

inline void check_same_dtype(const char* fn, const std::string& what, const TensorArg& arg, const char* ref_what,
                             const TensorArg& ref) {
  PYNCCL_CHECK_TYPE(arg.dtype == ref.dtype, fn, ": ", what, " has dtype ", arg.dtype, ", expected ", ref.dtype,
                   " (the dtype of ", ref_what, ")");
}

inline void check_rank(const char* fn, const char* what, int64_t rank, int world_size) {
  PYNCCL_CHECK_VALUE(rank >= 0 && rank < world_size, fn, ": ", what, " ", rank,
                    " is out of range for a communicator of world_size ", world_size);
}

// The optional `output` of an out-of-place op: a contiguous tensor on the same device with the
// dtype and element count of `in`. The same storage as `in` is in-place; any other overlap is
// rejected, since NCCL defines only exact aliasing.
inline TensorArg check_output(const char* fn, const at::Tensor& output, const TensorArg& in, int device) {
  const TensorArg out = check_tensor(fn, "output", output, device);
  check_same_dtype(fn, "output", out, "tensor", in);
  PYNCCL_CHECK_VALUE(out.numel == in.numel, fn, ": output has ", out.numel, " elements, expected ", in.numel,
                    " (the size of tensor)");
  const char* a = static_cast<const char*>(in.ptr);
  const char* b = static_cast<const char*>(out.ptr);
  PYNCCL_CHECK_VALUE(a == b || a + in.num_bytes <= b || b + out.num_bytes <= a, fn,
                    ": output partially overlaps tensor (pass the same tensor, or a disjoint one)");
  return out;
}

// `list` must hold world_size tensors shaped like `ref` (same dtype and number of elements).
inline std::vector<TensorArg> check_tensor_list(const char* fn, const char* what, const std::vector<at::Tensor>& list,
                                                int device, int world_size, const char* ref_what,
                                                const TensorArg& ref) {
  PYNCCL_CHECK_VALUE(static_cast<int>(list.size()) == world_size, fn, ": ", what, " has ", list.size(),
                    " tensors, expected world_size(", world_size, ")");
  std::vector<TensorArg> args;
  args.reserve(list.size());
  for (size_t i = 0; i < list.size(); ++i) {
    args.push_back(check_tensor(fn, what, list[i], device, static_cast<int64_t>(i)));
    check_same_dtype(fn, arg_name(what, static_cast<int64_t>(i)), args.back(), ref_what, ref);
    PYNCCL_CHECK_VALUE(args.back().numel == ref.numel, fn, ": ", arg_name(what, static_cast<int64_t>(i)), " has ",
                      args.back().numel, " elements, expected ", ref.numel, " (the size of ", ref_what, ")");
  }
  return args;
}

// True when the tensors lie back to back in memory, in order: then one flat NCCL call serves.
inline bool back_to_back(const std::vector<TensorArg>& args) {
  for (size_t i = 1; i < args.size(); ++i) {
    if (static_cast<char*>(args[i - 1].ptr) + args[i - 1].num_bytes != static_cast<char*>(args[i].ptr)) return false;
  }
  return true;
}

// ncclGroupStart()/ncclGroupEnd() around the calls of one op; ends the group on the error path.
class NcclGroup {
 public:
  NcclGroup() { PYNCCL_CHECK_NCCL(ncclGroupStart()); }
  ~NcclGroup() {
    if (active_) (void)ncclGroupEnd();
  }
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;
  ncclResult_t end() {
    active_ = false;
    return ncclGroupEnd();
  }

 private:
  bool active_ = true;
};

}  // namespace pynccl
