"""Hugging Face Llama-family checkpoints (config.json + safetensors) into llama.cpp or PowerInfer GGUF files.

The output follows PowerInfer's convert.py (spec section 1): the same metadata keys, values, types and order;
q/k rows permuted for llama.cpp's adjacent-pair RoPE; in a PowerInfer (PWRI) file `ffn_down_t` holds HF
`down_proj` transposed to (n_ff, n_embd) and the per-layer predictors follow as `blk.N.fc1`/`fc2`. Families
that share Llama's tensors with a difference (Mistral, Qwen2, Qwen3) are described in convert/families.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from powerinfer.arch.base import ACTIVATION_KEY
from powerinfer.convert import falcon_opt, gemma_phi, moe
from powerinfer.convert.common import (
    ATTENTION_TENSORS,
    GLOBAL_TENSORS,
    LAYER_RE,
    config_number,
    write_tensors,
)
from powerinfer.convert.families import CLASS_NAMES, FAMILIES, Family, extra_shape
from powerinfer.convert.predictor import Predictors, load_predictors
from powerinfer.convert.rope import RopeScaling
from powerinfer.convert.vocab import load_vocab, read_json
from powerinfer.errors import ConfigError, FormatError, InputError
from powerinfer.gguf.constants import QUANT_SIZES, GGMLType, Keys, TensorNames, ValueType
from powerinfer.gguf.writer import GGUFWriter, output_problem
from powerinfer.printable import printable
from powerinfer.quant.types import CONVERT_FILE_TYPES, FILE_TYPES

log = logging.getLogger(__name__)

# --outtype -> (ggml type of 2-D tensors, llama_ftype written as general.file_type)
OUTTYPES: dict[str, tuple[GGMLType, int]] = {
    ft.name.lower(): (ft.ggml_type, ft.ftype)
    for name in CONVERT_FILE_TYPES
    for ft in FILE_TYPES
    if ft.name == name and ft.ggml_type is not None
}
ARCHITECTURES = tuple(FAMILIES)  # HF model_type values (convert/families.py)
# HF model_type -> the converter of a family kept in its own module (dense GGUF only): it writes the file
FAMILY_CONVERTERS: dict[str, Callable[..., GGUFWriter]] = dict.fromkeys(
    gemma_phi.FAMILIES, gemma_phi.convert_family
) | dict.fromkeys(moe.MODEL_TYPES, moe.convert_moe)
SUPPORTED_MODEL_TYPES = (*ARCHITECTURES, *falcon_opt.MODEL_TYPES, *FAMILY_CONVERTERS)
ACTIVATIONS = ("silu", "relu")

# HF name (after the layer prefix) -> GGUF template
_LAYER_TENSORS = ATTENTION_TENSORS | {
    "mlp.gate_proj.weight": TensorNames.FFN_GATE,
    "mlp.up_proj.weight": TensorNames.FFN_UP,
    "mlp.down_proj.weight": TensorNames.FFN_DOWN,
}


@dataclass(frozen=True)
class HFConfig:
    """The fields of a HF Llama config.json that the converter uses."""

    arch: str
    n_vocab: int
    n_ctx: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    rms_eps: float
    rope_theta: float | None
    rope_scaling: RopeScaling  # linear, YaRN or Llama 3 scaling (convert.rope)
    activation: str
    family: Family = FAMILIES["llama"]
    head_dim: int = 0  # 0: n_embd / n_head
    head_dim_key: bool = False  # config.json has head_dim (written as key_length where the family does)
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.n_embd // self.n_head)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], path: Path) -> HFConfig:
        model_type = cfg.get("model_type")
        classes = cfg.get("architectures")
        classes = [a for a in classes if isinstance(a, str)] if isinstance(classes, list) else []
        if model_type is None:
            model_type = next((CLASS_NAMES[a] for a in classes if a in CLASS_NAMES), None)
        if not isinstance(model_type, str) or model_type not in ARCHITECTURES:
            arch = printable(str(model_type or (classes or ["?"])[0]))
            raise ConfigError(
                f"{path}: unsupported architecture '{arch}' (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )

        def need(key: str, kind: type = int) -> Any:
            return config_number(cfg, path, key, kind)

        n_embd, n_head = need("hidden_size"), need("num_attention_heads")
        n_head_kv = config_number(cfg, path, "num_key_value_heads", int, default=n_head)
        family = FAMILIES[model_type]
        head_dim = cfg.get("head_dim")
        free = family.free_head_dim and head_dim is not None
        if n_head <= 0 or (n_embd % n_head and not free) or n_head_kv <= 0 or n_head % n_head_kv:
            raise ConfigError(
                f"{path}: hidden_size {n_embd}, {n_head} heads and {n_head_kv} KV heads do not fit"
            )
        if free and (
            isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2
        ):
            raise ConfigError(f"{printable(str(path))}: head_dim must be a positive even integer")
        if head_dim is not None and not free and head_dim != n_embd // n_head:
            raise ConfigError(
                f"{printable(str(path))}: head_dim {head_dim} != hidden_size / num_attention_heads"
            )
        rope_params = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or rope_params
        if not isinstance(rope_params, dict) or not isinstance(scaling, dict):
            raise ConfigError(f"{printable(str(path))}: rope_scaling / rope_parameters must be objects")
        theta_cfg = cfg if "rope_theta" in cfg else rope_params
        rope_theta = (
            config_number(theta_cfg, path, "rope_theta", float)
            if theta_cfg.get("rope_theta") is not None
            else None
        )
        activation = cfg.get("hidden_act", "silu")
        if not isinstance(activation, str) or activation not in ACTIVATIONS:
            raise ConfigError(
                f"{path}: unsupported hidden_act '{activation}' (supported: {', '.join(ACTIVATIONS)})"
            )
        return cls(
            arch=family.arch,
            n_vocab=need("vocab_size"),
            n_ctx=need("max_position_embeddings"),
            n_embd=n_embd,
            n_layer=need("num_hidden_layers"),
            n_ff=need("intermediate_size"),
            n_head=n_head,
            n_head_kv=n_head_kv,
            rms_eps=need("rms_norm_eps", float),
            rope_theta=rope_theta,
            rope_scaling=RopeScaling.from_config(cfg, path),
            activation=activation,
            family=family,
            head_dim=head_dim if free else n_embd // n_head,
            head_dim_key=head_dim is not None,
            sliding_window=family.window(cfg, path),
        )


def shard_path(hf_dir: Path, name: str, index: Path) -> Path:
    """A shard named by the index: a plain file name inside the checkpoint folder (no folders, no `..`, no
    absolute path; a link may not lead out of the folder either), else FormatError."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise FormatError(
            f"{printable(str(index))}: weight file {printable(name)!r} is not a file of the folder"
        )
    path = hf_dir / name
    if path.resolve().parent != hf_dir.resolve():
        raise FormatError(f"{printable(str(index))}: weight file {printable(name)!r} leads out of the folder")
    return path


