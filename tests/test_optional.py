"""The one resolver of optional heavy dependencies: one error naming the config key and the install line."""

from __future__ import annotations

import asyncio
import sys

import pytest

from verl_async.optional import MEGATRON, VLLM, MissingDependencyError, OptionalDependency, require


def test_an_installed_module_is_returned():
    dep = OptionalDependency("json", "some.key=x", "pip install x")
    assert require(dep) is sys.modules["json"]
    assert require(dep, "json.decoder") is sys.modules["json.decoder"]


@pytest.mark.parametrize("dep,line", [
    (VLLM, "actor_rollout_ref.rollout.name=vllm needs vllm: pip install 'verl_async[vllm]'"),
    (MEGATRON, "actor_rollout_ref.actor.strategy=megatron needs megatron.core: pip install 'verl_async[megatron]'"),
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
