"""Loggers: Lightning Fabric's CSV/TensorBoard loggers and the built-in TensorBoard writer, read back from disk;
what is logged when; no extra device sync; rank 0 only."""

import csv

import pytest
import torch
from lightning.fabric.loggers import CSVLogger as FabricCSVLogger
from lightning.fabric.loggers import TensorBoardLogger as FabricTensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchspeed
import torchspeed.train.loggers as loggers_mod
from torchspeed.train.loggers import TensorBoardLogger

_FIT = dict(device="cpu", progress=False, seed=0, compile=False, precision="fp32", lr=0.05, trial=False)  # hparams are logged at the start, before a switch trial would decide
STEPS_PER_EPOCH = 12


def _data(n=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] > 0).long()
    return DataLoader(TensorDataset(x, y), batch_size=8)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


class RecordingLogger:
    """Any object with the three methods is a logger."""

    def __init__(self):
        self.metrics, self.hparams, self.status = [], [], []

    def log_metrics(self, metrics, step):
        self.metrics.append((step, dict(metrics)))

    def log_hyperparams(self, params):
        self.hparams.append(dict(params))

    def finalize(self, status):
        self.status.append(status)


def _events(log_dir):
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _hparams(acc) -> dict:
    """The hyperparameters of the run's hparams plugin summary (session_start_info), as Python values."""
    out = {}
    for content in acc.PluginTagToContent("hparams").values():
        data = plugin_data_pb2.HParamsPluginData.FromString(content)
        if data.HasField("session_start_info"):
            for k, v in data.session_start_info.hparams.items():
                out[k] = getattr(v, v.WhichOneof("kind"))
    return out


def test_fabric_csv_and_tensorboard_loggers_write_their_files(tmp_path):
    csv_logger = FabricCSVLogger(tmp_path / "csv", name="run")
    tb_logger = FabricTensorBoardLogger(tmp_path / "tb", name="run")
    r = torchspeed.fit(_mlp(), _data(), epochs=2, val_loader=_data(seed=1), log_every=4,
                       loggers=[csv_logger, tb_logger], **_FIT)

    rows = list(csv.DictReader(open(tmp_path / "csv" / "run" / "version_0" / "metrics.csv")))
    step_rows = [r_ for r_ in rows if r_.get("loss")]
    assert [int(r_["step"]) for r_ in step_rows] == [4, 8, 12, 16, 20, 24]
    epoch_rows = [r_ for r_ in rows if r_.get("val_acc")]
    assert [int(float(r_["epoch"])) for r_ in epoch_rows] == [1, 2]
    assert float(epoch_rows[-1]["val_acc"]) == pytest.approx(r.final["val_acc"])
    assert float(epoch_rows[-1]["train_loss"]) == pytest.approx(r.final["train_loss"])

    tb_dir = tmp_path / "tb" / "run" / "version_0"
    acc = _events(tb_dir)
    tags = acc.Tags()["scalars"]
    assert {"loss", "lr", "val_acc", "val_loss", "train_loss", "samples_per_s"} <= set(tags)
    assert [e.step for e in acc.Scalars("loss")] == [4, 8, 12, 16, 20, 24]
    assert [e.step for e in acc.Scalars("val_acc")] == [STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH]
    assert acc.Scalars("val_acc")[-1].value == pytest.approx(r.final["val_acc"], rel=1e-6)
    hparams = _hparams(acc)
    assert hparams["config/epochs"] == 2 and hparams["decisions/precision"].startswith("fp32")


def test_builtin_tensorboard_logger_reads_back(tmp_path):
    r = torchspeed.fit(_mlp(), _data(), epochs=2, val_loader=_data(seed=1), log_every=6,
                       loggers=[TensorBoardLogger(tmp_path / "tb")], **_FIT)
    acc = _events(tmp_path / "tb")
    assert [e.step for e in acc.Scalars("loss")] == [6, 12, 18, 24]
    assert [e.value for e in acc.Scalars("val_loss")] == pytest.approx([h["val_loss"] for h in r.history], rel=1e-6)
    assert [e.value for e in acc.Scalars("lr")][-1] == pytest.approx(r.final["lr"], rel=1e-6)
    hparams = _hparams(acc)
    assert hparams["config/log_every"] == 6 and hparams["config/checkpoint_dir"] == "None"
    assert hparams["decisions/optimizer"] == str(r.decisions["optimizer"])  # "value (reason)"
    assert acc.Tags()["tensors"] == ["hparams/text_summary"]   # the readable table


