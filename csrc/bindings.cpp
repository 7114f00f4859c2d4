// pynccl._C: registers what the other files define, nothing else. Ops take `op` as a plain int
// (a pynccl.ReduceOp) or a PremulSum object, so pynccl/backends/nccl.py can bind these methods
// as its own attributes and a SUM pays for one PyLong_Check. Host waits release the GIL.
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <set>

#include "bucket.h"
#include "check.h"
#include "communicator.h"
#include "dtypes.h"
#include "nccl_api.h"
#include "tp_overlap.h"
#include "work.h"

namespace py = pybind11;

namespace pynccl {
namespace {

struct OpArg {
  int op;
  double factor;
};

// A pynccl.ReduceOp (an int with torch's numbering): the fast path. Anything else (torch's
// RedOpType or ReduceOp objects, _make_nccl_premul_sum(f), ReduceOp.premul_sum(f)) goes through
// pynccl.comm.reduce_op.as_reduce_op, the one mapping (by member, not by integer), which raises
// TypeError for what is not an op.
OpArg parse_op(py::handle op, double premul_factor) {
  PyObject* obj = op.ptr();
  if (__builtin_expect(PyLong_Check(obj), 1) && !PyBool_Check(obj)) {
    const long value = PyLong_AsLong(obj);
    if (value == -1 && PyErr_Occurred()) throw py::error_already_set();
    return {static_cast<int>(value), premul_factor};
  }
  // NOTE: deliberately leaked: a static py::object would be destroyed after the interpreter.
  static auto* as_reduce_op = new py::object(py::module_::import("pynccl.comm.reduce_op").attr("as_reduce_op"));
  py::object mapped = (*as_reduce_op)(op);
  if (PyLong_Check(mapped.ptr())) return {mapped.cast<int>(), premul_factor};
  return {static_cast<int>(ReduceOp::kPremulSum), mapped.attr("factor").cast<double>()};
}

void set_python_error(const char* class_name, const char* message) {
  try {
    py::object cls = py::module_::import("pynccl.errors").attr(class_name);
    PyErr_SetString(cls.ptr(), message);
  } catch (py::error_already_set&) {
    PyErr_Clear();  // pynccl.errors unimportable (broken install): still raise, as RuntimeError
    PyErr_SetString(PyExc_RuntimeError, message);
  }
}

// torch.<name> (e.g. torch.OutOfMemoryError), or RuntimeError where this torch lacks it.
void set_torch_error(const char* class_name, const char* message) {
  try {
    py::object cls = py::module_::import("torch").attr(class_name);
    PyErr_SetString(cls.ptr(), message);
  } catch (py::error_already_set&) {
    PyErr_Clear();
    PyErr_SetString(PyExc_RuntimeError, message);
  }
}

py::dict entry_to_dict(const FlightEntry& e) {
  py::dict d;
  d["seq"] = e.seq;
  d["op"] = e.op;
  d["dtype"] = c10::toString(e.dtype);
  d["count"] = e.count;
  d["peer"] = e.peer;
  d["async_op"] = e.async_op;
  d["enqueue_time_us"] = e.enqueue_us;
  d["state"] = op_state_name(e.state);
  return d;
}

// The `output=` keyword of the out-of-place ops: None (in-place) or a torch.Tensor.
// NOTE: taken as a py::handle so the in-place hot path pays one is_none() test, no tensor caster.
at::Tensor output_tensor(const char* fn, py::handle output) {
  if (!THPVariable_Check(output.ptr())) {
    PYNCCL_CHECK_TYPE(false, fn, ": output must be a torch.Tensor or None, got ", Py_TYPE(output.ptr())->tp_name);
  }
  return THPVariable_Unpack(output.ptr());
}

std::vector<at::Tensor> or_empty(const std::optional<std::vector<at::Tensor>>& list) {
  return list ? *list : std::vector<at::Tensor>{};
}

}  // namespace
}  // namespace pynccl

