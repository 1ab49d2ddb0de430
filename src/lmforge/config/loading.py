"""A config from YAML and ``section.key=value`` overrides: each value coerced to its
field's type, unknown sections and keys refused naming them; then the defaults that
depend on the run (``defaults.py``) on the keys neither set."""
from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any, Optional, Union

import yaml

from lmforge.config.checks import refuse_ignored
from lmforge.config.defaults import apply_run_defaults
from lmforge.config.errors import ConfigError, show, show_name
from lmforge.config.keys import AUTO, IntOrAuto
from lmforge.config.schema import JobConfig


def load_config(path: Optional[str | Path] = None, overrides: list[str] = ()) -> JobConfig:
    """YAML file (or the embedded demo when None) + ``section.key=value`` overrides, with
    the fine-tuning defaults (``defaults.py``) where neither set a key."""
    cfg = JobConfig()
    explicit: set[str] = set()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path}: not found")
        raw = read_yaml_file(path) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path}: top level must be a mapping of sections")
        explicit.update(apply_dict(cfg, raw))
    for item in overrides:
        explicit.add(apply_override(cfg, item))
    apply_run_defaults(cfg, explicit, path)
    refuse_ignored(cfg, explicit)
    return cfg


def read_yaml_file(path: str | Path) -> Any:
    """The plain data (mappings, lists, strings, numbers) of a YAML file, read by the safe
    loader: the one reader of every YAML file lmforge is given (configs, a checkpoint's or
    a run's config.yaml). A tag that would build a Python object (``!!python/...``) or an
    unknown one, and a syntax error, are refused in one line naming the file and line."""
    try:
        return safe_load(Path(path).read_text(encoding="utf-8"))
    except YAMLTooLarge as e:
        raise ConfigError(f"{path}:{e.line}: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except yaml.constructor.ConstructorError as e:
        tag = re.search(r"tag '([^']*)'", e.problem or "")
        if tag is None:  # a known tag with a bad value, e.g. !!binary that is not base64
            raise ConfigError(f"{_where(path, e)}: not valid YAML ({e.problem})") from None
        name = tag.group(1).replace("tag:yaml.org,2002:", "!!")
        raise ConfigError(f"{_where(path, e)}: the YAML tag {name} is refused: only plain "
                          f"data is read (mappings, lists, strings, numbers), never "
                          f"Python objects") from None
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or _one_line(e)
        context, start = getattr(e, "context", None), getattr(e, "context_mark", None)
        if context and start is not None:  # where the unfinished construct began
            problem += f"; {context} from line {start.line + 1}"
        raise ConfigError(f"{_where(path, e)}: not valid YAML ({problem})") from None
    except RecursionError:
        raise ConfigError(f"{path}: not valid YAML (nested deeper than it can be read)") \
            from None
    except ValueError as e:  # a constructor's own, e.g. an int over Python's 4300 digits
        raise ConfigError(f"{path}: not valid YAML ({show_name(_one_line(e), 200)})") \
            from None


# Values a YAML document may expand to through its aliases (``&a`` ... ``*a``): a config
# holds hundreds; a few hundred bytes of nested aliases expand to billions ("billion
# laughs"), which PyYAML builds as shared lists but any repr or walk of them expands.
MAX_YAML_VALUES = 100_000


class YAMLTooLarge(ValueError):
    """A document whose aliases expand it past MAX_YAML_VALUES values, or into itself;
    ``line`` (1-based) is where the value that does so starts."""

    def __init__(self, message: str, line: int):
        super().__init__(message)
        self.line = line


def safe_load(text: str) -> Any:
    """``yaml.safe_load`` that refuses a document whose aliases expand past
    ``MAX_YAML_VALUES`` values or refer to a list or mapping holding them
    (``YAMLTooLarge``), before anything is built from it."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _check_expansion(root: yaml.Node) -> None:
    """Counts each node's values as its aliases expand them, children first, without
    recursion (a node reached twice is an alias: counted from its first visit)."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()  # begun, not finished: the ancestors of the current one
    stack = [(root, False)]
    while stack:
        node, finished = stack.pop()
        if finished:
            open_nodes.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes[id(c)] for c in _children(node))
            if sizes[id(node)] > MAX_YAML_VALUES:
                raise YAMLTooLarge(f"YAML aliases here expand to more than "
                                   f"{MAX_YAML_VALUES:,} values (write the values out)",
                                   node.start_mark.line + 1)
            continue
        if id(node) in sizes:
            continue
        open_nodes.add(id(node))
        stack.append((node, True))
        for child in _children(node):
            if id(child) in open_nodes:
                raise YAMLTooLarge("a YAML alias refers to the list or mapping that holds "
                                   "it (a value without end)", node.start_mark.line + 1)
            if id(child) not in sizes:
                stack.append((child, False))


