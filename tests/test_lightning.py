"""Lightning's IPU front door (``ipukit.lightning``): code written for lightning-graphcore runs on ipukit."""
import copy
import glob
import logging
import os
import time

import pytest
import torch
import torch.nn.functional as F

pl = pytest.importorskip("pytorch_lightning")

import ipukit as poptorch  # noqa: E402
from ipukit.lightning.strategy import (IPUAccelerator, IPUPrecision, IPUStrategy,  # noqa: E402
                              LightningError)

logging.getLogger("pytorch_lightning").setLevel(logging.WARNING)
logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")]


def trainer(**kwargs):
    """A quiet Trainer of one replica unless ``devices`` says otherwise (``devices="auto"``
    is 4 replicas, lightning-graphcore's auto_device_count)."""
    quiet = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                 enable_model_summary=False, num_sanity_val_steps=0, devices=1)
    quiet.update(kwargs)
    return pl.Trainer(**quiet)


def data(n=48, features=4, classes=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, features, generator=g),
                                          torch.randint(0, classes, (n,), generator=g))


class Small(pl.LightningModule):
    """Two linear layers; optionally split over two virtual IPUs with BeginBlock."""

    def __init__(self, pipelined=False, optimizer="sgd", log=False):
        super().__init__()
        self.l1 = torch.nn.Linear(4, 8)
        self.l2 = torch.nn.Linear(8, 3)
        if pipelined:
            poptorch.BeginBlock(self.l1, ipu_id=0)
            poptorch.BeginBlock(self.l2, ipu_id=1)
        self.optimizer = optimizer
        self.do_log = log
        self.seen = []

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        if self.do_log:
            self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        correct = (self(x).argmax(-1) == y).float().sum()
        if self.do_log:
            self.log("val_correct", correct)
        return correct

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        if self.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=0.01)
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Direct(torch.nn.Module):
    """The same network as :class:`Small`, written for ipukit directly (loss in the last stage)."""

    def __init__(self, lightning_module):
        super().__init__()
        self.l1 = copy.deepcopy(lightning_module.l1)
        self.l2 = copy.deepcopy(lightning_module.l2)

    def forward(self, x, y):
        return F.cross_entropy(self.l2(torch.relu(self.l1(x))), y)


def weights(module):
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


# ----------------------------------------------------------------------------- item 1
def test_importing_registers_the_accelerator_and_the_strategy():
    assert "ipu" in pl.accelerators.AcceleratorRegistry
    assert "ipu_strategy" in pl.strategies.StrategyRegistry
    t = trainer(accelerator="ipu", devices=3)
    assert isinstance(t.accelerator, IPUAccelerator)
    assert isinstance(t.strategy, IPUStrategy)          # not DDP
    assert isinstance(t.precision_plugin, IPUPrecision)
    assert t.strategy.replication_factor == 3
    t = trainer(accelerator="ipu", strategy="ipu_strategy")
    assert isinstance(t.strategy, IPUStrategy) and t.strategy.replication_factor == 1
    assert isinstance(trainer(accelerator="cpu", devices=1).strategy, pl.strategies.SingleDeviceStrategy)


def test_bad_strategy_arguments_are_clear_errors():
    with pytest.raises(LightningError, match="device_iterations"):
        IPUStrategy(device_iterations=0)
    with pytest.raises(LightningError, match="training_opts"):
        IPUStrategy(training_opts={"deviceIterations": 2})
    with pytest.raises(poptorch.Error, match="devices=-2.*replicationFactor"):
        trainer(accelerator="ipu", devices=-2)
    with pytest.raises(LightningError, match="precision"):
        IPUPrecision("bf16-mixed")


