"""`arborspec serve`: its flags, and starting the server (load the pair, warm up, listen, serve until SIGTERM).

The speculative settings use `arborspec generate`'s grammar and defaults (arborspec/runspec.py): --method takes the
whole NAME[(option=value,...)][@BUDGET][+LEVER...] name, so generate's per-option flags are written into it here
(`--method "static(depth=4,branch=2)"`, `--method chain@6+ngram`). Sampling flags are the defaults for requests
that leave a field out. Every flag is checked before anything loads, so a typo fails in a second with one line
naming the flag, not after the models have loaded. See docs/serve.md.
"""
from __future__ import annotations

import argparse
import ipaddress
import os
import re
import sys
from dataclasses import replace

import uvicorn

from ..flags import add_method_arguments, add_pair_arguments, add_sampling_arguments, add_tree_layout_arguments
from ..loading.model import ModelLoadError
from ..loading.pair import llama_options
from ..runspec import RunSpec, check_lossy, check_verifier, parse
from .build import build_server, describe, listen, rounds, url_host
from .protocol import sampling_problem
from .scheduler import Scheduler

API_KEY_ENV = "ARBORSPEC_API_KEY"  # the key without putting it on the command line, where `ps` shows it
LOG_LEVELS = ["critical", "error", "warning", "info", "debug"]
MAX_SHUTDOWN_S = 86400  # --shutdown-timeout's bound: a day (inf overflowed the scheduler's wait)
DEFAULT_MAX_TOKENS = 128  # a request without max_tokens: generate's --max-new-tokens default


