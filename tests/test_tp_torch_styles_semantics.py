"""torch's own parallel styles (torch.distributed.tensor.parallel) given to pynccl's parallelize_module
compute what torch's parallelize_module computes with DTensor, argument by argument: each case
parallelizes one deep copy of a small module with torch's parallelize_module and another with
pynccl's, from the SAME style objects, runs forward and backward on the same inputs, and compares
what the user gets (the outputs' types, shapes and values), every parameter's gradient as a full
tensor and the inputs' gradients. Where pynccl cannot match torch (a DTensor output, a re-layout it
has no collective for) it must refuse with an error naming the argument, and the case checks that
torch does accept the plan (so the refusal is not vacuous).

Everything runs in fp64 on 2 gloo ranks: the two sides differ only in the order of their sums, so
each comparison is bounded by numerics.chain_rtol over the reductions the case chains (named at
each case), in fp64 units; a semantic difference (a gradient summed twice, a layout ignored) is
O(1), some 10^13 times that.
"""
import copy
import sys

import pytest
import torch
import torch.distributed as tdist
import torch.nn as nn
import torch.nn.functional as F

import pynccl
from pynccl import tensor_parallel as tp
from pynccl.testing import run_multiprocess

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from numerics import chain_rtol, max_rel_diff  # noqa: E402

WS = 2
F64 = torch.float64
B, S, H = 2, 4, 8          # batch, sequence (divides by WS), hidden


# ----------------------------------------------------------------------------- modules
class MLP(nn.Module):
    def __init__(self, h=H, f=2 * H):
        super().__init__()
        self.up, self.down = nn.Linear(h, f), nn.Linear(f, h)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Attention(nn.Module):
    """q, k, v, o with heads derived from the projections' widths (view(..., -1, head_dim)), so
    the local head count is right under both frameworks. k has no bias: its gradient is zero in
    exact arithmetic (softmax is invariant to the q·b_k it adds to a row), rounding noise compared
    relative to itself."""

    def __init__(self, h=H, head_dim=2, residual=False):
        super().__init__()
        self.q, self.v, self.o = (nn.Linear(h, h) for _ in range(3))
        self.k = nn.Linear(h, h, bias=False)
        self.head_dim, self.residual = head_dim, residual

    def forward(self, x=None, *, scale=None):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = self.o(y.transpose(1, 2).reshape(b, s, -1))
        if scale is not None:
            y = y * scale
        return x + y if self.residual else y


class Block(nn.Module):
    """Pre-norm residual block: norm -> attention -> residual, norm -> MLP -> residual."""

    def __init__(self, h=H, residual_inside=False):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(h), Attention(h, residual=residual_inside)
        self.norm2, self.mlp = nn.LayerNorm(h), MLP(h)
        self.residual_inside = residual_inside

    def forward(self, x):
        a = self.attn(self.norm1(x))
        x = a if self.residual_inside else x + a
        return x + self.mlp(self.norm2(x))


class EmbedHead(nn.Module):
    def __init__(self, vocab=16, h=H):
        super().__init__()
        self.emb, self.norm, self.head = nn.Embedding(vocab, h), nn.LayerNorm(h), nn.Linear(h, vocab, bias=False)

    def forward(self, tokens):
        return self.head(self.norm(self.emb(tokens)))


def _randomized(module, seed=0):
    """fp64, every parameter random (norms too: a ones weight would hide a gradient summed twice)."""
    torch.manual_seed(seed)
    module = module.to(F64)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p))
    return module


# ----------------------------------------------------------------------------- the comparison
def _full(t, name, specs):
    """A gradient as a full tensor: torch's DTensor's full_tensor(), pynccl's shard gathered by its spec."""
    from torch.distributed.tensor import DTensor
    if isinstance(t, DTensor):
        return t.full_tensor()
    if name not in specs:
        return t
    dim, chunks = specs[name]
    parts = [torch.empty_like(t) for _ in range(tdist.get_world_size())]
    tdist.all_gather(parts, t.contiguous())
    return tp.unshard_tensor(parts, dim, chunks)


def _leaves(make_inputs, rank):
    args, kwargs = make_inputs(rank)
    args = tuple(a.clone().requires_grad_(a.is_floating_point()) for a in args)
    kwargs = {k: v.clone().requires_grad_(v.is_floating_point()) for k, v in kwargs.items()}
    return args, kwargs


