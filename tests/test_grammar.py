"""Structured output (issue 64 item 2): the target constrained by a grammar (a JSON Schema, a regular
expression, a Lark or GBNF grammar, OpenAI's response_format), plain and speculative, every drafter,
chains and trees, batches and the server: the output always parses, plain constrained greedy is the
reference's masked argmax, greedy speculative is plain constrained greedy token for token, and sampled
speculative output has the constrained target's joint distribution (χ²)."""

import json
import re
import sys
from collections import Counter

import pytest
import torch
import transformers
from conftest import save_reference, spread_init
from test_serve import CHAT, alone, checkpoints, client, expected  # noqa: F401 (fixtures)
from test_speculative import assert_sampled_from, vocab16  # noqa: F401 (a fixture)

import minispec

llguidance = pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3}},
          "required": ["name", "age", "pets"], "additionalProperties": False,
          "x-guidance": {"whitespace_flexible": False}}  # else a random model writes whitespace at length
REGEX = "[0-9]{3}-[a-z]{2,8}"
NEW_TOKENS = 80
DRAFTS = {"none": {}, "lookup": {"draft": "lookup"}, "ngram": {"draft": "ngram"}, "suffix": {"draft": "suffix"},
          "model": {"draft": "model"}, "int8": {"draft": "int8"}, "lookup tree": {"draft": "lookup", "tree": 8},
          "model tree": {"draft": "model", "tree": 8}, "model auto": {"draft": "model", "gamma": "auto"}}


def run(alone, prompt, options, **settings):
    target, draft = alone
    options = {"gamma": 3, **options}
    if options.get("draft") == "model":
        options["draft"] = draft
    return minispec.generate(target, prompt, max_new_tokens=NEW_TOKENS, **options, **settings)


def assert_schema(text):
    value = json.loads(text)
    assert set(value) == {"name", "age", "pets"} and isinstance(value["name"], str) and len(value["name"]) <= 10
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 120 and set(value["pets"]) <= {"cat", "dog"}


@pytest.mark.parametrize("draft", DRAFTS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_output_parses(alone, draft, temperature):
    for seed in range(3 if temperature else 1):
        out = run(alone, "the cat sat", DRAFTS[draft], grammar={"json_schema": SCHEMA}, temperature=temperature,
                  seed=seed)
        assert_schema(out.text)
        out = run(alone, "the cat sat", DRAFTS[draft], grammar={"regex": REGEX}, temperature=temperature, seed=seed)
        assert re.fullmatch(REGEX, out.text), out.text


def test_plain_constrained_greedy_is_the_references_masked_argmax(checkpoints):
    """Token by token against transformers' model and llguidance's own reading of the tokenizer (not
    minispec's): each token is the argmax of the logits among the tokens the grammar allows."""
    target = minispec.load(checkpoints[0])
    reference = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[0]).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoints[0])
    import llguidance.hf
    tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=target.vocab_size)
    prompt = target.tokenizer.encode("the cat sat")
    for grammar in ({"json_schema": SCHEMA}, {"regex": REGEX}):
        out = minispec.generate(target, prompt, grammar=grammar, max_new_tokens=NEW_TOKENS)
        assert out.tokens != minispec.generate(target, prompt, max_new_tokens=NEW_TOKENS).tokens[:len(out.tokens)]
        kind, text = next(iter(grammar.items()))
        matcher = llguidance.LLMatcher(tokenizer, llguidance.grammar_from(kind, json.dumps(text) if kind ==
                                                                          "json_schema" else text))
        with torch.no_grad():
            for token in out.tokens + [hf_tokenizer.eos_token_id]:
                logits = reference(torch.tensor([prompt])).logits[0, -1]
                allowed = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8)[:len(logits)]
                assert token == int(logits.masked_fill(allowed == 0, float("-inf")).argmax())
                if token != hf_tokenizer.eos_token_id:
                    assert matcher.consume_token(token)
                prompt = prompt + [token]


@pytest.mark.parametrize("draft", [name for name in DRAFTS if name != "none"])
def test_greedy_speculative_is_plain_constrained_greedy(alone, draft):
    for grammar in ({"json_schema": SCHEMA}, {"regex": REGEX}, {"type": "json_object"},
                    {"grammar": 'root ::= "the " ("cat" | "dog") " sat on " [a-z]+ "."'}):
        plain = run(alone, "the cat sat on the mat", {}, grammar=grammar)
        out = run(alone, "the cat sat on the mat", DRAFTS[draft], grammar=grammar)
        assert out.tokens == plain.tokens and out.text == plain.text


