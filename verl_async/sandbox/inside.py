"""The first process of a sandboxed run (PID 1 of its namespace): it runs the code in a child and reports.

This file's text is handed to the sandbox's interpreter with `-c` (the file itself is not
visible inside), so it uses the standard library only, and at start-up only built-in modules
(os, sys, _signal, _ast: each import is time every call pays). Its file descriptors:

* `code_fd`: the code, read to its end, then closed;
* `status_fd`: one line back, `exit <exit code, or -signal>`, written once the
  code's process has ended; closed in the code's process, so the code cannot forge it;
* 0, 1, 2: the code's own stdin, stdout and stderr.

Why a supervisor: PID 1 of a namespace is immune to the signals its own processes send it
and its end tears the namespace down (every process the code started is killed), while the
code runs as an ordinary process (so `os.abort()` is a SIGABRT, as anywhere) whose status
is told apart from the sandbox's own failures.

`mode`: "notebook" prints the value of a last expression (as ReTool's interpreter and a
notebook do: `2**10` answers 1024); "script" runs the code as `python file.py` would.
"""


def _limit_self(cfg):
    """Process mode only (no nsjail): the limits nsjail would set."""
    import resource

    mb = 1024 * 1024
    for name, value in (("RLIMIT_CPU", cfg["cpu_time_s"] + 1), ("RLIMIT_AS", cfg["memory_mb"] * mb),
                        ("RLIMIT_FSIZE", cfg["max_file_mb"] * mb), ("RLIMIT_NOFILE", cfg["max_open_files"]),
                        ("RLIMIT_NPROC", cfg["max_processes"]), ("RLIMIT_CORE", 0)):
        resource.setrlimit(getattr(resource, name), (int(value), int(value)))


def _run_code(source, cfg):
    """The code's process: run it, end as `python` would (SystemExit's code, 1 after a traceback)."""
    import _ast
    import _signal
    import sys

    import resource

    # SIGXCPU (catchable, reported as the CPU limit) at the limit; the hard limit's SIGKILL a second later
    resource.setrlimit(resource.RLIMIT_CPU, (cfg["cpu_time_s"], cfg["cpu_time_s"] + 1))
    _signal.signal(_signal.SIGINT, _signal.default_int_handler)
    sys.path[:] = cfg["sys_path"]
    sys.argv = ["<code>"]
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        tree = compile(source, "<code>", "exec", _ast.PyCF_ONLY_AST)
        last = None
        if cfg["mode"] == "notebook" and tree.body and isinstance(tree.body[-1], _ast.Expr):
            last = tree.body.pop()
        exec(compile(tree, "<code>", "exec"), namespace)
        if last is not None:
            value = eval(compile(_ast.Expression(last.value), "<code>", "eval"), namespace)
            if value is not None:
                print(repr(value))
    except SystemExit:
        raise
    except BaseException as exc:  # the traceback without this file's frames
        import traceback

        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename != "<string>"]
        try:
            sys.stdout.flush()
        except Exception:  # noqa: BLE001 - a closed or broken stdout: the traceback still goes out
            pass
        print("Traceback (most recent call last):\n" + "".join(traceback.format_list(frames))
              + "".join(traceback.format_exception_only(type(exc), exc)), end="", file=sys.stderr)
        raise SystemExit(1)
    raise SystemExit(0)


def parse_args(argv):
    """The command line the runner writes (`runner.supervisor_args`): numbers, the mode, then sys.path."""
    names = ("code_fd", "status_fd", "jailed", "cpu_time_s", "memory_mb", "max_file_mb", "max_open_files",
             "max_processes")
    cfg = {name: int(value) for name, value in zip(names, argv)}
    cfg["mode"] = argv[len(names)]
    cfg["sys_path"] = list(argv[len(names) + 1:])
    return cfg


def main():
    import _signal
    import os
    import sys

    cfg = parse_args(sys.argv[1:])
    chunks = []
    while True:
        chunk = os.read(cfg["code_fd"], 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(cfg["code_fd"])
    source = b"".join(chunks).decode("utf-8", errors="replace")
    if not cfg["jailed"]:
        _limit_self(cfg)
    status_fd = cfg["status_fd"]
    pid = os.fork()
    if pid == 0:
        os.close(status_fd)
        _run_code(source, cfg)  # raises SystemExit: the interpreter ends this process as python would
    for sig in (_signal.SIGINT, _signal.SIGTERM, _signal.SIGHUP, _signal.SIGUSR1, _signal.SIGUSR2, _signal.SIGPIPE):
        _signal.signal(sig, _signal.SIG_IGN)
    status = None
    while status is None:  # reap every orphan the namespace hands us until the code's process ends
        try:
            reaped, code = os.wait()
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        if reaped == pid:
            status = os.waitstatus_to_exitcode(code)
    os.write(status_fd, b"exit %d\n" % status if status is not None else b"lost\n")
    os.close(status_fd)
    if not cfg["jailed"]:  # no namespace to tear down: end what the code left in its process group
        os.killpg(0, _signal.SIGKILL)
    os._exit(0)


if __name__ == "__main__":
    main()
