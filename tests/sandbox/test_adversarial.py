"""Model-written code as a hostile model would write it, through `PythonCodeTool` with its default config.

Each test runs its payload in tests/sandbox/harness.py (a process standing for the Rollouter,
with a token planted in its environment) and then checks from outside that nothing of the
host was read, written, signalled or left running. Escapes 1-4 of issue 36 each worked
against the interpreter the tool had before (a Python audit hook); the others are the
issue's list: loopback network, the checkpoint folder, /proc/1/environ, a fork bomb, a
memory bomb, a 10 GB file, the venv, the parent, leftovers.

These tests need the OS sandbox (nsjail, user namespaces). Where the machine cannot give
it they skip with the sandbox's own one-line reason; under CI (CI=true) they fail instead.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HARNESS = Path(__file__).with_name("harness.py")
TOKEN = "verl-async-secret-" + uuid.uuid4().hex


def _isolation_problem():
    try:
        from verl_async.sandbox import isolation_problem
    except ImportError:  # the interpreter before the OS sandbox: nothing to ask, run (and fail)
        return None
    return isolation_problem()


@pytest.fixture(autouse=True, scope="module")
def _needs_the_os_sandbox():
    problem = _isolation_problem()
    if problem and not os.environ.get("CI"):
        pytest.skip(f"no OS sandbox on this machine: {problem}")
    assert not problem, f"CI must run the adversarial suite, but: {problem}"


def attack(*codes: str, config: dict | None = None, timeout: float = 120) -> tuple[int, list[dict], str]:
    """(harness exit code, one result per code, harness stderr); the harness has TOKEN in its environment."""
    env = {**os.environ, "VERL_ASYNC_PLANTED_TOKEN": TOKEN, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(HARNESS), json.dumps({"codes": list(codes), "config": config or {}})],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    results = json.loads(lines[-1])["results"] if lines else []
    return proc.returncode, results, proc.stderr


def one(code: str, **kwargs) -> str:
    rc, results, err = attack(code, **kwargs)
    assert rc == 0 and len(results) == 1, f"the tool's process did not survive (exit {rc}): {err[-2000:]}"
    return results[0]["text"]


def processes_with(marker: str) -> list[int]:
    """Pids whose command line holds `marker` (this test's own processes excluded)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found


@pytest.fixture
def marker():
    """A unique word the payload puts in its processes' command lines; whatever still carries it is killed after."""
    mark = "verlasyncmark" + uuid.uuid4().hex[:12]
    yield mark
    for pid in processes_with(mark):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def gone_within(marker: str, seconds: float = 3.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = processes_with(marker)
        if not left:
            return []
        time.sleep(0.1)
    return processes_with(marker)


FORK_EXEC = textwrap.dedent('''
    import _posixsubprocess, os
    def spawn(cmd):
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        argv = [b"/bin/sh", b"-c", cmd.encode()]
        head = (argv, [b"/bin/sh"], True, (out_w,), None, None, -1, -1, -1, out_w, -1, out_w, err_r, err_w,
                False, True, -1, None, None, None)
        for tail in ((-1, None), (-1, None, False), (None,)):
            try:
                pid = _posixsubprocess.fork_exec(*head, *tail)
                break
            except TypeError:
                continue
        os.close(out_w)
        data = b""
        while chunk := os.read(out_r, 65536):
            data += chunk
        return data.decode(errors="replace")
''')


# ------------------------------------------------------------------ escapes 1-4 of the issue
def test_1_fork_exec_runs_no_shell_reads_nothing_and_leaves_nothing(marker):
    """_posixsubprocess.fork_exec raised no audit event: /bin/sh ran, read the repo and the parent's environ."""
    readme_line = (REPO / "README.md").read_text().splitlines()[0]
    code = FORK_EXEC + textwrap.dedent(f'''
        ppid = os.getppid()
        print(spawn("cat {REPO}/README.md; cat /proc/%d/environ; "
                    "for i in 1 2 3 4 5; do setsid sleep 30 {marker} & done" % ppid))
    ''')
    text = one(code)
    assert TOKEN not in text and readme_line not in text
    assert not gone_within(marker), "processes the snippet started outlived the call"


def test_2_a_file_written_through_a_directory_fd_stays_inside(tmp_path):
    """os.open(name, O_CREAT, dir_fd=<outside folder>) passed the path check (the hook saw only the name)."""
    site = Path(sysconfig.get_paths()["purelib"])
    name = f"verl_async_probe_{uuid.uuid4().hex}.pth"
    code = textwrap.dedent(f'''
        import os
        for folder in ({str(tmp_path)!r}, {str(site)!r}):
            try:
                fd = os.open(folder, os.O_RDONLY)
                w = os.open({name!r}, os.O_WRONLY | os.O_CREAT, dir_fd=fd)
                os.write(w, b"import os; os.environ['PWNED'] = '1'\\n")
                os.close(w)
                print("wrote into", folder)
            except OSError as e:
                print("refused", type(e).__name__)
    ''')
    try:
        text = one(code)
        assert not (tmp_path / name).exists() and not (site / name).exists(), text
    finally:
        for path in (tmp_path / name, site / name):
            if path.exists():
                path.unlink()


def test_3_the_parent_cannot_be_killed_by_any_means():
    """signal.pidfd_send_signal(os.pidfd_open(os.getppid()), SIGKILL) killed the process that called the tool."""
    codes = [
        "import os, signal\nsignal.pidfd_send_signal(os.pidfd_open(os.getppid()), signal.SIGKILL)",
        "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
        "import os, signal\nos.killpg(os.getpgid(os.getppid()), signal.SIGKILL)",
        FORK_EXEC + "print(spawn('kill -9 %d' % os.getppid()))",
        "import ctypes, os\nctypes.CDLL(None).kill(os.getppid(), 9)",
    ]
    rc, results, err = attack(*codes)
    assert rc == 0 and len(results) == len(codes), f"the parent died (exit {rc}): {err[-1000:]}"


def test_4_sqlite_shared_memory_and_native_modules_reach_nothing_outside(tmp_path):
    """sqlite3.connect(<outside>) made a file there; shm_open left one in /dev/shm; a native module read files."""
    outside = tmp_path / "made_by_sqlite.db"
    shm_name = f"verl_async_probe_{uuid.uuid4().hex[:8]}"
    code = textwrap.dedent(f'''
        import sqlite3
        try:
            sqlite3.connect({str(outside)!r}).execute("create table t (x)")
        except Exception as e:
            print("sqlite refused", type(e).__name__)
        try:
            import _posixshmem
            _posixshmem.shm_open("/{shm_name}", 0o102, 0o600)
        except Exception as e:
            print("shm refused", type(e).__name__)
    ''')
    try:
        one(code)
        assert not outside.exists()
        assert not Path("/dev/shm", shm_name).exists()
    finally:
        Path("/dev/shm", shm_name).unlink(missing_ok=True)


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler to build the native module")
def test_4_a_compiled_module_imported_from_the_working_folder_reads_no_host_file(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text(TOKEN)
    source = tmp_path / "reader.c"
    source.write_text(textwrap.dedent(f'''
        #include <Python.h>
        #include <stdio.h>
        static struct PyModuleDef def = {{PyModuleDef_HEAD_INIT, "reader", NULL, -1, NULL}};
        PyMODINIT_FUNC PyInit_reader(void) {{
            char buf[256] = "unread";
            FILE *f = fopen("{secret}", "r");
            if (f) {{ size_t n = fread(buf, 1, sizeof buf - 1, f); buf[n] = 0; fclose(f); }}
            PyObject *m = PyModule_Create(&def);
            PyModule_AddStringConstant(m, "content", buf);
            return m;
        }}
    '''))
    so = tmp_path / "reader.so"
    include = sysconfig.get_paths()["include"]
    subprocess.run(["cc", "-shared", "-fPIC", f"-I{include}", str(source), "-o", str(so)], check=True,
                   capture_output=True)
    blob = base64.b64encode(so.read_bytes()).decode()
    code = textwrap.dedent(f'''
        import base64, sys
        open("reader.so", "wb").write(base64.b64decode({blob!r}))
        sys.path.insert(0, ".")
        import reader
        print(reader.content)
    ''')
    assert TOKEN not in one(code)


# ------------------------------------------------------------------ the further list
def test_no_network_not_even_to_the_hosts_loopback():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    got: list[bytes] = []
    stop = threading.Event()

    def accept():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            got.append(conn.recv(100))
            conn.close()

    listener = threading.Thread(target=accept, daemon=True)
    listener.start()
    try:
        text = one(f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=3)\n"
                   "s.sendall(b'hello from the sandbox')\nprint('connected')")
    finally:
        stop.set()
        listener.join(timeout=2)
        server.close()
    assert got == [] and "connected" not in text.splitlines()


def test_the_checkpoint_folder_and_proc_1_environ_are_out_of_reach(tmp_path):
    ckpt = tmp_path / "global_step_1"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_text(TOKEN)
    code = textwrap.dedent(f'''
        import os
        for path in ({str(ckpt / "model.safetensors")!r}, "/proc/1/environ", "/proc/self/environ",
                     "/proc/%d/environ" % os.getppid()):
            try:
                print(open(path, "rb").read()[:4000])
            except OSError as e:
                print("refused", path, type(e).__name__)
        try:
            print(os.listdir({str(ckpt)!r}))
        except OSError as e:
            print("refused listing", type(e).__name__)
    ''')
    text = one(code)
    assert TOKEN not in text and "model.safetensors'" not in text


def test_a_fork_bomb_is_bounded_to_a_few_hundred_processes(marker):
    code = textwrap.dedent(f'''
        import os, sys, time
        n = 0
        try:
            for _ in range(5000):
                pid = os.fork()
                if pid == 0:
                    time.sleep(30)
                    os._exit(0)
                n += 1
        except OSError as e:
            print("fork refused after", n, type(e).__name__)
        print("forked", n, "{marker}")
    ''')
    t0 = time.monotonic()
    text = one(code)
    assert time.monotonic() - t0 < 30
    forked = int(text.split("forked ")[1].split()[0]) if "forked " in text else 0
    assert forked <= 300, text


def test_a_memory_bomb_is_stopped_and_the_host_lives():
    text = one("chunks = []\nwhile True:\n    chunks.append(bytearray(256 * 1024 * 1024))")
    assert "MemoryError" in text or "Error: the process ended by SIGKILL" in text


def test_a_10_gb_file_is_refused(tmp_path):
    code = textwrap.dedent('''
        import os
        block = b"x" * (1 << 20)
        written = 0
        try:
            with open("big.bin", "wb") as f:
                while written < 10 * 1024:
                    f.write(block)
                    written += 1
        except OSError as e:
            print("stopped after MB", written, type(e).__name__)
        print("MB", written)
    ''')
    t0 = time.monotonic()
    text = one(code)
    assert time.monotonic() - t0 < 60
    assert "stopped after MB" in text and int(text.split("stopped after MB ")[1].split()[0]) < 10 * 1024


def test_the_venv_cannot_be_written():
    site = Path(sysconfig.get_paths()["purelib"])
    names = [f"verl_async_probe_{uuid.uuid4().hex}.pth", f"verl_async_probe_{uuid.uuid4().hex}.py"]
    code = textwrap.dedent(f'''
        import os
        for path in ({str(site / names[0])!r}, {str(Path(sys.prefix) / names[1])!r}):
            try:
                open(path, "w").write("import os\\n")
                print("wrote", path)
            except OSError as e:
                print("refused", type(e).__name__)
    ''')
    try:
        one(code)
        assert not (site / names[0]).exists() and not (Path(sys.prefix) / names[1]).exists()
    finally:
        for path in (site / names[0], Path(sys.prefix) / names[1]):
            path.unlink(missing_ok=True)


def test_nothing_is_left_after_the_call(marker):
    """A daemonised grandchild, files in the working folder and in /tmp: all gone when the call returns."""
    before_tmp = set(os.listdir("/tmp"))
    code = textwrap.dedent(f'''
        import os, sys, time
        open("left.txt", "w").write("x")
        open("/tmp/{marker}.txt", "w").write("x")
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", "{marker}"])
            os._exit(0)
        time.sleep(0.3)
        print("done")
    ''')
    one(code)
    assert not gone_within(marker), "a process the snippet started outlived the call"
    assert not any(marker in name for name in os.listdir("/tmp"))
    new = set(os.listdir("/tmp")) - before_tmp
    assert not [n for n in new if n.startswith("verl_async_sandbox")], new
