"""SandboxFusion's `run_code` API (bytedance/SandboxFusion, sandbox/server/sandbox_api.py): the wire format.

Request (POST /run_code, JSON):

    {"code": str, "language": "python", "stdin": str | null, "run_timeout": s, "compile_timeout": s,
     "memory_limit_MB": int (-1: the server's default), "files": {path: base64}, "fetch_files": [path]}

Response:

    {"status": "Success" | "Failed" | "SandboxError", "message": str,
     "compile_result": null, "run_result": {"status": "Finished" | "TimeLimitExceeded" | "Error",
        "execution_time": s, "return_code": int | null, "stdout": str, "stderr": str},
     "executor_pod_name": null, "files": {}}

`Success`: the run finished with return code 0; `Failed`: a time limit or a non-zero return
code (a signal's death is a negative code, as SandboxFusion's subprocess reports it);
`SandboxError`: the sandbox itself failed. This server runs Python only (SandboxFusion's
`python` language: `python file.py`, no value echoed); `files` and `fetch_files` must be
empty. Everything here is pure: the server and the tests use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from verl_async.sandbox.limits import SandboxLimits, SandboxResult

# SandboxFusion's Language literal (sandbox/runners/types.py): accepted in a request, only python runs here
LANGUAGES = ("python", "cpp", "nodejs", "go", "go_test", "java", "php", "csharp", "bash", "typescript", "sql",
             "rust", "cuda", "lua", "R", "perl", "D_ut", "ruby", "scala", "julia", "pytest", "junit",
             "kotlin_script", "jest", "verilog", "python_gpu", "lean", "swift", "racket")
SERVED = ("python",)


class RequestError(ValueError):
    """A request that does not follow the API (HTTP 422, as SandboxFusion's FastAPI answers it)."""


@dataclass(frozen=True)
class RunCodeRequest:
    code: str
    language: str
    stdin: Optional[str] = None
    run_timeout: float = 10.0
    compile_timeout: float = 10.0
    memory_limit_mb: int = -1
    files: dict = field(default_factory=dict)
    fetch_files: tuple = ()


def parse_request(body: Any) -> RunCodeRequest:
    """The request, checked as SandboxFusion's pydantic model checks it (RequestError names the field)."""
    if not isinstance(body, dict):
        raise RequestError("body: expected a JSON object")
    if not isinstance(body.get("code"), str):
        raise RequestError("code: required, a string")
    language = body.get("language")
    if language not in LANGUAGES:
        raise RequestError(f"language: {language!r} is not one of SandboxFusion's languages")
    stdin = body.get("stdin")
    if stdin is not None and not isinstance(stdin, str):
        raise RequestError("stdin: expected a string or null")
    numbers = {}
    for key, default in (("run_timeout", 10.0), ("compile_timeout", 10.0), ("memory_limit_MB", -1)):
        value = body.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise RequestError(f"{key}: expected a number, got {value!r}")
        numbers[key] = value
    files, fetch = body.get("files") or {}, body.get("fetch_files") or []
    if not isinstance(files, dict) or not isinstance(fetch, list):
        raise RequestError("files: expected an object; fetch_files: expected a list")
    return RunCodeRequest(code=body["code"], language=language, stdin=stdin, run_timeout=float(numbers["run_timeout"]),
                          compile_timeout=float(numbers["compile_timeout"]),
                          memory_limit_mb=int(numbers["memory_limit_MB"]), files=dict(files), fetch_files=tuple(fetch))


def unsupported(request: RunCodeRequest) -> Optional[str]:
    """Why this server cannot run the request (answered as SandboxError), or None."""
    if request.language not in SERVED:
        return f"language {request.language!r} is not served by verl_async's sandbox (python only)"
    if request.files or request.fetch_files:
        return "files and fetch_files are not supported by verl_async's sandbox"
    if request.run_timeout <= 0:
        return f"run_timeout must be > 0, got {request.run_timeout}"
    return None


def limits_for(request: RunCodeRequest, base: SandboxLimits) -> SandboxLimits:
    """The server's limits with the request's time and memory (memory_limit_MB <= 0: the server's own)."""
    from dataclasses import replace

    memory = request.memory_limit_mb if request.memory_limit_mb > 0 else base.memory_mb
    return replace(base, wall_time_s=request.run_timeout, cpu_time_s=max(1, math.ceil(request.run_timeout)),
                   memory_mb=memory)


def sandbox_error(message: str) -> dict:
    return {"status": "SandboxError", "message": message, "compile_result": None, "run_result": None,
            "executor_pod_name": None, "files": {}}


def response_for(result: SandboxResult) -> dict:
    """A SandboxFusion response for one run."""
    if result.sandbox_error:
        return sandbox_error(result.sandbox_error)
    stderr = result.stderr
    return_code = result.exit_code
    if result.truncated:  # SandboxFusion has no output cap; ours kills the run: a failed run that says why
        stderr += "\n[verl_async sandbox: output limit reached; the process was killed]"
        return_code = -9
    run_status = "TimeLimitExceeded" if result.timed_out else "Finished"
    run_result = {"status": run_status, "execution_time": round(result.duration_s, 6),
                  "return_code": None if result.timed_out else return_code,
                  "stdout": result.stdout, "stderr": stderr}
    status = "Success" if run_status == "Finished" and return_code == 0 else "Failed"
    return {"status": status, "message": "", "compile_result": None, "run_result": run_result,
            "executor_pod_name": None, "files": {}}


def request_payload(code: str, *, stdin: Optional[str], run_timeout: float, compile_timeout: float,
                    memory_limit_mb: int, language: str = "python") -> dict:
    """The body verl's client sends (verl/utils/reward_score/sandbox_fusion/utils.py, call_sandbox_api)."""
    return {"compile_timeout": compile_timeout, "run_timeout": run_timeout, "code": code, "stdin": stdin,
            "memory_limit_MB": memory_limit_mb, "language": language, "files": {}, "fetch_files": []}


def output_of(response: Optional[dict]) -> tuple[Optional[str], str, Optional[int]]:
    """(run status, stdout + stderr, return code) of a response; (None, "", None) when it has no run."""
    run = (response or {}).get("run_result") or {}
    if not run:
        return None, "", None
    return run.get("status"), (run.get("stdout") or "") + (run.get("stderr") or ""), run.get("return_code")
