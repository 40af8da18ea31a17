"""PopTorch's optimisers: torch.optim's, accepting PopTorch's extra arguments (recorded in
``optimizer.ipu_arguments``). ``loss_scaling`` multiplies the loss for the backward pass and
divides the gradients before the step, ``accum_type`` is the type half-precision gradients
accumulate in (default float32), ``max_grad_norm`` clips the global gradient norm;
``velocity_scaling`` and the other ``*_accum_type`` are recorded only. Each is an
:class:`Optimizer` whose ``state_dict()`` adds ``"ipu_state"`` and ``"ipu_param"`` under
PopART's names, with ``variable_attrs`` (:class:`VariableAttributes`). Plain ``torch.optim``
optimisers work with ipukit models too.
"""
from __future__ import annotations

import copy
import math
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from .errors import OptionsError

_IPU_ONLY = ("loss_scaling", "velocity_scaling", "use_combined_accum", "accum_type",
             "velocity_accum_type", "first_order_momentum_accum_type",
             "second_order_momentum_accum_type", "max_grad_norm", "use_tf_variant",
             "max_weight_norm")


def _split(kwargs: Dict[str, Any]):
    torch_kwargs = {k: v for k, v in kwargs.items() if k not in _IPU_ONLY and v is not None}
    ipu = {k: v for k, v in kwargs.items() if k in _IPU_ONLY and v is not None}
    return torch_kwargs, ipu


class VariableAttributes:
    """Which of an optimiser's attributes are variable and which constant (PopTorch's class):
    the constructor's arguments start variable. ipukit compiles no optimiser, so every attribute
    can change between calls (``setOptimizer``); the marks are kept for code that reads them."""

    def __init__(self, variable_attributes: List[str], allowed_attributes: List[str]) -> None:
        self._variable_attributes = list(variable_attributes)
        self._allowed_attributes = list(allowed_attributes)

    def isConstant(self, attr: str) -> bool:  # noqa: N802 - PopTorch's name
        """True unless ``attr`` is marked as variable."""
        return attr not in self._variable_attributes

    def _check(self, call: str, attr: str) -> None:
        if attr not in self._allowed_attributes:
            raise OptionsError(
                f"Unknown attribute {attr}, allowed values: {self._allowed_attributes}. "
                f"variable_attrs.{call}({attr!r}) names one of this optimiser's attributes "
                "(its defaults, or loss_scaling).")

    def markAsConstant(self, attr: str) -> None:  # noqa: N802
        """Mark ``attr`` (one of this optimiser's attributes) as constant."""
        self._check("markAsConstant", attr)
        self._variable_attributes = [a for a in self._variable_attributes if a != attr]

    def markAsVariable(self, attr: str) -> None:  # noqa: N802
        """Mark ``attr`` (one of this optimiser's attributes) as variable."""
        self._check("markAsVariable", attr)
        if attr not in self._variable_attributes:
            self._variable_attributes.append(attr)

    def __repr__(self) -> str:
        return (f"VariableAttributes(variable={self._variable_attributes}, "
                f"allowed={self._allowed_attributes})")


#: torch's per-parameter state keys -> PopART's prefixes in ``"ipu_state"`` (``Accl1___<param>``)
_ADAM_STATE = {"exp_avg": "Accl1", "exp_avg_sq": "Accl2", "max_exp_avg_sq": "Accl3",
               "step": "Step"}
_RMSPROP_STATE = {"square_avg": "Accl1", "grad_avg": "Accl2", "momentum_buffer": "Accl3",
                  "step": "Step"}
_SGD_STATE = {"momentum_buffer": "Accl1"}
#: param group hyperparameters -> PopART's names in ``"ipu_param"`` (``<name>___specific___<p>``)
_PARAM_NAMES = {"lr": "learningRate", "weight_decay": "weightDecay", "momentum": "momentum",
                "dampening": "dampening", "eps": "eps", "alpha": "alpha",
                "max_weight_norm": "maxWeightNorm", "betas": ("beta1", "beta2")}
_LOSS_SCALING = "lossScaling_FLOAT"


