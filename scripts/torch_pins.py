"""Which torch an ipukit environment uses, and the constraints that keep it (scripts/env.sh).

constraints.txt pins one tested point: torch with the CUDA wheels it was built against.
With IPUKIT_USE_INSTALLED_TORCH=1, env.sh keeps the torch already installed for $PYTHON
instead: the pins coupled to torch's build (``TORCH_COUPLED``) are dropped and the installed
versions pinned in their place. The tests (tests/test_packaging.py) resolve the same
filtered constraints, so this file is the one home of the rule.

    python scripts/torch_pins.py constraints [--torch SPEC] [--torchvision SPEC]
        constraints.txt without the torch-coupled pins (stdout), plus torch==SPEC and
        torchvision==SPEC when given
    python scripts/torch_pins.py installed OUT
        check the torch this interpreter sees against pyproject's range; write the
        constraints that keep it (and a torchvision that goes with it) to OUT; print
        "torch VERSION from PATH" (exit 1, with the fix, when missing or out of range)
    python scripts/torch_pins.py share VENV
        when this interpreter is itself a virtual environment's (whose packages
        --system-site-packages does not reach), make VENV see its site-packages (a .pth)
    python scripts/torch_pins.py where
        "torch VERSION from PATH" for the torch this interpreter sees

Standard library only (plus the ``packaging`` that pip carries), and nothing imports torch:
the versions come from installed metadata, so it runs in a second under any Python 3.11+.
"""
import argparse
import importlib.metadata
import os
import re
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SWITCH = "IPUKIT_USE_INSTALLED_TORCH"

# Distributions whose versions follow torch's build: torch itself, the libraries built
# against one torch release (torchvision, torchaudio), its compiler (triton), the CUDA
# wheels a torch wheel pins exactly (nvidia-*, cuda-*), and setuptools, whose range torch
# caps differently from release to release (torch 2.11: setuptools<82).
TORCH_COUPLED = re.compile(
    r"^(torch|torchvision|torchaudio|triton|pytorch-triton(-.*)?|nvidia-.*|cuda-.*|setuptools)$")


def canonical(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def is_torch_coupled(name):
    return bool(TORCH_COUPLED.match(canonical(name)))


def filter_constraints(text):
    """``text`` (constraints.txt) without the lines that pin a torch-coupled distribution;
    comments and every other pin are kept as they are."""
    kept = []
    for line in text.splitlines():
        match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", line.split("#", 1)[0])
        if match and is_torch_coupled(match.group(1)):
            continue
        kept.append(line)
    return "\n".join(kept) + "\n"


def constraints(torch=None, torchvision=None, path=os.path.join(ROOT, "constraints.txt")):
    with open(path, encoding="utf-8") as f:
        text = filter_constraints(f.read())
    text += f"# torch-coupled pins replaced ({SWITCH}, scripts/torch_pins.py)\n"
    for name, spec in (("torch", torch), ("torchvision", torchvision)):
        if spec:
            text += f"{name}=={spec}\n"
    return text


def _packaging():
    try:
        from packaging.requirements import Requirement
        from packaging.version import Version
    except ImportError:  # an interpreter with pip but no packaging of its own
        from pip._vendor.packaging.requirements import Requirement
        from pip._vendor.packaging.version import Version
    return Requirement, Version


def supported(name):
    """pyproject's requirement for ``name`` (torch: the core dependency; torchvision: the
    examples extra): its text as pyproject writes it, and its specifier set."""
    Requirement, _ = _packaging()
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    reqs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        reqs += extra
    for line in reqs:
        req = Requirement(line)
        if canonical(req.name) == name:
            return line, req.specifier
    raise LookupError(f"pyproject.toml names no {name}")


def found(name):
    """(version, folder it is installed in) for the distribution this interpreter sees,
    or None."""
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None
    return dist.version, os.path.realpath(str(dist.locate_file("")))


def where():
    torch = found("torch")
    return f"torch {torch[0]} from {torch[1]}" if torch else "no torch installed"


def installed(out):
    """Check the installed torch against pyproject's range and write the constraints that
    keep it to ``out``; returns the line to print, or raises SystemExit with the fix."""
    Requirement, Version = _packaging()
    torch_req, torch_range = supported("torch")
    fix = (f"install a torch inside that range for {sys.executable} "
           f"(pip install \"{torch_req}\"), or unset {SWITCH} to install the pinned one "
           f"into .venv")
    torch = found("torch")
    if torch is None:
        raise SystemExit(f"{SWITCH}=1, but no torch is installed for {sys.executable}; "
                         f"ipukit supports {torch_req}: {fix}")
    version, location = torch
    # pip's own rule: a pre-release (2.11.0a0+git, as in NGC containers) is below 2.11.
    if not torch_range.contains(Version(version), prereleases=True):
        raise SystemExit(f"{SWITCH}=1, but the torch installed for {sys.executable} is "
                         f"{version} ({location}), outside the range ipukit supports, "
                         f"{torch_req}: {fix}")
    # torchvision is built against one torch release and names it (torch==2.11.0); reuse
    # the installed one when it names this torch and lies in the examples extra's range,
    # else leave it to pip, which picks the release built for this torch.
    vision = found("torchvision")
    if vision is not None:
        requires = [Requirement(r) for r in
                    importlib.metadata.distribution("torchvision").requires or []]
        wants = [r for r in requires if canonical(r.name) == "torch"]
        matches = all(r.specifier.contains(Version(version), prereleases=True)
                      for r in wants)
        if not (matches and supported("torchvision")[1].contains(
                Version(vision[0]), prereleases=True)):
            print(f"ipukit: the torchvision {vision[0]} installed for {sys.executable} does "
                  f"not go with torch {version}: pip installs one that does", file=sys.stderr)
            vision = None
    local = Version(version).local
    if vision is None and local:
        # A torch from PyTorch's own index (2.13.0+cpu, +cu128) wants the torchvision built
        # the same way, from that index; PyPI's is built for PyPI's torch.
        print(f"ipukit: torch {version} comes from PyTorch's index; the torchvision pip takes "
              f"from PyPI may not load with it. Install the one built for it first: "
              f"{sys.executable} -m pip install \"torch=={version}\" \"{supported('torchvision')[0]}\" "
              f"--index-url https://download.pytorch.org/whl/{local}", file=sys.stderr)
    with open(out, "w", encoding="utf-8") as f:
        f.write(constraints(torch=version, torchvision=vision and vision[0]))
    return where()


def share(venv):
    """A venv made with --system-site-packages sees the base interpreter's packages; when
    this interpreter is itself a venv's, add its site-packages to ``venv`` with a .pth file
    (after ``venv``'s own, as --system-site-packages would). Only for the same Python."""
    import site
    if sys.prefix == sys.base_prefix:
        return
    target = os.path.join(venv, "lib", f"python{sys.version_info[0]}.{sys.version_info[1]}",
                          "site-packages")
    if os.path.isdir(target):
        with open(os.path.join(target, "_ipukit_installed_torch.pth"), "w") as f:
            f.write("".join(p + "\n" for p in site.getsitepackages()))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("constraints")
    c.add_argument("--torch")
    c.add_argument("--torchvision")
    i = sub.add_parser("installed")
    i.add_argument("out")
    sub.add_parser("share").add_argument("venv")
    sub.add_parser("where")
    args = parser.parse_args(argv)
    if args.command == "constraints":
        sys.stdout.write(constraints(args.torch, args.torchvision))
    elif args.command == "installed":
        print(installed(args.out))
    elif args.command == "share":
        share(args.venv)
    else:
        print(where())


if __name__ == "__main__":
    main()
