"""What a client may send, and how the server says no: request models, their validation, OpenAI-style errors.

Every refusal is an `APIError` carrying an HTTP status and OpenAI's error object
(`{"error": {"message", "type", "param", "code"}}`), so a client library reports it as it would OpenAI's own; a
malformed body, a field of the wrong type or an out-of-range value is a 4xx, never a 500. Types are checked
strictly (a string "16" is not a `max_tokens`), because coercing guesses would make a typo silently change a run.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..core.sampling import SEED_RANGE, TEMPERATURE_RULE, valid_temperature
from ..engine.generation import stop_strings as stop_texts
from .logprobs import MAX_CHAT_TOP, MAX_COMPLETION_TOP


class APIError(Exception):
    """A request the server refuses: `status` and the OpenAI error object `body()`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers  # HTTP headers the refusal carries (Retry-After on 429, WWW-Authenticate on 401)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Limits:
    """The server-wide bounds every request is checked against (`arborspec serve` flags)."""

    model_name: str  # the one model served: what `model` names, or a request that leaves it out gets
    max_tokens_limit: int  # the most tokens one request may ask for
    default_max_tokens: int  # when a request names none (generate's --max-new-tokens default)
    max_body_bytes: int
    api_key: str | None = None  # None: no authentication


# ---- request bodies ------------------------------------------------------------------------------------------------
class ArborspecOptions(BaseModel):
    """The `arborspec` extension field: this request's method and sizing instead of the server's."""

    model_config = ConfigDict(strict=True, extra="forbid")
    method: str | None = None  # NAME[(option=value,...)][@BUDGET][+LEVER...], as `arborspec generate --method`
    verifier: str | None = None
    budget: int | None = Field(default=None, ge=1)  # drafted tokens per step, for a method whose name pins none
    allow_lossy: bool = False  # consent to a verifier that does not preserve the target distribution
    return_token_ids: bool = False  # put the generated token ids in the response's `arborspec` field


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool | None = False  # a last chunk with empty `choices` carrying `usage` (and the `arborspec` stats)


