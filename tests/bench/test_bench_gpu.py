"""The bench on a GPU: hand row, MFU, CUDA-only rows (run with `pytest -m gpu`)."""

import json

import pytest
import torch

from torchspeed.bench.hand import search_hand_settings
from torchspeed.bench.runner import bench_configs, run_bench
from torchspeed.bench.workloads import SyntheticImages, create_model

pytestmark = pytest.mark.gpu


def test_cuda_rows_and_the_hand_search_tries_half_precision_and_keeps_the_fastest():
    names = [c.name for c in bench_configs(torch.device("cuda"))]
    assert {"prefetch", "cudnn_benchmark", "compile_cudagraphs", "hand", "all"} <= set(names)
    assert "omp_passive" not in names and "tcmalloc" not in names
    loader = torch.utils.data.DataLoader(SyntheticImages(256, size=32), batch_size=64)
    best, log = search_hand_settings(lambda: create_model("resnet18"), loader, torch.device("cuda"),
                                     try_compile=False)
    assert len(log["tried"]) == 8  # fp32/bf16 x NCHW/NHWC x for-loop/fused
    assert {"bf16", "bf16+channels_last"} <= set(log["tried"]), log
    # the fastest measured setting wins, whichever it is (on an H200 at 32 px and batch 64 the step is
    # launch-bound and fp32 + channels_last + fused beat bf16)
    assert log["chosen"] == best.label() == min(log["tried"], key=log["tried"].get), log


def test_run_bench_on_cuda_reports_mfu_and_all_over_hand():
    res = run_bench(model="resnet18", batch_size=128, steps=5, rounds=2, warmup=1, device="cuda",
                    configs=["hand", "all", "prefetch"], eval_batches=1, train_size=1024, compile=False,
                    progress=False)
    assert [r.config for r in res.rows] == ["naive", "prefetch", "hand", "all"]
    for r in res.rows:
        assert r.mfu is not None and 0 < r.mfu < 1
    assert res.meta["all_over_hand"] > 0
    search = json.loads(res.rows[2].decisions["search"])
    assert search["chosen"] == min(search["tried"], key=search["tried"].get), search  # the fastest measured
