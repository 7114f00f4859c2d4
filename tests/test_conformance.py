"""Conformance with torch.distributed (issue 29): every public function pynccl.comm.distributed
exports under a torch.distributed name has torch 2.11's parameters (names, order, kinds,
defaults; the deliberate differences are the table SIGNATURE_DIFFERENCES below, each with its
reason), and gives torch's results on gloo at world sizes 2 and 3: the return values (None, a
Work, a list of Works, a Future, a rank, a group), the output tensors, and what happens on
GroupMember.NON_GROUP_MEMBER (skipped with torch's warning, -1, or an error). conformance_cases.py
holds the cases; each body runs once through pynccl and once through torch.distributed, on the
same data, in the same processes.

The README's interop table is printed from the same run:
    PYTHONPATH=$PWD python tests/test_conformance.py --markdown
"""
from __future__ import annotations

import inspect
import sys
import warnings
from typing import Dict, List, Tuple

import pytest
import torch.distributed as tdist

import pynccl
import pynccl.comm.distributed as pdist
from pynccl.testing import run_multiprocess

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from conformance_cases import CASES, NON_MEMBER_CALLS, _non_member_calls, normalize  # noqa: E402

# (function, parameter) -> why pynccl's signature differs from torch's there, on purpose.
SIGNATURE_DIFFERENCES: Dict[Tuple[str, str], str] = {
    ("init_process_group", "check_collectives"):
        "pynccl's own, keyword-only: compare each collective's signature across ranks first",
}
# Parameters torch added after 2.11 (pynccl keeps to 2.11's): either side may lack them; where both
# have one, it must match.
AFTER_TORCH_2_11: Dict[Tuple[str, str], str] = {
    **{(f, "weights_only"): "torch 2.12+" for f in ("all_gather_object", "broadcast_object_list", "gather_object",
                                                     "scatter_object_list", "send_object_list", "recv_object_list")},
    ("barrier", "timeout"): "torch 2.12+",
    ("init_process_group", "enable_reconfigure"): "torch 2.12+",
    ("new_group", "sort_ranks"): "torch 2.12+",
    ("split_group", "backend"): "torch 2.12+ (pynccl has it)",
}
# Names compared by their runtime behaviour only (no Python signature on torch's side).
NO_SIGNATURE = {"ProcessGroup": "torch's is a C++ class; pynccl's is made by new_group, never by users: "
                                "rank() and size() as torch's (checked on gloo)"}
# Behaviour that differs on purpose (the README's interop table shows these).
TAGS = "; on nccl, as in torch, tags are not matched (NCCL has none): ops pair in posting order"
NOTES: Dict[str, str] = {
    "init_process_group": "backend 'nccl' runs pynccl's communicator (CUDA tensors only; CPU tensors go "
                          "through torch.distributed, whose default group pynccl makes 'cpu:gloo,cuda:nccl'); "
                          "pg_options is a pynccl NcclOptions",
    "new_group": "pg_options and use_local_synchronization=True refused (pass a torch group made with them)",
    "split_group": "runs on gloo too (torch's is NCCL-only)",
    "irecv": "src=None (any source) refused; the blocking recv(src=None) has it on gloo" + TAGS,
    "recv": "src=None (any source): gloo only (NCCL has none)" + TAGS,
    "isend": TAGS[2:],
    "send": TAGS[2:],
    "recv_object_list": "src=None receives from any rank (gloo), where torch 2.11 requires src",
    "barrier": "device_ids must be the group's device",
    "monitored_barrier": "runs on nccl too (through the store) and names the missing ranks on every rank",
    "broadcast_object_list": "device= of the other type (cpu on an nccl group) runs torch's own function on the "
                             "group's torch twin",
    "send_object_list": "as broadcast_object_list for device=",
    "is_nccl_available": "whether pynccl's NCCL extension is built (torch's: whether torch has NCCL)",
    "P2POp": "torch's P2POp objects are taken by pynccl.batch_isend_irecv too (op mapped by identity); checked "
             "through batch_isend_irecv",
    "batch_isend_irecv": "as torch's per backend: one Work for the batch on nccl, one per op on gloo" + TAGS,
    "all_to_all": "torch 2.11's gloo lacks it: pynccl's result checked against the closed form there",
    "all_reduce_coalesced": "a mix of dtypes is taken (one all-reduce per dtype); torch refuses it",
    "all_gather_into_tensor": "on gloo, the stacked (world_size, n) output is taken too; torch's gloo takes the "
                              "flat one only",
    "broadcast": "on NON_GROUP_MEMBER, rooted ops are skipped whatever the root; torch raises when a global root "
                 "is outside the last group this rank was left out of (its registry's -100 entry)",
    "get_global_rank": "group=None is the default group (torch raises)",
    "get_group_rank": "group=None is the default group (torch raises)",
}
NOT_RUN = {
    "init_process_group": "the harness itself (each run starts with it)",
    "destroy_process_group": "the harness itself; NON_GROUP_MEMBER checked",
    "split_group": "torch's is NCCL-only: checked in test_interop",
    "is_nccl_available": "different meaning (see notes)",
    "is_available": "checked with is_initialized",
    "is_gloo_available": "checked with is_initialized",
}


