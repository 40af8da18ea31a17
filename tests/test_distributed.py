"""Stages as processes: ipukit-run (torchrun, gloo) against the threaded executor.

Each scenario is one launch (15–30 s, mostly importing torch in every process);
tests/distributed_worker.py runs several checks inside it and writes what it
found per rank. Checks: weights, per-micro-batch losses and outputs (All, Final,
Sum) equal to the same model on threads; one timeline track per (replica,
virtual IPU) with non-overlapping spans; a raising process ends the run.
"""
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

import ipukit
import ipukit.distributed as ipd
from ipukit.distributed import run as ipukit_run
from ipukit.runtime.processes.runtime import DistributedError
from ipukit.core.errors import OptionsError

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "distributed_worker.py")


def launch(tmp_path, nproc, scenario, timeout=240):
    out = tmp_path / scenario
    out.mkdir()
    # CPU runs (gloo), also on a machine with a GPU
    env = dict(os.environ, IPUKIT_TEST_OUT=str(out), IPUKIT_DIST_TIMEOUT="60",
               CUDA_VISIBLE_DEVICES="")
    env.pop("RANK", None), env.pop("WORLD_SIZE", None)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "ipukit.distributed.run", "--nproc", str(nproc),
                           WORKER, scenario], env=env, capture_output=True, text=True,
                          timeout=timeout)
    seconds = time.monotonic() - started
    proc.out_dir = out
    results = {}
    for r in range(nproc):
        path = out / f"rank{r}.json"
        if path.exists():
            results[r] = json.loads(path.read_text())
    return proc, results, seconds


@pytest.fixture(scope="module")
def pp2_launch(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("pp2"), 2, "pp2")


@pytest.fixture(scope="module")
def pp2(pp2_launch):
    proc, results, _ = pp2_launch
    assert sorted(results) == [0, 1], proc.stderr[-3000:]
    return results


