"""Log-probabilities (logprobs=k, issue 64): each output token's log-probability and its k most likely
alternatives, read from the forward that verified it, are bit for bit what plain decoding reports for
the same token after the same prefix: for every drafter, chains and trees, batches, float32, bfloat16
and float16; greedy, of the model's softmax; sampled, of the distribution drawn from. They cost no
host transfer of their own, stream, and reach run.py's --json and the server in OpenAI's shapes."""

import json
import math

import openai
import pytest
import torch
from conftest import make_reference, noisy_copy, save_reference
from test_run import run_cli
from test_serve import (CHAT, PROMPTS, Steps, alone, checkpoints, expected, in_threads, make_app,  # noqa: F401
                        post, queued, serving, streamed, uvicorn_serving)
from test_speculative import HostSyncs

import minispec

PROMPT = [5, 17, 33, 8, 90, 41, 2, 63, 12, 77, 3, 54, 29, 88]
OTHERS = [[9, 31, 66, 24, 81], [50, 38, 7, 19, 44, 3, 61, 28, 90, 12, 55]]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NEW_TOKENS = 16
SAMPLED = {"temperature": 0.9, "top_k": 12, "top_p": 0.95}  # top_k <= logprobs: the drawn token is among the top
# drafter: (draft, extra settings): a model's chains and trees, lookup's chains and trees, ngram's chains
DRAFTERS = {"model": ("model", {"gamma": 3, "tree": None}), "model-tree": ("model", {"gamma": 3, "tree": 6}),
            "lookup": ("lookup", {"gamma": 3, "tree": None}), "lookup-tree": ("lookup", {"tree": 5}),
            "ngram": ("ngram", {"gamma": 2, "tree": None})}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """{dtype: (target, draft model)}: a tiny llama and a noisy copy, which accepts many guesses and rejects
    many; and "reference": the llama in the reference implementation."""
    reference = make_reference("llama_gqa")
    target_dir = save_reference(reference, tmp_path_factory.mktemp("target"))
    draft_dir = save_reference(noisy_copy(reference, seed=1, scale=0.02), tmp_path_factory.mktemp("draft"))
    return {"reference": reference,
            **{dtype: (minispec.load(target_dir, dtype=dtype), minispec.load(draft_dir, dtype=dtype))
               for dtype in DTYPES}}


def speculative(pairs, dtype, drafter, prompt=PROMPT, **settings):
    target, draft = pairs[dtype]
    name, extra = DRAFTERS[drafter]
    return minispec.generate(target, prompt, draft=draft if name == "model" else name, max_new_tokens=NEW_TOKENS,
                             ignore_eos=True, **extra, **settings)


