"""What the suite's tests share: a tiny workload's data, and registering a workload for one test."""

import contextlib

import torch

from torchspeed.bench.suite import WORKLOADS, SuiteData, Workload, register_workload


def line_data(seed: int) -> SuiteData:
    """140 samples of 4 features, the label the sign of the first: 100 to train, 40 held out."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(140, 4, generator=g)
    y = (x[:, 0] > 0).long()
    return SuiteData(x[:100], y[:100], x[100:], y[100:])


@contextlib.contextmanager
def registered(workload: Workload):
    """`workload` in the suite's registry for the block; the registry as it was afterwards."""
    register_workload(workload)
    try:
        yield workload
    finally:
        WORKLOADS.pop(workload.name, None)
