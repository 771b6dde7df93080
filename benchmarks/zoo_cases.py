"""The zoo's case type and the plain loop's losses, as a script's own loop writes them.

A `Case` is one model as a user trains it: how it is built (randomly initialised, nothing downloaded),
one batch drawn from a generator, the optimizer the script makes, and either a `step_fn` (a factory: each
run gets a fresh one, its closure state included) or the loss the plain loop computes from the model's output.
`fit` is handed the same model, batches and optimizer; the plain loop's loss is the batch contract of
docs/models.md written out by hand (cross-entropy on logits, the model's own loss, detection's sum, ...).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

Batch = Any


@dataclass
class Case:
    name: str
    source: str  # torchvision | torchvision-detection | torchvision-segmentation | timm | transformers | hand
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], Batch]
    plain: Callable[[nn.Module, Batch], torch.Tensor] | None = None  # the plain loop's loss (no step_fn)
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] = None  # type: ignore[assignment]
    step_fn: Callable[[], Callable[[nn.Module, Batch], torch.Tensor]] | None = None  # a fresh step_fn per run
    probe: Callable[[nn.Module, Batch], torch.Tensor] | None = None  # the K-step loss, when `plain` cannot say it
    fit_kwargs: dict = field(default_factory=dict)  # what the port passes besides the optimizer (loss_fn, clip)
    note: str = ""
    fresh_batches: bool = False  # the model writes its input in place: every way gets its own copy of each batch
    before_step: Callable[[nn.Module], None] | None = None  # what the loop does to the gradients before opt.step()
    after_step: Callable[[nn.Module], None] | None = None  # what it does to the weights after (a constraint)

    def __post_init__(self):
        if self.optimizer is None:
            self.optimizer = sgd(0.01)
        if self.plain is None and self.step_fn is None:
            raise ValueError(f"{self.name}: a case needs `plain` or `step_fn`")

    def loss_fn(self):
        return self.fit_kwargs.get("loss_fn")


def stateless(loss: Callable[[nn.Module, Batch], torch.Tensor]) -> Callable[[], Callable]:
    """A `step_fn` factory for a loss that keeps nothing between steps: every run may share the function."""
    return lambda: loss


def sgd(lr: float, **kw) -> Callable[[nn.Module], torch.optim.Optimizer]:
    return lambda m: torch.optim.SGD(m.parameters(), lr=lr, **kw)


def adamw(lr: float, **kw) -> Callable[[nn.Module], torch.optim.Optimizer]:
    return lambda m: torch.optim.AdamW(m.parameters(), lr=lr, **kw)


def adam(lr: float, **kw) -> Callable[[nn.Module], torch.optim.Optimizer]:
    return lambda m: torch.optim.Adam(m.parameters(), lr=lr, **kw)


def kept_on_model(make: Callable[[nn.Module], torch.optim.Optimizer]) -> Callable[[nn.Module], torch.optim.Optimizer]:
    """The script's optimizer, also kept on the model (`model.opt`, a plain attribute, not a submodule) where its
    step finds it to set the LR or zero the gradients; `scripts_optimizer(model)` reads it (None under
    recipe="auto", which makes its own)."""
    def build(m: nn.Module) -> torch.optim.Optimizer:
        opt = make(m)
        object.__setattr__(m, "opt", opt)
        return opt
    return build


def scripts_optimizer(model: nn.Module) -> torch.optim.Optimizer | None:
    return getattr(model, "opt", None)


# ---------------------------------------------------------------- models

def mlp(d_in: int = 32, classes: int = 10, hidden: int = 128) -> nn.Module:
    """Two hidden layers of `hidden` with ReLUs: the zoo's plain MLP."""
    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, classes))


# ---------------------------------------------------------------- the plain loop's losses

