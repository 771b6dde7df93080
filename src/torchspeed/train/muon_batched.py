"""Muon's Newton-Schulz step batched over all hidden matrices at once (T42).

torch's `torch.optim.Muon` orthogonalizes each matrix's update on its own: five Newton-Schulz iterations of
three matrix products each, per matrix, per step. On a transformer of a few dozen small matrices (the bench's
GPT: 4 layers of width 128) the products take microseconds and their dispatch takes more; the CIFAR-10 and
nanoGPT speedruns stack the updates into one tensor and run the iterations as batched products (`bmm`,
`baddbmm`).

`BatchedMuon` is `torch.optim.Muon` (its constructor, param groups, state keys, `state_dict`: a checkpoint of one
loads into the other) whose `step` does that:

- the momentum and Nesterov blend as torch's, with foreach ops over the group;
- each update laid out as torch lays it out (transposed where it has more rows than columns), in bf16 as torch
  computes it, and zero-padded into one `(matrices, rows, cols)` tensor of the largest oriented shape
  (`pad="all"`, the speedruns' layout: one product per iteration), or stacked by exact shape (`pad="shape"`:
  no padded work, a product per distinct shape);
- the iterations on the stack: a zero row or column stays exactly zero through them and adds nothing to the
  Frobenius norm, so a padded matrix's block is its own iteration's result; only the products' summation
  order changes, which moves bf16 roundings (the per-matrix result to float tolerance:
  tests/train/test_muon_batched.py);
- the decoupled weight decay and the shape-adjusted LR applied as torch applies them, per shape with foreach.

`pad="auto"` (the default) pads where the matrices are small (a padded one's products under 2M multiply-adds an
iteration: dispatch-bound) and the padded tensor holds at most 1.5x the work of the exact stacks; else it
stacks by shape. Measured on a 2-core Zen 4 (bf16 native), the Newton-Schulz of 8 same-shaped matrices batched
against one by one: 4.3x at 64x64, 1.95x at 128x128, 1.4x at 128x512, 1.07x at 384x1536 (compute-bound: the
products dominate, batched or not); padding a 384-wide GPT's matrices into one tensor cost 0.73x (the padded
work is real work there), hence the size gate. Muon itself is unchanged; only how many kernel launches its step
takes. Measured by `benchmarks/bench_muon_batched.py`.

Example:
    >>> opt = BatchedMuon(hidden_matrices, lr=0.02, adjust_lr_fn="match_rms_adamw")
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.optim._muon import _adjust_lr

__all__ = ["BatchedMuon", "batched_newton_schulz", "PAD_MODES"]

PAD_MODES = ("auto", "all", "shape")
PAD_WORK_LIMIT = 1.5  # pad="auto": one padded tensor when it holds at most this much the exact stacks' work
PAD_MAX_WORK = 2e6    # ... and its matrices are small (rows^2 x cols): products dispatch-bound, not compute-bound


def _oriented(shape: torch.Size) -> tuple[int, int]:
    rows, cols = shape
    return (cols, rows) if rows > cols else (rows, cols)


def _work(m: int, n: int) -> int:
    return m * m * n  # a Newton-Schulz iteration's products scale with rows^2 x cols (rows <= cols)


def _buckets(shapes: list[torch.Size], pad: str) -> list[tuple[tuple[int, int], list[int]]]:
    """[((rows, cols), [indices])]: the stacks the matrices go into, each at its (padded) oriented shape."""
    by_shape: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, s in enumerate(shapes):
        by_shape[_oriented(s)].append(i)
    if pad == "shape" or len(by_shape) == 1:
        return list(by_shape.items())
    big = (max(m for m, _ in by_shape), max(n for _, n in by_shape))
    exact = sum(_work(*shape) * len(ix) for shape, ix in by_shape.items())
    if pad == "all" or (_work(*big) <= PAD_MAX_WORK and _work(*big) * len(shapes) <= PAD_WORK_LIMIT * exact):
        return [(big, [i for ix in by_shape.values() for i in ix])]
    return list(by_shape.items())


def batched_newton_schulz(updates: list[torch.Tensor], ns_coefficients: tuple[float, float, float], ns_steps: int,
                          eps: float, pad: str = "auto") -> list[torch.Tensor]:
    """torch's `_zeropower_via_newtonschulz` of each 2-D tensor in `updates`, run as batched products over
    stacks of them (see the module docstring); bf16 results in the input matrices' shapes and order."""
    if pad not in PAD_MODES:
        raise ValueError(f"pad must be one of {PAD_MODES}, got {pad!r}")
    if ns_steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    a, b, c = ns_coefficients
    out: list[torch.Tensor | None] = [None] * len(updates)
    by_device: dict[torch.device, list[int]] = defaultdict(list)  # a stack lives on one device
    for i, u in enumerate(updates):
        by_device[u.device].append(i)
    stacks = [(shape, [on[k] for k in ix]) for on in by_device.values()
              for shape, ix in _buckets([updates[i].shape for i in on], pad)]
    for (rows, cols), ix in stacks:
        x = updates[ix[0]].new_zeros((len(ix), rows, cols), dtype=torch.bfloat16)
        for k, i in enumerate(ix):
            u = updates[i]
            u = u.T if u.size(0) > u.size(1) else u
            x[k, : u.size(0), : u.size(1)] = u  # the cast to bf16 in the copy, as torch's `grad.bfloat16()`
        x.div_(torch.linalg.vector_norm(x, dim=(1, 2), keepdim=True).clamp(min=eps))
        for _ in range(ns_steps):
            gram = torch.bmm(x, x.transpose(1, 2))
            gram_update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.baddbmm(x, gram_update, x, beta=a)
        for k, i in enumerate(ix):
            rows_i, cols_i = updates[i].shape
            if rows_i > cols_i:
                out[i] = x[k, :cols_i, :rows_i].T
            else:
                out[i] = x[k, :rows_i, :cols_i]
    return out  # type: ignore[return-value]


