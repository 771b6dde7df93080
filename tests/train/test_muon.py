import io

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchspeed
from torchspeed.bench.text import GPT
from torchspeed.train.state.checkpoint import load_checkpoint
from torchspeed.train.optim import create_optimizer, describe_optimizer, hidden_matrices, matrix_share, mostly_matrices
from torchspeed.train.muon import MuonAdamW
from torchspeed.train.schedule import create_scheduler


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 3))


def _gpt(seed=0):
    torch.manual_seed(seed)
    return GPT(n_layer=1, n_head=2, n_embd=16, block_size=8)


def _ids(opt_groups):
    return {id(p) for g in opt_groups for p in g["params"]}


def test_muon_gets_exactly_the_hidden_matrices_and_adamw_the_rest():
    model = _gpt()
    hidden, other = hidden_matrices(model)
    assert [n for n, _ in hidden] == ["blocks.0.attn.qkv.weight", "blocks.0.attn.proj.weight",
                                      "blocks.0.mlp.0.weight", "blocks.0.mlp.2.weight"]
    assert {"tok.weight", "pos.weight", "ln_f.weight", "blocks.0.attn.qkv.bias"} <= {n for n, _ in other}
    opt = create_optimizer("muon", model, lr=1e-3, weight_decay=0.05)
    assert isinstance(opt, MuonAdamW)
    assert _ids(opt.muon.param_groups) == {id(p) for _, p in hidden}
    assert _ids(opt.adamw.param_groups) == {id(p) for _, p in other}
    assert opt.param_groups == opt.muon.param_groups + opt.adamw.param_groups  # the same dicts
    assert all(a is b for a, b in zip(opt.param_groups, opt.muon.param_groups + opt.adamw.param_groups))
    # biases and norm weights never decay; embeddings (and the tied head) and the hidden matrices do
    no_decay = _ids(g for g in opt.param_groups if g["weight_decay"] == 0)
    assert no_decay == {id(p) for n, p in other if p.ndim == 1}
    assert opt.muon.param_groups[0]["adjust_lr_fn"] == "match_rms_adamw"
    assert "Muon (4 hidden matrices) + AdamW" in describe_optimizer(opt)


def test_mlp_head_is_adamw_and_share():
    model = _mlp()
    hidden, other = hidden_matrices(model)
    assert [n for n, _ in hidden] == ["0.weight", "3.weight"]  # 5.weight is the output head
    assert "5.weight" in {n for n, _ in other}
    assert 0.5 < matrix_share(model) < 1 and mostly_matrices(model)
    conv = nn.Sequential(nn.Conv2d(3, 64, 3), nn.BatchNorm2d(64), nn.Flatten(), nn.Linear(64, 10))
    assert matrix_share(conv) == 0 and not mostly_matrices(conv)


def test_conv_only_model_is_a_clear_error():
    conv = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3), nn.Flatten(), nn.Linear(4, 10))
    with pytest.raises(ValueError, match="no hidden 2-D weight matrices.*adamw"):
        create_optimizer("muon", conv, lr=1e-3)


def test_onecycle_drives_both_parts_lr_and_momentum():
    opt = create_optimizer("muon", _mlp(), lr=1e-2, weight_decay=0.0)
    sched = create_scheduler("onecycle", opt, total_steps=20, max_lr=1e-2)
    for _ in range(5):
        opt.step()
        sched.step()
    lrs = {g["lr"] for g in opt.param_groups}
    assert len(lrs) == 1 and 0 < lrs.pop() < 1e-2
    muon_m = opt.muon.param_groups[0]["momentum"]
    adam_b1 = opt.adamw.param_groups[0]["betas"][0]
    assert 0.9 <= muon_m < 0.999 and 0.85 <= adam_b1 < 0.95  # each around its own value (0.95, 0.9)
    opt.step()
    assert opt.adamw.param_groups[0]["betas"][0] == opt.adamw.param_groups[0]["momentum"]


def test_fit_with_muon_under_onecycle_lowers_the_loss(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(256, 8)
    y = (x[:, :3] @ torch.randn(3, 3)).argmax(1)
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0))
    res = torchspeed.fit(_mlp(), loader, optimizer="muon", lr=1e-2, epochs=4, schedule="onecycle", compile=False,
                         progress=False, precision="fp32", clip_grad_norm=1.0, checkpoint_dir=str(tmp_path))
    assert res.history[-1]["train_loss"] < 0.8 * res.history[0]["train_loss"]
    assert "Muon" in str(res.decisions["optimizer"])
    ckpt = sorted(tmp_path.glob("*.pt"))[-1]
    state = load_checkpoint(ckpt)  # weights_only=True
    model = _mlp()
    opt = create_optimizer("muon", model, lr=1e-2, weight_decay=None)  # fit's default decay: the same groups
    opt.load_state_dict(state["optimizer"])
    assert len(opt.state) == len(list(model.parameters()))


def test_checkpoint_round_trip_restores_identical_state():
    model = _gpt()
    opt = create_optimizer("muon", model, lr=1e-3, weight_decay=0.05)
    x = torch.randint(0, 256, (2, 8))
    for _ in range(3):
        model(x).float().logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    clone = _gpt(seed=1)
    clone.load_state_dict(model.state_dict())
    fresh = create_optimizer("muon", clone, lr=5.0, weight_decay=0.5)
    fresh.load_state_dict(loaded)
    assert fresh.muon.state is fresh.state and fresh.adamw.state is fresh.state
    assert all(a is b for a, b in zip(fresh.param_groups, fresh.muon.param_groups + fresh.adamw.param_groups))
    a, b = opt.state_dict(), fresh.state_dict()
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        for key, v in a["state"][k].items():
            assert torch.equal(v, b["state"][k][key])
    # both now take the same next step
    for m, o in ((model, opt), (clone, fresh)):
        m(x).float().logsumexp(-1).mean().backward()
        o.step()
    for (n, p), q in zip(model.named_parameters(), clone.parameters()):
        assert torch.equal(p, q), n


def test_grad_scaler_unscales_and_steps_both_parts():
    from torchspeed.train.loop.step import optimizer_step

    model = _mlp()
    opt = create_optimizer("muon", model, lr=1e-2, weight_decay=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
    skipped = optimizer_step(opt, scaler=scaler, clip_grad_norm=1.0)
    assert int(skipped) == 0
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))  # every tensor moved
    with pytest.raises(ValueError, match="new optimizer"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2, 2))]})
