"""The loader: checkpoint layouts it accepts, and the clear errors it gives for the ones it cannot."""

import json
import shutil
import socket

import pytest
import torch
from safetensors.torch import load_file

from minispec.loading.checkpoint import CheckpointError, load_model
from minispec.loading.weights import save_safetensors
from minispec.models import quant

TOKENS = torch.tensor([[5, 17, 33, 8, 90, 41, 2, 63]])


@pytest.fixture
def gpt2_dir(reference_dirs, tmp_path):
    """A private copy of the tiny GPT-2 checkpoint, free to break."""
    return shutil.copytree(reference_dirs["gpt2"][1], tmp_path / "gpt2")


def logits(model):
    model.setup_caches(1, TOKENS.shape[1])
    return model.prefill(TOKENS)


def edit_json(path, **changes):
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_missing_directory(tmp_path):
    path = tmp_path / "no_such_checkpoint"
    with pytest.raises(CheckpointError, match="does not exist") as error:
        load_model(path)
    assert str(path) in str(error.value)


def test_file_instead_of_directory(gpt2_dir):
    with pytest.raises(CheckpointError, match="is a file"):
        load_model(gpt2_dir / "config.json")


def test_directory_without_config(gpt2_dir):
    (gpt2_dir / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(gpt2_dir)


def test_directory_without_weights(gpt2_dir):
    (gpt2_dir / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        load_model(gpt2_dir)


def test_unknown_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(CheckpointError, match="'bert'") as error:
        load_model(tmp_path)
    for supported in ("gpt2", "llama", "qwen2", "t5"):  # the message lists what would work
        assert supported in str(error.value)


def test_shape_mismatch_names_the_tensor(gpt2_dir):
    edit_json(gpt2_dir / "config.json", n_positions=64)  # the stored wpe has 128 rows
    with pytest.raises(CheckpointError, match=r"wpe\.weight.*\(128, 32\).*\(64, 32\)"):
        load_model(gpt2_dir)


def test_sharded_checkpoint(reference_dirs, tmp_path):
    reference, directory = reference_dirs["gpt2"]
    sharded = tmp_path / "sharded"
    reference.save_pretrained(sharded, max_shard_size="20KB")
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 1 and (sharded / "model.safetensors.index.json").is_file()
    assert torch.equal(logits(load_model(sharded)), logits(load_model(directory)))

    shards[1].unlink()
    with pytest.raises(CheckpointError, match=shards[1].name):
        load_model(sharded)


@pytest.mark.parametrize("shard", ["../gpt2/model.safetensors", "/etc/shadow", "sub/model.safetensors", ".."])
def test_an_index_naming_files_outside_the_checkpoint_is_refused(reference_dirs, tmp_path, shard):
    """model.safetensors.index.json's weight_map names shards of the checkpoint's own folder: a path
    elsewhere would load another checkpoint's weights, or probe for files that are not the model's."""
    reference, _ = reference_dirs["gpt2"]
    sharded = tmp_path / "sharded"
    reference.save_pretrained(sharded, max_shard_size="20KB")
    index = sharded / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    weight_map[next(iter(weight_map))] = shard
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=f"names a shard outside its folder: {shard!r}"):
        load_model(sharded)


def test_hub_id_offline_and_not_cached(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub_constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    # huggingface_hub reads these variables once, at import: patch the values it already holds.
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HOME", str(tmp_path))
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))

    attempts = []  # offline means not even a DNS lookup: record any, and fail it at once

    def no_network(*args, **kwargs):
        attempts.append(args)
        raise OSError("network access in an offline test")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    with pytest.raises(CheckpointError) as error:
        load_model("openai-community/gpt2")
    assert attempts == []
    message = str(error.value)
    assert "openai-community/gpt2" in message
    assert "offline" in message and "cache" in message  # what went wrong
    assert "download" in message and "local path" in message  # and what to do


def test_eos_list_becomes_tuple(gpt2_dir):
    edit_json(gpt2_dir / "config.json", eos_token_id=[2, 5])
    (gpt2_dir / "generation_config.json").unlink()
    model = load_model(gpt2_dir)
    assert model.eos_token_ids == (2, 5)
    assert model.bos_token_id == 1


