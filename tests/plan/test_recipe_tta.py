"""The recipe's flip-TTA part (plan/recipe_tta.py): scored from 2 forward passes a batch, kept only when it scores
better on training batches, charged to the tuning budget, cached for the next run."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchspeed.plan import recipe_tta
from torchspeed.plan.recipe_tta import TTA_COST, after_training, choose_tta, flip_scores
from torchspeed.train.config import TrainConfig
from torchspeed.train.decision import TrialCache
from torchspeed.train.eval_view import eval_weights
from torchspeed.train.evaluate import evaluate
from torchspeed.train.loop.trainer import Trainer


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, 4))


def _loader(n=128, bs=16):
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 4, (n,), generator=g)
    x = torch.randn(n, 3, 8, 8, generator=g) + y.view(-1, 1, 1, 1).float()
    return DataLoader(TensorDataset(x, y), batch_size=bs, shuffle=True, generator=torch.Generator().manual_seed(0))


def test_flip_scores_match_evaluate_from_two_forward_passes_a_batch():
    model, batches = _net(), list(_loader())[:3]
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    got = flip_scores(model, batches)
    assert len(calls) == 2 * len(batches)  # evaluate plain + evaluate(tta="flip") would take 3 a batch
    plain, flip = evaluate(model, batches), evaluate(model, batches, tta="flip")
    assert got["plain"]["loss"] == pytest.approx(plain["val_loss"], rel=1e-5)
    assert got["flip"]["loss"] == pytest.approx(flip["val_loss"], rel=1e-5)
    assert (got["plain"]["acc"], got["flip"]["acc"]) == pytest.approx((plain["val_acc"], flip["val_acc"]))
    assert model.training  # its mode restored


@pytest.mark.parametrize("plain, flip, chosen", [
    ((0.50, 0.80), (0.40, 0.85), "flip"),     # flips score better: kept
    ((0.50, 0.80), (0.495, 0.85), None),      # within the 2% margin: not worth doubling evaluation
    ((0.50, 0.80), (0.40, 0.70), None),       # lower loss but fewer right: refused
    ((0.30, 0.95), (0.90, 0.60), None),       # digits-like: flipped inputs are other symbols
])
def test_tta_is_kept_only_when_flips_score_better_on_training_batches(plain, flip, chosen, monkeypatch):
    scores = {"plain": {"loss": plain[0], "acc": plain[1]}, "flip": {"loss": flip[0], "acc": flip[1]}}
    monkeypatch.setattr(recipe_tta, "flip_scores", lambda *a, **k: scores)
    d = choose_tta(_net(), [next(iter(_loader()))])
    assert d.value == chosen and d.measured == scores


def test_tta_is_not_tried_on_inputs_that_are_not_images_or_models_without_logits(recipe_of):
    tokens = [(torch.randint(0, 10, (4, 16)), torch.randint(0, 10, (4, 16)))]
    assert choose_tta(nn.Embedding(10, 10), tokens).value is None
    rec = recipe_of(nn.Sequential(nn.Embedding(10, 10), nn.Flatten(), nn.Linear(160, 10)),
                    DataLoader(TensorDataset(torch.randint(0, 10, (32, 16)), torch.randint(0, 10, (32,))),
                               batch_size=8), parts=("tta",))
    assert "tta" not in rec.pending and "not an image classifier" in rec.decisions["tta"].reason
    seg = nn.Conv2d(3, 4, 1)  # per-pixel logits: no flip score
    assert "no flip" in choose_tta(seg, [next(iter(_loader()))]).reason


def _trainer(model):
    return Trainer(model, device="cpu", config=TrainConfig(progress=False, compile=False, precision="fp32",
                                                           channels_last=False, schedule=None))


def test_the_check_is_charged_to_the_budget_then_measured_after_training_and_cached(tmp_path, monkeypatch, recipe_of):
    cache = TrialCache(tmp_path / "c.json")
    kw = dict(parts=("tta",), cache=cache, share=0.05)
    short = recipe_of(_net(), _loader(), steps=TTA_COST * 20 - 1, **kw)  # 5%: under its cost
    assert "tta" not in short.pending and short.tta is None
    assert short.decisions["tta"].reason.startswith("prior: no flip TTA") and "over 5%" in short.decisions["tta"].reason

    rec = recipe_of(_net(), _loader(), steps=TTA_COST * 20, **kw)
    assert rec.pending["tta"]["cost"] == TTA_COST and rec.decisions["tta"].value is None
    flips_better = {"plain": {"loss": 0.5, "acc": 0.8}, "flip": {"loss": 0.4, "acc": 0.85}}
    monkeypatch.setattr(recipe_tta, "flip_scores", lambda *a, **k: flips_better)
    trainer = _trainer(_net())
    dec = after_training(trainer, rec)
    assert dec.value == "flip" and trainer.config.tta == "flip" and trainer.decisions["tta"] is dec
    assert "tta" not in rec.pending

    monkeypatch.setattr(recipe_tta, "flip_scores", lambda *a, **k: pytest.fail("measured again"))
    again = recipe_of(_net(), _loader(), steps=TTA_COST * 20 - 1, **kw)  # short, but cached
    assert again.tta == "flip" and "cached" in again.decisions["tta"].reason and "tta" not in again.pending
    trainer = _trainer(_net())
    assert after_training(trainer, again).value == "flip" and trainer.config.tta == "flip"


def test_a_users_own_tta_stands(recipe_of):
    rec = recipe_of(_net(), _loader(), parts=("tta",))  # every part affordable: checked
    trainer = _trainer(_net())
    trainer.config.tta = "flip"
    after_training(trainer, rec)  # whatever the check says, the user's setting is kept
    assert trainer.config.tta == "flip"


def test_the_check_scores_the_weights_that_are_evaluated_schedule_free_averaged(monkeypatch, recipe_of):
    pytest.importorskip("schedulefree")
    trainer = Trainer(_net(), optimizer="schedulefree", lr=0.01, device="cpu",
                      config=TrainConfig(progress=False, compile=False, precision="fp32", channels_last=False,
                                         schedule=None, epochs=1))
    trainer.fit(_loader())
    seen = {}

    def spy(model, batches, **kw):
        seen["w"] = model[0].weight.detach().clone()
        return {"plain": {"loss": 0.5, "acc": 0.8}, "flip": {"loss": 0.5, "acc": 0.8}}

    monkeypatch.setattr(recipe_tta, "flip_scores", spy)
    rec = recipe_of(_net(), _loader(), parts=("tta",))
    averaged = trainer.module[0].weight.detach().clone()  # fit leaves the model holding the averaged weights
    trainer.optimizer.train()
    training_weights = trainer.module[0].weight.detach().clone()  # the iterate it trained
    trainer.optimizer.eval()
    after_training(trainer, rec)
    with eval_weights(trainer) as module:
        torch.testing.assert_close(module[0].weight.detach(), averaged, rtol=1e-5, atol=1e-6)
    # Schedule-Free's average differs from its iterate by far more than the eval()/train() round trip's rounding
    assert (averaged - training_weights).abs().max() > 1e-3
    torch.testing.assert_close(seen["w"], averaged, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(trainer.module[0].weight.detach(), averaged, rtol=1e-5, atol=1e-6)
