"""Context shift (runtime.context_shift): the KV cache after a shift against a plain-torch reference that re-rotates
the kept keys as llama.cpp does, and the logits the engine gives over it.

The reference un-rotates each moved key from its old position p and rotates it to p - n_discard in float64
(rotating a key at p by delta is rotating its raw value by the angle of p + delta). Recomputing the kept tokens at
their new positions would be another thing: the later layers' keys and values of the kept tokens were computed
attending to the tokens the shift drops, and the shift keeps them so.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import (
    assert_one_error_line,
    fixture_dir,
    load_script,
    random_llama_state,
    smollm2_path,
    write_llama_gguf,
    write_relu_sparse_model,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import live_server, request
from typer.testing import CliRunner

from powerinfer.cli import app
from powerinfer.errors import InputError
from powerinfer.model.blocks import Rope
from powerinfer.model.specs import RopeSpec
from powerinfer.runtime.context_shift import held_tokens, resolve_keep, truncate_prompt
from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.runtime.generate import Generator, GenParams
from powerinfer.runtime.kv_cache import KVCache
from powerinfer.runtime.session import Session, load_session
from powerinfer.sampling import Sampler, SamplingParams
from powerinfer.server import ServerOptions

F64 = torch.float64
runner = CliRunner()


def ref_rope(x: torch.Tensor, positions: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """x (T, H, D) rotated for positions (T,) in float64, written from the RoPE definition."""
    x = x.to(F64)
    half = spec.n_rot // 2
    inv_freq = spec.base ** (-torch.arange(half, dtype=F64) * 2 / spec.n_rot)
    angles = (positions.to(F64) / spec.scale)[:, None] * inv_freq  # (T, half)
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    out = x.clone()
    if spec.kind == "adjacent":
        a, b = x[..., 0 : spec.n_rot : 2], x[..., 1 : spec.n_rot : 2]
        out[..., 0 : spec.n_rot : 2], out[..., 1 : spec.n_rot : 2] = a * cos - b * sin, a * sin + b * cos
    else:
        a, b = x[..., :half], x[..., half : spec.n_rot]
        out[..., :half], out[..., half : spec.n_rot] = a * cos - b * sin, a * sin + b * cos
    return out


def ref_shift(
    keys: torch.Tensor, values: torch.Tensor, specs: list[RopeSpec | None], n_keep: int, n_discard: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A slot's keys and values (n_layer, n, H, D) after dropping n_discard positions after n_keep, the moved keys
    rotated from p to p - n_discard through their raw (unrotated) values."""
    n = keys.shape[1]
    old = torch.arange(n_keep + n_discard, n)
    out_k = []
    for k, spec in zip(keys, specs, strict=True):
        moved = k[n_keep + n_discard :].to(F64)
        if spec is not None:
            raw = ref_rope(moved, -old, spec)  # rotating by -p undoes the rotation for p
            moved = ref_rope(raw, old - n_discard, spec)
        out_k.append(torch.cat((k[:n_keep].to(F64), moved)))
    out_v = torch.cat((values[:, :n_keep], values[:, n_keep + n_discard :]), dim=1)
    return torch.stack(out_k).float(), out_v


