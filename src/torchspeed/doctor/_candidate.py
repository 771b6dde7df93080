"""One training step on the captured batch, with or without a fix (T02): the two sides `--verify` times.

`_Trainer` builds a fresh copy of the script's model and optimizer (same weights, same class and
hyper-parameters; `fused=True` for the fused-optimizer candidate; the sparse-gradient weights' momentum at 0 for
the sparse-momentum candidate) with one fix applied (bf16 autocast, channels_last, bf16 oneDNN math, no conv bias
before BatchNorm, compile, zero_grad to None) and steps it on
the captured batch. Its first `LOSS_STEPS` steps run with the same random draws on both sides and their losses
feed `loss_check`: the fix's losses within `LOSS_TOLERANCE` (5%) of the script's.
"""

from __future__ import annotations

import contextlib
import copy
import math

import torch
from torch import nn

from torchspeed.doctor._tree import call_model, generic_loss, map_tensors
from torchspeed.doctor.observation_runs import LossCheck
from torchspeed.model.conv_bias import remove_conv_bias
from torchspeed.train.optim import sparse_weights, sparse_without_momentum
from torchspeed.train.loop.step import closure_for
from torchspeed.train.trial.memory_format import apply_channels_last, to_channels_last

__all__ = ["LOSS_STEPS", "LOSS_TOLERANCE", "loss_check"]

LOSS_STEPS, LOSS_TOLERANCE = 3, 0.05  # the loss check: the first steps of both sides, within 5% of the script's


def _copy_model_and_optimizer(model: nn.Module, opt: torch.optim.Optimizer | None, fused: bool = False,
                              sparse_momentum: bool = False):
    """Copies of the model and its optimizer (same hyper-parameters); `fused`: the optimizer with fused=True;
    `sparse_momentum`: the sparse-gradient weights moved to groups of their own without momentum
    (`train.optim.sparse_without_momentum`, the split fit's own SGD makes)."""
    m2 = copy.deepcopy(model)
    if opt is None:
        return m2, torch.optim.SGD(m2.parameters(), lr=1e-3), "the script's optimizer was not seen: SGD used"
    index = {id(p): i for i, p in enumerate(model.parameters())}
    new_params = list(m2.parameters())
    groups = []
    for g in opt.param_groups:
        params = [new_params[index[id(p)]] for p in g["params"] if id(p) in index]
        if params:
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": params})
    if sparse_momentum:
        groups = sparse_without_momentum(groups, sparse_weights(m2))
    if fused:  # every group and the constructor: torch checks fused/foreach on both
        for g in groups:
            g.update(fused=True, foreach=None)
        return m2, type(opt)(groups, fused=True), ""
    try:
        return m2, type(opt)(groups), ""
    except Exception as e:
        return m2, torch.optim.SGD(m2.parameters(), lr=1e-3), f"{type(opt).__name__} could not be rebuilt ({e}): SGD used"


class _Trainer:
    """One training step on the captured batch, with or without a fix."""

    def __init__(self, cap, *, amp_dtype=None, channels_last=False, set_to_none=True, conv_bias=False,
                 compile_model=False, bf16_math=False, fused_optimizer=False, sparse_momentum=False):
        self.model, self.opt, self.note = _copy_model_and_optimizer(cap.model, cap.optimizer, fused=fused_optimizer,
                                                                    sparse_momentum=sparse_momentum)
        self.device = next(self.model.parameters()).device
        self.args = map_tensors(cap.args, lambda t: t.clone())
        self.kwargs = map_tensors(cap.kwargs or {}, lambda t: t.clone())
        self.loss_module, self.target = cap.loss_module, cap.target
        if conv_bias:
            # the removed biases stay in the optimizer without gradients: it skips them
            remove_conv_bias(self.model, example_input=self.args, example_kwargs=self.kwargs)
        if channels_last:
            apply_channels_last(self.model)
            self.args = map_tensors(self.args, to_channels_last)
            self.kwargs = map_tensors(self.kwargs, to_channels_last)
        if compile_model:
            self.model = torch.compile(self.model)
        self.set_to_none = set_to_none
        self.losses: list[float] = []  # the first LOSS_STEPS steps' losses (`loss_check`)
        dev_type = self.device.type
        self.ctx = (lambda: torch.autocast(dev_type, dtype=amp_dtype)) if amp_dtype is not None else contextlib.nullcontext
        if bf16_math:
            self.ctx = _bf16_math
        self.model.train()

    def forward_backward(self) -> torch.Tensor:
        """Forward (under the candidate's context), loss and backward on the captured batch; the loss."""
        with self.ctx():
            out = call_model(self.model, self.args, self.kwargs)
            if self.loss_module is not None and self.target is not None:
                loss = self.loss_module(out, self.target)
            else:
                loss = generic_loss(out)
        loss.backward()
        return loss

    def step(self) -> None:
        if len(self.losses) >= LOSS_STEPS:
            self._step()
            return
        # the first steps feed the loss check: the same random draws (dropout) on both sides, the caller's kept
        cuda = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(len(self.losses))
            self.losses.append(float(self._step()))

    def _step(self) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=self.set_to_none)
        loss = self.forward_backward()
        # LBFGS's step needs a closure: its line search evaluates the loss again on the same batch
        closure = closure_for(self.opt, loss.detach(), self.forward_backward)
        self.opt.step() if closure is None else self.opt.step(closure)
        return loss.detach()


def loss_check(base: _Trainer, cand: _Trainer, *, tolerance: float = LOSS_TOLERANCE) -> LossCheck:
    """The candidate's losses against the baseline's over their first steps (same weights, same batch, same
    random draws): `ok` when each differs by at most `tolerance` of the baseline's."""
    n = min(len(base.losses), len(cand.losses))
    b, c = base.losses[:n], cand.losses[:n]
    rel = [abs(y - x) / max(abs(x), 1e-8) for x, y in zip(b, c)]
    worst = max(rel) if rel else 0.0
    return {"steps": n, "baseline": [round(x, 6) for x in b], "candidate": [round(y, 6) for y in c],
            "max_rel_diff": round(worst, 5) if math.isfinite(worst) else worst, "tolerance": tolerance,
            "ok": (worst <= tolerance) if n else None}


@contextlib.contextmanager
def _bf16_math():
    """oneDNN fp32 matmuls and convolutions with bf16 inputs and fp32 accumulation, for one step."""
    mk = torch.backends.mkldnn
    saved = (mk.matmul.fp32_precision, mk.conv.fp32_precision)
    mk.matmul.fp32_precision = mk.conv.fp32_precision = "bf16"
    try:
        yield
    finally:
        mk.matmul.fp32_precision, mk.conv.fp32_precision = saved
