"""Schedule-Free AdamW's step without the package's per-step Python, its moments in flat buffers (T51, T42).

`recipe="auto"` trains short runs with Schedule-Free AdamW (the `schedulefree` package's
`AdamWScheduleFree`). Its `step()` rebuilds its lists of parameters, gradients and state every step and
runs ten foreach ops, which on the CPU are ten per-tensor loops: on a small model of many small tensors the
launches cost more than the arithmetic, as for torch's Adam (`lean_step`, `flat_state`).

`LeanScheduleFree` keeps the lists, does the group's bookkeeping (`k`, the warm-up, `lr_max`,
`weight_sum`, `scheduled_lr`) as the package's `step` does, and runs the package's foreach ops in its order.
Where `flat_state.flat_applies` holds (at least two contiguous float32 CPU tensors, small on average,
this CPU's kernels giving a number the same value at any position: `schedule_free_kernels_agree`), `z` and
`exp_avg_sq` are views of one buffer each and the gradients are copied into one more, so each moment op is
one kernel; the parameters (`y`) are updated per tensor, as the package does. The parameters and the state
are the package's, bit for bit (tests/train/test_lean_schedulefree.py). One difference, on purpose: the
package divides `p.grad` in place by the denominator; here `p.grad` stays as backward wrote it.

A large group (more numbers a tensor on average than the flat buffers take) runs the package's foreach ops in pieces
of `CHUNK` numbers instead (`Chunks`): every op over one piece, then the next, so that a piece's numbers stay
in the CPU's cache across the ten ops where the package streams the whole model through memory ten times.
Each number still goes through the same ops in the same order, so the result is the package's bit for bit
where this CPU's kernels give a number the same value at any position (`schedule_free_chunks_agree`).

Taken only in the common case, else the package's `step()` runs: exactly `AdamWScheduleFree` of a
`schedulefree` release whose step this replicates (`REPLICATED`), in train mode, on the CPU, one dtype per
group, plain tensors, every parameter with a dense gradient and its state made (the first step goes through
the package), the LR and betas plain numbers, no step hooks, no `step` replaced on the instance.

Example:
    >>> lean = lean_step_for(opt)   # a LeanScheduleFree for an AdamWScheduleFree
    >>> if lean is None or not lean.step():
    ...     opt.step()
"""

from __future__ import annotations

import importlib.metadata
import weakref
from collections.abc import Callable

import torch
from torch.optim import optimizer as _optimizer_module

from torchspeed.train.state.flat_state import (FlatMoments, flat_applies, schedule_free_chunks_agree,
                                                schedule_free_kernels_agree)

__all__ = ["CHUNK", "Chunks", "LeanScheduleFree", "is_adamw_schedule_free", "no_step_wrappers", "REPLICATED"]

CHUNK = 1 << 19  # numbers in a piece of a chunked update (2 MiB a float32 tensor; ~10 MiB the update's working set)

REPLICATED = ("1.4",)  # the schedulefree releases (major.minor) whose AdamWScheduleFree.step this replicates
_KEYS = ("z", "exp_avg_sq")


def is_adamw_schedule_free(optimizer) -> bool:
    """Exactly the package's `AdamWScheduleFree` (a subclass may step otherwise), without importing it."""
    kind = type(optimizer)
    return kind.__name__ == "AdamWScheduleFree" and kind.__module__.startswith("schedulefree")


def _replicated() -> bool:
    try:
        version = importlib.metadata.version("schedulefree")
    except importlib.metadata.PackageNotFoundError:
        return False
    return ".".join(version.split(".")[:2]) in REPLICATED


def no_step_wrappers(opt) -> bool:
    """No step hook (the optimizer's or the global ones) and no `step` replaced on the instance (an LR scheduler's
    call-tracking wrapper excepted): nothing a lean step (this one, `lean_step.LeanStep`) would leave out."""
    if opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks or \
            _optimizer_module._global_optimizer_pre_hooks or _optimizer_module._global_optimizer_post_hooks:
        return False
    own = opt.__dict__.get("step")
    return own is None or getattr(own, "_wrapped_by_lr_sched", False)


def plain_step(opt) -> bool:
    """Nothing around `opt`'s step that a lean one would leave out: no step wrapper, no scaler flags (GradScaler's
    or the guard's device skip: `grad_scale`, `found_inf`)."""
    return no_step_wrappers(opt) and getattr(opt, "grad_scale", None) is None and \
        getattr(opt, "found_inf", None) is None


