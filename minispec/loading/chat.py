"""Chat prompts: messages rendered by the checkpoint's chat template (a Jinja program) as the reference's
apply_chat_template renders it: jinja2's sandbox with its options, extensions, globals and filters."""

import datetime
import functools
import json
import re

import jinja2
import jinja2.ext
import jinja2.sandbox

NO_TEMPLATE = "the checkpoint has no chat template; use the prompt as plain text (run.py --no-chat)"
PRIVATE_USE = range(0xF0000, 0x110000)  # Unicode's supplementary private use planes: characters texts do not hold


class ChatTemplateError(ValueError):
    """A chat template that is missing or fails; the message names the template's error."""


class Generation(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %}, the reference's mark of the assistant's text (for training): its body."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def raise_exception(message):
    raise jinja2.TemplateError(message)


def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # The reference's: unlike Jinja's own, it neither escapes HTML characters nor sorts keys.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(format):
    return datetime.datetime.now().strftime(format)


ENVIRONMENT = jinja2.sandbox.ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, Generation])
ENVIRONMENT.filters["tojson"] = tojson
ENVIRONMENT.globals |= {"raise_exception": raise_exception, "strftime_now": strftime_now}


@functools.lru_cache(maxsize=8)
def compiled(template):
    return ENVIRONMENT.from_string(template)


def render(template, messages, add_generation_prompt=True, **variables):
    """The text of `messages` in the chat `template` (Jinja source) as the reference's apply_chat_template gives it."""
    if template is None:
        raise ChatTemplateError(NO_TEMPLATE)
    if not messages:
        raise ValueError("a chat needs at least one message")
    for message in messages:
        if not (isinstance(message.get("role"), str) and isinstance(message.get("content"), str)):
            raise ValueError(f"a chat message needs a string role and content, got {message!r}")
    try:  # the reference passes tools and documents always, None when there are none
        return compiled(template).render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **variables)
    except Exception as error:  # a template is a program: whatever compiling or running it raises is its own error
        line = f" at line {error.lineno}" if isinstance(error, jinja2.TemplateSyntaxError) else ""
        raise ChatTemplateError(f"the chat template failed ({type(error).__name__}{line}): "
                                f"{' '.join(str(error).split())}") from None


# What chat_prompt renders a template with and its own arguments: not template variables a caller sets.
RESERVED = ("messages", "tools", "documents", "add_generation_prompt", "tokenizer", "conversation", "system",
            "special_tokens_in_content")


def chat_prompt(tokenizer, conversation, system=None, special_tokens_in_content=False, **variables):
    """Token ids of a conversation (the user's text or the messages so far, after `system`) ready for the
    assistant's answer; `variables` go to the template. "<|im_end|>" typed in a message is those characters, not
    the token, so a user cannot write turns of their own; special_tokens_in_content=True reads it as the reference."""
    taken = next((name for name in variables if name in RESERVED), None)
    if taken is not None:
        raise ValueError(f"the chat template's variable {taken!r} is chat_prompt's to set")
    messages = [{"role": "system", "content": system}] if system is not None else []
    if isinstance(conversation, str):
        messages.append({"role": "user", "content": conversation})
    elif isinstance(conversation, list) and all(isinstance(m, dict) for m in conversation):
        messages += conversation
    else:
        raise ValueError(f"a chat is the user's text or a list of messages (dicts with role and content), "
                         f"got {type(conversation).__name__}")
    variables = special_tokens(tokenizer) | variables
    specials = {} if special_tokens_in_content else {tokenizer.added[i]["content"]: tokenizer.added[i]
                                                     for i in tokenizer.special_ids}
    masks = masked_specials(tokenizer.chat_template, messages, specials)
    if masks:
        pattern = re.compile("|".join(map(re.escape, sorted(masks, key=len, reverse=True))))  # longest first
        messages = mapped(messages, lambda text: pattern.sub(lambda match: masks[match[0]], text))
    text = render(tokenizer.chat_template, messages, **variables)
    return encoded(tokenizer, text, specials, {ord(mask): special for special, mask in masks.items()})


def user_turn_start(tokenizer):
    """Token ids of a chat up to the user's first message, which a chat model continues with one of its own (Magpie)."""
    template = tokenizer.chat_template
    mark = next(free_characters(template or ""))
    text = render(template, [{"role": "user", "content": mark}], add_generation_prompt=False, **special_tokens(tokenizer))
    if mark not in text:
        raise ChatTemplateError("the chat template does not write the user's message")
    return tokenizer.encode(text[:text.index(mark)], add_special_tokens=False)


def special_tokens(tokenizer):
    """The special tokens' text that the reference gives templates (bos_token, eos_token)."""
    ids = {"bos_token": tokenizer.bos_token_id, "eos_token": tokenizer.eos_token_id}
    return {name: tokenizer.decode([i]) for name, i in ids.items() if i is not None}


def free_characters(*texts):
    """Private-use characters that none of `texts` holds."""
    used = set().union(*texts)
    return (c for c in map(chr, PRIVATE_USE) if c not in used)


def mapped(value, function):
    """`value` (messages: dicts, lists and strings) with `function` applied to every string in it."""
    if isinstance(value, str):
        return function(value)
    if isinstance(value, dict):
        return {key: mapped(item, function) for key, item in value.items()}
    return [mapped(item, function) for item in value] if isinstance(value, (list, tuple)) else value


def masked_specials(template, messages, specials):
    """{text: mask}: a character of its own for each special token's text in the messages, plain text once rendered."""
    texts = []
    mapped(messages, texts.append)
    found = [special for special in specials if any(special in text for text in texts)]
    return dict(zip(found, free_characters(template or "", *texts)))


def encoded(tokenizer, text, specials, unmask):
    """Token ids of a rendered chat: the template's special tokens as tokens, the text between them as plain text."""
    if not unmask:  # then this is what the reference does
        return tokenizer.encode(text, add_special_tokens=False)
    # Cut where the tokenizer cuts the text too: at the template's special tokens, with the spaces they strip.
    splitter = re.compile("(" + "|".join(
        ("\\s*" if token.get("lstrip") else "") + re.escape(content) + ("\\s*" if token.get("rstrip") else "")
        for content, token in sorted(specials.items(), key=lambda item: len(item[0]), reverse=True)) + ")")
    ids = []
    for n, piece in enumerate(splitter.split(text)):  # text, special token, text, ..., text
        if n % 2:
            ids += tokenizer.encode(piece, add_special_tokens=False)
        elif piece:
            ids += tokenizer.encode(piece.translate(unmask), add_special_tokens=False, split_special_tokens=True)
    return ids
