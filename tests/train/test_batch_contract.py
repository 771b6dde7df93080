"""fit, evaluate and the tuners beyond (x, y) image classification: the batch contract and task-aware metrics."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import torchspeed
from torchspeed.train import Trainer, TrainConfig, evaluate
from torchspeed.train.loop.batch import count_correct, forward_loss, split_batch
from torchspeed.train.state.checkpoint import load_checkpoint

FAST = dict(compile=False, progress=False, precision="fp32", trial=False)  # bit-exact comparisons: no timing-based choice


class HFStyleClassifier(nn.Module):
    """Takes input_ids/attention_mask/labels keywords; returns an object with .loss and .logits."""

    def __init__(self, vocab=50, classes=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, 16)
        self.head = nn.Linear(16, classes)

    def forward(self, input_ids, attention_mask=None, labels=None):
        h = self.emb(input_ids)
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1)
        logits = self.head(h.mean(1))
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return SimpleNamespace(loss=loss, logits=logits)


class DictDataset(torch.utils.data.Dataset):
    def __init__(self, n=96, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 3, (n,), generator=g)
        # the class is written into the tokens: learnable
        self.ids = torch.randint(3, 50, (n, 12), generator=g)
        self.ids[:, :6] = self.labels[:, None]
        self.mask = torch.ones(n, 12)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


def test_hf_style_dict_batches_train_evaluate_and_find_lr():
    loader = DataLoader(DictDataset(), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0))
    model = HFStyleClassifier()
    res = torchspeed.fit(model, loader, epochs=4, val_loader=DataLoader(DictDataset(seed=1), batch_size=32),
                         lr=0.05, optimizer="adamw", **FAST)
    assert res.history[-1]["train_loss"] < res.history[0]["train_loss"]
    assert res.history[-1]["val_acc"] is not None and res.history[-1]["val_acc"] > 0.6  # chance is 1/3
    out = evaluate(model, DataLoader(DictDataset(seed=1), batch_size=32), device="cpu")
    assert out["samples"] == 96 and out["val_acc"] == pytest.approx(res.history[-1]["val_acc"])
    lr = torchspeed.find_lr(model, loader, num_steps=12, progress=False)
    assert len(lr.losses) >= 11 and all(math.isfinite(v) for v in lr.losses[:5])


def test_dict_batch_passes_only_the_keywords_the_model_accepts():
    class NoMask(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, x):
            return self.lin(x)

    batch = {"x": torch.randn(6, 4), "labels": torch.tensor([0, 1, 0, 1, 1, 0]), "meta": torch.zeros(6)}
    out = forward_loss(NoMask(), batch)
    assert out.loss.dim() == 0 and out.n == 6 and out.correct()[1] == 6


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(5, 8), nn.Linear(3, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, xa, xb):
        return self.head(torch.relu(self.a(xa) + self.b(xb)))


def test_model_with_two_inputs_trains_and_evaluates():
    g = torch.Generator().manual_seed(0)
    xa, xb = torch.randn(128, 5, generator=g), torch.randn(128, 3, generator=g)
    y = ((xa[:, 0] + xb[:, 0]) > 0).long()
    loader = DataLoader(TensorDataset(xa, xb, y), batch_size=16, shuffle=True, generator=g)
    res = torchspeed.fit(TwoInputs(), loader, epochs=5, val_loader=DataLoader(TensorDataset(xa, xb, y), batch_size=64),
                         lr=0.1, **FAST)
    assert res.history[-1]["val_acc"] > 0.8


def _regression_data(seed=0, n=256):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, (x @ torch.tensor([[1.0], [-2.0], [0.5], [0.0]])) * 0.3)


def test_regression_reports_no_accuracy_and_best_checkpoint_follows_val_loss(tmp_path):
    model = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 1))
    loader = DataLoader(_regression_data(), batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0))
    res = torchspeed.fit(model, loader, epochs=4, val_loader=DataLoader(_regression_data(1), batch_size=64),
                         loss_fn=nn.MSELoss(), lr=0.05, schedule=None, checkpoint_dir=str(tmp_path), **FAST)
    hist = res.history
    assert all(r["val_acc"] is None and r["train_acc"] is None for r in hist)
    assert hist[-1]["val_loss"] < hist[0]["val_loss"]
    best = load_checkpoint(tmp_path / "best.pt")["run"]["best"]
    assert best["metric"] == "val_loss"
    best_epoch = min(hist, key=lambda r: r["val_loss"])["epoch"]
    assert best["epoch"] == best_epoch and best_epoch > 1


class TinyLM(nn.Module):
    def __init__(self, vocab=11, d=16):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab)

    def forward(self, idx):
        return self.head(self.emb(idx))  # (B, T, V)


def test_language_model_accuracy_is_per_token():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 11, (40, 9), generator=g)
    y = (x + 1) % 11  # next token = this token + 1: learnable per token
    model = TinyLM()
    res = torchspeed.fit(model, DataLoader(TensorDataset(x, y), batch_size=8), epochs=6, lr=0.5,
                         val_loader=DataLoader(TensorDataset(x, y), batch_size=20), **FAST)
    with torch.no_grad():
        expected = (model(x).argmax(-1) == y).float().mean().item()  # correct tokens / tokens
    assert res.history[-1]["val_acc"] == pytest.approx(expected, abs=1e-6)
    assert 0.0 <= expected <= 1.0
    # padding targets (-100) are not counted
    logits = torch.zeros(1, 3, 4)
    logits[0, :, 2] = 1.0
    correct, counted = count_correct(logits, torch.tensor([[2, 1, -100]]))
    assert int(correct) == 1 and int(counted) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_predicted_class_is_argmaxs_first_maximum_on_every_layout(dtype):
    """count_correct reads the class with max(dim).indices (a fraction of argmax's cost on the CPU over a class
    dimension that is not the last, and in bf16): the same class as argmax, ties included."""
    g = torch.Generator().manual_seed(0)
    dense = torch.randint(0, 3, (2, 5, 4, 4), generator=g).to(dtype)  # small integers: many ties
    target = torch.randint(0, 5, (2, 4, 4), generator=g)
    want = (dense.argmax(1) == target).sum()
    assert int(count_correct(dense, target)[0]) == int(want)
    rows = torch.randint(0, 2, (64, 7), generator=g).to(dtype)
    labels = torch.randint(0, 7, (64,), generator=g)
    assert int(count_correct(rows, labels)[0]) == int((rows.argmax(-1) == labels).sum())


def test_the_training_count_reads_the_batchs_first_samples_up_to_its_budget(monkeypatch):
    """`max_elements` bounds the per-step count to the batch's first samples (one at least); under the budget the
    count is exact. The training loop passes metrics.TRAIN_COUNT_ELEMENTS: with the budget at one sample's logits,
    train_acc is the first sample's accuracy of each batch (here always right, the others always wrong)."""
    logits = torch.zeros(4, 3, 2, 2)
    logits[:, 1] = 1.0  # class 1 everywhere
    target = torch.zeros(4, 2, 2, dtype=torch.long)
    target[0] = 1  # the first sample right, the rest wrong
    assert [int(v) for v in count_correct(logits, target)] == [4, 16]
    assert [int(v) for v in count_correct(logits, target, max_elements=12)] == [4, 4]  # 12 logits: one sample
    assert [int(v) for v in count_correct(logits, target, max_elements=25)] == [4, 8]  # two samples
    assert [int(v) for v in count_correct(logits, target, max_elements=1)] == [4, 4]  # one sample at least
    assert [int(v) for v in count_correct(logits, target, max_elements=10_000)] == [4, 16]

    class FirstRight(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(()))

        def forward(self, x):
            out = torch.zeros(x.shape[0], 3, 2, 2) + self.w * 0
            out[:, 1] += 1.0
            return out

    import torchspeed.train.loop.trainer as trainer_mod
    x = torch.zeros(8, 1)
    y = torch.zeros(8, 2, 2, dtype=torch.long)
    y[::4] = 1  # each batch of 4: its first sample's pixels are class 1
    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    whole = torchspeed.fit(FirstRight(), loader, epochs=1, lr=0.0, **FAST)
    assert whole.final["train_acc"] == pytest.approx(0.25)
    monkeypatch.setattr(trainer_mod, "TRAIN_COUNT_ELEMENTS", 12)
    first = torchspeed.fit(FirstRight(), loader, epochs=1, lr=0.0, **FAST)
    assert first.final["train_acc"] == pytest.approx(1.0)


