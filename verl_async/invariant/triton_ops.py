"""Batch-invariant linear and RMSNorm as single Triton launches (issue 41 item 2: the GPU path's groundwork).

Today's CUDA path (`ops.py`, `shapes.CUDA`) gets invariance by cutting every call into fixed-shape chunks (256-row
GEMMs, 1024-row norms, the last padded), which turns one GEMM into dozens of launches and costs the mode 4.5x on an
H100. Here one launch covers any row count, and invariance comes from the kernel itself (`_triton_kernels`: one
program per output tile, K summed in a fixed order into float32, no split-K, launch constants that depend on the
weight's shape and dtype only). Engine and trainer calling these with the same weight get the same bits per row.

`ops.linear` and `ops.rms_norm` call these on CUDA when triton imports (`use_triton`; VERL_ASYNC_INVARIANT_TRITON=0
keeps the chunked path). Checked on an H200: 249/249 invariance cases bit-equal up to 16,384 rows, a decoder layer
at 0.8-1.05x torch's speed and 3.6-35x the chunked path's (bench/RESULTS.md, "Eighth session"). Triton is
imported on the first kernel call, never at import, so the CPU product path does not need it. On CPU the kernels
run only under Triton's interpreter (`TRITON_INTERPRET=1`, set before the first call), which the tests use to
check the kernels' indexing and invariance logic; GPU numerics are checked by the script.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass, replace
from typing import Optional

import torch

INTERPRET_ENV = "TRITON_INTERPRET"
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class MatmulConfig:
    """Launch constants of the linear kernel. They decide each output's summation order, so they must be a
    function of the weight (shape, dtype) alone: never of the row count."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3


def matmul_config(out_features: int, in_features: int, dtype: torch.dtype, rows: Optional[int] = None) -> MatmulConfig:
    """The config for a weight [out_features, in_features] of `dtype` (16-bit: tensor-core tiles; float32: the
    IEEE dot, a shorter K step to bound shared memory), and for a call of `rows` rows: up to DECODE_ROWS (a decode
    step) smaller tiles (`decode_tile`), so that a few rows spread the weight over many programs. The K step, the
    one float32 accumulator and the order of K never change with `rows`: an output's sum is the same sequence of
    `tl.dot`s whatever the tile (measured on an H200: BLOCK_M 128/64/32/16 give equal bits;
    scripts/bench_invariant_triton.py --decode-sweep checks each decode tile against the default and times it)."""
    del out_features, in_features  # one config per dtype today; a per-shape table may come after GPU tuning
    base = MatmulConfig(block_k=32) if dtype == torch.float32 else MatmulConfig()
    if rows is not None and rows <= DECODE_ROWS:
        tile = decode_tile()
    else:  # experiments: another tile for the long calls (training, prefill), the K step still the dtype's
        tile = parse_tile(LINEAR_TILE_ENV, os.environ.get(LINEAR_TILE_ENV, ""))
    if tile is None:
        return base
    return replace(base, block_m=tile[0], block_n=tile[1], num_warps=tile[2], num_stages=tile[3])


DECODE_ROWS = 64
DECODE_TILE_ENV = "VERL_ASYNC_INVARIANT_DECODE_TILE"
LINEAR_TILE_ENV = "VERL_ASYNC_INVARIANT_LINEAR_TILE"  # the tile of calls of more rows (default: MatmulConfig's)
DECODE_TILE = "16,64,4,4"  # BLOCK_M, BLOCK_N, num_warps, num_stages of a call of <= DECODE_ROWS rows


def decode_tile() -> Optional[tuple[int, int, int, int]]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of decode-sized calls: VERL_ASYNC_INVARIANT_DECODE_TILE
    (default DECODE_TILE; "off": the default tile for every row count). Engine and trainer read one environment."""
    return parse_tile(DECODE_TILE_ENV, os.environ.get(DECODE_TILE_ENV, DECODE_TILE))


@functools.cache
def parse_tile(name: str, spec: str) -> Optional[tuple[int, int, int, int]]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) from the value `spec` of environment variable `name`; None for
    "off" (or empty); a bad value is refused naming the variable."""
    if spec.strip().lower() in ("", "0", "off", "none"):
        return None
    try:
        bm, bn, warps, stages = (int(v) for v in spec.split(","))
    except ValueError:
        raise ValueError(f"{name}={spec!r}: want BLOCK_M,BLOCK_N,num_warps,num_stages or off") from None
    if min(bm, bn) < 16 or bm & (bm - 1) or bn & (bn - 1) or warps not in (1, 2, 4, 8) or stages < 1:
        raise ValueError(f"{name}={spec!r}: blocks must be powers of two >= 16, warps 1/2/4/8, stages >= 1")
    return bm, bn, warps, stages


USE_ENV = "VERL_ASYNC_INVARIANT_TRITON"


def use_triton(device: torch.device) -> bool:
    """Whether `ops` takes the Triton kernels on `device`: CUDA, triton importable, not turned off by
    VERL_ASYNC_INVARIANT_TRITON=0. Engine and trainer decide alike in one environment, so their bits still match."""
    return device.type == "cuda" and os.environ.get(USE_ENV, "1") != "0" and _importable()


@functools.cache
def _importable() -> bool:
    """triton is installed (found, not imported: `shapes.worker_env` asks at start-up, and an import then would fix
    Triton's interpreter setting before a test can choose it; a broken install fails at the first kernel, named)."""
    return importlib.util.find_spec("triton") is not None


