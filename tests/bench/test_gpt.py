"""The language-model workload: bytes of the stdlib's source, a small GPT, and its bench rows."""

import json

import pytest
import torch
from torch.utils.data import DataLoader

import torchspeed
from torchspeed.bench.flops import train_flops_per_sample
from torchspeed.bench.hand import HandLoop, HandSettings, search_hand_settings
from torchspeed.bench.runner import run_bench
from torchspeed.bench.text import GPT, byte_text_datasets, stdlib_text
from torchspeed.bench.workloads import check_workload, create_model, default_data, make_datasets
from torchspeed.cli.main import main

SMALL = dict(max_bytes=300_000)
TINY_GPT = dict(n_layer=2, n_head=2, n_embd=32, block_size=32)


def test_text_windows_are_deterministic_shifted_and_split():
    train, val = byte_text_datasets(train_size=64, val_size=16, block_size=32, seed=3, **SMALL)
    again, _ = byte_text_datasets(train_size=64, val_size=16, block_size=32, seed=3, **SMALL)
    other, _ = byte_text_datasets(train_size=64, val_size=16, block_size=32, seed=4, **SMALL)
    assert torch.equal(train.x, again.x) and torch.equal(train.y, again.y)
    assert not torch.equal(train.x, other.x)
    x, y = train[5]
    assert x.shape == y.shape == (32,) and x.dtype == y.dtype == torch.int64
    assert torch.equal(train.x[:, 1:], train.y[:, :-1])  # y is x shifted by one byte
    assert int(train.x.max()) < 256 and int(train.x.min()) >= 0 and len(train) == 64 and len(val) == 16
    text = stdlib_text(SMALL["max_bytes"])
    assert text.data.numel() == SMALL["max_bytes"] and "standard library" in text.source
    cut = int(text.data.numel() * 0.9)  # train from the first 90%, val from the rest: no window in both
    assert int(train.starts.max()) + 33 <= cut
    for i in (0, 7):
        s = cut + int(val.starts[i])
        assert torch.equal(val.x[i], text.data[s:s + 32].long())
        assert torch.equal(val.y[i], text.data[s + 1:s + 33].long())
    assert b"import " in text.data[:50_000].numpy().tobytes()  # it is Python source


def test_gpt_forward_shape_causality_and_tied_padded_head():
    torch.manual_seed(0)
    model = GPT(**TINY_GPT)
    idx = torch.randint(0, 256, (3, 32))
    logits = model(idx)
    assert logits.shape == (3, 32, 256)
    changed = idx.clone()
    changed[:, 20] = (changed[:, 20] + 1) % 256
    out = model(changed)
    assert torch.allclose(out[:, :20], logits[:, :20], atol=1e-5)  # causal: the past ignores the future
    assert not torch.allclose(out[:, 20:], logits[:, 20:])
    odd = GPT(vocab_size=997, **TINY_GPT)
    assert odd.vocab_size == 1024 and odd.head.weight is odd.tok.weight  # T24 padding, tied head
    assert GPT(vocab_size=997, pad_vocab_to=1, **TINY_GPT).vocab_size == 997
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 33, dtype=torch.long))
    bench = create_model("gpt")
    assert (bench.cfg.n_layer, bench.cfg.n_head, bench.cfg.n_embd, bench.cfg.block_size) == (4, 4, 128, 128)
    assert not any(isinstance(m, torch.nn.Conv2d) for m in bench.modules())


def test_text_data_goes_with_gpt_only():
    assert default_data("gpt") == "text" and default_data("resnet20") == "synthetic"
    check_workload("gpt", "text")
    with pytest.raises(ValueError, match="text"):
        check_workload("gpt", "synthetic")
    with pytest.raises(ValueError, match="image"):
        check_workload("resnet20", "text")
    train, _ = make_datasets("text", train_size=8, val_size=4)
    assert train[0][0].shape == (128,)


def test_bench_cli_refuses_a_model_on_the_wrong_data(capsys):
    assert main(["bench", "--model", "gpt", "--data", "digits"]) == 2
    assert main(["bench", "--model", "mlp", "--data", "text"]) == 2
    assert "trains on" in capsys.readouterr().err


def _tiny_text(n=256, seed=0):
    train, val = byte_text_datasets(train_size=n, val_size=64, block_size=32, seed=seed, **SMALL)
    return train, val