class LeanScheduleFree:
    """`AdamWScheduleFree.step()` on lists kept between steps (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self._optimizer = weakref.ref(optimizer)
        self._groups_ref = self._state_ref = None
        self._groups: list[tuple] = []  # per group: (group, params, n, z list, exp_avg_sq list, FlatMoments | None,
        #                                   Chunks | None)
        self._flats: list[FlatMoments] = []
        self.replicated = _replicated()
        self._prepared = False  # `prepare` ran (it runs once)
        self.steps = 0  # updates it made (the tests read them)
        self.flat_steps = 0  # of those, the updates with every group's moments in flat buffers
        self.chunk_steps = 0  # and those with a group's update run a piece at a time (`Chunks`)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer()

    def _fresh(self) -> bool:
        opt = self.optimizer
        if opt.param_groups is not self._groups_ref or opt.state is not self._state_ref or \
                len(opt.param_groups) != len(self._groups):
            return False
        for group, params, n, zs, _, flat, _ in self._groups:
            if group["params"] is not params or len(params) != n:
                return False
            if flat is not None and not flat.holds(opt, params):
                return False  # the state was replaced inside (load_state_dict keeps the dicts' identity)
        return True

    def _build(self) -> bool:
        opt, groups, flats = self.optimizer, [], []
        self._groups_ref, self._groups = None, []
        for group in opt.param_groups:
            params = group["params"]
            if not params or torch.is_tensor(group["lr"]) or any(torch.is_tensor(b) for b in group["betas"]):
                return False
            p0 = params[0]
            if p0.device.type != "cpu" or any(p.dtype != p0.dtype or p.device != p0.device or torch.is_complex(p)
                                              or type(p.data) is not torch.Tensor for p in params):
                return False
            states = [opt.state.get(p) for p in params]
            if any(not s or any(k not in s for k in _KEYS) for s in states):
                return False  # a parameter not stepped yet: the package makes its state
            zs, sqs = [s["z"] for s in states], [s["exp_avg_sq"] for s in states]
            flat = None
            if flat_applies(params, (zs, sqs), agree=schedule_free_kernels_agree):
                flat = next((f for f in self._flats if f.holds(opt, params)), None) or \
                    FlatMoments(opt, params, _KEYS, extra=("grad", "scratch"))
                flats.append(flat)
                zs, sqs = [opt.state[p]["z"] for p in params], [opt.state[p]["exp_avg_sq"] for p in params]
            chunks = Chunks.of(params, zs, sqs) if flat is None else None
            groups.append((group, params, len(params), zs, sqs, flat, chunks))
        self._groups, self._flats = groups, flats
        self._groups_ref, self._state_ref = opt.param_groups, opt.state
        return True

    def prepare(self) -> None:
        """The lists right after the package's first step made the state, once (`LeanStep.prepare`)."""
        if not self._prepared:
            self._prepared = True
            if self.replicated and no_step_wrappers(self.optimizer) and not self._fresh():
                self._build()

    def step(self) -> bool:
        """Update as `optimizer.step()` would; False (nothing done) where it must run instead."""
        opt = self.optimizer
        if not self.replicated or not no_step_wrappers(opt) or not opt.param_groups[0]["train_mode"]:
            return False  # out of train mode the package raises its own error
        if not self._fresh() and not self._build():
            return False
        grads = [[p.grad for p in g[1]] for g in self._groups]
        if any(gr is None or gr.is_sparse for gs in grads for gr in gs):
            return False  # the package steps only the parameters with gradients
        if "step" in opt.__dict__:
            opt._opt_called = True  # what an LR scheduler's wrapper records
        with torch.no_grad():
            for g, gs in zip(self._groups, grads):
                _update(*g, gs)
        self.steps += 1
        self.flat_steps += all(g[5] is not None for g in self._groups)
        self.chunk_steps += any(g[6] is not None for g in self._groups)
        return True

    def clear_grads(self) -> bool:
        """`zero_grad(set_to_none=True)` for the parameters it holds; False where `zero_grad` must run instead."""
        if not self._groups or "zero_grad" in self.optimizer.__dict__ or not self._fresh():
            return False
        for g in self._groups:
            for p in g[1]:
                p.grad = None
        return True


