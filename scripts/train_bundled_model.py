"""Train the small bundled ReLU-LLaMA from scratch, profile it, train its predictors, convert it.

Corpus: Python's own documentation (Debian package python3.11-doc, HTML under /usr/share/doc/python3.11/html),
stripped of HTML with the stdlib html.parser; every 20th page is held out (perplexity and predictor metrics).
Tokenizer: SentencePiece BPE with byte fallback. Model: transformers LlamaForCausalLM with hidden_act "relu"
(ReGLU FFN). Each stage writes into --workdir and is skipped when its output is already there:

    corpus -> tokenizer -> train (HF folder) -> dense GGUF -> profile -> predictors -> PWRI GGUF -> models/

Usage:
    apt-get install -y python3.11-doc
    python scripts/train_bundled_model.py --workdir /tmp/bundled --minutes 25          # everything
    python scripts/train_bundled_model.py --workdir /tmp/bundled --bench               # tokens/s only
"""

from __future__ import annotations

import argparse
import html.parser
import json
import logging
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("train_bundled_model")

DOC_ROOT = Path("/usr/share/doc/python3.11/html")
REPO = Path(__file__).resolve().parents[1]
SKIP_PAGES = ("genindex", "py-modindex", "search.html", "_sources", "_static", "_downloads", "_images")
BLOCK_TAGS = {
    "p",
    "div",
    "pre",
    "li",
    "dt",
    "dd",
    "h1",
    "h2",
    "h3",
    "h4",
    "h5",
    "h6",
    "tr",
    "table",
    "br",
    "ul",
    "ol",
    "dl",
    "section",
    "blockquote",
}
MODEL_FILE = "pydoc-relu-llama-8m.powerinfer.gguf"
MODEL_CONFIG = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=256,
)


# ---------------------------------------------------------------------------------------------------- corpus


