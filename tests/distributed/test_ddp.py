"""DistributedDataParallel in the Trainer, with 2 CPU processes on gloo (T31, T17, T19).

Each test runs a worker from ddp_helpers in 2 spawned processes with the torchrun
environment, then compares what they saved against a single-process reference computed
here on the concatenated batch.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from ddp_helpers import make_data, make_model, run_ranks, worker_accumulate, worker_epochs, worker_one_step

# Each test spawns 2 processes that import torch: seconds when idle, a minute or more on a loaded machine.
pytestmark = pytest.mark.timeout(600)


def _load(tmp_path, rank):
    return torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)


def _reference_sgd_step(x, y, *, lr: float) -> list[torch.Tensor]:
    model = make_model(seed=0)
    nn.functional.cross_entropy(model(x), y).backward()
    with torch.no_grad():
        return [p - lr * p.grad for p in model.parameters()]


def test_one_ddp_step_equals_single_process_on_the_concatenated_batch(tmp_path):
    run_ranks(worker_one_step, str(tmp_path))
    x, y = make_data(16)
    ref = make_model(seed=0)
    nn.functional.cross_entropy(ref(x), y).backward()
    r0, r1 = _load(tmp_path, 0), _load(tmp_path, 1)
    for r in (r0, r1):
        # raw DDP: averaged gradients of the two halves = gradient of the whole batch
        for g, p in zip(r["grads"], ref.parameters()):
            torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6)
        # Trainer: wrapped in DDP, LR scaled by the world size (T17), same update as one process
        assert r["is_ddp"] and "DDP, 2 processes (gloo)" in r["decisions"]["distributed"].value
        assert r["lr"] == pytest.approx(0.2)
        for got, want in zip(r["params"], _reference_sgd_step(x, y, lr=0.2)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        # static_graph=True (valid here: every step uses every parameter) gives the same update
        assert "static_graph=True" in r["static_decision"]
        for got, want in zip(r["static_params"], _reference_sgd_step(x, y, lr=0.1)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_accumulation_uses_no_sync_and_matches_single_process(tmp_path):
    run_ranks(worker_accumulate, str(tmp_path))
    x, y = make_data(16)
    want = _reference_sgd_step(x, y, lr=0.1)  # 2 ranks x 2 micro-batches of 4 = one batch of 16
    for rank in (0, 1):
        r = _load(tmp_path, rank)
        fast, wasteful = r["no_sync"], r["sync_every_micro_step"]
        assert fast["steps"] == wasteful["steps"] == 1
        for got in (fast["params"], wasteful["params"]):
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
        # the tiny model fits in one bucket: one all-reduce per optimizer step, not per micro-batch
        assert wasteful["allreduce_calls"] == 2 * fast["allreduce_calls"]
        assert fast["allreduce_calls"] == 1


@pytest.fixture(scope="module")
def epochs_run(tmp_path_factory):
    """One 2-process fit() of 2 epochs shared by the tests below (each rank with its own out_dir)."""
    out = tmp_path_factory.mktemp("epochs")
    run_ranks(worker_epochs, str(out))
    return out


def test_sampler_covers_the_dataset_once_per_epoch_and_metrics_are_global(epochs_run):
    r0, r1 = _load(epochs_run, 0), _load(epochs_run, 1)
    assert r0["world"] == r1["world"] == 2
    for epoch in (0, 1):
        a, b = r0["epochs"][epoch], r1["epochs"][epoch]
        assert len(a) == len(b) == 10
        assert sorted(a + b) == list(range(20))  # every sample once, no rank overlap
    # set_epoch: the shuffle changes between epochs
    assert r0["epochs"][0] != r0["epochs"][1]
    # replicas stay identical
    for p0, p1 in zip(r0["params"], r1["params"]):
        torch.testing.assert_close(p0, p1)
    # reduced metrics: both ranks report the same global numbers ...
    for h0, h1 in zip(r0["history"], r1["history"], strict=True):
        for k in ("train_loss", "train_acc", "val_loss", "val_acc"):
            assert h0[k] == pytest.approx(h1[k], rel=1e-9), k
    # ... and validation over the sharded set (6 + 5 samples) equals one process evaluating all 11
    last = r0["history"][-1]
    assert last["val_loss"] == pytest.approx(r0["full_val"]["val_loss"], rel=1e-5)
    assert last["val_acc"] == pytest.approx(r0["full_val"]["val_acc"])


def test_only_rank_zero_writes_metrics_and_checkpoints(epochs_run):
    assert (epochs_run / "out0" / "metrics.json").exists() and (epochs_run / "out0" / "metrics.csv").exists()
    assert not (epochs_run / "out1").exists()
    written = json.loads((epochs_run / "out0" / "metrics.json").read_text())
    assert len(written["history"]) == 2 and "DDP" in written["decisions"]["distributed"]["value"]
    assert list((epochs_run / "ckpt0").glob("*.pt")), "rank 0 wrote no checkpoint"
    ckpt1 = epochs_run / "ckpt1"
    assert not (ckpt1.exists() and any(ckpt1.iterdir())), "rank 1 wrote into its checkpoint_dir"
    # the checkpoint holds the plain module's weights (no DDP "module." prefix)
    from torchspeed.train.state.checkpoint import load_checkpoint

    newest = max((epochs_run / "ckpt0").glob("*.pt"), key=lambda p: p.stat().st_mtime)
    assert not any(k.startswith("module.") for k in load_checkpoint(newest)["model"])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL DDP needs 2 GPUs")
def test_sync_batchnorm_on_two_gpus_matches_one_process_with_the_whole_batch(tmp_path):
    from ddp_helpers import make_bn_model, worker_sync_batchnorm

    run_ranks(worker_sync_batchnorm, str(tmp_path))
    x, y = make_data(16)
    ref = make_bn_model(seed=0)
    nn.functional.cross_entropy(ref(x), y).backward()
    with torch.no_grad():
        want = [p - 0.1 * p.grad for p in ref.parameters()]
    for rank in (0, 1):
        r = _load(tmp_path, rank)
        assert r["has_sync_bn"] and "nccl" in r["decision"] and "sync_batchnorm=True" in r["decision"]
        for got, w in zip(r["params"], want):
            torch.testing.assert_close(got, w, rtol=1e-3, atol=1e-4)  # TF32 may be on for GPU convs
