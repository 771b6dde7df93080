"""The batch contract's model forms one by one: the call, the loss it reads, the metrics, the decision."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchspeed
from torchspeed.train import Trainer, TrainConfig, evaluate
from torchspeed.train.loop.batch import AUX_WEIGHT, batch_size, count_correct, forward_loss
from torchspeed.train.loop.model_output import read_output
from torchspeed.train.loop.model_call import takes_target

FAST = dict(compile=False, progress=False, precision="fp32", malloc=False)


class OwnLoss(nn.Module):
    """forward(x, targets=None); what it returns with targets is chosen by `form`."""

    def __init__(self, form: str):
        super().__init__()
        self.form, self.lin = form, nn.Linear(4, 3)

    def forward(self, x, targets=None):
        logits = self.lin(x)
        if targets is None:
            return logits[:1]  # a shortcut: scored against the whole target it would fail
        loss = F.cross_entropy(logits, targets)
        return {"tensor": lambda: loss, "logits_loss": lambda: (logits, loss), "loss_logits": lambda: (loss, logits),
                "dict": lambda: {"loss": loss, "logits": logits},
                "losses": lambda: {"loss_a": loss, "loss_b": 2 * loss, "accuracy": torch.tensor(0.5)},
                "object": lambda: SimpleNamespace(loss=loss, logits=logits)}[self.form]()


BATCH = (torch.randn(6, 4, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 2, 0, 1, 2]))


@pytest.mark.parametrize("form,factor,has_logits", [("tensor", 1, False), ("logits_loss", 1, True),
                                                    ("loss_logits", 1, True), ("dict", 1, True),
                                                    ("losses", 3, False), ("object", 1, True)])
def test_own_loss_forms_are_read_and_recorded(form, factor, has_logits):
    model = OwnLoss(form)
    decisions = {}
    out = forward_loss(model, BATCH, decisions=decisions)
    expected = F.cross_entropy(model.lin(BATCH[0]), BATCH[1]) * factor
    torch.testing.assert_close(out.loss, expected)
    assert out.own_loss and (out.logits is not None) == has_logits
    assert (out.correct() is not None) == has_logits  # a model's own logits feed the metrics
    d = decisions["batch_contract"]
    assert d.value == "called as model(x, targets)" and "the model returns its own loss" in d.reason
    if form == "losses":  # summed, each kept (and measured once in the decision); "accuracy" is not a loss
        assert set(out.parts) == {"loss_a", "loss_b"} and set(d.measured) == {"loss_a", "loss_b"}
        assert "a dict of 2 losses, summed" in d.reason


def test_target_parameter_is_found_by_name_and_position():
    class KeywordOnly(nn.Module):
        def forward(self, x, *, labels=None):
            return x

    class SecondIsInput(nn.Module):  # `y` is an input here: the batch (x, y, target) must not pass target as y
        def forward(self, x, y):
            return x

    class HFStyle(nn.Module):  # labels is not right after the input: (x, y) batches are not passed as labels
        def forward(self, input_ids, attention_mask=None, labels=None):
            return input_ids

    assert takes_target(OwnLoss("tensor"), 1) == "targets"
    assert takes_target(KeywordOnly(), 1) == "labels"
    assert takes_target(SecondIsInput(), 2) is None and takes_target(HFStyle(), 1) is None
    assert takes_target(nn.Linear(2, 2), 1) is None


def test_keyword_only_target_is_passed_by_name():
    seen = {}

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x, *, target=None):
            seen["target"] = target
            return F.cross_entropy(self.lin(x), target)

    out = forward_loss(Model(), BATCH)
    assert seen["target"] is BATCH[1] and out.own_loss


class Segmenter(nn.Module):
    """torchvision's segmentation form: a dict of per-pixel logits, `out` and optionally `aux`."""

    def __init__(self, aux: bool):
        super().__init__()
        self.out, self.aux = nn.Conv2d(3, 4, 1), nn.Conv2d(3, 4, 1) if aux else None

    def forward(self, x):
        return {"out": self.out(x), **({"aux": self.aux(x)} if self.aux is not None else {})}


