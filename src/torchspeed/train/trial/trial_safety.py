"""A switch-trial candidate never ends a run: the user's state kept as the plain step would leave it, and a step
that fails after a candidate's turn trained again in settings that work (T18, T21; the trial: autoswitch.py).

The trial runs each candidate (bf16, channels_last, a fused kernel, another thread count) on the run's own
steps, with the user's model, `step_fn` and the state they keep between steps. Three guards:

- **State put back.** A turn timed apart (shadow.py) and the numerics guard's losses only measure: what they
  wrote into the user's state (`user_state.UserState`: a `step_fn`'s carried hidden state, a forward's attributes)
  is put back before the plain step, so a trial that keeps the plain settings is the plain run to the last bit.
- **State cast back.** A turn that trains in a half precision keeps its numbers; when the run goes back to a
  wider precision, the bf16/fp16 tensors the turn left in the user's state are cast back (`Snapshot.cast_back`).
- **Recovery.** A step that raises in a candidate's turn, or within `AFTER_STEPS` steps after a turn in other
  settings than the plain, is not the end of the run: the state is put back as it was when the step began, the
  candidate is dropped (its error in the trial's report, `failed`), and the batch trains again in the plain
  settings; where those fail too right after a candidate's turn (state the walk cannot see), in the candidate's
  settings, which ran. The run goes on in the settings that worked, said in decisions["switch_trial"]. A failure
  that the plain settings raise with nothing of a candidate's before them is the user's error: raised as it was
  (the batch contract's note with it).

Example:
    >>> res = fit(model, batches, step_fn=step_fn)      # an LSTM carrying its hidden state, on a bf16 CPU
    >>> res.decisions["switch_trial"].measured["failed"]  # a candidate that could not run, and why
"""

from __future__ import annotations

import contextlib
import logging

import torch

from torchspeed.train.decision import Decision
from torchspeed.train.transfer import trial_layout
from torchspeed.train.trial.user_state import Snapshot, UserState

__all__ = ["TrialSafety", "AFTER_STEPS", "forked_rng"]

log = logging.getLogger("torchspeed")

AFTER_STEPS = 2  # a step that fails this soon after a turn in other settings may be that turn's doing
_HALF = ("bf16", "fp16")


def forked_rng(device: torch.device):
    """torch's generator for `device` (and the CPU's) forked: what a measuring pass draws is undone after it."""
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type)


@contextlib.contextmanager
def kept_buffers(module: torch.nn.Module):
    """The module's buffers put back as they were after a pass that only measures or reads: BatchNorm's running
    statistics in train mode, and what a forward writes in eval mode too (torch.ao's FakeQuantize observers update
    their min/max and resize their scale in any mode; spectral norm's power-iteration vectors)."""
    saved = [(b, b.clone()) for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, old in saved:
                if b.shape != old.shape:
                    b.resize_(old.shape)
                b.copy_(old)


class TrialSafety:
    """The guards of one `SwitchStage` (`stage.safety`): snapshots of the user's state, casting back, recovery."""

    def __init__(self, stage):
        self.stage = stage
        self._user: UserState | None = None
        self.half_left: Snapshot | None = None  # before the first turn that trained in a half precision
        self.other = None  # the last candidate in other settings than the plain that ran a turn
        self.other_at = -AFTER_STEPS - 1  # the run's step count when it did
        self.unrestored: list[str] = []
        self.plain_error: BaseException | None = None  # what the plain settings raised in the last recovery

    def user(self) -> UserState:
        if self._user is None:
            t = self.stage.t
            self._user = UserState(t.module, t.step_fn, known=(t.optimizer, t.model, t.compiler))
        return self._user

    def snapshot(self) -> Snapshot:
        return self.user().snapshot()

    def restore(self, snap: Snapshot) -> None:
        snap.restore()
        if snap.unrestored and not self.unrestored:
            self.unrestored = list(snap.unrestored)
            log.info("torchspeed: the switch trial could not put back %s", "; ".join(snap.unrestored))

    def before_turn(self, cand, plain, *, apart: bool) -> None:
        """A candidate's turn starts: a turn that trains in a half precision (the plain settings' wider) is the
        one whose state a later step in the plain precision casts back."""
        if not apart and cand.precision != plain.precision and cand.precision in _HALF and self.half_left is None:
            self.half_left = self.snapshot()

    def after_turn(self, cand, plain) -> None:
        """A turn ran: one in other settings than the plain is the one a failing step soon after may blame."""
        if cand != plain:
            self.other, self.other_at = cand, self.stage.t.step

    def precision_changed(self, new: str) -> None:
        """`apply` put `new` into effect: back from a half precision, cast back what a trained turn left."""
        if self.half_left is not None and new not in _HALF:
            n = self.half_left.cast_back()
            self.half_left = None
            if n:
                log.info("torchspeed: %d tensor(s) a half-precision trial turn left in the step's state cast back", n)

    def recent(self) -> bool:
        """Whether a turn in other settings than the plain ran within AFTER_STEPS steps."""
        return self.other is not None and self.stage.t.step - self.other_at <= AFTER_STEPS

    def recover(self, error: BaseException, batch, run_step, *, before: Snapshot | None, failed) -> bool:
        """A step failed with `error`, `failed` the settings it ran in (a candidate, or the plain ones right after a
        candidate's turn). Put the state back as the step found it, drop the candidate, train the batch in the
        plain settings, else in the candidate's (whose pass may have run: the plain step after it failed): True
        where one trained it, False where none did (the caller raises `plain_error`, the user's)."""
        stage, t = self.stage, self.stage.t
        plain = stage.plain
        blamed = failed if failed != plain else self.other  # whose turn ran before the failure
        note = f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
        self.plain_error = None
        for settings in [plain] + ([blamed] if blamed is not None else []):
            if before is not None:
                self.restore(before)
            if self.half_left is not None and settings.precision not in _HALF:
                self.half_left.cast_back()
            t.reset_micro()
            stage.apply(settings)
            try:
                run_step(trial_layout(t, batch, settings.channels_last))
            except Exception as e:  # noqa: BLE001 - the next settings, or the user's error raised by the caller
                self.plain_error = self.plain_error or e  # the plain settings' error: what the plain loop raises
                continue
            self._record(blamed, settings, note, error)
            return True
        return False

    def _record(self, blamed, settings, note: str, error: BaseException) -> None:
        """The run goes on in `settings`: the trial's report says which candidate failed and what runs now."""
        stage, plain = self.stage, self.stage.plain
        label = blamed.label() if blamed is not None else plain.label()
        if blamed is not None and blamed.channels_last and "view size is not compatible" in str(error):
            note += ("; a .view() of a convolution's output, as old scripts flatten (x.view(-1, 16 * 5 * 5)): "
                     "torch.flatten(x, 1) or .reshape() there lets channels_last run (T23)")
        if stage.live is not None and blamed is not None and blamed != plain:
            stage.live.fail(error, blamed)
        if settings != plain:  # the plain settings fail after the candidate's turn: the run keeps the candidate's
            stage.end_with(settings, f"the plain settings failed after {label}'s turn ({note}): the run trains "
                                     f"in {settings.label()}, which ran")
        else:
            log.warning("torchspeed: the switch trial's candidate %s failed (%s); the batch trained in the plain "
                        "settings and the run goes on", label, note)
        stage.t.decisions.refine("switch_recovered", Decision(settings.label(), f"{label} failed ({note}); the batch "
                                                              f"trained again in {settings.label()}"))
        self.other = None
