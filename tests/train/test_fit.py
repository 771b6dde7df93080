import json

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import torchspeed
from torchspeed.bench.workloads import create_model, digits
from torchspeed.train import Trainer, TrainConfig
from torchspeed.train.trial.compile import CompileTrial


def _loaders(batch=32):
    tr, va = digits(size=16)
    return (DataLoader(tr, batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(0)),
            DataLoader(va, batch_size=256))


def _small_cnn(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1, bias=False), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2), torch.nn.Conv2d(16, 32, 3, padding=1, bias=False), torch.nn.BatchNorm2d(32),
        torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 10))


def test_fit_learns_digits_and_writes_metrics(tmp_path):
    train, val = _loaders()
    res = torchspeed.fit(_small_cnn(), train, epochs=4, val_loader=val, lr=0.2, schedule="onecycle", compile=False,
                         progress=False,
                         out_dir=str(tmp_path))
    assert res.final["val_acc"] > 0.9
    assert res.history[0]["train_loss"] > res.history[-1]["train_loss"]
    data = json.loads((tmp_path / "metrics.json").read_text())
    assert [r["epoch"] for r in data["history"]] == [1, 2, 3, 4]
    assert (tmp_path / "metrics.csv").read_text().splitlines()[0].startswith("epoch,step,train_loss")


def test_all_reaches_naive_accuracy_on_real_digits():
    """Every numerics-changing default (auto precision, channels_last, fused SGD) keeps accuracy."""
    train, val = _loaders()
    naive = torchspeed.fit(_small_cnn(), train, epochs=4, val_loader=val, lr=0.2,
                           config=TrainConfig.naive(progress=False))
    fast = torchspeed.fit(_small_cnn(), train, epochs=4, val_loader=val, lr=0.2, compile=False, progress=False,
                          schedule="onecycle")  # the naive config's own schedule: the numerics alone differ
    assert fast.final["val_acc"] >= naive.final["val_acc"] - 0.02
    # and bf16 explicitly (emulated where the CPU lacks it: still must converge)
    bf16 = torchspeed.fit(_small_cnn(), train, epochs=4, val_loader=val, lr=0.2, compile=False, progress=False,
                          precision="bf16", schedule="onecycle")
    assert bf16.final["val_acc"] >= naive.final["val_acc"] - 0.03


def test_label_smoothing_changes_the_loss():
    x, y = torch.randn(32, 3, 8, 8), torch.randint(0, 4, (32,))
    cfg = dict(precision="fp32", compile=False, progress=False, schedule=None)
    plain = Trainer(_tiny(), device="cpu", config=TrainConfig(**cfg))
    smooth = Trainer(_tiny(), device="cpu", config=TrainConfig(label_smoothing=0.2, **cfg))
    lp, ls = plain.train_step((x, y)), smooth.train_step((x, y))
    logits = _tiny()(x)
    torch.testing.assert_close(ls, torch.nn.functional.cross_entropy(logits, y, label_smoothing=0.2))
    assert not torch.allclose(lp, ls)
    with pytest.raises(ValueError, match="label_smoothing"):
        Trainer(_tiny(), loss_fn=torch.nn.MSELoss(), device="cpu", config=TrainConfig(label_smoothing=0.1, **cfg))


def _tiny(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(192, 4))


def test_loss_read_only_every_log_every_steps(monkeypatch):
    """The hot loop makes no per-step host sync: .item() only every log_every steps (T13). On the CPU a read is not
    a sync, and the guard and the meter read each step's loss as a float (cheaper than a kernel): the trainer here
    reads as on an accelerator (`host_reads` False)."""
    calls = {"n": 0}
    real_item = torch.Tensor.item

    def counting_item(self):
        calls["n"] += 1
        return real_item(self)

    ds = TensorDataset(torch.randn(64, 3, 8, 8), torch.randint(0, 4, (64,)))
    loader = list(DataLoader(ds, batch_size=4))  # 16 steps; a list: DataLoader seeds its iterator with .item()
    t = Trainer(_tiny(), device="cpu", config=TrainConfig(precision="fp32", compile=False, progress=False,
                                                            schedule=None, log_every=8))
    assert t.guard.host_reads and t.meter.host_reads
    t.guard.host_reads = t.meter.host_reads = False
    it = t.batches(loader)
    monkeypatch.setattr(torch.Tensor, "item", counting_item)
    t.run_steps(it, 16)
    monkeypatch.undo()
    assert calls["n"] == 2
    naive = Trainer(_tiny(), device="cpu", config=TrainConfig.naive(progress=False, schedule=None))
    naive.guard.host_reads = naive.meter.host_reads = False
    it = naive.batches(loader)
    monkeypatch.setattr(torch.Tensor, "item", counting_item)
    calls["n"] = 0
    naive.run_steps(it, 16)
    monkeypatch.undo()
    assert calls["n"] == 16


