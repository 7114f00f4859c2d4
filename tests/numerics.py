"""Tolerances for comparing a parallel run with its reference (one process, or torch's own
counterpart), derived from the numerics instead of tuned to one CPU's rounding.

Both sides run the same math; they differ only in the order of floating-point sums: ranks'
partial sums, micro-batches, bucket layouts, and the CPU kernels' blocking (which
ATEN_CPU_CAPABILITY and the thread count change). The model, used by every helper below:

* Reduction order. A sum or dot product of K terms, in any order, is within γ_K·Σ|terms| of the
  exact one (Higham, Accuracy and Stability of Numerical Algorithms, §3.1; γ_K ≈ K·u, u = eps/2),
  so two orders are within K·eps·Σ|terms| of each other: relative K·eps for terms of one sign.
* Through a network, first-order relative errors add along the longest chain of reductions of
  forward and backward (layers taken as well conditioned, as pre-norm transformers and MLPs on
  unit-scale data are): `chain_rtol(K1, K2, ...) = eps·ΣK`. Gradients are compared relative to
  the largest element of their tensor.
* SGD (momentum μ) is linear in the gradient: gradients that agree to δ keep parameters within
  lr·δ·Σ_t Σ_{s≤t} μ^(t-s) (`sgd_atol`): no amplification.
* Adam(W) normalises: the step is lr·m̂/(√v̂+ε). Its size is at most lr·c_t, c_t =
  √(Σ_s w_s²/w'_s) over the bias-corrected weights of m̂ and v̂ (Cauchy-Schwarz; ≈ 1 for a few
  steps). For an element whose gradient has rms s, gradients that agree to δ·G (G the tensor's
  largest gradient) change the step by at most ≈ 2δG/s of lr. An element whose gradient is at
  rounding-noise level (an attention key
  bias, a bias feeding BatchNorm: zero in exact arithmetic) therefore moves by up to lr·c_t per
  step in a direction the noise picks, and two correct runs may be 2·lr·c_t apart there per step.
  `adam_atol` gives each element min(2·c_t, 2·δ·G/s)·lr per step, s and G read from the
  reference optimizer's exp_avg_sq: tight where the gradient is signal, Adam's own bound where it
  is noise.
* First order: the differences a step leaves in the parameters change later gradients too; in
  well-conditioned setups (SGD, or AdamW away from noise-level gradients) that is far below the
  rounding bound, and the tests' measured margins (NUMERICS_REPORT=1 prints each bound's use) show it.
  Where it is not (test_ddp_gpu.py at 4 ranks under AdamW: one element 13x over after 6 steps,
  session 12), a test compares every step from equal starting points instead: the gradients, then
  one optimizer step (steps=1), then both sides take the reference's parameters and state.

A bug a test guards (a missed 1/N, a dropped micro-batch, a stale shard) changes a gradient by
tens of per cent and a step by ~lr: orders of magnitude above these bounds.
"""
import math
import os

import torch


def eps(dtype=torch.float32) -> float:
    return torch.finfo(dtype).eps


def chain_rtol(*reductions: int, dtype=torch.float32) -> float:
    """Relative difference of a result computed through reductions of these lengths in two orders."""
    return eps(dtype) * sum(reductions)


def transformer_rtol(layers: int, hidden: int, intermediate: int, head_dim: int, seq: int, vocab: int,
                     tokens: int, dtype=torch.float32) -> float:
    """chain_rtol of a pre-norm transformer LM's loss and gradients. Per layer, forward: the norm
    (hidden), q/k/v (hidden), scores (head_dim), softmax and P·V (seq each), o (hidden), the norm,
    up/gate (hidden), down (intermediate); backward the transposed products, as long. Then the
    head (hidden forward, vocab backward), the loss's softmax over vocab, and the sums over tokens
    (the mean loss, each weight's gradient)."""
    per_layer = 5 * hidden + head_dim + 2 * seq + intermediate
    return chain_rtol(2 * layers * per_layer, 2 * hidden, 2 * vocab, 2 * tokens, dtype=dtype)


def max_rel_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| relative to expected's largest element (the scale of its rounding)."""
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def sgd_atol(lr: float, steps: int, grad_atol: float, momentum: float = 0.0, nesterov: bool = False) -> float:
    """Parameters of two SGD runs whose gradients agree to grad_atol at every step: step t applies
    lr·b_t, b_t = Σ_{s≤t} μ^(t-s)·g_s (torch's momentum buffer, dampening 0); Nesterov lr·(g_t + μ·b_t)."""
    def weight(t):
        buffer = sum(momentum ** k for k in range(t + 1))
        return 1 + momentum * buffer if nesterov else buffer
    return lr * grad_atol * sum(weight(t) for t in range(steps))


def adam_step_bound(betas, step: int) -> float:
    """c_t: the largest |m̂/√v̂| after `step` steps, by Cauchy-Schwarz over the bias-corrected
    weights w_s of m̂ and w'_s of v̂ (the largest over steps 1..step)."""
    b1, b2 = betas
    best = 1.0
    for t in range(1, step + 1):
        w1 = [(1 - b1) * b1 ** (t - s) / (1 - b1 ** t) for s in range(1, t + 1)]
        w2 = [(1 - b2) * b2 ** (t - s) / (1 - b2 ** t) for s in range(1, t + 1)]
        best = max(best, math.sqrt(sum(a * a / b for a, b in zip(w1, w2))))
    return best


