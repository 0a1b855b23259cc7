"""The `arborspec` command line, every command in full (console.py answers `--help` and `models` without torch).
Method options come from the policy registry, so a new policy needs no CLI code; what a method name means is
arborspec/runspec.py, the shared flags and defaults flags.py and loading/pair.py, the same for `arborspec bench`,
`serve` and the Python API.

Over 400 lines: one short function per subcommand plus the parser that names them; the flags shared with other front
ends are in flags.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

# torchao (the optional int4 backend) logs, when merely imported on a CPU machine, that its CUDA kernels and triton
# are missing, and torch warns about its enum registrations: four lines of noise before every command. So the logging
# setup comes first, then the imports (any of them may import torchao).
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)

from . import chat, loading
from .backends.native import is_native
from .bench.args import add_bench_arguments, add_report_arguments
from .bench.calibrate import DEFAULT_PROMPTS, calibrate, write_acceptance_file
from .bench.concurrency import bench_from_args
from .bench.report import report_from_args
from .console import CliError, add_models_arguments, cmd_models, run_command, top_parser, typed_text
from .core.options import option_parser, parse_int_list
from .core.sampling import SamplingConfig, check_seed
from .core.tree import MAX_TREE_NODES
from .drafting import POLICIES
from .engine.generation import stop_strings
from .flags import (
    add_backend_arguments,
    add_method_arguments,
    add_pair_arguments,
    add_sampling_arguments,
    add_tree_layout_arguments,
)
from .loading.pair import (
    DEFAULT_DRAFT,
    DEFAULT_DTYPE,
    DEFAULT_TARGET,
    backend_of,
    is_torch_model,
    llama_options,
    load_pair,
    load_pair_for,
)
from .runspec import (
    METHODS,
    NGRAM_LEN,
    RunSpec,
    build_decoder,
    check_lossy,
    check_options,
    check_verifier,
    option_names,
    parse,
)
from .server import add_serve_arguments, run_serve
from .tuning.cost_plots import plot_pair, plot_profile
from .tuning.costs import (
    WindowTooSmall,
    busy_share,
    fitting_prefix,
    measure_forward_cost,
    profile_model,
    profile_path,
)
from .tuning.draft_choice import choose_draft_quant, describe, plot_variants
from .tuning.runtime_model import check_fit_sizes, default_kind, fit_runtime, required_tau_ratio
from .verify import VERIFIERS
from .viz.trees import draw_trees

DEFAULT_PROMPT = 'def quicksort(arr):\n    """Sort a list of numbers in ascending order using quicksort."""\n'


# ---- argument parsing ---------------------------------------------------------------------------------------
def _method_option_fields() -> dict[str, list[dataclasses.Field]]:
    """Every option any policy takes, by name (one CLI flag each), with each policy's own field for it."""
    fields: dict[str, list[dataclasses.Field]] = {}
    for policy in POLICIES.values():
        for f in dataclasses.fields(policy.Options):
            fields.setdefault(f.name, []).append(f)
    return fields


def _option_help(fields: list[dataclasses.Field]) -> str:
    """The first policy's help, and the default where every policy taking the option shares it (`--budget` said
    "default 64" for every method: suffix's is 16)."""
    shared = len({repr(f.default) for f in fields}) == 1
    default = f"default {fields[0].default!r}" if shared else "default: each method's own, `arborspec methods`"
    return f"{fields[0].metadata.get('help', '')} ({default})"


