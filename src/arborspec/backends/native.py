"""The native backend: a GGUF model run by transformers' own layers with its weights kept as GGUF blocks.

The torch backend dequantizes a GGUF into dense bf16 tensors (the 1.5B target: ~3 GB resident); llama.cpp keeps the
blocks but runs its own kernels, one sequence-id set per tree node. Here the model is transformers' skeleton in
float32 (its sessions are `native_step.NativeSession`s on the C++ step; `hf.TreeSession` with the Python forward only
for head sizes the step does not take) whose every
linear layer and output head is a `QuantLinear` and whose embedding is a `QuantEmbedding`: both hold a
`kernels.QuantMatrix` over the file's blocks (nothing is dequantized up front), and the matrix products run on
arborspec's own kernels, which read the blocks once for all rows of a tree (docs/kernels.md). Norms, biases and the
rotary tables are the only float tensors made; a tied head reads the embedding's blocks.

The skeleton is built on the meta device (no weight memory) from the GGUF's config (its metadata renamed by
transformers' GGUF key table: what transformers itself reads), then each GGUF tensor replaces the module it belongs
to, its blocks read from the file. Every tensor of the file must find its module and every
parameter of the skeleton must be filled, so a file with something this mapping does not know (another architecture's
extra tensors, Llama 3.1's rope_freqs) is refused with `NotNative` instead of running wrong; the loader then runs it
on another backend. llama.cpp's converter stores the llama architecture's attn_q / attn_k rows permuted for its rope
layout (pairs of adjacent dimensions); transformers rotates halves, so those rows are put back in order here, a
permutation of whole rows of blocks (each row is independent).

The file's header is read by gguf_file.py; the forward itself lives in native_step.py (C++) and native_forward.py (the
Python reference).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from types import MethodType

import numpy as np
import torch
from gguf.quants import dequantize
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.modeling_gguf_pytorch_utils import GGUF_TO_TRANSFORMERS_MAPPING

from ..core.disk_cache import sha256_key
from ..core.downloads import first_line
from ..core.sampling import spread
from ..kernels import QuantMatrix, supported
from ..kernels.matrix import SUPPORTED_TYPES, VNNI_ROWS
from . import native_step
from .gguf_file import SIZES, ArrayLength, GgufFile, GgufTensor, check_causal, describe, read_gguf, read_gguf_info

ARCHITECTURES = ("qwen2", "llama")  # GGUF general.architecture values whose tensors map onto transformers' classes
# how the backend names its weight format (blocks as in the GGUF, float32 activations), as llama.cpp's "gguf-q4_k_m":
# in the cost-profile fingerprint. model.dtype itself stays torch.float32: TreeSession builds its attention mask in it.
DTYPE = "gguf-native"

# GGUF tensor name (blk.N.<part> or <part>) -> the transformers module it fills
_BLOCK_MODULES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_TOP_MODULES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_ROPE_PERMUTED = {"llama": {"attn_q": "num_attention_heads", "attn_k": "num_key_value_heads"}}


class NotNative(ValueError):
    """A readable GGUF that the native backend does not cover (the message says why); the loader runs it elsewhere."""


# ----------------------------------------------------------------------------------------------- the modules


class QuantLinear(nn.Module):
    """y = x · Wᵀ + b with W kept as GGUF blocks (a `QuantMatrix`); b float32 or None. The blocks are a buffer so the
    module's memory shows in `buffers()`, uint8, as in the file: no float copy of W exists."""

    def __init__(self, matrix: QuantMatrix, bias: torch.Tensor | None = None):
        super().__init__()
        self.matrix = matrix
        self.in_features, self.out_features = matrix.k, matrix.n
        self.register_buffer("blocks", matrix.data, persistent=False)  # uint8: the file's blocks, maybe repacked
        self.bias = None if bias is None else nn.Parameter(bias.to(torch.float32), requires_grad=False)  # (n,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        if x.numel() == 0:  # an empty forward (no tokens): nothing for the kernels to do
            return x.new_zeros(*lead, self.out_features)
        y = self.matrix(x.reshape(-1, self.in_features))  # (m, k) -> (m, n)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)  # (..., n)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, qtype={self.matrix.qtype.name}"


