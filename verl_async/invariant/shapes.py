"""The fixed shapes every true-on-policy kernel call uses, per device, and the process settings they need.

A GEMM, a row reduction or a softmax gives a row a result that may depend on how many rows
the call has (the library picks its algorithm, blocking and thread split from the shape) and,
on CPU, on how many threads run it. The rollout engine decodes a handful of rows; the trainer
forwards thousands. True on-policy mode therefore never lets the row count reach a kernel:
every call that computes a reported number has one of the fixed shapes below, padding the last
chunk, so row r gets the same bits whatever else shares its call and wherever it sits in it.

Measured on CPU (MKL fp32, oneDNN bf16, scripts/check_true_on_policy_gpu.py probes the same on
CUDA): with a fixed shape, row r's result is the same for any companion rows and any position;
with a varying row count it is not (fp32 GEMM at 1-12 rows, bf16 GEMM with K=1536 or
N=49152 at up to 32 and again at 600+ rows, a one-row sum over >= 32768 elements split
across threads). MKL fp32 results also change with the thread count (engine and trainer run
with different counts) unless its strict conditional-numerical-reproducibility mode is on:
`MKL_CBWR=AUTO,STRICT`, read when MKL starts, so it is set in the environment of every
process (PROCESS_ENV; the pipeline passes it to its Ray workers). On CUDA, cuBLAS(Lt) may
split K across thread blocks (split-K, stream-K) using its workspace; a workspace of 1 KiB
leaves only kernels that reduce each output in one block.

One exception to "fixed shapes everywhere", for cost: in strict mode MKL's fp32 GEMM gave every
row the same bits for any row count (1 to 8192 rows, 10 shapes from 64x128 to 896x151936, 1-3
threads, with and without bias; tests/test_invariant_ops.py keeps checking it), so CPU float32
linear layers run as one GEMM (`linear_rows=None`): padding a decode step to 16 rows made
SmolLM2's CPU decode 2.4x slower, mostly in the 49152-row LM head; what remains is strict mode's
own price (its single-row GEMMs run 2-3x slower than MKL's default ones). bf16 GEMMs (oneDNN) do
change with the row count and stay chunked.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Union

import torch

# What every process that computes true-on-policy numbers needs before its first GEMM.
PROCESS_ENV = {
    "MKL_CBWR": "AUTO,STRICT",
    "CUBLAS_WORKSPACE_CONFIG": ":16:8",
    "CUBLASLT_WORKSPACE_SIZE": "1",
}


@dataclass(frozen=True)
class Shapes:
    """Rows per call of each kind of kernel (the last chunk padded).

    `linear_rows`: rows of one GEMM of a linear layer (None: all rows in one GEMM, see above).
    `attn_tile`: query positions of one sequence per attention GEMM (decode pads its one position
    up to it). `reduce_rows`: rows of one norm-variance reduction; None: any number of rows >= 2 in one
    call, which is row-invariant on CPU (torch splits a row across threads only when the
    result is a single element). `logprob_rows`: rows of one log-softmax chunk.
    """

    linear_rows: Optional[int]
    attn_tile: int
    reduce_rows: Optional[int]
    logprob_rows: int


CPU_FP32 = Shapes(linear_rows=None, attn_tile=4, reduce_rows=None, logprob_rows=16)
CPU = Shapes(linear_rows=16, attn_tile=4, reduce_rows=None, logprob_rows=16)
# CUDA: each chunk is a kernel launch, so training wants big chunks and decode small ones. Norm reductions
# are cheap per row (1024: few launches for training, a tiny padded decode); a linear chunk of 256 rows costs a
# decode step about 1 ms of padded GEMMs on a 0.5B model; attention tiles of 32 positions multiply decode's
# attention FLOPs by 32 (its keys are read once either way). Not yet measured on a GPU.
CUDA = Shapes(linear_rows=256, attn_tile=32, reduce_rows=1024, logprob_rows=64)


def shapes_for(device: Union[str, torch.device], dtype: Optional[torch.dtype] = None) -> Shapes:
    """The shapes of `device` ("cpu", "cuda", "cuda:1", a torch.device) for tensors of `dtype` (only CPU
    float32 linear layers differ); other device kinds are refused before a model is built."""
    kind = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    if kind != "cpu":
        return CUDA
    return CPU_FP32 if dtype == torch.float32 else CPU


def environment_problem(device_kind: str) -> Optional[str]:
    """Why this process cannot compute true-on-policy numbers on `device_kind`, or None."""
    names = ("MKL_CBWR",) if device_kind == "cpu" else ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE")
    wrong = [n for n in names if os.environ.get(n) != PROCESS_ENV[n]]
    if not wrong:
        return None
    want = " ".join(f"{n}={PROCESS_ENV[n]}" for n in wrong)
    return (f"actor_rollout_ref.rollout.true_on_policy: this process was started without {want} (its BLAS "
            f"reads it at start-up); start it with that environment")
