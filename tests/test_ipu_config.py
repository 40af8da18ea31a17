"""ipukit.IPUConfig: optimum-graphcore's ipu_config.json rules, serialisation, options and placement."""
import copy
import json
import os
import sys
import types

import pytest
import torch
import torch.nn as nn

import ipukit
from ipukit.core.errors import UnsupportedError
from ipukit.ipuconfig.config import (ATTRIBUTES, IPUConfigError, IPUConfigTypeError,
                               _expand_layers_per_ipu_wildcard)

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "ipu_config")
VIT_BASE = os.path.join(FIXTURES, "vit-base-ipu.json")
WHISPER = os.path.join(FIXTURES, "whisper-small-ipu.json")
BERT = os.path.join(FIXTURES, "bert-base-uncased.json")

OPTIMUM_DEFAULTS = {
    "replication_factor": 1, "inference_replication_factor": 1,
    "gradient_accumulation_steps": 1, "layers_per_ipu": [-1], "inference_layers_per_ipu": [-1],
    "ipus_per_replica": 1, "inference_ipus_per_replica": 1, "optimizer_state_offchip": False,
    "replicated_tensor_sharding": False, "matmul_proportion": 0.2,
    "inference_matmul_proportion": 0.2, "enable_half_partials": True,
    "embedding_serialization_factor": 1, "inference_embedding_serialization_factor": 1,
    "serialized_embedding_splits_per_ipu": None,
    "inference_serialized_embedding_splits_per_ipu": None,
    "projection_serialization_factor": 1, "inference_projection_serialization_factor": 1,
    "serialized_projection_splits_per_ipu": None,
    "inference_serialized_projection_splits_per_ipu": None,
    "recompute_checkpoint_every_layer": False, "device_iterations": 1,
    "inference_device_iterations": 1, "output_mode": "final", "seed": None,
    "auto_loss_scaling": False, "executable_cache_dir": "", "explicit_ir_inference": False,
    "parallelize_kwargs": {}, "inference_parallelize_kwargs": {},
    "execute_encoder_on_cpu_for_generation": False,
}


def _load(path):
    with pytest.warns(UserWarning) if path == BERT else _no_warning():
        return ipukit.IPUConfig.from_pretrained(path)


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# -- defaults, twins, modes -------------------------------------------------------------
def test_defaults_are_optimums():
    config = ipukit.IPUConfig()
    assert config.to_dict() == OPTIMUM_DEFAULTS
    assert set(ATTRIBUTES) == set(OPTIMUM_DEFAULTS)
    assert config.mode == "training"


def test_inference_twins_fall_back_to_training_values_without_aliasing():
    config = ipukit.IPUConfig(layers_per_ipu=[2, 2], matmul_proportion=[0.1, 0.3])
    assert config.inference_layers_per_ipu == [2, 2]
    assert config.ipus_per_replica == config.inference_ipus_per_replica == 2
    assert config.inference_matmul_proportion == [0.1, 0.3]
    config.layers_per_ipu[0] = 3       # a copy, not the same list
    assert config.inference_layers_per_ipu == [2, 2]


def test_inference_ipus_fallback_rules():
    # wildcard layers with explicit IPUs: inference keeps the training IPU count
    config = ipukit.IPUConfig(layers_per_ipu=[-1], ipus_per_replica=4)
    assert config.inference_ipus_per_replica == 4
    # explicit inference layers: their length
    config = ipukit.IPUConfig(layers_per_ipu=[-1], ipus_per_replica=4,
                              inference_layers_per_ipu=[3, 3])
    assert config.inference_ipus_per_replica == 2
    # a per-IPU matmul list that does not fit the inference IPUs falls back to 0.2
    config = ipukit.IPUConfig(layers_per_ipu=[2, 2], matmul_proportion=[0.1, 0.3],
                              inference_layers_per_ipu=[4])
    assert config.inference_ipus_per_replica == 1
    assert config.inference_matmul_proportion == 0.2
    # explicit values win
    config = ipukit.IPUConfig(layers_per_ipu=[2, 2], inference_ipus_per_replica=2,
                              inference_matmul_proportion=0.5)
    assert (config.inference_ipus_per_replica, config.inference_matmul_proportion) == (2, 0.5)


