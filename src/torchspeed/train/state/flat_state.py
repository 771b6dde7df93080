"""A group's optimizer moments in one flat buffer: torch's default Adam/SGD numbers in a few kernels (T51).

On the CPU a script's `torch.optim.Adam(params, lr)` runs torch's for-loop: seven elementwise kernels per
parameter tensor and step. On a model of many small tensors the launches cost more than the arithmetic (a
2-layer transformer: 28 tensors of 670 numbers on average). `FlatMoments` makes a group's moments views of
one buffer each (`optimizer.state[p]["exp_avg"]` stays a tensor of `p`'s shape, in place), copies the
gradients into one more, and runs each moment kernel once over the buffer; the parameters are updated by
one foreach call on the views (the for-loop's own `addcdiv_` per tensor). 200 updates timed alone on a
2-core AVX2 EPYC: 290-320 -> 100-150 us a step on the 1D CNN, 600-1,040 -> 250-380 us on the transformer
(`torchspeed.bench.small`).

Every kernel is elementwise, so each number is computed from the same inputs by the same operation; one
kernel over the buffer gives each tensor's numbers exactly where this CPU's kernels give the same number at
any position of a tensor (their vectorized body and their scalar tail agree). `kernels_agree()` checks that
once a process, on the kernels the update runs; where they do not agree the group keeps the per-tensor ops.

Taken only where it pays and is plain: a group of at least two contiguous float32 tensors on the CPU of at
most `MEAN_NUMEL` numbers on average (above that the copy of the gradients costs more than the launches it
saves) and `MAX_NUMEL` in all (the memory of the two extra buffers), Adam/AdamW without amsgrad, SGD with
momentum (plain SGD has no moments), every step count equal.

Example:
    >>> flat = FlatMoments(opt, group["params"], ("exp_avg", "exp_avg_sq"))
    >>> flat.adam(group, params, steps, grads, maximize=False, decoupled=True)
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

__all__ = ["FlatMoments", "MAX_NUMEL", "MEAN_NUMEL", "flat_applies", "kernels_agree", "lean_chunks_agree",
           "schedule_free_chunks_agree", "schedule_free_kernels_agree"]

MEAN_NUMEL = 32_768  # numbers per tensor, on average, above which the gradients' copy costs what the launches save
MAX_NUMEL = 1 << 24  # a group's numbers at most: its two extra buffers (gradients, Adam's denominator) stay <= 128 MiB

_N, _PIECE = 263, 7  # the check's length, and a piece shorter than any vector body (a scalar tail only)
_OPS: tuple[Callable, ...] = (  # the update's kernels over the buffers, with scalars as the update passes them
    lambda a, b, c: a.lerp_(b, 0.1),
    lambda a, b, c: a.lerp_(b, 0.7),
    lambda a, b, c: a.mul_(0.999).addcmul_(b, b, value=0.001),
    lambda a, b, c: torch.sqrt(c, out=torch.empty_like(c)).div_(0.31).add_(1e-8),
    lambda a, b, c: a.mul_(0.9).add_(b, alpha=0.9),
    lambda a, b, c: a.neg_(),
)
_SF_OPS: tuple[Callable, ...] = (  # Schedule-Free AdamW's (lean_schedulefree): its denominator, the normalized step
    lambda a, b, c: a.mul_(0.999).addcmul_(b, b, value=0.001),
    lambda a, b, c: torch.div(c, 0.37).sqrt_().add_(1e-8),
    lambda a, b, c: a.div_(c),
    lambda a, b, c: a.sub_(b, alpha=0.01),
)

_SF_PARAM_OPS: tuple[Callable, ...] = (  # and its parameters' ops (the weight decay's add, the lerp, the step)
    lambda a, b, c: a.add_(b, alpha=0.05),
    lambda a, b, c: a.lerp_(b, 0.137),
    lambda a, b, c: a.add_(b, alpha=-0.00091),
)


def _agree(op: Callable, g: torch.Generator) -> bool:
    """`op` over a whole tensor gives, at every position, what it gives over pieces that run only scalar code."""
    a, b = torch.randn(_N, generator=g), torch.randn(_N, generator=g)
    c = torch.rand(_N, generator=g) + 1e-3
    whole = op(a.clone(), b, c)
    pieces = torch.cat([op(a[i:i + _PIECE].clone(), b[i:i + _PIECE], c[i:i + _PIECE]) for i in range(0, _N, _PIECE)])
    return torch.equal(whole, pieces)


@functools.cache
def kernels_agree() -> bool:
    """Whether this CPU's float32 elementwise kernels of the update give each number whatever its position."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        return all(_agree(op, g) for op in _OPS)


@functools.cache
def schedule_free_kernels_agree() -> bool:
    """`kernels_agree` for the kernels of Schedule-Free AdamW's update that run over the buffers."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        return all(_agree(op, g) for op in _SF_OPS)


@functools.cache
def schedule_free_chunks_agree() -> bool:
    """`kernels_agree` for every kernel of Schedule-Free AdamW's update: its moments' (`schedule_free_kernels_agree`)
    and its parameters' (a chunked update cuts the parameters too: `lean_schedulefree.Chunks`)."""
    if not schedule_free_kernels_agree():  # its moments' kernels, checked once a process
        return False
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        return all(_agree(op, g) for op in _SF_PARAM_OPS)


