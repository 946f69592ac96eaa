"""Training that runs for hours: the learning-rate schedule (warm-up, linear or cosine decay), the
torch device choice, the learning-curve CSV/PNG, and a run stopped, crashed and resumed that ends
bit-identical to one that never stopped, its curve included."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from train_fixtures import LAYERS, build_caches  # noqa: E402

from edgespec.errors import DeviceError  # noqa: E402
from edgespec.train.curve import append_curve, plot_curve, project, read_curve, write_curve  # noqa: E402
from edgespec.train.dflash_model import DFLASH_DECAY  # noqa: E402
from edgespec.train.model import TorchEagle3  # noqa: E402
from edgespec.train.pipeline import HeadJob, build_head  # noqa: E402
from edgespec.train.trainer import (  # noqa: E402
    TrainConfig,
    Trainer,
    head_config,
    init_tensors,
    lr_at,
    resolve_device,
)


@pytest.fixture(scope="module")
def caches(tmp_path_factory, tiny_target):
    return build_caches(tmp_path_factory, tiny_target)


def _trainer(caches, kind: str, **kw) -> Trainer:
    train, held, info, d2t = caches
    if kind == "eagle3":
        cfg = head_config(info["n_embd"], info["n_head"], info["n_head_kv"], info["n_ff"], LAYERS,
                          len(info["tok_embd"]), len(d2t))
        model = TorchEagle3(cfg, init_tensors(cfg, d2t, seed=0), info["tok_embd"])
        base = {"ttt_steps": 3}
    else:
        model = build_head(HeadJob(target=Path("t.gguf"), out=Path("h.gguf"), kind="dflash"), info, LAYERS, d2t,
                           train.files())
        base = {"step_decay": DFLASH_DECAY, "anchors": 8}
    cfg = TrainConfig(**(base | {"batch": 2, "lr": 3e-3, "eval_every": 2} | kw))
    return Trainer(model, train.files(), held.files(), cfg, device="cpu")


def test_learning_rate_schedule_values():
    lin = TrainConfig(lr=1.0, warmup_steps=4, decay_steps=12)
    assert [lr_at(lin, s) for s in (0, 1, 2, 4, 8, 11, 12, 30)] == [0.0, 0.25, 0.5, 1.0, 0.5, 0.125, 0.0, 0.0]
    cos = TrainConfig(lr=2.0, warmup_steps=4, decay_steps=12, decay_shape="cosine")
    np.testing.assert_allclose([lr_at(cos, s) for s in (2, 4, 6, 8, 10, 12, 13)],
                               [1.0, 2.0, 1.0 + math.cos(math.pi / 4), 1.0, 1.0 - math.cos(math.pi / 4), 0.0, 0.0],
                               atol=1e-15)
    assert {lr_at(TrainConfig(lr=5e-4), s) for s in (0, 7, 10**6)} == {5e-4}  # the default: constant, as before
    legacy = TrainConfig(lr=1e-3, decay_steps=4)  # the shipped DFlash recipe's --lr-decay
    assert [lr_at(legacy, s) for s in range(5)] == [1e-3 * (1 - s / 4) for s in range(5)]


@pytest.mark.parametrize("kw, words", [({"decay_shape": "step"}, ["'step'"]),
                                       ({"warmup_steps": 5, "decay_steps": 5}, ["5"]),
                                       ({"warmup_steps": -1}, ["-1"]), ({"eval_every": 0}, ["0"])])
def test_bad_schedules_are_one_line_errors(kw, words):
    with pytest.raises(ValueError) as e:
        TrainConfig(**kw)
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words)


def test_trainer_applies_the_schedule_on_the_named_device(caches):
    tr = _trainer(caches, "eagle3", warmup_steps=2, decay_steps=4, decay_shape="cosine")
    seen = []
    for _ in range(4):
        tr.train_step()
        seen.append(tr.opt.param_groups[0]["lr"])
    np.testing.assert_allclose(seen, [0.0, 1.5e-3, 3e-3, 1.5e-3], atol=1e-18)
    assert tr.device == torch.device("cpu") and all(p.device.type == "cpu" for p in tr.model.parameters())
    assert tr.tokens == sum(len(tr._tensors(tr._sample(i))["tokens"]) for i in range(8))


def _no_accelerators(monkeypatch, cuda: bool = False, mps: bool = False) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)


def test_device_auto_prefers_cuda_then_mps_then_cpu(monkeypatch):
    _no_accelerators(monkeypatch)
    assert resolve_device("auto") == torch.device("cpu") == resolve_device("cpu")
    _no_accelerators(monkeypatch, mps=True)
    assert resolve_device("auto") == torch.device("mps")
    _no_accelerators(monkeypatch, cuda=True, mps=True)
    assert resolve_device("auto") == torch.device("cuda")


@pytest.mark.parametrize("name", ["cuda", "mps", "tpu"])
def test_an_absent_or_unknown_device_is_a_one_line_error(monkeypatch, name):
    _no_accelerators(monkeypatch)
    with pytest.raises(DeviceError) as e:
        resolve_device(name)
    assert "\n" not in str(e.value) and name in str(e.value)


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_resumed_run_is_bit_identical_to_an_uninterrupted_one(caches, tmp_path, kind):
    """Warm-up + cosine decay over 7 steps, evaluated every 2. The interrupted run checkpoints at step 3
    (between evaluations: the loss window travels in the checkpoint), then 'crashes' at step 5 after
    writing a curve row its checkpoint never saw; the resume drops that row and recomputes it."""
    plan = {"warmup_steps": 2, "decay_steps": 7, "decay_shape": "cosine"}
    a = _trainer(caches, kind, **plan)
    a.run(max_steps=7, curve=tmp_path / "a.csv")
    b = _trainer(caches, kind, **plan)
    b.run(max_steps=3, checkpoint=tmp_path / "ck.pt", curve=tmp_path / "b.csv")
    b.run(max_steps=5, curve=tmp_path / "b.csv")  # no checkpoint after step 3: steps 4-5 are lost
    assert [r["step"] for r in read_curve(tmp_path / "b.csv")] == ["2", "4"]
    torch.manual_seed(1234)  # a new session's torch RNG: the checkpoint restores the one it saved
    c = _trainer(caches, kind, **plan)
    c.load(tmp_path / "ck.pt")
    seen = sum(len(c._tensors(c._sample(i))["tokens"]) for i in range(3 * 2))  # 3 steps of batch 2
    assert (c.step, c.tokens, len(c.window), len(c.history)) == (3, seen, 1, 1)
    c.run(max_steps=7, curve=tmp_path / "b.csv")
    for (name, x), (_, y) in zip(a.model.state_dict().items(), c.model.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    for sa, sc in zip(a.opt.state_dict()["state"].values(), c.opt.state_dict()["state"].values(), strict=True):
        assert torch.equal(sa["exp_avg"], sc["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sc["exp_avg_sq"])
    assert c.tokens == a.tokens > 0 and c.opt.param_groups[0]["lr"] == a.opt.param_groups[0]["lr"]
    rows_a, rows_c = read_curve(tmp_path / "a.csv"), read_curve(tmp_path / "b.csv")
    assert [r["step"] for r in rows_a] == ["2", "4", "6"]
    assert [r.keys() for r in rows_a] == [r.keys() for r in rows_c]
    strip = [{k: v for k, v in r.items() if k != "elapsed_s"} for r in rows_a]
    assert strip == [{k: v for k, v in r.items() if k != "elapsed_s"} for r in rows_c]
    assert 0 < int(rows_a[0]["tokens"]) < int(rows_a[-1]["tokens"]) < a.tokens  # step 6's count, then step 7


def test_curve_csv_rewrite_append_and_no_png_without_matplotlib(tmp_path, monkeypatch):
    path = tmp_path / "curve.csv"
    rows = [{"step": 1, "tokens": 100, "train_loss": 3.5, "val_loss": 4.0, "tau": 1.25, "acc_1": 0.25,
             "elapsed_s": 0.5}]
    write_curve(path, rows)
    rows.append({"step": 2, "tokens": 200, "train_loss": 3.0, "val_loss": 3.5, "tau": 1.5, "acc_1": 0.5,
                 "elapsed_s": 1.0})
    append_curve(path, rows)
    assert path.read_text().splitlines()[0] == "step,tokens,train_loss,val_loss,tau,acc_1,elapsed_s"
    assert [r["tau"] for r in read_curve(path)] == ["1.25", "1.5"]
    rows.append({"step": 3, "tokens": 300, "train_loss": 2.0, "val_loss": 3.0, "tau": 1.75, "acc_1": 0.5,
                 "acc_2": 0.25, "elapsed_s": 1.5})  # a deeper head after a resume: the file is rewritten
    append_curve(path, rows)
    assert [r["acc_2"] for r in read_curve(path)] == ["", "", "0.25"]
    write_curve(path, [])
    assert not path.exists() and read_curve(path) == []
    write_curve(path, rows)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)  # as without the plot extra
    assert not plot_curve(path, tmp_path / "curve.png") and not (tmp_path / "curve.png").exists()


def test_curve_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed: pip install 'edgespec[plot]'")
    path = tmp_path / "curve.csv"
    write_curve(path, [{"step": s, "tokens": 100 * s, "tau": 1 + s / 10, "elapsed_s": s} for s in (0, 1, 2, 3)])
    assert plot_curve(path, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fit = project(read_curve(path), goal=1.5, skip=0)
    assert fit is not None and plot_curve(path, tmp_path / "fit.png", fit)
    assert (tmp_path / "fit.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_projection_of_a_log_linear_curve():
    """τ = 1.1 + 0.1·ln(tokens) on the first pass: the fit recovers it and puts τ 2.5 at e^14; rows past
    max_tokens (later epochs) and the first (skip) row do not count; a flat curve projects nothing."""
    rows = [{"tokens": t, "tau": 1.1 + 0.1 * math.log(t)} for t in (1e3, 2e3, 4e3, 8e3, 16e3)]
    rows.insert(0, {"tokens": 500, "tau": 1.0})  # the start: left out by skip=1
    rows.append({"tokens": 64e3, "tau": 9.0})  # a later epoch: left out by max_tokens
    fit = project(rows, goal=2.5, max_tokens=16e3)
    assert fit is not None and fit.rows == 5
    assert fit.a == pytest.approx(1.1) and fit.b == pytest.approx(0.1)
    assert fit.goal_tokens == pytest.approx(math.exp(14.0), rel=1e-6)
    flat = project([{"tokens": t, "tau": 1.3} for t in (1, 10, 100, 1000)], goal=2.5)
    assert flat is not None and flat.goal_tokens is None
    assert project(rows[:3], goal=2.5) is None  # fewer than 3 rows after the skip


def _synthetic_trainer(root: Path, kind: str, device: str, **kw) -> Trainer:
    """A trainer on a random feature cache (no target GGUF, so it runs on a machine without the fetched
    models): 12 training and 3 held-out sequences of 48 tokens, V = 200, H = 64."""
    from edgespec.heads.dflash import DFlashConfig, random_tensors
    from edgespec.train.dflash_model import TorchDFlash

    v, h, vd = 200, 64, 120
    rng = np.random.default_rng(0)
    if not root.exists():
        for split, n in (("train", 12), ("held", 3)):
            (root / split).mkdir(parents=True)
            for i in range(n):
                top_lp = np.sort(np.log(rng.dirichlet(np.ones(8), 48)), axis=1)[:, ::-1]
                np.savez(root / split / f"seq_{i:05d}.npz", tokens=rng.integers(1, v, 48).astype(np.int32),
                         feats=rng.standard_normal((48, 3 * h)).astype(np.float16),
                         top_ids=rng.integers(1, v, (48, 8)).astype(np.int32), top_lp=top_lp.astype(np.float16),
                         n_prompt=np.int32(4))
    d2t = np.sort(np.random.default_rng(1).choice(v, vd, replace=False))
    emb = np.random.default_rng(2).standard_normal((v, h)).astype(np.float32)
    if kind == "eagle3":
        cfg = head_config(h, 4, 2, 96, LAYERS, v, vd)
        model = TorchEagle3(cfg, init_tensors(cfg, d2t, seed=0), emb)
        base = {"ttt_steps": 3}
    else:
        dcfg = DFlashConfig(n_embd=h, n_layer=1, n_head=4, n_head_kv=2, n_ff=96, target_layers=LAYERS, n_vocab=v,
                            n_draft_vocab=vd, mask_token_id=0, block_size=8)
        model = TorchDFlash(dcfg, random_tensors(dcfg, seed=1, d2t=d2t), emb)
        base = {"step_decay": DFLASH_DECAY, "anchors": 8}
    cfg = TrainConfig(**(base | {"batch": 2, "lr": 3e-3, "eval_every": 2, "warmup_steps": 2, "decay_steps": 6} | kw))
    files = sorted((root / "train").glob("*.npz")), sorted((root / "held").glob("*.npz"))
    return Trainer(model, *files, cfg, device=device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_cuda_training_matches_cpu_and_its_checkpoint_resumes_on_cpu(tmp_path, kind):
    """float32 on both: the same curve within float tolerance (CUDA reduces in another order); a
    checkpoint written on cuda continues on cpu."""
    cpu = _synthetic_trainer(tmp_path / "data", kind, "cpu", bf16=False)
    cpu.run(max_steps=6, curve=tmp_path / "cpu.csv")
    gpu = _synthetic_trainer(tmp_path / "data", kind, "cuda", bf16=False)
    gpu.run(max_steps=4, checkpoint=tmp_path / "gpu.pt", curve=tmp_path / "gpu.csv")
    moved = _synthetic_trainer(tmp_path / "data", kind, "cpu", bf16=False)
    moved.load(tmp_path / "gpu.pt")
    moved.run(max_steps=6, curve=tmp_path / "gpu.csv")
    rows_cpu, rows_gpu = read_curve(tmp_path / "cpu.csv"), read_curve(tmp_path / "gpu.csv")
    assert [r["step"] for r in rows_gpu] == ["2", "4", "6"] and len(rows_cpu) == 3
    for rc, rg in zip(rows_cpu, rows_gpu, strict=True):
        for k in ("train_loss", "val_loss", "tau"):
            assert abs(float(rc[k]) - float(rg[k])) <= 1e-4 * max(1.0, abs(float(rc[k]))), (k, rc, rg)
    for (name, x), (_, y) in zip(cpu.model.state_dict().items(), moved.model.state_dict().items(), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-4, msg=name)
    bf16 = _synthetic_trainer(tmp_path / "data", kind, "cuda")  # bf16 autocast on cuda: runs, loss finite
    assert np.isfinite(bf16.train_step())


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_synthetic_cache_trains_on_cpu(tmp_path, kind):
    """The CUDA test's data and heads on cpu (so its set-up is exercised on every machine): two runs on
    the same device agree bit for bit and the loss falls."""
    a = _synthetic_trainer(tmp_path / "data", kind, "cpu", bf16=False)
    losses = [a.train_step() for _ in range(6)]
    b = _synthetic_trainer(tmp_path / "data", kind, "cpu", bf16=False)
    assert [b.train_step() for _ in range(6)] == losses and losses[-1] < losses[0]