def _outputs(out):
    return out if isinstance(out, tuple) else (out,)


def _probe_loss(outs):
    """The same function of each local output on both sides: a fixed probe (not seeded per rank, so a
    replicated output gets the same gradient on every rank) times the output, summed."""
    gen = torch.Generator().manual_seed(1234)
    return sum((o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() for o in outs)


def compare(mesh, rank, build, plan, make_inputs, rtol, *, dtensor_output_ok=False):
    """Parallelize deep copies of build() with torch's parallelize_module and pynccl's (the same
    style objects), run forward + backward, assert equal outputs (types, shapes, values), full
    parameter gradients and input gradients. dtensor_output_ok: torch's output is a DTensor by the
    style's default (SequenceParallel's use_local_output=False) and pynccl gives its local tensor."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import parallel as ttp

    ref = build()
    theirs = ttp.parallelize_module(copy.deepcopy(ref), mesh, plan)
    ours = tp.parallelize_module(copy.deepcopy(ref), mesh, plan)
    specs = tp.shard_specs(ours)
    args_t, kwargs_t = _leaves(make_inputs, rank)
    args_o, kwargs_o = _leaves(make_inputs, rank)
    outs_t, outs_o = _outputs(theirs(*args_t, **kwargs_t)), _outputs(ours(*args_o, **kwargs_o))
    assert len(outs_t) == len(outs_o)
    locals_t = []
    for t, o in zip(outs_t, outs_o):
        assert type(o) is torch.Tensor, type(o)
        if isinstance(t, DTensor):
            assert dtensor_output_ok, f"torch's output is a DTensor {t.placements}, pynccl's a plain tensor"
            t = t.to_local()
        assert t.shape == o.shape, (t.shape, o.shape)   # a local tensor (maybe an AsyncCollectiveTensor)
        assert max_rel_diff(o, t) <= rtol, ("output", max_rel_diff(o, t), rtol)
        locals_t.append(t)
    _probe_loss(locals_t).backward()
    _probe_loss(outs_o).backward()
    grads_t = {n: _full(p.grad, n, specs) for n, p in theirs.named_parameters()}
    grads_o = {n: _full(p.grad, n, specs) for n, p in ours.named_parameters()}
    assert grads_t.keys() == grads_o.keys()
    for n in grads_t:
        assert grads_o[n].shape == grads_t[n].shape, (n, grads_o[n].shape, grads_t[n].shape)
        assert max_rel_diff(grads_o[n], grads_t[n]) <= rtol, (n, max_rel_diff(grads_o[n], grads_t[n]), rtol)
    for what, a, b in [(f"arg {i}", x, y) for i, (x, y) in enumerate(zip(args_t, args_o))] + \
                      [(f"kwarg {k}", kwargs_t[k], kwargs_o[k]) for k in kwargs_t]:
        if a.grad is not None or b.grad is not None:
            assert a.grad is not None and b.grad is not None, what
            assert max_rel_diff(b.grad, a.grad) <= rtol, (what, max_rel_diff(b.grad, a.grad), rtol)


def refused(mesh, build, plan, match, make_inputs=None, rank=0):
    """torch accepts `plan` (and runs it); pynccl refuses it with a ValueError matching `match`, at
    parallelize_module or at the first forward."""
    from torch.distributed.tensor import parallel as ttp
    ref = build()
    theirs = ttp.parallelize_module(copy.deepcopy(ref), mesh, plan)
    if make_inputs is not None:
        args, kwargs = _leaves(make_inputs, rank)
        theirs(*args, **kwargs)
    with pytest.raises(ValueError, match=match):
        ours = tp.parallelize_module(copy.deepcopy(ref), mesh, plan)
        if make_inputs is not None:
            args, kwargs = _leaves(make_inputs, rank)
            ours(*args, **kwargs)


def _x(shape, seed=7):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _shard(t, dim, rank):
    return t.chunk(WS, dim)[rank].contiguous()


# Reduction lengths, fp64: an MLP (h, 2h forward; the same backward, and the B*S tokens of each
# weight gradient) and an attention block (h for q/k/v/o, the head_dim and S of the scores and P·V).
MLP_RTOL = chain_rtol(2 * (H + 2 * H), 2 * B * S, dtype=F64)
ATTN_RTOL = chain_rtol(2 * (4 * H + 2 + 2 * S), 2 * B * S, dtype=F64)
BLOCK_RTOL = chain_rtol(2 * (2 * H + 4 * H + 2 + 2 * S + 3 * H), 2 * B * S, dtype=F64)   # two norms of h too
EMB_RTOL = chain_rtol(2 * (2 * H + 16), 2 * B * S, dtype=F64)   # norm (h), head (h fwd, vocab bwd)


# ----------------------------------------------------------------------------- cases
def _colwise_replicate_out_rowwise_replicate_in(mesh, rank):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import parallel as ttp
    plan = {"up": ttp.ColwiseParallel(output_layouts=Replicate()),
            "down": ttp.RowwiseParallel(input_layouts=Replicate())}
    compare(mesh, rank, lambda: _randomized(MLP()), plan, lambda r: ((_x((B, S, H)),), {}), MLP_RTOL)


def _sequence_sharded_mlp(mesh, rank):
    """Colwise(input Shard(1)) all-gathers the sequence; Rowwise(output Shard(1)) reduce-scatters it."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import parallel as ttp
    plan = {"up": ttp.ColwiseParallel(input_layouts=Shard(1)), "down": ttp.RowwiseParallel(output_layouts=Shard(1))}
    compare(mesh, rank, lambda: _randomized(MLP()), plan, lambda r: ((_shard(_x((B, S, H)), 1, r),), {}), MLP_RTOL)


def _batch_sharded_mlp_2d(mesh, rank):
    """(tokens, h) inputs sharded on dim 0, the output reduce-scattered back to Shard(0)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import parallel as ttp
    plan = {"up": ttp.ColwiseParallel(input_layouts=Shard(0)), "down": ttp.RowwiseParallel(output_layouts=Shard(0))}
    compare(mesh, rank, lambda: _randomized(MLP()), plan, lambda r: ((_shard(_x((B * S, H)), 0, r),), {}), MLP_RTOL)


def _feature_sharded_colwise_input(mesh, rank):
    """Colwise(input Shard(-1)): torch all-gathers the features; the gradient is reduce-scattered."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor import parallel as ttp
    plan = {"up": ttp.ColwiseParallel(input_layouts=Shard(-1), output_layouts=Replicate()),
            "down": ttp.RowwiseParallel(input_layouts=Replicate())}
    compare(mesh, rank, lambda: _randomized(MLP()), plan, lambda r: ((_shard(_x((B, S, H)), -1, r),), {}), MLP_RTOL)


def _rowwise_feature_sharded_output(mesh, rank):
    """Rowwise(output Shard(-1)): the partial sums reduce-scattered over the features, bias added."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import parallel as ttp
    plan = {"up": ttp.ColwiseParallel(), "down": ttp.RowwiseParallel(output_layouts=Shard(-1))}
    compare(mesh, rank, lambda: _randomized(MLP()), plan, lambda r: ((_x((B, S, H)),), {}), MLP_RTOL)


def _use_local_output_false_refused(mesh, rank):
    """torch returns a DTensor (global shape) for use_local_output=False; pynccl has none to return,
    and its local tensor would silently have the local shape: refused, naming the argument."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor import parallel as ttp
    inputs = lambda r: ((_x((B, S, H)),), {})  # noqa: E731
    refused(mesh, lambda: _randomized(MLP()), {"up": ttp.ColwiseParallel(use_local_output=False),
                                                "down": ttp.RowwiseParallel()}, "use_local_output", inputs)
    refused(mesh, lambda: _randomized(MLP()), {"up": ttp.ColwiseParallel(),
                                                "down": ttp.RowwiseParallel(use_local_output=False)},
            "use_local_output", inputs)
    refused(mesh, lambda: _randomized(MLP()),
            {"": ttp.PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1),
                                         use_local_output=False)}, "use_local_output", inputs)