_LEAN_PARAM_OPS: tuple[Callable, ...] = (  # a chunked Adam update's parameter ops (`lean_kernels.adam_chunked`)
    lambda a, b, c: a.mul_(0.99995),
    lambda a, b, c: a.addcdiv_(b, c, value=-0.00317),
    lambda a, b, c: torch.add(b, a, alpha=5e-4),
)


@functools.cache
def lean_chunks_agree() -> bool:
    """`kernels_agree` for every kernel of a chunked Adam update: its moments' (`kernels_agree`) and its
    parameters' (the pieces cut the parameters too: `lean_kernels`)."""
    if not kernels_agree():
        return False
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        return all(_agree(op, g) for op in _LEAN_PARAM_OPS)


def flat_applies(params: list, moments: tuple = (), agree: Callable[[], bool] | None = None) -> bool:
    """The group is one a flat buffer pays for and keeps exact on (the module docstring's rule); `moments`, the
    state's tensor lists, must be dense float32 tensors of their parameters' shapes (a sparse embedding's SGD
    momentum is not); `agree`, the check of the update's kernels (`kernels_agree`, Adam's and SGD's)."""
    if len(params) < 2 or any(p.dtype != torch.float32 or not p.is_contiguous() for p in params):
        return False
    if any(t.is_sparse or t.dtype != p.dtype or t.shape != p.shape for ts in moments for t, p in zip(ts, params)):
        return False
    n = sum(p.numel() for p in params)
    return n <= MEAN_NUMEL * len(params) and n <= MAX_NUMEL and (agree or kernels_agree)()


class FlatMoments:
    """A group's state tensors under `keys` made views of one buffer each, plus a gradient buffer (and Adam's
    denominator's)."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list, keys: tuple[str, ...],
                 extra: tuple[str, ...] | None = None):
        n = sum(p.numel() for p in params)
        self.params, self.keys = list(params), keys
        if extra is None:  # Adam's denominator has a buffer of its own
            extra = ("grad", "scratch") if "exp_avg" in keys else ("grad",)
        self.buffers = {k: torch.empty(n, dtype=params[0].dtype) for k in keys + extra}
        self.views: dict[str, list] = {k: [] for k in self.buffers}
        offset = 0
        for p in params:
            for k, buf in self.buffers.items():
                self.views[k].append(buf[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        with torch.no_grad():
            for k in keys:  # the state's numbers move into the buffer; the state holds the views from now on
                for p, view in zip(params, self.views[k]):
                    view.copy_(optimizer.state[p][k])
                    optimizer.state[p][k] = view

    def holds(self, optimizer: torch.optim.Optimizer, params: list) -> bool:
        """These are the group's parameters and the state still holds these views (no `load_state_dict` since)."""
        return len(params) == len(self.params) and all(a is b for a, b in zip(params, self.params)) and all(
            optimizer.state[p].get(k) is v for k in self.keys for p, v in zip(params, self.views[k]))

    def _grads(self, params: list, grads: list, *, maximize: bool, wd: float, decoupled: bool, lr: float):
        """The gradients copied into the buffer (backward's stay as they are), negated and decayed as torch does."""
        torch._foreach_copy_(self.views["grad"], grads)
        if maximize:
            self.buffers["grad"].neg_()
        if wd != 0:
            if decoupled:
                torch._foreach_mul_(params, 1 - lr * wd)
            else:
                torch._foreach_add_(self.views["grad"], params, alpha=wd)
        return self.buffers["grad"]

    def adam(self, group: dict, params: list, steps: list, grads: list, *, maximize: bool, decoupled: bool) -> None:
        """`_multi_tensor_adam`'s update (not amsgrad) with one kernel per moment; the step counts must be equal."""
        lr, (beta1, beta2), wd, eps = group["lr"], group["betas"], group["weight_decay"], group["eps"]
        torch._foreach_add_(steps, 1)
        g = self._grads(params, grads, maximize=maximize, wd=wd, decoupled=decoupled, lr=lr)
        exp_avg, exp_avg_sq, denom = self.buffers["exp_avg"], self.buffers["exp_avg_sq"], self.buffers["scratch"]
        exp_avg.lerp_(g, 1 - beta1)
        exp_avg_sq.mul_(beta2)
        exp_avg_sq.addcmul_(g, g, value=1 - beta2)
        n = steps[0].item()
        torch.sqrt(exp_avg_sq, out=denom)
        denom.div_((1 - beta2 ** n) ** 0.5)
        denom.add_(eps)
        torch._foreach_addcdiv_(params, self.views["exp_avg"], self.views["scratch"], (lr / (1 - beta1 ** n)) * -1)

    def sgd(self, group: dict, params: list, grads: list, *, maximize: bool, nesterov: bool) -> None:
        """`_multi_tensor_sgd`'s update with momentum (the buffers made), one kernel per buffer operation."""
        lr, momentum, dampening = group["lr"], group["momentum"], group["dampening"]
        g = self._grads(params, grads, maximize=maximize, wd=group["weight_decay"], decoupled=False, lr=lr)
        buf = self.buffers["momentum_buffer"]
        buf.mul_(momentum)
        buf.add_(g, alpha=1 - dampening)
        if nesterov:
            g.add_(buf, alpha=momentum)
        torch._foreach_add_(params, self.views["grad" if nesterov else "momentum_buffer"], alpha=-lr)
