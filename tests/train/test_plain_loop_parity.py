"""Never slower than the user's own loop: data in memory is sliced, per-step machinery runs only when used, a
ported LR is trained at, evaluation is priced. None of these tests times anything."""

import logging
import re
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset, random_split

import torchspeed
from torchspeed.bench.small import SMALL, evaluate_plain, make_small, plain_loop
from torchspeed.train.loop import callbacks as cb_mod
from torchspeed.train.loop.callbacks import Callback, EarlyStopping
from torchspeed.train.config import parse_eval_every
from torchspeed.train.evaluate import EvalClock, evaluate
from torchspeed.train.loop.metrics import TRAIN_ACC_EVERY
from torchspeed.train.in_memory import SlicedLoader, keep_on_device, sliced_loader
from torchspeed.train.schedule import default_schedule

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _data(n=240, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 16, generator=g)
    y = (x.mean(-1).squeeze(1) > 0).long()
    return x, y


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Conv1d(1, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(64, 2))


def _quiet(**kw):
    return dict(progress=False, compile=False, trial=False, precision="fp32", **kw)


# ------------------------------------------------------------------ data in memory is sliced (T10/T11)

def test_an_in_memory_tensor_dataset_is_sliced_not_collated_per_sample(monkeypatch):
    x, y = _data()
    calls = []
    real = TensorDataset.__getitem__
    monkeypatch.setattr(TensorDataset, "__getitem__", lambda self, i: calls.append(i) or real(self, i))
    loader = DataLoader(TensorDataset(x, y), batch_size=20, shuffle=True)
    val = DataLoader(TensorDataset(x[:60], y[:60]), batch_size=30)
    res = torchspeed.fit(_model(), loader, epochs=2, optimizer="adamw", lr=1e-2, val_loader=val, **_quiet())
    assert calls == []  # no per-sample read, in training or in validation
    assert res.decisions["batching"].value == "index slices"
    assert res.steps == 24 and res.final["val_acc"] is not None


@pytest.mark.parametrize("drop_last", [False, True])
def test_slices_come_in_the_dataloaders_order_and_leave_the_same_random_stream(drop_last):
    x, y = _data(103)

    def run(make):
        torch.manual_seed(7)
        loader = make(DataLoader(TensorDataset(x, y), batch_size=10, shuffle=True, drop_last=drop_last,
                                 generator=torch.Generator().manual_seed(3)))
        batches = [b for _ in range(2) for b in loader]  # two epochs
        return batches, torch.rand(3), loader.generator.get_state()

    ref, ref_next, ref_gen = run(lambda dl: dl)
    got, got_next, got_gen = run(lambda dl: sliced_loader(dl, torch.device("cpu")))
    assert len(got) == len(ref)
    assert all(isinstance(b, list) and len(b) == 2 for b in got)  # default_collate's batch type
    for (gx, gy), (rx, ry) in zip(got, ref):
        assert torch.equal(gx, rx) and torch.equal(gy, ry)
    assert torch.equal(got_next, ref_next) and torch.equal(got_gen, ref_gen)


@pytest.mark.parametrize("n, take", [(100, 3), (100, 10), (103, 11), (103, 4)])
def test_a_partial_or_whole_epoch_leaves_the_random_stream_as_the_dataloader_does(n, take):
    """A run that stops mid-epoch (max_steps) draws nothing more; one that ends an epoch draws what the sampler
    draws at its end (a second permutation for the remainder), before the last short batch."""
    x, y = _data(n)

    def run(make):
        loader = make(DataLoader(TensorDataset(x, y), batch_size=10, shuffle=True,
                                 generator=torch.Generator().manual_seed(5)))
        it = iter(loader)
        got = [next(it)[1] for _ in range(take)]
        return got, loader.generator.get_state()

    ref, ref_gen = run(lambda dl: dl)
    got, got_gen = run(lambda dl: sliced_loader(dl, torch.device("cpu")))
    assert all(torch.equal(a, b) for a, b in zip(got, ref)) and torch.equal(got_gen, ref_gen)


