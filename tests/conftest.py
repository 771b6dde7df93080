import os

import pytest
import torch

# Tests run on 2 cores next to other work: keep torch's threads predictable.
torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def tiny_cnn():
    def make(seed: int = 0, bias: bool = False):
        torch.manual_seed(seed)
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1, bias=bias), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4))
    return make


class FakeClock:
    """A stand-in for a module's `time`: perf_counter only moves when the test calls `advance`,
    so measuring code is tested on fixed step times, whatever the machine's load."""

    def __init__(self):
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def fake_clock():
    """A `FakeClock`; patch it in with `monkeypatch.setattr(module, "time", fake_clock)`."""
    return FakeClock()
