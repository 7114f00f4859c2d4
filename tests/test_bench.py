"""The nccl-tests-style benchmark: formulas and text against hand-computed values (no processes),
a log parser against a real nccl-tests log, one gloo CLI run parsed column by column, one run with
corrupted results that must fail, and every op × implementation checked on 3 ranks in one launch."""
import io
import json
import os
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout

import pytest
import torch

from pynccl.bench import data
from pynccl.bench.formatting import bandwidths, cell_text, float_str, footer, nccl_version_code, row_prefix, table_header
from pynccl.bench.ops import OPS, get_op
from pynccl.bench.ops.base import ALL, Segment
from pynccl.bench.options import parse_args, parse_size, size_steps
from pynccl.bench.parse import parse_log
from pynccl.testing import run_multiprocess
from repo_env import subprocess_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- no processes
def test_float_str_takes_first_format_that_fits():
    assert float_str(30.123, 7) == "  30.12"
    assert float_str(1234.567, 7) == "1234.57"       # %.2f is exactly 7 wide
    assert float_str(12345.67, 7) == "12345.7"       # %.2f would be 8: %.1f
    assert float_str(123456.7, 7) == " 123457"       # %.0f
    assert float_str(12345678.9, 7) == "1.2e+07"     # nothing fits: %.1e
    assert float_str(0.0, 6) == "  0.00"
    assert float_str(367.24, 6) == "367.24"
    assert float_str(1234.56, 6) == "1234.6"
    assert float_str(123456.0, 6) == "123456"
    assert float_str(1234567.0, 6) == "1.2e+06"
    assert float_str(99.999, 6) == "100.00"          # rounding that still fits stays %.2f
    assert float_str(None, 7) == "    N/A"


def test_bus_bandwidth_factors_match_the_table():
    n = 8
    expected = {"all_reduce": 2 * 7 / 8, "all_gather": 7 / 8, "reduce_scatter": 7 / 8, "alltoall": 7 / 8,
                "broadcast": 1.0, "reduce": 1.0, "sendrecv": 1.0, "gather": 7 / 8, "scatter": 7 / 8}
    assert set(expected) == set(OPS)
    for name, factor in expected.items():
        assert get_op(name).bus_factor(n) == pytest.approx(factor), name
    assert get_op("all_reduce").bus_factor(1) == 0.0
    # docs/benchmarks.md's example row: 1 MiB all_reduce in 30.12 us on 8 ranks.
    algbw, busbw = bandwidths(1048576, 30.12e-6, get_op("all_reduce").bus_factor(8))
    assert (round(algbw, 2), round(busbw, 2)) == (34.81, 60.92)


