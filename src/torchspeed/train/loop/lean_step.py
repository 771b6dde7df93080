"""torch's Adam/AdamW/SGD step without `torch.optim`'s per-step Python, fused or not (T51, T13).

On a small model the optimizer's kernels take a few microseconds and `Adam.step` around them takes
ten times that: the profiler's `record_function`, the hook loops, `_init_group` walking every parameter
and its state, the grouping by device and dtype, all rebuilt each step. Measured on a 5k-parameter
1D CNN on 2 CPU cores, right after the backward (where a training loop calls it): 225 us for
`AdamW(fused=True).step()` against 73 us for the same two kernels called on lists made once (about
7% of a 2.2 ms step).

`LeanStep` keeps those lists (parameters, moments, step counts) and calls the ops torch calls, with
the same arguments, so the update is torch's, bit for bit (tests/train/test_lean_step.py):

- a fused optimizer: the fused path's kernels (`torch._foreach_add_` on the step counts, then
  `torch._fused_adamw_` or `torch._fused_adam_`; for SGD `torch._fused_sgd_` on its momentum buffers);
- an optimizer on torch's default kernel (`fused` and `foreach` unset, the for-loop on the CPU) or on
  the foreach one: the ops of torch's foreach path (`_multi_tensor_adam`, `_multi_tensor_sgd`: the
  `torch._foreach_*` lerp, mul, addcmul, sqrt, div, add and addcdiv), which on the CPU run the for-loop's
  per-tensor kernels in the for-loop's order: the same numbers as `torch.optim.Adam(params, lr)` in a
  script, in less time (200 updates timed alone on a 2-core AVX2 EPYC: 627 -> 304 us a step on the 1D CNN,
  990 -> 676 on a 20-512-512-5 MLP, 2,257 -> 924 on a 2-layer transformer; a group of many small tensors
  further keeps its moments in one buffer each, `flat_state`: 100-150 us on the CNN; a large Adam group runs those
  ops a piece at a time, `lean_kernels.adam_chunked`: 27-33 -> 15-17 ms on ResNet-18; the fused kernel is cheaper
  still, but rounds otherwise: why `fit` keeps it off a ported run, `plan.planner`'s kernel rule).

It only ever takes the common case and hands every other step back to `optimizer.step()`:

- exactly `torch.optim.Adam`, `AdamW` or `SGD` (a subclass may step otherwise), on the CPU, one dtype per group
  (fp32 or fp64 on the for-loop: torch's foreach path rounds SGD's bf16/fp16 parameters and Adam's fp16 otherwise),
  plain tensors (no DTensor shard or other subclass), no complex parameters and no sparse gradients (amsgrad,
  maximize, nesterov, dampening and weight decay are passed through), not capturable or differentiable, the LR and
  betas plain numbers (a tensor LR only on the fused path, as torch's foreach path refuses it);
- the state already made by one real `step()` (the first step always goes through torch; plain SGD has none);
- no step hooks (the optimizer's or the global ones), no `step` replaced on the instance (an LR
  scheduler's call-tracking wrapper excepted: its flag is set as it would set it), no
  `grad_scale`/`found_inf` set on the optimizer (GradScaler, the guard's device skip);
- every parameter with a gradient this step.

Lists are rebuilt when the optimizer's `param_groups` or `state` is replaced (`load_state_dict`),
when a group is added (`add_param_group`), when a group's parameter list is replaced or grows or its
flags change (a switch between the fused and foreach kernels), or when the state's size changes, and after a
layout switch replaced the state's tensors (`forget_lists`, which `memory_format.state_follows_layout` calls). One
case is not seen: a moment tensor swapped by hand inside `optimizer.state[p]` (torch re-reads the
state each step; set the optimizer's state through `load_state_dict`). `optimizer_step` and
`zero_grad` (`torchspeed.train.loop.step`, `torchspeed.train.optim`) use it for every optimizer they are
given; nothing to switch on.

Example:
    >>> lean = lean_step_for(opt)
    >>> if lean is None or not lean.step():
    ...     opt.step()
"""

from __future__ import annotations

import weakref

import torch

from torchspeed.train.state.flat_state import FlatMoments, flat_applies
from torchspeed.train.lean_schedulefree import LeanScheduleFree, is_adamw_schedule_free, plain_step
from torchspeed.train.lean_kernels import adam_chunked as _adam_chunked, adam_foreach as _adam_foreach
from torchspeed.train.lean_kernels import chunks_for as _chunks, sgd_foreach as _sgd_foreach

