"""Run a function in N CPU processes joined by a gloo process group, the way torchrun would.

Each child gets the torchrun environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) before the function runs, so `fit`/`Trainer` with distributed="auto" sees
exactly what it sees under `torchspeed launch`. The functions live in this module so the
spawned children can import them.

The rendezvous store is served by the parent, as torchrun's agent serves it: bound to a port
the OS picks at that moment, and every rank a client (TORCHELASTIC_USE_AGENT_STORE). A port
picked in advance and bound seconds later by rank 0 could meanwhile be taken by any other
process on the machine (another test run's gloo sockets, for one).
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

WORLD = 2


def serve_store(world: int):
    """A TCPStore served from this process on a free port (bound now: no window for a collision)."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, world_size=world, is_master=True, wait_for_workers=False)


def _entry(rank: int, fn, world: int, port: int, args: tuple) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                      TORCHELASTIC_USE_AGENT_STORE="True")  # every rank a client of the parent's store
    torch.set_num_threads(1)
    from torchspeed.train.parallel.distributed import cleanup_distributed
    from torchspeed.train.parallel.rank_exit import exit_process

    try:
        fn(rank, *args)
    except BaseException:
        cleanup_distributed()
        raise  # spawn's wrapper reports it to the parent
    # A rank that built a DDP model can die of SIGABRT in interpreter teardown (gloo's threads outlive the
    # group): end the way torchspeed's own ranks do, after the group is destroyed and atexit has run.
    exit_process(0)


def run_ranks(fn, *args, world: int = WORLD) -> None:
    """fn(rank, *args) in `world` processes; raises if any of them fails."""
    import torch.multiprocessing as mp

    store = serve_store(world)  # kept alive until every rank has finished
    mp.start_processes(_entry, args=(fn, world, store.port, args), nprocs=world, join=True, start_method="spawn")


# ---------------------------------------------------------------------- shared model and data
def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                         nn.Linear(16, 3))