class PrunedQuantHead(QuantLinear):
    """A native draft's output head over the token ids `keep` only (FR-Spec's idea; tuning/draft_levers.PrunedHead
    is the same lever for dense drafts): its matrix holds just those rows of the file's head, so a draft step reads
    K rows instead of the vocabulary's (the 0.5B draft's Q8_0 head is 145 MB of the ~400 MB it reads a step), and
    every other token gets the lowest finite logit: probability exactly 0 after the softmax, so the distribution a
    verifier sees is the one the draft drew from."""

    def __init__(self, head: QuantLinear, keep: torch.Tensor):
        keep = torch.as_tensor(keep, dtype=torch.long).unique()  # sorted
        if len(keep) == 0 or keep[0] < 0 or keep[-1] >= head.out_features:
            raise ValueError(f"a pruned head keeps token ids in [0, {head.out_features})")
        # Padded to whole groups of VNNI_ROWS rows, copies of the last kept row whose logits `expand` drops: the packed
        # layouts need whole groups (16 rows with VNNI, 8 on AVX2), and K + the EOS ids is rarely a multiple of 16.
        # Unpadded, a 65537-row head ran the file layout's code: 0.4 ms more per draft token than the whole packed
        # head (Zen 4, 2026-11-26).
        rows = torch.cat([keep, keep[-1:].expand((-len(keep)) % VNNI_ROWS)])
        matrix = QuantMatrix(head.matrix.blocks().index_select(0, rows), head.matrix.qtype, len(rows), head.matrix.k)
        super().__init__(matrix, None if head.bias is None else head.bias[rows])
        self.vocab_size = head.out_features
        self.register_buffer("keep", keep, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.expand(super().forward(x))

    def expand(self, small: torch.Tensor) -> torch.Tensor:
        """(..., K + padding) logits of the kept ids -> (..., vocab), the lowest finite logit elsewhere."""
        return spread(small[..., :len(self.keep)], self.keep, self.vocab_size)


def with_pruned_head(model, keep: torch.Tensor):
    """A twin of the native `model` whose head covers the token ids in `keep` only. Every other weight is shared, not
    copied, and `model` itself is left as it was (the bench runs both side by side)."""
    if not is_native(model) or not isinstance(model.lm_head, QuantLinear):
        raise ValueError("a pruned head needs a native model")
    if isinstance(model.lm_head, PrunedQuantHead):
        raise ValueError("the model's head is pruned already")
    twin = copy.copy(model)
    twin._modules = dict(model._modules)  # a module table of its own: the head below is the twin's only
    twin.lm_head = PrunedQuantHead(model.lm_head, keep)
    # its own costs; hashed once (~4 ms for a 65536-id head, which every decoder made for a request paid a few times)
    fingerprint = sha256_key({"model": model.fingerprint(), "head": twin.lm_head.keep.tolist()})
    twin.fingerprint = lambda: fingerprint
    native_step.install_twin(twin, model)
    return twin


class QuantEmbedding(nn.Module):
    """An embedding table kept as GGUF blocks: each lookup dequantizes just the rows asked for."""

    def __init__(self, matrix: QuantMatrix):
        super().__init__()
        self.matrix = matrix
        self.num_embeddings, self.embedding_dim = matrix.n, matrix.k
        self.register_buffer("blocks", matrix.data, persistent=False)  # (vocab, row_bytes) uint8, the file's layout

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.numel() == 0:
            return torch.zeros(*ids.shape, self.embedding_dim)
        return self.matrix.rows(ids)  # (..., ) -> (..., embedding_dim) float32

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.matrix.qtype.name}"


def _open(path: Path) -> GgufFile:
    """`read_gguf(path)`; for a file it cannot read, the one-line ValueError llama.cpp's backend gives (from gguf's
    own, slower reader), or NotNative if gguf reads what this reader does not."""
    try:
        return read_gguf(path)
    except Exception as exc:
        reason = str(exc) or type(exc).__name__
    read_gguf_info(path)  # raises for a bad file
    raise NotNative(f"its header could not be read here ({reason})")


def read_header(path: str | Path) -> tuple[NativeInfo, PretrainedConfig]:
    """What a native model loaded from `path` would carry, from the file's header alone (~0.05 s, where loading
    reads every weight): its NativeInfo and its transformers config. ValueError / NotNative as load_native."""
    path = Path(path).expanduser().resolve()
    file = _open(path)
    info = describe(path, file)
    return NativeInfo(path, info.weight_type), _config(file, info.arch)


def _config(file: GgufFile, arch: str) -> PretrainedConfig:
    """transformers' config of the file: its metadata renamed by transformers' own GGUF key table, as
    `AutoConfig.from_pretrained(gguf_file=...)` does for these architectures (without parsing the file again)."""
    table = GGUF_TO_TRANSFORMERS_MAPPING["config"]
    values = {}
    for key, value in file.metadata.items():
        prefix, _, rest = key.partition(".")
        name = table[prefix].get(rest) if prefix in (arch, "general", "tokenizer") else None
        if name not in (None, -1):
            values[name] = value
    values["tie_word_embeddings"] = all(t.name != "output.weight" for t in file.tensors)
    values.setdefault("vocab_size", file.metadata.get("tokenizer.ggml.tokens"))
    return AutoConfig.for_model(values.pop("model_type"), **values)


