"""A look-alike of the GPU machines' Python on this CPU host, for the quick run's dry run.

A fresh virtual environment whose site-packages links, from the environment that runs this
script, only the distributions the GPU image holds (scripts/gpu/image_packages.txt) or that
travel as wheels (the names of the wheels in WHEEL_DIR); kvserve runs from the checkout. A step that
imports anything else fails here as it would on the GPU machine, so the dry run shows what
the quick run must carry. Versions are this environment's, not the image's (this host has
Python 3.11 and CPU torch).

Usage: .venv/bin/python scripts/gpu/image_venv.py DEST WHEEL_DIR
Prints the environment's python; DEST is replaced.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
import sysconfig

from packaging.requirements import Requirement

HERE = os.path.dirname(os.path.abspath(__file__))


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def names(wheel_dir: str) -> tuple[set[str], set[str]]:
    """(the image's distributions, the wheels' distributions), normalized."""
    with open(os.path.join(HERE, "image_packages.txt"), encoding="utf-8") as f:
        image = {norm(ln.strip()) for ln in f if ln.strip() and not ln.startswith("#")}
    wheels = {norm(w.split("-", 1)[0]) for w in os.listdir(wheel_dir) if w.endswith(".whl")}
    return image, wheels


def _requires(dist: md.Distribution) -> set[str]:
    """The distributions `dist` needs (no extras)."""
    out = set()
    for r in dist.requires or ():
        req = Requirement(r)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            out.add(norm(req.name))
    return out


def closure(have: dict[str, md.Distribution], image: set[str]) -> set[str]:
    """The image's distributions and what this environment's versions of them need (a newer
    huggingface-hub here needs httpx2, say), but never one of kvserve's own requirements that
    the image lacks (pydantic, reached here through typer): those must travel as wheels."""
    lacking = {norm(Requirement(r).name) for r in have["kvserve"].requires or ()} - image
    seen: set[str] = set()
    todo = [n for n in image if n in have]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo += [m for m in _requires(have[n]) if m in have and m not in lacking]
    return seen


def build(dest: str, wheel_dir: str) -> str:
    image, wheels = names(wheel_dir)
    have = {norm(d.metadata["Name"]): d for d in md.distributions()}
    keep = closure(have, image) | (wheels & set(have))  # kvserve runs from the checkout, as there
    shutil.rmtree(dest, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", dest], check=True)
    py = os.path.join(dest, "bin", "python")
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    src = sysconfig.get_paths()["purelib"]
    for name in sorted(keep):
        # each top-level entry the distribution installed (packages, modules, dist-info, .pth)
        files = have[name].files or ()
        for top in {p.parts[0] for p in files if p.parts and p.parts[0] != ".."}:
            there = os.path.join(site, top)
            if os.path.exists(os.path.join(src, top)) and not os.path.lexists(there):
                os.symlink(os.path.join(src, top), there)
    print(f"image_venv: {len(keep)} distributions; beyond the image's list: "
          f"{', '.join(sorted(keep - image - wheels)) or 'none'}; from the wheels: "
          f"{', '.join(sorted(wheels & keep)) or 'none'}", file=sys.stderr)
    if wheels - set(have):
        print(f"image_venv: wheels not in this environment: {', '.join(sorted(wheels - set(have)))}",
              file=sys.stderr)
    return py


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    print(build(sys.argv[1], sys.argv[2]))