def test_an_unshuffled_loader_is_sliced_in_order():
    x, y = _data(25)
    got = list(sliced_loader(DataLoader(TensorDataset(x, y), batch_size=10), torch.device("cpu")))
    assert [len(b[1]) for b in got] == [10, 10, 5] and torch.equal(torch.cat([b[1] for b in got]), y)


def test_shuffling_from_the_global_generator_matches_too():
    x, y = _data(50)
    torch.manual_seed(1)
    ref = [b[1] for b in DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)]
    torch.manual_seed(1)
    got = [b[1] for b in sliced_loader(DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True),
                                       torch.device("cpu"))]
    assert all(torch.equal(a, b) for a, b in zip(got, ref)) and len(got) == len(ref)


def test_a_random_split_subset_is_sliced_through_its_indices():
    x, y = _data(60)
    train, _ = random_split(TensorDataset(x, y), [40, 20], generator=torch.Generator().manual_seed(0))
    dl = DataLoader(train, batch_size=7, shuffle=False)
    got = sliced_loader(dl, torch.device("cpu"))
    assert isinstance(got, SlicedLoader) and len(got) == len(dl)
    for (gx, gy), (rx, ry) in zip(got, dl):
        assert torch.equal(gx, rx) and torch.equal(gy, ry)


def test_loaders_that_are_not_plain_tensors_are_left_as_they_are():
    x, y = _data(20)
    ds = TensorDataset(x, y)
    custom = DataLoader(ds, batch_size=4, collate_fn=lambda b: b)
    listed = DataLoader([(x[i], y[i]) for i in range(20)], batch_size=4)
    assert sliced_loader(custom, torch.device("cpu")) is custom
    assert sliced_loader(listed, torch.device("cpu")) is listed


class Pairs(torch.utils.data.Dataset):
    """The Dataset a script writes for data it holds: `__getitem__` only indexes its arrays."""

    def __init__(self, x, y):
        self.features, self.labels = x, y

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, idx):
        x = self.features[idx]
        return x, self.labels[idx]


class Flipped(Pairs):
    def __getitem__(self, idx):  # a random transform: must stay per sample
        x = self.features[idx]
        return (-x if torch.rand(()) < 0.5 else x), self.labels[idx]


class Scaled(Pairs):
    def __getitem__(self, idx):  # a computed sample
        return self.features[idx] / 255, self.labels[idx]


def test_your_own_dataset_that_only_indexes_its_tensors_is_sliced_and_one_that_computes_is_not(monkeypatch):
    x, y = _data(50)
    mk = lambda ds: DataLoader(ds, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3))  # noqa: E731
    for data in (Pairs(x, y), Pairs(x.double().numpy(), y.int().numpy())):  # tensors, or numpy arrays
        got = sliced_loader(mk(data), torch.device("cpu"))
        assert isinstance(got, SlicedLoader)
        reads = []
        with monkeypatch.context() as m:  # a spy on per-sample reads, set after the source was read
            m.setattr(Pairs, "__getitem__", lambda self, i: reads.append(i))
            batches = list(got)
        assert reads == []  # no per-sample read: one index per tensor a batch
        for (gx, gy), (rx, ry) in zip(batches, mk(data), strict=True):  # the DataLoader's order, dtypes and values
            assert torch.equal(gx, rx) and torch.equal(gy, ry) and gx.dtype == rx.dtype and gy.dtype == ry.dtype
    for other in (Flipped(x, y), Scaled(x, y)):
        assert sliced_loader(mk(other), torch.device("cpu")).__class__ is DataLoader
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 2))
    res = torchspeed.fit(model, mk(Pairs(x, y)), epochs=1, progress=False, trial=False)
    assert "Pairs.__getitem__ only indexes its tensors" in res.decisions["batching"].reason


def test_tensors_move_to_the_accelerator_only_when_they_fit_its_share():
    assert keep_on_device(1 << 20, 16 << 20)
    assert not keep_on_device(8 << 20, 16 << 20)
    assert not keep_on_device(1, None)  # a CPU run: nothing moves


