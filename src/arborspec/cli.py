"""The `arborspec` command line. Method options come from the policy registry, so a new policy needs no CLI code."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys

# torchao (the optional int4 backend) logs, when merely imported on a CPU machine, that its CUDA kernels and triton
# are missing, and torch warns about its enum registrations: four lines of noise before every command
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)

from .drafting import POLICIES  # noqa: E402  (after the logging setup: importing it may import torchao)
from .drafting.base import option_parser  # noqa: E402
from .verify import VERIFIERS  # noqa: E402

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"
DEFAULT_PROMPT = 'def quicksort(arr):\n    """Sort a list of numbers in ascending order using quicksort."""\n'


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


# ---- argument parsing ---------------------------------------------------------------------------------------
def _method_option_fields() -> dict[str, dataclasses.Field]:
    """Every option any policy takes, by name (one CLI flag each)."""
    fields: dict[str, dataclasses.Field] = {}
    for policy in POLICIES.values():
        for f in dataclasses.fields(policy.Options):
            fields.setdefault(f.name, f)
    return fields


def _argtype(parse):
    """Wrap an option parser so argparse reports its ValueError as a usage error."""
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def _add_generation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET, help="target model: alias, local dir, .gguf file or hub id")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model (same tokenizer as the target)")
    p.add_argument("--dtype", default="bf16", help="bf16 (default: 2-3x faster than fp32 on CPU), fp32 or fp16")
    p.add_argument("--method", default="static", help=f"tree policy: {', '.join(POLICIES)}")
    p.add_argument("--verifier", default=None, help=f"verification rule (default: the method's): {', '.join(VERIFIERS)}")
    p.add_argument("--allow-lossy", action="store_true", help="permit a verifier that changes the output distribution")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--draft-temperature", type=float, default=None, help="the draft's own temperature (default: same)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--token-order", default="bfs", choices=["bfs", "dfs", "heavy"],
                   help="layout of the tree's tokens in the target's forward (DySpec App. C; same output)")
    p.add_argument("--ssm-tree", default="packed", choices=["packed", "unrolled"],
                   help="Mamba2/hybrid models (STree): one packed tree pass, or every path unrolled (the baseline)")
    levers = p.add_argument_group("cheaper drafting (any method; the output stays exact)")
    levers.add_argument("--draft-quant", default="auto", choices=["auto", "none", "int8", "int4"],
                        help="quantize the draft's linear layers (int4 needs torchao); auto (default): the variant "
                             "measured fastest for this pair on this machine (cached; see `arborspec profile --pair`)")
    levers.add_argument("--draft-vocab", type=int, default=0,
                        help="draft head over the K most frequent tokens only (0 = full vocabulary)")
    levers.add_argument("--ngram", type=int, default=0,
                        help="graft prompt-lookup branches matching up to N-token n-grams of the context (0 = off)")
    levers.add_argument("--ngram-len", type=int, default=8, help="tokens per prompt-lookup branch")
    group = p.add_argument_group("method options (each method takes its own; see `arborspec methods`)")
    for name, f in _method_option_fields().items():
        group.add_argument("--" + name.replace("_", "-"), dest="opt_" + name, type=_argtype(option_parser(f)),
                           default=None,
                           help=f"{f.metadata.get('help', '')} (default {f.default!r})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="arborspec", description="Tree-based speculative decoding of causal LMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text with speculative decoding")
    _add_generation_args(gen)
    src = gen.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=None, help="prompt text (default: a code prompt)")
    src.add_argument("--prompt-file", default=None, help="read the prompt from this file")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the target's chat template")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    gen.add_argument("--per-step", action="store_true", help="with --json: include every step's statistics")
    gen.add_argument("--compare-ar", action="store_true",
                     help="also run plain decoding of the target and report the speed-up measured in this run")

    models = sub.add_parser("models", help="built-in model aliases")
    models.add_argument("action", choices=["list", "fetch", "path"])
    models.add_argument("alias", nargs="?")

    sub.add_parser("methods", help="list tree policies, their options, and verifiers")

    trees = sub.add_parser("trees", help="draw the trees a method drafts in the first steps (PNG)")
    _add_generation_args(trees)
    trees.add_argument("--prompt", default=None, help="prompt text (default: a code prompt)")
    trees.add_argument("--prompt-file", default=None, help="read the prompt from this file")
    trees.add_argument("--num-trees", type=int, default=3, help="how many steps to draw")
    trees.add_argument("--max-new-tokens", type=int, default=64)
    trees.add_argument("--out", default="trees.png", help="PNG file to write")
    trees.set_defaults(compare_ar=False)

    cal = sub.add_parser("calibrate", help="measure the draft's positional acceptance rates (for sequoia)")
    _add_generation_args(cal)
    cal.add_argument("--prompt", action="append", default=None, help="calibration prompt (repeatable)")
    cal.add_argument("--prompt-file", action="append", default=None, help="file with one calibration prompt (repeatable)")
    cal.add_argument("--max-new-tokens", type=int, default=64, help="tokens the target generates per prompt")
    cal.add_argument("--ranks", type=int, default=16, help="length of the acceptance vector")
    cal.add_argument("--out", default="acceptance.json", help="JSON file for `sequoia --acceptance-file`")
    cal.set_defaults(compare_ar=False)

    prof = sub.add_parser("profile", help="measure a model's tree-forward cost t(N) and fit STree's runtime model; "
                                          "--pair: the target's t(n) and the draft's per-layer cost that auto uses")
    prof.add_argument("--model", default=None, help="alias, local dir, .gguf file or hub id")
    prof.add_argument("--pair", action="store_true",
                      help="profile --target and --draft as `--method auto` does (cached per model, dtype, threads, "
                           "machine and library versions; --refresh measures again)")
    prof.add_argument("--target", default=DEFAULT_TARGET, help="with --pair: the target model")
    prof.add_argument("--draft", default=DEFAULT_DRAFT, help="with --pair: the draft model")
    prof.add_argument("--refresh", action="store_true", help="with --pair: measure even if a cached profile exists")
    prof.add_argument("--no-variants", action="store_true",
                      help="with --pair: skip the draft variants (bf16 / int8 / int4: cost curves and agreement)")
    prof.add_argument("--dtype", default="bf16", help="bf16 (default), fp32 or fp16")
    prof.add_argument("--kind", default=None, choices=["linear", "quadratic"],
                      help="t = k*N + C or a*N^2 + b*N + c (default: linear for pure SSMs, quadratic otherwise)")
    prof.add_argument("--sizes", default="1,2,4,8,16,32,64,128", help="tree sizes N (comma-separated)")
    prof.add_argument("--prefix", type=int, default=200, help="committed tokens before the tree")
    prof.add_argument("--repeats", type=int, default=3, help="timed forwards per size (median)")
    prof.add_argument("--ssm-tree", default="packed", choices=["packed", "unrolled"])
    prof.add_argument("--out", default=None, help="PNG plot of the fit and the tau-ratio rule")

    from .bench.args import add_bench_arguments, add_report_arguments

    add_bench_arguments(sub.add_parser("bench", help="benchmark methods on prompt sets: results.json, report.md, plots"))
    add_report_arguments(sub.add_parser("report", help="report.md and plots from a bench results.json; --check-equal"))
    return parser


# ---- commands -----------------------------------------------------------------------------------------------
def _read_prompt(args) -> str:
    if args.prompt_file:
        try:
            with open(args.prompt_file, encoding="utf-8") as fh:
                return fh.read()
        except OSError as err:
            raise CliError(f"cannot read prompt file {args.prompt_file!r}: {err.strerror}") from None
    return DEFAULT_PROMPT if args.prompt is None else args.prompt


def _load(spec: str, dtype: str, role: str):
    from .models.loading import load_model

    print(f"[arborspec] loading {role} {spec} ...", file=sys.stderr)
    return load_model(spec, dtype=dtype)


def _method_options(args) -> dict:
    return {k[4:]: v for k, v in vars(args).items() if k.startswith("opt_") and v is not None}


def _prepare_draft(args, target, draft) -> None:
    """Apply --draft-quant (auto: the measured best variant) and --draft-vocab to the loaded draft, in place."""
    from .models.draft_levers import prepare_draft

    quant = getattr(args, "draft_quant", "none")
    if quant == "auto":
        from .models.draft_choice import choose_draft_quant

        quant, record, source = choose_draft_quant(target, draft)
        best = record["variants"][quant]
        print(f"[arborspec] draft: {quant} ({source}: top-1 agreement {best['agreement']:.2f}, "
              f"{best['draft_times'][0] * 1e3:.0f} ms per draft token; --draft-quant to override)", file=sys.stderr)
    if quant != "none" or getattr(args, "draft_vocab", 0):
        print("[arborspec] preparing the draft (quantization / vocabulary) ...", file=sys.stderr)
        prepare_draft(draft, quant, getattr(args, "draft_vocab", 0))


def make_decoder(args, method: str | None = None, options: dict | None = None, baseline: bool = False):
    """Load the models named on the command line and build a decoder (models are loaded once and reused).

    `baseline`: plain decoding for --compare-ar, without the n-gram lever.
    """
    from .engine import SpeculativeDecoder

    method = method or args.method
    if method not in POLICIES:
        raise CliError(f"unknown method {method!r}; choose one of: {', '.join(POLICIES)}")
    if not hasattr(args, "_models"):
        target = _load(args.target, args.dtype, "target")
        draft = _load(args.draft, args.dtype, "draft") if POLICIES[method].needs_draft or args.compare_ar else None
        if draft is not None:
            from .models.loading import check_tokenizers_compatible

            check_tokenizers_compatible(target, draft)
            _prepare_draft(args, target, draft)
        args._models = (target, draft)
    target, draft = args._models
    return SpeculativeDecoder(
        target, draft if POLICIES[method].needs_draft else None, method=method, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, draft_temperature=args.draft_temperature, verifier=args.verifier,
        allow_lossy=args.allow_lossy, token_order=getattr(args, "token_order", "bfs"),
        record_trees=getattr(args, "record_trees", False) or getattr(args, "per_step", False),
        ssm_tree=getattr(args, "ssm_tree", "packed"), ngram=0 if baseline else getattr(args, "ngram", 0),
        ngram_len=getattr(args, "ngram_len", 8), **(_method_options(args) if options is None else options),
    )


def _summary(stats) -> str:
    d = stats.to_dict()
    return (f"{stats.method}/{stats.verifier}: {d['new_tokens']} tokens in {d['steps']} steps, "
            f"{d['tokens_per_step']:.2f} tokens/step (accepted {d['mean_accepted']:.2f}/step), "
            f"{d['tokens_per_s']:.2f} tokens/s, TTFT {d['t_first_token']:.2f}s; time draft {d['t_draft']:.1f}s, "
            f"verify {d['t_verify']:.1f}s, other {d['t_other']:.1f}s" + (" [LOSSY]" if stats.lossy else "")
            + (f"\n{stats.policy['summary']}" if stats.policy.get("summary") else ""))


def cmd_generate(args) -> int:
    if args.max_new_tokens < 1:
        raise CliError("--max-new-tokens must be at least 1")
    prompt = _read_prompt(args)
    if not prompt:
        raise CliError("the prompt is empty")
    if args.method not in POLICIES:
        raise CliError(f"unknown method {args.method!r}; choose one of: {', '.join(POLICIES)}")
    for name in _method_options(args):
        if name not in {f.name for f in dataclasses.fields(POLICIES[args.method].Options)}:
            raise CliError(f"method {args.method!r} takes no option --{name.replace('_', '-')}")
    dec = make_decoder(args)
    if args.chat:
        prompt = dec.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                   add_generation_prompt=True)
    kw = dict(max_new_tokens=args.max_new_tokens, stop=args.stop, seed=args.seed, ignore_eos=args.ignore_eos)
    if args.json:
        result = dec.generate(prompt, **kw)
    else:
        for chunk in dec.stream(prompt, **kw):
            print(chunk, end="", flush=True)
        print()
        result = dec.last_result
    out = {"text": result.text, "token_ids": result.token_ids, "stats": result.stats.to_dict(per_step=args.per_step)}
    if args.compare_ar:
        base = make_decoder(args, method="ar", options={}, baseline=True).generate(prompt, **kw)
        speedup = result.stats.tokens_per_s / base.stats.tokens_per_s if base.stats.tokens_per_s else float("nan")
        out["baseline_ar"] = {"tokens_per_s": base.stats.tokens_per_s, "token_ids": base.token_ids,
                              "speedup": speedup, "identical": base.token_ids == result.token_ids}
    if args.json:
        print(json.dumps(out))
        return 0
    print("-" * 80)
    print(_summary(result.stats))
    if args.compare_ar:
        b = out["baseline_ar"]
        same = "identical output" if b["identical"] else "outputs differ"
        print(f"plain decoding (ar): {b['tokens_per_s']:.2f} tokens/s -> speed-up {b['speedup']:.2f}x ({same})")
    return 0


def cmd_models(args) -> int:
    from .models import loading

    if args.action == "list":
        for name, spec in loading.ALIASES.items():
            state = "fetched" if loading.is_fetched(name) else "not fetched"
            print(f"{name:24s} {state:12s} {getattr(spec, 'description', '')}")
        return 0
    if not args.alias:
        raise CliError(f"`arborspec models {args.action}` needs an alias: {', '.join(loading.ALIASES)}")
    if args.alias not in loading.ALIASES:
        raise CliError(f"unknown alias {args.alias!r}; known: {', '.join(loading.ALIASES)}")
    if args.action == "fetch":
        print(loading.fetch_alias(args.alias))
    else:
        print(loading.alias_path(args.alias))
    return 0


def cmd_methods(args) -> int:
    for name, policy in POLICIES.items():
        print(f"{name}: {policy.summary}")
        for f in dataclasses.fields(policy.Options):
            print(f"    --{f.name.replace('_', '-')} (default {f.default!r}): {f.metadata.get('help', '')}")
    print("verifiers:")
    for name, ver in VERIFIERS.items():
        print(f"  {name}{'' if ver.exact else ' [LOSSY]'}: {ver.summary}")
    return 0


def cmd_trees(args) -> int:
    from .plots import draw_trees

    if args.num_trees < 1 or args.max_new_tokens < 1:
        raise CliError("--num-trees and --max-new-tokens must be at least 1")
    prompt = _read_prompt(args)
    for name in _method_options(args):
        if name not in {f.name for f in dataclasses.fields(POLICIES.get(args.method, POLICIES['ar']).Options)}:
            raise CliError(f"method {args.method!r} takes no option --{name.replace('_', '-')}")
    args.record_trees = True
    dec = make_decoder(args)
    result = dec.generate(prompt, max_new_tokens=args.max_new_tokens, seed=args.seed)
    trees = [s.tree for s in result.stats.steps[: args.num_trees]]
    title = (f"{args.method} ({', '.join(f'{k}={v}' for k, v in _method_options(args).items()) or 'defaults'}), "
             f"T={args.temperature}: {result.stats.tokens_per_step:.2f} tokens/step over {result.stats.n_steps} steps")
    print(draw_trees(trees, dec.tokenizer, args.out, title=title))
    return 0


def cmd_calibrate(args) -> int:
    from .calibrate import DEFAULT_PROMPTS, calibrate, write_acceptance_file

    prompts = list(args.prompt or [])
    for path in args.prompt_file or []:
        try:
            with open(path, encoding="utf-8") as fh:
                prompts.append(fh.read())
        except OSError as err:
            raise CliError(f"cannot read prompt file {path!r}: {err.strerror}") from None
    prompts = prompts or DEFAULT_PROMPTS
    target = _load(args.target, args.dtype, "target")
    draft = _load(args.draft, args.dtype, "draft")
    result = calibrate(target, draft, prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       ranks=args.ranks, seed=args.seed)
    result.update(target=args.target, draft=args.draft)
    write_acceptance_file(args.out, result)
    print(f"acceptance over {result['positions']} positions: "
          + ", ".join(f"{p:.3f}" for p in result["acceptance"]) + f" -> {args.out}")
    return 0


def cmd_profile(args) -> int:
    from .budget import default_kind, fit_runtime, measure_forward_cost, plot_profile, required_tau_ratio

    try:
        sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    except ValueError:
        raise CliError(f"--sizes must be comma-separated integers, got {args.sizes!r}") from None
    if not sizes or min(sizes) < 1 or args.repeats < 1 or args.prefix < 2:
        raise CliError("--sizes must be positive, --repeats at least 1 and --prefix at least 2")
    if args.out:
        from pathlib import Path

        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    if args.pair:
        return _profile_pair(args, sizes)
    if not args.model:
        raise CliError("`arborspec profile` needs --model SPEC, or --pair (with --target/--draft)")
    model = _load(args.model, args.dtype, "model").model
    kind = args.kind or default_kind(model)
    times = measure_forward_cost(model, sizes, prefix=args.prefix, repeats=args.repeats, ssm_tree=args.ssm_tree)
    fit = fit_runtime(sizes, times, kind)
    for n, t in zip(sizes, times):
        print(f"N = {n:4d}: {t * 1e3:9.2f} ms (fit {fit(n) * 1e3:9.2f} ms)")
    print(f"{kind} fit: {fit.describe()}")
    n1 = 5 if max(sizes) > 5 else min(sizes)
    print(f"a tree of N2 tokens pays over one of N1 = {n1} iff tau2/tau1 >= t(N2)/t(N1): "
          + ", ".join(f"N2={n}: {required_tau_ratio(fit, n1, n):.2f}" for n in sizes if n > n1))
    if args.out:
        print(plot_profile(sizes, times, fit, args.out, title=f"{args.model} ({args.dtype})", n1=n1))
    return 0


def _profile_pair(args, sizes: list[int]) -> int:
    """The two cost curves `--method auto` sizes its trees with: the target's t(n) and the draft's d(w)."""
    from .budget import plot_pair, profile_model, profile_path

    target_loaded, draft_loaded = _load(args.target, args.dtype, "target"), _load(args.draft, args.dtype, "draft")
    target, draft = target_loaded.model, draft_loaded.model
    curves = {}
    for role, model in (("target", target), ("draft", draft)):
        curve, source = profile_model(model, refresh=args.refresh, sizes=sizes, prefix=args.prefix,
                                      repeats=args.repeats, progress=True)
        curves[role] = curve
        print(f"{role}: {getattr(args, role)} ({args.dtype}): {source} profile {profile_path(model)}")
    t, d = curves["target"], curves["draft"]
    t1 = t(1)
    print(f"{'n':>5} {'target t(n) ms':>15} {'t(n)/t(1)':>10} {'draft d(n) ms':>14} {'d(n)/d(1)':>10} "
          f"{'d(n)/t(1)':>10}")
    for n in sorted(set(t.sizes) | set(d.sizes)):
        print(f"{n:5d} {t(n) * 1e3:15.2f} {t(n) / t1:10.2f} {d(n) * 1e3:14.2f} {d(n) / d(1):10.2f} {d(n) / t1:10.2f}")
    print(f"plain decoding: {1 / t1:.2f} tokens/s predicted; one draft layer of 1 node costs {d(1) / t1:.2f} target "
          "tokens (t(n) = target forward over n tree tokens, root included; d(n) = one draft call over n nodes)")
    if len(t.sizes) >= 3 and len(d.sizes) >= 3:
        from .budget import fit_runtime

        print(f"quadratic fits (auto interpolates the measurements instead): target "
              f"{fit_runtime(t.sizes, t.times, 'quadratic').describe()}; draft "
              f"{fit_runtime(d.sizes, d.times, 'quadratic').describe()}")
    if args.out:
        print(plot_pair(t, d, args.out, title=f"{args.target} / {args.draft} ({args.dtype})"))
    if args.no_variants:
        return 0
    from .models.draft_choice import choose_draft_quant, describe, plot_variants

    quant, record, source = choose_draft_quant(target_loaded, draft_loaded, refresh=args.refresh, sizes=sizes,
                                               prefix=args.prefix, repeats=args.repeats)
    print(f"\ndraft variants ({source}; agreement over {record['positions']} teacher-forced positions; est. tok/s = "
          "the best chain's predicted speed, see arborspec/models/draft_choice.py):")
    print("\n".join(describe(record)))
    if args.out:
        root, dot, ext = args.out.rpartition(".")
        print(plot_variants(record, f"{root}-draft-variants.{ext}" if dot else f"{args.out}-draft-variants.png",
                            title=f"{args.draft} variants ({args.dtype})"))
    return 0


def cmd_bench(args) -> int:
    from .bench.runner import run_from_args

    return run_from_args(args)


def cmd_report(args) -> int:
    from .bench.report import report_from_args

    return report_from_args(args)


COMMANDS = {"generate": cmd_generate, "models": cmd_models, "methods": cmd_methods, "trees": cmd_trees,
            "calibrate": cmd_calibrate, "bench": cmd_bench, "report": cmd_report, "profile": cmd_profile}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .models.loading import ModelLoadError

    try:
        return COMMANDS[args.command](args)
    except (CliError, ValueError, ModelLoadError, FileNotFoundError, FloatingPointError, ImportError) as err:
        if os.environ.get("ARBORSPEC_DEBUG"):
            raise
        print(f"arborspec: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("arborspec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
