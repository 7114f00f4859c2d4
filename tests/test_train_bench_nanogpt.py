"""benchmarks/nanogpt_swap.py: nanoGPT's own train.py with the wrapper swapped. The swap itself
on train.py's lines; the vendored files (benchmarks/nanogpt/) still upstream's, byte for byte; and
the real script on 2 gloo ranks with a 2-layer model: torch DDP, pynccl DDP and ZeRO-1/2/3 give the
same loss at every iteration (fp32: the same math; printed to 4 decimals) and the loss falls.
Clipping acts there (grad_clip 0.1): ZeRO with torch's clip_grad_norm_ left in place (each rank's
shards clipped by their own norm) ends 1e-3 off."""
import hashlib
import json
import os
import pickle
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import nanogpt_swap  # noqa: E402

NANOGPT = nanogpt_swap.VENDORED
# git's blob ids of karpathy/nanoGPT's files at 3adf61e154c3fe3fca428ad6bc3818b27a3b8291.
UPSTREAM_BLOBS = {"train.py": "de5785051050d64bbda37a4964c2c079f0739b2b",
                  "model.py": "c698f8b60129d793494de058b0dd4e318c0dcb5e",
                  "configurator.py": "a8bba9599537cbb34b378399a077b525a87d497f",
                  "LICENSE": "329db5e33310fd5d98343e2bca690bfb07317526"}
# The lines of nanoGPT's train.py (3adf61e) that the swap edits, in their context.
TRAIN_PY = ("import torch\n" + nanogpt_swap.IMPORT + "if ddp:\n" + nanogpt_swap.CPU_PATCHES[0][0]
            + "    master_process = ddp_rank == 0\n" + "if ddp:\n" + nanogpt_swap.CPU_PATCHES[1][0]
            + "    if grad_clip != 0.0:\n        scaler.unscale_(optimizer)\n" + nanogpt_swap.CLIP)


def test_swaps_edit_exactly_the_lines():
    assert nanogpt_swap.patched_train_py(TRAIN_PY, "torch-ddp", "cuda") == TRAIN_PY
    ddp = nanogpt_swap.patched_train_py(TRAIN_PY, "pynccl-ddp", "cuda")
    assert ddp == TRAIN_PY.replace(nanogpt_swap.IMPORT, "from pynccl import DistributedDataParallel as DDP\n")
    tied = nanogpt_swap.patched_train_py(TRAIN_PY, "pynccl-ddp-tied-rows", "cuda")
    assert tied == TRAIN_PY.replace(nanogpt_swap.IMPORT, "from nanogpt_swap import tied_rows_ddp as DDP\n")
    zero = nanogpt_swap.patched_train_py(TRAIN_PY, "zero2", "cpu")
    assert "DDP = zero_wrapper(2)\n" in zero and nanogpt_swap.IMPORT not in zero
    assert "__import__('pynccl').clip_grad_norm_(model.parameters(), grad_clip)" in zero
    assert "torch.nn.utils.clip_grad_norm_" not in zero
    assert "device_ids=[ddp_local_rank] if device_type == 'cuda' else None" in zero
    assert "    if device.startswith('cuda'):\n        device = f'cuda:{ddp_local_rank}'" in zero
    compile(zero, "train.py", "exec")                      # still Python
    with pytest.raises(ValueError, match="expected one 'from torch.nn.parallel import"):
        nanogpt_swap.patched_train_py(TRAIN_PY.replace(nanogpt_swap.IMPORT, ""), "zero3", "cuda")
    with pytest.raises(ValueError, match="unknown variant"):
        nanogpt_swap.patched_train_py(TRAIN_PY, "zero4", "cuda")


def test_synthetic_data_follows_its_rule(tmp_path):
    nanogpt_swap.write_data(str(tmp_path), 20_000, 64)
    x = np.fromfile(tmp_path / "train.bin", dtype=np.uint16).astype(np.int64)
    assert len(x) == 20_000 and x.max() < 64
    follows = np.mean(x[1:] == (5 * x[:-1] + 3) % 64)
    assert 0.9 < follows < 0.97                              # 1/16 random restarts
    with open(tmp_path / "meta.pkl", "rb") as f:
        assert pickle.load(f) == {"vocab_size": 64}


def git_blob_id(path: str) -> str:
    with open(path, "rb") as f:
        data = f.read()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def test_vendored_nanogpt_is_upstreams():
    """The client under test is nanoGPT's own code: every vendored file hashes to upstream's blob."""
    assert {f: git_blob_id(os.path.join(NANOGPT, f)) for f in UPSTREAM_BLOBS} == UPSTREAM_BLOBS
    assert set(nanogpt_swap.FILES) <= set(UPSTREAM_BLOBS)


def test_real_train_py_every_wrapper_trains_alike(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "rows.json"
    rc = nanogpt_swap.main(["--device", "cpu", "--nproc", "2", "--tiny", "--run-dir", str(tmp_path / "runs"),
                            "--json", str(out), "--loss-rtol", "1e-4", "--skip", "2"])
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == nanogpt_swap.VARIANTS and not any(r.get("error") for r in rows.values()), rows
    # NOTE: a variant may abort at interpreter exit after its last iteration (nanogpt_swap.TEARDOWN_ABORT):
    # reported by the script, tolerated here, where the training is under test; any other failure is not.
    # torch DDP's own run does too, where pynccl is not imported (session 31: 1 run in 4 on one CPU VM).
    assert rc == 0 or all(r.get("exit_error") for r in rows.values() if r["rc"] != 0), rows
    assert rows["torch-ddp"]["rc"] == 0 or rows["torch-ddp"].get("exit_error"), rows["torch-ddp"]
    ref = rows["torch-ddp"]["losses"]
    assert len(ref) == 13 and ref[-1] < ref[0] - 1.0, ref
    for variant, r in rows.items():
        if variant == "floor":       # one process, one rank's batches: its own losses, no communication
            assert len(r["losses"]) == 13 and r["rc"] == 0 and "over_floor_ms" not in r
            continue
        assert r["losses"] == pytest.approx(ref, rel=1e-4, abs=1e-4), variant
        assert r["over_floor_ms"] == pytest.approx(r["median_ms"] - rows["floor"]["median_ms"])
        assert r["median_ms"] > 0 and r["tokens_per_s_gpu"] > 0 and r["mfu"] is None
