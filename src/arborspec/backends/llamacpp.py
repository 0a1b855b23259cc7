"""Tree attention on llama.cpp: a GGUF model run through llama.cpp's C API (llama-cpp-python's ctypes bindings).

On CPUs llama.cpp decodes a Q4_K_M GGUF several times faster than PyTorch runs the same weights dequantized, and it
already has what a token tree needs: a KV cache whose cells carry *sets* of sequence ids. The attention mask is
built from those sets (llama-kv-cache.cpp, `set_input_kq_mask`): a batch token at position p attends to every cell
that holds (one of) its sequence ids and whose position is <= p. So a tree is one context with a unified KV cache:

    every root-to-leaf path is one sequence; the committed prefix is sequence 0.
    a node's *own* sequence: the first child forwarded under a node continues the node's sequence, every later
    child opens a fresh one. In a batch a node is tagged with its own sequence plus the own sequences of its
    descendants in the same batch; a fresh sequence whose branch point is already in the cache first gets the
    cached part of its path with `llama_memory_seq_cp(parent_seq, new_seq, -1, branch_pos + 1)` (metadata only).

Every sequence in a node's set is a path through that node, so the cells it sees at positions <= its own are exactly
its ancestors and itself, whichever of its sequences llama.cpp treats as the first (it keeps a token's ids in an
unordered set, llama-batch.h `llama_batch_ext::token::seq_ids`, so the order given is not kept). Positions are root
position + depth. The batch checks of llama-batch.cpp (`llama_batch_allocr::init`) hold by construction: per sequence
the batch's positions start right after the cache's last one and have no gaps (a sequence is a path), and sequences
coupled in one token start and end at the same cached positions (all of them were cut at the same branch point).

`commit(path)` keeps the accepted path without copying KV data: on the last accepted node's own sequence s it drops
positions after that node, keeps only cells of s (`llama_memory_seq_keep`), and renames s to 0. Committed tokens the
session has not seen ride in front of a step's first forward as a causal chain on sequence 0, tagged with every
sequence that batch opens. Sequence ids are reused every step, and when they run out within a step they are taken
back from branches that earlier forwards left behind (see LlamaCppSession).

llama-cpp-python is an optional dependency (pinned 0.3.36, llama.cpp 0c1e570); its import is deferred to the first
load so arborspec runs without it. llama.cpp's log output is silenced unless ARBORSPEC_LLAMA_LOG=1; its error lines
are kept and quoted when a load or a decode fails.

Over 400 lines: one backend behind one ctypes seam. The session (tree batches over sequence-id sets, commit, fork),
the loader and the error translation all speak the same raw llama.cpp C API and share its state (the model, the
context, the log); split apart they would pass that state around instead of holding it.
"""
from __future__ import annotations

import atexit
import ctypes
import os
import sys
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from ..core.disk_cache import sha256_key
from ..core.downloads import first_line
from ..core.host import usable_cores
from ..core.sampling import check_finite
from ..core.tree import MAX_TREE_NODES, TokenTree
from .gguf_file import GgufInfo, check_causal, read_gguf_info
from .hf import begin_forward, check_path
from .session import TreeRegion

PIN = "llama-cpp-python==0.3.36"
MAX_SEQ = 256  # llama.cpp's LLAMA_MAX_SEQ (src/llama-cparams.h)
# the integer settings' ranges, [low, high] (None: the file's trained context), checked here and, by flag, at the CLI
RANGES = {"n_threads": (1, 1024), "n_threads_batch": (1, 1024), "n_ctx": (2, None), "n_batch": (1, 1 << 16),
          "n_seq_max": (1, MAX_SEQ)}
LOG_ENV = "ARBORSPEC_LLAMA_LOG"
_LOG_ERROR = 4  # GGML_LOG_LEVEL_ERROR in ggml.h (llama-cpp-python's _logger.py comment still says 3)
_log = SimpleNamespace(callback=None, errors=[])  # the callback must outlive every llama.cpp call that may log
_OPEN: "weakref.WeakSet[LlamaCppModel]" = weakref.WeakSet()  # models not closed yet: closed at exit (close_all)


