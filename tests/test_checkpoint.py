"""The loader: checkpoint layouts it accepts, and the clear errors it gives for the ones it cannot."""

import json
import math
import re
import shutil
import socket

import pytest
import torch
from safetensors.torch import load_file

from minispec.loading.checkpoint import CheckpointError, load_model
from minispec.loading.weights import SAFETENSORS_DTYPES, save_safetensors
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
    # the gain-3 tiny model is chaotic: minispec's CPU kernel (inputs rounded to int8 blocks) agreed at
    # 5 of its 8 positions, PyTorch's bfloat16 kernels at 6 or more
    assert (ours.argmax(-1) == full.argmax(-1)).float().mean() >= (0.6 if model.layers[0].attention.wo.native else 0.75)


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


# ---------------------------------------------------------------------------------------------
# Hostile checkpoints (issue 30): each a one-line error naming the file, the key and the value

def private_copy(reference_dirs, tmp_path, kind):
    return shutil.copytree(reference_dirs[kind][1], tmp_path / kind)


def refused(directory, match, error_type=CheckpointError):
    """load_model's error for `directory`, checked to be one line matching `match`."""
    with pytest.raises(error_type, match=match) as error:
        load_model(directory)
    assert "\n" not in str(error.value)
    return str(error.value)


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "model.safetensors.index.json"])
@pytest.mark.parametrize("content", ["[1, 2]", "3", '"text"', "{not json", "[" * 100_000 + "]" * 100_000])
def test_json_files_that_hold_no_object(gpt2_dir, name, content):
    (gpt2_dir / name).write_text(content)
    refused(gpt2_dir, re.escape(str(gpt2_dir / name)))


@pytest.mark.parametrize("kind, change, key, shown", [
    ("gpt2", {"n_embd": "32"}, "n_embd", "'32'"),
    ("gpt2", {"n_head": 4.5}, "n_head", "4.5"),
    ("gpt2", {"n_positions": True}, "n_positions", "True"),
    ("gpt2", {"vocab_size": 1e30}, "vocab_size", "1e+30"),
    ("gpt2", {"layer_norm_epsilon": float("nan")}, "layer_norm_epsilon", "nan"),
    ("gpt2", {"activation_function": ["gelu"]}, "activation_function", "['gelu']"),
    ("gpt2", {"tie_word_embeddings": "yes"}, "tie_word_embeddings", "'yes'"),
    ("llama", {"hidden_size": "32"}, "hidden_size", "'32'"),
    ("llama", {"num_attention_heads": 0}, "num_attention_heads", "0"),
    ("llama", {"intermediate_size": -64}, "intermediate_size", "-64"),
    ("llama", {"num_key_value_heads": 2**40}, "num_key_value_heads", f"{2**40}"),
    ("llama", {"rope_parameters": "yarn"}, "rope_parameters", "'yarn'"),
    ("llama", {"rope_parameters": None, "rope_scaling": "yarn"}, "rope_scaling", "'yarn'"),
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": "2"}}, "rope factor", "'2'"),
    ("llama", {"rope_parameters": {"rope_type": ["linear"]}}, "rope_type", "['linear']"),
    ("llama", {"rope_parameters": {"rope_theta": 0}}, "rope_theta", "0"),
    ("qwen2", {"sliding_window": -1}, "sliding_window", "-1"),
    ("qwen2", {"sliding_window": 4.5}, "sliding_window", "4.5"),
    ("qwen2", {"layer_types": "full_attention"}, "layer_types", "'full_attention'"),
    ("llama", {"attention_bias": 1}, "attention_bias", "1"),
    ("qwen2", {"layer_types": None, "use_sliding_window": True, "max_window_layers": -1}, "max_window_layers", "-1"),
    ("t5_v1_0", {"d_model": "32"}, "d_model", "'32'"),
    ("t5_v1_0", {"num_heads": 0}, "num_heads", "0"),
    ("t5_v1_0", {"feed_forward_proj": 7}, "feed_forward_proj", "7"),
    ("t5_v1_0", {"decoder_start_token_id": 0.5}, "decoder_start_token_id", "0.5"),
])
def test_config_values_of_the_wrong_type_or_range(reference_dirs, tmp_path, kind, change, key, shown):
    directory = private_copy(reference_dirs, tmp_path, kind)
    edit_json(directory / "config.json", **change)
    refused(directory, re.escape(f"{directory / 'config.json'}: {key} must be ") + ".*" + re.escape(f", got {shown}"))


