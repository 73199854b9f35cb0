"""verl_async.invariant.triton_ops (issue 41 item 2): a row's bits do not depend on how many rows share the launch
or where the row sits, and the values are those of torch's linear / HF's RMSNorm within float rounding.

Runs on CUDA when there is one, else on CPU under Triton's interpreter (TRITON_INTERPRET=1, set by
tests/triton_interpreter.py before triton's first import): on CPU it checks the kernels' tiling, masking and reduction order, not GPU numerics
(scripts/bench_invariant_triton.py checks those on a GPU). Skipped where triton is not installed."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.triton_interpreter import DEVICE, PREIMPORTED, ROOT, fresh_process_only, kernels, run_in_fresh_process
from tests.triton_interpreter import rand as _rand
from verl_async.invariant import triton_ops
from verl_async.invariant.ops import rms_norm as ops_rms_norm
from verl_async.invariant.triton_ops import MatmulConfig

pytest.importorskip("triton")

DTYPES = [torch.float32, torch.bfloat16]
# Small tiles, so that a handful of rows already spans several row tiles, column tiles (the last partial) and K steps
# (the last partial); the default config (128x128x64) is checked too.
SMALL = MatmulConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=4, num_stages=1)
CONFIGS = [pytest.param(SMALL, id="small-tiles"), pytest.param(None, id="default")]


def _batches_around(row: torch.Tensor, seed: int):
    """`row` alone, and among 6 and 63 random rows at the first, last and a middle position."""
    yield row[None], 0
    for n in (7, 64):
        for pos in (0, n // 2 + 1, n - 1):
            batch = _rand(n, row.shape[-1], dtype=row.dtype, seed=seed + n + pos)
            batch[pos] = row
            yield batch, pos


@kernels
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_row_bits_do_not_depend_on_the_batch(dtype, config):
    k, n_out = 40, 24  # K: 2 full 16-steps and a partial one; N: one full column tile and a partial one
    x = _rand(64, k, dtype=dtype, seed=0)
    w = _rand(n_out, k, dtype=dtype, seed=1)
    b = _rand(n_out, dtype=dtype, seed=2)
    full = triton_ops.linear_forward(x, w, b, config)
    for r in (17, 63):
        for batch, pos in _batches_around(x[r], seed=10 * r):
            got = triton_ops.linear_forward(batch, w, b, config)
            assert torch.equal(got[pos], full[r]), (r, batch.shape[0], pos)
    # a strided view (rows 1..8 of a bigger tensor: no longer 16-byte aligned), a 3-D input, no bias
    assert torch.equal(triton_ops.linear_forward(x[1:9], w, b, config), full[1:9])
    assert torch.equal(triton_ops.linear_forward(x.view(4, 16, k), w, b, config).view(64, n_out), full)
    no_bias = triton_ops.linear_forward(x, w, None, config)
    assert torch.equal(triton_ops.linear_forward(x[63:], w, None, config), no_bias[63:])
    assert not torch.equal(no_bias, full)


@kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_matches_torch(dtype):
    x = _rand(33, 200, dtype=dtype, seed=3)  # the default config: K = 3 full 64-steps + 8, a partial row tile
    w = _rand(150, 200, dtype=dtype, seed=4)  # a full 128-column tile and a partial one
    b = _rand(150, dtype=dtype, seed=5)
    got = triton_ops.linear_forward(x, w, b)
    assert got.dtype == dtype and got.shape == (33, 150)
    exact = F.linear(x.double(), w.double(), b.double())
    # float32: summation order only (|sum| <= ~sqrt(K) * 3); bfloat16: the output's rounding (2^-8 relative)
    tol = {torch.float32: dict(atol=1e-4, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=8e-3)}[dtype]
    torch.testing.assert_close(got.double(), exact, **tol)
    torch.testing.assert_close(got, F.linear(x, w, b), **tol)


@kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_calls_take_their_own_tile_and_the_same_bits(dtype, monkeypatch):
    """A call of <= DECODE_ROWS rows (a decode step) gets the decode tile, a longer one the default; a row's bits
    are the same either way (on a GPU: real tensor-core tiles of other shapes; K is walked in the same steps)."""
    base = triton_ops.matmul_config(576, 576, dtype)
    small = triton_ops.matmul_config(576, 576, dtype, rows=triton_ops.DECODE_ROWS)
    assert triton_ops.matmul_config(576, 576, dtype, rows=triton_ops.DECODE_ROWS + 1) == base
    assert (small.block_m, small.block_n, small.num_warps, small.num_stages) == (16, 64, 4, 4)
    assert small.block_k == base.block_k and small != base
    x = _rand(200, 600, dtype=dtype, seed=21)  # K: 9 full 64-steps and a partial one; N: 3 decode column tiles
    w, b = _rand(150, 600, dtype=dtype, seed=22), _rand(150, dtype=dtype, seed=23)
    full = triton_ops.linear_forward(x, w, b)  # the default tile
    for m in (1, 5, 16, 64):
        assert torch.equal(triton_ops.linear_forward(x[:m], w, b), full[:m]), m
        assert torch.equal(triton_ops.linear_forward(x[100 : 100 + m], w, b), full[100 : 100 + m]), m
    monkeypatch.setenv(triton_ops.DECODE_TILE_ENV, "off")
    assert triton_ops.matmul_config(576, 576, dtype, rows=1) == base
    monkeypatch.setenv(triton_ops.DECODE_TILE_ENV, "32,128,8,3")
    assert triton_ops.matmul_config(576, 576, dtype, rows=1) == replace(base, block_m=32, num_warps=8)
    monkeypatch.setenv(triton_ops.LINEAR_TILE_ENV, "128,256,8,4")  # the long calls' tile (experiments)
    assert triton_ops.matmul_config(576, 576, dtype, rows=65) == replace(base, block_n=256, num_stages=4)
    assert torch.equal(triton_ops.linear_forward(x, w, b), full)
    monkeypatch.setenv(triton_ops.DECODE_TILE_ENV, "16,48,4,4")
    with pytest.raises(ValueError, match="VERL_ASYNC_INVARIANT_DECODE_TILE='16,48,4,4': blocks must be powers"):
        triton_ops.matmul_config(576, 576, dtype, rows=1)


@kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_adding_into_the_residual_inside_the_launch_has_torchs_bits(dtype):
    """`add_to` (the engine's decode step: o_proj and down_proj add into the residual stream in their launch) gives
    `residual + linear(x)` bit for bit: the product rounded to the dtype, then the sum rounded, as torch's add."""
    x, w, b = _rand(70, 200, dtype=dtype, seed=31), _rand(150, 200, dtype=dtype, seed=32), _rand(150, dtype=dtype, seed=33)
    res = _rand(70, 150, dtype=dtype, seed=34) * 4
    for m in (1, 70):
        target = res[:m].clone()
        got = triton_ops.linear_forward(x[:m], w, b, add_to=target)
        assert got is target and torch.equal(got, res[:m] + triton_ops.linear_forward(x[:m], w, b)), m
    with pytest.raises(ValueError, match=r"add_to .* is not the output's"):
        triton_ops.linear_forward(x, w, b, add_to=res.t())


@kernels
def test_a_different_summation_order_changes_bits():
    """The equality checks above can fail: the same float32 product with K walked backwards (the same sums in
    another order) differs in some bits. (A wider K step is no such check: on a GPU `tl.dot` chains its products
    one k at a time into the accumulator, so 16- and 32-wide steps add in the same order.)"""
    x, w = _rand(64, 200, dtype=torch.float32, seed=6), _rand(24, 200, dtype=torch.float32, seed=7)
    a = triton_ops.linear_forward(x, w, None, SMALL)
    b = triton_ops.linear_forward(x.flip(1).contiguous(), w.flip(1).contiguous(), None, SMALL)
    torch.testing.assert_close(a, b)
    assert not torch.equal(a, b)


@kernels
@settings(max_examples=10, deadline=None)
@given(m=st.integers(1, 40), k=st.integers(1, 50), n_out=st.integers(1, 40), data=st.data())
def test_linear_rows_are_invariant_for_any_shape(m, k, n_out, data):
    x = _rand(m, k, dtype=torch.float32, seed=m * 1000 + k)
    w = _rand(n_out, k, dtype=torch.float32, seed=n_out)
    full = triton_ops.linear_forward(x, w, None, SMALL)
    lo = data.draw(st.integers(0, m - 1))
    hi = data.draw(st.integers(lo + 1, m))
    assert torch.equal(triton_ops.linear_forward(x[lo:hi], w, None, SMALL), full[lo:hi])
    torch.testing.assert_close(full, x @ w.T, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("hidden", [40, 5000])  # one 64-wide block; two 4096-wide chunks (the last partial)
@pytest.mark.parametrize("dtype", DTYPES)
@kernels
def test_rms_norm_row_bits_do_not_depend_on_the_batch(dtype, hidden):
    x = _rand(64, hidden, dtype=dtype, seed=8) * 3
    weight = _rand(hidden, dtype=dtype, seed=9)
    full = triton_ops.rms_norm_forward(x, weight, 1e-6)
    for r in (40, 63):
        for batch, pos in _batches_around(x[r], seed=20 * r):
            assert torch.equal(triton_ops.rms_norm_forward(batch, weight, 1e-6)[pos], full[r]), (r, len(batch), pos)
    tol = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}[dtype]  # bf16: normed and product each rounded
    torch.testing.assert_close(full, triton_ops._plain_rms_norm(x, weight, 1e-6), **tol)
    torch.testing.assert_close(full, ops_rms_norm(x, weight, 1e-6, None) if DEVICE == "cpu" else full, **tol)


@kernels
def test_gradients_are_those_of_the_plain_ops():
    x = _rand(5, 3, 40, dtype=torch.float32, seed=10).requires_grad_()
    w = _rand(24, 40, dtype=torch.float32, seed=11).requires_grad_()
    b = _rand(24, dtype=torch.float32, seed=12).requires_grad_()
    nw = _rand(40, dtype=torch.float32, seed=13).requires_grad_()
    g = _rand(5, 3, 24, dtype=torch.float32, seed=14)
    ours = triton_ops.linear(triton_ops.rms_norm(x, nw, 1e-6), w, b)
    plain = F.linear(triton_ops._plain_rms_norm(x, nw, 1e-6), w, b)
    torch.testing.assert_close(ours, plain)
    for a, p in zip(torch.autograd.grad(ours, (x, w, b, nw), g), torch.autograd.grad(plain, (x, w, b, nw), g)):
        torch.testing.assert_close(a, p)


@kernels
def test_bad_inputs_are_named():
    x = _rand(4, 8, dtype=torch.float32, seed=0)
    with pytest.raises(TypeError, match="weight torch.bfloat16"):
        triton_ops.linear_forward(x, _rand(3, 8, dtype=torch.bfloat16, seed=1))
    with pytest.raises(ValueError, match=r"input \[\.\.\., 8\] does not fit weight \(3, 7\)"):
        triton_ops.linear_forward(x, _rand(3, 7, dtype=torch.float32, seed=1))
    with pytest.raises(ValueError, match=r"weight \(7,\) does not fit rows of 8"):
        triton_ops.rms_norm_forward(x, _rand(7, dtype=torch.float32, seed=1), 1e-6)
    with pytest.raises(TypeError, match="torch.int64"):
        triton_ops.linear_forward(x.long(), _rand(3, 8, dtype=torch.float32, seed=1))


@kernels
def test_ops_take_the_kernels_where_use_triton_says_so(monkeypatch):
    """ops.linear / ops.rms_norm (what the engine and trainer call in true on-policy mode) run the Triton kernels
    when `use_triton` holds (on CUDA), return a tensor of their own (FSDP2 hooks module outputs, not views), and
    keep gradients; VERL_ASYNC_INVARIANT_TRITON=0 turns the path off."""
    from verl_async.invariant import ops

    monkeypatch.setattr(triton_ops, "use_triton", lambda device: True)  # CPU here: the interpreter stands in
    x = _rand(5, 40, dtype=torch.float32, seed=11).requires_grad_()
    w, b = _rand(24, 40, dtype=torch.float32, seed=12), _rand(24, dtype=torch.float32, seed=13)
    got = ops.linear(x, w, b, rows=256)
    assert torch.equal(got, triton_ops.linear_forward(x.detach(), w, b)) and got._base is None
    got.sum().backward()
    torch.testing.assert_close(x.grad, w.sum(0).expand(5, 40))
    norm_w = _rand(40, dtype=torch.float32, seed=14)
    normed = ops.rms_norm(x.detach(), norm_w, 1e-6, reduce_rows=1024)
    assert torch.equal(normed, triton_ops.rms_norm_forward(x.detach(), norm_w, 1e-6)) and normed._base is None
    monkeypatch.undo()
    monkeypatch.setenv(triton_ops.USE_ENV, "0")
    assert not triton_ops.use_triton(torch.device("cuda"))


def test_where_the_kernels_cannot_run(monkeypatch):
    monkeypatch.delenv(triton_ops.INTERPRET_ENV, raising=False)
    assert "not on 'cpu'" in triton_ops.triton_problem("cpu")
    assert triton_ops.triton_problem("cuda:0") is None


def test_the_cpu_path_does_not_import_triton():
    code = ("import sys, verl_async.invariant, verl_async.invariant.triton_ops, verl_async.invariant.model; "
            "assert 'triton' not in sys.modules, sorted(m for m in sys.modules if 'triton' in m)")
    env = {k: v for k, v in os.environ.items() if k != triton_ops.INTERPRET_ENV}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120, cwd=ROOT)


@fresh_process_only
def test_in_a_fresh_process():
    run_in_fresh_process(__file__)


def test_a_gpu_build_of_triton_is_refused_on_cpu():
    if not PREIMPORTED and DEVICE == "cpu":
        code = ("import triton, os; os.environ['TRITON_INTERPRET'] = '1'; "
                "from verl_async.invariant.triton_ops import triton_problem; print(triton_problem('cpu'))")
        env = {k: v for k, v in os.environ.items() if k != triton_ops.INTERPRET_ENV}
        out = subprocess.run([sys.executable, "-c", code], env=env, timeout=120, capture_output=True, text=True,
                             cwd=ROOT)
        assert "was imported before TRITON_INTERPRET=1" in out.stdout, out.stdout + out.stderr
    else:
        pytest.skip("checked in a fresh CPU process only")