class Stream(IterableDataset):
    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        while True:  # endless
            x = torch.randn(8, generator=g)
            yield x, (x[0] > 0).long()


def test_iterable_dataset_without_len_trains_with_max_steps():
    loader = DataLoader(Stream(), batch_size=16)
    res = torchspeed.fit(nn.Linear(8, 2), loader, max_steps=25, lr=0.1, **FAST)
    assert res.steps == 25 and res.history[-1]["step"] == 25
    with pytest.raises(TypeError, match="max_steps"):
        torchspeed.fit(nn.Linear(8, 2), loader, lr=0.1, **FAST)


def test_step_fn_hook_for_any_batch():
    calls = []

    def step_fn(model, batch):
        calls.append(1)
        x, y = batch["features"], batch["y"]
        return F.mse_loss(model(x).squeeze(-1), y)

    batches = [{"features": torch.randn(8, 3), "y": torch.randn(8)} for _ in range(6)]
    res = torchspeed.fit(nn.Linear(3, 1), batches, epochs=2, step_fn=step_fn, lr=0.05, val_loader=batches[:2], **FAST)
    assert len(calls) == 12 + 2 * 2 and res.history[-1]["val_acc"] is None
    assert math.isfinite(res.history[-1]["val_loss"])


def test_unclear_batches_get_errors_that_name_the_fix():
    with pytest.raises(ValueError, match="no target"):
        forward_loss(nn.Linear(3, 2), (torch.randn(4, 3),))
    with pytest.raises(TypeError, match="step_fn"):
        split_batch("not a batch")


