"""verl's `perf/mfu/actor`: the model FLOPs a training step did over what its accelerators promise.

FLOPs of a dense decoder's training pass: 6 x parameters x tokens (forward 2, backward 4), times
`ppo_epochs` (each token is trained once per epoch); attention's sequence-squared term is left out,
so short sequences are counted exactly and long ones under-counted. The promised rate is the
accelerator's dense bf16 peak from its name (the table verl keeps, verl/utils/flops_counter.py);
an unknown device (and CPU) has none, and no MFU is logged.
"""

from __future__ import annotations

from typing import Optional

# dense bf16 TFLOP/s by a fragment of torch.cuda.get_device_name() (first match wins: longer names first)
PEAK_BF16_TFLOPS = (
    ("H100", 989.0), ("H200", 989.0), ("H800", 989.0), ("H20", 148.0), ("GB200", 2500.0), ("B200", 2250.0),
    ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L40", 181.0), ("L20", 119.5), ("A10", 125.0),
    ("910B", 354.0),
)


def promised_flops(device_name: Optional[str]) -> Optional[float]:
    """Dense bf16 FLOP/s of one device named so (None when unknown)."""
    if not device_name:
        return None
    for fragment, tflops in PEAK_BF16_TFLOPS:
        if fragment in device_name:
            return tflops * 1e12
    return None


def training_flops(params: int, tokens: int, epochs: int = 1) -> float:
    """6 x N x T per epoch (dense matmuls of forward and backward)."""
    return 6.0 * float(params) * float(tokens) * float(epochs)


def mfu(params: int, tokens: int, seconds: float, devices: int, peak_flops: Optional[float],
        epochs: int = 1) -> Optional[float]:
    """Model FLOPs utilisation of `devices` devices over `seconds` (None without a peak or time)."""
    if not peak_flops or seconds <= 0 or devices <= 0:
        return None
    return training_flops(params, tokens, epochs) / (seconds * devices * peak_flops)