def _rowwise_sequence_sharded_input_refused(mesh, rank):
    """Rowwise(input Shard(1)) on a Linear: torch re-lays the sequence shard to a feature shard
    (all-to-all); pynccl took any Shard as the feature shard."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import parallel as ttp
    plan = {"down": ttp.RowwiseParallel(input_layouts=Shard(1))}
    refused(mesh, lambda: _randomized(MLP()), plan, r"input_layouts", lambda r: ((_shard(_x((B, S, H)), 1, r),), {}),
            rank)


def _attention_sequence_parallel(mesh, rank):
    """The torchtitan shape: SequenceParallel norms (sequence_dim 1), PrepareModuleInput Shard(1) ->
    Replicate() into attention and MLP, q/k/v/up Colwise, o/down Rowwise(output Shard(1))."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor import parallel as ttp
    seq = Shard(1)
    plan = {"norm1": ttp.SequenceParallel(), "norm2": ttp.SequenceParallel(),
            "attn": ttp.PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "attn.q": ttp.ColwiseParallel(), "attn.k": ttp.ColwiseParallel(), "attn.v": ttp.ColwiseParallel(),
            "attn.o": ttp.RowwiseParallel(output_layouts=seq),
            "mlp": ttp.PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "mlp.up": ttp.ColwiseParallel(), "mlp.down": ttp.RowwiseParallel(output_layouts=seq)}
    compare(mesh, rank, lambda: _randomized(Block()), plan, lambda r: ((_shard(_x((B, S, H)), 1, r),), {}),
            BLOCK_RTOL)


