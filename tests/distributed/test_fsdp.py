"""FSDP2 and DCP in the Trainer, and fit inside a process group made by someone else (T31).

2 CPU processes on gloo (1 thread each), a tiny model with 3 repeated blocks; each test
compares what the ranks saved with one process computed here.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddp_helpers import run_ranks
from fsdp_helpers import (STEPS, make_block_model, make_data, resumable_loader, worker_existing_group,
                          worker_fit_record, worker_fsdp_steps, worker_options)

pytestmark = pytest.mark.timeout(600)


def _load(path):
    return torch.load(path, weights_only=False)


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    run_ranks(worker_fsdp_steps, str(out))
    return out


def _reference_adamw(steps: int) -> dict:
    model = make_block_model(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.0)
    x, y = make_data(16 * steps)
    for s in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[16 * s:16 * s + 16]), y[16 * s:16 * s + 16]).backward()
        opt.step()
    return model.state_dict()


def test_fsdp2_weights_match_one_process_on_the_full_batch(fsdp_run):
    want = _reference_adamw(STEPS)
    for rank in (0, 1):
        r = _load(fsdp_run / f"rank{rank}.pt")
        assert r["sharded"] and r["world"] == 2
        assert r["decisions"]["parallel"] == "fsdp2 (asked for)"
        assert r["decisions"]["fsdp_blocks"].startswith("3 x Block + root")
        assert "FSDP2, 2 processes (gloo)" in r["decisions"]["distributed"]
        # rank 1 built its model from another seed: the match also shows rank 0's weights were broadcast
        for k, v in want.items():
            assert (r["weights"][k] - v).abs().max().item() <= 1e-6, k


def test_dcp_round_trip_is_bit_identical_and_exports_a_plain_state_dict(fsdp_run, tmp_path):
    import torchspeed

    for rank in (0, 1):
        r = _load(fsdp_run / f"rank{rank}.pt")
        assert r["local"].keys() == r["local_loaded"].keys()
        for k in r["local"]:
            assert torch.equal(r["local"][k], r["local_loaded"][k]), k
        assert len(r["opt"]) == len(r["opt_loaded"]) > 0
        for (k, a), (k2, b) in zip(r["opt"], r["opt_loaded"]):
            assert k == k2 and torch.equal(a, b), k
    # each rank holds about half of the parameters
    full = sum(p.numel() for p in make_block_model().parameters())
    shards = [_load(fsdp_run / f"rank{rank}.pt")["shard_numel"] for rank in (0, 1)]
    assert sum(shards) == full and max(shards) <= full * 0.6
    # the shards joined, without a process group, into a file torch.load(weights_only=True) reads
    r0 = _load(fsdp_run / "rank0.pt")
    out = torchspeed.export_checkpoint(fsdp_run / "ckpt", tmp_path / "model.pt")
    weights = torch.load(out, weights_only=True)
    assert weights.keys() == r0["weights"].keys()
    for k, v in r0["weights"].items():
        assert torch.equal(weights[k], v), k
    model = make_block_model(seed=3)
    model.load_state_dict(weights)


def test_fit_in_an_existing_process_group_uses_it_and_leaves_it_alive(tmp_path):
    run_ranks(worker_existing_group, str(tmp_path))
    for rank in (0, 1):
        r = _load(tmp_path / f"rank{rank}.pt")
        assert r["alive"] and r["sum"] == 3.0
        assert "DDP, 2 processes (gloo)" in r["decisions"]["distributed"]
        assert r["steps"] == 4  # 32 samples / 2 ranks / batch 4
        # the hook ran on every rank, once per checkpoint, after the file was complete
        assert [(step, exists) for _, step, exists in r["calls"]] == [(2, True), (4, True)]
        assert r["calls"][0][0].endswith("step-00000002.pt")


def test_resume_from_two_processes_on_one_continues_at_the_same_sample(tmp_path):
    # 2 processes, 32 samples, batch 4: stop after 2 steps (16 samples), checkpointed mid-epoch
    run_ranks(worker_fit_record, str(tmp_path), "two", dict(epochs=1, max_steps=2, checkpoint_every=2))
    two = [_load(tmp_path / f"two-rank{rank}.pt") for rank in (0, 1)]
    assert [t["steps"] for t in two] == [2, 2]
    order = resumable_loader().sampler.order(0).tolist()
    assert sorted(two[0]["seen"] + two[1]["seen"]) == sorted(order[:16])
    # 1 process resumes: batch 2 of 2 processes is batch 4 of 1, and the next sample is order[16]
    run_ranks(worker_fit_record, str(tmp_path), "one", dict(epochs=1, resume="auto"), world=1)
    one = _load(tmp_path / "one-rank0.pt")
    assert one["resumed"] and "step-00000002" in one["resumed"]
    assert one["seen"] == order[16:]
    assert one["steps"] == 2 + 4


def test_activation_checkpointing_and_cpu_offload_train_the_same_and_bad_options_fail_clearly(tmp_path):
    run_ranks(worker_options, str(tmp_path), world=1)
    r = _load(tmp_path / "options.pt")
    plain = r["results"]["plain"]
    assert plain["forwards"] == 1
    assert r["results"]["checkpointed"]["forwards"] == 2  # the block's forward ran again in backward
    assert "cpu_offload=True" in r["results"]["offload"]["decision"]
    for name in ("checkpointed", "offload"):
        for k, v in plain["weights"].items():
            assert torch.equal(r["results"][name]["weights"][k], v), (name, k)
    assert "not module classes of this model" in r["errors"]["bad_class"]
    assert "pass the optimizer by name" in r["errors"]["optimizer"]