def test_generation_config_overrides_eos(gpt2_dir):
    edit_json(gpt2_dir / "config.json", eos_token_id=[2, 5])
    edit_json(gpt2_dir / "generation_config.json", eos_token_id=[7, 8])
    assert load_model(gpt2_dir).eos_token_ids == (7, 8)
    edit_json(gpt2_dir / "generation_config.json", eos_token_id=9)
    assert load_model(gpt2_dir).eos_token_ids == (9,)


def test_dtype_option(reference_dirs):
    directory = reference_dirs["gpt2"][1]
    model = load_model(directory, dtype=torch.float16)
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    half, full = logits(model), logits(load_model(directory))
    assert half.dtype == torch.float32  # the interface returns float32 logits whatever the weights
    assert (half.argmax(-1) == full.argmax(-1)).float().mean() >= 0.75


# ---------------------------------------------------------------------------------------------
# Checkpoints holding quantized weights (models/quant.py's stored form, as GGUF imports write them)

@pytest.fixture
def quantized_dir(reference_dirs, tmp_path):
    """The tiny Llama with the o_proj of its layer 0 stored as int4 and its down_proj as int8."""
    directory = shutil.copytree(reference_dirs["llama"][1], tmp_path / "llama")
    weights = {name: tensor.clone() for name, tensor in load_file(directory / "model.safetensors").items()}
    for name, quantize in [("model.layers.0.self_attn.o_proj", lambda w: quant.quantize_int4(w, 32)),
                           ("model.layers.0.mlp.down_proj", quant.quantize_int8)]:
        parts = quantize(weights.pop(f"{name}.weight"))
        weights.update({f"{name}.{key}": value for key, value in parts.items()})
    save_safetensors(weights, directory / "model.safetensors")
    edit_json(directory / "config.json", quantization_config={"quant_method": "minispec"})
    return directory


def test_quantized_checkpoint_loads_quantized(quantized_dir, reference_dirs):
    model = load_model(quantized_dir)
    assert isinstance(model.layers[0].attention.wo, quant.Int4Linear)
    assert isinstance(model.layers[0].feed_forward.w2, quant.Int8Linear)
    assert isinstance(model.layers[1].attention.wo, torch.nn.Linear)  # the float ones stay float
    with torch.inference_mode():
        ours, full = logits(model), logits(load_model(reference_dirs["llama"][1]))
    assert (ours.argmax(-1) == full.argmax(-1)).float().mean() >= 0.75


def test_bad_quantized_checkpoints_name_the_problem(quantized_dir):
    file = quantized_dir / "model.safetensors"
    weights = {name: tensor.clone() for name, tensor in load_file(file).items()}  # copies: the file is rewritten
    scales = weights["model.layers.0.self_attn.o_proj.scales"]
    save_safetensors({**weights, "model.layers.0.self_attn.o_proj.scales": scales[:, :0]}, file)
    with pytest.raises(CheckpointError, match=r"quantized weight layers\.0\.attention\.wo: scales \(32, 0\) do not"):
        load_model(quantized_dir)
    save_safetensors({**weights, "model.norm.qweight": weights["model.layers.0.mlp.down_proj.qweight"][:, :2],
                      "model.norm.scales": scales}, file)
    with pytest.raises(CheckpointError, match=r"quantized weight norm: qweight \(32, 2\) \(torch.int8\) does not make "
                                              r"a weight of shape \(32,\)"):
        load_model(quantized_dir)
    edit_json(quantized_dir / "config.json", quantization_config={"quant_method": "gptq", "bits": 4})
    with pytest.raises(CheckpointError, match="weights quantized with 'gptq', which minispec does not read"):
        load_model(quantized_dir)


def test_quantized_tensors_only_for_linear_layers_and_token_embeddings(gpt2_dir):
    weights = {name: tensor.clone() for name, tensor in load_file(gpt2_dir / "model.safetensors").items()}
    positions = weights.pop("transformer.wpe.weight")  # a position table: looked up, never quantized
    weights.update({f"transformer.wpe.{key}": value for key, value in quant.quantize_int8(positions).items()})
    save_safetensors(weights, gpt2_dir / "model.safetensors")
    edit_json(gpt2_dir / "config.json", quantization_config={"quant_method": "minispec"})
    with pytest.raises(CheckpointError, match="quantized tensors for wpe, which are not linear layers or token"):
        load_model(gpt2_dir)