class _MainText(html.parser.HTMLParser):
    """Text of a Sphinx page's main body (<div role="main">), blocks separated by newlines."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.depth = 0  # div nesting inside the main body; 0 = outside
        self.skip: list[str] = []  # open script/style/headerlink tags
        self.pre = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if self.depth == 0:
            if tag == "div" and a.get("role") == "main":
                self.depth = 1
            return
        if tag == "div":
            self.depth += 1
        if tag in ("script", "style") or (tag == "a" and "headerlink" in (a.get("class") or "")):
            self.skip.append(tag)
        if tag == "pre":
            self.pre += 1
        if tag in BLOCK_TAGS:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if self.depth == 0:
            return
        if tag == "div":
            self.depth -= 1
        if self.skip and tag == self.skip[-1]:
            self.skip.pop()
        if tag == "pre" and self.pre:
            self.pre -= 1
        if tag in BLOCK_TAGS:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if self.depth == 0 or self.skip:
            return
        if self.pre:
            self.parts.append(data)
        elif data.strip():
            lead, trail = data[:1].isspace(), data[-1:].isspace()
            self.parts.append(" " * lead + " ".join(data.split()) + " " * trail)
        elif data:
            self.parts.append(" ")

    def text(self) -> str:
        lines = [line.rstrip() for line in "".join(self.parts).split("\n")]
        out: list[str] = []
        for line in lines:
            if line.strip() or (out and out[-1]):
                out.append(line if line.strip() else "")
        return "\n".join(out).strip() + "\n"


def build_corpus(workdir: Path) -> tuple[Path, Path]:
    """train.txt and heldout.txt from the documentation pages (every 20th page held out)."""
    train, heldout = workdir / "train.txt", workdir / "heldout.txt"
    if train.exists() and heldout.exists():
        return train, heldout
    pages = sorted(p for p in DOC_ROOT.rglob("*.html") if not any(s in str(p) for s in SKIP_PAGES))
    if not pages:
        raise SystemExit(f"no HTML under {DOC_ROOT}: apt-get install -y python3.11-doc")
    docs = []
    for p in pages:
        parser = _MainText()
        parser.feed(p.read_text(encoding="utf-8", errors="replace"))
        t = parser.text()
        if len(t) > 200:
            docs.append(t)
    train.write_text("\n".join(d for i, d in enumerate(docs) if i % 20 != 7), encoding="utf-8")
    heldout.write_text("\n".join(d for i, d in enumerate(docs) if i % 20 == 7), encoding="utf-8")
    log.info(
        "corpus: %d pages, train %.1f MB, held-out %.1f MB",
        len(docs),
        train.stat().st_size / 1e6,
        heldout.stat().st_size / 1e6,
    )
    return train, heldout


# ------------------------------------------------------------------------------------------------- tokenizer


def train_tokenizer(workdir: Path, train: Path, vocab_size: int) -> Path:
    import sentencepiece as spm

    prefix = workdir / "tokenizer"
    model = prefix.with_suffix(".model")
    if model.exists():
        return model
    spm.SentencePieceTrainer.train(
        input=str(train),
        model_prefix=str(prefix),
        model_type="bpe",
        vocab_size=vocab_size,
        byte_fallback=True,
        character_coverage=1.0,
        split_digits=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        allow_whitespace_only_pieces=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        input_sentence_size=400_000,
        shuffle_input_sentence=True,
        max_sentence_length=8192,
        num_threads=2,
        minloglevel=2,
    )
    return model


def encode_file(workdir: Path, tokenizer: Path, text: Path) -> np.ndarray:
    """Token ids of a text file (no BOS), cached as .npy."""
    import sentencepiece as spm

    cache = workdir / (text.stem + ".ids.npy")
    if cache.exists():
        return np.load(cache)
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer))
    ids: list[int] = []
    for para in text.read_text(encoding="utf-8").split("\n\n"):
        ids.extend(sp.encode(para + "\n\n"))
    arr = np.asarray(ids, dtype=np.int16 if sp.get_piece_size() < 32768 else np.int32)
    np.save(cache, arr)
    return arr


# ------------------------------------------------------------------------------------------------- training


def make_model(vocab_size: int):
    import transformers

    cfg = transformers.LlamaConfig(
        **{**MODEL_CONFIG, "vocab_size": vocab_size},
        hidden_act="relu",
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=0.02,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(1234)
    return transformers.LlamaForCausalLM(cfg).float()


def batch_windows(ids: np.ndarray, n_ctx: int, batch: int, rng: np.random.Generator) -> torch.Tensor:
    """(batch, n_ctx) windows, each BOS + n_ctx-1 corpus tokens from a random offset."""
    starts = rng.integers(0, len(ids) - n_ctx, batch)
    x = np.stack([ids[s : s + n_ctx - 1] for s in starts]).astype(np.int64)
    return torch.from_numpy(np.concatenate([np.ones((batch, 1), np.int64), x], axis=1))


@torch.no_grad()
def heldout_nll(model, ids: np.ndarray, n_ctx: int, n_windows: int = 64) -> float:
    """Mean next-token NLL (nats) over consecutive BOS-prefixed windows of the held-out ids."""
    model.eval()
    total, count = 0.0, 0
    step = n_ctx - 1
    for i in range(min(n_windows, (len(ids) - 1) // step)):
        x = torch.from_numpy(np.concatenate([[1], ids[i * step : (i + 1) * step]]).astype(np.int64))[None]
        out = model(input_ids=x, labels=x)
        total += float(out.loss) * (x.shape[1] - 1)
        count += x.shape[1] - 1
    model.train()
    return total / count


def train_model(
    workdir: Path,
    tokenizer: Path,
    train_ids: np.ndarray,
    heldout_ids: np.ndarray,
    minutes: float,
    batch: int,
    lr: float,
    bench: bool,
    resume: bool = False,
) -> Path:
    """Train for a wall-clock budget (cosine schedule over the step count that fits), save an HF folder."""
    from safetensors.torch import save_file

    hf = workdir / "hf"
    previous: dict | None = None
    if (hf / "model.safetensors").exists() and not bench:
        if not resume:
            return hf
        previous = json.loads((workdir / "train_stats.json").read_text())
    n_ctx = MODEL_CONFIG["max_position_embeddings"]
    model = make_model(MODEL_CONFIG["vocab_size"])
    if previous is not None:
        # a second phase from the saved (fp16) weights: fresh AdamW, the same warm-up + cosine schedule
        from safetensors.torch import load_file

        model.load_state_dict({k: v.float() for k, v in load_file(hf / "model.safetensors").items()})
    log.info("model: %.2f M parameters", sum(p.numel() for p in model.parameters()) / 1e6)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    rng = np.random.default_rng(0 if previous is None else 1 + len(previous.get("phases", [])))
    # measure tokens/s on a few steps (the run itself is bounded by wall-clock time: the cores are shared)
    t0 = time.perf_counter()
    n_bench = 3
    for _ in range(n_bench):
        loss = model(input_ids=(x := batch_windows(train_ids, n_ctx, batch, rng)), labels=x).loss
        loss.backward()
        opt.zero_grad(set_to_none=True)
    sec_per_step = (time.perf_counter() - t0) / n_bench
    log.info(
        "%.0f tokens/s (%.2f s/step of %d x %d): ~%.1f M tokens in %.0f min",
        batch * n_ctx / sec_per_step,
        sec_per_step,
        batch,
        n_ctx,
        minutes * 60 / sec_per_step * batch * n_ctx / 1e6,
        minutes,
    )
    if bench:
        return hf
    # warm-up over the first 3% of the budget, then cosine to 10% of lr, as functions of elapsed time
    budget = minutes * 60

    def lr_at(frac: float) -> float:
        if frac < 0.03:
            return lr * (0.1 + 0.9 * frac / 0.03)
        return lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (frac - 0.03) / 0.97))))

    t0 = time.perf_counter()
    step = 0
    while (elapsed := time.perf_counter() - t0) < budget:
        for group in opt.param_groups:
            group["lr"] = lr_at(elapsed / budget)
        x = batch_windows(train_ids, n_ctx, batch, rng)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 25 == 0:
            log.info(
                "step %d loss %.3f lr %.2e %.0f s", step, float(loss), opt.param_groups[0]["lr"], elapsed
            )
        step += 1
    n_steps = step
    train_s = time.perf_counter() - t0
    nll = heldout_nll(model, heldout_ids, n_ctx)
    log.info("held-out NLL %.4f nats/token (ppl %.2f)", nll, math.exp(nll))
    hf.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(hf)
    state = {k: v.detach().half().contiguous() for k, v in model.state_dict().items()}
    save_file(state, hf / "model.safetensors")
    shutil.copy(tokenizer, hf / "tokenizer.model")
    (hf / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True, "add_eos_token": False}))
    phase = {
        "steps": n_steps,
        "tokens": n_steps * batch * n_ctx,
        "train_seconds": train_s,
        "lr": lr,
        "final_train_loss": float(loss),
        "heldout_nll_hf_fp32": nll,
    }
    phases = (previous.get("phases", [previous]) if previous is not None else []) + [phase]
    stats = {
        "steps": sum(p["steps"] for p in phases),
        "batch": batch,
        "n_ctx": n_ctx,
        "tokens": sum(p["tokens"] for p in phases),
        "train_seconds": sum(p["train_seconds"] for p in phases),
        "final_train_loss": float(loss),
        "heldout_nll_hf_fp32": nll,
        "lr": phases[0]["lr"],
        "phases": phases,
    }
    stats["tokens_per_second"] = stats["tokens"] / stats["train_seconds"]
    (workdir / "train_stats.json").write_text(json.dumps(stats, indent=1))
    return hf


# ------------------------------------------------------------------------------------------------------ main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/bundled"))
    ap.add_argument("--minutes", type=float, default=25.0, help="wall-clock budget of the LM training")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bench", action="store_true", help="only measure training tokens/s")
    ap.add_argument("--resume", action="store_true", help="train the saved model for another --minutes")
    ap.add_argument("--stop-after", choices=["corpus", "tokenizer", "train"], default=None)
    ap.add_argument("--out", type=Path, default=REPO / "models", help="where the bundled model goes")
    ap.add_argument("--target-recall", type=float, default=0.95)
    ap.add_argument("--profile-tokens", type=int, default=131072)
    ap.add_argument("--predictor-tokens", type=int, default=65536)
    ap.add_argument("--predictor-steps", type=int, default=1500)
    ap.add_argument("--eval-tokens", type=int, default=32768)
    ap.add_argument("--ppl-chunks", type=int, default=64)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    torch.set_num_threads(args.threads)
    args.workdir.mkdir(parents=True, exist_ok=True)
    train, heldout = build_corpus(args.workdir)
    if args.stop_after == "corpus":
        return
    tokenizer = train_tokenizer(args.workdir, train, MODEL_CONFIG["vocab_size"])
    train_ids = encode_file(args.workdir, tokenizer, train)
    heldout_ids = encode_file(args.workdir, tokenizer, heldout)
    log.info("tokens: train %d, held-out %d", len(train_ids), len(heldout_ids))
    if args.stop_after == "tokenizer":
        return
    hf = train_model(
        args.workdir,
        tokenizer,
        train_ids,
        heldout_ids,
        args.minutes,
        args.batch,
        args.lr,
        args.bench,
        args.resume,
    )
    if args.bench or args.stop_after == "train":
        return
    package(args, hf, train, heldout)


def package(args: argparse.Namespace, hf: Path, train: Path, heldout: Path) -> None:
    """Dense GGUF -> profile -> predictors -> PWRI GGUF in models/, held-out metrics, model card."""
    from powerinfer.convert import convert_hf_to_gguf
    from powerinfer.eval.perplexity import PerplexityOptions, perplexity
    from powerinfer.profile import (
        PredictorOptions,
        ProfileOptions,
        evaluate_on_text,
        run_profile,
        train_predictors,
        write_predictor_folder,
    )
    from powerinfer.runtime.engine import Engine, EngineOptions

    work, out = args.workdir, args.out
    n_ctx = MODEL_CONFIG["max_position_embeddings"]
    command = "python scripts/train_bundled_model.py " + " ".join(sys.argv[1:])
    results: dict[str, object] = {
        "command": command,
        "target_recall": args.target_recall,
        "eval_tokens": args.eval_tokens,
    }
    t = time.perf_counter()
    dense = convert_hf_to_gguf(hf, work / "dense.gguf", dense=True, outtype="f16")
    # profile and predictor corpora: slices of the training text (held-out pages stay unseen)
    text = train.read_text(encoding="utf-8")
    third = len(text) // 3
    (work / "profile.txt").write_text(text[third : third + 1_500_000], encoding="utf-8")
    (work / "predictor.txt").write_text(text[2 * third : 2 * third + 600_000], encoding="utf-8")
    profile, _ = run_profile(
        ProfileOptions(
            model=dense,
            corpus=work / "profile.txt",
            out_dir=work / "profile",
            n_ctx=n_ctx,
            n_threads=args.threads,
            max_tokens=args.profile_tokens,
        )
    )
    results["profile"] = profile.summary()
    log.info(
        "profile: %d tokens, sparsity %s, 80%% of firings in %s of neurons (%.0f s)",
        profile.n_tokens,
        np.round(profile.sparsity(), 3).tolist(),
        np.round(profile.hot_share(0.8), 3).tolist(),
        time.perf_counter() - t,
    )
    t = time.perf_counter()
    report = train_predictors(
        PredictorOptions(
            model=dense,
            corpus=work / "predictor.txt",
            out_dir=work / "predictor",
            n_ctx=n_ctx,
            n_threads=args.threads,
            target_recall=args.target_recall,
            max_tokens=args.predictor_tokens,
            steps=args.predictor_steps,
        )
    )
    write_predictor_folder(work / "predictor", report.predictors)
    results["predictor_train"] = report.summary()
    results["predictor_seconds"] = time.perf_counter() - t
    # metrics on held-out pages (neither the LM nor the predictors saw them)
    held = heldout.read_text(encoding="utf-8")
    metrics = evaluate_on_text(
        dense, report.predictors, held, n_ctx=n_ctx, max_tokens=args.eval_tokens, n_threads=args.threads
    )
    results["predictor_heldout"] = [m.as_dict() for m in metrics]
    for layer, m in enumerate(metrics):
        log.info(
            "layer %d: recall %.4f precision %.4f sparsity true %.4f predicted %.4f",
            layer,
            m.recall,
            m.precision,
            m.true_sparsity,
            m.predicted_sparsity,
        )
    log.info(
        "held-out recall: mean %.4f, worst %.4f",
        np.mean([m.recall for m in metrics]),
        min(m.recall for m in metrics),
    )
    # the bundled PowerInfer GGUF and its activation statistics
    staging = work / "models"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()
    model_path = convert_hf_to_gguf(hf, staging / MODEL_FILE, predictor_dir=work / "predictor", outtype="f16")
    shutil.copytree(work / "profile" / "activation", staging / "activation")
    # sparse vs dense perplexity and KL divergence on held-out text
    sparse = Engine(model_path, EngineOptions(act_precision="f32", n_ctx=n_ctx, n_threads=args.threads))
    dense_engine = Engine(
        model_path, EngineOptions(act_precision="f32", n_ctx=n_ctx, n_threads=args.threads, dense_ffn=True)
    )
    tokens = sparse.tokenizer.encode(held, add_bos=None, parse_special=False)
    popts = PerplexityOptions(n_ctx=n_ctx, n_chunks=args.ppl_chunks)
    ppl_sparse = perplexity(sparse, tokens, popts, reference=dense_engine)
    ppl_dense = perplexity(dense_engine, tokens, popts)
    assert ppl_sparse.kld is not None
    results["perplexity"] = {
        "n_ctx": n_ctx,
        "chunks": len(ppl_dense.running),
        "scored_tokens": ppl_dense.count,
        "dense": ppl_dense.ppl,
        "sparse": ppl_sparse.ppl,
        "ratio": ppl_sparse.ppl / ppl_dense.ppl,
        "kld_mean": ppl_sparse.kld.mean,
    }
    log.info(
        "held-out perplexity: dense %.3f, sparse %.3f (%+.2f%%), KLD %.5f",
        ppl_dense.ppl,
        ppl_sparse.ppl,
        100 * (ppl_sparse.ppl / ppl_dense.ppl - 1),
        ppl_sparse.kld.mean,
    )
    (work / "results.json").write_text(json.dumps(results, indent=1))
    # replace models/ as a whole (the GGUF, activation/ and the model card)
    card = model_card(json.loads((work / "train_stats.json").read_text()), results, model_path, work)
    (staging / "README.md").write_text(card, encoding="utf-8")
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(staging, out)
    log.info("wrote %s (%.1f MB)", out, sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 1e6)


def model_card(train: dict, results: dict, model_path: Path, work: Path) -> str:
    """The models/README.md text."""
    prof = results["profile"]
    held = results["predictor_heldout"]
    ppl = results["perplexity"]
    pred = results["predictor_train"]
    corpus = {p: (work / f"{p}.txt").stat().st_size for p in ("train", "heldout")}
    corpus["pages"] = json.loads((work / "corpus.json").read_text())["pages"]
    rows = "\n".join(
        f"| {i} | {prof['sparsity'][i]:.3f} | {prof['hot_share_80'][i]:.3f} | {m['recall']:.4f} | "
        f"{m['precision']:.4f} | {m['true_sparsity']:.4f} | {m['predicted_sparsity']:.4f} |"
        for i, m in enumerate(held)
    )
    cfg = MODEL_CONFIG
    arch = (
        f"llama, ReLU(gate) * up FFN; n_embd {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, "
        f"n_ff {cfg['intermediate_size']}, {cfg['num_attention_heads']} heads, "
        f"context {cfg['max_position_embeddings']}, vocab {cfg['vocab_size']}, untied output"
    )
    file = (
        f"PowerInfer GGUF (magic PWRI), F16 matrices, predictors rank {pred['rank']} (F16), "
        f"`powerinfer.sparse_threshold` {pred['threshold']:.4g}"
    )
    source = (
        f"Debian `python3.11-doc` HTML, main text of {corpus['pages']} pages via `html.parser`; every "
        f"20th page held out: train {corpus['train'] / 1e6:.1f} MB, "
        f"held-out {corpus['heldout'] / 1e6:.2f} MB"
    )
    training = (
        f"{train['steps']} steps of {train['batch']} x {train['n_ctx']} tokens "
        f"({train['tokens'] / 1e6:.2f} M tokens), AdamW lr {train['lr']} (warm-up, cosine to 10%), "
        f"weight decay 0.1, float32, 1 CPU thread: {train['train_seconds'] / 60:.1f} min "
        f"({train['tokens_per_second']:.0f} tokens/s on 2 shared cores)"
    )
    phases = train.get("phases", [])
    if len(phases) > 1:
        parts = ", ".join(f"{p['train_seconds'] / 60:.0f} min at peak lr {p['lr']}" for p in phases)
        training += f"; in {len(phases)} phases: {parts} (later phases resume the saved weights, fresh AdamW)"
    nll = train["heldout_nll_hf_fp32"]
    ppl_row = (
        f"dense FFN {ppl['dense']:.3f}, sparse (predictors) {ppl['sparse']:.3f} "
        f"({100 * (ppl['ratio'] - 1):+.2f}%), KL divergence sparse vs dense {ppl['kld_mean']:.2g}"
    )
    recalls = [m["recall"] for m in held]
    return f"""# Bundled default model: `{model_path.name}`