# ------------------------------------------------------------------ per-step machinery runs only when used

def test_with_no_callbacks_no_per_step_callback_machinery_runs(monkeypatch):
    seen = []
    monkeypatch.setattr(cb_mod.CallbackList, "on_step_end", lambda self, tr: seen.append(tr.step))
    x, y = _data()
    torchspeed.fit(_model(), DataLoader(TensorDataset(x, y), batch_size=20), epochs=1, lr=1e-2, **_quiet())
    assert seen == []

    class OnlyEpochs(Callback):
        def on_evaluate(self, trainer, metrics):
            pass

    torchspeed.fit(_model(), DataLoader(TensorDataset(x, y), batch_size=20), epochs=1, lr=1e-2,
                   callbacks=[OnlyEpochs()], **_quiet())
    assert seen == []


def test_a_callback_that_uses_the_step_event_gets_every_step():
    class Count(Callback):
        steps = 0

        def on_step_end(self, trainer):
            Count.steps += 1

    x, y = _data()
    res = torchspeed.fit(_model(), DataLoader(TensorDataset(x, y), batch_size=20), epochs=2, lr=1e-2,
                         callbacks=[Count()], **_quiet())
    assert Count.steps == res.steps == 24


def test_with_a_val_loader_the_train_step_counts_no_correct_predictions(monkeypatch):
    """The per-step argmax, compare and sum are the accuracy a plain loop does not compute: with a validation loader
    val_acc is the accuracy, and the loop leaves them out unless train_acc is asked for (metrics.train_accuracy)."""
    from torchspeed.train.loop.batch import StepOutput

    counted = []
    real = StepOutput.correct
    monkeypatch.setattr(StepOutput, "correct", lambda self, *a: counted.append(1) or real(self, *a))
    x, y = _data()
    train = DataLoader(TensorDataset(x, y), batch_size=20)
    val = DataLoader(TensorDataset(x[:60], y[:60]), batch_size=30)
    res = torchspeed.fit(_model(), train, epochs=1, lr=1e-2, val_loader=val, **_quiet())
    assert res.final["train_acc"] is None and res.final["val_acc"] is not None
    assert len(counted) == 2  # validation's two batches only
    for kw in ({"train_acc": True}, {"best_metric": "train_acc"}, {"callbacks": [EarlyStopping("train_acc")]}):
        counted.clear()
        res = torchspeed.fit(_model(), train, epochs=1, lr=1e-2, **_quiet(**({"val_loader": val} | kw)))
        assert res.final["train_acc"] is not None and len(counted) >= 12, kw  # the 12 steps counted
    counted.clear()  # no val_loader and nothing reads it: shown, estimated from one step in 32 (each epoch's first)
    res = torchspeed.fit(_model(), train, epochs=2, lr=1e-2, **_quiet())
    assert res.history[0]["train_acc"] is not None and res.history[1]["train_acc"] is not None
    assert len(counted) == 2 == 2 * len(range(0, 12, TRAIN_ACC_EVERY))
    off = torchspeed.fit(_model(), train, epochs=1, lr=1e-2, train_acc=False, **_quiet())
    assert off.final["train_acc"] is None
    with pytest.raises(ValueError, match="train_acc must be"):
        torchspeed.fit(_model(), train, epochs=1, lr=1e-2, train_acc="yes", **_quiet())


# ------------------------------------------------------------------ a ported LR is the LR trained at

def _doc_rule_rows():
    text = (DOCS / "train.md").read_text()
    block = text.split("<!-- schedule-rule -->")[1]
    rows = re.findall(r"^\| `(.+?)` \| (\w+) \|", block, flags=re.M)
    assert len(rows) >= 4, "docs/train.md lost the schedule rule's table"
    return rows


