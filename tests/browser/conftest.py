"""JupyterLab on loopback + headless Debian Chromium, driven by Playwright.

One server per test session, serving a throw-away copy of notebooks/ (so a run
never writes outputs into the committed notebooks), with all Jupyter state in a
temporary folder. The browser is Debian's /usr/bin/chromium: Playwright never
downloads one.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = Path(os.environ.get("IPUKIT_NOTEBOOKS", ROOT / "notebooks"))
CHROMIUM = os.environ.get("IPUKIT_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(os.environ.get("IPUKIT_ARTIFACTS", ROOT / "test-artifacts"))
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]


def pytest_collection_modifyitems(config, items):
    reason = None
    if not os.path.exists(CHROMIUM):
        reason = f"{CHROMIUM} not found (apt-get install chromium)"
    else:
        try:
            import playwright  # noqa: F401
        except ImportError:
            reason = "playwright is not installed"
    for item in items:
        if "tests/browser" in str(item.fspath) or "tests" + os.sep + "browser" in str(item.fspath):
            item.add_marker(pytest.mark.browser)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def lab():
    """A JupyterLab server on 127.0.0.1 serving a copy of notebooks/; yields its base URL."""
    state = Path(tempfile.mkdtemp(prefix="ipukit-lab-"))
    served = state / "notebooks"
    shutil.copytree(NOTEBOOKS, served, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    env = dict(os.environ)
    for var, sub in [("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_DATA_DIR", "data"),
                     ("JUPYTER_RUNTIME_DIR", "runtime"), ("JUPYTERLAB_SETTINGS_DIR", "settings"),
                     ("JUPYTERLAB_WORKSPACES_DIR", "workspaces"), ("IPYTHONDIR", "ipython")]:
        (state / sub).mkdir()
        env[var] = str(state / sub)
    # kernels need the jupyter data dir of the venv for the python3 kernelspec
    env["JUPYTER_PATH"] = str(Path(sys.prefix) / "share" / "jupyter")
    settings = state / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false"}))
    env.setdefault("IPUKIT_QUICK", "1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    port = _free_port()
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root",
           "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
           "--ServerApp.token=", "--ServerApp.password=", "--ServerApp.disable_check_xsrf=True",
           f"--ServerApp.root_dir={served}", "--LabApp.expose_app_in_browser=True"]
    log = open(state / "server.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    log.flush()
                    raise RuntimeError("JupyterLab did not start:\n"
                                       + (state / "server.log").read_text()[-3000:])
                time.sleep(0.5)
        yield {"url": base, "root": served, "state": state}
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
        except Exception:  # noqa: BLE001
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
        shutil.rmtree(state, ignore_errors=True)


@pytest.fixture(scope="session")
def browser():
    from playwright.sync_api import sync_playwright

    profile = tempfile.mkdtemp(prefix="ipukit-chromium-")
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            profile, executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True,
            viewport={"width": 1400, "height": 1000})
        try:
            yield context
        finally:
            context.close()
            shutil.rmtree(profile, ignore_errors=True)


class NotebookPage:
    """A notebook opened in JupyterLab, with helpers scoped to its panel."""

    def __init__(self, page, path: str):
        self.page = page
        self.path = path

    def js(self, body: str, arg=None):
        """Evaluate ``body`` with ``panel`` (the notebook panel) and ``arg`` in scope."""
        return self.page.evaluate(
            "([path, arg]) => { const panel = [...window.jupyterapp.shell.widgets('main')]"
            ".find(w => w.context && w.context.path === path);"
            f" {body} }}", [self.path, arg])

    @property
    def node(self):
        return self.page.locator(f"#{self.js('return panel.id;')}")

    def run_all(self, timeout_ms: int = 600_000) -> None:
        self.page.evaluate(
            "async ([path]) => { const app = window.jupyterapp;"
            " const panel = [...app.shell.widgets('main')].find(w => w.context && w.context.path === path);"
            " app.shell.activateById(panel.id);"
            " await app.commands.execute('notebook:run-all-cells'); }", [self.path])
        # run-all resolves when cells are queued; wait until the kernel is idle again
        self.wait_idle(timeout_ms)

    def wait_idle(self, timeout_ms: int = 600_000) -> None:
        self.page.wait_for_function(
            "([path]) => { const panel = [...window.jupyterapp.shell.widgets('main')]"
            ".find(w => w.context && w.context.path === path);"
            " if (!panel) return false; const k = panel.sessionContext.session?.kernel;"
            " const busy = [...panel.content.widgets].some(c => c.model.type === 'code' &&"
            " c.promptNode && c.promptNode.textContent.includes('*'));"
            " return k && k.status === 'idle' && !busy; }",
            arg=[self.path], timeout=timeout_ms, polling=500)

    def errors(self) -> list:
        loc = self.node.locator('.jp-RenderedText[data-mime-type="application/vnd.jupyter.error"]')
        return [loc.nth(i).inner_text()[:2000] for i in range(loc.count())]

    def widget_errors(self) -> list:
        loc = self.node.get_by_text("Error displaying widget")
        return [loc.nth(i).inner_text() for i in range(loc.count())]

    def outputs_text(self) -> str:
        return self.node.locator(".jp-OutputArea-output").all_inner_texts().__str__()

    def marker(self, name: str):
        """A JSON value the notebook printed as ``IPUKIT_CHECK <name> <json>``."""
        texts = self.node.locator(".jp-OutputArea-output").all_inner_texts()
        for text in texts:
            for line in text.splitlines():
                if line.startswith(f"IPUKIT_CHECK {name} "):
                    return json.loads(line.split(" ", 2)[2])
        raise AssertionError(f"the notebook printed no IPUKIT_CHECK {name}")

    def plot_data(self, index: int):
        """The plotly.js data actually drawn by the ``index``-th plot in the panel."""
        return self.js("const plots = panel.node.querySelectorAll('.js-plotly-plot');"
                       " const p = plots[arg]; if (!p) return null;"
                       " return JSON.parse(JSON.stringify((p.data || []).map(t =>"
                       " ({type: t.type, name: t.name, x: t.x, y: t.y}))));", index)

    def plot_count(self) -> int:
        return self.js("return panel.node.querySelectorAll('.js-plotly-plot').length;")

    def screenshot(self, name: str) -> Path:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / name
        self.page.screenshot(path=str(path), full_page=False)
        return path


@pytest.fixture
def open_notebook(lab, browser):
    pages = []

    def _open(name: str) -> NotebookPage:
        page = browser.new_page()
        pages.append(page)
        page.goto(f"{lab['url']}/lab/tree/{name}?reset", timeout=120_000)
        page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell", timeout=120_000)
        page.wait_for_function(
            "([path]) => { const panel = [...window.jupyterapp.shell.widgets('main')]"
            ".find(w => w.context && w.context.path === path);"
            " const k = panel?.sessionContext?.session?.kernel;"
            " return panel && panel.context.isReady && k && k.status === 'idle'; }",
            arg=[name], timeout=180_000, polling=500)
        return NotebookPage(page, name)

    yield _open
    for page in pages:
        page.close()
