"""`arborspec bench`: run every method on the same prompts in one process, interleaved, and write results.json.

Interleaving: for each prompt, every configuration (method x budget x temperature) runs once, in an order rotated by
one per prompt, so slow drift of the machine (other load, thermal state) hits all methods alike. Before timing, each
configuration runs one short warm-up generation (excluded); a configuration whose warm-up fails is skipped with its
error recorded. A failing timed run is recorded with its error and the benchmark goes on. results.json is rewritten
after every prompt (as results.json.gz once it is large: records.py), so an interrupted run keeps what it measured,
and `--resume` carries it on: the same command with `--resume` keeps every prompt that all configurations finished
and runs the rest; with a larger --prompts it extends a finished run (datasets take turns, so the old prompts come
first). Any other difference in settings is refused.
`arborspec report DIR` turns results.json into report.md and plots (see report.py), and is run automatically at the end.

What one run records (results.json "runs"): the method, its policy/verifier/options/budget, the prompt, the generated
token ids, per step the committed / accepted / drafted token counts and tree depth, and at T > 0 the best first-token
acceptance any exact verifier could reach on the step's tree (`root_optimum_per_step`, verify/base.py: root_optimum;
None where the root's children were not sampled; its computation is left out of the wall time), the run's acceptance
at each depth, zero-accept share and root acceptance vs that optimum, (draft probability, accepted?) of every drafted
node the verifier reached (DySpec Fig. 2), wall / prefill / draft / verify time, TTFT, TPOT, tokens/s (new tokens over
the whole wall time, prefill included, for every method alike), peak RSS (getrusage, process-wide and monotone) and
the RSS change over the run, the share of the CPUs other processes kept busy during it (`others_cpu`,
core/cpu_load.py: the report warns where it reached 0.1), the target's perplexity of the output, the lossy flag, the
draft variant it ran with (`draft_quant` and `draft_vocab`: the run's --draft-quant, "auto" resolved to the variant
measured fastest with its head size, unless the method's name carries a quantization or head lever), `sources` (per
source of drafted nodes -- the draft model, ngram, suffix, lookahead -- the nodes it proposed, the accepted ones
credited to it and those it proposed too; engine.StepStats.sources) and the environment.

What a method name means is arborspec/runspec.py, the same for `generate`, the bench and the Python API.

Over 400 lines: the interleaved loop, the warm-ups and the incremental results.json are one protocol whose parts must
agree (what is timed, what is written when); the method catalogue is runspec.py, the transformers baselines
bench/methods.py, the llama.cpp peers bench/llamacpp_peers.py, the metrics bench/metrics.py.
"""
from __future__ import annotations

import os
import platform
import resource
import shlex
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version
from itertools import zip_longest
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

from ..backends.model_info import context_window, eos_ids
from ..core.cpu_load import OtherLoad
from ..core.host import this_cpu
from ..core.options import parse_float_list, parse_int_list
from ..core.sampling import TEMPERATURE_RULE, SamplingConfig, valid_temperature
from ..loading.aliases import ALIASES, alias_gguf
from ..loading.pair import (
    DEFAULT_BACKEND,
    DEFAULT_DRAFT_QUANT,
    backend_of,
    llama_options,
    load_pair,
    prepare_draft,
    resolve_draft,
)
from ..runspec import RunSpec, build_decoder, options_for, parse, split_methods
from . import metrics, records
from .args import DEFAULT_METHODS
from .datasets import Prompt, check_dataset, load_prompt_file, load_prompts, prompt_ids
from .llamacpp_peers import llamacpp_generate, llamacpp_info, lookahead_generate
from .methods import hf_generate
from .perplexity import target_perplexity
from .report import write_report

SCHEMA = 2  # 2: the prompt's forward is no step in the per-step lists (records.upgraded reads a 1)
WARMUP_TOKENS = 8


