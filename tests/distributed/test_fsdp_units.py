"""The single-process parts of FSDP2 and DCP: block finding, the "auto" rule, position rescaling, errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdp_helpers import Block, make_block_model
from torchspeed.train.state.checkpoint import ResumeMismatchError
from torchspeed.train.state.dcp import export_checkpoint, rescale_position
from torchspeed.train.parallel.fsdp import choose_parallel, find_blocks, state_bytes


def test_find_blocks_picks_the_outermost_repeated_composite_module():
    model = make_block_model(blocks=3)
    blocks = find_blocks(model)
    assert [type(b) for b in blocks] == [Block] * 3 and blocks[0] is model[1]
    # the GPT of the bench: its 4 transformer blocks, not the attention or MLP inside them
    from torchspeed.bench.text import GPT

    gpt = GPT(n_layer=4, n_embd=32, n_head=2, block_size=16)
    assert find_blocks(gpt) == list(gpt.blocks)
    # repeated nn.Sequential stages are blocks too
    staged = nn.Sequential(nn.Linear(2, 4), *[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2)])
    assert find_blocks(staged) == [staged[1], staged[2]]
    # nothing repeats: the root alone is the unit
    assert find_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))) == []


def test_auto_stays_ddp_while_a_replica_fits_and_shards_beyond():
    model = make_block_model()
    need = state_bytes(model)
    fits = choose_parallel("auto", model, torch.device("cpu"), world_size=2, device_bytes=need * 4)
    assert fits.value == "ddp" and "fits" in fits.reason
    big = choose_parallel("auto", model, torch.device("cpu"), world_size=2, device_bytes=need)
    assert big.value == "fsdp2" and "sharded over 2" in big.reason
    assert choose_parallel("auto", model, torch.device("cpu"), world_size=1, device_bytes=1).value == "ddp"
    assert choose_parallel("fsdp2", model, torch.device("cpu"), world_size=2).reason == "asked for"
    with pytest.raises(ValueError, match="parallel must be one of"):
        choose_parallel("fsdp", model, torch.device("cpu"), world_size=2)


def test_rescale_position_keeps_the_samples_trained_on():
    state = {"batch_in_epoch": 5, "steps_per_epoch": 8, "world_size": 2}
    assert rescale_position(state, world_size=1, steps_per_epoch=16)["batch_in_epoch"] == 10
    assert rescale_position(state, world_size=2, steps_per_epoch=8) is state
    back = rescale_position({"batch_in_epoch": 10, "world_size": 1}, world_size=2, steps_per_epoch=8)
    assert back["batch_in_epoch"] == 5 and back["steps_per_epoch"] == 8
    with pytest.raises(ResumeMismatchError, match="cannot split evenly"):
        rescale_position({"batch_in_epoch": 5, "world_size": 1}, world_size=2, steps_per_epoch=8)


def test_fit_options_fail_in_one_line():
    import torchspeed

    with pytest.raises(ValueError, match="parallel must be 'auto', 'ddp' or 'fsdp2'"):
        torchspeed.fit(make_block_model(), [(torch.randn(2, 6), torch.tensor([0, 1]))], parallel="zero3",
                       device="cpu", progress=False)


def test_export_needs_a_sharded_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="no sharded checkpoint"):
        export_checkpoint(tmp_path, tmp_path / "model.pt")


def test_bench_refuses_fsdp2_without_nproc(capsys):
    from torchspeed.cli.main import main

    assert main(["bench", "--parallel", "fsdp2", "--quick"]) == 2
    assert "add --nproc 2" in capsys.readouterr().err