class ServeHelp(argparse.HelpFormatter):
    """`serve --help` showing every flag's default, where it has one and its help does not already say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or action.default is None or action.default is False
                or action.default == argparse.SUPPRESS or "default" in text):
            return text
        return f"{text} (default %(default)s)"


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """Every `arborspec serve` flag (`p`: the `serve` parser, whose --help this also makes show the defaults)."""
    if isinstance(p, argparse.ArgumentParser):
        p.formatter_class = ServeHelp
    add_pair_arguments(p)
    add_method_arguments(p, "'static(depth=4,branch=2)' or chain@6+ngram (a request may pick its own in its "
                            "`arborspec` field)")
    add_tree_layout_arguments(p)
    add_sampling_arguments(p.add_argument_group("sampling defaults (for requests that leave the field out; "
                                                "--draft-temperature: every request's)"))
    h = p.add_argument_group("server")
    h.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    h.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed at start)")
    h.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1/*; better: set ${API_KEY_ENV}, which `ps` does "
                        "not show (default: $" + API_KEY_ENV + "; neither set: no key, and a warning when --host is "
                        "not this machine)")
    h.add_argument("--model-name", default=None, help="the name clients put in `model` (default: --target)")
    h.add_argument("--max-batch", type=int, default=8, help="requests generated at once (one step each per round)")
    h.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot; beyond that: 429")
    h.add_argument("--max-tokens-limit", type=int, default=4096, help="the most tokens one request may ask for")
    h.add_argument("--default-max-tokens", type=int, default=None,
                   help=f"for a request that names no max_tokens (default: {DEFAULT_MAX_TOKENS}, or --max-tokens-limit "
                        "if lower)")
    h.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    h.add_argument("--prefix-cache-mb", type=int, default=1024,
                   help="finished requests' KV caches kept for requests that begin the same way (a chat's next turn "
                        "prefills only its new tokens; native backend), in MiB (0: off)")
    h.add_argument("--prefill-chunk", type=int, default=64,
                   help="prompt tokens a model reads per round, so that a long prompt joining does not hold up the "
                        "other requests' streams for its whole prefill (0: a prompt in one round)")
    h.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds in-flight requests get to finish before they are cancelled")
    h.add_argument("--log-level", default="warning", choices=LOG_LEVELS,
                   help="uvicorn's log level (info: a line per request)")
    r = p.add_argument_group("Ray Serve (pip install 'arborspec[ray]'; see docs/ray.md)")
    r.add_argument("--ray", action="store_true", help="serve through Ray Serve: replicas of this app behind Ray's "
                   "HTTP proxy, which listens on --host/--port")
    r.add_argument("--replicas", type=int, default=None, help="a fixed number of replicas (default 1)")
    r.add_argument("--autoscale", default=None, metavar="MIN,MAX",
                   help="let Ray scale between MIN and MAX replicas by ongoing requests (instead of --replicas)")
    r.add_argument("--ray-address", default=None,
                   help="the Ray cluster to join ('auto': the one started on this machine by `ray start`); "
                        "default: start a local Ray instance for this server")
    r.add_argument("--replica-cpus", type=float, default=None,
                   help="CPUs Ray reserves for each replica; also its torch and llama.cpp threads (default 1)")


def run_serve(args: argparse.Namespace) -> int:
    """Load, warm up, and serve until SIGTERM / Ctrl-C (ValueError for bad settings or a taken port, before anything
    loads)."""
    check_flags(args)
    spec = server_spec(args)
    if args.ray:
        from .replicas import run_on_ray
        return run_on_ray(args, spec, listening=lambda: warn_open(args))
    with listen(args.host, args.port) as sock:  # before loading: a taken port fails in a second, not after a minute
        warn_open(args)  # once it listens: a host it cannot listen on is an error, not a server open to anyone
        server = build_server(args, spec)
        host, port = sock.getsockname()[:2]
        print(f"[arborspec] serving {server.limits.model_name!r} on http://{url_host(host)}:{port} "
              f"({describe(args, spec)}{rounds(server.scheduler)}; {server.backend})", file=sys.stderr, flush=True)
        config = uvicorn.Config(server.app, log_level=args.log_level,
                                timeout_graceful_shutdown=args.shutdown_timeout + 5)
        Server(config, server.scheduler, args.shutdown_timeout).run(sockets=[sock])
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m arborspec.server ...`: the same as `arborspec serve ...`."""
    parser = argparse.ArgumentParser(prog="arborspec serve", description="OpenAI-compatible speculative decoding")
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_serve(args)
    except (ValueError, ModelLoadError, FileNotFoundError, ImportError) as err:
        print(f"arborspec: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


# ---- pieces --------------------------------------------------------------------------------------------------------
def check_flags(args) -> None:
    """Every flag a value of which is wrong whatever the models (ValueError naming the flag); sets args.api_key to
    the key from --api-key or $ARBORSPEC_API_KEY, or None."""
    asked = args.default_max_tokens is not None
    if not asked:
        args.default_max_tokens = min(DEFAULT_MAX_TOKENS, args.max_tokens_limit)  # a bad limit: named below
    for flag, value, least in (("--max-batch", args.max_batch, 1), ("--max-queue", args.max_queue, 0),
                               ("--max-tokens-limit", args.max_tokens_limit, 1),
                               ("--default-max-tokens", args.default_max_tokens, 1),
                               ("--max-body-bytes", args.max_body_bytes, 1), ("--port", args.port, 0),
                               ("--shutdown-timeout", args.shutdown_timeout, 0),
                               ("--prefix-cache-mb", args.prefix_cache_mb, 0),
                               ("--prefill-chunk", args.prefill_chunk, 0)):
        if not value >= least:  # `not >=`: a NaN fails too
            raise ValueError(f"{flag} must be at least {least}, got {value}")
    if asked and args.default_max_tokens > args.max_tokens_limit:  # was capped at the limit in silence
        raise ValueError(f"--default-max-tokens {args.default_max_tokens} is over --max-tokens-limit "
                         f"{args.max_tokens_limit}")
    if not args.shutdown_timeout <= MAX_SHUTDOWN_S:  # inf passed, and its wait overflowed at the first signal
        raise ValueError(f"--shutdown-timeout must be at most {MAX_SHUTDOWN_S} seconds (a day), got "
                         f"{args.shutdown_timeout}")
    if args.port > 65535:
        raise ValueError(f"--port must be at most 65535, got {args.port}")
    llama_options(args)  # (ValueError for a --llama-* value below 1)
    if args.model_name is not None and not args.model_name.strip():
        raise ValueError("--model-name is empty: give the name clients put in `model`, or leave it out (the "
                         "target's)")
    for name in ("temperature", "top_k", "top_p", "draft_temperature", "seed"):
        if problem := sampling_problem(name, getattr(args, name)):
            raise ValueError(f"--{name.replace('_', '-')} {problem}")
    args.api_key = api_key(args.api_key)
    check_ray_flags(args)


def warn_open(args) -> None:
    if args.api_key is None and not is_loopback(args.host):
        print(f"[arborspec] warning: listening on {args.host} without an API key: anyone who can reach this port "
              f"may use the server (set ${API_KEY_ENV} to require one)", file=sys.stderr, flush=True)


def api_key(flag: str | None) -> str | None:
    """The key clients must send: --api-key, else $ARBORSPEC_API_KEY, else None (no key). An empty one is an error:
    it would otherwise serve without a key while its operator believes it requires one."""
    for source, key in (("--api-key", flag), (f"${API_KEY_ENV}", os.environ.get(API_KEY_ENV))):
        if key is not None:
            if not key.strip():
                raise ValueError(f"{source} is empty: give a key, or leave it out to serve without one")
            return key.strip()  # as clients' keys are read (app.check_key)
    return None


def is_loopback(host: str) -> bool:
    """Whether `host` is this machine only (a name other than localhost counts as reachable from elsewhere)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_ray_flags(args) -> None:
    """Ray's flags only with --ray, and sane; --autoscale becomes args.autoscale = (min, max)."""
    given = [f for f, v in (("--replicas", args.replicas), ("--autoscale", args.autoscale),
                            ("--ray-address", args.ray_address), ("--replica-cpus", args.replica_cpus))
             if v is not None]
    if not args.ray:
        if given:
            raise ValueError(f"{', '.join(given)} {'only makes' if len(given) == 1 else 'only make'} sense with --ray")
        return
    if args.replica_cpus is None:
        args.replica_cpus = 1.0
    if args.replicas is not None and args.autoscale is not None:
        raise ValueError("give --replicas or --autoscale, not both")
    if args.replicas is not None and args.replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {args.replicas}")
    if args.autoscale is not None:
        low, _, high = str(args.autoscale).partition(",")
        whole = all(re.fullmatch(r"[0-9]+", part.strip()) for part in (low, high))  # isdigit() took "²"
        if not whole or not 0 <= int(low) <= int(high) or int(high) < 1:
            raise ValueError(f"--autoscale takes MIN,MAX with 0 <= MIN <= MAX and MAX >= 1, got {args.autoscale!r}")
        args.autoscale = (int(low), int(high))
    if not args.replica_cpus > 0:
        raise ValueError(f"--replica-cpus must be above 0, got {args.replica_cpus}")


def server_spec(args) -> RunSpec:
    spec = parse(args.method, draft_quant=args.draft_quant, allow_lossy=True)  # lossy: checked once --verifier is in
    if spec.policy is None:
        raise ValueError(f"{args.method!r} is a baseline (transformers' or llama.cpp's own loop): `arborspec bench` "
                         "runs it, the server does not")
    if args.verifier and spec.verifier:  # --verifier won in silence, as generate's did
        raise ValueError(f"--method {args.method!r} sets verifier already; drop --verifier or that part of the name")
    spec = replace(spec, verifier=check_verifier(args.verifier) if args.verifier else spec.verifier,
                   allow_lossy=args.allow_lossy)
    return check_lossy(spec)


class Server(uvicorn.Server):
    """uvicorn's server, telling the scheduler when a shutdown signal arrives: from then on no request is taken,
    and the running ones get `grace` seconds before they are cancelled (each client hears why)."""

    def __init__(self, config: uvicorn.Config, scheduler: Scheduler, grace: float):
        super().__init__(config)
        self.scheduler, self.grace = scheduler, grace

    def handle_exit(self, sig, frame) -> None:
        """The first signal starts the drain; a second one during the grace ends the grace at once, so each client
        hears why (uvicorn's own second-signal exit cancelled the handlers and printed their tracebacks); one after
        the grace forces uvicorn's exit."""
        if self.should_exit and not self.scheduler.overdue:
            self.scheduler.drain(0.0)
            return
        self.scheduler.drain(self.grace)
        super().handle_exit(sig, frame)
