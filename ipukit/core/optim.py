"""PopTorch's optimisers: torch.optim's, accepting PopTorch's extra arguments.

The extra arguments are recorded in ``optimizer.ipu_arguments``. Two act as in
PopTorch: ``loss_scaling`` (an ipukit model multiplies the loss by it for the
backward pass and divides the gradients by it before the step, which keeps
small half-precision gradients from underflowing), and ``accum_type``, the
type half-precision gradients are accumulated in (default float32).
Half-precision weights are always updated in float32 with float32 optimiser
state (the momentum ``*_accum_type`` arguments are recorded, not emulated).
``max_grad_norm`` clips the global gradient norm before each step.
``velocity_scaling`` only chose an IPU number format and changes nothing.
Plain ``torch.optim`` optimisers work with ipukit models too.
"""
from __future__ import annotations

import math
from typing import Any, Dict

import torch

from .errors import OptionsError

_IPU_ONLY = ("loss_scaling", "velocity_scaling", "use_combined_accum", "accum_type",
             "velocity_accum_type",
             "first_order_momentum_accum_type", "second_order_momentum_accum_type",
             "max_grad_norm", "use_tf_variant", "max_weight_norm")


def _split(kwargs: Dict[str, Any]):
    torch_kwargs = {k: v for k, v in kwargs.items() if k not in _IPU_ONLY and v is not None}
    ipu = {k: v for k, v in kwargs.items() if k in _IPU_ONLY and v is not None}
    return torch_kwargs, ipu


class _IpuArguments:
    def _init_ipu(self, ipu: Dict[str, Any]) -> None:
        scaling = ipu.get("loss_scaling", 1.0)
        if not isinstance(scaling, (int, float)) or not 0 < scaling < math.inf:
            raise OptionsError(f"{type(self).__name__}(loss_scaling={scaling!r}): expected a "
                               "positive number (the loss is multiplied by it for the backward "
                               "pass and the gradients divided by it before the update).")
        self.ipu_arguments = dict(ipu)
        norm = ipu.get("max_grad_norm", math.inf)
        self.max_grad_norm = math.inf if norm is None else float(norm)

    def __getstate__(self):
        # torch.optim keeps only defaults, state and param_groups; copies and
        # pickles must keep PopTorch's arguments too
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


class SGD(_IpuArguments, torch.optim.SGD):
    """``torch.optim.SGD`` (+ ``loss_scaling``, ``velocity_scaling``, ``use_combined_accum``, ``max_grad_norm``)."""

    def __init__(self, params, lr=None, momentum=None, dampening=None, weight_decay=None,
                 nesterov=None, maximize=None, foreach=None, differentiable=None, **ipu) -> None:
        kw, extra = _split(dict(lr=lr, momentum=momentum, dampening=dampening,
                                weight_decay=weight_decay, nesterov=nesterov, maximize=maximize,
                                foreach=foreach, differentiable=differentiable, **ipu))
        torch.optim.SGD.__init__(self, params, **kw)
        self._init_ipu(extra)


class _BiasCorrection:
    """PopTorch's ``bias_correction`` switch for Adam and AdamW (torch.optim's are always on)."""

    _decoupled_weight_decay = False

    def _init_bias_correction(self, bias_correction) -> None:
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
            beta1, beta2 = group["betas"]
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad if group.get("maximize") is not True else -p.grad
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                if decay and self._decoupled_weight_decay:
                    p.mul_(1 - lr * decay)
                elif decay:
                    grad = grad + decay * p
                state["exp_avg"].lerp_(grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                p.addcdiv_(state["exp_avg"], state["exp_avg_sq"].sqrt().add_(eps), value=-lr)
        return loss


class Adam(_BiasCorrection, _IpuArguments, torch.optim.Adam):
    """``torch.optim.Adam`` (+ PopTorch's ``loss_scaling``, ``*_accum_type``, ``max_grad_norm``,
    ``bias_correction``)."""

    def __init__(self, params, lr=None, betas=None, eps=None, weight_decay=None, amsgrad=None,
                 foreach=None, maximize=None, capturable=None, differentiable=None, fused=None,
                 bias_correction=None, **ipu) -> None:
        kw, extra = _split(dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                amsgrad=amsgrad, foreach=foreach, maximize=maximize,
                                capturable=capturable, differentiable=differentiable, fused=fused,
                                **ipu))
        torch.optim.Adam.__init__(self, params, **kw)
        self._init_ipu(extra)
        self._init_bias_correction(bias_correction)


class AdamW(_BiasCorrection, _IpuArguments, torch.optim.AdamW):
    """``torch.optim.AdamW`` (+ PopTorch's ``loss_scaling``, ``*_accum_type``, ``max_grad_norm``,
    ``bias_correction``)."""

    _decoupled_weight_decay = True

    def __init__(self, params, lr=None, betas=None, eps=None, weight_decay=None, amsgrad=None,
                 foreach=None, maximize=None, capturable=None, differentiable=None, fused=None,
                 bias_correction=None, **ipu) -> None:
        kw, extra = _split(dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                amsgrad=amsgrad, foreach=foreach, maximize=maximize,
                                capturable=capturable, differentiable=differentiable, fused=fused,
                                **ipu))
        torch.optim.AdamW.__init__(self, params, **kw)
        self._init_ipu(extra)
        self._init_bias_correction(bias_correction)


class RMSprop(_IpuArguments, torch.optim.RMSprop):
    """``torch.optim.RMSprop`` (+ PopTorch's ``loss_scaling``, ``*_accum_type``)."""

    def __init__(self, params, lr=None, alpha=None, eps=None, weight_decay=None, momentum=None,
                 centered=None, foreach=None, maximize=None, differentiable=None, **ipu) -> None:
        if ipu.get("use_tf_variant"):
            raise OptionsError("ipukit.optim.RMSprop(use_tf_variant=True) is not supported: "
                               "ipukit uses torch.optim.RMSprop's update rule. Leave "
                               "use_tf_variant unset (False).")
        kw, extra = _split(dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay,
                                momentum=momentum, centered=centered, foreach=foreach,
                                maximize=maximize, differentiable=differentiable, **ipu))
        torch.optim.RMSprop.__init__(self, params, **kw)
        self._init_ipu(extra)


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
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.lerp_(p.grad, 1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
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

    Per parameter tensor: Adam's moments (bias-corrected unless
    ``bias_correction=False``) give ``u = m / (sqrt(v) + eps) + weight_decay * w``;
    the step is ``w -= lr * trust * u`` with ``trust = min(|w|, max_weight_norm) / |u|``
    (1 when either norm is 0). PopTorch's defaults: ``lr=1e-3``,
    ``betas=(0.9, 0.999)``, ``eps=1e-8``, ``weight_decay=1e-2``,
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
        self._init_ipu(_split(ipu)[1])


class VariableAttributes:
    """PopTorch's optimizer attribute markers (accepted; no effect)."""

    def markAsConstant(self, attr: str) -> None:  # noqa: N802 - PopTorch's name
        pass

    def markAsVariable(self, attr: str) -> None:  # noqa: N802
        pass


for _cls in (SGD, Adam, AdamW, RMSprop, LAMB):
    _cls.variable_attrs = VariableAttributes()
