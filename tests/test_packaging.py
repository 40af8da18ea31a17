"""Packaging: the bare install needs torch alone (in its metadata, and `import ipukit`
with no extra installed), the extras the README names exist, and constraints.txt (the
pins ./test.sh and ./start.sh install) lies inside pyproject's ranges.

The resolution checks at the end (marked `network`) ask PyPI and skip without it; the rest
is offline and fast: the wheel metadata is built by setuptools' own backend in a subprocess
(the PEP 517 ``prepare_metadata_for_build_wheel`` hook, what pip calls before resolving),
so nothing is downloaded and no stale installed metadata is read."""
import email.parser
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import textwrap
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README_EXTRAS = ("viz", "examples", "lightning", "hub", "distributed", "notebooks", "test",
                 "bench", "docs")


def _pyproject():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _constraints():
    pins = {}
    with open(os.path.join(ROOT, "constraints.txt")) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            assert not line.startswith("-"), f"constraints.txt: options are not pins: {line!r}"
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"constraints.txt: not a pin: {line!r}"
            pins[canonicalize_name(req.name)] = Version(spec.version)
    return pins


@pytest.fixture(scope="module")
def metadata(tmp_path_factory):
    """The METADATA a build of this checkout would carry, from the build backend itself."""
    pytest.importorskip("setuptools", minversion="77", reason="the build backend "
                        "(pyproject's build-system) is not installed in this environment")
    out = tmp_path_factory.mktemp("metadata")
    code = ("import sys\nfrom setuptools import build_meta\n"
            "print(build_meta.prepare_metadata_for_build_wheel(sys.argv[1]))")
    proc = subprocess.run([sys.executable, "-c", code, str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    dist_info = proc.stdout.strip().splitlines()[-1]
    with open(os.path.join(out, dist_info, "METADATA"), encoding="utf-8") as f:
        return email.parser.Parser().parse(f)


def _requires(metadata, extra):
    """The requirements that `pip install ipukit[extra]` (extra="" for the bare install)
    adds, one level deep."""
    reqs = []
    for line in metadata.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": extra}):
            reqs.append(req)
    return reqs


def _closure(metadata, extra):
    """Every distribution name `pip install ipukit[extra]` asks for, self-references
    (ipukit[viz,...]) followed."""
    names, todo, seen = set(), [extra], set()
    while todo:
        e = todo.pop()
        if e in seen:
            continue
        seen.add(e)
        for req in _requires(metadata, e):
            if canonicalize_name(req.name) == "ipukit":
                todo.extend(req.extras)
            else:
                names.add(canonicalize_name(req.name))
    return names


def test_core_dependency_is_torch_alone():
    deps = [Requirement(d) for d in _pyproject()["project"]["dependencies"]]
    assert [canonicalize_name(r.name) for r in deps] == ["torch"]
    for v in ("2.11.0", "2.12.1", "2.13.0", "2.14.1"):
        assert deps[0].specifier.contains(v), v


def test_requires_python_admits_3_11_to_3_13():
    spec = SpecifierSet(_pyproject()["project"]["requires-python"])
    for v in ("3.11.0", "3.11.7", "3.12.0", "3.12.8", "3.13.0", "3.13.5"):
        assert spec.contains(v), v
    assert not spec.contains("3.10.14")


def test_extras_named_in_readme_exist():
    extras = set(_pyproject()["project"]["optional-dependencies"])
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    named = set(README_EXTRAS)
    for group in re.findall(r"(?:ipukit|[\"']\.)\[([a-z0-9_,\- ]+)\]", readme):
        named.update(e.strip() for e in group.split(","))
    assert named <= extras, f"README names extras pyproject lacks: {sorted(named - extras)}"


def test_bare_install_requires_torch_alone(metadata):
    """`pip install ipukit` (no extra) pulls torch in and nothing else; Python 3.11-3.13."""
    core = _requires(metadata, "")
    assert [canonicalize_name(r.name) for r in core] == ["torch"], [str(r) for r in core]
    assert core[0].specifier.contains("2.11.0") and core[0].specifier.contains("2.14.1")
    assert not core[0].specifier.contains("2.10.0")
    spec = SpecifierSet(metadata["Requires-Python"])
    assert all(spec.contains(v) for v in ("3.11.0", "3.12.0", "3.13.0"))
    assert set(README_EXTRAS) <= set(metadata.get_all("Provides-Extra") or [])


# The top-level modules the extras bring; a bare install has none of them.
EXTRA_MODULES = ("numpy", "plotly", "tqdm", "torchvision", "pytorch_lightning", "lightning",
                 "lightning_utilities", "torchmetrics", "huggingface_hub", "anywidget",
                 "ipywidgets", "IPython", "ipykernel", "jupyterlab", "torchgpipe")


def test_bare_install_imports_without_extras(tmp_path):
    """`import ipukit` and a small training step work with torch alone: every module an
    extra brings is shadowed by one that raises ModuleNotFoundError, as if not installed."""
    for name in EXTRA_MODULES:
        (tmp_path / f"{name}.py").write_text(
            f"raise ModuleNotFoundError('not in a bare install: {name}', name={name!r})\n")
    code = (
        "import warnings; warnings.simplefilter('ignore')\n"
        "import torch, ipukit as poptorch\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.a = poptorch.BeginBlock(torch.nn.Linear(4, 4), ipu_id=0)\n"
        "        self.b = poptorch.BeginBlock(torch.nn.Linear(4, 2), ipu_id=1)\n"
        "    def forward(self, x, y):\n"
        "        out = self.b(torch.relu(self.a(x)))\n"
        "        return out, torch.nn.functional.cross_entropy(out, y)\n"
        "opts = poptorch.Options()\n"
        "opts.Training.gradientAccumulation(3)\n"
        "opts.setExecutionStrategy(poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement))\n"
        "net = Net()\n"
        "model = poptorch.trainingModel(net, opts, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))\n"
        "out, loss = model(torch.randn(6, 4), torch.randint(0, 2, (6,)))\n"
        "import sys\n"
        "present = sorted(m for m in sys.modules if m.split('.')[0] in %r and sys.modules[m])\n"
        "assert not present, present\n"
        "print('ok', float(loss))\n" % (EXTRA_MODULES,))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tmp_path)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr


def test_extras_install_what_their_features_import(metadata):
    assert {"plotly", "numpy"} <= _closure(metadata, "viz")
    assert {"torchvision", "tqdm"} <= _closure(metadata, "examples")
    assert "pytorch-lightning" in _closure(metadata, "lightning")
    assert "huggingface-hub" in _closure(metadata, "hub")
    notebooks = _closure(metadata, "notebooks")
    assert {"plotly", "numpy", "torchvision", "tqdm", "pytorch-lightning", "jupyterlab",
            "ipywidgets", "anywidget", "ipykernel"} <= notebooks
    assert {"mkdocs", "mkdocs-material", "mkdocstrings"} <= _closure(metadata, "docs")
    assert notebooks | _closure(metadata, "docs") | {
        "torchgpipe", "pytest", "pytest-timeout", "nbval", "jsonschema",
        "playwright"} <= _closure(metadata, "test")


def test_constraints_pin_versions_inside_the_ranges():
    """Every package pyproject names is pinned in constraints.txt (but `hub`'s, which `test`
    leaves out), at a version inside pyproject's range."""
    pins = _constraints()
    assert "ipukit" not in pins
    project = _pyproject()["project"]
    named = [Requirement(d) for d in project["dependencies"]]
    for reqs in project["optional-dependencies"].values():
        named += [Requirement(d) for d in reqs]
    for req in named:
        name = canonicalize_name(req.name)
        if name == "ipukit":
            continue
        if name in pins:
            assert req.specifier.contains(pins[name], prereleases=True), \
                f"constraints.txt pins {name}=={pins[name]}, outside pyproject's {req}"
        elif name != "huggingface-hub":  # `hub` is not part of `test`
            pytest.fail(f"constraints.txt does not pin {name}, which pyproject names")


def test_installed_torch_inside_the_range():
    spec = Requirement(_pyproject()["project"]["dependencies"][0]).specifier
    installed = Version(importlib.metadata.version("torch"))
    assert spec.contains(Version(installed.base_version)), installed


def test_the_process_runtime_names_its_extra_when_numpy_is_missing(tmp_path):
    """torch.distributed's object collectives need numpy, which torch does not require:
    without it, joining a run says which extra to install instead of failing mid-call."""
    (tmp_path / "numpy.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n")
    code = textwrap.dedent("""
        import ipukit
        from ipukit.core.errors import MissingExtraError
        from ipukit.runtime.processes.group import ensure_process_group
        try:
            ensure_process_group(ipukit.Options())
        except MissingExtraError as exc:
            print("refused:", exc)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tmp_path)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert 'pip install "ipukit[distributed]"' in out.stdout


# --- IPUKIT_USE_INSTALLED_TORCH (scripts/env.sh): the constraints that keep an installed
# torch come from scripts/torch_pins.py, run here exactly as env.sh runs it.

TORCH_PINS = os.path.join(ROOT, "scripts", "torch_pins.py")
TORCH_COUPLED = ("torch", "torchvision", "torchaudio", "triton", "setuptools")


def _coupled(name):
    return name in TORCH_COUPLED or name.startswith(("nvidia-", "cuda-", "pytorch-triton"))


def _pins_of(text):
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            pins[canonicalize_name(req.name)] = str(next(iter(req.specifier)).version)
    return pins


def _torch_pins(*args, env=None):
    return subprocess.run([sys.executable, TORCH_PINS, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


def test_filtered_constraints_drop_every_torch_coupled_pin_and_keep_the_rest():
    full = {name: str(v) for name, v in _constraints().items()}
    proc = _torch_pins("constraints", "--torch", "2.11.0")
    assert proc.returncode == 0, proc.stderr
    kept = _pins_of(proc.stdout)
    assert kept.pop("torch") == "2.11.0"
    assert not [n for n in kept if _coupled(n)], kept
    assert kept == {n: v for n, v in full.items() if not _coupled(n)}
    dropped = set(full) - set(kept)
    assert {"torch", "torchvision", "triton", "setuptools", "nvidia-cudnn-cu13",
            "cuda-bindings"} <= dropped


def _fake_dist(site, name, version, requires=()):
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                   + "".join(f"Requires-Dist: {r}\n" for r in requires))


def _installed(site, out):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(site)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    return _torch_pins("installed", str(out), env=env)


def test_installed_torch_outside_the_range_is_refused_with_the_fix(tmp_path):
    _fake_dist(tmp_path / "site", "torch", "2.10.0")
    proc = _installed(tmp_path / "site", tmp_path / "c.txt")
    assert proc.returncode != 0
    torch_range = _pyproject()["project"]["dependencies"][0]
    for words in ("IPUKIT_USE_INSTALLED_TORCH", "2.10.0", torch_range, "unset"):
        assert words in proc.stderr, (words, proc.stderr)
    assert not (tmp_path / "c.txt").exists()


@pytest.mark.parametrize("vision, vision_torch, kept", [
    ("0.26.0", "2.11.0", True),    # built for this torch: kept
    ("0.29.1", "2.14.1", False),   # built for another: pip picks one
])
def test_installed_torch_is_pinned_and_a_matching_torchvision_kept(tmp_path, vision,
                                                                   vision_torch, kept):
    _fake_dist(tmp_path / "site", "torch", "2.11.0")
    _fake_dist(tmp_path / "site", "torchvision", vision,
               ["numpy", f"torch=={vision_torch}", "pillow!=8.3.*,>=5.3.0"])
    proc = _installed(tmp_path / "site", tmp_path / "c.txt")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"torch 2.11.0 from {os.path.realpath(tmp_path / 'site')}"
    pins = _pins_of((tmp_path / "c.txt").read_text())
    assert pins["torch"] == "2.11.0"
    assert pins.get("torchvision") == (vision if kept else None)
    assert not kept or "does not go with" not in proc.stderr


def _index_reachable():
    import urllib.request
    url = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/") + "/pip/"
    try:
        with urllib.request.urlopen(url, timeout=5):
            return True
    except Exception:  # noqa: BLE001 - offline, proxied away, DNS: all mean "skip"
        return False


# A Linux x86_64 box (glibc 2.28) as pip's --platform sees it: older pips take the tags
# listed, not the ones a manylinux_2_28 platform implies.
LINUX_TAGS = [f"manylinux_2_{minor}_x86_64" for minor in range(28, 4, -1)] + [
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]


@pytest.mark.network
@pytest.mark.timeout(240)
@pytest.mark.parametrize("python, torch, torchvision", [
    ("3.12", "2.11", "0.26"),
    ("3.13", "2.14", "0.29"),
])
def test_notebooks_extra_resolves_against_an_installed_torch(tmp_path, python, torch,
                                                             torchvision):
    """What IPUKIT_USE_INSTALLED_TORCH=1 asks pip for on a GPU box whose Python and torch
    differ from constraints.txt's: the notebooks extra, the filtered constraints, the
    box's torch; pip (dry run, PyPI's wheels for that Python on Linux) must resolve it."""
    if not _index_reachable():
        pytest.skip("the package index (PyPI) is unreachable: this check needs it")
    proc = _torch_pins("constraints", "--torch", f"{torch}.*")
    assert proc.returncode == 0, proc.stderr
    (tmp_path / "constraints.txt").write_text(proc.stdout)
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
           "--quiet", "--disable-pip-version-check", "--no-input",
           "--only-binary=:all:", "--implementation", "cp", "--python-version", python,
           *(arg for tag in LINUX_TAGS for arg in ("--platform", tag)),
           "--target", str(tmp_path / "target"), "--report", str(tmp_path / "report.json"),
           "-c", str(tmp_path / "constraints.txt"), f"torch=={torch}.*", ".[notebooks]"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=230)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "report.json", encoding="utf-8") as f:
        chosen = {canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"]
                  for item in json.load(f)["install"]}
    assert chosen["torch"].startswith(f"{torch}."), chosen["torch"]
    assert chosen["torchvision"].startswith(f"{torchvision}."), chosen["torchvision"]
    assert "ipukit" in chosen and {"jupyterlab", "pytorch-lightning"} <= set(chosen)
