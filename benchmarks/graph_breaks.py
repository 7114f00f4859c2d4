"""Graph breaks of pynccl's wrappers under torch.compile, counted by dynamo's own counters
(torch._dynamo.utils.counters, what torch._dynamo.explain reads), for the ways users compile:

  whole    torch.compile(wrapper(model))
  inner    wrapper(torch.compile(model))      nanoGPT's train.py order (TP: n/a, its plan names
                                              the model's own modules)
  blocks   each transformer block's module.compile(), then the wrapper (TP: the wrapper first),
           torchtitan's recipe

on a tiny HF Llama, a tiny HF GPT-2 and nanoGPT's GPT (its model.py, vendored in benchmarks/nanogpt/),
under pynccl DDP, ZeRO-1/2/3 and TP (plans.llama / plans.gpt2; nanoGPT's attention derives its head
size from its input width, which TP splits, so it has no plan), next to the unwrapped model ("none") and
torch's counterparts (torch-ddp; fsdp2, wrapped as torchtitan wraps it) compiled the same way.
Each case starts from a reset dynamo and trains 3 steps (AdamW). A row:

  breaks     graph breaks (each splits the captured code: a resume function, guards, and no
             fusion across it)
  graphs     graphs dynamo captured (the compiled pieces; DDPOptimizer's bucket splits of one
             graph are not counted)
  recompiled graphs captured after the first step: 0 in a steady state; more means guards fail
             every step (each new graph costs a compile, and past the recompile limit dynamo
             runs the frame eagerly)
  ops        graph operations run in the last step (forward graphs, as dynamo captured them), over
             the unwrapped model's in the same mode: below 1.00 means part of the model ran
             eagerly; a wrapper's code traced into the graphs adds some
  eager      "yes" where dynamo hit its recompile limit and fell back to eager for a frame
and the break reasons below the table.

    python benchmarks/graph_breaks.py                                  # CPU, 2 gloo ranks
    torchrun --nproc_per_node 2 benchmarks/graph_breaks.py --device cuda --backend inductor
"""
from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch._dynamo  # noqa: E402,F401  (imported before ranks fork, once)

import pynccl  # noqa: E402

MODELS = ["hf-llama", "hf-gpt2", "nanogpt"]
WRAPPERS = ["none", "ddp", "zero1", "zero2", "zero3", "tp", "torch-ddp", "fsdp2"]
MODES = ["whole", "inner", "blocks"]
VOCAB, SEQ, BATCH, STEPS = 128, 32, 4, 3


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--wrappers", default=",".join(WRAPPERS))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--backend", default="aot_eager", help="torch.compile backend (aot_eager: dynamo + AOT autograd, "
                   "no code generation; inductor on GPU)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--nproc", type=int, default=2, help="processes to spawn when not under torchrun")
    p.add_argument("--json", help="write the rows here (rank 0)")
    args = p.parse_args(argv)
    for name, allowed in (("models", MODELS), ("wrappers", WRAPPERS), ("modes", MODES)):
        chosen = [x.strip() for x in getattr(args, name).split(",") if x.strip()]
        bad = [x for x in chosen if x not in allowed]
        if bad or not chosen:
            p.error(f"--{name}: unknown {bad or chosen}; expected a comma list of {', '.join(allowed)}")
        setattr(args, name, chosen)
    return args


# ---------------------------------------------------------------------------------------- models
def build_model(name: str, layers: int, device):
    """Random init from one seed, fp32, dropout off, KV cache off (training)."""
    import transformers
    torch.manual_seed(0)
    with torch.device(device):
        if name == "hf-llama":
            cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                           num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                           max_position_embeddings=SEQ, tie_word_embeddings=False, use_cache=False,
                                           attn_implementation="sdpa", pad_token_id=None, bos_token_id=None,
                                           eos_token_id=None)
            return transformers.LlamaForCausalLM(cfg).train()
        if name == "hf-gpt2":
            cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=layers, n_head=4,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                          attn_implementation="sdpa", bos_token_id=0, eos_token_id=0)
            return transformers.GPT2LMHeadModel(cfg).train()
        from nanogpt import model as nanogpt_model
        cfg = nanogpt_model.GPTConfig(block_size=SEQ, vocab_size=VOCAB, n_layer=layers, n_head=4, n_embd=64,
                                      dropout=0.0, bias=True)
        return nanogpt_model.GPT(cfg).train()


