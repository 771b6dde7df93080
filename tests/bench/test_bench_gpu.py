"""The bench on a GPU: hand row, MFU, CUDA-only rows (run with `pytest -m gpu`)."""

import json

import pytest
import torch

from torchspeed.bench.hand import search_hand_settings
from torchspeed.bench.runner import bench_configs, run_bench
from torchspeed.bench.workloads import SyntheticImages, create_model

pytestmark = pytest.mark.gpu


def test_cuda_rows_and_the_hand_search_picks_half_precision():
    names = [c.name for c in bench_configs(torch.device("cuda"))]
    assert {"prefetch", "cudnn_benchmark", "compile_cudagraphs", "hand", "all"} <= set(names)
    assert "omp_passive" not in names and "tcmalloc" not in names
    loader = torch.utils.data.DataLoader(SyntheticImages(256, size=32), batch_size=64)
    best, log = search_hand_settings(lambda: create_model("resnet18"), loader, torch.device("cuda"),
                                     try_compile=False)
    assert len(log["tried"]) == 8  # fp32/bf16 x NCHW/NHWC x for-loop/fused
    assert best.precision == "bf16" and best.channels_last, log


def test_run_bench_on_cuda_reports_mfu_and_all_over_hand():
    res = run_bench(model="resnet18", batch_size=128, steps=5, rounds=2, warmup=1, device="cuda",
                    configs=["hand", "all", "prefetch"], eval_batches=1, train_size=1024, compile=False,
                    progress=False)
    assert [r.config for r in res.rows] == ["naive", "prefetch", "hand", "all"]
    for r in res.rows:
        assert r.mfu is not None and 0 < r.mfu < 1
    assert res.meta["all_over_hand"] > 0
    assert json.loads(res.rows[2].decisions["search"])["chosen"].startswith("bf16")
