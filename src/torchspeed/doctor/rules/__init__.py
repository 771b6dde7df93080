"""One file per rule; importing this package registers all of them in `RULES`."""

from torchspeed.doctor.rules import (  # noqa: F401
    channels_last, conv_bias_before_bn, cudnn_benchmark, data_bound, data_parallel, dataloader_workers,
    eval_grad_enabled, host_sync, input_not_normalized, model_design, no_amp, pin_memory, size_not_multiple_of_8,
    slow_jpeg_decode, small_batch, tensor_copy, unused_parameters, zero_grad_memset,
)
