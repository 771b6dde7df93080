"""tune_loader: its decisions, tested against fixed measurements, and its measuring code, tested on a fake clock.

No assertion here depends on how fast this machine is or how busy it is: the decision logic
gets its samples/s from `FakeRates` (in place of `_Tuner._time`), the measuring code reads a
`FakeClock` that only the dataset's collate and the model step move, and the one run on the
real clock asserts only what holds whatever it measures. Whether workers really help a
decode-heavy dataset on a given machine is a measurement: benchmarks/bench_loader.py.
"""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data._utils.collate import default_collate

import torchspeed.env
from torchspeed.bench.workloads import SyntheticImages, create_model
from torchspeed.tune import loader as loader_mod
from torchspeed.tune import tune_loader
from torchspeed.tune._jpeg import JpegImages


@pytest.fixture(scope="module")
def in_memory():
    ds = SyntheticImages(512, size=16)
    return TensorDataset(ds.data, ds.targets)


class FakeRates:
    """Stands in for `_Tuner._time`: samples/s by num_workers, loader alone and end to end (with the step)."""

    def __init__(self, alone: dict[int, float], e2e: dict[int, float] | None = None, prefetch4: float = 1.0):
        self.alone, self.e2e, self.prefetch4 = alone, e2e or alone, prefetch4
        self.calls: list[tuple[int, bool]] = []

    def __call__(self, loader, n, step):
        w = loader.num_workers
        self.calls.append((w, step is not None))
        rate = (self.e2e if step is not None else self.alone)[w]
        if w and loader.prefetch_factor == 4:
            rate *= self.prefetch4
        return 0.05 * (w + 1), rate


def _fake(monkeypatch, rates: FakeRates, model_rate: float | None = None) -> FakeRates:
    monkeypatch.setattr(loader_mod._Tuner, "_time", lambda tuner, loader, n, step: rates(loader, n, step))
    if model_rate is not None:
        monkeypatch.setattr(loader_mod._Tuner, "_model_rate", lambda self: model_rate)
    return rates


@pytest.fixture
def clock(monkeypatch, fake_clock):
    monkeypatch.setattr(loader_mod, "time", fake_clock)  # FakeClock (conftest.py)
    return fake_clock


def test_decode_heavy_dataset_gets_workers(monkeypatch):
    # Measured: each worker adds throughput, more than the 2 usable cores could run; the decision must follow.
    monkeypatch.setattr(torchspeed.env, "usable_cores", lambda: 2)
    rates = _fake(monkeypatch, FakeRates({0: 400.0, 1: 700.0, 2: 1000.0, 3: 1300.0}))
    ds = JpegImages(64, size=96, out_size=32)  # each __getitem__ decodes a JPEG
    s = tune_loader(ds, batch_size=16, batches=10, progress=False)
    assert s.num_workers == 2 and s.workers_help, s.reason
    assert s.reason.startswith("2 workers: 2.50x num_workers=0 (confirmation (loader alone)"), s.reason
    measured = {t.num_workers for t in s.table}
    assert measured == {0, 1, 2}  # swept up to the usable cores, not beyond
    zero = next(t for t in s.table if t.num_workers == 0 and t.note.startswith("median"))
    assert zero.samples_per_s == 400.0 and s.samples_per_s == 1000.0 and s.speedup_vs_0 == pytest.approx(2.5)
    # 3 interleaved rounds over the counts swept, then prefetch_factor=4, then 2 confirmation rounds against 0
    assert rates.calls.count((2, False)) == 3 + 1 + 2 and rates.calls.count((0, False)) == 3 + 2
    kw = s.kwargs()
    assert kw == {"num_workers": 2, "pin_memory": False, "prefetch_factor": 2, "persistent_workers": True}
    x, y = next(iter(DataLoader(ds, batch_size=16, **kw)))  # the settings make a working loader
    assert x.shape == (16, 3, 32, 32)


def test_prefetch_factor_4_is_kept_only_when_measurably_faster(monkeypatch, in_memory):
    alone = {0: 400.0, 1: 700.0, 2: 1000.0}
    _fake(monkeypatch, FakeRates(alone, prefetch4=1.2))
    assert tune_loader(in_memory, batch_size=64, max_workers=2, progress=False).prefetch_factor == 4
    _fake(monkeypatch, FakeRates(alone, prefetch4=1.03))  # inside the 5% plateau: the default stays
    assert tune_loader(in_memory, batch_size=64, max_workers=2, progress=False).prefetch_factor == 2


@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # built, never iterated
def test_the_sweep_stops_once_throughput_plateaus(monkeypatch, in_memory):
    rates = _fake(monkeypatch, FakeRates({0: 400.0, 1: 700.0, 2: 1000.0, 3: 1020.0, 4: 2000.0}))
    s = tune_loader(in_memory, batch_size=64, max_workers=4, progress=False)
    assert "stopped at 3 workers: throughput plateaued" in s.reason
    assert 4 not in {w for w, _ in rates.calls} and s.num_workers == 3


