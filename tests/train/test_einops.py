"""A model built with einops.layers (T39) stays one graph under fit(compile="auto"): the trial's compilation is made
with fullgraph=True, which raises at the first graph break (the controller would then fall back to eager and the
decision would say so), and dynamo's counters see no break."""

import pytest
import torch
import torch._dynamo as dynamo
from einops import rearrange
from einops.layers.torch import Rearrange, Reduce
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchspeed
import torchspeed.train.trial.compile as compile_mod


class PatchMixer(nn.Module):
    """Patches by einops.layers, a token mix by einops.rearrange inside forward, a mean by Reduce."""

    def __init__(self, patch: int = 4, dim: int = 16, classes: int = 4):
        super().__init__()
        self.patches = Rearrange("b c (h p1) (w p2) -> b (h w) (p1 p2 c)", p1=patch, p2=patch)
        self.embed = nn.Linear(3 * patch * patch, dim)
        self.mix = nn.Linear(4, 4)
        self.pool = Reduce("b n d -> b d", "mean")
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        t = self.embed(self.patches(x))                                   # (b, 4 patches, dim)
        t = t + rearrange(self.mix(rearrange(t, "b n d -> b d n")), "b d n -> b n d")
        return self.head(self.pool(t))


@pytest.mark.slow
def test_a_model_built_with_einops_layers_compiles_whole_under_compile_auto(monkeypatch):
    compiled = []

    def fullgraph(model, mode=None):
        compiled.append(mode)
        return torch.compile(model, mode=mode, fullgraph=True)  # a graph break is an error, not a split

    monkeypatch.setattr(compile_mod, "compile_model", fullgraph)
    dynamo.reset()
    dynamo.utils.counters.clear()
    ds = TensorDataset(torch.randn(64, 3, 8, 8), torch.randint(0, 4, (64,)))
    res = torchspeed.fit(PatchMixer(), DataLoader(ds, batch_size=8), epochs=2, compile="auto", progress=False,
                         compile_min_run_s=0, device="cpu", trial=False)
    assert compiled == [None]
    measured = res.decisions["compile"].measured
    assert measured["compiled_s"] > 0 and not measured.get("error"), measured
    assert sum(dynamo.utils.counters["graph_break"].values()) == 0, dict(dynamo.utils.counters["graph_break"])
    assert dynamo.utils.counters["stats"]["unique_graphs"] >= 1