CASES = {"lr=0.01": dict(lr=0.01, optimizer="adamw"), "optimizer=torch.optim.Adam(...)": dict(lr=None, optimizer="obj"),
         'lr="auto"': dict(lr="auto", optimizer="sgd"), 'recipe="auto"': dict(lr=None, optimizer="sgd", recipe="auto"),
         'recipe="auto", lr=0.01': dict(lr=0.01, optimizer="sgd", recipe="auto"),
         "lr=None": dict(lr=None, optimizer="sgd")}


def test_the_schedule_chosen_for_an_lr_is_the_one_the_docs_state():
    for case, stated in _doc_rule_rows():
        kw = dict(CASES[case])
        if kw["optimizer"] == "obj":
            kw["optimizer"] = torch.optim.Adam(_model().parameters(), lr=1e-3)
        assert default_schedule(**kw).value == stated, case


def test_fit_trains_at_the_lr_it_was_given_and_says_why():
    x, y = _data()
    loader = DataLoader(TensorDataset(x, y), batch_size=20, shuffle=True)
    res = torchspeed.fit(_model(), loader, epochs=3, optimizer="adamw", lr=0.01, weight_decay=0, **_quiet())
    assert res.decisions["schedule"].value == "constant" and "lr=0.01" in res.decisions["schedule"].reason
    assert [r["lr"] for r in res.history] == [0.01, 0.01, 0.01]
    default = torchspeed.fit(_model(), loader, epochs=3, **_quiet())
    assert default.decisions["schedule"].value == "onecycle"
    assert default.history[-1]["lr"] < 0.01  # annealed below the 0.1 peak
    asked = torchspeed.fit(_model(), loader, epochs=3, lr=0.01, schedule="cosine", **_quiet())
    assert "schedule" not in asked.decisions  # the user's own schedule stands, no rule ran
    assert asked.history[-1]["lr"] < 0.01
    from torchspeed.train import TrainConfig

    built = torchspeed.fit(_model(), loader, epochs=3, lr=0.01, config=TrainConfig(progress=False, compile=False,
                                                                                  trial=False, precision="fp32"))
    assert "schedule" not in built.decisions and built.history[-1]["lr"] < 0.01  # a TrainConfig's schedule stands


def test_a_run_that_names_an_optimizer_and_no_lr_trains_at_that_optimizers_default():
    """fit(optimizer="adamw") with no LR trained AdamW at a one-cycle peak of 0.1, SGD's LR, 100x Adam's own."""
    from torchspeed.train.optim_info import default_lr
    from torchspeed.train.loop.trainer import Trainer

    x, y = _data()
    loader = DataLoader(TensorDataset(x, y), batch_size=20, shuffle=True)
    res = torchspeed.fit(_model(), loader, epochs=3, optimizer="adamw", **_quiet())
    sched = res.decisions["schedule"]
    assert sched.value == "onecycle" and "lr=0.001 (adamw's default LR)" in sched.reason
    assert max(r["lr"] for r in res.history) <= 1e-3 + 1e-12  # the one-cycle's peak is AdamW's 1e-3
    assert default_lr("adamw") == default_lr("Adam") == 1e-3 and default_lr("sgd") == 0.1
    assert Trainer(_model(), optimizer="adamw").optimizer.param_groups[0]["lr"] == 1e-3
    assert Trainer(_model()).optimizer.param_groups[0]["lr"] == 0.1  # SGD, as before


def test_a_constant_schedule_can_warm_up():
    x, y = _data()
    res = torchspeed.fit(_model(), DataLoader(TensorDataset(x, y), batch_size=20), epochs=2, lr=0.01,
                         warmup_steps=24, **_quiet())
    # LambdaLR reads the factor at the step about to run: after 12 steps the 13th runs at 13/24 of the LR
    assert res.history[0]["lr"] == pytest.approx(0.01 * 13 / 24) and res.history[1]["lr"] == pytest.approx(0.01)


# ------------------------------------------------------------------ evaluation is priced

