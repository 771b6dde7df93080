"""The rows of where users would otherwise go (bench/peers.py): a plain fp32 loop and Lightning Fabric."""

import pytest
import torch

from torchspeed.bench.peers import lightning_precision
from torchspeed.bench.runner import bench_configs, run_bench
from torchspeed.env import DeviceCaps


def test_plain_and_lightning_rows_train_the_same_steps_as_naive():
    names = [c.name for c in bench_configs(torch.device("cpu"))]
    assert names[:3] == ["naive", "plain", "lightning"]
    assert "plain" not in [c.name for c in bench_configs(torch.device("cpu"), hand=False)]
    res = run_bench(model="mlp", batch_size=32, steps=1, rounds=1, warmup=1, device="cpu",
                    configs=["plain", "lightning"], eval_batches=1, train_size=128, compile=False, progress=False)
    naive, plain, lightning = res.rows
    assert [r.config for r in res.rows] == ["naive", "plain", "lightning"]
    assert plain.decisions["hand_settings"] == "fp32"  # plain PyTorch, fp32, nothing switched on
    assert plain.train_loss == pytest.approx(naive.train_loss, rel=1e-4)  # same weights, batches and numerics
    assert lightning.decisions["precision"] == lightning_precision(torch.device("cpu"))
    assert lightning.train_loss == pytest.approx(naive.train_loss, rel=0.05) and lightning.samples_per_s > 0


def test_lightning_precision_is_what_a_user_picks_for_the_hardware(monkeypatch):
    import torchspeed.train.trial.precision as precision

    for caps, expected in ((DeviceCaps("cpu", cpu_bf16=True), "bf16-mixed"), (DeviceCaps("cpu"), "32-true"),
                           (DeviceCaps("cuda", cuda_capability=(7, 0)), "16-mixed")):
        monkeypatch.setattr(precision.DeviceCaps, "of", classmethod(lambda cls, device, c=caps: c))
        assert lightning_precision(torch.device("cpu")) == expected
