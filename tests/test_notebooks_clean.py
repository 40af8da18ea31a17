"""Every notebook is committed clean: no outputs, no execution counts, no widget state, small."""
import glob
import json
import os

import pytest

NOTEBOOKS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "notebooks", "*.ipynb")))
KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
MAX_BYTES = 100 * 1024


def _ids(paths):
    return [os.path.basename(p) for p in paths]


def test_the_notebooks_exist():
    names = _ids(NOTEBOOKS)
    for expected in ("01_pipelining_walkthrough.ipynb", "02_pipeline_explorer.ipynb",
                     "04_running_poptorch_code.ipynb",
                     "03_scripts_and_profiles.ipynb", "05_lightning_on_ipukit.ipynb",
                     "06_scaling_out.ipynb", "07_costs_of_pipelining.ipynb",
                     "08_plan_fit_debug.ipynb"):
        assert expected in names


@pytest.fixture(params=NOTEBOOKS, ids=_ids(NOTEBOOKS))
def notebook(request):
    path = request.param
    with open(path, encoding="utf-8") as f:
        return path, json.load(f)


def test_small(notebook):
    path, _ = notebook
    assert os.path.getsize(path) < MAX_BYTES, f"{path} is {os.path.getsize(path)} bytes"


def test_valid_nbformat(notebook):
    nbformat = pytest.importorskip("nbformat")
    path, _ = notebook
    nbformat.validate(nbformat.read(path, as_version=4))


def test_kernelspec_is_python3(notebook):
    _, nb = notebook
    assert nb["metadata"].get("kernelspec") == KERNELSPEC


def test_no_widget_state(notebook):
    _, nb = notebook
    assert "widgets" not in nb["metadata"]
    for cell in nb["cells"]:
        assert "widgets" not in cell.get("metadata", {})


def test_no_outputs_or_execution_counts(notebook):
    path, nb = notebook
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code":
            assert cell.get("outputs") == [], f"{path} cell {i} has outputs"
            assert cell.get("execution_count") is None, f"{path} cell {i} has an execution count"
            assert "execution" not in cell.get("metadata", {}), f"{path} cell {i} has timings"
        assert "attachments" not in cell or not cell["attachments"]


def test_quick_switch_in_a_parameters_cell_near_the_top(notebook):
    """IPUKIT_QUICK is read in one short cell, among the first few."""
    path, nb = notebook
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    first = ["".join(c["source"]) for c in code[:2]]
    assert any("IPUKIT_QUICK" in src for src in first), f"{path}: no IPUKIT_QUICK switch on top"
    switches = [c for c in code if "IPUKIT_QUICK" in "".join(c["source"])]
    assert len(switches) == 1 and len("".join(switches[0]["source"]).splitlines()) <= 20


def test_ends_with_checks(notebook):
    """The last code cell asserts on what the notebook produced."""
    path, nb = notebook
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert "assert " in "".join(code[-1]["source"]), f"{path}: the last code cell asserts nothing"