def test_eval_every_n_steps_evaluates_at_the_first_epoch_end_past_n_and_at_the_end():
    x, y = _data()
    loader = DataLoader(TensorDataset(x, y), batch_size=20)  # 12 steps an epoch
    val = DataLoader(TensorDataset(x[:40], y[:40]), batch_size=20)
    res = torchspeed.fit(_model(), loader, epochs=5, lr=1e-2, val_loader=val, eval_every=30,
                         callbacks=[EarlyStopping("val_loss", patience=10)], **_quiet())
    evaluated = [r["epoch"] for r in res.history if "val_acc" in r]
    assert evaluated == [3, 5]  # step 36 (>= 30 after 0), then the last epoch
    assert all(r.get("val_skipped") for r in res.history if r["epoch"] not in evaluated)
    assert res.decisions["evaluation"].measured["count"] == 2
    assert res.decisions["restored_best"].value.startswith(("epoch 3", "epoch 5"))


def test_eval_every_under_an_epoch_evaluates_inside_the_epoch_every_n_steps(tmp_path):
    """eval_every=5 on 12-step epochs: steps 5 and 10 inside epoch 1, its end (12), then 17, 22, 24 (the end); the
    weights trained on between validations are the run's (a validation changes nothing), the callbacks and the
    loggers see each one, and the best may be a step inside an epoch."""
    x, y = _data()
    loader = DataLoader(TensorDataset(x, y), batch_size=20)  # 12 steps an epoch
    val = DataLoader(TensorDataset(x[:40], y[:40]), batch_size=20)
    seen = []

    class Spy(Callback):
        def on_evaluate(self, trainer, metrics):
            seen.append((metrics["step"], bool(metrics.get("mid_epoch")), trainer.model.training))

    model = _model()
    res = torchspeed.fit(model, loader, epochs=2, lr=1e-2, val_loader=val, eval_every=5, callbacks=[Spy()],
                         checkpoint_dir=str(tmp_path), **_quiet())
    assert [(e["step"], e["mid_epoch"]) for e in res.evaluations] == [
        (5, True), (10, True), (12, False), (17, True), (22, True), (24, False)]
    assert seen == [(5, True, True), (10, True, True), (12, False, True), (17, True, True), (22, True, True),
                    (24, False, True)]  # the model back in training mode after each validation
    assert [r["epoch"] for r in res.history] == [1, 2] and all("val_acc" in r for r in res.history)
    assert res.decisions["evaluation"].measured["count"] == 6
    ref = torchspeed.fit(_model(), DataLoader(TensorDataset(x, y), batch_size=20), epochs=2, lr=1e-2,
                         val_loader=val, **_quiet())  # every epoch: the same training, two validations
    assert [r["train_loss"] for r in ref.history] == [r["train_loss"] for r in res.history]
    assert ref.evaluations == []
    # restore_best: the weights of the first validation with the best accuracy, inside an epoch or at its end
    first_best = max(res.evaluations, key=lambda e: e["val_acc"])  # max keeps the first of equals
    assert ("inside the epoch" in res.decisions["restored_best"].value) == first_best["mid_epoch"]
    assert evaluate(model, val)["val_acc"] == first_best["val_acc"]


def test_a_stop_asked_inside_an_epoch_ends_there_without_a_second_validation():
    x, y = _data()
    loader = DataLoader(TensorDataset(x, y), batch_size=20)
    val = DataLoader(TensorDataset(x[:40], y[:40]), batch_size=20)

    class StopAtFirst(Callback):
        def on_evaluate(self, trainer, metrics):
            trainer.request_stop("first validation")

    res = torchspeed.fit(_model(), loader, epochs=3, lr=1e-2, val_loader=val, eval_every=4,
                         callbacks=[StopAtFirst()], **_quiet())
    assert res.steps == 4 and [e["step"] for e in res.evaluations] == [4]
    assert res.decisions["evaluation"].measured["count"] == 1  # the epoch's row reuses the validation at step 4
    assert res.final["val_acc"] == res.evaluations[0]["val_acc"] and res.final["val_at_step"] == 4