class Optimizer:
    """PopTorch's base class of its optimisers, mixed in before a ``torch.optim`` one
    (``class Mine(ipukit.optim.Optimizer, torch.optim.SGD)``). ``state_dict()`` adds
    ``"ipu_state"`` (state under PopART's names, e.g. ``Accl1___fc.weight``) and ``"ipu_param"``
    (hyperparameters per parameter), None until known; ``load_state_dict`` accepts only such a
    dictionary."""

    _ipu_state_prefixes: Dict[str, str] = _ADAM_STATE

    def __init__(self, *args, **kwargs) -> None:
        if args or kwargs:  # class Mine(Optimizer, torch.optim.SGD): super().__init__(params, ...)
            super().__init__(*args, **kwargs)
        self._reset_ipu()

    def _reset_ipu(self) -> None:
        self._ipu_names: Optional[List[str]] = None
        self._ipu_pending: Optional[Tuple[dict, dict]] = None
        self._ipu_used = False  # stepped once: PopTorch's state dict had IPU state from then on
        # PopTorch's flags: here they only say whether a state dict was loaded since the last use
        self.ipu_state_is_dirty = False
        self.host_state_is_dirty = False

    def state_dict(self) -> Dict[str, Any]:
        return self.get_state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.set_state_dict(state_dict)

    def get_state_dict(self) -> Dict[str, Any]:
        """torch's state dict plus ``"ipu_state"`` and ``"ipu_param"``."""
        ipu_state, ipu_param = self._ipu_entries()
        return {"ipu_state": ipu_state, "ipu_param": ipu_param,
                **torch.optim.Optimizer.state_dict(self)}

    def set_state_dict(self, state: Dict[str, Any]) -> None:
        """Load a state dict from :meth:`get_state_dict`; a failed load changes nothing."""
        if not state:
            raise OptionsError(
                "Cannot load optimizer state dictionary because it is empty. Pass the "
                "dictionary optimizer.state_dict() returned.")
        if not isinstance(state, dict) or "ipu_state" not in state or "ipu_param" not in state:
            raise OptionsError(
                "Only IPU optimizer states can be loaded onto the IPU. This dictionary has no "
                "\"ipu_state\" and \"ipu_param\" entries: it comes from a torch.optim "
                "optimiser (or was saved before ipukit added them). Load it into that "
                "torch.optim optimiser and pass that one to ipukit.trainingModel (ipukit runs "
                "torch.optim optimisers unchanged), or save the state with this optimiser's "
                "state_dict().")
        ipu_state, ipu_param = state["ipu_state"] or {}, state["ipu_param"] or {}
        for name, entries in (("ipu_state", ipu_state), ("ipu_param", ipu_param)):
            if not isinstance(entries, dict) or not all(
                    isinstance(k, str) and isinstance(v, (torch.Tensor, int, float))
                    for k, v in entries.items()):
                raise OptionsError(
                    f"Optimizer.load_state_dict: state_dict[{name!r}] must map names to "
                    "tensors, as optimizer.state_dict() returns it.")
        self._group_values(ipu_param)  # refuse conflicting values before changing anything
        scaling = ipu_param.get(_LOSS_SCALING)
        if scaling is not None and not 0 < float(scaling) < math.inf:
            raise OptionsError(f"Optimizer.load_state_dict: {_LOSS_SCALING}={float(scaling)} "
                               "must be a positive number.")
        backup = copy.deepcopy(torch.optim.Optimizer.state_dict(self))
        arguments = dict(getattr(self, "ipu_arguments", None) or {})
        try:
            torch.optim.Optimizer.load_state_dict(self, {k: v for k, v in state.items()
                                                         if k not in ("ipu_state", "ipu_param")})
            unresolved = self._apply_ipu(ipu_state, ipu_param)
        except (ValueError, KeyError, RuntimeError, TypeError) as exc:
            torch.optim.Optimizer.load_state_dict(self, backup)  # a failed load changes nothing
            if hasattr(self, "ipu_arguments"):
                self.ipu_arguments = arguments
            if isinstance(exc, OptionsError):
                raise
            raise OptionsError(f"Optimizer.load_state_dict: {exc} (the dictionary must come "
                               "from this kind of optimiser over the same parameter groups, "
                               "as optimizer.state_dict() returns it).") from exc
        # entries naming parameters not named yet: applied by bind_parameter_names
        self._ipu_pending = unresolved if getattr(self, "_ipu_names", None) is None and (
            unresolved[0] or unresolved[1]) else None
        self.ipu_state_is_dirty = True
        self.host_state_is_dirty = False

    def has_state(self) -> bool:
        """True when ``state_dict()`` carries IPU state (``"ipu_state"`` and ``"ipu_param"``)."""
        ipu_state, ipu_param = self._ipu_entries()
        return ipu_state is not None and ipu_param is not None

    def step(self, *args, **kwargs):
        self._ipu_used = True
        return super().step(*args, **kwargs)

    def __getstate__(self):  # copies and pickles keep the names and PopTorch's flags too
        state = super().__getstate__()
        for name in ("_ipu_names", "_ipu_pending", "_ipu_used", "ipu_state_is_dirty",
                     "host_state_is_dirty"):
            if name in self.__dict__:
                state[name] = self.__dict__[name]
        return state

    def bind_parameter_names(self, named_parameters: Iterable[Tuple[str, torch.nn.Parameter]]
                             ) -> None:
        """Name this optimiser's parameters (a model's ``named_parameters()``) in
        ``"ipu_state"`` / ``"ipu_param"``, as PopTorch did once the model was compiled;
        values loaded before the names were known are applied now."""
        by_id = {id(p): n for n, p in named_parameters}
        params = self._flat_params()
        self._ipu_names = [by_id.get(id(p), str(i)) for i, p in enumerate(params)]
        pending, self._ipu_pending = getattr(self, "_ipu_pending", None), None
        if pending is not None:
            self._group_values(pending[1])
            self._apply_ipu(*pending)

    def _flat_params(self) -> List[torch.nn.Parameter]:
        return [p for g in self.param_groups for p in g["params"]]

    def _names(self) -> List[str]:
        names = getattr(self, "_ipu_names", None)
        params = self._flat_params()
        if names is None or len(names) != len(params):
            return [str(i) for i in range(len(params))]
        return list(names)

    def _ipu_entries(self):
        if getattr(self, "_ipu_names", None) is None and not self.state \
                and not getattr(self, "_ipu_used", False):
            return None, None
        ipu_state: Dict[str, torch.Tensor] = {}
        ipu_param: Dict[str, torch.Tensor] = {}
        params = self._flat_params()
        names = dict(zip(map(id, params), self._names()))
        for group in self.param_groups:
            for p in group["params"]:
                name = names[id(p)]
                for key, value in self.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor):
                        value = value.detach().clone()
                    elif isinstance(value, (int, float)) and not isinstance(value, bool):
                        value = torch.tensor(value)
                    else:
                        continue
                    ipu_state[f"{self._ipu_state_prefixes.get(key, key)}___{name}"] = value
                for key, popart in _PARAM_NAMES.items():
                    value = group.get(key)
                    if key == "betas" and isinstance(value, (tuple, list)):
                        for part, beta in zip(popart, value):
                            ipu_param[f"{part}___specific___{name}"] = torch.tensor(float(beta))
                    elif isinstance(value, (int, float)) and not isinstance(value, bool):
                        ipu_param[f"{popart}___specific___{name}"] = torch.tensor(float(value))
        ipu_param[_LOSS_SCALING] = torch.tensor(float(self._loss_scaling()))
        return ipu_state, ipu_param

    def _loss_scaling(self) -> float:
        return float((getattr(self, "ipu_arguments", None) or {}).get("loss_scaling", 1.0))

    def _group_values(self, ipu_param: dict) -> Dict[Tuple[int, str], float]:
        """``ipu_param``'s hyperparameters per (group, key); conflicts in one group are refused."""
        names = self._names()
        params = self._flat_params()
        group_of = {id(p): g for g, group in enumerate(self.param_groups) for p in group["params"]}
        by_name = {n: group_of[id(p)] for n, p in zip(names, params)}
        wanted: Dict[Tuple[int, str], Tuple[float, str]] = {}
        for key, value in ipu_param.items():
            hyper, sep, name = key.partition("___specific___")
            if not sep or name not in by_name:
                continue
            target = next(((k, i) for k, popart in _PARAM_NAMES.items()
                           for i, n in enumerate(popart if isinstance(popart, tuple) else (popart,))
                           if n == hyper), None)
            if target is None:
                continue
            slot = (by_name[name], f"{target[0]}#{target[1]}")
            number = float(value)
            if slot in wanted and wanted[slot][0] != number:
                raise OptionsError(
                    f"Optimizer.load_state_dict: \"ipu_param\" gives {hyper} = {number} for "
                    f"{name} and {wanted[slot][0]} for {wanted[slot][1]}, which are in one param "
                    "group; ipukit's hyperparameters are per param group, as torch's: put "
                    "parameters that need their own values in their own groups.")
            wanted[slot] = (number, name)
        return {slot: v for slot, (v, _) in wanted.items()}

    def _apply_ipu(self, ipu_state: dict, ipu_param: dict) -> Tuple[dict, dict]:
        """Write loaded ``"ipu_state"`` / ``"ipu_param"`` values over torch's state;
        returns the entries naming no parameter of this optimiser."""
        params = dict(zip(self._names(), self._flat_params()))
        slots = {prefix: key for key, prefix in self._ipu_state_prefixes.items()}
        left_state = {k: v for k, v in ipu_state.items() if k.rpartition("___")[2] not in params}
        left_param = {k: v for k, v in ipu_param.items()
                      if "___specific___" in k and k.partition("___specific___")[2] not in params}
        for key, value in ipu_state.items():
            prefix, _, name = key.rpartition("___")
            p = params.get(name)
            if p is None:
                continue
            state = self.state[p]
            slot = slots.get(prefix, prefix)
            old = state.get(slot)
            value = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            if isinstance(old, torch.Tensor):
                with torch.no_grad():
                    old.copy_(value)
            elif isinstance(old, (int, float)):
                state[slot] = type(old)(value.item())
            else:
                state[slot] = value.detach().clone() if slot == "step" else \
                    value.detach().to(p.device, copy=True)
        for (g, slot), value in self._group_values(ipu_param).items():
            key, index = slot.split("#")
            group = self.param_groups[g]
            if key == "betas":
                betas = list(group["betas"])
                if not _same(betas[int(index)], value):
                    betas[int(index)] = value
                    group["betas"] = tuple(betas)
            elif key in group and not _same(group[key], value):
                group[key] = value
        scaling = ipu_param.get(_LOSS_SCALING)
        if scaling is not None and hasattr(self, "ipu_arguments") \
                and not _same(self._loss_scaling(), float(scaling)):
            self.ipu_arguments["loss_scaling"] = float(scaling)
        return left_state, left_param


