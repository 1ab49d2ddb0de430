"""Regenerates constraints.txt: the exact versions `make test` installs, resolved today
for each Python given, so that a fresh machine gets the set CI was tested with, whatever
was published since. Run it on purpose, then `make test` on a fresh clone before
committing the new file:

    python scripts/update_constraints.py /path/to/python3.10 /path/to/python3.11 ...

Each interpreter resolves `torch==TORCH` plus `lmforge[test]` in a throw-away venv with
`pip install --dry-run --report` (nothing is installed). torch and the CUDA packages it
pulls are left out: scripts/setup.sh installs torch itself, and a machine that has its
own build keeps it. A package resolved to different versions on different Pythons gets
one line per Python, with an environment marker; the newest Python's line also covers
later ones.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCH = "2.13.0"  # as scripts/setup.sh installs it
LEFT_OUT = ("torch", "triton", "nvidia-", "cuda-", "lmforge")


def resolve(python: str) -> tuple[str, dict[str, str]]:
    """(the interpreter's major.minor, {package: version}) of what pip would install."""
    with tempfile.TemporaryDirectory() as tmp:
        venv = Path(tmp) / "venv"
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        report = Path(tmp) / "report.json"
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
                        "--dry-run", "--ignore-installed", "--report", str(report),
                        f"torch=={TORCH}", "-e", f"{ROOT}[test]"], check=True)
        version = subprocess.run([str(venv / "bin" / "python"), "-c",
                                  "import sys; print('%d.%d' % sys.version_info[:2])"],
                                 check=True, capture_output=True, text=True).stdout.strip()
        installs = json.loads(report.read_text())["install"]
    return version, {i["metadata"]["name"].lower(): i["metadata"]["version"]
                     for i in installs}


def constraint_lines(resolved: dict[str, dict[str, str]]) -> list[str]:
    pythons = sorted(resolved, key=lambda v: tuple(map(int, v.split("."))))
    names = sorted({n for versions in resolved.values() for n in versions
                    if not n.startswith(LEFT_OUT)})
    lines = []
    for name in names:
        runs = _runs([(py, resolved[py].get(name)) for py in pythons])
        if len(runs) == 1 and runs[0][2] is not None:
            lines.append(f"{name}=={runs[0][2]}")
            continue
        lines += [f"{name}=={version}; {_marker(first, last, pythons)}"
                  for first, last, version in runs if version is not None]
    return lines


def _runs(pins: list[tuple[str, str | None]]) -> list[tuple[str, str, str | None]]:
    """Consecutive Pythons that resolved the same version: (first, last, version)."""
    runs = []
    for py, version in pins:
        if runs and runs[-1][2] == version:
            runs[-1] = (runs[-1][0], py, version)
        else:
            runs.append((py, py, version))
    return runs


def _marker(first: str, last: str, pythons: list[str]) -> str:
    if last == pythons[-1]:  # the newest Python's pin covers later ones
        return f'python_version >= "{first}"'
    if first == last:
        return f'python_version == "{first}"'
    return f'python_version >= "{first}" and python_version <= "{last}"'


def main(pythons: list[str]) -> None:
    if not pythons:
        sys.exit(__doc__)
    resolved = dict(resolve(p) for p in pythons)
    header = [f"# The test set `make test` installs (scripts/setup.sh), resolved for Python "
              f"{', '.join(sorted(resolved))} with torch=={TORCH}",
              "# by scripts/update_constraints.py. Regenerate on purpose; test before committing."]
    (ROOT / "constraints.txt").write_text("\n".join(header + constraint_lines(resolved)) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