@dataclass
class BenchSettings:
    target: str
    draft: str
    dtype: str = "bf16"
    datasets: list[str] = field(default_factory=lambda: ["humaneval"])
    prompt_file: str | None = None
    methods: list[str] = field(default_factory=lambda: split_methods(DEFAULT_METHODS))
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    budgets: list[int] | None = None
    draft_quant: str = DEFAULT_DRAFT_QUANT  # for methods whose name carries no quantization lever
    backend: str = DEFAULT_BACKEND  # what runs the models (auto: for GGUF models the backend measured fastest)
    draft_backend: str | None = None  # the draft's, when it differs
    llama: dict = field(default_factory=dict)  # llama.cpp options (n_threads, n_ctx, n_batch, n_seq_max) given
    allow_lossy: bool = False
    prompts: int = 20
    max_new_tokens: int = 128
    seed: int = 0
    top_k: int = 0
    top_p: float = 1.0
    draft_temperature: float | None = None  # None: each run's temperature
    ignore_eos: bool = False
    warmup: bool = True
    perplexity: bool = True
    max_prompt_tokens: int = 1024
    text_tokens: int = 128
    threads: int | None = None
    out: str = "results"
    progress: bool = True
    resume: bool = False
    command: str = ""


UNRECORDED = ("progress", "command", "resume")  # settings that do not change what is measured


@dataclass
class Config:
    """One column of the benchmark: a method at one budget and one temperature."""

    method: str
    spec: RunSpec
    budget: int | None
    temperature: float
    options: dict

    @property
    def label(self) -> str:
        if self.budget is None or self.spec.budget is not None:  # a pinned budget is already in the name
            return self.method
        return f"{self.method}@{self.budget}"


# ---------------------------------------------------------------------------------------------- measurement
def current_rss_mb() -> float | None:
    """This process's resident set size now, in MiB (psutil if installed, else /proc/self/status)."""
    try:
        import psutil  # optional: not a dependency of arborspec

        return psutil.Process().memory_info().rss / 2**20
    except ImportError:
        pass
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def peak_rss_mb() -> float:
    """Peak RSS of the whole process so far (monotone: the largest run so far dominates), MiB."""
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 2**20 if sys.platform == "darwin" else kb / 1024  # macOS reports bytes, Linux KiB


def environment(settings: BenchSettings, backends: tuple = ()) -> dict:
    """The host and versions; `backends`: what the target and the draft ran on, `--backend auto` resolved (the
    report said "auto"). On the GGUF backends --dtype does not apply: the dtype is the file's own."""
    try:
        ours = version("arborspec")
    except PackageNotFoundError:
        ours = "unknown"
    target_backend = backends[0] if backends else None
    dtype = settings.dtype if target_backend in (None, "torch") else f"the GGUF's own ({target_backend})"
    return dict(arborspec=ours, torch=torch.__version__, transformers=transformers.__version__,
                python=platform.python_version(), cpu=this_cpu().describe(), cores=os.cpu_count(),
                threads=torch.get_num_threads(), dtype=dtype, command=settings.command, llama_cpp=llamacpp_info(),
                backend=target_backend, draft_backend=backends[1] if len(backends) > 1 else None)