class Chunks:
    """A group's parameters and their state's lists (Schedule-Free's `z` and `exp_avg_sq`; Adam's moments:
    `lean_kernels`) as pieces of at most about `CHUNK` numbers: small tensors whole, several to a piece; a
    large one cut in its memory order. Made where the group holds more than two pieces, every tensor is dense, each
    state tensor is laid out as its parameter, and the kernels agree at any position (`agree`)."""

    def __init__(self, pieces: list[list[tuple[int, int, int]]], params: list, *states: list):
        self.pieces = pieces  # per piece: (tensor index, start, stop) in the tensor's memory order
        self.views = [tuple([_cut(ts[i], a, b) for i, a, b in piece] for ts in (params, *states)) for piece in pieces]
        self.ptrs = [p.data_ptr() for p in params]  # the views are of these: a parameter given new data is not

    @classmethod
    def of(cls, params: list, *states: list, agree: Callable[[], bool] | None = None) -> Chunks | None:
        """`agree`: the check of the update's kernels (default: Schedule-Free's, `schedule_free_chunks_agree`)."""
        if sum(p.numel() for p in params) <= 2 * CHUNK:
            return None
        if any(not _dense(p) or any(t.stride() != p.stride() or t.shape != p.shape for t in ts)
               for p, *ts in zip(params, *states)) or not (agree or schedule_free_chunks_agree)():
            return None
        pieces, cur, held = [], [], 0
        for i, p in enumerate(params):
            n = p.numel()
            if n > CHUNK:
                pieces += [[(i, a, min(a + CHUNK, n))] for a in range(0, n, CHUNK)]
                continue
            cur.append((i, 0, n))
            held += n
            if held >= CHUNK:
                pieces.append(cur)
                cur, held = [], 0
        return cls(pieces + ([cur] if cur else []), params, *states)

    def grads(self, params: list, grads: list) -> list[list] | None:
        """Each piece's gradients, cut as its parameters are; None where a gradient is laid out otherwise, or a
        parameter holds other memory than the views (`p.data = ...`: a layout switched mid-run)."""
        if any(g.stride() != p.stride() or p.data_ptr() != ptr for p, g, ptr in zip(params, grads, self.ptrs)):
            return None
        return [[_cut(grads[i], a, b) for i, a, b in piece] for piece in self.pieces]


def _dense(t: torch.Tensor) -> bool:
    return t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last))


def _cut(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Numbers a..b of a dense tensor in its memory order (the tensor itself when that is all of it)."""
    if a == 0 and b == t.numel():
        return t.detach()
    return t.detach().as_strided((t.numel(),), (1,), t.storage_offset())[a:b]


def _ops(lr: float, beta1: float, beta2: float, eps: float, decay: float, ckp1: float, bias_correction2: float,
         params: list, zs: list, sqs: list, grads: list) -> None:
    """The package's foreach ops, in its order, over these tensors (it normalizes the gradients in place)."""
    torch._foreach_mul_(sqs, beta2)
    torch._foreach_addcmul_(sqs, grads, grads, value=1 - beta2)
    denom = torch._foreach_div(sqs, bias_correction2)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    torch._foreach_div_(grads, denom)
    if decay != 0:
        torch._foreach_add_(grads, params, alpha=decay)
    torch._foreach_lerp_(params, zs, weight=ckp1)
    torch._foreach_add_(params, grads, alpha=lr * (beta1 * (1 - ckp1) - 1))
    torch._foreach_sub_(zs, grads, alpha=lr)


def _update(group: dict, params: list, n: int, zs: list, sqs: list, flat: FlatMoments | None, chunks: Chunks | None,
            grads: list) -> None:
    """`AdamWScheduleFree.step`'s bookkeeping and foreach ops for one group, in its order (schedulefree 1.4)."""
    beta1, beta2 = group["betas"]
    eps, decay, k, r = group["eps"], group["weight_decay"], group["k"], group["r"]
    warmup_steps, weight_lr_power = group["warmup_steps"], group["weight_lr_power"]
    sched = (k + 1) / warmup_steps if k < warmup_steps else 1.0
    bias_correction2 = 1 - beta2 ** (k + 1)
    lr = group["lr"] * sched
    group["scheduled_lr"] = lr
    lr_max = group["lr_max"] = max(lr, group["lr_max"])
    weight = ((k + 1) ** r) * (lr_max ** weight_lr_power)
    weight_sum = group["weight_sum"] = group["weight_sum"] + weight
    try:
        ckp1 = weight / weight_sum
    except ZeroDivisionError:
        ckp1 = 0
    group["k"] = k + 1
    if flat is None:  # the package's foreach path on the kept lists, whole or a piece at a time
        cut = chunks.grads(params, grads) if chunks is not None else None
        for ps, z, sq, gs in ([(params, zs, sqs, grads)] if cut is None else
                              [(*views, gs) for views, gs in zip(chunks.views, cut)]):
            _ops(lr, beta1, beta2, eps, decay, ckp1, bias_correction2, ps, z, sq, gs)
        return
    # one kernel per moment op over the buffers; backward's gradients stay as they are
    normalized = flat.views["grad"]
    torch._foreach_copy_(normalized, grads)
    g, sq, denom = flat.buffers["grad"], flat.buffers["exp_avg_sq"], flat.buffers["scratch"]
    sq.mul_(beta2)
    sq.addcmul_(g, g, value=1 - beta2)
    torch.div(sq, bias_correction2, out=denom)
    denom.sqrt_()
    denom.add_(eps)
    g.div_(denom)
    if decay != 0:
        torch._foreach_add_(normalized, params, alpha=decay)
    torch._foreach_lerp_(params, zs, weight=ckp1)
    torch._foreach_add_(params, normalized, alpha=lr * (beta1 * (1 - ckp1) - 1))
    flat.buffers["z"].sub_(g, alpha=lr)
