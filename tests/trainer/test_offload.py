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
    assert p.device.type == "cpu" and all(v.device.type == "cpu" for v in opt.state[p].values() if v.dim())
    assert opt.state[p]["step"].device == before["step"].device  # where this Adam keeps it (host unless fused)
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



def test_scalar_state_stays_and_the_rest_moves():
    state = {"step": torch.tensor(3.0), "exp_avg": torch.ones(4), "note": "kept"}
    offload.move_state([state], "meta")  # "meta" shows a move without a GPU
    assert state["step"].device.type == "cpu" and state["exp_avg"].device.type == "meta" and state["note"] == "kept"


def test_views_of_the_model_buffer_are_not_the_optimizers_to_move():
    """Megatron's distributed optimizer holds fp32 model params as views of DDP's buffer (issue 15)."""
    buffer = torch.arange(8, dtype=torch.float32)
    view = torch.nn.Parameter(buffer.view(-1)[2:6])  # shares the buffer's storage
    main = torch.nn.Parameter(torch.zeros(3))  # an fp32 main copy the optimizer owns
    # a dtype stands in for the device (a parameter's .data cannot change device type on CPU)
    moved = offload.move_params([view, main], torch.float64, model_storages=offload.storage_ptrs([buffer]))
    assert moved == 1 and main.dtype == torch.float64 and view.dtype == torch.float32
    assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()  # still the model's


def test_a_freed_storage_is_skipped_not_read():
    """Reading a CUDA storage resized to 0 was the `invalid argument`: such a tensor is never copied."""
    buffer = torch.arange(8, dtype=torch.float32)
    view = buffer.view(-1)[2:6]
    buffer.untyped_storage().resize_(0)
    assert offload.move_params([view], torch.float64) == 0 and view.dtype == torch.float32