# ------------------------------------------------------------------------------------------------- one run
class Bench:
    def __init__(self, settings: BenchSettings, target, draft):
        self.s, self.target, self.draft = settings, target, draft
        self.tokenizer = target.tokenizer
        self.eos = [] if settings.ignore_eos else sorted(eos_ids(target.model, self.tokenizer))
        self._ppl: dict[tuple, float | None] = {}
        self.variants: dict[tuple, tuple] = {}  # asked (quant, vocab): ("auto", 0), ... -> the variant run
        self.drafts = {("none", 0): draft}  # (quant, vocab) -> prepared draft

    def variant_for(self, spec: RunSpec) -> tuple[str, int]:
        """(quantization, head size) of the draft this method runs with (("none", 0) for a method without a draft);
        "auto" is measured once."""
        if not spec.needs_draft:
            return "none", 0
        asked = (spec.quant, spec.vocab)
        if asked not in self.variants:
            self.variants[asked] = resolve_draft(self.target, self.draft, *asked, progress=self.s.progress)
        return self.variants[asked]

    def draft_for(self, spec: RunSpec):
        """The draft this method runs with: the loaded one, or a copy of it with the method's levers applied."""
        if not spec.needs_draft:
            return None
        key = self.variant_for(spec)
        if key not in self.drafts:
            self.drafts[key], _, _ = prepare_draft(self.target, self.draft, *key, copy_first=True,
                                                   progress=self.s.progress)
        return self.drafts[key]

    def target_gguf(self) -> Path:
        """The GGUF file the llama.cpp peers run: the target's own (an alias's kept GGUF, or the .gguf given)."""
        if self.s.target in ALIASES:
            return alias_gguf(self.s.target, progress=self.s.progress)
        if self.s.target.endswith(".gguf"):
            return Path(self.s.target).expanduser()
        raise ValueError(f"the llama.cpp peers run GGUF files; target {self.s.target!r} is not one")

    def decoder(self, cfg: Config):
        return build_decoder(cfg.spec, self.target, self.draft_for(cfg.spec), temperature=cfg.temperature,
                             top_k=self.s.top_k, top_p=self.s.top_p, draft_temperature=self.s.draft_temperature,
                             budget=cfg.budget, record_trees=True, measure_optimum=True)

    def generate(self, cfg: Config, ids: list[int], max_new_tokens: int, seed: int | None) -> dict:
        """Generate once; return the measured fields (no perplexity, no memory)."""
        if cfg.spec.hf is not None:
            if not callable(getattr(self.target.model, "generate", None)):  # it failed as "'LlamaCppModel' object
                # has no attribute 'generate'"; a native target is transformers' own skeleton and runs it
                raise ValueError(f"{cfg.method} runs transformers' own generate, which needs a transformers model "
                                 f"(--backend torch or native); the target runs on {backend_of(self.target.model)}")
            draft = self.draft_for(cfg.spec)
            out = hf_generate(cfg.spec, self.target.model, draft.model if draft else None, ids,
                              max_new_tokens, cfg.temperature, self.s.top_k, self.s.top_p, self.eos, seed)
            out.update(verifier="hf", lossy=False, t_prefill=None, t_draft=None, t_verify=None, node_outcomes=None,
                       sources=None)
            return out
        if cfg.spec.llamacpp is not None:
            args = (str(self.target_gguf()), ids, max_new_tokens, cfg.temperature, self.s.top_k, self.s.top_p)
            threads = self.s.llama.get("n_threads", torch.get_num_threads())
            n_ctx = self.s.llama.get("n_ctx", 4096)  # --llama-ctx, as the llama.cpp backend's (it was ignored here)
            if cfg.spec.llamacpp.get("lookahead"):  # a program, not the Python binding (llamacpp_peers.py)
                out = lookahead_generate(*args, self.s.ignore_eos, seed, threads, self.tokenizer, n_ctx=n_ctx)
            else:
                out = llamacpp_generate(*args, self.eos, seed, threads, n_ctx=n_ctx, **cfg.spec.llamacpp)
            out.update(verifier="llama.cpp", lossy=False, t_prefill=None, t_draft=None, t_verify=None,
                       node_outcomes=None, sources=None)
            return out
        dec = self.decoder(cfg)
        start = time.perf_counter()
        res = dec.generate(ids, max_new_tokens=max_new_tokens, seed=seed, ignore_eos=self.s.ignore_eos)
        st = res.stats
        wall = time.perf_counter() - start - st.t_measure  # the root optimum is the bench's statistic, not decoding
        nodes = [(round(p, 5), int(a)) for s in st.steps if s.tree for p, a in metrics.node_outcomes(s.tree)]
        steps = st.decoding_steps  # the prompt's forward is no step (engine/stats.py), as in the papers' MAT
        return dict(
            token_ids=list(res.token_ids), wall=wall, ttft=st.t_first_token, finish_reason=st.finish_reason,
            committed_per_step=[s.committed for s in steps], accepted_per_step=[s.accepted for s in steps],
            drafted_per_step=[s.tree_size for s in steps], depth_per_step=[s.depth for s in steps],
            root_optimum_per_step=[None if s.root_optimum is None else round(s.root_optimum, 5) for s in steps],
            accepted_at_depth=st.accepted_at_depth, zero_accept_share=st.zero_accept_share,
            root_acceptance=st.root_acceptance, root_optimum=st.root_optimum, verifier=st.verifier, lossy=st.lossy,
            t_prefill=st.t_prefill, t_draft=sum(s.t_draft for s in st.steps),
            t_verify=sum(s.t_verify for s in st.steps), node_outcomes=nodes, sources=st.sources,
        )

    def run(self, cfg: Config, prompt: Prompt, ids: list[int], index: int, position: int, env: dict) -> dict:
        seed = self.s.seed + index  # the same seed for every method on this prompt
        rec = dict(method=cfg.method, label=cfg.label, policy=cfg.spec.policy, options=cfg.options, budget=cfg.budget,
                   temperature=cfg.temperature, top_k=self.s.top_k, top_p=self.s.top_p, seed=seed,
                   dataset=prompt.dataset, prompt_id=prompt.id, prompt_key=f"{prompt.dataset}/{prompt.id}",
                   category=prompt.category, prompt_tokens=len(ids), position=position,
                   lossy=cfg.spec.lossy, draft_quant=None, draft_vocab=cfg.spec.vocab,
                   ngram=cfg.spec.ngram, suffix=cfg.spec.suffix_nodes,
                   lookahead=cfg.spec.lookahead, error=None)
        rss0 = current_rss_mb()
        try:
            rec["draft_quant"], rec["draft_vocab"] = self.variant_for(cfg.spec)  # "auto" resolved (measured once)
            with OtherLoad() as load:
                out = self.generate(cfg, ids, self.s.max_new_tokens, seed)
        except Exception as err:  # one method failing must not end the benchmark
            rec.update(error=f"{type(err).__name__}: {err}", peak_rss_mb=peak_rss_mb(), env=env)
            return rec
        rss1 = current_rss_mb()
        rec.update(out)
        n = len(out["token_ids"])
        drafted = out["drafted_per_step"]
        rec.update(
            new_tokens=n, steps=len(out["committed_per_step"]), mat=metrics.mat(out["committed_per_step"]),
            acceptance_rate=metrics.acceptance_rate(out["accepted_per_step"], drafted) if drafted else None,
            tokens_per_s=metrics.throughput(n, out["wall"]), tpot=metrics.tpot(out["wall"], out["ttft"], n),
            exact=not out["lossy"], peak_rss_mb=peak_rss_mb(), rss_before_mb=rss0, rss_after_mb=rss1,
            rss_delta_mb=(rss1 - rss0) if rss0 is not None and rss1 is not None else None,
            perplexity=self.perplexity(ids, out["token_ids"]), env=env,
            others_cpu=None if load.share is None else round(load.share, 3),
        )
        return rec

    def perplexity(self, ids: list[int], new: list[int]) -> float | None:
        if not self.s.perplexity:
            return None
        key = (tuple(ids), tuple(new))  # greedy methods mostly produce the same text: compute it once
        if key not in self._ppl:
            try:
                self._ppl[key] = target_perplexity(self.target.model, ids, new)
            except Exception:  # e.g. prompt + output past the context window
                self._ppl[key] = None
        return self._ppl[key]


