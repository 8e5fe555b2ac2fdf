"""Suite-wide: give memory back between test modules. The suite loads many models (module-scoped engines up to
1.5B parameters); on a 24 GiB machine the single pytest process reached 22.8 GB resident and was killed by the
OOM killer in tensor-parallel tests (2026-12-01). Collecting cycles and trimming glibc's heap after each module
returns what finished modules freed."""

from __future__ import annotations

import ctypes
import gc

import pytest


@pytest.fixture(autouse=True, scope="module")
def _release_memory_after_module():
    yield
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


# Scheduling hint for `make test`'s two workers (xdist, a file per worker at a time): the longest files start
# first, so no long file is left to run alone at the end. Measured on 2 AVX2 cores (2026-12-02): these took
# 2-9 minutes each, most other files under one minute. test_models_hf (13 GB at its peak: the 1.5B in float32,
# ours and transformers') comes after the files that start alongside test_determinism (up to 7 GB), so its
# 1.5B test usually runs after that file: started together they reached 19 of the machine's 24 GB.
# Order only: every test runs anyway.
LONGEST_FIRST = ("test_determinism.py", "test_controller.py", "test_spec.py", "test_heads.py", "test_models_hf.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept otherwise
