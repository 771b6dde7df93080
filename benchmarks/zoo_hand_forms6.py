"""A sixth set of hand-written forms: a conv pruned with `torch.nn.utils.prune` (its weight recomputed from
`weight_orig * weight_mask` by a forward pre-hook), nested dict batches, a model the script put in channels_last
itself (its loop converts each batch), and bf16 autocast written inside the model's forward. `zoo_hand.cases()`
lists them with the others.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import prune

from zoo_cases import Case, adam, images, sgd, stateless, vectors, xy_logits


def cnn():
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


def pruned_cnn():
    m = cnn()
    prune.l1_unstructured(m[0], "weight", amount=0.3)
    prune.l1_unstructured(m[3], "weight", amount=0.3)
    return m


def nested_batch(g: torch.Generator):
    x, y = vectors()(g)
    return {"inputs": {"dense": x[:, :16], "extra": x[:, 16:]}, "labels": y}


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.fc = nn.Linear(16, 32), nn.Linear(16, 32), nn.Linear(32, 10)

    def forward(self, dense, extra):
        return self.fc(F.relu(self.a(dense) + self.b(extra)))


def nested_plain(model, batch):
    return F.cross_entropy(model(**batch["inputs"]), batch["labels"])


def channels_last_cnn():
    return cnn().to(memory_format=torch.channels_last)


def channels_last_plain(model, batch):
    x, y = batch
    return F.cross_entropy(model(x.contiguous(memory_format=torch.channels_last)), y)


class AutocastInside(nn.Module):
    """The script's own mixed precision: bf16 autocast around the body, written inside forward."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU())
        self.fc = nn.Linear(128, 10)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.body(x)
        return self.fc(h.float())


def cases() -> list[Case]:
    return [
        Case("hand/torch_prune_masks", "hand", pruned_cnn, images(16, 16), xy_logits, sgd(0.05, momentum=0.9),
             note="torch.nn.utils.prune: weight = weight_orig * weight_mask in a forward pre-hook"),
        Case("hand/nested_dict_batch", "hand", TwoInputs, nested_batch, step_fn=stateless(nested_plain),
             optimizer=adam(1e-3), probe=nested_plain, note="{'inputs': {'dense', 'extra'}, 'labels'} batches"),
        Case("hand/user_channels_last", "hand", channels_last_cnn, images(16, 16),
             step_fn=stateless(channels_last_plain), optimizer=sgd(0.05, momentum=0.9), probe=channels_last_plain,
             note="the script's model.to(channels_last), each batch converted in its step"),
        Case("hand/autocast_inside_forward", "hand", AutocastInside, vectors(), xy_logits, adam(1e-3),
             note="bf16 autocast written inside the model's forward"),
    ]
