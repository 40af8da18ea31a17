"""Options from text: PopTorch's config files (``Options.loadFromFile``) and JSON.

A config file has one setter call per line, written as in Python without the
``options.`` prefix (``deviceIterations(10)``, ``Training.gradientAccumulation(4)``,
``outputMode(poptorch.OutputMode.All)``); ``#`` starts a comment. PopTorch
``exec``-ed the file; ipukit parses each line and accepts only literals and
enum names as arguments, so a config file cannot run code.
"""
from __future__ import annotations

import ast
import json
from typing import Any, List, Sequence

from . import enums
from .errors import ConfigFileError


def _enum(dotted: str):
    """``OutputMode.All`` (optionally prefixed ``poptorch.``/``ipukit.``) -> the member, else None."""
    parts = dotted.split(".")
    if parts[0] in ("poptorch", "ipukit"):
        parts = parts[1:]
    if len(parts) != 2:
        return None
    kind = getattr(enums, parts[0], None)
    return getattr(kind, parts[1], None) if isinstance(kind, type) else None


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    raise ValueError("not a name")


def _value(node: ast.AST) -> Any:
    try:
        return ast.literal_eval(node)
    except ValueError:
        pass
    try:
        member = _enum(_dotted(node))
    except ValueError:
        member = None
    if member is None:
        raise ValueError(f"{ast.unparse(node)} is not a literal or an ipukit/poptorch enum value")
    return member


def _setter(options, path: str):
    target = options
    for name in path.split("."):
        target = getattr(target, name)  # unknown names raise UnknownOptionError with hints
    if not callable(target):
        raise ValueError(f"{path} is not a setter")
    return target


def apply_lines(options, lines: Sequence[str], source: str) -> None:
    """Apply setter calls, one per line, to ``options``."""
    for number, line in enumerate(lines, start=1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        where = f"line {number} of {source}"
        try:
            call = ast.parse(text, mode="eval").body
            if not isinstance(call, ast.Call):
                raise ValueError("expected a setter call such as deviceIterations(10)")
            args: List[Any] = [_value(a) for a in call.args]
            kwargs = {k.arg: _value(k.value) for k in call.keywords}
            setter = _setter(options, _dotted(call.func))
        except (SyntaxError, ValueError) as exc:
            raise ConfigFileError(
                f"{where}: {text!r}: {exc}. Write one setter call per line without the "
                "'options.' prefix, e.g. Training.gradientAccumulation(4).") from None
        setter(*args, **kwargs)


def apply_json(options, string: str) -> None:
    """Apply ``{"Training.gradientAccumulation": 4, "_Popart.set": ["name", 1]}``."""
    try:
        values = json.loads(string)
    except json.JSONDecodeError as exc:
        raise ConfigFileError(f"Options.from_json: not valid JSON ({exc}).") from None
    if not isinstance(values, dict):
        raise ConfigFileError("Options.from_json: expected a JSON object "
                              '{"name.of.setter": value, ...}.')
    for path, value in values.items():
        if isinstance(value, str) and "." in value:
            value = _enum(value) or value
        setter = _setter(options, path)
        if isinstance(value, list):
            setter(*[(_enum(v) or v) if isinstance(v, str) else v for v in value])
        else:
            setter(value)