def triton_problem(device: torch.device | str) -> Optional[str]:
    """Why the Triton kernels cannot run on `device` in this process, or None."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton is not importable ({e}); install it (pip install triton) or turn true_on_policy off"
    kind = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    if kind == "cuda":
        return None
    if kind == "cpu" and os.environ.get(INTERPRET_ENV) == "1":
        import triton.language as tl

        if type(tl.zeros).__name__ != "InterpretedFunction":  # triton's own @jit helpers were built for a GPU
            return (f"triton was imported before {INTERPRET_ENV}=1 was set; set it before triton's first import "
                    f"(a fresh process) to run the kernels on CPU")
        return None
    return f"the Triton kernels run on CUDA (or on CPU under {INTERPRET_ENV}=1), not on {kind!r}"


@functools.cache
def _kernels():
    from verl_async.invariant import _triton_kernels

    return _triton_kernels


def _check(name: str, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    if x.dtype not in _DTYPES:
        raise TypeError(f"{name}: input dtype {x.dtype} is not one of {_DTYPES}")
    for label, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name}: {label} is on {t.device}, the input on {x.device}")
    problem = triton_problem(x.device)
    if problem is not None:
        raise RuntimeError(f"{name}: {problem}")


def linear_forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                   config: Optional[MatmulConfig] = None, add_to: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`x @ weight.T (+ bias)` in one launch, each row's bits independent of the other rows (x's leading dims are
    rows). `config`: only for experiments (the default is `matmul_config` of the weight). `add_to` (a contiguous
    tensor of the output's shape and dtype): the result is added into it in place, with the bits of
    `add_to + linear(x)` (the decode step's residual add, one launch fewer); returns `add_to`."""
    _check("triton linear", x, weight, bias)
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"triton linear: input [..., {x.shape[-1]}] does not fit weight {tuple(weight.shape)}")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise TypeError(f"triton linear: input {x.dtype}, weight {weight.dtype}, bias "
                        f"{None if bias is None else bias.dtype}: one dtype expected")
    n_out, k = weight.shape
    x2d = x.reshape(-1, k)
    m = x2d.shape[0]
    cfg = config or matmul_config(n_out, k, weight.dtype, m)
    if add_to is None:
        result = torch.empty((*x.shape[:-1], n_out), dtype=x.dtype, device=x.device)  # not a view: FSDP2 hooks it
    elif add_to.shape != (*x.shape[:-1], n_out) or add_to.dtype != x.dtype or not add_to.is_contiguous():
        raise ValueError(f"triton linear: add_to {add_to.dtype} {tuple(add_to.shape)} (contiguous: "
                         f"{add_to.is_contiguous()}) is not the output's {x.dtype} {(*x.shape[:-1], n_out)}")
    else:
        result = add_to
    out = result.view(m, n_out)
    if m > 0 and n_out > 0:
        interpreted = x.device.type == "cpu"  # (CPU runs only under the interpreter: triton_problem)
        grid = (-(-m // cfg.block_m) * -(-n_out // cfg.block_n),)
        _kernels().linear_kernel[grid](
            x2d, weight, bias if bias is not None else weight, out, m, n_out, k,
            x2d.stride(0), x2d.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
            HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32 or interpreted,
            UPCAST=interpreted and x.dtype != torch.float32,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            ADD_TO_OUT=add_to is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return result


def norm_block(hidden: int) -> tuple[int, int]:
    """(BLOCK, num_warps) of the RMSNorm kernel for rows of `hidden` elements: a function of `hidden` only."""
    block = min(1 << max(hidden - 1, 1).bit_length(), 4096)
    return block, (4 if block <= 1024 else 8)


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Llama/Qwen RMSNorm (as `ops.rms_norm`), one program per row with a fixed reduction order."""
    _check("triton rms_norm", x, weight, None)
    h = x.shape[-1]
    if weight.shape != (h,):
        raise ValueError(f"triton rms_norm: weight {tuple(weight.shape)} does not fit rows of {h}")
    x2d = x.reshape(-1, h)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    m = x2d.shape[0]
    result = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    out = result.view(m, h)
    if m > 0:
        block, warps = norm_block(h)
        _kernels().rms_norm_kernel[(m,)](x2d, weight.contiguous(), out, m, h, x2d.stride(0), out.stride(0),
                                         float(eps), BLOCK=block, LOG_BLOCK=block.bit_length() - 1, num_warps=warps)
    return result


def _plain_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return weight * (h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class _Linear(torch.autograd.Function):
    """Forward: the invariant kernel; backward: whole-tensor GEMMs (a gradient need not match anything bitwise)."""

    @staticmethod
    def forward(ctx, x, weight, bias):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return linear_forward(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        g2d = grad.reshape(-1, grad.shape[-1])
        gx = (g2d @ weight).view_as(x) if ctx.needs_input_grad[0] else None
        gw = g2d.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        gb = g2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb


class _RMSNorm(torch.autograd.Function):
    """Forward: the invariant kernel; backward: autograd through the plain torch formula."""

    @staticmethod
    def forward(ctx, x, weight, eps):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return rms_norm_forward(x, weight, eps)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            xd, wd = x.detach().requires_grad_(), weight.detach().requires_grad_()
            gx, gw = torch.autograd.grad(_plain_rms_norm(xd, wd, ctx.eps), (xd, wd), grad)
        return (gx if ctx.needs_input_grad[0] else None), (gw if ctx.needs_input_grad[1] else None), None


def _wants_grad(*ts: Optional[torch.Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`F.linear` with a batch-invariant forward (and a plain backward when autograd records)."""
    if _wants_grad(x, weight, bias):
        return _Linear.apply(x, weight, bias)
    return linear_forward(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF RMSNorm with a batch-invariant forward (and a plain backward when autograd records)."""
    if _wants_grad(x, weight):
        return _RMSNorm.apply(x, weight, eps)
    return rms_norm_forward(x, weight, eps)
