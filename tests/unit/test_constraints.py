"""The test set is pinned: constraints.txt (what scripts/setup.sh installs with) pins every
package lmforge and its test extras name, for the running Python, and its generator
(scripts/update_constraints.py) writes one line per Python where versions differ."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def _pins() -> dict[str, str]:
    """{normalised name: version} of the lines whose marker holds on this Python."""
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        spec, _, marker = line.partition(";")
        if marker and not Marker(marker.strip()).evaluate():
            continue
        name, version = spec.strip().split("==")
        pins[_norm(name)] = version
    return pins


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_requirement_of_lmforge_and_its_test_extras_is_pinned():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {_norm(Requirement(r).name) for r in
             project["dependencies"] + project["optional-dependencies"]["test"]}
    names.discard("torch")  # scripts/setup.sh pins it (or keeps the machine's build)
    missing = names - set(_pins())
    assert not missing, f"constraints.txt pins no version of {sorted(missing)}"


def test_setup_installs_with_the_constraints():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert re.search(r"pip install .*-c constraints\.txt .*-e \"\.\[test\]\"", setup)
    assert "constraints.txt -nt" in setup  # a new pin reinstalls


def _generator():
    spec = importlib.util.spec_from_file_location(
        "update_constraints", ROOT / "scripts" / "update_constraints.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generator_pins_each_python_where_versions_differ_and_leaves_torch_out():
    resolved = {"3.10": {"numpy": "2.2.6", "peft": "0.21.2", "tomli": "2.5.0",
                         "torch": "2.13.0", "nvidia-nccl-cu13": "2.29.7"},
                "3.11": {"numpy": "2.4.6", "peft": "0.21.2", "torch": "2.13.0+cpu"},
                "3.12": {"numpy": "2.4.6", "peft": "0.21.2", "torch": "2.13.0"}}
    assert _generator().constraint_lines(resolved) == [
        'numpy==2.2.6; python_version == "3.10"',
        'numpy==2.4.6; python_version >= "3.11"',
        "peft==0.21.2",
        'tomli==2.5.0; python_version == "3.10"',
    ]
