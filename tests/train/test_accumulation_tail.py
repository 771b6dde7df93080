"""Gradient accumulation at the epoch end (T19): an epoch whose batches do not divide by grad_accum ends with a
partial window, which steps on the gradients it holds, averaged over its own micro-batches (Accelerate's and
Lightning's rule). So an epoch takes ceil(batches / k) optimizer steps, as the LR schedule counts them
(`schedule.steps_in_run`); each epoch end writes its checkpoint and best.pt; no gradient is left in p.grad after
fit. A run whose batches divide by k is a plain accumulation loop, bit for bit. A loader without len() (max_steps)
and a BatchRamp run (its schedule counts the run as one pass) carry the window over. None of these tests times
anything.
"""

import copy
import contextlib

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, SequentialSampler, TensorDataset

import torchspeed
from torchspeed.train.batch_ramp import BatchRamp
from torchspeed.train.loop.callbacks import Callback
from torchspeed.train.state.checkpoint import load_checkpoint
from torchspeed.train.schedule import create_scheduler
from torchspeed.train.loop.step import AccumulationWindow

_FIT = dict(device="cpu", progress=False, trial=False, compile=False, precision="fp32", deterministic=True, seed=0)


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def _batches(n_batches=10, bs=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n_batches * bs, 8, generator=g), torch.randint(0, 3, (n_batches * bs,), generator=g)
    return [(x[i:i + bs], y[i:i + bs]) for i in range(0, n_batches * bs, bs)]


def _plain_loop(model, batches, *, epochs, k, lr):
    """The reference: SGD over windows of k micro-batches that the epoch end cuts short, each loss / the
    window's own size (as Accelerate and Lightning step an epoch's last, partial window)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    steps = 0
    for _ in range(epochs):
        for start in range(0, len(batches), k):
            window = batches[start:start + k]
            for x, y in window:
                loss = nn.functional.cross_entropy(model(x), y)
                (loss / len(window) if len(window) > 1 else loss).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            steps += 1
    return steps


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


def _fit_sgd(model, batches, *, epochs, k, lr=0.05, **kw):
    opt = torch.optim.SGD(model.parameters(), lr=lr)  # an optimizer object: its LR, no schedule
    return torchspeed.fit(model, batches, optimizer=opt, epochs=epochs, grad_accum=k, **_FIT, **kw)


# ---------------------------------------------------------------------- the window
def test_the_window_closes_where_the_epoch_ends_and_all_reduces_its_last_micro_batch():
    class FakeDDP:
        def __init__(self):
            self.no_sync_calls = 0

        def no_sync(self):
            self.no_sync_calls += 1
            return contextlib.nullcontext()

    win, ddp = AccumulationWindow(4), FakeDDP()
    closed, sizes = [], []
    for left in range(6, 0, -1):  # an epoch of 6 micro-batches: windows of 4 and 2
        win.left = left
        sizes.append(win.size)
        with win.sync(ddp):
            pass
        closed.append(win.advance())
    assert closed == [False, False, False, True, False, True] and sizes == [4, 4, 4, 4, 2, 2]
    assert ddp.no_sync_calls == 4 and win.at_boundary  # 3 of the first window, 1 of the second: each last syncs
    assert win.left is None and win.size == 4  # no epoch end known after it: windows of k again


def test_the_epoch_ends_partial_window_all_reduces_its_last_micro_batch_in_fit():
    """Under DDP a window's last micro-batch runs outside `no_sync()`: the epoch's partial one too (else its
    gradients would step unreduced). A model with a `no_sync` of its own stands in for DDP's."""
    model, state, synced = _mlp(), {"no_sync": False}, []

    @contextlib.contextmanager
    def no_sync():
        state["no_sync"] = True
        try:
            yield
        finally:
            state["no_sync"] = False

    forward = model.forward

    def fwd(x):
        synced.append(not state["no_sync"])
        return forward(x)

    model.no_sync, model.forward = no_sync, fwd
    _fit_sgd(model, _batches(10), epochs=2, k=4)
    # each epoch: 4, 4 and 2 micro-batches; the last of each window all-reduces
    assert synced == [False, False, False, True, False, False, False, True, False, True] * 2


# ---------------------------------------------------------------------- steps, schedule, gradients
@pytest.mark.parametrize("epochs", [1, 3])
def test_a_partial_window_steps_at_each_epoch_end_as_a_plain_loop_does(epochs):
    batches = _batches(10)  # 10 batches, k=4: windows of 4, 4 and 2 each epoch
    ref, model = _mlp(), _mlp()
    ref_steps = _plain_loop(ref, batches, epochs=epochs, k=4, lr=0.05)
    r = _fit_sgd(model, batches, epochs=epochs, k=4)
    assert r.steps == ref_steps == 3 * epochs and [h["step"] for h in r.history] == [3 * e for e in
                                                                                      range(1, epochs + 1)]
    assert _same(model, ref)  # the same ops in the same order: bit for bit
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())  # nothing left over


def test_a_run_whose_batches_divide_by_k_is_a_plain_accumulation_loop_bit_for_bit():
    batches = _batches(12)
    ref, model = _mlp(), _mlp()
    assert _plain_loop(ref, batches, epochs=2, k=4, lr=0.05) == 6
    r = _fit_sgd(model, batches, epochs=2, k=4)
    assert r.steps == 6 and _same(model, ref)