def _same(current: Any, loaded: float) -> bool:
    """Whether a loaded hyperparameter is the current one (``"ipu_param"`` holds float32)."""
    if isinstance(current, bool) or not isinstance(current, (int, float)):
        return False
    return current == loaded or float(torch.tensor(current, dtype=torch.float32)) == loaded


class _IpuArguments(Optimizer):
    def _init_ipu(self, ipu: Dict[str, Any], given: Dict[str, Any],
                  extra: Tuple[str, ...] = ()) -> None:
        """Check and record PopTorch's arguments in ``ipu``; the arguments ``given`` become
        variable (PopTorch's rule: the defaults, ``extra`` and ``loss_scaling`` may be marked)."""
        self._reset_ipu()
        ipu = _split(ipu)[1]
        scaling = ipu.get("loss_scaling", 1.0)
        if not isinstance(scaling, (int, float)) or not 0 < scaling < math.inf:
            raise OptionsError(f"{type(self).__name__}(loss_scaling={scaling!r}): expected a "
                               "positive number (the loss is multiplied by it for the backward "
                               "pass and the gradients divided by it before the update).")
        for name in ("accum_type", "velocity_accum_type", "first_order_momentum_accum_type",
                     "second_order_momentum_accum_type"):
            if ipu.get(name, torch.float32) not in (torch.float16, torch.float32):
                raise OptionsError(
                    "Accumulation types must be either torch.float32 or torch.float16 "
                    f"({type(self).__name__}({name}={ipu[name]!r})): pass one of those, or "
                    "leave it unset (torch.float32).")
        self.ipu_arguments = dict(ipu)
        norm = ipu.get("max_grad_norm", math.inf)
        self.max_grad_norm = math.inf if norm is None else float(norm)
        self.variable_attrs = VariableAttributes(
            [k for k, v in given.items() if v is not None],
            list(self.defaults) + list(extra) + ["loss_scaling"])

    @property
    def loss_scaling(self) -> float:
        """PopTorch's attribute: the loss scaling factor (1.0 unless given); assignable."""
        return float(self.ipu_arguments.get("loss_scaling", 1.0))

    @loss_scaling.setter
    def loss_scaling(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not 0 < value < math.inf:
            raise OptionsError(f"{type(self).__name__}.loss_scaling = {value!r}: expected a "
                               "positive number.")
        self.ipu_arguments["loss_scaling"] = value

    def __getstate__(self):  # copies and pickles keep PopTorch's arguments too
        state = super().__getstate__()
        for name, value in self.__dict__.items():
            if not name.startswith("_") and name not in state:
                state[name] = value
        return state

    def _clip(self) -> None:
        if math.isfinite(self.max_grad_norm):
            params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)

    @torch.no_grad()
    def step(self, closure=None):
        self._clip()
        return super().step(closure)


