"""Checkpoints, exact resume, the non-finite loss guard and the out-of-memory message (issue: reliability)."""

import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchspeed
import torchspeed.train.state.resume as resume_mod
from torchspeed.train.state.checkpoint import (CheckpointManager, CheckpointMismatchError, CorruptCheckpointError,
                                               check_state_dict, load_checkpoint, save_checkpoint, verify_checkpoint)
from torchspeed.train.loop.guard import (NonFiniteLossError, TrainingOutOfMemoryError, is_out_of_memory,
                                         out_of_memory_error)
from torchspeed.train.state.rng import capture_rng_state, restore_rng_state
from torchspeed.train.sampler import ResumableSampler


def _mlp(seed=0, hidden=16, out=3):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Dropout(0.2), nn.Linear(hidden, out))


def _loader(kind="resumable", n=96, bs=8, nan_batches=()):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    if kind == "list":
        batches = [(x[i:i + bs].clone(), y[i:i + bs]) for i in range(0, n, bs)]
        for b in nan_batches:
            batches[b][0][0, 0] = float("nan")
        return batches
    ds = TensorDataset(x, y)
    if kind == "resumable":
        return DataLoader(ds, batch_size=bs, sampler=ResumableSampler(ds, seed=1))
    return DataLoader(ds, batch_size=bs, shuffle=True)


_FIT = dict(epochs=3, device="cpu", progress=False, deterministic=True, seed=0, compile=False,
            optimizer="adamw", lr=1e-2, precision="fp32")


class _Crash(Exception):
    pass


def _crash_at(model, call):
    """Make `model` raise on its `call`-th forward: a process dying in the middle of a step."""
    n = [0]
    forward = model.forward

    def fwd(x):
        n[0] += 1
        if n[0] == call:
            raise _Crash
        return forward(x)
    model.forward = fwd
    return model


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


# ---------------------------------------------------------------------- files
def test_save_is_atomic_and_roundtrips(tmp_path):
    m = _mlp()
    path = save_checkpoint(tmp_path / "a" / "m.pt", {"model": m.state_dict(), "step": 7, "rng": capture_rng_state()})
    assert sorted(os.listdir(tmp_path / "a")) == ["m.pt"]  # no temporary file left behind
    state = load_checkpoint(path)
    assert state["step"] == 7 and _same(m, _mlp()) and torch.equal(state["model"]["0.weight"], m[0].weight)
    plain = torch.load(path, weights_only=True)  # still a plain torch file despite the checksum trailer
    assert torch.equal(plain["model"]["0.weight"], m[0].weight)


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "garbage"])
def test_damaged_checkpoint_is_detected(tmp_path, damage):
    path = save_checkpoint(tmp_path / "m.pt", {"model": _mlp().state_dict()})
    data = bytearray(path.read_bytes())
    if damage == "flip":  # a flipped byte inside tensor data: torch.load alone would load it silently
        data[len(data) // 2] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "empty":
        data = bytearray()
    else:
        data = bytearray(b"not a checkpoint" * 10)
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError):
        load_checkpoint(path)


def test_weights_only_refuses_code(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))
    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "payload": Evil()}, path)
    with pytest.raises(CorruptCheckpointError, match="weights_only"):
        load_checkpoint(path)


def test_mismatched_model_lists_keys_and_shapes(tmp_path):
    path = save_checkpoint(tmp_path / "m.pt", {"model": _mlp(hidden=16, out=3).state_dict()})
    other = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 5), nn.Linear(5, 2))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointMismatchError) as e:
        load_checkpoint(path, model=other)
    msg = str(e.value)
    assert "3.weight is [3, 16] in the checkpoint but [5, 16] in the model" in msg
    assert "4.weight" in msg and "missing" in msg
    assert e.value.missing == ["4.weight", "4.bias"] and [s[0] for s in e.value.shapes] == ["3.weight", "3.bias"]
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())  # untouched
    load_checkpoint(path, model=other, strict=False)  # the matching tensors only
    assert torch.equal(other[0].weight, _mlp()[0].weight)


def test_wrapper_prefixes_are_ignored():
    sd = {f"module.{k}": v for k, v in _mlp().state_dict().items()}
    check_state_dict(_mlp(), sd)  # a DDP checkpoint fits the plain model


