"""The machinery every option group shares (freezing, ignored setters, typo hints), apart from
``Options`` so that its groups can build on it.
"""
from __future__ import annotations

import copy
import difflib
import functools
from typing import Any, List, Sequence, Tuple

from .errors import FrozenOptionsError, OptionsError, UnknownOptionError


def _positive_int(owner: str, name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise OptionsError(
            f"{owner}.{name}({value!r}): expected an int >= {minimum}, got "
            f"{type(value).__name__} {value!r}.")
    return value


class _OptionGroup:
    """Common machinery: freezing, ignored setters, helpful unknown-name errors."""

    _path = "Options"

    def __init__(self) -> None:
        object.__setattr__(self, "_frozen", False)
        object.__setattr__(self, "_sealed", False)
        object.__setattr__(self, "_ignored", {})

    def __init_subclass__(cls, **kwargs):
        """Seal every instance after its own ``__init__``: a new public name is then a typo."""
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is None:
            return

        @functools.wraps(init)  # help() and inspect.signature show the class's own
        def sealed_init(self, *args, **kw):
            init(self, *args, **kw)
            if type(self) is cls:
                object.__setattr__(self, "_sealed", True)

        cls.__init__ = sealed_init

    def _children(self) -> List["_OptionGroup"]:
        return [v for v in self.__dict__.values() if isinstance(v, _OptionGroup)]

    def freeze(self) -> None:
        """Freeze these options and their groups: a later setter raises FrozenOptionsError."""
        object.__setattr__(self, "_frozen", True)
        for child in self._children():
            child.freeze()

    def _check_not_frozen(self, call: str) -> None:
        if self._frozen:
            raise FrozenOptionsError(
                f"Can't modify frozen Options: {self._path}.{call} was called after these "
                "Options were handed to a model or DataLoader, which froze them. Call "
                "options.clone() and change the copy, then build the model or DataLoader "
                "with it.")

    def _ignore(self, name: str, *args: Any, **kwargs: Any):
        """Record a PopTorch setter that has no effect on CPU/GPU."""
        self._check_not_frozen(f"{name}(...)")
        value = [_jsonable(a) for a in args] + [{k: _jsonable(v)} for k, v in kwargs.items()]
        self._ignored[name] = value[0] if len(value) == 1 else value
        return self

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        known = [n for n in dir(type(self)) if not n.startswith("_")]
        known += [n for n in self.__dict__ if not n.startswith("_")]
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise UnknownOptionError(
            f"{self._path} has no option {name!r}.{hint} See the Options page of "
            "ipukit's documentation, docs/options.md (PopTorch's names, plus ipukit's "
            "additions), or help(ipukit.Options).")

    def __setattr__(self, name: str, value: Any) -> None:
        prop = getattr(type(self), name, None)
        if isinstance(prop, property) and prop.fset is not None:
            self._check_not_frozen(f"{name} = {value!r}")
            prop.fset(self, value)
            return
        if name.startswith("_") or name in self.__dict__ or not self._sealed:
            self._check_not_frozen(f"{name} = {value!r}")
            object.__setattr__(self, name, value)
            return
        raise UnknownOptionError(
            f"{self._path} has no attribute {name!r} to assign; use the setter methods "
            f"(for example {self._path}.deviceIterations(4)).")

    def __deepcopy__(self, memo):
        """An independent, unfrozen copy (PopTorch's ``clone()`` and ``copy.deepcopy``)."""
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        for key, value in self.__dict__.items():
            object.__setattr__(clone, key, copy.deepcopy(value, memo))
        object.__setattr__(clone, "_frozen", False)
        return clone

    def __copy__(self):
        """An independent copy, frozen when these options are (PopTorch's ``copy.copy``)."""
        clone = copy.deepcopy(self)
        if self._frozen:
            clone.freeze()
        return clone

    def _snapshot(self) -> dict:
        """This group's state (groups recursively), for :meth:`_restore` after a failed update."""
        return {key: (value, value._snapshot()) if isinstance(value, _OptionGroup)
                else (value, copy.deepcopy(value))
                for key, value in self.__dict__.items()}

    def _restore(self, snapshot: dict) -> None:
        """Put back a :meth:`_snapshot`; sub-groups keep their identity."""
        for key in [k for k in self.__dict__ if k not in snapshot]:
            object.__delattr__(self, key)
        for key, (value, state) in snapshot.items():
            if isinstance(value, _OptionGroup):
                value._restore(state)
                object.__setattr__(self, key, value)
            else:
                object.__setattr__(self, key, state)

    def _repr_items(self) -> List[Tuple[str, Any]]:
        """(name, value) pairs of ``repr``: public values, then recorded setters, then groups."""
        values = [(k, v) for k, v in self.__dict__.items()
                  if not k.startswith("_") and not isinstance(v, _OptionGroup)]
        values += [(k, getattr(self, k)) for k in sorted(dir(type(self)))
                   if isinstance(getattr(type(self), k), property)
                   and getattr(type(self), k).fset is not None]
        values += list(self._ignored.items())
        groups = sorted((k, v) for k, v in self.__dict__.items() if isinstance(v, _OptionGroup))
        return values + groups

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={v!r}" for k, v in self._repr_items())
        return f"{type(self).__name__}({body})"


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if hasattr(value, "name") and hasattr(value, "value"):
        return value.name
    return repr(value)


class _IgnoredGroup(_OptionGroup):
    """A PopTorch option group whose setters (named in ``_setters``) only matter to
    the IPU compiler: calling one records it under ``"ignored"`` and does nothing else."""

    _setters: Sequence[str] = ()

    def __getattr__(self, name: str):
        if name in self._setters:
            return lambda *args, **kwargs: self._ignore(name, *args, **kwargs)
        return super().__getattr__(name)

    def __dir__(self):
        return list(super().__dir__()) + list(self._setters)

    def toDict(self) -> dict:
        return dict(self._ignored)
