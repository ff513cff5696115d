"""Checkpoints whose embedding has more rows than their tokenizer has ids (Qwen2.5: 151,665 tokens for
151,936 rows; llama.cpp and vLLM pad too): the loader cuts the model to the tokenizer's ids, so that no
output is an id without a token, and a draft and a target of one tokenizer decode together whatever their
padding. Each checkpoint here has a planted padded row: a logit of 1000 wherever the test decodes, which
an uncut model would output."""

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
import transformers

import minispec
from conftest import make_reference, noisy_copy, save_reference, spread_init
from test_speculative import assert_sampled_from, exact_joint

IDS = 64  # the tokenizer's ids; the tiny checkpoints of conftest have 96 rows
PROMPT = "XYZZY"


def letters_tokenizer(directory, size, swap=None):
    """A byte-level BPE tokenizer.json of `size` ids: size - 1 printable characters without merges, then
    the special token <|end|>, an added token as real tokenizers have (its id counts). `swap`: (id, text),
    another token at that id."""
    vocab = {chr(33 + i): i for i in range(size - 1)}
    if swap is not None:
        vocab = {(swap[1] if i == swap[0] else token): i for token, i in vocab.items()}
    spec = {"model": {"type": "BPE", "vocab": vocab, "merges": []},
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True},
            "decoder": {"type": "ByteLevel"},
            "added_tokens": [{"id": size - 1, "content": "<|end|>", "special": True}]}
    Path(directory, "tokenizer.json").write_text(json.dumps(spec))
    Path(directory, "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>"}))
    return directory


def encode(text):
    """letters_tokenizer's ids of `text`: a token per character."""
    return [ord(character) - 33 for character in text]


def head_inputs(reference, prompt, decoder):
    """What the reference's output head reads at the last position: its final hidden state, scaled as
    the head's input (T5)."""
    seen = []
    hook = reference.get_output_embeddings().register_forward_hook(lambda module, args, out: seen.append(args[0]))
    with torch.no_grad():
        reference_logits(reference, prompt, decoder)
    hook.remove()
    return seen[0][0, -1]


def reference_logits(reference, prompt, decoder):
    """The reference's logits at the last position, of prompt ids + decoder ids (a T5: its decoder's)."""
    with torch.no_grad():
        if reference.config.is_encoder_decoder:
            start = reference.config.decoder_start_token_id
            return reference(input_ids=torch.tensor([prompt]), decoder_input_ids=torch.tensor([[start] + decoder])).logits[0, -1]
        return reference(torch.tensor([prompt + decoder])).logits[0, -1]


def greedy_reference(reference, prompt, n, ids=IDS):
    """The reference's greedy tokens with its logits past the tokenizer's ids suppressed."""
    tokens = []
    for _ in range(n):
        tokens.append(int(reference_logits(reference, prompt, tokens)[:ids].argmax()))
    return tokens


def plant(reference, prompt, paths, ids=IDS):
    """Padded rows of the head set so that their logits are 1000 at the last position of every path
    (decoder ids after the prompt): what an uncut model would pick there. The rows solve states @ w = 1000,
    fewer states than the hidden size. Asserts that it took."""
    states = torch.stack([head_inputs(reference, prompt, path) for path in paths]).double()
    row = torch.linalg.lstsq(states, torch.full((len(paths), 1), 1000.0, dtype=torch.float64)).solution[:, 0]
    with torch.no_grad():
        reference.get_output_embeddings().weight[ids:] = row.float()
    for path in paths:
        assert reference_logits(reference, prompt, path).argmax() >= ids  # the plant: an uncut argmax takes it


def padded_checkpoint(reference, directory, new_tokens, prompt):
    """The reference saved with letters_tokenizer(IDS) and a planted padding along its own greedy path."""
    path = greedy_reference(reference, prompt, new_tokens)
    plant(reference, prompt, [path[:i] for i in range(new_tokens)])
    return letters_tokenizer(save_reference(reference, directory), IDS)


