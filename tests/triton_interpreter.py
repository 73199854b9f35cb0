"""Set-up shared by the Triton kernel tests (tests/test_invariant_triton*.py): import it before triton.

On CUDA the kernels run natively. On CPU they run under Triton's interpreter, which must be switched on
(TRITON_INTERPRET=1) before triton's first import: its own @jit helpers are built then. In a full-suite run another
module may have imported triton already (torch.compile does): then the kernel tests skip (`kernels`) and each file's
`run_in_fresh_process` test runs it again in a process of its own.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from verl_async.invariant import triton_ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PREIMPORTED = DEVICE == "cpu" and "triton" in sys.modules and os.environ.get(triton_ops.INTERPRET_ENV) != "1"
if DEVICE == "cpu" and not PREIMPORTED:
    os.environ[triton_ops.INTERPRET_ENV] = "1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

kernels = pytest.mark.skipif(PREIMPORTED, reason="triton was imported without the interpreter: see "
                                                 "test_in_a_fresh_process")
fresh_process_only = pytest.mark.skipif(not PREIMPORTED, reason="this process runs the kernel tests itself")


def rand(*shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)


def run_in_fresh_process(test_file: str, timeout: float = 240) -> None:
    """Run `test_file` under pytest in a new process with the interpreter on; fail with its output if it fails."""
    env = dict(os.environ, **{triton_ops.INTERPRET_ENV: "1"})
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(test_file)],
                          env=env, cwd=ROOT, timeout=timeout, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout, done.stdout[-500:]
