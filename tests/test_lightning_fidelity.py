"""lightning-graphcore's behaviour at the Lightning front door (``ipukit.lightning``).

Each test follows lightning-graphcore's own (``strategy.py``, ``accelerator.py``,
``precision.py`` and their tests): ``poptorch_models``, ``replication_factor``,
``auto_device_count``, the ``"16-mixed"`` input cast, one trainer step per call, setup errors
that are ``MisconfigurationException`` s, and process-wide registrations that stay single.
"""
import copy
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

pl = pytest.importorskip("pytorch_lightning")

import ipukit as poptorch  # noqa: E402
from ipukit.lightning import IPUAccelerator, IPUPrecision, IPUStrategy  # noqa: E402
from lightning_fabric.utilities.exceptions import \
    MisconfigurationException as FabricMisconfiguration  # noqa: E402
from pytorch_lightning.accelerators import AcceleratorRegistry  # noqa: E402
from pytorch_lightning.strategies import StrategyRegistry  # noqa: E402
from pytorch_lightning.trainer.states import RunningStage  # noqa: E402
from pytorch_lightning.utilities.exceptions import MisconfigurationException  # noqa: E402

logging.getLogger("pytorch_lightning").setLevel(logging.WARNING)
logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")]


def trainer(**kwargs):
    quiet = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                 enable_model_summary=False, num_sanity_val_steps=0, devices=1)
    quiet.update(kwargs)
    return pl.Trainer(**quiet)


def data(n=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, 4, generator=g),
                                          torch.randint(0, 3, (n,), generator=g))


def loader(n=32, batch_size=2, seed=1):
    return torch.utils.data.DataLoader(data(n, seed), batch_size=batch_size)