def _argtype(parse_value):
    """Wrap an option parser so argparse reports its ValueError as a usage error."""
    def convert(text: str):
        try:
            return parse_value(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    convert.__name__ = getattr(parse_value, "__name__", "value")
    return convert


def _add_generation_args(p: argparse.ArgumentParser) -> None:
    add_pair_arguments(p)
    add_method_arguments(p)
    add_sampling_arguments(p)
    add_tree_layout_arguments(p)
    levers = p.add_argument_group("cheaper drafting (any method; the output stays exact; --draft-quant above)")
    levers.add_argument("--draft-vocab", type=int, default=0,
                        help="draft head over the K most frequent tokens only (0: the full vocabulary, or for a native "
                             "draft under --draft-quant auto the head size measured fastest)")
    levers.add_argument("--ngram", type=int, default=0,
                        help="graft prompt-lookup branches matching up to N-token n-grams of the context (0 = off)")
    levers.add_argument("--ngram-len", type=int, default=NGRAM_LEN, help="tokens per prompt-lookup branch")
    levers.add_argument("--suffix", type=int, default=None,
                        help="graft up to N suffix-tree nodes a step: the most frequent earlier continuations of the "
                             "text's suffix (0 = off; default: 16 for auto, at T > 0 only on steps it drafts nothing for; "
                             "else off; `--method suffix` "
                             "drafts with them alone, no draft model)")
    levers.add_argument("--lookahead", type=int, default=0,
                        help="graft lookahead branches: a Jacobi window W guesses wide and the n-grams it found "
                             "(0 = off; `--method ar --lookahead 4` is lookahead decoding, no draft model)")
    group = p.add_argument_group("method options (each method takes its own; see `arborspec methods`)")
    for name, fields in _method_option_fields().items():
        group.add_argument("--" + name.replace("_", "-"), dest="opt_" + name, type=_argtype(option_parser(fields[0])),
                           default=None, help=_option_help(fields))


def build_parser() -> argparse.ArgumentParser:
    parser, commands = top_parser()
    gen = commands["generate"]
    _add_generation_args(gen)
    src = gen.add_mutually_exclusive_group()
    src.add_argument("text", nargs="?", default=None, metavar="PROMPT",
                     help="prompt text, as with --prompt (arborspec generate \"def fib(n):\"); '-': standard input")
    src.add_argument("--prompt", default=None, help="prompt text (default: a code prompt)")
    src.add_argument("--prompt-file", default=None, help="read the prompt from this file ('-': standard input)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the target's chat template")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--stop", action="append", default=None,
                     help="stop string (repeatable): the output ends with the token that completes it")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    gen.add_argument("--per-step", action="store_true", help="with --json: include every step's statistics")
    gen.add_argument("--compare-ar", action="store_true",
                     help="also run plain decoding of the target and report the speed-up measured in this run")

    chat = commands["chat"]
    _add_generation_args(chat)
    chat.add_argument("--system", default=None, help="a system message to start the conversation with")
    chat.add_argument("--max-new-tokens", type=int, default=512, help="the longest answer, in tokens")

    add_models_arguments(commands["models"])

    kern = commands["kernels"]
    kern.add_argument("action", choices=["build", "info"])

    trees = commands["trees"]
    _add_generation_args(trees)
    tree_src = trees.add_mutually_exclusive_group()  # both given: the file was read, the text dropped unsaid
    tree_src.add_argument("--prompt", default=None, help="prompt text (default: a code prompt)")
    tree_src.add_argument("--prompt-file", default=None, help="read the prompt from this file ('-': standard input)")
    trees.add_argument("--num-trees", type=int, default=3, help="how many steps to draw")
    trees.add_argument("--max-new-tokens", type=int, default=64)
    trees.add_argument("--out", default="trees.png", help="PNG file to write")

    cal = commands["calibrate"]  # the pair and the target's sampling: it runs no method and drafts nothing
    add_pair_arguments(cal, quant=False)
    add_sampling_arguments(cal, draft=False)
    cal.add_argument("--prompt", action="append", default=None, help="calibration prompt (repeatable)")
    cal.add_argument("--prompt-file", action="append", default=None, help="file with one calibration prompt (repeatable)")
    cal.add_argument("--max-new-tokens", type=int, default=64, help="tokens the target generates per prompt")
    cal.add_argument("--ranks", type=int, default=16, help="length of the acceptance vector")
    cal.add_argument("--out", default="acceptance.json", help="JSON file for `sequoia --acceptance-file`")

    prof = commands["profile"]
    prof.add_argument("--model", default=None, help="alias, local dir, .gguf file or hub id")
    prof.add_argument("--pair", action="store_true",
                      help="profile --target and --draft as `--method auto` does (cached per model, dtype, threads, "
                           "machine and library versions; --refresh measures again)")
    prof.add_argument("--target", default=DEFAULT_TARGET, help="with --pair: the target model")
    prof.add_argument("--draft", default=DEFAULT_DRAFT, help="with --pair: the draft model")
    prof.add_argument("--dtype", default=DEFAULT_DTYPE, help="bf16 (default), fp32 or fp16")
    add_backend_arguments(prof)
    prof.add_argument("--refresh", action="store_true", help="with --pair: measure even if a cached profile exists")
    prof.add_argument("--no-variants", action="store_true",
                      help="with --pair: skip the draft variants (a PyTorch draft: bf16 / int8 / int4; a native GGUF "
                           "draft: as it is / iq4_nl, each with its pruned heads: cost curves and agreement)")
    prof.add_argument("--kind", default=None, choices=["linear", "quadratic"],
                      help="t = k*N + C or a*N^2 + b*N + c (default: linear for pure SSMs, quadratic otherwise)")
    prof.add_argument("--sizes", default="1,2,4,8,16,32,64,128", help="tree sizes N (comma-separated)")
    prof.add_argument("--prefix", type=int, default=200, help="committed tokens before the tree")
    prof.add_argument("--repeats", type=int, default=3, help="timed rounds per size (the fastest is kept)")
    add_tree_layout_arguments(prof)
    prof.add_argument("--out", default=None, help="PNG plot of the fit and the tau-ratio rule")

    add_bench_arguments(commands["bench"])
    add_report_arguments(commands["report"])
    add_serve_arguments(commands["serve"])
    return parser