def exported_torch_names() -> List[str]:
    public = {n for n in dir(tdist) if not n.startswith("_")}
    return sorted(set(pdist.__all__) & public)


def _params(obj):
    fn = obj.__init__ if inspect.isclass(obj) else obj
    params = list(inspect.signature(fn).parameters.values())
    return params[1:] if inspect.isclass(obj) else params


def _same_default(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - incomparable defaults differ
        return False


def signature_differences(name: str) -> List[str]:
    """What differs between pynccl's and torch's parameters of `name`, beyond the tables."""
    if name in NO_SIGNATURE:
        return []
    ours = [p for p in _params(getattr(pdist, name)) if (name, p.name) not in SIGNATURE_DIFFERENCES]
    theirs = [p for p in _params(getattr(tdist, name)) if not p.name.startswith("_")]
    later = {p for (f, p) in AFTER_TORCH_2_11 if f == name}
    both = {p.name for p in ours} & {p.name for p in theirs}
    ours = [p for p in ours if p.name not in later or p.name in both]
    theirs = [p for p in theirs if p.name not in later or p.name in both]
    problems = []
    if [p.name for p in ours] != [p.name for p in theirs]:
        problems.append(f"parameters {[p.name for p in ours]} != torch's {[p.name for p in theirs]}")
        return problems
    for a, b in zip(ours, theirs):
        if a.kind != b.kind:
            problems.append(f"{a.name}: kind {a.kind.name} != torch's {b.kind.name}")
        if (a.default is inspect.Parameter.empty) != (b.default is inspect.Parameter.empty) or (
                a.default is not inspect.Parameter.empty and not _same_default(a.default, b.default)):
            problems.append(f"{a.name}: default {a.default!r} != torch's {b.default!r}")
    for (f, p), why in SIGNATURE_DIFFERENCES.items():
        if f == name:
            param = inspect.signature(getattr(pdist, name)).parameters.get(p)
            if param is None or param.kind != inspect.Parameter.KEYWORD_ONLY:
                problems.append(f"{p}: listed as pynccl's extra, must exist and be keyword-only ({why})")
    return problems


# ----------------------------------------------------------------------------- the runs
def _call(fn):
    """(normalised result or ("raises", type), whether torch's not-in-group warning was given)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            value = normalize(fn())
        except Exception as e:  # noqa: BLE001 - compared with the other side's outcome
            value = ("raises", type(e).__name__, str(e)[:200])
    warned = any("does not belong to the given group" in str(w.message) for w in caught)
    return value, warned


def _same(ours, theirs) -> bool:
    if isinstance(ours, tuple) and isinstance(theirs, tuple) and ours[:1] == theirs[:1] == ("raises",):
        return True   # both raise (the types may differ; see NOTES)
    return ours == theirs


def conformance_run(rank: int, ws: int):
    """Every case through pynccl, then through torch, on this rank; and every NON_GROUP_MEMBER call."""
    results = []
    for i, c in enumerate(CASES):
        # NOTE: a barrier after each side: a message of one side (an any-source recv's) can never
        # be taken by the other, which runs on the same torch gloo group
        ours = _call(lambda: c.body(pynccl, rank, ws))
        tdist.barrier()
        theirs = _call(lambda: c.body(tdist, rank, ws))
        tdist.barrier()
        results.append((c.function, ours, theirs))
    # NON_GROUP_MEMBER on the ranks outside the group just made (see membership.py's NOTE on
    # torch's registry of groups: this is the case where torch skips rooted ops too)
    pynccl.new_group([0])
    tdist.new_group([0])
    for key in NON_MEMBER_CALLS if rank != 0 else ():
        ours = _call(_non_member_calls(pynccl, rank, ws)[key])
        theirs = _call(_non_member_calls(tdist, rank, ws)[key])
        results.append((f"{key} on NON_GROUP_MEMBER", ours, theirs))
    pynccl.barrier()   # rank 0, which makes no call above, hosts the store: it leaves last
    return results


def _function_of(label: str) -> str:
    return label.split(" ", 1)[0].split("(", 1)[0]


def compare(world_sizes=(2, 3)) -> Dict[str, List[str]]:
    """{function: differences found} over every case, rank and world size ([] where all agree)."""
    found: Dict[str, List[str]] = {}
    closed = {c.function: c.closed_form for c in CASES if c.closed_form is not None}
    for ws in world_sizes:
        per_rank = run_multiprocess(conformance_run, ws, backend="gloo", timeout=240)
        for rank, results in enumerate(per_rank):
            for label, (ours, our_warn), (theirs, their_warn) in results:
                fn = _function_of(label)
                bad = found.setdefault(fn, [])
                if isinstance(theirs, tuple) and theirs[:1] == ("raises",) and "does not support" in theirs[2] \
                        and fn in closed:
                    theirs = closed[fn](rank, ws)   # torch's gloo lacks the op here: the closed form instead
                if not _same(ours, theirs):
                    bad.append(f"ws {ws} rank {rank} {label}: pynccl {ours} != torch {theirs}")
                elif our_warn != their_warn:
                    bad.append(f"ws {ws} rank {rank} {label}: not-in-group warning pynccl={our_warn} torch={their_warn}")
    return found


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("name", exported_torch_names())
def test_signature_is_torchs(name):
    assert signature_differences(name) == []


def test_tables_name_real_parameters():
    """The difference tables stay true: every listed parameter exists where the table says."""
    for (fn, p) in SIGNATURE_DIFFERENCES:
        assert p in inspect.signature(getattr(pdist, fn)).parameters, (fn, p)
    for (fn, p) in AFTER_TORCH_2_11:
        assert fn in exported_torch_names(), fn
    assert set(NOTES) | set(NOT_RUN) <= set(exported_torch_names())


_results_cache: Dict[str, List[str]] = {}


def _results():
    if not _results_cache:
        _results_cache.update(compare())
    return _results_cache


def test_same_results_as_torch_on_gloo():
    found = _results()
    failures = [line for lines in found.values() for line in lines]
    assert not failures, "\n".join(failures)
    ran = set(found)
    missing = set(exported_torch_names()) - ran - set(NOT_RUN) - {"P2POp"}
    assert not missing, f"functions with no conformance case: {sorted(missing)}"


# ----------------------------------------------------------------------------- the README table
def markdown() -> str:
    found = compare()
    rows = ["| function | same signature as torch 2.11? | same results as torch on gloo (ws 2, 3)? | differences |",
            "|---|---|---|---|"]
    for name in exported_torch_names():
        sig = signature_differences(name)
        extras = [f"`{p}`: {why}" for (f, p), why in SIGNATURE_DIFFERENCES.items() if f == name]
        sig_text = "n/a (class)" if name in NO_SIGNATURE else ("yes" if not sig else "**no**: " + "; ".join(sig))
        if extras:
            sig_text += " + " + "; ".join(extras)
        if name in NOT_RUN:
            res = f"not compared: {NOT_RUN[name]}"
        elif name not in found and name != "P2POp":
            res = "no case"
        else:
            res = "yes" if not found.get(name) else f"**no** ({len(found[name])} differences)"
        notes = NOTES.get(name, NO_SIGNATURE.get(name, ""))
        rows.append(f"| `{name}` | {sig_text} | {res} | {notes} |")
    return "\n".join(rows)


if __name__ == "__main__":
    if "--markdown" in sys.argv:
        print(markdown())
    else:
        print(__doc__)
