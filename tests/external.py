"""Files the tests need from outside the checkout, found in one place.

A user's clone has only the repository; CI's clone has a `shared/` folder beside it. Each
outside file is named by an environment variable with a default beside the checkout. Where it
is absent the tests that need it (and only those) skip with a reason saying what is missing
and how to supply it, unless the matching `KVSERVE_REQUIRE_*` variable is set (`.ci/run` sets
them): then they fail, so CI can never lose those checks to a skip.

| variable | default | what |
|---|---|---|
| `KVSERVE_KUBERAY_CRDS` | `<repo>/../shared/kuberay` | KubeRay v1.7 CRDs (`ray.io_rayservices.yaml`) |
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
KUBERAY_ENV = "KVSERVE_KUBERAY_CRDS"
REQUIRE_KUBERAY_ENV = "KVSERVE_REQUIRE_KUBERAY_CRDS"
RAYSERVICE_CRD = "ray.io_rayservices.yaml"


def kuberay_crds_dir() -> Path:
    return Path(os.environ.get(KUBERAY_ENV) or REPO.parent / "shared" / "kuberay")


def rayservice_crd() -> Path:
    """KubeRay's RayService CRD file, or skip (fail where required) with how to get it."""
    where = kuberay_crds_dir()
    path = where / RAYSERVICE_CRD
    if path.is_file():
        return path
    reason = (f"KubeRay CRDs not found: no {RAYSERVICE_CRD} in {where}. Set {KUBERAY_ENV} to a "
              "folder holding KubeRay v1.7's CRDs (from the KubeRay release's "
              "ray-operator/config/crd/bases) to validate the RayService against them")
    if os.environ.get(REQUIRE_KUBERAY_ENV):
        pytest.fail(f"{reason} ({REQUIRE_KUBERAY_ENV} is set: this check must run here)")
    pytest.skip(reason)
