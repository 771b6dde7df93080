"""Exact resume with a loader's own generator, the optimizer class a checkpoint records, and optimizer= given a class."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, RandomSampler, TensorDataset

import torchspeed
from torchspeed.train.state.checkpoint import CheckpointManager, ResumeMismatchError, load_checkpoint, save_checkpoint
from torchspeed.train.parallel.fsdp import check_optimizer
from torchspeed.train.sampler import DataPosition

_FIT = dict(epochs=3, device="cpu", progress=False, deterministic=True, seed=0, compile=False,
            optimizer="adamw", lr=1e-2, precision="fp32")
_N, _BS = 96, 8  # 12 batches per epoch


class _Crash(Exception):
    pass


class _Samples(Dataset):
    """A custom map-style Dataset (not tensors in memory: read sample by sample)."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def _data(kind: str):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(_N, 8, generator=g), torch.randint(0, 3, (_N,), generator=g)
    return _Samples(x, y) if kind == "custom" else TensorDataset(x, y)


def _loader(kind: str = "loader"):
    """A fresh loader whose order comes from its own generator, as a restarted script builds it."""
    ds = _data(kind)
    if kind == "sampler":
        return DataLoader(ds, batch_size=_BS, sampler=RandomSampler(ds, generator=torch.Generator().manual_seed(5)))
    return DataLoader(ds, batch_size=_BS, shuffle=True, generator=torch.Generator().manual_seed(5))


