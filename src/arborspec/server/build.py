"""One engine behind one app, made the same way by `arborspec serve` (run.py) and by each Ray Serve replica
(replicas.py): load the pair, warm it up, make the scheduler, the metrics and the routes; and the listening socket."""
from __future__ import annotations

import argparse
import socket
from dataclasses import dataclass

from fastapi import FastAPI

from ..backends.batching import can_batch
from ..core.sampling import SamplingConfig
from ..engine import DecoderConfig
from ..engine.prefix_cache import PrefixCache
from ..loading.pair import LoadedPair, backend_of, load_pair_for
from ..runspec import RunSpec
from .app import create_app
from .decoders import Decoders
from .metrics import Metrics
from .protocol import Limits
from .scheduler import Scheduler

WARMUP_PROMPT = "def"  # any short prompt: the first forwards pay one-time kernel set-up, better before a client waits


@dataclass
class Built:
    """One engine behind one app: what `arborspec serve` runs, once per process or once per Ray replica."""

    app: FastAPI
    scheduler: Scheduler
    metrics: Metrics
    limits: Limits
    backend: str = ""  # what runs the target and why (the start-up line)


def build_server(args: argparse.Namespace, spec: RunSpec, render_metrics=None) -> Built:
    """Load the pair, warm it up, and make the app (`render_metrics`: what GET /metrics answers, default this
    server's own metrics)."""
    decoders, pair = load_decoders(args, spec)
    limits = Limits(args.model_name or args.target, args.max_tokens_limit, args.default_max_tokens,
                    args.max_body_bytes, args.api_key)
    metrics = Metrics()
    # one target forward per round for every request where the target batches (the native backend)
    scheduler = Scheduler(args.max_batch, args.max_queue, metrics, batch=can_batch(decoders.target.model))
    metrics.info.info(server_info(args, spec, decoders, scheduler))
    return Built(create_app(decoders, limits, scheduler, metrics, render_metrics), scheduler, metrics, limits,
                 backend_line(pair, scheduler))


def server_info(args, spec: RunSpec, decoders: Decoders, scheduler: Scheduler) -> dict[str, str]:
    """The labels of /metrics' arborspec_server_info: what runs (a dashboard's legend, a query's join)."""
    draft = decoders.draft
    return {"method": spec.name, "target": args.target, "draft": args.draft if draft is not None else "",
            "backend": backend_of(decoders.target.model),
            "draft_backend": backend_of(draft.model) if draft is not None else "",
            "draft_quant": decoders.quant, "draft_vocab": str(decoders.vocab),
            "batching": "true" if scheduler.batch else "false"}


def describe(args, spec: RunSpec) -> str:
    return (f"method {spec.name}, {args.max_batch} at once, {args.max_queue} queued"
            f"{', API key required' if args.api_key else ''}")


def rounds(scheduler: Scheduler) -> str:
    """How a round runs, for the start-up line: batched (native target) or one request after another."""
    return ", one target forward per round" if scheduler.batch else ", requests' steps one after another"


def load_decoders(args, spec: RunSpec) -> tuple[Decoders, LoadedPair]:
    """The pair loaded by the loader `arborspec generate` uses (loading.pair.load_pair_for: the same flags give the same
    backends and draft), keeping the draft's resolved quantization, which requests' method levers are checked
    against, and one warm-up generation, which also checks the sampling flags."""
    pair = load_pair_for(args, spec)
    config = DecoderConfig(sampling=SamplingConfig(args.temperature, args.top_k, args.top_p, args.seed),
                           draft_temperature=args.draft_temperature, token_order=args.token_order,
                           ssm_tree=args.ssm_tree)
    cache = PrefixCache(args.prefix_cache_mb << 20) if args.prefix_cache_mb else None
    decoders = Decoders(spec, pair.target, pair.draft, pair.quant, pair.vocab, config, cache, args.prefill_chunk)
    decoders.build(spec, decoders.defaults).generate(WARMUP_PROMPT, max_new_tokens=2)
    return decoders, pair


def backend_line(pair: LoadedPair, scheduler: Scheduler) -> str:
    """What runs the models and why, for the start-up line: `--backend auto`'s measured figures, and whether the
    target batches requests (native does, one target forward per round; llama.cpp runs requests' steps one after
    another, so under concurrent load a native target serves more than its single-stream rate says)."""
    target, draft = pair.backends if pair.backends else ("?", None)
    text = f"target on {target}" + (f", draft on {draft}" if draft else "")
    if pair.choice:
        text += f" (--backend auto, predicted: {pair.choice})"
    if not scheduler.batch and target == "llamacpp" and pair.choice and "native" in pair.choice:
        text += "; native would batch concurrent requests (--backend native)"
    return text


def listen(host: str, port: int) -> socket.socket:
    """A bound socket (port 0: a free one), so the address printed is the one served."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    return sock


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