SPECS = {
    "adjacent": RopeSpec("adjacent", 16),
    "neox": RopeSpec("neox", 16, base=1e6),
    "partial-neox": RopeSpec("neox", 8, base=500.0),
    "partial-adjacent-scaled": RopeSpec("adjacent", 12, scale=4.0),
}


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_kv_shift_matches_the_reference_rotation(kind: str):
    """Keys written at their positions and shifted: the kept rows stay, the moved ones equal the raw keys rotated
    for their new positions (and a layer without RoPE only moves its rows)."""
    spec = SPECS[kind]
    n_ctx, H, D, n, n_keep, n_discard = 64, 2, 16, 61, 5, 28
    torch.manual_seed(0)
    raw = torch.randn(2, n, H, D, dtype=F64)
    values = torch.randn(2, n, H, D)
    kv = KVCache(2, n_ctx, H, D)
    rope = Rope(spec, n_ctx)
    positions = torch.arange(n)
    rotated = [ref_rope(raw[0], positions, spec).float(), raw[1].float()]  # layer 1 has no RoPE
    kv.write_slot(0, torch.stack(rotated), values)
    kv.shift(0, n_keep, n_discard, [rope.shift, None])
    assert kv.n_past[0] == n - n_discard
    keys, got_v = kv.read_slot(0, n - n_discard)
    kept = torch.cat((torch.arange(n_keep), torch.arange(n_keep + n_discard, n)))
    new_pos = torch.arange(n - n_discard)
    want0 = ref_rope(raw[0][kept], new_pos, spec)
    err = ((keys[0].to(F64) - want0).abs().max() / want0.abs().max()).item()
    assert err < 5e-7, err  # measured 5.6e-8 (partial neox) .. 9.5e-8 (adjacent): one float32 rotation
    assert torch.equal(keys[1], raw[1].float()[kept]) and torch.equal(got_v, values[:, kept])


def tiny_llama(folder: Path) -> Path:
    return write_llama_gguf(folder / "llama.gguf", random_llama_state(n_head_kv=2), n_head=4, n_head_kv=2)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """Files and engine options of each placement: dense (adjacent RoPE), sparse PWRI (ReLU, predictors), MoE
    (neox RoPE; SmallThinker with its RoPE-less layers) and the dense file on the pool device's spans."""
    root = tmp_path_factory.mktemp("shift")
    llama = tiny_llama(root)
    sparse = write_relu_sparse_model(root / "sparse.gguf", n_ff=256, seed=1)
    moe = {p.name: p for p in load_script("make_synthetic_moe").generate(
        root, ["qwen3moe", "smallthinker"], "tiny", ["q4_0"], seed=0
    )}  # fmt: skip
    qwen3moe = next(p for name, p in moe.items() if "qwen3moe" in name)
    smallthinker = next(p for name, p in moe.items() if "smallthinker" in name)
    return {
        "dense": (llama, {}),
        "sparse": (sparse, {}),
        "qwen3moe": (qwen3moe, {}),
        "smallthinker": (smallthinker, {}),
        "pool-spans": (llama, dict(pool_device="cpu", n_gpu_layers=99)),
    }


def engine(path: Path, n_ctx: int, **fields) -> Engine:
    return Engine(path, EngineOptions(act_precision="f32", n_ctx=n_ctx, n_threads=1, **fields))


