"""examples/train_gpt.py under every layout that fits 4 CPU processes: the first 20 losses (and
global gradient norms, clipping active every step) equal the single-process run's within the fp32
rounding of the model's reductions (tests/numerics.py); a checkpoint saved at tp2-pp2 resumes at
dp4, at dp2-tp2 with ZeRO-2 and on one process like the uninterrupted run, and is the same file a
single process writes (parameters and AdamW moments within numerics' bounds); the single-process
model itself equals Hugging Face's GPT-2 with the same weights; invalid layouts fail naming every
value; torchrun runs the script end to end.

Three multi-process runs (4, 1 and 2 ranks) each train many layouts in the same processes,
because starting processes costs more than the tiny model's 20 steps.
"""
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pynccl.testing import find_free_port, run_multiprocess
from numerics import adam_moments_atol, adam_state_atol, assert_within, transformer_rtol

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
train_gpt = importlib.import_module("train_gpt")

STEPS, SAVE_AT, CLIP = 20, 10, 0.5
# Losses and gradient norms, relative: TINY's reduction chain (4 layers, hidden 32, ffn 128,
# head_dim 8, seq 16, the vocabulary padded to 64, 8 × 16 tokens). The norm's own sum of squares
# over ~55k elements is in fp64 (train_gpt's clip_grad_norm_): negligible.
REL = transformer_rtol(4, 32, 128, 8, 16, 64, 8 * 16)
TINY = ["--layers", "4", "--hidden", "32", "--heads", "4", "--seq-len", "16", "--batch-size", "8",
        "--micro-batches", "2", "--steps", str(STEPS), "--clip", str(CLIP), "--lr", "3e-3", "--no-progress",
        "--log-every", "0"]

FOUR_RANK_LAYOUTS = {
    "dp4": "--dp 4",
    "dp2-tp2": "--dp 2 --tp 2",
    "dp2-pp2": "--dp 2 --pp 2",
    "tp2-pp2 (saves)": "--tp 2 --pp 2 --save {tmp}/tp2pp2 --save-every 10",
    "tp4": "--tp 4",
    "pp4": "--pp 4 --micro-batches 4",
    "tp2-pp2 SP": "--tp 2 --pp 2 --sequence-parallel",
    "dp2-tp2 ZeRO-1": "--dp 2 --tp 2 --zero 1",
    "dp2-tp2 ZeRO-3 SP checkpointing (saves)": ("--dp 2 --tp 2 --zero 3 --sequence-parallel --activation-checkpointing "
                                                "--save {tmp}/zero3 --save-every 10"),
    "dp2-pp2 ZeRO-3": "--dp 2 --pp 2 --zero 3",
}
TWO_RANK_LAYOUTS = {
    "dp2 ZeRO-1": "--dp 2 --zero 1",
    "dp2 ZeRO-2": "--dp 2 --zero 2",
    "dp2 ZeRO-3": "--dp 2 --zero 3",
    "tp2 SP": "--tp 2 --sequence-parallel",
    "dp2 checkpointing": "--dp 2 --activation-checkpointing",
}
# Dropout draws layout-dependent masks, so these two are compared with each other: recomputation
# must redraw exactly the forward's masks (default generator and the TP tracker's sharded state).
DROPOUT_TWO = {"tp2 SP dropout": "--tp 2 --sequence-parallel --dropout 0.1",
               "tp2 SP dropout checkpointing": "--tp 2 --sequence-parallel --dropout 0.1 --activation-checkpointing"}
RESUME_FOUR = {"dp4 from tp2-pp2": "--dp 4", "dp2-tp2 ZeRO-2 from tp2-pp2": "--dp 2 --tp 2 --zero 2"}


def run_layouts(layouts: dict, tmp: str, resume_from: str = None) -> dict:
    out = {}
    for name, extra in layouts.items():
        argv = TINY + extra.format(tmp=tmp).split()
        if resume_from is not None:
            argv += ["--resume", resume_from]
        result = train_gpt.train(train_gpt.parse_args(argv))
        out[name] = (result["losses"], result["grad_norms"], result["start"])
    return out


