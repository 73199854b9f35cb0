"""Shared fixtures: one Ray instance per test session, hardware markers that skip cleanly.

How the suite stays fast (issue 39; `.ci/run` has a time budget of 12 minutes on 2 cores):

- `ray_session`: one local Ray per test process (per xdist worker). `pipeline.run` joins it instead
  of starting and stopping its own (~8 s each); so does the entry point run in this process.
- `tests/entry_point.py` `run_main(args)`: `python -m recipe.fully_async_main ARGS` in the test
  process (exit status, stdout, stderr as a subprocess's). Keep a subprocess only where the process
  is the claim (a kill, a signal, what it imported, an environment it must start without).
- A shared run: a module-scoped fixture that runs the pipeline once, and several tests that assert
  on its outputs (`tests/test_pipeline_integration.py` `sync_run`, `async_run`): a new claim on a
  config an existing run already has goes there, not into a run of its own.
- Parallel workers: `.ci/run` runs each step with `-n 2 --dist loadscope` (pytest-xdist): one worker
  runs a whole module, so its module-scoped fixtures (shared runs) are built once; the tests of a
  class are a unit of their own, so a module with several independent expensive runs can spread
  them over both workers by putting each group in a class. (`--dist loadgroup` does not group under
  pytest 9.2 with pytest-xdist 3.8: xdist renames a node id pytest no longer lets it rename.)
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# true on-policy mode's cuBLAS settings where its CUDA numbers come from cuBLAS (no triton; verl_async/invariant/
# shapes.py; CPU needs none), read when cuBLAS starts: set before this process runs its first GEMM; Ray workers
# started by these tests inherit them. With triton none are set: the GPU tests then check that none are needed.
from verl_async.invariant.shapes import worker_env  # noqa: E402

for _name, _value in worker_env("cuda").items():
    os.environ.setdefault(_name, _value)
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def _has_module(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # parent package missing (e.g. "megatron" for "megatron.core")
        return False


def pytest_collection_modifyitems(config, items):
    skips = {
        "gpu": (torch.cuda.is_available(), "needs a CUDA GPU"),
        "multigpu": (torch.cuda.device_count() >= 2, "needs >= 2 CUDA GPUs"),
        "npu": (_has_module("torch_npu"), "needs torch_npu and an Ascend NPU"),
        "vllm": (_has_module("vllm"), "needs vllm"),
        "megatron": (_has_module("megatron.core"), "needs megatron-core"),
    }
    for item in items:
        for mark, (ok, why) in skips.items():
            # markers, not item.keywords: keywords also hold directory names (a checkout named "gpu" skipped all)
            if item.get_closest_marker(mark) is not None and not ok:
                item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole test session (small: fractional-CPU actors only)."""
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(
            address="local",  # never a cluster another test's `ray start` (ray.cluster_utils) left on the machine
            num_cpus=4,
            include_dashboard=False,
            log_to_driver=False,
            ignore_reinit_error=True,
            runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}},
        )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A random tiny Qwen2 + byte tokenizer, built once per session."""
    from verl_async.models.tiny import build_tiny_model_dir

    return build_tiny_model_dir(str(tmp_path_factory.mktemp("tiny_model")))
