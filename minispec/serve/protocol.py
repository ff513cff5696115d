"""The OpenAI API's shapes: a request's JSON checked field by field into api.Requests, and the reply's bodies."""

import reprlib
import secrets
import time
from dataclasses import dataclass, replace
from itertools import accumulate

from .. import api
from ..loading.chat import RESERVED, ChatTemplateError, chat_prompt
from ..models.checks import FLAG, LIST, TABLE, Check, SettingError, is_integer, is_text
from ..settings import SETTING_CHECKS, is_grammar


class RequestError(Exception):
    """A refused request: its HTTP status and the OpenAI error body's message, param, type and code."""

    def __init__(self, status, message, param=None, kind="invalid_request_error", code=None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self):
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def invalid(message, param=None, code=None):
    return RequestError(400, message, param, code=code)


STRING = Check(is_text, "must be a string (of text: no lone surrogates)")
CHOICE = Check(lambda v: isinstance(v, (str, dict)), "must be a string or an object")
LOGPROBS = SETTING_CHECKS["logprobs"]
PROMPT = Check(lambda v: isinstance(v, (str, list)), "must be a string or a list of token ids")
ANSWERS = SETTING_CHECKS["n"]
ANY = Check(lambda v: True, "")

# The request's fields that are settings, as api.Settings' fields; each is checked by that field's check.
SETTINGS = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens", "temperature": "temperature",
            "top_p": "top_p", "seed": "seed", "stop": "stop",
            "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
            # the rest are minispec's (and vLLM's), not OpenAI's
            "top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty", "ignore_eos": "ignore_eos"}
# A request's grammar (Settings.grammar): OpenAI's response_format, or one of vLLM's fields for one kind.
GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_grammar": "grammar"}
GRAMMAR_FIELDS = {"response_format": Check(lambda v: is_grammar(v) and "type" in v, "must be {'type': 'text' | "
                                           "'json_object' | 'json_schema', 'json_schema': {'schema': SCHEMA}}"),
                  "guided_json": Check(lambda v: isinstance(v, (dict, str)), "must be an object or a string"),
                  "guided_regex": STRING, "guided_grammar": STRING}
SHARED = {"model": STRING, "stream": FLAG, "stream_options": TABLE, "n": ANSWERS, "user": STRING, "logit_bias": TABLE,
          **GRAMMAR_FIELDS,
          **{name: SETTING_CHECKS[setting] for name, setting in SETTINGS.items()
             if name != "max_completion_tokens"}}
FIELDS = {
    False: {**SHARED, "prompt": PROMPT, "echo": FLAG, "best_of": ANSWERS, "logprobs": LOGPROBS, "suffix": STRING},
    True: {**SHARED, "messages": LIST, "max_completion_tokens": SHARED["max_tokens"], "logprobs": FLAG,
           "top_logprobs": LOGPROBS, "tools": LIST, "tool_choice": CHOICE,
           "parallel_tool_calls": FLAG, "functions": LIST, "function_call": CHOICE, "store": FLAG, "metadata": TABLE,
           "service_tier": STRING, "modalities": LIST, "chat_template_kwargs": TABLE, "audio": TABLE,
           "moderation": ANY, "prediction": TABLE, "prompt_cache_key": STRING, "prompt_cache_options": TABLE,
           "prompt_cache_retention": STRING, "reasoning_effort": STRING, "safety_identifier": STRING,
           "verbosity": STRING, "web_search_options": TABLE},
}  # by whether the request is a chat
# Fields read only at a neutral value (or null): the values, and why. (parallel_tool_calls, metadata,
# prediction, safety_identifier and the prompt_cache ones take any value: they change no output here.)
NEUTRAL = {
    "echo": ((False,), "the prompt is not sent back"),
    "suffix": (("",), "no insertion"),
    "logit_bias": (({},), "no logit bias: it would change the target's distribution"),
    "tools": (([],), "no tool calls"),
    "tool_choice": (("none", "auto"), "no tool calls"),
    "functions": (([],), "no function calls"),
    "function_call": (("none", "auto"), "no function calls"),
    "store": ((False,), "replies are not stored"),
    "service_tier": (("auto", "default"), "one service tier"),
    "modalities": ((["text"],), "text output only"),
    "audio": ((), "text output only"),
    "moderation": ((), "no moderation"),
    "reasoning_effort": ((), "the model reasons as its template says"),
    "verbosity": (("medium",), "the model's own verbosity"),
    "web_search_options": ((), "no web search"),
}
ROLES = ("system", "user", "assistant")
ROLE = Check(lambda v: isinstance(v, str) and v in ROLES, f"must be one of {', '.join(ROLES)}")
# a message's content: text, or content parts' text (joined by line breaks, as vLLM joins them)
CONTENT = Check(lambda v: is_text(v) or isinstance(v, list) and all(
    isinstance(part, dict) and part.get("type") == "text" and is_text(part.get("text")) for part in v),
    "must be a string (of text: no lone surrogates) or a list of text parts ({'type': 'text', 'text': ...})")