@pytest.fixture(scope="module")
def dp2pp2(tmp_path_factory):
    proc, results, _ = launch(tmp_path_factory.mktemp("dp2pp2"), 4, "dp2pp2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return results


CASES = ["all", "final", "sum", "gpipe", "four_stages"]


@pytest.mark.processes
@pytest.mark.parametrize("case", CASES)
def test_two_processes_match_threads(pp2, case):
    for rank in (0, 1):
        r = pp2[rank][case]
        assert r["weights"] == 0.0, (rank, r)
        assert r.get("inference_after_training", 0.0) == 0.0, (rank, r)
        assert r["losses"] == 0.0 and r["outputs"] == 0.0, (rank, r)
        for d_out, d_loss, t_out, t_loss in r["shapes"]:
            assert d_out == t_out and d_loss == t_loss


@pytest.mark.processes
def test_torch_schedule_class_where_identical_else_the_runtime(pp2, dp2pp2):
    # torch's own class where its per-rank actions are exactly ipukit's: Schedule1F1B /
    # ScheduleGPipe (one stage per process), the modern ones' classes (two per process);
    # otherwise torch's _PipelineScheduleRuntime fed ipukit's actions (1F1B over 4 stages on 2
    # processes; ZB-H1, which torch has no class for)
    expected = {"all": "Schedule1F1B", "gpipe": "ScheduleGPipe", "four_stages": "Runtime",
                "interleaved-1f1b": "ScheduleInterleaved1F1B", "looped-bfs": "ScheduleLoopedBFS",
                "zb-h1": "Runtime", "zbv": "ScheduleZBVZeroBubble",
                "dualpipev": "ScheduleDualPipeV"}
    for rank in (0, 1):
        assert {case: pp2[rank][case]["runner"] for case in expected} == expected
    assert dp2pp2[3]["sum"]["runner"] == "Schedule1F1B"
    assert dp2pp2[3]["zbv"]["runner"] == "ScheduleZBVZeroBubble"


MODERN = ["interleaved-1f1b", "looped-bfs", "zb-h1", "zbv", "dualpipev"]


@pytest.mark.processes
@pytest.mark.parametrize("case", MODERN)
def test_modern_schedules_on_two_processes_match_threads_and_the_plain_loop(pp2, case):
    """Several stages per process (loop or V placement), split backward (I, W): the same
    weights, losses and outputs as ipukit on threads, and the plain PyTorch loop's weights."""
    for rank in (0, 1):
        r = pp2[rank][case]
        assert r["weights"] == 0.0 and r["losses"] == 0.0 and r["outputs"] == 0.0, (rank, r)
        assert r["plain"] < 1e-6 and r["trained"] > 1e-3, (rank, r)
        split = {"input-grad", "weight-grad"} <= set(r["kinds"])
        assert split == (case in ("zb-h1", "zbv", "dualpipev")), r["kinds"]
    # the measured order on each virtual IPU (gathered on process 0) is that IPU's lane
    assert pp2[0][case]["order"] and pp2[0][case]["overlaps"] == 0
    assert pp2[0][case]["tracks"] == ["0/0", "0/1"]
    assert pp2[0][case]["stage_ipus"] == ([0, 1] if case == "zb-h1" else
                                          [0, 1, 1, 0] if case in ("zbv", "dualpipev") else
                                          [0, 1, 0, 1])


#: dp2×pp2 cases: torch's DDP where every backward is a full one (1F1B, GPipe: one stage per
#: process; interleaved 1F1B: two), one all-reduce where a backward is split (ZBV, ZB-H1)
DDP_CASES = ["all", "final", "sum", "gpipe", "interleaved-1f1b"]
ALL_REDUCE_CASES = ["zbv", "zb-h1"]


@pytest.mark.processes
@pytest.mark.parametrize("case", DDP_CASES + ALL_REDUCE_CASES)
def test_two_replicas_of_two_stages_match_threads(dp2pp2, case):
    # exactly the same weights as threads, BatchNorm buffers included, either way: the all-reduce
    # sums the gradients as the threaded step does; DDP averages them over 2 replicas (halving is
    # exact in binary) and the Mean/Sum rule undoes that. (Without replicas.without_sync, as in
    # the DDP runtime before 87ce7b7, 1F1B was 6e-8 off: torch's shape inference ran through DDP
    # with sync on, so DDP also all-reduced the first step's first backward; GPipe failed.)
    for rank in range(4):
        r = dp2pp2[rank][case]
        assert r["weights"] == 0.0 and r["buffers"] == 0.0, (rank, r)
        assert r.get("inference_after_training", 0.0) == 0.0, (rank, r)
        assert r["losses"] == 0.0 and r["outputs"] == 0.0, (rank, r)
    assert dp2pp2[0][case]["order"]


@pytest.mark.processes
def test_replicas_use_ddp_unless_a_backward_is_split(pp2, dp2pp2):
    """Full backwards: each of a process's stages under torch's DDP (one per process for 1F1B
    and GPipe, two for interleaved 1F1B); a split backward (ZBV, ZB-H1): no DDP, one
    all-reduce (ipukit.distributed.replicas.gradient_sync); one replica: neither."""
    for rank in range(4):
        for case in DDP_CASES + ALL_REDUCE_CASES:
            r = dp2pp2[rank][case]
            stages = 2 if case in ("interleaved-1f1b", "zbv") else 1
            want = (("ddp", [True] * stages) if case in DDP_CASES
                    else ("all-reduce", [False] * stages))
            assert (r["sync"], r["under_ddp"]) == want, (rank, case, r["sync"], r["under_ddp"])
    for rank in (0, 1):
        for case in CASES + MODERN:
            assert pp2[rank][case]["sync"] is None and not any(pp2[rank][case]["under_ddp"])


@pytest.mark.processes
def test_inference_matches_threads(pp2, dp2pp2):
    for results in (pp2, dp2pp2):
        for r in results.values():
            assert r["inference"]["outputs"] == 0.0


@pytest.mark.processes
def test_outputs_of_both_stages_reach_both_processes(pp2):
    """A model output from each stage: each process returns all of them (the end-of-call
    exchange, ipukit/distributed/exchange.py), equal to threads call after call."""
    for r in pp2.values():
        mine, threads = r["two_producers"]["shapes"]
        assert r["two_producers"]["outputs"] == 0.0 and mine == threads
        assert mine == [[16, 8], [16, 3], [8]]  # DI 2 × GA 4 micro-batches of 2; a loss each


@pytest.mark.processes
def test_gathered_timeline_has_a_track_per_replica_and_ipu(pp2, dp2pp2):
    for results, tracks in ((pp2, ["0/0", "0/1"]), (dp2pp2, ["0/0", "0/1", "1/0", "1/1"])):
        r = results[0]["all"]
        assert r["tracks"] == tracks
        assert r["overlaps"] == 0
        # the last call: DI 2 × GA 4 micro-batches, a forward and a backward each
        assert set(r["spans"].values()) == {16}
    four = pp2[0]["four_stages"]  # two stages per process: spans of both on one track
    assert four["tracks"] == ["0/0", "0/1"] and four["overlaps"] == 0
    assert set(four["spans"].values()) == {64}


@pytest.fixture(scope="module")
def memory(tmp_path_factory):
    proc, results, _ = launch(tmp_path_factory.mktemp("memory"), 2, "memory")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {rank: r["memory"] for rank, r in results.items()}


@pytest.mark.processes
def test_each_process_measures_its_virtual_ipu_and_process_0_gathers_them(memory):
    """track_memory() with stages as processes: each process tracks its virtual IPU during the
    call; process 0's timeline holds a track per (replica, virtual IPU), process 1's its own.
    Untracked calls carry none; a call only process 1 tracks gives process 0 that one track."""
    first, second = memory[0], memory[1]
    assert first["untracked"] == second["untracked"] == [0, 0]
    assert [(m["replica"], m["ipu"]) for m in first["processes"]] == [(0, 0), (0, 1)]
    assert [(m["replica"], m["ipu"]) for m in second["processes"]] == [(0, 1)]
    mine, sent = second["processes"][0], first["processes"][1]   # as measured, times shifted
    assert [b for _, b in mine["samples"]] == [b for _, b in sent["samples"]]
    assert all(mine[k] == sent[k] for k in ("baseline", "peak", "end", "parts", "rss_peak"))
    assert first["only_process_1"] == [[0, 1]] and second["only_process_1"] == [[0, 1]]
    assert first["report"] == [[m["ipu"], m["peak"]] for m in first["processes"]]
    for m in first["processes"]:
        weights = first["weights"][str(m["ipu"])]
        parts = m["parts"]
        assert parts["parameters"] == weights
        assert parts["optimizer_state"] == weights     # SGD's momentum, from the first call
        assert m["peak"] >= m["baseline"] + weights   # the gradients besides all it held
        levels = [b for _, b in m["samples"]]
        assert min(levels) >= 0 and max(levels) == m["peak"]
        assert m["samples"][0][1] == m["baseline"] and m["samples"][-1][1] == m["end"]
        # everything the call made is gone by its end but the rows it returns (stage 1's)
        assert m["baseline"] <= m["end"] <= m["baseline"] + (first["rows"] if m["ipu"] else 0)
        # on the gathered timeline's clock: the peak falls inside the call
        assert 0.0 <= m["samples"][0][0] <= m["peak_time"] <= first["end"]
        # the process's own figure: its peak RSS before and after the call (CPU: no allocator)
        before, after = m["rss_peak"]
        assert 0 < before <= after and m["allocator_peak"] is None


@pytest.mark.processes
def test_process_memory_agrees_with_threads_but_for_torchs_receive_buffers(memory):
    """The same model, split, schedule (1F1B) and batch on threads: each virtual IPU's peak
    agrees within 10 % once torch's receive buffers are set aside. torch's PipelineStage
    keeps one per micro-batch for each tensor it receives (IPU 1: stage 0's activation;
    IPU 0: its gradient), for the stage's life; on threads a received tensor counts only
    while it is used, so with them the process's peaks are 13-24 % higher here."""
    r = memory[0]
    receive = r["micro_batches"] * r["activation"]
    for proc, thr in zip(r["processes"], r["threads"]):
        assert proc["ipu"] == thr["ipu"]
        assert proc["parts"]["receive_buffers"] == receive
        assert proc["baseline"] - receive == thr["baseline"]
        assert abs(proc["peak"] - receive - thr["peak"]) <= 0.1 * thr["peak"], (proc, thr)


@pytest.mark.processes
def test_wrong_process_count_and_mismatch_are_clear_errors(pp2):
    for r in pp2.values():
        assert "runs as 4 processes" in r["wrong_count"] and "--nproc 4" in r["wrong_count"]
        assert "process 1 compiled a different model" in r["mismatch"]
        assert "inputs differ" in r["mismatch"]


@pytest.mark.processes
def test_a_raising_process_ends_the_run(pp2_launch):
    # the pp2 launch ends with rank 1 raising inside a call (its optimiser's third step)
    proc, results, _ = pp2_launch
    assert all(r["fails_next"] for r in results.values())
    assert proc.returncode != 0
    assert "ipukit-run: process 1 failed first" in proc.stderr
    assert "boom from the optimiser on rank 1" in proc.stderr
    # the failed call is undone: rank 1 (raised in its step), and rank 0 (stopped by the
    # failure after its own step) unless torchrun ended it first
    stopped = {r: json.loads((proc.out_dir / f"rank{r}-stopped.json").read_text())
               for r in (0, 1) if (proc.out_dir / f"rank{r}-stopped.json").exists()}
    assert 1 in stopped and stopped[1]["error"] == "ValueError: boom from the optimiser on rank 1"
    for r, note in stopped.items():
        assert note["restored"] and note["momentum"] > 0, (r, note)
    if 0 in stopped:
        assert "process 1 failed (ValueError: boom" in stopped[0]["error"]


@pytest.mark.processes
def test_a_killed_process_ends_the_run(tmp_path):
    """Rank 1 is SIGKILLed inside a call (no error of its own to report): torchrun ends the run
    within seconds, far inside the process group's 60 s timeout, and says which rank."""
    proc, _, _ = launch(tmp_path, 2, "killed")
    ended = time.time()
    killed_at = float((proc.out_dir / "killed-at.txt").read_text())
    assert proc.returncode != 0
    assert ended - killed_at < 30, ended - killed_at
    assert "Signal 9 (SIGKILL)" in proc.stderr
    assert "no process reported an error from an ipukit call" in proc.stderr
    # rank 0 (which ignores torchrun's SIGTERM here) names no culprit, and does not blame itself
    note = json.loads((proc.out_dir / "rank0-stopped.json").read_text())
    assert note["error"].startswith("DistributedError: ipukit: process 0 lost contact with the "
                                    "other processes"), note
    assert note["at"] - killed_at < 30
    assert "failed first" not in proc.stderr


# -- no launch needed -----------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--nproc", "0", "x.py"], "--nproc '0': expected an int >= 1"),
    (["--nproc", "two", "x.py"], "expected an int >= 1"),
    (["--nproc", "2", "missing_script.py"], "script 'missing_script.py' not found"),
    (["--nproc", "2"], "give the script to run"),
    (["--nproc", "2", "--nnodes", "2", __file__], "needs --rdzv-endpoint HOST:PORT"),
])
def test_launcher_bad_input(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        ipukit_run.build_command(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_launcher_command(tmp_path, monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    script = tmp_path / "s.py"
    script.write_text("")
    cmd, env = ipukit_run.build_command(["-n", "4", str(script), "--epochs", "1"])
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    assert cmd[5] == "4" and cmd[-3:] == [str(script), "--epochs", "1"]
    assert env["GLOO_SOCKET_IFNAME"] == "lo" and env["OMP_NUM_THREADS"] == "1"
    cmd, _ = ipukit_run.build_command(["-n", "2", "-m", "ipukit.examples.mnist_pipeline"])
    assert cmd[-2:] == ["-m", "ipukit.examples.mnist_pipeline"]
    cmd, env = ipukit_run.build_command(["-n", "2", "--nnodes", "2", "--rdzv-endpoint",
                                         "host0:29500", str(script)])
    assert "--standalone" not in cmd and "host0:29500" in cmd and "GLOO_SOCKET_IFNAME" not in env


def test_a_run_leaves_nothing_in_the_temporary_directory(tmp_path):
    """torchrun makes a folder of per-process log folders for every run and never removes
    it; ipukit-run gives it one inside its own temporary folder, removed when the run ends."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    script = tmp_path / "hello.py"
    # one write per process (two processes share the pipe: print's separate writes interleave)
    script.write_text("import os, sys\nsys.stdout.write(f\"rank {os.environ['RANK']}\\n\")\n")
    env = dict(os.environ, TMPDIR=str(tmp), CUDA_VISIBLE_DEVICES="")
    env.pop("RANK", None), env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, "-m", "ipukit.distributed.run", "--nproc", "2",
                           str(script)], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0" in proc.stdout and "rank 1" in proc.stdout
    assert sorted(os.listdir(tmp)) == []


def test_options_distributed_reads_torchrun(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    o = ipukit.Options()
    assert (o.Distributed.numProcesses, o.Distributed.processId) == (4, 3)
    assert ipd.is_active(o)
    o.Distributed.disable()
    assert not ipd.is_active(o)
    monkeypatch.setenv("MY_SIZE", "2")
    monkeypatch.setenv("MY_ID", "1")
    o = ipukit.Options()
    o.Distributed.setEnvVarNames("MY_SIZE", "MY_ID")
    assert (o.Distributed.numProcesses, o.Distributed.processId) == (2, 1)
    assert ipd.getNumProcesses() == 4 and ipd.getProcessIndex() == 3
    assert ipd.getNumInstances(ipus_per_replica=2) == 2
    assert ipd.getInstanceIndex(ipus_per_replica=2) == 1
    assert ipd.getNumTotalReplicas(ipus_per_replica=2) == 2
    opts = ipd.Options(ipus_per_replica=2)
    assert opts.replication_factor == 2 and opts.Distributed.processId == 3
    with pytest.raises(DistributedError, match="cannot be split into replicas of 3"):
        ipd.getNumInstances(ipus_per_replica=3)


def test_options_distributed_bad_values(monkeypatch):
    with pytest.raises(OptionsError, match="process id 5 must be an int in 0..3"):
        ipukit.Options().Distributed.configureProcessId(5, 4)
    with pytest.raises(OptionsError, match="expected an int >= 1"):
        ipukit.Options().Distributed.configureProcessId(0, 0)
    monkeypatch.setenv("WORLD_SIZE", "many")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(OptionsError, match="must be integers"):
        ipukit.Options()


def test_not_launched_runs_on_threads():
    from helpers import StackNet, make_data

    o = ipukit.Options()
    o.Training.gradientAccumulation(3)
    model = ipd.trainingModel(StackNet(2), o)
    x, y = make_data(6)
    out, loss = model(x, y)
    assert out.shape == (2, 4) and loss.dim() == 0
    assert model.isCompiled() and "processes" not in model.runtime_state


@pytest.mark.processes
def test_processes_configured_without_a_launcher_is_a_clear_error(monkeypatch):
    from helpers import StackNet, make_data

    monkeypatch.delenv("MASTER_ADDR", raising=False)
    o = ipukit.Options()
    o.Training.gradientAccumulation(3)
    o.Distributed.configureProcessId(0, 2)
    model = ipd.trainingModel(StackNet(2), o)
    x, y = make_data(6)
    with pytest.raises(DistributedError, match="MASTER_ADDR is not set"):
        model(x, y)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_two_stages_on_one_gpu_match_plain_pytorch():
    """Two stages sharing one GPU (deviceMapping), against plain PyTorch on the CPU."""
    from helpers import StackNet, make_data
    import copy

    torch.manual_seed(0)
    net = StackNet(2)
    ref = copy.deepcopy(net)
    o = ipukit.Options().deviceMapping(["cuda:0"])
    o.Training.gradientAccumulation(4)
    model = ipukit.trainingModel(net, o, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    x, y = make_data(8)
    model(x, y)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for xs, ys in zip(x.chunk(4), y.chunk(4)):
        (ref(xs, ys)[1] / 4).backward()
    opt.step()
    for p, q in zip(net.parameters(), ref.parameters()):
        assert p.device.type == "cuda"
        assert torch.allclose(p.cpu(), q, atol=1e-5)
    tl = model.getTimeline()
    assert {e.ipu for e in tl.events if e.kind == "forward"} == {0, 1}


def test_dataloader_gives_each_pipeline_the_same_batches_and_each_instance_its_share():
    dataset = torch.utils.data.TensorDataset(torch.arange(100).float())

    def passes(rank, world=4, replicas=2):
        o = ipukit.Options().deviceIterations(2).replicationFactor(replicas).randomSeed(5)
        o.Training.gradientAccumulation(3)
        o.Distributed.configureProcessId(rank, world)
        loader = ipukit.DataLoader(o, dataset, batch_size=2, shuffle=True)
        assert loader.combinedBatchSize == 12  # one replica's: 2 × DI 2 × GA 3
        return [[b[0].tolist() for b in loader] for _ in range(2)]

    runs = [passes(r) for r in range(4)]
    assert runs[0] == runs[1] and runs[2] == runs[3]      # the processes of one pipeline
    for first, second in zip(runs[0], runs[2]):           # two instances: disjoint shares
        assert len(first) == len(second) == 4             # 50 samples each → 4 batches of 12
        assert not set(sum(first, [])) & set(sum(second, []))
    assert runs[0][0] != runs[0][1]                       # each pass reshuffles
    assert sorted(sum(runs[0][0], []))[0] >= 0


def test_dataloader_share_too_small_is_a_clear_error():
    o = ipukit.Options().replicationFactor(2)
    o.Distributed.configureProcessId(0, 2)
    with pytest.raises(DistributedError, match="fewer than one combined batch"):
        ipukit.DataLoader(o, torch.utils.data.TensorDataset(torch.zeros(3)), batch_size=4)


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("IPUKIT_SLOW") != "1", reason="a full epoch: set IPUKIT_SLOW=1")
def test_tutorial_mnist_as_four_processes_learns_like_threads(data_root, tmp_path):
    """The seed tutorial's model, 4 stages as 4 processes, one epoch; then the same on threads."""
    out = tmp_path / "mnist.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env.pop("RANK", None), env.pop("WORLD_SIZE", None)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "ipukit.distributed.run", "--nproc", "4",
                           os.path.join(HERE, "distributed_mnist.py"), data_root, str(out)],
                          env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    processes = json.loads(out.read_text())
    processes["launch_seconds"] = time.monotonic() - started
    from test_tutorial import tutorial_run

    started = time.monotonic()
    _, threaded_acc = tutorial_run(data_root, epochs=1)
    threaded_seconds = time.monotonic() - started
    print(f"4 processes: test accuracy {processes['test_acc']:.2f}% (train "
          f"{processes['train_seconds']:.1f} s, launch {processes['launch_seconds']:.1f} s); "
          f"threads: {threaded_acc:.2f}% in {threaded_seconds:.1f} s")
    assert processes["tracks"] == [0, 1, 2, 3]
    assert processes["test_acc"] > 96.0
    assert abs(processes["test_acc"] - threaded_acc) < 1.5


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.skipif(os.environ.get("IPUKIT_SLOW") != "1",
                    reason="a 4-process launch of the training script (about 45 s): set IPUKIT_SLOW=1")
def test_training_script_runs_as_four_processes(data_root, tmp_path):
    """``ipukit-run -n 4 -m ipukit.examples.mnist_pipeline``: the script unchanged, 4 stages as
    4 processes, its smallest quick settings (GA 7 = 2·4 − 1, DI 1): 10 training calls of
    280 samples, then 2 test calls; process 0's profile holds every process's spans."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", IPUKIT_DIST_TIMEOUT="120")
    env.pop("RANK", None), env.pop("WORLD_SIZE", None)
    profile = tmp_path / "profile"
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "ipukit.distributed.run", "-n", "4",
         "-m", "ipukit.examples.mnist_pipeline", "--data", data_root, "--epochs", "1",
         "--limit-train", "2800", "--limit-test", "560", "--batch-size", "40",
         "--test-batch-size", "40", "--device-iterations", "1", "--gradient-accumulation", "7",
         "--profile", "--profile-dir", str(profile)],
        env=env, capture_output=True, text=True, timeout=600)
    seconds = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr[-3000:]
    # four processes share one stdout: two lines can arrive run together, so search, not split
    accuracies = [float(v) for v in re.findall(r"Accuracy on test set: ([0-9.]+)%", proc.stdout)]
    print(f"ipukit-run -n 4 -m ipukit.examples.mnist_pipeline: {seconds:.1f} s, "
          f"test accuracy {accuracies}")
    assert len(accuracies) == 4 and len(set(accuracies)) == 1  # every process: the same model
    assert accuracies[0] > 40.0  # 2800 samples: far above chance (10 %), so it trained
    traces = sorted(profile.glob("training-call*.trace.json"))
    assert len(traces) == 10  # process 0 only writes, one per call
    for path in traces:
        trace = json.loads(path.read_text())
        assert trace["otherData"]["processes"] == 4 and trace["otherData"]["gathered"]
        spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        for ipu in range(4):  # each process (virtual IPU) ran 7 forwards and 7 backwards
            for kind in ("forward", "backward"):
                assert sum(e["tid"] == ipu + 1 and e["cat"] == kind for e in spans) == 7
    for page in profile.glob("*.html"):  # 4.5 MB each (plotly.js embedded)
        page.unlink()


@pytest.mark.processes
def test_more_processes_than_gpus_is_a_clear_error(monkeypatch):
    from ipukit.runtime.processes.runtime import ensure_process_group

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    o = ipukit.Options().deviceMapping(["cuda:0"])
    o.Distributed.configureProcessId(0, 2)
    with pytest.raises(DistributedError, match="NCCL needs a GPU per process"):
        ensure_process_group(o)


def recorder_on(device, monkeypatch, record=True):
    """A process's span recorder (runtime._Recorder) built without a process group: its
    barrier is skipped; it records virtual IPU 1 of replica 0."""
    from types import SimpleNamespace

    import torch.distributed as dist
    from ipukit.runtime.processes.runtime import _Recorder

    monkeypatch.setattr(dist, "barrier", lambda *args, **kwargs: None)
    layout = SimpleNamespace(device=torch.device(device), ipu=1, replica=0)
    return _Recorder(SimpleNamespace(record=record), layout)


def test_recorder_on_cpu_records_host_times(monkeypatch):
    """On CPU an action's span is the host clock around it: no GpuClock, nothing to resolve."""
    import ipukit.runtime.processes.runtime as runtime

    monkeypatch.setattr(runtime, "GpuClock", None)  # building one would fail
    rec = recorder_on("cpu", monkeypatch)
    before = time.perf_counter()
    start = rec.start()
    rec.span(0, "B", 3, start)
    after = time.perf_counter()
    rec.resolve()
    assert type(start) is float and rec.clock is None
    (e,) = rec.events
    assert (e.stage, e.kind, e.micro_batch, e.ipu, e.replica) == (0, "backward", 3, 1, 0)
    assert before - rec.t0 <= e.start <= e.end <= after - rec.t0
    off = recorder_on("cpu", monkeypatch, record=False)
    off.span(0, "F", 0, off.start())
    assert off.events == [] and off.clock is None


class _StandInClock:
    """GpuClock's interface without CUDA: marks are 1, 2, 3, ...; resolve writes them as times."""

    def __init__(self):
        self.marks, self.pending = 0, []

    def mark(self, device):
        self.marks += 1
        return self.marks

    def later(self, events, index, device, begin, end):
        self.pending.append((events, index, begin, end))

    def resolve(self, t0):
        for events, index, begin, end in self.pending:
            events[index] = events[index]._replace(start=float(begin), end=float(end))
        self.pending.clear()


def test_recorder_on_cuda_defers_spans_to_the_gpu_clock(monkeypatch):
    """On CUDA (a stand-in clock here) a span is a placeholder between two marks, its times
    written once after the call: no synchronisation per action (tests/test_gpu.py: real CUDA)."""
    import ipukit.runtime.processes.runtime as runtime

    monkeypatch.setattr(runtime, "GpuClock", _StandInClock)
    monkeypatch.setattr(torch.cuda, "synchronize", None)  # calling it would fail
    rec = recorder_on("cuda:0", monkeypatch)
    for m in range(3):
        rec.span(0, "F", m, rec.start())
    assert [(e.start, e.end) for e in rec.events] == [(0.0, 0.0)] * 3
    rec.resolve()
    assert [(e.micro_batch, e.start, e.end) for e in rec.events] == [(0, 1, 2), (1, 3, 4),
                                                                       (2, 5, 6)]


def test_what_processes_do_not_support_yet_is_a_clear_error():
    from helpers import StackNet, make_data
    from ipukit.runtime.processes.runtime import _check_supported

    o = ipukit.Options()
    o.Training.gradientAccumulation(3)
    o.anchorTensor("grad", "Gradient___head.weight")
    model = ipukit.trainingModel(StackNet(2), o)
    model.compile(*make_data(6))
    with pytest.raises(DistributedError, match="anchored tensors are not supported"):
        _check_supported(model)


def test_weights_are_copied_where_the_first_stage_would_wait_for_a_peer():
    """The undo copy of the weights is taken after the first stage's leading forwards (its
    process then waits for the next stage); a process that waits from the start copies at once."""
    from ipukit.runtime.processes.runtime import idle_point
    from ipukit.runtime.processes.stages import process_lanes
    from ipukit.schedules import build
    from ipukit.schedules.generators import placement

    want = {("1f1b", 2, 2): [(0, 1), None], ("gpipe", 2, 2): [(0, 7), None],
            ("1f1b", 4, 4): [(0, 3), None, None, None],
            ("interleaved-1f1b", 4, 2): [(0, 1), None], ("zbv", 4, 2): [(0, 2), None]}
    for (kind, n, p), points in want.items():
        schedule = build(kind, n, 8, stage_ipus=placement(kind, n, p))
        lanes = process_lanes(schedule, sorted(set(schedule.stage_ipus)))
        assert [idle_point(lane) for lane in lanes] == points, kind


def test_a_failed_call_is_undone_whether_the_weights_were_copied_yet_or_not():
    """The process runtime's undo with the weights' copy deferred to the idle point: a call
    that fails before the copy leaves the weights of the last call that succeeded (not the
    copy of an earlier call), one that fails after its step leaves those before it."""
    from types import SimpleNamespace

    from ipukit.runtime.processes.runtime import _Runtime
    from ipukit.runtime.update import StateSnapshot

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    rt = object.__new__(_Runtime)
    rt.compiled = SimpleNamespace(training=True, optimizer=opt)
    rt.own, rt.snapshot, rt.weights = net, StateSnapshot(), StateSnapshot()
    rt.weights_due = rt.weights_taken = False
    rt.ctx = SimpleNamespace(idle_after=(0, 0))
    x = torch.randn(4, 3)

    def call(fail_at):  # a stand-in for one call: forward (buffers move), copy, step
        def body(flat):
            opt.zero_grad()
            net(x).sum().backward()
            if fail_at == "forward":
                raise RuntimeError("before the copy")
            rt._copy_weights()
            opt.step()
            if fail_at == "step":
                raise RuntimeError("after the step")
        rt._run = body
        rt.run([])

    def state():
        return ({k: v.clone() for k, v in net.state_dict().items()},
                {id(p): s["momentum_buffer"].clone() for p, s in opt.state.items()})

    def assert_state(expected):
        now = state()
        for a, b in zip(expected, now):
            assert a.keys() == b.keys()
            assert all(torch.equal(a[k], b[k]) for k in a)

    call(None)
    call(None)
    after_two = state()
    for fail_at in ("forward", "step", "forward"):
        with pytest.raises(RuntimeError):
            call(fail_at)
        assert_state(after_two)


def test_a_process_call_timeline_is_built_when_first_read_and_only_once():
    """With stages as processes a call hands the model what builds its timeline: it runs at
    the first getTimeline() (most calls' timelines are never read), and once."""
    from helpers import StackNet, make_data
    from ipukit.timeline.events import Timeline

    net = StackNet(2)
    opts = ipukit.Options()
    opts.Training.gradientAccumulation(4)
    model = ipukit.trainingModel(net, opts, torch.optim.SGD(net.parameters(), lr=0.1))
    model(*make_data(8))
    built = []

    def build():
        built.append(1)
        return Timeline([], meta={"call": len(built)})

    model._keep_timeline(build)
    assert built == []
    first = model.getTimeline()
    assert model.getTimeline() is first and built == [1]
