"""benchmarks/gpu_suite.py, checked on CPU so that a GPU session does not spend its budget on a typo:
`--list` names every group, an unknown group is refused before anything runs, and every command of
every group (at 1, 2 and 4 GPUs) names scripts and test files that exist, with flags their argparse
accepts (each step's own arguments are parsed, with --help appended, in one child process)."""
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import gpu_suite  # noqa: E402
from repo_env import subprocess_env  # noqa: E402

ENV = subprocess_env(CUDA_VISIBLE_DEVICES="")
SEPARATORS = {";", "&&", "||", "|"}
TORCHRUN_VALUE_FLAGS = {"--nproc_per_node", "--master_port", "--nnodes", "--node_rank"}


def _steps():
    for n in (1, 2, 4):
        for group, steps in gpu_suite.groups(n).items():
            for name, cap, cmd in steps:
                yield n, group, name, cap, cmd.format(port=29999, out="/tmp/gpu_suite_out")


def _simple_commands(cmd):
    """The shell command's simple commands as token lists, VAR=value prefixes dropped."""
    lexer = shlex.shlex(cmd, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    current, out = [], []
    for tok in lexer:
        if tok in SEPARATORS:
            out.append(current)
            current = []
        elif current or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", tok):
            current.append(tok)
    return [c for c in out + [current] if c]


def _invocation(tokens):
    """(kind, target, args): ("script", path, args), ("module", name, args), ("pytest", None, args)
    or ("other", program, args)."""
    prog, rest = tokens[0], tokens[1:]
    if prog == "torchrun":
        i = 0
        while rest[i].startswith("-"):
            i += 2 if rest[i] in TORCHRUN_VALUE_FLAGS else 1
        return "script", rest[i], rest[i + 1:]
    if prog in ("python", "python3"):
        if rest[0] == "-m":
            return ("pytest", None, rest[2:]) if rest[1] == "pytest" else ("module", rest[1], rest[2:])
        if rest[0] == "-c":
            return "other", prog, rest
        return "script", rest[0], rest[1:]
    return "other", prog, rest


def _invocations():
    return [(step, *_invocation(toks)) for *step, cmd in _steps() for toks in _simple_commands(cmd)]


def test_list_names_every_group_and_alias():
    out = subprocess.run([sys.executable, "benchmarks/gpu_suite.py", "--list", "--gpus", "4"], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    listed = [line.split(":")[0].split(" = ")[0] for line in out.stdout.splitlines()]
    assert listed == list(gpu_suite.groups(4)) + list(gpu_suite.ALIASES)
    assert "multigpu: multigpu4 (540 s); multigpu2 (420 s)" in out.stdout     # sized by --gpus
    for members in gpu_suite.ALIASES.values():
        assert set(members) <= set(gpu_suite.groups(4))


def test_unknown_group_is_refused_before_anything_runs(tmp_path):
    out = subprocess.run([sys.executable, "benchmarks/gpu_suite.py", "--out", str(tmp_path / "o"), "ddp", "dpp"],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "unknown group(s) ['dpp']" in out.stderr
    assert not (tmp_path / "o").exists()


def test_group_names_and_steps_are_stable():
    # The lead's groups, named in RESULTS.md and in session notes: renaming one breaks their commands.
    groups = gpu_suite.groups(2)
    for name in ("versions", "tests26", "contention", "ddp", "zero12", "zero3", "gputests", "collectives", "faults",
                 "host", "tp", "pp", "multigpu", "gpu1", "examples"):
        assert name in groups, name
    names = [s for steps in groups.values() for s, _, _ in steps]
    assert len(names) == len(set(names)), "two steps would write the same log"


def test_every_script_and_test_path_exists():
    for (n, group, name, cap), kind, target, args in _invocations():
        where = f"group {group!r}, step {name!r} at {n} GPUs"
        if kind == "script":
            assert os.path.isfile(os.path.join(ROOT, target)), f"{where}: no script {target}"
        elif kind == "module":
            assert importlib.util.find_spec(target) is not None, f"{where}: no module {target}"
        elif kind == "pytest":
            paths = [a for a in args if a.startswith("tests")]
            assert paths, f"{where}: pytest without a test path"
            for path in paths:
                assert os.path.exists(os.path.join(ROOT, path)), f"{where}: no {path}"
        else:
            assert target in ("nvidia-smi", "cat", "exit", "python3"), f"{where}: {target}"   # python3 -c


# Runs in one child process: each job's argparse sees its own arguments plus --help, so an unknown
# choice or a bad value fails (exit 2) and the help text lists every option the job may use.
_DRIVER = r"""
import contextlib, io, json, runpy, sys
results = []
for kind, target, args in json.load(sys.stdin):
    out, err, code = io.StringIO(), io.StringIO(), None
    sys.argv = [target] + args + ["--help"]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if kind == "module":
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(target, run_name="__main__")
        except SystemExit as e:
            code = e.code or 0
    results.append({"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()[-2000:]})
sys.path.insert(0, "benchmarks")
from train_bench_lib.models import STRATEGIES
from ddp_bench_lib.levers import LEVERS
print(json.dumps({"results": results, "strategies": STRATEGIES, "levers": sorted(LEVERS)}))
"""


def _uses_argparse(kind, target):
    if kind == "module":
        return True
    with open(os.path.join(ROOT, target)) as f:
        return "argparse" in f.read() and not target.endswith("setup.py")


def test_every_flag_is_accepted_by_its_script():
    jobs, where = [], []
    for (n, group, name, cap), kind, target, args in _invocations():
        if kind in ("script", "module") and _uses_argparse(kind, target) and [kind, target, args] not in jobs:
            jobs.append([kind, target, args])
            where.append(f"group {group!r}, step {name!r} at {n} GPUs: {target}")
    assert len(jobs) >= 20
    out = subprocess.run([sys.executable, "-c", _DRIVER], input=json.dumps(jobs), cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    for (kind, target, args), at, res in zip(jobs, where, report["results"]):
        assert res["code"] == 0, f"{at}: argparse refused {args}: {res['stderr']}"
        options = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", res["stdout"]))
        for flag in (a.split("=")[0] for a in args if re.match(r"^--?[A-Za-z]", a)):
            assert flag in options, f"{at}: {flag} is not an option of {target}"
        values = dict(zip(args, args[1:]))
        for strategy in values.get("--strategy", "").split(",") if target.endswith("train_bench.py") else []:
            assert strategy in report["strategies"], f"{at}: unknown train_bench strategy {strategy!r}"
        if "--levers" in args:
            levers = args[args.index("--levers") + 1:]
            levers = levers[:next((i for i, a in enumerate(levers) if a.startswith("-")), len(levers))]
            for lever in levers:
                assert lever in report["levers"] or lever in ("all", "default"), f"{at}: unknown lever {lever!r}"


@pytest.mark.parametrize("cmd, expected", [
    ("A=1 torchrun --nproc_per_node 2 --master_port 1 b.py --x 1; cat f", [["torchrun", "--nproc_per_node", "2",
                                                                          "--master_port", "1", "b.py", "--x", "1"],
                                                                         ["cat", "f"]]),
    ("python3 -m pytest -q -m 'gpu or multigpu' tests/t.py", [["python3", "-m", "pytest", "-q", "-m",
                                                               "gpu or multigpu", "tests/t.py"]]),
])
def test_command_parsing(cmd, expected):
    assert _simple_commands(cmd) == expected
    assert _invocation(expected[0])[:2] in (("script", "b.py"), ("pytest", None))