def test_eval_every_is_checked():
    assert parse_eval_every(None) is None
    assert parse_eval_every(500) == ("steps", 500.0)
    assert parse_eval_every("30s") == ("seconds", 30.0)
    for bad in (0, "often", "-3s", True):
        with pytest.raises(ValueError, match="eval_every"):
            parse_eval_every(bad)
    with pytest.raises(ValueError, match="eval_every"):
        torchspeed.fit(_model(), [(torch.zeros(2, 1, 16), torch.zeros(2, dtype=torch.long))], lr=0.1,
                       eval_every="soon", **_quiet())


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_evaluation_over_five_percent_of_the_run_is_said_with_the_eval_every_that_fixes_it(caplog):
    clock = Clock()
    ev = EvalClock(None, clock=clock)
    for _ in range(10):  # 10 epochs of 1 s training and 0.2 s evaluation (2 s in all: worth a warning)
        clock.now += 1.0
        assert ev.due(0)
        with ev.timing():
            clock.now += 0.2
    with caplog.at_level(logging.WARNING, logger="torchspeed"):
        d = ev.decision(None, steps=400)
    assert d.value == pytest.approx(2 / 12, rel=1e-3)
    # 2% of 12 s is 0.24 s: one evaluation of 0.2 s, so every 400 steps
    assert "eval_every=400 (steps) would evaluate once, at the end" in d.reason and "eval_every=400" in caplog.text


def test_a_short_run_or_few_evaluations_get_no_advice(caplog):
    clock = Clock()
    ev = EvalClock(None, clock=clock)
    for _ in range(2):  # two evaluations, a third of the run, but 0.2 s in all: noise to warn about
        clock.now += 0.1
        with ev.timing():
            clock.now += 0.1
    with caplog.at_level(logging.WARNING, logger="torchspeed"):
        d = ev.decision(None, steps=20)
    assert d.value > 0.3 and caplog.text == "" and "eval_every" not in d.reason


def test_cheap_evaluation_says_nothing(caplog):
    clock = Clock()
    ev = EvalClock(None, clock=clock)
    for _ in range(4):
        clock.now += 10.0
        with ev.timing():
            clock.now += 0.01
    with caplog.at_level(logging.WARNING, logger="torchspeed"):
        d = ev.decision(None, steps=100)
    assert d.value < 0.01 and caplog.text == ""


def test_eval_every_seconds_counts_training_time_since_the_last_evaluation():
    clock = Clock()
    ev = EvalClock(("seconds", 5.0), clock=clock)
    clock.now = 3.0
    assert not ev.due(10)
    clock.now = 5.5
    assert ev.due(20)
    with ev.timing():
        clock.now = 9.0  # a long evaluation does not count as training time
    clock.now = 12.0
    assert not ev.due(30) and ev.due(30, last=True)



def test_eval_every_seconds_evaluates_inside_an_epoch_longer_than_that():
    """"5s": inside an epoch once 5 s of training passed since the last validation and since the epoch began; an
    epoch shorter than 5 s evaluates at its end only, as before."""
    clock = Clock()
    ev = EvalClock(("seconds", 5.0), clock=clock)
    assert ev.inside and not EvalClock(None, clock=clock).inside and not EvalClock(("steps", 50.0)).inside
    assert ev.start_epoch()
    clock.now = 4.0
    assert not ev.due_mid(40)
    clock.now = 5.0
    assert ev.due_mid(50)
    with ev.timing():
        clock.now = 7.0  # the validation's own seconds are not training
    clock.now = 11.0
    assert not ev.due_mid(90)  # 4 s of training since it
    clock.now = 12.5
    assert ev.due_mid(100) and not ev.due_mid(101)
    with ev.timing():
        pass
    clock.now = 14.0
    assert not ev.due(120)  # the epoch ends 1.5 s after the last validation: not due at its end
    clock.now = 20.0
    assert ev.start_epoch() and not ev.due_mid(130)  # a new epoch: 5 s since it began, not since the last one
    clock.now = 25.0
    assert ev.due_mid(140)