@dataclass
class Parsed:
    requests: list  # api.Requests: best_of (or n) answers of the prompt, each with its own seed
    n: int  # the choices returned: the n of the requests' answers with the highest total log-probability
    stream: bool
    include_usage: bool
    logprobs: bool  # whether the reply shows them (best_of asks for them to rank the answers)


def parse(body, chat, scheduler, model_name):
    """A request's JSON body -> Parsed, or a RequestError naming the field at fault."""
    if not isinstance(body, dict):
        raise invalid(f"the body must be a JSON object, got {type(body).__name__}")
    check_fields(body, FIELDS[chat])
    model = body.get("model")
    if model is not None and model != model_name:
        raise RequestError(404, f"the model {model!r} does not exist; this server serves {model_name!r}", "model",
                           code="model_not_found")
    options = body.get("stream_options") or {}
    check_fields(options, {"include_usage": FLAG}, "stream_options.")
    target = scheduler.target
    prompt_field = "messages" if chat else "prompt"
    if chat:
        ids = chat_ids(target, body.get("messages"), scheduler.max_text, body.get("chat_template_kwargs") or {})
    else:
        ids = prompt_ids(target, body.get("prompt"), scheduler.max_text)
    max_field = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = new_tokens(target, ids, body.get(max_field), scheduler.max_length, prompt_field, max_field)
    given = {SETTINGS[name]: value for name, value in body.items() if name in SETTINGS and value is not None}
    n, best_of = body.get("n") or 1, body.get("best_of") or body.get("n") or 1
    if best_of < n:
        raise invalid(f"best_of ({best_of}) must be at least n ({n})", "best_of")
    if best_of > n and body.get("stream"):
        raise invalid("best_of > n cannot be streamed: the best answers are known at the end", "best_of")
    logprobs = logprobs_of(body, chat)
    grammar_field, grammar = grammar_of(body)
    try:
        # OpenAI's default temperature (1) and the request's settings over the server's (its draft, gamma and tree)
        settings = replace(scheduler.settings, **{"temperature": 1.0, **given, "max_new_tokens": max_tokens},
                           logprobs=0 if logprobs is None and best_of > n else logprobs, grammar=grammar)
        requests = [api.Request.from_settings(target, ids, replace(settings, seed=seed))
                    for seed in api.answers(settings.seed, best_of)]
    except SettingError as error:  # named by its request's field (none: the server's own settings)
        names = {"prompt": prompt_field, "max_new_tokens": max_field, "grammar": grammar_field,
                 "logprobs": "top_logprobs" if chat else "logprobs",
                 **{setting: name for name, setting in SETTINGS.items() if setting != "max_new_tokens"}}
        raise invalid(str(error), names.get(error.field)) from None
    return Parsed(requests, n, bool(body.get("stream")), bool(options.get("include_usage")), logprobs is not None)