def test_in_memory_tensors_workers_do_not_help_loader_alone(monkeypatch, in_memory):
    # Workers only add inter-process copies: none is 10% faster than the main process.
    _fake(monkeypatch, FakeRates({0: 50_000.0, 1: 30_000.0, 2: 52_000.0}))
    s = tune_loader(in_memory, batch_size=64, max_workers=2, progress=False)
    assert s.num_workers == 0 and not s.workers_help and "workers do not help" in s.reason
    assert s.loader_outruns_model is None and s.model_samples_per_s is None
    assert s.kwargs() == {"num_workers": 0, "pin_memory": False}


def test_a_lucky_sweep_is_overruled_by_the_confirmation_rounds(monkeypatch, in_memory):
    # The sweep saw 2 workers 50% faster; end to end (load + step), against 0 workers, they are not.
    _fake(monkeypatch, FakeRates({0: 400.0, 1: 500.0, 2: 600.0}, e2e={0: 400.0, 2: 420.0}), model_rate=2000.0)
    s = tune_loader(in_memory, batch_size=64, max_workers=2, step=lambda b: None, progress=False)
    assert s.num_workers == 0 and "take cores from the model's compute" in s.reason
    assert s.loader_outruns_model is False and s.model_samples_per_s == 2000.0
    _fake(monkeypatch, FakeRates({0: 400.0, 1: 500.0, 2: 600.0}, e2e={0: 400.0, 2: 560.0}), model_rate=2000.0)
    s = tune_loader(in_memory, batch_size=64, max_workers=2, step=lambda b: None, progress=False)
    assert s.num_workers == 2 and s.reason.startswith("2 workers: 1.40x num_workers=0 (end to end (load + step)")


def test_says_when_the_loader_already_outruns_the_model_step(clock, in_memory):
    # The real measuring code on a fake clock: loading costs 0.1 ms per batch, the step 20 ms.
    def collate(samples):
        clock.advance(1e-4)
        return default_collate(samples)

    def slow_step(batch):
        clock.advance(0.02)

    s = tune_loader(in_memory, batch_size=64, step=slow_step, collate_fn=collate, min_time=0.01, progress=False)
    assert s.model_samples_per_s == pytest.approx(64 / 0.02)
    assert s.samples_per_s == pytest.approx(64 / 1e-4)
    assert s.loader_outruns_model is True and s.num_workers == 0
    assert "outruns the model step" in s.reason
    assert [t.num_workers for t in s.table] == [0]  # no worker count was even tried


def test_time_counts_steady_batches_for_at_least_min_time(clock, in_memory):
    def collate(samples):
        clock.advance(0.002)
        return default_collate(samples)

    tuner = loader_mod._Tuner(in_memory, batch_size=64, model=None, step=None, loss_fn=None, device="cpu",
                              collate_fn=collate, max_workers=0, batches=4, min_time=0.05, prefetch_factors=(2,),
                              plateau=0.05, min_gain=0.1, rounds=1, progress=False, seed=0)
    startup, rate = tuner._time(tuner._loader(0, False, None), 4, None)
    assert startup == pytest.approx(0.002)  # the first batch, timed on its own
    assert rate == pytest.approx(64 / 0.002)  # 25 steady batches (0.05 s) after it, not 4


def test_with_a_model_the_step_is_timed_and_the_model_left_unchanged(clock, in_memory):
    # A real training step of a real model, on the fake clock: the loss advances it 20 ms per step.
    def loss_fn(out, y):
        clock.advance(0.02)
        return torch.nn.functional.cross_entropy(out, y)

    def collate(samples):
        clock.advance(1e-3)
        return default_collate(samples)

    torch.manual_seed(0)
    model = create_model("mlp", image_size=16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    s = tune_loader(in_memory, batch_size=64, model=model, loss_fn=loss_fn, collate_fn=collate, min_time=0.01,
                    progress=False)
    assert s.model_samples_per_s == pytest.approx(64 / 0.02) and s.samples_per_s == pytest.approx(64 / 1e-3)
    assert s.num_workers == 0 and not s.workers_help and s.loader_outruns_model is True
    assert "workers do not help" in s.reason and "outruns the model step" in s.reason
    assert s.kwargs() == {"num_workers": 0, "pin_memory": False}
    for k, v in model.state_dict().items():  # the model steps used for timing changed nothing
        assert torch.equal(v, before[k])


def test_a_real_run_with_workers_is_consistent_with_its_own_measurements(in_memory):
    # The real clock, a real worker: whatever this machine measures, the decision must follow the table.
    s = tune_loader(in_memory, batch_size=64, max_workers=1, batches=4, min_time=0.05, rounds=2, progress=False)
    medians = {t.num_workers: t for t in s.table if t.note.startswith("median")}
    assert set(medians) == {0, 1} and all(t.samples_per_s > 0 for t in s.table)
    if s.num_workers == 0:
        assert s.reason.startswith("workers do not help") and s.kwargs() == {"num_workers": 0, "pin_memory": False}
    else:
        confirm = {t.num_workers: t.samples_per_s for t in s.table if t.note.startswith("confirmation")}
        assert confirm[1] >= 1.1 * confirm[0] and medians[1].samples_per_s >= 1.1 * medians[0].samples_per_s
        assert s.kwargs()["persistent_workers"]


def test_arguments_are_checked(in_memory):
    with pytest.raises(ValueError, match="fewer than one batch"):
        tune_loader(in_memory, batch_size=10_000, progress=False)
