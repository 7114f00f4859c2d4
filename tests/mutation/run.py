"""Mutation testing: the suite's contract that it catches the bugs it is named for.

Each mutant in mutants.toml is one realistic bug (a missed 1/N, a skipped bucket, a stale shard,
...): a file, an exact snippet of it, its replacement, and the tests that must fail on it. This
script copies the tree (the files git tracks or would track, plus the built extension) to a
temporary folder once, then for each mutant: checks the snippet occurs exactly once, writes the
mutated file, runs the mutant's tests there with -x and a timeout, and puts the file back. The
working tree is never written. A mutant is killed when its tests fail (or time out: a hang is a
failure too), survives when they pass; the run fails unless every mutant it ran was killed.

    python tests/mutation/run.py                       # the CPU mutants, each with all its tests
    python tests/mutation/run.py --ci --budget 720     # the CPU mutants, each with its fastest killers
    python tests/mutation/run.py --device gpu          # the GPU mutants (one and several GPUs)
    python tests/mutation/run.py --only zero-layout-off-by-one --keep

First the mutants' tests run once on the unmutated copy (the baseline): a test that fails without
any mutant would count every mutant as killed. --no-baseline skips it (CI runs the suite anyway).
The result is a markdown table (stdout, and --report FILE).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[2]
MUTANTS = Path(__file__).with_name("mutants.toml")
DEVICES = ("cpu", "gpu", "multigpu")


@dataclasses.dataclass
class Mutant:
    id: str
    what: str
    file: str
    original: str
    mutated: str
    tests: List[str]
    ci_tests: List[str]
    device: str = "cpu"
    timeout_s: float = 600.0
    note: str = ""


@dataclasses.dataclass
class Outcome:
    mutant: Mutant
    result: str          # killed, killed (timeout), SURVIVED, ERROR: ..., not run: ...
    seconds: float
    tests: List[str]
    tail: str = ""

    @property
    def ok(self) -> bool:
        return self.result.startswith("killed")


def load_mutants(path: Path = MUTANTS) -> List[Mutant]:
    data = tomllib.loads(path.read_text())
    mutants = []
    for entry in data["mutant"]:
        entry = dict(entry)
        entry.setdefault("ci_tests", entry["tests"])
        mutants.append(Mutant(**entry))
    ids = [m.id for m in mutants]
    duplicated = sorted({i for i in ids if ids.count(i) > 1})
    if duplicated:
        raise ValueError(f"{path}: mutant ids must be unique, repeated: {duplicated}")
    for m in mutants:
        if m.device not in DEVICES:
            raise ValueError(f"{path}: mutant {m.id}: device must be one of {DEVICES}, got {m.device!r}")
        if m.original == m.mutated or not m.tests:
            raise ValueError(f"{path}: mutant {m.id}: needs a replacement that differs and at least one test")
    return mutants


def apply(source: str, mutant: Mutant) -> str:
    """`source` with the mutant's snippet replaced; ValueError unless the snippet occurs exactly once."""
    count = source.count(mutant.original)
    if count != 1:
        raise ValueError(f"mutant {mutant.id}: the original snippet occurs {count} times in {mutant.file}, "
                         f"expected exactly once (the code moved on: update mutants.toml)")
    return source.replace(mutant.original, mutant.mutated)


