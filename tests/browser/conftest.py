"""JupyterLab on loopback + headless Debian Chromium, driven by Playwright.

One server per test session, serving a throw-away copy of notebooks/ (so a run
never writes outputs into the committed notebooks), with all Jupyter state in a
temporary folder. The browser is Debian's /usr/bin/chromium: Playwright never
downloads one.

Environment switches (all optional):

``IPUKIT_DATA``
    the MNIST data root the kernels read (default: ``../shared/data`` beside
    the checkout when it exists; the notebook tests skip without real MNIST).
``IPUKIT_NOTEBOOKS``, ``IPUKIT_CHROMIUM``, ``IPUKIT_ARTIFACTS``
    the notebooks folder, the browser binary, where screenshots go.
``IPUKIT_BREAK_FRONTEND``
    break the front end on purpose, to prove the browser tests can fail
    (comma-separated):

    * ``callback`` -- make the explorer's control callback raise for changes
      made in the browser (an IPython startup file in the throw-away
      IPYTHONDIR patches ``PipelineExplorer._on_change``; changes made from
      code keep working, so nbval cannot notice).

    Nothing in the library knows about these switches.
"""
from __future__ import annotations

import json
import os
import re
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
DATA = os.environ.get("IPUKIT_DATA") or str((ROOT / ".." / "shared" / "data").resolve())
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]
BREAKS = {"callback"}
BREAK = {s.strip() for s in os.environ.get("IPUKIT_BREAK_FRONTEND", "").split(",") if s.strip()}

# Bounds on every wait, generous for a loaded 2-core CI machine.
SERVER_START_S = 120          # JupyterLab answering /api/status
PAGE_LOAD_MS = 120_000        # the lab page and window.jupyterapp
KERNEL_READY_MS = 180_000     # the notebook's kernel started and idle
RUN_ALL_MS = 900_000          # one notebook, all cells
SETTLE_MS = 60_000            # widget/figure updates reaching the DOM

#: seconds each notebook took, printed in the terminal summary
TIMINGS: dict = {}

_BREAK_CALLBACK = '''\
# Written by tests/browser/conftest.py because IPUKIT_BREAK_FRONTEND=callback: the
# explorer's control callback raises when a control is moved in the browser.
def _ipukit_break_callback():
    from ipukit.widgets.explorer import PipelineExplorer

    original = PipelineExplorer._on_change

    def _on_change(self, change):
        if change["owner"]._property_lock:        # the new value came from the front end
            raise RuntimeError("IPUKIT_BREAK_FRONTEND=callback: a control moved in the browser")
        return original(self, change)

    PipelineExplorer._on_change = _on_change


_ipukit_break_callback()
del _ipukit_break_callback
'''


def pytest_collection_modifyitems(config, items):
    reason = None
    if not os.path.exists(CHROMIUM):
        reason = f"{CHROMIUM} not found (apt-get install chromium)"
    else:
        try:
            import playwright  # noqa: F401
        except ImportError:
            reason = "playwright is not installed"
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.browser)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


class _RunOnceInLab:
    """A notebook the browser tests run whole in JupyterLab is not run again by nbval.

    The browser test runs every cell (Run All) in a real kernel in quick mode, and fails on
    any error output, any cell left unrun and any widget error, which is what nbval
    (``--nbval-lax``) checks, plus the rendering. So when the browser tests of a notebook
    will run in this session (selected, Chromium and Playwright present, MNIST found), the
    notebook's nbval items are skipped; otherwise (``-m "not browser"``, ``pytest
    notebooks/``, no Chromium) nbval runs it. Decided after every other plugin has
    deselected items (``trylast``).
    """

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        if not os.path.isdir(os.path.join(DATA, "MNIST", "raw")):
            return
        in_lab = {item.callspec.params["name"] for item in items
                  if getattr(item, "callspec", None) is not None
                  and "name" in item.callspec.params
                  and item.get_closest_marker("browser") is not None
                  and item.get_closest_marker("skip") is None
                  and item.originalname == "test_notebook_runs_and_renders_in_jupyterlab"}
        for item in items:
            path = Path(str(item.fspath))
            if path.suffix == ".ipynb" and path.name in in_lab:
                item.add_marker(pytest.mark.skip(
                    reason=f"{path.name} runs whole in JupyterLab in tests/browser (every "
                           "cell and check, and what it renders)"))