@pytest.mark.parametrize("kind", ["llama", "gpt2", "t5_v1_1"])
def test_no_output_past_the_tokenizer_and_greedy_equals_the_reference(kind, tmp_path):
    """Greedy decoding over the tokenizer's ids only: the reference's with the padded rows suppressed,
    for an output head of its own (Llama, T5) and one tied to the embedding (GPT-2); text decodes."""
    reference = make_reference(kind)
    prompt = encode(PROMPT)
    directory = padded_checkpoint(reference, tmp_path / "padded", 12, prompt)
    model = minispec.load(directory)
    expected = greedy_reference(reference, prompt, 12)
    assert len(set(expected)) > 3  # greedy varies: a real comparison
    out = minispec.generate(model, PROMPT, max_new_tokens=12, ignore_eos=True)
    assert out.tokens == expected and max(out.tokens) < IDS
    assert out.text == model.tokenizer.decode(expected, skip_special_tokens=True)
    assert reference.config.vocab_size == 96 and model.vocab_size == IDS
    drafted = minispec.generate(model, PROMPT, max_new_tokens=12, ignore_eos=True, draft="int8")
    assert drafted.tokens == expected  # the self-draft: a quantized copy of the cut model
    quantized = minispec.load(directory, quantize="int8")
    assert max(minispec.generate(quantized, PROMPT, max_new_tokens=12, ignore_eos=True).tokens) < IDS


def padded_llama(rows, seed=0, hidden=32, layers=2):
    config = transformers.LlamaConfig(vocab_size=rows, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=64)
    torch.manual_seed(seed)
    return spread_init(transformers.LlamaForCausalLM(config).eval(), seed, gain=1.0 if hidden < 32 else 3.0)


def with_rows(reference, rows, seed):
    """A noisy copy of `reference` (a draft that agrees with it often) with `rows` rows, the extra ones
    copies of its last."""
    copy = noisy_copy(reference, seed=seed, scale=0.2)
    bigger = padded_llama(rows, hidden=reference.config.hidden_size, layers=reference.config.num_hidden_layers)
    state = copy.state_dict()
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        state[name] = torch.cat([state[name], state[name][-1:].expand(rows - len(state[name]), -1)])
    bigger.load_state_dict(state)
    return bigger


def test_a_pair_that_differs_in_padding_decodes_greedy_exactly(tmp_path):
    """Draft 16 rows more than the target, one tokenizer: speculative greedy is plain greedy."""
    target, prompt = padded_llama(IDS + 16), encode(PROMPT)
    draft = with_rows(target, IDS + 32, seed=1)
    plant(draft, prompt, [[]])
    draft_dir = letters_tokenizer(save_reference(draft, tmp_path / "draft"), IDS)
    target_dir = padded_checkpoint(target, tmp_path / "target", 16, prompt)
    target, draft = minispec.load(target_dir), minispec.load(draft_dir)
    plain = minispec.generate(target, PROMPT, max_new_tokens=16, ignore_eos=True)
    speculative = minispec.generate(target, PROMPT, max_new_tokens=16, ignore_eos=True, draft=draft, gamma=3)
    assert speculative.tokens == plain.tokens and max(plain.tokens) < IDS
    assert 0 < speculative.stats["accepted"] < speculative.stats["verified"]  # guesses kept and refused


def test_a_pair_that_differs_in_padding_samples_the_targets_distribution(tmp_path):
    """χ² of the first three sampled tokens (test_speculative's joint test) over a 16-id tokenizer, the
    target padded to 32 rows, the draft to 48; the first token's padded logit planted in both."""
    target = padded_llama(32, hidden=16, layers=1)
    draft = with_rows(target, 48, seed=1)
    for model in (target, draft):
        plant(model, [1, 2, 3], [[]], ids=16)
    target_dir = letters_tokenizer(save_reference(target, tmp_path / "target"), 16)
    draft_dir = letters_tokenizer(save_reference(draft, tmp_path / "draft"), 16)
    target, draft = minispec.load(target_dir), minispec.load(draft_dir)
    sampling = {"temperature": 1.0, "top_k": 3}
    joint = exact_joint(target, [1, 2, 3], minispec.Sampling(**sampling), length=3)
    draws, counts, accepted, verified = 3000, Counter(), 0, 0
    for seed in range(draws):
        out = minispec.generate(target, [1, 2, 3], draft=draft, gamma=2, max_new_tokens=3, seed=seed,
                                ignore_eos=True, **sampling)
        counts[tuple(out.tokens)] += 1
        accepted, verified = accepted + out.stats["accepted"], verified + out.stats["verified"]
    print(f"acceptance rate {accepted / verified:.3f}")
    assert 0.2 < accepted / verified < 0.95  # guesses kept and refused: the pair did decode together
    assert_sampled_from(counts, joint, draws)