def _moments(state: dict, p: torch.Tensor, grad: torch.Tensor, betas, step0) -> Tuple:
    """Adam's first and second moments of ``p``, updated with ``grad``."""
    if not state:
        state.update(step=step0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
    state["step"] += 1
    state["exp_avg"].lerp_(grad, 1 - betas[0])
    state["exp_avg_sq"].mul_(betas[1]).addcmul_(grad, grad, value=1 - betas[1])
    return state["exp_avg"], state["exp_avg_sq"]


class SGD(_IpuArguments, torch.optim.SGD):
    """``torch.optim.SGD`` (+ ``loss_scaling``, ``velocity_scaling``, ``use_combined_accum``, ``max_grad_norm``)."""

    _ipu_state_prefixes = _SGD_STATE

    def __init__(self, params, lr=None, momentum=None, dampening=None, weight_decay=None,
                 nesterov=None, maximize=None, foreach=None, differentiable=None, **ipu) -> None:
        given = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                     nesterov=nesterov, maximize=maximize, foreach=foreach,
                     differentiable=differentiable, **ipu)
        torch.optim.SGD.__init__(self, params, **_split(given)[0])
        self._init_ipu(ipu, given, ("velocity_scaling",) if ipu.get("use_combined_accum") else ())


class _BiasCorrection:
    """PopTorch's ``bias_correction`` switch for Adam and AdamW (torch.optim's are always on)."""

    _decoupled_weight_decay = False
    _torch_class = torch.optim.Adam        #: the torch.optim class the optimiser is

    def __init__(self, params, lr=None, betas=None, eps=None, weight_decay=None, amsgrad=None,
                 foreach=None, maximize=None, capturable=None, differentiable=None, fused=None,
                 bias_correction=None, **ipu) -> None:
        given = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)
        self._torch_class.__init__(self, params, **_split(dict(
            given, foreach=foreach, maximize=maximize, capturable=capturable,
            differentiable=differentiable, fused=fused, **ipu))[0])
        self._init_ipu(ipu, dict(given, bias_correction=bias_correction, **ipu))
        self.bias_correction = True if bias_correction is None else bool(bias_correction)
        if not self.bias_correction and any(g.get("amsgrad") for g in self.param_groups):
            raise OptionsError(f"{type(self).__name__}(bias_correction=False, amsgrad=True): "
                               "ipukit implements bias_correction=False without amsgrad only.")

    @torch.no_grad()
    def step(self, closure=None):
        if self.bias_correction:
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._clip()
        for group in self.param_groups:
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad if group.get("maximize") is not True else -p.grad
                if decay and self._decoupled_weight_decay:
                    p.mul_(1 - lr * decay)
                elif decay:
                    grad = grad + decay * p
                m, v = _moments(self.state[p], p, grad, group["betas"], torch.tensor(0.0))
                p.addcdiv_(m, v.sqrt().add_(eps), value=-lr)
        return loss