def pytest_configure(config):
    config.pluginmanager.register(_RunOnceInLab(), "ipukit-run-once-in-lab")


def pytest_terminal_summary(terminalreporter):
    if TIMINGS:
        terminalreporter.write_sep("-", "notebooks in JupyterLab (seconds)")
        for name, t in TIMINGS.items():
            terminalreporter.write_line(
                f"{name}: open {t['open']:.1f} s, run all {t['run']:.1f} s, "
                f"checks {t.get('checks', 0.0):.1f} s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the server process (Linux): get SIGTERM if pytest dies without cleaning up."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort, not on every platform
        pass


def _process_table() -> dict:
    """{pid: (parent pid, start time)} from /proc ({} where there is none)."""
    table = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return table
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        table[int(name)] = (int(fields[1]), fields[19])
    return table


def _descendants(pid: int) -> dict:
    """{pid: start time} of every process below ``pid`` (kernels run in sessions of their own)."""
    table = _process_table()
    children: dict = {}
    for child, (parent, _) in table.items():
        children.setdefault(parent, []).append(child)
    found, todo = {}, [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found[child] = table[child][1]
            todo.append(child)
    return found


def _stop_server(proc: subprocess.Popen, base: str) -> None:
    """Shut the server down with its kernels; then make sure none of its processes is left."""
    below = _descendants(proc.pid)
    try:
        req = urllib.request.Request(f"{base}/api/shutdown", method="POST", data=b"")
        urllib.request.urlopen(req, timeout=10)
    except OSError:
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=wait)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
    # kernels and anything else the server started, if still there (same pid, same start time)
    time.sleep(0.5)
    table = _process_table()
    for pid, started in below.items():
        if pid in table and table[pid][1] == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _break_frontend(state: Path, env: dict) -> None:
    unknown = BREAK - BREAKS
    if unknown:
        raise pytest.UsageError(f"IPUKIT_BREAK_FRONTEND: unknown {sorted(unknown)}; "
                                f"known: {sorted(BREAKS)}")
    if "callback" in BREAK:
        startup = state / "ipython" / "profile_default" / "startup"
        startup.mkdir(parents=True)
        (startup / "00-ipukit-break-callback.py").write_text(_BREAK_CALLBACK)


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
    (settings / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    env.setdefault("IPUKIT_QUICK", "1")
    env["IPUKIT_DATA"] = DATA
    # files the notebooks write to temporary folders go into the throw-away state too
    (state / "tmp").mkdir()
    env["TMPDIR"] = str(state / "tmp")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    _break_frontend(state, env)
    port = _free_port()
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root",
           "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
           "--ServerApp.token=", "--ServerApp.password=", "--ServerApp.disable_check_xsrf=True",
           f"--ServerApp.root_dir={served}", "--LabApp.expose_app_in_browser=True",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    log = open(state / "server.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=_die_with_parent)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + SERVER_START_S
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
        yield {"url": base, "root": served, "state": state, "break": set(BREAK)}
    finally:
        _stop_server(proc, base)
        log.close()
        shutil.rmtree(state, ignore_errors=True)


@pytest.fixture(scope="session")
def browser():
    from playwright.sync_api import sync_playwright

    profile = tempfile.mkdtemp(prefix="ipukit-chromium-")
    try:
        with sync_playwright() as p:
            context = p.chromium.launch_persistent_context(
                profile, executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True,
                viewport={"width": 1400, "height": 1000})
            try:
                yield context
            finally:
                context.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)


# JavaScript run with ``panel`` (the notebook's panel) and ``arg`` in scope -----------------

_FIND_PANEL = ("const panel = [...window.jupyterapp.shell.widgets('main')]"
               ".find(w => w.context && w.context.path === path);")

# The checks' values every code cell displayed, read from the cells' models (drawn or not).
_CHECKS_JS = """
return [...panel.content.widgets].filter(c => c.model.type === 'code').flatMap(c => {
  const o = c.model.outputs, r = [];
  for (let k = 0; k < o.length; k++) {
    const data = o.get(k).toJSON().data || {};
    if (data['application/vnd.ipukit.check+json']) r.push(data['application/vnd.ipukit.check+json']);
  }
  return r;
});
"""

# The plotly.js data of every plot in the panel, in document order: each trace as plotly.js
# drew it (its ``_fullData``, where arrays sent base64-encoded are decoded; typed arrays
# turned into plain ones) and the layout's title.
_PLOTS_JS = """
const plain = v => (v == null ? null : (ArrayBuffer.isView(v) || Array.isArray(v)) ? Array.from(v) : v);
return [...panel.node.querySelectorAll('.js-plotly-plot')].map(p => {
  const layout = p._fullLayout || p.layout || {};
  const title = layout.title == null ? '' : (typeof layout.title === 'string' ? layout.title
                                                                             : (layout.title.text || ''));
  const inWidget = !!p.closest('.jupyter-widgets, .widget-container')
                   || !p.classList.contains('jp-OutputArea-output');
  const rect = p.getBoundingClientRect();
  return {title, in_widget: inWidget, width: rect.width, height: rect.height,
          drawn_width: layout.width == null ? null : layout.width,
          box_width: p.parentElement ? p.parentElement.clientWidth : null,
          traces: (p.data || []).map((t, i) => {
            const full = (p._fullData || []).find(f => f.index === i) || {};
            return {type: full.type || t.type || 'scatter', name: t.name == null ? null : t.name,
                    x: plain(full.x), y: plain(full.y), base: plain(full.base)};
          })};
});
"""

# For every widget output of the notebook: the widget manager's models for the model ids the
# kernel expects (arg: {root model id: [model ids]}), and how many views of each are on the
# page inside this panel and not an error view.
_WIDGETS_JS = """
const within = (promise, ms, what) => Promise.race([promise, new Promise((_, reject) =>
  setTimeout(() => reject(new Error('timed out: ' + what)), ms))]);
const report = [];
for (const [ci, cell] of panel.content.widgets.entries()) {
  if (cell.model.type !== 'code') continue;
  for (let j = 0; j < cell.model.outputs.length; j++) {
    const spec = (cell.model.outputs.get(j).data || {})['application/vnd.jupyter.widget-view+json'];
    if (!spec) continue;
    const entry = {cell: ci, root: spec.model_id, models: {}, error: null};
    report.push(entry);
    try {
      const child = cell.outputArea.widgets[j];
      const renderer = child.widgets[child.widgets.length - 1];
      const manager = await within(renderer._manager.promise, 10000, 'widget manager');
      for (const id of (arg[spec.model_id] || [spec.model_id])) {
        let model;
        try {
          model = await within(manager.get_model(id), 10000, 'model ' + id);
        } catch (e) {
          entry.models[id] = {name: null, views: 0, error_views: 0, error: String(e)};
          continue;
        }
        const views = (await Promise.all(Object.values(model.views || {}).map(
          v => within(v, 10000, 'view').catch(() => null)))).filter(v => v && v.el);
        const here = views.filter(v => panel.node.contains(v.el));
        // ipywidgets' error view (a model class that could not load) puts its message in a child
        const broken = here.filter(v => v.el.classList.contains('jupyter-widgets-error-widget')
                                       || v.el.querySelector(':scope > .jupyter-widgets-error-widget'));
        entry.models[id] = {name: model.get('_model_name'), views: here.length - broken.length,
                            error_views: broken.length, error: null};
      }
    } catch (e) {
      entry.error = String(e);
    }
  }
}
return report;
"""

_EXECUTE_JS = """
const kernel = panel.sessionContext.session.kernel;
const future = kernel.requestExecute({code: arg, silent: false, store_history: false});
let stdout = '', error = null;
future.onIOPub = msg => {
  const kind = msg.header.msg_type;
  if (kind === 'stream' && msg.content.name === 'stdout') stdout += msg.content.text;
  if (kind === 'error') error = msg.content.ename + ': ' + msg.content.evalue + '\\n'
                                + (msg.content.traceback || []).join('\\n');
};
const reply = await future.done;
return {stdout, error, status: reply.content.status};
"""


class NotebookPage:
    """A notebook opened in JupyterLab, with helpers scoped to its panel."""

    def __init__(self, page, path: str):
        self.page = page
        self.path = path

    def js(self, body: str, arg=None):
        """Evaluate ``body`` (may ``await``) with ``panel`` (the notebook panel) and ``arg`` in scope."""
        return self.page.evaluate(
            f"async ([path, arg]) => {{ {_FIND_PANEL} {body} }}", [self.path, arg])

    @property
    def node(self):
        return self.page.locator(f"#{self.js('return panel.id;')}")

    def run_all(self, timeout_ms: int = RUN_ALL_MS) -> None:
        self.js("window.jupyterapp.shell.activateById(panel.id);"
                " await window.jupyterapp.commands.execute('notebook:run-all-cells');")
        # run-all may resolve when cells are queued; wait until the kernel is idle again
        self.wait_idle(timeout_ms)

    def wait_idle(self, timeout_ms: int = RUN_ALL_MS) -> None:
        self.page.wait_for_function(
            f"([path]) => {{ {_FIND_PANEL}"
            " if (!panel) return false; const k = panel.sessionContext.session?.kernel;"
            " const busy = [...panel.content.widgets].some(c => c.model.type === 'code' &&"
            " c.promptNode && c.promptNode.textContent.includes('*'));"
            " return k && k.status === 'idle' && !busy; }",
            arg=[self.path], timeout=timeout_ms, polling=500)

    def execution_counts(self) -> list:
        """The execution count of every code cell (None: not run)."""
        return self.js("return [...panel.content.widgets].filter(c => c.model.type === 'code')"
                       ".map(c => c.model.executionCount);")

    def errors(self) -> list:
        """Every error output: those drawn, and those in the cells' models (drawn or not)."""
        loc = self.node.locator('.jp-RenderedText[data-mime-type="application/vnd.jupyter.error"]')
        drawn = [loc.nth(i).text_content()[:2000] for i in range(loc.count())]
        held = self.js("return [...panel.content.widgets].filter(c => c.model.type === 'code')"
                       ".flatMap((c, i) => { const o = c.model.outputs, r = [];"
                       " for (let k = 0; k < o.length; k++) { const x = o.get(k).toJSON();"
                       " if (x.output_type === 'error') r.push(`cell ${i}: ${x.ename}: ${x.evalue}`); }"
                       " return r; });")
        return drawn + [e for e in held if not any(e.split(": ", 2)[-1][:80] in d for d in drawn)]

    def widget_errors(self) -> list:
        """Widgets that failed: JupyterLab's "Error displaying widget" and ipywidgets' error views."""
        found = []
        text = self.node.get_by_text("Error displaying widget")
        found += [text.nth(i).text_content() for i in range(text.count())]
        views = self.node.locator(".jupyter-widgets-error-widget")
        found += ["ipywidgets error view: " + " ".join((views.nth(i).get_attribute("title") or
                                                        views.nth(i).text_content()).split())[:500]
                  for i in range(views.count())]
        return found

    def outputs_text(self) -> str:
        return self.node.locator(".jp-OutputArea-output").all_text_contents().__str__()

    def markers(self) -> dict:
        """What the notebook's checks found: every ``application/vnd.ipukit.check+json``
        output (``{name: value}``; the learner sees its one-line ``text/plain``), by name."""
        found = {}
        for data in self.js(_CHECKS_JS):
            found.update(data)
        return found

    def marker(self, name: str):
        """The value the notebook's checks displayed under ``name``."""
        found = self.markers()
        if name not in found:
            raise AssertionError(f"the notebook displayed no check value {name!r}")
        return found[name]

    def plots(self) -> list:
        """Every plot in the panel as plotly.js drew it.

        ``{title, in_widget, width, height, drawn_width, box_width, traces}``: the element's
        size, the width plotly.js laid the figure out at, the width of the box holding it,
        and ``[{type, name, x, y, base}]``.
        """
        return self.js(_PLOTS_JS)

    def plot_data(self, index: int):
        """The plotly.js data actually drawn by the ``index``-th plot in the panel."""
        plots = self.plots()
        return plots[index]["traces"] if index < len(plots) else None

    def plot_count(self) -> int:
        return self.js("return panel.node.querySelectorAll('.js-plotly-plot').length;")

    def widget_views(self, expected: dict) -> list:
        """For each widget output: views on the page of the models in ``expected[root]``."""
        return self.js(_WIDGETS_JS, expected)

    def kernel_execute(self, code: str) -> str:
        """Run ``code`` in the notebook's kernel (no cell is added); returns its stdout."""
        result = self.js(_EXECUTE_JS, code)
        if result["status"] != "ok":
            error = re.sub(r"\x1b\[[0-9;]*m", "", result["error"] or "")    # no terminal colours
            raise AssertionError(f"kernel code failed: {error}")
        return result["stdout"]

    def wait_for(self, check, timeout_ms: int = SETTLE_MS, interval_s: float = 0.5):
        """Call ``check()`` until it neither raises AssertionError nor returns ``False``.

        Returns its result; after ``timeout_ms`` the last AssertionError is raised.
        """
        deadline = time.time() + timeout_ms / 1000
        while True:
            try:
                result = check()
                if result is not False:
                    return result
                if time.time() > deadline:
                    raise AssertionError(f"still false after {timeout_ms / 1000:.0f} s: {check}")
            except AssertionError:
                if time.time() > deadline:
                    raise
            time.sleep(interval_s)

    def hide_side_panels(self) -> None:
        self.js("window.jupyterapp.shell.collapseLeft(); window.jupyterapp.shell.collapseRight();")

    def screenshot(self, name: str, locator=None) -> Path:
        """A screenshot (of the page, or of ``locator``) into the artefacts folder."""
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / name
        if locator is None:
            self.page.screenshot(path=str(path), full_page=False)
        else:
            locator.screenshot(path=str(path))
        return path


def open_page(lab, browser, name: str) -> NotebookPage:
    """Open notebook ``name`` in a new tab and wait for its kernel."""
    page = browser.new_page()
    try:
        # a workspace of its own per tab: JupyterLab would otherwise move a second tab on the
        # same workspace to a new one (a navigation in the middle of our waits); ?reset: no
        # tabs restored from a saved workspace
        workspace = "ipukit-" + "".join(c if c.isalnum() else "-" for c in Path(name).stem)
        page.goto(f"{lab['url']}/lab/workspaces/{workspace}/tree/{name}?reset",
                  timeout=PAGE_LOAD_MS)
        page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell",
                               timeout=PAGE_LOAD_MS)
        page.wait_for_function(
            "([path]) => { if (!window.jupyterapp || !window.jupyterapp.shell) return false;"
            f" {_FIND_PANEL}"
            " const k = panel?.sessionContext?.session?.kernel;"
            " return panel && panel.context.isReady && k && k.status === 'idle'; }",
            arg=[name], timeout=KERNEL_READY_MS, polling=500)
    except Exception:
        page.close()
        raise
    return NotebookPage(page, name)


def close_page(lab, notebook: NotebookPage) -> None:
    """Close the tab and shut down the notebook's kernel (a fresh one for the next opening)."""
    try:
        notebook.page.close()
    finally:
        try:
            with urllib.request.urlopen(f"{lab['url']}/api/sessions", timeout=10) as r:
                sessions = json.load(r)
            for s in sessions:
                if s.get("path") == notebook.path:
                    req = urllib.request.Request(f"{lab['url']}/api/sessions/{s['id']}",
                                                 method="DELETE")
                    urllib.request.urlopen(req, timeout=30)
        except OSError:
            pass


@pytest.fixture
def open_notebook(lab, browser):
    pages = []

    def _open(name: str) -> NotebookPage:
        notebook = open_page(lab, browser, name)
        pages.append(notebook)
        return notebook

    yield _open
    for notebook in pages:
        close_page(lab, notebook)
