"""The settings a switch trial chooses among, and the choice (T18, T21, T23; the trial: switches.py).

`Switches` is one combination (precision, memory layout, optimizer kernel, threads); `candidate_grid` lists the
ones left on "auto" (a pure function of the device's capabilities), `rule_switches` is the fixed rule where no
trial runs, and `choose` picks among measured step times: the fastest, unless one with fewer changes from the
plain settings is within `min_gain`, a change is not sure (`SURE`), or another precision is not `PRECISION_GAIN`
faster (it moves the run's results). `model_signature`/`batch_signature` key the trial cache.

Example:
    >>> candidate_grid(caps=DeviceCaps("cpu", cpu_bf16=True), has_conv=True)[0].label()
    'fp32'
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from torchspeed.env import DeviceCaps
from torchspeed.train.decision import Decision
from torchspeed.train.trial.memory_format import has_conv, has_conv2d
from torchspeed.train.optim import sparse_gradients
from torchspeed.train.optim_info import info_for
from torchspeed.train.trial.precision import normalize_precision
from torchspeed.train.rounds import faster_beyond_chance, medians, share_faster

__all__ = ["Switches", "candidate_grid", "prior_first", "rule_switches", "rule_choice", "autocast_moot",
           "small_products", "small_here", "choose", "numerics_ok", "fusable", "set_fused",
           "model_signature", "batch_signature", "AHEAD", "PRECISION_GAIN", "SURE"]

AHEAD = 1.1  # a candidate timed apart this much faster than the plain settings is likely to win: its turns train
PRECISION_GAIN = AHEAD  # another precision is taken only this much faster than the plain settings' (it moves results)
SURE = 0.75  # a change is taken when it was the faster in this share of its timed steps' pairings with the plain's
# (or, over many steps, faster beyond chance: `rounds.faster_beyond_chance`, a rank test at 5%)
SMALL_PRODUCTS = 1 << 16  # CPU rule: a model whose weight matrices are all this small keeps fp32 (`small_products`)


@dataclass(frozen=True)
class Switches:
    """One combination of the measured switches. `fused`/`threads` None: left as they are."""

    precision: str = "fp32"
    channels_last: bool = False
    fused: bool | None = None
    threads: int | None = None

    def label(self) -> str:
        parts = [self.precision] + (["channels_last"] if self.channels_last else [])
        if self.fused is not None:
            parts.append("fused" if self.fused else "foreach")
        if self.threads is not None:
            parts.append(f"{self.threads} threads")
        return "+".join(parts)

    def changes(self, plain: "Switches") -> int:
        """How many switches differ from `plain` (ties go to fewer changes)."""
        return sum(getattr(self, k) != getattr(plain, k) for k in ("precision", "channels_last", "fused", "threads"))

    def rounds_apart(self, plain: "Switches") -> bool:
        """Whether these settings round otherwise than `plain`'s (precision, layout): a trial times them apart."""
        return self.precision != plain.precision or self.channels_last != plain.channels_last


def fusable(optimizer: torch.optim.Optimizer | None, model: nn.Module | None = None) -> bool:
    """True when `optimizer` has a fused kernel to switch: its row says torch has one (SGD, Adam, AdamW), and
    `model` (when given) makes no sparse gradients, which the fused kernels refuse (`optim.sparse_gradients`)."""
    info = info_for(optimizer)
    return info is not None and info.fusable and "fused" in optimizer.defaults and \
        (model is None or not sparse_gradients(model))


def set_fused(optimizer: torch.optim.Optimizer, fused: bool) -> None:
    """Switch a torch SGD/Adam/AdamW between its fused kernel and the foreach (multi-tensor) path, in place."""
    for group in [optimizer.defaults, *optimizer.param_groups]:
        group["fused"], group["foreach"] = (True, False) if fused else (None, True)
    if hasattr(optimizer, "_step_supports_amp_scaling"):
        optimizer._step_supports_amp_scaling = fused  # a fused step unscales inside its kernel (GradScaler)


def candidate_grid(*, caps: DeviceCaps, has_conv: bool, precision: str = "auto",
                   channels_last: bool | str = "auto", fused: bool | None = None) -> list[Switches]:
    """Stage 1: every precision x memory layout left to choose, plain loop first (pure function)."""
    ps = [precision] if precision != "auto" else ["fp32"] + ([caps.half] if caps.half else [])
    layouts = [bool(channels_last)] if channels_last != "auto" else [False, True] if has_conv else [False]
    return [Switches(p, cl, fused) for p in ps for cl in layouts]