@pytest.mark.parametrize("aux", [False, True])
def test_dict_of_logits_is_scored_per_pixel_with_the_aux_head_weighted(aux):
    g = torch.Generator().manual_seed(0)
    x, mask = torch.randn(2, 3, 5, 6, generator=g), torch.randint(0, 4, (2, 5, 6), generator=g)
    mask[0, 0, 0] = -100  # padding: neither scored nor counted
    model = Segmenter(aux)
    decisions = {}
    out = forward_loss(model, (x, mask), decisions=decisions)
    expected = F.cross_entropy(model.out(x), mask) + (AUX_WEIGHT * F.cross_entropy(model.aux(x), mask) if aux else 0)
    torch.testing.assert_close(out.loss, expected)
    correct, counted = out.correct()
    assert int(counted) == 2 * 5 * 6 - 1
    assert int(correct) == int(((model.out(x).argmax(1) == mask) & (mask != -100)).sum())
    assert ("0.5 x cross-entropy on 'aux'" in decisions["batch_contract"].reason) == aux
    # a user's loss_fn scores each head
    mse = forward_loss(model, (x, mask), loss_fn=lambda o, t: o.square().mean())
    torch.testing.assert_close(mse.loss, model.out(x).square().mean() + (
        AUX_WEIGHT * model.aux(x).square().mean() if aux else 0))


def test_per_pixel_accuracy_needs_the_class_dimension_second():
    logits = torch.zeros(1, 3, 2, 2)
    logits[0, 2] = 1.0
    correct, counted = count_correct(logits, torch.tensor([[[2, 0], [2, -100]]]))
    assert int(correct) == 2 and int(counted) == 3
    assert count_correct(torch.zeros(1, 3, 2, 5), torch.zeros(1, 2, 2, dtype=torch.long)) is None


class Detector(nn.Module):
    """The detection form: model(list of variable-size images, list of target dicts) -> a dict of losses
    in train mode, predictions in eval mode."""

    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv2d(3, 4, 3), nn.Linear(4, 3)

    def forward(self, images, targets=None):
        feats = torch.stack([self.conv(im.unsqueeze(0)).mean((0, 2, 3)) for im in images])
        logits = self.head(feats)
        if not self.training:
            return [{"labels": lg.argmax().unsqueeze(0)} for lg in logits]
        labels = torch.stack([t["labels"][0] for t in targets])
        return {"loss_classifier": F.cross_entropy(logits, labels), "loss_box_reg": feats.square().mean()}


def _detection_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    images = [torch.rand(3, 8, 10, generator=g), torch.rand(3, 12, 9, generator=g), torch.rand(3, 7, 7, generator=g)]
    targets = [{"boxes": torch.tensor([[0.0, 0.0, 4.0, 4.0]]), "labels": torch.tensor([i % 3])} for i in range(3)]
    return images, targets


def test_list_batches_train_with_the_list_length_as_batch_size_and_no_compile_trial(cpu_profile):
    batch = _detection_batch()
    assert batch_size(batch) == 3 and batch_size(batch[0]) == 3
    res = torchspeed.fit(Detector(), [batch] * 2, max_steps=2, progress=False, malloc=False, compile="auto",
                         channels_last=True)
    d = res.decisions
    assert d["batch_contract"].value == "called as model(x, targets)"
    reason = d["batch_contract"].reason
    assert "a dict of 2 losses, summed" in reason and "lists of tensors" in reason
    assert d["compile"].value is False and d["compile"].reason.startswith("not applicable")
    assert "not applicable to the inputs" in d["channels_last"].reason


def test_detection_in_eval_mode_gets_an_error_naming_the_fix():
    model = Detector().eval()
    with pytest.raises(TypeError, match="eval mode.*step_fn"):
        forward_loss(model, _detection_batch())


def test_evaluate_reports_each_named_loss():
    class TwoLosses(nn.Module):
        def forward(self, x, targets=None):
            return {"loss_a": x.mean() * 0 + 1.0, "loss_b": x.mean() * 0 + 2.0}

    out = evaluate(TwoLosses(), [BATCH, BATCH], device="cpu")
    assert out["val_loss"] == pytest.approx(3.0) and out["val_loss_a"] == pytest.approx(1.0)
    assert out["val_loss_b"] == pytest.approx(2.0) and out["val_acc"] is None


def test_unknown_dict_output_gets_an_error_naming_the_fix():
    class Odd(nn.Module):
        def forward(self, x):
            return {"features": x}

    with pytest.raises(TypeError, match="no loss and no logits.*step_fn"):
        forward_loss(Odd(), BATCH)
    assert read_output({"features": torch.ones(2)}).logits is None


def test_trainer_records_the_contract_once():
    t = Trainer(OwnLoss("logits_loss"), device="cpu", config=TrainConfig(**FAST, schedule=None))
    t.step_batch(BATCH)
    first = t.decisions["batch_contract"]
    t.step_batch(BATCH)
    assert t.decisions["batch_contract"] is first and "logits feed the metrics" in first.reason
