"""Callbacks: the events, stopping, EarlyStopping, EMA (alone and in fit), and their state across a resume."""

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchspeed
from torchspeed.train.loop.callbacks import EMA, Callback, CallbackList, EarlyStopping
from torchspeed.train.state.checkpoint import CheckpointManager, load_checkpoint
from torchspeed.train.evaluate import evaluate
from torchspeed.train.sampler import ResumableSampler

_FIT = dict(device="cpu", progress=False, deterministic=True, seed=0, compile=False, precision="fp32",
            optimizer="sgd", lr=0.05)


def _data(n=96, bs=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    ds = TensorDataset(x, y)
    return DataLoader(ds, batch_size=bs, sampler=ResumableSampler(ds, seed=1))


def _val(n=64):
    return _data(n=n, seed=5)


def _bn_mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 2))


def _state_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class Recorder(Callback):
    def __init__(self):
        self.events = []

    def on_train_start(self, trainer):
        self.events.append(("start", trainer.step))

    def on_step_end(self, trainer):
        self.events.append(("step", trainer.step))

    def on_evaluate(self, trainer, metrics):
        self.events.append(("evaluate", metrics["epoch"], "val_acc" in metrics))

    def on_save(self, trainer, path):
        self.events.append(("save", path.name))

    def on_train_end(self, trainer, status):
        self.events.append(("end", status))


# ---------------------------------------------------------------------- events and stopping
def test_events_fire_in_order_once_per_optimizer_step(tmp_path):
    rec = Recorder()
    r = torchspeed.fit(_bn_mlp(), _data(), epochs=2, val_loader=_val(), grad_accum=2, callbacks=[rec],
                       checkpoint_dir=str(tmp_path), checkpoint_every=3, **_FIT)
    steps = [e[1] for e in rec.events if e[0] == "step"]
    assert r.steps == 12 and steps == list(range(1, 13))  # 24 micro-batches, 12 optimizer steps
    assert rec.events[0] == ("start", 0) and rec.events[-1] == ("end", "success")
    assert [e for e in rec.events if e[0] == "evaluate"] == [("evaluate", 1, True), ("evaluate", 2, True)]
    saves = [e[1] for e in rec.events if e[0] == "save"]
    assert saves == ["step-00000003.pt", "step-00000006.pt", "step-00000009.pt", "step-00000012.pt"]
    # the epoch-end evaluation comes before that epoch's checkpoint (so the checkpoint holds the callback's reaction)
    i_eval = rec.events.index(("evaluate", 2, True))
    assert rec.events.index(("save", "step-00000012.pt")) > i_eval
    assert set(r.config) == set(torchspeed.TrainConfig.__dataclass_fields__)  # callbacks are not config


def test_train_end_reports_failure():
    class Boom(Callback):
        def on_step_end(self, trainer):
            if trainer.step == 3:
                raise RuntimeError("boom")
    rec = Recorder()
    with pytest.raises(RuntimeError, match="boom"):
        torchspeed.fit(_bn_mlp(), _data(), epochs=1, callbacks=[rec, Boom()], **_FIT)
    assert rec.events[-1] == ("end", "failed")


def test_a_callback_stops_training_after_the_step():
    class StopAt(Callback):
        def on_step_end(self, trainer):
            if trainer.step == 5:
                trainer.request_stop("enough")
    r = torchspeed.fit(_bn_mlp(), _data(), epochs=3, val_loader=_val(), callbacks=[StopAt()], **_FIT)
    assert r.steps == 5 and len(r.history) == 1 and r.decisions["stopped"].value == "enough"
    assert r.history[0]["step"] == 5 and "val_acc" in r.history[0]  # the partial epoch is evaluated


def test_callbacks_must_be_callbacks():
    with pytest.raises(TypeError, match="not a torchspeed Callback"):
        torchspeed.fit(_bn_mlp(), _data(), callbacks=[object()], **_FIT)


# ---------------------------------------------------------------------- EarlyStopping
class FreezeAfter(Callback):
    """Sets the learning rate to 0 after epoch `n`: from then on the weights, so val_loss, stay exactly the same."""

    def __init__(self, n):
        self.n = n

    def on_evaluate(self, trainer, metrics):
        if metrics["epoch"] >= self.n:
            for g in trainer.optimizer.param_groups:
                g["lr"] = 0.0
            trainer.scheduler = None


