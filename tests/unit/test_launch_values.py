"""`lmforge launch slurm` writes nothing but its own directives and commands, whatever the
values it is given: each hostile value is refused naming its option, or lands in the
script as exactly one directive value or one quoted word, on the line meant for it.

The check compares the script line by line with one rendered from harmless values: the
same number of lines, every line the same except the ones that carry a value, and each of
those parses (as bash would, ``shlex``) to exactly the value given."""
from __future__ import annotations

import random
import re
import shlex
import subprocess

import pytest

from lmforge.cli import main
from lmforge.launch import render_slurm_script, time_limit_seconds

# Harmless values of every string the script carries; a case replaces one of them.
PLAIN = {"job_name": "lmforge", "time_limit": "24:00:00", "partition": "gpu",
         "account": "proj", "log_dir": "slurm-logs", "env": "/opt/venv",
         "setup": ("module load cuda",), "config": "recipe.yaml",
         "overrides": ("parallel.tp=2",)}
DIRECTIVES = {"job_name": "--job-name", "time_limit": "--time", "partition": "--partition",
              "account": "--account", "log_dir": "--output"}
OPTIONS = {**DIRECTIVES, "log_dir": "log_dir", "env": "--env", "setup": "--setup",
           "config": "CONFIG", "overrides": "override"}


def render(**changes) -> str:
    v = {**PLAIN, **changes}
    return render_slurm_script(v["config"], list(v["overrides"]), nodes=2, gpus_per_node=4,
                               job_name=v["job_name"], time_limit=v["time_limit"],
                               partition=v["partition"], account=v["account"],
                               log_dir=v["log_dir"], env=v["env"], setup=v["setup"])


def assert_only_the_intended_lines(script: str, **changes) -> None:
    """``script`` (rendered with ``changes``) has the plain script's lines, but for the
    value-carrying ones, each holding exactly its value; and bash can parse it."""
    assert_same_lines(script, **changes)
    assert_bash_parses(script)


def assert_bash_parses(script: str) -> None:
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def assert_same_lines(script: str, **changes) -> None:
    v = {**PLAIN, **changes}
    plain = render(setup=PLAIN["setup"] * len(v["setup"])).split("\n")  # as many lines
    got = script.split("\n")
    assert len(got) == len(plain), script
    setups = iter(v["setup"])
    for line, reference in zip(got, plain):
        if reference.startswith("#SBATCH --"):
            key = reference.split("=", 1)[0]
            field = next((f for f, o in DIRECTIVES.items() if key == f"#SBATCH {o}"), None)
            value = v[field] + ("/%x-%j.out" if field == "log_dir" else "") if field else None
            assert line == (reference if field is None else f"{key}={value}")
            assert re.fullmatch(r"#SBATCH --[a-z-]+(=[^\s'\"#]+)?", line), line
        elif reference.startswith("eval "):
            assert shlex.split(line) == ["eval", next(setups)]
        elif reference.startswith("source "):
            assert shlex.split(line) == ["source", v["env"] + "/bin/activate"]
        elif reference.lstrip().startswith("-m lmforge.cli train "):
            assert line.startswith("    -m lmforge.cli train ")
            assert shlex.split(line) == ["-m", "lmforge.cli", "train", v["config"],
                                         *v["overrides"], "train.resume=auto", "&"]
        else:
            assert line == reference


HOSTILE = {  # field -> values; each is refused naming its option, or written harmlessly
    "job_name": ["x\ntouch F", "x\rtouch F", "x\x00", "x; touch F", "$(touch F)",
                 "`touch F`", "a b", "#x", "'x'", "x/../y", "", "x%j", "-x", "x\u2028y"],
    "partition": ["gpu\n#SBATCH --wrap=touch F", "gpu --wrap=x", "gpu,", ",gpu", "gpu;x",
                  "gpu,debug"],
    "account": ["proj\ntouch F", "a b", "a=b", "proj'"],
    "time_limit": ["1:00:00\ntouch F", "1:00:00 --wrap=x", "-1", "1:2:3:4", "\uff11:00",
                   "unlimited\n", "UNLIMITED", "2-00:00:00", "90"],
    "log_dir": ["logs\ntouch F", "my logs", "logs'", "logs%j", "/scratch/logs"],
    "env": ["/opt/a b", "/opt/$(touch F)", "/opt/x'y", "/opt/x\ny", "/opt/x\ry", "/opt/`id`"],
    "setup": [("echo \"unclosed",), ("echo \\",), ("cat <<EOF",), ("#SBATCH --wrap=x",),
              ("x'y",), ("$(touch F)",), ("a\nb",), ("a\rb",), ("a\x00b",), ("a\u2028b",),
              ("module load a", "echo 'b'; true")],
    "config": ["my recipe.yaml", "x';touch F;'.yaml", "$(touch F).yaml", "a\nb.yaml", "-x"],
    "overrides": [("train.output_dir=$(touch F)",), ("train.output_dir=a b",),
                  ("train.output_dir=a'b",), ("data.template={prompt}\n{response}",),
                  ("x=`id`",), ("train.output_dir=a\tb",)],
}
CASES = [(field, value) for field, values in HOSTILE.items() for value in values]