# ---------------------------------------------------------------------------------------------- the loop
def load_models(settings: BenchSettings, configs: list) -> tuple:
    """(target, draft) for a run of `configs`: the draft only if a method needs one, loaded as it is (each method's
    variant is prepared from it), both on the run's backends."""
    need_draft = any(c.spec.needs_draft for c in configs)
    return load_pair(settings.target, settings.draft if need_draft else None, draft_quant="none", dtype=settings.dtype,
                     backend=settings.backend, draft_backend=settings.draft_backend, llama=settings.llama,
                     progress=settings.progress)


def _configs(settings: BenchSettings, warnings: list[str]) -> list[Config]:
    """Every (method, budget, temperature) to run. A method name that does not parse (a typo, a lossy verifier without
    --allow-lossy) is a ValueError naming it, before anything loads: skipped with a warning in report.md alone, a
    misspelled method vanished from a run that ended with exit status 0. A method that parses and then cannot run
    (a missing package) is skipped at its warm-up instead."""
    specs = {}
    for name in settings.methods:
        try:
            specs[name] = parse(name, draft_quant=settings.draft_quant, allow_lossy=settings.allow_lossy)
        except ValueError as err:
            raise ValueError(f"--methods: {err}") from None
    out = []
    for t in settings.temperatures:
        for name, spec in specs.items():
            if spec.budget is not None:
                budgets = [spec.budget]
            else:
                budgets = settings.budgets if (settings.budgets and spec.size is not None) else [None]
            for b in budgets:
                options, warn = options_for(spec, b)
                if warn and warn not in warnings:
                    warnings.append(warn)
                out.append(Config(name, spec, b if not warn else None, t, options))
    unique = {}
    for c in out:  # a budget that was not applied collapses onto the defaults
        unique.setdefault((c.label, c.temperature), c)
    return list(unique.values())


