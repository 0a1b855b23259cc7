"""The llama.cpp programs a user would run instead of arborspec, timed like an arborspec run.

- `llamacpp-ar`: plain decoding with llama.cpp's own loop and sampler chain (llama-cpp-python's `Llama.generate`,
  no draft): the baseline that the llama.cpp backend's guard must never fall below.
- `llamacpp-lookup`: llama-cpp-python's own speculation, prompt-lookup drafting (`LlamaPromptLookupDecoding`): the
  speculative decoding a Python user of llama.cpp gets today.

Both run the same GGUF file as the arborspec llama.cpp backend, with the same thread count. Sampling uses llama.cpp's
sampler (temperature -> top-k -> top-p, seeded), so at T > 0 the token streams are draws from the same distribution
as arborspec's, not the same draws.
"""
from __future__ import annotations

import time

LOOKUP_TOKENS = 10  # drafted tokens per step for llamacpp-lookup (llama-cpp-python's documented example)

_LOADED: dict[tuple, object] = {}  # (path, lookup, threads, n_ctx) -> Llama; loading takes seconds, runs reuse it


def _llama(path: str, lookup: int, n_threads: int, n_ctx: int):
    key = (path, lookup, n_threads, n_ctx)
    if key not in _LOADED:
        try:
            from llama_cpp import Llama
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        except ImportError as exc:  # an optional backend: say how to get it
            raise ValueError("the llama.cpp peers need llama-cpp-python (bash scripts/setup.sh installs it)") from exc
        draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup) if lookup else None
        _LOADED[key] = Llama(model_path=path, n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads,
                             draft_model=draft, verbose=False)
    return _LOADED[key]


def llamacpp_generate(path: str, ids: list[int], max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                      eos: list[int], seed: int | None, n_threads: int, lookup: int = 0, n_ctx: int = 4096) -> dict:
    """Generate with llama.cpp's own loop; the fields a bench run records (token ids, wall time, TTFT, tokens per
    model call). A "step" is one `eval` call: one token for plain decoding, 1 + accepted drafts for lookup."""
    llm = _llama(path, lookup, n_threads, n_ctx)
    llm.reset()
    llm.set_seed(seed if seed is not None else 0)
    calls = []
    plain_eval = type(llm).eval

    def counted_eval(tokens):  # count model calls; the prompt's eval is the first
        calls.append(len(tokens))
        return plain_eval(llm, tokens)

    llm.eval = counted_eval
    drafts = []
    if lookup:
        lookup_draft = llm.draft_model

        def counted_draft(input_ids):  # how many tokens each lookup proposed (0 when nothing matched)
            out = lookup_draft(input_ids)
            drafts.append(len(out))
            return out

        llm.draft_model = counted_draft
    new, stamps = [], []
    # llama.cpp's sampler: temp 0 is greedy; top_k 0 = off; min_p off so the warp equals arborspec's
    sampling = dict(temp=temperature, top_k=top_k, top_p=top_p, min_p=0.0, repeat_penalty=1.0)
    start = time.perf_counter()
    try:
        for token in llm.generate(ids, reset=True, **sampling):
            new.append(int(token))
            stamps.append((time.perf_counter(), len(calls)))
            if token in eos or len(new) >= max_new_tokens:
                break
    finally:
        del llm.eval
        if lookup:
            llm.draft_model = lookup_draft
    wall = time.perf_counter() - start
    per_call: dict[int, int] = {}
    for _, call in stamps:
        per_call[call] = per_call.get(call, 0) + 1
    committed = list(per_call.values())
    # the prompt's eval carries no draft; every later eval carries the previous lookup's proposal
    drafted = [0] + drafts[: len(committed) - 1] if lookup else [0] * len(committed)
    return dict(
        token_ids=new, wall=wall, ttft=(stamps[0][0] - start) if stamps else None,
        committed_per_step=committed, accepted_per_step=[max(n - 1, 0) for n in committed],
        drafted_per_step=drafted, finish_reason="eos" if new and new[-1] in eos else "length",
    )


def llamacpp_info() -> dict | None:
    """llama-cpp-python's version and llama.cpp's build/CPU features (what results.json records); None without it."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return {"llama_cpp_python": llama_cpp.__version__,
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()}