def _attention_kwarg_layouts(mesh, rank):
    """PrepareModuleInput by keyword: x (Shard(1) -> Replicate()) and scale (Replicate() -> Replicate());
    use_local_output=True, so the module gets plain tensors under torch too."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor import parallel as ttp
    for local in (False, True):
        plan = {"": ttp.PrepareModuleInput(input_kwarg_layouts={"x": Shard(1)},
                                           desired_input_kwarg_layouts={"x": Replicate()}, use_local_output=local),
                "q": ttp.ColwiseParallel(), "k": ttp.ColwiseParallel(), "v": ttp.ColwiseParallel(),
                "o": ttp.RowwiseParallel()}
        compare(mesh, rank, lambda: _randomized(Attention()), plan,
                lambda r: ((), {"x": _shard(_x((B, S, H)), 1, r), "scale": _x((1, 1, H), seed=3)}), ATTN_RTOL)


def _prepare_input_local_output_plain_reader(mesh, rank):
    """PrepareModuleInput(use_local_output=True): torch hands the module a plain tensor whose
    gradient is not summed there (each ColwiseParallel sums its own), so a plain op may read it too
    (the residual inside Attention); from Replicate() and from a sequence shard."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor import parallel as ttp
    for src, shard in ((Replicate(), False), (Shard(1), True)):
        plan = {"": ttp.PrepareModuleInput(input_layouts=src, desired_input_layouts=Replicate(), use_local_output=True),
                "q": ttp.ColwiseParallel(), "k": ttp.ColwiseParallel(), "v": ttp.ColwiseParallel(),
                "o": ttp.RowwiseParallel()}
        x = _x((B, S, H))
        compare(mesh, rank, lambda: _randomized(Attention(residual=True)), plan,
                lambda r: ((_shard(x, 1, r) if shard else x,), {}), ATTN_RTOL)


def _prepare_input_rowwise_reader(mesh, rank):
    """PrepareModuleInput Replicate() -> Replicate() (DTensor input, torch's default) read by a
    RowwiseParallel(input_layouts=Replicate()), which slices it: its gradient is this rank's slice
    only, and the sum over ranks (PrepareModuleInput's) is the whole gradient, once."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import parallel as ttp
    plan = {"": ttp.PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Replicate()),
            "up": ttp.ColwiseParallel(output_layouts=Replicate()),
            "down": ttp.RowwiseParallel(input_layouts=Replicate())}

    class TwoReaders(MLP):      # up reads x (Colwise), and so does down (Rowwise, sliced)
        def __init__(self):
            super().__init__(H, H)

        def forward(self, x):
            return self.up(x) + self.down(x)

    compare(mesh, rank, lambda: _randomized(TwoReaders()), plan, lambda r: ((_x((B, S, H)),), {}), MLP_RTOL)


def _prepare_input_missing_positional_refused(mesh, rank):
    """PrepareModuleInput(input_layouts=(Shard(1),)) on a module called with its input by keyword:
    torch refuses (module inputs and input_layouts differ in length); pynccl left the shard as it
    was and its readers took it for the whole sequence."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor import parallel as ttp
    plan = {"": ttp.PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "q": ttp.ColwiseParallel(), "k": ttp.ColwiseParallel(), "v": ttp.ColwiseParallel(),
            "o": ttp.RowwiseParallel()}
    inputs = lambda r: ((), {"x": _shard(_x((B, S, H)), 1, r)})  # noqa: E731
    theirs = ttp.parallelize_module(_randomized(Attention()), mesh, plan)
    with pytest.raises(ValueError, match="input_layouts"):
        theirs(*_leaves(inputs, rank)[0], **_leaves(inputs, rank)[1])
    ours = tp.parallelize_module(_randomized(Attention()), mesh, plan)
    with pytest.raises(ValueError, match="input_layouts"):
        ours(*_leaves(inputs, rank)[0], **_leaves(inputs, rank)[1])


