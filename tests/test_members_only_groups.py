"""Groups made by their members alone (pynccl/comm/members_only_groups.py), after the group histories
that make torch's own names for them differ between members: a group some ranks are not in
(`new_group([0])`: torch 2.11's salt, the number of groups a rank is in) and a members-only group of
a subgroup (torch 2.14's salt, a count its non-members do not advance). With torch's names the
members wait for each other under different store prefixes until the group's time-out (seen on
torch 2.11: train_bench --floor's ZeRO-3 after `new_group([0])`); here each group carries
collectives, and torch's own all-rank new_group still works after them."""
import datetime

import torch
import torch.distributed as tdist

import pynccl
from pynccl.comm.groups import duplicate_group
from pynccl.comm.members_only_groups import group_name
from pynccl.testing import run_multiprocess

TIMEOUT = datetime.timedelta(seconds=20)   # a hang is a time-out of this, well inside the test's


def _sum_of_ranks(group, ranks):
    x = torch.tensor([pynccl.get_rank() + 1.0])
    pynccl.all_reduce(x, group=group)
    assert x.item() == sum(r + 1.0 for r in ranks), (x.item(), ranks)


def _histories(rank, ws):
    world = pynccl.get_default_group()
    # A group rank 0 alone is in, from pynccl and from torch (train_bench --floor's groups).
    pynccl.new_group([0])
    tdist.new_group([0])
    _sum_of_ranks(duplicate_group(world, "after-one-rank-groups"), range(ws))
    # A members-only group of a subgroup, then one of the world: torch 2.14 salts with a count the
    # non-member (rank 2) did not advance.
    sub = pynccl.new_group([0, 1])
    if rank in (0, 1):
        _sum_of_ranks(duplicate_group(sub, "sub"), [0, 1])
    _sum_of_ranks(duplicate_group(world, "after-a-subgroup"), range(ws))
    # The same purpose again after a destroy: a new generation, not the old group's store keys.
    again = duplicate_group(world, "after-a-subgroup")
    pynccl.destroy_process_group(again)
    _sum_of_ranks(duplicate_group(world, "after-a-subgroup"), range(ws))
    # torch's own names are untouched: an all-rank torch group after all of these.
    t = torch.tensor([rank + 1.0])
    tdist.all_reduce(t, group=tdist.new_group(list(range(ws))))
    assert t.item() == 6.0
    return True


def test_members_only_groups_after_asymmetric_histories():
    assert run_multiprocess(_histories, 3, backend="gloo", init_kwargs={"timeout": TIMEOUT},
                            timeout=120) == [True] * 3


def _generations(rank, ws):
    groups = {0: pynccl.new_group([0, 1]), 2: pynccl.new_group([2])}
    members = [0, 1] if rank < 2 else [2]
    names = []
    for _ in range(3):
        names.append(group_name(f"test/{members}", len(members)))
        pynccl.barrier(group=groups[members[0]])     # as making the group would: every member has added
    assert names == [f"pynccl:test/{members}:{g}" for g in range(3)], names
    return True


def test_generation_counts_groups_not_members():
    """Each member adds 1 per group: (count - 1) // size is the group's generation on every member."""
    assert run_multiprocess(_generations, 3, backend="gloo") == [True] * 3