def check_fields(body, fields, prefix=""):
    """Every field known, of its type (null is every field's default), and at its neutral value if it has one."""
    for name, value in body.items():
        if name not in fields:
            raise invalid(f"unrecognized request argument: {prefix}{name}", prefix + name)
        if value is None:
            continue
        checked(fields[name], prefix + name, value)
        if name in NEUTRAL:
            neutral, why = NEUTRAL[name]
            if not any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in neutral):  # 0 is no False
                raise invalid(f"{name}={reprlib.repr(value)} is not supported ({why})", name)


def checked(kind, name, value):
    """`value` checked to be `kind`, its refusal a bad request naming the field."""
    try:
        return kind(name, value)
    except SettingError as error:
        raise invalid(str(error), error.field) from None


def grammar_of(body):
    """(the field, Settings.grammar) a request asks for: response_format or a guided_* field (one at most)."""
    given = [name for name in GRAMMAR_FIELDS if body.get(name) is not None]
    if len(given) > 1:
        raise invalid(f"give one of {' and '.join(given)}: each constrains the output", given[1])
    field = given[0] if given else "response_format"
    return field, {GUIDED[field]: body[field]} if field in GUIDED else body.get(field)


def logprobs_of(body, chat):
    """A completion's logprobs=k, or a chat's logprobs: true with top_logprobs=k (0 when absent)."""
    if not chat:
        return body.get("logprobs")
    if not body.get("logprobs"):
        if body.get("top_logprobs"):
            raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
        return None
    return body.get("top_logprobs") or 0