class Small(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(4, 8)
        self.l2 = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return (self(x).argmax(-1) == y).float().sum()

    def test_step(self, batch, batch_idx):
        return self.validation_step(batch, batch_idx)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def weights(module):
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


# ----------------------------------------------------------------------------- poptorch_models
def test_poptorch_models_holds_each_stages_ipukit_model():
    """lightning-graphcore's dict: built at setup, keyed by RunningStage (fit: training,
    validation and the sanity check's model, which is validation's); one stage per
    validate/test/predict run."""
    seen = {}

    class Look(pl.Callback):
        def on_train_start(self, t, module):
            models = t.strategy.poptorch_models
            seen["keys"] = list(models)
            seen["compiled"] = models[RunningStage.TRAINING].isCompiled()
            seen["device_iterations"] = \
                models[RunningStage.TRAINING].options.toDict()["device_iterations"]

        def on_train_end(self, t, module):
            seen["ran"] = t.strategy.poptorch_models["train"].isCompiled()

    strategy = IPUStrategy(device_iterations=2)
    assert strategy.poptorch_models == {}
    t = trainer(accelerator="ipu", max_epochs=1, num_sanity_val_steps=1, strategy=strategy,
                callbacks=[Look()])
    t.fit(Small(), loader(16), loader(8))
    # there before the first training batch (which compiles it), as in lightning-graphcore
    assert seen == {"keys": [RunningStage.TRAINING, RunningStage.VALIDATING,
                             RunningStage.SANITY_CHECKING],
                    "compiled": False, "device_iterations": 2, "ran": True}
    models = t.strategy.poptorch_models
    train, val = models[RunningStage.TRAINING], models[RunningStage.VALIDATING]
    assert isinstance(train, poptorch.PoplarExecutor) and train.training
    assert isinstance(val, poptorch.PoplarExecutor) and not val.training
    assert models["train"] is train and models["validate"] is val          # string keys too
    assert models[RunningStage.SANITY_CHECKING] is val
    assert train.optimizer is t.optimizers[0]
    assert t.strategy.model_for("train") is train    # the model that ran (destroyed at teardown)

    lm = Small()
    for run, stage in ((t.validate, RunningStage.VALIDATING), (t.test, RunningStage.TESTING),
                       (t.predict, RunningStage.PREDICTING)):
        run(lm, loader(8))
        assert list(t.strategy.poptorch_models) == [stage]
        model = t.strategy.poptorch_models[stage]
        assert model.isCompiled() and model is t.strategy.model_for(stage.value)


def test_fit_without_validation_has_only_the_training_model():
    t = trainer(accelerator="ipu", max_steps=1)
    t.fit(Small(), loader(8))
    assert list(t.strategy.poptorch_models) == [RunningStage.TRAINING]


# ----------------------------------------------------------------------------- replication
def test_replication_factor_is_devices():
    strategy = IPUStrategy()
    t = trainer(accelerator=IPUAccelerator(), devices=2, strategy=strategy)
    assert isinstance(t.accelerator, IPUAccelerator) and t.num_devices == 2
    assert t.strategy.replication_factor == 2
    assert trainer(accelerator="ipu", devices=3).strategy.replication_factor == 3


def test_replication_factor_follows_the_users_options_per_stage():
    """lightning-graphcore: replicationFactor(8) for training, 7 for inference, devices=1."""
    training_opts = poptorch.Options().replicationFactor(8)
    inference_opts = poptorch.Options().replicationFactor(7)
    strategy = IPUStrategy(training_opts=training_opts, inference_opts=inference_opts)
    assert strategy.replication_factor == 8            # before meeting a Trainer
    seen = []

    class Look(pl.Callback):
        def on_train_batch_start(self, t, module, batch, batch_idx):
            seen.append(("train", t.strategy.replication_factor, len(batch[0])))

        def on_validation_batch_start(self, t, module, batch, batch_idx, dataloader_idx=0):
            seen.append(("validate", t.strategy.replication_factor, len(batch[0])))

    t = trainer(accelerator="ipu", max_epochs=1, strategy=strategy, callbacks=[Look()])
    assert t.strategy.replication_factor == 8
    t.fit(Small(), loader(16), loader(14))
    assert seen == [("train", 8, 16), ("validate", 7, 14)]
    assert t.strategy.poptorch_models["train"].options.replication_factor == 8
    assert t.strategy.poptorch_models["validate"].options.replication_factor == 7
    # devices="auto" (4) leaves the options' factor as it is, as in lightning-graphcore
    auto = trainer(accelerator="ipu", devices="auto",
                   strategy=IPUStrategy(training_opts=poptorch.Options().replicationFactor(2)))
    assert auto.strategy.replication_factor == 2


def test_auto_device_count_is_four():
    assert IPUAccelerator.auto_device_count() == 4
    t = trainer(accelerator="ipu", devices="auto")
    assert t.num_devices == 4 and t.strategy.replication_factor == 4
    assert trainer(accelerator="ipu", devices=-1).strategy.replication_factor == 4


# ----------------------------------------------------------------------------- precision
def test_16_mixed_batch_to_device_casts_floats_to_half():
    t = trainer(accelerator="ipu", precision="16-mixed")
    assert isinstance(t.strategy.precision_plugin, IPUPrecision)
    assert t.strategy.precision_plugin.precision == "16-mixed"
    changed = [torch.zeros(1, dtype=d) for d in (torch.float32, torch.float64)]
    assert all(v.dtype is torch.float16 for v in t.strategy.batch_to_device(changed))
    kept = (torch.uint8, torch.int8, torch.int32, torch.int64)
    out = t.strategy.batch_to_device({"x": [torch.zeros(1, dtype=d) for d in kept]})
    assert [v.dtype for v in out["x"]] == list(kept)
    x = torch.randn(5, dtype=torch.float64)
    assert torch.equal(t.strategy.batch_to_device(x), x.half())
    # 32-true leaves the batch as it is
    plain = trainer(accelerator="ipu").strategy.batch_to_device([x])
    assert plain[0].dtype == torch.float64


# ----------------------------------------------------------------------------- max_steps
def test_max_steps_counts_calls_as_lightning_graphcore():
    """max_steps=1 with device_iterations=2: one call, two optimiser steps (one per
    micro-batch, as eager PyTorch would make them), global_step 1."""
    torch.manual_seed(0)
    lm = Small()
    eager = copy.deepcopy(lm)
    ds = data(16)
    t = trainer(accelerator="ipu", max_steps=1, strategy=IPUStrategy(device_iterations=2))
    t.fit(lm, torch.utils.data.DataLoader(ds, batch_size=2))
    assert t.global_step == 1
    assert t.fit_loop.epoch_loop.batch_progress.total.completed == 1

    optimizer = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    x, y = ds.tensors
    for i in range(2):                     # the call's two micro-batches of 2
        optimizer.zero_grad()
        F.cross_entropy(eager(x[2 * i:2 * i + 2]), y[2 * i:2 * i + 2]).backward()
        optimizer.step()
    mine, theirs = weights(lm), weights(eager)
    diff = max((mine[k] - theirs[k]).abs().max().item() for k in mine)
    assert diff <= 1e-6, diff


def test_a_scheduler_sized_by_estimated_stepping_batches_runs_to_its_end():
    """Why a step is a call: ported code sizes schedulers in Lightning steps
    (OneCycleLR(total_steps=trainer.estimated_stepping_batches)); with device iterations
    and accumulation, that count is the number of calls, and the scheduler steps once a call."""
    totals = []

    class OneCycle(Small):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            total = self.trainer.estimated_stepping_batches
            totals.append(total)
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=total)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    t = trainer(accelerator="ipu", max_epochs=2, accumulate_grad_batches=2,
                strategy=IPUStrategy(device_iterations=2))
    t.fit(OneCycle(), loader(48))              # 48 / (2 × 2 × 2) = 6 calls an epoch
    assert totals == [12] and t.global_step == 12
    assert t.lr_scheduler_configs[0].scheduler.last_epoch == 12
    assert t.accumulate_grad_batches == 2


