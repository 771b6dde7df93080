"""Where the model's forward and backward time goes by kind of kernel (T25, T21, T39), from the profiler.

The captured model (a copy) runs a few training steps on its captured batch under
`torch.profiler`, after untimed warm-up steps; each aten operator's self time is put in one of
three groups: matrix products and convolutions (what bf16 math and autocast speed up), element-wise
operators (activations, adds, multiplies, their backward, and the mean/var of hand-written
normalisations: what `torch.compile` fuses into fewer passes over memory), and the rest. Backward
starts from a tensor of ones at the model's output, so no stand-in loss adds kernels of its own. The shares are of the aten self time, so Python and autograd
overhead do not dilute them.

Layout copies (T39) are counted apart too: the self time of the copies that `contiguous`, `reshape` and `flatten`
make of a permuted or transposed tensor (a copy kernel with one of them above it in the profiler's tree), as
an eager `einops.rearrange` does. Compiled, such a copy is folded into the kernel that reads it.

The profiler runs with kineto's log switched off (`quiet_kineto`), so its start and stop lines do not land in
the script's output, whose last lines the report shows.

Each operator's time is its smallest over the profiled steps, not the sum: the profiler times wall
clock, so when the rest of the machine preempts a step (a scheduler tick of 4 ms), the lost time lands
on whichever operator was running, and on a loaded machine one such tick in a 2.5 ms step of an MLP
carried a ReLU to half of the step and the matrix products from 84% to a third. Preemption only adds
time, and the same operator is rarely hit in every step.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
from bisect import bisect_right
from collections import defaultdict

import torch

from torchspeed.doctor._capture import Captured
from torchspeed.doctor._tree import call_model, generic_loss, map_tensors

__all__ = ["profile_kernels", "kernel_kind", "step_op_times", "fastest_op_times", "quiet_kineto",
           "layout_copy_times"]

_STEP = "torchspeed::kernel_step"  # the profiler range around each profiled step
KINETO_ENV, KINETO_QUIET = "KINETO_LOG_LEVEL", "6"  # above every level kineto logs at (USDT prints at 5)

_MATMUL = re.compile(r"^aten::(mm|addmm|bmm|baddbmm|addbmm|matmul|_?convolution|mkldnn_convolution|"
                     r"convolution_backward|_?mkldnn_.*linear.*|_scaled_dot_product.*|_efficient_attention.*|"
                     r"_flash_attention.*|cudnn_convolution.*|_slow_conv2d.*|thnn_conv.*)$")
_ELEMENTWISE = re.compile(
    r"^aten::(add|add_|sub|sub_|mul|mul_|div|div_|neg|pow|sqrt|rsqrt|exp|log|abs|sign|clamp|clamp_|clamp_min|"
    r"clamp_max|where|relu|relu_|threshold_backward|gelu|gelu_backward|silu|silu_|silu_backward|sigmoid|"
    r"sigmoid_backward|tanh|tanh_backward|hardtanh|hardtanh_backward|leaky_relu|leaky_relu_backward|elu|"
    r"elu_backward|softplus|softplus_backward|mish|mish_backward|hardswish|hardswish_backward|square|"
    r"reciprocal|erf|sin|cos|maximum|minimum|addcmul|addcdiv|lerp|masked_fill|masked_fill_|"
    r"native_dropout|native_dropout_backward|fill_|zero_|copy_|_to_copy|pow_|exp_|mul_out|add_out|"
    r"var|var_mean|std|std_mean|mean)$")  # reductions in hand-written normalisations: compile fuses them too


def kernel_kind(name: str) -> str:
    """'matmul' (matrix products, convolutions), 'elementwise' or 'other' for an aten operator name."""
    if _MATMUL.match(name):
        return "matmul"
    if _ELEMENTWISE.match(name):
        return "elementwise"
    return "other"


def _steps_of(events, mark: str):
    """(the number of profiled steps, `step_of`): `step_of(event)` is the index of the step whose `mark` range (a
    `record_function`) the event starts in, or None (in none). Without marks, all events form one step."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == mark)
    if not spans:
        return 1, lambda e: 0
    starts = [s for s, _ in spans]

    def step_of(e) -> int | None:
        i = bisect_right(starts, e.time_range.start) - 1
        return i if i >= 0 and e.time_range.start <= spans[i][1] else None
    return len(spans), step_of


def step_op_times(events, mark: str = _STEP) -> list[dict[str, float]]:
    """aten self time (us) by operator, one dict per profiled step: each operator event belongs to the
    step whose `mark` range (a `record_function`) it starts in. Without marks, all events form one step."""
    n, step_of = _steps_of(events, mark)
    out: list[dict[str, float]] = [defaultdict(float) for _ in range(n)]
    for e in events:
        if e.name.startswith("aten::") and (i := step_of(e)) is not None:
            out[i][e.name] += e.self_cpu_time_total
    return out


