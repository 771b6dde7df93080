"""One row per optimizer (train/optim_info.py): every rule reads the row, so a new row needs no other edit."""

import inspect

import pytest
import torch
from torch import nn

from torchspeed.train.optim import create_optimizer, is_schedule_free
from torchspeed.train.optim_info import (OPTIM_INFO, OPTIMIZERS, WEIGHT_DECAY, OptimInfo, default_weight_decay,
                                         optimizer_available, optimizer_info, register_optimizer)
from torchspeed.train.schedule import lr_rule, scale_lr_for_batch
from torchspeed.train.trial.switch_choice import fusable


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 8),
                               torch.nn.Linear(8, 2))


class FakeOpt(torch.optim.SGD):
    """An optimizer torchspeed has never heard of (a subclass: no rule may match it by torch's class)."""


def _register(monkeypatch, info: OptimInfo) -> OptimInfo:
    monkeypatch.setitem(OPTIM_INFO, info.name.lower(), info)  # removed again after the test
    return register_optimizer(info)


@pytest.fixture
def fake_row(monkeypatch):
    return _register(monkeypatch, OptimInfo("Fake", FakeOpt, weight_decay=0.123, lr_rule="sqrt", fusable=True,
                                            momentum=True, default_lr=0.7))


def test_a_new_row_is_built_and_answered_from_with_no_other_edit(fake_row):
    opt = create_optimizer("fake", _model(), lr=0.1, weight_decay=None, momentum=0.8)
    assert type(opt) is FakeOpt
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0, 0.123]  # its default; norms and biases: none
    assert opt.defaults["momentum"] == 0.8 and opt.defaults["nesterov"] is False  # momentum yes, nesterov no
    assert opt.defaults["fused"] is True and fusable(opt)  # its row says torch has a kernel: the switch may flip it
    assert lr_rule("fake") == "sqrt" and scale_lr_for_batch(0.1, 400, 100, "FAKE") == pytest.approx(0.2)
    assert default_weight_decay("fake") == 0.123 and WEIGHT_DECAY["fake"] == 0.123
    assert "fake" in OPTIMIZERS and optimizer_info("fake").default_lr == 0.7


def test_flags_change_what_is_built_and_answered(monkeypatch):
    _register(monkeypatch, OptimInfo("fake", FakeOpt, lr_rule="linear", nesterov=True, momentum=True))
    opt = create_optimizer("fake", _model(), lr=0.1, weight_decay=None)
    assert opt.defaults["nesterov"] is True and opt.defaults["weight_decay"] == 0.0
    assert not opt.defaults.get("fused") and not fusable(opt)
    assert lr_rule("fake") == "linear" and default_weight_decay("fake") == 0.0


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_row_builds_on_a_tiny_model_and_agrees_with_what_it_builds(name):
    info = optimizer_info(name)
    if not optimizer_available(name):
        pytest.skip(f"{name} needs the {info.extra} extra")
    model = _model()
    opt = create_optimizer(name, model, lr=info.default_lr or 0.01, weight_decay=None)
    assert type(opt) is info.resolve()
    decays = {g["weight_decay"] for g in opt.param_groups}
    assert decays == ({0.0, info.weight_decay} if info.weight_decay else {0.0})
    if info.build is None:  # a class over param groups: the row's flags are the class's arguments
        params = inspect.signature(type(opt).__init__).parameters
        assert info.betas == ("betas" in params) and info.momentum == ("momentum" in params)
        assert info.lr_rule == lr_rule(opt)  # the name's rule and the object's rule agree
        assert info.fusable == ("fused" in params) == fusable(opt)
    assert is_schedule_free(opt) == info.schedule_free
    if info.schedule_free:
        opt.train()  # Schedule-Free steps in train mode
    before = [p.detach().clone() for p in model.parameters()]
    torch.nn.functional.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 2, (8,))).backward()
    opt.step()
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_the_views_and_the_old_defaults_read_the_rows():
    assert tuple(OPTIMIZERS)[:6] == ("sgd", "adamw", "lamb", "lars", "muon", "schedulefree")
    assert dict(WEIGHT_DECAY) == {n: OPTIM_INFO[n].weight_decay for n in OPTIM_INFO}
    assert [lr_rule(n) for n in ("sgd", "lars", "adamw", "lamb", "muon", "schedulefree", "adam")] == \
        ["linear"] * 2 + ["sqrt"] * 5
    assert lr_rule("unknown") == lr_rule(None) == "linear" and default_weight_decay("unknown") == 0.0


