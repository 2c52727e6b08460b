"""The seams of the engine: sparse FFNs for any activation, -ngl layer offload, engine-owned kernel settings,
one step for every batch shape, and an import graph without cycles."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import random_llama_state, random_predictors, write_llama_gguf

from powerinfer import ops
from powerinfer.gguf import GGMLType
from powerinfer.runtime.engine import Engine, EngineOptions

N_HEAD, N_HEAD_KV, N_FF, N_LAYER = 4, 2, 128, 4
TOKENS = [5, 17, 99, 200, 3, 41, 250, 8]
PACKAGE = Path(__file__).resolve().parents[1] / "powerinfer"


def _state(seed: int = 0) -> dict[str, np.ndarray]:
    return random_llama_state(n_layer=N_LAYER, n_ff=N_FF, n_head=N_HEAD, n_head_kv=N_HEAD_KV, seed=seed)


def _dense_file(tmp_path: Path, dtype: GGMLType, act: str | None = None) -> Path:
    return write_llama_gguf(
        tmp_path / f"dense-{dtype.name}-{act}.gguf",
        _state(),
        n_head=N_HEAD,
        n_head_kv=N_HEAD_KV,
        dtype=dtype,
        act=act,
    )


# ------------------------------------------------------------------------------------------ activations


@pytest.mark.parametrize("act", ["silu", "gelu", "relu"])
def test_sparse_ffn_computes_the_files_activation(tmp_path, act):
    """A PowerInfer file that declares a SiLU (or GELU) FFN runs sparse with that activation: at threshold
    -inf every neuron is active and the logits equal the dense path's, which computes act(gate) * up."""
    sd = _state()
    path = write_llama_gguf(
        tmp_path / f"{act}.powerinfer.gguf",
        sd,
        n_head=N_HEAD,
        n_head_kv=N_HEAD_KV,
        act=act,
        predictors=random_predictors(sd),
        threshold=float("-inf"),
    )
    sparse = Engine(path, EngineOptions(act_precision="f32", n_ctx=64, n_threads=2))
    dense = Engine(path, EngineOptions(act_precision="f32", n_ctx=64, n_threads=2, dense_ffn=True))
    want = dense.logits_all(TOKENS)
    got = sparse.logits_all(TOKENS)
    # measured: 0 for relu, <= 3e-7 relative for silu and gelu (prefill: same matmuls, other summation order in
    # the transposed down product); decode goes through the fused kernel with the activation as an argument
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    sparse.reset()
    dense.reset()
    for t in TOKENS:
        d, s = dense.eval([t]), sparse.eval([t])
        assert (s - d).abs().max().item() <= 1e-5 * d.abs().max().item()
    # the dense path really is that activation: relu and silu logits differ
    if act != "relu":
        relu = write_llama_gguf(
            tmp_path / "relu-twin.gguf", sd, n_head=N_HEAD, n_head_kv=N_HEAD_KV, act="relu"
        )
        other = Engine(relu, EngineOptions(act_precision="f32", n_ctx=64, n_threads=2)).logits_all(TOKENS)
        assert (other - want).abs().max().item() > 1e-2


# ------------------------------------------------------------------------------------------ -ngl