def test_a_step_fn_that_returns_the_loss_read_back_as_a_number_is_told_to_return_the_tensor():
    batches = [(torch.randn(8, 3), torch.randint(0, 2, (8,))) for _ in range(2)]
    with pytest.raises(TypeError, match=r"returned float: return the loss tensor itself, not loss.item\(\)"):
        torchspeed.fit(nn.Linear(3, 2), batches, step_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]).item(), **FAST)
    with pytest.raises(TypeError, match=r"of shape \(8,\): reduce it to one value"):
        torchspeed.fit(nn.Linear(3, 2), batches, step_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none"),
                       **FAST)


def test_a_step_fn_that_cannot_be_called_with_model_and_batch_is_refused_before_any_work():
    """A Lightning `training_step(batch, batch_idx)` brought as it is: named, with how it ports, before the plan ran
    anything (the model's weights untouched)."""
    model = nn.Linear(3, 2)
    before = [p.clone() for p in model.parameters()]
    batches = [(torch.randn(8, 3), torch.randint(0, 2, (8,))) for _ in range(2)]
    with pytest.raises(TypeError, match=r"step_fn\(model, batch\).*missing a required argument: 'batch_idx'.*"
                                        r"Lightning training_step"):
        torchspeed.fit(model, batches, step_fn=lambda model, batch, batch_idx: batch[0].sum(), recipe="auto", **FAST)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    with pytest.raises(TypeError, match="too many positional arguments"):
        Trainer(model, step_fn=lambda batch: batch[0].sum(), config=TrainConfig(**FAST))
    with pytest.raises(TypeError, match="step_fn must be a function"):
        torchspeed.fit(model, batches, step_fn="loss", **FAST)
    kept = torchspeed.fit(nn.Linear(3, 2), batches, step_fn=lambda *a: F.cross_entropy(a[0](a[1][0]), a[1][1]), **FAST)
    assert kept.steps == 2  # (model, batch) bound by *args: called as it is


