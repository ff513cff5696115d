"""The server's n and best_of, log-probabilities, penalties and seed through the official openai client
(issue 64): each choice is what minispec.generate gives its seed alone."""

import openai

from minispec.api import answers
from test_serve import CHAT, PROMPTS, alone, checkpoints, expected, make_app, uvicorn_serving  # noqa: F401 (fixtures)

SAMPLED = {"temperature": 1.2, "max_tokens": 8, "seed": 5}
ALONE = {"temperature": 1.2, "max_new_tokens": 8}


def total(generation):
    return sum(entry.logprob for entry in generation.logprobs)


def test_n_best_of_logprobs_penalties_and_seed_with_the_openai_client(checkpoints, alone):
    app, scheduler = make_app(checkpoints, rows=4)
    with uvicorn_serving(app, scheduler) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        chat = client.chat.completions.create(model="tiny", messages=CHAT, n=3, **SAMPLED)
        chunks = list(client.chat.completions.create(model="tiny", messages=CHAT, n=2, stream=True,
                                                     stream_options={"include_usage": True},
                                                     extra_body={"ignore_eos": True}, **SAMPLED))
        best = client.completions.create(model="tiny", prompt=PROMPTS[0], n=2, best_of=4, **SAMPLED)
        every = client.completions.create(model="tiny", prompt=PROMPTS[0], n=4, logprobs=2, **SAMPLED)
        top = client.chat.completions.create(model="tiny", messages=CHAT, logprobs=True, top_logprobs=3, **SAMPLED)
        penalized = client.chat.completions.create(model="tiny", messages=CHAT, presence_penalty=0.8,
                                                   frequency_penalty=0.5, **SAMPLED)
        greedy = client.completions.create(model="tiny", prompt=PROMPTS[1], n=2, temperature=0, max_tokens=8)

    chat_answers = [expected(alone, CHAT, seed=seed, **ALONE) for seed in answers(5, 3)]
    assert [choice.index for choice in chat.choices] == [0, 1, 2]
    assert [choice.message.content for choice in chat.choices] == [answer.text for answer in chat_answers]
    assert len({answer.text for answer in chat_answers}) > 1
    assert chat.usage.completion_tokens == sum(len(answer.tokens) for answer in chat_answers)

    streamed = [expected(alone, CHAT, seed=seed, ignore_eos=True, **ALONE) for seed in answers(5, 2)]
    pieces = [chunk.choices[0] for chunk in chunks if chunk.choices]
    order = [piece.index for piece in pieces if piece.delta.content]
    assert order != sorted(order), order  # the answers' chunks interleave, step by step
    for i, answer in enumerate(streamed):
        assert "".join(piece.delta.content or "" for piece in pieces if piece.index == i) == answer.text
        assert [piece.finish_reason for piece in pieces if piece.index == i and piece.finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 16

    # best_of 4: the 2 answers of the highest total log-probability, best first, without the log-probabilities
    # nobody asked for; usage counts all 4
    four = [expected(alone, PROMPTS[0], seed=seed, logprobs=2, **ALONE) for seed in answers(5, 4)]
    ranked = sorted(four, key=lambda answer: -total(answer))
    assert [choice.text for choice in best.choices] == [answer.text for answer in ranked[:2]]
    assert [choice.index for choice in best.choices] == [0, 1] and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == sum(len(answer.tokens) for answer in four)
    for choice, answer in zip(every.choices, four):  # n = 4 with logprobs: each choice's own
        assert choice.text == answer.text
        assert choice.logprobs.token_logprobs == [entry.logprob for entry in answer.logprobs]
        assert choice.logprobs.text_offset[0] == 0

    top_answer = expected(alone, CHAT, seed=5, logprobs=3, **ALONE)
    content = top.choices[0].logprobs.content
    assert [entry.logprob for entry in content] == [entry.logprob for entry in top_answer.logprobs]
    assert [len(entry.top_logprobs) for entry in content] == [len(entry.top) for entry in top_answer.logprobs]
    assert penalized.choices[0].message.content == expected(alone, CHAT, seed=5, presence_penalty=0.8,
                                                            frequency_penalty=0.5, **ALONE).text
    assert greedy.choices[0].text == greedy.choices[1].text == expected(alone, PROMPTS[1], max_new_tokens=8).text