def make_data(n: int = 16, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 6, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def plain_config(**overrides):
    from torchspeed.train.config import TrainConfig

    base = dict(precision="fp32", compile=False, schedule=None, prefetch=False, progress=False,
                channels_last=False, log_every=1)
    base.update(overrides)
    return TrainConfig(**base)


def sgd_trainer(model: nn.Module, **config):
    from torchspeed.train.loop.trainer import Trainer

    return Trainer(model, optimizer="sgd", lr=0.1, momentum=0.0, weight_decay=0.0, device="cpu",
                   config=plain_config(**config))


# ---------------------------------------------------------------------- workers
def worker_one_step(rank: int, out: str) -> None:
    """One DDP step of the Trainer on this rank's half of the batch; save grads (raw DDP) and weights."""
    from torchspeed.train.parallel.distributed import init_distributed, wrap_ddp

    x, y = make_data(16)
    half = slice(rank * 8, rank * 8 + 8)
    # Raw DDP: gradients after one backward equal the full-batch gradient.
    init_distributed(device="cpu")
    ddp = wrap_ddp(make_model(seed=0), device="cpu")
    nn.functional.cross_entropy(ddp(x[half]), y[half]).backward()
    grads = [p.grad.clone() for p in ddp.parameters()]
    # The Trainer: rank 1 starts from other weights on purpose; DDP must broadcast rank 0's.
    trainer = sgd_trainer(make_model(seed=rank), scale_lr_world_size=True)
    trainer.train_step((x[half], y[half]))
    static = sgd_trainer(make_model(seed=rank), static_graph=True)
    static.train_step((x[half], y[half]))
    torch.save({"static_params": [p.detach().clone() for p in static.module.parameters()],
                "static_decision": static.decisions["distributed"].value, "grads": grads, "params": [p.detach().clone() for p in trainer.module.parameters()],
                "lr": trainer.optimizer.param_groups[0]["lr"], "decisions": trainer.decisions,
                "is_ddp": isinstance(trainer.model, nn.parallel.DistributedDataParallel)}, f"{out}/rank{rank}.pt")


def worker_accumulate(rank: int, out: str) -> None:
    """grad_accum=2: two micro-batches per rank and one all-reduce, counted by a DDP comm hook.

    Runs twice: with the Trainer's no_sync, and with no_sync hidden from it (the reference
    that proves the counter sees a wasted all-reduce).
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    x, y = make_data(16)
    result = {}
    for mode in ("no_sync", "sync_every_micro_step"):
        trainer = sgd_trainer(make_model(seed=0), grad_accum=2)
        calls: list[int] = []

        def counting_hook(state, bucket, calls=calls):
            calls.append(bucket.index())
            return allreduce_hook(None, bucket)

        trainer.model.register_comm_hook(None, counting_hook)
        if mode == "sync_every_micro_step":
            trainer.model.no_sync = contextlib.nullcontext  # shadows DDP.no_sync: every backward all-reduces
        for k in range(2):
            lo = rank * 8 + k * 4
            trainer.train_step((x[lo:lo + 4], y[lo:lo + 4]))
        result[mode] = {"params": [p.detach().clone() for p in trainer.module.parameters()],
                        "allreduce_calls": len(calls), "steps": trainer.step}
    torch.save(result, f"{out}/rank{rank}.pt")


def worker_epochs(rank: int, out: str) -> None:
    """fit() for 2 epochs on a shuffled DataLoader: record which samples this rank trained on."""
    from torch.utils.data import DataLoader, TensorDataset

    from torchspeed.train.parallel.distributed import get_world_size
    from torchspeed.train.evaluate import evaluate
    from torchspeed.train.loop.trainer import Trainer

    n = 20
    x, y = make_data(n)
    x[:, 0, 0, 0] = torch.arange(n, dtype=torch.float32)  # the sample's id, read back by the hook below
    model = make_model(seed=0)
    seen: list[int] = []

    def record(module, inputs):
        if module.training:  # training batches only, not validation
            seen.extend(inputs[0][:, 0, 0, 0].round().long().tolist())

    model.register_forward_pre_hook(record)
    loader = DataLoader(TensorDataset(x, y), batch_size=3, shuffle=True)
    val = DataLoader(TensorDataset(x[:11], y[:11]), batch_size=4)  # 11: uneven shards on purpose
    trainer = Trainer(model, optimizer="sgd", lr=0.05, momentum=0.0, weight_decay=0.0, device="cpu",
                      config=plain_config(out_dir=f"{out}/out{rank}", checkpoint_dir=f"{out}/ckpt{rank}",
                                          restore_best=False,  # the last epoch's weights, to evaluate below
                                          train_acc=True))  # the training accuracy too: reduced over the ranks
    result = trainer.fit(loader, epochs=2, val_loader=val)
    full_val = evaluate(trainer.module, val, device="cpu")  # this rank alone, on the whole val set
    per = len(seen) // 2
    torch.save({"epochs": [seen[:per], seen[per:]], "history": result.history, "full_val": full_val,
                "world": get_world_size(), "params": [p.detach().clone() for p in trainer.module.parameters()]},
               f"{out}/rank{rank}.pt")


def make_bn_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(2),
                         nn.Flatten(), nn.Linear(16, 3))


def worker_sync_batchnorm(rank: int, out: str) -> None:
    """GPUs only: with SyncBatchNorm, BatchNorm sees the global batch, so one step matches one process."""
    from torchspeed.train.loop.trainer import Trainer

    x, y = make_data(16)
    half = slice(rank * 8, rank * 8 + 8)
    trainer = Trainer(make_bn_model(seed=0), optimizer="sgd", lr=0.1, momentum=0.0, weight_decay=0.0,
                      config=plain_config(sync_batchnorm=True))
    assert trainer.device == torch.device("cuda", rank), trainer.device
    trainer.train_step((x[half].to(trainer.device), y[half].to(trainer.device)))
    torch.save({"params": [p.detach().cpu() for p in trainer.module.parameters()],
                "decision": trainer.decisions["distributed"].value,
                "has_sync_bn": any(isinstance(m, nn.SyncBatchNorm) for m in trainer.module.modules())},
               f"{out}/rank{rank}.pt")