def available() -> bool:
    """Whether llama-cpp-python is installed (the backend is optional)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def bindings():
    """The llama_cpp module, its logging routed through `_on_log` (once), and the backend initialised."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise ValueError(f"the llama.cpp backend needs {PIN} ({exc}): pip install 'arborspec[llamacpp]' builds it "
                         "(10-30 min, once; in a checkout, bash scripts/setup.sh)") from None
    if _log.callback is None:
        _log.callback = llama_cpp.llama_log_callback(_on_log)
        llama_cpp.llama_log_set(_log.callback, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
    return llama_cpp


def _on_log(level: int, text: bytes, user_data) -> None:
    message = text.decode("utf-8", "replace") if text else ""
    if level == _LOG_ERROR and message.strip():
        _log.errors.append(message.strip())
        del _log.errors[:-8]
    if os.environ.get(LOG_ENV) == "1":
        print(message, end="", file=sys.stderr, flush=True)


def llama_error(default: str) -> str:
    """The most telling error line llama.cpp logged since the last call (or `default`)."""
    errors, _log.errors[:] = list(_log.errors), []
    for line in errors:
        if "error loading model:" in line:
            return line.split("error loading model:", 1)[1].strip()
    return errors[0] if errors else default


@atexit.register
def close_all() -> None:
    """Close every llama.cpp model still open (see LlamaCppModel.close); runs at interpreter exit."""
    for model in list(_OPEN):
        model.close()


# ----------------------------------------------------------------------------------------------- the GGUF file


# -------------------------------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class LlamaCppSettings:
    """How llama.cpp runs a model; part of the model's fingerprint (cost profiles are measured under them)."""

    n_ctx: int  # context window: committed positions a session may hold
    n_batch: int  # tokens per llama_decode call; longer forwards are split
    n_seq_max: int  # sequence ids per context: one forward call may open n_seq_max - 1 branches
    n_threads: int  # one-token forwards
    n_threads_batch: int  # multi-token forwards (trees, prefill)
    flash_attn: bool  # llama.cpp's flash attention; with an f16 cache its rounding follows where cells sit
    # (after commits a path's cells are scattered): ~1e-2 logit noise against a fresh session, ~5e-4 without
    kv_type: str  # "f16" (llama.cpp's default) or "f32" (bit-stable comparisons, twice the memory)


_KV_TYPES = {"f32": 0, "f16": 1}  # GGML_TYPE_F32, GGML_TYPE_F16 (ggml.h)


class LlamaCppModel:
    """A GGUF loaded into llama.cpp, with the attributes the engine reads from a model and `new_session(role)`.

    The weights are loaded once; every live session has its own llama.cpp context (KV cache) of n_ctx + `region`
    cells: n_ctx committed positions plus room for a step's tree at the end of the window, as large as a tree may be
    (MAX_TREE_NODES, or n_batch if larger; with n_batch cells, a tree larger than n_batch forwarded near the end of
    the window filled the cache: wetap's draft forwards ~600 nodes a step). Making a context
    costs ~150 ms (it allocates and zeroes its buffers), so a finished session's context is cleared and kept for the
    next session instead of freed: a `generate` call then starts in well under a millisecond.
    """

    def __init__(self, path: Path, handle, info: GgufInfo, settings: LlamaCppSettings):
        self.lib = bindings()
        self.path, self.handle, self.settings = path, handle, settings
        self.n_ctx, self.n_batch, self.n_seq_max = settings.n_ctx, settings.n_batch, settings.n_seq_max
        self.n_threads = settings.n_threads
        vocab = self.lib.llama_model_get_vocab(handle)
        self.n_vocab = int(self.lib.llama_vocab_n_tokens(vocab))
        eos = int(self.lib.llama_vocab_eos(vocab))
        self.config = SimpleNamespace(vocab_size=self.n_vocab, max_position_embeddings=self.n_ctx,
                                      model_type=info.arch, _name_or_path=str(path))
        self.generation_config = SimpleNamespace(eos_token_id=eos if eos >= 0 else None)
        self.dtype = f"gguf-{info.weight_type.lower()}"  # weights as stored; llama.cpp computes in f32
        self._idle: list[tuple] = []  # (context, batch) pairs of finished sessions, cleared, ready for reuse
        self._sessions: weakref.WeakSet[LlamaCppSession] = weakref.WeakSet()  # live sessions: each holds a context
        _OPEN.add(self)

    @property
    def region(self) -> int:
        return max(self.n_batch, MAX_TREE_NODES)

    def new_session(self, role: str = "target") -> "LlamaCppSession":
        return LlamaCppSession(self, role)

    def fingerprint(self) -> str:
        """Changes with the file (path, size, mtime), the llama.cpp settings and llama-cpp-python's version."""
        stat = self.path.stat()
        return sha256_key({"gguf": str(self.path), "size": stat.st_size, "mtime": stat.st_mtime_ns,
                           "settings": asdict(self.settings), "llama_cpp": self.lib.__version__})

    def take_context(self) -> tuple:
        """(context, batch) for a new session: an idle one, its KV cache cleared, or a new one."""
        if self.closed:
            raise ValueError(f"the llama.cpp model {self.path.name} is closed")
        if self._idle:
            ctx, batch = self._idle.pop()
            self.lib.llama_memory_clear(self.lib.llama_get_memory(ctx), True)
            return ctx, batch
        return self.new_context(), self.lib.llama_batch_init(self.n_batch, 0, self.n_seq_max)

    def give_back(self, ctx, batch) -> None:
        if self.closed:  # a session outliving its model's close (it was closed with the model already)
            self.lib.llama_batch_free(batch)
            self.lib.llama_free(ctx)
        else:
            self._idle.append((ctx, batch))

    def new_context(self):
        """A fresh llama.cpp context (KV cache) on these weights; the caller frees it with llama_free."""
        s, params = self.settings, self.lib.llama_context_default_params()
        params.n_ctx = s.n_ctx + self.region
        params.n_batch = params.n_ubatch = s.n_batch
        params.n_seq_max = s.n_seq_max
        params.n_outputs_max = max(s.n_batch, s.n_seq_max)  # output_reserve asserts n_seq_max rows fit
        params.n_threads, params.n_threads_batch = s.n_threads, s.n_threads_batch
        params.flash_attn_type = int(s.flash_attn)  # LLAMA_FLASH_ATTN_TYPE_DISABLED / _ENABLED
        params.type_k = params.type_v = _KV_TYPES[s.kv_type]
        params.kv_unified = True  # one cell array shared by all sequences: seq_cp is metadata only
        params.no_perf = True
        ctx = self.lib.llama_init_from_model(self.handle, params)
        if not ctx:
            raise ValueError(f"llama.cpp could not create a context for {self.path}: "
                             f"{llama_error('llama_init_from_model failed')}")
        if not self.lib.llama_get_memory(ctx):
            self.lib.llama_free(ctx)
            raise ValueError(f"{self.path}: llama.cpp gives this model no KV cache; not a causal LM")
        return ctx

    def close(self) -> None:
        """Free the weights and every context now (idempotent); its sessions are closed first, and a closed model
        makes no new ones.

        Why not leave it to `__del__`: a model still referenced at interpreter exit is collected after the modules are
        torn down, when llama-cpp-python's ctypes functions are already None, and freeing it then prints "TypeError:
        'NoneType' object is not callable" (twice at the end of every full test run). `close_all` runs at exit,
        before that teardown; tests close their models in their fixtures' teardown."""
        for session in list(getattr(self, "_sessions", ())):
            session.close()
        for ctx, batch in getattr(self, "_idle", []):
            self.lib.llama_batch_free(batch)
            self.lib.llama_free(ctx)
        self._idle = []
        if getattr(self, "handle", None):
            self.lib.llama_model_free(self.handle)
            self.handle = None
        _OPEN.discard(self)

    @property
    def closed(self) -> bool:
        return not getattr(self, "handle", None)

    def __del__(self):
        self.close()


def load_llamacpp(path: str | Path, n_threads: int | None = None, n_threads_batch: int | None = None,
                  n_ctx: int | None = None, n_batch: int = 512, n_seq_max: int = 128, flash_attn: bool = False,
                  kv_type: str = "f16") -> LlamaCppModel:
    """Load a causal-LM GGUF into llama.cpp (CPU). ValueError with a one-line reason for anything it cannot run.

    n_threads / n_threads_batch: threads for one-token / multi-token forwards (default: the cores this process may
    use). n_ctx: the context window (default min(4096, the model's trained context); more than trained is refused).
    n_batch: tokens per llama_decode call (longer forwards are split). n_seq_max: sequence ids, so one forward call
    may open n_seq_max - 1 branches (at most 256, llama.cpp's limit; later calls reuse ids of abandoned branches);
    each context also keeps (and zeroes) a logits buffer of n_seq_max x vocab floats (Qwen2.5, 128: 78 MB).
    flash_attn: off by default, it makes logits depend more on where cells sit (see LlamaCppSettings). kv_type: the
    KV cache's element type, "f16" or "f32".
    """
    path = Path(path).expanduser()
    if path.is_dir():
        raise ValueError(f"{str(path)!r} is a directory; a GGUF model is one .gguf file")
    if not path.is_file():
        raise ValueError(f"GGUF file {str(path)!r} not found")
    n_threads = usable_cores() if n_threads is None else n_threads
    n_threads_batch = n_threads if n_threads_batch is None else n_threads_batch
    for name, value in (("n_threads", n_threads), ("n_threads_batch", n_threads_batch), ("n_batch", n_batch),
                        ("n_seq_max", n_seq_max)):
        low, high = RANGES[name]
        if not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
    if kv_type not in _KV_TYPES:
        raise ValueError(f"kv_type must be one of {', '.join(_KV_TYPES)}, got {kv_type!r}")
    info = read_gguf_info(path)
    check_causal(path, info)
    trained = info.context_length
    if n_ctx is None:
        n_ctx = min(4096, trained or 4096)
    if not isinstance(n_ctx, int) or n_ctx < RANGES["n_ctx"][0]:
        raise ValueError(f"n_ctx must be an integer >= 2, got {n_ctx!r}")
    if trained and n_ctx > trained:
        raise ValueError(f"n_ctx {n_ctx} is larger than {path.name}'s trained context ({trained} tokens)")
    settings = LlamaCppSettings(n_ctx, n_batch, n_seq_max, n_threads, n_threads_batch, bool(flash_attn), kv_type)
    lib = bindings()
    _log.errors.clear()
    handle = lib.llama_model_load_from_file(os.fsencode(path), model_params(lib))
    if not handle:
        raise ValueError(f"llama.cpp could not load {path}: {llama_error('llama_model_load_from_file failed')}")
    for check, what in ((lib.llama_model_has_encoder, "has an encoder"), (lib.llama_model_is_recurrent, "is recurrent"),
                        (lib.llama_model_is_hybrid, "is a recurrent hybrid"),
                        (lib.llama_model_is_diffusion, "is a diffusion model")):
        if check(handle):
            lib.llama_model_free(handle)
            raise ValueError(f"{path} ({info.arch}) {what}; the llama.cpp backend runs decoder-only attention models")
    model = LlamaCppModel(path.resolve(), handle, info, settings)
    lib.llama_free(model.new_context())  # fail now, not at the first generate, if no context can be made
    return model


def model_params(lib, defaults=None):
    """llama.cpp's default model parameters, without its extra weight buffers where the build has AMX kernels.

    Why: the AMX matrix product of the pinned llama.cpp (ggml-cpu/amx, reached through the extra buffer types) loads
    a tile configuration the compiler leaves half unset, and the first forward of more than one token dies of a
    general protection fault (`ldtilecfg`): seen on a 2-core Intel Xeon with AMX-INT8 (family 6 model 167,
    2026-11-29), in every tree forward, the test suite included; llama.cpp PR 26954 describes the same fault.
    scripts/setup.sh builds llama.cpp without AMX, so this applies to builds made elsewhere; the cost is llama.cpp's
    repacked weight layouts, which the same switch turns off. `defaults`: the function that makes the defaults
    (lib's own unless given)."""
    params = (defaults or lib.llama_model_default_params)()
    if b"AMX_INT8 = 1" in lib.llama_print_system_info():
        params.use_extra_bufts = False
    return params


def gguf_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer transformers builds from the GGUF's own vocabulary metadata."""
    path = Path(path).expanduser().resolve()
    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:
        reason = first_line(exc)
        if isinstance(exc, KeyError) and exc.args:  # transformers' lookup of a field the file lacks: "'scores'" alone
            reason = f"its tokenizer metadata is incomplete (transformers looked for tokenizer.ggml.{exc.args[0]})"
        raise ValueError(f"could not build a tokenizer from {path}: {reason}") from None


@dataclass
class LlamaCppLoaded:
    """The llama.cpp counterpart of loading.LoadedModel: what SpeculativeDecoder accepts as target or draft."""

    model: LlamaCppModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    source: str


def load_llamacpp_pair(path: str | Path, name: str | None = None, tokenizer=gguf_tokenizer,
                       **options) -> LlamaCppLoaded:
    """Model (see `load_llamacpp` for the options) and tokenizer from one GGUF file; `tokenizer(path)` makes the
    tokenizer (loading/model.py's keeps the one it builds)."""
    model = load_llamacpp(path, **options)
    return LlamaCppLoaded(model, tokenizer(model.path), name or str(path), str(model.path))


# ------------------------------------------------------------------------------------------------ the session


class LlamaCppSession(TreeRegion):
    """One sequence's KV cache on a llama.cpp model, with a speculative tree region (see the module docstring).

    `slot[node]` is any sequence whose cells up to the node's position are exactly the node's path. Sequence ids are
    scarce (n_seq_max - 1 branches): when a forward needs one and none is free, a sequence forwarded by an earlier
    call is evicted. Its nodes that another sequence also holds (they lie on a later branch's path) move to that
    sequence; the others, dead-end nodes, leave the region (`has` turns false) and their cells are freed. A sequence
    is only evicted if this call's nodes and their ancestors all stay. If a later forward needs an evicted node as an
    ancestor, it is forwarded again in front of that batch (no logits). So wide layer-by-layer drafts (WETAP's
    unpruned tree) run on few sequences, and so do wide forwards: a call whose nodes have more leaves than there are
    branch sequences runs in pieces (`_runs`), and an accepted path an eviction cut short is committed up to the cut,
    its remaining tokens carried in front of the next forward as committed ones.
    """

    def __init__(self, model: LlamaCppModel, role: str = "target"):
        self.model, self.role, self.lib = model, role, model.lib
        self.ctx, self.batch = model.take_context()
        model._sessions.add(self)
        self.mem = self.lib.llama_get_memory(self.ctx)
        self.cached: list[int] = []  # committed token ids whose KV is in the cache (sequence 0)
        self.tree: TokenTree | None = None
        self.slot: dict[int, int] = {}  # forwarded tree node -> its own sequence id
        self.forwards = 0  # llama_decode calls, for statistics
        self._free = self._all_sequences()  # branch sequence ids not in use this step
        self.evicted: set[int] = set()  # nodes forwarded this step whose cells an eviction freed

    def prefill(self, ids: list[int]) -> None:
        """Put committed tokens into the cache (sequence 0), no logits."""
        self._check_open()
        if self.slot:
            raise RuntimeError("prefill with a non-empty region")
        past = len(self.cached)
        for start in range(0, len(ids), self.model.n_batch):
            chunk = [(int(t), past + start + i, None, False)
                     for i, t in enumerate(ids[start:start + self.model.n_batch])]
            self._decode(chunk, {})
        self.cached.extend(int(t) for t in ids)

    def forward(self, context: list[int], tree: TokenTree, nodes: list[int]) -> torch.Tensor:
        """Logits (len(nodes), vocab), float32, for `nodes` of `tree` (parents first), whose root is context[-1]."""
        self._check_open()
        runs = self._runs(tree, nodes)
        if len(runs) == 1:
            return self._forward_run(context, tree, nodes)
        return torch.cat([self._forward_run(context, tree, run) for run in runs])

    def _runs(self, tree: TokenTree, nodes: list[int]) -> list[list[int]]:
        """`nodes` (parents first) in runs that one call each can take. A call needs a sequence per leaf of its nodes'
        forest, and the sequences that hold its ancestors forwarded earlier (at most one a leaf) stay: so one run
        when the region is empty and there are at most n_seq_max - 1 leaves, else runs of at most half as many leaves
        each. A run's logits are read before a later run evicts its branches. Before, a forward wider than that
        (dyspec's 64 tokens at --llama-seq 8) stopped the generation at its first step."""
        limit = self.model.n_seq_max - 1
        cap = max(1, limit // 2)
        if len(nodes) - len({tree.parents[n] for n in nodes} & set(nodes)) <= (cap if self.slot else limit):
            return [nodes]
        runs, run, tips = [], [], set()  # tips: the leaves of the current run's forest
        for n in nodes:
            if tree.parents[n] in tips:  # n extends a leaf: as many leaves as before
                tips.remove(tree.parents[n])
            elif len(tips) >= cap:
                runs.append(run)
                run, tips = [], set()
            run.append(n)
            tips.add(n)
        return runs + [run]

    def _forward_run(self, context: list[int], tree: TokenTree, nodes: list[int]) -> torch.Tensor:
        pending = begin_forward(self, context, tree, nodes)
        root_pos = len(context) - 1
        wanted = set(nodes)
        lineage = {a for n in nodes for a in tree.path(n)}  # the nodes and their ancestors: not evicted meanwhile
        restore = sorted((a for a in lineage - wanted if a not in self.slot), key=tree.depths.__getitem__)
        entries = [(int(t), len(self.cached) + i, None, False) for i, t in enumerate(pending)]
        entries += [(tree.tokens[n], root_pos + tree.depths[n], n, False) for n in restore]
        entries += [(tree.tokens[n], root_pos + tree.depths[n], n, True) for n in nodes]
        out = torch.empty(len(nodes), self.model.n_vocab)  # (len(nodes), vocab)
        row = 0
        for start in range(0, len(entries), self.model.n_batch):
            chunk = entries[start:start + self.model.n_batch]
            own = self._assign_sequences(tree, chunk, root_pos, lineage)
            row += self._decode(chunk, _sequence_sets(tree, chunk, own), out[row:])
            self.slot.update(own)
        self.cached.extend(int(t) for t in pending)
        check_finite(out, self.role)
        return out

    def commit(self, path: list[int]) -> None:
        """Keep the committed prefix plus `path` (root first, a chain of forwarded nodes); drop the rest."""
        self._check_open()
        gone = next((i for i, n in enumerate(path) if n not in self.slot and n in self.evicted), None)
        if gone is not None:  # a wide forward evicted the rest: its tokens ride in front of the next forward
            path = path[:gone]
        check_path(self, path)
        if path:
            seq, last = self.slot[path[-1]], len(self.cached) + self.tree.depths[path[-1]]
        else:
            seq, last = 0, len(self.cached) - 1
        lib, mem = self.lib, self.mem
        lib.llama_memory_seq_rm(mem, seq, last + 1, -1)  # the path's descendants on its sequence
        lib.llama_memory_seq_keep(mem, seq)  # every cell not on the path, and other sequences' ids on it
        if seq != 0:
            lib.llama_memory_seq_cp(mem, seq, 0, -1, -1)
            lib.llama_memory_seq_rm(mem, seq, -1, -1)
        self.cached.extend(self.tree.tokens[n] for n in path)
        self.slot, self.tree, self._free, self.evicted = {}, None, self._all_sequences(), set()

    def renumber(self, kept: list[int]) -> None:
        super().renumber(kept)
        self.evicted = {new for new, old in enumerate(kept) if old in self.evicted}

    # ---- internals --------------------------------------------------------------------------------------------
    def _all_sequences(self) -> list[int]:
        return list(range(self.model.n_seq_max - 1, 0, -1))  # popped from the end: 1 first

    def _assign_sequences(self, tree: TokenTree, chunk, root_pos: int, lineage: set[int]) -> dict[int, int]:
        """Own sequence of each tree node in `chunk`; fresh sequences get the cached part of their path copied."""
        own: dict[int, int] = {}
        end: dict[int, int] = {}  # sequence -> the node now at its end, for sequences touched in this chunk
        for _, pos, node, _ in chunk:
            if node is None:
                continue
            if node in self.slot:
                raise RuntimeError(f"node {node} has been forwarded already")
            parent = tree.parents[node]
            if parent < 0:  # the root continues the committed sequence
                own[node], end[0] = 0, node
                continue
            seq = own.get(parent, self.slot.get(parent))
            if seq in end:
                at_end = end[seq] == parent
            else:  # the parent is cached: is it still the last cell of its sequence?
                at_end = self.lib.llama_memory_seq_pos_max(self.mem, seq) == pos - 1
            if not at_end:
                seq = self._fresh_sequence(tree, node, root_pos, lineage, busy=set(end))
            own[node], end[seq] = seq, node
        return own

    def _fresh_sequence(self, tree: TokenTree, node: int, root_pos: int, lineage: set[int], busy: set[int]) -> int:
        """Open a sequence for `node`; give it the cells of the node's path that are already in the cache."""
        seq = self._free.pop() if self._free else self._evict(tree, lineage, busy)
        anc = tree.parents[node]
        while anc >= 0 and anc not in self.slot:
            anc = tree.parents[anc]
        if anc >= 0:  # the nearest cached ancestor's sequence, up to and including it
            self.lib.llama_memory_seq_cp(self.mem, self.slot[anc], seq, -1, root_pos + tree.depths[anc] + 1)
        else:  # nothing of the tree is cached yet: the committed prefix
            self.lib.llama_memory_seq_cp(self.mem, 0, seq, -1, root_pos)
        return seq

    def _evict(self, tree: TokenTree, lineage: set[int], busy: set[int]) -> int:
        """Free up to a quarter of the sequence ids the current chunk does not use (`busy`), oldest branches first;
        return one and keep the rest free (see the class docstring). One scan of the region per batch of ids."""
        members: dict[int, list[int]] = {}  # sequence -> the nodes it is the slot of
        holders: dict[int, list[int]] = {}  # node -> other sequences holding its cell (descendants on other branches)
        for node, seq in self.slot.items():
            members.setdefault(seq, []).append(node)
            anc = tree.parents[node]
            while anc >= 0:
                if anc in self.slot and self.slot[anc] != seq:
                    holders.setdefault(anc, []).append(seq)
                anc = tree.parents[anc]
        freed: list[int] = []
        for seq in sorted(set(members) - busy - {0}):
            if len(freed) == max(1, (self.model.n_seq_max - 1) // 4):
                break
            # (a node moved here from a sequence freed before lists this one among its holders: not alive)
            alive = {n: [t for t in holders.get(n, ()) if t not in freed and t != seq] for n in members[seq]}
            if not all(alive[n] for n in members[seq] if n in lineage):
                continue  # it holds one of this call's nodes or ancestors, and no other sequence does
            self.lib.llama_memory_seq_rm(self.mem, seq, -1, -1)
            for n, others in alive.items():
                if others:
                    self.slot[n] = others[0]
                    members[others[0]].append(n)
                else:
                    del self.slot[n]
                    self.evicted.add(n)
            freed.append(seq)
        if not freed:
            raise ValueError(f"one forward needs more than {self.model.n_seq_max - 1} branches; load the model "
                             f"with a larger n_seq_max (--llama-seq, at most {MAX_SEQ}) or draft narrower trees")
        self._free += freed[:0:-1]
        return freed[0]

    def _decode(self, chunk, seqs: dict[int, list[int]], out: torch.Tensor | None = None) -> int:
        """One llama_decode over `chunk` [(token, position, tree node or None for a committed token, wants logits)];
        copy the logits rows asked for into `out`; return how many rows."""
        b = self.batch
        pending_seqs = seqs.get(0, [0])  # committed tokens are seen by every sequence of the root (node 0)
        n_out = 0
        for i, (token, pos, node, wants) in enumerate(chunk):
            b.token[i], b.pos[i] = token, pos
            ids = pending_seqs if node is None else seqs[node]
            b.n_seq_id[i] = len(ids)
            for k, s in enumerate(ids):
                b.seq_id[i][k] = s
            b.logits[i] = wants
            n_out += wants
        b.n_tokens = len(chunk)
        _log.errors.clear()
        rc = self.lib.llama_decode(self.ctx, b)
        if rc == 1:
            raise RuntimeError(f"{self.role} KV cache is full ({self.model.n_ctx} + {self.model.region} cells): "
                               "the tree does not fit at the end of the context window")
        if rc != 0:
            raise RuntimeError(f"{self.role} llama_decode failed ({rc}): {llama_error('no message')}")
        self.forwards += 1
        if n_out:
            ptr = self.lib.llama_get_logits(self.ctx)
            out[:n_out].copy_(torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(n_out, self.model.n_vocab))))
        return n_out

    def close(self) -> None:
        """Give the context back to the model (the next session reuses it); the session cannot forward after."""
        if getattr(self, "ctx", None):
            ctx, self.ctx = self.ctx, None
            self.model._sessions.discard(self)
            self.model.give_back(ctx, self.batch)

    def _check_open(self) -> None:
        if self.ctx is None:
            raise RuntimeError(f"{self.role} session is closed (its llama.cpp model was closed)")

    def __del__(self):
        self.close()


def _sequence_sets(tree: TokenTree, chunk, own: dict[int, int]) -> dict[int, list[int]]:
    """node -> its own sequence plus the own sequences of its descendants in this chunk (children come after
    parents, so one backward pass collects them)."""
    sets: dict[int, set[int]] = {node: {seq} for node, seq in own.items()}
    for _, _, node, _ in reversed(chunk):
        if node is not None and tree.parents[node] in sets:
            sets[tree.parents[node]] |= sets[node]
    return {node: sorted(s) for node, s in sets.items()}
