"""scripts/run_qwen2.5_0.5b_gsm8k_fully_async_npu.sh: the reference script's settings, NPU device, valid config.

No Ascend hardware here: the script's argv is compared with the adapted reference
script's, and its config is checked end to end (VERL_ASYNC_DRY_RUN=1) with the device
switched to CPU by an appended override.
"""

from __future__ import annotations

import subprocess
import sys

from verl_async.config.cli import REPO_ROOT

NPU_SCRIPT = REPO_ROOT / "scripts" / "run_qwen2.5_0.5b_gsm8k_fully_async_npu.sh"
REFERENCE = REPO_ROOT / "scripts" / "run_qwen2.5_0.5b_gsm8k_fully_async_reference.sh"
# Keys whose values name local paths / run names, and the two deliberate changes.
DIFFERENT = ("data.train_files", "data.val_files", "actor_rollout_ref.model.path", "trainer.experiment_name",
             "trainer.default_local_dir", "trainer.device", "actor_rollout_ref.rollout.name", "hydra.run.dir")


def _parquet(path) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = {"prompt": [{"role": "user", "content": "Natalia sold 48 clips. How many?"}], "data_source": "openai/gsm8k",
           "ability": "math", "reward_model": {"style": "rule", "ground_truth": "72"},
           "extra_info": {"split": "train", "index": 0}}
    pq.write_table(pa.Table.from_pylist([row] * 64), path)
    return str(path)


def _env(tmp_path, model_dir, python_body: str) -> dict:
    import os

    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    (bindir / "python").write_text("#!/bin/sh\n" + python_body + "\n")
    (bindir / "python").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_ASYNC_DRY_RUN", "PYTHON", "ROLLOUT_NAME")}
    env.update(PATH=f"{bindir}:{env.get('PATH', '/usr/bin:/bin')}", PYTHONPATH=str(REPO_ROOT),
               MODEL_PATH=model_dir, TRAIN_FILE=_parquet(tmp_path / "train.parquet"),
               TEST_FILE=_parquet(tmp_path / "test.parquet"), LOG_FILE=str(tmp_path / "log.txt"),
               CKPTS_DIR=str(tmp_path / "ckpts"), TRAINER_DEVICE="npu", TOKENIZERS_PARALLELISM="false")
    return env


def _overrides(script, env, tmp_path) -> dict[str, str]:
    out = tmp_path / f"argv_{script.stem}"
    capture = dict(env, ARGV_OUT=str(out))
    subprocess.run(["bash", str(script)], cwd=REPO_ROOT, env=capture, check=True, capture_output=True, timeout=60)
    args = [a for a in out.read_text().split("\0")[:-1] if "=" in a and not a.startswith("--")]
    return dict(a.lstrip("+").split("=", 1) for a in args)


def test_npu_script_keeps_the_reference_settings(tmp_path, tiny_model_dir):
    env = _env(tmp_path, tiny_model_dir, 'case "$1" in -c) exit 1;; esac; printf "%s\\0" "$@" > "$ARGV_OUT"')
    npu, ref = _overrides(NPU_SCRIPT, env, tmp_path), _overrides(REFERENCE, env, tmp_path)
    assert npu["trainer.device"] == "npu" and npu["actor_rollout_ref.rollout.name"] == "native"
    for key, value in ref.items():
        if key.startswith(DIFFERENT):
            continue
        assert key in npu, f"the NPU script drops {key}"
        assert npu[key].strip("'\"") == value.strip("'\""), f"{key}: {npu[key]} != {value}"


def test_npu_script_config_is_valid(tmp_path, tiny_model_dir):
    env = _env(tmp_path, tiny_model_dir, f'exec "{sys.executable}" "$@"')
    env["VERL_ASYNC_DRY_RUN"] = "1"
    proc = subprocess.run(["bash", str(NPU_SCRIPT), "trainer.device=cpu", f"hydra.run.dir={tmp_path / 'hydra'}"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rollout engine: native" in proc.stdout
    assert "megatron on 1x1 cpu" in proc.stdout and "dry run" in proc.stdout
