"""On CUDA: ipukit against plain PyTorch, stages sharing a GPU, and CUDA-event timing.

Skipped without CUDA (CI has none); run on a GPU machine with
``pytest -m gpu tests/test_gpu.py``.
"""
import pytest
import torch

import ipukit
from helpers import StackNet, clone_model, make_data, max_weight_diff, reference_training

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _train(blocks, ipus, ga, di, sharded=False):
    torch.manual_seed(0)
    model = StackNet(blocks, ipus=ipus)
    ref = clone_model(model).cuda()
    opts = ipukit.Options().deviceIterations(di).deviceMapping(["cuda:0"])
    opts.Training.gradientAccumulation(ga)
    if sharded:
        opts.setExecutionStrategy(ipukit.ShardedExecution())
    tm = ipukit.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.1,
                                                                    momentum=0.9))
    x, y = make_data(2 * ga * di)
    tm(x, y)
    reference_training(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9),
                       x.cuda(), y.cuda(), device_iterations=di, gradient_accumulation=ga,
                       replicas=1)
    return model, ref, tm


@pytest.mark.parametrize("blocks,ipus,ga,sharded", [(1, [0], 1, False), (2, [0, 1], 3, False),
                                                    (4, [0, 1, 2, 3], 7, False),
                                                    (4, [0, 1, 2, 3], 2, True)])
def test_weights_equal_plain_pytorch_on_one_gpu(blocks, ipus, ga, sharded):
    model, ref, _ = _train(blocks, ipus, ga, 2, sharded)
    assert next(model.parameters()).is_cuda
    assert max_weight_diff(model, ref) < 1e-5


def test_cuda_event_spans_follow_the_pipeline():
    """Stages on one GPU share its stream: a stage's forward of a micro-batch starts after
    the previous stage's ended, and each virtual IPU's spans never overlap."""
    _, _, tm = _train(2, [0, 1], 3, 2)
    tl = tm.getTimeline()
    fwd = {(e.stage, e.iteration, e.micro_batch): e for e in tl.events if e.kind == "forward"}
    assert len(fwd) == 2 * 3 * 2
    for (stage, it, m), e in fwd.items():
        assert 0 <= e.start <= e.end <= tl.end
        if stage == 1:
            assert e.start >= fwd[(0, it, m)].end - 1e-6
    for ipu in (0, 1):
        spans = sorted((e.start, e.end) for e in tl.events
                       if e.ipu == ipu and e.kind in ("forward", "backward"))
        assert all(a[1] <= b[0] + 1e-6 for a, b in zip(spans, spans[1:]))


def test_a_second_model_of_a_module_already_on_cuda_compiles():
    """A training model moved the shared weights to CUDA; an inference model of the same
    module is traced with host inputs."""
    model, _, tm = _train(2, [0, 1], 3, 1)
    opts = ipukit.Options().deviceIterations(2).deviceMapping(["cuda:0"])
    out = ipukit.inferenceModel(model, opts)(torch.randn(4, 8))
    assert out.shape == (4, 4)