def blocks_of(model):
    inner = getattr(model, "model", None)
    return inner.layers if inner is not None else model.transformer.h


def loss_of(name: str, model, x):
    if name == "nanogpt":
        return model(x, x)[1]
    return model(input_ids=x, labels=x).loss


# ---------------------------------------------------------------------------------------- cases
def not_applicable(model: str, wrapper: str, mode: str):
    if wrapper == "tp" and model == "nanogpt":
        return "no TP plan: nanoGPT's attention takes its head size from its input width, which TP splits"
    if wrapper == "tp" and mode == "inner":
        return "TP's plan names the model's own modules, not an OptimizedModule's"
    if wrapper == "none" and mode == "inner":
        return "the same as whole"
    return None


def wrap(wrapper: str, model_name: str, model):
    if wrapper == "none":
        return model
    if wrapper == "ddp":
        return pynccl.DistributedDataParallel(model)
    if wrapper == "torch-ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    if wrapper == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from train_bench_lib.torch_fsdp import titan_fully_shard
        mesh = init_device_mesh(next(model.parameters()).device.type, (pynccl.get_world_size(),))
        return titan_fully_shard(model, mesh, None)
    if wrapper.startswith("zero"):
        return pynccl.FullyShardedDataParallel(model, stage=int(wrapper[-1]))
    from pynccl.tensor_parallel import parallelize_module, plans
    plan = plans.llama() if model_name == "hf-llama" else plans.gpt2()
    return parallelize_module(model, pynccl.get_default_group(), plan)


class _LimitHits(logging.Handler):
    """Counts dynamo's warnings that a frame hit the recompile limit (it then runs eagerly)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.hits = 0

    def emit(self, record):
        msg = record.getMessage()
        if "recompile_limit" in msg or "cache_size_limit" in msg:
            self.hits += 1


def _counting_backend(backend: str, tally: collections.Counter):
    """The backend, and a tally of the graphs it compiled and of the graph operations run (each
    call of a compiled graph adds its operation count)."""
    inner = torch._dynamo.lookup_backend(backend)

    def count(gm, example_inputs, **kwargs):
        tally["compiled"] += 1
        n = sum(1 for node in gm.graph.nodes if node.op in ("call_function", "call_method", "call_module"))
        compiled = inner(gm, example_inputs, **kwargs)

        def run(*args):
            tally["ops_run"] += n
            return compiled(*args)
        return run
    return count


def run_case(model_name: str, wrapper: str, mode: str, args, device, rank: int, world: int) -> dict:
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    tally = collections.Counter()
    backend = _counting_backend(args.backend, tally)
    model = build_model(model_name, args.layers, device)
    if mode == "inner":
        model = wrap(wrapper, model_name, torch.compile(model, backend=backend))
    elif mode == "blocks":
        if wrapper == "tp":
            model = wrap(wrapper, model_name, model)
            blocks = blocks_of(model)
        else:
            blocks = blocks_of(model)
            model = wrap(wrapper, model_name, model)
        for block in blocks:
            block.compile(backend=backend)
    else:
        model = torch.compile(wrap(wrapper, model_name, model), backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    g = torch.Generator().manual_seed(rank if wrapper != "tp" else 0)
    limit = _LimitHits()
    logging.getLogger("torch._dynamo").addHandler(limit)
    try:
        first = ops_before_last = 0
        for step in range(STEPS):
            if step == STEPS - 1:
                ops_before_last = tally["ops_run"]
            x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(device)
            loss_of(model_name, model, x).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step == 0:
                first = counters["stats"]["unique_graphs"]
    finally:
        logging.getLogger("torch._dynamo").removeHandler(limit)
    reasons = collections.Counter()
    for reason, n in counters["graph_break"].items():
        reasons[_short(reason)] += n
    graphs = int(counters["stats"]["unique_graphs"])
    return dict(model=model_name, wrapper=wrapper, mode=mode, breaks=int(sum(counters["graph_break"].values())),
                graphs=graphs, recompiled=graphs - first,
                ops=tally["ops_run"] - ops_before_last, compiled=tally["compiled"], limit_hits=limit.hits,
                reasons=[[n, r] for r, n in reasons.most_common()])


def _short(reason: str) -> str:
    """The first line of a break reason, with the explanation's start (which names the function)."""
    lines = [ln.strip() for ln in reason.splitlines() if ln.strip()]
    head = lines[0] if lines else reason
    expl = next((ln[len("Explanation:"):].strip() for ln in lines if ln.startswith("Explanation:")), "")
    return f"{head}: {expl[:150]}" if expl else head[:200]