def test_what_is_logged_and_when():
    lg = RecordingLogger()
    r = torchspeed.fit(_mlp(), _data(), epochs=2, val_loader=_data(seed=1), log_every=5, loggers=[lg],
                       schedule="cosine", **_FIT)
    step_logs = [(s, m) for s, m in lg.metrics if "epoch" not in m]
    epoch_logs = [(s, m) for s, m in lg.metrics if "epoch" in m]
    assert [s for s, _ in step_logs] == [5, 10, 15, 20]
    assert all(set(m) == {"loss", "lr"} and m["loss"] > 0 for _, m in step_logs)
    assert [s for s, _ in epoch_logs] == [12, 24]
    assert epoch_logs[-1][1] == {k: float(v) for k, v in r.final.items() if k != "step" and v is not None}
    assert lg.hparams[0]["config/epochs"] == 2 and lg.hparams[0]["config/log_every"] == 5
    assert lg.hparams[0]["decisions/precision"].startswith("fp32")
    assert all(isinstance(v, (bool, int, float, str)) for v in lg.hparams[0].values())
    assert lg.status == ["success"]


def test_step_loss_is_the_value_the_loop_read(monkeypatch):
    """The logged loss is the trainer's own log_every read (`last_loss`), not a new one."""
    seen = []

    class Spy(RecordingLogger):
        def log_metrics(self, metrics, step):
            if "loss" in metrics:
                seen.append(metrics["loss"])

    class Watch(torchspeed.Callback):
        def __init__(self):
            self.reads = []

        def on_step_end(self, trainer):
            if trainer.step % 3 == 0:
                self.reads.append(trainer.last_loss)
    w = Watch()
    torchspeed.fit(_mlp(), _data(), epochs=1, log_every=3, loggers=[Spy()], callbacks=[w], **_FIT)
    assert seen == w.reads and len(seen) == 4


def _count_host_reads(monkeypatch):
    counts = {"n": 0}
    for name in ("item", "tolist", "__float__"):
        orig = getattr(torch.Tensor, name)

        def wrapped(self, *a, _orig=orig, **k):
            counts["n"] += 1
            return _orig(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, wrapped)
    return counts


def test_loggers_add_no_device_reads(monkeypatch, tmp_path):
    counts = _count_host_reads(monkeypatch)
    torchspeed.fit(_mlp(), _data(), epochs=2, val_loader=_data(seed=1), log_every=2, **_FIT)
    without = counts["n"]
    counts["n"] = 0
    torchspeed.fit(_mlp(), _data(), epochs=2, val_loader=_data(seed=1), log_every=2,
                   loggers=[RecordingLogger(), TensorBoardLogger(tmp_path / "tb")], **_FIT)
    assert counts["n"] == without > 0


def test_only_rank_zero_logs(monkeypatch):
    monkeypatch.setattr(loggers_mod, "is_rank_zero", lambda: False)
    lg = RecordingLogger()
    torchspeed.fit(_mlp(), _data(), epochs=1, log_every=2, loggers=[lg], **_FIT)
    assert lg.metrics == [] and lg.hparams == [] and lg.status == []


def test_bad_logger_is_a_clear_error():
    with pytest.raises(TypeError, match="has no log_metrics"):
        torchspeed.fit(_mlp(), _data(), loggers=[object()], **_FIT)


def test_minimal_logger_needs_only_log_metrics():
    class Minimal:
        def __init__(self):
            self.n = 0

        def log_metrics(self, metrics, step):
            self.n += 1
    lg = Minimal()
    torchspeed.fit(_mlp(), _data(), epochs=1, log_every=4, loggers=[lg], **_FIT)
    assert lg.n == 3 + 1
