"""The CPU C kernels in tests: a kernel that fails to build where a compiler is present is a
failure, not a skip (a broken csrc/*.c must turn CI red, not leave the engine silently on
the slower torch path). Without a compiler the kernel tests skip, saying so, unless
KVSERVE_REQUIRE_C_KERNELS is set (`.ci/run` sets it): then they fail too."""

from __future__ import annotations

import os
from typing import TypeVar

import pytest

from kvserve.workers.model import cpu_kernels

REQUIRE_ENV = "KVSERVE_REQUIRE_C_KERNELS"
T = TypeVar("T")


def require_kernel(name: str, lib: T | None) -> T:
    """`lib` (the loaded kernel `name`), or fail / skip with the reason."""
    if lib is not None:
        return lib
    state = cpu_kernels.kernel_states().get(name, "not built")
    if cpu_kernels.build_failure(name) is not None:
        pytest.fail(f"the C kernel {name} failed to build: {state}")
    if os.environ.get(REQUIRE_ENV):
        pytest.fail(f"the C kernel {name} is required here ({REQUIRE_ENV}) but is {state}")
    pytest.skip(f"the C kernel {name} is not available: {state}")