class Checkpoint:
    """The tensors of the *.safetensors files of a HF folder (a sharded index too), read on demand."""

    def __init__(self, hf_dir: Path) -> None:
        from safetensors import SafetensorError, safe_open

        index = hf_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise FormatError(f"{printable(str(index))}: no weight_map")
            names = weight_map.values()
            if not all(isinstance(f, str) for f in names):
                raise FormatError(f"{printable(str(index))}: weight_map values must be file names")
            files = [shard_path(hf_dir, f, index) for f in dict.fromkeys(sorted(names))]
        else:
            files = sorted(hf_dir.glob("*.safetensors"))
        if not files:
            extra = (
                " (only PyTorch .bin weights found; convert them to safetensors)"
                if any(hf_dir.glob("*.bin"))
                else ""
            )
            raise FormatError(f"{printable(str(hf_dir))}: no *.safetensors weights{extra}")
        self._files: dict[str, Any] = {}
        self.location: dict[str, Any] = {}  # tensor name -> open file
        for path in files:
            if not path.is_file():
                raise FormatError(f"{printable(str(path))}: weight file listed in the index is missing")
            try:
                handle = safe_open(str(path), framework="numpy")
            except (SafetensorError, OSError) as e:
                raise FormatError(
                    f"{printable(str(path))}: not a safetensors file: {printable(str(e))}"
                ) from None
            self._files[str(path)] = handle
            for name in handle.keys():
                self.location[name] = (handle, path)

    def names(self) -> list[str]:
        return list(self.location)

    def shape(self, name: str) -> tuple[int, ...]:
        handle, _ = self.location[name]
        return tuple(handle.get_slice(name).get_shape())

    def get(self, name: str) -> np.ndarray:
        """The tensor as numpy; bfloat16 (which numpy lacks) is widened to float32 through torch. Weights must be
        floats (F64, F32, F16, BF16): an integer or boolean tensor is a FormatError, not a silent cast."""
        handle, path = self.location[name]
        dtype = handle.get_slice(name).get_dtype()
        if dtype not in ("F64", "F32", "F16", "BF16"):
            raise FormatError(
                f"{printable(str(path))}: tensor {printable(name)} is {printable(str(dtype))}, not a float type"
            )
        if dtype == "BF16":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                return f.get_tensor(name).float().numpy()
        return handle.get_tensor(name)


