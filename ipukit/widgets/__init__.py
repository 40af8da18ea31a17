"""Interactive notebook widgets for ipukit (``pip install ipukit[notebooks]``).

``PipelineExplorer`` (:mod:`ipukit.widgets.explorer`) is the dashboard. Its parts:
:mod:`~ipukit.widgets.controls`, :mod:`~ipukit.widgets.dashboard`,
:mod:`~ipukit.widgets.modeler` (the modeled call and ipukit's verdict),
:mod:`~ipukit.widgets.runner` and :mod:`~ipukit.widgets.suggester`. The pure logic needs
no ipywidgets: :mod:`~ipukit.widgets.logic`, :mod:`~ipukit.widgets.comparison`,
:mod:`~ipukit.widgets.models` (the model specs) and :mod:`~ipukit.widgets.session`
(the training it runs with ipukit).
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
