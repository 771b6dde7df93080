"""Optimizers by name, with fused kernels, and the cheap zero_grad (T18, T26, T42).

- One row per optimizer (`torchspeed.train.optim_info.OptimInfo`; the rows are at the end of this module):
  its class, weight-decay default, LR-for-batch rule, fused kernel, momentum/betas, Schedule-Free flag,
  default LR and extra. `create_optimizer`, `lr_rule`, `default_weight_decay` and the fused switch read it.
- `create_optimizer("sgd" | "adamw" | "lamb" | "lars" | "muon" | "schedulefree" | "adam" | ..., model, lr=...)`:
  SGD with Nesterov momentum, AdamW (decoupled weight decay), torch's Adam, NAdam and RAdam, and timm's LAMB
  and LARS for large batches (timm's implementations are maintained and tested; we do not rewrite them: the
  `timm` extra). Bias and normalisation parameters get no weight decay (`param_groups`, the
  rule of timm's `param_groups_weight_decay`, here so that SGD/AdamW need no timm).
- "muon" (T42): torch's `torch.optim.Muon` for the hidden weight matrices and AdamW for
  everything else (embeddings, the output head, biases, norms, conv kernels), as one
  optimizer (`MuonAdamW`, muon.py) that schedulers, clipping, GradScaler and checkpoints use like any
  other. `hidden_matrices` says which parameters are hidden matrices (2-D weights that are
  not an `nn.Embedding`'s and not the output head's: the last `nn.Linear`, or one tied to an
  embedding); `mostly_matrices` says whether they hold most of the model's weights (where
  Muon is worth a trial: `torchspeed.tune.optimizer_trial.compare_optimizers`). Muon runs
  with `adjust_lr_fn="match_rms_adamw"`, which scales each matrix's update to AdamW's size, so
  one learning rate (and weight decay) serves both parts and a scheduler drives both.
- `fused="auto"` asks torch for its fused kernel (one kernel for all parameters) where the
  optimizer and device have one (SGD/Adam/AdamW on CPU and CUDA), else the foreach
  (multi-tensor) path. Fused SGD measured about +8% step throughput on a 2-core CPU.
  `fused="default"`: torch's own choice, a script's `AdamW(params, lr=...)` (a run given its LR: `kernel_reason`).
- Weight decay defaults per optimizer (the rows; used when `weight_decay=None`): SGD and LARS 5e-4,
  AdamW 0.05, LAMB 0.02, torch's Adam family 0.
- `zero_grad(optimizer)` (optim_kernel.py, with the fused-or-foreach choice) sets gradients to None (T26): no
  memset kernel per parameter, backward writes them.

Example:
    >>> opt = create_optimizer("sgd", model, lr=0.1, momentum=0.9, weight_decay=5e-4)
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from torchspeed.train.muon import MuonAdamW
from torchspeed.train.optim_kernel import _device_of, _fused_or_foreach
from torchspeed.train.decision import Decision
from torchspeed.train.optim_info import (OptimInfo, kernel_reason, optimizer_available, optimizer_info,
                                        register_optimizer)

__all__ = ["create_optimizer", "param_groups", "describe_optimizer", "optimizer_record", "SCHEDULE_FREE_LR",
           "typical_fan_in", "sparse_weights", "sparse_without_momentum", "schedule_free_lr", "has_attention",
           "weight_layers",
           "schedule_free_available", "set_schedule_free_warmup", "trains_iterate", "train_mode", "eval_mode",
           "SCHEDULE_FREE_BN_BATCHES",
           "SCHEDULE_FREE_BN_SAMPLES", "hidden_matrices", "matrix_share", "mostly_matrices"]


def schedule_free_available() -> bool:
    """Whether the `schedulefree` package (the extra `torchspeed[schedulefree]`) is installed."""
    return optimizer_available("schedulefree")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: weights with decay, biases and 1-D (norm) parameters without.

    The same groups, in the same order, as timm's `param_groups_weight_decay` (no decay first). The weight of a
    sparse embedding (`sparse=True`) is not decayed either: torch's optimizers cannot add a dense decay to a sparse
    gradient (`add(sparse, dense) is not supported`).
    """
    if weight_decay == 0:
        return [{"params": [p for p in model.parameters() if p.requires_grad]}]
    sparse = sparse_weights(model)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim <= 1 or name.endswith(".bias") or id(p) in sparse else decay).append(p)
    return [{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": weight_decay}]


def sparse_weights(model: nn.Module) -> set[int]:
    """The ids of the weights that get sparse gradients: those of `nn.Embedding` / `nn.EmbeddingBag(sparse=True)`."""
    return {id(m.weight) for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse}


def sparse_gradients(model: nn.Module) -> bool:
    """Whether `model` makes sparse gradients (an `nn.Embedding` or `nn.EmbeddingBag` with `sparse=True`): torch's
    fused SGD kernel refuses them (Adam's refuse them on every path), so such a model keeps the for-loop path."""
    return bool(sparse_weights(model))


def create_optimizer(name: str, model: nn.Module, *, lr: float, weight_decay: float | None = 0.0,
                     momentum: float = 0.9, nesterov: bool = True, betas: tuple[float, float] = (0.9, 0.999),
                     fused: bool | str = "auto") -> torch.optim.Optimizer:
    """Build optimizer `name` (a row of `OPTIM_INFO`) over `model`'s trainable parameters (`weight_decay=None`:
    its default).

    `momentum` and `nesterov` are SGD's and LARS's; `betas` are AdamW's and LAMB's (and the AdamW part of "muon",
    whose Muon part keeps momentum 0.95 with Nesterov).
    """
    info = optimizer_info(name)
    if weight_decay is None:
        weight_decay = info.weight_decay
    kw = info.kwargs(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, betas=betas)
    if info.build is not None:
        return info.build(model, fused=fused, **kw)
    groups = param_groups(model, weight_decay)
    cls = info.resolve()
    sparse = sparse_weights(model)
    if fused == "auto" and sparse:
        fused = False  # the for-loop path: the one that takes sparse gradients, as a script's torch.optim.SGD does
    if kw.get("momentum") and sparse:
        groups = sparse_without_momentum(groups, sparse)
    if info.fusable:
        return _fused_or_foreach(cls, groups, kw, fused, shards=info.fused_shards)
    return cls(groups, **kw)


def sparse_without_momentum(groups: list[dict], sparse: set[int]) -> list[dict]:
    """`groups` with the sparse embeddings' weights moved to a group of their own without momentum. torch's SGD keeps
    a sparse gradient's momentum buffer sparse and never coalesces it (`buf.mul_(m).add_(grad)` appends the step's
    rows), so each step costs more than the last: on the zoo's `EmbeddingBag(sparse=True)` text classifier, 400 steps
    of auto's SGD went from 0.7-1.0 ms to 4.6-6.8 ms a step, 1.07-1.39 s in all, against 0.16-0.18 s without
    (docs/train.md, "A sparse embedding"). A script's sparse embedding trains with plain SGD, SparseAdam or Adagrad;
    this group is plain SGD with the settings of the group it came from (the run's LR), one such group per group that
    held sparse weights (none where the embedding is frozen), after the others. The doctor's `--verify` rebuilds a
    script's SGD with it (rule sparse-momentum's fix)."""
    dense = [dict(g, params=[p for p in g["params"] if id(p) not in sparse]) for g in groups]
    plain = [dict(g, params=rows, weight_decay=0.0, momentum=0.0, nesterov=False) for g in groups
             if (rows := [p for p in g["params"] if id(p) in sparse])]
    return [g for g in dense if g["params"]] + plain


def describe_optimizer(opt: torch.optim.Optimizer) -> str:
    """e.g. "SGD (fused)": the optimizer class and its kernel (fused, foreach or for-loop)."""
    if isinstance(opt, MuonAdamW):
        return opt.describe()
    d = opt.defaults
    kind = "fused" if d.get("fused") else "foreach" if d.get("foreach") else "for-loop"
    if d.get("fused") is None and d.get("foreach") is None and _device_of(opt.param_groups).type not in ("cpu", "meta"):
        kind = "torch's default: foreach"  # torch picks the foreach path on an accelerator when neither is set
    return f"{type(opt).__name__} ({kind})"


def optimizer_record(opt: torch.optim.Optimizer, fused_option) -> Decision:
    """decisions["optimizer"] for the optimizer a run trains with, where no stage chose it: its class and kernel,
    and why that kernel (`fused_optimizer`'s setting)."""
    return Decision(describe_optimizer(opt), kernel_reason(fused_option))


# --- Muon for the hidden matrices, AdamW for the rest (T42) ---------------------------------------------------


def _embedding_weights(model: nn.Module) -> set[int]:
    """ids of the embeddings' weights (`nn.Embedding`, `nn.EmbeddingBag`): lookups, not matrices applied to inputs."""
    return {id(m.weight) for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))}


