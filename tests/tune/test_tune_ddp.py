"""Under torch.distributed every tuner makes one decision on rank 0 and broadcasts it (2 CPU processes, gloo)."""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    from torch.utils.data import DataLoader, TensorDataset

    from torchspeed.bench.workloads import SyntheticImages, create_model
    from torchspeed.tune import find_batch_size, find_lr, tune_loader

    torch.set_num_threads(1)
    # Each rank sees different data, a different model and a different memory budget, so ranks
    # deciding on their own would disagree; the broadcast makes them act as one.
    ds = SyntheticImages(256, size=8, seed=rank)
    torch.manual_seed(rank)
    model = create_model("mlp", image_size=8)
    budget = int(5.0e6) if rank == 0 else int(4.3e6)
    # what this rank alone decides (no process group yet: the tuner runs locally)
    alone = find_batch_size(model, ds, memory_budget=budget, rounds=1, min_time=0.0, progress=False)

    # the parent serves the store (see below): every rank is a client, as under torchrun
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        bs = find_batch_size(model, ds, memory_budget=budget, rounds=1, min_time=0.0, progress=False)
        lr = find_lr(model, DataLoader(ds, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(rank)),
                     num_steps=30, progress=False)
        ld = tune_loader(TensorDataset(ds.data, ds.targets), batch_size=32, max_workers=0, batches=4, min_time=0.05,
                        rounds=1, progress=False)
        torch.save({"batch": (bs.largest, bs.largest_raw, bs.limited_by), "lr": lr.lrs + lr.losses,
                    "suggestion": lr.suggestion, "loader": ld.num_workers, "alone": alone.largest_raw},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_one_decision_broadcast_to_every_rank(tmp_path):
    # A store bound here, now, on a port the OS picks: a port picked in advance and bound later by
    # rank 0 could be taken in between by another process on the machine.
    store = dist.TCPStore("127.0.0.1", 0, world_size=2, is_master=True, wait_for_workers=False)
    mp.spawn(_worker, args=(2, store.port, str(tmp_path)), nprocs=2, join=True)
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=True)
    assert r0["alone"] != r1["alone"], (r0["alone"], r1["alone"])  # alone, the ranks would disagree
    assert r0["batch"] == r1["batch"] and r0["batch"][1] == r0["alone"]  # rank 0's decision, everywhere
    assert r0["lr"] == r1["lr"] and r0["suggestion"] == r1["suggestion"]  # the same range test curve
    assert r0["loader"] == r1["loader"] == 0