def test_the_one_cycle_schedule_runs_to_its_end_with_a_partial_window():
    class LRs(Callback):
        def __init__(self):
            self.lrs = []

        def on_step_end(self, trainer):  # after the step and its scheduler step: the next step's LR
            self.lrs.append(trainer.optimizer.param_groups[0]["lr"])

    seen = LRs()
    r = torchspeed.fit(_mlp(), _batches(10), epochs=3, grad_accum=4, optimizer="sgd", lr=0.1, schedule="onecycle",
                       callbacks=[seen], **_FIT)
    assert r.steps == 9  # 3 epochs x ceil(10 / 4): the steps the schedule was sized for
    opt = torch.optim.SGD(_mlp().parameters(), lr=0.1, momentum=0.9)
    sched = create_scheduler("onecycle", opt, total_steps=9)
    ref = []
    for _ in range(9):
        opt.step()
        sched.step()
        ref.append(opt.param_groups[0]["lr"])
    assert seen.lrs == pytest.approx(ref)  # the schedule stepped to its end, not cut short
    assert seen.lrs[-2] == pytest.approx(0.1 / 25 / 1e4)  # the last step trained at one-cycle's floor


def test_max_steps_counts_the_epoch_end_step():
    r = _fit_sgd(_mlp(), _batches(10), epochs=5, k=4, max_steps=4)
    assert r.steps == 4 and len(r.history) == 2 and r.history[0]["step"] == 3


def test_a_batch_ramp_run_steps_its_last_window_at_the_runs_end():
    """A BatchRamp's schedule counts its run as one pass (ceil(all batches / k) steps): the window carries over
    its epochs' ends, as that count has it, and the run's end steps the last one."""
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(100, 8, generator=g), torch.randint(0, 3, (100,), generator=g))
    ramp = BatchRamp(SequentialSampler(ds), start=8, end=16, ramp_samples=150, multiple=8)
    assert [len(ramp.sizes(e)) for e in range(3)] == [13, 10, 7]  # 30 batches: 8 steps of 4, the last of 2
    model = _mlp()
    r = torchspeed.fit(model, DataLoader(ds, batch_sampler=ramp), epochs=3, grad_accum=4, optimizer="sgd", lr=0.1,
                       schedule="onecycle", **_FIT)  # OneCycleLR raises if stepped past its 8 steps
    assert r.steps == 8 and [h["step"] for h in r.history] == [3, 5, 8]
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


class _Stream(IterableDataset):
    """10 batches a pass, no len(): no epoch end is known."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


def test_a_stream_without_len_carries_the_window_over_its_passes():
    seen, model = [0], _mlp()
    forward = model.forward

    def fwd(x):
        seen[0] += 1
        return forward(x)

    model.forward = fwd
    r = torchspeed.fit(model, DataLoader(_Stream(_batches(10)), batch_size=None), grad_accum=4,
                       max_steps=5, optimizer="sgd", lr=0.05, **_FIT)
    assert r.steps == 5 and seen[0] == 20  # 5 windows of 4 over two passes, none cut at a pass's end


# ---------------------------------------------------------------------- checkpoints and resume
@pytest.mark.parametrize("epochs", [1, 3])
def test_each_epoch_end_writes_its_checkpoint_and_best_with_the_final_weights(tmp_path, epochs):
    model = _mlp()
    r = _fit_sgd(model, _batches(10), epochs=epochs, k=4, checkpoint_dir=str(tmp_path))
    names = sorted(p.name for p in tmp_path.glob("step-*.pt"))
    assert names == [f"step-{3 * e:08d}.pt" for e in range(1, epochs + 1)] and (tmp_path / "best.pt").exists()
    last = load_checkpoint(tmp_path / names[-1])
    assert all(torch.equal(v, last["model"][k]) for k, v in model.state_dict().items())  # the final weights saved
    assert last["run"]["step"] == r.steps == last["run"]["total_steps"]


class _Crash(Exception):
    pass


def _crash_at(model, call):
    """`model` raises on its `call`-th forward: a process dying inside an accumulation window."""
    n, forward = [0], model.forward

    def fwd(x):
        n[0] += 1
        if n[0] == call:
            raise _Crash
        return forward(x)
    model.forward = fwd
    return model


@pytest.mark.parametrize("crash_at", [7, 10, 16])  # inside a full window, inside the partial one, epoch 2
def test_a_crash_inside_a_window_resumes_bit_for_bit(tmp_path, crash_at):
    batches = _batches(10)
    ref = _mlp()
    r_ref = _fit_sgd(ref, batches, epochs=3, k=4, checkpoint_dir=str(tmp_path / "ref"), checkpoint_every=1)
    with pytest.raises(_Crash):
        _fit_sgd(_crash_at(_mlp(), crash_at), batches, epochs=3, k=4, checkpoint_dir=str(tmp_path / "b"),
                 checkpoint_every=1)
    resumed = _mlp(seed=99)  # other initial weights: every one must come from the checkpoint
    r = _fit_sgd(resumed, batches, epochs=3, k=4, checkpoint_dir=str(tmp_path / "b"), checkpoint_every=1,
                 resume="auto")
    assert r.steps == r_ref.steps == 9 and len(r.history) == 3
    assert _same(ref, resumed)
    assert [h["step"] for h in r.history] == [h["step"] for h in r_ref.history] == [3, 6, 9]


def test_an_extended_run_takes_the_steps_of_its_new_segment(tmp_path):
    """A finished run resumed with more epochs: its added schedule segment is sized ceil(batches / k) x epochs
    too, and OneCycleLR is never stepped past its end (it raises when it is)."""
    batches = _batches(10)
    kw = dict(grad_accum=4, optimizer="sgd", lr=0.1, schedule="onecycle", checkpoint_dir=str(tmp_path), **_FIT)
    torchspeed.fit(_mlp(), batches, epochs=2, **kw)
    r = torchspeed.fit(_mlp(), copy.deepcopy(batches), epochs=4, resume="auto", **kw)
    assert r.steps == 12 and [h["step"] for h in r.history] == [3, 6, 9, 12]