def permute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF q/k rows (rotate-half RoPE, per head: first halves then second halves) into llama.cpp's
    adjacent-pair order."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class ConversionResult:
    """What `convert_checkpoint` wrote."""

    path: Path
    sparse: bool
    outtype: str
    n_tensors: int
    n_kv: int
    n_bytes: int


def _expected_shapes(c: HFConfig) -> dict[str, tuple[int, ...]]:
    n_embd_gqa, n_embd_q = c.head_dim * c.n_head_kv, c.head_dim * c.n_head
    per_layer = {
        TensorNames.ATTN_NORM: (c.n_embd,),
        TensorNames.FFN_NORM: (c.n_embd,),
        TensorNames.ATTN_Q: (n_embd_q, c.n_embd),
        TensorNames.ATTN_OUT: (c.n_embd, n_embd_q),
        TensorNames.ATTN_K: (n_embd_gqa, c.n_embd),
        TensorNames.ATTN_V: (n_embd_gqa, c.n_embd),
        TensorNames.FFN_GATE: (c.n_ff, c.n_embd),
        TensorNames.FFN_UP: (c.n_ff, c.n_embd),
        TensorNames.FFN_DOWN: (c.n_embd, c.n_ff),  # HF orientation, before any transpose
    }
    for template, size in c.family.extra.values():
        per_layer[template] = extra_shape(size, c.n_head, c.n_head_kv, c.head_dim)
    out = {t.format(bid=b): s for b in range(c.n_layer) for t, s in per_layer.items()}
    out[TensorNames.TOKEN_EMBD] = out[TensorNames.OUTPUT] = (c.n_vocab, c.n_embd)
    out[TensorNames.OUTPUT_NORM] = (c.n_embd,)
    return out


def _map_names(ckpt: Checkpoint, c: HFConfig) -> dict[str, str]:
    """GGUF name -> HF name, in checkpoint order; checks that every tensor is present with its shape."""
    mapping: dict[str, str] = {}
    for hf_name in ckpt.names():
        gguf_name = GLOBAL_TENSORS.get(hf_name)
        m = LAYER_RE.fullmatch(hf_name)
        if m and int(m.group(1)) < c.n_layer:
            template = _LAYER_TENSORS.get(m.group(2)) or c.family.extra.get(m.group(2), (None,))[0]
            gguf_name = gguf_name if template is None else template.format(bid=int(m.group(1)))
        if gguf_name is None:
            if hf_name.endswith("rotary_emb.inv_freq"):
                continue  # recomputed from rope.freq_base
            raise FormatError(f"unexpected tensor '{printable(hf_name)}' in the checkpoint")
        mapping[gguf_name] = hf_name
    if TensorNames.OUTPUT not in mapping and TensorNames.TOKEN_EMBD in mapping and c.family.tied_output:
        # tied embeddings: PowerInfer's loader requires output.weight
        mapping[TensorNames.OUTPUT] = mapping[TensorNames.TOKEN_EMBD]
    expected = _expected_shapes(c)
    if TensorNames.OUTPUT not in mapping and not c.family.tied_output:
        del expected[TensorNames.OUTPUT]  # tied: the head reads token_embd
    for gguf_name, shape in expected.items():
        if gguf_name not in mapping:
            raise FormatError(f"the checkpoint has no tensor for {printable(gguf_name)}")
        got = ckpt.shape(mapping[gguf_name])
        if got != shape:
            raise FormatError(
                f"tensor '{mapping[gguf_name]}' has shape {got}, expected {shape} from config.json"
            )
    return mapping


