"""Chat prompts: messages wrapped in the checkpoint's chat template, without a template engine.

Checkpoint chat templates are Jinja programs. minispec renders the ChatML family (SmolLM, SmolLM2,
Qwen2, Qwen2.5), recognised by its parts in the template's source:

    <|im_start|>system\\n{system}<|im_end|>\\n       the template's default system prompt, if it has one,
                                                 when the conversation does not start with its own
    <|im_start|>{role}\\n{content}<|im_end|>\\n      every message
    <|im_start|>assistant\\n                       the generation prompt

Any other template is refused with an error, rather than rendered differently from the reference.
"""

import re

NEWLINE = r"(?:\n|\\n)"  # a template's string literals hold newlines as such or as the escape \n
MESSAGE = re.compile(  # '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'
    r"'<\|im_start\|>' \+ message(?:\['role'\]|\.role) \+ '" + NEWLINE + r"' \+ message(?:\['content'\]|\.content)"
    r" \+ '<\|im_end\|>(?:' \+ '" + NEWLINE + "|" + NEWLINE + ")'"
)
GENERATION_PROMPT = re.compile(  # {% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}
    r"add_generation_prompt %\}\s*\{\{-?\s*'<\|im_start\|>assistant" + NEWLINE + r"'\s*-?\}\}"
)
DEFAULT_SYSTEM = re.compile(r"'<\|im_start\|>system" + NEWLINE + r"((?:[^'\\]|\\.)*?)<\|im_end\|>" + NEWLINE + "'")
# Parts of other templates that this renderer would silently leave out.
UNSUPPORTED = ("bos_token", "eos_token", "<think>", "enable_thinking", "is string")
ESCAPES = {"n": "\n", "t": "\t", "'": "'", '"': '"', "\\": "\\"}


class ChatTemplateError(ValueError):
    """A chat template minispec cannot render; the message says what to do instead."""


def unescape(literal):
    return re.sub(r"\\(.)", lambda m: ESCAPES.get(m[1], m[0]), literal)


def default_system_prompt(template):
    """The system prompt a ChatML template adds to conversations without one ('' for none); raises
    ChatTemplateError for a template that is not ChatML as minispec renders it."""
    if template is None:
        raise ChatTemplateError("the checkpoint has no chat template; use the prompt as plain text (run.py --no-chat)")
    supported = (MESSAGE.search(template) and GENERATION_PROMPT.search(template)
                 and not any(part in template for part in UNSUPPORTED))
    defaults = {unescape(literal) for literal in DEFAULT_SYSTEM.findall(template)}
    if not supported or len(defaults) > 1:
        raise ChatTemplateError(
            "the checkpoint's chat template is not one minispec can render (it renders the ChatML templates of "
            "SmolLM, SmolLM2, Qwen2 and Qwen2.5); use the prompt as plain text (run.py --no-chat), or render "
            "the template yourself and pass the resulting text"
        )
    return defaults.pop() if defaults else ""


def render(template, messages, add_generation_prompt=True):
    """The text of `messages` ([{"role": ..., "content": ...}]) in a ChatML `template`, as the
    reference's apply_chat_template(messages, tokenize=False) gives it."""
    return "".join(text for text, _ in rendered_parts(template, messages, add_generation_prompt))


def rendered_parts(template, messages, add_generation_prompt=True):
    """render's text in parts, each (text, whether it comes from a message): the template's own
    markers, and each message's role and content between them."""
    system = default_system_prompt(template)
    if not messages:
        raise ValueError("a chat needs at least one message")
    for message in messages:
        if not (isinstance(message.get("role"), str) and isinstance(message.get("content"), str)):
            raise ValueError(f"a chat message needs a string role and content, got {message!r}")
    if system and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system}, *messages]
    parts = []
    for m in messages:
        parts += [("<|im_start|>", False), (f"{m['role']}\n{m['content']}", True), ("<|im_end|>\n", False)]
    return parts + [("<|im_start|>assistant\n", False)] if add_generation_prompt else parts


def chat_prompt(tokenizer, conversation, system=None, special_tokens_in_content=False):
    """Token ids of a conversation ready for the assistant's answer. `conversation` is the user's text,
    or the messages so far ([{"role": "system" | "user" | "assistant", "content": ...}], as apps keep
    them); `system`, if given, goes first. Special tokens come from the template, so none are added.

    A message's text is encoded as plain text: "<|im_end|>" typed in it is those characters, not the
    token that ends a turn, so a user cannot write turns of their own. (The template's markers are
    special tokens in the checkpoints this renders, which the reference cuts out of the text first
    too: for messages without such text, the ids are the reference's.) special_tokens_in_content=True
    reads special tokens in messages too, as the reference's apply_chat_template does."""
    messages = [{"role": "system", "content": system}] if system is not None else []
    if isinstance(conversation, str):
        messages.append({"role": "user", "content": conversation})
    elif isinstance(conversation, list) and all(isinstance(m, dict) for m in conversation):
        messages += conversation
    else:
        raise ValueError(f"a chat is the user's text or a list of messages (dicts with role and content), "
                         f"got {type(conversation).__name__}")
    parts = rendered_parts(tokenizer.chat_template, messages)
    if special_tokens_in_content:
        return tokenizer.encode("".join(text for text, _ in parts), add_special_tokens=False)
    return encoded(tokenizer, parts)


def user_turn_start(tokenizer):
    """Token ids of a chat up to where the user's first message starts (the template's default system
    prompt, then the user's turn marker): what a chat model continues with a user's message of its
    own (Magpie, Xu et al. 2024: how minispec.heads writes prompts to train on)."""
    parts = rendered_parts(tokenizer.chat_template, [{"role": "user", "content": ""}], add_generation_prompt=False)
    return encoded(tokenizer, parts[:-1])  # all but the end of the (empty) message


def encoded(tokenizer, parts):
    """rendered_parts' token ids: the template's markers are special tokens, a message's text never."""
    return [i for text, from_message in parts
            for i in tokenizer.encode(text, add_special_tokens=False, split_special_tokens=from_message)]
