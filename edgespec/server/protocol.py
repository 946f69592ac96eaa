"""The OpenAI wire format: request bodies → validated `GenRequest`s, engine results → response dicts.

Pure functions and dataclasses (no HTTP, no engine): the app parses with these, the worker runs the
request, and these shape what goes back. Field names follow OpenAI's chat/completions API; the
`timings` object follows llama-server's (prompt_n, predicted_per_second, draft_n, ...), plus τ.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from edgespec.errors import EdgespecError
from edgespec.sampling import InvalidSamplingError, SamplingParams
from edgespec.schedule.scheduler import check_num_draft
from edgespec.stats import Stats

MAX_BODY = 1 << 20  # bytes; a larger body is refused with 413
MAX_STOPS = 16
MAX_USER = 256  # characters of the OpenAI `user` field (it names a history scope: edgespec.server.isolation)
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}  # engine finish_reason → OpenAI's


class ApiError(EdgespecError):
    """A request the server refuses, as OpenAI's error object: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Defaults:
    """What a request gets for a field it omits (the server's --temp, --max-tokens, ... flags)."""

    max_tokens: int = 4096
    temperature: float = 0.7
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    num_draft: int | str | None = None  # None: the engine's own

    def __post_init__(self) -> None:
        SamplingParams(self.temperature, self.top_k, self.top_p, self.min_p)
        if self.max_tokens < 1:
            raise EdgespecError(f"max_tokens must be >= 1 (got {self.max_tokens})")
        if self.num_draft is not None:
            check_num_draft(self.num_draft)


@dataclass(frozen=True)
class GenRequest:
    """One validated generation request: what to run (`kind`, `messages` or `prompt`) and how."""

    kind: str  # "chat" or "completion"
    messages: list[dict[str, Any]] | None = None
    prompt: str | list[int] | None = None
    options: dict[str, Any] = field(default_factory=dict)  # keyword arguments for Engine.stream
    stream: bool = False
    include_usage: bool = False
    id: str = ""
    created: int = 0
    user: str = ""  # OpenAI's end-user id: subdivides the caller's history scope


def parse_json(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object (400 otherwise)."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object (got {type(data).__name__})")
    return data


def parse_request(kind: str, data: dict[str, Any], defaults: Defaults) -> GenRequest:
    """Validate a /v1/chat/completions (kind "chat") or /v1/completions ("completion") body.

    Unknown fields are ignored, as OpenAI's clients expect. Raises ApiError (400) naming the field.
    """
    n = data.get("n", 1)
    if n is not None and (isinstance(n, bool) or n != 1):
        raise ApiError(400, f"only n = 1 is supported (got n = {n!r})", param="n")
    if kind == "chat":
        messages, prompt = _messages(data.get("messages")), None
    else:
        messages, prompt = None, _prompt(data.get("prompt"))
    stream = _flag(data, "stream")
    opts = data.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options")
    include_usage = bool(stream and opts.get("include_usage"))
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    return GenRequest(kind, messages, prompt, _options(data, defaults), stream, include_usage,
                      f"{prefix}-{uuid.uuid4().hex[:24]}", int(time.time()), parse_user(data))


def parse_user(data: dict[str, Any]) -> str:
    """The optional `user` field: a string of at most MAX_USER characters ("" when absent)."""
    user = data.get("user")
    if user is None:
        return ""
    if not isinstance(user, str) or len(user) > MAX_USER:
        raise ApiError(400, f"user must be a string of at most {MAX_USER} characters", param="user")
    return user


def _flag(data: dict[str, Any], name: str) -> bool:
    value = data.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be true or false (got {value!r})", param=name)
    return value


def _messages(messages: object) -> list[dict[str, Any]]:
    """OpenAI messages → [{"role", "content": str}, ...]; content parts of type "text" are joined."""
    if messages is None:
        raise ApiError(400, "missing required field 'messages'", param="messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a string 'role'", param="messages")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", param="messages")
            content = "".join(p["text"] for p in content)
        elif not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts",
                           param="messages")
        out.append({"role": m["role"], "content": content})
    return out


def _prompt(prompt: object) -> str | list[int]:
    """A string, a list of one string, or a list of token ids."""
    if prompt is None:
        raise ApiError(400, "missing required field 'prompt'", param="prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "prompt is empty", param="prompt")
        return prompt
    if (isinstance(prompt, list) and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)):
        return list(prompt)
    raise ApiError(400, "prompt must be a non-empty string, a list of one string, or a list of token ids "
                        "(several prompts at once are not supported)", param="prompt")


