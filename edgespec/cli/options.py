"""The flags every generating command (generate, chat, demo) shares, declared once.

`@run_options(**defaults)` adds them to a typer command's signature and hands the command one
frozen `RunOptions`; per-command defaults (chat's temperature 0.7) are the only variation.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Annotated, Any, get_type_hints

import typer

from edgespec.errors import EdgespecError

if TYPE_CHECKING:
    from edgespec.engine import Engine


@dataclass(frozen=True)
class RunOptions:
    """The model, drafter and sampling flags every generating command takes."""

    target: str | None = None
    drafter: str = "ngram"
    backend: str = "llama.cpp"
    num_draft: str = "auto"
    tree: str = "off"
    temp: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    threads: int | None = None
    ctx: int = 4096
    gpu_layers: int = 0
    no_spec: bool = False
    verbose: bool = False

    def check(self) -> None:
        """Reject bad values before any model is loaded."""
        from edgespec.drafters.registry import BACKENDS
        from edgespec.sampling import SamplingParams
        from edgespec.schedule.scheduler import check_num_draft

        SamplingParams(self.temp, self.top_k, self.top_p, self.min_p)
        if self.backend not in BACKENDS:
            raise EdgespecError(f"--backend must be one of {', '.join(BACKENDS)} (got {self.backend!r})")
        try:
            check_num_draft(self.num_draft)
        except EdgespecError:
            raise EdgespecError(f"--num-draft must be 'auto' or an integer >= 0 (got {self.num_draft!r})") from None
        from edgespec.tree_step import check_tree

        try:
            check_tree(self.tree)
        except EdgespecError as e:
            raise EdgespecError(f"--{e}") from None
        if check_tree(self.tree, self.gamma) == "auto" and self.gamma != "auto":
            raise EdgespecError(f"--tree auto prices trees under -k auto; with a fixed -k {self.gamma} use --tree N "
                                "(trees of up to N nodes every cycle)")
        for flag, value, low in (("--max-tokens", self.max_tokens, 1),
                                 ("--ctx", self.ctx, 16), ("--threads", self.threads, 1)):
            if value is not None and value < low:
                raise EdgespecError(f"{flag} must be >= {low} (got {value})")

    def load(self, price: bool = True, learn: bool = True) -> Engine:
        """The Engine for these options (no drafter with --no-spec or --drafter none), priced at load
        (`price`), except a target with no cached cost profile when `learn`: its first reply learns
        its costs instead (session.price_engine)."""
        from edgespec.cli import ui
        from edgespec.session import load

        self.check()
        drafter = None if self.no_spec else self.drafter
        return load(self.target, drafter, backend=self.backend, num_draft=self.gamma, tree=self.tree, note=ui.status,
                    price=price,
                    learn=learn, n_ctx=self.ctx, threads=self.threads, n_gpu_layers=self.gpu_layers,
                    verbose=self.verbose)

    def sampling(self) -> dict[str, Any]:
        """Keyword arguments for Engine.stream / stream_chat."""
        return dict(max_tokens=self.max_tokens, temperature=self.temp, top_k=self.top_k, top_p=self.top_p,
                    min_p=self.min_p, seed=self.seed, num_draft=self.gamma, speculative=not self.no_spec)

    @property
    def gamma(self) -> int | str:
        """--num-draft as the engine takes it: an int, or "auto"."""
        from edgespec.schedule.scheduler import check_num_draft

        return check_num_draft(self.num_draft)


_PANEL = "Model and sampling"
_FLAGS: dict[str, tuple[tuple[str, ...], str]] = {
    "target": (("--target",), "Target model: GGUF path or known name (default: smollm2; see `edgespec models list`); "
                               "with --backend mlx also an mlx-lm model directory."),
    "drafter": (("--drafter",), "Drafter: 'ngram' (prompt lookup; 'ngram:N_MAX:N_MIN' sets the n-gram sizes, default 4:2), "
                                "'history' (lookup in earlier prompts and replies too: 'history\\[:MAX_TOKENS]\\[@CORPUS]'), "  # \[: not rich markup
                                "a same-vocabulary GGUF path or model name, "
                                "a head GGUF (EAGLE-3, DFlash, DSpark), 'mtp' (the target's own MTP layers: a "
                                "Qwen3.5/3.6 GGUF that kept them), a Gemma-4 assistant GGUF, 'none', or a chain of "
                                "these separated by "
                                "commas ('ngram,MODEL': each cycle verifies the best member's proposal)."),
    "backend": (("--backend",), "Runtime: 'llama.cpp' or 'mlx' (mlx-lm models; a GGUF target/drafter is "
                                "converted to MLX once and cached; needs `pip install 'edgespec\\[mlx]'`)."),  # \[: not rich markup
    "num_draft": (("--num-draft", "-k"), "γ: draft tokens per cycle, or 'auto': chosen each cycle from measured "
                                         "costs and acceptance (0 = plain steps when speculation would lose)."),
    "tree": (("--tree",), "Draft trees: 'off'; 'auto': under -k auto each cycle verifies a tree or the chain, whichever "
                          "is priced faster (sampled: only draft models', DFlash/DSpark heads' and n-gram trees); or N: every cycle verifies a tree of up to N "
                          "nodes and depth γ in one forward (needs a fixed -k). Drafters with trees: draft models, "
                          "n-gram, Medusa, EAGLE-3/DFlash/DSpark heads."),
    "temp": (("--temp",), "Temperature (0 = greedy)."),
    "top_k": (("--top-k",), "Keep the k most likely tokens (0 = off)."),
    "top_p": (("--top-p",), "Nucleus sampling mass in (0, 1] (1 = off)."),
    "min_p": (("--min-p",), "Drop tokens below min_p × the top probability (0 = off)."),
    "seed": (("--seed",), "Sampler seed (default: random)."),
    "max_tokens": (("--max-tokens", "-n"), "Most tokens to generate."),
    "threads": (("--threads",), "CPU threads (default: up to 8)."),
    "ctx": (("--ctx",), "Context size in tokens."),
    "gpu_layers": (("--gpu-layers",), "Layers to offload on GPU builds of llama.cpp (-1 = all)."),
    "no_spec": (("--no-spec",), "Decode plainly (no drafter): the baseline."),
    "verbose": (("--verbose",), "Show the scheduler's stats (γ histogram, plain-step time, predicted vs "
                                "measured tok/s) and llama.cpp's own log."),
}


def run_options(**defaults: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Add the RunOptions flags to a command; the command receives them as `opts: RunOptions`.

    `defaults` override RunOptions' defaults for this command (e.g. temp=0.7 for chat).
    """
    return with_options(RunOptions, _FLAGS, _PANEL, **defaults)


