"""Lends the host's CUDA build of PyTorch to the test venv, and nothing else of the host's.

Run by scripts/setup.sh with the HOST interpreter (standard library only):

    python3 scripts/host_torch.py VENV_DIR

A GPU image ships torch built for its CUDA, with no package index to fetch another, so the
venv reuses it; but a venv that sees all of the host's site-packages (``venv
--system-site-packages``) also sees whatever else the host has: pip then reports
dependency conflicts of unrelated host packages, and pytest loads the host's plugins. So
only torch and the distributions its CUDA build needs (triton, nvidia-*, cuda-*) are
linked into ``VENV_DIR/host-torch/``, which a ``.pth`` file puts on the venv's path; their
``*.dist-info`` go along, so pip sees them as installed and installs the rest of torch's
requirements at the pinned versions. A CPU build, or no torch at all, is not lent: the
venv gets the pinned CPU wheel. Prints what it lent, or nothing.
"""
from __future__ import annotations

import importlib.metadata as metadata
import re
import sys
from pathlib import Path

LENT_PREFIXES = ("triton", "nvidia-", "cuda-")  # what a CUDA build of torch loads at import


def cuda_torch() -> metadata.Distribution | None:
    """The host's torch distribution when it is a CUDA build, else None."""
    try:
        dist = metadata.distribution("torch")
        import torch  # noqa: F401  (its build says whether it is a CUDA one)
    except Exception:  # no torch, or one that does not import: nothing to lend
        return None
    return dist if getattr(torch.version, "cuda", None) else None


def lent_distributions(torch_dist: metadata.Distribution) -> list[metadata.Distribution]:
    """torch and the installed distributions among its requirements that its CUDA build
    needs (by name: triton, nvidia-*, cuda-*), with theirs in turn."""
    found, todo = {}, [torch_dist]
    while todo:
        dist = todo.pop()
        name = _normal(dist.metadata["Name"])
        if name in found:
            continue
        found[name] = dist
        for requirement in dist.requires or []:
            req_name = _normal(re.split(r"[\s;<>=!~\[(]", requirement, maxsplit=1)[0])
            if req_name.startswith(LENT_PREFIXES):
                try:
                    todo.append(metadata.distribution(req_name))
                except metadata.PackageNotFoundError:  # a marker left it out here
                    pass
    return list(found.values())


def top_level_entries(dist: metadata.Distribution) -> set[Path]:
    """The top-level files and directories of site-packages that ``dist`` installed (its
    packages, modules and its own .dist-info)."""
    base = Path(dist.locate_file(""))
    entries = set()
    for file in dist.files or []:
        first = Path(file).parts[0]
        if first in ("..", "") or first.endswith(".pth") or first == "__pycache__":
            continue  # scripts outside site-packages, and path hooks, are not lent
        entries.add(base / first)
    return {e for e in entries if e.exists()}


def lend(venv: Path) -> list[str]:
    """Links the host's CUDA torch into ``venv``; returns the names lent (none: nothing
    to lend)."""
    torch_dist = cuda_torch()
    if torch_dist is None:
        return []
    target = venv / "host-torch"
    target.mkdir(parents=True, exist_ok=True)
    for dist in lent_distributions(torch_dist):
        for entry in top_level_entries(dist):
            link = target / entry.name
            if not link.exists():
                link.symlink_to(entry)
    site = _site_packages(venv)
    (site / "lmforge-host-torch.pth").write_text(f"{target.resolve()}\n")
    return sorted(_normal(d.metadata["Name"]) for d in lent_distributions(torch_dist))


def _site_packages(venv: Path) -> Path:
    found = sorted(venv.glob("lib/python*/site-packages"))
    if len(found) != 1:
        raise SystemExit(f"host_torch: no single site-packages under {venv}/lib")
    return found[0]


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python3 scripts/host_torch.py VENV_DIR")
    lent = lend(Path(sys.argv[1]))
    if lent:
        print(f"setup: the venv reuses the host's CUDA build of torch ({', '.join(lent)}); "
              f"nothing else of the host's is visible", file=sys.stderr)
    sys.exit(0)
