"""Stateful parts in one list: a part registered in `Trainer.stateful` is saved under its name and restored by
the resume loop with no other edit; the missing-part policy; the older flat layout; the guard follows the
precision without a rebuild; one step-folder store for single-file and sharded checkpoints."""

import logging

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchspeed.train.loop.callbacks import Callback
from torchspeed.train.state.checkpoint import CheckpointManager, load_checkpoint, save_checkpoint
from torchspeed.train.config import TrainConfig
from torchspeed.train.state.dcp import ShardedCheckpoints
from torchspeed.train.loop.guard import NonFiniteGuard
from torchspeed.train.sampler import ResumableSampler
from torchspeed.train.state.stateful import MissingPartError, collect_state
from torchspeed.train.state.store import StepStore
from torchspeed.train.trial.switch_choice import Switches
from torchspeed.train.loop.trainer import Trainer

STEPS = 24  # 2 epochs x 12 batches


class _Crash(Exception):
    pass


class Counter:
    """A part of the test's own: a count and a tensor, changed at every optimizer step."""

    def __init__(self):
        self.n, self.total, self.loaded = 0, torch.zeros(3), []

    def state_dict(self) -> dict:
        return {"n": self.n, "total": self.total.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.loaded.append(state["n"])
        self.n, self.total = int(state["n"]), state["total"].clone()


class Count(Callback):
    """Moves the counter at each step, and ends the process (an exception) after step `crash_at`."""

    def __init__(self, counter: Counter | None, crash_at: int | None = None):
        self.counter, self.crash_at = counter, crash_at

    def on_step_end(self, trainer) -> None:
        if self.counter is not None:
            self.counter.n += 1
            self.counter.total += trainer.step
        if trainer.step == self.crash_at:
            raise _Crash


def _loader():
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(96, 8, generator=g), torch.randint(0, 3, (96,), generator=g))
    return DataLoader(ds, batch_size=8, sampler=ResumableSampler(ds, seed=1))


def _trainer(ckpt, *, counter=None, crash_at=None, seed=0, **config) -> Trainer:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    cfg = TrainConfig(**{**dict(epochs=2, progress=False, deterministic=True, seed=0, compile=False,
                                precision="fp32", checkpoint_dir=str(ckpt) if ckpt else None,
                                checkpoint_every=1 if ckpt else None, keep_last=50), **config})
    t = Trainer(model, optimizer="adamw", lr=1e-2, device="cpu", config=cfg, callbacks=[Count(counter, crash_at)])
    if counter is not None:
        t.stateful["counter"] = counter  # the only edit a new part needs
    return t


def _crashed_run(ckpt, counter=None, crash_at=7) -> None:
    with pytest.raises(_Crash):
        _trainer(ckpt, counter=counter, crash_at=crash_at).fit(_loader())


def test_a_registered_part_round_trips_through_save_kill_and_resume(tmp_path):
    ref = Counter()
    _trainer(tmp_path / "ref", counter=ref).fit(_loader())
    _crashed_run(tmp_path / "run", Counter())  # dies after step 7: the last checkpoint is step 6's
    saved = torch.load(tmp_path / "run" / "step-00000006.pt", weights_only=True)
    assert saved["counter"]["n"] == 6 and torch.equal(saved["counter"]["total"], torch.full((3,), 21.0))
    counter = Counter()  # a new process: a new trainer, a new part, nothing carried over in memory
    t = _trainer(tmp_path / "run", counter=counter, seed=5, resume="auto")
    t.fit(_loader())
    assert counter.loaded == [6]
    assert counter.n == ref.n == STEPS and torch.equal(counter.total, ref.total)


def test_a_part_missing_from_the_checkpoint_is_a_clear_error_before_any_change(tmp_path):
    _crashed_run(tmp_path)  # written by a run without the part
    t = _trainer(tmp_path, counter=Counter(), seed=5, resume="auto")
    before = {k: v.clone() for k, v in t.module.state_dict().items()}
    with pytest.raises(MissingPartError, match=r"no state for part\(s\) \['counter'\].*remove them from "
                                               r"trainer.stateful"):
        t.fit(_loader())
    assert all(torch.equal(before[k], v) for k, v in t.module.state_dict().items()) and t.step == 0


