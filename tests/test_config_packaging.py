"""Packaging: the config ships with the wheel, the extras exist, a CPU install has no CUDA wheels."""

from __future__ import annotations

import importlib.metadata
import tomllib

import pytest
import torch

from verl_async.config.cli import REPO_ROOT


def _pyproject() -> dict:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())


def test_every_config_folder_is_packaged():
    data_files = _pyproject()["tool"]["setuptools"]["data-files"]
    folders = {p.parent.relative_to(REPO_ROOT).as_posix() for p in (REPO_ROOT / "config").rglob("*.yaml")}
    packaged = {pattern.rsplit("/", 1)[0] for patterns in data_files.values() for pattern in patterns}
    assert folders == packaged, f"add these folders to [tool.setuptools.data-files]: {sorted(folders - packaged)}"
    for target, patterns in data_files.items():
        assert all(target == "share/verl_async/" + p.rsplit("/", 1)[0] for p in patterns), target


def test_extras():
    extras = _pyproject()["project"]["optional-dependencies"]
    assert {"vllm", "megatron", "npu", "math", "test"} <= set(extras)
    assert any(d.startswith("megatron-core") for d in extras["megatron"])
    assert any(d.startswith("torch-npu") or d.startswith("torch_npu") for d in extras["npu"])


def test_cpu_torch_brings_no_cuda_wheels():
    if torch.version.cuda is not None:
        pytest.skip("a CUDA build of torch brings its CUDA wheels on purpose")
    cuda = sorted(d.metadata["Name"] for d in importlib.metadata.distributions() if d.metadata["Name"].lower().startswith("nvidia-"))
    assert cuda == [], f"CUDA wheels installed next to a CPU torch: {cuda}"