SEED_LIMIT = 2**32 - 2  # the largest seed a run may get: llama.cpp reads 2**32 - 1 as "seed at random"


def check_settings(settings: BenchSettings) -> None:
    """The datasets' names and the sampling values, checked as the run would check them later."""
    for name in settings.datasets:
        check_dataset(name)
    if settings.prompt_file and not Path(settings.prompt_file).is_file():  # was found after the models loaded
        raise ValueError(f"cannot read prompt file {settings.prompt_file!r}: there is no such file")
    stem = Path(settings.prompt_file).stem if settings.prompt_file else None
    if stem in settings.datasets:  # runs are paired by prompt name, dataset/id
        raise ValueError(f"--prompt-file {settings.prompt_file!r} names its prompts {stem}/<id>, as --dataset {stem} "
                         "does: two prompts could share a name, and their runs be compared; rename the file")
    for t in settings.temperatures:
        SamplingConfig(temperature=t, top_k=settings.top_k, top_p=settings.top_p)
    if settings.draft_temperature is not None and not valid_temperature(settings.draft_temperature):
        raise ValueError(f"--draft-temperature must be {TEMPERATURE_RULE}, got {settings.draft_temperature}")
    # prompt i runs with seed + i, on every method: llama.cpp's baselines take 32-bit seeds, 2**32 - 1 meaning "a
    # random one" (an out-of-range seed failed each run in turn, after the models loaded, and exited 0)
    most = SEED_LIMIT - settings.prompts * (len(settings.datasets) + bool(settings.prompt_file)) + 1
    if not 0 <= settings.seed <= most:
        raise ValueError(f"--seed must be an integer in [0, {max(most, 0)}] (prompt i runs with --seed + i, and "
                         f"llama.cpp's seeds are 32-bit), got {settings.seed}")


def _fitting(prompts: list[Prompt], bench, settings: BenchSettings,
             warnings: list[str]) -> tuple[list[Prompt], list[list[int]]]:
    """The prompts with room for --max-new-tokens in the target's context window, and their token ids. A longer one
    ended arborspec's runs at the window ("context") while transformers' generate ran past it: no like-for-like
    comparison."""
    window = context_window(bench.target.model)
    tokenized = [(p, prompt_ids(bench.tokenizer, p)) for p in prompts]
    kept = [(p, ids) for p, ids in tokenized if len(ids) + settings.max_new_tokens <= window]
    if len(kept) < len(prompts):
        warnings.append(f"{len(prompts) - len(kept)} prompt(s) skipped: with --max-new-tokens "
                        f"{settings.max_new_tokens} they do not fit the target's context window of {window} tokens")
        print(f"[arborspec] {warnings[-1]}", file=sys.stderr)
    if not kept:
        raise ValueError(f"no prompt fits the target's context window ({window} tokens) with --max-new-tokens "
                         f"{settings.max_new_tokens}")
    return [p for p, _ in kept], [ids for _, ids in kept]