def test_manager_keeps_last_k_and_passes_over_damaged(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        mgr.save({"step": step}, step=step)
    mgr.save_best({"step": 2})
    (tmp_path / ".step-00000004.pt.99999.tmp").write_bytes(b"half a write")  # a killed writer's leftover
    assert [p.name for p in mgr.checkpoints()] == ["step-00000003.pt", "step-00000002.pt"]
    newest = mgr.checkpoints()[0]
    newest.write_bytes(newest.read_bytes()[:-50])
    found = CheckpointManager(tmp_path, keep_last=2).latest()
    assert found.state["step"] == 2 and found.path.name == "step-00000002.pt"
    assert "step-00000003.pt" in found.skipped[0] and "passing over" in caplog.text
    CheckpointManager(tmp_path, keep_last=2).save({"step": 5}, step=5)
    assert not list(tmp_path.glob(".*.tmp"))  # stale temporary files are cleaned on the next save


def test_rng_state_survives_weights_only_roundtrip(tmp_path):
    import random

    import numpy as np
    state = capture_rng_state()
    expected = (torch.rand(3), np.random.rand(3), random.random())
    save_checkpoint(tmp_path / "r.pt", {"rng": state})
    torch.rand(5), np.random.rand(5), random.random()
    restore_rng_state(load_checkpoint(tmp_path / "r.pt")["rng"])
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(expected[0], got[0]) and (expected[1] == got[1]).all() and expected[2] == got[2]


def test_resumable_sampler_order_and_offset():
    s = ResumableSampler(20, seed=4)
    s.set_epoch(2)
    full = list(s)
    s.start_at(8)
    assert list(s) == full[8:] and list(s) == full  # the offset applies to one pass only
    s.set_epoch(3)
    assert list(s) != full and sorted(s) == list(range(20))


# ---------------------------------------------------------------------- exact resume in fit
@pytest.mark.parametrize("kind", ["resumable", "shuffle", "list"])
def test_mid_epoch_resume_is_bit_identical(tmp_path, kind):
    ref = _mlp()
    r_ref = torchspeed.fit(ref, _loader(kind), checkpoint_dir=str(tmp_path / "ref"), checkpoint_every=1, **_FIT)
    crashed = _crash_at(_mlp(), 17)  # dies inside epoch 2 (12 batches per epoch)
    with pytest.raises(_Crash):
        torchspeed.fit(crashed, _loader(kind), checkpoint_dir=str(tmp_path / "b"), checkpoint_every=1, **_FIT)
    resumed = _mlp(seed=99)  # different initial weights: all must come from the checkpoint
    r = torchspeed.fit(resumed, _loader(kind), checkpoint_dir=str(tmp_path / "b"), checkpoint_every=1,
                       resume="auto", **_FIT)
    assert "step-00000016.pt (epoch 2, batch 4, step 16)" in str(r.decisions["resumed_from"])
    assert _same(ref, resumed)
    assert r.steps == r_ref.steps == 36 and len(r.history) == 3
    assert r.history[-1]["train_loss"] == r_ref.history[-1]["train_loss"]
    assert (tmp_path / "b" / "best.pt").exists()


def test_resume_without_rng_restore_differs(tmp_path, monkeypatch):
    """The check above is sharp: resuming without the RNG states (dropout) does not match."""
    ref = _mlp()
    torchspeed.fit(ref, _loader(), **_FIT)
    with pytest.raises(_Crash):
        torchspeed.fit(_crash_at(_mlp(), 17), _loader(), checkpoint_dir=str(tmp_path), checkpoint_every=1, **_FIT)
    monkeypatch.setattr(resume_mod, "restore_rng_state", lambda state: None)
    resumed = _mlp()
    torchspeed.fit(resumed, _loader(), checkpoint_dir=str(tmp_path), checkpoint_every=1, resume="auto", **_FIT)
    assert not _same(ref, resumed)


def test_resume_from_explicit_path_and_bad_options(tmp_path):
    cfg = dict(_FIT, epochs=2, schedule="onecycle")  # a schedule whose length a resume must keep
    ref = _mlp()
    torchspeed.fit(ref, _loader(), checkpoint_dir=str(tmp_path), checkpoint_every=1, **cfg)
    path = CheckpointManager(tmp_path).checkpoints()[-1]
    assert path.name == "step-00000022.pt"
    resumed = _mlp()
    r = torchspeed.fit(resumed, _loader(), resume=str(path), **cfg)
    assert r.steps == 24 and "epoch 2, batch 10" in str(r.decisions["resumed_from"]) and _same(ref, resumed)
    with pytest.raises(CheckpointMismatchError, match="different shape"):
        torchspeed.fit(_mlp(hidden=4), _loader(), resume=str(path), **cfg)
    with pytest.raises(ValueError, match="checkpoint_dir"):
        torchspeed.fit(_mlp(), _loader(), resume="auto", **cfg)
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        torchspeed.fit(_mlp(), _loader(), resume=str(tmp_path / "missing.pt"), **cfg)
    with pytest.raises(ValueError, match="batches per epoch"):
        torchspeed.fit(_mlp(), _loader(bs=16), resume=str(path), **cfg)
    with pytest.raises(ValueError, match="epochs or max_steps changed"):
        torchspeed.fit(_mlp(), _loader(), resume=str(path), **dict(cfg, epochs=3))


# ---------------------------------------------------------------------- non-finite loss
def test_nonfinite_loss_skips_the_step(tmp_path):
    """A NaN batch changes nothing: same weights as training on the same batches with that step skipped."""
    cfg = dict(_FIT, epochs=1, optimizer="sgd", schedule=None, lr=0.05)
    model = _mlp()
    r = torchspeed.fit(model, _loader("list", nan_batches=(3, 7)), **cfg)
    assert r.skipped_steps == 2 and r.steps == 12
    assert all(torch.isfinite(p).all() for p in model.parameters())

    # Reference: the same loop by hand, leaving out the updates of batches 3 and 7.
    ref = _mlp()
    torchspeed.train.state.rng.seed_everything(0)
    # the same optimizer fit builds: given its LR, torch's own kernel (the plan's kernel rule)
    opt = torchspeed.create_optimizer("sgd", ref, lr=0.05, weight_decay=5e-4, fused="default")
    for i, (x, y) in enumerate(_loader("list", nan_batches=(3, 7))):
        loss = nn.functional.cross_entropy(ref(x), y)
        if i in (3, 7):
            continue
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert _same(ref, model)
    # Switched off, a NaN batch poisons the weights.
    off = _mlp()
    torchspeed.fit(off, _loader("list", nan_batches=(3,)), max_nonfinite=None, **cfg)
    assert not all(torch.isfinite(p).all() for p in off.parameters())


def test_nonfinite_run_stops_with_last_checkpoint_intact(tmp_path):
    batches = _loader("list", nan_batches=range(5, 12))
    model = _mlp()
    with pytest.raises(NonFiniteLossError, match=r"3 optimizer steps in a row .*step-00000007\.pt.* is intact"):
        torchspeed.fit(model, batches, checkpoint_dir=str(tmp_path), checkpoint_every=1, max_nonfinite=3,
                       **dict(_FIT, epochs=1))
    state = load_checkpoint(tmp_path / "step-00000007.pt")  # batches 5 and 6 were skipped before it
    assert all(torch.isfinite(v).all() for v in state["model"].values())
    assert state["run"]["step"] == 7 and state["guard"]["skipped"] == 2
    assert all(torch.isfinite(p).all() for p in model.parameters())


# ---------------------------------------------------------------------- out of memory
class _Hungry(nn.Module):
    def __init__(self, error):
        super().__init__()
        self.lin = nn.Linear(8, 3)
        self.error = error

    def forward(self, x):
        raise self.error


@pytest.mark.parametrize("error", [
    torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: "
                 "you tried to allocate 85899345920 bytes"),
])
def test_out_of_memory_message(tmp_path, error):
    with pytest.raises(TrainingOutOfMemoryError) as e:
        torchspeed.fit(_Hungry(error), _loader(bs=16), grad_accum=2, **dict(_FIT, epochs=1))
    msg = str(e.value)
    for part in ("batch of 16", "GiB", "batch_size=8", "grad_accum=4", "activation checkpointing"):
        assert part in msg, (part, msg)
    assert isinstance(e.value.__cause__, type(error))


def test_other_errors_are_not_reported_as_memory():
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert is_out_of_memory(MemoryError())
    assert "a smaller model" in str(out_of_memory_error(MemoryError(), batch_size=1, device="cpu"))


@pytest.mark.parametrize("schedule", ["wsd", "linear", "cosine"])
def test_a_run_resumed_inside_a_decay_schedule_ends_as_the_uninterrupted_one(tmp_path, schedule):
    """The warm-up-then-decay schedules (a LambdaLR over the run's length) go on from the checkpoint's step: a run
    that dies at step 31 of 36, inside warmup-stable-decay's cooldown, ends with the uninterrupted run's weights."""
    cfg = dict(_FIT, schedule=schedule)
    ref = _mlp()
    torchspeed.fit(ref, _loader(), **cfg)
    with pytest.raises(_Crash):
        torchspeed.fit(_crash_at(_mlp(), 32), _loader(), checkpoint_dir=str(tmp_path), checkpoint_every=1, **cfg)
    resumed = _mlp(seed=99)
    r = torchspeed.fit(resumed, _loader(), checkpoint_dir=str(tmp_path), checkpoint_every=1, resume="auto", **cfg)
    assert "step 31" in str(r.decisions["resumed_from"]) and _same(ref, resumed)
