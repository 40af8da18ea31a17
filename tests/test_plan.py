"""The planner: ipukit.plan searches splits × schedules × batching × recomputation (modeled).

The search tests run on a hand-made cost table and block memory (nothing is timed);
one test plans a real model end to end and one runs a plan's options for real.
"""
import dataclasses

import pytest
import torch

import ipukit
from helpers import StackNet, make_data
from ipukit.core.errors import OptionsError, PipelineConfigError
from ipukit.plan import BlockMemory, Planner, micro_batch_candidates, search, table_at
from ipukit.timeline.costs import CostTable

BLOCKS = ["b0", "b1", "b2", "b3"]


def costs(micro_batch=8, scale=1.0, **kw):
    base = dict(blocks=list(BLOCKS), forward=[1e-3 * scale, 2e-3 * scale, 3e-3 * scale,
                                               1e-3 * scale],
                backward=[2e-3 * scale, 4e-3 * scale, 6e-3 * scale, 2e-3 * scale],
                per_pass=1e-4, handoff=5e-5, step=1e-3, host_before=2e-4, host_after=1e-4,
                cores=8, micro_batch=micro_batch)
    base.update(kw)
    return CostTable(**base)


def memory(micro_batch=8):
    return BlockMemory(blocks=list(BLOCKS), weights=[1000, 2000, 3000, 500],
                       activations=[8000.0, 6000.0, 4000.0, 1000.0],
                       inputs=[800.0, 600.0, 400.0, 200.0], outputs=[600.0, 400.0, 200.0, 10.0],
                       micro_batch=micro_batch)


def run_plan(**kw):
    args = dict(costs=[costs(8), costs(32, scale=3.0)], memory=memory(), ipus=2,
                global_batch=64)
    args.update(kw)
    planner = Planner(args.pop("costs"), args.pop("memory"), args.pop("ipus"),
                      args.pop("global_batch"), **args)
    return search(planner)


