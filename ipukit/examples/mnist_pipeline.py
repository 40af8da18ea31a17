"""Train and test the pipelining tutorial's MNIST network with ipukit (``ipukit-mnist``).

The PopTorch pipelining tutorial's training script: the four-block network
(:mod:`ipukit.examples.mnist`) on four virtual IPUs, trained with AdamW through a pipelined
(or sharded) training model, then tested by an inference model built from a clone of the
training options (gradient accumulation 1, ``deviceIterations × gradientAccumulation``
device iterations). Run ``python -m ipukit.examples.mnist_pipeline --help``; the last line
printed is ``Accuracy on test set: XX.XX%``.

Differences from the tutorial: both strategies accumulate gradients, so ``--strategy``
changes only the timing; MNIST is decoded once into tensors
(:func:`ipukit.datasets.mnist_tensors`); the inference model returns every prediction.
``--model vit`` trains :mod:`ipukit.examples.vit` configured by an optimum-graphcore
``ipu_config.json`` (``--ipu-config PATH``), whose batching, placement and offload settings
replace the matching flags; the IPU-only settings it holds are printed as ignored.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import traceback
from typing import List, Optional, Sequence

import torch
from ..core.errors import needs_extra

with needs_extra("examples", "ipukit.examples.mnist_pipeline"):
    from tqdm.auto import tqdm

import ipukit
from ipukit.datasets import DATA_ENV, DEFAULT_ROOT, mnist_tensors
from ipukit.examples.mnist import Network, TrainingModelWithLoss, accuracy, strategy
from ipukit.ipuconfig.config import IPUConfig

PROG = "ipukit-mnist"
OUTPUT_MODES = {"all": ipukit.OutputMode.All, "final": ipukit.OutputMode.Final,
                "sum": ipukit.OutputMode.Sum, "default": ipukit.OutputMode.Default}


class UsageError(Exception):
    """Flags that are individually valid but make the run impossible (e.g. no full batch)."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag on one line instead of usage + error."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The tutorial's flags, plus ipukit's (output mode, schedule, data root, quick-run limits)."""
    p = _Parser(prog=PROG, description="Train the pipelining tutorial's MNIST network on "
                "ipukit's virtual IPUs, then report its test accuracy.")
    add = p.add_argument
    add("--model", choices=["convnet", "vit"], default="convnet",
        help="the tutorial's convnet, or a small Vision Transformer (default: convnet)")
    add("--ipu-config", metavar="PATH", default=None,
        help="an optimum-graphcore ipu_config.json (file or folder); default for --model vit: "
             "the one beside ipukit/examples/vit.py")
    add("--vit-layers", type=int, default=8,
        help="ViT encoder layers when layers_per_ipu has -1 wildcards (default: 8)")
    add("--batch-size", type=int, default=None,
        help="training micro-batch size (default: 40, or 16 for --model vit)")
    add("--device-iterations", type=int, default=10,
        help="optimiser steps per training call (default: 10)")
    add("--gradient-accumulation", type=int, default=10,
        help="micro-batches per optimiser step (default: 10)")
    add("--test-batch-size", type=int, default=8, help="test micro-batch size (default: 8)")
    add("--epochs", type=int, default=3, help="training epochs (default: 3)")
    add("--learning-rate", type=float, default=None,
        help="AdamW learning rate (default: 0.001; for --model vit the peak of the one-cycle "
             "schedule, 0.002)")
    add("--lr-schedule", choices=["constant", "onecycle"], default=None,
        help="learning rate per call: constant, or one cycle (warm up over the first 10%% of "
             "the calls, then anneal to near 0) (default: constant; onecycle for --model vit)")
    add("--profile", action="store_true",
        help="write a Chrome trace and an HTML report of every call to --profile-dir")
    add("--profile-dir", default="./profile", help="profile folder (default: ./profile)")
    add("--strategy", choices=["pipelined", "sharded"], default="pipelined",
        help="execution strategy over the 4 virtual IPUs (default: pipelined)")
    add("--offload-optimiser", action="store_true",
        help="keep AdamW's state in host memory between steps")
    add("--debug", action="store_true", help="debug logging, and full tracebacks on errors")
    add("--output-mode", choices=list(OUTPUT_MODES), default="all",
        help="what a training call returns (default: all micro-batches)")
    add("--schedule", choices=["1f1b", "gpipe"], default="1f1b",
        help="pipelined training schedule (default: 1f1b)")
    add("--data", metavar="DIR", default=None,
        help=f"data root holding MNIST/raw (default: ${DATA_ENV}, else {DEFAULT_ROOT})")
    add("--limit-train", type=int, metavar="N", default=None,
        help="use only the first N training samples (quick runs)")
    add("--limit-test", type=int, metavar="N", default=None,
        help="use only the first N test samples (quick runs)")
    add("--num-workers", type=int, default=0,
        help="DataLoader worker processes (default: 0; the data is already in memory)")
    add("--seed", type=int, default=0, help="random seed (default: 0)")
    return p.parse_args(argv)


def load_ipu_config(args: argparse.Namespace) -> Optional[IPUConfig]:
    """The --ipu-config file (the packaged one for --model vit), or None; prints what it ignores."""
    path = args.ipu_config
    if path is None and args.model == "vit":
        from ipukit.examples.vit import CONFIG_PATH
        path = CONFIG_PATH
    if path is None:
        return None
    config = IPUConfig.from_pretrained(path)
    print(f"IPU config: {path}", flush=True)
    for note in config.legacy_notes:
        print(f"  older file: {note}")
    ignored = config.ignored_settings()
    for key, value in config.ignored_settings(for_inference=True).items():
        twin = key[len("inference_"):] if key.startswith("inference_") else key
        if key not in ignored and ignored.get(twin, object()) != value:
            ignored[key] = value
    print("  ignored (IPU-only, no effect in ipukit): "
          + (", ".join(f"{k}={v}" for k, v in ignored.items()) or "none"), flush=True)
    return config


def training_options(args: argparse.Namespace,
                     ipu_config: Optional[IPUConfig] = None) -> ipukit.Options:
    """Options of the training model (and its DataLoader): strategy, batching, extras."""
    sharded = args.strategy == "sharded"
    if ipu_config is not None:
        opts = ipu_config.to_options()
        args.device_iterations = opts.device_iterations
        args.gradient_accumulation = opts.Training.gradient_accumulation
        args.output_mode = opts.output_mode.name.lower()
        args.offload_optimiser = args.offload_optimiser or ipu_config.optimizer_state_offchip
        if args.model == "vit":
            if sharded:
                opts.setExecutionStrategy(ipukit.ShardedExecution(ipukit.AutoStage.AutoIncrement))
        else:
            opts.setExecutionStrategy(strategy(sharded=sharded))
    else:
        opts = ipukit.Options().deviceIterations(args.device_iterations)
        opts.Training.gradientAccumulation(args.gradient_accumulation)
        opts.setExecutionStrategy(strategy(sharded=sharded))
        opts.outputMode(OUTPUT_MODES[args.output_mode])
    opts.pipelineSchedule(args.schedule)
    if args.offload_optimiser:
        on_chip = ipukit.TensorLocationSettings().useOnChipStorage(True)
        opts.TensorLocations.setActivationLocation(on_chip)
        opts.TensorLocations.setWeightLocation(on_chip)
        opts.TensorLocations.setAccumulatorLocation(on_chip)
        opts.TensorLocations.setOptimizerLocation(
            ipukit.TensorLocationSettings().useOnChipStorage(False))
    if args.profile:
        if importlib.util.find_spec("ipukit.viz.profile") is None:
            raise UsageError("--profile needs ipukit.viz.profile (the trace and report writer), "
                             "which this ipukit installation does not have.")
        opts.profileDir(args.profile_dir)
    return opts


def inference_options(train_opts: ipukit.Options, args: argparse.Namespace,
                      ipu_config: Optional[IPUConfig] = None) -> ipukit.Options:
    """The training options with the accumulation window turned into device iterations
    (for --model vit: the IPU config's inference options)."""
    if ipu_config is not None and args.model == "vit":
        return ipu_config.to_options(for_inference=True)
    opts = train_opts.clone()
    opts.Training.gradientAccumulation(1)
    opts.deviceIterations(args.device_iterations * args.gradient_accumulation)
    opts.outputMode(ipukit.OutputMode.All)
    return opts


def data_loaders(args: argparse.Namespace, train_opts: ipukit.Options,
                 test_opts: Optional[ipukit.Options] = None):
    """Training and test DataLoaders whose batches are exactly one model call each."""
    train_set = mnist_tensors(train=True, root=args.data, limit=args.limit_train)
    test_set = mnist_tensors(train=False, root=args.data, limit=args.limit_test)
    train = ipukit.DataLoader(train_opts, train_set, batch_size=args.batch_size, shuffle=True,
                              num_workers=args.num_workers, mode=ipukit.DataLoaderMode.Async)
    if test_opts is None:
        test_opts = ipukit.Options().deviceIterations(
            args.device_iterations * args.gradient_accumulation)
    test = ipukit.DataLoader(test_opts, test_set, batch_size=args.test_batch_size,
                             drop_last=True, num_workers=args.num_workers,
                             mode=ipukit.DataLoaderMode.Async)
    _check_not_empty(train, len(train_set), "--limit-train")
    _check_not_empty(test, len(test_set), "--limit-test")
    return train, test


def _check_not_empty(loader: ipukit.DataLoader, samples: int, flag: str) -> None:
    """A loader with no full batch would train or test nothing: say which flag to change."""
    if len(loader) == 0:
        raise UsageError(
            f"{samples} samples make no full batch: one call needs {loader.combinedBatchSize} "
            f"(micro-batch {loader.micro_batch_size} x {loader.combinedBatchSize // loader.micro_batch_size} "
            f"micro-batches). Raise {flag} or lower the batch size, device iterations or "
            "gradient accumulation.")


def first_batch(loader: ipukit.DataLoader) -> List[torch.Tensor]:
    """One call's worth of samples, read straight from the dataset (no loader threads)."""
    dataset = loader.dataset
    return torch.utils.data.default_collate(
        [dataset[i] for i in range(loader.combinedBatchSize)])


def _loss_value(losses: torch.Tensor, args: argparse.Namespace) -> float:
    """Mean loss per micro-batch, whatever the output mode returned."""
    if args.output_mode == "sum":
        return losses.item() / (args.device_iterations * args.gradient_accumulation)
    return torch.mean(losses).item()


def train(model: ipukit.PoplarExecutor, loader: ipukit.DataLoader,
          args: argparse.Namespace, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """The training loop: one model call per batch (with ``--lr-schedule onecycle`` the learning
    rate changes after every call and the model is given the optimiser again).
    """
    scheduler = None
    if args.lr_schedule == "onecycle" and optimizer is not None:
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=args.learning_rate, total_steps=args.epochs * len(loader),
            pct_start=0.1)
    for epoch in range(1, args.epochs + 1):
        print(f"Epoch {epoch}/{args.epochs}", flush=True)
        with tqdm(loader, total=len(loader), unit="call") as bar:
            for data, labels in bar:
                predictions, losses = model(data, labels)
                postfix = {"loss": f"{_loss_value(losses, args):.4f}"}
                if args.output_mode != "sum":  # summed logits have no per-sample labels
                    postfix["accuracy"] = f"{accuracy(predictions, labels):.2f}%"
                bar.set_postfix(postfix)
                if scheduler is not None:
                    scheduler.step()
                    model.setOptimizer(optimizer)


def test(model: ipukit.PoplarExecutor, loader: ipukit.DataLoader) -> float:
    """Mean accuracy over the test batches (every batch has the same size: drop_last)."""
    total = 0.0
    with tqdm(loader, total=len(loader), unit="call") as bar:
        # count calls here: tqdm updates bar.n lazily, so it lags behind the loop
        for calls, (data, labels) in enumerate(bar, start=1):
            total += accuracy(model(data), labels)
            bar.set_postfix(accuracy=f"{total / calls:.2f}%")
    return total / len(loader)


def run(args: argparse.Namespace) -> float:
    """Build everything, train, test; returns the test accuracy in percent."""
    torch.manual_seed(args.seed)
    if args.debug:
        ipukit.setLogLevel(1)
    vit = args.model == "vit"
    if args.batch_size is None:
        args.batch_size = 16 if vit else 40
    if args.lr_schedule is None:
        args.lr_schedule = "onecycle" if vit else "constant"
    if args.learning_rate is None:
        args.learning_rate = 0.002 if vit else 0.001
    ipu_config = load_ipu_config(args)
    train_opts = training_options(args, ipu_config)
    test_opts = inference_options(train_opts, args, ipu_config)
    train_loader, test_loader = data_loaders(args, train_opts, test_opts)
    if args.model == "vit":
        from ipukit.examples.vit import ViT, num_layers_for

        network = ViT(num_layers=num_layers_for(ipu_config, default=args.vit_layers))
        network.parallelize(ipu_config.train())
        print(f"ViT: {len(network.layers)} encoder layers on IPUs {network.layer_ipus()}",
              flush=True)
        trained = network
    else:
        network = Network()
        trained = TrainingModelWithLoss(network)
    optimizer = ipukit.optim.AdamW(network.parameters(), lr=args.learning_rate)
    training_model = ipukit.trainingModel(trained, train_opts, optimizer)
    if args.profile:
        print(f"Profiling is enabled: writing to {args.profile_dir}")
    print("Compiling...", flush=True)
    training_model.compile(*first_batch(train_loader))
    print("Training...", flush=True)
    train(training_model, train_loader, args, optimizer)
    training_model.detachFromDevice()
    if args.model == "vit":  # placed again by the inference twins (inference_layers_per_ipu)
        network.parallelize(ipu_config.eval())
    inference_model = ipukit.inferenceModel(network, test_opts)
    inference_model.compile(first_batch(test_loader)[0])
    print("Testing...", flush=True)
    result = test(inference_model, test_loader)
    inference_model.detachFromDevice()
    return result


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point: 0 on success, 1 on a configuration or data error, 130 on Ctrl-C."""
    args = parse_args(argv)
    try:
        result = run(args)
    except (ipukit.Error, UsageError) as exc:
        if args.debug:
            traceback.print_exc()
        print(f"{PROG}: error: {_one_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    print(f"Accuracy on test set: {result:0.2f}%", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