def layer_specs(e: Engine) -> list[RopeSpec | None]:
    return [None if layer.attn.rope is None else layer.attn.rope.spec for layer in e.model.layers]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize(
    "name",
    ["dense", "sparse", "qwen3moe", "smallthinker", "pool-spans", "smollm2", "smollm2-q8_0", "smollm2-q4_0"],
)
def test_logits_after_a_shift_match_the_reference_cache(models, name: str):
    """Fill a context, shift it, decode: the logits equal those decoded over the reference's shifted cache."""
    if name.startswith("smollm2"):  # -q8_0, -q4_0: typed caches (head size 64: whole blocks of 32)
        types = {"smollm2": {}, "smollm2-q8_0": dict(cache_type_k="q8_0", cache_type_v="q8_0")}
        types["smollm2-q4_0"] = dict(cache_type_k="q4_0", cache_type_v="f16")
        path, fields = smollm2_path(), types[name]
    else:
        path, fields = models[name]
    n_ctx = 48
    tokens = [(7 * i + 3) % 200 + 3 for i in range(n_ctx - 1)]
    e = engine(path, n_ctx, **fields)
    e.prefill(0, tokens[:-1])
    e.decode([0], tokens[-1:])  # a device span made before the shift keeps its views of the cache
    n_keep, n_discard = 4, (len(tokens) - 4) // 2
    e.shift(0, n_keep, n_discard)
    assert e.kv.n_past[0] == len(tokens) - n_discard
    got = e.decode([0], [42])[0]

    ref = engine(path, n_ctx, **fields)
    ref.prefill(0, tokens)
    keys, values = ref.kv.read_slot(0, len(tokens))
    specs = layer_specs(ref)
    if name == "smallthinker":
        assert None in specs and any(s is not None for s in specs)  # layers with and without RoPE
    k2, v2 = ref_shift(keys, values, specs, n_keep, n_discard)
    ref.kv.write_slot(0, k2, v2)
    want = ref.decode([0], [42])[0]
    # measured: dense 2.5e-7, sparse 2.7e-7, qwen3moe 1.7e-7, smallthinker 1.7e-7, pool-spans 2.5e-7, smollm2 5.1e-7;
    # typed caches re-encode the moved rows (the reference rotates in float64, the engine in float32, so a few
    # elements land on the next quantisation level): smollm2-q8_0 8.4e-5, smollm2-q4_0 (keys; f16 values) 0
    assert rel(got, want) < (2e-6 if "-" not in name else 4e-4)
    # the rows moved without re-rotating their keys: measured 0.028 (smallthinker) .. 1.08 (sparse), smollm2 0.16
    ref.kv.write_slot(0, torch.cat((keys[:, :n_keep], keys[:, n_keep + n_discard :]), dim=1), v2)
    assert rel(ref.decode([0], [42])[0], want) > 1e-2


class Recorder:
    """A greedy sampler that keeps every logits row it is given."""

    def __init__(self) -> None:
        self.rows: list[torch.Tensor] = []
        self.seed = 0

    def __call__(self, logits: torch.Tensor, history: list[int]) -> int:
        self.rows.append(logits.clone())
        return int(torch.argmax(logits))


@pytest.fixture(scope="module")
def pair(models) -> tuple[Engine, Engine]:
    path = models["dense"][0]
    return engine(path, 24), engine(path, 24)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n_prompt=st.integers(1, 20), keep=st.integers(-1, 25), n_predict=st.integers(1, 70))
def test_generator_shifts_as_the_reference(pair, n_prompt: int, keep: int, n_predict: int):
    """Random prompt lengths and --keep values: the loop's logits at every step equal a reference loop that shifts
    its cache with ref_shift at llama.cpp's points (n_past + 1 >= n_ctx, n_discard = (n_past - n_keep) / 2), and
    the slot ends up holding `held_tokens`."""
    e, ref = pair
    n_ctx = e.n_ctx
    prompt = [1] + [(5 * i + 11) % 250 + 3 for i in range(n_prompt - 1)]
    n_keep = resolve_keep(keep, len(prompt), add_bos=True)
    assert n_keep == (len(prompt) if keep < 0 or keep > len(prompt) else min(keep + 1, len(prompt)))
    gen = Generator(e, keep=True)
    recorder = Recorder()
    params = GenParams(n_predict=n_predict, ignore_eos=True, context_shift=True, n_keep=n_keep)
    events = gen.start(0, prompt, params, recorder)  # type: ignore[arg-type]
    while gen.live:
        events += gen.step()
    seq = events[-1].seq
    assert seq is not None and seq.end == "length" and seq.n_gen == n_predict

    # the reference: the same tokens, its own shifts
    specs = layer_specs(ref)
    ref.free(0)
    logits = ref.prefill(0, prompt)
    held = list(prompt)
    shifts = []
    eog = sorted(e.tokenizer.eog_ids)
    live = torch.ones(logits.shape[0], dtype=torch.bool)
    live[eog] = False
    for i, token in enumerate(seq.history[len(prompt) :]):
        want = logits.clone()
        want[eog] = float("-inf")  # ignore_eos bans them
        assert rel(recorder.rows[i][live], want[live]) < 2e-6, (i, shifts)  # measured <= 5.4e-7
        assert token == int(torch.argmax(want))
        if i == n_predict - 1:
            break
        n_past = ref.kv.n_past[0]
        if n_past + 1 >= n_ctx:
            n_discard = (n_past - n_keep) // 2
            keys, values = ref.kv.read_slot(0, n_past)
            ref.kv.write_slot(0, *ref_shift(keys, values, specs, n_keep, n_discard))
            held = held[:n_keep] + held[n_keep + n_discard :]
            shifts.append((n_keep, n_discard))
        logits = ref.decode([0], [token])[0]
        held.append(token)
    assert seq.shifts == shifts
    held.append(seq.history[-1])
    assert held_tokens(seq) == held
    assert e.kv.n_past[0] == len(held) - 1  # the last token was sampled, not evaluated