class Adam(_BiasCorrection, _IpuArguments, torch.optim.Adam):
    """``torch.optim.Adam`` (+ PopTorch's ``loss_scaling``, ``*_accum_type``, ``max_grad_norm``,
    ``bias_correction``)."""

    _torch_class = torch.optim.Adam


class AdamW(_BiasCorrection, _IpuArguments, torch.optim.AdamW):
    """``torch.optim.AdamW`` (+ PopTorch's ``loss_scaling``, ``*_accum_type``, ``max_grad_norm``,
    ``bias_correction``)."""

    _torch_class = torch.optim.AdamW
    _decoupled_weight_decay = True


class RMSprop(_IpuArguments, torch.optim.RMSprop):
    """``torch.optim.RMSprop`` (+ PopTorch's ``loss_scaling``, ``*_accum_type``)."""

    _ipu_state_prefixes = _RMSPROP_STATE

    def __init__(self, params, lr=None, alpha=None, eps=None, weight_decay=None, momentum=None,
                 centered=None, foreach=None, maximize=None, differentiable=None, **ipu) -> None:
        if ipu.get("use_tf_variant"):
            raise OptionsError("ipukit.optim.RMSprop(use_tf_variant=True) is not supported: "
                               "ipukit uses torch.optim.RMSprop's update rule. Leave "
                               "use_tf_variant unset (False).")
        given = dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum,
                     centered=centered)
        torch.optim.RMSprop.__init__(self, params, **_split(dict(
            given, foreach=foreach, maximize=maximize, differentiable=differentiable, **ipu))[0])
        self._init_ipu(ipu, dict(given, **ipu))