@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_greedy_logprobs_are_plain_decodings_bit_for_bit(pairs, dtype, drafter):
    target = pairs[dtype][0]
    plain = minispec.generate(target, PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
    out = speculative(pairs, dtype, drafter, logprobs=5)
    assert out.stats["proposed"] and (out.stats["accepted"] or not drafter.startswith("model"))
    assert out.tokens == plain.tokens and out.logprobs == plain.logprobs
    assert [entry.token for entry in out.logprobs] == out.tokens


@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sampled_logprobs_are_plain_decodings_after_the_same_prefix(pairs, dtype, drafter):
    """Sampled, speculative and plain decoding draw other tokens: each token's numbers are compared with
    plain decoding's first token after the same prefix, whose top-20 holds every token top_k keeps."""
    target = pairs[dtype][0]
    out = speculative(pairs, dtype, drafter, logprobs=20, seed=3, **SAMPLED)
    assert len(out.logprobs) == len(out.tokens) == NEW_TOKENS
    for i, (token, entry) in enumerate(zip(out.tokens, out.logprobs)):
        plain = minispec.generate(target, PROMPT + out.tokens[:i], max_new_tokens=1, logprobs=20, seed=i,
                                  **SAMPLED).logprobs[0]
        assert entry.token == token and entry.top == plain.top, i
        assert dict(plain.top)[token] == entry.logprob, i


@pytest.mark.parametrize("drafter", ["model", "lookup-tree", "model-tree"])
def test_a_batch_reports_what_each_prompt_reports_alone(pairs, drafter):
    target = pairs[torch.bfloat16][0]
    prompts = [PROMPT] + OTHERS
    batch = speculative(pairs, torch.bfloat16, drafter, prompts, logprobs=3, batch_size=2)
    for prompt, out in zip(prompts, batch):
        plain = minispec.generate(target, prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
        assert out.tokens == plain.tokens and out.logprobs == plain.logprobs


def test_the_numbers_are_the_targets_distribution(pairs):
    """Against the reference implementation's forward over prompt and output: its log-softmax (greedy),
    after temperature and top-k (sampled); not the draft's, nor a neighbouring position's."""
    for settings in ({}, {"temperature": 0.7, "top_k": 5, "seed": 1}):
        out = speculative(pairs, torch.float32, "model", logprobs=4, **settings)
        with torch.no_grad():
            logits = pairs["reference"](torch.tensor([PROMPT + out.tokens])).logits[0, len(PROMPT) - 1:-1]
        if settings:
            logits = logits / settings["temperature"]
            logits = logits.masked_fill(logits < logits.topk(settings["top_k"]).values[:, -1:], -math.inf)
        reference = logits.log_softmax(-1)
        for i, entry in enumerate(out.logprobs):
            assert math.isclose(entry.logprob, reference[i, entry.token].item(), abs_tol=1e-4), i
            assert [token for token, _ in entry.top] == reference[i].topk(4).indices.tolist()[:len(entry.top)], i


@pytest.mark.parametrize("settings", [{}, SAMPLED])
def test_top_alternatives_are_sorted_and_hold_the_token(pairs, settings):
    for k in (0, 1, 7):
        out = speculative(pairs, torch.float32, "model", logprobs=k, seed=5, **settings)
        for entry in out.logprobs:
            values = [value for _, value in entry.top]
            # sampled: fewer where top-k and top-p keep fewer (-inf is no alternative)
            assert len(entry.top) == k if not settings else min(k, 1) <= len(entry.top) <= k
            assert values == sorted(values, reverse=True)
            assert all(math.isfinite(value) and value <= 0 for value in values + [entry.logprob])
            if k and not settings:  # greedy: the token is the most likely one
                assert entry.top[0] == (entry.token, entry.logprob)
    out = speculative(pairs, torch.float32, "model", logprobs=20, seed=5, **SAMPLED)
    assert all((entry.token, entry.logprob) in entry.top for entry in out.logprobs)


def test_logprobs_ride_the_steps_one_host_transfer(pairs):
    target, draft = pairs[torch.float32]
    counts = []
    for settings in ({"logprobs": 5}, {"logprobs": 5, **SAMPLED, "seed": 2}):
        with HostSyncs() as syncs:
            out = minispec.generate(target, PROMPT, draft=draft, gamma=3, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                    tree=None, **settings)
        counts.append((syncs.tolist, out.stats["target_calls"]))
    assert all(tolist == steps for tolist, steps in counts), counts


def test_none_asked_none_reported(pairs):
    target, draft = pairs[torch.float32]
    assert minispec.generate(target, PROMPT, draft=draft, max_new_tokens=4).logprobs is None
    assert all(chunk.logprobs is None for chunk in minispec.stream(target, PROMPT, draft="lookup", max_new_tokens=4))


def test_streamed_logprobs_are_the_generations(pairs):
    target, draft = pairs[torch.float32]
    chunks = list(minispec.stream(target, PROMPT, draft=draft, gamma=3, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                  logprobs=2))
    generation = chunks[-1].generation
    assert all([entry.token for entry in chunk.logprobs] == chunk.tokens for chunk in chunks)
    assert [entry for chunk in chunks for entry in chunk.logprobs] == generation.logprobs
    plain = minispec.generate(target, PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    assert generation.logprobs == plain.logprobs


def test_a_stop_cuts_the_logprobs_with_the_tokens(pairs):
    target, draft = pairs[torch.float32]
    plain = minispec.generate(target, PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    stop = plain.tokens[5]
    out = minispec.generate(target, PROMPT, draft=draft, gamma=4, max_new_tokens=NEW_TOKENS, stop_token_ids=[stop],
                            logprobs=1)
    assert out.tokens[-1] == stop and [entry.token for entry in out.logprobs] == out.tokens


@pytest.mark.parametrize("settings, message", [
    ({"logprobs": 21}, "logprobs must be None or an integer in [0, 20]"),
    ({"logprobs": -1}, "logprobs must be"),
    ({"logprobs": True}, "logprobs must be"),
    ({"logprobs": 2, "beams": 2}, "beam search reports its sequences' scores"),
])
def test_bad_logprobs_are_refused_naming_the_setting(pairs, settings, message):
    with pytest.raises(minispec.SettingError, match=message.replace("[", r"\[").replace("]", r"\]")) as error:
        minispec.generate(pairs[torch.float32][0], PROMPT, max_new_tokens=2, **settings)
    assert error.value.field == "logprobs"


def test_run_json_carries_them(pairs, tmp_path):
    directory = save_reference(make_reference("llama_gqa"), tmp_path / "target")
    result = run_cli("--target", str(directory), "--draft", "lookup", "--prompt-ids", ",".join(map(str, PROMPT)),
                     "--max-new-tokens", "6", "--logprobs", "2", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    plain = minispec.generate(minispec.load(directory), PROMPT, max_new_tokens=6, logprobs=2)
    assert out["logprobs"] == [{"token": e.token, "logprob": e.logprob, "top": [list(pair) for pair in e.top]}
                               for e in plain.logprobs]


# --- the server -------------------------------------------------------------------------------------------


def test_the_servers_logprobs_in_openais_shapes(checkpoints, alone):
    """Chat (logprobs + top_logprobs) and completions (logprobs), whole and streamed: the numbers
    generate gives alone, the tokens' text, a completion's top_logprobs holding its token."""
    greedy = {"temperature": 0, "max_tokens": 12}
    with serving(checkpoints, draft="model", rows=2) as client:
        chat = client.post("/v1/chat/completions", json={"messages": CHAT, "logprobs": True, "top_logprobs": 3,
                                                         **greedy}).json()
        chat_chunks = streamed(client, "/v1/chat/completions", {"messages": CHAT, "logprobs": True, **greedy})()
        completion = client.post("/v1/completions", json={"prompt": PROMPTS[1], "logprobs": 2, **greedy}).json()
        completion_chunks = streamed(client, "/v1/completions", {"prompt": PROMPTS[1], "logprobs": 2, **greedy})()
        plain = client.post("/v1/completions", json={"prompt": PROMPTS[1], **greedy}).json()
    tokenizer = alone[0].tokenizer
    chat_out = expected(alone, CHAT, draft=None, max_new_tokens=12, logprobs=3)
    content = chat["choices"][0]["logprobs"]["content"]
    assert [entry["logprob"] for entry in content] == [entry.logprob for entry in chat_out.logprobs]
    assert [entry["token"] for entry in content] == [tokenizer.decode([entry.token]) for entry in chat_out.logprobs]
    assert all(entry["bytes"] == list(entry["token"].encode()) and len(entry["top_logprobs"]) == 3 for entry in content)
    assert [[top["logprob"] for top in entry["top_logprobs"]] for entry in content] == \
        [[value for _, value in entry.top] for entry in chat_out.logprobs]
    streamed_content = [entry for chunk in chat_chunks if chunk.get("choices") and chunk["choices"][0]["logprobs"]
                        for entry in chunk["choices"][0]["logprobs"]["content"]]
    assert [entry["logprob"] for entry in streamed_content] == [entry["logprob"] for entry in content]
    assert all(entry["top_logprobs"] == [] for entry in streamed_content)  # top_logprobs absent: 0

    completion_out = expected(alone, PROMPTS[1], draft=None, max_new_tokens=12, logprobs=2)
    logprobs = completion["choices"][0]["logprobs"]
    texts = [tokenizer.decode([entry.token]) for entry in completion_out.logprobs]
    assert logprobs["tokens"] == texts and logprobs["token_logprobs"] == [e.logprob for e in completion_out.logprobs]
    assert logprobs["text_offset"] == [sum(map(len, texts[:i])) for i in range(len(texts))]
    # keyed by text: tokens whose text is alike (bytes of a broken character, each "\ufffd") share a key
    assert all(logprobs["top_logprobs"][i][token] == value and len(logprobs["top_logprobs"][i]) <= 3
               for i, (token, value) in enumerate(zip(texts, logprobs["token_logprobs"])))
    pieces = [chunk["choices"][0]["logprobs"] for chunk in completion_chunks if chunk.get("choices")]
    assert [value for piece in pieces if piece for value in piece["token_logprobs"]] == logprobs["token_logprobs"]
    assert [offset for piece in pieces if piece for offset in piece["text_offset"]] == logprobs["text_offset"]
    assert plain["choices"][0]["logprobs"] is None and plain["choices"][0]["text"] == completion["choices"][0]["text"]


def test_the_openai_client_reads_the_servers_logprobs(checkpoints, alone):
    app, scheduler = make_app(checkpoints, rows=2)
    sampled = {"temperature": 0.8, "seed": 4, "max_tokens": 10}
    with uvicorn_serving(app, scheduler) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        chat = client.chat.completions.create(model="tiny", messages=CHAT, logprobs=True, top_logprobs=2, **sampled)
        chunks = list(client.chat.completions.create(model="tiny", messages=CHAT, logprobs=True, top_logprobs=2,
                                                     stream=True, **sampled))
        completion = client.completions.create(model="tiny", prompt=PROMPTS[0], logprobs=1, **sampled)
    out = expected(alone, CHAT, max_new_tokens=10, logprobs=2, temperature=0.8, seed=4)
    content = chat.choices[0].logprobs.content
    assert [entry.logprob for entry in content] == [entry.logprob for entry in out.logprobs]
    assert [[top.logprob for top in entry.top_logprobs] for entry in content] == \
        [[value for _, value in entry.top] for entry in out.logprobs]
    streamed_content = [entry for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                        for entry in chunk.choices[0].logprobs.content]
    assert [entry.logprob for entry in streamed_content] == [entry.logprob for entry in content]
    completion_out = expected(alone, PROMPTS[0], max_new_tokens=10, logprobs=1, temperature=0.8, seed=4)
    assert completion.choices[0].logprobs.token_logprobs == [entry.logprob for entry in completion_out.logprobs]



@pytest.mark.parametrize("tree", [None, 4], ids=["chains", "trees"])
def test_a_batch_mixes_requests_with_and_without_logprobs(checkpoints, alone, monkeypatch, tree):
    """Rows that ask and rows that do not share steps; each gets what generate gives it alone."""
    steps = Steps(monkeypatch)
    bodies = [{"prompt": PROMPTS[0], "logprobs": 2, "temperature": 0.8, "seed": 1, "max_tokens": 12},
              {"prompt": PROMPTS[1], "temperature": 0, "max_tokens": 12},
              {"prompt": PROMPTS[3], "logprobs": 0, "temperature": 0, "max_tokens": 12}]
    with serving(checkpoints, draft="model", rows=3, tree=tree) as client:
        steps.hold()
        calls = [post(client, "/v1/completions", body) for body in bodies]
        steps.open_when(queued(client, 3))
        replies = [reply.json()["choices"][0] for reply in in_threads(calls)]
    assert any(len(batch) == 3 for batch in steps.batches)
    for body, reply in zip(bodies, replies):
        out = expected(alone, body["prompt"], draft="model", max_new_tokens=12, temperature=body["temperature"],
                       seed=body.get("seed"), logprobs=body.get("logprobs"), tree=tree)
        assert reply["text"] == out.text
        assert (reply["logprobs"] and reply["logprobs"]["token_logprobs"]) == \
            (out.logprobs and [entry.logprob for entry in out.logprobs])