def test_truncate_prompt_keeps_n_keep_and_the_end():
    """llama-server's cut: n_keep tokens, then the end, whole blocks of (n_ctx - n_keep) / 2 dropped between."""
    prompt = list(range(100))
    assert truncate_prompt(prompt, 128, 4) == prompt
    cut = truncate_prompt(prompt, 40, 4)  # block 18: (100 - 4 - 18) // 18 = 4 blocks, 72 tokens dropped
    assert cut == list(range(4)) + list(range(76, 100)) and len(cut) < 40
    cut = truncate_prompt(list(range(40)), 40, 0)  # a prompt of exactly n_ctx is cut too
    assert cut == list(range(20, 40))


# ---------------------------------------------------------------------- main and the server
GREEDY = SamplingParams(temp=0.0)


def reference_text(path: Path, n_ctx: int, prompt: list[int], n: int, n_keep: int) -> tuple[list[int], str]:
    """Greedy tokens and text of the library's loop with context shift (the path `main` takes)."""
    e = engine(path, n_ctx)
    ids = list(e.generate(prompt, Sampler(GREEDY), n_predict=n, ignore_eos=True, n_keep=n_keep))
    return ids, e.tokenizer.decode(ids, strip_leading_space=False)


def test_main_shifts_and_writes_every_token(models):
    """-c 32 -n 100: a hundred tokens, as the library's loop with --keep 2 (+ BOS) gives them; the prompt
    tokens it keeps are in the `generate:` line."""
    path = models["dense"][0]
    args = ["main", "-m", str(path), "-c", "32", "-n", "100", "--temp", "0", "--ignore-eos", "-t", "1"]
    result = runner.invoke(app, [*args, "--keep", "2", "-p", "a b c", "--no-display-prompt"])
    assert result.exit_code == 0, result.stderr
    prompt = engine(path, 32).tokenizer.encode("a b c", add_bos=None, parse_special=True)
    assert prompt[0] == 1  # the tiny vocabulary adds BOS: --keep 2 keeps 3 tokens
    ids, text = reference_text(path, 32, prompt, 100, 3)
    assert len(ids) == 100 and result.stdout == text + "\n"
    assert "n_keep = 3," in result.stderr
    # --no-context-shift: the run stops at the full context with llama.cpp's line
    stopped = runner.invoke(app, [*args, "--no-context-shift", "-p", "a b c", "--no-display-prompt"])
    assert (
        stopped.exit_code == 0 and "context full and context shift is disabled => stopping" in stopped.stderr
    )
    assert stopped.stdout == engine(path, 32).tokenizer.decode(ids[: 32 - len(prompt) + 1]) + "\n"


@pytest.mark.parametrize(("flags", "needle"), [(["--keep", "32"], "--keep 32"), (["--keep", "-3"], "--keep")])
def test_bad_keep_is_one_error_line(models, flags: list[str], needle: str):
    path = models["dense"][0]
    result = runner.invoke(app, ["main", "-m", str(path), "-c", "32", "-n", "4", "-p", "a", *flags])
    assert_one_error_line(result, needle)