def test_train_eval_switch_the_managed_views():
    config = ipukit.IPUConfig(layers_per_ipu=[2, 2], inference_layers_per_ipu=[4],
                              inference_ipus_per_replica=1, matmul_proportion=0.3,
                              inference_matmul_proportion=0.6)
    assert config._layers_per_ipu == [2, 2] and config._ipus_per_replica == 2
    assert config.eval() is config and config.mode == "inference"
    assert config._layers_per_ipu == [4] and config._ipus_per_replica == 1
    assert config._matmul_proportion == 0.6
    config._matmul_proportion = 0.7                 # writes the inference twin
    assert config.inference_matmul_proportion == 0.7 and config.matmul_proportion == 0.3
    assert config._get_managed_attr_mode_name("layers_per_ipu") == "inference_layers_per_ipu"
    config.train()
    assert config._matmul_proportion == 0.3
    assert config._get_managed_attr_mode_name("seed") == "seed"
    with pytest.raises(ipukit.Error, match="train\\(\\)"):
        config.mode = "testing"
    config.mode = "inference"
    assert config.mode == "inference"


# -- validation on assignment --------------------------------------------------------------
MINIMUMS = [("replication_factor", 1), ("inference_replication_factor", 1),
            ("gradient_accumulation_steps", 1), ("ipus_per_replica", 1),
            ("inference_ipus_per_replica", 1), ("embedding_serialization_factor", 1),
            ("inference_embedding_serialization_factor", 1),
            ("projection_serialization_factor", 1),
            ("inference_projection_serialization_factor", 1), ("device_iterations", 1),
            ("inference_device_iterations", 1), ("seed", 0)]


@pytest.mark.parametrize("name,minimum", MINIMUMS)
def test_minimums_are_checked_on_assignment(name, minimum):
    config = ipukit.IPUConfig()
    with pytest.raises(IPUConfigError, match=f"{name} = {minimum - 1}.*>= {minimum}") as info:
        setattr(config, name, minimum - 1)
    assert isinstance(info.value, ValueError) and isinstance(info.value, ipukit.Error)
    setattr(config, name, minimum)
    assert getattr(config, name) == minimum


@pytest.mark.parametrize("name,bad", [("layers_per_ipu", [2, -2]),
                                      ("inference_layers_per_ipu", [-3]),
                                      ("matmul_proportion", -0.1),
                                      ("matmul_proportion", [0.2, -0.1]),
                                      ("inference_matmul_proportion", -1)])
def test_list_minimums(name, bad):
    with pytest.raises(IPUConfigError, match=">= "):
        setattr(ipukit.IPUConfig(), name, bad)


@pytest.mark.parametrize("name,bad", [("replication_factor", True), ("replication_factor", 2.0),
                                      ("device_iterations", "4"), ("layers_per_ipu", 4),
                                      ("layers_per_ipu", [1.5, 2]), ("matmul_proportion", "0.2"),
                                      ("matmul_proportion", []), ("enable_half_partials", 1),
                                      ("output_mode", None), ("ipus_per_replica", None),
                                      ("parallelize_kwargs", None), ("seed", 1.0)])
def test_types_are_checked_on_assignment(name, bad):
    with pytest.raises(IPUConfigTypeError, match=name) as info:
        setattr(ipukit.IPUConfig(), name, bad)
    assert isinstance(info.value, TypeError) and isinstance(info.value, ipukit.Error)


def test_constructor_checks_types_too():
    with pytest.raises(TypeError, match="replication_factor"):
        ipukit.IPUConfig(replication_factor="2")


def test_output_mode_values():
    config = ipukit.IPUConfig()
    for mode in ("all", "sum", "final", "default"):
        config.output_mode = mode
    with pytest.raises(IPUConfigError, match="'every'.*'all', 'sum', 'final', 'default'"):
        config.output_mode = "every"
    with pytest.raises(IPUConfigError):
        ipukit.IPUConfig(output_mode="All")


@pytest.mark.parametrize("name", ["serialized_embedding_splits_per_ipu",
                                  "inference_serialized_projection_splits_per_ipu"])
def test_serialized_splits_rules(name):
    config = ipukit.IPUConfig(layers_per_ipu=[1, 1, 1, 1])
    with pytest.raises(IPUConfigError, match="consecutive"):
        setattr(config, name, [3, 0, 1, 0])
    with pytest.raises(IPUConfigError, match="at least 1 split"):
        setattr(config, name, [0, 0, 0, 0])
    with pytest.raises(IPUConfigError, match=">= 0"):
        setattr(config, name, [2, -1, 0, 0])
    setattr(config, name, [0, 3, 1, 0])
    assert getattr(config, name) == [0, 3, 1, 0]