def _plain_mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def test_early_stopping_stops_when_val_loss_stops_improving():
    es = EarlyStopping("val_loss", patience=2)
    r = torchspeed.fit(_plain_mlp(), _data(), epochs=10, val_loader=_val(), schedule=None,
                       callbacks=[FreezeAfter(3), es], **_FIT)
    losses = [row["val_loss"] for row in r.history]
    assert losses[0] > losses[1] > losses[2]                 # improving while training
    assert losses[2] == losses[3] == losses[4]               # frozen: no improvement
    assert len(r.history) == 5 and r.steps == 5 * 12          # stopped at epoch 5 = 3 + patience
    assert es.best_epoch == 3 and es.stopped_epoch == 5 and es.best == losses[2]
    assert "early stopping at epoch 5: val_loss did not improve for 2 epoch(s)" in str(r.decisions["stopped"])
    # the control: the same run without EarlyStopping trains all 10 epochs
    r_all = torchspeed.fit(_plain_mlp(), _data(), epochs=10, val_loader=_val(), schedule=None,
                           callbacks=[FreezeAfter(3)], **_FIT)
    assert len(r_all.history) == 10 and "stopped" not in r_all.decisions


def test_early_stopping_modes_and_errors():
    es = EarlyStopping("val_acc", patience=1, min_delta=0.01)
    assert es.mode == "max"
    assert es.improved(0.5)
    es.best = 0.5
    assert not es.improved(0.505) and es.improved(0.52) and not es.improved(float("nan"))
    assert EarlyStopping("val_loss").mode == "min" and EarlyStopping("score", mode="max").mode == "max"
    with pytest.raises(ValueError, match="patience"):
        EarlyStopping(patience=0)
    with pytest.raises(ValueError, match="no epoch metric 'val_loss'.*train_loss.*pass val_loader"):
        torchspeed.fit(_plain_mlp(), _data(), epochs=1, callbacks=[EarlyStopping("val_loss")], **_FIT)


def test_early_stopped_run_stays_stopped_on_resume(tmp_path):
    cfg = dict(_FIT, epochs=10, val_loader=_val(), schedule=None, checkpoint_dir=str(tmp_path))
    r = torchspeed.fit(_plain_mlp(), _data(), callbacks=[FreezeAfter(3), EarlyStopping("val_loss", patience=2)], **cfg)
    assert len(r.history) == 5
    es = EarlyStopping("val_loss", patience=2)
    r2 = torchspeed.fit(_plain_mlp(seed=3), _data(), callbacks=[FreezeAfter(3), es], resume="auto", **cfg)
    assert r2.steps == r.steps and len(r2.history) == 5 and es.stopped_epoch == 5 and es.wait == 2


# ---------------------------------------------------------------------- EMA as a plain object
@pytest.mark.parametrize("buffers, warmup", [("average", False), ("copy", False), ("average", True)])
def test_ema_object_matches_the_formula(buffers, warmup):
    model = _bn_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = EMA(0.8, buffers=buffers, warmup=warmup).attach(model)
    ref = {}
    x, y = torch.randn(32, 8), torch.randint(0, 2, (32,))
    decays = []
    for t in range(40):
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        ema.update()
        d = min(0.8, (1 + t) / (10 + t)) if warmup else 0.8
        decays.append(d)
        for k, v in model.state_dict().items():
            if t == 0 or (buffers == "copy" and "running" in k):
                ref[k] = v.clone().float()           # the first update copies; "copy" copies the BN statistics
            else:
                ref[k] = ref[k] * d + v.float() * (1 - d)
    for k, v in ema.module.state_dict().items():
        if k.endswith("num_batches_tracked"):
            continue  # an integer: BatchNorm reads it only with momentum=None (see the EMA docstring)
        assert torch.allclose(v.float(), ref[k], atol=1e-5), k
    assert (decays[1] < 0.8) == warmup and decays[-1] == 0.8   # the warm-up ramps up to the cap
    assert ema.updates == 40 and int(ema.averaged.n_averaged) == 40 and not ema.module.training
    assert not torch.equal(ema.module[0].weight, model[0].weight)
    # buffers="copy": the running statistics are the live model's; "average": they are not
    same_stats = torch.equal(ema.module[1].running_mean, model[1].running_mean)
    assert same_stats == (buffers == "copy")


def test_ema_needs_attach_and_validates():
    with pytest.raises(RuntimeError, match="attach"):
        EMA(0.9).update()
    with pytest.raises(ValueError, match="decay"):
        EMA(1.5)
    with pytest.raises(ValueError, match="buffers"):
        EMA(0.9, buffers="sometimes")