def test_a_loss_fn_that_needs_more_than_output_and_target_is_sent_to_a_step_fn_before_any_work():
    batches = [(torch.randn(8, 3), torch.randint(0, 2, (8,))) for _ in range(2)]
    with pytest.raises(TypeError, match=r"loss_fn\(output, target\); CTCLoss.*input_lengths.*goes in a step_fn"):
        torchspeed.fit(nn.Linear(3, 2), batches, loss_fn=nn.CTCLoss(), **FAST)
    with pytest.raises(TypeError, match="missing a required argument: 'mask'"):
        torchspeed.fit(nn.Linear(3, 2), batches, loss_fn=lambda out, y, mask: F.cross_entropy(out, y), **FAST)
    ctc = nn.CTCLoss()  # with a step_fn the loss is the step's own: not checked
    assert torchspeed.fit(nn.Linear(3, 2), batches, loss_fn=ctc, step_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                          **FAST).steps == 2
    assert torchspeed.fit(nn.Linear(3, 2), batches, loss_fn=nn.CrossEntropyLoss(label_smoothing=0.1), **FAST).steps == 2


def test_a_loss_class_for_an_instance_or_a_loss_for_a_step_is_named_before_any_work():
    """`loss_fn=nn.CrossEntropyLoss` (no parentheses): calling the class builds a module with the logits as its
    class weights, and torch's error ("Boolean value of Tensor with more than one value is ambiguous") named
    nothing of it. `step_fn=F.cross_entropy`: torch's error said the input "must be Tensor, not Linear"."""
    batches = [(torch.randn(8, 3), torch.randint(0, 2, (8,))) for _ in range(2)]
    model = nn.Linear(3, 2)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TypeError, match=r"loss_fn=CrossEntropyLoss is the class.*loss_fn=CrossEntropyLoss\(\)"):
        torchspeed.fit(model, batches, loss_fn=nn.CrossEntropyLoss, **FAST)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    for loss in (F.cross_entropy, nn.CrossEntropyLoss()):  # a loss given as the step: torch's error named the model
        with pytest.raises(TypeError, match=r"step_fn=(cross_entropy|CrossEntropyLoss) is a loss.*pass it as loss_fn"):
            torchspeed.fit(model, batches, step_fn=loss, **FAST)


def test_stateful_dataloader_state_is_checkpointed_and_resume_is_exact(tmp_path):
    from torchdata.stateful_dataloader import StatefulDataLoader

    def make():
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        ds = TensorDataset(torch.randn(96, 6, generator=g), torch.randint(0, 3, (96,), generator=g))
        return nn.Linear(6, 3), StatefulDataLoader(ds, batch_size=8, shuffle=True)

    cfg = dict(lr=0.1, schedule=None, seed=0, **FAST)
    model_a, loader_a = make()
    torchspeed.fit(model_a, loader_a, epochs=2, **cfg)  # uninterrupted

    model_b, loader_b = make()
    torchspeed.fit(model_b, loader_b, epochs=2, max_steps=17, checkpoint_dir=str(tmp_path), checkpoint_every=5, **cfg)
    state = load_checkpoint(sorted(tmp_path.glob("step-*.pt"))[-1])
    assert state["position"]["loader_state"] is not None and state["position"]["batch_in_epoch"] == 5  # step 17 = epoch 2, batch 5
    model_c, loader_c = make()  # a fresh process: new model, new loader
    res = torchspeed.fit(model_c, loader_c, epochs=2, checkpoint_dir=str(tmp_path), resume="auto", **cfg)
    assert res.steps == 24
    for a, c in zip(model_a.parameters(), model_c.parameters()):
        torch.testing.assert_close(a, c, rtol=0, atol=0)