def test_byte_counts_round_per_rank_chunks_to_16_bytes():
    # (op, size B, dtype bytes, ranks) -> (size column, count column)
    cases = {("all_reduce", 1048576, 4, 8): (1048576, 262144),
             ("all_gather", 1048576, 4, 8): (1048576, 32768),
             ("all_gather", 1000, 4, 3): (960, 80),        # 250//3 = 83 -> 332 B -> 320 B -> 80
             ("reduce_scatter", 100, 1, 3): (96, 32),      # 33 int8 -> 32
             ("alltoall", 100, 8, 3): (96, 4),             # 12//3 = 4 doubles = 32 B
             ("gather", 8, 4, 2): (0, 0),                  # 1 float is < 16 B: nothing
             ("scatter", 64, 2, 2): (64, 16),
             ("broadcast", 10, 4, 3): (8, 2),
             ("sendrecv", 8, 4, 2): (8, 2)}
    for (name, size, e, n), (size_col, count_col) in cases.items():
        c = get_op(name).counts(size // e, n, e)
        assert (max(c.send, c.recv) * e, c.param) == (size_col, count_col), (name, size, e, n)


def test_text_matches_benchmarks_md_exactly():
    assert table_header(False) == [
        "#                                                              out-of-place                       in-place",
        "#       size         count      type   redop    root     time   algbw   busbw  #wrong     time   algbw   busbw  #wrong",
        "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)             (us)  (GB/s)  (GB/s)",
    ]
    assert table_header(True)[1].split()[6] == "cputime"
    row = row_prefix(1048576, 262144, "float", "sum", -1) + cell_text(30.12, 34.81, 60.92, 0) * 2
    assert row == ("     1048576        262144     float     sum      -1    30.12   34.81   60.92       0"
                   "    30.12   34.81   60.92       0")
    assert cell_text(5.9, 0.0, 0.0, None).endswith("    N/A")
    assert footer(0, 60.92, "all_reduce_perf") == ["# Out of bounds values : 0 OK", "# Avg bus bandwidth    : 60.92",
                                                   "#", "# Collective test concluded: all_reduce_perf"]
    assert footer(3, 1.5, "x")[0] == "# Out of bounds values : 3 FAILED"
    assert nccl_version_code((2, 28, 9)) == 22809 and nccl_version_code("2.19.3") == 21903
    assert nccl_version_code(None) == 0


def test_sizes_and_flags():
    assert [parse_size(s) for s in ("8", "64K", "1M", "1G", "1.5k", "32m")] == \
        [8, 65536, 1 << 20, 1 << 30, 1536, 32 << 20]
    for bad in ("abc", "-1", "1T"):
        with pytest.raises(ValueError, match="invalid size"):
            parse_size(bad)
    opts = parse_args(["all_reduce", "-b", "8", "-e", "64K", "-f", "4"])
    assert size_steps(opts) == [8, 32, 128, 512, 2048, 8192, 32768]
    assert (opts.iters, opts.warmup_iters, opts.check, opts.root, opts.average) == (20, 1, 1, 0, 1)
    opts = parse_args(["broadcast", "-b", "1M", "-e", "3M"])      # -f 1: additive -i 1M
    assert size_steps(opts) == [1 << 20, 2 << 20, 3 << 20]
    assert parse_args(["all", "-o", "all", "-d", "all"]).ops == list(OPS)
    assert parse_args(["reduce", "-o", "all"]).redop == ["sum", "prod", "max", "min", "avg"]
    assert parse_args(["reduce", "-n", "0x10"]).iters == 16      # strtol(..., 0), as nccl-tests
    for argv, message in ((["all_reduce", "-b", "1M", "-e", "1K"], "minbytes"),
                          (["nope"], "unknown OP"),
                          (["all_reduce", "-d", "float17"], "datatype"),
                          (["all_reduce", "-G", "1", "-z", "1"], "exclude"),
                          (["all_reduce,broadcast", "-J", "out.json"], "{op}")):
        err = io.StringIO()
        with pytest.raises(SystemExit) as exc, redirect_stderr(err):
            parse_args(argv)
        assert exc.value.code == 2 and message in err.getvalue(), (argv, err.getvalue())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
                                   torch.int8, torch.float32])
@pytest.mark.parametrize("redop", ["sum", "prod", "max", "min"])
def test_inputs_reduce_exactly_in_the_dtype_in_any_order(dtype, redop):
    """The claim the bit-exact check rests on: reducing in the dtype itself, in either rank order,
    gives exactly the expected values (count_wrong == 0), for 8 ranks."""
    n, length = 8, 3000
    inputs = [data.pattern(r, 0, length, dtype, redop, n, 5, "cpu") for r in range(n)]
    fn = {"sum": torch.add, "prod": torch.mul, "max": torch.maximum, "min": torch.minimum}[redop]
    for order in (range(n), reversed(range(n))):
        order = list(order)
        acc = inputs[order[0]].float()
        for r in order[1:]:
            acc = fn(acc, inputs[r].float()).to(dtype).float()   # rounded to the dtype after every step
        assert data.count_wrong(acc.to(dtype), [Segment(0, length, ALL, 0)], redop, n, 5) == 0


