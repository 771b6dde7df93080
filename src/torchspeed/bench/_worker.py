"""One bench configuration in its own process (see runner.py).

A process per configuration lets each row have the process set-up it is about: the
allocator is chosen when a process starts (tcmalloc through LD_PRELOAD), and compilation
caches, thread pools and allocator state do not leak from one row into another.

Protocol: one JSON command per line on stdin; each answer is one line on stdout starting
with `@@torchspeed ` (anything else a library prints is ignored by the parent).
"""

from __future__ import annotations

import copy
import json
import sys
import traceback

PREFIX = "@@torchspeed "


def _reply(obj) -> None:
    sys.stdout.write(PREFIX + json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()


class _State:
    def __init__(self, spec: dict):
        import torch
        from torch.utils.data import DataLoader

        from torchspeed.bench.workloads import create_model, make_datasets
        from torchspeed.env import allocator_in_use
        from torchspeed.train.trainer import Trainer, TrainConfig

        seed = spec["seed"]
        train_set, val_set = make_datasets(spec["data"], train_size=spec["train_size"], seed=seed)
        torch.manual_seed(seed)  # every config starts from the same weights
        model = create_model(spec["model"])
        cfg = TrainConfig(**spec["train"])
        device = torch.device(spec["device"])
        self.trainer = Trainer(model, optimizer="sgd", lr=spec["lr"], device=device, config=cfg)
        workers = spec["num_workers"]
        self.loader = DataLoader(train_set, batch_size=spec["batch_size"], shuffle=True, drop_last=True,
                                 generator=torch.Generator().manual_seed(seed), num_workers=workers,
                                 pin_memory=workers > 0 and device.type == "cuda", persistent_workers=workers > 0)
        self.val_loader = DataLoader(val_set, batch_size=256)
        self.allocator = allocator_in_use()
        self._it = None
        self._seed = seed
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
        total, taken = self.steps(n), n
        while self.trainer._compile_trial is not None:  # finish the compile="auto" trial
            total += self.steps(1)
            taken += 1
        self._restart()
        return {"seconds": total, "steps": taken}

    def _restart(self) -> None:
        import torch

        model_state, opt_state = self._initial
        self.trainer.module.load_state_dict(model_state)  # in place: a compiled module keeps its kernels
        self.trainer.optimizer.load_state_dict(opt_state)
        self.loader.generator.manual_seed(self._seed)
        self._it = None
        self.trainer.meter.reset()
        torch.manual_seed(self._seed)

    def finish(self, eval_batches: int | None) -> dict:
        loss = self.trainer.meter.compute()["loss"]  # mean train loss of the last timed round
        loader = self.val_loader
        if eval_batches is not None:
            loader = [b for _, b in zip(range(eval_batches), loader)]
        val = self.trainer.evaluate(loader)["val_acc"]
        decisions = {k: str(v) for k, v in self.trainer.decisions.items() if k != "compile_detail"}
        decisions["allocator"] = self.allocator
        decisions["num_workers"] = self.loader.num_workers
        return {"train_loss": loss, "val_acc": val, "decisions": decisions}


def main() -> int:
    state: _State | None = None
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            op = cmd["op"]
            if op == "setup":
                state = _State(cmd["spec"])
                _reply({"ok": True, "allocator": state.allocator})
            elif op == "warmup":
                _reply({"ok": True, **state.warm_up(cmd["n"])})
            elif op == "steps":
                state.trainer.meter.reset()
                _reply({"ok": True, "seconds": state.steps(cmd["n"])})
            elif op == "finish":
                _reply({"ok": True, **state.finish(cmd.get("eval_batches"))})
            elif op == "exit":
                _reply({"ok": True})
                return 0
        except Exception as e:  # reported to the parent, which names the config that failed
            _reply({"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