def test_compile_does_not_recompile_for_every_sequence_length():
    """compile=True on varying lengths: automatic dynamic shapes, so a few graphs, not one per length."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = TinyLM()
    t = Trainer(model, device="cpu", config=TrainConfig(compile=True, progress=False, precision="fp32",
                                                        schedule=None))
    for length in (5, 7, 9, 12, 16, 21):
        x = torch.randint(0, 11, (4, length))
        t.step_batch((x, (x + 1) % 11))
    assert t.decisions["compile"].value is True
    frames = counters["stats"]["unique_graphs"]
    assert 1 <= frames <= 3, f"{frames} graphs compiled for 6 lengths"


def test_first_samples_cuts_every_per_sample_part_and_copies_every_tensor():
    """A copy: the numerics guard and the recipe's probe run the model on it, and a forward that writes its input
    (`x.mul_(0.5)`) must leave the batch the run trains as it was."""
    from torchspeed.train.loop.batch import first_samples

    x, y, mask = torch.randn(8, 3, 4, 4), torch.arange(8), torch.ones(5)
    a, b = first_samples((x, y), 2)
    assert torch.equal(a, x[:2]) and torch.equal(b, y[:2])
    a.mul_(0.5)
    assert torch.equal(a, x[:2] * 0.5)  # the batch itself unwritten
    d = first_samples({"input_ids": x, "labels": y, "other": mask, "name": "n"}, 3)
    assert d["input_ids"].shape[0] == 3 and torch.equal(d["labels"], y[:3]) and d["name"] == "n"
    assert torch.equal(d["other"], mask) and d["other"] is not mask
    imgs, targets = [torch.randn(3, 5 + i, 6) for i in range(8)], [{"boxes": torch.zeros(1, 4)} for _ in range(8)]
    cut = first_samples((imgs, targets), 2)  # detection: lists of samples
    assert len(cut[0]) == len(cut[1]) == 2 and torch.equal(cut[0][1], imgs[1]) and cut[0][1] is not imgs[1]
    small = first_samples((x[:2], y[:2]), 4)[0]  # already as small: whole, and still a copy
    assert small.shape[0] == 2 and small.data_ptr() != x.data_ptr()


def test_a_target_the_default_loss_cannot_take_is_named_with_both_shapes_and_the_fix():
    """torch says "0D or 1D target tensor expected, multi-target not supported" and names neither shape."""
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 2))
    mask = DataLoader(TensorDataset(torch.randn(8, 3, 2, 2), torch.zeros(8, 2, 2, dtype=torch.long)), batch_size=4)
    with pytest.raises(ValueError, match=r"logits of shape \(4, 2\) and a target of shape \(4, 2, 2\).*class "
                                         r"indices of shape \(4,\)"):
        torchspeed.fit(model, mask, epochs=1, progress=False, trial=False, compile=False)
    values = DataLoader(TensorDataset(torch.randn(8, 12), torch.randn(8)), batch_size=4)  # regression, no loss_fn
    reg = nn.Sequential(nn.Linear(12, 1))
    with pytest.raises(ValueError, match=r"logits of shape \(4, 1\) and a target of shape \(4,\).*nn.MSELoss"):
        torchspeed.fit(reg, values, epochs=1, progress=False, trial=False, compile=False)
    column = DataLoader(TensorDataset(torch.randn(8, 12), torch.randn(8, 1)), batch_size=4)  # shapes fit: loss 0
    with pytest.raises(ValueError, match=r"logits with one class \(shape \(4, 1\)\).*nn.MSELoss\(\).*BCEWithLogits"):
        torchspeed.fit(nn.Sequential(nn.Linear(12, 1)), column, epochs=1, progress=False, trial=False, compile=False)
    labels = DataLoader(TensorDataset(torch.randn(8, 12), torch.arange(8) % 2), batch_size=4)  # binary, one logit
    with pytest.raises(ValueError, match=r"logits with one class.*BCEWithLogitsLoss"):  # torch: "Target 1 is out of
        torchspeed.fit(nn.Sequential(nn.Linear(12, 1)), labels, epochs=1, progress=False, trial=False, compile=False)
    binary = DataLoader(TensorDataset(torch.randn(8, 12), (torch.arange(8) % 2).float()), batch_size=4)
    with pytest.raises(ValueError, match=r"Target size.*loss_fn got output of shape \(4, 1\) and a target of shape "
                                         r"\(4,\).*output.squeeze\(-1\)"):  # your loss, its (B, 1) against (B,)
        torchspeed.fit(nn.Sequential(nn.Linear(12, 1)), binary, loss_fn=nn.BCEWithLogitsLoss(), epochs=1,
                       progress=False, trial=False, compile=False)
    ok = torchspeed.fit(nn.Sequential(nn.Linear(12, 3)), DataLoader(TensorDataset(  # shapes that fit: untouched
        torch.randn(8, 12), torch.softmax(torch.randn(8, 3), 1)), batch_size=4), epochs=1, progress=False)
    assert ok.steps == 2


def test_a_model_call_that_fails_on_the_first_step_says_how_the_batch_was_read():
    """PyTorch's text-classification tutorial collates (label, text, offsets): read as (inputs..., target), the
    model is called as model(label, text) and torch's error ("offsets[0] has to be 0") names neither."""

    class Bag(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.fc = nn.EmbeddingBag(50, 8), nn.Linear(8, 4)

        def forward(self, text, offsets):
            return self.fc(self.emb(text, offsets))

    def collate(items):
        return (torch.tensor([y for y, _ in items]), torch.cat([t for _, t in items]),
                torch.tensor([0] + [len(t) for _, t in items[:-1]]).cumsum(0))

    data = [(i % 4, torch.randint(0, 50, (5 + i % 3,))) for i in range(32)]
    loader = DataLoader(data, batch_size=8, collate_fn=collate)
    with pytest.raises(Exception) as info:
        torchspeed.fit(Bag(), loader, epochs=1, progress=False, trial=False, compile=False)
    note = "\n".join(getattr(info.value, "__notes__", []))
    assert "model(x0, x1)" in note and "last of 3 elements as the target" in note and "step_fn=" in note

    def step_fn(model, batch):
        label, text, offsets = batch
        return F.cross_entropy(model(text, offsets), label)

    assert torchspeed.fit(Bag(), loader, epochs=1, step_fn=step_fn, progress=False).steps == 4


class WithAux(nn.Module):
    """A mixture-of-experts-shaped model: (logits, aux_loss), where aux_loss is a term the script adds, not the loss."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 3)

    def forward(self, x):
        logits = self.fc(x)
        return logits, logits.mean()  # minimised alone, it would push every logit down and learn nothing


def test_a_given_loss_fn_scores_the_logits_of_a_tuple_whose_scalar_the_model_made_without_the_target():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 12, generator=g)
    y = x[:, :3].argmax(1)
    loader = DataLoader(TensorDataset(x, y), batch_size=16)
    decisions: dict = {}
    model = WithAux()
    out = forward_loss(model, (x[:16], y[:16]), loss_fn=nn.CrossEntropyLoss(), decisions=decisions)
    assert torch.allclose(out.loss, F.cross_entropy(model(x[:16])[0], y[:16]))
    assert not out.own_loss and "not added" in decisions["batch_contract"].reason
    res = torchspeed.fit(WithAux(), loader, epochs=3, loss_fn=nn.CrossEntropyLoss(), optimizer="adamw", lr=0.05, **FAST)
    assert res.history[-1]["train_loss"] > 0 and res.history[-1]["train_loss"] < res.history[0]["train_loss"]
    own = forward_loss(model, (x[:16], y[:16]), loss_fn=None)  # no loss_fn: the tuple's scalar is the loss
    assert own.own_loss and torch.allclose(own.loss, model(x[:16])[1])


def test_float64_data_from_numpy_gets_a_note_that_names_the_dtype_and_the_fix():
    """torch.from_numpy keeps numpy's float64; a script's loop casts with .float(), a port to fit often forgets."""
    x, y = torch.randn(16, 4, dtype=torch.float64), torch.randint(0, 3, (16,))
    with pytest.raises(RuntimeError) as info:
        torchspeed.fit(nn.Linear(4, 3), DataLoader(TensorDataset(x, y), batch_size=8), epochs=1, **FAST)
    note = "\n".join(getattr(info.value, "__notes__", []))
    assert "float64" in note and "dtype=torch.float32" in note
    res = torchspeed.fit(nn.Linear(4, 3), DataLoader(TensorDataset(x.float(), y), batch_size=8), epochs=1, **FAST)
    assert res.steps == 2


def test_numpy_batches_get_a_note_and_parameters_for_a_model_a_clear_error():
    """A list of numpy batches (no DataLoader collate to make tensors): torch's "must be Tensor, not
    numpy.ndarray" gets a note naming torch.as_tensor. `fit(model.parameters(), ...)` had been an AttributeError
    on a generator."""
    import numpy as np
    g = np.random.default_rng(0)
    batches = [(g.standard_normal((8, 4)).astype("float32"), g.integers(0, 3, 8)) for _ in range(2)]
    with pytest.raises(TypeError) as info:
        torchspeed.fit(nn.Linear(4, 3), batches, epochs=1, **FAST)
    assert "torch.as_tensor(x)" in "\n".join(getattr(info.value, "__notes__", []))
    model = nn.Linear(4, 3)
    tensors = [(torch.as_tensor(x), torch.as_tensor(y)) for x, y in batches]
    for wrong in (model.parameters(), list(model.parameters())):
        with pytest.raises(TypeError, match=r"got (generator|list) \(its parameters\): pass the model itself"):
            torchspeed.fit(wrong, tensors, epochs=1, **FAST)
    with pytest.raises(TypeError, match="got function: wrap what computes the output in an nn.Module"):
        torchspeed.fit(lambda x: x, tensors, epochs=1, **FAST)
    assert torchspeed.fit(model, tensors, epochs=1, **FAST).steps == 2


def test_binary_and_multi_label_losses_count_accuracy_per_element_and_regression_still_gets_none():
    logits = torch.tensor([[2.0, -1.0], [-0.5, 0.3]])
    target = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    correct, counted = count_correct(logits, target, "logits")
    assert int(correct) == 3 and counted == 4  # (-0.5 > 0) is wrong for a target of 1
    assert int(count_correct(torch.sigmoid(logits), target, "probs")[0]) == 3
    assert count_correct(logits, target) is None  # no binary loss named: float targets are regression
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 6, generator=g)
    y = (x[:, :1] > 0).float()  # a binary target, (B, 1), as BCEWithLogitsLoss takes it
    res = torchspeed.fit(nn.Linear(6, 1), DataLoader(TensorDataset(x, y), batch_size=16), epochs=8,
                         val_loader=DataLoader(TensorDataset(x, y), batch_size=32), loss_fn=nn.BCEWithLogitsLoss(),
                         optimizer="adamw", lr=0.1, train_acc=True, **FAST)
    assert res.final["val_acc"] is not None and res.final["val_acc"] > 0.85 and res.final["train_acc"] is not None
    reg = torchspeed.fit(nn.Linear(6, 1), DataLoader(TensorDataset(x, y), batch_size=16), epochs=1,
                         val_loader=DataLoader(TensorDataset(x, y), batch_size=32), loss_fn=nn.MSELoss(), **FAST)
    assert reg.final["val_acc"] is None


def test_a_dict_of_scalar_losses_by_other_names_is_summed_as_torchvisions_retinanet_returns():
    """RetinaNet, FCOS and SSD return {'classification': ..., 'bbox_regression': ...}: no key says "loss", every
    value is a scalar: they are the losses, summed; a dict holding a tensor that is not a scalar stays logits."""
    from torchspeed.train.loop.model_output import read_output

    cls, box = torch.tensor(1.5, requires_grad=True), torch.tensor(0.25, requires_grad=True)
    out = read_output({"classification": cls, "bbox_regression": box})
    assert float(out.loss) == 1.75 and set(out.parts) == {"classification", "bbox_regression"}
    assert read_output({"logits": torch.randn(2, 3), "score": torch.tensor(1.0)}).loss is None


def test_named_tuple_batches_reach_the_step_fn_as_the_named_tuple(tmp_path, monkeypatch):
    """A loader of named tuples (`Pair(inputs, labels)`) and a step_fn that reads `batch.inputs`: the batch moved to
    the device, the switch trial's measuring passes and the numerics guard's first samples keep the named tuple
    (they came back as lists, and `batch.inputs` raised AttributeError on the first step). The trial runs live on
    an injected bf16 CPU, so its copies of the batch are made."""
    from collections import namedtuple

    from torchspeed.train.loop.batch import first_samples
    from torchspeed.train.transfer import map_tensors

    Pair = namedtuple("Pair", ["inputs", "labels"])
    x, y = torch.randn(8, 4), torch.arange(8) % 2
    moved = map_tensors(Pair(x, y), torch.Tensor.clone)
    cut = first_samples(Pair(x, y), 3)
    assert type(moved) is Pair and torch.equal(moved.inputs, x)
    assert type(cut) is Pair and torch.equal(cut.inputs, x[:3]) and torch.equal(cut.labels, y[:3])
    monkeypatch.setenv("TORCHSPEED_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TORCHSPEED_CPU_PROFILE", "avx512_bf16")
    seen = []

    def step_fn(model, batch):
        seen.append(type(batch))
        return F.cross_entropy(model(batch.inputs), batch.labels)

    g = torch.Generator().manual_seed(0)
    batches = [Pair(torch.randn(16, 4, generator=g), torch.randint(0, 2, (16,), generator=g)) for _ in range(24)]
    res = torchspeed.fit(nn.Linear(4, 2), batches, epochs=1, step_fn=step_fn, lr=0.05, trial=True, compile=False,
                         progress=False)
    assert res.steps == 24 and set(seen) == {Pair}


def test_a_batch_holding_a_sparse_adjacency_trains_with_the_trial_live(tmp_path, monkeypatch):
    """A graph network's batch is (node features, sparse adjacency, labels): its rows are nodes, and slicing the
    sparse adjacency to the "first samples" raised NotImplementedError ('aten::as_strided' on SparseCPU) in the
    numerics guard of a bf16 CPU's trial, ending the run. Such a batch is copied whole. The trial runs live on an
    injected bf16 CPU, so the guard's copy is made."""
    from torchspeed.train.loop.batch import first_samples

    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 32, (2, 96), generator=g)
    adj = torch.sparse_coo_tensor(idx, torch.ones(96), (32, 32)).coalesce()
    x, y = torch.randn(32, 8, generator=g), torch.randint(0, 3, (32,), generator=g)
    cx, cadj, cy = first_samples((x, adj, y), 4)
    assert cx.shape == x.shape and torch.equal(cadj.to_dense(), adj.to_dense()) and cx.data_ptr() != x.data_ptr()

    class GCN(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w2 = nn.Linear(8, 16), nn.Linear(16, 3)

        def forward(self, x, adj):
            return torch.sparse.mm(adj, self.w2(F.relu(torch.sparse.mm(adj, self.w1(x)))))

    def step_fn(model, batch):
        x, adj, y = batch
        return F.cross_entropy(model(x, adj), y)

    monkeypatch.setenv("TORCHSPEED_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TORCHSPEED_CPU_PROFILE", "avx512_bf16")
    res = torchspeed.fit(GCN(), [(x, adj, y)] * 24, epochs=1, step_fn=step_fn, lr=0.05, trial=True, compile=False,
                         progress=False)
    assert res.steps == 24 and res.decisions["switch_trial"].value == "measured"