# -- cross-checks at construction ----------------------------------------------------------
def test_matmul_proportion_list_length_must_match_ipus():
    with pytest.raises(ipukit.IncompatibleIPUConfigError, match=r"matmul_proportion=\[0.1, 0.2\]"
                       r".*ipus_per_replica=3") as info:
        ipukit.IPUConfig(layers_per_ipu=[1, 1, 1], matmul_proportion=[0.1, 0.2])
    assert isinstance(info.value, ValueError)
    with pytest.raises(ipukit.IncompatibleIPUConfigError, match="inference_matmul_proportion"):
        ipukit.IPUConfig(layers_per_ipu=[1, 1], inference_matmul_proportion=[0.1, 0.2, 0.3])


def test_layers_per_ipu_length_must_match_ipus_unless_wildcards():
    with pytest.raises(ipukit.IncompatibleIPUConfigError, match=r"layers_per_ipu=\[2, 2\].*"
                       r"ipus_per_replica=4"):
        ipukit.IPUConfig(layers_per_ipu=[2, 2], ipus_per_replica=4)
    with pytest.raises(ipukit.IncompatibleIPUConfigError, match="inference_layers_per_ipu"):
        ipukit.IPUConfig(layers_per_ipu=[2, 2], inference_layers_per_ipu=[1, 1, 1],
                         inference_ipus_per_replica=2)
    assert ipukit.IPUConfig(layers_per_ipu=[2, -1], ipus_per_replica=4).ipus_per_replica == 4


def test_factor_and_splits_are_exclusive_and_splits_fit_the_ipus():
    with pytest.raises(ipukit.IncompatibleIPUConfigError, match="only one of "
                       "embedding_serialization_factor=2 and serialized_embedding_splits_per_ipu"):
        ipukit.IPUConfig(layers_per_ipu=[1, 1], embedding_serialization_factor=2,
                         serialized_embedding_splits_per_ipu=[1, 1])
    with pytest.raises(ipukit.IncompatibleIPUConfigError,
                       match=r"serialized_projection_splits_per_ipu=\[1, 1, 1\].*3 entries"):
        ipukit.IPUConfig(layers_per_ipu=[1, 1], serialized_projection_splits_per_ipu=[1, 1, 1])
    with pytest.raises(ipukit.IncompatibleIPUConfigError,
                       match="inference_projection_serialization_factor"):
        ipukit.IPUConfig(layers_per_ipu=[1, 1], inference_projection_serialization_factor=4,
                         inference_serialized_projection_splits_per_ipu=[2, 2])
    # with splits given, the factor stays None; without either it becomes 1
    config = ipukit.IPUConfig(layers_per_ipu=[1, 1], serialized_embedding_splits_per_ipu=[2, 1])
    assert config.embedding_serialization_factor is None
    assert config.inference_embedding_serialization_factor == 1


def test_replicated_tensor_sharding_without_replicas_warns(caplog):
    with caplog.at_level("WARNING", logger="ipukit"):
        ipukit.IPUConfig(replicated_tensor_sharding=True)
    assert "replicated_tensor_sharding is not used when replication_factor=1" in caplog.text


# -- unknown keys and older files -----------------------------------------------------------
def test_unknown_keys_everywhere_are_incompatible_errors():
    with pytest.raises(ipukit.IncompatibleIPUConfigError,
                       match="'layer_per_ipu' \\(did you mean 'layers_per_ipu'\\?\\)") as info:
        ipukit.IPUConfig(layer_per_ipu=[1])
    assert isinstance(info.value, ValueError) and isinstance(info.value, ipukit.Error)
    with pytest.raises(ipukit.IncompatibleIPUConfigError, match="'bogus'"):
        ipukit.IPUConfig.from_dict({"bogus": 1})
    with pytest.raises(ipukit.IncompatibleIPUConfigError, match="'devise_iterations'"):
        ipukit.IPUConfig.from_dict({}, devise_iterations=2)
    with pytest.raises(ipukit.IncompatibleIPUConfigError, match="'seeds'"):
        ipukit.IPUConfig().update_from_string("seeds=1")
    config = ipukit.IPUConfig()
    with pytest.raises(ipukit.IncompatibleIPUConfigError, match="'gradient_accumulation'"):
        config.gradient_accumulation = 4
    with pytest.raises(AttributeError, match="gradient_accumulation_steps"):
        config.gradient_accumulation
    assert not hasattr(config, "no_such_thing")