def prompt_ids(target, prompt, max_text):
    """A completion's prompt: token ids, or text, special tokens' text in it plain text."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not is_text(prompt):
            raise invalid("prompt is not text: it holds a lone surrogate", "prompt")
        if len(prompt) > max_text:  # refused untokenized: tokenizing it took tens of MiB, left resident fragmented
            raise invalid(f"the prompt has {len(prompt)} characters: more than this server's context can hold "
                          f"({max_text})", "prompt", "context_length_exceeded")
        return target.tokenizer.encode(prompt, split_special_tokens=True)
    if not (isinstance(prompt, list) and all(is_integer(token) for token in prompt)):
        raise invalid("prompt must be a string or a list of token ids (one prompt per request)", "prompt")
    return prompt


def chat_ids(target, messages, max_text, variables):
    """A chat's prompt in the target's chat template, the messages' text plain text (it cannot end a turn and
    write another); `variables`: chat_template_kwargs (vLLM's field), the template's own variables."""
    taken = next((name for name in variables if name in RESERVED), None)
    if taken is not None:
        raise invalid(f"chat_template_kwargs.{taken} is set by the server, not by a request",
                      f"chat_template_kwargs.{taken}")
    if not messages:
        raise invalid("messages must be a list of at least one message", "messages")
    plain = [checked_message(message, f"messages[{i}]") for i, message in enumerate(messages)]
    characters = sum(len(message["content"]) for message in plain)
    if characters > max_text:  # refused unrendered and untokenized, as a completion's prompt
        raise invalid(f"the messages have {characters} characters: more than this server's context can hold "
                      f"({max_text})", "messages", "context_length_exceeded")
    try:
        return chat_prompt(target.tokenizer, plain, special_tokens_in_content=False, **variables)
    except ChatTemplateError as error:  # the template's own error (it refuses these messages), or none
        raise invalid(f"{target.name}: {error}; send a rendered prompt to /v1/completions", "messages") from None


def checked_message(message, where):
    checked(TABLE, where, message)
    role = checked(ROLE, f"{where}.role", message.get("role"))
    content = checked(CONTENT, f"{where}.content", message.get("content"))
    extra = next((key for key, value in message.items()
                  if key not in ("role", "content", "name") and value is not None), None)
    if extra is not None:
        raise invalid(f"{where}.{extra} is not supported", f"{where}.{extra}")
    return {"role": role, "content": content if isinstance(content, str) else "\n".join(p["text"] for p in content)}


def new_tokens(target, ids, asked, max_length, prompt_field, max_field):
    """max_tokens, checked against the room the prompt leaves in the server's context; by default all of it."""
    start = 1 if target.is_encoder_decoder else len(ids)  # tokens the decoder starts from
    room = max_length - start
    if len(ids) > max_length or room < 1:
        raise invalid(f"the prompt has {len(ids)} tokens: this server's context of {max_length} tokens has no room "
                      "for them and a new token", prompt_field, "context_length_exceeded")
    if is_integer(asked) and asked > room:
        raise invalid(f"{max_field} is {asked}, but the prompt's {len(ids)} tokens leave room for {room} new tokens in "
                      f"this server's context of {max_length}", max_field, "context_length_exceeded")
    return room if asked is None else asked


SPECULATIVE_STATS = ("gamma", "acceptance_rate", "alpha", "tokens_per_target_call", "target_calls",
                     "accepted_lengths", "guesses_histogram", "seed")


class Reply:
    """One request's reply bodies and stream chunks; `speculative` is minispec's field: how the draft did."""

    def __init__(self, chat, model_name, draft_name, prompt_tokens, tokenizer):
        self.chat, self.model_name, self.draft_name, self.prompt_tokens = chat, model_name, draft_name, prompt_tokens
        self.tokenizer = tokenizer
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self.offsets = {}  # by choice: a completion's characters of token text so far, its logprobs' text_offset

    def head(self, kind):
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_name}

    def whole(self, chosen, outcomes):
        """The body: the chosen outcomes as choices; usage counts all of them (best_of's others too)."""
        choices = []
        for i, outcome in enumerate(chosen):
            output = {"message": {"role": "assistant", "content": outcome.text}} if self.chat else {"text": outcome.text}
            choices.append({"index": i, **output, "logprobs": self.logprobs(outcome.logprobs, i),
                            "finish_reason": outcome.finish_reason})
        return {**self.head("chat.completion" if self.chat else "text_completion"), "choices": choices,
                "usage": self.usage(outcomes), "speculative": self.speculative(chosen[0])}

    def chunk(self, output, finish_reason=None, logprobs=None, index=0):
        return {**self.head("chat.completion.chunk" if self.chat else "text_completion"),
                "choices": [{"index": index, **output, "logprobs": self.logprobs(logprobs, index),
                             "finish_reason": finish_reason}]}

    def logprobs(self, entries, index=0):
        """OpenAI's logprobs of a choice or chunk for these TokenLogprobs (None: not asked): a chat's
        content list, or a completion's parallel lists, whose top_logprobs also hold the token itself."""
        if entries is None:
            return None
        if self.chat:
            return {"content": [{**self.token(e.token, e.logprob),
                                 "top_logprobs": [self.token(*pair) for pair in e.top]} for e in entries],
                    "refusal": None}
        texts = [self.tokenizer.decode([e.token]) for e in entries]
        offsets = list(accumulate(map(len, texts), initial=self.offsets.get(index, 0)))
        self.offsets[index] = offsets.pop()
        return {"tokens": texts, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self.tokenizer.decode([token]): value for token, value in [*e.top, e[:2]]}
                                 for e in entries], "text_offset": offsets}

    def token(self, token, logprob):
        text = self.tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def piece(self, text, logprobs=None, index=0):
        """A stream's chunk of text, with the log-probabilities of its step's tokens (whose text may lag)."""
        return self.chunk({"delta": {"content": text}} if self.chat else {"text": text}, logprobs=logprobs, index=index)

    def ending(self, outcome, index=0):
        """A stream's last chunk of a choice's text: why it ended, and how the draft did."""
        chunk = self.chunk({"delta": {}} if self.chat else {"text": ""}, outcome.finish_reason, index=index)
        return {**chunk, "speculative": self.speculative(outcome)}

    def usage_chunk(self, outcomes):
        return {**self.head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": self.usage(outcomes)}

    def usage(self, outcomes):
        """Of every answer decoded (the prompt once: its forward is shared)."""
        completion = sum(outcome.completion_tokens for outcome in outcomes)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": outcomes[0].stats.get("cached_tokens", 0)}}

    def speculative(self, outcome):
        stats = outcome.stats
        return {"draft": self.draft_name, **{key: stats[key] for key in SPECULATIVE_STATS if key in stats}}
