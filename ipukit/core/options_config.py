"""Options from text: PopTorch's config files (``Options.loadFromFile``: one setter call per
line without ``options.``, ``#`` comments) and JSON. PopTorch ``exec``-ed the file; ipukit
parses it, accepting only literals, enum names and PopTorch's option objects (:data:`OBJECTS`).
"""
from __future__ import annotations

import ast
import json
import os
from typing import Any, Callable, Dict, List, Optional, Sequence

from . import enums, strategies
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


#: PopTorch's option objects a config line may build (``poptorch.`` prefix optional).
OBJECTS: Dict[str, Callable] = {
    "PipelinedExecution": strategies.PipelinedExecution,
    "ShardedExecution": strategies.ShardedExecution,
    "Stage": strategies.Stage,
    "SerialPhasedExecution": strategies.SerialPhasedExecution,
    "ParallelPhasedExecution": strategies.ParallelPhasedExecution,
    "PhasedExecution": strategies.PhasedExecution,
    "Phase": strategies.Phase,
}

_ACCEPTED = ("a literal or an ipukit/poptorch enum value, nor one of PopTorch's option objects "
             "(poptorch.ShardedExecution(), poptorch.PipelinedExecution(...), "
             "poptorch.Stage(...).ipu(n), poptorch.TensorLocationSettings()...)")


def _object(node: ast.Call, objects: Dict[str, Callable]) -> Any:
    """``poptorch.Stage("B1").ipu(0)``: a known constructor, then public methods of what it built."""
    func = node.func
    args = [_value(a, objects) for a in node.args]
    kwargs = {k.arg: _value(k.value, objects) for k in node.keywords if k.arg is not None}
    if len(kwargs) != len(node.keywords):
        raise ValueError(f"{ast.unparse(node)}: **arguments are not accepted")
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Call):
        receiver = _object(func.value, objects)
        if func.attr.startswith("_") or not callable(getattr(receiver, func.attr, None)):
            raise ValueError(f"{ast.unparse(node)}: {type(receiver).__name__} has no method "
                             f"{func.attr!r}")
        return getattr(receiver, func.attr)(*args, **kwargs)
    parts = _dotted(func).split(".")
    if parts[0] in ("poptorch", "ipukit"):
        parts = parts[1:]
    if len(parts) != 1 or parts[0] not in objects:
        raise ValueError(f"{ast.unparse(node)} is not {_ACCEPTED}")
    return objects[parts[0]](*args, **kwargs)


def _value(node: ast.AST, objects: Optional[Dict[str, Callable]] = None) -> Any:
    objects = OBJECTS if objects is None else objects
    try:
        return ast.literal_eval(node)
    except ValueError:
        pass
    if isinstance(node, ast.Call):
        return _object(node, objects)
    if isinstance(node, (ast.List, ast.Tuple)):
        items = [_value(e, objects) for e in node.elts]
        return items if isinstance(node, ast.List) else tuple(items)
    try:
        member = _enum(_dotted(node))
    except ValueError:
        member = None
    if member is None:
        raise ValueError(f"{ast.unparse(node)} is not {_ACCEPTED}")
    return member


def _setter(options, path: str):
    target = options
    for name in path.split("."):
        target = getattr(target, name)  # unknown names raise UnknownOptionError with hints
    if not callable(target):
        raise ValueError(f"{path} is not a setter")
    return target


_HOW = ("Write one setter call per line without the 'options.' prefix, e.g. "
        "Training.gradientAccumulation(4).")


def apply_lines(options, lines: Sequence[str], source: str,
                objects: Optional[Dict[str, Callable]] = None) -> None:
    """Apply setter calls, one per line, to ``options`` (all parsed first); ``objects`` adds option
    classes a line may build."""
    known = dict(OBJECTS, **(objects or {}))
    filename = os.path.basename(source)
    parsed = []
    for number, line in enumerate(lines, start=1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        try:
            call = ast.parse(text, mode="eval").body
        except SyntaxError as exc:
            # PopTorch's words: "<error> at line <n> of <file>: <detail>\n> <line>"
            raise ConfigFileError(
                f"SyntaxError at line {number} of {filename}: {exc.msg}\n> {text}\n"
                f"(line {number} of {source}) {_HOW}") from None
        parsed.append((number, text, call))
    for number, text, call in parsed:
        where = f"line {number} of {source}"
        try:
            if not isinstance(call, ast.Call):
                raise ValueError("expected a setter call such as deviceIterations(10)")
            args: List[Any] = [_value(a, known) for a in call.args]
            kwargs = {k.arg: _value(k.value, known) for k in call.keywords}
            setter = _setter(options, _dotted(call.func))
        except ValueError as exc:
            raise ConfigFileError(f"{where}: {text!r}: {exc}. {_HOW}") from None
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
