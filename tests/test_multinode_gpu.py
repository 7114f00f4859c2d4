"""Multi-node jobs on NCCL's network transport (issue 28): two torchrun agents ("nodes") × one GPU
each on one host, NCCL between them over sockets on the loopback interface (P2P, shared memory
and InfiniBand off, NCCL_NET=Socket, a NCCL_HOSTID per node: NCCL sees two hosts), so the
inter-node code paths run. The scenarios of test_multinode.py, on NCCL:

* checks: torchrun's variables, node-aware groups, every core collective equal to torch's NCCL
  over the same sockets; DDP, ZeRO 1-3 and hybrid sharding (1 GPU per node: the shard group is one
  GPU, the replicas are the two nodes) equal to one process on the same GPU (1e-5: GEMMs of other
  batch shapes sum in other orders, as in test_zero_gpu);
* a node dies mid-step: the survivor ends within the group timeout + 5 s (NCCL's default ends the
  process, exit code 75, or the error is raised), with its flight record written;
* torchrun --max-restarts 1 resumes from the last checkpoint with the uninterrupted run's losses;
* pynccl-bench --nnodes 2 --impl both on NCCL.

    NCCL_NVLS_ENABLE=0 python -m pytest -m multigpu tests/test_multinode_gpu.py -s
"""
import pytest
import torch

import test_multinode as mn

PER_NODE = 1
GPU_TOL = 1e-5
NCCL_TIMEOUT_S = 10.0

pytestmark = [
    pytest.mark.multigpu,
    pytest.mark.skipif(torch.cuda.device_count() < mn.NNODES * PER_NODE, reason="needs 2 GPUs (one per node)"),
]


def test_two_nodes_over_sockets_match_torch_and_one_process(tmp_path):
    mn.run_checks(tmp_path, "nccl", PER_NODE)


def test_a_node_dies_mid_step_on_nccl(tmp_path):
    ended, outcomes = mn.run_node_death(tmp_path, "nccl", PER_NODE, NCCL_TIMEOUT_S)
    assert set(outcomes) <= {"raised", "teardown"}, outcomes


def test_restart_resumes_from_the_last_checkpoint_on_nccl(tmp_path):
    mn.run_resume(tmp_path, "nccl", PER_NODE, GPU_TOL, GPU_TOL)


def test_benchmark_over_two_nodes_on_nccl():
    out = mn.run_bench("nccl", PER_NODE)
    assert "NCCL" in out and "(nccl backend)" in out, out