def test_a_bad_row_or_name_says_what_is_wrong():
    with pytest.raises(ValueError, match="lr_rule must be one of"):
        OptimInfo("x", torch.optim.SGD, lr_rule="cubic")
    with pytest.raises(ValueError, match="'module:Class' with the extra"):
        OptimInfo("x", "somewhere.Opt")
    with pytest.raises(ValueError, match="not one of sgd, adamw"):
        optimizer_info("adagradx")


# ------------------------------------------------------------------ Schedule-Free's LR by the model's width
def test_typical_fan_in_is_the_median_by_weight_count_embeddings_excepted():
    from torchspeed.train.optim import typical_fan_in

    mlp = nn.Sequential(nn.Linear(20, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 5))
    assert typical_fan_in(mlp) == 512  # 20 x 512 + 2 x 512-input matrices: most weights take 512 inputs
    conv = nn.Sequential(nn.Conv2d(3, 16, 3), nn.Conv2d(16, 32, 3))  # 3*9 and 16*9 inputs per output
    assert typical_fan_in(conv) == 144
    lm = nn.Sequential(nn.Embedding(50_000, 64), nn.Linear(64, 64))  # the lookup has no fan-in
    assert typical_fan_in(lm) == 64
    assert typical_fan_in(nn.Sequential(nn.BatchNorm1d(4))) is None


def test_schedule_free_lr_scales_up_for_narrow_models_by_class_transformers_at_most_4x():
    """(512 / fan-in) ** 2, at most 16x, for a model without attention or LayerNorm (less for one deeper than 5 weight
    layers): a 512-wide MLP keeps the default (4x overfit it, docs/recipe.md); 512 / fan-in, at most 4x, for one
    with either (a transformer: twice that lost accuracy)."""
    from torchspeed.train.optim import SCHEDULE_FREE_LR, has_attention, schedule_free_lr, weight_layers

    wide = nn.Sequential(nn.Linear(4096, 4096), nn.Linear(4096, 10))
    assert schedule_free_lr(wide)[0] == SCHEDULE_FREE_LR and "default" in schedule_free_lr(wide)[1]
    mid = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512))
    assert not has_attention(mid) and schedule_free_lr(mid)[0] == SCHEDULE_FREE_LR
    half = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))  # (512 / 256) ** 2
    assert schedule_free_lr(half)[0] == pytest.approx(4 * SCHEDULE_FREE_LR) and "^2" in schedule_free_lr(half)[1]
    quarter = nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 128))  # (512 / 128) ** 2: the most
    assert schedule_free_lr(quarter)[0] == pytest.approx(16 * SCHEDULE_FREE_LR)
    narrow = nn.Sequential(nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 2))
    lr, why = schedule_free_lr(narrow)
    assert lr == pytest.approx(16 * SCHEDULE_FREE_LR) and "fan-in is 32" in why and "no attention" in why
    # the same widths with a LayerNorm, an attention layer, or a model's own attention class: the transformer rule
    normed = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.Linear(32, 32), nn.Linear(32, 2))
    assert has_attention(normed) and schedule_free_lr(normed)[0] == pytest.approx(4 * SCHEDULE_FREE_LR)

    class CausalSelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(512, 3 * 512)

    own = nn.Sequential(CausalSelfAttention(), nn.Linear(512, 512))
    assert has_attention(own) and schedule_free_lr(own)[0] == SCHEDULE_FREE_LR
    mha = nn.ModuleList([nn.MultiheadAttention(32, 4), nn.Linear(32, 32)])
    assert has_attention(mha) and schedule_free_lr(mha)[0] == pytest.approx(4 * SCHEDULE_FREE_LR)
    assert not has_attention(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.GRU(8, 8)))
    # a deep stack without attention: the width rule x sqrt(5 / depth) (depth-muP); 20 layers of fan-in 32: 16x / 2
    deep = nn.Sequential(*(nn.Linear(32, 32) for _ in range(20)))
    assert weight_layers(deep) == 20 and weight_layers(narrow) == 3
    lr, why = schedule_free_lr(deep)
    assert lr == pytest.approx(8 * SCHEDULE_FREE_LR) and "20 weight layers" in why
    wide_deep = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(80)))  # wider than 512: 1x, and depth no less
    lr, why = schedule_free_lr(wide_deep)
    assert lr == SCHEDULE_FREE_LR and "as wide as those it was tuned on" in why
    narrow_deep = nn.Sequential(*(nn.Linear(256, 256) for _ in range(80)))  # 4x x sqrt(5 / 80) = 1x: depth's doing
    lr, why = schedule_free_lr(narrow_deep)
    assert lr == SCHEDULE_FREE_LR and "80 weight layers take back the 4x" in why and "as wide" not in why
    assert schedule_free_lr(nn.Sequential(nn.BatchNorm1d(4)))[0] == SCHEDULE_FREE_LR
