"""ParallelMesh: grid arithmetic without processes; groups on 4 gloo processes."""
import pytest
import torch

import pynccl
from pynccl.mesh import MeshShape, ParallelMesh
from pynccl.testing import run_multiprocess


def test_grid_arithmetic_tp_fastest_then_dp_then_pp():
    shape = MeshShape(dp=2, tp=2, pp=2)
    assert [shape.coords(r) for r in range(8)] == [
        (0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0), (0, 0, 1), (0, 1, 1), (1, 0, 1), (1, 1, 1)]
    assert all(shape.rank_of(*shape.coords(r)) == r for r in range(8))
    assert shape.tp_ranks(1, 0) == [2, 3]
    assert shape.dp_ranks(1, 1) == [5, 7]
    assert shape.pp_ranks(0, 1) == [1, 5]


def test_product_must_equal_world_size():
    with pytest.raises(ValueError, match=r"dp\(2\) × tp\(2\) × pp\(2\) = 8, but the world size is 4"):
        MeshShape(2, 2, 2).validate(4)
    with pytest.raises(ValueError, match=r"tp must be a positive int, got 0 \(dp=4, tp=0, pp=1\)"):
        MeshShape(4, 0, 1).validate(4)


def mesh_case(rank, ws):
    mesh = ParallelMesh(dp=1, tp=2, pp=2)
    assert (mesh.dp_rank, mesh.tp_rank, mesh.pp_rank) == (0, rank % 2, rank // 2)
    assert mesh.tp_group.ranks == [rank - rank % 2, rank - rank % 2 + 1]
    assert mesh.pp_group.ranks == [rank % 2, rank % 2 + 2]
    assert mesh.dp_group.ranks == [rank]
    assert mesh.pp_next_rank == (rank + 2 if rank < 2 else None)
    assert mesh.pp_prev_rank == (rank - 2 if rank >= 2 else None)
    t = torch.tensor([float(rank)])
    pynccl.all_reduce(t, group=mesh.tp_group)
    assert t.item() == sum(mesh.tp_group.ranks)
    with pytest.raises(ValueError, match=r"num_heads=3 is not divisible by tp=2 \(dp=1, tp=2, pp=2\)"):
        mesh.check_divides(num_heads=3)
    with pytest.raises(ValueError, match=r"num_layers=5 is not divisible by pp=2"):
        mesh.check_divides(num_layers=5)
    with pytest.raises(ValueError, match=r"world size is 4"):
        ParallelMesh(dp=2, tp=2, pp=2)
    return "ok"


def test_mesh_groups_on_four_ranks():
    assert run_multiprocess(mesh_case, 4) == ["ok"] * 4