@dataclass(frozen=True)
class NativeInfo:
    """What a native model was loaded from; its presence on a model marks the model as native (`is_native`)."""

    path: Path
    weight_type: str  # e.g. "Q4_K_M", as read_gguf_info reports it


def is_native(model) -> bool:
    return isinstance(getattr(model, "native_gguf", None), NativeInfo)


def _module_path(name: str) -> tuple[str, str]:
    """GGUF tensor name -> (transformers module path, "weight" or "bias"); NotNative for a name it does not know."""
    stem, _, kind = name.rpartition(".")
    parts = stem.split(".")
    if kind in ("weight", "bias"):
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK_MODULES:
            return f"model.layers.{parts[1]}.{_BLOCK_MODULES[parts[2]]}", kind
        if len(parts) == 1 and parts[0] in _TOP_MODULES:
            return _TOP_MODULES[parts[0]], kind
    raise NotNative(f"tensor {name!r} has no place in the native backend's mapping")


def _check_covered(arch: str, tensors: list[GgufTensor]) -> None:
    """NotNative unless the architecture is mapped and every 2-D weight has a kernel."""
    if arch not in ARCHITECTURES:
        raise NotNative(f"architecture {arch!r} is not covered (native runs {', '.join(ARCHITECTURES)})")
    uncovered = sorted({t.qtype.name for t in tensors if len(t.shape) == 2 and not supported(t.qtype)})
    if uncovered:
        raise NotNative(f"weight type(s) {', '.join(uncovered)} have no native kernel (covered: "
                        f"{', '.join(t.name for t in SUPPORTED_TYPES)})")


def _check_hyperparameters(meta: dict, arch: str) -> None:
    """NotNative for metadata the native forward would not follow (sizes out of range are refused for both GGUF
    backends when the header is read: gguf_file.py): rope scaling (YaRN, linear, ...: llama.cpp applies it, native
    ran as if it were absent, and logits differed by up to 3.3 on a tiny file) and per-layer sizes."""
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise NotNative(f"rope scaling {scaling!r} ({arch}.rope.scaling.type) is not implemented natively")
    for key in SIZES:
        if isinstance(meta.get(f"{arch}.{key}"), ArrayLength):
            raise NotNative(f"{arch}.{key} is given per layer; native runs one value for every layer")


def _check_kernels() -> None:
    """NotNative if arborspec's kernels cannot be compiled here (no C++ compiler, ...; compiled once per CPU)."""
    from ..kernels.build import KernelBuildError, library

    try:
        library()
    except KernelBuildError as exc:
        raise NotNative(str(exc)) from None


