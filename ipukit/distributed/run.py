"""``ipukit-run``: launch a script as processes (a thin wrapper over torchrun).

    ipukit-run --nproc 4 train.py --epochs 1
    ipukit-run -n 4 -m ipukit.examples.mnist_pipeline
    ipukit-run -n 2 --nnodes 2 --rdzv-endpoint host0:29500 train.py   # on each of 2 machines

Runs ``python -m torch.distributed.run`` (standalone, or with ``--nnodes`` torchrun's c10d
rendezvous) with ``GLOO_SOCKET_IFNAME=lo`` (one machine) and ``OMP_NUM_THREADS=1`` unless
set. When a process fails, the others are stopped and one line names the process that
failed first and its exception. torchrun's log folders go in a temporary folder.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from typing import List, Optional


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ipukit-run",
        description="Run an ipukit script as N processes (one per virtual IPU per replica) "
                    "with torchrun.")
    p.add_argument("-n", "--nproc", required=True, metavar="N",
                   help="processes (per machine): the model's virtual IPUs × replicationFactor "
                   "÷ machines")
    p.add_argument("-m", dest="module", metavar="MODULE", default=None,
                   help="run a module (like python -m) instead of a script")
    p.add_argument("--nnodes", type=int, default=1, metavar="M",
                   help="machines (each runs this command with the same --rdzv-endpoint)")
    p.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                   help="rendezvous of a run over several machines (torchrun's c10d backend)")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="process-group timeout (IPUKIT_DIST_TIMEOUT, default 300)")
    p.add_argument("script", nargs="?", help="the script to run")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return p


def _split_module(argv: List[str]) -> tuple:
    """(launcher's arguments, the module's arguments): like ``python -m``, everything after
    ``-m MODULE`` belongs to the module (its own ``--flags`` included)."""
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if arg == "-m" and i + 1 < len(argv):
            return argv[:i + 2], argv[i + 2:]
        if arg.startswith("-m") and len(arg) > 2 and not arg.startswith("--"):
            return argv[:i + 1], argv[i + 1:]
        if not arg.startswith("-") and (i == 0 or argv[i - 1] not in _VALUED):
            break  # the script: the rest are its arguments
    return argv, None


_VALUED = {"-n", "--nproc", "--nnodes", "--rdzv-endpoint", "--timeout"}


def build_command(argv: List[str]) -> tuple:
    """(command, environment) for ``argv``; raises SystemExit with a message on bad input."""
    p = _parser()
    argv, module_args = _split_module(argv)
    ns = p.parse_args(argv)
    if module_args is not None:
        ns.script, ns.args = None, module_args
    try:
        n = int(ns.nproc)
    except ValueError:
        n = 0
    if n < 1:
        p.error(f"--nproc {ns.nproc!r}: expected an int >= 1, the model's virtual IPUs × "
                "replicationFactor (e.g. --nproc 4 for 2 stages × 2 replicas)")
    target: List[str]
    if ns.module:
        target = ["-m", ns.module] + list(ns.args)
    else:
        if not ns.script:
            p.error("give the script to run (ipukit-run --nproc N script.py ...) or -m MODULE")
        if not os.path.isfile(ns.script):
            p.error(f"script {ns.script!r} not found")
        target = [ns.script] + list(ns.args)
    env = dict(os.environ)
    if ns.nnodes == 1:  # one machine: loopback (several machines must use a real interface)
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("OMP_NUM_THREADS", "1")
    if ns.timeout is not None:
        if ns.timeout <= 0:
            p.error(f"--timeout {ns.timeout}: expected seconds > 0")
        env["IPUKIT_DIST_TIMEOUT"] = str(ns.timeout)
    if ns.nnodes < 1:
        p.error(f"--nnodes {ns.nnodes}: expected an int >= 1")
    if ns.nnodes > 1:
        if not ns.rdzv_endpoint:
            p.error(f"--nnodes {ns.nnodes} needs --rdzv-endpoint HOST:PORT (the same on every "
                    "machine) so that the machines can find each other")
        launch = ["--nnodes", str(ns.nnodes), "--rdzv-backend", "c10d",
                  "--rdzv-endpoint", ns.rdzv_endpoint]
    else:
        launch = ["--standalone"]
    cmd = ([sys.executable, "-m", "torch.distributed.run"] + launch
           + ["--nproc-per-node", str(n), "--monitor-interval", "0.2"] + target)
    return cmd, env


def _first_failure(folder: str) -> Optional[str]:
    notes = []
    for name in os.listdir(folder):
        try:
            with open(os.path.join(folder, name)) as f:
                stamp, line = f.read().split("\n", 1)
            notes.append((float(stamp), line.strip()))
        except (OSError, ValueError):
            continue
    return min(notes)[1] if notes else None


def main(argv: Optional[List[str]] = None) -> int:
    cmd, env = build_command(list(sys.argv[1:] if argv is None else argv))
    with tempfile.TemporaryDirectory(prefix="ipukit-run-") as folder:
        env["IPUKIT_FAILURE_DIR"] = folder
        # torchrun never removes its per-process log folders: given ours, they go at the end
        cmd = cmd[:3] + ["--log-dir", os.path.join(folder, "torchrun")] + cmd[3:]
        try:
            code = subprocess.call(cmd, env=env)
        except KeyboardInterrupt:
            code = 130
        if code != 0:
            first = _first_failure(folder)
            if first:
                print(f"ipukit-run: process {first.split(':', 1)[0].split()[-1]} failed first "
                      f"({first})", file=sys.stderr)
            elif code != 130:
                print(f"ipukit-run: the run failed (exit code {code}) and no process reported "
                      "an error from an ipukit call; torchrun's report above names the process "
                      "that ended first (a killed one shows as 'Signal 9 (SIGKILL)')",
                      file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
