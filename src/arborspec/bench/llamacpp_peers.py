"""The llama.cpp programs a user would run instead of arborspec, timed like an arborspec run.

- `llamacpp-ar`: plain decoding with llama.cpp's own loop and sampler chain (llama-cpp-python's `Llama.generate`,
  no draft): the baseline that the llama.cpp backend's guard must never fall below.
- `llamacpp-lookup`: llama-cpp-python's own speculation, prompt-lookup drafting (`LlamaPromptLookupDecoding`): the
  speculative decoding a Python user of llama.cpp gets today.
- `llamacpp-lookahead`: llama.cpp's lookahead decoding example (`llama-lookahead`, Fu et al.'s Jacobi window and
  n-gram pool; W = 15, N = 5, G = 15 fixed in its source). llama-cpp-python does not ship it: a user builds it from
  llama.cpp's source (docs/llamacpp.md, "Lookahead peer") and names it in $ARBORSPEC_LLAMA_LOOKAHEAD. It runs as a
  program, so it reads the prompt as text and prints text: the prompt is the ids decoded, the tokens are its output
  text encoded again, and only totals come back (tokens, accepted tokens, prompt and decoding seconds), so a step's
  share is the mean one.

All three run the same GGUF file as the arborspec llama.cpp backend, with the same thread count. Sampling uses llama.cpp's
sampler (temperature -> top-k -> top-p, seeded), so at T > 0 the token streams are draws from the same distribution
as arborspec's, not the same draws.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from unittest import mock

from arborspec.backends.llamacpp import model_params

LOOKAHEAD_ENV = "ARBORSPEC_LLAMA_LOOKAHEAD"  # path of llama.cpp's llama-lookahead program (llamacpp-lookahead)

_LOADED: dict[tuple, object] = {}  # (path, lookup, threads, n_ctx) -> Llama; loading takes seconds, runs reuse it


def _llama(path: str, lookup: int, n_threads: int, n_ctx: int):
    key = (path, lookup, n_threads, n_ctx)
    if key not in _LOADED:
        try:
            from llama_cpp import Llama
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        except ImportError as exc:  # an optional backend: say how to get it
            raise ValueError("the llama.cpp peers need llama-cpp-python: pip install 'arborspec[llamacpp]' "
                             "(in a checkout, bash scripts/setup.sh)") from exc
        draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup) if lookup else None
        with _without_amx_buffers():
            _LOADED[key] = Llama(model_path=path, n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads,
                                 draft_model=draft, verbose=False)
    return _LOADED[key]


def _without_amx_buffers():
    """Llama() loads with llama.cpp's default model parameters and lets no caller change them; while it loads, they are
    the ones backends.llamacpp.model_params gives (on a build with AMX kernels, no extra weight buffers: see there)."""
    import llama_cpp.llama_cpp as low

    defaults = low.llama_model_default_params
    return mock.patch.object(low, "llama_model_default_params", lambda: model_params(low, defaults))


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
    # the prompt's eval carries no draft; every later eval carries the previous lookup's proposal. The prompt's eval
    # is no decoding step (engine/stats.py), so its first token is left out of the per-step lists, as arborspec's
    drafted = [0] + drafts[: len(committed) - 1] if lookup else [0] * len(committed)
    if len(committed) > 1:
        committed, drafted = committed[1:], drafted[1:]
    return dict(
        token_ids=new, wall=wall, ttft=(stamps[0][0] - start) if stamps else None,
        committed_per_step=committed, accepted_per_step=[max(n - 1, 0) for n in committed],
        drafted_per_step=drafted, finish_reason="eos" if new and new[-1] in eos else "length",
    )


def lookahead_program() -> str:
    """The llama-lookahead program: $ARBORSPEC_LLAMA_LOOKAHEAD, else `llama-lookahead` on the PATH."""
    path = os.environ.get(LOOKAHEAD_ENV) or shutil.which("llama-lookahead")
    if not path or not os.access(path, os.X_OK):
        raise ValueError(f"llamacpp-lookahead runs llama.cpp's llama-lookahead program, which llama-cpp-python does "
                         f"not ship: build it from llama.cpp's source (docs/llamacpp.md, 'Lookahead peer') and set "
                         f"{LOOKAHEAD_ENV} to its path" + (f" ({path!r} is not an executable)" if path else ""))
    return path


_TOTALS = {"enc": re.compile(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds"),
           "dec": re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds"),
           "accept": re.compile(r"n_accept\s*=\s*(\d+)")}


def lookahead_generate(path: str, ids: list[int], max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                       ignore_eos: bool, seed: int | None, n_threads: int, tokenizer, n_ctx: int = 4096) -> dict:
    """Run llama-lookahead once on the prompt `ids` (decoded to text; the program tokenizes it, special tokens
    included); the fields a bench run records. The wall time is the program's own prompt + decoding seconds (not its
    start or model load, as the other peers keep their model loaded)."""
    prompt = tokenizer.decode(ids)
    cmd = [lookahead_program(), "-m", path, "-p", prompt, "-n", str(max_new_tokens), "-c", str(n_ctx),
           "-t", str(n_threads), "-tb", str(n_threads), "--temp", str(temperature), "--top-k", str(top_k),
           "--top-p", str(top_p), "--min-p", "0", "--repeat-penalty", "1", "-s", str(seed or 0)]
    if ignore_eos:
        cmd.append("--ignore-eos")
    done = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=600)
    log = done.stdout + done.stderr
    found = {k: rx.search(log) for k, rx in _TOTALS.items()}
    if done.returncode != 0 or not all(found.values()):
        raise RuntimeError(f"llama-lookahead failed (exit {done.returncode}): {log.strip()[-400:]}")
    n_new, t_enc, t_dec = int(found["dec"].group(1)), float(found["enc"].group(2)), float(found["dec"].group(2))
    accepted = int(found["accept"].group(1))
    text = re.sub(r"\x1b\[[0-9;]*m", "", done.stdout)  # accepted tokens are printed in colour
    text = text[text.find(prompt) + len(prompt):] if prompt in text else text
    steps = max(n_new - accepted, 1)  # each step commits 1 + its accepted tokens
    committed = [n_new // steps + (i < n_new % steps) for i in range(steps)]  # totals only: the mean split
    return dict(token_ids=tokenizer(text.strip("\n"), add_special_tokens=False)["input_ids"][:n_new],
                wall=t_enc + t_dec, ttft=t_enc, committed_per_step=committed,
                accepted_per_step=[max(n - 1, 0) for n in committed], drafted_per_step=None,
                finish_reason="length" if n_new >= max_new_tokens else "eos")


def llamacpp_info() -> dict | None:
    """llama-cpp-python's version and llama.cpp's build/CPU features (what results.json records); None without it."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return {"llama_cpp_python": llama_cpp.__version__,
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()}
