"""verl_async/trainer/offload.py: optimizer state and owned parameters move and come back intact."""

from __future__ import annotations

import pytest
import torch

from verl_async.trainer import offload


def _stepped_adam(device: str) -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
    p = torch.nn.Parameter(torch.arange(6, dtype=torch.float32, device=device).reshape(2, 3))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.ones_like(p)
    opt.step()
    return p, opt


def _round_trip(device: str) -> None:
    p, opt = _stepped_adam(device)
    before = {k: v.clone() for k, v in opt.state[p].items()}
    value = p.detach().clone()
    offload.move_params([p], "cpu")
    offload.move_state(opt.state.values(), "cpu")
    assert p.device.type == "cpu" and all(v.device.type == "cpu" for v in opt.state[p].values())
    assert not p.data.is_pinned()  # blocking copies into pageable memory (no cudaHostAlloc)
    offload.move_params([p], device)
    offload.move_state(opt.state.values(), device)
    assert opt.param_groups[0]["params"][0] is p  # the optimizer still holds the same object
    torch.testing.assert_close(p.detach(), value)
    for key, v in before.items():
        torch.testing.assert_close(opt.state[p][key], v)
    p.grad = torch.ones_like(p)
    opt.step()  # and can step where it came back
    assert torch.isfinite(p).all()


def test_round_trip_on_cpu():
    _round_trip("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_round_trip_through_the_host_on_cuda():
    _round_trip("cuda")

