"""minispec.generate's contract around the decoding loops: what it refuses before any work, the seed,
statistics at a stop token, and one request per model at a time."""

import gc
import threading
from contextlib import contextmanager

import pytest
import torch
import transformers
from conftest import make_reference, save_reference
from hypothesis import HealthCheck, given
from hypothesis import settings as budget
from hypothesis import strategies as st

import minispec
from minispec.models.base import Feed
from minispec import api
from minispec.settings import SETTING_CHECKS

PROMPT = [5, 17, 33, 8, 90, 41, 2, 63, 12, 77, 3, 54]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_reference(make_reference("llama"), tmp_path_factory.mktemp("generate_llama"))


@pytest.fixture(scope="module")
def target(llama_dir):
    return minispec.load(llama_dir)


@pytest.fixture(scope="module")
def same(llama_dir):
    return minispec.load(llama_dir)


class CountingForward:
    """Wraps a model's forward and counts its calls."""

    def __init__(self, model, monkeypatch):
        self.calls, self.forward = 0, model.forward
        monkeypatch.setattr(model, "forward", self)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.forward(*args, **kwargs)


def test_a_path_as_draft_is_refused_with_what_to_do(target, llama_dir):
    with pytest.raises(ValueError, match=r"minispec\.load"):
        minispec.generate(target, PROMPT, draft=str(llama_dir))


def test_a_draft_on_another_device_fails_before_any_work(target, llama_dir, monkeypatch):
    draft = minispec.load(llama_dir).to("meta")  # a device other than the target's, on any machine
    forwards = CountingForward(target, monkeypatch)
    with pytest.raises(ValueError, match="the draft .* is on meta but the target .* is on cpu"):
        minispec.generate(target, PROMPT, draft=draft)
    assert forwards.calls == 0


def test_a_draft_with_a_shorter_context_fails_before_any_work(target, tmp_path, monkeypatch):
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, max_position_embeddings=32)
    short = minispec.load(save_reference(transformers.LlamaForCausalLM(config).eval(), tmp_path))
    forwards = CountingForward(target, monkeypatch)
    with pytest.raises(ValueError, match="exceeds the draft .* context of 32 tokens"):
        minispec.generate(target, PROMPT, draft=short, max_new_tokens=40)
    assert forwards.calls == 0
    assert len(minispec.generate(target, PROMPT, draft=short, max_new_tokens=20).tokens) == 20  # 12 + 20 fits


def test_without_a_seed_each_call_samples_afresh_and_stats_give_the_seed(target):
    first, second = (minispec.generate(target, PROMPT, temperature=1.0, max_new_tokens=40, ignore_eos=True)
                     for _ in range(2))
    assert first.tokens != second.tokens  # 40 tokens from a 96-token vocabulary: equal by chance ~never
    again = minispec.generate(target, PROMPT, temperature=1.0, max_new_tokens=40, ignore_eos=True,
                              seed=first.stats["seed"])
    assert again.tokens == first.tokens
    assert minispec.generate(target, PROMPT, temperature=1.0, max_new_tokens=8, seed=3).stats["seed"] == 3


def test_a_batch_takes_a_seed_per_prompt(target, same):
    """seed=[...] with a list of prompts: prompt i samples as it does alone with seed i (one seed for all
    draws alike for alike prompts, so a batch of one prompt is written many ways only with a seed each)."""
    for draft in (None, same):
        out = minispec.generate(target, [PROMPT] * 3, draft=draft, gamma=3, temperature=1.0, max_new_tokens=24,
                                ignore_eos=True, seed=[7, 8, 7])
        alone = [minispec.generate(target, PROMPT, draft=draft, gamma=3, temperature=1.0, max_new_tokens=24,
                                   ignore_eos=True, seed=seed).tokens for seed in (7, 8)]
        assert [o.tokens for o in out] == [alone[0], alone[1], alone[0]] and alone[0] != alone[1]
        assert [o.stats["seed"] for o in out] == [7, 8, 7]
    with pytest.raises(ValueError, match="seed: a list of seeds needs one per prompt, got 2 for 3 prompts"):
        minispec.generate(target, [PROMPT] * 3, seed=[1, 2])
    with pytest.raises(ValueError, match=r"prompt 1: seed must be an integer in \[0, 2\*\*63\) or None, got -1"):
        minispec.generate(target, [PROMPT] * 2, seed=[1, -1])
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*63\) or None, got \[1\]"):
        minispec.generate(target, PROMPT, seed=[1])  # one prompt, one seed


