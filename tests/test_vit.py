"""The ViT example: optimum's parallelize pattern, pipelined training equal to plain PyTorch, the script."""
import os
import time

import pytest
import torch

import ipukit
from helpers import clone_model, max_weight_diff, reference_training
from ipukit.core.blocks import _BlockHook
from ipukit.examples import mnist_pipeline
from ipukit.examples.vit import CONFIG_PATH, ViT, num_layers_for
from ipukit.ipuconfig.config import _Recompute
from ipukit.runtime.executor import default_threads

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "ipu_config")


def _blocks(model):
    return {name: (h.user_id, h.ipu_id) for name, m in model.named_modules()
            for h in m._forward_pre_hooks.values() if isinstance(h, _BlockHook)}


def test_packaged_config():
    config = ipukit.IPUConfig.from_pretrained(CONFIG_PATH)
    assert config.layers_per_ipu == [2, 2, 2, 2] and config.ipus_per_replica == 4
    assert config.gradient_accumulation_steps >= 2 * 4 - 1   # a full 4-stage pipeline
    assert num_layers_for(config) == 8
    assert num_layers_for(ipukit.IPUConfig(layers_per_ipu=[-1], ipus_per_replica=2), 6) == 6


def test_parallelize_places_like_optimum_and_deparallelize_undoes_it():
    model = ViT(num_layers=8, dim=16, heads=2, mlp_dim=32)
    config = ipukit.IPUConfig(layers_per_ipu=[2, 2, 2, 2], recompute_checkpoint_every_layer=True)
    assert model.parallelize(config) is model
    blocks = _blocks(model)
    assert blocks["embeddings"] == ("Embedding", 0)
    assert [blocks[f"layers.{i}"] for i in range(8)] == [
        (f"Encoder{i}", ipu) for i, ipu in enumerate([0, 0, 1, 1, 2, 2, 3, 3])]
    assert blocks["norm"] == ("LayerNorm", 3) and blocks["classifier"] == ("Classifier", 3)
    assert all(isinstance(layer.__dict__.get("forward"), _Recompute) for layer in model.layers)
    model.parallelize(config)                           # again: replaces, no double blocks
    assert len(_blocks(model)) == 11
    assert model.deparallelize() is model
    assert _blocks(model) == {} and model._hooks == []
    assert not any("forward" in layer.__dict__ for layer in model.layers)
    # inference placement follows the config's eval mode
    config = ipukit.IPUConfig(layers_per_ipu=[4, 4], inference_layers_per_ipu=[8],
                              inference_ipus_per_replica=1)
    model.parallelize(config.eval())
    assert set(_blocks(model).values()) == {("Embedding", 0), ("LayerNorm", 0), ("Classifier", 0)} | {
        (f"Encoder{i}", 0) for i in range(8)}
    with pytest.raises(ipukit.IncompatibleIPUConfigError, match="places 12 layers"):
        model.parallelize(ipukit.IPUConfig(layers_per_ipu=[3, 3, 3, 3]))
    with pytest.raises(AttributeError, match="no IPUConfig"):
        ViT(num_layers=1, dim=8, heads=2, mlp_dim=8).parallelize()


