"""`edgespec serve` / `edgespec.serve()`: an OpenAI-compatible local HTTP server with speculative decoding.

protocol.py (request validation, response shapes: no HTTP), worker.py (the one generation thread and
its bounded queue), app.py (the Starlette endpoints), runner.py (uvicorn; `Server`, `serve`). Needs
the optional extra: pip install 'edgespec[serve]'.
"""

from __future__ import annotations

from edgespec.server.protocol import ApiError, Defaults
from edgespec.server.runner import Server, host_warning, serve

__all__ = ["serve", "Server", "Defaults", "ApiError", "host_warning"]