def _add_metadata(
    w: GGUFWriter, c: HFConfig, name: str, file_type: int, predictors: Predictors | None
) -> None:
    def k(template: str) -> str:
        return template.format(arch=c.arch)

    u32 = ValueType.UINT32
    w.add(Keys.ARCHITECTURE, c.arch, ValueType.STRING)
    w.add(Keys.NAME, name, ValueType.STRING)
    w.add(k(Keys.CONTEXT_LENGTH), c.n_ctx, u32)
    w.add(k(Keys.EMBEDDING_LENGTH), c.n_embd, u32)
    w.add(k(Keys.BLOCK_COUNT), c.n_layer, u32)
    w.add(k(Keys.FEED_FORWARD_LENGTH), c.n_ff, u32)
    if c.family.rope_dim_key:
        w.add(k(Keys.ROPE_DIMENSION_COUNT), c.head_dim, u32)
    w.add(k(Keys.HEAD_COUNT), c.n_head, u32)
    w.add(k(Keys.HEAD_COUNT_KV), c.n_head_kv, u32)
    w.add(k(Keys.LAYERNORM_RMS_EPS), c.rms_eps, ValueType.FLOAT32)
    if c.family.key_length and c.head_dim_key:
        w.add(k(Keys.KEY_LENGTH), c.head_dim, u32)
        w.add(k(Keys.VALUE_LENGTH), c.head_dim, u32)
    if c.sliding_window is not None:
        w.add(k(Keys.SLIDING_WINDOW), c.sliding_window, u32)
    if c.rope_theta is not None:
        w.add(k(Keys.ROPE_FREQ_BASE), c.rope_theta, ValueType.FLOAT32)
    for key, value, kind in c.rope_scaling.keys(c.arch):
        w.add(key, value, kind)
    w.add(Keys.FILE_TYPE, file_type, u32)
    if predictors is not None and predictors.threshold is not None:
        w.add(Keys.SPARSE_THRESHOLD, predictors.threshold, ValueType.FLOAT32)
    if c.activation != "silu":
        # our own key (GGUF has none); omitted for SiLU so SiLU files match llama.cpp's byte for byte
        w.add(ACTIVATION_KEY, c.activation, ValueType.STRING)


def _tensors(
    ckpt: Checkpoint, c: HFConfig, mapping: dict[str, str], sparse: bool, predictors: Predictors | None
) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, row-major array) pairs: Llama 3's rope_freqs first (as llama.cpp's converter writes it), the
    checkpoint's in its order, then the predictors layer by layer."""
    factors = c.rope_scaling.freq_factors(c.head_dim)
    if factors is not None:
        yield TensorNames.ROPE_FREQS, factors
    for gguf_name, hf_name in mapping.items():
        data = ckpt.get(hf_name)
        if gguf_name.endswith(".attn_q.weight") and c.family.permute_qk:
            data = permute_rope(data, c.n_head)
        elif gguf_name.endswith(".attn_k.weight") and c.family.permute_qk:
            data = permute_rope(data, c.n_head_kv)
        elif gguf_name.endswith(".ffn_down.weight") and sparse:
            gguf_name = gguf_name.replace(".ffn_down.", ".ffn_down_t.")
            data = data.T  # (n_ff, n_embd): row j = output column of neuron j
        yield gguf_name, data
    if predictors is not None:
        for layer, (fc1, fc2) in enumerate(zip(predictors.fc1, predictors.fc2, strict=True)):
            yield TensorNames.PRED_FC1.format(bid=layer), fc1
            yield TensorNames.PRED_FC2.format(bid=layer), fc2


def convert_checkpoint(
    hf_dir: Path,
    outfile: Path,
    *,
    predictor_dir: Path | None = None,
    outtype: str = "f16",
    dense: bool = False,
    on_tensor: Callable[[str, int, int], None] | None = None,
) -> ConversionResult:
    """Convert a HF Llama/Bamboo/Mistral/Qwen2/Qwen3 checkpoint; `on_tensor(name, index, total)` reports
    progress per tensor.

    Every input is read and checked before anything is written; the file appears atomically at the end.
    """
    hf_dir, outfile = Path(hf_dir), Path(outfile)
    if outtype not in OUTTYPES:
        raise InputError(f"unsupported output type '{outtype}' (choose from {', '.join(OUTTYPES)})")
    matrix_type, file_type = OUTTYPES[outtype]
    problem = output_problem(outfile)  # before reading gigabytes: a FIFO or device there is never replaced
    if problem is not None:
        raise InputError(f"cannot write {printable(str(outfile))}: {problem}")
    if not hf_dir.is_dir():
        raise InputError(f"model folder {printable(str(hf_dir))} does not exist")
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise FormatError(f"{printable(str(hf_dir))}: no config.json (not a Hugging Face model folder)")
    config = read_json(config_path)
    if config.get("model_type") in falcon_opt.MODEL_TYPES:
        return _convert_falcon_opt(
            hf_dir, outfile, config, config_path, predictor_dir, outtype, dense, on_tensor
        )
    family = FAMILY_CONVERTERS.get(str(config.get("model_type")))
    if family is not None:
        if predictor_dir is not None and not dense:
            raise ConfigError(
                f"{config['model_type']}: PowerInfer's sparse format covers llama/bamboo/falcon/opt only; convert without "
                f"the predictor folder (a dense GGUF; `powerinfer sparsify` makes it sparse)"
            )
        w = family(hf_dir, outfile, config, Checkpoint(hf_dir), matrix_type, file_type, on_tensor)
        return ConversionResult(outfile, False, outtype, len(w.tensors), len(w.kv), outfile.stat().st_size)
    c = HFConfig.from_dict(config, config_path)
    ckpt = Checkpoint(hf_dir)
    mapping = _map_names(ckpt, c)
    vocab = load_vocab(hf_dir, config)
    vocab.pad_to(c.n_vocab)
    sparse = predictor_dir is not None and not dense
    if sparse and not c.family.sparse:
        raise InputError(
            f"a PowerInfer predictor folder is for llama/bamboo/falcon/opt checkpoints; '{c.arch}' "
            f"({config.get('model_type')}) converts to a dense GGUF only (omit the predictor folder)"
        )
    if predictor_dir is not None and dense:
        log.warning("--dense: ignoring the predictor folder %s", predictor_dir)
    predictors = load_predictors(Path(predictor_dir), c.n_layer, c.n_embd, c.n_ff) if sparse else None
    block = QUANT_SIZES[matrix_type][0]
    if predictors is not None and predictors.fc1[0].shape[0] % block:
        raise FormatError(
            f"predictor rank {predictors.fc1[0].shape[0]} is not a multiple of {block} "
            f"(needed for {matrix_type.name.lower()})"
        )

    writer = GGUFWriter(outfile, sparse=sparse)
    _add_metadata(writer, c, hf_dir.resolve().name, file_type, predictors)
    vocab.add_to(writer)
    total = len(mapping) + (2 * c.n_layer if predictors is not None else 0)
    total += c.rope_scaling.freq_factors(c.head_dim) is not None
    write_tensors(writer, _tensors(ckpt, c, mapping, sparse, predictors), total, matrix_type, on_tensor)
    return ConversionResult(
        outfile, sparse, outtype, len(writer.tensors), len(writer.kv), outfile.stat().st_size
    )


