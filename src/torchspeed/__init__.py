"""torchspeed: make PyTorch training fast, and prove each fix on your own machine.

The public API: `fit` / `Trainer` (the fast loop), each technique as a plain function
(`apply_channels_last`, `resolve_precision`, `create_optimizer`, `create_scheduler`,
`scale_lr`, `Prefetcher`, `evaluate`, ...), model surgery (`remove_conv_bias`,
`pad_to_multiple`, `freeze_batchnorm`, `apply_activation_checkpointing`), the doctor
(`diagnose`), structured pruning measured by time (`slim`, `finetune`), fast image data
(`FastImageFolder`, `PackedDataset`, `CachedDataset`, `DeviceAugment`; see `torchspeed.data`), and
`detect` (what this machine can accelerate).
"""

from torchspeed.env import EnvInfo, detect
from torchspeed.train import *  # noqa: F403
from torchspeed.train import __all__ as _train_all
from torchspeed.distill import Teacher, kd_loss
from torchspeed.fitting import fit
from torchspeed.slimming import SlimReport, SlimResult, finetune, slim
from torchspeed.inference import LoadedModel, Prediction, load_model, predict
from torchspeed.train.state.dcp import export_checkpoint

from torchspeed.tune import (BatchSizeResult, LoaderSettings, LRFinderResult, find_batch_size, find_lr,
                             tune_loader)

from torchspeed.model import (CheckpointWrapper, ConvBNPair, PaddingResult, apply_activation_checkpointing,
                              find_conv_bn_pairs, freeze_batchnorm, pad_to_multiple, remove_conv_bias)
from torchspeed.doctor import DoctorReport, Finding, diagnose
from torchspeed.data import (CachedDataset, DeviceAugment, DeviceLoader, FastImageFolder, PackedDataset, decode_image,
                             pack_folder)

__version__ = "0.1.0"
__all__ = ["EnvInfo", "detect", "__version__", "fit", "export_checkpoint", "load_model", "predict", "LoadedModel",
           "Prediction", *_train_all, "slim", "finetune", "SlimResult", "SlimReport", "Teacher", "kd_loss",
           "find_batch_size", "find_lr", "tune_loader", "BatchSizeResult", "LRFinderResult", "LoaderSettings",
           "remove_conv_bias", "find_conv_bn_pairs", "ConvBNPair", "pad_to_multiple", "PaddingResult",
           "freeze_batchnorm", "apply_activation_checkpointing", "CheckpointWrapper",
           "diagnose", "DoctorReport", "Finding",
           "FastImageFolder", "PackedDataset", "CachedDataset", "DeviceAugment", "DeviceLoader", "decode_image",
           "pack_folder"]