def test_the_fastest_plan_fits_and_the_alternatives_are_ranked_by_modeled_time():
    free = run_plan()
    budget = int(sorted({p.peak_memory for p in free.alternatives})[len(free.alternatives) // 2])
    best = run_plan(memory_budget=budget)
    assert best.peak_memory <= budget
    assert all(p.peak_memory <= budget for p in best.alternatives)
    times = [p.time_per_sample for p in best.alternatives]
    assert times == sorted(times) and best.alternatives[0] is best
    assert best.time_per_sample == min(times)
    # every fitting candidate under the budget is at least as slow as the best
    assert best.time_per_sample >= free.time_per_sample
    assert best.global_batch == 64 and best.samples_per_call == 64


def test_rejections_say_why():
    setting = dict(ipus=2, global_batch=8, micro_batch_sizes=[1, 2, 4, 8])
    peaks = sorted(p.peak_memory for p in run_plan(**setting).alternatives)
    best = run_plan(memory_budget=peaks[len(peaks) // 2], recompute=False, **setting)
    reasons = [r.reason for r in best.rejected]
    assert any(r.startswith("too few micro-batches for the schedule: gradient accumulation 2 < 3")
               for r in reasons)
    over = [r for r in best.rejected if r.over_budget]
    assert over and all(f"over budget on IPU {max(r.over_budget, key=r.over_budget.get)} by "
                        in r.reason for r in over)
    worst = over[0]
    ipu = max(worst.over_budget, key=worst.over_budget.get)
    assert f"{worst.over_budget[ipu]:,} bytes" in worst.reason
    # three blocks cannot make the four stages a V or a loop needs on two IPUs
    three = BlockMemory(blocks=BLOCKS[:3], weights=[1, 1, 1], activations=[1.0] * 3,
                        inputs=[1.0] * 3, outputs=[1.0] * 3, micro_batch=8)
    small = run_plan(costs=[costs(8, blocks=BLOCKS[:3], forward=[1e-3] * 3, backward=[2e-3] * 3)],
                     memory=three)
    assert any("needs 4 stages (2 per IPU) but the model has 3 blocks" in r.reason
               for r in small.rejected)
    text = str(best)
    assert "Rejected" in text and "| rank | schedule |" in text and "modeled" in text


def test_a_tight_budget_turns_recomputation_on():
    fixed = dict(schedules=["1F1B"], split=[2, 2], micro_batch_sizes=[8])
    free = run_plan(**fixed)
    assert free.recompute == []
    tight = run_plan(memory_budget=free.memory_per_ipu[0] - 1, **fixed)
    assert tight.recompute and 0 in tight.recompute      # the first IPU's stage recomputes
    assert tight.peak_memory < free.memory_per_ipu[0]
    assert tight.time_per_sample > free.time_per_sample  # recomputing costs a forward
    assert run_plan(memory_budget=free.memory_per_ipu[0] - 1, recompute=None,
                    **fixed).recompute == tight.recompute
    with pytest.raises(OptionsError):
        run_plan(memory_budget=free.memory_per_ipu[0] - 1, recompute=False, **fixed)


def test_a_tight_budget_picks_smaller_micro_batches_without_recomputation():
    fixed = dict(schedules=["1F1B"], split=[2, 2], micro_batch_sizes=[8, 16],
                 recompute=False, costs=[costs(8, per_pass=5e-3)])   # big micro-batches win
    free = run_plan(**fixed)
    assert free.micro_batch == 16
    tight = run_plan(memory_budget=free.peak_memory - 1, **fixed)
    assert tight.micro_batch == 8 and tight.gradient_accumulation == 8
    assert tight.peak_memory < free.peak_memory


def test_an_impossible_budget_names_the_smallest_budget_that_fits():
    with pytest.raises(OptionsError) as err:
        run_plan(memory_budget=1000)
    message = str(err.value)
    assert "memory_budget=1000" in message and "smallest budget that fits is" in message
    smallest = int(message.split("smallest budget that fits is ")[1].split(" bytes")[0]
                   .replace(",", ""))
    assert run_plan(memory_budget=smallest).peak_memory == smallest
    with pytest.raises(OptionsError, match="smallest budget"):
        run_plan(memory_budget=smallest - 1)
    assert "reached by" in message and "Raise memory_budget" in message


def test_impossible_settings_name_the_setting_and_the_fix():
    model = StackNet(num_blocks=3)
    x, y = make_data(8)
    with pytest.raises(PipelineConfigError, match=r"ipus=4\).*only 3 blocks.*ipus <= 3"):
        ipukit.plan(model, (x, y), ipus=4, global_batch=8)
    with pytest.raises(OptionsError, match=r"global_batch=10.*divisors \[1, 2, 5, 10\]"):
        micro_batch_candidates(10, [3, 4])
    with pytest.raises(PipelineConfigError, match="no candidate is possible.*Raise global_batch"):
        run_plan(global_batch=2, micro_batch_sizes=[1, 2], schedules=["GPipe", "1F1B"])
    with pytest.raises(OptionsError, match="split=\\[3, 3\\]"):
        run_plan(split=[3, 3])


def test_costs_at_other_micro_batch_sizes_are_interpolated():
    lo, hi = costs(8), costs(32, scale=3.0)
    mid = table_at([lo, hi], 20)
    assert mid.micro_batch == 20
    assert mid.forward[1] == pytest.approx(2e-3 * 2.0)        # halfway: 1× → 3×
    assert table_at([lo], 16).backward[2] == pytest.approx(12e-3)   # one table: proportional
    # per-block halves scale, the rest (cores, threads) does not
    lo = dataclasses.replace(lo, input_grad=[1.0] * 4, threads=1)
    hi = dataclasses.replace(hi, input_grad=[3.0] * 4, threads=1)
    mid = table_at([lo, hi], 20)
    assert mid.input_grad == [pytest.approx(2.0)] * 4
    assert mid.threads == 1 and table_at([hi], 64).threads == 1


def test_plans_apply_and_run_for_real():
    torch.manual_seed(0)
    model = StackNet(num_blocks=4)
    x, y = make_data(64)
    best = ipukit.plan(model, (x, y), ipus=2, global_batch=16, micro_batch_sizes=[4],
                       schedules=["1F1B", "ZBV"], device_iterations=2, repeats=2)
    assert best.micro_batch == 4 and best.gradient_accumulation == 4
    assert best.notes and best.memory_per_ipu and best.time_per_call > 0
    for p in (best, *[a for a in best.alternatives if a.schedule != best.schedule][:1]):
        opts = p.apply(model)
        training = ipukit.trainingModel(model, opts,
                                        optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
        try:
            n = p.samples_per_call
            out, loss = training(x[:n], y[:n])
            assert torch.isfinite(loss).all()
            assert [st.ipu for st in training.program.partition.stages] == p.stage_ipus
            assert training.program.schedule.kind == p.schedule
        finally:
            training.destroy()


def forward_calls(training, *batch):
    """How many times each stage's forward runs in one call (counted on the stage's own
    ``forward``, which a recomputing backward calls again)."""
    stages = training.program.partition.stages
    calls = [0] * len(stages)

    def counted(i, forward):
        def run(*args, **kwargs):
            calls[i] += 1
            return forward(*args, **kwargs)
        return run

    for i, st in enumerate(stages):
        st.module.forward = counted(i, st.module.forward)
    try:
        training(*batch)
    finally:
        for st in stages:
            del st.module.forward
    return calls


def test_a_recomputing_plan_marks_its_stages():
    model = StackNet(num_blocks=4)
    x, y = make_data(16)
    mem = BlockMemory(blocks=["b0", "b1", "b2", "b3"], weights=[0] * 4,
                      activations=[1.0] * 4, inputs=[0.1] * 4, outputs=[0.1] * 4, micro_batch=4)
    best = ipukit.plan(model, (x, y), ipus=2, global_batch=12, micro_batch_sizes=[4],
                       schedules=["1F1B"], split=[2, 2], recompute=True,
                       costs=costs(4, blocks=["b0", "b1", "b2", "b3"]), memory=mem)
    assert best.recompute == [0, 1]
    with pytest.raises(OptionsError, match="pass the model"):
        best.apply()
    opts = best.apply(model)
    training = ipukit.trainingModel(model, opts,
                                    optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
    try:
        training(x[:12], y[:12])
        stages = training.program.partition.stages
        assert [st.recompute for st in stages] == [True, True]
        # measured: each stage's forward runs twice per micro-batch, the second time
        # in its backward (3 micro-batches per call)
        assert forward_calls(training, x[:12], y[:12]) == [2 * 3, 2 * 3]
    finally:
        training.destroy()
        for h in model._ipukit_plan_hooks:
            h.remove()
    plain = ipukit.trainingModel(model, dataclasses.replace(best, recompute=[]).apply(model),
                                 optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
    try:
        plain(x[:12], y[:12])
        assert forward_calls(plain, x[:12], y[:12]) == [3, 3]   # without: once each
    finally:
        plain.destroy()


def test_groups_kept_together_and_the_layers_per_ipu_form():
    """``together``: a ViT's norm and classifier share the last IPU, so no split cuts them;
    ``Plan.layers_per_ipu`` counts the layers of each stage (an IPUConfig's form)."""
    free = run_plan(schedules=["1F1B"])
    assert any(p.split[-1] == 1 for p in free.alternatives)       # b3 alone is tried freely
    kept = run_plan(schedules=["1F1B"], together=[("b2", "b3")])
    assert kept.alternatives and all(
        any({"b2", "b3"} <= set(s) for s in p.stages) for p in kept.alternatives)
    assert kept.stages[0] and kept.layers_per_ipu(["b1", "b2"]) == [
        sum(b in ("b1", "b2") for b in s) for s in kept.stages]
    with pytest.raises(OptionsError, match="not blocks of the model"):
        run_plan(together=[("b2", "head")])
    assert run_plan(schedules=["1F1B"], split=[2, 1, 1], ipus=3,
                    together=[("b0", "b1")]).split == [2, 1, 1]
    with pytest.raises(PipelineConfigError, match="cuts a group of blocks that must share"):
        run_plan(schedules=["1F1B"], split=[1, 2, 1], ipus=3, together=[("b0", "b1")])


def test_recomputation_costs_its_forward_again_and_its_backward_rebuilds_a_micro_batch():
    """Recomputing stages pay their forward again in the backward (time), and rebuild one
    micro-batch's whole activations while that backward runs, beside their gradients
    (memory): on stage 0 (b0, b1 at micro-batch 16, twice the table's 8) the weights, 1F1B's
    two held micro-batches of inputs and outputs, and the rebuilt micro-batch twice; without
    recomputation, two whole micro-batches held and one micro-batch's gradients."""
    again = run_plan(schedules=["1F1B"], split=[2, 2], recompute=True)
    once = run_plan(schedules=["1F1B"], split=[2, 2], recompute=False)
    assert again.recompute == [0, 1] and once.recompute == []
    assert again.micro_batch == once.micro_batch == 16
    assert again.time_per_call > once.time_per_call
    held = 2 * (800 + 400)                    # b0's input and b1's output, per micro-batch
    rebuilt = 2 * (8000 + 6000 - 600)         # b0 and b1's activations, less the hand-over
    assert again.memory_per_ipu[0] == 1000 + 2000 + 2 * held + 2 * rebuilt
    assert once.memory_per_ipu[0] == 1000 + 2000 + 2 * rebuilt + rebuilt
    assert "needs at least 2N − 1 = 3" in again.summary()
