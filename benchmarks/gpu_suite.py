"""The GPU measurements and tests in one driver: named groups of commands, each run with a cap and
within one overall budget, its log kept and its table lines printed (RESULTS-ready).

    python benchmarks/gpu_suite.py --gpus 2 --budget 540 --out OUT contention ddp zero12
    python benchmarks/gpu_suite.py --list                 # every group, its steps and caps

Each command runs as its own process (torchrun for multi-GPU ones) with NCCL_NVLS_ENABLE=0, so a
crash or hang in one is contained: it is killed at its cap and the suite goes on. A group's
commands are skipped once less than 30 s of the budget is left. Everything fits an 80 GB H100
(ddp_bench's GPT-2 medium runs without its CUDA-graph modes). Groups are sized by --gpus: the
multi-GPU steps use GPUs 0..N-1; steps that need more (tp2xdp2 needs 4) are left out.
benchmarks/RESULTS.md names the group behind each figure; tests/test_gpu_suite.py checks on CPU
that every script and flag named here exists.
"""
import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# ~1B Llama (HF config, random init): what the issues' ZeRO targets name; a 3B one for TP scaling.
L1B = "--model hf-llama --hidden 2048 --layers 16 --heads 32 --kv-heads 8 --intermediate 8192 --vocab 32000 --seq 2048"
L3B = "--model hf-llama --hidden 3072 --layers 28 --heads 24 --kv-heads 8 --intermediate 8192 --vocab 32000 --seq 2048"
GPT2M = "--model hf-gpt2 --hidden 1024 --layers 24 --heads 16 --vocab 50257 --seq 1024"
NOGRAPH = '--skip "no DDP + graph" "pynccl DDP + graph"'
TESTS = "python3 -m pytest -q -rA -p no:cacheprovider"
SUMMARY = re.compile(r"^(# |strategy|zero|pp-|ddp|tp|mode|no DDP|torch DDP|pynccl DDP|\s*\d+(\.\d+)? |FAILED|ERROR|"
                     r"XFAIL|\{|[=]+ .*(passed|failed))|passed|failed|Error")
# Names that run several groups in order (the old run_train_bench.sh session).
ALIASES = {"train": ["zero_gpt2", "zero3", "tp", "pp", "ddp_llama", "tp3b", "train_summary"],
           "suite": ["suite1", "suite2", "suite3", "suite4"]}


def _torchrun(n, script, args):
    return f"torchrun --nproc_per_node {n} --master_port {{port}} {script} {args}"


def _train(n, name, args, cap=200, env=""):
    """A train_bench step: pynccl against its torch counterpart, JSON kept for train_summary; `env`:
    VAR=value settings for this step alone."""
    return (name, cap, env + _torchrun(n, "benchmarks/train_bench.py", f"{args} --json {{out}}/{name}.json"))


def _devices(n):
    return ",".join(str(i) for i in range(n))


def _sweep(n, name, args, cap):
    """The nccl-tests-style sweep, pynccl and torch.distributed in the same processes."""
    spawn = f" --nproc {n}" if n > 1 else ""
    iters = "-n 50 -w 5" if n == 1 else "-n 20 -w 5"   # world size 1: µs per op even at 1 GiB
    return (name, cap, f"python3 -m pynccl.bench all -b 8 -f 2 {iters} --impl both --reps 3{spawn} {args} "
                       f"-J {{out}}/{name}_{{{{op}}}}.json")


SHARDS = 4


def _suite_shard(k):
    """The README's test command (`pytest -q`: CPU and GPU tests in one process per shard, as a user
    on a GPU machine runs it), one of SHARDS parts by test file, so each fits one capped call."""
    files = sorted(f for f in os.listdir(os.path.join(ROOT, "tests")) if f.startswith("test_") and f.endswith(".py"))
    return [(f"suite{k + 1}", 540, f"{TESTS} " + " ".join(f"tests/{f}" for f in files[k::SHARDS]))]


