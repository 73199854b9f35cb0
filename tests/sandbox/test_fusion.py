"""SandboxFusion's run_code API both ways: the wire format, the built-in server on loopback, verl's clients.

The server is started as users start it (`python -m verl_async.sandbox.server --port P`) and
verl's tool config (`verl.tools.sandbox_fusion_tools.SandboxFusionTool`) and ReTool's
(`recipe/retool/sandbox_fusion_tool_config.yaml`) are pointed at it.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest
import requests

from tests.sandbox_server import free_port
from verl_async.sandbox import SandboxResult
from verl_async.sandbox.client import call_run_code, call_run_code_sync, service_problem
from verl_async.sandbox.fusion import RequestError, parse_request, request_payload, response_for

REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ the wire format (pure)
def test_requests_are_checked_as_sandboxfusion_checks_them():
    ok = parse_request(request_payload("print(1)", stdin="x", run_timeout=3, compile_timeout=3, memory_limit_mb=-1))
    assert (ok.code, ok.stdin, ok.run_timeout, ok.memory_limit_mb, ok.language) == ("print(1)", "x", 3.0, -1, "python")
    for body, field in [([], "body"), ({"language": "python"}, "code"), ({"code": "1", "language": "cobol"}, "language"),
                        ({"code": "1", "language": "python", "run_timeout": "10"}, "run_timeout"),
                        ({"code": "1", "language": "python", "stdin": 5}, "stdin")]:
        with pytest.raises(RequestError, match=f"^{field}:"):
            parse_request(body)


@pytest.mark.parametrize("result, status, run", [
    (SandboxResult("42\n", "", exit_code=0, duration_s=0.5), "Success",
     {"status": "Finished", "return_code": 0, "stdout": "42\n", "stderr": ""}),
    (SandboxResult("", "Traceback...\n", exit_code=1), "Failed", {"status": "Finished", "return_code": 1}),
    (SandboxResult("", "", exit_code=-9, signal_name="SIGKILL"), "Failed", {"status": "Finished", "return_code": -9}),
    (SandboxResult("part", "", timed_out=True, duration_s=2.0), "Failed",
     {"status": "TimeLimitExceeded", "return_code": None, "stdout": "part"}),
])
def test_responses_say_what_sandboxfusion_says(result, status, run):
    response = response_for(result)
    assert response["status"] == status and response["compile_result"] is None and response["files"] == {}
    assert {k: response["run_result"][k] for k in run} == run


def test_a_sandbox_failure_is_a_sandbox_error():
    response = response_for(SandboxResult("", "", sandbox_error="it ended without a result"))
    assert response == {"status": "SandboxError", "message": "it ended without a result", "compile_result": None,
                        "run_result": None, "executor_pod_name": None, "files": {}}


# ------------------------------------------------------------------ the real server on loopback
def test_verls_payload_runs_with_stdin_and_separate_streams(server):
    """The exact request verl's call_sandbox_api sends (json.dumps body, its headers)."""
    payload = json.dumps(request_payload("import sys\nname = input()\nprint('hi', name)\nprint('e', file=sys.stderr)",
                                         stdin="ada\n", run_timeout=10, compile_timeout=10, memory_limit_mb=1024))
    reply = requests.post(server, data=payload, timeout=30,
                          headers={"Content-Type": "application/json", "Accept": "application/json"}).json()
    assert reply["status"] == "Success" and reply["compile_result"] is None
    run = reply["run_result"]
    assert (run["status"], run["return_code"], run["stdout"], run["stderr"]) == ("Finished", 0, "hi ada\n", "e\n")


def test_failures_timeouts_and_unserved_languages(server):
    failed, _ = call_run_code_sync(server, "raise SystemExit(3)")
    assert failed["status"] == "Failed" and failed["run_result"]["return_code"] == 3
    slow, _ = call_run_code_sync(server, "import time\ntime.sleep(30)", run_timeout=1)
    assert slow["status"] == "Failed" and slow["run_result"]["status"] == "TimeLimitExceeded"
    cpp, _ = call_run_code_sync(server, "int main() {}", language="cpp")
    assert cpp["status"] == "SandboxError" and "python only" in cpp["message"]
    bad = requests.post(server, json={"code": 1, "language": "python"}, timeout=10)
    assert bad.status_code == 422 and bad.json()["detail"].startswith("code:")


