import time

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from torchspeed.bench.workloads import SyntheticImages, create_model
from torchspeed.env import parallel_speedup, usable_cores
from torchspeed.tune import tune_loader
from torchspeed.tune._jpeg import JpegImages


@pytest.fixture(scope="module")
def in_memory():
    ds = SyntheticImages(512, size=16)
    return TensorDataset(ds.data, ds.targets)


def test_decode_heavy_dataset_gets_workers():
    if usable_cores() < 2:
        pytest.skip("needs 2 usable cores to run workers in parallel")
    if (speedup := parallel_speedup()) < 1.4:
        # other processes hold every core: no loader setting can run in parallel right now
        pytest.skip(f"the machine is busy: 2 processes run only {speedup:.2f}x faster than 1")
    ds = JpegImages(256, size=320, out_size=32)  # each __getitem__ decodes a 320 px JPEG
    s = tune_loader(ds, batch_size=16, batches=10, progress=False)
    assert s.num_workers > 0 and s.workers_help, s.reason
    measured = {t.num_workers for t in s.table}
    assert 0 in measured and s.num_workers in measured and max(measured) <= usable_cores()
    zero = next(t for t in s.table if t.num_workers == 0 and t.note.startswith("median"))
    assert s.samples_per_s >= 1.1 * zero.samples_per_s
    kw = s.kwargs()
    assert kw["persistent_workers"] and kw["prefetch_factor"] in (2, 4) and kw["pin_memory"] is False
    x, y = next(iter(DataLoader(ds, batch_size=16, **kw)))  # the settings make a working loader
    assert x.shape == (16, 3, 32, 32)


def test_in_memory_tensors_workers_do_not_help_with_a_model(in_memory):
    torch.manual_seed(0)
    model = create_model("mlp", image_size=16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    s = tune_loader(in_memory, batch_size=64, model=model, progress=False)
    assert s.num_workers == 0 and not s.workers_help
    assert "workers do not help" in s.reason
    assert s.loader_outruns_model is not None and s.model_samples_per_s < s.samples_per_s
    assert s.kwargs() == {"num_workers": 0, "pin_memory": False}
    for k, v in model.state_dict().items():  # the model step used for timing changed nothing
        assert torch.equal(v, before[k])


def test_says_when_the_loader_already_outruns_the_model_step(in_memory):
    def slow_step(batch):  # a model step of 20 ms per batch: far slower than indexing tensors
        time.sleep(0.02)

    s = tune_loader(in_memory, batch_size=64, step=slow_step, progress=False)
    assert s.loader_outruns_model is True and s.num_workers == 0
    assert "outruns the model step" in s.reason
    assert s.model_samples_per_s == pytest.approx(64 / 0.02, rel=0.3)


def test_in_memory_tensors_workers_do_not_help_loader_alone(in_memory):
    s = tune_loader(in_memory, batch_size=64, batches=20, min_time=0.2, progress=False)
    assert s.num_workers == 0 and "workers do not help" in s.reason
    assert s.loader_outruns_model is None


def test_arguments_are_checked(in_memory):
    with pytest.raises(ValueError, match="fewer than one batch"):
        tune_loader(in_memory, batch_size=10_000, progress=False)