def _prompts(settings: BenchSettings, tokenizer, warnings: list[str]) -> list[Prompt]:
    groups = {name: load_prompts(name, settings.prompts, tokenizer, settings.max_prompt_tokens, settings.text_tokens,
                                 progress=settings.progress) for name in settings.datasets}
    if settings.prompt_file:  # one more group: after the datasets, a larger --prompts could not extend a --resume
        skipped = Counter()
        groups[settings.prompt_file] = load_prompt_file(settings.prompt_file, tokenizer, settings.prompts,
                                                        settings.max_prompt_tokens, skipped)
        if skipped:  # they were dropped without a word
            why = {"empty": "empty", "too long": f"longer than --max-prompt-tokens {settings.max_prompt_tokens}"}
            warnings.append(f"{settings.prompt_file}: {sum(skipped.values())} prompt(s) skipped ("
                            + ", ".join(f"{count} {why[reason]}" for reason, count in skipped.items()) + ")")
            print(f"[arborspec] {warnings[-1]}", file=sys.stderr)
    for name in settings.datasets:  # a prompt file may hold fewer; a dataset short of them says why
        group = groups[name]
        if len(group) < settings.prompts:  # --text-tokens 0 gave no sharegpt-text prompt, and not a word
            warnings.append(f"{name} gave {len(group)} of the {settings.prompts} prompts asked for (the rest are "
                            f"longer than --max-prompt-tokens {settings.max_prompt_tokens}, or the set is smaller)")
            print(f"[arborspec] {warnings[-1]}", file=sys.stderr)
    # datasets in turn, so a run cut short (or the first prompts of a --resume'd one) covers every dataset
    prompts = [p for group in zip_longest(*groups.values()) for p in group if p is not None]
    if not prompts:
        raise ValueError("no prompts to run (empty dataset, or every prompt longer than --max-prompt-tokens)")
    return prompts


def run_bench(settings: BenchSettings, models=None) -> Path:
    """Run the benchmark; returns the path of results.json (or results.json.gz, see records.py). `models`: an
    already loaded (target, draft) pair."""
    warnings: list[str] = []
    configs = _configs(settings, warnings)  # before --out is made: a typo leaves nothing behind
    check_settings(settings)  # before minutes of loading: a typo fails at once
    threads = torch.get_num_threads()
    if settings.threads:
        torch.set_num_threads(settings.threads)
    try:
        with records.writing(settings.out):
            return _run_bench(settings, models, configs, warnings)
    finally:
        torch.set_num_threads(threads)


def warm_up(configs: list[Config], run) -> list[tuple[Config, Exception]]:
    """`run(cfg)` once per configuration, untimed (the first forwards pay one-time set-up); a configuration that
    fails is removed from `configs`, said on stderr and returned with its error: one method failing must not end the
    benchmark."""
    failed = []
    for cfg in list(configs):
        try:
            run(cfg)
        except Exception as err:
            configs.remove(cfg)
            failed.append((cfg, err))
            print(f"[arborspec] skipping {cfg.label} at T={cfg.temperature}: {err}", file=sys.stderr)
    return failed