def _head_weights(model: nn.Module) -> set[int]:
    """ids of the output head's weights: the last nn.Linear's, and any Linear weight tied to an embedding."""
    embeddings = _embedding_weights(model)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    heads = {id(m.weight) for m in linears if id(m.weight) in embeddings}
    if linears:
        heads.add(id(linears[-1].weight))
    return heads


def hidden_matrices(model: nn.Module) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
    """(hidden, other): trainable parameters Muon should take, and those AdamW should, as (name, parameter).

    Hidden = 2-D weights that are not an embedding's (`nn.Embedding`, `nn.EmbeddingBag`) and not the
    output head's (the last `nn.Linear` registered in the model, so define the head last, or a Linear
    whose weight is tied to an embedding).
    Everything else (embeddings, the head, biases, norm weights, conv kernels of 3 or more dims) is other.
    A parameter shared by several modules is listed once.
    """
    embeddings = _embedding_weights(model)
    excluded = embeddings | _head_weights(model)
    hidden, other = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (hidden if p.ndim == 2 and id(p) not in excluded else other).append((name, p))
    return hidden, other


def matrix_share(model: nn.Module) -> float:
    """The fraction of the model's trainable weights (by element count) in hidden matrices (see `hidden_matrices`)."""
    hidden, other = hidden_matrices(model)
    n_hidden = sum(p.numel() for _, p in hidden)
    total = n_hidden + sum(p.numel() for _, p in other)
    return n_hidden / total if total else 0.0


