"""pynccl._C on any machine, GPU or not: it imports, reports NCCL's versions, makes unique ids,
shares the one libnccl torch loaded, and fails cleanly (an exception, never a crash) where a
GPU would be needed."""
import pytest
import torch

from pynccl import _ext
from pynccl.comm.flight_recorder import FILE_KEYS
from pynccl.errors import CommTimeoutError, PyncclError


def _c():
    assert _ext.available(), f"pynccl._C did not import: {_ext.import_error()!r}"
    return _ext._C


def test_extension_imports():
    c = _c()
    assert hasattr(c, "Communicator") and hasattr(c, "Work")


def test_nccl_version_build_and_runtime():
    v = _ext.nccl_version()
    for version in (v.build, v.runtime):
        assert isinstance(version, tuple) and len(version) == 3 and all(isinstance(x, int) for x in version)
    assert v.build >= (2, 18, 0) and v.runtime >= (2, 18, 0)
    # torch reports the version of the libnccl it loaded: the same library must serve us.
    if hasattr(torch.cuda, "nccl") and torch.version.cuda:
        assert v.runtime == tuple(torch.cuda.nccl.version()[:3])


def test_one_libnccl_in_process():
    _c()
    libs = _ext.loaded_nccl_libraries()
    assert len(libs) == 1, f"expected one libnccl mapped, got {libs}"


def test_unique_id_is_128_fresh_bytes():
    c = _c()
    a, b = c.get_unique_id(), c.get_unique_id()
    assert isinstance(a, bytes) and len(a) == 128 and len(b) == 128
    assert a != b


def test_native_alltoall_gate_follows_runtime_version():
    c = _c()
    if _ext.nccl_version().runtime < (2, 28, 0) or _ext.nccl_version().build < (2, 28, 0):
        assert not c.native_alltoall_available()
    else:
        assert c.native_alltoall_available()


def test_bad_unique_id_is_value_error():
    c = _c()
    with pytest.raises(ValueError, match="128 bytes"):
        c.Communicator(b"short", 1, 0, 0)
    with pytest.raises(TypeError):
        c.Communicator("a str, not bytes", 1, 0, 0)


def test_bad_rank_is_value_error():
    c = _c()
    with pytest.raises(ValueError, match="rank 3 is out of range"):
        c.Communicator(c.get_unique_id(), 2, 3, 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_communicator_without_gpu_raises_pyncclerror():
    c = _c()
    with pytest.raises(PyncclError, match="needs a CUDA GPU") as info:
        c.Communicator(c.get_unique_id(), 1, 0, 0, timeout_s=5.0)
    assert isinstance(info.value, RuntimeError)
    assert not isinstance(info.value, CommTimeoutError)


def test_pack_unpack_reject_cpu_tensors():
    c = _c()
    flat = torch.zeros(8)
    with pytest.raises(ValueError, match="pack: flat must be a CUDA tensor, got a tensor on cpu"):
        c.pack([torch.ones(4)], flat, 1.0)
    with pytest.raises(ValueError, match="unpack: flat must be a CUDA tensor"):
        c.unpack(flat, [torch.ones(4)], 0.5)


def test_require_extension_says_how_to_build(monkeypatch):
    monkeypatch.setattr(_ext, "_C", None)
    monkeypatch.setattr(_ext, "_IMPORT_ERROR", ImportError("libfoo.so: cannot open shared object file"))
    with pytest.raises(ImportError) as info:
        _ext.require_extension('the "nccl" backend')
    message = str(info.value)
    assert "pip install --no-build-isolation -e ." in message
    assert "libfoo.so" in message and 'the "nccl" backend' in message


def test_nccl_backend_implements_the_interface():
    from pynccl.comm.backends.base import Backend, Work
    from pynccl.comm.backends.nccl import NcclBackend

    assert issubclass(NcclBackend, Backend)
    assert not NcclBackend.__abstractmethods__
    assert issubclass(_c().Work, Work)


@pytest.mark.parametrize("release_gil", [False, True], ids=["gil", "nogil"])
@pytest.mark.parametrize("kind, exc", [("value", ValueError), ("type", TypeError), ("error", PyncclError),
                                       ("timeout", CommTimeoutError), ("c10_value", ValueError),
                                       ("c10_error", RuntimeError), ("std", RuntimeError)])
def test_cpp_errors_reach_python_as_the_right_class(kind, exc, release_gil):
    with pytest.raises(exc, match="^test ") as info:
        _c()._raise_for_test(kind, release_gil)
    if kind == "error":
        assert not isinstance(info.value, CommTimeoutError)


def test_flight_record_file_is_json(tmp_path, monkeypatch):
    import json
    monkeypatch.setenv("PYNCCL_FLIGHT_RECORDER_DIR", str(tmp_path / "a" / "b"))
    path = _c()._write_flight_record_for_test('dp "group"/1', 3, "watchdog: all_reduce (seq 7)\ttimed out")
    assert path.startswith(str(tmp_path / "a" / "b")) and path.endswith(".json"), path
    record = json.load(open(path))
    assert record["group"] == 'dp "group"/1' and record["rank"] == 3 and record["world_size"] == 2
    assert tuple(record) == FILE_KEYS   # the gloo recorder writes the same keys (flight_recorder.py)
    assert record["reason"] == "watchdog: all_reduce (seq 7)\ttimed out"
    assert [e["state"] for e in record["entries"]] == ["completed", "timed_out"]
    assert record["entries"][1] == {"seq": 1, "op": "broadcast", "dtype": "BFloat16", "count": 1 << 20, "peer": 0,
                                    "async_op": True, "enqueue_time_us": 1700000000000100, "state": "timed_out"}
    monkeypatch.setenv("PYNCCL_FLIGHT_RECORDER_DIR", "/proc/no/such/dir")
    assert _c()._write_flight_record_for_test("g", 0, "r").startswith("(flight record not written: ")


def test_nccl_backend_signatures_match_the_interface():
    import inspect

    from pynccl.comm.backends.base import Backend
    from pynccl.comm.backends.nccl import NcclBackend

    for name, member in inspect.getmembers(Backend, inspect.isfunction):
        if getattr(member, "__isabstractmethod__", False):
            ours = inspect.signature(getattr(NcclBackend, name))
            assert list(ours.parameters) == list(inspect.signature(member).parameters), name


@pytest.mark.parametrize("method", ["all_reduce", "reduce", "broadcast"])
def test_out_of_place_output_is_the_last_keyword(method):
    # The in-place hot path `comm.all_reduce(t, op, async_op)` must keep its positions; output=
    # comes last, defaulting to None (pybind's signature line in the docstring).
    doc = getattr(_c().Communicator, method).__doc__
    signature = doc.strip().splitlines()[0]
    assert signature.endswith(", output: object = None) -> pynccl._C.Work"), signature
    assert signature.startswith(f"{method}(self: pynccl._C.Communicator, tensor: torch.Tensor"), signature