@pytest.mark.parametrize("gamma", [3, 5])
def test_statistics_count_only_the_guesses_emitted_before_a_stop_token(target, same, gamma):
    """The draft has the target's weights, so every guess is accepted; a stop token placed among the
    guesses of a block ends the output there, and the guesses after it are not counted."""
    plain = minispec.generate(target, PROMPT, max_new_tokens=30, ignore_eos=True)
    stop = plain.tokens[gamma + 2]  # the second guess of the second block
    first_stop = plain.tokens.index(stop)
    assert first_stop % (gamma + 1) < gamma - 1  # a guess with accepted guesses after it in its block
    original_eos = target.eos_token_ids
    target.eos_token_ids = (stop,)
    try:
        out = minispec.generate(target, PROMPT, draft=same, gamma=gamma, max_new_tokens=30)
    finally:
        target.eos_token_ids = original_eos
    assert out.tokens == plain.tokens[: first_stop + 1]
    emitted_guesses = sum(len(ids) for ids, kind in out.trace if kind == "accepted")
    stats = out.stats
    assert stats["accepted"] == emitted_guesses
    assert sum(n * count for n, count in enumerate(stats["accepted_lengths"])) == emitted_guesses
    assert stats["verified"] == emitted_guesses  # all were accepted: no rejected position was tested
    assert stats["acceptance_rate"] == 1.0
    assert stats["accepted_at"] == stats["verified_at"] and sum(stats["accepted_at"]) == emitted_guesses


@contextmanager
def running_in_another_thread(target, call):
    """Runs call() in a thread whose target forwards wait until the block ends; yields the list its
    result lands in."""
    inside, release = threading.Event(), threading.Event()
    forward = target.forward

    def blocking_forward(*args, **kwargs):
        inside.set()
        release.wait(timeout=30)
        return forward(*args, **kwargs)

    target.forward = blocking_forward
    results = []
    worker = threading.Thread(target=lambda: results.append(call()))
    worker.start()
    try:
        assert inside.wait(timeout=30)
        yield results
    finally:
        release.set()
        worker.join(timeout=60)
        del target.forward  # the class's own again


def test_a_model_in_use_by_another_thread_is_refused(target):
    """Two requests at once on one model would interleave writes to its one KV cache."""
    with running_in_another_thread(target, lambda: minispec.generate(target, PROMPT, max_new_tokens=4)) as results:
        with pytest.raises(RuntimeError, match="already generating"):
            minispec.generate(target, PROMPT, max_new_tokens=4)
    assert len(results) == 1 and len(results[0].tokens) == 4
    assert minispec.generate(target, PROMPT, max_new_tokens=4).tokens == results[0].tokens  # free again


