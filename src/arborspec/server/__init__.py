"""`arborspec serve`: an OpenAI-compatible HTTP server (completions and chat completions, streamed as server-sent
events) over speculative decoding, with continuous batching (requests join and leave between steps) and Prometheus
metrics. One module per concern: protocol (requests, validation, errors), output (responses, stream chunks),
decoders (each request's own decoder), scheduler (the step-interleaving worker), metrics, logprobs, app (the
routes), build (load the pair, warm up, listen: shared with the Ray replicas), replicas (--ray), run (the flags). See
docs/serve.md.
"""
from .run import add_serve_arguments, main, run_serve

__all__ = ["add_serve_arguments", "run_serve", "main"]