def expect_error(argv, *fragments):
    with pytest.raises(ValueError) as e:
        train_gpt.train(train_gpt.parse_args(TINY + argv))
    for fragment in fragments:
        assert fragment in str(e.value), (fragment, str(e.value))


def four_rank_case(rank, world_size, tmp):
    expect_error(["--dp", "3", "--tp", "2"], "dp(3) × tp(2) × pp(1) = 6, but the world size is 4")
    expect_error(["--tp", "3"], "world size 4 is not divisible by tp(3) × pp(1) = 3")
    expect_error(["--tp", "2", "--pp", "2", "--heads", "3", "--hidden", "48", "--layers", "3"],
                 "num_heads=3 is not divisible by tp=2", "num_layers=3 is not divisible by pp=2", "(dp=1, tp=2, pp=2)")
    expect_error(["--tp", "4", "--heads", "2"], "num_heads=2 is not divisible by tp=4", "(dp=1, tp=4, pp=1)")
    expect_error(["--dp", "4", "--batch-size", "4"], "batch_size=4 is not divisible by dp(4) × micro_batches(2) = 8")
    expect_error(["--dp", "2", "--pp", "2", "--zero", "2"], "--zero 2 with --pp 2 is not supported")
    results = run_layouts(FOUR_RANK_LAYOUTS, tmp)
    results.update(run_layouts(RESUME_FOUR, tmp, resume_from=f"{tmp}/tp2pp2/step_{SAVE_AT:06d}.pt"))
    return results


def clip_matches_torch() -> None:
    """The mesh-wide clipping at world size 1 is torch.nn.utils.clip_grad_norm_."""
    from gpt.model import GPTConfig, GPTStage, lm_loss, tp_shard_spec
    from gpt.parallel import clip_grad_norm_
    from pynccl.mesh import ParallelMesh
    mesh = ParallelMesh()
    config = GPTConfig(vocab_size=40, seq_len=16, num_layers=2, hidden_size=32, num_heads=4)
    stage = GPTStage(config, mesh)
    x = torch.randint(0, 40, (3, 16))
    lm_loss(stage(x), x, mesh.tp_group, config.vocab_size).backward()
    reference = [torch.nn.Parameter(p.detach().clone()) for p in stage.parameters()]
    for r, p in zip(reference, stage.parameters()):
        r.grad = p.grad.clone()
    expected = torch.nn.utils.clip_grad_norm_(reference, 0.1)
    total = clip_grad_norm_(stage, mesh, tp_shard_spec(stage), 0.1)
    assert abs(total - expected.item()) <= 1e-5 * expected.item(), (total, expected.item())
    for p, r in zip(stage.parameters(), reference):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-7)


def one_rank_case(rank, world_size, tmp):
    clip_matches_torch()
    results = run_layouts({"single": f"--save {tmp}/single --save-every 10"}, tmp)
    results.update(run_layouts({"single from tp2-pp2": ""}, tmp, resume_from=f"{tmp}/tp2pp2/step_{SAVE_AT:06d}.pt"))
    return results


def two_rank_case(rank, world_size, tmp):
    return {**run_layouts(TWO_RANK_LAYOUTS, tmp), **run_layouts(DROPOUT_TWO, tmp)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("gpt3d"))
    four = run_multiprocess(four_rank_case, 4, args=(tmp,), timeout=400)[0]
    one = run_multiprocess(one_rank_case, 1, args=(tmp,), timeout=200)[0]
    two = run_multiprocess(two_rank_case, 2, args=(tmp,), timeout=200)[0]
    return {**four, **one, **two, "tmp": tmp}


def assert_close_rel(got, expected, what):
    assert len(got) == len(expected), (what, len(got), len(expected))
    for i, (g, e) in enumerate(zip(got, expected)):
        assert abs(g - e) <= REL * abs(e), f"{what}: step {i}: {g!r} vs single process {e!r} (bound {REL:.1e} relative)"


