"""A virtual IPU may keep its memory (ipukit.runtime.host_memory): glibc stops handing freed
pages back, once per process, at the first call of a model that asks
(``Options.keepHostMemory(True)``). By default nothing process-wide changes.

Each case runs in a fresh interpreter: the setting is process-wide and permanent.
"""
import json
import os
import platform
import subprocess
import sys

import pytest

import ipukit
from ipukit.core.errors import OptionsError

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

_SCRIPT = r"""
import json, resource, sys, torch
import ipukit
from ipukit.runtime import host_memory

out = {"before": host_memory.kept()}
ipukit.inferenceModel(torch.nn.Linear(4, 4))(torch.randn(2, 4))   # a model with the default
out["after_default_model"] = host_memory.kept()
if "--opt-in" in sys.argv:   # a model that asks
    ipukit.inferenceModel(torch.nn.Linear(4, 4), ipukit.Options().keepHostMemory(True))(
        torch.randn(2, 4))
out["after_first_call"] = host_memory.kept()

# what a pipelined call does to the heap: many activations alive at once, then all freed
faults = []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    held = [torch.ones(256, 1024) for _ in range(64)]     # 64 MiB in 1 MiB blocks
    del held
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
out["faults"] = faults
print("RESULT " + json.dumps(out))
"""


def _run(*flags, env=None):
    full = dict(os.environ)
    for k in ("IPUKIT_KEEP_HOST_MEMORY", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_"):
        full.pop(k, None)
    full.update(env or {})
    done = subprocess.run([sys.executable, "-c", _SCRIPT, *flags], capture_output=True,
                          text=True, env=full, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def test_by_default_the_allocator_is_left_alone():
    out = _run()
    assert out["before"] is None and out["after_default_model"] is None
    assert out["after_first_call"] is None          # nothing process-wide was changed


@pytest.mark.skipif(not GLIBC, reason="glibc's allocator only")
def test_a_model_that_asks_makes_the_allocator_keep_freed_memory():
    out = _run("--opt-in")
    assert out["after_default_model"] is None and out["after_first_call"] is True
    # 64 MiB freed and taken again: the pages stay in the process (allow a few hundred
    # faults for the allocator's own; returned to the system, they would all fault again)
    assert out["faults"][-1] < 1000, out["faults"]


@pytest.mark.skipif(not GLIBC, reason="glibc's allocator only")
def test_the_environment_turns_it_on_or_off_for_every_model():
    on = _run(env={"IPUKIT_KEEP_HOST_MEMORY": "1"})
    assert on["after_default_model"] is True
    off = _run("--opt-in", env={"IPUKIT_KEEP_HOST_MEMORY": "0"})
    assert off["after_first_call"] is None
    own = _run("--opt-in", env={"MALLOC_MMAP_THRESHOLD_": "1048576"})   # the user's own glibc setting
    assert own["after_first_call"] is False


def test_the_option_is_checked_and_recorded():
    assert ipukit.Options().keep_host_memory is False
    opts = ipukit.Options().keepHostMemory(True)
    assert opts.toDict()["ipukit"]["keep_host_memory"] is True
    with pytest.raises(OptionsError, match=r"keepHostMemory\('yes'\): expected True or False"):
        ipukit.Options().keepHostMemory("yes")
