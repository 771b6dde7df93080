"""Workers for the FSDP2, DCP and launcher tests (spawned by ddp_helpers.run_ranks, so importable).

The model has repeated blocks (what `find_blocks` looks for) and no randomness; every
worker saves what it saw to `out/rank{r}.pt` for the test to compare with one process.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddp_helpers import plain_config


class Block(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


def make_block_model(seed: int = 0, blocks: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), *[Block() for _ in range(blocks)], nn.Linear(8, 3))


def make_data(n: int = 16, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def sharded_trainer(model: nn.Module, *, optimizer: str = "sgd", **config):
    from torchspeed.train.loop.trainer import Trainer

    return Trainer(model, optimizer=optimizer, lr=0.1, momentum=0.0, weight_decay=0.0, device="cpu",
                   config=plain_config(parallel="fsdp2", **config))


STEPS = 4


def worker_fsdp_steps(rank: int, out: str) -> None:
    """STEPS SGD steps of FSDP2 on this rank's half of each batch; then a DCP save and load into a fresh model."""
    import torch.distributed as dist

    from torchspeed.train.state.dcp import ShardedCheckpoints
    from torchspeed.train.parallel.fsdp import full_state_dict, is_sharded

    x, y = make_data(16 * STEPS)
    trainer = sharded_trainer(make_block_model(seed=rank), optimizer="adamw", checkpoint_dir=f"{out}/ckpt")
    for p in trainer.optimizer.param_groups:
        p["lr"] = 0.01
    for s in range(STEPS):
        lo = 16 * s + 8 * rank
        trainer.train_step((x[lo:lo + 8], y[lo:lo + 8]))
    weights = full_state_dict(trainer.module)
    path = trainer.save_checkpoint()
    # A fresh model from other weights; the checkpoint must bring back weights and optimizer state exactly.
    other = sharded_trainer(make_block_model(seed=7), optimizer="adamw")
    other.train_step((x[:8], y[:8]))  # creates optimizer state, to be overwritten
    ShardedCheckpoints.load(path, other.module, other.optimizer)
    local = {k: v.to_local().clone() for k, v in trainer.module.state_dict().items()}
    local_loaded = {k: v.to_local().clone() for k, v in other.module.state_dict().items()}
    opt = [(k, v.to_local().clone()) for st in trainer.optimizer.state.values() for k, v in st.items()
           if hasattr(v, "to_local")]
    opt_loaded = [(k, v.to_local().clone()) for st in other.optimizer.state.values() for k, v in st.items()
                  if hasattr(v, "to_local")]
    torch.save({"weights": weights, "local": local, "local_loaded": local_loaded, "opt": opt,
                "opt_loaded": opt_loaded, "decisions": {k: str(v) for k, v in trainer.decisions.items()},
                "sharded": is_sharded(trainer.module), "world": dist.get_world_size(), "path": str(path),
                "shard_numel": sum(v.numel() for v in local.values())}, f"{out}/rank{rank}.pt")


def worker_existing_group(rank: int, out: str) -> None:
    """A process group made before fit, as Ray Train makes it, and no torchrun variables left: fit uses the
    group, calls on_checkpoint on every rank, and the group is still alive afterwards."""
    import torch.distributed as dist

    import torchspeed

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), 2, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_USE_AGENT_STORE"):
        os.environ.pop(k, None)
    x, y = make_data(32)
    calls = []

    def on_checkpoint(path, step):
        calls.append((path, step, os.path.exists(path)))

    result = torchspeed.fit(make_block_model(seed=0), DataLoader(TensorDataset(x, y), batch_size=4), epochs=1,
                            device="cpu", on_checkpoint=on_checkpoint, checkpoint_dir=f"{out}/ckpt",
                            checkpoint_every=2, **_fast())
    alive = dist.is_initialized()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)  # the group still works
    torch.save({"alive": alive, "sum": float(t), "calls": calls, "steps": result.steps,
                "decisions": {k: str(v) for k, v in result.decisions.items()}}, f"{out}/rank{rank}.pt")


def _fast() -> dict:
    return dict(precision="fp32", compile=False, schedule=None, prefetch=False, progress=False,
                channels_last=False, log_every=1, optimizer="sgd", lr=0.05, weight_decay=0.0)


def resumable_loader(n: int = 32, batch: int = 4) -> DataLoader:
    from torchspeed.train.sampler import ResumableSampler

    x, y = make_data(n)
    x[:, 0] = torch.arange(n, dtype=torch.float32)  # the sample's id, read back by `record`
    ds = TensorDataset(x, y)
    return DataLoader(ds, batch_size=batch, sampler=ResumableSampler(ds, seed=5))


def worker_fit_record(rank: int, out: str, tag: str, options: dict) -> None:
    """fit with FSDP2 on the resumable loader; record the ids of the samples trained on, in order."""
    import torchspeed

    model = make_block_model(seed=0)
    seen: list[int] = []
    model.register_forward_pre_hook(lambda m, inp: seen.extend(inp[0][:, 0].round().long().tolist())
                                    if m.training else None)
    result = torchspeed.fit(model, resumable_loader(), device="cpu", parallel="fsdp2",
                            checkpoint_dir=f"{out}/ckpt", **{**_fast(), **options})
    torch.save({"seen": seen, "steps": result.steps, "resumed": str(result.decisions.get("resumed_from"))},
               f"{out}/{tag}-rank{rank}.pt")


def worker_options(rank: int, out: str) -> None:
    """One process: activation checkpointing by class and CPU offload train and match the plain FSDP2 step;
    the errors for a misnamed block class and an optimizer built before sharding."""
    from torchspeed.train.parallel.fsdp import full_state_dict

    x, y = make_data(16)
    results, errors = {}, {}
    for name, options in {"plain": {}, "checkpointed": dict(activation_checkpointing=("Block",)),
                          "offload": dict(cpu_offload=True)}.items():
        trainer = sharded_trainer(make_block_model(seed=0), **options)
        recomputed = []
        trainer.module[1].fc1.register_forward_hook(lambda m, i, o: recomputed.append(torch.is_grad_enabled()))
        trainer.train_step((x, y))
        results[name] = {"weights": full_state_dict(trainer.module), "forwards": len(recomputed),
                         "decision": trainer.decisions["distributed"].value}
    for name, make in {"bad_class": lambda: sharded_trainer(make_block_model(), activation_checkpointing=("Blok",)),
                       "optimizer": lambda: _optimizer_instance()}.items():
        try:
            make()
        except ValueError as e:
            errors[name] = str(e)
    torch.save({"results": results, "errors": errors}, f"{out}/options.pt")


def _optimizer_instance():
    from torchspeed.train.loop.trainer import Trainer

    model = make_block_model()
    return Trainer(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), device="cpu",
                   config=plain_config(parallel="fsdp2"))
