"""The documentation: the mkdocs site builds in strict mode (broken links and missing API
references fail), the README stays a short front page (no dates, clock times or run logs;
every notebook in its table), and ``help(ipukit.Options)`` reads as a user's page."""
import importlib.util
import os
import inspect
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
ISO_DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
CLOCK_TIME = re.compile(r"\b\d\d:\d\d\b")


def test_readme_is_a_short_front_page():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300, len(text.splitlines())
    assert len(text.encode("utf-8")) <= 25 * 1024, len(text.encode("utf-8"))
    assert not ISO_DATE.findall(text), ISO_DATE.findall(text)
    assert not CLOCK_TIME.findall(text), CLOCK_TIME.findall(text)
    for command in ("./start.sh", "./test.sh", "mkdocs serve"):
        assert command in text, command


def test_readme_names_every_notebook_in_its_table():
    rows = [line for line in README.read_text(encoding="utf-8").splitlines()
            if line.startswith("|")]
    notebooks = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert len(notebooks) == 8, notebooks
    missing = [name for name in notebooks if not any(name in row for row in rows)]
    assert not missing, f"notebooks missing from the README's table: {missing}"


def test_docs_pages_hold_no_dates_or_clock_times():
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text(encoding="utf-8")
        found = ISO_DATE.findall(text) + CLOCK_TIME.findall(text)
        assert not found, f"{page.relative_to(ROOT)}: {found}"


def test_options_help_reads_as_a_users_page():
    import ipukit

    signature = inspect.signature(ipukit.Options)
    assert "_OptionGroup__init" not in str(signature) and not signature.parameters
    assert not inspect.signature(ipukit.TensorLocationSettings).parameters
    doc = inspect.getdoc(ipukit.Options)
    for group in ("opts.Training", "opts.TensorLocations", "opts.Distributed",
                  "opts.Precision"):
        assert group in doc, group
    for ignored in ("enableExecutableCaching", "setAvailableMemoryProportion"):
        assert ignored in doc, ignored
    # sealing still works: an unknown name is refused after __init__
    opts = ipukit.Options()
    with pytest.raises(ipukit.Error):
        opts.deviceIteration = 4


def test_every_public_name_is_in_the_api_reference():
    """Each name in ``ipukit.__all__`` appears on a page of docs/api/ (a ``::: ipukit.X``
    entry, or named in the text, as PopTorch's aliases are)."""
    import ipukit

    text = "\n".join(p.read_text(encoding="utf-8") for p in (DOCS / "api").glob("*.md"))
    missing = [name for name in ipukit.__all__
               if not re.search(rf"\b{re.escape(name)}\b", text)]
    assert not missing, f"public names missing from docs/api/: {missing}"


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None
                    or importlib.util.find_spec("mkdocstrings") is None
                    or importlib.util.find_spec("material") is None,
                    reason="mkdocs, mkdocs-material or mkdocstrings not installed "
                           "(pip install -e '.[docs]')")
def test_the_site_builds_in_strict_mode(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert (tmp_path / "index.html").exists()
    reference = (tmp_path / "api" / "models" / "index.html").read_text(encoding="utf-8")
    assert "deviceIterations" in reference          # docstrings were rendered