def test_the_server_runs_in_the_os_sandbox(server):
    reply, _ = call_run_code_sync(server, "import os\nprint(os.getuid(), sorted(os.listdir('/')))")
    assert reply["run_result"]["stdout"].startswith("65534 ") and "'proc'" not in reply["run_result"]["stdout"]
    net, _ = call_run_code_sync(server, f"import socket\nsocket.create_connection(('127.0.0.1', {server.split(':')[2].split('/')[0]}), 2)")
    assert net["status"] == "Failed" and "Network is unreachable" in net["run_result"]["stderr"]


def test_async_client_and_concurrent_requests(server):
    async def three():
        t0 = time.monotonic()
        replies = await asyncio.gather(*(call_run_code(server, "import time\ntime.sleep(0.6)\nprint('ok')")
                                         for _ in range(3)))
        return replies, time.monotonic() - t0

    replies, elapsed = asyncio.run(three())
    assert [r[0]["run_result"]["stdout"] for r in replies] == ["ok\n"] * 3
    assert elapsed >= 1.2  # --max-concurrent 2: the third waited for a slot


def test_verls_sandbox_fusion_tool_config_runs_against_it(server, tmp_path):
    from verl_async.tools import load_all_tools

    config = tmp_path / "tools.yaml"
    config.write_text(f"""
tools:
  - class_name: verl.tools.sandbox_fusion_tools.SandboxFusionTool
    config: {{sandbox_fusion_url: "{server}", num_workers: 4, rate_limit: 4, default_timeout: 10,
             default_language: python, memory_limit_mb: 512, enable_global_rate_limit: true, type: native}}
    tool_schema:
      type: function
      function:
        name: code_interpreter
        description: A tool for executing code.
        parameters: {{type: object, properties: {{code: {{type: string, description: code}}}}, required: [code]}}
""")
    tool = load_all_tools(str(config), None)["code_interpreter"]

    async def go():
        instance, _ = await tool.create()
        out = await tool.execute(instance, {"code": "print(2 ** 10)"})
        slow = await tool.execute(instance, {"code": "import time\ntime.sleep(5)", "timeout": 1})
        await tool.release(instance)
        return out, slow

    (response, _, metrics), (slow, _, _) = asyncio.run(go())
    assert response.text == "1024\n" and metrics["success"] is True
    assert slow.text == "no stdout here"  # verl's words for a run that did not finish


def test_retools_tool_config_runs_in_the_agent_loop(server, tmp_path):
    """recipe/retool/sandbox_fusion_tool_config.yaml as shipped (only the port differs) in a whole trajectory."""
    from tests.agent_fakes import call
    from tests.test_agent_loop import build, run, segments
    from verl_async.tools import load_all_tools

    text = (REPO / "recipe/retool/sandbox_fusion_tool_config.yaml").read_text()
    assert "http://localhost:8080/run_code" in text
    config = tmp_path / "retool.yaml"
    config.write_text(text.replace("http://localhost:8080/run_code", server))
    tools = load_all_tools(str(config), None)
    assert type(tools["code_interpreter"]).__name__ == "CustomSandboxFusionTool"
    code = "Let me check.\n```python\nx = sum(range(10))\nx * 2\n```"
    ro, loop, _, sink = build(lambda u, i, t, c: [call("code_interpreter", code=code), "done"][t],
                              list(tools.values()), budget=1000)
    run(ro, timeout=60)
    answers = "".join(t for m, t in segments(sink.groups[0].responses[0]) if m == 0)
    assert "\n90\n" in answers  # ReTool prints the last line: print(x * 2)
    assert loop.stats.metrics()["multi_turn/tool_success_rate"] == 1.0


def test_no_service_is_refused_in_one_line(tmp_path):
    from verl_async.tools import ToolLoadError, load_all_tools

    url = f"http://127.0.0.1:{free_port()}/run_code"
    problem = service_problem(url, "config.sandbox_fusion_url", timeout_s=3)
    assert problem.startswith(f"config.sandbox_fusion_url={url}: no SandboxFusion service runs code there")
    assert "python -m verl_async.sandbox.server" in problem and "\n" not in problem
    config = tmp_path / "tools.yaml"
    config.write_text(f"""
tools:
  - class_name: verl.tools.sandbox_fusion_tools.SandboxFusionTool
    config: {{sandbox_fusion_url: "{url}", type: native}}
    tool_schema: {{type: function, function: {{name: code_interpreter, description: d}}}}
""")
    with pytest.raises(ToolLoadError, match="no SandboxFusion service runs code there"):
        load_all_tools(str(config), None)