def test_count_wrong_sees_every_kind_of_error():
    n, c = 3, 40
    recv = torch.cat([data.pattern(s, 0, c, torch.float32, None, n, 1, "cpu") for s in range(n)])
    segs = get_op("all_gather").expected(0, n, 0, get_op("all_gather").counts(c * n, n, 4))
    assert data.count_wrong(recv, segs, None, n, 1) == 0
    swapped = torch.cat([recv[c:2 * c], recv[:c], recv[2 * c:]])    # two ranks' chunks exchanged
    assert data.count_wrong(swapped, segs, None, n, 1) > 0
    poisoned = recv.clone()
    data.fill_poison(poisoned[5:7])                                 # an element never written
    assert data.count_wrong(poisoned, segs, None, n, 1) == 2
    data.corrupt(recv, segs)
    assert data.count_wrong(recv, segs, None, n, 1) == 1
    # avg rounds: within tolerance passes, a real difference does not.
    avg = sum(data.pattern(r, 0, c, torch.bfloat16, "avg", n, 2, "cpu").double() for r in range(n)) / n
    seg = [Segment(0, c, ALL, 0)]
    assert data.count_wrong(avg.to(torch.bfloat16), seg, "avg", n, 2) == 0
    assert data.count_wrong((avg + 8).to(torch.bfloat16), seg, "avg", n, 2) == c   # tolerance: (2n+2) ulps


NCCL_TESTS_LOG = """\
# nThread 1 nGpus 8 minBytes 8 maxBytes 134217728 step: 2(factor) warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0
#
# Using devices
#  Rank  0 Group  0 Pid 219870 on dgx-h100-01 device  0 [0x18] NVIDIA H100 80GB HBM3
#  Rank  1 Group  0 Pid 219870 on dgx-h100-01 device  1 [0x2a] NVIDIA H100 80GB HBM3
dgx-h100-01:219870:219870 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.1<0>
#
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
           8             2     float     sum      -1    16.91    0.00    0.00      0    16.63    0.00    0.00      0
      131072         32768     float     sum      -1    21.46    6.11   10.69      0    21.03    6.23   10.91      0
   134217728      33554432     float     sum      -1    652.8  205.60  359.80      0    651.9  205.89  360.31      0
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 123.452
#
"""


def test_parser_reads_a_real_nccl_tests_log():
    (t,) = parse_log(NCCL_TESTS_LOG)
    assert t.params["nGpus"] == 8 and t.params["maxBytes"] == 134217728 and t.params["step_kind"] == "factor"
    assert [d["device"] for d in t.devices] == [0, 1] and t.devices[1]["device_hex"] == "0x2a"
    assert [r.size for r in t.rows] == [8, 131072, 134217728]
    big = t.rows[-1]
    assert (big.count, big.type, big.redop, big.root) == (33554432, "float", "sum", -1)
    assert (big.out_of_place.time_us, big.out_of_place.busbw, big.in_place.algbw) == (652.8, 359.80, 205.89)
    assert t.out_of_bounds == 0 and t.avg_busbw == 123.452


# ----------------------------------------------------------------------------- the CLI on gloo
def _cli(args, tmp_path, env_extra=None, timeout=120):
    env = subprocess_env()
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "pynccl.bench", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _close(printed, exact, digits=2):
    """A value printed with `digits` decimals matches the exact one (with one unit of rounding slack)."""
    return abs(printed - exact) <= 10 ** -digits + 1e-3 * abs(exact)