def tree_files(root: Path) -> List[Path]:
    """What a fresh clone plus a build holds: git's tracked and untracked-not-ignored files, and the
    built extension (pynccl/_C*.so, ignored by git)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                            check=True, capture_output=True).stdout.decode().split("\0")
    files = [Path(f) for f in listed if f and (root / f).is_file()]
    files += [p.relative_to(root) for p in (root / "pynccl").glob("_C*.so")]
    return files


def copy_tree(root: Path, dest: Path) -> None:
    for rel in tree_files(root):
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target)


def check_imports_from(copy: Path) -> None:
    """The tests must import pynccl from the copy, not from an install elsewhere (an editable one)."""
    env = dict(os.environ, PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1")
    found = subprocess.run([sys.executable, "-c", "import pynccl; print(pynccl.__file__)"], cwd=copy, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    if not Path(found).resolve().is_relative_to(copy.resolve()):
        raise SystemExit(f"pynccl imports from {found}, not from the copy {copy}: mutants would not be seen")


def run_tests(copy: Path, tests: List[str], timeout_s: float) -> tuple:
    """(pytest's exit code, or None on time-out; seconds; the output's tail)."""
    env = dict(os.environ, PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1")
    # NOTE: no bytecode: a mutant and its original can have the same size and mtime second, and
    # Python would then run a stale .pyc of the other.
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)          # the test's own rank processes too
        out, _ = proc.communicate()
        code = None
    return code, time.monotonic() - start, "\n".join((out or "").strip().splitlines()[-15:])


def run_mutant(copy: Path, mutant: Mutant, tests: List[str], timeout_s: float) -> Outcome:
    path = copy / mutant.file
    original = path.read_text()
    try:
        mutated = apply(original, mutant)
    except ValueError as e:
        return Outcome(mutant, f"ERROR: {e}", 0.0, tests)
    path.write_text(mutated)
    try:
        try:
            compile(mutated, str(path), "exec")
        except SyntaxError as e:
            return Outcome(mutant, f"ERROR: the mutated file does not compile: {e}", 0.0, tests)
        code, seconds, tail = run_tests(copy, tests, timeout_s)
    finally:
        path.write_text(original)
    if code is None:
        return Outcome(mutant, "killed (timeout)", seconds, tests, tail)
    if code == 1:
        return Outcome(mutant, "killed", seconds, tests, tail)
    if code == 0:
        return Outcome(mutant, "SURVIVED", seconds, tests, tail)
    return Outcome(mutant, f"ERROR: pytest exited {code} (no test ran, or a usage error)", seconds, tests, tail)


def table(outcomes: List[Outcome]) -> str:
    rows = ["| mutant | bug | file | device | tests run | result | s |", "|---|---|---|---|---|---|---|"]
    for o in outcomes:
        m = o.mutant
        tests = "<br>".join(f"`{t}`" for t in o.tests)
        what = f"{m.what} ({m.note})" if m.note else m.what
        rows.append(f"| `{m.id}` | {what} | `{m.file}` | {m.device} | {tests} | {o.result} | {o.seconds:.0f} |")
    killed = sum(o.ok for o in outcomes)
    rows.append(f"\n{killed} of {len(outcomes)} mutants killed in {sum(o.seconds for o in outcomes):.0f} s.")
    return "\n".join(rows)


def select(mutants: List[Mutant], device: str, only: Optional[List[str]]) -> List[Mutant]:
    if only:
        unknown = sorted(set(only) - {m.id for m in mutants})
        if unknown:
            raise SystemExit(f"--only: no mutant named {unknown}")
        return [m for m in mutants if m.id in only]
    wanted = {"cpu": ("cpu",), "gpu": ("gpu", "multigpu"), "all": DEVICES}[device]
    return [m for m in mutants if m.device in wanted]


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "gpu", "all"), default="cpu",
                    help="which mutants: cpu (default), gpu (one and several GPUs), all")
    ap.add_argument("--only", nargs="+", metavar="ID", help="just these mutants")
    ap.add_argument("--ci", action="store_true", help="each mutant's ci_tests only (its fastest killers)")
    ap.add_argument("--budget", type=float, default=None, metavar="S",
                    help="seconds for the whole run; mutants it leaves out count as failures")
    ap.add_argument("--no-baseline", action="store_true", help="skip the run of the tests on the unmutated tree")
    ap.add_argument("--report", type=Path, help="also write the markdown table here")
    ap.add_argument("--keep", action="store_true", help="keep the copy of the tree (its path is printed)")
    ap.add_argument("--verbose", action="store_true", help="print each mutant's pytest output tail")
    args = ap.parse_args(argv)

    mutants = select(load_mutants(), args.device, args.only)
    tests_of: Dict[str, List[str]] = {m.id: (m.ci_tests if args.ci else m.tests) for m in mutants}
    deadline = None if args.budget is None else time.monotonic() + args.budget
    copy = Path(tempfile.mkdtemp(prefix="pynccl-mutation-"))
    try:
        copy_tree(ROOT, copy)
        check_imports_from(copy)
        print(f"tree copied to {copy}; {len(mutants)} mutants", flush=True)
        if not args.no_baseline:
            union = sorted({t for ts in tests_of.values() for t in ts})
            code, seconds, tail = run_tests(copy, union, 3600 if deadline is None else deadline - time.monotonic())
            print(f"baseline: {len(union)} test selections, exit {code}, {seconds:.0f} s", flush=True)
            if code != 0:
                print(tail)
                print("the mutants' tests fail (or hang) on the unmutated tree: a kill would mean nothing")
                return 2
        outcomes = []
        for m in mutants:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left < 10:
                outcomes.append(Outcome(m, "not run: out of --budget", 0.0, tests_of[m.id]))
                continue
            o = run_mutant(copy, m, tests_of[m.id], m.timeout_s if left is None else min(m.timeout_s, left))
            outcomes.append(o)
            print(f"{o.result:>18}  {o.seconds:6.0f} s  {m.id}", flush=True)
            if args.verbose or not o.ok:
                print("    " + o.tail.replace("\n", "\n    "), flush=True)
    finally:
        if args.keep:
            print(f"kept {copy}")
        else:
            shutil.rmtree(copy, ignore_errors=True)
    report = table(outcomes)
    print(report)
    if args.report:
        args.report.write_text(report + "\n")
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