@pytest.mark.parametrize("dtype", [GGMLType.F32, GGMLType.Q4_0])
@pytest.mark.parametrize("n_gpu_layers", [0, 1, N_LAYER // 2, N_LAYER, N_LAYER + 1])
def test_ngl_offloads_the_last_layers(tmp_path, dtype, n_gpu_layers):
    path = _dense_file(tmp_path, dtype)
    ref = Engine(path, EngineOptions(act_precision="f32", n_ctx=64, n_threads=2)).logits_all(TOKENS)
    engine = Engine(
        path,
        EngineOptions(
            act_precision="f32", n_ctx=64, n_threads=2, pool_device="cpu", n_gpu_layers=n_gpu_layers
        ),
    )
    on_device = [isinstance(layer.attn.wq, ops.DeviceWeight) for layer in engine.model.layers]
    n = min(n_gpu_layers, N_LAYER)
    assert on_device == [False] * (N_LAYER - n) + [True] * n
    ffn_on_device = [isinstance(layer.ffn.down, ops.DeviceWeight) for layer in engine.model.layers]
    assert ffn_on_device == on_device
    assert isinstance(engine.model.head.output, ops.DeviceWeight) == (n_gpu_layers > N_LAYER)
    # the pool holds the layers' tensors in their file's blocks: its bytes are the file's bytes of them
    names = [
        t
        for t in engine.gguf.tensors
        if t.startswith(tuple(f"blk.{b}." for b in range(N_LAYER - n, N_LAYER)))
    ]
    if n_gpu_layers > N_LAYER:
        names += ["output.weight", "output_norm.weight"]
    assert engine.loader.device_bytes == sum(engine.gguf.tensors[t].n_bytes for t in names)
    got = engine.logits_all(TOKENS)
    # measured: identical (the stand-in runs the same kernels on copied blocks)
    assert (got - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
    # decode through the offloaded layers (their KV caches live with them)
    engine.reset()
    cpu = Engine(path, EngineOptions(act_precision="f32", n_ctx=64, n_threads=2))
    for t in TOKENS[:4]:
        a, b = cpu.eval([t]), engine.eval([t])
        assert (a - b).abs().max().item() <= 1e-4 * a.abs().max().item()
    if n:
        assert any(line.startswith("placement:") for line in engine.placement_report())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("n_gpu_layers", [0, 1, N_LAYER // 2, N_LAYER, N_LAYER + 1])
def test_ngl_on_cuda(tmp_path, n_gpu_layers):
    path = _dense_file(tmp_path, GGMLType.Q4_0)
    ref = Engine(path, EngineOptions(act_precision="f32", n_ctx=64, n_threads=2)).logits_all(TOKENS)
    engine = Engine(
        path,
        EngineOptions(
            act_precision="f32", n_ctx=64, n_threads=2, pool_device="cuda", n_gpu_layers=n_gpu_layers
        ),
    )
    got = engine.logits_all(TOKENS)
    assert (got - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


def test_ngl_is_refused_for_a_negative_count(tmp_path):
    from powerinfer.errors import PlacementError

    path = _dense_file(tmp_path, GGMLType.F32)
    with pytest.raises(PlacementError, match="-ngl"):
        Engine(path, EngineOptions(act_precision="f32", n_ctx=64, pool_device="cpu", n_gpu_layers=-1))


# ------------------------------------------------------------------------------------------ kernel context


@pytest.mark.skipif(not ops.kernels_available(), reason="kernels not built")
def test_two_engines_keep_their_own_kernel_settings(tmp_path):
    """Two engines in one process, f32 and q8 activations, interleaved: each gives what it gives alone."""
    path = _dense_file(tmp_path, GGMLType.Q4_0)
    alone = {}
    for act in ("f32", "q8"):
        alone[act] = Engine(path, EngineOptions(n_ctx=64, n_threads=2, act_precision=act)).logits_all(TOKENS)
    assert not torch.equal(alone["f32"], alone["q8"])  # the modes really differ
    engines = {
        act: Engine(path, EngineOptions(n_ctx=64, n_threads=1, act_precision=act)) for act in ("f32", "q8")
    }
    for t in TOKENS:
        for engine in engines.values():
            engine.eval([t])
    for act, engine in engines.items():
        engine.reset()
        assert torch.equal(engine.logits_all(TOKENS), alone[act]), act


# ------------------------------------------------------------------------------------------ one step


def test_step_serves_every_batch_shape(tmp_path):
    """Prompts of two sequences in one mixed step, then batched decode, equal each sequence run alone."""
    path = _dense_file(tmp_path, GGMLType.F32)
    prompts = [[1, 5, 17, 99], [1, 200, 3]]
    single = []
    for p in prompts:
        e = Engine(path, EngineOptions(act_precision="f32", n_ctx=64, n_threads=2))
        rows = [e.eval(p)]
        for t in (7, 9, 11):
            rows.append(e.eval([t]))
        single.append(torch.stack(rows))
    e = Engine(path, EngineOptions(act_precision="f32", n_ctx=64, n_threads=2, n_seq=2))
    seqs = [0] * 4 + [1] * 3
    positions = [0, 1, 2, 3, 0, 1, 2]
    first = e.step(seqs, prompts[0] + prompts[1], positions)  # the last token of each run
    assert first.shape[0] == 2
    got = [[first[0]], [first[1]]]
    for t in (7, 9, 11):
        logits = e.decode([0, 1], [t, t])
        got[0].append(logits[0])
        got[1].append(logits[1])
    for s in range(2):
        # measured: <= 2e-7 relative (batched attention sums in another order than the single-token kernel)
        want = single[s]
        assert (torch.stack(got[s]) - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    assert e.kv.n_past == [7, 6]


def test_engine_steps_an_assembled_model_through_its_forward_strategy(tmp_path):
    """Engine(assemble(...)) is Engine(path, ...); an injected forward strategy runs every step and fork."""
    from powerinfer.runtime.assembly import assemble
    from powerinfer.runtime.forward import LocalForward
    from powerinfer.runtime.generate import generate
    from powerinfer.sampling import Sampler, SamplingParams

    path = _dense_file(tmp_path, GGMLType.Q8_0)
    options = EngineOptions(n_ctx=64, n_threads=1, n_seq=2)
    want = Engine(path, options).logits_all(TOKENS)
    model = assemble(path, options)
    assert model.kc.act_precision == "q8" and model.n_ctx == 64 and model.stage is None

    class Counting(LocalForward):
        steps, forks = 0, []

        def __call__(self, *args):
            Counting.steps += 1
            return super().__call__(*args)

        def fork(self, src, dst, n):
            Counting.forks.append((src, dst, n))

    engine = Engine(model, forward=Counting(model.kc))
    assert torch.equal(engine.logits_all(TOKENS), want)
    assert Counting.steps == 1 and engine.governor is None
    engine.fork(0, 1)
    assert Counting.forks == [(0, 1, len(TOKENS))] and engine.kv.n_past == [len(TOKENS)] * 2
    with pytest.raises(ValueError, match="its own options"):
        Engine(model, EngineOptions(n_ctx=32))
    greedy = Sampler(SamplingParams(temp=0))
    engine.reset()
    assert list(generate(engine, TOKENS, greedy, n_predict=4)) == list(
        Engine(path, options).generate(TOKENS, Sampler(SamplingParams(temp=0)), n_predict=4)
    )


def test_step_rejects_positions_past_a_sequence(tmp_path):
    from powerinfer.errors import InputError

    e = Engine(_dense_file(tmp_path, GGMLType.F32), EngineOptions(act_precision="f32", n_ctx=64, n_threads=1))
    with pytest.raises(InputError, match="skips past"):
        e.step([0], [5], [3])


# ------------------------------------------------------------------------------------------ imports


def _imports(path: Path, module: str) -> set[str]:
    """Modules of powerinfer this module imports anywhere: at the top, inside functions (lazy imports) and under
    `if TYPE_CHECKING:` (an import only for annotations is still a dependency: a circle through one is a knot
    the code hides, not one it lacks)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names if a.name.startswith("powerinfer"))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = module.split(".")[: -child.level]
                    base = ".".join(parts + ([base] if base else []))
                if base.startswith("powerinfer"):
                    for a in child.names:
                        sub = f"{base}.{a.name}"
                        found.add(sub if _module_path(sub) is not None else base)
            visit(child)

    visit(tree)
    return found


def _module_path(name: str) -> Path | None:
    rel = Path(*name.split(".")[1:])
    for candidate in (PACKAGE / rel.with_suffix(".py"), PACKAGE / rel / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _graph() -> dict[str, set[str]]:
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        name = ".".join(parts)
        graph[name] = {
            m for m in _imports(path, name if path.name != "__init__.py" else name + ".x") if m != name
        }
    return graph


def test_the_import_graph_sees_type_checking_and_lazy_imports():
    """The graph the no-cycle test walks has the edges only annotations or a function body need."""
    graph = _graph()
    assert "powerinfer.ops.qweight" in graph["powerinfer.ops.dense"]  # under TYPE_CHECKING only
    assert (
        "powerinfer.runtime.pipeline" in graph["powerinfer.runtime.engine"]
    )  # TYPE_CHECKING and in functions


def test_no_import_cycle_in_the_package():
    """No circle in the imports between powerinfer's modules, TYPE_CHECKING and function-level imports included."""
    graph = _graph()
    state: dict[str, int] = {}
    cycle: list[str] = []

    def dfs(node: str, stack: list[str]) -> bool:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if state.get(nxt) == 1:
                cycle.extend(stack[stack.index(nxt) :] + [nxt] if nxt in stack else [node, nxt])
                return True
            if state.get(nxt) is None and dfs(nxt, stack + [nxt]):
                return True
        state[node] = 2
        return False

    for node in sorted(graph):
        if state.get(node) is None and dfs(node, [node]):
            break
    assert not cycle, " -> ".join(cycle)


def test_only_the_cli_imports_the_command_bodies():
    """cli/ parses options and calls app/ (the commands' bodies); no library module imports either."""
    graph = _graph()
    assert "powerinfer.app.main" in graph["powerinfer.cli.main"]  # the graph sees these edges
    for name, deps in graph.items():
        if name == "powerinfer.__main__" or name.startswith("powerinfer.cli"):
            continue
        bad = [d for d in deps if d.startswith("powerinfer.cli")]
        if not name.startswith("powerinfer.app"):
            bad += [d for d in deps if d.startswith("powerinfer.app")]
        assert not bad, (name, bad)


def test_runtime_does_not_import_an_architecture_module():
    graph = _graph()
    for name, deps in graph.items():
        if name.startswith("powerinfer.runtime"):
            bad = [d for d in deps if d.startswith("powerinfer.arch.")]
            assert not bad, (name, bad)


def test_sparse_ffn_refuses_arguments_that_contradict_its_spec():
    """A gate matrix exactly when the spec is gated, the biases exactly when it has them: one clear error when the
    model is built otherwise. (Ungated and biased FFNs, Falcon's and OPT's, do run sparse: the next test.)"""
    from powerinfer.errors import ConfigError
    from powerinfer.model.sparse import PredictorSelector, SparseFFN, SparseStats
    from powerinfer.model.specs import FFNSpec

    w = ops.QWeight.from_numpy(np.zeros((32, 32), np.float32), GGMLType.F32, (32, 32))
    kc = ops.KernelContext()
    selector = PredictorSelector(w, w, 0.0, kc)
    b = (torch.zeros(32), torch.zeros(32))
    for spec, gate, biases, needle in (
        (FFNSpec(act="relu", gated=False), w, (None, None), "gate matrix exactly when"),
        (FFNSpec(act="relu"), None, (None, None), "gate matrix exactly when"),
        (FFNSpec(act="relu", gated=False, bias=True), None, (None, None), "biases given do not match"),
        (FFNSpec(act="relu"), w, b, "biases given do not match"),
    ):
        with pytest.raises(ConfigError, match=needle):
            SparseFFN(spec, 0, selector, gate, w, w, None, SparseStats.zeros(1), kc, biases=biases)
    with pytest.raises(ConfigError, match="unsupported FFN activation"):
        FFNSpec(act="swish")


@pytest.mark.parametrize("bias", [False, True])
def test_ungated_sparse_ffn_computes_act_of_up(bias):
    """An ungated FFN (Falcon; with biases, OPT) runs sparse: with every neuron active it computes
    down(act(up . u + b_up)) + b_down, for one token (decode rows) and several (the cold path)."""
    from powerinfer.model.sparse import PredictorSelector, SparseFFN, SparseStats
    from powerinfer.model.specs import FFNSpec
    from powerinfer.ops.reference import dense

    D, n_ff, rank = 64, 96, 32
    g = torch.Generator().manual_seed(0)

    def weight(n: int, k: int) -> ops.QWeight:
        return ops.QWeight.from_numpy(torch.randn(n, k, generator=g).numpy() * 0.2, GGMLType.F32, (n, k))

    up, down_t, fc1, fc2 = weight(n_ff, D), weight(n_ff, D), weight(rank, D), weight(n_ff, rank)
    b_up, b_down = (torch.randn(n_ff, generator=g), torch.randn(D, generator=g)) if bias else (None, None)
    kc = ops.KernelContext(n_threads=1)
    ffn = SparseFFN(
        FFNSpec(act="gelu", gated=False, bias=bias),
        0,
        PredictorSelector(fc1, fc2, float("-inf"), kc),  # every neuron active
        None,
        up,
        down_t,
        None,
        SparseStats.zeros(1),
        kc,
        biases=(b_up, b_down),
    )
    up_f, down_f = dense(up), dense(down_t)
    for T in (1, 3):
        u = torch.randn(T, D, generator=g)
        pre = u @ up_f.T + (0 if b_up is None else b_up)
        want = ops.act("gelu", pre) @ down_f + (0 if b_down is None else b_down)
        got = ffn(u, u)
        # F32 weights, float32 sums of 64 and 96 terms: measured <= 2.7e-7 of the largest output
        assert (got - want).abs().max().item() <= 1e-6 * want.abs().max().item(), T
    assert int(ffn.stats.active[0]) == 4 * n_ff  # 1 + 3 tokens, every neuron
