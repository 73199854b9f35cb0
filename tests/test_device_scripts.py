"""The device scripts count the GPUs the session may use as CUDA and Ray do (scripts/device/session.sh).

On a 2-GPU machine with CUDA_VISIBLE_DEVICES=0, `nvidia-smi -L` counts 2: real_model_gpu.sh chose the split layout
and the run waited for a second GPU that Ray never saw (issue 37, the start-up A/B of 2026-11-28).
"""

from __future__ import annotations

import os
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def visible_gpus(tmp_path, cuda_visible_devices, machine_gpus=2) -> int:
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    smi = fake / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + "".join(f"echo 'GPU {i}: NVIDIA H200 (UUID: GPU-{i})'\n"
                                           for i in range(machine_gpus)))
    smi.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["PATH"] = f"{fake}:{env['PATH']}"
    if cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
    out = subprocess.run(["bash", "-c", "source scripts/device/session.sh && visible_gpus"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip())


@pytest.mark.parametrize("value, count", [
    (None, 2), ("0", 1), ("1,0", 2), ("", 0), ("-1", 0),
    ("0,5,1", 1),  # CUDA stops at the first index the machine lacks
    ("GPU-482fedd7-4090-b7ec", 1), ("0, 1", 2), ("0,1,0,1", 2),
])
def test_visible_gpus_honours_cuda_visible_devices(tmp_path, value, count):
    assert visible_gpus(tmp_path, value) == count


def test_the_layout_choosing_scripts_count_with_it():
    for script in ("scale_gpu.sh", "real_model_gpu.sh", "v1_gpu.sh", "run_all_gpu.sh"):
        text = open(os.path.join(REPO, "scripts", "device", script)).read()
        assert "visible_gpus" in text and "nvidia-smi -L | wc -l" not in text and \
            "nvidia-smi -L 2>/dev/null | wc -l" not in text, script