def _recording(seen: list, crash_at: int | None = None, seed: int = 0):
    """An MLP that records each batch it trains on (and raises on its `crash_at`-th forward)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))
    forward = model.forward

    def fwd(x):
        if crash_at is not None and len(seen) + 1 == crash_at:
            raise _Crash
        seen.append(x.detach().clone())
        return forward(x)
    model.forward = fwd
    return model


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


def _crash_and_resume(tmp_path, kind: str, crash_at: int, **fit):
    """(uninterrupted batches, model), (resumed run's batches, model), the resume decision."""
    ref_seen, seen = [], []
    ref = _recording(ref_seen)
    torchspeed.fit(ref, _loader(kind), **_FIT)
    with pytest.raises(_Crash):
        torchspeed.fit(_recording([], crash_at), _loader(kind), checkpoint_dir=str(tmp_path), **fit, **_FIT)
    resumed = _recording(seen, seed=99)  # other initial weights: all must come from the checkpoint
    r = torchspeed.fit(resumed, _loader(kind), checkpoint_dir=str(tmp_path), resume="auto", **fit, **_FIT)
    return (ref_seen, ref), (seen, resumed), str(r.decisions["resumed_from"])


@pytest.mark.parametrize("kind", ["loader", "sampler", "custom"])
def test_mid_epoch_resume_with_the_loaders_own_generator_is_exact(tmp_path, kind):
    (ref_seen, ref), (seen, resumed), where = _crash_and_resume(tmp_path, kind, 17, checkpoint_every=1)
    assert "epoch 2, batch 4, step 16" in where
    assert len(seen) == 36 - 16 and all(torch.equal(a, b) for a, b in zip(ref_seen[16:], seen))
    assert _same(ref, resumed)


@pytest.mark.parametrize("kind", ["loader", "sampler"])
def test_resume_at_an_epoch_start_with_the_loaders_own_generator_is_exact(tmp_path, kind):
    (ref_seen, ref), (seen, resumed), where = _crash_and_resume(tmp_path, kind, 15)  # epoch ends only: step 12
    assert "epoch 2, batch 0, step 12" in where
    assert len(seen) == 24 and all(torch.equal(a, b) for a, b in zip(ref_seen[12:], seen))
    assert _same(ref, resumed)


def test_position_keeps_the_generators_as_tensors_and_an_old_checkpoint_still_loads(tmp_path):
    with pytest.raises(_Crash):
        torchspeed.fit(_recording([], 17), _loader(), checkpoint_dir=str(tmp_path), checkpoint_every=1, **_FIT)
    path = CheckpointManager(tmp_path).checkpoints()[-1]
    state = load_checkpoint(path)  # weights_only
    epoch_gens = state["position"]["epoch_loader_rng"]
    assert set(epoch_gens) == {"loader"} and epoch_gens["loader"].dtype == torch.uint8
    old = {**state, "position": {k: v for k, v in state["position"].items()
                                 if k not in ("epoch_loader_rng", "loader_rng")}}
    save_checkpoint(path, old)  # as written before the loader's generators were kept
    r = torchspeed.fit(_recording([]), _loader(), checkpoint_dir=str(tmp_path), checkpoint_every=1,
                       resume="auto", **_FIT)
    assert r.steps == 36


def test_position_saves_the_generators_at_an_epoch_start():
    pos = DataPosition(keep_rng=True)
    loader = _loader()
    list(pos.epoch_iter(loader, 0))
    pos.start_epoch(1, 0)
    state = pos.state_dict()
    assert torch.equal(state["loader_rng"]["loader"], loader.generator.get_state())
    fresh = _loader()
    again = DataPosition(keep_rng=True)
    again.load_state_dict(state)
    a = [x for x, _ in again.epoch_iter(fresh, 0)]
    b = [x for x, _ in pos.epoch_iter(loader, 0)]
    assert all(torch.equal(p, q) for p, q in zip(a, b))


# ---------------------------------------------------------------------- the optimizer a checkpoint records
def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def test_resuming_with_another_optimizer_is_a_clear_error(tmp_path):
    torchspeed.fit(_model(), _loader(), checkpoint_dir=str(tmp_path), **dict(_FIT, epochs=1))
    path = CheckpointManager(tmp_path).checkpoints()[-1]
    assert load_checkpoint(path)["run"]["optimizer_class"] == "AdamW"
    with pytest.raises(ResumeMismatchError, match=r"optimizer AdamW.*optimizer is SGD.*optimizer='adamw'"):
        torchspeed.fit(_model(), _loader(), checkpoint_dir=str(tmp_path), resume="auto",
                       **dict(_FIT, optimizer="sgd"))
    m = _model()
    with pytest.raises(ResumeMismatchError, match=r"AdamW.*SGD.*new run"):
        torchspeed.fit(m, _loader(), checkpoint_dir=str(tmp_path), resume="auto",
                       **dict(_FIT, optimizer=torch.optim.SGD(m.parameters(), lr=0.1)))
    r = torchspeed.fit(_model(), _loader(), checkpoint_dir=str(tmp_path), resume="auto", **_FIT)
    assert r.steps == 36  # the same optimizer continues


def test_a_checkpoint_without_the_optimizer_name_still_resumes(tmp_path):
    torchspeed.fit(_model(), _loader(), checkpoint_dir=str(tmp_path), **dict(_FIT, epochs=1))
    path = CheckpointManager(tmp_path).checkpoints()[-1]
    state = load_checkpoint(path)
    save_checkpoint(path, {**state, "run": {k: v for k, v in state["run"].items() if k != "optimizer_class"}})
    r = torchspeed.fit(_model(), _loader(), checkpoint_dir=str(tmp_path), resume="auto", **_FIT)
    assert r.steps == 36


# ---------------------------------------------------------------------- optimizer= given a class
def test_an_optimizer_class_is_a_type_error_naming_the_fix():
    msg = (r"optimizer= takes a name like 'adamw' or an instance like torch\.optim\.AdamW\(model\.parameters\(\), "
           r"lr=\.\.\.\); got the class AdamW")
    with pytest.raises(TypeError, match=msg):
        check_optimizer(torch.optim.AdamW, sharded=False)
    with pytest.raises(TypeError, match=msg):
        torchspeed.fit(_model(), _loader(), **dict(_FIT, optimizer=torch.optim.AdamW, epochs=1))
    check_optimizer("adamw", sharded=True)  # a name is fine everywhere


def test_a_list_of_optimizers_or_a_scheduler_as_the_optimizer_is_a_type_error_naming_the_fix():
    """A GAN script's [opt_g, opt_d], or the scheduler passed where its optimizer goes: named with the fix before any
    work, not torch's "'list' object has no attribute 'param_groups'"."""
    m = _model()
    two = [torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(m.parameters(), lr=0.1)]
    with pytest.raises(TypeError, match=r"takes one optimizer; got a list of 2.*step the other inside your step_fn"):
        torchspeed.fit(m, _loader(), **dict(_FIT, optimizer=two, epochs=1))
    sched = torch.optim.lr_scheduler.StepLR(two[0], 1)
    with pytest.raises(TypeError, match=r"got an LR scheduler \(StepLR\).*optimizer=sched.optimizer.*schedule=sched"):
        torchspeed.fit(m, _loader(), **dict(_FIT, optimizer=sched, epochs=1))
    with pytest.raises(TypeError, match="got dict"):
        check_optimizer({"lr": 0.1}, sharded=False)


def test_resuming_with_the_same_optimizer_grouped_otherwise_is_a_clear_error(tmp_path):
    """optimizer='adamw' (weight decay split off the biases: two groups) resumed with torch.optim.AdamW over all the
    parameters (one group): a ResumeMismatchError naming the part and the fix, not torch's bare ValueError."""
    torchspeed.fit(_model(), _loader(), checkpoint_dir=str(tmp_path), **dict(_FIT, epochs=1, weight_decay=0.05))
    m = _model()
    with pytest.raises(ResumeMismatchError, match=r"'optimizer' state does not fit.*parameter groups.*load_checkpoint"):
        torchspeed.fit(m, _loader(), checkpoint_dir=str(tmp_path), resume="auto",
                       **dict(_FIT, optimizer=torch.optim.AdamW(m.parameters(), lr=1e-3)))