class _Generation(BaseModel):
    """The fields completions and chat completions share. Unknown fields are ignored, as OpenAI's own clients send
    some this server has no use for (`user`, ...); the ones that would change the output are refused unless neutral
    (see `check_unsupported`)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None  # None: the one model this server serves (as llama-server and vLLM take it)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens (chat's; a completion's too, as
    # a client that sends it to both would otherwise get the default length there unasked)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # an extension (vLLM's name): 0 turns it off
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: str | list[str] | None = None
    stream: bool | None = False  # None, as OpenAI's clients may send for any optional field: the default
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False  # an extension (vLLM's name): generate past end-of-sequence tokens
    arborspec: ArborspecOptions | None = None


class CompletionRequest(_Generation):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_TOP)  # k alternatives (server/logprobs.py)
    echo: bool | None = False  # the prompt before the completion, with its tokens' logprobs when logprobs are asked for

    def top_logprobs_asked(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    name: str | None = None  # a participant's name: handed to the chat template, which may write it or not
    content: str | list[TextPart] | None = None  # None only for an assistant's turn (OpenAI: one with tool calls)
    tool_calls: list | None = None  # refused unless empty: this server has no tools, and dropping them would
    function_call: dict | None = None  # show the model a turn other than the one the client sent

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content):
        """An image or audio part was refused as "Input should be a valid string", which names neither."""
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise ValueError(f"content parts of type {kind!r} are not supported: this server reads text parts "
                                 "only")
        return content

    @model_validator(mode="after")
    def _content_given(self):
        if self.tool_calls or self.function_call:
            raise ValueError("messages with tool calls are not supported by this server (it serves no tools)")
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs 'content' (a string or a list of text parts)")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = False  # each token's logprob (server/logprobs.py)
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_CHAT_TOP)  # and this many alternatives

    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# OpenAI fields this server does not implement, with the values that mean "not used": anything else is refused
# rather than ignored, since ignoring it would hand back something other than what was asked for.
NEUTRAL = {
    "n": (1, None), "best_of": (1, None), "echo": (False, None), "logprobs": (None, False),
    "top_logprobs": (None, 0), "presence_penalty": (0, None), "frequency_penalty": (0, None),
    "logit_bias": (None, {}), "suffix": (None, ""), "tools": (None, []), "functions": (None, []),
    "response_format": (None, {"type": "text"}), "tool_choice": (None, "none", "auto"),
    "function_call": (None, "none", "auto"), "modalities": (None, ["text"]), "audio": (None,),
    "repetition_penalty": (None, 1), "min_p": (None, 0),  # vLLM's, as top_k and ignore_eos are: never dropped unread
    # vLLM's and llama.cpp server's other extensions that change the output (clients send them through extra_body;
    # each was answered 200 with its setting unread): sampling, stopping and constrained decoding
    "typical_p": (None, 1), "min_tokens": (None, 0), "stop_token_ids": (None, []), "bad_words": (None, []),
    "include_stop_str_in_output": (None, False), "allowed_token_ids": (None,), "length_penalty": (None, 1),
    "use_beam_search": (None, False), "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
    "guided_grammar": (None,), "repeat_penalty": (None, 1), "n_predict": (None,), "grammar": (None, ""),
    "json_schema": (None,), "mirostat": (None, 0), "tfs_z": (None, 1), "dry_multiplier": (None, 0),
    "xtc_probability": (None, 0), "top_n_sigma": (None, -1), "dynatemp_range": (None, 0), "samplers": (None,),
    "typ_p": (None, 1), "n_probs": (None, 0), "structured_outputs": (None,), "logits_processors": (None, []),
    "truncate_prompt_tokens": (None,), "skip_special_tokens": (None, True), "prompt_logprobs": (None,),
    "add_generation_prompt": (None, True), "continue_final_message": (None, False), "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
}
# vLLM's `add_special_tokens`, whose neutral value depends on the endpoint: a completion's text is tokenized with the
# tokenizer's special tokens (a BOS where it adds one), a chat template's text without (the template writes them)
NEUTRAL_BY_KIND = {CompletionRequest: {"add_special_tokens": (None, True)},
                   ChatRequest: {"add_special_tokens": (None, False)}}

_TYPES = {"str", "int", "float", "bool"}  # how a union's member types appear in an error's location

Request = TypeVar("Request", bound=_Generation)


def parse_request(raw: bytes, model: type[Request]) -> Request:
    """The request `raw` holds (APIError 400 for a body that is not a JSON object of the right fields and types)."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise APIError(400, f"the request body is not valid JSON: {err}") from None
    except RecursionError:  # "[[[[...": json nests by recursion, so a body within the size limit could 500
        raise APIError(400, "the request body nests its JSON too deeply") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    check_unsupported(data, model)
    try:
        req = model.model_validate(data)
    except ValidationError as err:
        # the deepest error: of a union (content: str | list of parts) the branch that got furthest says what is
        # wrong ("messages.0.content.0.text: Field required", not "content: Input should be a valid string")
        first = max(err.errors(), key=lambda e: len(e["loc"]))
        # a union's errors name the member type tried ('str', 'list[int]'): the client wants the field's path
        where = ".".join(str(p) for p in first["loc"] if not (isinstance(p, str) and (p in _TYPES or "[" in p)))
        param = str(first["loc"][0]) if first["loc"] else None
        raise APIError(400, f"invalid '{where or 'body'}': {first['msg']}", param=param) from None
    if getattr(req, "top_logprobs", None) and not req.logprobs:  # chat's: checked here to name the field
        raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return req


def check_unsupported(data: dict, model: type[BaseModel]) -> None:
    for name, neutral in {**NEUTRAL, **NEUTRAL_BY_KIND.get(model, {})}.items():
        if name in model.model_fields:  # implemented by this kind of request (logprobs)
            continue
        value = data.get(name)
        if name in data and not any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in neutral):
            raise APIError(400, f"'{name}' = {value!r} is not supported by this server "
                                f"(supported: {' or '.join(json.dumps(v) for v in neutral)})", param=name)