def _children(node: yaml.Node) -> list:
    if isinstance(node, yaml.SequenceNode):
        return node.value
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _where(path: str | Path, error: yaml.YAMLError) -> str:
    """``path:line`` of a YAML error, ``path`` when the error has no position."""
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    return f"{path}:{mark.line + 1}" if mark is not None else str(path)


def apply_dict(cfg: JobConfig, raw: dict) -> list[str]:
    """Sets each ``{section: {key: value}}`` of ``raw``; returns the keys set."""
    keys = []
    for section, values in raw.items():
        if not hasattr(cfg, section) or not dataclasses.is_dataclass(getattr(cfg, section)):
            raise ConfigError(f"{show_name(section)}: unknown config section "
                              f"(known: {', '.join(f.name for f in dataclasses.fields(cfg))})")
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ConfigError(f"{show_name(section)}: must be a mapping of keys to values")
        for key, value in values.items():
            keys.append(set_field(cfg, f"{section}.{key}", value))
    return keys


def apply_override(cfg: JobConfig, item: str) -> str:
    """Sets one ``section.key=value``; returns the key."""
    if "=" not in item:
        raise ConfigError(f"{show_name(item)}: overrides are written section.key=value")
    key, text = item.split("=", 1)
    try:
        value = safe_load(text) if text != "" else None
    except YAMLTooLarge as e:
        raise ConfigError(f"{show_name(key.strip())}: {str(e).replace(' here', '')}") \
            from None
    except (yaml.YAMLError, ValueError, RecursionError):  # not YAML: the text as written
        value = text
    return set_field(cfg, key.strip(), value)


def set_field(cfg: JobConfig, dotted: str, value: Any) -> str:
    """Sets ``section.key`` to ``value`` coerced to the field's type; returns the key."""
    parts = dotted.split(".")
    if len(parts) > 2 and _is_mapping_key(cfg, *parts[:2]):
        whole = ".".join(parts[:2])
        raise ConfigError(f"{show_name(dotted)}: {whole} is set as a whole mapping "
                          f"({whole}={{{show_name(parts[2], 40)}: ..., ...}})")
    if len(parts) != 2:
        raise ConfigError(f"{show_name(dotted)}: keys are written section.key (e.g. "
                          f"optim.lr)")
    section_name, key = parts
    section = getattr(cfg, section_name, None)
    if section is None or not dataclasses.is_dataclass(section):
        raise ConfigError(f"{show_name(dotted)}: unknown config section "
                          f"'{show_name(section_name)}'")
    hints = typing.get_type_hints(type(section))
    if key not in hints:
        known = ", ".join(f.name for f in dataclasses.fields(section))
        raise ConfigError(f"{show_name(dotted)}: unknown key (known in {section_name}: "
                          f"{known})")
    setattr(section, key, _coerce(dotted, value, hints[key]))
    return dotted


def _is_mapping_key(cfg: JobConfig, section: str, key: str) -> bool:
    """Whether ``section.key`` holds a mapping whose keys are checked (keys.key's mapping)."""
    values = getattr(cfg, section, None)
    if not dataclasses.is_dataclass(values):
        return False
    f = {f.name: f for f in dataclasses.fields(values)}.get(key)
    return f is not None and f.metadata.get("mapping") is not None


def _coerce(name: str, value: Any, hint: Any) -> Any:
    if typing.get_origin(hint) in (Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none")):
            return None
        return _coerce(name, value, next(a for a in typing.get_args(hint)
                                         if a is not type(None)))
    if hint not in _COERCIONS:
        return value  # Any
    accepts, convert, expected = _COERCIONS[hint]
    if not accepts(value):
        raise ConfigError(f"{name}: expected {expected}, got {show(value)}")
    return convert(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_float_text(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return isinstance(value, str)


# field type -> (accepts the value?, converts it, what the error says was expected)
_COERCIONS = {
    bool: (lambda v: isinstance(v, bool), bool, "true or false"),
    int: (lambda v: _is_number(v) and (isinstance(v, int) or v.is_integer()), int,
          "an integer"),
    # YAML 1.1 reads "3e-4" as a string
    float: (lambda v: _is_number(v) or _is_float_text(v), float, "a number"),
    str: (lambda v: _is_number(v) or isinstance(v, str), str, "a string"),
    list: (lambda v: isinstance(v, list), lambda v: v, "a list"),
}
_COERCIONS[IntOrAuto] = (lambda v: v == AUTO or _COERCIONS[int][0](v),
                         lambda v: v if v == AUTO else int(v), "an integer or auto")


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())


def config_yaml(cfg: JobConfig) -> str:
    """The config as a run saves it (``config.yaml``) and ``train --print-config`` shows it."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def save_config(cfg: JobConfig, path: str | Path) -> None:
    Path(path).write_text(config_yaml(cfg))