def test_a_tiny_gpt_learns_the_text_with_the_trainer():
    train, val = _tiny_text()
    torch.manual_seed(0)
    model = GPT(**TINY_GPT)
    loader = DataLoader(train, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0))
    res = torchspeed.fit(model, loader, epochs=3, val_loader=DataLoader(val, batch_size=64), optimizer="adamw",
                         lr=3e-3, compile=False, progress=False, precision="fp32", schedule=None)
    first, last = res.history[0], res.history[-1]
    assert first["train_loss"] < 5.0  # ln 256 = 5.55 at the start: it learned within the first epoch
    assert last["train_loss"] < first["train_loss"] - 0.3
    assert last["val_acc"] is not None and last["val_acc"] > 0.2  # per token; a uniform guess gets 1/256


def test_the_hand_loop_trains_a_gpt_on_per_token_loss():
    train, val = _tiny_text()
    torch.manual_seed(0)
    loader = DataLoader(train, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0))
    loop = HandLoop(GPT(**TINY_GPT), loader, torch.device("cpu"), settings=HandSettings(), lr=0.05)  # the bench's lr
    loop.run(8)
    early = loop.train_loss()  # the mean over the first 8 steps, from ln 256 = 5.55
    loop.run(24)
    loop.restart()  # the meter and the data start over; the weights stay trained
    loop.run(8)
    assert loop.train_loss() < early - 0.5, (early, loop.train_loss())
    acc = loop.evaluate(DataLoader(val, batch_size=64))
    assert 0.1 < acc < 1.0  # counted per token, not per window


def test_hand_search_leaves_channels_last_out_for_a_gpt(monkeypatch):
    import torchspeed.bench.hand as hand

    monkeypatch.setattr(hand, "hand_precisions", lambda device: ["fp32"])
    monkeypatch.setattr(hand, "_time_candidate", lambda mk, loader, dev, s, steps, warm: 1.0 + s.fused)
    _, log = search_hand_settings(lambda: GPT(**TINY_GPT), [], torch.device("cpu"))
    assert set(log["tried"]) == {"fp32", "fp32+fused", "fp32+compile"}


def test_gpt_training_flops_match_the_formula():
    n = 4 * 12 * 128 * 128 + 256 * 128          # block weights and the (tied) embedding
    attention = 4 * 2 * 2 * 128 * 128 * 128     # per layer: QK^T and AV, 2 FLOPs per multiply-add
    expected = 6 * n * 128 + 3 * attention        # forward + backward per window of 128 tokens
    assert train_flops_per_sample("gpt") == pytest.approx(expected, rel=0.1)


@pytest.mark.capability
def test_run_bench_gpt_reports_channels_last_not_applicable(tmp_path, cpu_profile):
    res = run_bench(model="gpt", batch_size=4, steps=1, rounds=1, warmup=1, device="cpu",
                    configs=["channels_last", "hand", "all"], eval_batches=1, train_size=32, compile=False,
                    progress=False)
    assert res.meta["data"] == "text" and res.workload.startswith("gpt on text")
    assert [r.config for r in res.rows] == ["naive", "channels_last", "hand", "all"]
    na = res.rows[1]
    assert na.samples_per_s is None and na.speedup is None and "no 2D convolutions" in na.decisions["not_applicable"]
    for r in (res.rows[0], res.rows[2], res.rows[3]):
        assert r.samples_per_s > 0 and 0 < r.train_loss < 6.0 and 0 <= r.check_val_acc <= 1
    assert res.rows[2].decisions["channels_last"] == "False"
    # same weights, same batches: all trains like naive (bf16, where its trial picked it, within its noise)
    same_numerics = res.rows[3].decisions["precision"]["value"] == "fp32"
    assert res.rows[3].train_loss == pytest.approx(res.rows[0].train_loss, rel=0.02 if same_numerics else 0.05)
    assert res.meta["train_flops_per_sample"] > 1e8


def test_bench_cli_prints_not_applicable(tmp_path, capsys):
    out = tmp_path / "gpt.json"
    assert main(["bench", "--quick", "--model", "gpt", "--configs", "channels_last", "--no-hand", "--batch-size", "4",
                 "--steps", "1", "--rounds", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "n/a" in printed and "channels_last" in printed
    rows = json.loads(out.read_text())["rows"]
    assert [r["config"] for r in rows] == ["naive", "channels_last"]
    assert rows[1]["samples_per_s"] is None and rows[1]["decisions"]["not_applicable"]
