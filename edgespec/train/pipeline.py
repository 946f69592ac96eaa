"""``edgespec train-head`` end to end: corpus → feature cache → d2t → head → training → GGUF.

Kinds: ``eagle3``, ``dflash`` (``edgespec.train.dflash_model``) and ``dspark`` (Markov and
confidence heads on a frozen DFlash head, ``edgespec.train.dspark_model``). All read the same feature
cache (EAGLE-3's target layers by default), so one work directory serves every kind. ``medusa``
(``edgespec.train.medusa_model``) reads the target's final-norm hidden state instead: its caches are
``medusa/train``, ``medusa/heldout`` and ``medusa/heldout-gen`` of the same work directory (the same
sequences and ``generated.jsonl``, other features).

Work directory, the run directory (default ``$EDGESPEC_HOME/train/<target file stem>``): ``train/``
and ``heldout/`` feature caches, ``d2t-<V_d>.npy``, and per head kind and shape one
``checkpoint-<kind>…pt`` with its learning curve ``curve-<kind>…csv`` (``edgespec.train.curve``) and
``curve-<kind>…png``. The curve is named like its checkpoint because one work directory serves every
kind. Rerunning resumes the extraction; ``resume`` continues training from the checkpoint: model,
optimizer, step (hence learning rate and data position), tokens seen, curve and torch's RNG (the
budget then counts the new run's seconds only).
Held-out data are the target's generations on ``prompts.HELDOUT_PROMPTS``, never trained on, and,
with ``heldout_gen`` > 0, the self-distilled replies to that many more generated prompts (the first
ones drawn, kept out of training: ``heldout-gen/``), so the curve is measured on more than the eight
fixed prompts. More ``gen_prompts`` on the same work directory grow the data: the prompt draw, the
greedy/temperature mix and the train cache are prefix-stable, so only the new replies are generated
and evaluated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edgespec.gguf_file import read_gguf
from edgespec.heads.dflash import DFlashConfig
from edgespec.heads.dflash_gguf import read_dflash_gguf
from edgespec.heads.medusa import MedusaConfig
from edgespec.models import edgespec_home
from edgespec.train import prompts as P
from edgespec.train.curve import plot_curve, project
from edgespec.train.data import local_corpus
from edgespec.train.dflash_model import DFLASH_DECAY, TorchDFlash
from edgespec.train.dspark_model import TorchDSpark, dspark_config, init_dspark
from edgespec.train.features import CachePlan, FeatureCache, Generated, build_cache
from edgespec.train.medusa_model import MEDUSA_DECAY, HiddenRows, TorchMedusa, head_top1
from edgespec.train.model import TorchEagle3, TrainableHead
from edgespec.train.trainer import (
    TrainConfig,
    Trainer,
    autocast_dtype,
    head_config,
    init_tensors,
    resolve_device,
)

KINDS = ("eagle3", "dflash", "dspark", "medusa")


@dataclass
class HeadJob:
    """Everything ``train_head`` needs (the CLI's flags)."""

    target: Path
    out: Path
    kind: str = "eagle3"
    budget_s: float | None = 600.0
    max_steps: int | None = None
    seed: int = 0
    draft_vocab: int = 8192
    resume: bool = False
    weight_type: str = "f16"
    corpus_chars: int = 1_000_000
    n_prompts: int = len(P.TRAIN_PROMPTS)
    gen_tokens: int = 192
    seq_len: int = 256
    threads: int | None = None
    layers: tuple[int, ...] | None = None  # None: EAGLE-3's (2, n//2, n-3)
    work_dir: Path | None = None
    norm_before_fc: bool = True  # RMS-normalise the fused features before fc (trainer.head_config)
    init_from_target: bool = True  # LM head and final norm start as the target's (trainer.init_tensors)
    block_size: int = 8  # dflash: B, the anchor included
    dflash_layers: int = 1  # dflash: decoder layers of the head
    base: Path | None = None  # dspark: the trained DFlash head it is built on (frozen)
    markov_rank: int = 32  # dspark: R
    medusa_heads: int = 4  # medusa: K (head k predicts the token k + 2 after h_t's)
    medusa_layers: int = 1  # medusa: residual blocks per head
    lr_decay: bool = False  # the learning rate falls to 0 at max_steps (train.decay_shape: linear or cosine)
    device: str = "auto"  # torch device: auto, cpu, cuda or mps (trainer.resolve_device)
    gen_prompts: int = 0  # generated prompts (prompt_gen) whose replies are self-distilled in batches
    n_seq: int = 8  # sequences per batched decode of those replies (generate.BatchGenerator)
    greedy_share: float = 0.5  # share of them answered greedily (the rest at T in 0.7–1.0)
    heldout_gen: int = 0  # more generated prompts (drawn first) whose replies are held out (never trained on)
    train: TrainConfig = field(default_factory=TrainConfig)


def target_info(path: Path) -> dict[str, Any]:
    """Architecture hyperparameters, LM head (V, H) and final norm of a target GGUF."""
    f = read_gguf(path, lambda k: not k.startswith("tokenizer."))
    arch, key = f.value("general.architecture"), f.arch_value
    n_embd, n_head = int(key("embedding_length")), int(key("attention.head_count"))
    lm = "output.weight" if "output.weight" in f.tensors else "token_embd.weight"
    return {"arch": arch, "n_layer": int(key("block_count")), "n_embd": n_embd, "n_head": n_head,
            "n_head_kv": int(key("attention.head_count_kv", n_head)), "n_ff": int(key("feed_forward_length")),
            "head_dim": int(key("attention.key_length", n_embd // n_head)),
            "rms_eps": float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_base": float(key("rope.freq_base", 10000.0)),
            "tok_embd": f.tensor("token_embd.weight"), "lm_head": f.tensor(lm),
            "output_norm": f.tensor("output_norm.weight") if "output_norm.weight" in f.tensors else None,
            "mask_token_id": mask_token(path, len(f.tensor("token_embd.weight")))}


def mask_token(path: Path, n_vocab: int) -> int:
    """The DFlash MASK token for a target: its own ``tokenizer.ggml.mask_token_id`` if it has one, else
    its unknown token (never produced by tokenizing text: SmolLM2's <|endoftext|> 0, Gemma-3's <unk>
    3), else its padding token, else the last vocabulary id. The head embeds it with the target's
    frozen embedding row, so what matters is that the token does not occur inside the text."""
    keys = [f"tokenizer.ggml.{k}_token_id" for k in ("mask", "unknown", "padding")]
    f = read_gguf(path, lambda k: k in keys, with_tensors=False)
    for k in keys:
        v = f.value(k)
        if v is not None and 0 <= int(v) < n_vocab:
            return int(v)
    return n_vocab - 1


def self_distilled(job: HeadJob, work: Path, progress: Callable[[str, int, int], None] | None = None) -> list[Generated]:
    """The target's replies to ``job.heldout_gen + job.gen_prompts`` generated prompts (the held-out ones
    first, so that more training prompts leave them as they are), ``job.n_seq`` at a time
    (``generate.self_distill``), kept in ``work``/generated.jsonl so that a rerun resumes or grows them."""
    n = job.heldout_gen + job.gen_prompts
    if not n:
        return []
    from edgespec.train.generate import BatchGenerator, chat_prompts, self_distill
    from edgespec.train.prompt_gen import generate_prompts

    with BatchGenerator(job.target, n_seq=job.n_seq, seq_ctx=-(-job.seq_len // 256) * 256, threads=job.threads) as bg:
        prompts, sources = chat_prompts(bg, generate_prompts(n, seed=job.seed))
        return self_distill(bg, prompts, sources, max_new=job.gen_tokens, max_len=job.seq_len, seed=job.seed,
                            greedy_share=job.greedy_share, out=work / "generated.jsonl",
                            progress=(lambda d, t: progress("self-distilled replies", d, t)) if progress else None)


def data_mix(cache: FeatureCache) -> str:
    """"; by source: n sequences / tokens (greedy share)" from the cache's manifest, or "" when it holds
    no batched self-distilled replies (their sources start with gen:)."""
    by: dict[str, list[int]] = {}
    for e in cache.manifest():
        if str(e.get("source", "")).startswith("gen:"):
            c = by.setdefault(e["source"], [0, 0, 0])
            c[0], c[1], c[2] = c[0] + 1, c[1] + int(e["tokens"]), c[2] + (float(e["temperature"]) == 0.0)
    return "".join(f"; {k}: {n} seqs / {t} tokens ({g / n:.0%} greedy)" for k, (n, t, g) in sorted(by.items()))


def feature_rms(files: Sequence[Path], n_files: int = 64) -> np.ndarray:
    """Per feature dimension, the root mean square over the rows of the first ``n_files`` cached
    sequences (floored at 1e-3 × the median, so a dead dimension is not blown up)."""
    sq, rows = None, 0
    for f in files[:n_files]:
        x = FeatureCache.load_file(f)["feats"].astype(np.float64)
        sq = (x * x).sum(0) if sq is None else sq + (x * x).sum(0)
        rows += len(x)
    rms = np.sqrt(sq / max(rows, 1))
    return np.maximum(rms, 1e-3 * np.median(rms)).astype(np.float32)


def build_head(job: HeadJob, info: dict[str, Any], layers: tuple[int, ...], d2t: np.ndarray,
               feature_files: Sequence[Path] = ()) -> TrainableHead:
    """The torch head of ``job.kind`` for a target (``target_info``) whose features are ``layers``:
    the target's width, attention shape, rope base and rms eps; eagle3/dflash initialised by
    ``init_tensors``, dspark on the frozen DFlash head ``job.base``. A DFlash head's fc is
    preconditioned by the per-dimension RMS of ``feature_files`` (``TorchDFlash.set_feature_scale``)."""
    n_vocab = len(info["tok_embd"])
    if job.kind == "medusa":  # the whole vocabulary through the target's frozen LM head: d2t, layers unused
        cfg = MedusaConfig(job.medusa_heads, job.medusa_layers, info["n_embd"], n_vocab, shared_lm_head=True)
        return TorchMedusa(cfg, info["lm_head"])
    borrowed = (info["lm_head"], info["output_norm"]) if job.init_from_target else ()
    if job.kind == "eagle3":
        cfg = head_config(info["n_embd"], info["n_head"], info["n_head_kv"], info["n_ff"], layers, n_vocab,
                          len(d2t), info["rms_eps"], info["rope_base"], info["head_dim"], job.norm_before_fc)
        return TorchEagle3(cfg, init_tensors(cfg, d2t, job.seed, *borrowed), info["tok_embd"])
    if job.kind == "dflash":
        dcfg = DFlashConfig(n_embd=info["n_embd"], n_layer=job.dflash_layers, n_head=info["n_head"],
                            n_head_kv=info["n_head_kv"], n_ff=info["n_ff"], target_layers=layers, n_vocab=n_vocab,
                            n_draft_vocab=len(d2t), mask_token_id=info["mask_token_id"], block_size=job.block_size,
                            head_dim=info["head_dim"], rms_eps=info["rms_eps"], rope_base=info["rope_base"])
        head = TorchDFlash(dcfg, init_tensors(dcfg, d2t, job.seed, *borrowed), info["tok_embd"])
        if feature_files:
            head.set_feature_scale(1.0 / feature_rms(feature_files))
        return head
    if job.base is None:
        raise ValueError("--kind dspark needs --base, a trained DFlash head GGUF")
    base_cfg, tensors = read_dflash_gguf(job.base)
    if base_cfg.markov_rank:
        raise ValueError(f"--base {job.base} is a DSpark head; give the plain DFlash head it was trained on")
    if base_cfg.target_layers != tuple(layers) or base_cfg.n_vocab != n_vocab or base_cfg.n_embd != info["n_embd"]:
        raise ValueError(f"--base {job.base} was not trained on this target's features (layers "
                         f"{base_cfg.target_layers}, V {base_cfg.n_vocab}, H {base_cfg.n_embd}; the target: "
                         f"{tuple(layers)}, {n_vocab}, {info['n_embd']})")
    base = TorchDFlash(base_cfg, tensors, info["tok_embd"])
    return TorchDSpark(base, init_dspark(dspark_config(base_cfg, job.markov_rank), job.seed), job.markov_rank)


def train_head(job: HeadJob, note: Callable[[str], None] = print,
               progress: Callable[[str, int, int], None] | None = None,
               on_step: Callable[[int, float, dict[str, Any] | None], None] | None = None) -> dict[str, Any]:
    """Train a head and write it to ``job.out``; returns a summary (steps, seconds, held-out acceptance).

    Args:
        job: what to train.
        note: one-line status messages.
        progress: ``progress(phase, done, total)`` during feature extraction.
        on_step: ``Trainer.run``'s per-step callback.
    """
    from edgespec.backends.llama_features import eagle3_layer_ids
    from edgespec.drafters.registry import open_backend

    if job.kind not in KINDS:
        raise ValueError(f"--kind must be one of {', '.join(KINDS)} (got {job.kind!r})")
    device = resolve_device(job.device)  # before the extraction: an absent device fails in a second
    torch.manual_seed(job.seed)
    work = job.work_dir or edgespec_home() / "train" / job.target.stem
    work.mkdir(parents=True, exist_ok=True)
    info = target_info(job.target)
    n_ctx = max(1024, 2 * job.seq_len)
    medusa = job.kind == "medusa"
    caches = work / "medusa" if medusa else work
    if medusa:  # captures the final-norm hidden states (result_norm), as the Medusa drafter reads them
        backend: Any = HiddenRows(open_backend(job.target, hidden=True, n_ctx=n_ctx, threads=job.threads))
    else:
        layers = job.layers or eagle3_layer_ids(info["n_layer"])
        backend = open_backend(job.target, layers=layers, n_ctx=n_ctx, threads=job.threads)  # captures features
    generator = open_backend(job.target, n_ctx=n_ctx, threads=job.threads)
    try:
        plan = CachePlan(target=str(job.target.resolve()), target_size=job.target.stat().st_size,
                         seq_len=job.seq_len, corpus_chars=job.corpus_chars, n_prompts=job.n_prompts,
                         gen_tokens=job.gen_tokens, seed=job.seed)
        note(f"features of {job.target.name} (layers {list(backend.feature_layers)}) → {work}")
        texts = list(local_corpus(max_chars=job.corpus_chars, seed=job.seed)) if job.corpus_chars else []
        seqs = self_distilled(job, work, progress)
        kept = seqs[job.heldout_gen:]
        cache = build_cache(backend, caches / "train", plan, texts, P.TRAIN_PROMPTS[:job.n_prompts],
                            progress=(lambda d, t: progress("train data", d, t)) if progress else None,
                            generator=generator, generated=kept)
        held_plan = CachePlan(target=plan.target, target_size=plan.target_size, seq_len=job.seq_len,
                              corpus_chars=0, n_prompts=len(P.HELDOUT_PROMPTS), gen_tokens=job.gen_tokens)
        held = build_cache(backend, caches / "heldout", held_plan, [], P.HELDOUT_PROMPTS,
                           progress=(lambda d, t: progress("held-out data", d, t)) if progress else None,
                           generator=generator)
        heldouts = {"heldout": held}
        if job.heldout_gen:
            gen_plan = CachePlan(target=plan.target, target_size=plan.target_size, seq_len=job.seq_len,
                                 corpus_chars=0, gen_tokens=job.gen_tokens, seed=job.seed)
            heldouts["heldout-gen"] = build_cache(
                backend, caches / "heldout-gen", gen_plan, [], generated=seqs[:job.heldout_gen],
                progress=(lambda d, t: progress("held-out replies", d, t)) if progress else None)
        layers = backend.feature_layers
    finally:
        backend.close()
        generator.close()
    d2t_path = work / f"d2t-{job.draft_vocab}.npy"
    if medusa:
        d2t = np.arange(len(info["tok_embd"]))
    elif d2t_path.exists():
        d2t = np.load(d2t_path)
    else:
        d2t = cache.d2t(len(info["tok_embd"]), job.draft_vocab)
        np.save(d2t_path, d2t)
    model = build_head(job, info, layers, d2t, cache.files())
    decay = {"step_decay": MEDUSA_DECAY if medusa else DFLASH_DECAY} if job.kind != "eagle3" else {}
    if job.lr_decay:
        if not job.max_steps:
            raise ValueError("a learning-rate decay needs --max-steps (it falls to 0 at the last step)")
        decay["decay_steps"] = job.max_steps
    train_cfg = TrainConfig(**{**job.train.__dict__, **decay, "seed": job.seed})
    val_files = [f for c in heldouts.values() for f in c.files()]
    trainer = Trainer(model, cache.files(), val_files, train_cfg, device=device)
    shape = {"eagle3": "", "dflash": f"-b{job.block_size}-l{job.dflash_layers}",
             "dspark": f"-r{job.markov_rank}-{Path(job.base or '').stem}",
             "medusa": f"-k{job.medusa_heads}-l{job.medusa_layers}"}[job.kind]
    run_name = f"{job.kind}{shape}" + ("" if medusa else f"-v{job.draft_vocab}") + f"-s{job.seed}"
    ckpt, curve = work / f"checkpoint-{run_name}.pt", work / f"curve-{run_name}.csv"
    if job.resume and ckpt.exists():
        before = trainer.load(ckpt)
        note(f"resumed from {ckpt} at step {trainer.step} ({trainer.elapsed:.0f} s trained, "
             f"{trainer.tokens} tokens seen)")
        changed = [f"{k} {before[k]} → {v}" for k, v in asdict(train_cfg).items() if k in before and before[k] != v]
        if changed:
            note(f"settings changed since the checkpoint: {'; '.join(changed)}")
        if before.get("n_train", len(trainer.train_files)) != len(trainer.train_files):
            note(f"training data: {before['n_train']} → {len(trainer.train_files)} sequences since the checkpoint "
                 "(samples from here on are drawn from the new set)")
    elif ckpt.exists():
        note(f"starting over (pass --resume to continue {ckpt})")
    held_n = " + ".join(f"{len(c.files())} {name}" for name, c in heldouts.items())
    note(f"{len(cache.files())} training sequences, {held_n}; draft vocab {len(model.d2t)}; "
         f"{sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6:.1f}M trained parameters; "
         f"device {device}, {'bfloat16 autocast' if train_cfg.bf16 and autocast_dtype(device) else 'float32'}")
    start = trainer.evaluate() if val_files else None
    trainer.run(max_steps=job.max_steps, budget_s=job.budget_s, on_step=on_step, checkpoint=ckpt, curve=curve)
    end = trainer.evaluate() if val_files else None
    by_set = {name: trainer.evaluate(c.files()) for name, c in heldouts.items() if c.files()} if len(heldouts) > 1 else {}
    per_head = head_top1(trainer.model, val_files, trainer.t2d, train_cfg, device) if medusa and val_files else None
    if per_head:
        note("held-out top-1 per Medusa head (unchained): " + " ".join(f"{a:.2f}" for a in per_head))
    data_tokens = sum(int(e["tokens"]) for e in cache.manifest())
    fit = project(trainer.history, max_tokens=data_tokens)  # the first pass: training tokens = data tokens
    png = curve.with_suffix(".png") if curve.exists() and plot_curve(curve, curve.with_suffix(".png"), fit) else None
    if curve.exists():
        note(f"learning curve: {curve}" + (f" and {png}" if png else
                                           " (no PNG: matplotlib is not installed; pip install 'edgespec[plot]')"))
    provenance = {"edgespec.head.trained_steps": str(trainer.step), "edgespec.head.seed": str(job.seed),
                  "edgespec.head.train_seconds": f"{trainer.elapsed:.0f}",
                  "edgespec.head.train_tokens": str(trainer.tokens), "edgespec.head.train_device": device.type,
                  "edgespec.head.train_dtype": "bfloat16" if train_cfg.bf16 and autocast_dtype(device) else "float32",
                  "edgespec.head.data": f"{len(cache.files())} sequences: stdlib + /usr/share/doc text "
                                        f"({job.corpus_chars} chars) and greedy generations on "
                                        f"{job.n_prompts} training prompts" + data_mix(cache),
                  "edgespec.head.heldout_acceptance": ",".join(f"{a:.3f}" for a in (end or {}).get("acceptance", []))}
    if job.kind == "dspark":
        provenance["edgespec.head.base"] = Path(job.base or "").name
    trainer.export(job.out, job.target, job.weight_type, extra_kv=provenance)
    return {"steps": trainer.step, "seconds": trainer.elapsed, "tokens": trainer.tokens, "start": start, "end": end,
            "out": job.out, "checkpoint": ckpt, "curve": curve, "png": png, "by_set": by_set,
            "data_tokens": data_tokens, "projection": fit, "per_head": per_head}