def test_older_hub_files():
    with pytest.warns(UserWarning, match="enable_half_first_order_momentum"):
        config = ipukit.IPUConfig.from_dict({"enable_half_first_order_momentum": True,
                                             "optimum_version": "0.1.2",
                                             "transformers_version": "4.18.0"})
    assert "optimum_version" not in config.to_dict()
    assert any("optimum_version='0.1.2'" in n for n in config.legacy_notes)
    assert any("transformers_version" in n for n in config.legacy_notes)
    with pytest.warns(UserWarning, match="sharded_execution_for_inference"):
        ipukit.IPUConfig(sharded_execution_for_inference=True)
    with pytest.warns(UserWarning, match="serialization_factor=0: read as unset"):
        config = ipukit.IPUConfig(embedding_serialization_factor=0,
                                  inference_projection_serialization_factor=0)
    assert config.embedding_serialization_factor == 1
    assert config.inference_projection_serialization_factor == 1
    with pytest.raises(IPUConfigError, match=">= 1"):   # only loading reads 0 as unset
        config.embedding_serialization_factor = 0


def test_execute_encoder_on_cpu_is_refused_by_to_options():
    config = ipukit.IPUConfig(execute_encoder_on_cpu_for_generation=True)
    with pytest.raises(ipukit.UnsupportedError, match="execute_encoder_on_cpu_for_generation"):
        config.to_options()


# -- the three Hub files ----------------------------------------------------------------------
def _summary(opts):
    d = opts.toDict()
    return {"replication": d["replication_factor"], "device_iterations": d["device_iterations"],
            "gradient_accumulation": d["Training"]["gradient_accumulation"],
            "reduction": d["Training"]["accumulation_and_replication_reduction_type"],
            "output_mode": d["output_mode"], "seed": d["random_seed"],
            "optimizer_on_chip": d["TensorLocations"]["location_optimizer"]["onChip"],
            "strategy": d["execution_strategy"]}


PIPELINED = {"type": "PipelinedExecution", "auto_stage": "AutoIncrement"}
SHARDED = {"type": "ShardedExecution", "auto_stage": "AutoIncrement"}


def test_vit_base_hub_file():
    config = _load(VIT_BASE)
    assert config.layers_per_ipu == config.inference_layers_per_ipu == [3, 3, 3, 3]
    assert config.recompute_checkpoint_every_layer and config.optimizer_state_offchip
    assert _summary(config.to_options()) == {
        "replication": 1, "device_iterations": 1, "gradient_accumulation": 128,
        "reduction": "Mean", "output_mode": "Final", "seed": None, "optimizer_on_chip": False,
        "strategy": PIPELINED}
    assert _summary(config.to_options(for_inference=True)) == {
        "replication": 1, "device_iterations": 4, "gradient_accumulation": 1,
        "reduction": "Mean", "output_mode": "All", "seed": None, "optimizer_on_chip": False,
        "strategy": SHARDED}
    ignored = config.to_options().toDict()["ignored"]
    assert ignored["setAvailableMemoryProportion"] == {f"IPU{i}": 0.3 for i in range(4)}
    assert ignored["enableExecutableCaching"] == "./exe_cache"
    assert ignored["Precision"]["setPartialsType"] == "torch.float16"
    assert config.ignored_settings() == {
        "matmul_proportion": 0.3, "enable_half_partials": True,
        "replicated_tensor_sharding": True, "executable_cache_dir": "./exe_cache"}
    assert ipukit.get_layer_ipu(config, 12) == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert config.batch_size_factor() == 128 and config.batch_size_factor(True) == 4


def test_whisper_small_hub_file():
    config = _load(WHISPER)
    assert config.ipus_per_replica == config.inference_ipus_per_replica == 8
    assert config.inference_matmul_proportion == config.matmul_proportion
    assert config.projection_serialization_factor is None       # the splits are given
    assert config.embedding_serialization_factor == 1
    assert _summary(config.to_options()) == {
        "replication": 1, "device_iterations": 1, "gradient_accumulation": 32,
        "reduction": "Mean", "output_mode": "Final", "seed": None, "optimizer_on_chip": False,
        "strategy": PIPELINED}
    assert config.ignored_settings()["serialized_projection_splits_per_ipu"] == [0, 0, 0, 0, 0, 4,
                                                                                  0, 0]
    layer_ipu = ipukit.get_layer_ipu(config, 24)   # 12 encoder + 12 decoder layers
    assert layer_ipu == [0] + [1] * 2 + [2] * 3 + [3] * 3 + [4] * 3 + [6] * 6 + [7] * 6
    # the encoder's 12 layers end after 5 or 6 IPUs: no power-of-two cut
    with pytest.raises(ipukit.IncompatibleIPUConfigError, match="power-of-two"):
        ipukit.split_encoder_decoder_ipu_config(config, 12, 12)