# ----------------------------------------------------------------------------- setup errors
def passthrough(self, batch, *args):
    return batch


@pytest.mark.parametrize("hook", ["transfer_batch_to_device", "on_after_batch_transfer"])
@pytest.mark.parametrize("where", ["module", "datamodule"])
def test_overriding_batch_transfer_hooks_is_a_misconfiguration(hook, where):
    lm = Small() if where == "datamodule" else type("Overrides", (Small,), {hook: passthrough})()
    before = weights(lm)
    kwargs = {"train_dataloaders": loader(8)}
    if where == "datamodule":
        dm = type("DM", (pl.LightningDataModule,),
                  {hook: passthrough, "train_dataloader": lambda self: loader(8)})()
        kwargs = {"datamodule": dm}
    with pytest.raises(MisconfigurationException,
                       match=rf"^Overriding `{hook}` is not .* with IPUs") as info:
        trainer(accelerator="ipu", max_epochs=1).fit(lm, **kwargs)
    assert isinstance(info.value, poptorch.Error)
    assert isinstance(info.value, FabricMisconfiguration)
    assert all(torch.equal(before[k], v) for k, v in weights(lm).items())


@pytest.mark.parametrize("precision", ["bf16-mixed", "64-true"])
def test_unsupported_precision_is_a_misconfiguration(precision):
    pattern = rf"^`Trainer\(accelerator='ipu', precision='{precision}'\)` is not supported"
    with pytest.raises(ValueError, match=pattern) as info:
        trainer(accelerator="ipu", precision=precision)
    assert isinstance(info.value, MisconfigurationException)
    assert isinstance(info.value, poptorch.Error)


# ----------------------------------------------------------------------------- registrations
def _registrations():
    from pytorch_lightning.trainer.connectors import accelerator_connector

    return (dict(AcceleratorRegistry), {k: dict(v) for k, v in AcceleratorRegistry.items()},
            {k: dict(v) for k, v in StrategyRegistry.items()},
            accelerator_connector._AcceleratorConnector._choose_strategy)


def test_a_failed_trainer_leaves_the_registries_as_they_were():
    before = _registrations()
    with pytest.raises(poptorch.Error):
        trainer(accelerator="ipu", precision="bf16-mixed")
    with pytest.raises(poptorch.Error):
        trainer(accelerator="ipu", devices=-2)
    with pytest.raises(MisconfigurationException):
        trainer(accelerator="ipu", max_epochs=1).fit(
            type("Overrides", (Small,), {"on_after_batch_transfer": passthrough})(), loader(8))
    assert _registrations() == before
    assert isinstance(trainer(accelerator="ipu").strategy, IPUStrategy)


def test_importing_again_or_reloading_wraps_the_strategy_choice_once():
    """In a fresh process (a reload makes new classes, which would leak into other tests)."""
    script = textwrap.dedent("""
        import importlib
        import pytorch_lightning as pl
        from pytorch_lightning.accelerators import AcceleratorRegistry
        from pytorch_lightning.strategies import StrategyRegistry
        from pytorch_lightning.trainer.connectors.accelerator_connector import \\
            _AcceleratorConnector as C
        lightning_original = C._choose_strategy
        import ipukit.lightning
        import ipukit.lightning.strategy as s
        first = C._choose_strategy
        assert first._ipukit_original is lightning_original
        import ipukit.lightning  # noqa: F811 - a second import changes nothing
        assert C._choose_strategy is first
        for _ in range(2):
            importlib.reload(s)
            importlib.reload(ipukit.lightning)
        assert C._choose_strategy is not first
        assert C._choose_strategy._ipukit_original is lightning_original
        assert not hasattr(lightning_original, "_ipukit_original")
        assert AcceleratorRegistry["ipu"]["accelerator"] is s.IPUAccelerator
        assert StrategyRegistry["ipu_strategy"]["strategy"] is s.IPUStrategy
        assert list(AcceleratorRegistry).count("ipu") == 1
        t = pl.Trainer(accelerator="ipu", devices=1, logger=False)
        assert type(t.strategy) is s.IPUStrategy is ipukit.lightning.IPUStrategy
        t = pl.Trainer(accelerator="cpu", devices=1, logger=False)
        assert isinstance(t.strategy, pl.strategies.SingleDeviceStrategy)
        print("ok")
    """)
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
