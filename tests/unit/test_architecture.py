"""The shape of src/lmforge, read from its source with ``ast`` (nothing is imported):

(a) no import cycle between lmforge modules;
(b) imports follow the flow: a module imports only its own package or a lower layer;
(c) lmforge imports sit at module top; one inside a function carries a comment (on its
    line or the line above) saying why, e.g. an optional heavy dependency;
(d) no function over 60 lines, no file over 400 lines (a declarative table may opt out of
    the file limit with a ``# layout: table`` comment).

The checker takes a package directory, so the tests at the bottom run it on small fake
trees to prove that each rule can fail.
"""
from __future__ import annotations

import ast
import io
import re
import textwrap
import tokenize
from dataclasses import dataclass
from pathlib import Path

import pytest

# The flow, from the top: cli -> train -> export -> {perf, eval} -> job ->
# {peft, checkpoint} -> parallel -> {models, data} -> {config, fsio}. A module may import its own package and any
# package of a LOWER rank; packages of one rank never import each other. A top-level
# module (lmforge/launch.py) counts as its own package.
LAYERS: list[tuple[str, ...]] = [
    ("lmforge", "config", "fsio"),  # "lmforge": the root package's __init__.py
    ("models", "data"),
    ("parallel",),
    ("peft", "checkpoint"),
    ("job",),  # lmforge/job.py: a config resolved into a run's facts
    ("perf", "eval"),
    ("export",),
    ("train", "launch"),  # launch: sbatch scripts for `lmforge launch`; imports below cli
    ("cli",),
]
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 400
TABLE_MARKER = re.compile(r"#\s*layout:\s*table\b")
# Comments that tag a line for a tool say nothing about why the import is there.
TOOL_COMMENT = re.compile(r"#\s*(noqa|type:|pragma|fmt:|pylint:)")

SRC_PACKAGE = Path(__file__).resolve().parents[2] / "src" / "lmforge"


@dataclass(frozen=True)
class Problem:
    rule: str  # "cycle", "flow", "lazy-import", "size"
    where: str  # file:line
    text: str

    def __str__(self) -> str:
        return f"{self.where}: {self.text}"


@dataclass(frozen=True)
class Import:
    source: str  # the importing module, dotted
    target: str  # the imported lmforge module (or name's module), dotted
    line: int
    in_function: bool
    node: ast.stmt


@dataclass
class Module:
    name: str  # dotted, e.g. lmforge.data.readers
    path: Path
    shown: str  # the path shown in messages
    text: str
    tree: ast.Module
    comments: dict  # line -> comment text


# ------------------------------------------------------------------------ reading the tree

def read_modules(package_dir: Path) -> dict[str, Module]:
    """Every .py under ``package_dir``, by dotted module name."""
    root = package_dir.parent
    shown_root = root.parent
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        text = path.read_text(encoding="utf-8")
        modules[".".join(parts)] = Module(".".join(parts), path,
                                          str(path.relative_to(shown_root)), text,
                                          ast.parse(text, str(path)), _comments(text))
    return modules


def _comments(text: str) -> dict[int, str]:
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    return {t.start[0]: t.string for t in tokens if t.type == tokenize.COMMENT}


def _is_package(module: Module) -> bool:
    return module.path.name == "__init__.py"


def _resolve(module: Module, node: ast.stmt, known: set[str], root: str) -> list[str]:
    """The lmforge modules an import statement names (a name imported from a module
    counts as that module; a submodule imported by name counts as the submodule)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == root]
    if node.level:
        base = module.name.split(".")
        if not _is_package(module):
            base.pop()
        base = base[:len(base) - (node.level - 1)]
        stem = ".".join(base + ([node.module] if node.module else []))
    else:
        stem = node.module or ""
    if stem.split(".")[0] != root:
        return []
    return [f"{stem}.{a.name}" if f"{stem}.{a.name}" in known else stem for a in node.names]


def find_imports(modules: dict[str, Module]) -> list[Import]:
    """Every lmforge import of every module, at module top or inside a function."""
    known, found = set(modules), []
    for module in modules.values():
        root = module.name.split(".")[0]
        for node, in_function in _import_nodes(module.tree):
            for target in dict.fromkeys(_resolve(module, node, known, root)):
                found.append(Import(module.name, target, node.lineno, in_function, node))
    return found


def _import_nodes(tree: ast.AST, in_function: bool = False):
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, in_function
        nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                   ast.Lambda))
        yield from _import_nodes(child, nested)


def _known_module(name: str, known: set[str]) -> str | None:
    """``name`` or its longest prefix that is a module of the tree."""
    parts = name.split(".")
    while parts and ".".join(parts) not in known:
        parts.pop()
    return ".".join(parts) if parts else None


def package_of(module: str) -> str:
    """The layer-table name of a module: its first level below the root (the root itself
    for the root package)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