def test_bert_base_uncased_hub_file():
    config = _load(BERT)
    assert config.embedding_serialization_factor == 2
    assert config.ignored_settings()["embedding_serialization_factor"] == 2
    assert _summary(config.to_options()) == {
        "replication": 4, "device_iterations": 1, "gradient_accumulation": 512,
        "reduction": "Mean", "output_mode": "Final", "seed": 42, "optimizer_on_chip": True,
        "strategy": PIPELINED}
    inference = config.to_options(for_inference=True)
    assert _summary(inference)["replication"] == 4
    assert _summary(inference)["device_iterations"] == 4
    # replicated tensor sharding is asked for with replicas: recorded, no effect
    assert inference.toDict()["TensorLocations"]["location_optimizer"][
        "useReplicatedTensorSharding"] is True
    assert ipukit.get_layer_ipu(config, 12) == [1] * 4 + [2] * 4 + [3] * 4
    assert config.batch_size_factor() == 4 * 512 and config.batch_size_factor(True) == 16


# -- serialisation ----------------------------------------------------------------------------
@pytest.mark.parametrize("path", [VIT_BASE, WHISPER, BERT])
def test_json_round_trip(path, tmp_path):
    config = _load(path)
    text = config.to_json_string()
    assert text.endswith("\n") and list(json.loads(text)) == sorted(ATTRIBUTES)
    assert ipukit.IPUConfig.from_dict(json.loads(text)) == config
    written = config.save_pretrained(tmp_path / "saved")
    assert written == str(tmp_path / "saved" / "ipu_config.json")
    assert ipukit.IPUConfig.from_pretrained(tmp_path / "saved") == config
    assert ipukit.IPUConfig.from_pretrained(written).to_json_string() == text


def test_round_trip_keeps_explicit_inference_values(tmp_path):
    config = ipukit.IPUConfig(layers_per_ipu=[2, 2], inference_layers_per_ipu=[4],
                              inference_ipus_per_replica=1, seed=0, output_mode="all")
    config.save_pretrained(tmp_path)
    again = ipukit.IPUConfig.from_pretrained(str(tmp_path))
    assert again.to_dict() == config.to_dict()
    assert again.inference_layers_per_ipu == [4]


def test_save_pretrained_refuses_a_file(tmp_path):
    target = tmp_path / "file.json"
    target.write_text("{}")
    with pytest.raises(IPUConfigError, match="is a file; pass a directory"):
        ipukit.IPUConfig().save_pretrained(target)