def _train_pipelined(config_path, seed, **vit):
    config = ipukit.IPUConfig.from_pretrained(config_path, output_mode="all")
    torch.manual_seed(seed)
    model = ViT(num_layers=num_layers_for(config), **vit)
    reference = clone_model(model)
    model.parallelize(config)
    di, ga = config.device_iterations, config.gradient_accumulation_steps
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2 * di * ga * 2, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (x.shape[0],), generator=g)
    opts = config.to_options()
    training = ipukit.trainingModel(model, opts, optimizer=torch.optim.AdamW(
        model.parameters(), lr=1e-3))
    losses = torch.cat([training(x[:x.shape[0] // 2], y[:x.shape[0] // 2])[1],
                        training(x[x.shape[0] // 2:], y[x.shape[0] // 2:])[1]])
    ref_losses = []
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    # the plain loop with a worker's intra-op threads, as ipukit computes and steps: AdamW
    # turns a last-bit difference in a near-zero gradient (other threads, other summation
    # order) into a step of up to lr
    callers = torch.get_num_threads()
    torch.set_num_threads(default_threads(len({s.ipu for s in training.program.partition.stages})))
    try:
        for half in (slice(0, x.shape[0] // 2), slice(x.shape[0] // 2, None)):
            ref_losses += reference_training(reference, ref_opt, x[half], y[half],
                                             device_iterations=di, gradient_accumulation=ga,
                                             replicas=1)
    finally:
        torch.set_num_threads(callers)
    return model, reference, losses, torch.stack(ref_losses), training


def test_vit_pipelined_over_4_ipus_matches_plain_pytorch():
    model, reference, losses, ref_losses, training = _train_pipelined(
        CONFIG_PATH, seed=3, dim=16, heads=2, mlp_dim=32)
    stages = training.program.partition.stages
    assert [s.ipu for s in stages] == [0, 1, 2, 3]
    tl = training.getTimeline()
    assert {0, 1, 2, 3} <= {e.ipu for e in tl.events}
    assert max_weight_diff(model, reference) < 1e-5
    assert torch.allclose(losses, ref_losses, atol=1e-5)
    assert max_weight_diff(model, ViT(num_layers=8, dim=16, heads=2, mlp_dim=32)) > 1e-3


def test_vit_with_wildcards_and_the_hub_vit_config_matches_plain_pytorch(tmp_path):
    # vit-base's file (12 layers on 4 IPUs, recomputation on, GA 128) on a tiny ViT
    config = ipukit.IPUConfig.from_pretrained(os.path.join(FIXTURES, "vit-base-ipu.json"),
                                              gradient_accumulation_steps=8,
                                              layers_per_ipu=[-1, 3, 3, -1])
    path = config.save_pretrained(tmp_path)
    model, reference, losses, ref_losses, training = _train_pipelined(
        path, seed=4, dim=8, heads=2, mlp_dim=16)
    assert len(model.layers) == 8 and model.layer_ipus() == [0, 1, 1, 1, 2, 2, 2, 3]
    assert [s.ipu for s in training.program.partition.stages] == [0, 1, 2, 3]
    assert max_weight_diff(model, reference) < 1e-5
    assert torch.allclose(losses, ref_losses, atol=1e-5)


@pytest.mark.parametrize("schedule", ["1F1B", "ZBH1"])
def test_recompute_every_layer_really_recomputes_each_traced_stage(schedule):
    """vit-base's file asks for recomputation: each traced stage keeps only its inputs and
    runs its forward again in its backward (a pre-hook sees two passes per micro-batch),
    with the weights of the run that keeps every activation."""
    weights, passes = {}, {}
    for recompute in (False, True):
        config = ipukit.IPUConfig(ipus_per_replica=2, layers_per_ipu=[2, 2],
                                  gradient_accumulation_steps=4,
                                  recompute_checkpoint_every_layer=recompute)
        torch.manual_seed(0)
        model = ViT(num_layers=4, dim=16, heads=2, mlp_dim=32).parallelize(config)
        opts = config.to_options().pipelineSchedule(schedule)
        training = ipukit.trainingModel(model, opts, optimizer=torch.optim.SGD(
            model.parameters(), lr=0.05))
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(16, 1, 28, 28, generator=g), torch.randint(0, 10, (16,), generator=g)
        training(x, y)
        stages = training.program.partition.stages
        assert [s.recompute for s in stages] == [recompute] * 2
        calls = []
        for stage in stages:
            stage.module.register_forward_pre_hook(lambda *_: calls.append(1))
        training(x, y)
        passes[recompute] = len(calls)
        weights[recompute] = [p.detach().clone() for p in model.parameters()]
        training.destroy()
    assert passes == {False: 2 * 4, True: 2 * 2 * 4}
    assert max((a - b).abs().max().item() for a, b in zip(weights[False], weights[True])) < 1e-6


# -- the training script ----------------------------------------------------------------------------
def test_script_with_a_hub_file(data_root, capsys):
    code = mnist_pipeline.main([
        "--model", "vit", "--ipu-config", os.path.join(FIXTURES, "vit-base-ipu.json"),
        "--batch-size", "1", "--test-batch-size", "2", "--limit-train", "128",
        "--limit-test", "16", "--epochs", "1", "--data", data_root])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "ignored (IPU-only, no effect in ipukit): matmul_proportion=0.3" in out
    assert "enable_half_partials=True" in out and "executable_cache_dir=./exe_cache" in out
    assert "ViT: 12 encoder layers on IPUs [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]" in out
    assert "Accuracy on test set:" in out


@pytest.mark.parametrize("name,layers,ipus", [
    ("bert-base-uncased.json", 12, [1] * 4 + [2] * 4 + [3] * 4),
    ("whisper-small-ipu.json", 24, [0, 1, 1] + [2] * 3 + [3] * 3 + [4] * 3 + [6] * 6 + [7] * 6),
])
def test_script_reads_the_other_hub_files(name, layers, ipus, capsys):
    args = mnist_pipeline.parse_args(["--model", "vit", "--ipu-config",
                                      os.path.join(FIXTURES, name)])
    config = mnist_pipeline.load_ipu_config(args)
    opts = mnist_pipeline.training_options(args, config)
    out = capsys.readouterr().out
    assert "ignored (IPU-only, no effect in ipukit):" in out
    if name.startswith("bert"):
        assert "older file: enable_half_first_order_momentum=True" in out
        assert "embedding_serialization_factor=2" in out
        assert (opts.replication_factor, args.gradient_accumulation) == (4, 512)
    else:
        assert "serialized_projection_splits_per_ipu=[0, 0, 0, 0, 0, 4, 0, 0]" in out
    assert args.output_mode == "final" and args.offload_optimiser == (name != "bert-base-uncased.json")
    model = ViT(num_layers=num_layers_for(config), dim=8, heads=2, mlp_dim=8)
    assert model.parallelize(config).layer_ipus() == ipus and len(model.layers) == layers


def test_script_reports_a_bad_config(tmp_path, capsys):
    bad = tmp_path / "ipu_config.json"
    bad.write_text('{"layers_per_ipu": [2, 2], "ipus_per_replica": 3}')
    assert mnist_pipeline.main(["--model", "vit", "--ipu-config", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "ipukit-mnist: error: IPUConfig.layers_per_ipu=[2, 2]" in err


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("IPUKIT_SLOW") != "1", reason="full epochs: set IPUKIT_SLOW=1")
def test_vit_reaches_97_percent_on_mnist(data_root):
    start = time.time()
    args = mnist_pipeline.parse_args(["--model", "vit", "--epochs", "3", "--data", data_root])
    accuracy = mnist_pipeline.run(args)
    print(f"ViT, 3 epochs pipelined over 4 virtual IPUs: {accuracy:.2f}% in "
          f"{time.time() - start:.0f} s")
    assert accuracy >= 97.0