@pytest.mark.numerics
@pytest.mark.parametrize("layout", list(FOUR_RANK_LAYOUTS) + list(TWO_RANK_LAYOUTS))
def test_layout_matches_single_process(runs, layout):
    ref_losses, ref_norms, _ = runs["single"]
    assert len(ref_losses) == STEPS and ref_losses[-1] < ref_losses[0] - 0.5      # it learns
    assert min(ref_norms) > CLIP                                               # clipping acts every step
    losses, norms, start = runs[layout]
    assert start == 0
    assert_close_rel(losses, ref_losses, f"{layout} loss")
    assert_close_rel(norms, ref_norms, f"{layout} grad norm")


def test_activation_checkpointing_redraws_the_same_dropout_masks(runs):
    (plain, plain_norms, _), (recomputed, recomputed_norms, _) = (runs[name] for name in DROPOUT_TWO)
    assert_close_rel(recomputed, plain, "loss with checkpointing")
    assert_close_rel(recomputed_norms, plain_norms, "grad norm with checkpointing")
    assert abs(plain[0] - runs["single"][0][0]) > 1e-3                      # dropout is really on


@pytest.mark.parametrize("layout", list(RESUME_FOUR) + ["single from tp2-pp2"])
def test_checkpoint_from_tp2_pp2_resumes_in_another_layout(runs, layout):
    ref_losses, ref_norms, _ = runs["single"]
    losses, norms, start = runs[layout]
    assert start == SAVE_AT
    assert_close_rel(losses, ref_losses[SAVE_AT:], f"{layout} loss")
    assert_close_rel(norms, ref_norms[SAVE_AT:], f"{layout} grad norm")


@pytest.mark.parametrize("writer", ["tp2pp2", "zero3"])
def test_checkpoint_is_the_single_process_state(runs, writer):
    """Same names, shapes and (within rounding) values as the file one process writes at that step:
    parameters within numerics.adam_state_atol of the single file's AdamW state, element-wise (the
    key third of a fused qkv bias, whose gradient is zero in exact arithmetic, gets Adam's own
    bound: its updates amplify rounding noise without changing any output), moments within
    numerics.adam_moments_atol."""
    from pynccl.checkpoint_io import load
    tmp = Path(runs["tmp"])
    single = load(tmp / "single" / f"step_{SAVE_AT:06d}.pt")
    other = load(tmp / writer / f"step_{SAVE_AT:06d}.pt")
    assert other["step"] == single["step"] == SAVE_AT and other["config"] == single["config"]
    assert (tmp / writer / "latest").read_text() == f"step_{STEPS:06d}.pt"
    assert sorted(other["model"]) == sorted(single["model"])
    group = single["optimizer"]["param_groups"][0]
    for name, t in single["model"].items():
        state = single["optimizer"]["state"][name]
        assert_within(other["model"][name], t, adam_state_atol(state, group, t, REL), f"{writer} {name}")
        if name.endswith("attn.qkv.bias"):              # the key bias's gradient really is ~0
            assert state["exp_avg_sq"].chunk(3)[1].max() < 1e-15
    assert sorted(other["optimizer"]["state"]) == sorted(single["optimizer"]["state"]) == sorted(single["model"])
    for name, state in single["optimizer"]["state"].items():
        assert sorted(other["optimizer"]["state"][name]) == sorted(state)
        bounds = adam_moments_atol(state, group, REL)
        for key, v in state.items():
            assert_within(torch.as_tensor(other["optimizer"]["state"][name][key]), torch.as_tensor(v), bounds[key],
                          f"{writer} {name}.{key}")
    assert other["optimizer"]["param_groups"] == single["optimizer"]["param_groups"]


def test_torchrun_two_processes_prints_final_line(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(find_free_port()),
           str(ROOT / "examples" / "train_gpt.py"), "--tp", "2", "--steps", "3", "--log-every", "1",
           "--layers", "2", "--hidden", "32", "--seq-len", "32", "--batch-size", "4", "--save", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"^final loss \d+\.\d{4} after 3 steps$", proc.stdout, re.M), proc.stdout + proc.stderr
    assert "step 3 loss" in proc.stderr + proc.stdout                  # tqdm.write on rank 0
    assert (tmp_path / "latest").read_text() == "step_000003.pt"