# ------------------------------------------------------------------------------ the rules

def cycle_problems(modules: dict[str, Module], imports: list[Import]) -> list[Problem]:
    """(a) One problem per strongly connected group of modules, naming one cycle."""
    known = set(modules)
    edges: dict[str, dict[str, Import]] = {name: {} for name in modules}
    for imp in imports:
        target = _known_module(imp.target, known)
        if target is not None:
            edges[imp.source].setdefault(target, imp)
    problems = []
    for group in _strongly_connected(edges):
        start = min(group)
        if len(group) == 1 and start not in edges[start]:
            continue
        path = _cycle_through(start, edges, group)
        first = edges[path[0]][path[1]]
        where = f"{modules[first.source].shown}:{first.line}"
        others = sorted(group - set(path))
        also = f" (the same group: {', '.join(others)})" if others else ""
        problems.append(Problem("cycle", where, "import cycle: " + " -> ".join(path) + also))
    return problems


def _strongly_connected(edges: dict[str, dict]) -> list[set[str]]:
    """Tarjan's algorithm, iterative (no recursion limit on deep chains)."""
    index, low, on_stack, stack, groups, counter = {}, {}, set(), [], [], [0]
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.add(member)
                        if member == node:
                            break
                    groups.append(group)
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(edges[child])))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return groups