# ---- what a request asks for ----------------------------------------------------------------------------------------
_TEMPERATURE = (valid_temperature, TEMPERATURE_RULE)
SAMPLING_RULES = {  # the engine's own rules (sampling.SamplingConfig), checked early to name the field or flag
    "temperature": _TEMPERATURE,
    "draft_temperature": _TEMPERATURE,
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "top_k": (lambda v: v >= 0, "an integer >= 0 (0 turns it off)"),
    "seed": (lambda v: SEED_RANGE[0] <= v <= SEED_RANGE[1], f"in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]"),
}


def sampling_problem(name: str, value) -> str | None:
    """What is wrong with the sampling setting `name` = `value` ("must be ..."), or None: for a request's field and
    for `arborspec serve`'s flag alike."""
    ok, rule = SAMPLING_RULES[name]
    return None if value is None or ok(value) else f"must be {rule}, got {value!r}"


def check_sampling(req: _Generation) -> None:
    """The request's own sampling fields, each refused naming itself (`param`)."""
    for name in ("temperature", "top_p", "top_k"):
        if problem := sampling_problem(name, getattr(req, name)):
            raise APIError(400, f"{name} {problem}", param=name)
    if req.temperature is not None and req.temperature > 2:  # OpenAI's range; `serve --temperature` may go past it
        raise APIError(400, f"temperature must be at most 2, got {req.temperature!r}", param="temperature")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")


def max_tokens(req: _Generation, limits: Limits) -> int:
    value, name = req.max_completion_tokens, "max_completion_tokens"
    if value is None:
        value, name = req.max_tokens, "max_tokens"
    if value is None:
        return min(limits.default_max_tokens, limits.max_tokens_limit)
    if value == 0 and getattr(req, "echo", False) and req.top_logprobs_asked() is not None:
        return 0  # a prompt scored: its tokens' logprobs, no completion (OpenAI's legacy echo)
    if not 1 <= value <= limits.max_tokens_limit:
        raise APIError(400, f"{name} must be between 1 and {limits.max_tokens_limit} (0 only with echo and "
                            f"logprobs: a prompt scored), got {value}", param=name)
    return value


MAX_STOP_CHARS = 4096  # each event checks the text's end against every start of a stop string (server/output.py)


def stop_strings(req: _Generation) -> list[str]:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > 4 or any(not s or len(s) > MAX_STOP_CHARS for s in stop):
        raise APIError(400, f"stop takes up to 4 non-empty strings of at most {MAX_STOP_CHARS} characters",
                       param="stop")
    try:
        stop_texts(stop)  # a lone surrogate ("\ud800" in JSON) could never match decoded text
    except ValueError as err:
        raise APIError(400, str(err), param="stop") from None
    return stop


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """The one prompt a completion request holds: text, or token ids."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, f"one prompt per request (got {len(prompt)}): this server answers n=1",
                           param="prompt")
        prompt = prompt[0]
    if not prompt:
        raise APIError(400, "the prompt is empty", param="prompt")
    return prompt


def chat_messages(req: ChatRequest) -> list[dict]:
    """The conversation as a chat template takes it. A `developer` message is OpenAI's newer name for a system
    message; templates know only `system` (Qwen2.5's has no branch for `developer` and put its default system
    prompt in the instructions' place)."""
    return [{"role": "system" if m.role == "developer" else m.role, "content": m.text(),
             **({"name": m.name} if m.name is not None else {})} for m in req.messages]


def check_model(name: str | None, limits: Limits) -> None:
    """A request's `model` (None: left out, served by the one model there is), or 404 in OpenAI's shape."""
    if name is not None and name != limits.model_name:
        raise APIError(404, f"the model {name!r} does not exist; this server serves {limits.model_name!r}",
                       param="model", code="model_not_found")
