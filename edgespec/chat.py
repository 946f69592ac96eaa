"""Chat templates: messages → prompt text, rendered from a GGUF's `tokenizer.chat_template`.

A chat template is code that ships inside a model file, so it runs in jinja2's immutable sandbox
(the environment Hugging Face transformers uses: trim_blocks, lstrip_blocks, `raise_exception`,
`strftime_now`, a `tojson` filter). Any template failure — a syntax error, `raise_exception`, an
unsafe attribute such as `__class__` or `_TemplateReference__context`, an oversized repetition —
becomes one `ChatTemplateError` line; nothing outside the sandbox runs.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from jinja2 import Template
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from edgespec.errors import EdgespecError

# Results a template may build with `*` or `**` (a model file should not be able to exhaust memory
# or spin the CPU while we render a prompt).
_MAX_REPEAT = 1 << 20
_MAX_POW_BITS = 4096


class ChatTemplateError(EdgespecError):
    """A chat template failed to compile or render, or tried to leave the sandbox."""


class InvalidMessagesError(EdgespecError, ValueError):
    """`messages` is not a list of {"role": str, "content": str} dicts."""


class _Sandbox(ImmutableSandboxedEnvironment):
    """Immutable sandbox that fails loudly: jinja2's default turns an unsafe attribute into a silent
    Undefined (so `{{ x.__class__ }}` renders as ""); we raise instead, so a hostile template is
    reported, not half-rendered."""

    intercepted_binops = frozenset({"*", "**"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__} object is unsafe")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 \
                    and right * max(abs(left).bit_length(), 1) > _MAX_POW_BITS:
                raise SecurityError(f"{left} ** {right} is too large for a chat template")
            return left**right
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > _MAX_REPEAT:
                raise SecurityError(f"repeating a {type(seq).__name__} {n} times is too large for a chat template")
        return left * right


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template raised an error: {_one_line(message)}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> _Sandbox:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=8)
def _compiled(template: str) -> Template:
    """The template compiled once per template text, so compiling is not a fixed cost of every chat
    turn before its first token (a failure is not cached: it raises each time)."""
    return _environment().from_string(template)


def _one_line(text: object, limit: int = 200) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def validate_messages(messages: object) -> list[dict[str, Any]]:
    """Check that `messages` is a list of dicts with str "role" and "content"; return plain copies.

    Raises:
        InvalidMessagesError naming the first bad message.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InvalidMessagesError(f"messages must be a list of dicts (got {type(messages).__name__})")
    if not messages:
        raise InvalidMessagesError("messages is empty (need at least one {'role': ..., 'content': ...})")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise InvalidMessagesError(f"messages[{i}] must be a dict (got {type(m).__name__})")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                got = "missing" if key not in m else type(m[key]).__name__
                raise InvalidMessagesError(f"messages[{i}][{key!r}] must be a str (got {got})")
        out.append(dict(m))
    return out


def render_chat(template: str | None, messages: list[dict], *, bos_token: str = "", eos_token: str = "",
                add_generation_prompt: bool = True) -> str:
    """Render a conversation into prompt text.

    Args:
        template: a Jinja2 chat template (e.g. GGUF `tokenizer.chat_template`), rendered in a
            sandbox with the variables `messages`, `bos_token`, `eos_token`, `add_generation_prompt`.
            None uses the fallback format: one "role: content" line per message, then
            "assistant: " when `add_generation_prompt` is set (bos/eos tokens are not added).
        messages: [{"role": "system"|"user"|"assistant"|..., "content": str}, ...]; other keys
            are passed through to the template.
        bos_token, eos_token: the model's BOS/EOS token text, for templates that write them.
        add_generation_prompt: end with the header that starts the assistant's reply.

    Returns:
        The prompt text (special tokens as text: tokenize it with parse_special=True).

    Raises:
        InvalidMessagesError: `messages` is malformed.
        ChatTemplateError: the template does not compile, raises, or touches an unsafe attribute.
    """
    msgs = validate_messages(messages)
    if template is None:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in msgs)
        return text + ("assistant: " if add_generation_prompt else "")
    if not isinstance(template, str):
        raise ChatTemplateError(f"chat template must be a str (got {type(template).__name__})")
    try:
        compiled = _compiled(template)
    except TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile (line {e.lineno}): {_one_line(e.message)}") from None
    except (TemplateError, ArithmeticError, TypeError, ValueError, RecursionError) as e:
        raise ChatTemplateError(f"chat template does not compile: {_one_line(e)}") from None
    try:
        return compiled.render(messages=msgs, bos_token=bos_token, eos_token=eos_token,
                               add_generation_prompt=add_generation_prompt)
    except ChatTemplateError:
        raise
    except SecurityError as e:
        raise ChatTemplateError(f"chat template blocked by the sandbox: {_one_line(e)}") from None
    # The template is untrusted code: whatever it raises (TypeError, ZeroDivisionError, ...) is its fault.
    except Exception as e:
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {_one_line(e)}") from None


def chat_prompt(target: Any, messages: list[dict]) -> tuple[str, bool]:
    """The conversation rendered with `target`'s chat template (None: a plain fallback), and
    whether the tokenizer should still add BOS (not when the template wrote it)."""
    text_of = target.vocab_fingerprint().token_text
    bos = text_of(target.bos_id) if target.bos_id is not None else ""
    eos = text_of(target.eos_id) if target.eos_id is not None else ""
    text = render_chat(target.metadata("tokenizer.chat_template"), messages, bos_token=bos, eos_token=eos)
    return text, not (bos and text.startswith(bos))