def _cycle_through(start: str, edges: dict[str, dict], group: set[str]) -> list[str]:
    """The shortest path start -> ... -> start inside ``group`` (breadth first)."""
    parent, frontier = {start: None}, [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(edges[node]):
                if child == start:
                    path = [node]
                    while parent[path[-1]] is not None:
                        path.append(parent[path[-1]])
                    return path[::-1] + [start]
                if child in group and child not in parent:
                    parent[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle through {start}")  # a group of >1 always has one


def flow_problems(modules: dict[str, Module], imports: list[Import],
                  layers: list[tuple[str, ...]] = LAYERS) -> list[Problem]:
    """(b) An import of another package must go to a lower rank of ``layers``."""
    rank = {package: r for r, packages in enumerate(layers) for package in packages}
    flow = " -> ".join("{" + ", ".join(p) + "}" for p in reversed(layers))
    problems = []
    for module in modules.values():  # every package has a place, importer or not
        package = package_of(module.name)
        if package not in rank:
            rank[package] = None
            problems.append(Problem("flow", f"{module.shown}:1", f"package {package!r} is "
                                    "not in the layer table (LAYERS in tests/unit/"
                                    "test_architecture.py)"))
    for imp in imports:
        where = f"{modules[imp.source].shown}:{imp.line}"
        source, target = package_of(imp.source), package_of(imp.target)
        if source == target or rank[source] is None:
            continue
        if rank.get(target) is None:
            problems.append(Problem("flow", where, f"imports {imp.target}: package "
                                    f"{target!r} is not in the layer table"))
        elif rank[target] >= rank[source]:
            problems.append(Problem(
                "flow", where, f"{imp.source} ({source}, layer {rank[source]}) imports "
                f"{imp.target} ({target}, layer {rank[target]}): against the flow {flow}"))
    return problems


def lazy_import_problems(modules: dict[str, Module], imports: list[Import]) -> list[Problem]:
    """(c) An lmforge import inside a function needs a comment saying why."""
    problems, seen = [], set()
    for imp in imports:
        if not imp.in_function or (imp.source, imp.line) in seen:
            continue
        seen.add((imp.source, imp.line))
        module = modules[imp.source]
        lines = range(imp.line - 1, (imp.node.end_lineno or imp.line) + 1)
        reasons = [module.comments[n] for n in lines if n in module.comments
                   and not TOOL_COMMENT.match(module.comments[n])]
        if not reasons:
            problems.append(Problem("lazy-import", f"{module.shown}:{imp.line}",
                                    f"import of {imp.target} inside a function: move it "
                                    "to the module top, or say why in a comment"))
    return problems


def size_problems(modules: dict[str, Module]) -> list[Problem]:
    """(d) Functions of at most 60 lines; files of at most 400 unless a declared table."""
    problems = []
    for module in modules.values():
        lines = len(module.text.splitlines())
        is_table = any(TABLE_MARKER.match(c) for c in module.comments.values())
        if lines > MAX_FILE_LINES and not is_table:
            problems.append(Problem("size", f"{module.shown}:1",
                                    f"{lines} lines (limit {MAX_FILE_LINES}; only a "
                                    "declarative table may say '# layout: table')"))
        for node in ast.walk(module.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    problems.append(Problem(
                        "size", f"{module.shown}:{node.lineno}",
                        f"function {node.name} is {length} lines (limit "
                        f"{MAX_FUNCTION_LINES})"))
    return problems


def layout_problems(package_dir: Path, layers: list[tuple[str, ...]] = LAYERS
                    ) -> list[Problem]:
    """Every problem of rules (a)-(d) in the package at ``package_dir``."""
    modules = read_modules(package_dir)
    imports = find_imports(modules)
    return (cycle_problems(modules, imports) + flow_problems(modules, imports, layers)
            + lazy_import_problems(modules, imports) + size_problems(modules))


def _fail_on(problems: list[Problem], rule: str) -> None:
    """Fails with one line per problem of ``rule`` (file:line first)."""
    lines = [str(p) for p in problems if p.rule == rule]
    if lines:
        pytest.fail(f"{len(lines)} problem(s):\n" + "\n".join(lines), pytrace=False)


# ------------------------------------------------------------------ the real source tree

@pytest.fixture(scope="module")
def src_problems() -> list[Problem]:
    return layout_problems(SRC_PACKAGE)


def test_src_has_no_import_cycles(src_problems):
    _fail_on(src_problems, "cycle")


def test_src_imports_only_its_own_package_or_a_lower_layer(src_problems):
    _fail_on(src_problems, "flow")


def test_src_imports_lmforge_at_module_top_or_says_why(src_problems):
    _fail_on(src_problems, "lazy-import")


def test_src_functions_and_files_stay_short(src_problems):
    _fail_on(src_problems, "size")


# ------------------------------------------------ the checker itself, on small fake trees

def _tree(root: Path, files: dict[str, str]) -> Path:
    """A fake ``src/lmforge`` under ``root`` holding ``files`` (path -> source)."""
    package = root / "src" / "lmforge"
    for name, source in {"__init__.py": "", **files}.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.parent != package and not (path.parent / "__init__.py").exists():
            (path.parent / "__init__.py").write_text('"""A package."""\n')
        path.write_text(textwrap.dedent(source))
    return package


def _problems(tmp_path, files: dict[str, str], rule: str) -> list[str]:
    return [str(p) for p in layout_problems(_tree(tmp_path, files)) if p.rule == rule]


def test_checker_passes_a_tree_that_follows_every_rule(tmp_path):
    package = _tree(tmp_path, {
        "config.py": "import json\n",
        "data/loader.py": "from lmforge.config import json\nfrom . import sampler\n",
        "data/sampler.py": "import lmforge.config\n",
        "train/loop.py": "from lmforge.data import loader\nfrom ..models import llama\n"
                         "def run():\n    # tqdm-like optional dependency: imported late\n"
                         "    from lmforge.models import llama\n    import json\n",
        "models/llama.py": "from lmforge import config\n",
        "cli/__init__.py": '"""Commands."""\nfrom lmforge.train import loop\n',
    })
    assert [str(p) for p in layout_problems(package)] == []


def test_checker_names_an_import_cycle_with_its_file_and_line(tmp_path):
    found = _problems(tmp_path, {
        "data/a.py": "import json\nfrom lmforge.data import b\n",
        "data/b.py": "from lmforge.data.c import x\n",
        "data/c.py": "def f():\n    # late, to show that a lazy import still counts\n"
                     "    from . import a\n",
    }, "cycle")
    assert found == ["src/lmforge/data/a.py:2: import cycle: lmforge.data.a -> "
                     "lmforge.data.b -> lmforge.data.c -> lmforge.data.a"]


def test_checker_finds_a_module_that_imports_itself_through_its_package(tmp_path):
    found = _problems(tmp_path, {
        "peft/__init__.py": '"""Adapters."""\nfrom lmforge.peft.lora import Lora\n',
        "peft/lora.py": "from lmforge.peft import helper_defined_in_init\n",
    }, "cycle")
    assert found == ["src/lmforge/peft/__init__.py:2: import cycle: lmforge.peft -> "
                     "lmforge.peft.lora -> lmforge.peft"]


@pytest.mark.parametrize("source, files, line", [
    ("models/hf.py", "import torch\nfrom lmforge.train.loop import run\n", 2),
    ("models/hf.py", "from ..peft import lora\n", 1),  # relative, upward
    ("data/x.py", "import lmforge.models.llama\n", 1),  # same rank, other package
    ("peft/lora.py", "from lmforge.checkpoint import save\n", 1),  # same-rank siblings
    ("config.py", "def f():\n    # why: optional\n    from lmforge.data import x\n", 3),
])
def test_checker_refuses_an_import_against_the_flow(tmp_path, source, files, line):
    found = _problems(tmp_path, {source: files}, "flow")
    assert len(found) == 1 and found[0].startswith(f"src/lmforge/{source}:{line}: ")
    assert "against the flow {cli} -> {train, launch} ->" in found[0]


def test_checker_allows_downward_and_own_package_imports(tmp_path):
    assert _problems(tmp_path, {
        "checkpoint/state.py": "from lmforge.parallel import mesh\nfrom . import layout\n"
                               "from lmforge.checkpoint.directory import names\n",
        "export.py": "from lmforge.checkpoint import state\nfrom lmforge.peft import lora\n",
        "eval/rouge.py": "from lmforge.models import generate\nimport lmforge.fsio\n",
    }, "flow") == []


def test_checker_refuses_a_package_missing_from_the_layer_table(tmp_path):
    found = _problems(tmp_path, {"misc/util.py": "from lmforge.config import x\n"}, "flow")
    assert found == ["src/lmforge/misc/__init__.py:1: package 'misc' is not in the layer "
                     "table (LAYERS in tests/unit/test_architecture.py)"]


def test_checker_refuses_an_unexplained_lmforge_import_inside_a_function(tmp_path):
    found = _problems(tmp_path, {"train/loop.py": """\
        import json


        def plain():
            from lmforge.data import loader
            import os  # not lmforge: fine anywhere


        def tool_tag_only():
            from lmforge.models import llama  # noqa: F401


        class Trainer:
            def method(self):
                import lmforge.config


        def explained_above():
            # safetensors is optional here: only the HF export needs it
            from lmforge.models import hf


        def explained_on_the_line():
            from lmforge.models import hf  # optional heavy dependency (transformers)
        """}, "lazy-import")
    assert [f.split(": ")[0] for f in found] == ["src/lmforge/train/loop.py:5",
                                                 "src/lmforge/train/loop.py:10",
                                                 "src/lmforge/train/loop.py:15"]


def test_checker_refuses_long_functions_and_files_unless_a_declared_table(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES - 1))
    table = "".join(f"ROW_{i} = {i}\n" for i in range(MAX_FILE_LINES))
    found = _problems(tmp_path, {
        "models/ok.py": f"def fits():\n{body}",
        "models/long.py": f"import json\n\n\ndef too_long():\n{body}    return x0\n",
        "models/big.py": table + "\n",
        "models/presets.py": "# layout: table (one row per preset)\n" + table,
    }, "size")
    assert found == [
        f"src/lmforge/models/big.py:1: {MAX_FILE_LINES + 1} lines (limit {MAX_FILE_LINES}; "
        "only a declarative table may say '# layout: table')",
        f"src/lmforge/models/long.py:4: function too_long is {MAX_FUNCTION_LINES + 1} lines "
        f"(limit {MAX_FUNCTION_LINES})",
    ]


def test_checker_reads_the_real_tree():
    """Guards the guard: a resolver that found nothing would pass every rule above."""
    modules = read_modules(SRC_PACKAGE)
    imports = {(i.source, i.target) for i in find_imports(modules)}
    assert {"lmforge.cli", "lmforge.config", "lmforge.data.preprocess"} <= set(modules)
    assert ("lmforge.data.preprocess", "lmforge.data.readers") in imports