# ---- the run spec and the models ----------------------------------------------------------------------------
def run_spec(args) -> RunSpec:
    """What `generate` / `trees` run: --method (the whole NAME[(option=value,...)][@BUDGET][+LEVER...] grammar) with
    the option flags (--k, --budget, ...), --verifier and the lever flags on top."""
    spec = parse(args.method, draft_quant=args.draft_quant, allow_lossy=True)  # lossy: checked once the flags are in
    if spec.policy is None:
        raise CliError(f"{args.method!r} is a baseline (transformers' or llama.cpp's own loop): `arborspec bench` runs "
                       "it, `generate` does not")
    flags = {k[4:]: v for k, v in vars(args).items() if k.startswith("opt_") and v is not None}
    for name in flags:
        if name not in option_names(spec.policy):
            raise CliError(f"method {spec.policy!r} takes no option --{name.replace('_', '-')}")
    twice = [name for name in flags if name in dict(spec.options)]  # the flag won in silence: chain(k=3) --k 4 ran 4
    twice += [flag for flag, both in (("verifier", args.verifier and spec.verifier),
                                      ("draft_vocab", args.draft_vocab and spec.vocab),
                                      ("ngram", args.ngram and spec.ngram),
                                      ("suffix", args.suffix is not None and spec.suffix is not None),
                                      ("lookahead", args.lookahead and spec.lookahead)) if both]
    if twice:
        raise CliError(f"--method {args.method!r} sets {twice[0]} already; drop --{twice[0].replace('_', '-')} or "
                       "that part of the name")
    spec = replace(spec, options=spec.options + tuple(flags.items()), allow_lossy=args.allow_lossy,
                   verifier=check_verifier(args.verifier) if args.verifier else spec.verifier,
                   vocab=args.draft_vocab or spec.vocab, ngram=args.ngram or spec.ngram, ngram_len=args.ngram_len,
                   suffix=spec.suffix if args.suffix is None else args.suffix,
                   lookahead=args.lookahead or spec.lookahead)
    return check_lossy(check_options(spec))


def _decoder(args, spec: RunSpec, target, draft, record_trees: bool = False):
    return build_decoder(spec, target, draft, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                         draft_temperature=args.draft_temperature, token_order=args.token_order,
                         record_trees=record_trees, ssm_tree=args.ssm_tree)


# ---- commands -----------------------------------------------------------------------------------------------
def _check_sampling(args) -> None:
    """The sampling values and the seed, checked before minutes of loading (the decoder checks them again; `trees`
    and `calibrate` refused a seed only after both models had loaded)."""
    SamplingConfig(temperature=args.temperature, top_k=getattr(args, "top_k", 0), top_p=getattr(args, "top_p", 1.0),
                   seed=getattr(args, "seed", None))


