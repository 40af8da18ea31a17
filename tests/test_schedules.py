"""The modern schedules: generated, validated, equal to torch's, modeled by closed forms, run for real."""
import itertools
import warnings

import pytest
import torch

import ipukit
from helpers import StackNet, clone_model, make_data, max_weight_diff, reference_training
from ipukit.timeline.compare import compare_schedules
from ipukit.schedules import PIPELINED_KINDS, ScheduleError, build, walk
from ipukit.schedules.generators import (LOOPED, SPLIT_BACKWARD, V_SHAPED, lanes_for, minimum_micro_batches,
                              placement)

MODERN = ("interleaved-1f1b", "looped-bfs", "zb-h1", "zbv", "dualpipev")
TORCH_NAMES = {"interleaved-1f1b": "Interleaved1F1B", "looped-bfs": "LoopedBFS",
               "zbv": "ZBVZeroBubble", "dualpipev": "DualPipeV"}


def _stages(kind, P):
    return 2 * P if kind in LOOPED + V_SHAPED else P


def _valid_ms(kind, P):
    N = _stages(kind, P)
    low = minimum_micro_batches(kind, N, P) if kind not in ("gpipe", "1f1b") else 1
    ms = [m for m in (low, low + 1, 2 * P, 3 * P, 8) if m >= low]
    if kind == "interleaved-1f1b":
        ms = [m for m in ms if m % max(1, m // P) == 0]
    return sorted(set(ms))


GRID = [(k, P, M) for k in PIPELINED_KINDS for P in (2, 3, 4) for M in _valid_ms(k, P)]


@pytest.mark.parametrize("kind,P,M", GRID, ids=[f"{k}-P{p}-M{m}" for k, p, m in GRID])
def test_every_schedule_validates_and_torch_parses_it(kind, P, M):
    N = _stages(kind, P)
    schedule = build(kind, N, M, iterations=2, stage_ipus=placement(kind, N, P))
    assert len(schedule.lanes) == P
    # each (stage, micro-batch, iteration): one F, and one B or one I and one W
    for it in range(2):
        for s in range(N):
            for m in range(M):
                kinds = sorted(a.kind for lane in schedule.lanes for a in lane
                               if (a.stage, a.micro_batch, a.iteration) == (s, m, it))
                assert kinds in (["B", "F"], ["F", "I", "W"]), (s, m, it, kinds)
    # torch's own parser reads every action, and the strings round-trip
    per_rank = schedule.to_torch(iteration=1)
    for rank, lane in per_rank.items():
        assert [str(a) for a in lane] == [str(a) for a in schedule.iteration_lanes(1)[rank]]
    again = type(schedule).from_strings(kind, schedule.to_strings(), N, M, schedule.stage_ipus,
                                        schedule.lane_ipus)
    assert again.lanes == schedule.lanes
    # every lane only runs stages of its own IPU
    for ipu, lane in zip(schedule.lane_ipus, schedule.lanes):
        assert {schedule.stage_ipus[a.stage] for a in lane} == {ipu}


def _torch_actions(name, P, M, v):
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ranks = get_schedule_ops(name, P, M, num_stages_per_rank=v)
    out = []
    for rank_ops in ranks:
        lane = []
        for a in rank_ops:
            if a is None:
                continue
            kind = a.computation_type.value
            if kind == "OVERLAP_F_B":  # DualPipe's pair: ipukit runs its forward, then backward
                lane += [str(sub) for sub in a.sub_actions]
            elif kind in ("F", "B", "I", "W"):
                lane.append(str(a))
        out.append(lane)
    return out


TORCH_GRID = [(k, P, M) for k in TORCH_NAMES for P in (2, 3, 4) for M in (P, 2 * P, 3 * P, 8)
              if not (k == "dualpipev" and M < 2 * P)]


@pytest.mark.parametrize("kind,P,M", TORCH_GRID, ids=[f"{k}-P{p}-M{m}" for k, p, m in TORCH_GRID])
def test_action_lists_equal_torch_schedule_classes(kind, P, M):
    """torch 2.14.1's classes of the same name give the same per-rank order
    (ipukit drops torch's empty slots and writes an OVERLAP_F_B pair as F then B)."""
    N = 2 * P
    mine = [[f"{s}{k}{m}" for k, s, m in ops] for ops in lanes_for(kind, N, M, placement(kind, N, P))]
    assert mine == _torch_actions(TORCH_NAMES[kind], P, M, 2)


def test_zb_h1_has_no_torch_twin_and_defers_w_by_rank():
    """torch's zero-bubble class needs ≥ 2 stages per rank; ipukit's ZB-H1 is 1F1B with
    IPU r running its first W r micro-batches late."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    with pytest.raises(Exception, match="stages_per_rank"):
        get_schedule_ops("InterleavedZeroBubble", 4, 8, num_stages_per_rank=1)
    lanes = lanes_for("zb-h1", 4, 8, [0, 1, 2, 3])
    for r, ops in enumerate(lanes):
        first_w = next(i for i, op in enumerate(ops) if op[0] == "W")
        inputs_before = sum(1 for op in ops[:first_w] if op[0] == "I")
        assert inputs_before == r + 1


@pytest.mark.parametrize("kind,ipus,fragment", [
    ("zbv", [0, 1, 2, 3], "IPU i holds stages i and 2P−1−i"),
    ("dualpipev", [0, 1, 0, 1], r"stage IPUs \[0, 1, 1, 0\]"),
    ("interleaved-1f1b", [0, 1, 1, 0], "stage s on IPU s mod P"),
    ("looped-bfs", [0, 1, 2, 3], "several stages per IPU"),
    ("zbv", [0, 1, 0], "an even number of stages"),
])
def test_wrong_placement_names_the_one_wanted(kind, ipus, fragment):
    with pytest.raises(ScheduleError, match=fragment):
        build(kind, len(ipus), 8, stage_ipus=ipus)


def test_too_few_micro_batches_is_a_clear_error():
    with pytest.raises(ScheduleError, match="gradientAccumulation 3 < 4"):
        build("dualpipev", 4, 3)
    with pytest.raises(ScheduleError, match="multiple of 2"):
        build("interleaved-1f1b", 4, 5)


@pytest.mark.parametrize("P", (2, 3, 4))
@pytest.mark.parametrize("M_per_ipu", (2, 4, 8))
def test_modeled_bubbles_follow_their_closed_forms(P, M_per_ipu):
    """Equal costs, F = 1 and B = 2 per IPU's part (I = W = 1): the step lasts
    M·(F+B) plus a fill-and-drain of (P−1)·(F+B) for GPipe and 1F1B, a v-th of it
    with v = 2 virtual stages (interleaved, looped), (P−1)·(F+I−W) for ZB-H1 — a third
    of 1F1B's — and (P−1)·F/2 for ZBV and DualPipeV, constant in M."""
    M = M_per_ipu * P
    result = compare_schedules(P, M, forward_cost=1.0, backward_cost=2.0)
    ideal = 3.0 * M
    expected = {"gpipe": 3 * (P - 1), "1f1b": 3 * (P - 1), "interleaved-1f1b": 1.5 * (P - 1),
                "looped-bfs": 1.5 * (P - 1), "zb-h1": 1.0 * (P - 1), "zbv": 0.5 * (P - 1),
                "dualpipev": 0.5 * (P - 1)}
    for kind, extra in expected.items():
        summary = result[kind]
        assert summary.available and summary.modeled
        assert summary.step_time == pytest.approx(ideal + extra), kind
        assert summary.bubble == pytest.approx(1 - ideal / (ideal + extra)), kind
    assert result["zb-h1"].step_time - ideal == pytest.approx((result["1f1b"].step_time - ideal) / 3)


@pytest.mark.parametrize("v", (2, 3, 4))
@pytest.mark.parametrize("P", (2, 4))
def test_interleaved_bubble_shrinks_with_the_number_of_virtual_stages(P, v):
    """Interleaved 1F1B with v stages per IPU: fill and drain (P−1)·(F+B)/v (Megatron's)."""
    M = 2 * P
    r = compare_schedules(P, M, kinds=["interleaved-1f1b", "1f1b"], virtual_stages=v)
    assert r["interleaved-1f1b"].num_stages == v * P
    assert r["interleaved-1f1b"].step_time - 3 * M == pytest.approx(3 * (P - 1) / v)
    assert r["1f1b"].step_time - 3 * M == pytest.approx(3 * (P - 1))


def test_zbv_bubble_share_vanishes_as_micro_batches_grow():
    shares = [compare_schedules(4, M, kinds=["zbv"])["zbv"].bubble for M in (8, 32, 128)]
    assert shares[0] > shares[1] > shares[2] and shares[2] < 0.01


@pytest.mark.parametrize("P", (2, 4))
def test_modeled_peak_activations_per_ipu(P):
    """1F1B holds P−i micro-batches on IPU i, GPipe and looped BFS all M; ZB-H1 holds P on
    every IPU (the most 1F1B holds anywhere: its "same memory"), ZBV too; interleaved
    1F1B holds more on IPU 0 than 1F1B (its price for the smaller bubble)."""
    M = 4 * P
    r = compare_schedules(P, M)
    assert r["1f1b"].peak_activations == [P - i for i in range(P)]
    assert r["gpipe"].peak_activations == [M] * P
    assert r["looped-bfs"].peak_activations == [M] * P
    assert r["zb-h1"].peak_activations == [P] * P
    assert r["zbv"].peak_activations == [P] * P
    assert r["interleaved-1f1b"].peak_activations[0] > P
    assert max(r["dualpipev"].peak_activations) >= P


def test_unequal_costs_and_a_core_limit_still_model_every_schedule():
    for kind in MODERN:
        N = 4
        ipus = placement(kind, N, 2) if kind in LOOPED + V_SHAPED else [0, 1, 2, 3]
        schedule = build(kind, N, 8, stage_ipus=ipus)
        costs = {"F": [1.0, 2.0, 0.5, 1.5], "B": [2.0, 3.0, 1.0, 2.5],
                 "I": [1.2, 1.0, 0.5, 1.0], "W": [0.8, 2.0, 0.5, 1.5]}
        free = walk(schedule.lanes, N, costs)[0]
        one_core = walk(schedule.lanes, N, costs, cores=1)[0]
        end_free = max(e for lane in free for _, e in lane)
        end_one = max(e for lane in one_core for _, e in lane)
        total = sum(costs["F"]) * 8 + sum(costs["B" if kind not in SPLIT_BACKWARD else "I"]) * 8
        assert end_one >= end_free and end_one >= total - 1e-9


# -- the threaded executor runs them ------------------------------------------------------

RUNS = [("Interleaved1F1B", [0, 1, 0, 1], 2), ("LoopedBFS", [0, 1, 0, 1], 2),
        ("ZBH1", [0, 1, 2, 3], 4), ("ZBH1", [0, 1], 2), ("ZBV", [0, 1, 1, 0], 2),
        ("DualPipeV", [0, 1, 1, 0], 4)]
RUN_CASES = [(s, ipus, ga, di, r) for (s, ipus, ga), di, r in itertools.product(RUNS, (1, 2), (1, 2))]


def _options(schedule, ipus, ga, di=1, r=1):
    """Options placing StackNet's blocks b0, b1, ... on ``ipus`` under ``schedule``."""
    opts = ipukit.Options().deviceIterations(di).replicationFactor(r).pipelineSchedule(schedule)
    opts.Training.gradientAccumulation(ga)
    opts.outputMode(ipukit.OutputMode.All)
    opts.setExecutionStrategy(ipukit.PipelinedExecution(
        *[ipukit.Stage(f"b{i}").ipu(p) for i, p in enumerate(ipus)]))
    return opts


def _train(schedule, ipus, ga, di, r, calls=2):
    torch.manual_seed(1)
    model = StackNet(len(ipus), ipus=ipus, with_ipu_ids=False)
    ref = clone_model(model)
    x, y = make_data(di * ga * r * 2)
    opts = _options(schedule, ipus, ga, di, r)
    tm = ipukit.trainingModel(model, opts,
                              optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for _ in range(calls):
        tm(x, y)
    reference_training(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), x, y,
                       device_iterations=di, gradient_accumulation=ga, replicas=r, calls=calls)
    return model, ref, tm


@pytest.mark.parametrize("schedule,ipus,ga,di,r", RUN_CASES,
                         ids=[f"{c[0]}-{''.join(map(str, c[1]))}-GA{c[2]}-DI{c[3]}-R{c[4]}"
                              for c in RUN_CASES])
def test_weights_equal_the_plain_loop(schedule, ipus, ga, di, r):
    model, ref, tm = _train(schedule, ipus, ga, di, r)
    assert max_weight_diff(model, ref) < 1e-5
    assert max_weight_diff(model, StackNet(len(ipus), ipus=ipus)) > 1e-3  # it trained
    program = tm.program
    assert program.schedule.kind == ipukit.schedules.kind_of(schedule)
    assert len(program.partition.stages) == len(ipus)
    assert [st.ipu for st in program.partition.stages] == ipus
    tm.destroy()


@pytest.mark.parametrize("schedule,ipus,ga", RUNS, ids=[f"{s}-{''.join(map(str, i))}"
                                                       for s, i, _ in RUNS])
def test_each_worker_runs_its_lane_in_schedule_order(schedule, ipus, ga):
    """The measured timeline is the schedule: per virtual IPU, the recorded actions in
    start order are that IPU's lane (F, B, I, W kinds included)."""
    _, _, tm = _train(schedule, ipus, ga, 1, 1, calls=1)
    tl = tm.getTimeline()
    program = tm.program
    letter = {"forward": "F", "backward": "B", "input-grad": "I", "weight-grad": "W"}
    for ipu, lane in zip(program.schedule.lane_ipus, program.schedule.lanes):
        wanted = [str(a) for a in lane if a.kind != "S"]
        got = [f"{e.stage}{letter[e.kind]}{e.micro_batch}"
               for e in sorted(tl.events, key=lambda e: e.start)
               if e.ipu == ipu and e.kind in letter]
        assert got == wanted
    if ipukit.schedules.kind_of(schedule) in SPLIT_BACKWARD:
        kinds = {e.kind for e in tl.events}
        assert {"input-grad", "weight-grad"} <= kinds
    tm.destroy()


def test_split_backward_does_not_rerun_the_forward():
    """I then W run no stage module again: one forward per micro-batch and stage
    (forward hooks on the compiled stage modules count them)."""
    calls = []
    torch.manual_seed(1)
    model = StackNet(4, ipus=[0, 1, 2, 3], with_ipu_ids=False)
    opts = _options("ZBH1", [0, 1, 2, 3], 4)
    tm = ipukit.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = make_data(8)
    tm(x, y)
    for stage in tm.program.partition.stages:
        stage.module.register_forward_hook(lambda *_: calls.append(1))
    tm(x, y)
    assert len(calls) == 4 * 4  # 4 stages × 4 micro-batches, no recomputation
    assert sum(e.kind == "weight-grad" for e in tm.getTimeline().events) == 4 * 4
    tm.destroy()


def test_split_backward_halves_equal_one_backward_on_branching_graphs():
    from ipukit.runtime.split_backward import backward_input, backward_weight

    torch.manual_seed(0)

    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)
            self.norm = torch.nn.LayerNorm(6)
            self.bias = torch.nn.Parameter(torch.randn(6))      # reaches the output alone
            self.unused = torch.nn.Parameter(torch.randn(2))

        def forward(self, x):
            h = self.norm(torch.relu(self.a(x))) + 0.5 * x
            return self.b(h) * h + self.bias.sin()

    m = Branchy()
    params = list(m.parameters())
    for needs_input in (True, False):
        x = torch.randn(3, 6, requires_grad=needs_input)
        out = m(x)
        g = torch.randn_like(out)
        inputs = [x] if needs_input else []
        ref = torch.autograd.grad([out], inputs + params, [g], allow_unused=True,
                                  retain_graph=True)
        dx, pending = backward_input([out], [g], inputs, params)
        got = list(dx) + backward_weight(pending, params)
        for want, have in zip(ref, got):
            assert (want is None) == (have is None)
            if want is not None:
                assert torch.allclose(want, have, atol=1e-6)


def _split_matches_one_backward(m, x, fresh: bool = False):
    from ipukit.runtime.split_backward import backward_input, backward_weight

    params = list(m.parameters())
    out = m(x)
    g = torch.randn_like(out)
    inputs = [x] if x.requires_grad else []
    ref = torch.autograd.grad([out], inputs + params, [g], allow_unused=True,
                              retain_graph=True)
    dx, pending = backward_input([out], [g], inputs, params)
    shape = [[len(grads_in) for grads_in in group["grads"]] for group in pending.groups]
    if fresh:   # W finds the parameters' accumulators again (a PendingWeights built without)
        pending.param_of = {}
    got = list(dx) + backward_weight(pending, params)
    for want, have in zip(ref, got):
        assert (want is None) == (have is None)
        if want is not None:
            assert torch.allclose(want, have, atol=1e-6)
    return shape    # per group, each intermediate's gradient inputs kept for W


def test_split_backward_handles_multi_output_nodes_and_shared_weights():
    """An intermediate with several gradient inputs (an op of two outputs, both used,
    whose inputs are the data's path and a weight; a layer norm's node, whose mean and
    deviation outputs are unused), and weights used twice (groups of two intermediates,
    one reaching the other): both halves still equal one backward."""
    torch.manual_seed(0)

    class TwoOut(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x * w, x + w

        @staticmethod
        def backward(ctx, g_prod, g_sum):
            x, w = ctx.saved_tensors
            return g_prod * w + g_sum, (g_prod * x + g_sum).sum(0)

    class Multi(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4))
            self.norm = torch.nn.LayerNorm(4)
            self.tied = torch.nn.Linear(4, 4)

        def forward(self, x):
            prod, total = TwoOut.apply(x, self.w)
            h = self.norm(self.norm(prod + total.relu()))   # its group: two 3-output nodes
            return self.tied(torch.relu(self.tied(h)))

    shape = _split_matches_one_backward(Multi(), torch.randn(3, 4, requires_grad=True))
    _split_matches_one_backward(Multi(), torch.randn(3, 4, requires_grad=True), fresh=True)
    assert max(n for group in shape for n in group) == 2      # TwoOut's two outputs
    assert max(len(group) for group in shape) >= 2            # the tied weight's group


def test_the_input_half_runs_no_python_inside_the_autograd_engine():
    """``I`` captures the intermediates' gradients in the engine, not with Python hooks:
    on threads a hook waits for the interpreter lock other workers hold."""
    import sys

    from ipukit.runtime.split_backward import backward_input

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.GELU(),
                            torch.nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    out = m(x)
    inside, called = [], []

    def profile(frame, event, arg):
        if event == "c_call" and getattr(arg, "__name__", "") == "run_backward":
            inside.append(True)
        elif event in ("c_return", "c_exception") and \
                getattr(arg, "__name__", "") == "run_backward":
            inside.pop()
        elif event == "call" and inside:
            called.append(frame.f_code.co_name)

    before = sys.getprofile()
    sys.setprofile(profile)
    try:
        _, pending = backward_input([out], [torch.ones_like(out)], [x], list(m.parameters()))
    finally:
        sys.setprofile(before)
    assert len(pending.groups) >= 2            # there were intermediates to capture
    assert called == []


def test_options_and_compile_errors_name_the_fix():
    with pytest.raises(ipukit.core.errors.OptionsError, match="DualPipeV"):
        ipukit.Options().pipelineSchedule("zero-bubble-please")
    model = StackNet(4, ipus=[0, 1, 2, 3], with_ipu_ids=False)
    opts = _options("ZBV", [0, 1, 2, 3], 8)
    tm = ipukit.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = make_data(16)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ipukit.core.errors.PipelineConfigError, match=r"Stage\(\"b0\"\)\.ipu\(0\)"):
        tm(x, y)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    tm.destroy()


def test_schedule_benchmark_measures_and_models_each_schedule():
    """benchmarks/schedules.py: a measured step and the core-limited model of that call."""
    from benchmarks.schedules import measure

    tiny = {"width": 8, "layers": 1, "micro_batch": 2, "micro_batches": 4, "calls": 1}
    for kind in ("zbv", "zb-h1"):
        r = measure(kind, 2, tiny)
        assert r["step_ms"] > 0 and 0 < r["model_over_measured"]


def test_memory_report_counts_activations_until_the_weight_gradient():
    """ZB-H1 holds a micro-batch's activations until its W: P on every stage (1F1B: N − s)."""
    from ipukit.viz.memory import activation_stash, memory_report

    assert activation_stash("zb-h1", 4, 8) == [4, 4, 4, 4]
    assert activation_stash("1f1b", 4, 8) == [4, 3, 2, 1]
    _, _, tm = _train("ZBH1", [0, 1, 2, 3], 4, 1, 1, calls=1)
    report = memory_report(tm)
    assert [st["micro_batches_in_flight"] for st in report.stages] == [4, 4, 4, 4]
    tm.destroy()