# ---------------------------------------------------------------------------------------- report
def add_op_ratios(rows) -> None:
    """ops of each row over the unwrapped model's in the same mode (inner: whole's)."""
    ref = {(r["model"], r["mode"]): r["ops"] for r in rows if r["wrapper"] == "none" and "ops" in r}
    for r in rows:
        base = ref.get((r["model"], "whole" if r["mode"] == "inner" else r["mode"]))
        if "ops" in r and base:
            r["ops_vs_plain"] = r["ops"] / base


def format_table(rows) -> str:
    out = [f"{'model':<10}{'wrapper':<11}{'mode':<8}{'breaks':>7}{'graphs':>8}{'recompiled':>12}{'ops':>7}"
           f"{'eager':>7}  note"]
    for r in rows:
        head = f"{r['model']:<10}{r['wrapper']:<11}{r['mode']:<8}"
        if "breaks" not in r:
            out.append(head + f"{'-':>7}{'-':>8}{'-':>12}{'-':>7}{'-':>7}  {r.get('na') or 'FAILED: ' + r['error']}")
            continue
        ratio = f"{r['ops_vs_plain']:.2f}" if "ops_vs_plain" in r else "-"
        out.append(head + f"{r['breaks']:>7}{r['graphs']:>8}{r['recompiled']:>12}{ratio:>7}"
                   f"{'yes' if r['limit_hits'] else 'no':>7}")
    out.append("")
    for r in rows:
        if r.get("reasons"):
            out.append(f"{r['model']} {r['wrapper']} {r['mode']}:")
            out.extend(f"  {n:>3} x {reason}" for n, reason in r["reasons"])
    return "\n".join(out)


def worker(rank, world, args):
    if args.device == "cuda":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if args.device == "cuda":
        import torch.distributed as tdist
        # torch's side (torch-ddp, fsdp2) needs NCCL for CUDA tensors; pynccl reuses the store.
        tdist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
        pynccl.init_process_group("nccl", device_id=device.index)
    else:
        pynccl.init_process_group("gloo")
    rows = []
    for model_name in args.models:
        for wrapper in args.wrappers:
            for mode in args.modes:
                na = not_applicable(model_name, wrapper, mode)
                if na:
                    rows.append(dict(model=model_name, wrapper=wrapper, mode=mode, na=na))
                    continue
                try:
                    rows.append(run_case(model_name, wrapper, mode, args, device, rank, world))
                except Exception as e:  # noqa: BLE001 - one failing case must not hide the others
                    if rank == 0:
                        traceback.print_exc()
                    rows.append(dict(model=model_name, wrapper=wrapper, mode=mode,
                                     error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]))
    add_op_ratios(rows)
    if rank == 0:
        print(f"# graph breaks, torch {torch.__version__}, backend {args.backend}, {world} ranks on {args.device}, "
              f"{args.layers} layers")
        print(format_table(rows), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(torch=torch.__version__, backend=args.backend, world_size=world, rows=rows), f, indent=1)
    pynccl.barrier()
    pynccl.destroy_process_group()
    import torch.distributed as tdist
    if tdist.is_initialized():
        tdist.destroy_process_group()
    return rows


def main(argv=None):
    args = parse_args(argv)
    import transformers  # noqa: F401  (loaded once, before the ranks fork)
    if "RANK" in os.environ:
        return worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
    from pynccl.testing import run_multiprocess
    return run_multiprocess(worker, args.nproc, backend=None, timeout=1800, args=(args,), cuda=args.device == "cuda")[0]


if __name__ == "__main__":
    main()