def ce_logits(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy as a loop writes it: (B, C) logits, or (B, T, V) / (N, C, H, W) with their targets."""
    if out.dim() == 3 and y.dim() == 2:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return F.cross_entropy(out, y)


def xy_logits(model: nn.Module, batch: Batch) -> torch.Tensor:
    """`(x, y)` -> `cross_entropy(model(x), y)`."""
    x, y = batch
    return ce_logits(model(x), y)


def xxy_logits(model: nn.Module, batch: Batch) -> torch.Tensor:
    """`(x1, x2, y)` -> `cross_entropy(model(x1, x2), y)`."""
    *xs, y = batch
    return ce_logits(model(*xs), y)


def xy_with(loss_fn: nn.Module) -> Callable[[nn.Module, Batch], torch.Tensor]:
    """`(x..., y)` -> `loss_fn(model(x...), y)` (a regression's MSE, say)."""
    def plain(model, batch):
        *xs, y = batch
        return loss_fn(model(*xs), y)
    return plain


def own_loss(out: Any) -> torch.Tensor:
    """The model's own loss: `out.loss`, `out["loss"]`, or the 0-dim tensor in a tuple."""
    if isinstance(out, dict):
        return out["loss"]
    if isinstance(out, (tuple, list)):
        return next(t for t in out if torch.is_tensor(t) and t.dim() == 0)
    if dataclasses.is_dataclass(out) or hasattr(out, "loss"):
        return out.loss
    raise TypeError(f"no loss in {type(out).__name__}")


def xy_own(model: nn.Module, batch: Batch) -> torch.Tensor:
    """`(x, y)` -> `model(x, y)`'s own loss (a GPT's `forward(idx, targets)`)."""
    x, y = batch
    return own_loss(model(x, y))


def dict_own(model: nn.Module, batch: dict) -> torch.Tensor:
    """A Hugging Face dict batch -> `model(**batch).loss`."""
    return own_loss(model(**batch))


def detection(model: nn.Module, batch: Batch) -> torch.Tensor:
    """`(images, targets)` -> the sum of torchvision's detection losses."""
    images, targets = batch
    return sum(model(list(images), list(targets)).values())


def segmentation(model: nn.Module, batch: Batch) -> torch.Tensor:
    """torchvision's segmentation recipe: loss on "out" + 0.5 x loss on "aux"."""
    x, y = batch
    out = model(x)
    loss = F.cross_entropy(out["out"], y)
    if "aux" in out:
        loss = loss + 0.5 * F.cross_entropy(out["aux"], y)
    return loss


# ---------------------------------------------------------------- batches
#
# Batches a model can learn from, so that a K-step loss says how far a run got: an image is its class's fixed
# prototype (coarse colour blobs) under unit noise, a vector its class's fixed direction plus noise, a mask's
# pixels their class's colour, a token sequence a fixed random successor table with 10% of the tokens random.
# The "teacher" (prototypes, colours, successors) is drawn from its own fixed seed, the same in every process;
# the batches' draws come from the generator the caller passes. A maker carries `learnable = True`; a case whose
# batches are noise (random labels) has nothing to learn, and the sweep says so beside its loss.

TEACHER_SEED = 4321


def teacher(*shape: int, salt: int = 0) -> torch.Tensor:
    """A fixed standard-normal tensor of this shape: the same in every process and run."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(TEACHER_SEED + salt))


def learnable(make: Callable[[torch.Generator], Batch]) -> Callable[[torch.Generator], Batch]:
    make.learnable = True  # type: ignore[attr-defined]
    return make


@functools.lru_cache(maxsize=4)
def prototypes(classes: int, channels: int, h: int, w: int) -> torch.Tensor:
    """(classes, channels, h, w): each class a 4x4 grid of random colours, upsampled to smooth blobs (made on a
    maker's first batch: a registry of every case builds none)."""
    return F.interpolate(teacher(classes, channels, 4, 4), size=(h, w), mode="bilinear", align_corners=False)


def images(n: int, size: int | tuple[int, int], classes: int = 10, channels: int = 3):
    """A batch maker of `(x, y)` image classification batches: x its class's prototype under unit noise."""
    h, w = (size, size) if isinstance(size, int) else size

    def make(g: torch.Generator):
        y = torch.randint(0, classes, (n,), generator=g)
        return prototypes(classes, channels, h, w)[y] + torch.randn(n, channels, h, w, generator=g), y
    return learnable(make)


def vectors(n: int = 32, d: int = 32, classes: int = 10, dtype: torch.dtype = torch.float32):
    """A batch maker of `(x, y)` batches of `n` feature vectors of width `d`: x its class's direction plus noise."""
    proto = teacher(classes, d, salt=1)

    def make(g: torch.Generator):
        y = torch.randint(0, classes, (n,), generator=g)
        return (proto[y] + torch.randn(n, d, generator=g)).to(dtype), y
    return learnable(make)


def masks(n: int, size: int, classes: int = 5):
    """`(x, y)` segmentation batches: blob-shaped label maps, each pixel its class's colour under noise (x in
    channels_last strides, as images made from HWC arrays come)."""
    colours = teacher(classes, 3, salt=2)

    def make(g: torch.Generator):
        logits = F.interpolate(torch.randn(n, classes, 4, 4, generator=g), size=(size, size), mode="bilinear",
                               align_corners=False)
        y = logits.argmax(1)
        return colours[y].permute(0, 3, 1, 2) + 0.5 * torch.randn(n, 3, size, size, generator=g), y
    return learnable(make)


def boxes(n: int, size: int, classes: int = 5, with_masks: bool = False, keypoints: int = 0):
    """`(list of images, list of target dicts)`, 2 boxes an image, each painted its class's colour on noise."""
    colours = teacher(classes, 3, salt=3).sigmoid()

    def make(g: torch.Generator):
        ims, tgts = [], []
        for _ in range(n):
            im = 0.5 * torch.rand(3, size, size, generator=g)
            xy = torch.rand(2, 2, generator=g) * size * 0.5
            wh = 8 + torch.rand(2, 2, generator=g) * size * 0.4
            b = torch.cat([xy, (xy + wh).clamp(max=size - 1)], 1)
            t = {"boxes": b, "labels": torch.randint(1, classes, (2,), generator=g)}
            for (x0, y0, x1, y1), c in zip(b.int().tolist(), t["labels"].tolist()):
                im[:, y0:y1, x0:x1] = colours[c, :, None, None]
            ims.append(im)
            if with_masks:
                m = torch.zeros(2, size, size, dtype=torch.uint8)
                for i, (x0, y0, x1, y1) in enumerate(b.int().tolist()):
                    m[i, y0:y1, x0:x1] = 1
                t["masks"] = m
            if keypoints:
                kp = torch.cat([xy.unsqueeze(1) + torch.rand(2, keypoints, 2, generator=g) * wh.unsqueeze(1),
                                torch.ones(2, keypoints, 1)], 2)
                t["keypoints"] = kp
            tgts.append(t)
        return ims, tgts
    return learnable(make)


def chains(n: int, t: int, vocab: int, g: torch.Generator, noise: float = 0.1) -> torch.Tensor:
    """(n, t) token ids: each the fixed successor of the one before (`successors`), a `noise` share at random."""
    nxt = successors(vocab)
    ids = torch.empty(n, t, dtype=torch.long)
    ids[:, 0] = torch.randint(0, vocab, (n,), generator=g)
    rand = torch.randint(0, vocab, (n, t), generator=g)
    keep = torch.rand(n, t, generator=g) >= noise
    for i in range(1, t):
        ids[:, i] = torch.where(keep[:, i], nxt[ids[:, i - 1]], rand[:, i])
    return ids


def successors(vocab: int) -> torch.Tensor:
    """The fixed successor of each token id: a random permutation, the same in every process."""
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(TEACHER_SEED + 4))


def tokens(n: int, t: int, vocab: int, *, keys: tuple[str, ...] = ("input_ids", "labels"), shift: bool = False):
    """Hugging Face dict batches: input ids, their mask, and labels (the ids again: the model shifts them)."""
    def make(g: torch.Generator):
        ids = chains(n, t + (1 if shift else 0), vocab, g)
        out = {"input_ids": ids[:, :t] if shift else ids}
        if "attention_mask" in keys:
            out["attention_mask"] = torch.ones(n, t, dtype=torch.long)
        if "labels" in keys:
            out["labels"] = ids[:, 1:] if shift else ids.clone()
        return out
    return learnable(make)


def lm_pairs(n: int, t: int, vocab: int):
    """`(x, y)` token batches, y = x shifted by one (a script's language model)."""
    def make(g: torch.Generator):
        ids = chains(n, t + 1, vocab, g)
        return ids[:, :-1], ids[:, 1:]
    return learnable(make)
