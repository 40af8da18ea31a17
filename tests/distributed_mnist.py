"""The seed tutorial's MNIST model, 4 stages as 4 processes, one epoch (run by ipukit-run).

Used by tests/test_distributed.py's slow test: ``ipukit-run --nproc 4 tests/distributed_mnist.py
DATA_ROOT OUT.json``. Process 0 writes the test accuracy and wall times.
"""
import json
import os
import sys
import time

import torch

import ipukit as poptorch
import ipukit.distributed as ipd
from ipukit.datasets import mnist
from ipukit.examples.mnist import Network, TrainingModelWithLoss, accuracy


def main(data_root, out_path, train_limit=None):
    start = time.perf_counter()
    torch.manual_seed(0)
    train_set, test_set = mnist(True, data_root), mnist(False, data_root)
    if train_limit:
        train_set = torch.utils.data.Subset(train_set, range(train_limit))
    opts = poptorch.Options().deviceIterations(10).randomSeed(0)
    opts.Training.gradientAccumulation(10)
    opts.setExecutionStrategy(poptorch.PipelinedExecution(
        *[poptorch.Stage(b).ipu(i) for i, b in enumerate(("B1", "B2", "B3", "B4"))]))
    opts.outputMode(poptorch.OutputMode.All)
    train_data = poptorch.DataLoader(opts, train_set, batch_size=40, shuffle=True)
    model = Network()
    training_model = ipd.trainingModel(
        TrainingModelWithLoss(model), opts,
        optimizer=poptorch.optim.AdamW(model.parameters(), lr=0.001))
    train_acc = []
    t_train = time.perf_counter()
    for data, labels in train_data:
        preds, losses = training_model(data, labels)
        train_acc.append(accuracy(preds, labels))
    t_train = time.perf_counter() - t_train
    timeline = training_model.getTimeline()
    inf = opts.clone()
    inf.Training.gradientAccumulation(1)
    inf.deviceIterations(100)
    test_data = poptorch.DataLoader(inf, test_set, batch_size=8)
    inference_model = ipd.inferenceModel(model, inf)
    total, n = 0.0, 0
    for data, labels in test_data:
        total += accuracy(inference_model(data), labels)
        n += 1
    if int(os.environ["RANK"]) == 0:
        with open(out_path, "w") as f:
            json.dump({"train_acc_last": train_acc[-1], "test_acc": total / n,
                       "calls": len(train_acc), "train_seconds": t_train,
                       "seconds": time.perf_counter() - start,
                       "utilisation": timeline.utilisation()["overall"],
                       "tracks": sorted({e.ipu for e in timeline.events if e.ipu >= 0})}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else None)