def prior_first(grid: list[Switches], prior: Switches) -> list[Switches]:
    """`grid` with the plain settings first, then the rules' own choice (`prior`), then the others by how few
    switches they differ from it in (grid order on ties). A run that cannot afford every candidate tries them in
    this order, as many as it affords (`switches.LiveTrial._price`): the likeliest winner first."""
    rest = sorted(grid[1:], key=lambda s: (s.changes(prior), grid.index(s)))
    return grid[:1] + rest


def small_products(model: nn.Module) -> str | None:
    """Why bf16 would not pay for `model` on a CPU: no convolution (1D, 2D or 3D) and no weight matrix over
    `SMALL_PRODUCTS` elements (an embedding's own table aside: a lookup, not a product); None otherwise. Measured
    on a 2-core Zen 4 (AVX512-BF16, benchmarks/bench_bf16_sizes.py): a 3-layer MLP's step in bf16 autocast against
    fp32 at widths 64 / 128 / 256 was 0.47x / 0.48x / 0.67x at batch 32 and 0.67x / 0.82x / 1.01x at batch 256;
    at width 512 (262,144 elements) 0.87x and 1.31x. Autocast casts each weight every forward: a small product's
    cast costs what bf16 saves."""
    params = [(m, p) for m in model.modules() for p in m.parameters(recurse=False)]
    if has_conv(model) or any(is_lazy(p) for _, p in params):
        return None  # a convolution's rows are batch x positions; a lazy module's size is not known yet
    sizes = [p.numel() for m, p in params if not isinstance(m, (nn.Embedding, nn.EmbeddingBag))
             and p.ndim == 2 and p.is_floating_point()]
    if not sizes or max(sizes) > SMALL_PRODUCTS:
        return None
    return (f"the model's largest weight matrix has {max(sizes):,} elements (<= {SMALL_PRODUCTS:,}) and no "
            "convolution: products this small lose more to bf16's casts than they gain on the CPU")


def small_here(model: nn.Module, caps: DeviceCaps) -> str | None:
    """`small_products(model)` where the rule reads it: a CPU with a native half precision; else None."""
    return small_products(model) if caps.device_type == "cpu" and caps.half else None


def rule_switches(*, caps: DeviceCaps, has_conv: bool, precision: str = "auto", channels_last: bool | str = "auto",
                  fused: bool | None = None, small: str | None = None) -> Switches:
    """The fixed rules, used when no trial runs: the native half precision (on a CPU not for a model whose products
    are small: `small`, from `small_products`), channels_last for conv nets."""
    p = (caps.half or "fp32") if precision == "auto" else precision
    if precision == "auto" and small and caps.device_type == "cpu":
        p = "fp32"
    cl = has_conv if channels_last == "auto" else bool(channels_last)
    return Switches(p, cl, fused)


def numerics_ok(reference_loss: float, loss: float, *, tol: float) -> bool:
    """A candidate's loss at the same weights on the same batch is within `tol` (relative) of fp32's."""
    if not (loss == loss) or abs(loss) == float("inf"):  # NaN or inf
        return False
    return abs(loss - reference_loss) <= tol * abs(reference_loss) + 1e-4


