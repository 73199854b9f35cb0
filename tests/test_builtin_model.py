import json
import os

import pytest

from verl_async.config.resolvers import builtin_or
from verl_async.models import builtin as bm


def test_builtin_model_is_built_warm_started_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("VERL_ASYNC_CACHE", str(tmp_path))
    monkeypatch.setitem(bm.SPECS, "unit", bm.TinySpec(hidden_size=32, num_layers=1, sft_steps=3, sft_batch=4))
    path = bm.resolve_model_path("builtin://unit")
    assert path.startswith(str(tmp_path)) and os.path.exists(os.path.join(path, "model.safetensors"))
    report = json.load(open(os.path.join(path, "warmstart.json")))
    assert report["sft_steps"] == 3 and report["final_loss"] > 0
    stamp = os.path.getmtime(os.path.join(path, "model.safetensors"))
    assert bm.resolve_model_path("builtin://unit") == path  # cached: not rebuilt
    assert os.path.getmtime(os.path.join(path, "model.safetensors")) == stamp


def test_non_builtin_paths_pass_through_and_unknown_names_fail():
    assert bm.resolve_model_path("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    with pytest.raises(ValueError, match="actor_rollout_ref.model.path"):
        bm.resolve_model_path("builtin://huge")


def test_demo_values_only_for_builtin_models():
    assert builtin_or("builtin://tiny", 3e-4, 1e-6) == 3e-4
    assert builtin_or("/models/Qwen2.5-7B", 3e-4, 1e-6) == 1e-6


def test_default_config_keeps_verl_lr_for_real_models():
    from verl_async.config import compose

    assert compose(overrides=[]).actor_rollout_ref.actor.optim.lr == pytest.approx(3e-4)
    real = compose(overrides=["actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct"])
    assert real.actor_rollout_ref.actor.optim.lr == pytest.approx(1e-6)
    assert real.rollout.total_rollout_steps is None


def test_cached_folder_builds_once_in_private_and_keeps_a_concurrent_winner(tmp_path):
    from verl_async.utils.cache import cached_folder

    folder = str(tmp_path / "model")
    built = []

    def build(tmp):
        built.append(tmp)
        assert not os.path.exists(folder)  # nobody sees the folder before it is complete
        os.makedirs(tmp)
        open(os.path.join(tmp, "weights"), "w").close()
        with open(os.path.join(tmp, "done.json"), "w") as f:
            f.write("{}")

    assert cached_folder(folder, "done.json", build) == folder
    assert sorted(os.listdir(folder)) == ["done.json", "weights"] and built == [f"{folder}.tmp{os.getpid()}"]
    assert cached_folder(folder, "done.json", build) == folder and len(built) == 1  # cached: not rebuilt

    other = str(tmp_path / "raced")

    def build_while_another_process_wins(tmp):
        os.makedirs(tmp)
        os.makedirs(other)
        open(os.path.join(other, "theirs"), "w").close()

    assert cached_folder(other, "done.json", build_while_another_process_wins) == other
    assert os.listdir(other) == ["theirs"] and not os.path.exists(f"{other}.tmp{os.getpid()}")
