"""The Megatron-layout layers and the plan's styles are one set of tensor-parallel building blocks
with the layout as a parameter: the same torch layer cut either way holds the same shards, and a
column -> row pair built either way, at either sequence dim, equals torch's unsharded layers (the
reference here is torch's own nn.Linear / nn.Embedding, not pynccl code): outputs, input
gradients and every parameter gradient, with and without sequence parallelism, on gloo at TP 2
and 3. Sizes divide by 2 and 3 (hidden 12, ffn 24, sequence 6, vocabulary 18).
"""
import copy

import pytest
import torch
import torch._dynamo  # noqa: F401  a layer's meta-device build imports it: once, before the ranks fork
import torch.nn as nn

import pynccl
import pynccl.tensor_parallel as tp
from pynccl.testing import run_multiprocess

B, S, H, FFN, VOCAB = 2, 6, 12, 24, 18
# fp32, sums of at most FFN = 24 products and a TP-size sum of partial sums: the orders differ
# from torch's by a few ulps of values of order 1.
FP32_TOL = dict(rtol=1e-5, atol=1e-5)


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _close(actual, expected, what):
    assert actual is not None, f"{what}: no gradient"
    torch.testing.assert_close(actual, expected, **FP32_TOL, msg=lambda m: f"{what}: {m}")


def _mlp():
    torch.manual_seed(3)
    return nn.ModuleDict({"fc": nn.Linear(H, FFN), "proj": nn.Linear(FFN, H)})


def _by_layers(ref, group, sequence_parallel, seq_dim):
    return nn.ModuleDict({
        "fc": tp.ColumnParallelLinear.from_linear(ref["fc"], group, sequence_parallel=sequence_parallel,
                                                  sequence_dim=seq_dim),
        "proj": tp.RowParallelLinear.from_linear(ref["proj"], group, sequence_parallel=sequence_parallel,
                                                 sequence_dim=seq_dim)})


def _by_plan(ref, group, sequence_parallel, seq_dim):
    seq = tp.Shard(seq_dim) if sequence_parallel else tp.Replicate()
    return tp.parallelize_module(copy.deepcopy(ref), group, {"fc": tp.ColwiseParallel(input_layouts=seq),
                                                             "proj": tp.RowwiseParallel(output_layouts=seq)})


def _layout(seq_dim):
    """An activation in that layout: [s, b, h] (seq_dim 0, Megatron) or [b, s, h] (1, Hugging Face)."""
    return (S, B) if seq_dim == 0 else (B, S)


def _check_pair(group, build, sequence_parallel, seq_dim, what):
    ref = _mlp()
    par = build(ref, group, sequence_parallel, seq_dim)
    shard = (lambda t: t.chunk(group.world_size, seq_dim)[group.rank]) if sequence_parallel else (lambda t: t)
    x = _randn(*_layout(seq_dim), H, seed=11).requires_grad_(True)
    y = ref["proj"](ref["fc"](x))
    dy = _randn(*y.shape, seed=12)
    y.backward(dy)
    x_par = shard(x.detach()).clone().requires_grad_(True)
    y_par = par["proj"](par["fc"](x_par))  # (.., s or s/tp, ..) as the input
    _close(y_par, shard(y.detach()), f"{what}: output")
    y_par.backward(shard(dy))
    _close(x_par.grad, shard(x.grad), f"{what}: input grad")
    ref_params = dict(ref.named_parameters())
    for name, p in par.named_parameters():
        _close(p.grad, tp.shard_like(p, ref_params[name].grad, group), f"{what}: grad of {name}")


def _check_embedding(group, sequence_parallel, seq_dim):
    torch.manual_seed(4)
    ref = nn.Embedding(VOCAB, H)
    seq = tp.Shard(seq_dim) if sequence_parallel else tp.Replicate()
    layer = tp.VocabParallelEmbedding.from_embedding(ref, group, sequence_parallel, sequence_dim=seq_dim)
    planned = tp.parallelize_module(nn.ModuleDict({"wte": copy.deepcopy(ref)}), group,
                                    {"wte": tp.RowwiseParallel(input_layouts=tp.Replicate(), output_layouts=seq)})
    assert torch.equal(layer.weight, planned["wte"].weight), "the layer and the style cut the vocabulary differently"
    tokens = torch.randint(0, VOCAB, _layout(seq_dim), generator=torch.Generator().manual_seed(13))
    y = ref(tokens)
    dy = _randn(*y.shape, seed=14)
    y.backward(dy)
    shard = (lambda t: t.chunk(group.world_size, seq_dim)[group.rank]) if sequence_parallel else (lambda t: t)
    for what, module in (("VocabParallelEmbedding", layer), ("RowwiseParallel(nn.Embedding)", planned["wte"])):
        what = f"{what} seq_dim={seq_dim} sp={sequence_parallel}"
        out = module(tokens)
        _close(out, shard(y.detach()), f"{what}: output")
        out.backward(shard(dy))
        _close(module.weight.grad, tp.shard_like(module.weight, ref.weight.grad, group), f"{what}: weight grad")


def check_layouts(rank, world_size):
    group = pynccl.get_default_group()
    # One sharding: a layer built from a torch layer, and the style applied to that torch layer.
    ref = _mlp()
    layers, planned = _by_layers(ref, group, False, 0), _by_plan(ref, group, False, 0)
    spec = lambda p: (getattr(p, "tp_shard_dim", None), getattr(p, "tp_num_chunks", None))  # noqa: E731
    for name, p in layers.named_parameters():
        q = dict(planned.named_parameters())[name]
        assert torch.equal(p, q) and spec(p) == spec(q), f"{name}: {spec(p)} != {spec(q)}"
    assert getattr(layers["proj"].bias, "tp_shard_dim", None) is None, "the row-parallel bias is replicated"
    for seq_dim in (0, 1):
        for sequence_parallel in (False, True):
            for build in (_by_layers, _by_plan):
                _check_pair(group, build, sequence_parallel, seq_dim,
                            f"{build.__name__} seq_dim={seq_dim} sequence_parallel={sequence_parallel}")
            _check_embedding(group, sequence_parallel, seq_dim)
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_layers_and_styles_are_one_set_of_blocks(world_size):
    assert run_multiprocess(check_layouts, world_size, timeout=120) == [True] * world_size