@pytest.fixture(scope="module")
def shifting_server(models):
    path = models["dense"][0]
    opts = ServerOptions(
        model=path,
        engine=EngineOptions(act_precision="f32", n_ctx=32, n_seq=2, n_threads=1),
        alias="tiny",
        context_shift=True,
    )
    with live_server(opts) as srv:
        yield srv


def test_server_truncates_and_shifts(models, shifting_server):
    """A prompt longer than the slot: cut as llama-server cuts it (n_keep tokens, then the end), the generation
    shifts its context and says `truncated`; the text is the library loop's over the cut prompt. The OpenAI
    client gets the same text; a request that fits and never shifts is not truncated; the slot's cache after a
    shift serves the next request's common prefix correctly."""
    path = models["dense"][0]
    prompt = [1] + [(3 * i + 7) % 250 + 3 for i in range(59)]  # 60 tokens, context 32
    cut = truncate_prompt(prompt, 32, 4)
    assert len(cut) < 32 and cut[:4] == prompt[:4] and cut[4:] == prompt[-(len(cut) - 4) :]
    ids, text = reference_text(path, 32, cut, 60, 4)
    body = {"prompt": prompt, "n_predict": 60, "temperature": 0, "ignore_eos": True, "n_keep": 3}
    status, out, _ = request(shifting_server, "POST", "/completion", body)
    assert status == 200, out
    assert out["truncated"] is True and out["content"] == text and out["tokens_predicted"] == 60
    assert out["tokens_evaluated"] == len(cut) and out["generation_settings"]["n_keep"] == 4
    # the same request again: the slot's cache holds the shifted tokens; what it reuses must still be right
    status, again, _ = request(shifting_server, "POST", "/completion", body)
    assert status == 200 and again["content"] == text and again["timings"]["cache_n"] >= 4

    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=shifting_server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    got = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=60,
        temperature=0,
        extra_body={"n_keep": 3, "ignore_eos": True},
    )
    assert got.choices[0].text == text and got.usage.prompt_tokens == len(cut)

    short = [1, 5, 6, 7]
    _, text = reference_text(path, 32, short, 8, 1)
    status, out, _ = request(
        shifting_server, "POST", "/completion", {"prompt": short, "n_predict": 8, "temperature": 0}
    )
    assert status == 200 and out["truncated"] is False and out["content"] == text
    # n_keep -1 keeps the whole prompt: a prompt over the context then cannot be cut
    status, out, _ = request(shifting_server, "POST", "/completion", {**body, "n_keep": -1})
    assert status == 400 and "n_keep" in out["error"]["message"]


def test_pipeline_stages_shift_as_one_process(models, tmp_path: Path):
    """Two pipeline ranks: the shift reaches the second stage's cache (a header passed along the ring), and the
    logits after it equal one process's."""
    from test_pipeline import run_program, single

    spec = {"model": str(models["dense"][0]), "n_ctx": 128, "n_predict": 6, "shift": [3, 40]}
    want = single(spec)
    got = run_program(tmp_path, 2, spec)
    # a second stage that kept its rows would attend over 40 stale ones: far off
    torch.testing.assert_close(got["shifted"], want["shifted"], rtol=0, atol=1e-5)


# ---------------------------------------------------------------------- interactive main and session files
def test_session_makes_room_over_the_shifted_cache(models):
    """Input that would overflow the context: the cache drops the same positions as the tokens (keys re-rotated
    as the reference does), only the new tokens are evaluated, and their logits are the reference cache's."""
    path = models["dense"][0]
    held = [1] + [(9 * i + 4) % 250 + 3 for i in range(25)]  # 26 tokens in a context of 32
    new = [17, 18, 19, 20, 21]
    e = engine(path, 32)
    session = Session(e)
    session.sync(held)
    tokens = session.make_room(held + new, 2)
    n_discard = (len(held + new) - 2) // 2
    assert tokens == held[:2] + (held + new)[2 + n_discard :]
    assert session.cached == held[:2] + held[2 + n_discard :] and e.kv.n_past[0] == len(session.cached)
    got, n_evaluated = session.sync(tokens)
    assert n_evaluated == len(new)

    ref = engine(path, 32)
    ref.prefill(0, held)
    keys, values = ref.kv.read_slot(0, len(held))
    ref.kv.write_slot(0, *ref_shift(keys, values, layer_specs(ref), 2, n_discard))
    want = ref.prefill(0, new, ref.kv.n_past[0])
    assert rel(got, want) < 1e-6  # measured 1.6e-7