def _number(data: dict[str, Any], name: str, default: Any, integer: bool = False) -> Any:
    value = data.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and value != int(value)):
        raise ApiError(400, f"{name} must be {'an integer' if integer else 'a number'} (got {value!r})", param=name)
    return int(value) if integer else float(value)


def _options(data: dict[str, Any], d: Defaults) -> dict[str, Any]:
    """Engine.stream keyword arguments; each sampling value checked by SamplingParams itself."""
    sampling = {"temperature": _number(data, "temperature", d.temperature),
                "top_k": _number(data, "top_k", d.top_k, integer=True),
                "top_p": _number(data, "top_p", d.top_p),
                "min_p": _number(data, "min_p", d.min_p)}
    for name, value in sampling.items():  # one at a time, so the error names its field
        try:
            SamplingParams(**{name: value})
        except InvalidSamplingError as e:
            raise ApiError(400, str(e), param=name) from None
    limit_field = "max_completion_tokens" if data.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(data, limit_field, d.max_tokens, integer=True)
    if max_tokens < 1:
        raise ApiError(400, f"{limit_field} must be >= 1 (got {max_tokens})", param=limit_field)
    seed = _number(data, "seed", d.seed, integer=True)
    stop = data.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(isinstance(s, str) for s in stops):
        raise ApiError(400, f"stop must be a string or a list of at most {MAX_STOPS} strings", param="stop")
    num_draft = data.get("num_draft", d.num_draft)
    if num_draft is not None:
        try:
            num_draft = check_num_draft(num_draft)
        except EdgespecError as e:
            raise ApiError(400, str(e), param="num_draft") from None
    return {**sampling, "max_tokens": max_tokens, "seed": seed, "stop": tuple(stops), "num_draft": num_draft}


# -- responses ---------------------------------------------------------------------------------------


def finish_reason(engine_reason: str) -> str:
    """eos / stop → "stop", length → "length"."""
    return FINISH.get(engine_reason, "stop")


def usage(stats: Stats) -> dict[str, int]:
    return {"prompt_tokens": stats.n_prompt, "completion_tokens": stats.n_tokens,
            "total_tokens": stats.n_prompt + stats.n_tokens}


def timings(stats: Stats, drafting: bool) -> dict[str, float | int]:
    """llama-server's timings object; draft_n / draft_n_accepted only when a drafter is loaded (as
    llama-server omits them without one), and edgespec's τ (tokens per target forward pass)."""
    prompt_ms, predicted_ms = stats.t_prefill * 1000, stats.t_decode * 1000
    n_eval, n_out = stats.n_prompt_evaluated, stats.n_tokens
    out: dict[str, float | int] = {
        "cache_n": stats.n_prompt - n_eval,
        "prompt_n": n_eval, "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / n_eval if n_eval else 0.0,
        "prompt_per_second": n_eval / stats.t_prefill if stats.t_prefill > 0 else 0.0,
        "predicted_n": n_out, "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / n_out if n_out else 0.0,
        "predicted_per_second": stats.tok_per_s,
    }
    if drafting:
        out.update(draft_n=stats.n_drafted, draft_n_accepted=stats.n_accepted)
    out["tau"] = stats.tau
    return out


def response(req: GenRequest, model: str, text: str, reason: str, stats: Stats, drafting: bool) -> dict[str, Any]:
    """The non-streamed answer (chat.completion or text_completion)."""
    if req.kind == "chat":
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "logprobs": None, "finish_reason": finish_reason(reason)}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason(reason)}
    obj = "chat.completion" if req.kind == "chat" else "text_completion"
    return {"id": req.id, "object": obj, "created": req.created, "model": model, "choices": [choice],
            "usage": usage(stats), "timings": timings(stats, drafting)}


def chunk(req: GenRequest, model: str, text: str | None, reason: str | None = None, *, first: bool = False,
          stats: Stats | None = None, drafting: bool = False) -> dict[str, Any]:
    """One streamed chunk. `text` None with `stats`: the usage chunk (no choices) that
    stream_options.include_usage asks for; the chunk with a finish_reason carries `timings`."""
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    out: dict[str, Any] = {"id": req.id, "object": obj, "created": req.created, "model": model}
    if text is None:
        out["choices"] = []
    else:
        reason_out = finish_reason(reason) if reason else None
        if req.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {}
            if text and not first:
                delta["content"] = text
            out["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason_out}]
        else:
            out["choices"] = [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason_out}]
    if stats is not None:
        if text is None:
            out["usage"] = usage(stats)
        out["timings"] = timings(stats, drafting)
    return out


def sse(obj: dict[str, Any] | str) -> bytes:
    """One server-sent event: `data: <json>` (or a literal such as [DONE]) and a blank line."""
    payload = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {payload}\n\n".encode()
