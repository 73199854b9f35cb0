"""How verl's `enforce_eager` maps onto the native engine: null (the default) leaves CUDA graphs to the device."""

from __future__ import annotations

import pytest

from verl_async.rollout.native import NativeEngine


@pytest.mark.parametrize("enforce_eager, cuda_graphs", [(None, None), (True, False), (False, True)])
def test_enforce_eager_maps_to_cuda_graphs(monkeypatch, enforce_eager, cuda_graphs):
    seen = {}

    def capture(self, model_path=None, **kwargs):
        seen.update(kwargs)

    monkeypatch.setattr(NativeEngine, "__init__", capture)
    NativeEngine.from_config({"max_num_seqs": 2, "max_model_len": 32, "enforce_eager": enforce_eager},
                             model_path="unused", device="cuda")
    # None: the engine's own default, graphs on CUDA (the fast path) and off elsewhere
    assert seen["cuda_graphs"] is cuda_graphs