PYBIND11_MODULE(_C, m) {
  using namespace pynccl;
  m.doc() = "pynccl's C++ core: NCCL communicators, collectives, watchdog, fused bucket kernels.";

  // NOTE: c10 errors are mapped here too (as torch maps them), so the message never depends on
  // torch_python's translator or on TORCH_SHOW_CPP_STACKTRACES.
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const TimeoutError& e) {
      set_python_error("CommTimeoutError", e.what());
    } catch (const Error& e) {
      set_python_error("PyncclError", e.what());
    } catch (const ValueError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const TypeError& e) {
      PyErr_SetString(PyExc_TypeError, e.what());
    } catch (const c10::ValueError& e) {
      PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
    } catch (const c10::TypeError& e) {
      PyErr_SetString(PyExc_TypeError, e.what_without_backtrace());
    } catch (const c10::IndexError& e) {
      PyErr_SetString(PyExc_IndexError, e.what_without_backtrace());
    } catch (const c10::NotImplementedError& e) {
      PyErr_SetString(PyExc_NotImplementedError, e.what_without_backtrace());
    } catch (const c10::OutOfMemoryError& e) {
      set_torch_error("OutOfMemoryError", e.what_without_backtrace());
    } catch (const c10::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    }
  });

  m.def("nccl_version_build", [] { return NCCL_VERSION_CODE; }, "NCCL_VERSION_CODE of the headers pynccl was built with.");
  m.def("nccl_version_runtime", &nccl_runtime_version, "ncclGetVersion() of the loaded libnccl.");
  m.def(
      "get_unique_id",
      [] {
        ncclUniqueId id;
        {
          py::gil_scoped_release release;
          // ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId);
          PYNCCL_CHECK_NCCL(ncclGetUniqueId(&id));
        }
        return py::bytes(id.internal, sizeof(id.internal));
      },
      "A fresh ncclUniqueId (128 bytes) for rank 0 to share with the others.");
  m.def(
      "_raise_for_test",
      [](const std::string& kind, bool release_gil) {
        // Test hook: raise each kind of C++ error, with or without the GIL, through the translator.
        std::optional<py::gil_scoped_release> release;
        if (release_gil) release.emplace();
        if (kind == "value") PYNCCL_CHECK_VALUE(false, "test ValueError");
        if (kind == "type") PYNCCL_CHECK_TYPE(false, "test TypeError");
        if (kind == "error") throw Error("test PyncclError");
        if (kind == "timeout") throw TimeoutError("test CommTimeoutError");
        if (kind == "c10_value") TORCH_CHECK_VALUE(false, "test c10::ValueError");
        if (kind == "c10_error") TORCH_CHECK(false, "test c10::Error");
        if (kind == "std") throw std::runtime_error("test std::runtime_error");
      },
      py::arg("kind"), py::arg("release_gil") = false);
  m.def(
      "_write_flight_record_for_test",
      [](const std::string& name, int rank, const std::string& reason) {
        // Test hook: the watchdog's JSON dump, without a GPU (two made-up entries).
        std::vector<FlightEntry> entries(2);
        entries[0] = FlightEntry{0, "all_reduce", c10::kFloat, 4, -1, false, 1700000000000000, OpState::kCompleted};
        entries[1] = FlightEntry{1, "broadcast", c10::kBFloat16, 1 << 20, 0, true, 1700000000000100, OpState::kTimedOut};
        return write_flight_record_file(name, rank, flight_record_json(name, rank, 2, 0, reason, 2, entries));
      },
      py::arg("name"), py::arg("rank"), py::arg("reason"));
  m.attr("TIMEOUT_EXIT_CODE") = kTimeoutExitCode;
  m.def(
      "timeout_policy",
      [](std::optional<std::string> on_timeout, std::optional<bool> blocking) {
        const auto [is_blocking, raise_on_timeout] = resolve_timeout_policy(on_timeout, blocking);
        py::dict d;
        d["blocking"] = is_blocking;
        d["on_timeout"] = raise_on_timeout ? "raise" : "teardown";
        return d;
      },
      py::arg("on_timeout") = py::none(), py::arg("blocking") = py::none(),
      "What a Communicator made with these arguments does: {'blocking': bool, 'on_timeout': 'teardown'|'raise'}; "
      "None reads PYNCCL_ON_TIMEOUT and PYNCCL_NCCL_NONBLOCKING as the constructor does.");
  m.def(
      "_overdue_call_for_test",
      [](const std::string& op, uint64_t seq, int64_t start_ns, int64_t now_ns, double timeout_s, bool cleared) {
        // Test hook: the watchdog's view of a call into NCCL (ActiveCall), without a GPU.
        static std::set<std::string> names;  // NOTE: ActiveCall keeps a pointer; set nodes never move (GIL held)
        ActiveCall call;
        call.set(names.insert(op).first->c_str(), seq, start_ns);
        if (cleared) call.clear();
        return call.overdue(now_ns, timeout_s);
      },
      py::arg("op"), py::arg("seq"), py::arg("start_ns"), py::arg("now_ns"), py::arg("timeout_s"),
      py::arg("cleared") = false);
  m.def(
      "_tear_down_for_test", [](const std::string& message) { tear_down_process(message); }, py::arg("message"),
      "Test hook: what the watchdog does on a time-out by default (message to stderr, exit code 75).");
  m.def("native_alltoall_available", [] { return optional_nccl_api().alltoall != nullptr; },
        "Whether ncclAlltoAll/Gather/Scatter (NCCL >= 2.28) are used.");
  m.def("pack", &pack, py::arg("tensors"), py::arg("flat"), py::arg("scale") = 1.0,
        "Copy tensors back to back into flat, times scale, cast to flat's dtype; one launch per 120 tensors.");
  m.def("unpack", &unpack, py::arg("flat"), py::arg("tensors"), py::arg("scale") = 1.0,
        "The inverse of pack: tensors[i] = flat's i-th segment times scale, cast to the tensors' dtype.");

  py::class_<Work, std::shared_ptr<Work>>(m, "Work", "Handle of an op started with async_op=True.")
      .def("wait", [](Work& w, py::object /*timeout*/) { return w.wait(std::nullopt); }, py::arg("timeout") = py::none(),
           "The current CUDA stream waits for the op (no host block); then the op's tensors are released.")
      .def("is_completed", &Work::is_completed)
      .def("synchronize",
           [](Work& w, std::optional<double> timeout_s) {
             {
               py::gil_scoped_release release;
               w.synchronize(timeout_s);
             }
             // NOTE: with the GIL again: the tensors may be the last references to Python-owned ones,
             // and WorkState::tensors is only touched with the GIL held (Work.wait clears it too).
             w.release_tensors();
             return true;
           },
           py::arg("timeout_s") = py::none(),
           "Block the host until the op completes, bounded by timeout_s (default: the communicator's); on timeout "
           "the process ends (exit code 75), or with on_timeout='raise' the communicator is aborted and "
           "CommTimeoutError raised.")
      .def_property_readonly("seq", &Work::seq)
      .def_property_readonly("op", [](const Work& w) { return std::string(w.op()); })
      .def("__repr__", [](const Work& w) { return "<pynccl._C.Work " + std::string(w.op()) + " seq=" + std::to_string(w.seq()) + ">"; });

  py::class_<Communicator, std::shared_ptr<Communicator>>(m, "Communicator")
      // blocking / on_timeout: None resolves them as init_process_group does (resolve_timeout_policy).
      .def(py::init([](py::bytes unique_id, int world_size, int rank, int device, double timeout_s,
                       std::optional<bool> blocking, std::string name, int cga_cluster_size, int min_ctas,
                       int max_ctas, std::optional<std::string> on_timeout, int cta_policy) {
             std::string id = unique_id;
             const auto [is_blocking, raise_on_timeout] = resolve_timeout_policy(on_timeout, blocking);
             CommOptions options{timeout_s, is_blocking, raise_on_timeout, std::move(name), cga_cluster_size,
                                 min_ctas, max_ctas, cta_policy};
             py::gil_scoped_release release;
             return std::make_shared<Communicator>(id, world_size, rank, device, std::move(options));
           }),
           py::arg("unique_id"), py::arg("world_size"), py::arg("rank"), py::arg("device"),
           py::arg("timeout_s") = 600.0, py::arg("blocking") = py::none(), py::arg("name") = "",
           py::arg("cga_cluster_size") = -1, py::arg("min_ctas") = -1, py::arg("max_ctas") = -1,
           py::arg("on_timeout") = py::none(), py::arg("cta_policy") = -1)
      .def_property_readonly("rank", &Communicator::rank)
      .def_property_readonly("world_size", &Communicator::world_size)
      .def_property_readonly("device", &Communicator::device)
      .def_property_readonly("stream_handle", &Communicator::stream_handle,
                             "The cudaStream_t its ops run on (an int, as torch.cuda.Stream.cuda_stream); no two "
                             "live communicators of a device share one.")
      .def_property_readonly("name", &Communicator::name)
      .def_property_readonly("blocking", &Communicator::blocking)
      .def_property_readonly("cta_policy", &Communicator::cta_policy,
                             "ncclConfig_t.CTAPolicy in effect (2: ZERO, copy-engine collectives; -1: NCCL's default)")
      .def_property_readonly("on_timeout", [](const Communicator& c) { return std::string(c.on_timeout()); })
      .def_property_readonly("seq", &Communicator::seq, "Ops enqueued so far.")
      .def_property("timeout_s", &Communicator::timeout_s, &Communicator::set_timeout_s)
      .def_property("track_sync_ops", &Communicator::track_sync_ops, &Communicator::set_track_sync_ops,
                    "Whether the watchdog also times ops with async_op=False (one event record each).")
      .def_property("flight_recorder_size", &Communicator::flight_recorder_size, &Communicator::set_flight_recorder_size)
      // --- collectives --------------------------------------------------------------------
      // output=None (last keyword): in-place. A tensor: out-of-place, one NCCL call (Communicator docs).
      .def("all_reduce",
           [](Communicator& c, const at::Tensor& tensor, py::handle op, bool async_op, double premul_factor,
              py::handle output) {
             const OpArg o = parse_op(op, premul_factor);
             if (output.is_none()) return c.all_reduce(tensor, o.op, async_op, o.factor);
             const at::Tensor out = output_tensor("all_reduce", output);
             return c.all_reduce(tensor, o.op, async_op, o.factor, &out);
           },
           py::arg("tensor"), py::arg("op") = 0, py::arg("async_op") = false, py::arg("premul_factor") = 1.0,
           py::arg("output") = py::none())
      .def("reduce_bucket", &Communicator::reduce_bucket, py::arg("grads"), py::arg("flat"), py::arg("scale"),
           py::arg("pack_stream"), py::arg("split_all_reduce") = false, py::arg("unpack_stream") = 0,
           py::arg("chunks") = 1, py::arg("scratch") = py::none(), py::arg("copy_pack") = false,
           "One DDP bucket in one call: pack grads into flat (x scale, cast) on pack_stream (a "
           "torch.cuda.Stream.cuda_stream handle) after the current stream, then a SUM all-reduce of flat after the "
           "pack (split_all_reduce: as an in-place reduce-scatter then all-gather); with unpack_stream (a handle, "
           "0 = none), flat is copied back into grads there after the all-reduce. chunks > 1 pipelines the three "
           "over slices of flat. scratch (a tensor of flat's dtype, in a symmetric window like flat): the reduce-scatter as "
           "an all-to-all into scratch (copy engines) and a local sum; a flat bigger than scratch goes in slices. "
           "copy_pack (with split_all_reduce): grads copied into flat on the copy engines, unscaled, and each rank's "
           "reduced shard scaled before the all-gather (every rank must pass the same). Returns the all-reduce's Work; "
           "its wait() orders the current stream after all.")
      .def("alloc_symmetric", &Communicator::alloc_symmetric, py::arg("num_bytes"),
           "Collective: num_bytes of ncclMemAlloc memory registered as a symmetric window (NCCL >= 2.27), as a "
           "uint8 CUDA tensor (view it as the dtype you need). Collectives on such buffers, at the same offsets on "
           "every rank, run NCCL's symmetric kernels; with cta_policy=2 all-gathers run on the copy engines. "
           "ValueError where the communicator has no symmetric support.")
      .def("register_buffer", &Communicator::register_buffer, py::arg("tensor"),
           "ncclCommRegister of the tensor's bytes (NCCL >= 2.19; not during graph capture): returns a handle for "
           "deregister_buffer. NCCL may then skip staging copies for collectives on that memory.")
      .def("deregister_buffer", &Communicator::deregister_buffer, py::arg("handle"))
      .def("broadcast",
           [](Communicator& c, const at::Tensor& tensor, int root, bool async_op, py::handle output) {
             if (output.is_none()) return c.broadcast(tensor, root, async_op);
             const at::Tensor out = output_tensor("broadcast", output);
             return c.broadcast(tensor, root, async_op, &out);
           },
           py::arg("tensor"), py::arg("root"), py::arg("async_op") = false, py::arg("output") = py::none())
      .def("reduce",
           [](Communicator& c, const at::Tensor& tensor, int root, py::handle op, bool async_op, double premul_factor,
              py::handle output) {
             const OpArg o = parse_op(op, premul_factor);
             if (output.is_none()) return c.reduce(tensor, root, o.op, async_op, o.factor);
             const at::Tensor out = output_tensor("reduce", output);
             return c.reduce(tensor, root, o.op, async_op, o.factor, &out);
           },
           py::arg("tensor"), py::arg("root"), py::arg("op") = 0, py::arg("async_op") = false,
           py::arg("premul_factor") = 1.0, py::arg("output") = py::none())
      .def("all_gather", &Communicator::all_gather, py::arg("output_list"), py::arg("input"),
           py::arg("async_op") = false)
      .def("all_gather_into_tensor", &Communicator::all_gather_into_tensor, py::arg("output"), py::arg("input"),
           py::arg("async_op") = false)
      .def("reduce_scatter",
           [](Communicator& c, const at::Tensor& output, const std::vector<at::Tensor>& input_list, py::handle op,
              bool async_op, double premul_factor) {
             const OpArg o = parse_op(op, premul_factor);
             return c.reduce_scatter(output, input_list, o.op, async_op, o.factor);
           },
           py::arg("output"), py::arg("input_list"), py::arg("op") = 0, py::arg("async_op") = false,
           py::arg("premul_factor") = 1.0)
      .def("reduce_scatter_tensor",
           [](Communicator& c, const at::Tensor& output, const at::Tensor& input, py::handle op, bool async_op,
              double premul_factor) {
             const OpArg o = parse_op(op, premul_factor);
             return c.reduce_scatter_tensor(output, input, o.op, async_op, o.factor);
           },
           py::arg("output"), py::arg("input"), py::arg("op") = 0, py::arg("async_op") = false,
           py::arg("premul_factor") = 1.0)
      .def("all_to_all", &Communicator::all_to_all, py::arg("output_list"), py::arg("input_list"),
           py::arg("async_op") = false)
      .def("all_to_all_single",
           [](Communicator& c, const at::Tensor& output, const at::Tensor& input,
              const std::optional<std::vector<int64_t>>& output_split_sizes,
              const std::optional<std::vector<int64_t>>& input_split_sizes, bool async_op) {
             return c.all_to_all_single(output, input, output_split_sizes.value_or(std::vector<int64_t>{}),
                                        input_split_sizes.value_or(std::vector<int64_t>{}), async_op);
           },
           py::arg("output"), py::arg("input"), py::arg("output_split_sizes") = py::none(),
           py::arg("input_split_sizes") = py::none(), py::arg("async_op") = false)
      .def("gather",
           [](Communicator& c, const at::Tensor& input, const std::optional<std::vector<at::Tensor>>& gather_list,
              int root, bool async_op) { return c.gather(input, or_empty(gather_list), root, async_op); },
           py::arg("input"), py::arg("gather_list"), py::arg("root"), py::arg("async_op") = false)
      .def("scatter",
           [](Communicator& c, const at::Tensor& output, const std::optional<std::vector<at::Tensor>>& scatter_list,
              int root, bool async_op) { return c.scatter(output, or_empty(scatter_list), root, async_op); },
           py::arg("output"), py::arg("scatter_list"), py::arg("root"), py::arg("async_op") = false)
      .def("send", &Communicator::send, py::arg("tensor"), py::arg("peer"), py::arg("async_op") = false)
      .def("recv", &Communicator::recv, py::arg("tensor"), py::arg("peer"), py::arg("async_op") = false)
      .def("batch_isend_irecv", &Communicator::batch_isend_irecv, py::arg("ops"),
           "ops: list of (is_send, tensor, peer); one NCCL group on the communicator's stream. Returns a Work.")
      // --- sequence-parallel TP's collective matmuls (tp_overlap.cpp; pynccl/tensor_parallel/async_tp.py)
      .def("tp_gather_linears", &tp_gather_linears, py::arg("x"), py::arg("weights"), py::arg("seq_dim"),
           py::arg("scratch") = py::none())
      .def("tp_gather_linears_backward", &tp_gather_linears_backward, py::arg("x_full"), py::arg("weights"),
           py::arg("grad_ys"), py::arg("grad_x_full"), py::arg("seq_dim"), py::arg("scratch") = py::none())
      .def("tp_linear_reduce_scatter", &tp_linear_reduce_scatter, py::arg("h"), py::arg("weight"), py::arg("seq_dim"),
           py::arg("scratch") = py::none())
      .def("tp_linear_reduce_scatter_backward", &tp_linear_reduce_scatter_backward, py::arg("grad_out"), py::arg("h"),
           py::arg("weight"), py::arg("seq_dim"), py::arg("scratch") = py::none())
      // --- TP's all-reduces overlapped with GEMMs (tp_overlap.cpp; pynccl/tensor_parallel/async_tp_allreduce.py)
      .def("tp_linears_all_reduce_backward", &tp_linears_all_reduce_backward, py::arg("x"), py::arg("weights"),
           py::arg("grad_ys"), py::arg("grad_x"), py::arg("scratch"), py::arg("gather") = false)
      .def("tp_linear_all_reduce", &tp_linear_all_reduce, py::arg("h"), py::arg("weight"), py::arg("chunks"),
           py::arg("scratch"), py::arg("gather") = false)
      .def("barrier", &Communicator::barrier, py::call_guard<py::gil_scoped_release>())
      // --- life cycle -----------------------------------------------------------------------
      .def("split", &Communicator::split, py::arg("color"), py::arg("key"), py::arg("timeout_s") = py::none(),
           py::arg("name") = "", py::call_guard<py::gil_scoped_release>(),
           "Collective: the communicator of the ranks that passed the same color (ordered by key), or None for "
           "color < 0.")
      .def("abort", &Communicator::abort, py::call_guard<py::gil_scoped_release>())
      .def("destroy", &Communicator::destroy, py::call_guard<py::gil_scoped_release>())
      .def("is_aborted", &Communicator::is_aborted)
      .def("get_async_error", &Communicator::get_async_error)
      .def("check", &Communicator::check, py::call_guard<py::gil_scoped_release>(),
           "Raise the stored failure or the comm's NCCL async error; an async error aborts the communicator "
           "(joins the watchdog, ncclCommAbort), so the GIL is released.")
      .def("flight_record",
           [](const Communicator& c) {
             py::list out;
             for (const auto& e : c.flight_record()) out.append(entry_to_dict(e));
             return out;
           },
           "The last flight_recorder_size ops, oldest first, as dicts.")
      .def("__repr__", [](const Communicator& c) {
        return "<pynccl._C.Communicator '" + c.name() + "' rank " + std::to_string(c.rank()) + " of " +
               std::to_string(c.world_size()) + " on cuda:" + std::to_string(c.device()) + ">";
      });
}