def _check_out_file(path: str, flag: str = "--out") -> None:
    """An output file that cannot be written, refused before anything loads (not after minutes of measuring)."""
    target = Path(path)
    if target.is_dir():
        raise CliError(f"{flag} {path!r} is a directory; give a file name")
    parent = target.resolve().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise CliError(f"{flag} {path!r} cannot be written: {parent} is not a writable directory")
    try:  # a file made there says for sure: os.access says yes to root on /proc and other special file systems
        tempfile.TemporaryFile(dir=parent).close()
    except OSError as err:
        raise CliError(f"{flag} {path!r} cannot be written: {err.strerror} in {parent}") from None


def _check_plot_file(path: str, flag: str = "--out") -> None:
    """`_check_out_file`, and a suffix matplotlib writes (none: ".png"): `profile --out x.xyz` failed only after
    minutes of measuring, its draft variants' figures lost."""
    _check_out_file(path, flag)
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix:
        from matplotlib.backend_bases import FigureCanvasBase
        kinds = FigureCanvasBase.get_supported_filetypes()
        if suffix not in kinds:
            raise CliError(f"{flag} {path!r}: a picture is written as one of {', '.join(sorted(kinds))}, not .{suffix}")


def _read_prompt_file(path: str) -> str:
    """A prompt file's text; CliError naming the file when it cannot be read or is not UTF-8."""
    try:
        with open(path, encoding="utf-8", newline="") as fh:  # "\r\n" kept, as standard input's are (text mode
            return fh.read()  # made it "\n": the same file read two ways gave the model two prompts)
    except OSError as err:
        raise CliError(f"cannot read prompt file {path!r}: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise CliError(f"prompt file {path!r} is not UTF-8 text ({err.reason} at byte {err.start})") from None


def _read_prompt(args) -> str:
    """--prompt-file (a path, or '-' for standard input), the positional prompt or --prompt, else DEFAULT_PROMPT.
    A positional '-' reads standard input too, as most tools' do (it was the one-character prompt "-", the piped
    text unread)."""
    if args.prompt_file == "-" or getattr(args, "text", None) == "-":  # bytes, decoded here: text that is not
        # UTF-8 was refused only after the loading
        if not hasattr(sys.stdin, "buffer"):  # already text (a StringIO)
            return sys.stdin.read()
        raw = sys.stdin.buffer.read()
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise CliError(f"standard input is not UTF-8 text ({err.reason} at byte {err.start})") from None
    if args.prompt_file:
        return _read_prompt_file(args.prompt_file)
    text = getattr(args, "text", None)
    prompt = text if text is not None else args.prompt
    return DEFAULT_PROMPT if prompt is None else typed_text(prompt, "the prompt argument")


def _summary(stats) -> str:
    d = stats.to_dict()
    return (f"{stats.method}/{stats.verifier}: {d['new_tokens']} tokens in {d['steps']} steps, "
            f"{d['tokens_per_step']:.2f} tokens/step (accepted {d['mean_accepted']:.2f}/step), "
            f"{d['tokens_per_s']:.2f} tokens/s, TTFT {d['t_first_token']:.2f}s; time draft {d['t_draft']:.1f}s, "
            f"verify {d['t_verify']:.1f}s, other {d['t_other']:.1f}s" + (" [LOSSY]" if stats.lossy else "")
            + (f"\n{stats.policy['summary']}" if stats.policy.get("summary") else ""))


def _check_answer_flags(args) -> None:
    """--max-new-tokens and the sampling values of `generate` and `chat`, checked before minutes of loading."""
    if args.max_new_tokens < 1:
        raise CliError("--max-new-tokens must be at least 1")
    _check_sampling(args)
    check_seed(args.seed)  # chat checked it at each turn, and told each to /reset
    if args.temperature == 0 and (args.top_k or args.top_p < 1):  # transformers' generate warns the same
        print("arborspec: note: --top-k and --top-p shape sampling; at --temperature 0 (greedy, the default) they "
              "change nothing: give --temperature > 0 to sample", file=sys.stderr)


def cmd_generate(args) -> int:
    _check_answer_flags(args)
    prompt = _read_prompt(args)
    if not prompt:
        raise CliError("the prompt is empty")
    stop_strings(args.stop)  # the engine's check, before minutes of loading
    if args.per_step and not args.json:
        raise CliError("--per-step adds every step's statistics to --json's output; give --json too")
    spec = run_spec(args)
    target, draft = load_pair_for(args, spec)
    dec = _decoder(args, spec, target, draft, record_trees=args.per_step)
    if args.chat:  # the decoder writes it in the target's chat template (engine/prompts.py)
        prompt = [{"role": "user", "content": prompt}]
    kw = dict(max_new_tokens=args.max_new_tokens, stop=args.stop, seed=args.seed, ignore_eos=args.ignore_eos)
    plain = _decoder(args, parse("ar"), target, None) if args.compare_ar else None
    if plain is not None:  # both warmed alike, untimed: the first run paid the cold caches the second did not
        for warm in (dec, plain):
            warm.generate(prompt, **{**kw, "max_new_tokens": min(4, args.max_new_tokens)})
    if args.json:
        result = dec.generate(prompt, **kw)
    else:
        for chunk in dec.stream(prompt, **kw):
            print(chunk, end="", flush=True)
        print()
        result = dec.last_result
    out = {"text": result.text, "token_ids": result.token_ids, "stats": result.stats.to_dict(per_step=args.per_step)}
    if plain is not None:
        base = plain.generate(prompt, **kw)
        # one token (or an EOS at once) leaves no time after the first: no rate, so no ratio (it printed NaN: no JSON)
        rates = result.stats.tokens_per_s, base.stats.tokens_per_s
        speedup = rates[0] / rates[1] if all(rates) else None
        out["baseline_ar"] = {"tokens_per_s": base.stats.tokens_per_s, "token_ids": base.token_ids,
                              "speedup": speedup, "identical": base.token_ids == result.token_ids}
    if args.json:
        print(json.dumps(out, allow_nan=False))
        return 0
    print("-" * 80)
    print(_summary(result.stats))
    if args.compare_ar:
        b = out["baseline_ar"]
        same = ("identical output" if b["identical"] else "outputs differ" if args.temperature == 0 else
                "different draws of the same distribution, as expected at T > 0")
        ratio = "no speed-up to measure (one token: no time after the first)" if b["speedup"] is None else \
            f"speed-up {b['speedup']:.2f}x"
        print(f"plain decoding (ar): {b['tokens_per_s']:.2f} tokens/s -> {ratio} ({same})")
    return 0


def cmd_chat(args) -> int:
    _check_answer_flags(args)
    spec = run_spec(args)
    target, draft = load_pair_for(args, spec)
    conversation = chat.Conversation(_decoder(args, spec, target, draft), args.system, args.max_new_tokens, args.seed)
    drafted = f", drafted by {args.draft}" if spec.needs_draft else ""
    return chat.run(conversation, f"[arborspec] chatting with {args.target}{drafted} (method {spec.name})")


def cmd_kernels(args) -> int:
    """`build`: compile the kernels for this CPU now (the set-up scripts run this) and say which code path they run;
    `info`: say so without compiling."""
    from .core.host import this_cpu
    from .kernels.build import KernelBuildError, build_dir, library
    if args.action == "info" and not any(build_dir().glob("*.so")):
        print(f"arborspec kernels: not built for this CPU ({this_cpu().describe()}) yet; `arborspec kernels build` "
              f"compiles them into {build_dir()} (20-40 s), as the first native run would")
        return 0
    start = time.perf_counter()
    try:
        kernels = library()
    except KernelBuildError as err:
        raise CliError(str(err)) from None
    print(f"arborspec kernels: {kernels.isa} code, in {build_dir()} ({time.perf_counter() - start:.1f} s)")
    return 0


def cmd_methods(args) -> int:
    for name, policy in POLICIES.items():
        print(f"{name}: {policy.summary}")
        for f in dataclasses.fields(policy.Options):
            print(f"    --{f.name.replace('_', '-')} (default {f.default!r}): {f.metadata.get('help', '')}")
    print("named variants (baselines run in `arborspec bench`):")
    for name, spec in METHODS.items():
        if name not in POLICIES:
            print(f"  {name}: {spec.about}")
    print("verifiers:")
    for name, ver in VERIFIERS.items():
        print(f"  {name}{'' if ver.exact else ' [LOSSY]'}: {ver.summary}")
    return 0


def cmd_trees(args) -> int:
    if args.num_trees < 1 or args.max_new_tokens < 1:
        raise CliError("--num-trees and --max-new-tokens must be at least 1")
    _check_sampling(args)
    _check_plot_file(args.out)
    prompt = _read_prompt(args)
    spec = run_spec(args)
    target, draft = load_pair_for(args, spec)
    dec = _decoder(args, spec, target, draft, record_trees=True)
    result = dec.generate(prompt, max_new_tokens=args.max_new_tokens, seed=args.seed)
    # the first step is the prompt's own forward, which drafts nothing (engine/decoder.py): the trees come after it
    steps = [s for s in result.stats.steps if not s.prefill]
    if not steps:
        raise CliError("the generation ended with the prompt's own forward, before any tree was drafted; raise "
                       "--max-new-tokens")
    trees = [s.tree for s in steps[: args.num_trees]]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    title = (f"{spec.policy} ({', '.join(f'{k}={v}' for k, v in spec.options) or 'defaults'}), "
             f"T={args.temperature}: {result.stats.tokens_per_step:.2f} tokens/step over {result.stats.n_steps} steps")
    print(draw_trees(trees, dec.tokenizer, args.out, title=title))
    return 0


def cmd_calibrate(args) -> int:
    prompts = [typed_text(p, "--prompt") for p in args.prompt or []] + [_read_prompt_file(path)
                                                                         for path in args.prompt_file or []]
    prompts = prompts or DEFAULT_PROMPTS
    _check_sampling(args)
    if args.max_new_tokens < 1 or args.ranks < 1:
        raise CliError("--max-new-tokens and --ranks must be at least 1")
    if args.ranks > MAX_TREE_NODES:  # a node has no more children than a tree has nodes; 10**9 took the memory
        raise CliError(f"--ranks must be at most {MAX_TREE_NODES} (the most nodes a step's tree holds)")
    _check_out_file(args.out)
    target, draft = load_pair(args.target, args.draft, draft_quant="none", dtype=args.dtype, backend=args.backend,
                              draft_backend=args.draft_backend, llama=llama_options(args))
    result = calibrate(target, draft, prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       top_k=args.top_k, top_p=args.top_p, ranks=args.ranks, seed=args.seed)
    result.update(target=args.target, draft=args.draft)
    if not any(result["acceptance"]):  # its one reader, sequoia --acceptance-file, refuses an all-zero vector
        raise CliError(f"the target's token was never among the draft's first {args.ranks} on these "
                       f"{result['positions']} positions: sequoia could build no tree from them, so {args.out} is "
                       "not written; give more --ranks, prompts or --max-new-tokens, or another draft")
    write_acceptance_file(args.out, result)
    print(f"acceptance over {result['positions']} positions: "
          + ", ".join(f"{p:.3f}" for p in result["acceptance"]) + f" -> {args.out}")
    return 0


def cmd_profile(args) -> int:
    sizes = list(parse_int_list(args.sizes, "--sizes"))
    if args.repeats < 1 or args.prefix < 2:
        raise CliError("--repeats must be at least 1 and --prefix at least 2")
    if any(n < 1 or n > MAX_TREE_NODES for n in sizes):
        raise CliError(f"--sizes must each be between 1 and {MAX_TREE_NODES} (the largest tree a policy drafts)")
    if args.pair and args.model:
        raise CliError("--pair profiles --target and --draft; --model is for one model without --pair")
    if len(set(sizes)) != len(sizes):  # a cost curve needs distinct sizes: refused after the measuring before
        raise CliError(f"--sizes lists a size twice: {args.sizes}")
    if args.out:
        _check_plot_file(args.out)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    if args.pair:
        return _profile_pair(args, sizes)
    if not args.model:
        raise CliError("`arborspec profile` needs --model SPEC, or --pair (with --target/--draft)")
    check_fit_sizes(sizes, args.kind or "linear")  # before loading and measuring: minutes on a real model
    model = loading.load_model(args.model, dtype=args.dtype, backend=args.backend, llama=llama_options(args)).model
    kind = args.kind or default_kind(model)
    check_fit_sizes(sizes, kind)
    try:
        prefix = fitting_prefix(model, args.prefix, sizes, args.repeats)  # native refused a prefix past its window
    except WindowTooSmall as err:  # its advice is for generate's methods
        raise CliError(f"{err.what}; profile fewer or smaller --sizes, or fewer --repeats") from None
    if prefix < args.prefix:
        print(f"[arborspec] --prefix {args.prefix} cut to {prefix}: the model's context window holds no more beside "
              "the timed trees", file=sys.stderr)
    times = measure_forward_cost(model, sizes, prefix=prefix, repeats=args.repeats, ssm_tree=args.ssm_tree)
    fit = fit_runtime(sizes, times, kind)
    for n, t in zip(sizes, times):
        print(f"N = {n:4d}: {t * 1e3:9.2f} ms (fit {fit(n) * 1e3:9.2f} ms)")
    print(f"{kind} fit: {fit.describe()}")
    n1 = 5 if max(sizes) > 5 else min(sizes)
    if fit(n1) > 0:
        print(f"a tree of N2 tokens pays over one of N1 = {n1} iff tau2/tau1 >= t(N2)/t(N1): "
              + ", ".join(f"N2={n}: {required_tau_ratio(fit, n1, n):.2f}" for n in sizes if n > n1))
    else:  # noisy timings (a shared host) can bend a quadratic fit below 0: the figures stand, the rule does not
        print(f"the fit predicts no positive time at N1 = {n1}, so it gives no rule for larger trees; the timings "
              "are noisy (measure again with more --repeats, or --kind linear)")
    if args.out:
        print(plot_profile(sizes, times, fit, args.out, title=f"{args.model} ({_computes_in(model, args)})", n1=n1))
    return 0


def _profile_pair(args, sizes: list[int]) -> int:
    """The two cost curves `--method auto` sizes its trees with: the target's t(n) and the draft's d(w)."""
    target_loaded, draft_loaded = load_pair(args.target, args.draft, draft_quant="none", dtype=args.dtype,
                                            backend=args.backend, draft_backend=args.draft_backend,
                                            llama=llama_options(args))
    curves = {}
    for role, model in (("target", target_loaded.model), ("draft", draft_loaded.model)):
        curve, source = profile_model(model, refresh=args.refresh, sizes=sizes, prefix=args.prefix,
                                      repeats=args.repeats, progress=True, ssm_tree=args.ssm_tree)
        curves[role] = curve
        kept = profile_path(model, args.ssm_tree)  # not there when the cache cannot be written (it was named)
        print(f"{role}: {getattr(args, role)} ({_computes_in(model, args)}): {source} profile "
              + (str(kept) if kept.exists() else "(not cached: the cache cannot be written)"))
        if (busy := busy_share(model, args.ssm_tree)) is not None:
            print(f"  (measured while other processes kept {busy:.0%} of the CPUs busy: its times read slow, and it is "
                  "measured again at the first start that finds the machine quiet)")
        if source != "measured" and list(curve.sizes) != sizes:
            print(f"  (the cached profile's sizes {','.join(map(str, curve.sizes))}: --sizes and --repeats apply "
                  "when it is measured again, --refresh)")
    t, d = curves["target"], curves["draft"]
    t1 = t(1)
    print(f"{'n':>5} {'target t(n) ms':>15} {'t(n)/t(1)':>10} {'draft d(n) ms':>14} {'d(n)/d(1)':>10} "
          f"{'d(n)/t(1)':>10}")
    for n in sorted(set(t.sizes) | set(d.sizes)):
        print(f"{n:5d} {t(n) * 1e3:15.2f} {t(n) / t1:10.2f} {d(n) * 1e3:14.2f} {d(n) / d(1):10.2f} {d(n) / t1:10.2f}")
    print(f"plain decoding: {1 / t1:.2f} tokens/s predicted; one draft layer of 1 node costs {d(1) / t1:.2f} target "
          "tokens (t(n) = target forward over n tree tokens, root included; d(n) = one draft call over n nodes)")
    if len(t.sizes) >= 3 and len(d.sizes) >= 3:
        print(f"quadratic fits (auto interpolates the measurements instead): target "
              f"{fit_runtime(t.sizes, t.times, 'quadratic').describe()}; draft "
              f"{fit_runtime(d.sizes, d.times, 'quadratic').describe()}")
    if args.out:
        title = f"{args.target} / {args.draft} ({_computes_in(target_loaded.model, args)})"
        print(plot_pair(t, d, args.out, title=title))
    if args.no_variants or not (is_torch_model(draft_loaded) or is_native(draft_loaded.model)):
        return 0  # variants exist for PyTorch drafts (int8, int4) and native GGUF drafts (lean 4-bit files)
    quant, record, source = choose_draft_quant(target_loaded, draft_loaded, refresh=args.refresh, sizes=sizes,
                                               prefix=args.prefix, repeats=args.repeats)
    print(f"\ndraft variants ({source}; agreement over {record['positions']} teacher-forced positions; est. tok/s = "
          "the best chain's predicted speed, see arborspec/tuning/draft_choice.py):")
    print("\n".join(describe(record)))
    if args.out:
        out = Path(args.out)  # the name's own dot, not one in a directory's name ("res.d/pair")
        print(plot_variants(record, out.with_name(f"{out.stem}-draft-variants{out.suffix or '.png'}"),
                            title=f"{args.draft} variants ({_computes_in(draft_loaded.model, args)})"))
    return 0


def _computes_in(model, args) -> str:
    """What a title says a model runs in: --dtype on transformers, the file's own types on the GGUF backends (a
    native profile was labelled "bf16")."""
    backend = backend_of(model)
    if backend == "torch":
        return args.dtype
    return f"{backend}, GGUF {model.native_gguf.weight_type}" if is_native(model) else f"{backend}, {model.dtype}"


COMMANDS = {"generate": cmd_generate, "chat": cmd_chat, "models": cmd_models, "kernels": cmd_kernels,
            "methods": cmd_methods, "trees": cmd_trees, "calibrate": cmd_calibrate, "bench": bench_from_args,
            "report": report_from_args, "profile": cmd_profile, "serve": run_serve}


def main(argv: list[str] | None = None) -> int:
    """Every command, parsed in full (the console script calls this for all but the light ones, console.py)."""
    args = build_parser().parse_args(_negative_lists_attached(sys.argv[1:] if argv is None else argv))
    return run_command(lambda a: COMMANDS[a.command](_refuse_empty(a)), args)


_NEGATIVE_LIST = re.compile(r"-\d*\.?\d+(e-?\d+)?,.*")  # "-0.1,0.5": argparse reads it as a flag


def _negative_lists_attached(argv: list[str]) -> list[str]:
    """`--acceptance -0.1,0.5` as `--acceptance=-0.1,0.5`: argparse takes a lone negative number as a value but a
    list starting with one as a flag, and said "expected one argument" instead of the option's own check."""
    out, rest = [], list(argv)
    while rest:
        arg = rest.pop(0)
        if arg.startswith("--") and "=" not in arg and rest and _NEGATIVE_LIST.fullmatch(rest[0]):
            arg = f"{arg}={rest.pop(0)}"
        out.append(arg)
    return out


def _refuse_empty(args):
    """`args`, unless a path, name or method-option flag is the empty string: read as not given, `--prompt-file ''`
    ran the default prompt, `--verifier ''` the default verifier, `--target ''` the current directory and `--widths ''`
    the method's default widths, each without a word."""
    options = [name for name in vars(args) if name.startswith("opt_")]  # method options: `--widths ''` too
    for name in ("target", "draft", "model", "prompt_file", "verifier", "out", "method", *options):
        if getattr(args, name, None) == "":
            raise CliError(f"--{name.removeprefix('opt_').replace('_', '-')} is empty")
    return args


if __name__ == "__main__":
    sys.exit(main())
