"""One bench configuration in its own process (see runner.py).

A process per configuration lets each row have the process set-up it is about: the
allocator and OpenMP settings are chosen when a process starts (tcmalloc through
LD_PRELOAD, OMP_WAIT_POLICY), and compilation caches, thread pools and allocator state do
not leak from one row into another.

Two kinds of row: `trainer` rows run torchspeed's `Trainer` with a `TrainConfig`; the `hand`
row runs `bench.hand.HandLoop`, plain PyTorch with the fastest settings found by trying.

Protocol: one JSON command per line on stdin; each answer is one line on stdout
(bench/_protocol.py: anything else a library prints is ignored by the parent).

The process's one job is to train, so every kind's stack is imported at the top: `import torchspeed` has
loaded the train stack already, and the hand and Lightning rows' modules add little (Lightning itself is
imported only in its own row, bench/peers.py).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
import traceback

import torch
from torch.utils.data import DataLoader

from torchspeed._allocator import allocator_in_use
from torchspeed.bench._protocol import reply
from torchspeed.bench.hand import HandLoop, HandSettings, search_hand_settings
from torchspeed.bench.peers import LightningLoop
from torchspeed.bench.workloads import create_model, make_datasets
from torchspeed.train.config import TrainConfig
from torchspeed.train.loop.metrics import jsonable
from torchspeed.train.loop.trainer import Trainer


def _data(spec: dict):
    seed = spec["seed"]
    train_set, val_set = make_datasets(spec["data"], train_size=spec["train_size"], val_size=spec.get("val_size", 1024),
                                       seed=spec.get("data_seed", seed), image_size=spec.get("image_size", 32))
    device = torch.device(spec["device"])
    workers = spec["num_workers"]
    loader = DataLoader(train_set, batch_size=spec["batch_size"], shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(seed), num_workers=workers,
                        pin_memory=workers > 0 and device.type == "cuda", persistent_workers=workers > 0)
    return loader, DataLoader(val_set, batch_size=256), device


def _model(spec: dict):
    torch.manual_seed(spec["seed"])  # every config starts from the same weights
    return create_model(spec["model"], image_size=spec.get("image_size", 32))


class _State:
    """What every row does: set up, warm up (untimed), timed rounds, finish (loss and accuracy)."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.loader, self.val_loader, self.device = _data(spec)
        self.allocator = allocator_in_use()
        self._seed = spec["seed"]

    def _release(self) -> None:
        # Every row is a process on the same GPU: give the cached blocks back after a round, so the
        # rows that are not running hold no activation memory (the next round's first step is untimed).
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def round(self, n: int) -> float:
        if self.device.type == "cuda":
            self.steps(1)  # untimed: re-reserves the memory released after the last round
        self.reset_meter()  # the loss column: the mean over this round's timed steps
        seconds = self.steps(n)
        self._release()
        return seconds

    def _restart_data(self) -> None:
        self.loader.generator.manual_seed(self._seed)
        torch.manual_seed(self._seed)


class _TrainerState(_State):
    def __init__(self, spec: dict):
        super().__init__(spec)
        cfg = TrainConfig(**spec["train"])
        self.trainer = Trainer(_model(spec), optimizer="sgd", lr=spec["lr"], device=self.device, config=cfg)
        self._it = None
        # Kept to restart from after the warm-up: every config then trains the same number of steps from
        # the same weights on the same batches, however many steps its warm-up (compile trial) took.
        self._initial = (copy.deepcopy(self.trainer.module.state_dict()),
                         copy.deepcopy(self.trainer.optimizer.state_dict()))

    def _batches(self):
        while True:
            yield from self.trainer.batches(self.loader)

    def steps(self, n: int) -> float:
        if self._it is None:
            self._it = self._batches()
        return self.trainer.run_steps(self._it, n)

    def warm_up(self, n: int) -> dict:
        # What fit() does: measure the switches left on "auto" on this model's first training steps (the bench
        # stands for a long run: the full trial). Here, not at set-up: the configs set up all at once but warm up
        # one at a time, so the trial has the cores to itself.
        self.trainer.switcher.prepare(self.loader)
        total, taken = self.steps(n), n
        while self.trainer.switcher.live is not None or self.trainer.compiler.undecided:  # finish both trials
            total += self.steps(1)
            taken += 1
        self._restart()
        self._release()
        return {"seconds": total, "steps": taken}

    def _restart(self) -> None:
        model_state, opt_state = self._initial
        self.trainer.module.load_state_dict(model_state)  # in place: a compiled module keeps its kernels
        self.trainer.optimizer.load_state_dict(opt_state)
        self._restart_data()
        self._it = None
        self.trainer.meter.reset()

    def reset_meter(self) -> None:
        self.trainer.meter.reset()

    def finish(self, eval_batches: int | None) -> dict:
        loss = self.trainer.meter.compute()["loss"]  # mean train loss of the last timed round
        loader = self.val_loader
        if eval_batches is not None:
            loader = [b for _, b in zip(range(eval_batches), loader)]
        val = self.trainer.evaluate(loader)["val_acc"]
        decisions = jsonable(self.trainer.decisions)  # each a {"value", "reason", "measured"} (the trial's cost too)
        decisions["allocator"] = self.allocator
        decisions["num_workers"] = self.loader.num_workers
        decisions["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY", "default (spin, then sleep)")
        return {"train_loss": loss, "val_acc": val, "decisions": decisions}