def groups(n):
    """name -> [(step name, cap seconds, shell command)]; {port} and {out} are filled in per step."""
    tests = f"{TESTS} -m 'gpu or multigpu'"
    multigpu = [(f"multigpu{n}", 540, f"CUDA_VISIBLE_DEVICES={_devices(n)} {TESTS} -m multigpu tests")]
    if n > 2:
        multigpu.append(("multigpu2", 420, f"CUDA_VISIBLE_DEVICES=0,1 {TESTS} -m multigpu tests"))
    tp, pp = min(2, n), max(1, n // 2)
    return {
        "versions": [("versions", 60, "python3 -c \"import torch, pynccl, transformers; print('torch', torch.__version__, "
                                      "'pynccl NCCL', pynccl.nccl_version(), 'transformers', transformers.__version__)\"; "
                                      "nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv")],
        "build": [("build", 420, "TORCH_CUDA_ARCH_LIST=${{TORCH_CUDA_ARCH_LIST:-9.0}} MAX_JOBS=${{MAX_JOBS:-32}} "
                                 "python3 setup.py build_ext --inplace")],
        # Tests. gputests: everything at N GPUs; gpu1 / multigpu: the markers apart (multigpu at N and at 2).
        "tests26": [("tests26", 240, f"{tests} tests/test_symmetric.py tests/test_reduce_op.py")],
        "gputests": [("gpu_tests", 420, f"{tests} tests")],
        **{f"suite{k + 1}": _suite_shard(k) for k in range(SHARDS)},
        "gpu1": [("gpu1", 300, f"CUDA_VISIBLE_DEVICES=0 {TESTS} -m gpu tests")],
        "multigpu": multigpu,
        "interop": [("interop", 240, f"{tests} tests/test_interop.py")],
        "tpplan": [("tp_plan_tests", 420, f"{TESTS} -m multigpu tests/test_tp_plan_gpu.py tests/test_tp_compile.py")],
        "zerotests": [("zero_tests", 200, f"{tests} tests/test_zero_gpu.py")],
        "ppgraphtests": [("pp_graph_tests", 200, f"{tests} tests/test_pipeline_graphs_gpu.py")],
        # Faults: every NCCL wait bounded (N ranks, 10 s group timeout), the one-GPU time-out tests.
        "faults": [("faults", 420, f"FAULT_WORLD_SIZE={n} FAULT_TIMES_FILE={{out}}/fault_times.jsonl "
                                   f"{TESTS} tests/test_faults_gpu.py; rc=$?; cat {{out}}/fault_times.jsonl; exit $rc"),
                   ("timeouts1", 300, f"CUDA_VISIBLE_DEVICES=0 {TESTS} tests/test_nccl_timeouts_lifecycle.py "
                                      "-k 'timeout or abort or destroy or self_recv or split'")],
        # Host time per call at world size 1, and the cost of PYNCCL_CHECK_COLLECTIVES on NCCL.
        "host": [("host_overhead", 200, "CUDA_VISIBLE_DEVICES=0 python3 benchmarks/host_overhead.py "
                                        "--json {out}/host_overhead.json"),
                 ("check_cost", 120, f"python3 benchmarks/collective_check_cost.py --backend nccl --nproc {n} --iters 2000")],
        # Collectives, pynccl vs torch.distributed, 8 B - 1 GiB: eager, CUDA graph, host time per enqueue.
        "collectives": [_sweep(n, "eager", "-e 1G", 300), _sweep(n, "graph", "-e 1G -G 1", 240),
                        _sweep(n, "cputime", "-e 64M -C 1", 150),
                        ("targets", 60, "python3 benchmarks/check_targets.py {out}/eager_*.json {out}/graph_*.json")],
        "contention": [("sm_contention", 150, _torchrun(n, "benchmarks/sm_contention.py", "--mib 25 100"))],
        # DDP over the no-DDP floor against torch DDP's, with the levers each in its own window.
        "ddp": [("ddp_nano", 240, _torchrun(n, "benchmarks/ddp_bench.py", "--model nanogpt-124m --steps 8 --repeats 2 "
                                            "--warmup 3 --no-diagnostics --levers comm-default comm-symmetric "
                                            "comm-copy-engine overlap-optimizer bf16-wire grad-view max-ctas-4 "
                                            "--json {out}/ddp_nano.json")),
                ("ddp_medium", 240, _torchrun(n, "benchmarks/ddp_bench.py", f"--model hf-gpt2-medium --steps 5 "
                                              f"--repeats 2 --warmup 2 --no-diagnostics {NOGRAPH} --levers comm-default "
                                              f"comm-copy-engine overlap-optimizer bf16-wire "
                                              f"--json {{out}}/ddp_medium.json"))],
        # Issue 26: the defaults since session 13 (bucket views + the tied embedding's tail: head part
        # first, the lookups' rows at the end + the copy engine) against session 12's defaults, the
        # same without the tied tail, and with symmetric buckets; nanoGPT's own train.py against its
        # one-GPU floor (compiled, then eager).
        "ddpdefaults": [("ddpdefaults_tests", 150, f"{tests} tests/test_ddp_embedding_rows_gpu.py tests/test_ddp_gpu.py"),
                        ("ddpdefaults_nano", 150, _torchrun(n, "benchmarks/ddp_bench.py", "--model nanogpt-124m "
                                                            "--steps 8 --repeats 3 --warmup 3 --no-diagnostics --levers "
                                                            "rows-plain-buffers views+plain-tied+copy-engine comm-symmetric "
                                                            "--json {out}/ddpdefaults_nano.json")),
                        ("ddpdefaults_medium", 200, _torchrun(n, "benchmarks/ddp_bench.py", f"--model "
                                                              f"hf-gpt2-medium --steps 5 --repeats 2 --warmup 2 "
                                                              f"--no-diagnostics {NOGRAPH} --levers rows-plain-buffers "
                                                              f"views+plain-tied+copy-engine comm-symmetric "
                                                              f"--json {{out}}/ddpdefaults_medium.json")),
                        ("ddpdefaults_trainpy", 240, f"python3 benchmarks/nanogpt_swap.py --nproc {n} --variants "
                                                     "floor,torch-ddp,pynccl-ddp --set max_iters=40 --timeout 75 "
                                                     "--json {out}/ddpdefaults_trainpy.json --run-dir {out}/nanogpt_runs"),
                        ("ddpdefaults_trainpy_eager", 200, f"python3 benchmarks/nanogpt_swap.py --nproc {n} --variants "
                                                           "floor,torch-ddp,pynccl-ddp --set compile=False --set "
                                                           "max_iters=40 --rounds 2 --timeout 60 --json "
                                                           "{out}/ddpdefaults_trainpy_eager.json --run-dir "
                                                           "{out}/nanogpt_runs_eager")],
        # Issue 26's early unpack: its tests, then its A/B (the default of reducer.unpack_early).
        "unpack": [("unpack_tests", 180, f"{tests} tests/test_ddp_unpack_gpu.py tests/test_nccl_inputs_buckets.py"),
                   ("unpack_ab", 240, _torchrun(n, "benchmarks/ddp_bench.py", "--model nanogpt-124m --steps 8 "
                                                "--repeats 2 --warmup 3 --no-diagnostics --levers unpack-early "
                                                "unpack-late unpack-early-tail4 --json {out}/ddp_unpack.json"))],
        # DDP: GPU phases, the host-bound step (buckets through C++ vs Python), stream priority, every lever.
        "ddp_more": [("ddp_phases", 200, _torchrun(n, "benchmarks/ddp_bench.py", "--steps 6 --repeats 3 --phases 10 "
                                                   "--grad-view both --json {out}/ddp_phases.json")),
                     ("ddp_host", 150, _torchrun(n, "benchmarks/ddp_bench.py", f"--batch 1 --seq 128 --compare-py-path "
                                                 f"--repeats 5 --no-diagnostics {NOGRAPH} --json {{out}}/ddp_host.json")),
                     ("ddp_prio", 150, _torchrun(n, "benchmarks/ddp_bench.py", "--compare-priority --repeats 4 "
                                                 "--no-diagnostics --json {out}/ddp_prio.json")),
                     ("ddp_levers", 200, _torchrun(n, "benchmarks/ddp_bench.py", "--steps 6 --repeats 3 --warmup 3 "
                                                   "--no-diagnostics --levers all --budget-s 120 "
                                                   "--json {out}/ddp_levers.json"))],
        "ddp_llama": [_train(n, "llama1b_ddp", f"{L1B} --batch 4 --strategy ddp --warmup 3 --steps 12")],
        # ZeRO against FSDP2 (bf16 params, fp32 reduce, fused AdamW on both sides), memory against the formula.
        "zero12": [_train(n, "zero12_sym", f"{L1B} --batch 4 --strategy zero1,zero2 --warmup 3 --steps 10 --repeats 2"),
                   ("zero12_plain", 200, "PYNCCL_ZERO_SYMMETRIC=0 " + _torchrun(
                       n, "benchmarks/train_bench.py", f"{L1B} --batch 4 --strategy zero1,zero2 --warmup 3 --steps 10 "
                       "--repeats 2 --json {out}/zero12_plain.json"))],
        "zero3": [("zero3_llama", 200, _torchrun(n, "benchmarks/train_bench.py", f"{L1B} --batch 4 --strategy zero3 "
                                                 "--warmup 3 --steps 10 --repeats 2 --json {out}/zero3.json"))],
        # Issue 26 item 2: ZeRO-3's block gathers in a symmetric-window ring (on by default) against
        # ordinary buffers; the tests first (bit-identical training, no NCCL all-gather kernels).
        "zero3ring": [("zero3_ring_tests", 300, f"CUDA_VISIBLE_DEVICES=0,1 {TESTS} -s -m multigpu "
                                                "tests/test_zero3_symmetric_gpu.py tests/test_zero_gpu.py"),
                      ("zero3_ring", 200, _torchrun(n, "benchmarks/train_bench.py", f"{L1B} --batch 4 --strategy zero3 "
                                                    "--impl pynccl --warmup 3 --steps 10 --repeats 2 "
                                                    "--json {out}/zero3_ring.json")),
                      ("zero3_plain", 200, "PYNCCL_ZERO3_SYMMETRIC=0 " + _torchrun(
                          n, "benchmarks/train_bench.py", f"{L1B} --batch 4 --strategy zero3 --impl pynccl --warmup 3 "
                          "--steps 10 --repeats 2 --json {out}/zero3_plain.json"))],
        # Issue 26's memory target with HF gradient checkpointing: ZeRO-3's backward pacing (tests: the
        # reduce inputs alive stay bounded, a rank skipping blocks does not hang), the checkpointed pair
        # against FSDP2, and one lead shorter.
        "zero3mem": [("zero3_pacing_tests", 150, f"{TESTS} tests/test_zero3_pacing_gpu.py"),
                     _train(n, "llama1b_zero3_ckpt", f"{L1B} --batch 4 --strategy zero3 --grad-ckpt --warmup 3 --steps 8"),
                     ("llama1b_zero3_ckpt_lead1", 150, "PYNCCL_ZERO3_BACKWARD_LEAD=1 " + _torchrun(
                         n, "benchmarks/train_bench.py", f"{L1B} --batch 4 --strategy zero3 --grad-ckpt --impl pynccl "
                         "--warmup 3 --steps 8 --json {out}/llama1b_zero3_ckpt_lead1.json"))],
        "zero_gpt2": [_train(n, "gpt2m_zero", f"{GPT2M} --batch 8 --strategy zero1,zero2,zero3 --warmup 3 --steps 12 "
                                              "--repeats 2", cap=240)],
        "zeromem": [("zero_memory", 150, _torchrun(n, "benchmarks/zero_memory.py", "--device cuda")),
                    ("zero_memory1", 120, "CUDA_VISIBLE_DEVICES=0 python3 benchmarks/zero_memory.py --device cuda"),
                    ("zero_bench", 150, _torchrun(n, "benchmarks/zero_bench.py", "--json {out}/zero_bench.json"))],
        # Tensor parallelism (tp = N) against DTensor TP; one block alone; TP + ZeRO-3 on a 2-D mesh.
        "tp": [_train(n, "llama1b_tp", f"{L1B} --batch 4 --strategy tp,tp-sp --warmup 3 --steps 12"),
               ("tp_block", 120, _torchrun(n, "benchmarks/tp_bench.py", "--json {out}/tp_block.json"))]
        + ([_train(n, "llama1b_tp2xdp2", f"{L1B} --batch 4 --strategy tp2xdp2 --warmup 3 --steps 12")] if n >= 4 else []),
        "tp3b": ([_train(n, "llama3b_tp", f"{L3B} --batch 1 --strategy tp --warmup 3 --steps 12")] if n > 1 else [])
        + [_train(1, "llama3b_tp1", f"{L3B} --batch 1 --strategy tp --warmup 3 --steps 12")],
        # Pipelines (pp = N) against torch.distributed.pipelining; the matmul-stage bubble; a stage's host cost.
        "pp": [_train(n, "llama1b_pp", f"{L1B} --batch 8 --microbatches 8 --strategy pp-1f1b-graphs,pp-gpipe-graphs,"
                                       "pp-1f1b,pp-gpipe,pp-interleaved --warmup 3 --steps 10 --repeats 2", cap=360),
               ("pp_bubble", 120, f"python3 benchmarks/pp_bench.py --backend nccl --nproc {n} --json {{out}}/pp_bubble.json"),
               ("pp_stage_cost", 120, "CUDA_VISIBLE_DEVICES=0 python3 benchmarks/pp_stage_cost.py")],
        "train_summary": [("train_summary", 60, "python3 benchmarks/train_bench_summary.py {out}")],
        # Issue 27: pynccl against torch at its best, eager and compiled (torchtitan's recipes), with MFU;
        # the one-GPU reference (TP scaling, ZeRO-3's floor); nanoGPT's own train.py with compile=True
        # (vendored in benchmarks/nanogpt/); graph breaks.
        "compile": [_train(n, "gpt2m_compile", f"{GPT2M} --batch 8 --strategy ddp,zero1,zero2,zero3 --compile both "
                                               "--warmup 3 --steps 10", cap=300),
                    _train(n, "llama1b_compile", f"{L1B} --batch 4 --strategy tp,tp-sp-async,zero3 --compile both "
                                                 "--warmup 3 --steps 10", cap=270),
                    _train(1, "llama1b_1gpu", f"{L1B} --batch 4 --strategy tp --compile both --warmup 3 --steps 10",
                           cap=120)],
        # Issue 27's targets in one run each (--floor: rank 0 alone trains the no-communication floor after
        # each pair): TP's step over the one-GPU step (<= 0.6 at tp 2), and ZeRO-3's cost over its own
        # world-size-1 floor against FSDP2's (<= 0.5), eager and compiled per block.
        "tpscale": [_train(n, "llama1b_tpscale", f"{L1B} --batch 4 --strategy tp --compile both --floor --warmup 3 "
                                                 "--steps 8", cap=480)],
        # What a tp rank computes with no communication, against one GPU (the bound a perfect overlap reaches).
        "tpfloor": [("tp_rank_floor", 300, f"CUDA_VISIBLE_DEVICES=0 python3 benchmarks/tp_rank_floor.py {L1B} --batch 4 "
                                           f"--tp {max(n, 2)} --modes eager,compiled,graphed"),
                    ("tp_rank_floor_sp", 300, f"CUDA_VISIBLE_DEVICES=0 python3 benchmarks/tp_rank_floor.py {L1B} "
                                              f"--batch 4 --tp {max(n, 2)} --modes eager,compiled,graphed "
                                              "--sequence-parallel"),
                    ("tp_rank_floor_sp_batch", 300, f"CUDA_VISIBLE_DEVICES=0 python3 benchmarks/tp_rank_floor.py {L1B} "
                                                    f"--batch 4 --tp {max(n, 2)} --modes eager,compiled,graphed "
                                                    "--sequence-parallel --sequence-dim 0")],
        # Where TP's step goes against one GPU's: GPU time by kernel category (--profile), eager and compiled.
        "tpprofile": [_train(n, "llama1b_tpprofile", f"{L1B} --batch 4 --strategy tp --impl pynccl --compile both "
                                                     "--floor --profile --warmup 3 --steps 6", cap=300)],
        # Issue 27's TP levers in one call: the overlap's GPU tests on NCCL, then tp and tp-sp against the
        # one-GPU step, eager and compiled per block, with the default (PYNCCL_TP_ASYNC auto) and without.
        "tpasync": [("tp_async_tests", 240, f"{TESTS} tests/test_tp_async_allreduce.py tests/test_tp_compile.py "
                                            "tests/test_tp_plan_gpu.py -k 'on_nccl or nccl_tp2'"),
                    _train(n, "llama1b_tpasync", f"{L1B} --batch 4 --strategy tp,tp-sp --compile both --floor "
                                                 "--warmup 3 --steps 8", cap=300),
                    _train(n, "llama1b_tpasync_off", f"{L1B} --batch 4 --strategy tp --compile both --floor "
                                                     "--warmup 3 --steps 8", cap=300, env="PYNCCL_TP_ASYNC=0 ")],
        # Sequence parallelism split along the batch (--sp-dim 0: contiguous slabs, no relayout copy around
        # its collectives) beside tp in the same run, eager and compiled, then with the decomposed
        # sequence-parallel ops (PYNCCL_TP_ASYNC=1) compiled; the one-GPU floor in each.
        "tpspbatch": [("tpspbatch_tests", 120, f"{TESTS} tests/test_tp_plan_gpu.py"),
                      _train(n, "llama1b_tp_sp_batch", f"{L1B} --batch {max(4, n)} --strategy tp,tp-sp "
                                                       "--impl pynccl --compile both --floor --sp-dim 0 "
                                                       "--warmup 3 --steps 8", cap=300),
                      _train(n, "llama1b_tp_sp_batch_async", f"{L1B} --batch {max(4, n)} --strategy tp-sp "
                                                             "--impl pynccl --compile on --floor --sp-dim 0 "
                                                             "--warmup 3 --steps 8", cap=180, env="PYNCCL_TP_ASYNC=1 ")],
        # Sequence parallelism's chunks on the copy engines (PYNCCL_TP_ASYNC=1, the batch split) with each
        # compiled block replayed as a CUDA graph, beside TP with its row-parallel sums in 4 slices, the
        # one-GPU floor in the same run; then the ops' GPU tests (the window and NCCL's kernels).
        "tpspgraph": [_train(n, "llama1b_tp_sp_graphed", f"{L1B} --batch {max(4, n)} --strategy tp-sp,tp "
                                                         "--impl pynccl --compile on --compile-mode reduce-overhead "
                                                         "--floor --sp-dim 0 --warmup 3 --steps 10", cap=240,
                             env="PYNCCL_TP_ASYNC=1 PYNCCL_TP_ASYNC_CHUNKS=4 "),
                      ("tpspgraph_tests", 180, f"{TESTS} tests/test_tp_async.py -k nccl")],
        "zero3floor": [_train(n, "llama1b_zero3floor", f"{L1B} --batch 4 --strategy zero3 --compile both --floor "
                                                       "--warmup 3 --steps 8", cap=540)],
        "nanogpt": [("nanogpt", 300, f"python3 benchmarks/nanogpt_swap.py --nproc {n} --json {{out}}/nanogpt.json "
                                     "--variants torch-ddp,pynccl-ddp,zero3,zero1,zero2 --timeout 150 "
                                     "--run-dir {out}/nanogpt_runs")],
        "graph_breaks": [("graph_breaks", 90, _torchrun(n, "benchmarks/graph_breaks.py", "--device cuda --models hf-llama "
                                                        "--wrappers none,ddp,zero3,tp,torch-ddp,fsdp2 --modes whole,blocks "
                                                        "--json {out}/graph_breaks.json"))],
        # Issue 28 on one host: 2 torchrun agents x 1 GPU, NCCL on its socket transport.
        "multinode": [("multinode_tests", 300, f"{TESTS} -m multigpu tests/test_multinode_gpu.py"),
                      ("socket_bench", 150, "python3 -m pynccl.bench all_reduce,all_gather,reduce_scatter --nnodes 2 "
                                            "--backend nccl -b 8 -e 128M -f 4 -n 20 -w 5 --impl both"),
                      ("scaling_check", 90, "python3 benchmarks/scaling_check.py --backend nccl --nnodes 2 "
                                            "--nproc-per-node 1")],
        # This session's new GPU tests: symmetric memory, torch's ops, the optimizer overlap, DCP with
        # FSDP2, torch code after pynccl's init, and the rewritten DDP/ZeRO/PP/TP/fault tests.
        "newtests": [("newtests", 420, f"{tests} tests/test_symmetric.py tests/test_reduce_op.py "
                                       "tests/test_optimizer_overlap.py tests/test_dcp_gpu.py tests/test_interop.py "
                                       "tests/test_ddp_gpu.py tests/test_zero_gpu.py")],
        # The examples on NCCL: a stock DDP script, the 3-D GPT (tp 2 x pp N/2, ZeRO-3, SP).
        "examples": [("train_ddp", 120, _torchrun(n, "examples/train_ddp.py", "--epochs 2")),
                     ("train_gpt", 120, _torchrun(n, "examples/train_gpt.py", "--steps 200 --no-progress --log-every 50")),
                     ("train_gpt_3d", 180, _torchrun(n, "examples/train_gpt.py", f"--tp {tp} --pp {pp} --zero 3 "
                                                     "--sequence-parallel --layers 8 --hidden 512 --heads 8 --seq-len 256 "
                                                     "--batch-size 32 --steps 100 --no-progress --log-every 50"))],
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("groups", nargs="*", help="groups to run, in order (or an alias: " + ", ".join(ALIASES) + ")")
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--budget", type=float, default=540, help="seconds for everything")
    p.add_argument("--out", default="benchmarks/results/gpu_suite", help="logs and JSON go here")
    p.add_argument("--list", action="store_true")
    args = p.parse_args()
    table = groups(args.gpus)
    if args.list or not args.groups:
        for name, steps in table.items():
            print(f"{name}: " + "; ".join(f"{s} ({cap} s)" for s, cap, _ in steps))
        for name, members in ALIASES.items():
            print(f"{name} = " + " ".join(members))
        return
    names = [m for g in args.groups for m in ALIASES.get(g, [g])]
    unknown = [g for g in names if g not in table]
    if unknown:
        sys.exit(f"gpu_suite: unknown group(s) {unknown}; --list shows them")
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
               PYTHONUNBUFFERED="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0, port, failed = time.monotonic(), 29600, []
    for g in names:
        for name, cap, cmd in table[g]:
            left = args.budget - (time.monotonic() - t0)
            if left < 30:
                print(f"=== {name}: skipped (budget spent)", flush=True)
                continue
            port += 1
            cmd = cmd.format(port=port, out=shlex.quote(args.out))
            log = os.path.join(args.out, f"{name}.log")
            start = time.monotonic()
            with open(log, "w") as f:
                proc = subprocess.Popen(["bash", "-c", cmd], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                        start_new_session=True)
                try:
                    rc = proc.wait(timeout=min(cap, left))
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)     # torchrun and every rank it started
                    proc.wait()
                    rc = "timeout"
            if rc != 0:
                failed.append(name)
            print(f"=== {name} rc={rc} {time.monotonic() - start:.0f} s (cap {min(cap, left):.0f}): {cmd}", flush=True)
            with open(log) as f:
                lines = [ln.rstrip() for ln in f if SUMMARY.search(ln) and not ln.startswith("# [")]
            print("\n".join(lines[-60:]), flush=True)
    print(f"=== total {time.monotonic() - t0:.0f} s; failed or timed out: {' '.join(failed) or 'none'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
