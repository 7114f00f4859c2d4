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


def test_dp_inferred_from_world_size():
    assert MeshShape.infer(8, None, 2, 2) == MeshShape(2, 2, 2)
    assert MeshShape.infer(4, 4, 1, 1) == MeshShape(4, 1, 1)
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by tp\(4\) × pp\(1\) = 4"):
        MeshShape.infer(6, None, 4, 1)
    with pytest.raises(ValueError, match=r"dp\(3\) × tp\(2\) × pp\(1\) = 6, but the world size is 4"):
        MeshShape.infer(4, 3, 2, 1)
    with pytest.raises(ValueError, match=r"pp must be a positive int, got 0 \(dp=None, tp=2, pp=0, world size 4\)"):
        MeshShape.infer(4, None, 2, 0)


def test_check_divides_names_every_failing_dimension():
    shape = MeshShape(dp=2, tp=4, pp=3)
    shape.check_divides(num_heads=8, hidden_size=64, num_layers=6, batch_size=10)
    with pytest.raises(ValueError) as e:
        shape.check_divides(num_heads=6, hidden_size=64, num_layers=4, batch_size=7, seq_len=0)
    assert str(e.value) == ("ParallelMesh: num_heads=6 is not divisible by tp=4; num_layers=4 is not divisible "
                            "by pp=3; batch_size=7 is not divisible by dp=2; seq_len must be a positive int, "
                            "got 0 (dp=2, tp=4, pp=3)")


def mesh_case(rank, ws):
    mesh = ParallelMesh(dp=1, tp=2, pp=2)
    assert (mesh.dp_rank, mesh.tp_rank, mesh.pp_rank) == (0, rank % 2, rank // 2)
    assert mesh.tp_group.ranks == [rank - rank % 2, rank - rank % 2 + 1]
    assert mesh.pp_group.ranks == [rank % 2, rank % 2 + 2]
    assert mesh.dp_group.ranks == [rank]
    assert mesh.mp_group.ranks == [0, 1, 2, 3] and mesh.world_group.ranks == [0, 1, 2, 3]
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
    inferred = ParallelMesh(dp=None, tp=2, pp=1)
    assert (inferred.dp_size, inferred.dp_rank, inferred.tp_rank) == (2, rank // 2, rank % 2)
    return "ok"


def test_mesh_groups_on_four_ranks():
    assert run_multiprocess(mesh_case, 4) == ["ok"] * 4
