"""`edgespec serve`: the model behind an OpenAI-compatible HTTP API (edgespec.server)."""

from __future__ import annotations

from typing import Annotated

import typer

from edgespec.cli.options import RunOptions, run_options

_PANEL = "Server"


@run_options(temp=0.7, max_tokens=4096, drafter="history")
def serve(
    opts: RunOptions,
    host: Annotated[str, typer.Option(
        "--host", help="Address to listen on. The default serves this machine only; any other (0.0.0.0: "
                       "every interface) prints a warning: set --api-key then.", rich_help_panel=_PANEL)] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port.", rich_help_panel=_PANEL)] = 8080,
    api_key: Annotated[list[str] | None, typer.Option(
        "--api-key", envvar="EDGESPEC_API_KEY", help="Require `Authorization: Bearer KEY` on every endpoint "
                                                     "but /health. Repeat it for several clients: each key "
                                                     "is a client with its own history (EDGESPEC_API_KEY: "
                                                     "keys separated by spaces).", rich_help_panel=_PANEL)] = None,
    history: Annotated[str, typer.Option(
        "--history", help="What a request may draft from earlier requests (the history drafter's index, "
                          "and cached prompts): 'global' (one for all), 'session' (one per client: API key "
                          "+ the request's `user` field; caches dropped between clients), 'off' (nothing "
                          "across requests), or 'auto': session, but off when listening beyond this "
                          "machine without --api-key. POST /v1/history/clear forgets yours.",
        rich_help_panel=_PANEL)] = "auto",
    queue: Annotated[int, typer.Option(
        "--queue", min=0, help="Most requests waiting behind the running one; beyond it 503 + Retry-After.",
        rich_help_panel=_PANEL)] = 8,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API.

    POST /v1/chat/completions and /v1/completions (streamed or not), GET /v1/models
    and /health. One generation at a time, the others wait in a bounded queue. The
    sampling flags are the defaults for requests that omit those fields. The default
    drafter is 'history' (it also drafts from earlier requests: see --history).
    Ctrl-C stops.
    """
    from edgespec.server import Defaults
    from edgespec.server.runner import import_uvicorn
    from edgespec.server.runner import serve as run_server

    opts.check()
    from edgespec.server.isolation import resolve_mode
    resolve_mode(history, 0, True)  # a bad --history is one line, before the model loads
    import_uvicorn()  # before the model loads: a missing extra is one line, at once
    defaults = Defaults(max_tokens=opts.max_tokens, temperature=opts.temp, top_k=opts.top_k, top_p=opts.top_p,
                        min_p=opts.min_p, seed=opts.seed, num_draft=opts.gamma)
    with opts.load(price=False) as engine:  # priced (or left to learn) by run_server
        run_server(engine=engine, host=host, port=port, api_key=api_key or None, queue=queue, history=history,
                   defaults=defaults, access_log=opts.verbose)