def test_a_failed_request_frees_its_models(target, same, monkeypatch):
    def failing_forward(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("planted")

    with monkeypatch.context() as patch:
        patch.setattr(target, "forward", failing_forward)
        with pytest.raises(torch.cuda.OutOfMemoryError):
            minispec.generate(target, PROMPT, draft=same)
    assert target not in api.HOLDERS and same not in api.HOLDERS
    assert len(minispec.generate(target, PROMPT, draft=same, max_new_tokens=4).tokens) == 4


@pytest.fixture(scope="module")
def chatty(llama_with_tokenizer):
    """A target with a tokenizer, and the same weights as draft (every guess accepted)."""
    return minispec.load(llama_with_tokenizer), minispec.load(llama_with_tokenizer)


TEXT_PROMPT = "the cat sat"


def spanning_string(tokenizer, generation):
    """Three characters of the output around a token boundary past its middle: a string that spans
    tokens, the case that needs care."""
    tokens, text = generation.tokens, generation.text
    boundaries = [len(tokenizer.decode(tokens[:i])) for i in range(len(tokens) // 2, len(tokens))]
    return next(text[b - 1:b + 2] for b in boundaries if "\ufffd" not in text[b - 1:b + 2])


def shortest_prefix_containing(tokenizer, tokens, string):
    return next(m for m in range(1, len(tokens) + 1) if string in tokenizer.decode(tokens[:m], skip_special_tokens=True))


@pytest.mark.parametrize("draft", [None, "same", "lookup"])
def test_a_stop_string_ends_the_output_just_before_it(chatty, draft):
    """Even when it spans tokens and falls inside a run of accepted guesses: the text ends where the stop
    string begins, and no token after the one completing it is emitted."""
    target, same = chatty
    draft = same if draft == "same" else draft
    plain = minispec.generate(target, TEXT_PROMPT, max_new_tokens=60, ignore_eos=True)
    tokenizer = target.tokenizer
    stop = spanning_string(tokenizer, plain)
    first = plain.text.index(stop)
    m = shortest_prefix_containing(tokenizer, plain.tokens, stop)
    assert stop not in tokenizer.decode(plain.tokens[m - 1:m])
    out = minispec.generate(target, TEXT_PROMPT, draft=draft, gamma=8, max_new_tokens=60, ignore_eos=True,
                            stop=["no such string", stop])
    assert out.text == plain.text[:first]
    assert out.tokens == plain.tokens[:m]
    if draft is same:
        assert out.stats["accepted"] >= m - out.stats["target_calls"]  # the string came in runs of guesses


def test_stop_token_ids_end_the_output_like_eos(chatty):
    target, same = chatty
    plain = minispec.generate(target, TEXT_PROMPT, max_new_tokens=40, ignore_eos=True)
    token = plain.tokens[17]
    out = minispec.generate(target, TEXT_PROMPT, draft=same, max_new_tokens=40, ignore_eos=True,
                            stop_token_ids=[token])
    assert out.tokens == plain.tokens[: plain.tokens.index(token) + 1]


# (Sampled with a fixed gamma: with "auto" a step's number of guesses depends on measured times, and so
# does which random draws make which token: a seed then gives the same distribution, not the same tokens.)
@pytest.mark.parametrize("settings", [{}, {"draft": "same", "gamma": 3},
                                      {"draft": "same", "gamma": 3, "temperature": 1.0, "seed": 4},
                                      {"draft": "lookup", "stop": "t"}, {"draft": "same", "stop": "spanning"}])
def test_stream_yields_each_step_and_its_text_joins_to_the_output(chatty, settings):
    """Chunks' tokens and texts join to the Generation of the last chunk (which generate() gives too),
    no chunk's text has a broken character, and none runs past a stop string."""
    target, same = chatty
    settings = {**settings, "draft": same if settings.get("draft") == "same" else settings.get("draft")}
    if settings.get("stop") == "spanning":
        settings["stop"] = spanning_string(target.tokenizer, minispec.generate(target, TEXT_PROMPT, max_new_tokens=50,
                                                                               ignore_eos=True))
    expected = minispec.generate(target, TEXT_PROMPT, max_new_tokens=50, ignore_eos=True, **settings)
    chunks = list(minispec.stream(target, TEXT_PROMPT, max_new_tokens=50, ignore_eos=True, **settings))
    generation = chunks[-1].generation
    assert generation is not None and all(chunk.generation is None for chunk in chunks[:-1])
    assert generation.tokens == expected.tokens and generation.text == expected.text
    assert sum((chunk.tokens for chunk in chunks), []) == expected.tokens
    # Segments, read by name: the ids not rejected are the output, in the trace as in the chunks
    assert sum((s.ids for s in generation.trace if s.kind != "rejected"), []) == expected.tokens
    assert sum((s.ids for chunk in chunks for s in chunk.segments if s.kind != "rejected"), []) == expected.tokens
    # (A character broken at a chunk's end would decode as U+FFFD there, unlike in the whole text.)
    assert "".join(chunk.text for chunk in chunks) == expected.text
    assert len(chunks) - 1 == generation.stats["target_calls"]  # one chunk per step, then the summary
    if "stop" in settings:
        assert len(expected.text) < len(target.tokenizer.decode(expected.tokens))  # the stop string was cut
    assert any("\ufffd" in target.tokenizer.decode([t]) for t in expected.tokens)  # split characters were streamed


def test_stream_checks_its_settings_before_the_first_chunk(chatty):
    target, _ = chatty
    with pytest.raises(ValueError, match="top_p"):
        minispec.stream(target, TEXT_PROMPT, top_p=0)
    with pytest.raises(ValueError, match="stop strings must be non-empty"):
        minispec.stream(target, TEXT_PROMPT, stop=[""])
    with pytest.raises(ValueError, match="stop_token_ids"):
        minispec.generate(target, TEXT_PROMPT, stop_token_ids=[10**6])


def test_an_unfinished_stream_holds_its_models_until_closed_or_collected(target):
    """A stream claims its models while it runs; one left unfinished says so to the next call in its
    thread, and gives them back when closed, left by a `break`, or garbage collected."""
    chunks = minispec.stream(target, PROMPT, max_new_tokens=8)
    next(chunks)
    with pytest.raises(RuntimeError, match="unfinished call in this thread .* close()"):
        minispec.generate(target, PROMPT, max_new_tokens=4)
    chunks.close()
    expected = minispec.generate(target, PROMPT, max_new_tokens=4).tokens
    for _ in minispec.stream(target, PROMPT, max_new_tokens=8):
        break
    chunks = minispec.stream(target, PROMPT, max_new_tokens=8)
    next(chunks)
    del chunks
    gc.collect()
    assert minispec.generate(target, PROMPT, max_new_tokens=4).tokens == expected


def test_a_refused_call_leaves_the_caches_of_the_call_under_way_alone(target):
    """A batch call refused because another thread holds the model must not have resized its caches
    first: the request under way would go on in freshly zeroed ones."""
    expected = minispec.generate(target, PROMPT, max_new_tokens=6, ignore_eos=True).tokens
    call = lambda: minispec.generate(target, PROMPT, max_new_tokens=6, ignore_eos=True)  # noqa: E731
    with running_in_another_thread(target, call) as results:
        shape = target.cache_batch_size, target.cache_max_seq_len
        with pytest.raises(RuntimeError, match="already generating"):
            minispec.generate(target, [PROMPT] * 8, max_new_tokens=100)
        assert (target.cache_batch_size, target.cache_max_seq_len) == shape
    assert results[0].tokens == expected


@pytest.mark.parametrize("settings", [{}, {"draft": "same", "gamma": 3}, {"draft": "lookup", "tree": 4},
                                      {"draft": "same", "gamma": 3, "stop": True}])
@pytest.mark.parametrize("layers", [None, [0, 2]])
def test_on_states_gets_the_states_of_every_token_the_forwards_saw(target, same, settings, layers):
    """generate(on_states=...): per prompt, the tokens the target's forwards saw and kept, in order (the
    prompt, then the output but its last token, which no forward sees), and its states at each, those
    of one forward over the same tokens: the last (what the output head reads), or with state_layers
    those entering those layers; a stop token among accepted guesses cuts them at the output's end."""
    prompts = [PROMPT, PROMPT[:5]]
    settings = {**settings, "draft": same if settings.get("draft") == "same" else settings.get("draft")}
    if settings.pop("stop", False):  # the 6th token of each output, as a stop token
        settings["stop_token_ids"] = [o.tokens[5] for o in minispec.generate(target, prompts, max_new_tokens=12)]
    seen = {}
    out = minispec.generate(target, prompts, max_new_tokens=12, state_layers=layers, **settings,
                            on_states=lambda i, tokens, states: seen.setdefault(i, []).append((tokens, states)))
    for i, (prompt, generation) in enumerate(zip(prompts, out)):
        tokens = torch.cat([tokens for tokens, _ in seen[i]])
        assert tokens.tolist() == prompt + generation.tokens[:-1]
        target.ensure_caches(1, len(tokens))
        _, expected = target.decode_rows(Feed(tokens.view(1, -1), [0]), eager=True, hidden=tuple(layers or ()) or True)
        torch.testing.assert_close(torch.cat([states for _, states in seen[i]]), expected[0], rtol=1e-5, atol=1e-6)
    if "stop_token_ids" in settings:
        assert any(len(g.tokens) < 12 for g in out)
    streamed = []  # stream() takes them too
    for _ in minispec.stream(target, prompts[0], max_new_tokens=12, state_layers=layers, **settings,
                             on_states=lambda i, tokens, states: streamed.append((i, tokens, states))):
        pass
    assert [i for i, _, _ in streamed] == [0] * len(seen[0])
    assert all(torch.equal(a, b) for (_, a, _), (b, _) in zip(streamed, seen[0]))


@pytest.mark.parametrize("kwargs, message", [
    ({"seed": 2**70}, r"seed must be an integer in \[0, 2\*\*63\)"),
    ({"seed": "abc"}, "seed must be an integer"),
    ({"temperature": "1"}, "temperature must be a number >= 0"),
    ({"temperature": float("nan")}, "temperature must be a number >= 0"),
    ({"top_p": None}, r"top_p must be a number in \(0, 1\]"),
    ({"top_k": 2.0}, "top_k must be an integer"),
    ({"max_new_tokens": True}, "max_new_tokens must be an integer >= 1"),
    ({"draft": "lookup", "lenience": "0.5"}, r"lenience must be in \(0, 1\]"),
    ({"ignore_eos": "no"}, "ignore_eos must be True or False, got 'no'"),
    ({"stop": 5}, "stop must be a string or a list of strings, got 5"),
    ({"stop_token_ids": "5"}, "stop_token_ids must be a list of token ids, got '5'"),
    ({"beams": True}, "beams .* must be an integer >= 1"),
    ({"on_states": 5}, r"on_states must be a function \(i, tokens, states\), got 5"),
    ({"state_layers": [0]}, "state_layers says which states on_states receives: give on_states too"),
    ({"on_states": print, "beams": 2}, "on_states needs decoding without beams"),
    ({"on_states": print, "state_layers": [3]}, r"state_layers must be a list of layer indices in \[0, 2\], got \[3\]"),
    ({"on_states": print, "state_layers": []}, r"state_layers must be a list of layer indices"),
])
def test_bad_settings_are_named_before_any_work(target, kwargs, message):
    with pytest.raises(ValueError, match=message) as refused:
        minispec.generate(target, PROMPT, **kwargs)
    assert isinstance(refused.value, minispec.SettingError) and refused.value.field in kwargs


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": 1e-300}, "temperature must be a number >= 0"),  # would overflow the logits: every token 0
    ({"temperature": 5e-324}, "temperature must be a number >= 0"),  # a denormal
    ({"temperature": float("inf")}, "temperature must be a number >= 0"),
    ({"top_p": float("nan")}, "top_p must be a number"),
    ({"draft": "lookup", "lenience": float("inf")}, r"lenience must be in \(0, 1\]"),
    ({"stop_token_ids": [True]}, r"stop_token_ids must be a list of token ids, got \[True\]"),
    ({"stop_token_ids": [96]}, r"stop_token_ids must be token ids in \[0, 96\), got 96"),
    ({"draft": "lookup", "gamma": 10**9}, r"gamma .* must be 'auto' or an integer in \[1, 64\]"),
    ({"draft": "lookup", "gamma": True}, "gamma"),
    ({"seed": True}, "seed must be an integer"),
    ({"max_new_tokens": 8.0}, "max_new_tokens must be an integer"),
    ({"max_new_tokens": 10**12}, "exceeds"),
    ({"temperature": 1.0, "beams": 2}, "beam search is deterministic"),
    ({"draft_beams": 2}, "draft_beams .* needs a draft model"),
    ({"tree": 4}, "token trees need a drafter"),
])
def test_numbers_at_their_edges_are_refused_naming_their_setting(target, kwargs, message):
    with pytest.raises(minispec.SettingError, match=message) as refused:
        minispec.generate(target, PROMPT, **kwargs)
    assert refused.value.field == list(kwargs)[-1]


def test_an_unknown_setting_is_named(target):
    for call in (minispec.generate, minispec.stream):
        with pytest.raises(TypeError, match=f"{call.__name__}\\(\\) got an unknown setting 'temprature'"):
            call(target, PROMPT, temprature=1.0)


def test_settings_are_one_list_that_generate_and_stream_take(target):
    """Settings' fields are generate()'s and stream()'s keywords, with Settings' defaults."""
    defaults = minispec.Settings()
    assert (defaults.gamma, defaults.max_new_tokens, defaults.temperature, defaults.top_k, defaults.top_p,
            defaults.tree) == ("auto", 64, 0.0, 0, 1.0, "auto")
    out = minispec.generate(target, PROMPT, **{name: getattr(defaults, name) for name in SETTING_CHECKS})
    assert out.tokens == minispec.generate(target, PROMPT).tokens


def test_a_text_prompt_that_is_not_text_is_named(llama_with_tokenizer):
    model = minispec.load(llama_with_tokenizer)
    with pytest.raises(minispec.SettingError, match="lone surrogate") as refused:
        minispec.generate(model, "caf\udce9", max_new_tokens=2)
    assert refused.value.field == "prompt"


def test_load_takes_a_dtype_by_name(llama_dir):
    assert minispec.load(llama_dir, dtype="float32").dtype == torch.float32
    with pytest.raises(ValueError, match="dtype must be a torch.dtype or one of float32, bfloat16, float16, got 'int8"):
        minispec.load(llama_dir, dtype="int8")


ODD = st.one_of(st.none(), st.booleans(), st.floats(), st.integers(-2**70, 2**70), st.text(max_size=3),
                st.lists(st.integers(-2, 100), max_size=3))  # floats(): NaN, infinities and denormals too
VALUES = {
    "draft": st.sampled_from([None, "none", "lookup", "ngram"]),
    "gamma": st.one_of(st.just("auto"), st.integers(-1, 4), ODD),
    "max_new_tokens": st.one_of(st.integers(-1, 6), ODD),
    "temperature": st.one_of(st.floats(0, 2), ODD),
    "top_k": st.one_of(st.integers(-1, 100), ODD),
    "top_p": st.one_of(st.floats(0, 1), ODD),
    "seed": st.one_of(st.integers(-1, 2**64), ODD),
    "lenience": st.one_of(st.floats(0, 1), ODD),
    "ignore_eos": st.one_of(st.booleans(), ODD),
    "beams": st.one_of(st.integers(0, 3), ODD),
    "draft_beams": st.one_of(st.integers(0, 4), ODD),
    "stop": st.one_of(st.text(max_size=2), st.lists(st.text(max_size=2), max_size=2), ODD),
    "stop_token_ids": st.one_of(st.lists(st.integers(-1, 100), max_size=3), ODD),
    "tree": st.one_of(st.sampled_from(["auto", "off"]), st.integers(-1, 5), ODD),
    "logprobs": st.one_of(st.integers(-1, 25), ODD),
    "min_p": st.one_of(st.floats(0, 1), ODD),
    "presence_penalty": st.one_of(st.floats(-3, 3), ODD),
    "frequency_penalty": st.one_of(st.floats(-3, 3), ODD),
    "repetition_penalty": st.one_of(st.floats(0, 3), ODD),
    "n": st.one_of(st.integers(-1, 34), ODD),
    "coupling": st.one_of(st.sampled_from(["gumbel", "rejection"]), ODD),
}


@given(st.fixed_dictionaries({}, optional=VALUES))
@budget(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_every_setting_is_accepted_or_refused_naming_its_field(target, values):
    """Whatever the values, generate() works, or raises a SettingError that names one of them."""
    try:
        out = minispec.generate(target, PROMPT, **values)
    except minispec.SettingError as error:
        assert error.field in values, (error.field, str(error))
        return
    for one in out if isinstance(out, list) else [out]:  # n > 1: n answers
        assert 1 <= len(one.tokens) <= values.get("max_new_tokens", 64)
        assert all(0 <= token < target.vocab_size for token in one.tokens)


def test_state_layers_are_refused_outside_the_llama_family(reference_dirs):
    with pytest.raises(ValueError, match="state_layers reads states inside a Llama-family target; .* is not one"):
        minispec.generate(minispec.load(reference_dirs["gpt2"][1]), PROMPT, on_states=print, state_layers=[1])


@pytest.mark.parametrize("prompt, message", [
    (None, "a prompt is a text, a list of token ids or a 1-D tensor of them, got NoneType"),
    (b"abc", "got bytes"),
    ([1.0, 2.0], "prompt token ids must be integers, got 1.0"),  # not a batch of one-token prompts
    ([True, False], "prompt token ids must be integers, got True"),
    (torch.tensor([[1, 2], [3, 4]]), r"1-D token ids of an integer dtype, got shape \(2, 2\)"),  # not flattened
    (torch.tensor([1.0, 2.0]), "torch.float32"),
    ([[[1]]], "prompt 0: prompt token ids must be integers, got \\[1\\]"),
])
def test_a_prompt_of_the_wrong_kind_is_named(target, prompt, message):
    with pytest.raises(ValueError, match=message):
        minispec.generate(target, prompt, max_new_tokens=2)


def test_a_beam_width_too_large_for_memory_is_refused_before_allocating(target):
    """100000 beams: beam search's hypothesis comparisons alone would take hundreds of GiB."""
    with pytest.raises(ValueError, match="100000 cache row.* more than the .* GiB free; ask for fewer"):
        minispec.generate(target, PROMPT, beams=100000, max_new_tokens=4)
