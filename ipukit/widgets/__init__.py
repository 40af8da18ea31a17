"""Interactive notebook widgets for ipukit.

``PipelineExplorer`` (in :mod:`ipukit.widgets.explorer`) is the dashboard. Its
parts: :mod:`~ipukit.widgets.controls` (the controls and the configuration they
describe), :mod:`~ipukit.widgets.dashboard` (figures, text, buttons),
:mod:`~ipukit.widgets.modeler` and :mod:`~ipukit.widgets.prober` (the modeled
call and ipukit's verdict on it), :mod:`~ipukit.widgets.runner` (Run, Stop, New
model). The pure logic needs no ipywidgets: :mod:`~ipukit.widgets.logic`
(control values → options, costs calibrated on this machine, modeled timelines and
figure data),
:mod:`~ipukit.widgets.comparison` (every schedule on the same stages),
:mod:`~ipukit.widgets.models` (the model specs the explorer is given, e.g.
``ipukit.examples.mnist.explorer_model()``, and placement by ``layers_per_ipu``) and :mod:`~ipukit.widgets.session` (the training it runs
with ipukit). The explorer needs ipywidgets (``pip install ipukit[notebooks]``).
"""
from __future__ import annotations

__all__ = ["PipelineExplorer", "Config"]


def __getattr__(name):
    if name == "PipelineExplorer":
        from .explorer import PipelineExplorer

        return PipelineExplorer
    if name == "Config":
        from .logic import Config

        return Config
    raise AttributeError(f"module 'ipukit.widgets' has no attribute {name!r}")
