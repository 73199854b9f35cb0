"""The one resolver of optional heavy dependencies: one error naming the config key and the install line."""

from __future__ import annotations

import asyncio
import sys

import pytest

from verl_async.optional import (MEGATRON, MINDSPEED, TORCH_NPU, VLLM, MissingDependencyError, OptionalDependency,
                                 require, try_import)


def test_an_installed_module_is_returned():
    dep = OptionalDependency("json", "some.key=x", "pip install x")
    assert require(dep) is sys.modules["json"]
    assert require(dep, "json.decoder") is sys.modules["json.decoder"]


@pytest.mark.parametrize("dep,line", [
    (VLLM, "actor_rollout_ref.rollout.name=vllm needs vllm: pip install 'verl_async[vllm]'"),
    (MEGATRON, "actor_rollout_ref.actor.strategy=megatron needs megatron.core: pip install 'verl_async[megatron]'"),
    (TORCH_NPU, "trainer.device=npu needs torch_npu: pip install 'verl_async[npu]' on an Ascend host"),
])
def test_a_missing_dependency_names_the_key_and_the_install_line(monkeypatch, dep, line):
    monkeypatch.setitem(sys.modules, dep.package, None)  # import fails as if it were not installed
    with pytest.raises(MissingDependencyError) as info:
        require(dep)
    assert str(info.value).startswith(line) and "\n" not in str(info.value)
    assert isinstance(info.value, ImportError)


def test_starting_a_vllm_engine_without_vllm_says_what_to_install(monkeypatch):
    from verl_async.rollout.vllm_engine import VLLMEngine

    monkeypatch.setitem(sys.modules, "vllm", None)
    engine = VLLMEngine({"model": "/no/model"})
    with pytest.raises(MissingDependencyError, match=r"^actor_rollout_ref\.rollout\.name=vllm needs vllm: pip install"):
        asyncio.run(engine.start())


def test_an_optional_improvement_is_none_when_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "mindspeed", None)
    assert try_import(MINDSPEED, "mindspeed.megatron_adaptor") is None
    assert try_import(OptionalDependency("json", "k=v", "pip install x")) is sys.modules["json"]


def test_npu_without_torch_npu_says_what_to_install(monkeypatch):
    from verl_async.trainer.megatron import device_shim
    from verl_async.utils import device

    monkeypatch.setitem(sys.modules, "torch_npu", None)
    device._import_torch_npu.cache_clear()
    with pytest.raises(device.DeviceUnavailableError, match=r"^trainer\.device=npu needs torch_npu: pip install"):
        device.resolve("npu")
    with pytest.raises(MissingDependencyError, match=r"^trainer\.device=npu needs torch_npu: pip install"):
        device_shim.prepare("npu")