def adam_atol(optimizer: torch.optim.Optimizer, param: torch.Tensor, grad_rtol: float,
              grad_scale: float = 0.0) -> torch.Tensor:
    """Element-wise bound on |p - p_ref| after the reference optimizer's steps, for two Adam(W)
    runs whose gradients agreed to grad_rtol (relative to the tensor's largest gradient, or to
    grad_scale where that is larger: see adam_state_atol). `optimizer` is the reference's,
    holding `param`'s state."""
    group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
    return adam_state_atol(optimizer.state[param], group, param, grad_rtol, grad_scale)


def _adam_gradient_scale(state: dict, group: dict):
    """(each element's gradient rms over the run, the largest |gradient| any step can have had):
    v̂ = Σ w'_s g_s² with weights w'_s summing to 1, so |g_s| <= sqrt(v̂ / min w')."""
    steps = int(state["step"])
    b2 = group["betas"][1]
    rms = (state["exp_avg_sq"] / (1 - b2 ** steps)).sqrt()
    min_weight = (1 - b2) * b2 ** (steps - 1) / (1 - b2 ** steps)
    return rms, rms.max().item() / math.sqrt(min_weight)


def adam_state_atol(state: dict, group: dict, param: torch.Tensor, grad_rtol: float,
                    grad_scale: float = 0.0) -> torch.Tensor:
    """adam_atol from one parameter's Adam state (step, exp_avg_sq) and its param group (lr,
    betas, eps), e.g. read from a checkpoint. grad_scale: the largest |term| of a gradient that is
    a sum over ranks, where it exceeds the sum's (the ranks' terms partly cancel): two orders of
    that sum differ by a multiple of the terms' rounding, not of the sum's."""
    steps = int(state["step"])
    rms, largest = _adam_gradient_scale(state, group)
    largest = max(largest, grad_scale or 0.0)
    c = adam_step_bound(group["betas"], steps)
    per_step = torch.clamp(2 * grad_rtol * largest / (rms + group["eps"]), max=2 * c)
    # + the rounding of the parameter's own value at each step (|p|·eps/2 per update, both runs).
    return group["lr"] * steps * per_step + steps * eps(param.dtype) * param.detach().abs()


def adam_moments_atol(state: dict, group: dict, grad_rtol: float) -> dict:
    """Bounds on Adam's moments of two runs whose gradients agreed to grad_rtol of the largest
    |gradient| G: exp_avg, a weighted mean of gradients, within grad_rtol·G; exp_avg_sq, of their
    squares, within (2·grad_rtol + grad_rtol²)·G²."""
    _, largest = _adam_gradient_scale(state, group)
    return {"exp_avg": grad_rtol * largest, "exp_avg_sq": (2 * grad_rtol + grad_rtol ** 2) * largest ** 2,
            "step": 0.0}


def trained_atol(optimizer: torch.optim.Optimizer, param: torch.Tensor, grad_rtol: float, grad_scale: float,
                 steps: int):
    """Element-wise bound on |p - p_ref| after `steps` steps of the reference's optimizer (Adam(W):
    adam_atol; SGD-like, without exp_avg_sq: sgd_atol from the largest gradient grad_scale), for
    two runs whose gradients agreed to grad_rtol of their tensor's scale. 0 where the reference
    never stepped the parameter (frozen, unused: both must be unchanged)."""
    if grad_scale is None:
        return 0.0
    if "exp_avg_sq" in optimizer.state.get(param, {}):
        return adam_atol(optimizer, param, grad_rtol, grad_scale)
    group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
    return (sgd_atol(group["lr"], steps, grad_rtol * grad_scale, group.get("momentum", 0.0), group.get("nesterov", False))
            + steps * eps(param.dtype) * param.detach().abs().max().item())   # the value's own rounding


def record_grad_scale(params, grad_scale: dict) -> None:
    """grad_scale[p] = the largest |gradient| p has had (call before each optimizer step)."""
    for p in params:
        if p.grad is not None:
            grad_scale[p] = max(grad_scale.get(p, 0.0), p.grad.abs().max().item())


def assert_within(actual: torch.Tensor, expected: torch.Tensor, atol, what: str) -> None:
    """|actual - expected| <= atol element-wise (atol a number or a tensor), naming the worst element."""
    expected = expected.detach().to(actual.device)
    if isinstance(atol, torch.Tensor):
        atol = atol.to(actual.device)
    diff = (actual.detach().float() - expected.float()).abs()
    if os.environ.get("NUMERICS_REPORT"):         # how much of each bound a run uses: RATIO <max diff/bound>
        ratio = (diff / torch.as_tensor(atol, dtype=diff.dtype).clamp_min(1e-30)).max().item()
        print(f"RATIO {ratio:.3g} {what}", flush=True)
    excess = diff - atol
    if excess.max().item() > 0:
        i = int(excess.argmax())
        bound = atol.flatten()[i].item() if isinstance(atol, torch.Tensor) else atol
        raise AssertionError(f"{what}: |diff| {diff.flatten()[i].item():.3g} > bound {bound:.3g} at flat index {i} "
                             f"({int((excess > 0).sum())} of {diff.numel()} elements over)")
