"""Interactive notebook widgets for ipukit.

``PipelineExplorer`` (in :mod:`ipukit.widgets.explorer`) is the dashboard;
:mod:`ipukit.widgets.logic` holds its pure logic (control values → options,
modeled timelines and figure data) and :mod:`ipukit.widgets.session` the
training it runs with ipukit. The explorer needs ipywidgets (``pip install
ipukit[notebooks]``); the logic does not.
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
