"""Fast image data: decode (T04), uint8 tensors (T11), cache (T10), pack (T09), device augmentation (T05).

The pieces, each usable alone:
- `decode_image` / `decode_jpeg`: libjpeg-turbo (simplejpeg), OpenCV or Pillow, with DCT-domain downscaling.
- `FastImageFolder`: torchvision's ImageFolder, fast, returning uint8 tensors; `uint8_collate`.
- `DeviceAugment` + `DeviceLoader`: random-resized-crop, flip, jitter, normalize on the device, in batches.
- `CachedDataset`: items in a shared-memory LRU pool with a byte budget.
- `pack_folder` / `PackedDataset` / `LocalShuffleSampler`: one file + index, memory-mapped, local shuffle.
- `make_jpeg_folder`: a JPEG folder from scikit-image's photos (tests, benchmarks, docs).
- `build_loaders`: the whole pipeline for `torchspeed train`.
"""

from torchspeed.data.augment import IMAGENET_MEAN, IMAGENET_STD, DeviceAugment, DeviceLoader, random_boxes
from torchspeed.data.cache import CachedDataset, CacheStats, SharedLRUPool
from torchspeed.data.decode import (ImageDecodeError, available_backends, decode_image, decode_jpeg,
                                    decode_jpeg_batch, image_size, pick_backend)
from torchspeed.data.folder import (DataSummary, FastImageFolder, ImageDataset, load_image, random_resized_crop_box,
                                    uint8_collate)
from torchspeed.data.packed import LocalShuffleSampler, PackedDataset, PackResult, is_packed, pack_folder
from torchspeed.data.synthetic import PHOTOS, make_jpeg_folder

__all__ = ["decode_image", "decode_jpeg", "decode_jpeg_batch", "image_size", "available_backends", "pick_backend",
           "ImageDecodeError", "FastImageFolder", "ImageDataset", "DataSummary", "load_image",
           "random_resized_crop_box", "uint8_collate", "DeviceAugment", "DeviceLoader", "random_boxes",
           "IMAGENET_MEAN", "IMAGENET_STD", "CachedDataset", "CacheStats", "SharedLRUPool", "pack_folder",
           "PackedDataset", "PackResult", "LocalShuffleSampler", "is_packed", "make_jpeg_folder", "PHOTOS"]