A small ReLU-LLaMA (ReGLU FFN) trained from scratch on Python's documentation, with PowerInfer activation
predictors and activation statistics: the model `powerinfer main` (and the other commands) run when `-m` is
not given. It writes English-looking, documentation-flavoured text; it knows little and is not an assistant.

Made by `scripts/train_bundled_model.py` (command below); every number here comes from that run.

| | |
|---|---|
| architecture | {arch} |
| file | {file} |
| tokenizer | SentencePiece BPE, {cfg["vocab_size"]} pieces, byte fallback, trained on the training split |
| corpus | {source} |
| training | {training} |
| held-out NLL (transformers, fp32) | {nll:.3f} nats/token (perplexity {math.exp(nll):.2f}) |
| held-out perplexity of this file (-c {ppl["n_ctx"]}, {ppl["chunks"]} chunks, {ppl["scored_tokens"]} \
scored tokens) | {ppl_row} |

## Activation statistics and predictors

`activation/activation_<N>.pt`: how often each neuron fired (ReLU(gate) > 0) over {prof["n_tokens"]} tokens
of training text (`powerinfer profile`). Predictors (`powerinfer train-predictor`, target recall
{results["target_recall"]}) were fit on {pred["tokens"]["train"]} tokens of training text; thresholds were
calibrated per layer on {pred["tokens"]["calibration"]} more and folded into fc2 (the format has one global
threshold). Metrics below are on the first {results["eval_tokens"]} tokens of the held-out pages:

| layer | sparsity (profile) | neurons for 80% of firings | recall | precision | true sparsity | \
predicted sparsity |
|---:|---:|---:|---:|---:|---:|---:|
{rows}

Mean recall {sum(recalls) / len(recalls):.4f}, worst layer {min(recalls):.4f}.

## Reproduce

```bash
apt-get install -y python3.11-doc
{results["command"]}
```
"""


if __name__ == "__main__":
    main()