@pytest.mark.parametrize("draft", ["model", "lookup tree"])
def test_logprobs_and_stream_are_plain_decodings(alone, draft):
    """A constrained request's log-probabilities are those of the masked distribution it draws from, as
    plain decoding reports them, and stream() gives generate()'s text."""
    grammar = {"json_schema": SCHEMA}
    plain = run(alone, "the cat sat", {}, grammar=grammar, logprobs=2)
    out = run(alone, "the cat sat", DRAFTS[draft], grammar=grammar, logprobs=2)
    assert out.tokens == plain.tokens and out.logprobs == plain.logprobs
    assert all(len(entry.top) <= 2 and entry.logprob <= 0 for entry in out.logprobs)
    target, draft_model = alone
    options = {**DRAFTS[draft], "draft": draft_model if draft == "model" else "lookup"}
    chunks = list(minispec.stream(target, "the cat sat", max_new_tokens=NEW_TOKENS, gamma=3, grammar=grammar,
                                  **options))
    assert "".join(chunk.text for chunk in chunks) == plain.text


@pytest.mark.parametrize("draft", ["none", "model", "lookup tree"])
def test_each_row_of_a_batch_has_its_own_matcher(alone, draft):
    prompts = ["the cat sat", "a dog ran", "the mat", "on the mat the cat"]
    target, draft_model = alone
    options = {"gamma": 3, **DRAFTS[draft], **({"draft": draft_model} if draft == "model" else {})}
    outs = minispec.generate(target, prompts, max_new_tokens=NEW_TOKENS, grammar={"json_schema": SCHEMA},
                             batch_size=3, **options)
    for prompt, out in zip(prompts, outs):
        assert out.tokens == run(alone, prompt, {}, grammar={"json_schema": SCHEMA}).tokens
        assert_schema(out.text)


def test_forced_tokens_are_free_guesses(alone):
    """A grammar that forces most of its text: plain decoding takes it in few target calls, and a
    drafter's guesses are not asked for where the grammar forces them."""
    grammar = {"regex": "the cat sat on the mat and then it slept[0-9]"}
    out = run(alone, "x", {}, grammar=grammar)
    assert out.text.startswith("the cat sat on the mat and then it slept") and out.stats["target_calls"] <= 4
    assert run(alone, "x", {"draft": "lookup"}, grammar=grammar).tokens == out.tokens


@pytest.mark.parametrize("draft", ["lookup", "ngram", "suffix"])
def test_a_guess_the_grammar_forbids_is_never_verified(alone, draft):
    """The chain is cut before it: every rejected guess of the trace is one the grammar allowed there."""
    from minispec.decoding.grammar import compile_grammar
    grammar = {"regex": REGEX}
    prompt = " ".join([run(alone, "the cat", {}, grammar=grammar).text] * 3)  # guesses that run past its end
    out = run(alone, prompt, {"draft": draft}, grammar=grammar)
    matcher = compile_grammar(grammar, alone[0]).matcher
    for tokens, kind in out.trace:
        if kind == "rejected":
            assert all(matcher.validate_tokens([token]) == 1 for token in tokens)
        elif tokens[-1] not in alone[0].eos_token_ids:
            assert matcher.consume_tokens(tokens)
    assert out.stats["proposed"] > 0 and re.fullmatch(REGEX, out.text)


# The χ² test's tiny vocabulary: the letters a..o and EOS (id 15), one token each.
LETTERS = "abcdefghijklmno"
CHI_REGEX = "[a-d]e[a-d][a-d]"  # 64 outputs; 'e' is forced, and then only EOS is allowed
CHI_PROMPT = "abeaccebdhkeab"  # lookup's guesses from here are often what the grammar forbids


