"""The mutation set (tests/mutation/mutants.toml) still applies to the code as it is: every mutant's
snippet occurs exactly once in its file, the mutated file compiles, and every test it names exists.
Cheap, so the ordinary suite notices when a change moves code under a mutant; whether each mutant
is killed is tests/mutation/run.py's job (CI runs it with --ci)."""
import ast
import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("mutation_run", ROOT / "tests" / "mutation" / "run.py")
mutation_run = sys.modules["mutation_run"] = importlib.util.module_from_spec(_spec)   # dataclasses look it up
_spec.loader.exec_module(mutation_run)
MUTANTS = mutation_run.load_mutants()


def _test_functions(path: pathlib.Path) -> set:
    return {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}


def test_the_set_covers_every_path_the_issue_names():
    assert len(MUTANTS) >= 15
    assert sum(m.device == "cpu" for m in MUTANTS) >= 15
    files = {m.file for m in MUTANTS}
    for f in ("pynccl/ddp/reducer.py", "pynccl/zero/flat_unit.py", "pynccl/zero/stage3.py", "pynccl/zero/layout.py",
              "pynccl/tensor_parallel/comm.py", "pynccl/pipeline/actions.py", "pynccl/comm/reduce_op.py",
              "pynccl/zero/clip.py", "pynccl/ddp/sync_batchnorm.py", "pynccl/zero/checkpoint.py"):
        assert f in files, f"no mutant in {f}"


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.id for m in MUTANTS])
def test_mutant_applies_and_names_real_tests(mutant):
    path = ROOT / mutant.file
    mutated = mutation_run.apply(path.read_text(), mutant)   # ValueError unless the snippet is there once
    compile(mutated, str(path), "exec")
    for node in set(mutant.tests) | set(mutant.ci_tests):
        file, _, name = node.partition("::")
        assert (ROOT / file).is_file(), f"{mutant.id}: no test file {file}"
        if name:
            assert name.split("[")[0] in _test_functions(ROOT / file), f"{mutant.id}: no test {node}"


def test_apply_refuses_a_snippet_that_is_not_there_once():
    m = MUTANTS[0]
    with pytest.raises(ValueError, match="occurs 0 times"):
        mutation_run.apply("nothing here", m)
    with pytest.raises(ValueError, match="occurs 2 times"):
        mutation_run.apply(m.original + "\n" + m.original, m)
