"""A training loop whose costs are set from the command line; test_probe_known.py runs it under the probe.

Each cost is known by construction: a sleep in `Dataset.__getitem__` (the data wait), in the model's
forward, and in an optimizer step pre-hook (the optimizer's share of the step); `.item()` calls per step
(host reads); fresh anonymous pages written once per step (minor page faults); and a model made of
matrix products only or of element-wise operators only (the kernel shares), or matrix products with the
axes swapped and made contiguous between them (layout copies, as an eager einops.rearrange makes). The loader
yields sample indices; the model trains on one fixed batch of its own shape.
"""
import argparse
import mmap
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=("matmul", "elementwise", "layout"), default="matmul")
    p.add_argument("--data-ms", type=float, default=0.0, help="sleep per sample in __getitem__")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--forward-ms", type=float, default=0.0, help="sleep per forward")
    p.add_argument("--optim-ms", type=float, default=0.0, help="sleep per optimizer step")
    p.add_argument("--items", type=int, default=0, help=".item() calls per step")
    p.add_argument("--dataset-items", type=int, default=0,
                   help=".item() calls per sample in __getitem__ (a random augmentation's draw: host reads, no sync)")
    p.add_argument("--fault-mib", type=int, default=0, help="fresh MiB written per step")
    return p.parse_args()


class Slept(Dataset):
    def __init__(self, ms, items=0):
        self.ms, self.items = ms, items

    def __len__(self):
        return 100_000

    def __getitem__(self, i):
        if self.ms:
            time.sleep(self.ms / 1e3)
        for _ in range(self.items):
            torch.rand(1).item()
        return i


class ElementwiseOnly(nn.Module):
    """Element-wise operators only: a scale as large as the batch (no broadcast, so backward has no
    reduction), then ten rounds of h * sigmoid(h) + tanh(h) / 2."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(512, 64))

    def forward(self, x):
        h = x * self.scale
        for _ in range(10):
            h = h * torch.sigmoid(h) + 0.5 * torch.tanh(h)
        return h


class SwapAxes(nn.Module):
    """Linear layers over alternating axes of a (batch, tokens, features) tensor, the axes swapped and made
    contiguous between them (a token-mixing MLP's form): each swap a copy of the whole tensor, as an eager
    `einops.rearrange(x, "b t f -> b f t")` feeding a reshape makes."""

    def __init__(self, width: int = 128, blocks: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(2 * blocks))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x).transpose(1, 2).contiguous()
        return x


class Net(nn.Module):
    def __init__(self, body, forward_ms):
        super().__init__()
        self.body, self.forward_ms = body, forward_ms

    def forward(self, x):
        if self.forward_ms:
            time.sleep(self.forward_ms / 1e3)
        return self.body(x)


def touch_fresh_pages(mib):
    """Map `mib` MiB of anonymous memory without huge pages, write one byte per page, unmap it:
    one minor page fault per page."""
    m = mmap.mmap(-1, mib << 20)
    if hasattr(m, "madvise") and hasattr(mmap, "MADV_NOHUGEPAGE"):
        m.madvise(mmap.MADV_NOHUGEPAGE)
    for offset in range(0, len(m), mmap.PAGESIZE):
        m[offset] = 1
    m.close()


def main():
    a = get_args()
    torch.set_num_threads(1)  # the costs are the script's own, not idle OpenMP threads spinning on a loaded machine
    torch.manual_seed(0)
    if a.model == "matmul":  # one matrix product forward, two backward, nothing else
        body, x = nn.Linear(1024, 1024, bias=False), torch.randn(64, 1024)
    elif a.model == "layout":
        body, x = SwapAxes(), torch.randn(16, 128, 128)
    else:
        body, x = ElementwiseOnly(), torch.randn(512, 64)
    model = Net(body, a.forward_ms)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    if a.optim_ms:  # runs inside the optimizer's step, after the probe's global pre-hook
        opt.register_step_pre_hook(lambda *_: time.sleep(a.optim_ms / 1e3))
    for _ in DataLoader(Slept(a.data_ms, a.dataset_items), batch_size=a.batch):
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        for _ in range(a.items):
            loss.item()
        if a.fault_mib:
            touch_fresh_pages(a.fault_mib)
        opt.step()


if __name__ == "__main__":
    main()