def _sequence_parallel_dim0(mesh, rank):
    """SequenceParallel(sequence_dim=0) on a (s, b, h) shard; its DTensor output feeds a
    Colwise(input Shard(0)); Rowwise(output Shard(0)) back; and SequenceParallel(use_local_output=True)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import parallel as ttp

    class NormMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.mlp = nn.LayerNorm(H), MLP()

        def forward(self, x):
            return self.mlp(self.norm(x))

    for local in (False, True):
        plan = {"norm": ttp.SequenceParallel(sequence_dim=0, use_local_output=local),
                "mlp.up": ttp.ColwiseParallel(input_layouts=Shard(0)),
                "mlp.down": ttp.RowwiseParallel(output_layouts=Shard(0))}
        compare(mesh, rank, lambda: _randomized(NormMLP()), plan, lambda r: ((_shard(_x((S, B, H)), 0, r),), {}),
                MLP_RTOL + chain_rtol(2 * H, dtype=F64))
    # the norm alone: torch's output is a Shard(0) DTensor by default, pynccl's its local tensor
    compare(mesh, rank, lambda: _randomized(nn.LayerNorm(H)), ttp.SequenceParallel(sequence_dim=0),
            lambda r: ((_shard(_x((S, B, H)), 0, r),), {}), chain_rtol(2 * H, B * S, dtype=F64),
            dtensor_output_ok=True)


def _embedding_sequence_parallel(mesh, rank):
    """Rowwise embedding (Replicate() ids) reduce-scattered to Shard(1), a SequenceParallel norm, the
    head Colwise(input Shard(1), output Replicate()); and the vocabulary-sharded head."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor import parallel as ttp
    tokens = torch.randint(0, 16, (B, S), generator=torch.Generator().manual_seed(5))
    for out in (Replicate(), Shard(-1)):
        plan = {"emb": ttp.RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                "norm": ttp.SequenceParallel(),
                "head": ttp.ColwiseParallel(input_layouts=Shard(1), output_layouts=out)}
        compare(mesh, rank, lambda: _randomized(EmbedHead()), plan, lambda r: ((tokens,), {}), EMB_RTOL)


def _embedding_sharded_token_ids(mesh, rank):
    """An embedding whose token ids come as sequence shards: torch's RowwiseParallel() (input_layouts
    default Shard(-1)) and ColwiseParallel(input_layouts=Shard(1)) all-gather the ids first."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor import parallel as ttp
    tokens = torch.randint(0, 16, (B, S), generator=torch.Generator().manual_seed(5))
    for emb in (ttp.RowwiseParallel(), ttp.RowwiseParallel(input_layouts=Shard(1)),
                ttp.ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())):
        plan = {"emb": emb, "head": ttp.ColwiseParallel(output_layouts=Replicate())}
        compare(mesh, rank, lambda: _randomized(EmbedHead()), plan, lambda r: ((_shard(tokens, 1, r),), {}),
                EMB_RTOL)


def _prepare_output_layouts(mesh, rank):
    """PrepareModuleOutput Shard(1) -> Replicate() (gather) and Replicate() -> Shard(1) (slice) match,
    and PrepareModuleInputOutput;
    Shard(1) -> Shard(2) (torch: an all-to-all) is refused, naming the layouts, where pynccl returned
    the output unchanged."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor import parallel as ttp
    x = _x((B, S, H))
    sp = {"up": ttp.ColwiseParallel(input_layouts=Shard(1)), "down": ttp.RowwiseParallel(output_layouts=Shard(1))}
    compare(mesh, rank, lambda: _randomized(MLP()),
            {**sp, "": ttp.PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate())},
            lambda r: ((_shard(x, 1, r),), {}), MLP_RTOL)
    compare(mesh, rank, lambda: _randomized(MLP()),
            {"up": ttp.ColwiseParallel(), "down": ttp.RowwiseParallel(),
             "": ttp.PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))},
            lambda r: ((x,), {}), MLP_RTOL)
    # PrepareModuleInputOutput: the sequence gathered in, the summed output sliced back out
    compare(mesh, rank, lambda: _randomized(MLP()),
            {"up": ttp.ColwiseParallel(), "down": ttp.RowwiseParallel(),
             "": ttp.PrepareModuleInputOutput(input_layouts=Shard(1), desired_input_layouts=Replicate(),
                                              output_layouts=Replicate(), desired_output_layouts=Shard(1))},
            lambda r: ((_shard(x, 1, r),), {}), MLP_RTOL)
    refused(mesh, lambda: _randomized(MLP()),
            {**sp, "": ttp.PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Shard(2))},
            r"Shard\(1\) -> Shard\(2\)", lambda r: ((_shard(x, 1, r),), {}), rank)