@pytest.mark.parametrize("kind, change, message", [
    ("gpt2", {"n_embd": 30}, "n_embd 30 is not a multiple of n_head 4"),
    ("llama", {"num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ("qwen2", {"layer_types": ["full_attention"] * 3}, "layer_types lists 3 layers but num_hidden_layers is 2"),
    ("t5_v1_0", {"decoder_start_token_id": 96}, "decoder_start_token_id 96 is outside the vocabulary of 96 tokens"),
    # each size below 2^31, but tensors of 2^62 elements: torch's sizes overflow
    ("gpt2", {"n_embd": 2**31 - 1, "n_head": 1, "vocab_size": 2**31 - 1}, "its sizes make tensors too large for torch"),
])
def test_config_values_that_do_not_fit_together(reference_dirs, tmp_path, kind, change, message):
    directory = private_copy(reference_dirs, tmp_path, kind)
    (directory / "generation_config.json").unlink()  # its token ids would override config.json's
    edit_json(directory / "config.json", **change)
    refused(directory, re.escape(f"{directory / 'config.json'}: {message}"))


@pytest.mark.parametrize("kind, key, count", [
    ("gpt2", "n_layer", 3),
    ("llama", "num_hidden_layers", 1),
    ("llama", "num_hidden_layers", 10**9),  # took 8 GB and hung building the layers, before this check
    ("qwen2", "num_hidden_layers", 2**31 - 1),
    ("t5_v1_0", "num_layers", 10**9),
    ("t5_v1_0", "num_decoder_layers", 3),
])
def test_layer_counts_are_bounded_by_the_weights(reference_dirs, tmp_path, kind, key, count):
    directory = private_copy(reference_dirs, tmp_path, kind)
    edit_json(directory / "config.json", **{key: count})
    refused(directory, re.escape(f"config.json: {key} is {count} but the weights hold 2 layers"))


@pytest.mark.parametrize("file", ["config.json", "generation_config.json"])
@pytest.mark.parametrize("key, value", [
    ("eos_token_id", "2"), ("eos_token_id", -1), ("eos_token_id", 2.0), ("eos_token_id", True),
    ("eos_token_id", [2, "5"]), ("bos_token_id", [1]), ("pad_token_id", False), ("pad_token_id", -1),
])
def test_token_ids_that_are_not_ids(gpt2_dir, file, key, value):
    edit_json(gpt2_dir / file, **{key: value})
    message = refused(gpt2_dir, re.escape(f"{gpt2_dir / file}: {key} must be "))
    assert repr(value) in message


@pytest.mark.parametrize("key, value", [("eos_token_id", 96), ("eos_token_id", [2, 500]), ("bos_token_id", 96),
                                        ("pad_token_id", 10**6)])
def test_token_ids_outside_the_vocabulary(gpt2_dir, key, value):
    (gpt2_dir / "generation_config.json").unlink()
    edit_json(gpt2_dir / "config.json", **{key: value})
    outside = value[-1] if isinstance(value, list) else value
    refused(gpt2_dir, re.escape(f"{gpt2_dir}: {key} {outside} is outside the vocabulary of 96 tokens"))


def test_null_and_listed_token_ids_are_valid(gpt2_dir):
    (gpt2_dir / "generation_config.json").unlink()
    edit_json(gpt2_dir / "config.json", eos_token_id=[2, 95], bos_token_id=None, pad_token_id=0)
    model = load_model(gpt2_dir)
    assert (model.eos_token_ids, model.bos_token_id, model.pad_token_id) == ((2, 95), None, 0)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.int8, torch.bool])
def test_integer_weights_are_refused_not_cast(gpt2_dir, dtype):
    file = gpt2_dir / "model.safetensors"
    weights = {name: tensor.clone() for name, tensor in load_file(file).items()}
    weights["transformer.h.1.mlp.c_fc.weight"] = weights["transformer.h.1.mlp.c_fc.weight"].to(dtype)
    save_safetensors(weights, file)
    name = SAFETENSORS_DTYPES[dtype]
    refused(gpt2_dir, re.escape(f"{gpt2_dir}: tensor transformer.h.1.mlp.c_fc.weight is stored as {name}; "))
    edit_json(gpt2_dir / "config.json", quantization_config={"quant_method": "minispec"})  # not a stored form
    refused(gpt2_dir, re.escape(f"tensor transformer.h.1.mlp.c_fc.weight is stored as {name}; "))


def test_float_weights_labelled_gguf_load(reference_dirs, tmp_path):
    """transformers saves a GGUF file it loaded as float tensors, labelled quant_method "gguf": the dtypes
    decide, not the label. Integer tensors under a label minispec does not read stay refused."""
    directory = private_copy(reference_dirs, tmp_path, "llama")
    edit_json(directory / "config.json", quantization_config={"quant_method": "gguf"})
    assert torch.equal(logits(load_model(directory)), logits(load_model(reference_dirs["llama"][1])))

    file = directory / "model.safetensors"
    weights = {name: tensor.clone() for name, tensor in load_file(file).items()}
    name = "model.layers.0.mlp.down_proj"
    save_safetensors({**weights, f"{name}.weight": weights[f"{name}.weight"].to(torch.uint8)}, file)
    refused(directory, "weights quantized with 'gguf', which minispec does not read")


def test_a_tensor_in_two_shards_is_refused(reference_dirs, tmp_path):
    reference, _ = reference_dirs["gpt2"]
    sharded = tmp_path / "sharded"
    reference.save_pretrained(sharded, max_shard_size="20KB")
    first, second = sorted(sharded.glob("model-*.safetensors"))[:2]
    both = {name: tensor.clone() for name, tensor in {**load_file(second), **load_file(first)}.items()}
    save_safetensors(both, second)  # copies: the file is rewritten
    refused(sharded, re.escape(f"of {second} is also in another shard"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_nan_and_infinite_weights_are_refused_with_the_tensor_name(gpt2_dir, dtype, value):
    """A NaN or infinite weight would make every output NaN, or garbage, without an error: refused at load,
    naming the tensor, whatever the float type it is stored in."""
    file = gpt2_dir / "model.safetensors"
    weights = {name: tensor.to(dtype, copy=True) for name, tensor in load_file(file).items()}
    weights["transformer.h.1.mlp.c_fc.weight"][7, 3] = value
    save_safetensors(weights, file)
    refused(gpt2_dir, re.escape(f"{gpt2_dir}: tensor transformer.h.1.mlp.c_fc.weight holds NaN or infinite values"))