_COPY = ("aten::copy_", "aten::clone", "aten::empty_like", "aten::empty_strided")  # a copy's own kernels
_LAYOUT = ("aten::contiguous", "aten::reshape", "aten::flatten")  # the calls that copy a permuted tensor


def _under_layout_call(e) -> bool:
    parent = e.cpu_parent
    while parent is not None and parent.name not in _LAYOUT:
        parent = parent.cpu_parent
    return parent is not None


def layout_copy_times(events, mark: str = _STEP) -> list[float]:
    """Per profiled step, the self time (us) of the copy kernels under a `contiguous`, `reshape` or `flatten`
    call: the copies a permuted or transposed tensor costs where the next operator wants it contiguous."""
    n, step_of = _steps_of(events, mark)
    out = [0.0] * n
    for e in events:
        if e.name in _COPY and _under_layout_call(e) and (i := step_of(e)) is not None:
            out[i] += e.self_cpu_time_total
    return out


def matmul_calls(events) -> int:
    """The matrix products and convolutions the events ran: each call once (an `aten::matmul` that calls
    `aten::mm` is one)."""
    def is_mm(e) -> bool:
        return e.name.startswith("aten::") and kernel_kind(e.name) == "matmul"
    return sum(1 for e in events if is_mm(e) and not any(is_mm(c) for c in (e.cpu_children or ())))


def fastest_op_times(per_step: list[dict[str, float]]) -> dict[str, float]:
    """Each operator's smallest time over the steps it ran in: preemption only adds time, so the
    smallest reading is the one with the least of the rest of the machine in it."""
    names = {n for ops in per_step for n in ops}
    return {n: min(ops[n] for ops in per_step if n in ops) for n in names}


@contextlib.contextmanager
def quiet_kineto(environ=None):
    """KINETO_LOG_LEVEL=6 (nothing) while the doctor's profiler starts, unless the user set it: kineto reads it when
    it first starts, in this process, and would otherwise print its log lines (`USDT:... profiler_start`) into the
    script's output, where the report shows the last lines the script printed."""
    environ = os.environ if environ is None else environ
    if KINETO_ENV in environ:
        yield
        return
    environ[KINETO_ENV] = KINETO_QUIET
    try:
        yield
    finally:
        environ.pop(KINETO_ENV, None)


def profile_kernels(cap: Captured, obs: dict, *, steps: int = 3, warmup: int = 2) -> None:
    """Record `obs["kernels"]`: the matmul/conv and element-wise shares of forward + backward time."""
    if cap.model is None or cap.args is None:
        return
    try:
        model = copy.deepcopy(cap.model).train()
        args = map_tensors(cap.args, lambda t: t.clone())
        kwargs = map_tensors(cap.kwargs or {}, lambda t: t.clone())

        def step():
            out = call_model(model, args, kwargs)
            if isinstance(out, torch.Tensor) and out.dim() > 0 and out.requires_grad:
                out.backward(torch.ones_like(out))  # the model's own kernels only, no stand-in loss
            else:
                generic_loss(out).backward()  # the model returns its loss: that is the script's too
            model.zero_grad(set_to_none=True)

        for _ in range(warmup):
            step()
        from torch.profiler import ProfilerActivity, profile, record_function
        with quiet_kineto(), profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                with record_function(_STEP):
                    step()
        events = prof.events()
        ops = fastest_op_times(step_op_times(events))
        layout_us = min(layout_copy_times(events))  # the least preempted step, as for the operators
    except Exception as e:  # a model the profiler cannot run: skip the kernel-based rules
        obs["notes"].append(f"profiling the model failed ({type(e).__name__}: {e}); kernel shares skipped")
        return
    total = sum(ops.values()) or 1e-9
    calls = matmul_calls(events) / max(steps, 1)
    by_kind = {"matmul": 0.0, "elementwise": 0.0, "other": 0.0}
    for name, t in ops.items():
        by_kind[kernel_kind(name)] += t
    top = sorted(ops.items(), key=lambda kv: -kv[1])[:6]
    obs["kernels"] = {"matmul_share": round(by_kind["matmul"] / total, 4),
                      "elementwise_share": round(by_kind["elementwise"] / total, 4),
                      "layout_share": round(min(layout_us, total) / total, 4),
                      "ms_per_step": round(total / 1e3, 4),
                      "matmul_us_per_call": round(by_kind["matmul"] / calls, 2) if calls else None,
                      "top": [f"{n.removeprefix('aten::')} {t / total:.0%}" for n, t in top]}