def test_fit_with_eval_every_seconds_validates_inside_a_long_epoch(monkeypatch):
    """One 12-step epoch and a clock that moves 1 s a read: "3.5s" validates inside the epoch (the callbacks and
    FitResult.evaluations see each one) and at the run's end."""
    import functools

    import torchspeed.train.loop.trainer as trainer_mod

    ticks = iter(range(10**6))
    monkeypatch.setattr(trainer_mod, "EvalClock", functools.partial(EvalClock, clock=lambda: float(next(ticks))))
    x, y = _data()
    val = DataLoader(TensorDataset(x[:40], y[:40]), batch_size=20)
    seen = []

    class Spy(Callback):
        def on_evaluate(self, trainer, metrics):
            seen.append((metrics["step"], bool(metrics.get("mid_epoch"))))

    res = torchspeed.fit(_model(), DataLoader(TensorDataset(x, y), batch_size=20), epochs=1, lr=1e-2,
                         val_loader=val, eval_every="3.5s", callbacks=[Spy()], **_quiet())
    mids = [e["step"] for e in res.evaluations if e["mid_epoch"]]
    assert len(mids) >= 2 and all(0 < s < 12 for s in mids) and mids == sorted(set(mids))
    assert res.evaluations[-1] == {"epoch": 1, "step": 12, "mid_epoch": False,
                                   **{k: v for k, v in res.final.items() if k.startswith("val_")}}
    assert seen == [(e["step"], e["mid_epoch"]) for e in res.evaluations]
    assert res.decisions["evaluation"].measured["count"] == len(res.evaluations)

# ------------------------------------------------------------------ the small workloads learn

@pytest.mark.parametrize("name", SMALL)
def test_each_small_workloads_plain_loop_learns(name):
    w = make_small(name, n_train=600, n_val=300)
    torch.manual_seed(0)
    model = w.model()
    before = evaluate_plain(model, w.vx, w.vy)
    out = plain_loop(model, w, epochs=4)
    classes = int(w.y.max()) + 1
    assert out["steps"] == 24
    assert out["val_acc"] > max(before, 1.0 / classes) + 0.1


