"""The model zoo: each common model form trains under `torchspeed.fit` with no step_fn.

Every model is randomly initialised (weights=None, pretrained=False, Hugging Face models from tiny
configs: nothing is downloaded) and trains 3 steps on one synthetic batch repeated. Each must be
read by the batch contract as its form (decisions["batch_contract"]) and its loss must fall.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torch.utils.data import DataLoader, TensorDataset

import torchspeed
from torchspeed.train.loop.callbacks import Callback

pytest.importorskip("torchvision")

# The automatic plan (precision, channels_last, compile and the switch trial all "auto") on an injected
# CPU kind (the `cpu_profile` fixture: avx2, no native half precision), so the rules choose the same on
# every machine; 3 steps: the switch trial and compile="auto" skip a run this short.
PLAN = dict(max_steps=3, log_every=1, progress=False, schedule=None, malloc=False)


class GPT(nn.Module):
    """A GPT in the form GPT training scripts use: forward(idx, targets=None) -> (logits, loss);
    without targets, the logits of the last position only (an inference shortcut) and no loss."""

    def __init__(self, vocab=32, block=16, d=32, heads=2, layers=1):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(block, d)
        layer = nn.TransformerEncoderLayer(d, heads, 2 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device)
        x = self.blocks(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)), mask=mask, is_causal=True)
        x = self.ln(x)
        if targets is None:
            return self.head(x[:, [-1], :]), None
        logits = self.head(x)
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


class StepLosses(Callback):
    """The loss of every step (log_every=1: read at each step)."""

    def __init__(self):
        self.losses = []

    def on_step_end(self, trainer):
        self.losses.append(trainer.last_loss)


def _tokens(b=4, t=16, vocab=32):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (b, t), generator=g)
    return x, torch.roll(x, -1, dims=1)


def gpt():
    x, y = _tokens()
    return GPT(), (x, y), dict(optimizer="adamw", lr=3e-3)


def tv_classifier():
    from torchvision.models import resnet18

    g = torch.Generator().manual_seed(0)
    return resnet18(num_classes=10), (torch.randn(4, 3, 32, 32, generator=g), torch.arange(4)), dict(lr=0.01)


def tv_detection():
    from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_320_fpn

    g = torch.Generator().manual_seed(0)
    model = fasterrcnn_mobilenet_v3_large_320_fpn(weights=None, weights_backbone=None, num_classes=3,
                                                  min_size=64, max_size=80)
    images = [torch.rand(3, 64, 80, generator=g), torch.rand(3, 72, 64, generator=g)]  # variable sizes
    targets = [{"boxes": torch.tensor([[4.0, 6.0, 40.0, 50.0]]), "labels": torch.tensor([1])},
               {"boxes": torch.tensor([[10.0, 8.0, 50.0, 60.0], [2.0, 2.0, 20.0, 20.0]]),
                "labels": torch.tensor([2, 1])}]
    return model, (images, targets), dict(lr=0.01)


def tv_segmentation():
    from torchvision.models.segmentation import deeplabv3_mobilenet_v3_large

    g = torch.Generator().manual_seed(0)
    model = deeplabv3_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=3, aux_loss=True)
    mask = torch.zeros(2, 64, 64, dtype=torch.long)
    mask[:, 16:48, 16:48] = 1
    mask[1, :8] = 2
    return model, (torch.randn(2, 3, 64, 64, generator=g), mask), dict(optimizer="adamw", lr=1e-3)


def timm_classifier():
    timm = pytest.importorskip("timm")
    g = torch.Generator().manual_seed(0)
    model = timm.create_model("resnet10t", pretrained=False, num_classes=10)
    return model, (torch.randn(4, 3, 32, 32, generator=g), torch.arange(4)), dict(lr=0.01)


def hf_causal_lm():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=32, n_layer=1, n_head=2, bos_token_id=0,
                                  eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    x, _ = _tokens()
    return transformers.GPT2LMHeadModel(cfg), {"input_ids": x, "labels": x}, dict(optimizer="adamw", lr=3e-3)


def hf_sequence_classifier():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=32, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=16, num_labels=3,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    x, _ = _tokens()
    batch = {"input_ids": x, "attention_mask": torch.ones_like(x), "labels": torch.tensor([0, 1, 2, 1])}
    return transformers.BertForSequenceClassification(cfg), batch, dict(optimizer="adamw", lr=3e-3)


# (model, how the contract must read it, whether the metrics get an accuracy)
ZOO = {
    "gpt_logits_loss": (gpt, ("called as model(x, targets)", "own loss (a tuple of 2 holding a 0-dim loss)",
                              "logits feed the metrics"), True),
    "torchvision_resnet18": (tv_classifier, ("called as model(x)", "cross-entropy(logits, target)"), True),
    "torchvision_fasterrcnn": (tv_detection, ("called as model(x, targets)", "a dict of 4 losses, summed",
                                              "lists of tensors"), False),
    "torchvision_deeplabv3_aux": (tv_segmentation, ("called as model(x)", "'out' + 0.5 x cross-entropy on 'aux'"),
                                  True),
    "timm_resnet10t": (timm_classifier, ("called as model(x)", "cross-entropy(logits, target)"), True),
    "hf_gpt2_causal_lm": (hf_causal_lm, ("called as model(**batch)", "own loss (CausalLMOutput",
                                         "logits at t against labels[t + 1]"), True),
    "hf_bert_sequence_classification": (hf_sequence_classifier, ("called as model(**batch)",
                                                                 "own loss (SequenceClassifierOutput"), True),
}


@pytest.mark.parametrize("name", list(ZOO))
def test_model_zoo_trains_without_step_fn(name, cpu_profile):
    make, expected, has_acc = ZOO[name]
    torch.manual_seed(0)
    model, batch, opts = make()
    steps = StepLosses()
    res = torchspeed.fit(model, [batch] * 3, callbacks=[steps], **opts, **PLAN)
    contract = str(res.decisions["batch_contract"])
    for part in expected:
        assert part in contract, f"{name}: {contract!r} lacks {part!r}"
    assert res.steps == 3 and len(steps.losses) == 3 and all(math.isfinite(v) for v in steps.losses)
    assert steps.losses[-1] < steps.losses[0], f"{name}: the loss did not fall on a repeated batch: {steps.losses}"
    acc = res.history[-1]["train_acc"]
    assert (acc is not None) == has_acc, f"{name}: train_acc={acc}"


def test_detection_batch_size_counts_the_list_and_parts_are_measured(cpu_profile):
    from torchspeed.train.loop.batch import batch_size

    torch.manual_seed(0)
    model, batch, opts = tv_detection()
    assert batch_size(batch) == 2  # the images' list, not their 3 channels
    res = torchspeed.fit(model, [batch] * 3, **opts, **PLAN)
    measured = res.decisions["batch_contract"].measured
    assert set(measured) == {"loss_classifier", "loss_box_reg", "loss_objectness", "loss_rpn_box_reg"}
    assert res.history[-1]["train_acc"] is None


def test_gpt_trains_on_plain_batches_and_val_loss_is_its_own_loss_over_every_position(cpu_profile):
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, 32, (96, 1), generator=g)
    seq = (start + torch.arange(17)) % 32  # next token = this token + 1: learnable
    x, y = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    train = DataLoader(TensorDataset(x[:64], y[:64]), batch_size=16, shuffle=True, generator=g)
    val = DataLoader(TensorDataset(x[64:], y[64:]), batch_size=8)
    model = GPT()
    res = torchspeed.fit(model, train, epochs=3, val_loader=val, optimizer="adamw", lr=3e-3, progress=False,
                         restore_best=False)
    assert str(res.decisions["batch_contract"]).startswith("called as model(x, targets)")
    model.eval()
    with torch.no_grad():
        own = sum(model(xb, yb)[1] * len(xb) for xb, yb in val) / 32  # the model's own loss, every position
        last = F.cross_entropy(model(x[64:])[0][:, -1], y[64:, -1])  # the last-position shortcut
        acc = (model(x[64:], y[64:])[0].argmax(-1) == y[64:]).float().mean()
    row = res.history[-1]
    assert row["val_loss"] == pytest.approx(float(own), rel=1e-5)
    assert abs(row["val_loss"] - float(last)) > 1e-3
    assert row["val_acc"] == pytest.approx(float(acc), abs=1e-6)  # per token, from the model's own logits
    assert row["val_loss"] < res.history[0]["val_loss"], [r["val_loss"] for r in res.history]
