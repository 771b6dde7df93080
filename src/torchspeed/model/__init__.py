"""Model surgery: changes to a model that keep the function it computes (or how it trains).

Each is a plain function a hand-written loop can call; the doctor's fixes call the same ones.

- `remove_conv_bias` / `find_conv_bn_pairs`: a conv directly followed by BatchNorm needs no bias (T27)
- `apply_channels_last`: NHWC weights for fast convolution kernels (T23)
- `pad_to_multiple`: hidden sizes padded to multiples of 8 with zero weights, exactly (T24)
- `freeze_batchnorm`: BatchNorm keeps its running statistics (and optionally its affine) fixed (T34)
- `apply_activation_checkpointing`: recompute blocks in backward instead of storing activations (T29)
"""

from torchspeed.model.checkpointing import CheckpointWrapper, apply_activation_checkpointing
from torchspeed.model.conv_bias import ConvBNPair, find_conv_bn_pairs, remove_conv_bias
from torchspeed.model.freeze_bn import freeze_batchnorm
from torchspeed.model.padding import PaddingResult, pad_to_multiple
from torchspeed.train.trial.memory_format import apply_channels_last

__all__ = [
    "CheckpointWrapper", "apply_activation_checkpointing", "ConvBNPair", "find_conv_bn_pairs",
    "remove_conv_bias", "freeze_batchnorm", "PaddingResult", "pad_to_multiple", "apply_channels_last",
]