def mostly_matrices(model: nn.Module, threshold: float = 0.5) -> bool:
    """True when hidden matrices hold more than `threshold` of the weights: Muon is worth a trial (T42)."""
    return matrix_share(model) > threshold


def _muon_adamw(model: nn.Module, *, lr: float, weight_decay: float, betas, fused) -> MuonAdamW:
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        raise ValueError("optimizer='muon' needs whole weight matrices (its Newton-Schulz step), not FSDP2 "
                         "shards; use optimizer='adamw' with parallel='fsdp2', or parallel='ddp' with 'muon'")
    hidden, other = hidden_matrices(model)
    if not hidden:
        raise ValueError(f"optimizer='muon': {type(model).__name__} has no hidden 2-D weight matrices (Muon takes "
                         "the weights of nn.Linear layers between the input and the output head; conv kernels, "
                         "embeddings, the head, biases and norms go to AdamW); use optimizer='adamw'")
    decay = [p for n, p in other if not (p.ndim <= 1 or n.endswith(".bias"))]
    no_decay = [p for n, p in other if p.ndim <= 1 or n.endswith(".bias")]
    groups = ([{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": weight_decay}]
              if weight_decay else [{"params": no_decay + decay}])
    return MuonAdamW([p for _, p in hidden], groups, lr=lr, weight_decay=weight_decay, betas=betas, fused=fused)


def is_schedule_free(optimizer) -> bool:
    """A Schedule-Free optimizer (`schedulefree`): .train()/.eval() around training and evaluation, no schedule."""
    return callable(getattr(optimizer, "eval", None)) and "train_mode" in getattr(optimizer, "defaults", {})


def trains_iterate(optimizer) -> bool:
    """A Schedule-Free optimizer in train mode: the model holds its training iterate, not its averaged weights."""
    return is_schedule_free(optimizer) and optimizer.param_groups[0].get("train_mode", False)


SCHEDULE_FREE_BN_BATCHES = 8  # the last training batches BatchNorm is recalibrated on for the averaged weights...
SCHEDULE_FREE_BN_SAMPLES = 256  # ...the newest holding this many (settles each channel's statistics; 4 batches of 64)


def set_schedule_free_warmup(optimizer, total_steps: int | None, warmup_steps: int | None = None) -> int:
    """Give a Schedule-Free optimizer its warm-up: `warmup_steps`, else a twentieth of the run (of 100 steps when
    its length is unknown), at least 1. Returns the warm-up."""
    warm = warmup_steps if warmup_steps is not None else max(1, (total_steps or 100) // 20)
    for g in optimizer.param_groups:
        g["warmup_steps"] = warm
    return warm


def train_mode(optimizer) -> None:
    """A Schedule-Free optimizer to train mode (the model holds its training iterate; it steps only in this mode);
    another optimizer, or one in train mode already: nothing. The one home of Schedule-Free's modes, with
    `eval_mode` and `averaged_weights`."""
    if is_schedule_free(optimizer) and not trains_iterate(optimizer):
        optimizer.train()


def eval_mode(optimizer) -> bool:
    """A Schedule-Free optimizer in train mode to eval mode (the model holds its averaged weights); returns whether
    it switched."""
    if not trains_iterate(optimizer):
        return False
    optimizer.eval()
    return True


@contextlib.contextmanager
def averaged_weights(optimizer):
    """Inside the block a Schedule-Free optimizer's model holds its averaged weights (evaluated and saved), after it the
    training iterate. Another optimizer, or one in eval mode already (a fit's end): nothing. Yields if it switched."""
    if not eval_mode(optimizer):
        yield False
        return
    try:
        yield True
    finally:
        train_mode(optimizer)


# --- One row per optimizer (T18, T42) ---------------------------------------------------------------------------
# Weight decay: SGD and LARS 5e-4 (the ResNet convention); AdamW 0.05 and LAMB 0.02 (timm's: decoupled decay is
# multiplied by the LR, so it needs a larger value); Muon with match_rms_adamw reuses AdamW's (Liu et al. 2025,
# "Muon is Scalable"). FSDP2's DTensor shards have no fused-SGD kernel (AdamW's works).
# The default LR (what a run that names the optimizer and no LR trains at, the peak of its one-cycle): SGD's 0.1 (the
# ResNet convention), the Adam family's and LAMB's own 1e-3 (torch's and timm's defaults; NAdam's 2e-3), Muon's 1e-3
# (match_rms_adamw scales its update to AdamW's, so AdamW's LR carries over), LARS's 0.1 (SGD-like with its trust
# ratio), Schedule-Free AdamW's own 0.0025.
for _info in (
    OptimInfo("sgd", torch.optim.SGD, 5e-4, fusable=True, fused_shards=False, momentum=True, nesterov=True,
              default_lr=0.1),
    OptimInfo("adamw", torch.optim.AdamW, 0.05, "sqrt", fusable=True, betas=True, default_lr=1e-3),
    OptimInfo("lamb", "timm.optim:Lamb", 0.02, "sqrt", betas=True, default_lr=1e-3, extra="timm"),
    OptimInfo("lars", "timm.optim:Lars", 5e-4, momentum=True, default_lr=0.1, extra="timm"),
    OptimInfo("muon", MuonAdamW, 0.05, "sqrt", betas=True, default_lr=1e-3, build=_muon_adamw),
    # Schedule-Free AdamW (Defazio et al. 2024): no LR schedule, its warm-up set by the Trainer; 0.0025 is its own
    OptimInfo("schedulefree", "schedulefree:AdamWScheduleFree", 0.05, "sqrt", betas=True, schedule_free=True,
              default_lr=0.0025, extra="schedulefree"),
    OptimInfo("adam", torch.optim.Adam, 0.0, "sqrt", fusable=True, betas=True, default_lr=1e-3),
    OptimInfo("nadam", torch.optim.NAdam, 0.0, "sqrt", betas=True, default_lr=2e-3),
    OptimInfo("radam", torch.optim.RAdam, 0.0, "sqrt", betas=True, default_lr=1e-3),
):
    register_optimizer(_info)
del _info
SCHEDULE_FREE_LR = optimizer_info("schedulefree").default_lr  # Schedule-Free AdamW's own default LR


# Schedule-Free AdamW's default LR was tuned on AlgoPerf's workloads (ResNet-50, ViT, Conformer, the WMT transformer,
# U-Net, DLRM, GNN), whose weight matrices mostly take 512 inputs or more: a model as wide keeps it. Adam's best LR
# for a hidden matrix grows as its fan-in shrinks (muP: 1 / fan-in, Yang et al. 2022), so a narrower model's prior is
# scaled up by (512 / fan-in) ** power. Two classes, measured (benchmarks/bench_sf_lr.py, docs/recipe.md):
# - attention or LayerNorm/RMSNorm (a transformer): power 1, at most 4x. Twice that lost accuracy on a 64-wide ViT,
#   and 4x that diverged;
# - neither (MLPs, CNNs, RNNs): power 2, at most 16x (reached at fan-in 128), times sqrt(SF_REF_DEPTH / depth) where
#   the model has more weight layers than SF_REF_DEPTH (Adam's LR for a deep residual stack goes as 1 / sqrt(depth):
#   depth-muP, Yang et al. 2023). Models of fan-in 64-100 were fastest at 16x; a 512-wide MLP overfit at 4x (2048 /
#   fan-in, the rule before), peaking under its plain loop's accuracy on 2-3 seeds of 5, where 1x reached it on all.
SF_REF_FAN_IN = 512
SF_MAX_SCALE = 4.0
SF_PLAIN_POWER = 2.0
SF_MAX_SCALE_PLAIN = 16.0
SF_REF_DEPTH = 5  # the deepest of the models the plain rule was measured on (weight layers)
_ATTENTION_WORDS = ("attention", "attn", "layernorm", "rmsnorm", "transformer")


def has_attention(model: nn.Module) -> bool:
    """Whether `model` looks like a transformer: an attention module or a LayerNorm/RMSNorm, by type or by class
    name (a model's own `CausalSelfAttention`, `RMSNorm`)."""
    kinds = (nn.MultiheadAttention, nn.LayerNorm, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer,
             *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()))
    return any(isinstance(m, kinds) or any(w in type(m).__name__.lower() for w in _ATTENTION_WORDS)
               for m in model.modules())


def _weight_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The trainable weights of 2 or more dims, embeddings excepted (a lookup has no fan-in); a shared one once."""
    embeddings = _embedding_weights(model)
    return [p for p in model.parameters() if p.requires_grad and p.ndim >= 2 and id(p) not in embeddings]


def typical_fan_in(model: nn.Module) -> int | None:
    """The fan-in (inputs per output unit: a Linear's in_features, a conv's in_channels x kernel size) of the
    model's weights, the median by element count over its trainable weights of 2 or more dims, embeddings
    excepted (a lookup has no fan-in). None: no such weight."""
    fans = [(p.numel() // p.shape[0], p.numel()) for p in _weight_matrices(model) if p.shape[0]]
    if not fans:
        return None
    fans.sort()
    half, acc = sum(n for _, n in fans) / 2, 0
    for fan, n in fans:
        acc += n
        if acc >= half:
            return fan
    return fans[-1][0]


def weight_layers(model: nn.Module) -> int:
    """The model's depth in weight layers: its trainable weights of 2 or more dims, embeddings excepted."""
    return len(_weight_matrices(model))


def schedule_free_lr(model: nn.Module) -> tuple[float, str]:
    """Schedule-Free AdamW's LR for `model` when nothing measured one, and why: its default x (SF_REF_FAN_IN / the
    typical fan-in) ** power, at least 1x; a transformer: power 1, at most SF_MAX_SCALE x; else SF_PLAIN_POWER, at
    most SF_MAX_SCALE_PLAIN x, times sqrt(SF_REF_DEPTH / depth) for a model deeper than SF_REF_DEPTH weight layers."""
    fan = typical_fan_in(model)
    attention = has_attention(model)
    power, most = (1.0, SF_MAX_SCALE) if attention else (SF_PLAIN_POWER, SF_MAX_SCALE_PLAIN)
    depth = weight_layers(model)
    deep = not attention and depth > SF_REF_DEPTH
    wide = 1.0 if fan is None else max(1.0, min(most, (SF_REF_FAN_IN / max(fan, 1)) ** power))
    scale = max(1.0, wide * (math.sqrt(SF_REF_DEPTH / depth) if deep else 1.0))
    if scale == 1.0:  # as wide as the models it was tuned on, or so deep that depth takes back what width gave
        why = (f"its {depth} weight layers take back the {wide:.2g}x its fan-in {fan} gives (depth-muP)" if wide > 1
               else f"the weights' typical fan-in {fan} is as wide as those it was tuned on")
        return SCHEDULE_FREE_LR, (f"Schedule-Free AdamW's default LR ({why})" if fan is not None
                                  else "Schedule-Free AdamW's default LR")
    kind = ("attention or LayerNorm: x 512 / fan-in, at most 4x" if attention else
            "no attention or LayerNorm: x (512 / fan-in)^2, at most 16x" +
            (f", x sqrt({SF_REF_DEPTH} / {depth}) for its {depth} weight layers (depth-muP)" if deep else ""))
    return SCHEDULE_FREE_LR * scale, (
        f"Schedule-Free AdamW's default {SCHEDULE_FREE_LR:g} x {scale:.2g}: the weights' typical fan-in is {fan}, "
        f"and Adam's best LR grows as fan-in shrinks (muP); {kind} (measured, docs/recipe.md)")