def _flat(state: dict) -> dict:
    """The same training state in the layout of format 1: position, guard counts and progress at the top."""
    out = {k: v for k, v in state.items() if k not in ("position", "guard", "run", "counter")}
    for part in ("position", "guard", "run"):
        out.update(state[part])
    return {**out, "format": "torchspeed-checkpoint/1"}


def test_a_checkpoint_of_the_flat_layout_resumes_the_same(tmp_path, caplog):
    _crashed_run(tmp_path / "run", Counter())
    nested = load_checkpoint(tmp_path / "run" / "step-00000006.pt")
    save_checkpoint(tmp_path / "flat.pt", _flat(nested))
    results = {}
    for name in ("step-00000006.pt", "flat.pt"):
        path = tmp_path / "run" / name if name.startswith("step") else tmp_path / name
        with caplog.at_level(logging.WARNING, logger="torchspeed"):
            t = _trainer(None, seed=5, resume=str(path))
            r = t.fit(_loader())
        results[name] = (r.steps, [h["train_loss"] for h in r.history], t.module.state_dict())
    (s1, h1, w1), (s2, h2, w2) = results.values()
    assert s1 == s2 == STEPS and h1 == h2 and all(torch.equal(w1[k], w2[k]) for k in w1)
    assert "holds state for part(s) ['counter'] that this run does not register; left out" in caplog.text


def test_reserved_names_cannot_be_parts():
    with pytest.raises(ValueError, match="reserved.*another name"):
        collect_state({"config": Counter()})


def test_the_guard_follows_a_precision_switch_without_a_rebuild():
    t = _trainer(None)
    guard = t.guard
    guard.skipped.fill_(3)
    assert guard.mode == "host"  # fp32 on CPU: the guard reads the loss and skips bad steps itself
    t.switcher.apply(Switches("fp16", False, None, None))  # fp16: the GradScaler skips them
    assert t.guard is guard and guard.mode == "scaler" and int(guard.skipped) == 3
    t.switcher.apply(Switches("fp32", False, None, None))
    assert guard.mode == "host"


def test_the_guard_skips_by_its_own_check_only_without_precision_skips():
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=1.0)
    calls = []
    update = lambda: calls.append(1) or torch.zeros((), dtype=torch.int64)  # noqa: E731
    guard = NonFiniteGuard(5, optimizer=opt, device=torch.device("cpu"))
    guard.observe(torch.tensor(float("nan")))
    assert int(guard.step(opt, update)) == 1 and calls == []  # skipped by the guard
    guard.precision_skips = True
    guard.observe(torch.tensor(float("nan")))
    assert int(guard.step(opt, update)) == 0 and calls == [1]  # the precision's step decides (it reported 0)


def _finished_folder(store: ShardedCheckpoints, step: int):
    folder = store.path_for(step)
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(b"")


def test_one_store_lists_prunes_and_cleans_files_and_folders(tmp_path):
    files, folders = CheckpointManager(tmp_path / "f", keep_last=2), ShardedCheckpoints(tmp_path / "s", keep_last=2)
    assert isinstance(files, StepStore) and isinstance(folders, StepStore)
    for step in (1, 2, 3):
        _finished_folder(folders, step)
    folders.path_for(4).mkdir()  # no .metadata: a folder not finished is not a checkpoint
    (tmp_path / "s" / ".step-00000005.tmp").mkdir()  # a save killed midway
    (tmp_path / "s" / ".step-00000000.old").mkdir()  # a prune killed midway
    assert [p.name for p in folders.checkpoints()] == ["step-00000003", "step-00000002", "step-00000001"]
    folders.prune()
    folders.clean_stale()
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["step-00000002", "step-00000003", "step-00000004"]

    (tmp_path / "f").mkdir()
    (tmp_path / "f" / ".step-00000009.pt.999999.tmp").write_bytes(b"half")  # another process, killed mid-write
    for step in (1, 2, 3):
        files.save({"step": step}, step=step)
    assert sorted(p.name for p in (tmp_path / "f").iterdir()) == ["step-00000002.pt", "step-00000003.pt"]
    assert files.latest().state["step"] == 3
