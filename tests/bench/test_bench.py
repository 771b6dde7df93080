import json

import torch

from torchspeed.bench.runner import bench_configs, run_bench, write_results
from torchspeed.bench.workloads import SyntheticImages, digits, resnet18_cifar
from torchspeed.cli.main import main
from torchspeed.train import TrainConfig


def test_synthetic_images_are_deterministic_and_learnable():
    a, b = SyntheticImages(64, seed=3), SyntheticImages(64, seed=3)
    assert torch.equal(a.data, b.data) and torch.equal(a.targets, b.targets)
    assert a.data.shape == (64, 3, 32, 32)
    # learnable: nearest class-mean classification beats chance by far on held-out samples
    train, val = SyntheticImages(512, seed=0), SyntheticImages(256, seed=1)
    means = torch.stack([train.data[train.targets == c].mean(0) for c in range(10)])
    pred = torch.cdist(val.data.flatten(1), means.flatten(1)).argmin(1)
    assert (pred == val.targets).float().mean() > 0.5


def test_resnet18_cifar_stem_and_digits_shapes():
    m = resnet18_cifar()
    assert m.conv1.kernel_size == (3, 3) and m.conv1.stride == (1, 1)
    assert isinstance(m.maxpool, torch.nn.Identity)
    tr, va = digits()
    assert tr[0][0].shape == (3, 32, 32) and len(tr) + len(va) == 1797


def test_naive_config_is_what_the_seeds_call_before():
    naive = next(c for c in bench_configs(torch.device("cpu")) if c.name == "naive")
    t = naive.train
    assert (t.precision, t.channels_last, t.compile, t.set_to_none, t.log_every) == ("fp32", False, False, False, 1)
    assert naive.num_workers == 0 and naive.allocator == "glibc"
    names = [c.name for c in bench_configs(torch.device("cpu"))]
    assert names[0] == "naive" and names[-1] == "all"
    assert {"channels_last", "no_item_sync", "set_to_none", "fused_optimizer", "compile", "workers"} <= set(names)
    assert next(c for c in bench_configs(torch.device("cpu")) if c.name == "all").train == TrainConfig(
        schedule=None, progress=False)


def test_run_bench_end_to_end_json_and_png(tmp_path):
    res = run_bench(model="mlp", batch_size=32, steps=2, rounds=2, warmup=1, device="cpu",
                    configs=["channels_last", "all"], eval_batches=1, train_size=256, compile=False,
                    progress=False)
    names = [r.config for r in res.rows]
    assert names == ["naive", "channels_last", "all"]
    naive = res.rows[0]
    assert naive.speedup == 1.0 and len(naive.samples_per_s_runs) == 2
    for r in (res.rows[0], res.rows[2]):
        assert r.samples_per_s > 0 and r.train_loss == r.train_loss and 0 <= r.check_val_acc <= 1
    cl = res.rows[1]  # an MLP has no convolutions: the row is there, marked not applicable, not run
    assert cl.samples_per_s is None and cl.speedup is None and "channels_last" in cl.decisions["not_applicable"]
    # each config ran in its own process with its own settings
    assert res.rows[-1].decisions["channels_last"]["value"] is False  # an MLP has no convolutions
    assert res.rows[0].decisions["allocator"] == "glibc"
    write_results(res, tmp_path / "b.json", tmp_path / "b.png")
    data = json.loads((tmp_path / "b.json").read_text())
    assert set(data) >= {"device", "torch", "workload", "rows"}
    assert set(data["rows"][0]) >= {"config", "samples_per_s", "speedup", "train_loss", "check_val_acc"}
    assert "val_acc" not in data["rows"][0] and data["meta"]["check_val_acc_chance"] == 0.1
    assert data["meta"]["commit"] is None or len(data["meta"]["commit"]) == 40
    assert (tmp_path / "b.png").stat().st_size > 1000


def test_bench_cli_quick_mlp(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert main(["bench", "--quick", "--model", "mlp", "--configs", "set_to_none", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    header = next(line for line in printed.splitlines() if "samples/s" in line)
    assert "speed-up" in header and "acc" not in header  # the throughput table shows no accuracy
    assert "accuracy is judged by time to target" in " ".join(printed.split())  # rich wraps long lines
    rows = json.loads(out.read_text())["rows"]
    assert [r["config"] for r in rows] == ["naive", "set_to_none"]
    assert out.with_suffix(".png").exists()


def test_every_config_restarts_from_the_same_weights_after_warm_up():
    """However long a warm-up (e.g. a compile trial), the timed rows train the same steps from the same start."""
    kw = dict(model="mlp", batch_size=32, steps=2, rounds=1, device="cpu", configs=["set_to_none"],
              eval_batches=1, train_size=256, compile=False, progress=False)
    short, long = run_bench(warmup=1, **kw), run_bench(warmup=4, **kw)
    assert long.rows[0].decisions["warmup_steps"] == 4
    for a, b in zip(short.rows, long.rows):
        assert a.train_loss == b.train_loss and a.check_val_acc == b.check_val_acc
