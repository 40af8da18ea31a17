"""A training script that runs as processes or on threads, unchanged: the tutorial's MNIST network.

    ipukit-run -n 2 -m ipukit.examples.distributed --out result.pkl     # 2 stages, 2 processes
    python -m ipukit.examples.distributed --out result.pkl              # the same on threads

The four blocks of :class:`ipukit.examples.mnist.Network` are split over two virtual IPUs
(``--split 0,0,1,1``), trained with AdamW under 1F1B, then tested. Nothing in the script says
"processes": under ``ipukit-run`` the options read torchrun's ``RANK`` and ``WORLD_SIZE``.
The data is read in one fixed order, so processes and threads must end with the same
weights. Process 0 writes ``--out``, a pickle of :func:`train`'s result (weights, losses,
test accuracy, the last call's timeline, wall times).
"""
from __future__ import annotations

import argparse
import pickle
import sys
import time
from typing import Any, Dict, Optional, Sequence

import torch

import ipukit
import ipukit.distributed as ipd
from ipukit.datasets import mnist_tensors
from ipukit.examples.mnist import Network, TrainingModelWithLoss, accuracy, strategy


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ipukit.examples.distributed",
                                description="Train the tutorial's MNIST network, as processes "
                                "under ipukit-run or on threads.")
    add = p.add_argument
    add("--out", default=None, help="where process 0 writes the results (a pickle)")
    add("--data", default=None, help="data root holding MNIST/raw (default: $IPUKIT_DATA)")
    add("--split", default="0,0,1,1", help="virtual IPU of blocks B1-B4 (default: 0,0,1,1)")
    add("--epochs", type=int, default=1)
    add("--batch-size", type=int, default=32, help="micro-batch size (default: 32)")
    add("--device-iterations", type=int, default=4)
    add("--gradient-accumulation", type=int, default=4)
    add("--limit-train", type=int, default=None, help="first N training samples only")
    add("--limit-test", type=int, default=None, help="first N test samples only")
    add("--device", default="cpu", help="where the stages run (default: cpu)")
    add("--seed", type=int, default=0)
    return p.parse_args(argv)


def training_options(args: argparse.Namespace) -> ipukit.Options:
    opts = ipukit.Options().deviceIterations(args.device_iterations).randomSeed(args.seed)
    opts.Training.gradientAccumulation(args.gradient_accumulation)
    opts.setExecutionStrategy(strategy([int(i) for i in args.split.split(",")]))
    opts.outputMode(ipukit.OutputMode.All)
    opts.deviceMapping([args.device])
    return opts


def train(args: argparse.Namespace) -> Dict[str, Any]:
    """Train and test; every process returns the same result (the whole model's weights)."""
    started = time.perf_counter()
    torch.manual_seed(args.seed)
    train_set = mnist_tensors(train=True, root=args.data, limit=args.limit_train)
    order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(args.seed))
    train_set = torch.utils.data.Subset(train_set, order.tolist())
    opts = training_options(args)
    loader = ipukit.DataLoader(opts, train_set, batch_size=args.batch_size, shuffle=False)
    network = Network()
    model = ipukit.trainingModel(TrainingModelWithLoss(network), opts,
                                 optimizer=ipukit.optim.AdamW(network.parameters(), lr=0.001))
    losses = []
    t_train = time.perf_counter()
    for _ in range(args.epochs):
        for images, labels in loader:
            _, loss = model(images, labels)
            losses.append(loss.mean().item())
    t_train = time.perf_counter() - t_train
    timeline = model.getTimeline()
    model.copyWeightsToHost()  # with processes: every process gets every stage's weights
    model.destroy()
    test_opts = opts.clone()
    test_opts.Training.gradientAccumulation(1)
    test_opts.deviceIterations(args.device_iterations * args.gradient_accumulation)
    test_set = mnist_tensors(train=False, root=args.data, limit=args.limit_test)
    tester = ipukit.inferenceModel(network, test_opts)
    correct = [accuracy(tester(images), labels)
               for images, labels in ipukit.DataLoader(test_opts, test_set,
                                                       batch_size=args.batch_size)]
    tester.destroy()
    return {"processes": opts.Distributed.numProcesses, "losses": losses,
            "accuracy": sum(correct) / len(correct), "timeline": timeline,
            "state": {k: v.detach().cpu().clone() for k, v in network.state_dict().items()},
            "train_seconds": t_train, "seconds": time.perf_counter() - started}


def load(path: str) -> Dict[str, Any]:
    """A result written by ``--out``."""
    with open(path, "rb") as f:
        return pickle.load(f)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    result = train(args)
    if ipd.getProcessIndex() == 0:
        print(f"{result['processes']} process(es): {len(result['losses'])} training calls in "
              f"{result['train_seconds']:.1f} s, loss {result['losses'][0]:.3f} → "
              f"{result['losses'][-1]:.3f}, test accuracy {result['accuracy']:.2f}%", flush=True)
        if args.out:
            with open(args.out, "wb") as f:
                pickle.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
