"""Tuners that find settings by measuring: batch size (T17), learning rate (T15), DataLoader (T06-T08).

- `find_batch_size`: the largest batch that fits and the fastest batch, with the measured table.
- `find_lr`: an LR range test with a spike-proof suggestion; restores everything it touched.
- `tune_loader`: num_workers / prefetch_factor / pin_memory / persistent_workers by throughput.
- `measure_noise_scale`: the gradient noise scale B_simple, about the critical batch size.
- `compare_optimizers`: a short trial of each optimizer (e.g. AdamW vs Muon+AdamW, T42) from the
  same state; the one that learns faster, by a clear margin over the simpler one.

Under torch.distributed each tuner measures on rank 0 and broadcasts one decision to all ranks.
"""

from torchspeed.tune.batch import BatchSizeResult, BatchTrial, find_batch_size
from torchspeed.tune.loader import LoaderSettings, LoaderTrial, tune_loader
from torchspeed.tune.lr import LRFinderResult, find_lr, plot_lr, suggest_lr
from torchspeed.tune.optimizer_trial import OptimizerTrial, compare_optimizers
from torchspeed.train.noise import NoiseScaleEstimator, NoiseScaleResult, measure_noise_scale

__all__ = ["BatchSizeResult", "BatchTrial", "find_batch_size", "LRFinderResult", "find_lr", "plot_lr", "suggest_lr",
           "LoaderSettings", "LoaderTrial", "tune_loader", "NoiseScaleEstimator", "NoiseScaleResult",
           "measure_noise_scale", "OptimizerTrial", "compare_optimizers"]