def _run_bench(settings: BenchSettings, models, configs: list[Config], warnings: list[str]) -> Path:
    out_dir = Path(settings.out)
    found = records.find(out_dir) if out_dir.is_dir() else None  # under the lock: another run may be writing it
    if found is not None and not settings.resume:  # a plain rerun replaced it, its plots left beside the new record
        raise ValueError(f"--out {settings.out} holds a benchmark already ({found.name}); add --resume to carry it "
                         "on, or choose another --out")
    out_dir.mkdir(parents=True, exist_ok=True)
    need_draft = any(c.spec.needs_draft for c in configs)
    # the draft as loaded: each variant a method asks for is prepared from it (Bench.draft_for)
    pair = models if models is not None else load_models(settings, configs)
    target, draft = pair
    if need_draft and draft is None:
        raise ValueError("a method needs a draft model")
    bench = Bench(settings, target, draft)
    prompts, ids_of = _fitting(_prompts(settings, bench.tokenizer, warnings), bench, settings, warnings)
    env = environment(settings, getattr(pair, "backends", ()))
    results = dict(schema=SCHEMA, command=settings.command, argv=list(sys.argv), env=env,
                   settings={k: v for k, v in asdict(settings).items() if k not in UNRECORDED},
                   target=settings.target, draft=settings.draft, started=time.strftime("%Y-%m-%d %H:%M:%S"),
                   finished=None, warnings=warnings, skipped=[],
                   prompts=[dict(key=f"{p.dataset}/{p.id}", dataset=p.dataset, id=p.id, category=p.category,
                                 chat=p.chat, tokens=len(ids), text=p.text)
                            for p, ids in zip(prompts, ids_of)],
                   runs=[])
    path = out_dir / "results.json"
    first = 0  # index of the first prompt still to run
    old = _resumable(path, results) if settings.resume and records.find(path) else None  # before the warm-ups

    if settings.warmup:  # one short generation per configuration, not timed, not recorded
        shortest = min(ids_of, key=len)  # (a long first prompt made every method fail its warm-up)
        warm = min(WARMUP_TOKENS, settings.max_new_tokens)
        for cfg, err in warm_up(configs, lambda cfg: bench.generate(cfg, shortest, warm, settings.seed)):
            results["skipped"].append(dict(label=cfg.label, method=cfg.method, budget=cfg.budget,
                                           temperature=cfg.temperature, reason=f"{type(err).__name__}: {err}"))
    if not configs:
        if old is not None:
            raise ValueError(f"every method failed its warm-up (the reasons above); {path} is left as it was")
        path = records.write(path, results)
        raise ValueError("every method failed its warm-up; see skipped in " + str(path))
    if old is not None:
        results, first = _carry_on(old, results, configs)
        print(f"[arborspec] resuming {path}: {first} of {len(prompts)} prompts already done", file=sys.stderr)

    bar = tqdm(total=len(prompts) * len(configs), initial=first * len(configs), desc="bench", unit="run",
               file=sys.stderr, disable=not settings.progress)
    for i, (prompt, ids) in enumerate(zip(prompts, ids_of)):
        if i < first:
            continue
        shift = i % len(configs)
        for position, cfg in enumerate(configs[shift:] + configs[:shift]):
            bar.set_postfix_str(f"{prompt.dataset}/{prompt.id} {cfg.label} T={cfg.temperature}")
            results["runs"].append(bench.run(cfg, prompt, ids, i, position, env))
            bar.update()
        path = records.write(path, results)
    bar.close()
    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    path = records.write(path, results)
    return path


def _resumable(path: Path, fresh: dict) -> dict:
    """The interrupted (or smaller) run at `path`, if this run may carry it on: nothing but --prompts differs, and
    its prompts, text included, are the first of the new list (datasets take turns, so a larger --prompts only
    appends). Anything else is refused (ValueError): mixing two different benchmarks in one table would be a silent
    wrong answer (an edited prompt file kept the runs made on the old text under the new one)."""
    try:
        old = records.read(path)
    except (OSError, ValueError) as err:
        raise ValueError(f"--resume: cannot read {path}: {err}") from None
    before = old.get("settings", {})
    differ = sorted(k for k in set(fresh["settings"]) | set(before)
                    if k not in ("prompts", "out")  # results/ = results
                    and _as_path(k, fresh["settings"].get(k)) != _as_path(k, before.get(k)))
    if differ:
        raise ValueError(f"--resume: {path} was run with other settings ({', '.join(differ)}); "
                         "resume with the same command, or use another --out")
    new = [(p["key"], p["text"]) for p in fresh["prompts"]]
    old_prompts = [(p.get("key"), p.get("text")) for p in old.get("prompts", [])]
    if old_prompts != new[:len(old_prompts)]:
        raise ValueError(f"--resume: {path} was run on other prompts (a dataset or prompt file changed, or fewer "
                         "--prompts); use another --out")
    if old.get("finished") and len(old_prompts) == len(new):
        raise ValueError(f"--resume: {path} is a finished run; raise --prompts to extend it, or use another --out")
    return old


def _as_path(key: str, value):
    """A model or prompt file that names an existing path, as its absolute path: `--target ./m` and `--target
    /home/u/m` are one model, and a resume that typed it the other way was refused as "other settings (target)"."""
    if key in ("target", "draft", "prompt_file") and isinstance(value, str) and Path(value).expanduser().exists():
        return str(Path(value).expanduser().resolve())
    return value


