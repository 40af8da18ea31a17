"""Every private torch name ipukit uses, in one place (floor 0: imports torch only), under a
public name, so a torch release that moves one breaks this module alone
(``tests/test_torch_adapter.py`` checks each against the installed torch).
"""
from __future__ import annotations

import contextlib
from typing import Dict, List

import torch
from torch.utils import _pytree as pytree  # noqa: F401  (re-exported)

#: The private names, as (module, attribute): what the adapter test checks.
PRIVATE_NAMES = (
    ("torch.utils._pytree", "tree_flatten"),
    ("torch.distributed.pipelining.schedules", "_Action"),
    ("torch.distributed.pipelining.schedules", "_PipelineScheduleRuntime"),
    ("torch.distributed.pipelining._backward", "_get_grad_fn_or_grad_acc"),
    ("torch.distributed.pipelining._backward", "get_param_groups"),
    ("torch.utils._python_dispatch", "TorchDispatchMode"),
    ("torch.nn.modules.module", "_global_forward_pre_hooks"),
    ("torch.nn.modules.module", "_global_forward_hooks"),
    ("torch.nn.modules.module", "_global_backward_pre_hooks"),
    ("torch.nn.modules.module", "_global_backward_hooks"),
)
PRIVATE_METHODS = (
    ("torch.distributed.pipelining.PipelineStage", "_prepare_forward_infra"),
    ("torch.distributed.pipelining.schedules.PipelineScheduleMulti",
     "_validate_and_set_stage_mapping"),
    ("torch.distributed.pipelining.schedules._PipelineScheduleRuntime",
     "_prepare_schedule_with_comms"),
)


def torch_action(text: str):
    """torch's action for ``text`` in the shared notation (``"2F0"``, ``"1I3"``...)."""
    from torch.distributed.pipelining.schedules import _Action

    return _Action.from_str(text)


def dispatch_mode_class():
    """torch's ``TorchDispatchMode`` (thread-local: entered on one thread, it sees that thread's ops)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def direct_forward(module: torch.nn.Module):
    """``module.forward`` when calling ``module`` would only call it (no module hook, global
    or its own, not compiled), which skips ``nn.Module.__call__``'s cost; else ``module``."""
    from torch.nn.modules import module as mod

    if (mod._global_forward_pre_hooks or mod._global_forward_hooks
            or mod._global_backward_pre_hooks or mod._global_backward_hooks
            or getattr(module, "_compiled_call_impl", None) is not None
            or module._forward_pre_hooks or module._forward_hooks
            or module._backward_pre_hooks or module._backward_hooks):
        return module
    return module.forward


def grad_fn_or_grad_acc(t: torch.Tensor):
    """The autograd node that produced ``t``, or the gradient accumulator of a leaf."""
    from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc

    return _get_grad_fn_or_grad_acc(t)


def param_groups(inputs, params, reverse_edges):
    """torch's grouping of a stage's parameters by the inputs they share a graph with."""
    from torch.distributed.pipelining._backward import get_param_groups

    return get_param_groups(inputs, params, reverse_edges)


def hooked_stage_class():
    """``PipelineStage`` with a public hook around its first-step shape inference."""
    from torch.distributed.pipelining import PipelineStage

    class HookedStage(PipelineStage):
        def around_shape_inference(self):
            """A context manager around torch's shape inference (default: nothing)."""
            return contextlib.nullcontext()

        def _prepare_forward_infra(self, *args, **kwargs):
            with self.around_shape_inference():
                return super()._prepare_forward_infra(*args, **kwargs)

    return HookedStage


def mapped_runtime_class():
    """torch's action-list runtime, told the stage → rank mapping (``runner.stage_rank``, set
    before loading actions) instead of inferring it, which a forward-only schedule fails."""
    from torch.distributed.pipelining.schedules import (PipelineScheduleMulti,
                                                        _PipelineScheduleRuntime)

    class Mapping(PipelineScheduleMulti):
        def _validate_and_set_stage_mapping(self, actions) -> None:
            self.stage_index_to_group_rank = dict(self.stage_rank)
            for stage in self._stages:
                stage.stage_index_to_group_rank = self.stage_index_to_group_rank

    class Runtime(_PipelineScheduleRuntime, Mapping):
        pass

    return Runtime


def load_actions(runner, lanes: Dict[int, List[str]]) -> None:
    """Feed ``runner`` (a :func:`mapped_runtime_class` instance) one list of actions per rank."""
    runner._prepare_schedule_with_comms(
        {rank: [torch_action(a) for a in lane] for rank, lane in lanes.items()})
