"""Settings dataclasses whose fields carry their own help, allowed values and check, and the
command-line flags generated from them.

`EngineArgs` (engine_args.py), `ServerConfig` (server/config.py) and `RouterConfig`
(router/args.py) declare each setting once with `option(...)`; `check_options` validates an
instance (types, choices, checks) and `add_flags` / `options_from_flags` give the CLI the same
names, defaults and help. A neutral module: stdlib only, so every command parses and fails fast
without torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable, Iterable
from dataclasses import field, fields
from typing import Any

Check = Callable[[Any], "str | None"]


class OptionError(ValueError):
    """A bad setting; `option` is its field name (the CLI shows it as a flag)."""

    def __init__(self, option: str, problem: str) -> None:
        super().__init__(f"{option}: {problem}")
        self.option = option
        self.problem = problem


def option(default: Any = dataclasses.MISSING, help: str = "", *,
           choices: Iterable[Any] | None = None, check: Check | None = None, cli: bool = True,
           default_factory: Callable[[], Any] | None = None, action: str | None = None,
           flag_name: str | None = None, group: str | None = None) -> Any:
    """A field with its help text, allowed values and a check returning a problem or None.
    `cli=False`: no flag. `action` "append" or "extend": a list flag given several times or
    with several values; `flag_name` overrides the flag's spelling; `group` names its help
    section."""
    meta = {"help": help, "choices": tuple(choices) if choices else None, "check": check,
            "cli": cli, "action": action, "flag": flag_name, "group": group}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


def at_least(low: int | float) -> Check:
    def check(v: Any) -> str | None:
        return None if v is None or v >= low else f"must be >= {low}, got {v}"
    return check


def positive(v: Any) -> str | None:
    return None if v is None or v > 0 else f"must be > 0, got {v}"


def type_problem(kind: str, value: Any) -> str | None:
    if value is None:
        return None if "None" in kind else "must be given, got None"
    base = kind.split("|")[0].strip().split("[")[0]
    ok = {
        "bool": isinstance(value, bool),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, int | float) and not isinstance(value, bool),
        "str": isinstance(value, str),
        "tuple": isinstance(value, tuple),
        "list": isinstance(value, list),
        "dict": isinstance(value, dict),
    }[base]
    return None if ok else f"must be {'a ' + base if base != 'int' else 'an int'}, got {value!r}"


def check_options(obj: Any, error: Callable[[str, str], Exception] = OptionError) -> None:
    """Validate every field of a settings dataclass: type, choices, check."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        meta = f.metadata
        problem = type_problem(str(f.type), value)
        if problem is not None:
            raise error(f.name, problem)
        choices = meta.get("choices")
        if choices is not None and value is not None and value not in choices:
            raise error(f.name, f"{value!r} is not one of {', '.join(map(str, choices))}")
        check = meta.get("check")
        problem = check(value) if check is not None else None
        if problem is not None:
            raise error(f.name, problem)


def flag(f: dataclasses.Field | str) -> str:
    if isinstance(f, str):
        return "--" + f.replace("_", "-")
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, *,
              exclude: Iterable[str] = (), overrides_only: bool = False,
              title: str | None = None) -> None:
    """One flag per field of `cls` (that has `cli`). `overrides_only`: no defaults, so only the
    flags given show up in the namespace. `title`: a help section for fields without a group
    (fields with one get their own section)."""
    skip = set(exclude)
    defaults = {f.name: _default(f) for f in fields(cls)}
    sections: dict[str | None, Any] = {}

    def section(name: str | None) -> Any:
        name = name or title
        if name is None or not isinstance(parser, argparse.ArgumentParser):
            return parser
        if name not in sections:
            sections[name] = parser.add_argument_group(name)
        return sections[name]

    for f in fields(cls):
        if f.name in skip or not f.metadata.get("cli", True) or "help" not in f.metadata:
            continue
        default = argparse.SUPPRESS if overrides_only else defaults[f.name]
        kw: dict[str, Any] = {"dest": f.name, "default": default}
        help_text = f.metadata["help"]
        if not overrides_only and "default" not in help_text and default not in (None, [], ()):
            help_text += " (default: %(default)s)"
        action = f.metadata.get("action")
        if str(f.type) == "bool":
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = _cli_type(f)
            kw["metavar"] = f.name.upper()
            if action is not None:
                kw["action"] = action
            elif str(f.type).startswith("list"):
                kw["nargs"] = "+"
            if f.metadata.get("choices") is not None:
                kw["choices"] = f.metadata["choices"]
                kw["metavar"] = "{" + ",".join(map(str, f.metadata["choices"])) + "}"
        section(f.metadata.get("group")).add_argument(flag(f), help=help_text, **kw)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _cli_type(f: dataclasses.Field) -> Callable[[str], Any]:
    kind = str(f.type)
    if kind.startswith("list["):
        kind = kind[5:]
    if kind.startswith("int"):
        return int
    if kind.startswith("float"):
        return float
    if kind.startswith("dict"):
        return json_dict
    if kind.startswith("tuple"):
        return lambda text: tuple(part.strip() for part in text.split(",") if part.strip())
    return str


def json_dict(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def options_from_flags(cls: type, ns: argparse.Namespace, **extra: Any) -> Any:
    """An instance of `cls` from the flags in `ns` (and `extra` fields); a bad value is
    reported with its flag."""
    given = {f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)}
    given.update(extra)
    try:
        return cls(**given)
    except OptionError as e:
        f = next((f for f in fields(cls) if f.name == e.option), None)
        raise type(e)(flag(f) if f is not None else flag(e.option), e.problem) from None
