"""What one pipeline stage costs per micro-batch on one GPU, eager against CUDA-graphed: how much of a
stage's forward and backward is host work (Python, kernel launches) rather than GPU work.

Builds the train_bench Llama (random init, bf16 autocast over fp32 parameters, as train_bench's
pipelines), cuts it with pynccl.pipeline.hf_stage_modules into --pp stages, and times stage
--stages (default: a middle one and the last, whose loss is included) for --iters micro-batches of
--microbatch × --seq tokens:
  eager   forward, loss, backward as the schedules run them; host ms (until the call returns) and GPU ms
  graphed the same module captured with torch.cuda.make_graphed_callables (forward and backward replays)

    python benchmarks/pp_stage_cost.py [--pp 4] [--stages 1,3] [--iters 20]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--stages", default="1,3")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--microbatch", type=int, default=1)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=32000)
    return p.parse_args()


class WithLoss(torch.nn.Module):
    """The last stage and its loss as one module (what a graph of the last stage must hold)."""

    def __init__(self, stage):
        super().__init__()
        self.stage = stage

    def forward(self, x, labels):
        from pynccl.pipeline import causal_lm_loss
        return causal_lm_loss(self.stage(x), labels)


def timed(fn, iters):
    """[(host ms, gpu ms)] per call of fn (one micro-batch's forward + backward)."""
    out = []
    for _ in range(iters):
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        s.record()
        fn()
        e.record()
        host = (time.perf_counter() - t0) * 1e3
        e.synchronize()
        out.append((host, s.elapsed_time(e)))
    return out


def main():
    args = parse()
    import transformers
    from pynccl.pipeline import hf_stage_modules
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, intermediate_size=args.intermediate,
        max_position_embeddings=max(args.seq, 2048), use_cache=False, attn_implementation="sdpa",
        tie_word_embeddings=False, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    with dev:
        model = transformers.LlamaForCausalLM(config).train()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.cuda.get_device_name()}")
    ids = torch.randint(0, args.vocab, (args.microbatch, args.seq), device=dev)
    for k in [int(s) for s in args.stages.split(",")]:
        stage = hf_stage_modules(model, k, args.pp)[0]
        last = k == args.pp - 1
        mod = WithLoss(stage) if last else stage
        if k == 0:
            x = ids
        else:
            x = torch.randn(args.microbatch, args.seq, args.hidden, device=dev, requires_grad=True)
        sample = (x, ids) if last else (x,)
        gout = None if last else torch.randn(args.microbatch, args.seq, args.hidden, device=dev)

        def step(m):
            def run():
                with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
                    y = m(*sample)
                if last:
                    y.backward()
                else:
                    y.backward(gout)
            return run

        timed(step(mod), 3)
        report(k, "eager", timed(step(mod), args.iters))
        # forward alone (host and GPU)
        def fwd():
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
                mod(*sample)
        timed(fwd, 2)
        report(k, "eager fwd only (no grad)", timed(fwd, args.iters))
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
                g = torch.cuda.make_graphed_callables(mod, sample)
            timed(step(g), 3)
            report(k, "graphed", timed(step(g), args.iters))
        except Exception as e:  # noqa: BLE001 - a probe: say why capture failed
            print(f"stage {k} graphed: capture failed: {type(e).__name__}: {str(e)[:300]}")
        for p in model.parameters():
            p.grad = None


def report(k, name, r):
    host = statistics.median(h for h, _ in r)
    gpu = statistics.median(g for _, g in r)
    print(f"stage {k} {name:26s} host {host:7.2f} ms  gpu {gpu:7.2f} ms  (min gpu {min(g for _, g in r):.2f})",
          flush=True)


if __name__ == "__main__":
    main()