@pytest.mark.parametrize("field, value", CASES, ids=[f"{f}-{v!r}" for f, v in CASES])
def test_a_hostile_value_is_refused_naming_its_option_or_written_as_one_value(field, value):
    try:
        script = render(**{field: value})
    except ValueError as e:
        assert str(e).startswith(f"{OPTIONS[field]}: ") and "\n" not in str(e)
        return
    assert_only_the_intended_lines(script, **{field: value})


def test_values_that_must_not_reach_the_script_are_refused():
    # A control character, a line break or whitespace in a directive never gets through.
    for field, value in CASES:
        text = "".join(value) if isinstance(value, tuple) else value
        line_break = any(c in text for c in "\n\r\x00\u2028")
        splits = field in DIRECTIVES and (re.search(r"\s", text) or text == "")
        if line_break or splits:
            with pytest.raises(ValueError, match=f"^{OPTIONS[field]}: "):
                render(**{field: value})


ALPHABET = "aZ09._-+/,:=%#;&|$`'\"\\(){}<>*?!~ \t\n\r\x00\x0b\x0c\u2028\u0085\u00e9-"


def test_random_strings_in_every_field_never_change_the_scripts_structure():
    rng, accepted = random.Random(20240611), []
    for field in PLAIN:
        for _ in range(150):
            safe = rng.random() < 0.5  # half of them from characters a name may hold
            chars = "aZ09._-+:," if safe else ALPHABET
            text = "".join(rng.choice(chars) for _ in range(rng.randint(1, 10)))
            value = (text,) if field in ("setup", "overrides") else text
            try:
                script = render(**{field: value})
            except ValueError as e:
                assert str(e).startswith(f"{OPTIONS[field]}: "), (field, value, e)
                continue
            assert_same_lines(script, **{field: value})
            accepted.append(script)
    assert len(accepted) > 300  # the check saw scripts, not only refusals
    assert_bash_parses("\n".join(accepted))  # one bash for them all: each ends its line


@pytest.mark.parametrize("option, value, message", [
    ("--nodes", "0", r"--nodes: must be >= 1, got 0"),
    ("--gpus-per-node", "-1", r"--gpus-per-node: must be >= 0"),
    ("--gpus-per-node", "0", r"--procs-per-node: required with --gpus-per-node 0"),
    ("--cpus-per-task", "0", r"--cpus-per-task: must be >= 1"),
    ("--port", "65536", r"--port: must be a TCP port in \[1, 65535\]"),
    ("--port", "0", r"--port: must be a TCP port"),
    ("--stop-before", "0", r"--stop-before: must be in \[1, 65535\]"),
    ("--stop-before", "70000", r"--stop-before: must be in \[1, 65535\]"),
    ("--stop-before", "7200", r"--stop-before: 7200 s is not shorter than --time 1:00:00"),
])
def test_numbers_out_of_range_are_refused_naming_the_option(tmp_path, capsys, option, value,
                                                           message):
    argv = ["launch", "slurm", "--nodes", "1", "--gpus-per-node", "1", "--time", "1:00:00",
            "--env", "none", "--output", str(tmp_path / "job.sbatch")]
    code = main(argv + [option, value])
    err = capsys.readouterr().err
    assert code == 2 and re.match(rf"lmforge: error: {message}", err), err
    assert not (tmp_path / "job.sbatch").exists()


@pytest.mark.parametrize("text, seconds", [
    ("90", 5400), ("90:30", 5430), ("1:00:00", 3600), ("2-0", 172800),
    ("1-2:03", 93780), ("1-00:00:01", 86401), ("0", None), ("UNLIMITED", None)])
def test_slurm_time_limits_are_read_in_each_of_slurms_forms(text, seconds):
    assert time_limit_seconds(text) == seconds


def test_a_newline_in_the_job_name_from_the_command_line_is_refused_in_one_line(tmp_path,
                                                                               capsys):
    out = tmp_path / "job.sbatch"
    code = main(["launch", "slurm", "--nodes", "1", "--gpus-per-node", "1", "--env", "none",
                 "--job-name", "x\ntouch F", "--output", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--job-name: 'x\\ntouch F'" in err
    assert not out.exists()