@pytest.fixture(scope="module")
def letters(tmp_path_factory):
    """vocab16's tiny llama and its noisy copy (test_speculative.py), with a one-letter-per-token
    tokenizer, and the target's transformers model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from conftest import noisy_copy
    config = transformers.LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                      eos_token_id=15, bos_token_id=15)
    torch.manual_seed(0)
    reference = spread_init(transformers.LlamaForCausalLM(config).eval(), 0, gain=1.0)
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(LETTERS)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<eos>"])
    loaded = {}
    for name, model in (("target", reference), ("noisy", noisy_copy(reference, seed=1, scale=0.2))):
        directory = save_reference(model, tmp_path_factory.mktemp(f"letters_{name}"))
        transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>").save_pretrained(directory)
        loaded[name] = minispec.load(directory)
    return loaded, reference


def constrained_joint(reference, prompt, temperature):
    """The exact joint of CHI_REGEX's four tokens: at each position the reference's distribution over
    the tokens the regex allows there (by hand: the letters in its class), renormalized."""
    classes = [[LETTERS.index(c) for c in cls] for cls in ("abcd", "e", "abcd", "abcd")]
    joint = {(): 1.0}
    with torch.no_grad():
        for allowed in classes:
            grown = {}
            for prefix, p in joint.items():
                logits = reference(torch.tensor([prompt + list(prefix)])).logits[0, -1].double() / temperature
                probs = logits[allowed].softmax(-1)
                grown.update({prefix + (token,): p * float(q) for token, q in zip(allowed, probs)})
            joint = grown
    return joint


@pytest.mark.parametrize("draft, options, draws", [("noisy", {}, 2000), ("lookup", {"tree": 6}, 2000),
                                                   ("lookup", {}, 1000)], ids=["model chain", "lookup tree", "lookup"])
def test_sampled_speculative_output_is_the_constrained_targets(letters, draft, options, draws):
    (models, reference), temperature = letters, 0.8
    target, draft = models["target"], models.get(draft, draft)
    prompt = target.tokenizer.encode(CHI_PROMPT)
    joint = constrained_joint(reference, prompt, temperature)
    counts = Counter()
    for seed in range(draws):
        out = minispec.generate(target, prompt, draft=draft, gamma=2, max_new_tokens=6, seed=seed,
                                temperature=temperature, grammar={"regex": CHI_REGEX}, **options)
        assert len(out.tokens) == 5 and out.tokens[-1] == 15  # then EOS, the only token the regex allows
        counts[tuple(out.tokens[:4])] += 1
    assert_sampled_from(counts, joint, draws)


@pytest.mark.parametrize("grammar, message", [
    ({"json_schema": {"type": "nonsense"}}, "grammar: Invalid type: nonsense"),
    ({"regex": "[0-9"}, "unclosed character class"),
    ({"grammar": "start: foo"}, 'unknown name: "foo"'),
    ({"json_schema": "{not json"}, "grammar: key must be a string"),
    ({"xml": "<a/>"}, "grammar must be None, {kind: text}"),
])
def test_a_bad_grammar_is_one_line_naming_it(alone, grammar, message):
    with pytest.raises(minispec.SettingError) as error:
        minispec.generate(alone[0], "x", grammar=grammar)
    assert error.value.field == "grammar" and message in str(error.value) and "\n" not in str(error.value)


def test_a_grammar_without_beams_and_with_eos(alone):
    for settings in ({"beams": 2}, {"ignore_eos": True}):
        with pytest.raises(minispec.SettingError, match="a grammar needs decoding without beams"):
            minispec.generate(alone[0], "x", grammar={"regex": "a"}, **settings)


def test_a_model_without_a_tokenizer_is_refused(vocab16):  # noqa: F811
    with pytest.raises(minispec.SettingError, match="a grammar needs a tokenizer and an EOS token"):
        minispec.generate(vocab16["target"], [1, 2], grammar={"regex": "a"})


def test_without_llguidance_the_error_names_the_extra(alone, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)
    with pytest.raises(minispec.SettingError, match=r"pip install 'minispec\[grammar\]'"):
        minispec.generate(alone[0], "x", grammar={"regex": "a"})


def test_the_server_takes_response_format_through_the_openai_client(client, alone):
    import openai
    api = openai.OpenAI(base_url=str(client.base_url) + "/v1", api_key="k", http_client=client, max_retries=0)
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    chat = api.chat.completions.create(model="tiny", messages=CHAT, max_tokens=NEW_TOKENS, temperature=0,
                                       response_format=response_format)
    assert_schema(chat.choices[0].message.content)
    assert chat.choices[0].message.content == expected(alone, CHAT, max_new_tokens=NEW_TOKENS,
                                                       grammar=response_format).text
    stream = api.chat.completions.create(model="tiny", messages=CHAT, max_tokens=NEW_TOKENS, temperature=0,
                                         response_format=response_format, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == chat.choices[0].message.content
    anything = api.chat.completions.create(model="tiny", messages=CHAT, max_tokens=NEW_TOKENS, temperature=0,
                                           response_format={"type": "json_object"})
    # any JSON object: a random model seldom closes one, so it is compared with generate()'s
    assert anything.choices[0].message.content.startswith("{")
    assert anything.choices[0].message.content == expected(alone, CHAT, max_new_tokens=NEW_TOKENS,
                                                           grammar={"type": "json_object"}).text
    text = api.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0,
                                       response_format={"type": "text"})
    assert text.choices[0].message.content == expected(alone, CHAT, max_new_tokens=8).text
    completion = api.completions.create(model="tiny", prompt="the cat", max_tokens=NEW_TOKENS, temperature=0,
                                        extra_body={"guided_regex": REGEX})
    assert re.fullmatch(REGEX, completion.choices[0].text)
    with pytest.raises(openai.BadRequestError) as error:
        api.chat.completions.create(model="tiny", messages=CHAT, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "nonsense"}}})
    body = error.value.body
    assert body["param"] == "response_format" and "Invalid type: nonsense" in body["message"]
    assert "\n" not in body["message"]
    both = client.post("/v1/completions", json={"prompt": "x", "guided_json": SCHEMA, "guided_regex": REGEX})
    assert both.status_code == 400 and both.json()["error"]["param"] == "guided_regex"
    vllm = client.post("/v1/completions", json={"prompt": "the cat", "max_tokens": NEW_TOKENS, "temperature": 0,
                                                "guided_json": SCHEMA})
    assert_schema(vllm.json()["choices"][0]["text"])