def test_fit_gives_the_weights_of_the_same_ipukit_training():
    """Pipelined over 2 virtual IPUs, 2 replicas, DI 2, GA 3: the same weights and optimiser
    state as ipukit driven directly with the same options and data order."""
    torch.manual_seed(0)
    lm = Small(pipelined=True, optimizer="adam")
    direct = Direct(lm)  # the copies keep their BeginBlock annotations
    ds = data(n=96)
    t = trainer(accelerator="ipu", devices=2, max_epochs=2, accumulate_grad_batches=3,
                strategy=IPUStrategy(device_iterations=2))
    t.fit(lm, torch.utils.data.DataLoader(ds, batch_size=2))

    opts = poptorch.Options().deviceIterations(2).replicationFactor(2)
    opts.Training.gradientAccumulation(3)
    optimizer = torch.optim.Adam(direct.parameters(), lr=0.01)
    model = poptorch.trainingModel(direct, opts, optimizer=optimizer)
    loader = poptorch.DataLoader(opts, ds, batch_size=2)
    for _ in range(2):
        for x, y in loader:
            model(x, y)
    assert t.strategy.timeline("train").meta["num_stages"] == 2
    assert t.global_step == 2 * 4              # epochs × calls: one Lightning step per call
    mine, theirs = weights(lm), weights(direct)
    diff = max((mine[k] - theirs[k]).abs().max().item() for k in mine)
    print(f"largest weight difference, Lightning vs ipukit directly: {diff:.3g}")
    assert diff <= 1e-6, diff
    state = t.optimizers[0].state_dict()["state"]
    for i, p in enumerate(direct.parameters()):
        assert torch.allclose(state[i]["exp_avg"].cpu(), optimizer.state[p]["exp_avg"].cpu(),
                              atol=1e-6)
        assert state[i]["step"] == optimizer.state[p]["step"] == 16


def test_a_users_ipukit_dataloader_is_kept_as_is():
    opts = poptorch.Options().deviceIterations(2)
    loader = poptorch.DataLoader(opts, data(), batch_size=4)
    t = trainer(accelerator="ipu", max_epochs=1,
                strategy=IPUStrategy(device_iterations=2, training_opts=opts))
    t.fit(Small(), loader)
    assert t.train_dataloader is loader
    assert t.global_step == len(loader)


def test_a_plain_dataloader_becomes_an_ipukit_dataloader_of_whole_calls():
    t = trainer(accelerator="ipu", devices=2, max_epochs=1, accumulate_grad_batches=2,
                strategy=IPUStrategy(device_iterations=3))
    t.fit(Small(), torch.utils.data.DataLoader(data(n=60), batch_size=2, shuffle=True))
    loader = t.train_dataloader
    assert isinstance(loader, poptorch.DataLoader)
    assert loader.combinedBatchSize == 2 * 3 * 2 * 2
    assert len(loader) == 2 and t.global_step == 2
    assert t.accumulate_grad_batches == 2         # restored after the run