def test_a_ported_loop_with_the_same_numerics_keeps_its_results_epoch_by_epoch():
    """The script's loop and `fit` with its optimizer and LR (and the loop's numerics: fp32, no trial, the foreach
    kernel) train on the same batches to the same accuracy after every epoch: nothing in fit changes the run."""
    from torchspeed.bench.small import make_small

    w = make_small("cnn1d", n_train=600, n_val=400)
    torch.manual_seed(0)
    plain = []
    plain_loop(w.model(), w, epochs=3, seed=0, on_epoch=lambda e, a: plain.append(a) and False)
    torch.manual_seed(0)
    loader = DataLoader(TensorDataset(w.x, w.y), batch_size=w.batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    res = torchspeed.fit(w.model(), loader, epochs=3, optimizer="adamw", lr=w.lr, weight_decay=0.0,
                         val_loader=DataLoader(TensorDataset(w.vx, w.vy), batch_size=500), fused_optimizer=False,
                         restore_best=False, **_quiet())
    assert [r["val_acc"] for r in res.history] == pytest.approx(plain, abs=1.5 / 400)


# ------------------------------------------------------------------ a ported run is the loop's run, bit for bit

def _script_and_fit(name: str, *, epochs: int = 2, **fit_kw):
    """The small workload's own loop (torch.optim.Adam at its LR, the for-loop kernel a script gets on the CPU) and
    `fit` given the same optimizer and LR over a DataLoader with the same generator; both models after `epochs`."""
    from torchspeed.bench.small import shuffled_epochs

    w = make_small(name, n_train=400, n_val=100)
    torch.manual_seed(0)
    script = w.model()
    opt = torch.optim.Adam(script.parameters(), lr=w.lr)
    shuffled_epochs(script, opt, w.x, w.y, loss_fn=torch.nn.functional.cross_entropy, batch_size=w.batch_size,
                    epochs=epochs, seed=0, evaluate=lambda m: 0.0)
    torch.manual_seed(0)
    model = w.model()
    loader = DataLoader(TensorDataset(w.x, w.y), batch_size=w.batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    res = torchspeed.fit(model, loader, epochs=epochs, optimizer="adamw", lr=w.lr, weight_decay=0.0,
                         progress=False, precision="fp32", **fit_kw)
    return script, model, res


@pytest.mark.parametrize("name", SMALL)
def test_fit_given_the_loops_optimizer_and_lr_trains_the_loops_weights_bit_for_bit(name):
    """No kernel, trial or loop machinery of `fit` moves a ported run's numbers (fp32 fixed: the precision is the
    one switch allowed to change them, and it depends on this CPU). Fails with the fused kernel on such a run
    (it rounds otherwise), or with any change to the batches, their order or the update."""
    script, model, res = _script_and_fit(name)
    assert res.decisions["fused_optimizer"].value is False
    assert "your loop's" in res.decisions["fused_optimizer"].reason
    assert res.decisions["optimizer"].value == "AdamW (for-loop)"
    for (k, a), b in zip(script.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), k


@pytest.mark.parametrize("lean_step", [True, False])
def test_a_run_handed_a_model_the_users_own_steps_left_gradients_on_trains_the_loops_weights(lean_step):
    """A script that trained a few steps in its own loop (zero_grad before each backward, so the last step's
    gradients stay on the weights) and hands the model and its optimizer to `fit`: the loop would zero them before
    its next backward, so `fit` starts from none. Before, they were summed into the first step's."""
    x, y = _data()
    batches = [(x[i:i + 24], y[i:i + 24]) for i in range(0, len(x), 24)]

    def own_steps(model, opt, bs):
        for xb, yb in bs:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()

    script, ported = _model(), _model()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (script, ported)]
    for m, opt in zip((script, ported), opts):
        own_steps(m, opt, batches[:3])
    own_steps(script, opts[0], batches)
    assert ported[0].weight.grad is not None
    torchspeed.fit(ported, batches, optimizer=opts[1], epochs=1, lean_step=lean_step, **_quiet())
    for (k, a), b in zip(script.state_dict().items(), ported.state_dict().values()):
        assert torch.equal(a, b), k


def test_the_ported_runs_update_goes_through_the_lean_step(adamw_step_calls):
    """torch's for-loop Adam runs its `step` once (the state made), then the lean step's foreach ops: the same bits
    (above) at about 0.6x the step's time. Fails with the lean step off (every update is torch's)."""
    calls = adamw_step_calls
    _, _, res = _script_and_fit("mlp")
    assert res.steps == 8 and len(calls) == 1
    calls.clear()
    _, _, naive = _script_and_fit("mlp", lean_step=False)  # the bench's naive loop: torch's own step every time
    assert naive.steps == 8 and len(calls) == 8


def test_the_kernel_rule_keeps_the_fused_kernel_where_the_run_did_not_give_its_lr():
    """The kernel rule is for a run given its LR with no recipe; fit's own default LR (one-cycle), an explicit
    fused_optimizer=True, and the recipe's runs keep the fused kernel."""
    from torchspeed.plan.planner import make_plan
    from torchspeed.train.config import TrainConfig

    x, y = _data()
    loader = DataLoader(TensorDataset(x, y), batch_size=20, shuffle=True)
    assert torchspeed.fit(_model(), loader, epochs=1, optimizer="adamw", **_quiet()).decisions[
        "optimizer"].value == "AdamW (fused)"
    assert torchspeed.fit(_model(), loader, epochs=1, optimizer="adamw", lr=1e-2, fused_optimizer=True,
                          **_quiet()).decisions["optimizer"].value == "AdamW (fused)"
    given = make_plan(_model(), loader, TrainConfig(epochs=1, progress=False), optimizer="adamw", lr=1e-2)
    assert given.config.fused_optimizer == "default"
    recipe = make_plan(_model(), loader, TrainConfig(epochs=1, progress=False, fused_optimizer="auto"),
                       optimizer="adamw", lr=1e-2, recipe="auto", recipe_parts=())
    assert recipe.config.fused_optimizer == "auto"