# ---------------------------------------------------------------------- EMA in fit
def test_fit_with_ema_evaluates_and_saves_the_ema_weights(tmp_path):
    model = _bn_mlp()
    ema = EMA(0.9, apply_at_end=False)
    r = torchspeed.fit(model, _data(), epochs=2, val_loader=_val(), callbacks=[ema],
                       checkpoint_dir=str(tmp_path), restore_best=False, **_FIT)  # the model keeps its last weights
    assert ema.updates == r.steps == 24
    on_ema = evaluate(ema.module, _val(), device="cpu")
    on_live = evaluate(model, _val(), device="cpu")
    assert r.final["val_loss"] == pytest.approx(on_ema["val_loss"], rel=1e-6)
    assert on_live["val_loss"] != pytest.approx(on_ema["val_loss"], rel=1e-3)   # the two really differ
    best = load_checkpoint(tmp_path / "best.pt")
    last = load_checkpoint(CheckpointManager(tmp_path).checkpoints()[0])
    assert best["run"]["best"]["epoch"] == 2   # the last epoch: best.pt "model" = EMA weights, "train_model" = trained
    assert _state_equal(best["model"], ema.module.state_dict())
    assert _state_equal(best["train_model"], model.state_dict())
    assert _state_equal(last["model"], model.state_dict())            # step checkpoints: the trained weights
    assert "EMA" in last["callbacks"] and last["callbacks"]["EMA"]["decay"] == 0.9


def test_ema_is_copied_into_the_model_at_the_end():
    model = _bn_mlp()
    ema = EMA(0.9)
    torchspeed.fit(model, _data(), epochs=1, callbacks=[ema], **_FIT)
    assert _state_equal(model.state_dict(), ema.module.state_dict())


def test_resume_with_ema_is_bit_identical(tmp_path):
    cfg = dict(_FIT, epochs=3, val_loader=_val(), checkpoint_dir=None, checkpoint_every=None)
    ref_model, ref_ema = _bn_mlp(), EMA(0.9, apply_at_end=False)
    ref = torchspeed.fit(ref_model, _data(), callbacks=[ref_ema, EarlyStopping("val_acc", patience=5)], **cfg)

    class Crash(Exception):
        pass

    class CrashAt(Callback):
        def on_step_end(self, trainer):
            if trainer.step == 17:
                raise Crash
    cfg.update(checkpoint_dir=str(tmp_path), checkpoint_every=1, keep_last=50)
    with pytest.raises(Crash):
        torchspeed.fit(_bn_mlp(), _data(), callbacks=[EMA(0.9, apply_at_end=False), EarlyStopping("val_acc", patience=5),
                                                      CrashAt()], **cfg)
    model, ema = _bn_mlp(seed=7), EMA(0.9, apply_at_end=False)
    es = EarlyStopping("val_acc", patience=5)
    r = torchspeed.fit(model, _data(), callbacks=[ema, es], resume="auto", **cfg)
    assert "step 16" in str(r.decisions["resumed_from"])
    assert _state_equal(model.state_dict(), ref_model.state_dict())
    assert _state_equal(ema.averaged.state_dict(), ref_ema.averaged.state_dict())
    assert [h["val_acc"] for h in r.history] == [h["val_acc"] for h in ref.history]
    assert es.best is not None and es.best_epoch == max(range(1, 4), key=lambda e: (ref.history[e - 1]["val_acc"], -e))


def test_resume_without_the_ema_state_differs(tmp_path, caplog):
    """The check above is sharp: an EMA restarted at the resume (its state not restored) ends elsewhere."""
    cfg = dict(_FIT, epochs=2, checkpoint_dir=str(tmp_path), checkpoint_every=1)
    ref_ema = EMA(0.9, apply_at_end=False)
    torchspeed.fit(_bn_mlp(), _data(), callbacks=[ref_ema], **dict(cfg, checkpoint_dir=str(tmp_path / "ref")))
    torchspeed.fit(_bn_mlp(), _data(), callbacks=[EMA(0.9)], **cfg)
    path = CheckpointManager(tmp_path).checkpoints()[-1]  # the oldest kept: mid-run
    state = load_checkpoint(path)
    state.pop("callbacks")
    torch.save(state, tmp_path / "no_ema.pt")
    ema = EMA(0.9, apply_at_end=False)
    torchspeed.fit(_bn_mlp(), _data(), callbacks=[ema], **dict(cfg, checkpoint_dir=None, checkpoint_every=None,
                                                                 resume=str(tmp_path / "no_ema.pt")))
    assert not _state_equal(ema.averaged.module.state_dict(), ref_ema.averaged.module.state_dict())
    assert "the checkpoint has no state for callback EMA; it starts afresh" in caplog.text


def test_callback_list_keys_state_by_class():
    a, b = EMA(0.9), EMA(0.99)
    cbs = CallbackList([a, b, EarlyStopping()])
    model = _bn_mlp()
    a.attach(model)
    b.attach(copy.deepcopy(model))
    sd = cbs.state_dict()
    assert list(sd) == ["EMA", "EMA#1", "EarlyStopping"] and sd["EMA#1"]["decay"] == 0.99