def _carry_on(old: dict, fresh: dict, configs: list[Config]) -> tuple[dict, int]:
    """`old` (from `_resumable`), cut back to the prompts every configuration that passed this run's warm-ups
    finished, and how many those are. The warm-ups decide the skipped methods anew (a method skipped before kept
    every prompt from counting as finished, and was listed once more per resume)."""
    wanted = {(c.label, c.temperature) for c in configs}
    keys, done = [p["key"] for p in fresh["prompts"]], 0
    for key in keys:  # prompts run in order, so the finished ones are a prefix
        have = {(r["label"], r["temperature"]) for r in old["runs"] if r["prompt_key"] == key}
        if not wanted <= have:
            break
        done += 1
    kept = set(keys[:done])
    old["runs"] = [r for r in old["runs"] if r["prompt_key"] in kept]  # a method skipped now keeps its finished runs
    old.setdefault("resumed", []).append(dict(at=time.strftime("%Y-%m-%d %H:%M:%S"), prompts_done=done,
                                              env=fresh["env"]))
    for field_ in ("settings", "prompts", "command", "skipped"):  # the command that reproduces the whole run
        old[field_] = fresh[field_]
    old["finished"] = None
    old["warnings"] = sorted(set(old.get("warnings", [])) | set(fresh["warnings"]))
    return old, done


# ------------------------------------------------------------------------------------------------- the CLI
def _no_methods(text: str) -> list[str]:
    raise ValueError(f"--methods names no method, got {text!r} (e.g. --methods ar,chain,auto; `arborspec methods`)")


def command_line(args) -> str:
    """The bench command line, rebuilt from the parsed arguments (so it reads the same however it was invoked)."""
    parts = ["arborspec", "bench"]
    for key, value in vars(args).items():
        if key in ("command", "func", "resume") or key.startswith("_") or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        parts += [flag] if value is True else [flag, str(value)]
    return shlex.join(parts)


def settings_from_args(args) -> BenchSettings:
    if args.prompts < 1 or args.max_new_tokens < 1:
        raise ValueError("--prompts and --max-new-tokens must be at least 1")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")
    for flag, value in (("--text-tokens", args.text_tokens), ("--max-prompt-tokens", args.max_prompt_tokens)):
        if value < 1:  # --text-tokens -5 cut 5 tokens off each text's end
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if args.dataset is None:  # --prompt-file alone runs only the file
        datasets = [] if args.prompt_file else ["humaneval"]
    else:
        datasets = [d.strip() for d in args.dataset.split(",") if d.strip()]
    return BenchSettings(
        target=args.target, draft=args.draft, dtype=args.dtype, datasets=datasets, prompt_file=args.prompt_file,
        methods=split_methods(args.methods) or _no_methods(args.methods),
        temperatures=parse_float_list(args.temperatures, "--temperatures"),
        budgets=list(parse_int_list(args.budgets, "--budgets")) if args.budgets else None,
        draft_quant=args.draft_quant, backend=args.backend, draft_backend=args.draft_backend, llama=llama_options(args),
        allow_lossy=args.allow_lossy, prompts=args.prompts,
        max_new_tokens=args.max_new_tokens, seed=args.seed, top_k=args.top_k, top_p=args.top_p,
        draft_temperature=args.draft_temperature,
        ignore_eos=args.ignore_eos, warmup=not args.no_warmup, perplexity=not args.no_perplexity,
        max_prompt_tokens=args.max_prompt_tokens, text_tokens=args.text_tokens, threads=args.threads, out=args.out,
        progress=not args.no_progress, resume=args.resume, command=command_line(args),
    )


def run_from_args(args) -> int:
    settings = settings_from_args(args)
    path = run_bench(settings)
    files = write_report(path.parent)
    print(f"results: {path}")
    for f in files:
        print(f"report: {f}")
    runs = records.read(path.parent).get("runs") or []
    if runs and all(r.get("error") for r in runs):  # each failed with a warning, and the command exited 0
        print(f"arborspec: error: every run failed (the first: {runs[0]['error']})", file=sys.stderr)
        return 1
    return 0