class BatchedMuon(torch.optim.Muon):
    """`torch.optim.Muon` with every group's Newton-Schulz iterations batched (see the module docstring).
    `pad`: "auto", "all" (one padded tensor) or "shape" (a stack per exact shape)."""

    def __init__(self, params, *args, pad: str = "auto", **kwargs):
        if pad not in PAD_MODES:
            raise ValueError(f"pad must be one of {PAD_MODES}, got {pad!r}")
        super().__init__(params, *args, **kwargs)
        self.pad = pad

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, bufs = [], [], []
            self._init_group(group, params, grads, bufs)
            if params:
                self._step_group(group, params, grads, bufs)
        return loss

    def _step_group(self, group: dict, params: list, grads: list, bufs: list) -> None:
        lr, wd, momentum = float(group["lr"]), group["weight_decay"], group["momentum"]
        torch._foreach_lerp_(bufs, grads, 1 - momentum)
        updates = torch._foreach_lerp(grads, bufs, momentum) if group["nesterov"] else bufs
        ortho = batched_newton_schulz(list(updates), group["ns_coefficients"], group["ns_steps"], group["eps"],
                                      getattr(self, "pad", "auto"))
        if lr * wd != 0:
            torch._foreach_mul_(params, 1 - lr * wd)
        by_lr: dict[float, tuple[list, list]] = defaultdict(lambda: ([], []))
        for p, o in zip(params, ortho):
            ps, os_ = by_lr[_adjust_lr(lr, group["adjust_lr_fn"], p.shape)]
            ps.append(p)
            os_.append(o.to(p.dtype))  # bf16 -> the parameter's dtype is exact: torch's `param.add_` upcasts too
        for adjusted, (ps, os_) in by_lr.items():
            torch._foreach_add_(ps, os_, alpha=-adjusted)