def _hf_llama(mesh, rank):
    """A 1-layer Hugging Face Llama (random init, fp64) under the tutorial's plan: Rowwise embedding
    (Replicate() ids), q/k/v/gate/up Colwise, o/down Rowwise, the LM head Colwise(output Replicate())."""
    transformers = pytest.importorskip("transformers")
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor import parallel as ttp
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    cfg._attn_implementation = "eager"
    layer = "model.layers.*"
    plan = {"model.embed_tokens": ttp.RowwiseParallel(input_layouts=Replicate()),
            **{f"{layer}.self_attn.{p}_proj": ttp.ColwiseParallel() for p in "qkv"},
            f"{layer}.self_attn.o_proj": ttp.RowwiseParallel(),
            f"{layer}.mlp.gate_proj": ttp.ColwiseParallel(), f"{layer}.mlp.up_proj": ttp.ColwiseParallel(),
            f"{layer}.mlp.down_proj": ttp.RowwiseParallel(),
            "lm_head": ttp.ColwiseParallel(output_layouts=Replicate())}

    def build():
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(cfg).to(F64)

    tokens = torch.randint(0, 32, (B, S), generator=torch.Generator().manual_seed(5))

    ref = build()
    theirs = ttp.parallelize_module(copy.deepcopy(ref), mesh, plan)
    ours = tp.parallelize_module(copy.deepcopy(ref), mesh, plan)
    specs = tp.shard_specs(ours)
    lt = theirs(input_ids=tokens, use_cache=False).logits
    lo = ours(input_ids=tokens, use_cache=False).logits
    assert type(lo) is torch.Tensor and not isinstance(lt, DTensor) and lo.shape == lt.shape
    # 1 layer: the norms and projections (h), scores (head_dim) and P·V (S), the MLP (2h), the head
    # (h forward, vocab backward), each weight gradient's sum over the B*S tokens
    rtol = chain_rtol(2 * (2 * 16 + 4 * 16 + 4 + 2 * S + 2 * 32), 2 * 32, 2 * B * S, dtype=F64)
    assert max_rel_diff(lo, lt) <= rtol
    _probe_loss((lt,)).backward()
    _probe_loss((lo,)).backward()
    grads_t = {n: _full(p.grad, n, specs) for n, p in theirs.named_parameters()}
    for n, p in ours.named_parameters():
        g = _full(p.grad, n, specs)
        assert max_rel_diff(g, grads_t[n]) <= rtol, (n, max_rel_diff(g, grads_t[n]), rtol)


CASES = [_colwise_replicate_out_rowwise_replicate_in, _sequence_sharded_mlp, _batch_sharded_mlp_2d,
         _feature_sharded_colwise_input, _rowwise_feature_sharded_output, _use_local_output_false_refused,
         _rowwise_sequence_sharded_input_refused, _attention_sequence_parallel, _attention_kwarg_layouts,
         _prepare_input_local_output_plain_reader, _prepare_input_rowwise_reader,
         _prepare_input_missing_positional_refused, _sequence_parallel_dim0, _embedding_sequence_parallel,
         _embedding_sharded_token_ids, _prepare_output_layouts, _hf_llama]


def _run(rank, ws, case):
    from torch.distributed.device_mesh import init_device_mesh
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (ws,))
    try:
        case(mesh, rank)
    finally:
        pynccl.barrier()   # rank 0 hosts the store: no rank leaves while another still uses it
    return True


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__.strip("_"))
def test_torch_style_semantics(case):
    assert run_multiprocess(_run, WS, backend="gloo", timeout=120, args=(case,)) == [True] * WS