def test_a_real_tokenizer_difference_is_refused_naming_the_token(tmp_path):
    target = padded_llama(IDS + 16)
    target_dir = letters_tokenizer(save_reference(target, tmp_path / "target"), IDS)
    draft_dir = letters_tokenizer(save_reference(target, tmp_path / "draft"), IDS, swap=(5, "é"))
    with pytest.raises(ValueError, match="different tokenizers") as error:
        minispec.generate(minispec.load(target_dir), PROMPT, draft=minispec.load(draft_dir), max_new_tokens=2)
    assert str(error.value) == ("target target and draft draft use different tokenizers: id 5 is '&' in the "
                                "target's, 'é' in the draft's")


def test_a_tokenizer_with_more_ids_than_rows_leaves_the_model_whole(tmp_path):
    """Cutting only ever narrows: rows the tokenizer does not reach stay, as before."""
    directory = letters_tokenizer(save_reference(padded_llama(IDS - 8), tmp_path / "short"), IDS)
    assert minispec.load(directory).vocab_size == IDS - 8


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "medusa"])
def test_a_head_saved_for_the_padded_rows_drafts_for_the_cut_target(kind, tmp_path):
    """Heads published for a padded target have its rows (config.json's vocab_size, their output heads
    and embeddings): they are cut as the target was, and draft exactly."""
    from test_heads import write_eagle, write_eagle3, write_medusa

    directory = padded_checkpoint(make_reference("llama_gqa"), tmp_path / "target", 16, encode(PROMPT))
    hf = json.loads((directory / "config.json").read_text())
    head_dir = {"eagle": lambda: write_eagle(tmp_path / "head", hf)[0],
                "eagle3": lambda: write_eagle3(tmp_path / "head", hf, draft_vocab=list(range(1, IDS, 2)),
                                               layer_ids=[0, 1], dim=hf["hidden_size"] // 2)[0],
                "medusa": lambda: write_medusa(tmp_path / "head", hf["hidden_size"], hf["vocab_size"])[0]}[kind]()
    target = minispec.load(directory)
    head = minispec.load_draft_head(head_dir, target)
    plain = minispec.generate(target, PROMPT, max_new_tokens=16, ignore_eos=True)
    out = minispec.generate(target, PROMPT, draft=head, gamma=3, max_new_tokens=16, ignore_eos=True)
    assert out.tokens == plain.tokens and max(plain.tokens) < IDS and out.stats["proposed"] > 0
    assert hf["vocab_size"] == 96 and target.vocab_size == IDS


def test_a_padded_checkpoint_holding_quantized_rows_is_cut_too(tmp_path):
    """Quantized embedding and head (models/quant.py's stored form, as GGUF imports keep them): their
    stored tensors are cut as float ones are."""
    from safetensors.torch import load_file

    from minispec.loading.weights import save_safetensors
    from minispec.models import quant

    directory = padded_checkpoint(make_reference("llama"), tmp_path / "llama", 12, encode(PROMPT))
    weights = {name: tensor.clone() for name, tensor in load_file(directory / "model.safetensors").items()}
    for name in ("model.embed_tokens", "lm_head"):
        weights.update({f"{name}.{key}": value for key, value in quant.quantize_int8(weights.pop(f"{name}.weight"), 32).items()})
    save_safetensors(weights, directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "minispec"}}))
    model = minispec.load(directory)
    assert isinstance(model.head, quant.Int8Linear) and model.head.out_features == IDS
    assert model.tok_embeddings.num_embeddings == IDS
    assert max(minispec.generate(model, PROMPT, max_new_tokens=12, ignore_eos=True).tokens) < IDS
