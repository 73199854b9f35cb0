"""verl_async.invariant.rope: the decode step's rotary kernel gives HF's `apply_rotary_pos_emb` bit for bit and
writes the new keys and values where the torch path writes them.

On CUDA natively (the GPU's roundings against torch's), on CPU under Triton's interpreter (tests/triton_interpreter.py:
the kernel's indexing, its cache writes and its explicit round-to-nearest-even). Skipped without triton."""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import DEVICE, fresh_process_only, kernels, rand, run_in_fresh_process  # before triton
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, rotate_half  # noqa: I001
from verl_async.invariant.rope import rope_into_cache, rope_problem

pytest.importorskip("triton")

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@kernels
@pytest.mark.parametrize("head_dim", [64, 24, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_kernel_has_hfs_bits(dtype, head_dim):
    assert rope_problem(apply_rotary_pos_emb, dtype, head_dim, torch.device(DEVICE)) is None


@kernels
def test_a_function_with_other_roundings_is_caught():
    def rounded_once(q, k, cos, sin, unsqueeze_dim=1):  # float32 inside, one rounding: not HF's bits in bf16
        c, s = cos.unsqueeze(unsqueeze_dim).float(), sin.unsqueeze(unsqueeze_dim).float()
        rot = [(t.float() * c + rotate_half(t.float()) * s).to(t.dtype) for t in (q, k)]
        return rot[0], rot[1]

    problem = rope_problem(rounded_once, torch.bfloat16, 64, torch.device(DEVICE))
    assert problem == "the rotary kernel's query differs from the model's apply_rotary_pos_emb in torch.bfloat16"


@kernels
def test_keys_and_values_land_at_each_rows_position_in_strided_caches():
    B, H, G, L, D = 3, 4, 2, 10, 16
    q, k, v = rand(B, H, D, dtype=torch.bfloat16, seed=0), rand(B, G, D, dtype=torch.bfloat16, seed=1), \
        rand(B, G, D, dtype=torch.bfloat16, seed=2)
    angle = torch.arange(B, dtype=torch.float32)[:, None, None] * torch.linspace(0.1, 1.0, D // 2)
    angle = torch.cat([angle, angle], -1).to(DEVICE)
    cos, sin = angle.cos().to(torch.bfloat16), angle.sin().to(torch.bfloat16)
    positions = torch.tensor([9, 0, 4], device=DEVICE)
    outs = []
    for kernel in (True, False):
        # caches of 5 slots, the first 3 rows in use (slot b = row b), as the engine's cache views are
        # and views into longer slots (strides not those of a [5, G, L, D] tensor)
        k_cache, v_cache = (torch.full((5, G, L + 3, D), 7.0, dtype=torch.bfloat16, device=DEVICE)[:, :, 2 : L + 2]
                            for _ in range(2))
        rq = rope_into_cache(q, k, v, cos, sin, positions, k_cache, v_cache, apply_rotary_pos_emb, use_kernel=kernel)
        outs.append((rq, k_cache, v_cache))
    (kq, kk, kv), (tq, tk, tv) = outs
    assert torch.equal(kq, tq) and torch.equal(kk, tk) and torch.equal(kv, tv)
    written = torch.zeros(5, L, dtype=torch.bool)
    written[[0, 1, 2], [9, 0, 4]] = True
    untouched = ~written.to(DEVICE)
    assert bool((kk.transpose(1, 2)[untouched] == 7.0).all()) and bool((kv.transpose(1, 2)[untouched] == 7.0).all())
    assert torch.equal(kv[torch.arange(B), :, positions], v)


@fresh_process_only
def test_in_a_fresh_process():
    run_in_fresh_process(__file__)
