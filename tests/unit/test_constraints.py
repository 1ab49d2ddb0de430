"""The test set is pinned: constraints.txt (what scripts/setup.sh installs with) pins every
package lmforge and its test extras name, for the running Python, and its generator
(scripts/update_constraints.py) writes one line per Python where versions differ."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
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


def _fake_site(root: Path, cuda: str | None) -> Path:
    """A site-packages holding a stand-in ``torch`` (its build's CUDA version ``cuda``)
    that requires an nvidia library and sympy, the nvidia library, and an unrelated
    package, each with the .dist-info pip reads."""
    site = root / "host-site"

    def dist(name: str, version: str, files: dict[str, str], requires: list[str] = ()):
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
        (info / "METADATA").write_text(meta)
        record = [f"{info.name}/METADATA,,", f"{info.name}/RECORD,,"]
        for path, text in files.items():
            (site / path).parent.mkdir(parents=True, exist_ok=True)
            (site / path).write_text(text)
            record.append(f"{path},,")
        record.append("../../../bin/torchrun,,")  # a script outside site-packages
        (info / "RECORD").write_text("\n".join(record) + "\n")

    dist("torch", "2.11.0", {"torch/__init__.py": "from torch import version\n",
                             "torch/version.py": f"cuda = {cuda!r}\n"},
         ["nvidia-cublas-cu13==13.0.0; platform_system == 'Linux'", "sympy>=1.13.3"])
    dist("nvidia-cublas-cu13", "13.0.0", {"nvidia/cublas/lib/libcublas.so": ""})
    dist("boto3", "1.0.0", {"boto3/__init__.py": ""})
    return site


def _lend(tmp_path: Path, site: Path) -> subprocess.CompletedProcess:
    venv = tmp_path / "venv"
    (venv / "lib" / "python3.x" / "site-packages").mkdir(parents=True)
    return subprocess.run([sys.executable, "-S", "-c",
                           "import runpy, sys; sys.path.insert(0, sys.argv[1]); "
                           "sys.argv = sys.argv[2:]; "
                           "runpy.run_path(sys.argv[0], run_name='__main__')",
                           str(site), str(ROOT / "scripts" / "host_torch.py"), str(venv)],
                          capture_output=True, text=True)


def test_a_hosts_cuda_torch_is_lent_to_the_venv_and_nothing_else(tmp_path):
    result = _lend(tmp_path, _fake_site(tmp_path, cuda="13.0"))
    assert result.returncode == 0, result.stderr
    assert "nvidia-cublas-cu13, torch" in result.stderr
    lent = tmp_path / "venv" / "host-torch"
    assert sorted(p.name for p in lent.iterdir()) == [
        "nvidia", "nvidia_cublas_cu13-13.0.0.dist-info", "torch",
        "torch-2.11.0.dist-info"]  # not boto3, not sympy (pip installs the pinned one)
    pth = tmp_path / "venv" / "lib" / "python3.x" / "site-packages" / "lmforge-host-torch.pth"
    assert pth.read_text().strip() == str(lent.resolve())


def test_a_hosts_cpu_torch_is_not_lent(tmp_path):
    result = _lend(tmp_path, _fake_site(tmp_path, cuda=None))
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "venv" / "host-torch").exists()
    assert not list((tmp_path / "venv").rglob("*.pth"))


def test_setup_makes_a_venv_that_sees_no_host_packages():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "--system-site-packages" not in setup
    assert "scripts/host_torch.py .venv" in setup
