"""edgespec: lossless speculative decoding for local LLMs (llama.cpp, MLX).

    import edgespec
    with edgespec.load("smollm2", drafter="ngram") as engine:
        print(engine.generate("Hello", max_tokens=64).text)
"""

from __future__ import annotations

from edgespec.api import load
from edgespec.engine import Engine
from edgespec.errors import EdgespecError
from edgespec.generation import Chunk, Generation
from edgespec.sampling import SamplingParams
from edgespec.stats import Stats

__version__ = "0.1.0"
__all__ = ["load", "serve", "Engine", "Chunk", "Generation", "Stats", "SamplingParams", "EdgespecError",
           "__version__"]


def __getattr__(name: str) -> object:
    # `serve` loads on first use: `import edgespec` stays free of the server (uvicorn, starlette: extra `serve`)
    if name == "serve":
        from edgespec.server import serve

        return serve
    raise AttributeError(f"module 'edgespec' has no attribute {name!r}")