# ----------------------------------------------------------------------------- item 2: the seed docs
class BeginBlockModule(pl.LightningModule):
    """The seed docs' first pattern, as written: BeginBlock in __init__, 4 IPUs."""

    def __init__(self):
        super().__init__()
        self.layer1 = poptorch.BeginBlock(torch.nn.Linear(5, 10), ipu_id=0)
        self.layer2 = poptorch.BeginBlock(torch.nn.Linear(10, 5), ipu_id=1)
        self.layer3 = torch.nn.Linear(5, 5)
        self.layer4 = poptorch.BeginBlock(torch.nn.Linear(5, 5), ipu_id=2)
        self.softmax = poptorch.BeginBlock(torch.nn.Softmax(dim=1), ipu_id=3)

    def forward(self, x):
        x = self.layer3(torch.relu(self.layer2(torch.relu(self.layer1(x)))))
        return self.softmax(self.layer4(torch.relu(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.nll_loss(torch.log(self(x)), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return (self(x).argmax(-1) == y).float().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class BlockModule(BeginBlockModule):
    """The seed docs' second pattern: Blocks in forward; the loss is computed in
    training_step, after the last block closed."""

    def __init__(self):
        pl.LightningModule.__init__(self)
        self.layer1 = torch.nn.Linear(5, 10)
        self.layer2 = torch.nn.Linear(10, 5)
        self.layer3 = torch.nn.Linear(5, 5)
        self.layer4 = torch.nn.Linear(5, 5)
        self.act = torch.nn.ReLU()
        self.softmax = torch.nn.Softmax(dim=1)

    def forward(self, x):
        with poptorch.Block(ipu_id=0):
            x = self.act(self.layer1(x))
        with poptorch.Block(ipu_id=1):
            x = self.act(self.layer2(x))
        with poptorch.Block(ipu_id=2):
            x = self.act(self.layer3(x))
            x = self.act(self.layer4(x))
        with poptorch.Block(ipu_id=3):
            x = self.softmax(x)
        return x


class StepBlockModule(BlockModule):
    """Blocks in a step: the loss gets its own block on the last IPU."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        with poptorch.Block("loss", ipu_id=3):
            return F.nll_loss(torch.log(out), y)


def seed_data(n):
    g = torch.Generator().manual_seed(2)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
        torch.randn(n, 5, generator=g), torch.randint(0, 5, (n,), generator=g)), batch_size=2)


@pytest.mark.parametrize("module", [BeginBlockModule, BlockModule, StepBlockModule])
def test_the_seed_docs_pipelined_modules_run_as_written(module):
    """devices=8 and device_iterations=20 scaled down to 2 replicas and 4 iterations; the
    pipelined training needs gradient accumulation ≥ 2·4 − 1 = 7."""
    lm = module()
    before = weights(lm)
    t = trainer(accelerator="ipu", devices=2, max_epochs=1, accumulate_grad_batches=7,
                strategy=IPUStrategy(device_iterations=4))
    t.fit(lm, seed_data(2 * 4 * 7 * 2), seed_data(2 * 4 * 2 * 2))
    tl = t.strategy.timeline("train")
    assert tl.meta["num_stages"] == 4 and tl.meta["replicas"] == 2
    assert sorted({e.ipu for e in tl.events if e.ipu >= 0}) == [0, 1, 2, 3]
    assert t.strategy.timeline("validate").meta["num_stages"] == 4
    assert t.global_step == 1
    assert any(not torch.equal(before[k], v) for k, v in weights(lm).items())


def test_pipelined_training_without_enough_accumulation_says_how_to_fix_it():
    t = trainer(accelerator="ipu", max_epochs=1, strategy=IPUStrategy(device_iterations=4))
    with pytest.raises(poptorch.Error, match=r"gradientAccumulation.*\(7\).*accumulate_grad_batches"):
        t.fit(BlockModule(), seed_data(16))


def test_the_seed_docs_training_and_inference_options():
    """The third pattern: user Options with AnchorMode.All for training, others for inference."""
    inference_opts = poptorch.Options()
    inference_opts.deviceIterations(4)
    training_opts = poptorch.Options()
    training_opts.anchorMode(poptorch.AnchorMode.All)
    training_opts.deviceIterations(4)

    losses = []

    class Recorder(Small):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            losses.append(outputs["loss"])

    lm = Recorder()
    strategy = IPUStrategy(inference_opts=inference_opts, training_opts=training_opts)
    t = trainer(accelerator="ipu", devices=2, max_epochs=1, strategy=strategy)
    t.fit(lm, torch.utils.data.DataLoader(data(n=32), batch_size=2),
          torch.utils.data.DataLoader(data(n=32, seed=3), batch_size=2))
    assert len(losses) == 2 and losses[0].shape == (8,)   # every micro-batch's loss (All)
    assert t.strategy.training_opts.replication_factor == 2
    assert t.strategy.inference_opts.device_iterations == 4
    assert training_opts.device_iterations == 4 and training_opts.replication_factor == 1


def test_validation_during_fit_sees_the_trained_weights_and_predict_returns_every_sample():
    lm = Small(log=True)
    val = data(n=24, seed=5)
    t = trainer(accelerator="ipu", max_epochs=2, strategy=IPUStrategy(device_iterations=2))
    t.fit(lm, torch.utils.data.DataLoader(data(), batch_size=4),
          torch.utils.data.DataLoader(val, batch_size=4))
    x, y = val.tensors
    with torch.no_grad():
        expected = (lm(x).argmax(-1) == y).float().view(-1, 4).sum(1).mean()
    assert torch.isclose(t.callback_metrics["val_correct"], expected)
    assert "train_loss" in t.callback_metrics        # self.log in a single-stage step works
    preds = t.predict(lm, torch.utils.data.DataLoader(val, batch_size=4))
    assert len(preds) == 3 and preds[0].shape == (8, 3)
    with torch.no_grad():
        assert torch.allclose(torch.cat(preds), lm(x), atol=1e-6)
    assert t.strategy.timeline("predict") is not None


def test_validate_and_test_run_on_inference_models():
    lm = Small(log=True)
    t = trainer(accelerator="ipu", devices=2)
    out = t.validate(lm, torch.utils.data.DataLoader(data(n=16), batch_size=2))
    assert "val_correct" in out[0]
    assert t.strategy.model_for("validate").options.replication_factor == 2


def test_each_validation_loader_gets_its_own_inference_model():
    class Two(Small):
        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            x, y = batch
            self.log(f"correct{dataloader_idx}", (self(x).argmax(-1) == y).float().sum(),
                     add_dataloader_idx=False)

    t = trainer(accelerator="ipu", devices=2)
    t.validate(Two(), [torch.utils.data.DataLoader(data(n=16), batch_size=2),
                       torch.utils.data.DataLoader(data(n=12), batch_size=3)])
    assert {"correct0", "correct1"} <= set(t.callback_metrics)
    assert [len(d) for d in t.val_dataloaders] == [4, 2]


@pytest.mark.parametrize("precision", [16, "16-mixed", "16-true"])
def test_half_precision_on_a_float32_model(precision):
    lm = Small()
    t = trainer(accelerator="ipu", max_epochs=1, precision=precision)
    assert isinstance(t.precision_plugin, IPUPrecision)
    t.fit(lm, torch.utils.data.DataLoader(data(), batch_size=4),
          torch.utils.data.DataLoader(data(n=16), batch_size=4))
    dtype = torch.float16 if precision == "16-true" else torch.float32
    assert lm.l1.weight.dtype == dtype
    assert all(torch.isfinite(p).all() for p in lm.parameters())
    assert t.global_step == 12


def test_16_mixed_rounds_float_inputs_to_half_and_keeps_the_models_dtype():
    seen = []

    class Seeing(Small):
        def training_step(self, batch, batch_idx):
            seen.append(batch[0].detach().clone())
            return super().training_step(batch, batch_idx)

    t = trainer(accelerator="ipu", max_epochs=1, precision="16-mixed")
    t.fit(Seeing(), torch.utils.data.DataLoader(data(), batch_size=4))
    seen = seen[1:]                    # the first call traced the step
    assert len(seen) == 12 and all(x.dtype == torch.float32 for x in seen)
    assert all(torch.equal(x, x.half().float()) for x in seen)
    assert not torch.equal(data().tensors[0], data().tensors[0].half().float())


def test_replicas_of_a_single_stage_model_with_buffers_and_self_log():
    class Normed(Small):
        def __init__(self):
            super().__init__(log=True)
            self.norm = torch.nn.BatchNorm1d(4)

        def forward(self, x):
            return super().forward(self.norm(x))

    lm = Normed()
    t = trainer(accelerator="ipu", devices=2, max_epochs=1, num_sanity_val_steps=2,
                strategy=IPUStrategy(device_iterations=2))
    t.fit(lm, torch.utils.data.DataLoader(data(), batch_size=2),
          torch.utils.data.DataLoader(data(n=16), batch_size=2))
    assert t.global_step == 6 and lm.norm.num_batches_tracked.item() == 12
    assert {"train_loss", "val_correct"} <= set(t.callback_metrics)
    assert t.strategy.timeline("train").meta["replicas"] == 2


def test_a_half_model_takes_float32_batches():
    lm = Small().half()
    t = trainer(accelerator="ipu", max_epochs=1)
    t.fit(lm, torch.utils.data.DataLoader(data(), batch_size=4))
    assert lm.l1.weight.dtype == torch.float16 and t.global_step == 12


def test_autoreport_writes_ipukit_profiles_per_run(tmp_path):
    t = trainer(accelerator="ipu", max_epochs=1, accumulate_grad_batches=3,
                strategy=IPUStrategy(device_iterations=2, autoreport=True,
                                     autoreport_dir=str(tmp_path)))
    t.fit(Small(pipelined=True), torch.utils.data.DataLoader(data(n=48), batch_size=4),
          torch.utils.data.DataLoader(data(n=16), batch_size=4))
    names = sorted(os.path.basename(p) for p in glob.glob(str(tmp_path / "*")))
    # the last call of the training run and of the validation run: a trace and a report each
    assert {"training-call0001.trace.json", "training-call0001.html",
            "validation-call0001.trace.json", "validation-call0001.html"} <= set(names), names
    assert len(t.strategy.reports) == 2


# ----------------------------------------------------------------------------- item 3: limitations
def test_two_optimizers_are_an_error_at_setup():
    class Two(Small):
        def configure_optimizers(self):
            return [torch.optim.SGD(self.l1.parameters(), lr=0.1),
                    torch.optim.SGD(self.l2.parameters(), lr=0.1)]

    with pytest.raises(LightningError, match="more than one optimizer;.*one optimiser"):
        trainer(accelerator="ipu", max_epochs=1).fit(
            Two(), torch.utils.data.DataLoader(data(), batch_size=4))


def test_gradient_clipping_is_an_error_that_names_the_optimisers_clipping():
    with pytest.raises(LightningError, match="gradient_clip_val=0.5.*max_grad_norm"):
        trainer(accelerator="ipu", max_epochs=1, gradient_clip_val=0.5).fit(
            Small(), torch.utils.data.DataLoader(data(), batch_size=4))


def test_self_log_in_a_traced_step_says_to_log_in_on_train_batch_end():
    lm = Small(pipelined=True, log=True)
    before = weights(lm)
    with pytest.raises(LightningError, match=r"self\.log \('train_loss'\).*2 pipeline stages"
                                             r".*on_train_batch_end"):
        trainer(accelerator="ipu", max_epochs=1, accumulate_grad_batches=3).fit(
            lm, torch.utils.data.DataLoader(data(), batch_size=4))
    assert all(torch.equal(before[k], v) for k, v in weights(lm).items())

    class Fixed(Small):  # the fix the message gives
        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.log("train_loss", outputs["loss"])

    t = trainer(accelerator="ipu", max_epochs=1, accumulate_grad_batches=3)
    t.fit(Fixed(pipelined=True), torch.utils.data.DataLoader(data(), batch_size=4))
    assert "train_loss" in t.callback_metrics


@pytest.mark.parametrize("hook", ["transfer_batch_to_device", "on_after_batch_transfer"])
def test_overridden_batch_transfer_hooks_are_an_error(hook):
    def passthrough(self, batch, *args):
        return batch

    cls = type("Overrides", (Small,), {hook: passthrough})
    with pytest.raises(LightningError, match=hook):
        trainer(accelerator="ipu", max_epochs=1).fit(
            cls(), torch.utils.data.DataLoader(data(), batch_size=4))


def test_a_batch_sampler_with_several_replicas_is_an_error():
    sampler = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(range(48)), 4,
                                            drop_last=True)
    loader = torch.utils.data.DataLoader(data(), batch_sampler=sampler)
    with pytest.raises(LightningError, match="batch_sampler.*2 replicas"):
        trainer(accelerator="ipu", devices=2, max_epochs=1).fit(Small(), loader)
    t = trainer(accelerator="ipu", max_epochs=1)       # one replica: used as it is
    t.fit(Small(), loader)
    assert t.global_step == 12


def test_manual_optimisation_is_an_error():
    lm = Small()
    lm.automatic_optimization = False
    with pytest.raises(LightningError, match="automatic_optimization"):
        trainer(accelerator="ipu", max_epochs=1).fit(
            lm, torch.utils.data.DataLoader(data(), batch_size=4))


# ----------------------------------------------------------------------------- item 4: steps
def test_max_steps_and_schedulers_count_calls():
    """One Lightning step is one call (lightning-graphcore): a call of 2 device iterations
    makes 2 optimiser steps at the learning rate it began with; the scheduler then steps once."""
    class Scheduled(Small):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=1.0)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    calls = []

    class Counting(Scheduled):
        def on_train_batch_start(self, batch, batch_idx):
            calls.append(self.trainer.optimizers[0].param_groups[0]["lr"])

    t = trainer(accelerator="ipu", max_steps=3, accumulate_grad_batches=2,
                strategy=IPUStrategy(device_iterations=2))
    t.fit(Counting(), torch.utils.data.DataLoader(data(n=160), batch_size=2))
    assert t.global_step == 3 and len(calls) == 3       # 3 calls of 2 optimiser steps each
    assert calls == [1.0, 0.5, 0.25]
    assert t.optimizers[0].param_groups[0]["lr"] == 0.5 ** 3


def test_accumulation_counts_one_step_per_call():
    """accumulate_grad_batches=2 is ipukit's gradientAccumulation(2): max_steps=2 stops after
    2 calls, not at the end of the epoch."""
    t = trainer(accelerator="ipu", max_steps=2, accumulate_grad_batches=2)
    t.fit(Small(), torch.utils.data.DataLoader(data(n=80), batch_size=2))
    assert t.global_step == 2 and t.fit_loop.epoch_loop.batch_progress.total.completed == 2
    assert t.strategy.training_opts.Training.gradient_accumulation == 2


def test_resuming_from_a_checkpoint_continues_the_same_training(tmp_path):
    loader = torch.utils.data.DataLoader(data(n=32), batch_size=4)
    torch.manual_seed(0)
    whole = Small(optimizer="adam")
    start = weights(whole)
    t = trainer(accelerator="ipu", max_epochs=2, strategy=IPUStrategy(device_iterations=2))
    t.fit(whole, loader)

    half = Small(optimizer="adam")
    half.load_state_dict(start)
    t1 = trainer(accelerator="ipu", max_epochs=1, strategy=IPUStrategy(device_iterations=2))
    t1.fit(half, loader)
    path = str(tmp_path / "epoch1.ckpt")
    t1.save_checkpoint(path)

    resumed = Small(optimizer="adam")
    t2 = trainer(accelerator="ipu", max_epochs=2, strategy=IPUStrategy(device_iterations=2))
    t2.fit(resumed, loader, ckpt_path=path)
    assert t1.global_step == 4 and t2.global_step == t.global_step == 8
    mine, theirs = weights(resumed), weights(whole)
    assert all(torch.allclose(mine[k], theirs[k], atol=1e-6) for k in mine)
    a, b = t2.optimizers[0].state_dict()["state"], t.optimizers[0].state_dict()["state"]
    for i in a:
        assert a[i]["step"] == b[i]["step"] == 16
        assert torch.allclose(a[i]["exp_avg_sq"], b[i]["exp_avg_sq"], atol=1e-7)


# ----------------------------------------------------------------------------- slow: MNIST
class LitMNIST(pl.LightningModule):
    """The tutorial's MNIST network as a LightningModule, Blocks in forward (seed-docs style)."""

    def __init__(self):
        super().__init__()
        from ipukit.examples.mnist import ConvLayer

        self.layer1 = ConvLayer(1, 10, 5, 2)
        self.layer2 = ConvLayer(10, 20, 5, 2)
        self.layer3 = torch.nn.Linear(320, 256)
        self.layer4 = torch.nn.Linear(256, 10)
        self.correct = 0
        self.total = 0

    def forward(self, x):
        with poptorch.Block("B1", ipu_id=0):
            x = self.layer1(x)
        with poptorch.Block("B2", ipu_id=1):
            x = self.layer2(x)
        with poptorch.Block("B3", ipu_id=2):
            x = torch.relu(self.layer3(x.view(-1, 320)))
        with poptorch.Block("B4", ipu_id=3):
            x = self.layer4(x)
        return x

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def test_step(self, batch, batch_idx):
        x, y = batch
        return (self(x).argmax(-1) == y).sum()

    def on_test_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        self.correct += int(outputs.sum())
        self.total += len(batch[1])

    def configure_optimizers(self):
        return poptorch.optim.AdamW(self.parameters(), lr=0.001)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("IPUKIT_SLOW") != "1", reason="full epochs: set IPUKIT_SLOW=1")
def test_lightning_mnist_reaches_the_tutorials_bar(data_root):
    from ipukit.datasets import mnist_tensors

    torch.manual_seed(0)
    train = torch.utils.data.DataLoader(mnist_tensors(True, data_root), batch_size=40, shuffle=True)
    test = torch.utils.data.DataLoader(mnist_tensors(False, data_root), batch_size=8)
    start = time.perf_counter()
    lm = LitMNIST()
    t = trainer(accelerator="ipu", max_epochs=2, accumulate_grad_batches=10,
                strategy=IPUStrategy(device_iterations=10))
    t.fit(lm, train)
    t2 = trainer(accelerator="ipu", strategy=IPUStrategy(device_iterations=100))
    t2.test(lm, test)
    accuracy = 100.0 * lm.correct / lm.total
    print(f"Lightning MNIST, 2 epochs: test accuracy {accuracy:.2f}% on {lm.total} images in "
          f"{time.perf_counter() - start:.1f} s")
    assert t.global_step == 2 * (60000 // 4000)   # one step per call of 10 optimiser steps
    assert 97.5 < accuracy < 99.9