def _rope_rows(rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's rope permutation: within each head, the file holds dimension pairs
    interleaved, row (head, i, half) at head * 2d + 2i + half; transformers wants (head, half, i)."""
    d = rows // heads // 2
    return torch.arange(rows).reshape(heads, d, 2).transpose(1, 2).reshape(-1)


def _float(tensor: GgufTensor) -> torch.Tensor:
    """A 1-D GGUF tensor (norm weight, bias) as a float32 torch tensor of its own (small: copied)."""
    values = dequantize(tensor.read(), tensor.qtype).astype(np.float32)
    return torch.from_numpy(values.reshape(-1))


def _matrix(tensor: GgufTensor, config, arch: str, lookup: bool = False) -> QuantMatrix:
    """A 2-D GGUF tensor as a QuantMatrix over its blocks read from the file, rows put back in order for the llama
    rope layout. `lookup`: an embedding table, read row by row, which keeps the file's layout (the kernels may
    repack a matrix for their products, kernels/matrix.py)."""
    n, k = tensor.shape
    blocks = torch.from_numpy(tensor.read()).reshape(n, -1)  # (n, row_bytes) uint8
    heads = _rope_heads(tensor, config, arch)
    if heads:
        blocks = blocks[_rope_rows(n, heads)]
    return QuantMatrix(blocks, tensor.qtype, n, k, pack=not lookup)


def _rope_heads(tensor: GgufTensor, config, arch: str) -> int | None:
    """The head count whose rope permutation `tensor` (a q or k weight or bias of a llama GGUF) carries, else None."""
    key = _ROPE_PERMUTED.get(arch, {}).get(tensor.part) if tensor.name.startswith("blk.") else None
    return getattr(config, key) if key else None


# ----------------------------------------------------------------------------------------------- loading


def load_native(path: str | Path) -> PreTrainedModel:
    """The GGUF at `path` as a float32 transformers model with GGUF-block linear layers (see the module docstring).

    ValueError (one line) for an unreadable file; NotNative for a readable one this backend does not cover."""
    path = Path(path).expanduser().resolve()
    file = _open(path)
    info = describe(path, file)
    check_causal(path, info)
    arch = info.arch
    _check_covered(arch, file.tensors)
    _check_hyperparameters(file.metadata, arch)
    _check_kernels()
    groups: dict[str, dict[str, GgufTensor]] = {}  # module path -> {"weight": tensor, "bias": tensor}
    for tensor in file.tensors:
        module, kind = _module_path(tensor.name)
        groups.setdefault(module, {})[kind] = tensor
    try:
        config = _config(file, arch)
    except Exception as exc:
        raise NotNative(f"transformers cannot make its config ({first_line(exc)})") from None
    try:  # transformers' own checks of the config: an AssertionError traceback where the header is off
        with torch.device("meta"):  # the skeleton: module structure and shapes, no weight memory
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    except (AssertionError, ValueError, TypeError) as exc:
        raise ValueError(f"{path}: transformers cannot build the model its header describes ({first_line(exc)})") \
            from None
    for module, tensors in groups.items():
        _fill(model, module, tensors, config, arch)
    if "lm_head" not in groups and config.tie_word_embeddings:
        model.lm_head = QuantLinear(model.model.embed_tokens.matrix)  # the head reads the embedding's blocks
    _rebuild_rotary(model)
    _check_filled(model)
    model.eval()
    model.requires_grad_(False)
    model.config._name_or_path = str(path)  # what profiles and messages call the model, as llama.cpp's backend does
    model.native_gguf = NativeInfo(path, info.weight_type)
    model.fingerprint = MethodType(fingerprint, model)  # what disk_cache.model_fingerprint uses for cost profiles
    native_step.install(model)
    return model


def _fill(model: PreTrainedModel, path: str, tensors: dict, config, arch: str) -> None:
    """Replace the skeleton's module at `path` by one over the GGUF tensors (weight, optional bias) given."""
    try:
        old = model.get_submodule(path)
    except AttributeError:
        raise NotNative(f"the {type(model).__name__} skeleton has no module {path}") from None
    weight, bias = tensors.get("weight"), tensors.get("bias")
    if weight is None:
        raise NotNative(f"{path} has a bias but no weight in the file")
    if isinstance(old, (nn.Linear, nn.Embedding)):
        have, want = weight.shape, tuple(old.weight.shape)  # (out, in) / (vocab, dim)
        if have != want:
            raise NotNative(f"{weight.name} is {'x'.join(map(str, have))}, the config wants {path} "
                            f"{want[0]}x{want[1]}")
        if isinstance(old, nn.Embedding):
            new = QuantEmbedding(_matrix(weight, config, arch, lookup=True))
        else:
            b = _float(bias) if bias is not None else None
            if b is not None and _rope_heads(bias, config, arch):
                b = b[_rope_rows(len(b), _rope_heads(bias, config, arch))]
            new = QuantLinear(_matrix(weight, config, arch), b)
        model.set_submodule(path, new)
        return
    values = _float(weight)
    if bias is not None or getattr(old, "weight", None) is None or tuple(old.weight.shape) != tuple(values.shape):
        raise NotNative(f"{weight.name} {tuple(values.shape)} does not fit {path} ({type(old).__name__})")
    old.weight = nn.Parameter(values, requires_grad=False)


def _rebuild_rotary(model: PreTrainedModel) -> None:
    """The rotary tables were computed on the meta device with the skeleton: compute them again for real."""
    for path, module in list(model.named_modules()):
        if path and any(b.is_meta for b in module.buffers(recurse=False)) and "Rotary" in type(module).__name__:
            model.set_submodule(path, type(module)(config=model.config))


def _check_filled(model: PreTrainedModel) -> None:
    """NotNative if any parameter or buffer of the skeleton was left without data by the file."""
    empty = [name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if empty:
        more = f" and {len(empty) - 3} more" if len(empty) > 3 else ""
        raise NotNative(f"the file leaves {', '.join(empty[:3])}{more} of the transformers model empty")


def fingerprint(model) -> str:
    """A native model's identity for cached cost profiles: its file's (`file_fingerprint`)."""
    return file_fingerprint(model.native_gguf)


def file_fingerprint(info: NativeInfo) -> str:
    """The identity of a native model loaded from `info.path`: the file (path, size, mtime), this backend and the
    kernels' build key (their source, this CPU, torch), since a profile records those kernels' timings. The default
    fingerprint would see only the config and the norms, the same for every quantization of one model."""
    from ..kernels.build import cache_key

    stat = info.path.stat()
    return sha256_key({"gguf": str(info.path), "size": stat.st_size, "mtime": stat.st_mtime_ns, "backend": DTYPE,
                       "weights": info.weight_type, "kernels": cache_key()})