def test_interactive_main_shifts_and_saves_the_held_tokens(models, tmp_path: Path):
    """-i with replies that overflow the context: every turn goes on (no "context is full"), and
    --prompt-cache-all saves the tokens the cache holds, which a later run loads and reuses."""
    path = models["dense"][0]
    cache = tmp_path / "session.bin"
    args = ["main", "-m", str(path), "-c", "32", "-n", "20", "--temp", "0", "--ignore-eos", "-t", "1"]
    args += ["--act-precision", "f32", "--keep", "-1", "-p", "a b", "--prompt-cache", str(cache)]
    result = runner.invoke(app, [*args, "-i", "--prompt-cache-all"], input="c d\ne f\n")
    assert result.exit_code == 0, result.stderr
    assert "error" not in result.stderr
    e = engine(path, 32)
    prompt = e.tokenizer.encode("a b", add_bos=None)
    tokens = load_session(cache, e)
    assert 0 < len(tokens) < 32 and tokens[: len(prompt)] == prompt
    # with the whole run it held (3 turns of 20 tokens) the context shifted; the file holds what the cache held
    again = runner.invoke(app, args)
    assert again.exit_code == 0, again.stderr
    assert f"loaded a session with prompt size of {len(tokens)} tokens" in again.stderr
    assert "using full prompt from session file" in again.stderr
    # without the shift the second turn does not fit
    stopped = runner.invoke(app, [*args[:-2], "-i", "--no-context-shift"], input="c d\ne f\n")
    assert_one_error_line(stopped, "context is full")


def test_conversation_goes_on_past_the_context(models):
    """-cnv renders the whole conversation each turn: once it no longer fits it is cut like a shift and the turns
    go on; without the shift the fourth turn is one error line."""
    path = models["dense"][0]
    args = ["main", "-m", str(path), "-c", "96", "-n", "20", "--temp", "0", "--ignore-eos", "-t", "1"]
    args += ["--act-precision", "f32", "-cnv", "-sys", "be nice"]
    turns = "hello there\nand more\nand again\nfour\nfive\n"
    result = runner.invoke(app, args, input=turns)
    assert result.exit_code == 0, result.stderr
    assert result.stdout.count("> ") == 6  # five answers, then the prompt that meets the end of input
    assert_one_error_line(runner.invoke(app, [*args, "--no-context-shift"], input=turns), "context is full")


def test_learned_positions_stop_with_one_warning(tmp_path: Path):
    """OPT adds learned absolute positions to the residual: its cached rows cannot move. A full context stops the
    generation with one warning line instead of shifting (and an explicit shift is refused)."""
    path = fixture_dir("tiny-relu-opt") / "tiny.powerinfer.gguf"
    e = engine(path, 16)
    with pytest.raises(InputError, match="learned absolute positions"):
        e.prefill(0, [5, 6, 7, 8])
        e.shift(0, 1, 2)
    args = [
        "main",
        "-m",
        str(path),
        "-c",
        "16",
        "-n",
        "40",
        "--temp",
        "0",
        "--ignore-eos",
        "-t",
        "1",
        "-p",
        "a",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    lines = [ln for ln in result.stderr.splitlines() if "cannot shift" in ln]
    assert len(lines) == 1 and "=> stopping" in lines[0], result.stderr