class _Lamb(torch.optim.Optimizer):
    """LAMB's update rule (torch.optim has none)."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                m, v = _moments(state, p, p.grad, group["betas"], 0)
                t = state["step"]
                m_hat, v_hat = ((m / (1 - beta1 ** t), v / (1 - beta2 ** t))
                                if self.bias_correction else (m, v))
                update = m_hat / (v_hat.sqrt() + group["eps"]) + group["weight_decay"] * p
                weight_norm = p.norm().clamp(max=group["max_weight_norm"])
                update_norm = update.norm()
                both = (weight_norm > 0) & (update_norm > 0)
                trust = torch.where(both, weight_norm / update_norm, torch.ones_like(update_norm))
                p.sub_(group["lr"] * trust * update)
        return loss


class LAMB(_IpuArguments, _Lamb):
    """LAMB (You et al., 2019, "Large Batch Optimization for Deep Learning"), PopTorch's form.

    Per parameter tensor: Adam's moments (bias-corrected unless ``bias_correction=False``) give
    ``u = m / (sqrt(v) + eps) + weight_decay * w``; the step is ``w -= lr * trust * u`` with
    ``trust = min(|w|, max_weight_norm) / |u|`` (1 when either norm is 0). PopTorch's defaults:
    ``lr=1e-3``, ``betas=(0.9, 0.999)``, ``eps=1e-8``, ``weight_decay=1e-2``,
    ``max_weight_norm=65500``.
    """

    def __init__(self, params, lr=None, betas=None, eps=None, weight_decay=None,
                 bias_correction=None, max_weight_norm=None, **ipu) -> None:
        defaults = dict(lr=1e-3 if lr is None else lr,
                        betas=(0.9, 0.999) if betas is None else tuple(betas),
                        eps=1e-8 if eps is None else eps,
                        weight_decay=1e-2 if weight_decay is None else weight_decay,
                        max_weight_norm=65500.0 if max_weight_norm is None else max_weight_norm)
        for name in ("lr", "eps", "weight_decay", "max_weight_norm"):
            if not isinstance(defaults[name], (int, float)) or defaults[name] < 0:
                raise OptionsError(f"ipukit.optim.LAMB({name}={defaults[name]!r}): "
                                   "expected a number >= 0.")
        if not all(0.0 <= b < 1.0 for b in defaults["betas"]):
            raise OptionsError(f"ipukit.optim.LAMB(betas={defaults['betas']!r}): "
                               "each beta must be in [0, 1).")
        unknown = sorted(set(ipu) - set(_IPU_ONLY))
        if unknown:
            raise TypeError(f"LAMB.__init__() got unexpected keyword argument(s) {unknown}")
        torch.optim.Optimizer.__init__(self, params, defaults)
        self.bias_correction = True if bias_correction is None else bool(bias_correction)
        self._init_ipu(ipu, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                 bias_correction=bias_correction,
                                 max_weight_norm=max_weight_norm, **ipu))