class _HandState(_State):
    """The hand-written ceiling: plain PyTorch with the settings that measured fastest here."""

    def __init__(self, spec: dict):
        super().__init__(spec)
        self._initial_model = _model(spec)  # kept on the CPU: each search candidate starts from a copy
        self.search: dict = {}
        self.loop = None

    def _fresh(self):
        return copy.deepcopy(self._initial_model)

    def warm_up(self, n: int) -> dict:
        t0 = time.perf_counter()
        opts = self.spec.get("hand", {})
        if opts.get("settings"):  # given (e.g. by a test), not searched
            settings = HandSettings(**opts["settings"])
            self.search = {"chosen": settings.label(), "settings": opts["settings"], "tried": {}}
        else:
            settings, self.search = search_hand_settings(self._fresh, self.loader, self.device,
                                                         try_compile=opts.get("compile", True))
        self.search["search_s"] = time.perf_counter() - t0
        self.loop = HandLoop(self._fresh(), self.loader, self.device, settings=settings, lr=self.spec["lr"])
        self._opt_state = copy.deepcopy(self.loop.opt.state_dict())
        seconds = self.loop.run(n if not settings.compile else max(n, 2))
        self._restart()
        self._release()
        return {"seconds": seconds, "steps": n}

    def _restart(self) -> None:
        self.loop.model.load_state_dict(self._initial_model.state_dict())  # in place: compiled kernels stay
        self.loop.opt.load_state_dict(self._opt_state)
        self._restart_data()
        self.loop.restart()

    def steps(self, n: int) -> float:
        return self.loop.run(n)

    def reset_meter(self) -> None:
        self.loop.loss_sum.zero_()
        self.loop.samples = 0

    def finish(self, eval_batches: int | None) -> dict:
        loss = self.loop.train_loss()
        loader = self.val_loader
        if eval_batches is not None:
            loader = [b for _, b in zip(range(eval_batches), loader)]
        s = self.loop.settings
        decisions = {"hand_settings": s.label(), "precision": s.precision, "channels_last": str(s.channels_last),
                     "optimizer": "SGD (fused)" if s.fused else "SGD (for-loop)",
                     "compile": "on" if s.compile else "off", "search": json.dumps(self.search, default=str),
                     "allocator": self.allocator, "num_workers": self.loader.num_workers}
        return {"train_loss": loss, "val_acc": self.loop.evaluate(loader), "decisions": decisions}


class _LightningState(_HandState):
    """Lightning Fabric with the precision a user picks for speed here (bench/peers.py)."""

    def warm_up(self, n: int) -> dict:
        self.loop = LightningLoop(self._fresh(), self.loader, self.device, lr=self.spec["lr"])
        self.search = {"precision": self.loop.precision}
        self._opt_state = copy.deepcopy(self.loop.opt.state_dict())
        seconds = self.loop.run(n)
        self._restart()
        self._release()
        return {"seconds": seconds, "steps": n}

    def finish(self, eval_batches: int | None) -> dict:
        loader = self.val_loader
        if eval_batches is not None:
            loader = [b for _, b in zip(range(eval_batches), loader)]
        decisions = {"precision": self.loop.precision, "lightning": "Fabric, SGD (torch default kernel)",
                     "allocator": self.allocator, "num_workers": self.loader.num_workers}
        return {"train_loss": self.loop.train_loss(), "val_acc": self.loop.evaluate(loader), "decisions": decisions}


def main() -> int:
    state: _State | None = None
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            op = cmd["op"]
            if op == "setup":
                spec = cmd["spec"]
                kind = spec.get("kind")
                state = (_HandState(spec) if kind == "hand" else _LightningState(spec) if kind == "lightning"
                         else _TrainerState(spec))
                reply({"ok": True, "allocator": state.allocator})
            elif op == "warmup":
                reply({"ok": True, **state.warm_up(cmd["n"])})
            elif op == "steps":
                reply({"ok": True, "seconds": state.round(cmd["n"])})
            elif op == "finish":
                reply({"ok": True, **state.finish(cmd.get("eval_batches"))})
            elif op == "exit":
                reply({"ok": True})
                return 0
        except Exception as e:  # reported to the parent, which names the config that failed
            reply({"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
