"""`edgespec serve --history`: what one client's request may draft from (and its timing reveal) of
another's. A live server on the tiny GGUF target with the history drafter at a fixed γ, greedy, so
a request's draft statistics are deterministic: a request that learned nothing from earlier ones
drafts exactly as the first, cold, request did; one that drew on a history accepts more."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import edgespec
from edgespec.engine import Engine
from edgespec.errors import EdgespecError
from edgespec.server import Server
from edgespec.server.isolation import resolve_mode

pytestmark = pytest.mark.real  # the tiny target copies the fetched SmolLM2's tokenizer

KEYS = ("key-alice", "key-bob")
PROMPT = "The lighthouse keeper wrote in his log every night, and on the last page he wrote"


@pytest.fixture
def engine(tiny_target: Path) -> Iterator[Engine]:
    with edgespec.load(str(tiny_target), "history", n_ctx=2048, threads=1, num_draft=4) as e:
        yield e


def _ask(url: str, key: str | None, user: str | None = None) -> dict:
    body = {"prompt": PROMPT, "max_tokens": 48, "temperature": 0, "num_draft": 4}
    if user is not None:
        body["user"] = user
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    return {"text": out["choices"][0]["text"], **out["timings"]}


def _drafting(t: dict) -> tuple:
    return t["text"], t["draft_n"], t["draft_n_accepted"]


def _clear(url: str, key: str | None, user: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(url + "/v1/history/clear", json={"user": user} if user else None, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_session_keeps_clients_apart(engine: Engine) -> None:
    with Server(engine, port=0, api_key=KEYS, history="session") as srv:
        a1 = _ask(srv.url, KEYS[0])
        b1 = _ask(srv.url, KEYS[1])  # the same prompt from another client: as cold as a1 was
        assert _drafting(b1) == _drafting(a1) and b1["cache_n"] == a1["cache_n"] == 0
        a2 = _ask(srv.url, KEYS[0])  # alice again: her own history helps; bob's request dropped the cache
        assert a2["text"] == a1["text"] and a2["draft_n_accepted"] > a1["draft_n_accepted"]
        assert a2["cache_n"] == 0
        # the `user` field subdivides a key: a new user under alice's key is cold again
        assert _drafting(_ask(srv.url, KEYS[0], user="carol")) == _drafting(a1)
        assert httpx.get(srv.url + "/health").json()["history"] == "session"


def test_global_shares_one_history(engine: Engine) -> None:
    """The control: without isolation bob drafts from alice's request (so the session test can fail)."""
    with Server(engine, port=0, api_key=KEYS, history="global") as srv:
        a1 = _ask(srv.url, KEYS[0])
        b1 = _ask(srv.url, KEYS[1])
        assert b1["text"] == a1["text"] and b1["draft_n_accepted"] > a1["draft_n_accepted"]
        assert b1["cache_n"] > 0  # the cached prompt is shared too


def test_clear_on_request_forgets_the_callers_history_only(engine: Engine) -> None:
    with Server(engine, port=0, api_key=KEYS, history="session") as srv:
        a1 = _ask(srv.url, KEYS[0])
        b1 = _ask(srv.url, KEYS[1])
        assert _clear(srv.url, KEYS[0]) == {"object": "history.cleared", "history": "session"}
        assert _drafting(_ask(srv.url, KEYS[0])) == _drafting(a1)  # alice: cold again
        assert _ask(srv.url, KEYS[1])["draft_n_accepted"] > b1["draft_n_accepted"]  # bob kept his
        r = httpx.post(srv.url + "/v1/history/clear", headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401


def test_off_remembers_nothing_across_requests(engine: Engine) -> None:
    with Server(engine, port=0, history="off") as srv:
        a1 = _ask(srv.url, None)
        a2 = _ask(srv.url, None)
        assert _drafting(a2) == _drafting(a1)
        assert a2["cache_n"] == 0  # nor is the cached prompt: every request is a client of its own
        assert httpx.get(srv.url + "/health").json()["history"] == "off"


def test_one_local_client_keeps_its_history_by_default(engine: Engine) -> None:
    with Server(engine, port=0) as srv:  # loopback, no key: auto is session, one client
        assert srv.history == "session"
        a1 = _ask(srv.url, None)
        assert _ask(srv.url, None)["draft_n_accepted"] > a1["draft_n_accepted"]


def test_auto_mode_and_bad_values() -> None:
    assert resolve_mode("auto", 0, loopback=True) == "session"
    assert resolve_mode("auto", 2, loopback=False) == "session"
    assert resolve_mode("auto", 0, loopback=False) == "off"  # anyone on the network, one index: no
    assert resolve_mode("global", 0, loopback=False) == "global"
    with pytest.raises(EdgespecError, match="--history is 'everyone'"):
        resolve_mode("everyone", 0, True)


def test_bad_keys_and_user_fields(engine: Engine) -> None:
    with pytest.raises(EdgespecError, match="--api-key is empty"):
        Server(engine, port=0, api_key=("a", " "))
    with pytest.raises(EdgespecError, match="twice"):
        Server(engine, port=0, api_key=("a", "a"))
    with Server(engine, port=0) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "user": 7}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "user"


def test_cli_refuses_a_bad_history_mode_before_loading(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from edgespec.cli import app as cli

    result = CliRunner().invoke(cli.app, ["serve", "--target", str(tmp_path / "x.gguf"), "--history", "all"])
    assert result.exit_code == 1
    [line] = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert line.startswith("error: ") and "--history is 'all'" in line  # the missing target is never reached
