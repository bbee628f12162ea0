"""The package layout: imports run one way, the CLI needs Ray only to serve, a wheel works."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Each layer may import itself and the layers after it, never one before it.
LAYERS = [
    "kvserve.deploy",
    "kvserve.router",
    "kvserve.workers",  # the worker actor and stream pacing, on top of its subpackages
    "kvserve.workers.engine",
    "kvserve.workers.structured",  # grammars of structured outputs, masks on the logits
    "kvserve.workers.model",
    "kvserve.workers.loading",
    "kvserve.kvcache",
    "kvserve.protos",
    "kvserve",  # the core: config, sampling, outputs, errors, models, hardware
]
# Front doors may import any part: the offline API, the CLI, its gRPC client and the benches.
FRONT_DOORS = ("kvserve.llm", "kvserve.cli", "kvserve.grpc_client", "kvserve.bench")
FOLDERS = {"kvserve": "kvserve", "kvserve.kvcache": "kvcache", "kvserve.workers": "workers",
           "kvserve.router": "router", "kvserve.deploy": "deploy", "kvserve.protos": "protos"}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([pkg, *parts])] = path
    return out


def _layer(module: str) -> int:
    """Index in LAYERS of the most specific layer holding `module`."""
    best = None
    for i, name in enumerate(LAYERS):
        if module == name or module.startswith(name + "."):
            if best is None or len(name) > len(LAYERS[best]):
                best = i
    assert best is not None, module
    return best


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, node.module)]
            # `from kvserve.bench import serve` names a module too
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return sorted({(n, m) for n, m in found if m == "kvserve" or m.startswith("kvserve.")})


def test_every_package_says_what_lives_there():
    for folder in FOLDERS.values():
        for init in (ROOT / folder).rglob("__init__.py"):
            doc = ast.get_docstring(ast.parse(init.read_text()))
            assert doc and "later" not in doc, f"{init} needs a docstring saying what lives there"


def test_imports_run_one_way():
    modules = _modules()
    bad = []
    for name, path in modules.items():
        if name == "kvserve" or name.startswith(FRONT_DOORS):
            continue  # the package's own lazy `kvserve.LLM` is a front door too
        here = _layer(name)
        for line, target in _imports(path):
            if target not in modules and target.rsplit(".", 1)[0] in modules:
                target = target.rsplit(".", 1)[0]  # `from pkg.mod import name`
            if target == "kvserve":
                continue  # the package itself (lazy attributes)
            if target.startswith(FRONT_DOORS):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports the front door {target}")
            elif _layer(target) < here:
                bad.append(f"{path.relative_to(ROOT)}:{line} ({LAYERS[here]}) imports {target}")
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_the_layer_check_catches_a_wrong_import():
    assert _layer("kvserve.kvcache.manager") > _layer("kvserve.workers.engine.engine")
    assert _layer("kvserve.workers.loading.loader") > _layer("kvserve.workers.model.models.llama")
    assert _layer("kvserve.config") == len(LAYERS) - 1


NO_RAY = textwrap.dedent("""
    import sys

    class NoRay:
        def find_spec(self, name, path=None, target=None):
            if name == "ray" or name.startswith("ray."):
                raise ImportError("ray is made unimportable for this test")

    sys.meta_path.insert(0, NoRay())
    from kvserve.cli import main
    try:
        main(sys.argv[1:])
    except SystemExit as e:
        assert not e.code, e.code
    assert "ray" not in sys.modules
""")


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"],
                                  ["bench", "throughput", "--help"], ["bench", "--help"]])
def test_cli_needs_no_ray_except_to_serve(argv):
    r = subprocess.run([sys.executable, "-c", NO_RAY, *argv], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "usage: kvserve" in r.stdout


def test_wheel_installs_every_subpackage(tmp_path):
    wheels, target = tmp_path / "wheels", tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels),
                    str(ROOT)], check=True, timeout=600, capture_output=True)
    (wheel,) = wheels.glob("kvserve-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, timeout=300, capture_output=True)
    packages = sorted({m.rsplit(".", 1)[0] if not p.name == "__init__.py" else m
                       for m, p in _modules().items()})
    check = textwrap.dedent(f"""
        import importlib, os
        for name in {packages!r}:
            mod = importlib.import_module(name)
            assert mod.__file__.startswith({str(target)!r}), (name, mod.__file__)
        import kvserve.workers.model.cpu_kernels as k
        assert os.path.isfile(os.path.join(os.path.dirname(k.__file__), "csrc", "paged_decode.c"))
        import kvserve.deploy as d
        assert os.path.isfile(os.path.join(os.path.dirname(d.__file__), "serve_config.yaml"))
    """)
    env = {**os.environ, "PYTHONPATH": str(target)}
    r = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
