"""Chat templates: ChatML rendering, the fallback format, message validation, and the sandbox."""

from __future__ import annotations

from pathlib import Path

import jinja2
import pytest

from edgespec.chat import ChatTemplateError, InvalidMessagesError, render_chat
from edgespec.errors import EdgespecError

# tokenizer.chat_template of SmolLM2-135M-Instruct (copied from its GGUF).
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SMOLLM2_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


def test_smollm2_chatml() -> None:
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "2+2?"}]
    assert render_chat(SMOLLM2_TEMPLATE, msgs) == (
        SMOLLM2_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")


def test_smollm2_system_message_and_no_generation_prompt() -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    out = render_chat(SMOLLM2_TEMPLATE, msgs, add_generation_prompt=False)
    assert out == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


def test_hf_environment_features() -> None:
    """trim_blocks/lstrip_blocks, bos/eos variables, tojson, strftime_now, loop controls."""
    template = (
        "{{ bos_token }}\n"
        "{% for m in messages %}\n"
        "  {% if m.role == 'skip' %}{% continue %}{% endif %}\n"
        "[{{ m.role }}] {{ m.content }}{{ eos_token }}\n"
        "{% endfor %}\n"
        "{{ messages[0] | tojson }}|{{ strftime_now('%Y') | length }}"
    )
    msgs = [{"role": "user", "content": "é"}, {"role": "skip", "content": "x"}]
    out = render_chat(template, msgs, bos_token="<s>", eos_token="</s>")
    assert out == '<s>\n[user] é</s>\n{"role": "user", "content": "é"}|4'


def test_message_content_is_data_not_template() -> None:
    out = render_chat(SMOLLM2_TEMPLATE, [{"role": "user", "content": "{{ 7*7 }} {% if 1 %}x{% endif %}"}])
    assert "{{ 7*7 }} {% if 1 %}x{% endif %}" in out and "49" not in out


def test_fallback_format() -> None:
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert render_chat(None, msgs) == "system: S\nuser: U\nassistant: "
    assert render_chat(None, msgs, add_generation_prompt=False) == "system: S\nuser: U\n"


@pytest.mark.parametrize(("messages", "needle"), [
    ("hello", "list of dicts"),
    ([], "empty"),
    (["hello"], "messages[0] must be a dict"),
    ([{"role": "user"}], "messages[0]['content'] must be a str (got missing)"),
    ([{"role": "user", "content": "a"}, {"role": None, "content": "b"}], "messages[1]['role'] must be a str"),
    ([{"role": "user", "content": 3}], "(got int)"),
])
@pytest.mark.parametrize("template", [None, SMOLLM2_TEMPLATE])
def test_invalid_messages(messages: object, needle: str, template: str | None) -> None:
    with pytest.raises(InvalidMessagesError) as info:
        render_chat(template, messages)  # type: ignore[arg-type]
    assert needle in str(info.value)
    assert isinstance(info.value, EdgespecError)


@pytest.mark.parametrize(("template", "needle"), [
    ("{% for m in messages %}", "does not compile"),
    ("{{ raise_exception('only user/assistant roles\nare supported') }}", "only user/assistant roles are supported"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{{ messages.append({'role': 'x'}) }}", "unsafe"),  # the sandbox is immutable
    ("{{ messages[0].update(role='x') }}", "unsafe"),
    ("{{ 'x' * 2 ** 40 }}", "too large"),
    ("{{ 9 ** 9999999 }}", "too large"),
    ("{{ range(10 ** 9) | list }}", "MAX_RANGE"),
])
def test_template_failures_are_one_line_errors(template: str, needle: str) -> None:
    with pytest.raises(ChatTemplateError) as info:
        render_chat(template, [{"role": "user", "content": "hi"}])
    message = str(info.value)
    assert needle in message and "\n" not in message


# Each payload would create MARKER (a directory) if it escaped the sandbox.
ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('mkdir MARKER').read() }}",
    "{{ cycler.__init__.__globals__.os.mkdir('MARKER') }}",
    "{{ joiner.__init__.__globals__.os.mkdir('MARKER') }}",
    "{{ namespace.__init__.__globals__.os.mkdir('MARKER') }}",
    "{{ lipsum.__globals__['os'].mkdir('MARKER') }}",
    "{{ lipsum['__globals__']['os'].mkdir('MARKER') }}",
    "{{ self._TemplateReference__context.cycler.__init__.__globals__.os.mkdir('MARKER') }}",
    "{{ raise_exception.__globals__['__builtins__']['__import__']('os').mkdir('MARKER') }}",
    "{{ strftime_now.__globals__.datetime.__class__ }}",
    "{{ (messages | attr('__class__')).__base__.__subclasses__() }}",
    "{{ '{0.__class__.__base__}'.format(messages) }}",
    "{% set x = cycler.__init__ %}{{ x.__globals__.os.mkdir('MARKER') }}",
    "{% for m in messages %}{{ m.__class__ }}{% endfor %}",
]


@pytest.mark.parametrize("payload", ESCAPES)
def test_sandbox_escapes_raise_and_run_nothing(payload: str, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    template = payload.replace("MARKER", str(marker))
    with pytest.raises(ChatTemplateError) as info:
        render_chat(template, [{"role": "user", "content": "hi"}])
    assert "unsafe" in str(info.value) and "\n" not in str(info.value)
    assert not marker.exists()


def test_escape_payload_is_live_outside_the_sandbox(tmp_path: Path) -> None:
    """Control: the same payload in a plain jinja2 Environment does run (so the test above means something)."""
    marker = tmp_path / "pwned"
    payload = "{{ cycler.__init__.__globals__.os.mkdir('MARKER') }}".replace("MARKER", str(marker))
    jinja2.Environment().from_string(payload).render()
    assert marker.is_dir()


@pytest.mark.real
def test_malicious_template_inside_a_gguf(tmp_path: Path, smollm2_path: Path) -> None:
    """A model file whose tokenizer.chat_template tries to run a command: chat() refuses, nothing runs."""
    from gguf_fixtures import build_tiny_llama

    import edgespec

    marker = tmp_path / "pwned"
    payload = ("{% for m in messages %}{{ m.content }}{% endfor %}"
               "{{ cycler.__init__.__globals__.os.popen('mkdir MARKER').read() }}").replace("MARKER", str(marker))
    path = build_tiny_llama(tmp_path / "evil.gguf", vocab_source=smollm2_path, chat_template=payload)
    with edgespec.load(str(path), drafter=None, n_ctx=256) as engine:
        assert engine.target.metadata("tokenizer.chat_template") == payload
        with pytest.raises(ChatTemplateError, match="unsafe"):
            engine.chat([{"role": "user", "content": "hi"}], max_tokens=4)
        assert not marker.exists()
        assert engine.generate("hi", max_tokens=2).tokens  # the engine is still usable