__all__ = ["LeanStep", "forget_lists", "lean_step_for", "step_with_torch", "steps_with_torch"]

_FLAGS = ("fused", "foreach", "amsgrad", "maximize", "capturable", "differentiable", "decoupled_weight_decay",
          "nesterov")
_KINDS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
_LEAN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> its LeanStep (or _TORCH)
_TORCH = "torch"  # `step_with_torch`: this optimizer always steps through its own `step()`


def _flags(group: dict, optimizer) -> tuple:
    """The group's kernel flags; `decoupled_weight_decay` as AdamW has it where torch's groups do not say."""
    return tuple(group.get(k, type(optimizer) is torch.optim.AdamW) if k == "decoupled_weight_decay" else group.get(k)
                 for k in _FLAGS)


def _state_lists(kind: type, group: dict, states: list) -> tuple | None:
    """The state tensors the kernel takes, per parameter in order; None where a state is not made yet."""
    if kind is torch.optim.SGD:
        if group["momentum"] == 0:
            return ([],)
        bufs = [s.get("momentum_buffer") if s else None for s in states]
        return None if any(b is None for b in bufs) else (bufs,)
    keys = ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())
    if any(not s or any(k not in s for k in keys) for s in states):
        return None
    return ([s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
            [s["max_exp_avg_sq"] for s in states] if group["amsgrad"] else [], [s["step"] for s in states])


def _adam_update(lists: tuple, grads: list) -> None:
    """What `torch.optim.adam._fused_adam` runs for one device and dtype: the step counts, then the kernel."""
    group, flags, params, exp_avgs, exp_avg_sqs, max_sqs, steps = lists
    torch._foreach_add_(steps, 1)
    kernel = torch._fused_adamw_ if flags[6] else torch._fused_adam_
    beta1, beta2 = group["betas"]
    kernel(params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps, amsgrad=flags[2], lr=group["lr"], beta1=beta1,
           beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"], maximize=flags[3], grad_scale=None,
           found_inf=None)


def _adam_flat(lists: tuple, grads: list) -> bool:
    """`_adam_foreach` with the moments in flat buffers (`flat_state`); per tensor (False) where the step counts
    differ (a step torch took for the parameters that had gradients)."""
    *kept, flat = lists
    group, flags, params, steps = kept[0], kept[1], kept[2], kept[6]
    first = steps[0].item()
    if any(s.item() != first for s in steps):
        _adam_foreach(tuple(kept), grads)
        return False
    flat.adam(group, params, steps, grads, maximize=flags[3], decoupled=flags[6])
    return True


def _sgd_flat(lists: tuple, grads: list) -> bool:
    """`_sgd_foreach` with the momentum buffers in one flat buffer (`flat_state`)."""
    group, flags, params, _, flat = lists
    flat.sgd(group, params, grads, maximize=flags[3], nesterov=flags[7])
    return True


def _sgd_update(lists: tuple, grads: list) -> None:
    """What `torch.optim.sgd._fused_sgd` runs after its first step (the momentum buffers made)."""
    group, flags, params, bufs = lists
    torch._fused_sgd_(params, grads, bufs, weight_decay=group["weight_decay"], momentum=group["momentum"],
                      lr=group["lr"], dampening=group["dampening"], nesterov=flags[7], maximize=flags[3],
                      is_first_step=False, grad_scale=None, found_inf=None)


def lean_step_for(optimizer) -> LeanStep | LeanScheduleFree | None:
    """The optimizer's `LeanStep` (Schedule-Free AdamW's: `lean_schedulefree.LeanScheduleFree`), made once, or None
    for an optimizer it never applies to."""
    torch_kind = type(optimizer) in _KINDS
    if not torch_kind and not is_adamw_schedule_free(optimizer):
        return None
    lean = _LEAN.get(optimizer)
    if lean is None:
        lean = _LEAN[optimizer] = LeanStep(optimizer) if torch_kind else LeanScheduleFree(optimizer)
    return None if lean is _TORCH else lean


def forget_lists(optimizer) -> None:
    """The optimizer's state tensors were replaced (`memory_format.state_follows_layout` after a layout switch): its
    lean step makes its lists again from the state before its next update. Without it, the lists kept updating the
    moments from before the switch and `optimizer.state` (what a checkpoint saves) stayed as the switch left it."""
    lean = _LEAN.get(optimizer)
    if lean is not None and lean is not _TORCH:
        lean._groups_ref = None  # `_fresh()` is False: `_build()` reads the state anew


def step_with_torch(optimizer) -> None:
    """Leave `optimizer` to its own `step()` and `zero_grad()` from now on (a loop that must cost what a plain
    loop costs: the bench's naive row, `TrainConfig(lean_step=False)`)."""
    _LEAN[optimizer] = _TORCH  # any kind: `dynamo_deferred.torch_step` then calls its `step()` too


def steps_with_torch(optimizer) -> bool:
    """`step_with_torch` was called on it: its `step()` runs as the script's does, wrapper and all."""
    return _LEAN.get(optimizer) is _TORCH


class LeanStep:
    """torch's Adam/AdamW/SGD update on lists kept between steps, fused or not (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self._optimizer = weakref.ref(optimizer)  # weak: `_LEAN`'s value must not keep its key (the optimizer) alive
        self._groups_ref = self._state_ref = None
        self._n_state = -1
        self._sizes: list[int] = []
        self._groups: list[tuple] = []  # per group: (group, flags, params, *the state's lists: `_state_lists`)
        self._all: list[list] = []  # per group: its own list of parameters (`params` above: those it steps)
        self._idle: list[list] = []  # per group: the parameters torch never stepped (frozen): no gradient allowed
        self._updates: list = []  # per group: the update it runs (fused kernels, or torch's foreach ops)
        self._flats: list[FlatMoments] = []  # the groups' flat moments, kept across rebuilds while the state holds them
        self._sgd = type(optimizer) is torch.optim.SGD
        self._prepared = False  # `prepare` ran (it runs once)
        self._sparse = False  # a sparse gradient was seen: torch steps (an embedding's sparse=True stays so)
        self.steps = 0  # updates it made (the tests read it)
        self.flat_steps = 0  # of those, the updates with every group's moments in flat buffers
        self.chunk_steps = 0  # and those with a group's Adam update run a piece at a time (`lean_kernels.adam_chunked`)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer()

    def _fresh(self, *, flags: bool = True) -> bool:
        """The kept lists are the optimizer's as it is now (`flags=False`: only its parameters, all that clearing the
        gradients needs)."""
        opt = self.optimizer
        if opt.param_groups is not self._groups_ref or opt.state is not self._state_ref or \
                len(opt.state) != self._n_state or len(opt.param_groups) != len(self._groups):
            return False  # replaced (load_state_dict), or a group added in place (add_param_group)
        for (group, kept, *_), params, n in zip(self._groups, self._all, self._sizes):
            if group["params"] is not params or len(params) != n or (flags and _flags(group, opt) != kept):
                return False
        return True

    def _build(self) -> bool:
        """Make the lists from the optimizer as it is; False where the lean step does not apply."""
        opt, groups, updates, flats, alls, idles = self.optimizer, [], [], [], [], []
        self._groups_ref, self._groups = None, []  # stale until the lists are whole
        for group in opt.param_groups:
            flags = _flags(group, opt)
            fused, _, _, _, capturable, differentiable, _, _ = flags
            params = group["params"]
            if capturable or differentiable or not params:
                return False
            if not fused and torch.is_tensor(group["lr"]):
                return False  # torch's foreach path refuses a tensor LR, its for-loop takes it: torch steps
            p0 = params[0]
            if p0.device.type != "cpu" or any(p.dtype != p0.dtype or p.device != p0.device or torch.is_complex(p)
                                              or type(p.data) is not torch.Tensor for p in params):
                return False  # a DTensor shard (FSDP2) or another subclass: torch groups and dispatches it
            if (torch.is_tensor(group["lr"]) and group["lr"].device.type != "cpu") or (
                    not fused and not group.get("foreach") and p0.dtype not in (torch.float32, torch.float64)):
                return False  # bf16/fp16 parameters: torch's foreach path rounds them otherwise than its for-loop
            if any(torch.is_tensor(b) for b in group.get("betas", ())):
                return False
            stepped, idle = self._stepped(group, params)
            lists = _state_lists(type(opt), group, [opt.state.get(p) for p in stepped]) if stepped else None
            if lists is None:
                return False  # no parameter stepped yet: torch makes their state
            update = (_sgd_update if self._sgd else _adam_update) if fused else (
                _sgd_foreach if self._sgd else _adam_foreach)
            moments = lists[:1] if self._sgd else lists[:2]  # SGD's momentum buffers; Adam's exp_avg, exp_avg_sq
            if not fused and (group["momentum"] != 0 if self._sgd else not flags[2]) and flat_applies(stepped, moments):
                flat = self._flat_for(stepped)
                flats.append(flat)
                lists = (*_state_lists(type(opt), group, [opt.state[p] for p in stepped]), flat)  # the views
                update = _sgd_flat if self._sgd else _adam_flat
            elif not fused and not self._sgd and (chunks := _chunks(group, flags, stepped, lists)) is not None:
                lists, update = (*lists, chunks), _adam_chunked
            groups.append((group, flags, stepped, *lists))
            updates.append(update)
            alls.append(params)
            idles.append(idle)
        self._groups, self._updates, self._n_state, self._flats = groups, updates, len(opt.state), flats
        self._all, self._idle = alls, idles
        self._sizes = [len(p) for p in alls]  # a parameter appended to a group's list makes them stale
        self._groups_ref, self._state_ref = opt.param_groups, opt.state
        return True

    def _stepped(self, group: dict, params: list) -> tuple[list, list]:
        """(the parameters the lists hold, those left out): the ones torch has stepped (their state made), and the
        ones it never stepped, a frozen target network or backbone that `Adam(model.parameters())` holds too, whose
        gradient stays None (torch skips them; a step that finds one with a gradient is torch's, and its state is
        made). SGD without momentum has no state: every parameter."""
        if self._sgd and group["momentum"] == 0:
            return params, []
        state = self.optimizer.state
        stepped = [p for p in params if state.get(p)]
        return stepped, ([p for p in params if not state.get(p)] if len(stepped) < len(params) else [])

    def _flat_for(self, params: list) -> FlatMoments:
        """The group's flat moments: the ones made before while the state still holds their views, else new ones."""
        opt = self.optimizer
        for flat in self._flats:
            if flat.holds(opt, params):
                return flat
        return FlatMoments(opt, params, ("momentum_buffer",) if self._sgd else ("exp_avg", "exp_avg_sq"))

    def prepare(self) -> None:
        """Make the lists now (right after torch's first step made the state), so that their one-off cost (the
        lists, the flat moments' copy) falls in that step and not in the next one, which a switch trial times.
        Once: where the lists cannot be made (a case torch must step), later steps do not try twice a step."""
        if not self._prepared:
            self._prepared = True
            if plain_step(self.optimizer) and not self._fresh():
                self._build()

    def step(self) -> bool:
        """Update the parameters as `optimizer.step()` would; False (nothing done) where it must run instead."""
        if self._sparse or not plain_step(self.optimizer) or (not self._fresh() and not self._build()):
            return False
        if any(p.grad is not None for idle in self._idle for p in idle):
            return False  # a parameter torch never stepped has a gradient now: torch steps it, and makes its state
        grads = [[p.grad for p in g[2]] for g in self._groups]
        if any(gr is None or gr.is_sparse for gs in grads for gr in gs):
            self._sparse = any(gr is not None and gr.is_sparse for gs in grads for gr in gs)
            return False  # torch steps only the parameters with gradients; a sparse one takes its own path
        opt = self.optimizer
        if "step" in opt.__dict__:
            opt._opt_called = True  # what an LR scheduler's wrapper records (its step-order warning)
        with torch.no_grad():
            done = [update(g, gs) for update, g, gs in zip(self._updates, self._groups, grads)]  # True: flat or chunked
        self.steps += 1
        self.flat_steps += all(f is True and u in (_adam_flat, _sgd_flat) for f, u in zip(done, self._updates))
        self.chunk_steps += any(f is True and u is _adam_chunked for f, u in zip(done, self._updates))
        return True

    def clear_grads(self) -> bool:
        """`zero_grad(set_to_none=True)` for the parameters it holds; False where `zero_grad` must run instead."""
        if not self._groups or "zero_grad" in self.optimizer.__dict__ or not self._fresh(flags=False):
            return False  # nothing kept yet, or a zero_grad replaced on the instance: it runs
        for params in self._all:
            for p in params:
                p.grad = None
        return True
