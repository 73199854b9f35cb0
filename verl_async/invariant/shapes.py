"""The fixed shapes the CUDA kernels of true on-policy mode use, and the process settings they need.

A GEMM, a row reduction or a softmax gives a row a result that may depend on how many rows
the call has (the library picks its algorithm, blocking and thread split from the shape). The
rollout engine decodes a handful of rows; the trainer forwards thousands.

On CPU that is answered by exactness, not by shapes: the linear layers' and attention's GEMMs,
the norm's and the softmaxes' sums are exact (exact.py), so no row count, thread count or BLAS
library can change a row's bits, and no process setting is needed (CPU chunk sizes below only
bound memory).

On CUDA with triton (the default), linear, RMSNorm, attention and the log-prob are single launches whose order
does not depend on the batch (triton_ops.py, triton_softmax.py) and these shapes go unused. Without it (or with
VERL_ASYNC_INVARIANT_TRITON=0), every call that computes a reported number has one of the fixed shapes below, padding
the last chunk, so row r gets the same bits whatever else shares its call and wherever it sits in it.
cuBLAS(Lt) may split K across thread blocks (split-K, stream-K) using its workspace; a workspace
of 1 KiB leaves only kernels that reduce each output in one block (PROCESS_ENV, read when cuBLAS
starts: the pipeline passes it to its Ray workers). scripts/check_true_on_policy_gpu.py probes it.
With triton no forward value that engine and trainer compare comes from cuBLAS (the rotary table's
`inv_freq @ positions` has K = 1: one product, exact in any kernel), so the process keeps cuBLAS's
default settings: the backward's GEMMs (weight gradients with K = tokens, few output tiles) keep
their split-K kernels (`worker_env`, `environment_problem`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Union

import torch

# What every process that computes true-on-policy numbers on CUDA needs before its first GEMM.
PROCESS_ENV = {
    "CUBLAS_WORKSPACE_CONFIG": ":16:8",
    "CUBLASLT_WORKSPACE_SIZE": "1",
}
# CPU: the driver's torch CPU capability (AVX2, AVX512, ...), handed to every worker (pipeline.ray_init). The sums
# are exact anywhere, but torch's vectorized exp/log/division kernels are chosen per capability: an engine and a
# trainer on CPUs of different capabilities could round an element differently, so such a worker refuses.
CPU_CAPABILITY_ENV = "VERL_ASYNC_TRUE_ON_POLICY_CPU_CAPABILITY"


def cpu_capability() -> str:
    return str(torch.backends.cpu.get_cpu_capability())


def _needs_cublas_settings(device_kind: str) -> bool:
    """Whether the mode's numbers on `device_kind` come from cuBLAS: CUDA without the Triton kernels."""
    from verl_async.invariant import triton_ops

    return device_kind != "cpu" and not triton_ops.use_triton(torch.device("cuda" if device_kind == "cuda" else "cpu"))


def worker_env(device_kind: str) -> dict[str, str]:
    """What the pipeline sets in its Ray workers' environment for the mode on `device_kind` (CUDA with triton:
    nothing; a worker that cannot take the Triton path then refuses in `environment_problem`)."""
    if device_kind == "cpu":
        return {CPU_CAPABILITY_ENV: cpu_capability()}
    return dict(PROCESS_ENV) if _needs_cublas_settings(device_kind) else {}


@dataclass(frozen=True)
class Shapes:
    """Rows per call of each kind of kernel (the last chunk padded).

    `linear_rows`: rows of one GEMM of a linear layer (None: exact, CPU). `attn_tile`: query positions of
    one sequence per attention GEMM (decode pads its one position up to it; CPU: exact, no tiles).
    `reduce_rows`: rows of one norm-variance reduction (None: exact, CPU). `logprob_rows`: rows of one
    log-softmax chunk (CPU: memory only).
    """

    linear_rows: Optional[int]
    attn_tile: int
    reduce_rows: Optional[int]
    logprob_rows: int


CPU = Shapes(linear_rows=None, attn_tile=1, reduce_rows=None, logprob_rows=16)
# CUDA: each chunk is a kernel launch, so training wants big chunks and decode small ones. Norm reductions
# are cheap per row (1024: few launches for training, a tiny padded decode); a linear chunk of 256 rows costs a
# decode step about 1 ms of padded GEMMs on a 0.5B model; attention tiles of 32 positions multiply decode's
# attention FLOPs by 32 (its keys are read once either way). Not yet measured on a GPU.
CUDA = Shapes(linear_rows=256, attn_tile=32, reduce_rows=1024, logprob_rows=64)


def shapes_for(device: Union[str, torch.device]) -> Shapes:
    """The shapes of `device` ("cpu", "cuda", "cuda:1", a torch.device); other device kinds are refused
    before a model is built."""
    kind = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    return CPU if kind == "cpu" else CUDA


def environment_problem(device_kind: str) -> Optional[str]:
    """Why this process cannot compute true-on-policy numbers on `device_kind`, or None."""
    if device_kind == "cpu":
        want = os.environ.get(CPU_CAPABILITY_ENV)
        if want and want != cpu_capability():
            return (f"actor_rollout_ref.rollout.true_on_policy: this worker's CPU runs torch's {cpu_capability()} "
                    f"kernels and the driver's {want}: engine and trainer must run on CPUs of one capability")
        return None
    if not _needs_cublas_settings(device_kind):
        return None
    wrong = [n for n in PROCESS_ENV if os.environ.get(n) != PROCESS_ENV[n]]
    if not wrong:
        return None
    want = " ".join(f"{n}={PROCESS_ENV[n]}" for n in wrong)
    return (f"actor_rollout_ref.rollout.true_on_policy: this process was started without {want} (its BLAS "
            f"reads it at start-up); start it with that environment, or install triton (its kernels need none)")