def test_bad_files_give_clear_errors(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(IPUConfigError, match="not valid JSON"):
        ipukit.IPUConfig.from_pretrained(tmp_path / "bad.json")
    with pytest.raises(IPUConfigError, match="holds list"):
        ipukit.IPUConfig.from_pretrained(tmp_path / "list.json")
    with pytest.raises(IPUConfigError, match="folder has no ipu_config.json"):
        ipukit.IPUConfig.from_pretrained(tmp_path)
    with pytest.raises(IPUConfigError, match="no such file or folder"):
        ipukit.IPUConfig.from_pretrained(str(tmp_path / "missing.json"))


def test_from_pretrained_overrides_then_checks_again():
    config = ipukit.IPUConfig.from_pretrained(VIT_BASE, device_iterations=8, seed=3)
    assert (config.device_iterations, config.seed) == (8, 3)
    with pytest.raises(ipukit.IncompatibleIPUConfigError, match="layers_per_ipu"):
        ipukit.IPUConfig.from_pretrained(VIT_BASE, layers_per_ipu=[6, 6])
    config, unused = ipukit.IPUConfig.from_pretrained(VIT_BASE, return_unused_kwargs=True,
                                                      foo=1, seed=5)
    assert unused == {"foo": 1} and config.seed == 5


# -- the Hub: never downloads in tests ----------------------------------------------------------
def test_hub_id_without_huggingface_hub(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(UnsupportedError,
                       match=r'huggingface_hub package.*pip install "ipukit\[hub\]".*pass its local path'):
        ipukit.IPUConfig.from_pretrained("Graphcore/vit-base-ipu")


def _fake_hub(monkeypatch, download):
    module = types.ModuleType("huggingface_hub")
    module.hf_hub_download = download
    monkeypatch.setitem(sys.modules, "huggingface_hub", module)


def test_hub_id_offline(monkeypatch):
    _fake_hub(monkeypatch, lambda *a, **k: pytest.fail("must not download when offline"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(IPUConfigError, match="HF_HUB_OFFLINE.*Download ipu_config.json from "
                       "https://huggingface.co/Graphcore/vit-base-ipu"):
        ipukit.IPUConfig.from_pretrained("Graphcore/vit-base-ipu")


def test_hub_id_download_and_failure(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    calls = []

    def download(repo_id, filename, **kwargs):
        calls.append((repo_id, filename, kwargs))
        return VIT_BASE

    _fake_hub(monkeypatch, download)
    config = ipukit.IPUConfig.from_pretrained("Graphcore/vit-base-ipu", revision="main")
    assert calls == [("Graphcore/vit-base-ipu", "ipu_config.json", {"revision": "main"})]
    assert config.layers_per_ipu == [3, 3, 3, 3]

    def unreachable(repo_id, filename, **kwargs):
        raise OSError("network is unreachable")

    _fake_hub(monkeypatch, unreachable)
    with pytest.raises(IPUConfigError, match="network is unreachable.*pass its local path"):
        ipukit.IPUConfig.from_pretrained("Graphcore/vit-base-ipu")


# -- update_from_string, batch size factor ------------------------------------------------------
def test_update_from_string():
    config = ipukit.IPUConfig()
    config.update_from_string("device_iterations=4,layers_per_ipu=[1 2 1],ipus_per_replica=3,"
                              "enable_half_partials=false,output_mode=all,"
                              "matmul_proportion=[0.1 0.2 0.3],seed=7,executable_cache_dir=./c")
    assert config.device_iterations == 4 and config.layers_per_ipu == [1, 2, 1]
    assert config.ipus_per_replica == 3 and config.enable_half_partials is False
    assert config.output_mode == "all" and config.matmul_proportion == [0.1, 0.2, 0.3]
    assert config.seed == 7 and config.executable_cache_dir == "./c"
    config.update_from_string("recompute_checkpoint_every_layer=yes,seed=none")
    assert config.recompute_checkpoint_every_layer is True and config.seed is None


@pytest.mark.parametrize("text,match", [
    ("device_iterations=four", "device_iterations='four' cannot be read as an int"),
    ("enable_half_partials=maybe", "true/false"),
    ("device_iterations", "is not name=value"),
    ("device_iterations=0", ">= 1"),
    ("layers_per_ipu=[1 2]", "ipus_per_replica=1"),
])
def test_update_from_string_errors(text, match):
    with pytest.raises(IPUConfigError, match=match):
        ipukit.IPUConfig().update_from_string(text)


def test_batch_size_factor():
    config = ipukit.IPUConfig(replication_factor=2, gradient_accumulation_steps=8,
                              device_iterations=4, inference_replication_factor=3,
                              inference_device_iterations=5)
    assert config.batch_size_factor() == 64
    assert config.batch_size_factor(for_inference=True) == 15


# -- to_options ----------------------------------------------------------------------------------
def test_to_options_settings():
    config = ipukit.IPUConfig(layers_per_ipu=[1, 1], replication_factor=2, seed=0,
                              optimizer_state_offchip=True, replicated_tensor_sharding=True,
                              auto_loss_scaling=True, output_mode="sum",
                              enable_half_partials=False, executable_cache_dir="disabled")
    config.eval()
    opts = config.to_options()
    assert config.mode == "inference"                  # the mode is restored
    assert isinstance(opts, ipukit.Options)
    assert opts.random_seed == 0                       # 0 is a seed (optimum skipped it)
    assert opts.output_mode == ipukit.OutputMode.Sum
    assert not opts.TensorLocations.on_chip("optimizer")
    assert type(opts.execution_strategy) is ipukit.PipelinedExecution
    assert opts.execution_strategy._auto_stage == ipukit.AutoStage.AutoIncrement
    d = opts.toDict()
    assert d["TensorLocations"]["location_optimizer"]["useReplicatedTensorSharding"] is True
    assert d["Training"]["ignored"] == {"setAutomaticLossScaling": True}
    assert "enableExecutableCaching" not in d["ignored"]
    assert "setPartialsType" not in d["ignored"]["Precision"]
    inference = config.to_options(for_inference=True, compile_only=True)
    assert isinstance(inference.execution_strategy, ipukit.ShardedExecution)
    assert inference.output_mode == ipukit.OutputMode.All
    assert inference.toDict()["ignored"]["useOfflineIpuTarget"] == []
    assert "ignored" not in inference.toDict()["Training"]   # no loss scaling for inference
    for mode, expected in (("all", "All"), ("final", "Final"), ("default", "Default")):
        config.output_mode = mode
        assert config.to_options().output_mode.name == expected


def test_to_options_trains_a_parallelized_model_equal_to_plain_pytorch():
    from helpers import make_data, max_weight_diff

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
            self.head = nn.Linear(8, 4)

        def forward(self, x, labels):
            for layer in self.layers:
                x = torch.tanh(layer(x))
            out = self.head(x)
            return out, nn.functional.cross_entropy(out, labels)

    config = ipukit.IPUConfig(layers_per_ipu=[-1, -1], gradient_accumulation_steps=4,
                              device_iterations=2, output_mode="all")
    model = Net()
    reference = copy.deepcopy(model)
    for layer, ipu in zip(model.layers, ipukit.get_layer_ipu(config, model.layers)):
        ipukit.BeginBlock(layer, ipu_id=ipu)
    ipukit.BeginBlock(model.head, ipu_id=config._ipus_per_replica - 1)
    x, y = make_data(config.batch_size_factor() * 2)
    training = ipukit.trainingModel(model, config.to_options(),
                                    optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    training(x, y)
    assert training.program.partition.num_stages == 2
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(2):
        opt.zero_grad()
        for k in range(4):
            sl = slice((step * 4 + k) * 2, (step * 4 + k + 1) * 2)
            (reference(x[sl], y[sl])[1] / 4).backward()
        opt.step()
    assert max_weight_diff(model, reference) < 1e-6
    training.destroy() if hasattr(training, "destroy") else training.detachFromDevice()


# -- placement helpers ------------------------------------------------------------------------------
@pytest.mark.parametrize("layers,ipus,count,expected", [
    ([-1], 4, 10, [2, 2, 2, 4]),                 # remainder on the last IPU
    ([-1, -1], None, 9, [4, 5]),
    ([-1, -1, -1, -1], None, 12, [3, 3, 3, 3]),
    ([1, 2, -1, -1], None, 12, [1, 2, 4, 5]),
    ([1, -1, 2, -1], None, 10, [1, 3, 2, 4]),
    ([0, 4, 4, 4], None, 12, [0, 4, 4, 4]),
    ([-1], None, 7, [7]),                        # one IPU takes everything
    ([2, -1, -1, -1], None, 3, [2, 0, 0, 1]),
])
def test_layers_per_ipu_expansion(layers, ipus, count, expected):
    config = ipukit.IPUConfig(layers_per_ipu=layers, ipus_per_replica=ipus)
    assert _expand_layers_per_ipu_wildcard(config, count) == expected
    layer_ipu = ipukit.get_layer_ipu(config, nn.ModuleList(nn.Identity() for _ in range(count)))
    assert layer_ipu == [i for i, n in enumerate(expected) for _ in range(n)]
    assert _expand_layers_per_ipu_wildcard(config) == layers   # no count: as given


def test_get_layer_ipu_errors():
    with pytest.raises(ipukit.IncompatibleIPUConfigError, match="places 12 layers but the model "
                       "has 8"):
        ipukit.get_layer_ipu(ipukit.IPUConfig(layers_per_ipu=[3, 3, 3, 3]), 8)
    with pytest.raises(ipukit.IncompatibleIPUConfigError, match="places 5 layers"):
        ipukit.get_layer_ipu(ipukit.IPUConfig(layers_per_ipu=[5]), 8)
    with pytest.raises(ipukit.IncompatibleIPUConfigError, match="leaving -2 for the -1 entries"):
        ipukit.get_layer_ipu(ipukit.IPUConfig(layers_per_ipu=[5, 5, -1, -1]), 8)
    with pytest.raises(ipukit.IncompatibleIPUConfigError, match="has 3 entries but "
                       "ipus_per_replica=4"):
        ipukit.get_layer_ipu(ipukit.IPUConfig(layers_per_ipu=[2, -1, 2], ipus_per_replica=4), 8)
    with pytest.raises(IPUConfigError, match="expected an ipukit.IPUConfig"):
        ipukit.get_layer_ipu({"layers_per_ipu": [1]}, 1)


def test_get_layer_ipu_follows_the_mode():
    config = ipukit.IPUConfig(layers_per_ipu=[2, 2], inference_layers_per_ipu=[4],
                              inference_ipus_per_replica=1)
    assert ipukit.get_layer_ipu(config, 4) == [0, 0, 1, 1]
    assert ipukit.get_layer_ipu(config.eval(), 4) == [0, 0, 0, 0]
    with pytest.raises(ipukit.IncompatibleIPUConfigError, match="inference_layers_per_ipu"):
        ipukit.get_layer_ipu(config, 5)


def test_split_encoder_decoder_ipu_config():
    config = ipukit.IPUConfig(layers_per_ipu=[3, 3, 3, 3], matmul_proportion=[0.1, 0.2, 0.3, 0.4],
                              serialized_projection_splits_per_ipu=[0, 0, 4, 0])
    encoder, decoder = ipukit.split_encoder_decoder_ipu_config(config, 6, 6)
    assert (encoder.layers_per_ipu, decoder.layers_per_ipu) == ([3, 3], [3, 3])
    assert (encoder.ipus_per_replica, decoder.ipus_per_replica) == (2, 2)
    assert (encoder.matmul_proportion, decoder.matmul_proportion) == ([0.1, 0.2], [0.3, 0.4])
    assert encoder.serialized_projection_splits_per_ipu is None
    assert decoder.serialized_projection_splits_per_ipu == [4, 0]
    assert config.layers_per_ipu == [3, 3, 3, 3]            # the original is unchanged
    assert ipukit.get_layer_ipu(decoder, 6) == [0, 0, 0, 1, 1, 1]
    # wildcards are expanded first; the largest power-of-two cut wins
    encoder, decoder = ipukit.split_encoder_decoder_ipu_config(
        ipukit.IPUConfig(layers_per_ipu=[-1], ipus_per_replica=4), 4, 4)
    assert (encoder.layers_per_ipu, decoder.layers_per_ipu) == ([2, 2], [2, 2])
    encoder, _ = ipukit.split_encoder_decoder_ipu_config(
        ipukit.IPUConfig(layers_per_ipu=[2, 2, 0, 0, 4]), 4, 4)
    assert encoder.layers_per_ipu == [2, 2, 0, 0]


def test_split_encoder_decoder_errors():
    with pytest.raises(ipukit.IncompatibleIPUConfigError, match="at least 2 IPUs"):
        ipukit.split_encoder_decoder_ipu_config(ipukit.IPUConfig(layers_per_ipu=[4]), 2, 2)
    with pytest.raises(ipukit.IncompatibleIPUConfigError, match="power-of-two"):
        ipukit.split_encoder_decoder_ipu_config(ipukit.IPUConfig(layers_per_ipu=[1, 2, 2, 3]),
                                                5, 3)
    with pytest.raises(ipukit.IncompatibleIPUConfigError, match="on the decoder's IPUs"):
        ipukit.split_encoder_decoder_ipu_config(
            ipukit.IPUConfig(layers_per_ipu=[2, 2], serialized_embedding_splits_per_ipu=[1, 1]),
            2, 2)
    with pytest.raises(ipukit.IncompatibleIPUConfigError, match="on the encoder's IPUs"):
        ipukit.split_encoder_decoder_ipu_config(
            ipukit.IPUConfig(layers_per_ipu=[2, 2], serialized_projection_splits_per_ipu=[1, 0]),
            2, 2)


# -- recomputation ------------------------------------------------------------------------------------
class _Counted(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return torch.tanh(self.linear(x)) * 2


def test_recomputation_checkpoint_recomputes_in_backward():
    torch.manual_seed(0)
    plain, checked = _Counted(), _Counted()
    checked.load_state_dict(plain.state_dict())
    handle = ipukit.recomputation_checkpoint(checked)
    x = torch.randn(3, 4, requires_grad=True)
    plain(x).sum().backward()
    y = checked(x)
    assert checked.calls == 1
    y.sum().backward()
    assert (plain.calls, checked.calls) == (1, 2)       # the forward ran again for backward
    assert torch.allclose(plain.linear.weight.grad, checked.linear.weight.grad)
    with torch.no_grad():
        checked(x)
    assert checked.calls == 3                           # nothing to recompute without grad
    copied = copy.deepcopy(checked)                     # the copy recomputes its own forward
    copied(x).sum().backward()
    assert (copied.calls, checked.calls) == (5, 3)
    handle.remove()
    checked(x).sum().backward()
    assert checked.calls == 4
    with pytest.raises(IPUConfigError, match="torch.nn.Module"):
        ipukit.recomputation_checkpoint(lambda x: x)


def test_recomputation_in_a_single_stage_training_model():
    torch.manual_seed(0)
    counted = _Counted()

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = counted
            self.head = nn.Linear(4, 2)

        def forward(self, x, labels):
            out = self.head(self.body(x))
            return out, nn.functional.cross_entropy(out, labels)

    net = Net()
    ipukit.recomputation_checkpoint(net.body)
    opts = ipukit.Options()
    opts.Training.gradientAccumulation(3)
    training = ipukit.trainingModel(net, opts, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))
    training(x, y)
    before = counted.calls
    training(x, y)
    assert counted.calls - before == 6                  # 3 micro-batches, forward + recompute


def test_copies_and_pickles_keep_values_and_mode():
    import pickle

    config = ipukit.IPUConfig(layers_per_ipu=[1, 2], seed=3).eval()
    for clone in (copy.deepcopy(config), pickle.loads(pickle.dumps(config))):
        assert clone == config and clone.mode == "inference"
        clone.layers_per_ipu[0] = 5
        assert config.layers_per_ipu == [1, 2]