def test_gloo_cli_run_parses_as_nccl_tests_output(tmp_path):
    r = _cli(["all_reduce", "--backend", "gloo", "--nproc", "2", "-b", "8", "-e", "64K", "-f", "4",
              "-J", "out.json", "--plot", "out.png"], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    (t,) = parse_log(r.stdout)
    assert t.name == "all_reduce_perf" and t.concluded
    assert t.params == {"nThread": 1, "nGpus": 1, "minBytes": 8, "maxBytes": 65536, "step": 4, "step_kind": "factor",
                        "warmup iters": 1, "iters": 20, "agg iters": 1, "validation": 1, "graph": 0}
    assert len(t.devices) == 2 and [d["rank"] for d in t.devices] == [0, 1]
    assert [row.size for row in t.rows] == [8, 32, 128, 512, 2048, 8192, 32768]
    for row in t.rows:
        assert (row.count, row.type, row.redop, row.root) == (row.size // 4, "float", "sum", -1)
        for res in (row.out_of_place, row.in_place):
            assert res.wrong == 0 and res.time_us > 0
            assert res.busbw == res.algbw                    # 2(n-1)/n = 1 at n = 2
            assert _close(res.algbw, row.size / (res.time_us * 1e3))
    busbws = [res.busbw for row in t.rows for res in (row.out_of_place, row.in_place)]
    assert t.out_of_bounds == 0 and _close(t.avg_busbw, sum(busbws) / len(busbws))
    assert "NCCL environment:" in r.stdout

    doc = json.loads((tmp_path / "out.json").read_text())
    assert doc["version"] == 2 and doc["config"]["iterations"] == 20 and len(doc["config"]["devices"]) == 2
    assert [res["size"] for res in doc["results"]] == [row.size for row in t.rows]
    for res, row in zip(doc["results"], t.rows):
        assert res["count"] == row.count and res["root"].strip() == "-1"
        assert res["out_of_place"]["nwrong"] == 0.0 and res["in_place"]["nwrong"] == 0.0
        assert _close(row.out_of_place.time_us, res["out_of_place"]["time"], 2 if row.out_of_place.time_us < 1e4 else 0)
    assert doc["out_of_bounds"] == {"count": 0, "okay": "true"}
    assert (tmp_path / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_corrupted_results_are_counted_and_fail_the_run(tmp_path):
    r = _cli(["all_gather", "--backend", "gloo", "--nproc", "2", "-b", "64", "-e", "256", "-f", "2", "-n", "2"],
             tmp_path, env_extra={"PYNCCL_BENCH_CORRUPT": "1"})
    assert r.returncode != 0, r.stdout + r.stderr
    (t,) = parse_log(r.stdout)
    assert len(t.rows) == 3
    for row in t.rows:
        assert row.out_of_place.wrong > 0 and row.in_place.wrong > 0
    assert t.out_of_bounds == 6 and "FAILED" in r.stdout


def test_runs_under_torchrun(tmp_path):
    env = subprocess_env(OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "pynccl.bench",
                        "reduce_scatter", "--backend", "gloo", "-b", "64", "-e", "1K", "-f", "4", "-n", "2"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    (t,) = parse_log(r.stdout)
    assert len(t.devices) == 2 and [row.size for row in t.rows] == [64, 256, 1024]
    assert all(row.out_of_place.wrong == 0 and row.in_place.wrong == 0 for row in t.rows)


# ----------------------------------------------------------------------------- every op, 3 ranks
def _every_op(rank, world_size):
    from pynccl.bench.runner import run_initialized
    out = {}

    def run(argv):
        buf = io.StringIO()
        with redirect_stdout(buf):
            code = run_initialized(parse_args(argv), "gloo")
        return code, buf.getvalue()

    # every op, both implementations, every root; 3 ranks so that chunks do not divide evenly.
    out["both"] = run(["all", "-b", "8", "-e", "4K", "-f", "8", "-n", "2", "-r", "-1", "--impl", "both",
                       "--reps", "2"])
    # every reduction and the dtypes gloo has, on the two reducing collectives.
    out["redops"] = run(["all_reduce,reduce_scatter", "-b", "1K", "-e", "1K", "-n", "1", "-w", "0",
                         "-o", "all", "-d", "all", "-a", "3"])
    # host-overhead mode, blocking mode, min over ranks, one root
    out["modes"] = run(["broadcast", "-b", "8", "-e", "64", "-f", "8", "-n", "2", "-C", "1", "-z", "1", "-a", "2",
                        "-r", "2"])
    os.environ["PYNCCL_BENCH_CORRUPT"] = "1"
    out["corrupt"] = run(["alltoall,gather", "-b", "48", "-e", "96", "-f", "2", "-n", "1"])
    del os.environ["PYNCCL_BENCH_CORRUPT"]
    try:
        run(["all_reduce", "-G", "1", "-b", "8", "-e", "8"])
        out["graph"] = "no error"
    except ValueError as e:
        out["graph"] = str(e)
    return out


def test_every_op_and_impl_on_three_ranks():
    results = run_multiprocess(_every_op, 3, backend="gloo", timeout=240)
    code, text = results[0]["both"]
    assert code == 0, text
    tests = parse_log(text)
    assert [t.name for t in tests] == [f"{name}_perf" for name in OPS]
    for t in tests:
        op = get_op(t.name[:-len("_perf")])
        assert t.out_of_bounds == 0
        roots = sorted({row.root for row in t.rows})
        assert roots == ([0, 1, 2] if op.has_root else [-1]), t.name
        checked = [row for row in t.rows if row.size > 0]
        assert len(checked) >= 3 * len(roots), t.name
        for row in t.rows:
            assert row.out_of_place.wrong == 0, (t.name, row)
            assert row.in_place.wrong == (0 if op.in_place_checked else None), (t.name, row)
    # the comparison table follows each op's rows, torch checked too
    assert text.count("# pynccl vs torch") == len(OPS)
    assert text.count("# torch: Out of bounds values : 0 OK") == len(OPS)
    assert "spread over 2 repetitions" in text

    code, text = results[0]["redops"]
    assert code == 0, text
    rows = [row for t in parse_log(text) for row in t.rows]
    seen = {(row.type, row.redop) for row in rows}
    assert {("half", "avg"), ("bfloat16", "prod"), ("int8", "sum"), ("double", "min"), ("uint8", "max")} <= seen
    assert all(row.out_of_place.wrong == 0 and row.in_place.wrong == 0 for row in rows)
    assert "skipping all_reduce int8 avg" in text and "skipping all_reduce uint32 sum" in text

    code, text = results[0]["modes"]
    assert code == 0, text
    (t,) = parse_log(text)
    assert t.time_label == "cputime" and "# Blocking Enabled: wait for completion and barrier" in text
    assert [(row.size, row.root, row.out_of_place.wrong) for row in t.rows] == [(8, 2, 0), (64, 2, 0)]

    code, text = results[0]["corrupt"]
    assert code == 1
    for t in parse_log(text):
        assert t.out_of_bounds == len([r for r in t.rows if r.size]) * (2 if t.name == "gather_perf" else 1)
    assert all(r["graph"].startswith("-G (CUDA graphs) needs CUDA tensors") for r in results)


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_every_op_on_nccl_world_size_1_with_and_without_graphs(tmp_path):
    for extra in ([], ["-G", "2"], ["-C", "1"]):
        r = _cli(["all", "-b", "8", "-e", "2M", "-f", "64", "-n", "5", "--impl", "both", *extra], tmp_path,
                 timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        tests = parse_log(r.stdout)
        assert len(tests) == len(OPS)
        for t in tests:
            assert t.out_of_bounds == 0 and len(t.rows) == 4, t.name


def test_check_targets_lists_the_sizes_that_miss(tmp_path, capsys):
    """benchmarks/check_targets.py: busbw ratio at >= 32 MiB and time ratio at <= 64 KiB, per
    op and placement, with every size that misses named."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("check_targets", os.path.join(REPO, "benchmarks", "check_targets.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def row(size, oop_us, ip_us):
        return {"size": size, "out_of_place": {"time": oop_us}, "in_place": {"time": ip_us}}
    ours = [row(8, 10.0, 10.0), row(65536, 30.0, 20.0), row(32 << 20, 100.0, 100.0), row(1 << 30, 1000.0, 900.0)]
    torch_ = [row(8, 20.0, 10.0), row(65536, 20.0, 40.0), row(32 << 20, 110.0, 100.0), row(1 << 30, 1000.0, 1000.0)]
    path = tmp_path / "eager_all_reduce.json"
    path.write_text(json.dumps({"pynccl": {"op": "all_reduce", "world_size": 2, "implementations": {
        "pynccl": {"results": ours}, "torch": {"results": torch_}}}}))
    mod.main([str(path)])
    lines = capsys.readouterr().out.splitlines()
    oop = next(ln for ln in lines if ln.startswith("all_reduce") and "out_of_place" in ln)
    ip = next(ln for ln in lines if ln.startswith("all_reduce") and "in_place" in ln)
    assert "65536B time 1.50" in oop and "B busbw" not in oop          # 30 us vs 20 us; 1.10 and 1.00 pass
    assert "1.000 / 1.050" in oop                                        # busbw ratios 1.10 and 1.00
    assert ip.endswith("none") and "1.000 / 1.056" in ip                 # 1.00 and 1000/900
