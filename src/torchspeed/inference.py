"""Use a trained run: `load_model(run_dir)` and `predict(...)` under inference mode (T28), with validation's
preprocessing (fast decode T04, normalize T30).

`torchspeed train` writes `model.pt` (weights, class names, model spec, image side and the
normalization). `load_model` rebuilds the model from it (the same built-in name, or the
same `module:factory`), loads the weights (`weights_only=True`, checksum checked) and
returns it in eval mode with its preprocessing: the exact steps validation uses, so a
prediction matches what `evaluate` scored:

  decode (fast JPEG) -> resize the shorter side to `size`, crop the centre square
  -> float / 255 -> subtract `mean`, divide by `std` (ImageNet's, per RGB channel).

Example:
    >>> m = load_model("runs/cnn")
    >>> m.predict(["cat.jpg", "dog.jpg"])          # [Prediction(label='cat', prob=0.93, ...), ...]
    >>> x = m.preprocess(["cat.jpg"]); m.model(x)  # the logits yourself
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from torchspeed.env import default_device

__all__ = ["LoadedModel", "Prediction", "load_model", "predict"]


@dataclass(frozen=True)
class Prediction:
    """One image's top class, its probability, and every class's probability."""

    image: str
    label: str
    index: int
    prob: float
    probs: dict[str, float]


@dataclass
class LoadedModel:
    """A trained model with what it needs to see an image as training did."""

    model: nn.Module
    classes: list[str]
    size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    device: torch.device

    def preprocess(self, images: Sequence) -> torch.Tensor:
        """Image paths (or encoded bytes) -> a normalized float NCHW batch on the model's device."""
        from torchspeed.data.augment import DeviceAugment
        from torchspeed.data.decode import ImageDecodeError
        from torchspeed.data.folder import load_image

        arrays = []
        for im in images:
            data = im if isinstance(im, (bytes, bytearray)) else Path(im).read_bytes()
            try:
                arrays.append(torch.from_numpy(load_image(data, size=self.size, crop="center")))
            except Exception as e:  # noqa: BLE001 - cv2/PIL errors on odd inputs: name the image
                reason = e.reason if isinstance(e, ImageDecodeError) else f"{type(e).__name__}: {e}"
                raise ImageDecodeError(reason, None if isinstance(im, (bytes, bytearray)) else str(im)) from None
        x = torch.stack(arrays).permute(0, 3, 1, 2).to(self.device)
        norm = DeviceAugment(size=self.size, train=False, mean=self.mean, std=self.std).to(self.device)
        return norm(x)

    @torch.inference_mode()
    def predict(self, images: Sequence, *, batch_size: int = 64) -> list[Prediction]:
        """The class and probabilities for each image (in fp32, in batches of `batch_size`)."""
        out: list[Prediction] = []
        self.model.eval()
        for i in range(0, len(images), batch_size):
            chunk = list(images[i:i + batch_size])
            probs = torch.softmax(self.model(self.preprocess(chunk)).float(), dim=1).cpu()
            for im, p in zip(chunk, probs):
                k = int(p.argmax())
                out.append(Prediction(image=str(im) if not isinstance(im, (bytes, bytearray)) else "<bytes>",
                                      label=self.classes[k], index=k, prob=float(p[k]),
                                      probs={c: float(v) for c, v in zip(self.classes, p)}))
        return out


def _model_file(path: str | os.PathLike) -> Path:
    p = Path(path)
    if p.is_dir():
        p = p / "model.pt"
    if not p.is_file():
        raise FileNotFoundError(f"{path}: no model.pt here; pass the --out folder of `torchspeed train` "
                                "or its model.pt file")
    return p


def load_model(run: str | os.PathLike, *, device: torch.device | str | None = None) -> LoadedModel:
    """The model a `torchspeed train` run saved (its folder or its model.pt), ready for `predict`.

    Example:
        >>> m = load_model("runs/cnn", device="cpu")
        >>> [p.label for p in m.predict(paths)]
    """
    from torchspeed.model.spec import build_model
    from torchspeed.data.augment import IMAGENET_MEAN, IMAGENET_STD
    from torchspeed.train.state.checkpoint import load_checkpoint

    path = _model_file(run)
    state = load_checkpoint(path)
    missing = [k for k in ("model", "classes", "model_name", "size") if k not in state]
    if missing:
        raise ValueError(f"{path} has no {', '.join(missing)}: not a model.pt written by `torchspeed train`; "
                         "for a checkpoint of your own, build the model and use load_checkpoint(path, model=model)")
    model = build_model(state["model_name"], num_classes=len(state["classes"]))
    load_checkpoint(path, model=model)
    dev = default_device(device)
    return LoadedModel(model=model.to(dev).eval(), classes=list(state["classes"]), size=int(state["size"]),
                       mean=tuple(state.get("mean", IMAGENET_MEAN)), std=tuple(state.get("std", IMAGENET_STD)),
                       device=dev)


def predict(run: str | os.PathLike | LoadedModel, images: Sequence, *, device: torch.device | str | None = None,
            batch_size: int = 64) -> list[Prediction]:
    """`load_model(run).predict(images)`; `run` may already be a `LoadedModel`."""
    m = run if isinstance(run, LoadedModel) else load_model(run, device=device)
    return m.predict(images, batch_size=batch_size)