def flag(default: Any, help_text: str, panel: str | None = None) -> Any:
    """A field of an options dataclass that is also its flag: --name-with-dashes, `help_text`, shown
    under `panel` in --help (`with_options`)."""
    return field(default=default, metadata={"help": help_text, "panel": panel})


def with_options(cls: type, flags: dict[str, tuple[tuple[str, ...], str]] | None = None, panel: str | None = None,
                 **defaults: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Add one flag per field of the frozen dataclass `cls` to a command (`flags`: field → (names,
    help); None: each field's own `flag()` metadata; a field whose default is ... is required); the
    command receives them as `opts: cls`."""
    base = replace(cls(), **defaults)
    types = get_type_hints(cls)  # the field types are strings under `from __future__`

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        own = [p for p in inspect.signature(func, eval_str=True).parameters.values() if p.name != "opts"]
        shared = []
        for f in fields(cls):
            if flags is None:
                names, help_text = (f"--{f.name.replace('_', '-')}",), f.metadata["help"]
                option = typer.Option(*names, help=help_text, rich_help_panel=f.metadata["panel"])
            else:
                names, help_text = flags[f.name]
                option = typer.Option(*names, help=help_text, rich_help_panel=panel)
            annotation = Annotated[types[f.name], option]
            shared.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY,
                                            default=getattr(base, f.name), annotation=annotation))

        @functools.wraps(func)
        def command(**kwargs: Any) -> Any:
            opts = cls(**{f.name: kwargs.pop(f.name) for f in fields(cls)})
            return func(opts, **kwargs)

        params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own] + shared
        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        del command.__wrapped__  # typer must read the signature above, not func's
        return command

    return decorate
