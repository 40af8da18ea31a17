"""A stage's traced module as one flat graph: :func:`flat_stage` inlines torch's nested
``InterpreterModule``s (each level a call and checks per forward) into one ``GraphModule`` with
the same ops on the same parameters and buffers, and calls torch's public built-ins for aten
overloads (:func:`public_op`: same kernels, faster binding). What it does not understand stays
nested.
"""
from __future__ import annotations

import operator
from typing import Any, Dict, Optional

import torch
import torch.fx as fx


class _NotFlat(Exception):
    """Something :func:`flat_stage` does not inline: keep the nested module."""


def _has_graph(module: torch.nn.Module) -> bool:
    return isinstance(getattr(module, "graph", None), fx.Graph)


def flat_stage(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with every nested graph module inlined, or ``module`` itself when not possible."""
    if not _has_graph(module):
        return module
    graph = fx.Graph()
    attrs: Dict[str, Any] = {}
    inputs = [graph.placeholder(n.target) for n in module.graph.nodes if n.op == "placeholder"]
    try:
        out = _inline(module, "", inputs, graph, attrs)
    except _NotFlat:
        return module
    graph.output(out)
    holder = torch.nn.Module()
    for name, value in attrs.items():
        if isinstance(value, torch.nn.Parameter):
            holder.register_parameter(name, value)
        elif isinstance(value, torch.Tensor):
            holder.register_buffer(name, value)
        else:
            setattr(holder, name, value)
    flat = fx.GraphModule(holder, graph, class_name="FlatStage")
    flat.__dict__["_ipukit_nested"] = module  # what it was made from (not a submodule)
    return flat


def _inline(module: torch.nn.Module, prefix: str, args: list, graph: fx.Graph,
            attrs: Dict[str, Any]) -> Any:
    """Emit ``module``'s graph into ``graph`` with its placeholders bound to ``args``;
    returns what its output node returns (nodes of ``graph``)."""
    env: Dict[fx.Node, Any] = {}
    given = iter(args)

    def value(n: Any) -> Any:
        return fx.node.map_arg(n, lambda m: env[m])

    for node in module.graph.nodes:
        if node.op == "placeholder":
            try:
                env[node] = next(given)
            except StopIteration:
                if not node.args:  # no default value
                    raise _NotFlat(node.target) from None
                env[node] = node.args[0]
        elif node.op == "get_attr":
            obj = module
            for part in node.target.split("."):
                obj = getattr(obj, part)
            name = (prefix + node.target).replace(".", "_")
            if name in attrs and attrs[name] is not obj:
                raise _NotFlat(name)
            attrs[name] = obj
            env[node] = graph.get_attr(name)
        elif node.op == "call_module":
            sub = module.get_submodule(node.target)
            if node.kwargs or not _has_graph(sub) or getattr(sub, "_forward_hooks", None) \
                    or getattr(sub, "_forward_pre_hooks", None):
                raise _NotFlat(node.target)
            env[node] = _inline(sub, f"{prefix}{node.target}.", list(value(node.args)), graph,
                                attrs)
        elif node.op == "call_function" and node.target is operator.getitem \
                and isinstance(node.args[0], fx.Node) \
                and isinstance(env[node.args[0]], (tuple, list)):
            env[node] = env[node.args[0]][node.args[1]]  # an item of an inlined module's output
        elif node.op in ("call_function", "call_method"):
            env[node] = copied = graph.node_copy(node, lambda m: env[m])
            if copied.op == "call_function":
                public = public_op(copied.target)
                if public is not None:
                    copied.op, copied.target = public
        elif node.op == "output":
            return value(node.args[0])
    raise _NotFlat("no output")


_PUBLIC: Dict[Any, Optional[tuple]] = {}


def public_op(target: Any) -> Optional[tuple]:
    """``(node op, target)`` calling torch's public built-in for the aten overload ``target``, or
    None where it may not be the same call."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    if target in _PUBLIC:
        return _PUBLIC[target]
    found = None
    if target.namespace == "aten":
        schema = target._schema
        name = schema.name.split("::", 1)[1]
        first = schema.arguments[0] if schema.arguments else None
        if first is not None and str(first.type) in ("Tensor", "List[Tensor]") \
                and not first.kwarg_only and not name.startswith("_"):
            for home in (torch.nn.functional, torch):
                f = getattr(home, name, None)
                if type(f).__name__ == "builtin_function_or_method" and f.__name__ == name:
                    found = ("call_function", f)
                    break
            else:
                if type(getattr(torch.Tensor, name, None)).__name__ == "method_descriptor":
                    found = ("call_method", name)
    _PUBLIC[target] = found
    return found


def nested_of(module: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The nested module a flat stage was made from (None when ``module`` is not one)."""
    return getattr(module, "_ipukit_nested", None)
