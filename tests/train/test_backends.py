"""TF32 through one API: the per-backend fp32_precision settings, the legacy flags only on older torch."""

from types import SimpleNamespace as NS

import pytest
import torch

from torchspeed.train.backends import enable_tf32


def test_tf32_uses_the_per_backend_settings_where_torch_has_them():
    b = NS(cuda=NS(matmul=NS(fp32_precision="none")), cudnn=NS(conv=NS(fp32_precision="none"),
                                                               rnn=NS(fp32_precision="none")))
    how = enable_tf32(b)
    assert (b.cuda.matmul.fp32_precision, b.cudnn.conv.fp32_precision, b.cudnn.rnn.fp32_precision) == ("tf32",) * 3
    assert not hasattr(b.cuda.matmul, "allow_tf32") and "fp32_precision" in how


def test_tf32_falls_back_to_the_legacy_flags_on_older_torch():
    b = NS(cuda=NS(matmul=NS(allow_tf32=False)), cudnn=NS(allow_tf32=False))
    how = enable_tf32(b)
    assert b.cuda.matmul.allow_tf32 and b.cudnn.allow_tf32 and "allow_tf32" in how


def test_tf32_on_this_torch_sets_the_per_backend_settings():
    b = torch.backends
    objs = (b.cuda.matmul, b.cudnn.conv, b.cudnn.rnn)
    if not all(hasattr(o, "fp32_precision") for o in objs):
        pytest.skip("this torch has no per-backend fp32_precision (the legacy path is covered above)")
    saved = [o.fp32_precision for o in objs]
    try:
        enable_tf32()
        assert [o.fp32_precision for o in objs] == ["tf32"] * 3
    finally:
        for o, v in zip(objs, saved):
            o.fp32_precision = v