# ----------------------------------------------------------------------------- independent reference
def _hf_names(name: str):
    """The Hugging Face GPT-2 parameter holding GPTStage's `name`, and whether it is transposed
    (HF's Conv1D keeps (in, out))."""
    table = {"embed.tok.weight": "transformer.wte.weight", "embed.pos.weight": "transformer.wpe.weight",
             "head.ln_f.weight": "transformer.ln_f.weight", "head.ln_f.bias": "transformer.ln_f.bias",
             "head.lm_head.weight": "lm_head.weight"}
    if name in table:
        return table[name], False
    _, i, rest = name.split(".", 2)
    module, leaf = rest.rsplit(".", 1)
    hf_module = {"ln1": "ln_1", "ln2": "ln_2", "attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj",
                 "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}[module]
    return f"transformer.h.{i}.{hf_module}.{leaf}", leaf == "weight" and not module.startswith("ln")


def single_process_model_is_hf_gpt2(rank, world_size):
    """The 3D example's single-process model (GPTStage on a mesh of one; every layout is compared
    with it) against code pynccl did not write: Hugging Face's GPT2LMHeadModel (eager attention,
    untied head) with the same weights: logits over the real vocabulary, the loss, every gradient."""
    import transformers
    import torch.nn.functional as F
    from gpt.model import GPTConfig, GPTStage, lm_loss
    from numerics import assert_within, transformer_rtol
    from pynccl.mesh import ParallelMesh
    mesh = ParallelMesh()
    config = GPTConfig(vocab_size=40, seq_len=16, num_layers=2, hidden_size=32, num_heads=4)
    stage = GPTStage(config, mesh)
    hf_config = transformers.GPT2Config(vocab_size=config.padded_vocab_size, n_embd=32, n_layer=2, n_head=4,
                                        n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    hf_config._attn_implementation = "eager"
    hf = transformers.GPT2LMHeadModel(hf_config)
    hf_params = dict(hf.named_parameters())
    with torch.no_grad():
        for name, p in stage.named_parameters():
            hf_name, transposed = _hf_names(name)
            hf_params[hf_name].copy_(p.t() if transposed else p)
    x = torch.randint(0, config.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, config.vocab_size, (3, 16), generator=torch.Generator().manual_seed(1))
    logits = stage(x)                                                    # (s, b, V_padded)
    loss = lm_loss(logits, y, mesh.tp_group, config.vocab_size)
    loss.backward()
    hf_logits = hf(input_ids=x).logits[..., :config.vocab_size]          # (b, s, V)
    hf_loss = F.cross_entropy(hf_logits.flatten(0, 1), y.flatten())
    hf_loss.backward()
    # Relative to each tensor's largest element: the model's reduction chain (tests/numerics.py).
    rtol = transformer_rtol(2, 32, 128, 8, 16, config.padded_vocab_size, 3 * 16)

    def close(actual, expected, what):
        assert_within(actual, expected, rtol * expected.abs().max().item(), what)
    close(loss, hf_loss, "loss vs HF GPT2LMHeadModel")
    close(logits[..., :config.vocab_size].transpose(0, 1), hf_logits, "logits vs HF GPT2LMHeadModel")
    for name, p in stage.named_parameters():
        hf_name, transposed = _hf_names(name)
        g = hf_params[hf_name].grad
        close(p.grad, g.t() if transposed else g, f"grad of {name} vs HF's {hf_name}")
    return True


@pytest.mark.numerics
def test_single_process_model_is_hugging_face_gpt2():
    pytest.importorskip("transformers")
    assert run_multiprocess(single_process_model_is_hf_gpt2, 1, timeout=120) == [True]


# ----------------------------------------------------------------------------- NCCL on GPUs
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_2_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
GPU_SINGLE = {"single": "", "single ZeRO-3 SP checkpointing": "--zero 3 --sequence-parallel --activation-checkpointing",
              "single ZeRO-1 (saves)": "--zero 1 --save {tmp}/gpu1 --save-every 10"}
GPU_LAYOUTS = {
    2: {**TWO_RANK_LAYOUTS, "tp2": "--tp 2", "pp2 (saves)": "--pp 2 --save {tmp}/gpu --save-every 10"},
    4: {**FOUR_RANK_LAYOUTS, "tp2-pp2 (saves)": "--tp 2 --pp 2 --save {tmp}/gpu --save-every 10"},
    8: {"dp2-tp2-pp2 (saves)": "--dp 2 --tp 2 --pp 2 --save {tmp}/gpu --save-every 10",
        "dp2-tp2-pp2 ZeRO-3 SP": "--dp 2 --tp 2 --pp 2 --zero 3 --sequence-parallel",
        "tp4-pp2 SP checkpointing": "--tp 4 --pp 2 --sequence-parallel --activation-checkpointing",
        "dp4-tp2 ZeRO-2": "--dp 4 --tp 2 --zero 2", "pp4-dp2": "--pp 4 --dp 2 --micro-batches 4", "dp8": "--dp 8 --micro-batches 1"},
}
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0"}


def gpu_case(rank, world_size, layouts, tmp, resume_from=None):
    torch.backends.cuda.matmul.allow_tf32 = False       # fp32 everywhere: comparable within 1e-4
    torch.backends.cudnn.allow_tf32 = False
    return run_layouts(layouts, tmp, resume_from)


@pytest.mark.gpu
@needs_gpu
def test_gpu_one_process_nccl(tmp_path):
    """World size 1 on NCCL: ZeRO-3 with SP and checkpointing, and a resume, match the plain run."""
    tmp = str(tmp_path)
    out = run_multiprocess(gpu_case, 1, backend="nccl", start_method="spawn", timeout=600, env=NCCL_ENV,
                           args=(GPU_SINGLE, tmp))[0]
    out.update(run_multiprocess(gpu_case, 1, backend="nccl", start_method="spawn", timeout=600, env=NCCL_ENV,
                                args=({"resumed": ""}, tmp, f"{tmp}/gpu1/step_{SAVE_AT:06d}.pt"))[0])
    ref_losses, ref_norms, _ = out["single"]
    assert ref_losses[-1] < ref_losses[0] - 0.5
    for name in GPU_SINGLE:
        assert_close_rel(out[name][0], ref_losses, f"{name} loss")
        assert_close_rel(out[name][1], ref_norms, f"{name} grad norm")
    assert_close_rel(out["resumed"][0], ref_losses[SAVE_AT:], "resumed loss")


@pytest.mark.multigpu
@needs_2_gpus
def test_gpu_layouts_match_one_gpu(tmp_path):
    """Every layout on 2, 4 or 8 GPUs (the most this machine has) against one GPU, and a resume
    of the multi-GPU checkpoint on one GPU."""
    n = max(k for k in GPU_LAYOUTS if k <= torch.cuda.device_count())
    tmp = str(tmp_path)
    ref = run_multiprocess(gpu_case, 1, backend="nccl", start_method="spawn", timeout=600, env=NCCL_ENV,
                           args=({"single": ""}, tmp))[0]["single"]
    out = run_multiprocess(gpu_case, n, backend="nccl", start_method="spawn", timeout=600, env=NCCL_ENV,
                           args=(GPU_LAYOUTS[n], tmp))[0]
    out.update(run_multiprocess(gpu_case, 1, backend="nccl", start_method="spawn", timeout=600, env=NCCL_ENV,
                                args=({"one GPU from the multi-GPU checkpoint": ""}, tmp,
                                      f"{tmp}/gpu/step_{SAVE_AT:06d}.pt"))[0])
    for name, (losses, norms, start) in out.items():
        assert_close_rel(losses, ref[0][start:], f"{n} GPUs, {name} loss")
        assert_close_rel(norms, ref[1][start:], f"{n} GPUs, {name} grad norm")


@pytest.mark.parametrize("gpus, local_ranks, built, expected", [(0, 2, True, "gloo"), (1, 2, True, "gloo"),
                                                                (2, 2, True, "nccl"), (2, 2, False, "gloo"),
                                                                (1, 1, True, "nccl")])
def test_examples_take_nccl_only_with_a_gpu_per_local_rank(monkeypatch, gpus, local_ranks, built, expected):
    """The README's first command (`torchrun --nproc_per_node 2 examples/train_gpt.py`) on a machine
    with one GPU: two ranks cannot share it on NCCL, so they run on gloo."""
    import launch
    import pynccl
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(pynccl, "is_nccl_available", lambda: built)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_ranks))
    assert launch.backend() == expected
