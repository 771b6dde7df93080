import json

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler

from torchspeed import fit, scale_lr
from torchspeed.bench.workloads import create_model, digits
from torchspeed.cli.main import main
from torchspeed.train.sampler import rebuild_loader
from torchspeed.plan import make_plan
from torchspeed.train.config import TrainConfig


@pytest.fixture(scope="module")
def digits8():
    return digits(size=8)


def _mlp(seed=0):
    torch.manual_seed(seed)
    return create_model("mlp", image_size=8)


def test_fit_auto_tunes_batch_lr_and_loader(digits8):
    train, val = digits8
    loader = DataLoader(train, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0))
    res = fit(_mlp(), loader, epochs=1, val_loader=DataLoader(val, batch_size=256), batch_size="auto", lr="auto",
              loader="auto", progress=False, compile=False, device="cpu")
    d = res.decisions
    new_batch = int(d["batch_size"].value)
    assert new_batch % 8 == 0 and new_batch <= len(train) // 16
    found = float(d["lr_find"].value)  # measured at the batch the run trains with: not scaled to it afterwards
    assert f"at batch {new_batch}" in d["lr_find"].reason and "lr" not in d and float(d["peak_lr"].value) == found
    assert "one-cycle trial" in d["lr_find"].reason  # the one LR chooser: the recipe's rule (tune.lr_peak)
    assert "num_workers" in d["loader"].value
    assert res.steps == len(train) // new_batch + (len(train) % new_batch > 0)  # trained on the rebuilt loader
    assert res.final["val_acc"] > 0.5


def test_fixed_batch_scales_the_given_lr_and_keeps_the_sampler(digits8):
    train, _ = digits8
    loader = DataLoader(train, batch_size=16, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(0))
    model = _mlp()
    plan = make_plan(model, loader, TrainConfig(progress=False), batch_size=64, lr=0.05, optimizer="sgd",
                     weight_decay=0.0, device="cpu")  # the tuners' stages, for your own loop
    new_loader, lr, decisions = plan.loader, plan.lr, plan.decisions
    assert lr == pytest.approx(0.2) and "linear rule" in str(decisions["lr"])
    assert new_loader.batch_size == 64 and new_loader.drop_last
    assert new_loader.sampler is loader.sampler and isinstance(new_loader.sampler, RandomSampler)
    res = fit(_mlp(), loader, epochs=1, batch_size=64, lr=0.05, schedule=None, progress=False, compile=False,
              device="cpu")
    assert res.history[-1]["lr"] == pytest.approx(0.2)  # the optimizer ran at the scaled LR
    assert res.steps == len(train) // 64


def test_rebuild_loader_refuses_custom_batch_sampler(digits8):
    from torch.utils.data import Sampler

    class Buckets(Sampler):
        def __iter__(self):
            return iter([[0, 1], [2, 3]])

        def __len__(self):
            return 2

    loader = DataLoader(digits8[0], batch_sampler=Buckets())
    with pytest.raises(ValueError, match="custom batch_sampler"):
        rebuild_loader(loader, batch_size=32)


def test_auto_options_need_a_dataloader(digits8):
    batches = [(torch.randn(4, 3, 8, 8), torch.zeros(4, dtype=torch.long))]
    with pytest.raises(TypeError, match="DataLoader"):
        fit(_mlp(), batches, batch_size="auto", progress=False, device="cpu")


def test_cli_tune_writes_json_and_plot(tmp_path, capsys):
    rc = main(["tune", "lr", "--data", "digits", "--image-size", "8", "--quick", "--out", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "tune.json").read_text())
    assert report["lr"]["max_lr"] > 0 and report["provenance"]["torch"] == torch.__version__
    assert (tmp_path / "lr.png").stat().st_size > 1000
    assert "one-cycle max_lr" in capsys.readouterr().out


def test_cli_tune_batch(tmp_path):
    rc = main(["tune", "batch", "--data", "digits", "--image-size", "8", "--quick", "--max-batch", "64",
               "--out", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "tune.json").read_text())
    assert report["batch"]["largest"] == 64 and report["batch"]["fastest"] % 8 == 0


def test_cli_expected_mistakes_are_one_line_errors(tmp_path, capsys):
    assert main(["tune", "lr", "--data", str(tmp_path / "missing"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no such folder" in err and "Traceback" not in err
    assert main(["tune", "batch", "--batch-size", "0"]) == 2


def test_a_given_optimizer_gets_the_tuned_lr_and_keeps_its_state(digits8):
    train, _ = digits8
    loader = DataLoader(train, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0))
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = make_plan(model, loader, TrainConfig(progress=False), lr="auto", optimizer=opt, weight_decay=0.0,
                     device="cpu")
    lr, decisions = plan.lr, plan.decisions
    assert opt.param_groups[0]["lr"] == pytest.approx(lr) and "range test" in str(decisions["lr_find"])
    assert not opt.state  # the range test's momentum buffers are gone
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_cli_tune_on_an_image_folder(tmp_path):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for cls in ("cat", "dog"):
        (tmp_path / "data" / cls).mkdir(parents=True)
        for i in range(8):
            Image.fromarray(rng.integers(0, 255, (20, 20, 3), dtype=np.uint8)).save(tmp_path / "data" / cls / f"{i}.png")
    rc = main(["tune", "lr", "--data", str(tmp_path / "data"), "--image-size", "8", "--batch-size", "4", "--quick",
               "--out", str(tmp_path / "out")])
    assert rc == 0
    report = json.loads((tmp_path / "out" / "tune.json").read_text())
    assert report["workload"]["samples"] == 16 and len(report["lr"]["lrs"]) > 10
