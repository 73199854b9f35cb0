"""The model stack imported in a background thread at a rank's or a replica's start (verl_async/utils/preimport.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from verl_async.utils.preimport import MODEL_STACK, BackgroundImport, model_modules


def test_the_model_family_modules_come_from_the_folders_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert model_modules(str(tmp_path)) == ["transformers.models.qwen2.configuration_qwen2",
                                            "transformers.models.qwen2.modeling_qwen2"]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "../x"}))  # never a path out of transformers
    assert model_modules(str(tmp_path)) == []
    (tmp_path / "config.json").write_text("{not json")
    assert model_modules(str(tmp_path)) == []
    assert model_modules(str(tmp_path / "absent")) == [] and model_modules(None) == []


def test_a_background_import_loads_the_modules_and_keeps_going_past_one_that_fails():
    job = BackgroundImport(["json", "no_such_module_here_xyz", "email.mime.text"])
    assert job.wait(60)
    assert job.failed == ["no_such_module_here_xyz"]
    assert "email.mime.text" in sys.modules


def test_the_model_stack_is_loaded_in_a_fresh_process_with_the_models_own_module(tiny_model_dir):
    """What a rank waits for as `model_imports`: transformers' modeling stack and the model's own module."""
    code = ("import json, sys; from verl_async.utils.preimport import import_model_stack\n"
            f"job = import_model_stack({str(tiny_model_dir)!r}, extra=('torch.distributed.fsdp',))\n"
            "done = job.wait(300)\n"
            "print(json.dumps([done, job.failed, list(job.modules), [m for m in job.modules if m not in sys.modules]]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    done, failed, modules, missing = json.loads(out.stdout.strip().splitlines()[-1])
    assert done and failed == [] and missing == []
    family = json.loads(open(os.path.join(tiny_model_dir, "config.json")).read())["model_type"]
    assert modules == [*MODEL_STACK, *model_modules(str(tiny_model_dir)), "torch.distributed.fsdp"]
    assert f"transformers.models.{family}.modeling_{family}" in modules