def test_compile_failure_falls_back_to_eager_with_a_message(monkeypatch, caplog):
    import torchspeed.train.trial.compile as compile_mod

    class Boom(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            raise RuntimeError("inductor exploded")

    monkeypatch.setattr(compile_mod, "compile_model", lambda model, mode=None: Boom(model))
    ds = TensorDataset(torch.randn(64, 3, 8, 8), torch.randint(0, 4, (64,)))
    with caplog.at_level("WARNING", logger="torchspeed"):
        res = torchspeed.fit(_tiny(), DataLoader(ds, batch_size=8), epochs=1, compile=True, progress=False,
                             trial=False)  # the switch trial runs eager: a compiled step from the first
    assert res.steps == 8
    assert res.decisions["compile"].value is False and "continuing eager" in res.decisions["compile"].reason
    assert "inductor exploded" in caplog.text


def test_compile_auto_keeps_the_faster_variant():
    slow_compiled = CompileTrial(steps=3, warmup=1)
    for t in [1.0, 1.0, 1.0, 1.0]:
        slow_compiled.record("eager", t)
    for t in [30.0, 1.2, 1.2, 1.2, 1.2]:
        slow_compiled.record("compiled", t)
    assert slow_compiled.phase() == "done"
    d = slow_compiled.decide()
    assert not d.use_compiled and d.compile_s == 30.0
    fast = CompileTrial(steps=3, warmup=1)
    for t in [1.0] * 4:
        fast.record("eager", t)
    for t in [30.0, 0.5, 0.5, 0.5, 0.5]:
        fast.record("compiled", t)
    assert fast.decide().use_compiled


@pytest.mark.slow
def test_compile_auto_trial_runs_real_compilation():
    ds = TensorDataset(torch.randn(128, 3, 8, 8), torch.randint(0, 4, (128,)))
    res = torchspeed.fit(_tiny(), DataLoader(ds, batch_size=8), epochs=1, compile="auto", progress=False,
                         compile_min_run_s=0)
    assert res.steps == 16
    detail = res.decisions["compile"].measured
    assert detail["eager_s"] > 0 and detail["compiled_s"] > 0 and detail["compile_s"] > 0


def test_data_parallel_is_unwrapped_with_a_warning(caplog):
    model = torch.nn.DataParallel(_tiny())
    with caplog.at_level("WARNING", logger="torchspeed"):
        t = Trainer(model, device="cpu", config=TrainConfig(compile=False, progress=False))
    assert not isinstance(t.model, torch.nn.DataParallel)
    assert "DistributedDataParallel" in caplog.text


def test_fit_rejects_unknown_options_and_empty_loaders():
    with pytest.raises(TypeError, match="unknown option"):
        torchspeed.fit(_tiny(), [], epochs=1, precison="bf16")
    with pytest.raises(ValueError, match="empty"):
        torchspeed.fit(_tiny(), [], epochs=1, progress=False, compile=False)


def test_model_from_bench_workloads_trains_one_step():
    t = Trainer(create_model("resnet18"), device="cpu", config=TrainConfig(compile=False, progress=False))
    before = [p.detach().clone() for p in t.module.parameters()]
    loss = t.train_step((torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))))
    assert torch.isfinite(loss) and t.step == 1
    changed = sum(not torch.equal(b, p) for b, p in zip(before, t.module.parameters()))
    assert changed == len(before)  # the optimizer step moved every parameter


def test_compile_trial_picks_the_fastest_mode_and_skips_a_failed_one():
    trial = CompileTrial(steps=2, warmup=1, modes=(None, "reduce-overhead"))
    for t in [1.0] * 3:
        trial.record("eager", t)
    assert trial.phase() == "compiled" and trial.current_mode() is None
    for t in [20.0, 0.9, 0.9, 0.9]:
        trial.record("compiled", t)
    assert trial.current_mode() == "reduce-overhead"
    for t in [25.0, 0.5, 0.5, 0.5]:
        trial.record("compiled", t)
    d = trial.decide()
    assert d.use_compiled and d.mode == "reduce-overhead" and d.compile_s == 45.0
    assert "mode=reduce-overhead" in d.reason and "default 1.11x" in d.reason
    broken = CompileTrial(steps=2, warmup=1, modes=(None, "reduce-overhead"))
    for t in [1.0] * 3:
        broken.record("eager", t)
    broken.fail(RuntimeError("cudagraphs unsupported"))  # the default mode fails: the next mode is tried
    assert broken.phase() == "compiled" and broken.current_mode() == "reduce-overhead"
    for t in [25.0, 0.5, 0.5, 0.5]:
        broken.record("compiled", t)
    assert broken.decide().mode == "reduce-overhead"


def test_compile_auto_leaves_a_short_run_eager_without_compiling(monkeypatch):
    import torchspeed.train.trial.compile as compile_mod

    calls = []
    monkeypatch.setattr(compile_mod, "compile_model", lambda model, mode=None: calls.append(mode) or model)
    ds = TensorDataset(torch.randn(64, 3, 8, 8), torch.randint(0, 4, (64,)))
    res = torchspeed.fit(_tiny(), DataLoader(ds, batch_size=8), epochs=1, compile="auto", progress=False)
    assert calls == [] and "too short to pay back a compilation" in res.decisions["compile"].reason
    # the same run with the threshold at 0 s goes through the trial and compiles
    res = torchspeed.fit(_tiny(), DataLoader(ds, batch_size=8), epochs=2, compile="auto", progress=False,
                         compile_min_run_s=0)
    assert calls == [None] and res.decisions["compile"].measured["compiled_s"] > 0


def test_a_cuda_device_asked_for_where_torch_sees_none_says_why_and_what_to_do(monkeypatch):
    """torch's own error, at the first tensor moved, is "Found no NVIDIA driver on your system"."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a GPU machine sees none too
    x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    with pytest.raises(RuntimeError, match=r"device='cuda' was asked for, but torch sees no CUDA GPU here.*leave "
                                           r"device out"):
        torchspeed.fit(torch.nn.Linear(8, 3), loader, device="cuda", progress=False)
    assert torchspeed.fit(torch.nn.Linear(8, 3), loader, progress=False).steps == 4  # left out: what is here
    with pytest.raises(ValueError, match=r"device='gpu' is no torch device: pass 'cuda'"):
        torchspeed.fit(torch.nn.Linear(8, 3), loader, device="gpu", progress=False)  # torch: "Expected one of cpu, ..."
