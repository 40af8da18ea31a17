"""The explorer's Suggest: :func:`ipukit.plan` for the current model, IPUs and global batch.

:class:`Suggester` holds a memory budget per IPU (MiB; empty: no limit) and a Suggest
button, which asks :func:`ipukit.plan` for the fastest modeled plan on the controls' IPUs
at their global batch (micro-batch size × gradient accumulation), from the cost tables
already calibrated, shows it and applies its values to the controls.
"""
from __future__ import annotations

import html
from typing import Any, Callable, Dict, Optional, Sequence, Union

from ..core.errors import Error, needs_extra

with needs_extra("notebooks", "ipukit.widgets"):
    import ipywidgets as W

from . import logic
from .models import layered_split

MIB = 2 ** 20
#: the sliders' largest micro-batch size and gradient accumulation: a plan beyond them
#: could not be applied to the controls
MAX_MICRO_BATCH, MAX_ACCUMULATION = 128, 64


class Suggester:
    """The memory budget box, the Suggest button and the plan it shows.

    ``config()`` gives the controls' :class:`~ipukit.widgets.logic.Config`, ``costs_for(config)``
    the calibrated table, ``apply(**values)`` sets the controls (the explorer's ``set``).
    """

    def __init__(self, models: Dict[str, Any], config: Callable[[], logic.Config],
                 costs_for: Callable[[logic.Config], logic.CostTable],
                 apply: Callable[..., None]) -> None:
        self._models, self._config, self._costs_for, self._apply = models, config, costs_for, apply
        self._memory: Dict[str, Any] = {}          # model name -> (module, BlockMemory)
        self.memory_budget = W.Text(value="", placeholder="no limit",
                                    description="memory budget per IPU (MiB)",
                                    style={"description_width": "200px"},
                                    layout=W.Layout(width="330px"))
        self.suggest_button = W.Button(description="Suggest", icon="magic",
                                       tooltip="ipukit.plan: the fastest modeled plan for these "
                                               "IPUs and this global batch, applied to the controls")
        self.suggestion = W.HTML(value="")
        self.suggested = None                     # the plan the last Suggest applied
        self.suggest_error: Optional[str] = None  # why the last Suggest found no plan
        self.suggest_button.on_click(lambda _: self.suggest())
        self.suggest_box = W.VBox([W.HBox([self.memory_budget, self.suggest_button]),
                                   self.suggestion])

    def under(self, controls: W.Widget) -> W.Widget:
        """``controls`` with the budget, the Suggest button and the plan shown below them."""
        return W.VBox([controls, self.suggest_box])

    def budget_bytes(self) -> Optional[int]:
        """The budget box in bytes (None when empty); a ``ValueError`` for other text."""
        text = self.memory_budget.value.strip()
        if not text:
            return None
        try:
            mib = float(text)
        except ValueError:
            raise ValueError(f"memory budget {text!r}: write MiB per IPU, e.g. 4 or 2.5, or "
                             "leave it empty for no limit") from None
        return int(mib * MIB)

    def suggest(self, budget_mib: Union[None, float, str] = None,
                costs: Union[None, logic.CostTable, Sequence[logic.CostTable]] = None):
        """Press Suggest: plan, show it, apply it to the controls; returns the plan (None when
        none fits: :attr:`suggest_error` says why). ``budget_mib`` fills the budget box first;
        ``costs`` replaces the calibrated tables (numbers that do not depend on the machine)."""
        if budget_mib is not None:
            self.memory_budget.value = str(budget_mib)
        self.suggested, self.suggest_error = None, None
        self.suggestion.value = "<i>Planning with ipukit.plan…</i>"
        try:
            plan = self._plan(costs)
            values = self._values(plan)
        except (Error, ValueError) as exc:
            self.suggest_error = logic.check_message(exc)
            self.suggestion.value = logic.error_html(self.suggest_error,
                                                     heading="No plan to suggest:")
            return None
        self._apply(**values)
        self.suggested = plan
        self.suggestion.value = ("<details open><summary><b>Suggested and applied</b> "
                                 f"({html.escape(plan.summary())})</summary><pre style="
                                 f"'font-size:80%'>{html.escape(str(plan))}</pre></details>")
        return plan

    def clear_suggestion(self) -> None:
        """Empty the budget box and the plan shown (the controls keep their values)."""
        self.memory_budget.value = self.suggestion.value = ""
        self.suggested, self.suggest_error = None, None

    def _plan(self, costs):
        from ..core.optim import AdamW
        from ..plan import measure_block_memory, micro_batch_candidates, plan

        config = self._config()
        spec = self._models[config.model]
        budget = self.budget_bytes()
        global_batch = config.micro_batch_size * config.gradient_accumulation
        sizes = [m for m in micro_batch_candidates(global_batch)
                 if m <= MAX_MICRO_BATCH and global_batch // m <= MAX_ACCUMULATION]
        if not sizes:
            raise ValueError(f"global batch {global_batch}: no micro-batch size up to "
                             f"{MAX_MICRO_BATCH} divides it with a gradient accumulation up to "
                             f"{MAX_ACCUMULATION}; choose another micro-batch size or accumulation")
        if costs is None:
            self._costs_for(config)              # calibrates the modeled view's table
            costs = logic.calibrated_tables(spec)
        if config.model not in self._memory:     # activation bytes: measured once per model
            module = spec.calibration_module()
            self._memory[config.model] = (module, measure_block_memory(
                module, spec.sample_batch(config.micro_batch_size), list(spec.blocks),
                AdamW(module.parameters())))
        module, memory = self._memory[config.model]
        return plan(module, spec.sample_batch(config.micro_batch_size),
                    ipus=len(set(config.stage_ipus)), global_batch=global_batch,
                    memory_budget=budget, micro_batch_sizes=sizes, recompute=False,
                    device_iterations=config.device_iterations, costs=costs, memory=memory,
                    together=getattr(spec, "together", ()))

    def _values(self, plan) -> Dict[str, Any]:
        """The controls' values that describe ``plan``."""
        spec = self._models[self._config().model]
        values: Dict[str, Any] = dict(sharded=False, schedule=plan.title,
                                      micro_batch_size=plan.micro_batch,
                                      gradient_accumulation=plan.gradient_accumulation,
                                      device_iterations=plan.device_iterations)
        if not spec.layered:
            return {**values, "split": logic.split_label(
                spec.blocks, [s for s, n in enumerate(plan.split) for _ in range(n)])}
        layers = plan.layers_per_ipu(spec.layer_blocks)
        block_ipus, _ = layered_split(spec, layers)
        stages = [[b for b, i in zip(spec.blocks, block_ipus) if i == ipu]
                  for ipu in sorted(set(block_ipus))]
        if stages != plan.stages:
            raise ValueError(f"the plan's stages {plan.stages} are not a layers_per_ipu of the "
                             f"{spec.name} (layers_per_ipu {layers} places {stages})")
        values["layers_per_ipu"] = layers
        return values