def choose(times: dict[Switches, list[float]], *, plain: Switches, min_gain: float = 1.02,
           rejected: dict[Switches, str] | None = None, ref: str = "the plain settings") -> tuple[Switches, str]:
    """The fastest candidate (median seconds per step), or one with fewer changes from `plain` (called `ref` in
    the reason) within `min_gain` of it. A change must also be sure: faster in SURE of the pairings of its timed
    steps with the plain settings' (`rounds.share_faster`), or, with 4 or more a side, faster beyond chance
    (`rounds.faster_beyond_chance`: on noisy steps a real gain wins fewer pairings however many are timed, and a
    choice pooled over runs has many); another precision, PRECISION_GAIN faster on any run
    (it moves the results; docs/train.md, "Choice"), a few percent do not buy it."""
    rejected = rejected or {}
    med = medians({s: t for s, t in times.items() if s not in rejected})
    if not med:
        return plain, f"no candidate could be measured: kept {ref}"
    fastest, base = min(med, key=med.get), times.get(plain) if plain in med else None
    unsure = {s: v for s in med if base and s != plain and (v := share_faster(times[s], base)) < SURE
              and not faster_beyond_chance(times[s], base)}
    small = {s for s in med if s.precision != plain.precision and plain in med
             and med[plain] < med[s] * PRECISION_GAIN}
    sure = {s: m for s, m in med.items() if s not in unsure and s not in small}
    best = min(sure, key=sure.get)
    pick = min([s for s in sure if sure[s] <= sure[best] * min_gain], key=lambda s: (s.changes(plain), med[s]))
    if pick == plain:
        why = f"{ref} measured fastest" if fastest == plain else (
            f"{fastest.label()} measured {med[plain] / med[fastest]:.2f}x {ref} but was the faster in only "
            f"{unsure[fastest]:.1%} of the pairings of its timed steps with theirs (< {SURE:.0%}), not beyond "
            "chance: not sure enough for a change") if fastest in unsure else (
            f"{fastest.label()} measured only {med[plain] / med[fastest]:.2f}x {ref} (< {PRECISION_GAIN}x for "
            "another precision, which moves the run's results): not worth a change") if fastest in small else (
            f"{best.label()} was only {med[plain] / med[best]:.2f}x {ref} (< {min_gain}x): not worth a change")
    else:
        why = f"{med[plain] / med[pick]:.2f}x {ref} ({plain.label()})" if plain in med else "fastest measured"
    return pick, why


def model_signature(model: nn.Module) -> dict:
    """What identifies a model for the trial cache: its class and parameter shapes and dtypes."""
    shapes = [[n, list(p.shape), str(p.dtype)] for n, p in model.named_parameters()]
    return {"class": f"{type(model).__module__}.{type(model).__qualname__}", "params": shapes,
            "conv2d": has_conv2d(model)}


def batch_signature(batch) -> object:
    """Shapes and dtypes of a batch's tensors (nested), for the trial cache."""
    if isinstance(batch, torch.Tensor):
        return [list(batch.shape), str(batch.dtype)]
    if isinstance(batch, dict):
        return {k: batch_signature(v) for k, v in sorted(batch.items())}
    if isinstance(batch, (list, tuple)):
        return [batch_signature(b) for b in batch]
    return type(batch).__name__


def autocast_moot(model: nn.Module) -> str | None:
    """Why a half-precision autocast would change nothing in `model`: it has floating-point weights and none is
    float32 (a float64 model; one cast to bf16 or fp16 already): autocast casts float32 operations only, so a half
    precision candidate would time the same work twice. None: autocast applies."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if not dtypes or torch.float32 in dtypes:
        return None
    names = ", ".join(sorted(str(d).replace("torch.", "") for d in dtypes))
    return f"the model's weights are {names}: autocast casts float32 operations only"


def rule_choice(model: nn.Module, *, caps: DeviceCaps, precision: str = "auto",
                channels_last: bool | str = "auto") -> tuple[Switches, dict[str, Decision]]:
    """The fixed rules' precision and layout, with their decisions: what the loop runs until (or unless)
    the trial measures. bf16/fp16 where the hardware runs it natively (not for a model autocast cannot change:
    `autocast_moot`); channels_last for conv nets."""
    key = normalize_precision(precision)
    moot = autocast_moot(model) if key == "auto" else None
    small = small_here(model, caps) if key == "auto" else None
    sw = rule_switches(caps=caps, has_conv=has_conv2d(model), precision="fp32" if moot else key,
                       channels_last=channels_last, small=small)
    half_why = {"bf16": f"{caps.device_type.upper()} runs bf16 natively", "fp16": "fp16 Tensor Cores, no fast bf16",
                "fp32": moot or small or f"no native half precision on this {caps.device_type.upper()}"}[sw.precision]
    return sw, {"precision": Decision(sw.precision, "asked for" if key != "auto" else f"rule: {half_why}"),
                "channels_last": Decision(sw.channels_last, "asked for" if channels_last != "auto" else (
                    "rule: a conv net" if sw.channels_last else "rule: no 2D convolutions"))}
