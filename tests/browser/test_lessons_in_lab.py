"""Notebooks 03–05 in JupyterLab, with the checks of test_notebooks_in_lab.py.

A file of their own so that the suite's processes (pytest-xdist runs each file whole in one
of them) run the browser tests side by side, each process with its own JupyterLab.
"""
import pytest

from .test_notebooks_in_lab import LESSONS, notebooks, run_and_check  # noqa: F401 (a fixture)


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", LESSONS)
def test_notebook_runs_and_renders_in_jupyterlab(notebooks, name):  # noqa: F811
    run_and_check(notebooks, name)