def _convert_falcon_opt(
    hf_dir: Path,
    outfile: Path,
    config: dict[str, Any],
    config_path: Path,
    predictor_dir: Path | None,
    outtype: str,
    dense: bool,
    on_tensor: Callable[[str, int, int], None] | None,
) -> ConversionResult:
    """A Falcon or OPT checkpoint (powerinfer.convert.falcon_opt); the same checks-then-write order as Llama's."""
    matrix_type, file_type = OUTTYPES[outtype]
    c = falcon_opt.read_config(config, config_path)
    ckpt = Checkpoint(hf_dir)
    tied = config.get("tie_word_embeddings", True) is not False
    mapping = falcon_opt.map_names(ckpt.names(), c, tied)
    n_positions = falcon_opt.check_shapes(c, mapping, ckpt.shape)
    vocab = load_vocab(hf_dir, config)
    vocab.pad_to(c.n_vocab)
    sparse = predictor_dir is not None and not dense
    if predictor_dir is not None and dense:
        log.warning("--dense: ignoring the predictor folder %s", predictor_dir)
    if sparse and c.activation != "relu":
        raise ConfigError(
            f"PowerInfer's sparse {c.arch} graph is ReLU; this checkpoint's activation is {printable(c.activation)}"
        )
    predictors = load_predictors(Path(predictor_dir), c.n_layer, c.n_embd, c.n_ff) if sparse else None
    if sparse:
        vocab.pre = None  # PowerInfer's converter writes none (its runtime splits with the GPT-2 regex)
    writer = GGUFWriter(outfile, sparse=sparse)
    falcon_opt.add_metadata(writer, c, file_type, sparse, predictors, n_positions)
    vocab.add_to(writer)
    total = len(mapping) + (2 * c.n_layer if predictors is not None else 0)
    tensors = falcon_opt.tensors(ckpt.get, c, mapping, sparse, predictors)
    write_tensors(writer, tensors, total, matrix_type, on_tensor)
    return ConversionResult(
        outfile, sparse, outtype, len(writer.tensors), len(writer.kv), outfile.stat().st_size
    )


def convert_hf_to_gguf(
    hf_dir: Path,
    outfile: Path,
    *,
    predictor_dir: Path | None = None,
    outtype: str = "f16",
    dense: bool = False,
) -> Path:
    """Convert a HF Llama-family checkpoint into a PowerInfer GGUF (with `predictor_dir`) or a dense GGUF.

    outtype: a key of OUTTYPES (quant.types.CONVERT_FILE_TYPES, lower-cased) for 2-D tensors (1-D tensors are always F32). dense=True (or no
    predictor folder) writes a plain llama.cpp GGUF with `ffn_down`. Returns the written path.
    """
    return convert_checkpoint(hf_dir, outfile, predictor_dir=predictor_dir, outtype=outtype, dense=dense).path
