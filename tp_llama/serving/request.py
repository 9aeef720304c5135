"""The rules both front doors share: one request body into a generation job, or an error naming the problem.

The native API (native.py) and the OpenAI one (openai_api.py) read their fields with these
checkers, so a rule is written once. Only rank 0 reads requests; the other ranks run its plans.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from collections.abc import Container
from typing import Any, Protocol

from tp_llama.engine.sampling import GREEDY_BELOW, MAX_LOGPROBS, SEED_LIMIT, SamplingParams, TokenLogprobs
from tp_llama.engine.scheduler import Sequence
from tp_llama.serving.settings import HandlerSettings

MAX_LOGIT_BIAS = 1024


class RequestError(ValueError):
    """The request cannot be served; the message is sent back to the client as is.

    `param` names the offending field when there is one (the OpenAI error shape reports it).
    """

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code  # OpenAI's error code, where it has one (model_not_found)


class ChatTokenizer(Protocol):
    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]: ...

    def encode_chat(self, messages: list[dict]) -> list[int]: ...


def sequence_id(rid: str, i: int) -> str:
    """The id of a request's i-th engine sequence (n > 1, or several prompts): the request's own for the first."""
    return rid if i == 0 else f"{rid}#{i}"


def request_of(seq_id: str, requests: Container[str]) -> str:
    """The request among `requests` that a sequence_id belongs to."""
    return seq_id if seq_id in requests else seq_id.rpartition("#")[0]


@dataclass(frozen=True)
class GrammarSpec:
    """A structured output: kind "json" (a JSON schema), "regex", "choice" or "grammar" (GBNF or Lark);
    `text` is its canonical text (the compiled-grammar cache's key); `param` the request field it came from."""

    kind: str
    text: str
    param: str


@dataclass(frozen=True)
class Job:
    """A validated request: what the engine needs plus how to answer."""

    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    cache_salt: str | None = None  # the prefix cache is shared only between requests of the same salt
    grammar: GrammarSpec | None = None  # the reply's constraint (serving/grammars.py compiles it)
    n: int = 1  # sequences per prompt, prefilled once (engine/scheduler.py's groups)
    tools: Any = None  # chat's tools: a serving.tool_use.ToolUse (which imports this module)
    adapter: str | None = None  # the LoRA adapter the reply comes from (serving/models.py); None: the base


class FrontDoor(Protocol):
    """A parsed request of either API and its reply state between TorchServe calls."""

    job: Job
    stopped: bool  # a stop string ended the generation (of one of its sequences)

    @property
    def content_type(self) -> str: ...

    def sequences(self, rid: str) -> list[Sequence]:
        """The engine sequences that answer the request (one per prompt), made once when it is admitted."""

    def advance(self) -> list[Sequence]:
        """After each step: follow the newly shown text (stop strings watched); returns the sequences
        a stop string ends now."""

    def reply(self, timeout_s: float) -> str:
        """This call's reply for the request ("" for nothing yet)."""


@dataclass(eq=False)
class Live:
    """A request between its first call and its last reply (the handler holds one per request id)."""

    api: FrontDoor
    seqs: list[Sequence]
    first_token_seen: bool = False

    @property
    def finished(self) -> bool:
        return all(seq.finished for seq in self.seqs)


def json_line(payload: dict[str, Any]) -> str:
    return json.dumps(payload, ensure_ascii=False) + "\n"


def request_body(request: dict[str, Any]) -> Any:
    """The body TorchServe passed on: raw bytes, text, or an already-decoded JSON value."""
    for key in ("body", "data"):
        if key in request and request[key] is not None:
            return request[key]
    raise RequestError("empty request: send a JSON object with Content-Type: application/json")


def _reject_constant(name: str) -> None:
    raise RequestError(f"body is not valid JSON: {name} is not a number")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise RequestError(f"duplicate field {key!r}")
        result[key] = value
    return result


def client_json(text: str | bytes, what: str, param: str | None = None, *,
                syntax: str = "is not valid JSON: {msg}", too_long: str = "holds a number too long to read",
                **options: Any) -> Any:
    """json.loads for JSON text a client sent, where every way it fails is the client's 400 naming `what`, never
    the handler's 500: json.loads raises a RecursionError for deep nesting and a bare ValueError for an integer
    longer than int() reads (sys.get_int_max_str_digits). Bytes must be UTF-8 (json.loads would guess UTF-16 or
    32). `syntax` words a syntax error ({msg}, {line}, {column}, or the whole {error}); a RequestError that a hook
    in `options` raises goes out as it is."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RequestError(f"{what} is not valid UTF-8 (byte {exc.start})", param=param) from None
    try:
        return json.loads(text, **options)
    except json.JSONDecodeError as exc:
        detail = syntax.format(msg=exc.msg, line=exc.lineno, column=exc.colno, error=exc)
        raise RequestError(f"{what} {detail}", param=param) from None
    except RecursionError:
        raise RequestError(f"{what} is nested too deeply", param=param) from None
    except RequestError:
        raise
    except ValueError:
        raise RequestError(f"{what} {too_long}", param=param) from None


def json_object(value: Any, what: str, param: str | None = None) -> dict[str, Any]:
    """The value client_json read, where only an object will do (a field list, call arguments)."""
    if not isinstance(value, dict):
        raise RequestError(f"{what} must be a JSON object, got {type_name(value)}", param=param)
    return value


def decode_body(body: Any, max_bytes: int) -> dict[str, Any]:
    """Parse the body strictly: UTF-8 JSON object, no NaN/Infinity, no duplicate keys, bounded size."""
    if isinstance(body, str):
        body = body.encode("utf-8", errors="surrogatepass")
    if isinstance(body, (bytes, bytearray)):
        if len(body) > max_bytes:
            raise RequestError(f"body is {len(body)} bytes; the limit is {max_bytes}")
        value = client_json(bytes(body), "body", syntax="is not valid JSON: {msg} at line {line} column {column}",
                            too_long="is not valid JSON here: a number too long to read",
                            parse_constant=_reject_constant, object_pairs_hook=_no_duplicates)
        _utf8_size(value)
    else:
        # TorchServe already decoded an application/json body (decode_input_request=true).
        value = body
        size = _utf8_size(value)
        if size > max_bytes:
            raise RequestError(f"body is about {size} bytes; the limit is {max_bytes}")
    return json_object(value, "body")


def _utf8_size(value: Any) -> int:
    """Size of the value as UTF-8 JSON; JSON escapes can smuggle in lone surrogates, which tokenizers reject."""
    try:
        return len(json.dumps(value, ensure_ascii=False, allow_nan=True, separators=(",", ":")).encode("utf-8"))
    except UnicodeEncodeError:
        raise RequestError("body contains an unpaired UTF-16 surrogate escape (\\ud800-\\udfff)") from None
    except RecursionError:
        raise RequestError("body is nested too deeply") from None


def type_name(value: Any) -> str:
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


# The field checkers: a missing field and a JSON null mean "not set".


def integer_field(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{key} must be an integer, got {type_name(value)}", param=key)
    return value


def number_field(body: dict[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"{key} must be a number, got {type_name(value)}", param=key)
    try:
        number = float(value)
    except OverflowError:  # an integer literal with hundreds of digits
        raise RequestError(f"{key} is out of range", param=key) from None
    if not math.isfinite(number):
        raise RequestError(f"{key} must be finite, got {number}", param=key)
    return number


def boolean_field(body: dict[str, Any], key: str) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"{key} must be true or false, got {type_name(value)}", param=key)
    return value


def cache_salt_field(body: dict[str, Any]) -> str | None:
    """vLLM's cache_salt: a non-empty string that keeps a tenant's cached prefixes its own."""
    value = body.get("cache_salt")
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise RequestError(f"cache_salt must be a non-empty string, got {type_name(value)}", param="cache_salt")
    return value


def bounded_number(body: dict[str, Any], key: str, default: float, low: float, high: float,
                   open_low: bool = False) -> float:
    """A number in [low, high] ((low, high] with open_low); `default` when not set."""
    value = number_field(body, key)
    if value is None:
        return default
    if not (low < value if open_low else low <= value) or value > high:
        where = f">= {low:g}" if high == float("inf") else f"in {'(' if open_low else '['}{low:g}, {high:g}]"
        raise RequestError(f"{key} must be {where}, got {value:g}", param=key)
    return value


def _logit_bias(body: dict[str, Any], vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias in [-100, 100]}; ids as strings (JSON keys) or integers. Keys naming one id
    ("5", "05") give it the last one's bias, as vLLM's int(key) dict does: summed, they passed the range."""
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise RequestError(f"logit_bias must be an object of token id -> number, got {type_name(bias)}",
                           param="logit_bias")
    if len(bias) > MAX_LOGIT_BIAS:
        raise RequestError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens", param="logit_bias")
    entries: dict[int, float] = {}
    for key, value in bias.items():
        # Leading zeros dropped first: int() refuses a string of more digits than sys.get_int_max_str_digits.
        digits = (key.lstrip("0") or "0") if isinstance(key, str) and key.isascii() and key.isdigit() else None
        token = int(digits) if digits is not None and len(digits) <= len(str(vocab_size)) else None
        if token is None or not 0 <= token < vocab_size:
            raise RequestError(f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r}",
                               param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise RequestError(f"logit_bias values must be numbers in [-100, 100], got {value!r} for token {key}",
                               param="logit_bias")
        entries[token] = float(value)
    return tuple(entries.items())


def pickable_ids(vocab_size: int, tokenizer: Any) -> int:
    """How many ids the sampler can pick: its logits stop at the tokenizer's ids (a padded embedding's extra rows
    have no text), so an id past them must never index them."""
    return min(vocab_size, getattr(tokenizer, "n_words", vocab_size))


def sampling_params(body: dict[str, Any], settings: HandlerSettings, max_new_tokens: int, pickable: int,
                    logprobs: int | None, ignore_eos: bool) -> SamplingParams:
    """The sampling fields both APIs share (OpenAI's, and vLLM's top_k, min_p and repetition_penalty);
    temperature and top_p default from the yaml; logit_bias ids below `pickable` (pickable_ids)."""
    seed = integer_field(body, "seed")
    if seed is not None and not 0 <= seed < SEED_LIMIT:
        raise RequestError(f"seed must be in [0, 2**63), got {seed}", param="seed")
    top_k = integer_field(body, "top_k")
    if top_k is not None and top_k < -1:
        raise RequestError(f"top_k must be -1 or 0 (no limit) or a positive integer, got {top_k}", param="top_k")
    temperature = bounded_number(body, "temperature", settings.temperature, 0.0, float("inf"))
    return SamplingParams(
        max_new_tokens,
        temperature=0.0 if temperature < GREEDY_BELOW else temperature,
        top_p=bounded_number(body, "top_p", settings.top_p, 0.0, 1.0, open_low=True),
        # At least the vocabulary is no limit; kept as such, a huge k overflows the sampler's int64 (a failed step).
        top_k=top_k if top_k is not None and 0 < top_k < pickable else 0,
        min_p=bounded_number(body, "min_p", 0.0, 0.0, 1.0),
        frequency_penalty=bounded_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        presence_penalty=bounded_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=bounded_number(body, "repetition_penalty", 1.0, 0.0, 2.0, open_low=True),
        logit_bias=_logit_bias(body, pickable),
        logprobs=logprobs,
        seed=seed,
        ignore_eos=ignore_eos,
    )


def logprobs_field(body: dict[str, Any], key: str, most: int = MAX_LOGPROBS) -> int | None:
    """An integer in [0, most], or None when not set."""
    value = integer_field(body, key)
    if value is not None and not 0 <= value <= most:
        raise RequestError(f"{key} must be in [0, {most}], got {value}", param=key)
    return value


def native_logprobs(logprobs: list[TokenLogprobs]) -> list[dict[str, Any]]:
    """Token log-probabilities in the native API's shape."""
    return [{"token_id": t.token, "logprob": t.logprob,
             "top_logprobs": [{"token_id": token, "logprob": value} for token, value in t.top]} for t in logprobs]


def text_prompt_ids(prompt: Any, tokenizer: ChatTokenizer, key: str = "prompt") -> list[int]:
    """A non-empty text prompt, encoded with BOS."""
    if not isinstance(prompt, str):
        raise RequestError(f"{key} must be a string, got {type_name(prompt)}", param=key)
    if not prompt:
        raise RequestError(f"{key} must not be empty", param=key)
    return tokenizer.encode(prompt, bos=True, eos=False)


def chat_prompt_ids(messages: Any, tokenizer: ChatTokenizer, key: str = "messages") -> list[int]:
    """A chat of {"role", "content"} objects, encoded with the family's template."""
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"{key} must be a non-empty array of {{\"role\", \"content\"}} objects", param=key)
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError(f"{key}[{i}] must be an object, got {type_name(message)}", param=key)
        extra = sorted(set(message) - {"role", "content"})
        if extra:
            raise RequestError(f"{key}[{i}] has unknown field(s) {extra}; allowed: role, content", param=key)
    try:
        return tokenizer.encode_chat(messages)
    except ValueError as exc:
        raise RequestError(f"invalid {key}: {exc}", param=key) from None


MAX_N = 16


def n_field(body: dict[str, Any], settings: HandlerSettings) -> int:
    """OpenAI's n: how many replies to one prompt; a group runs at once, so at most max_batch_size."""
    n = integer_field(body, "n")
    if n is None:
        return 1
    most = min(MAX_N, settings.engine.max_batch_size)
    if not 1 <= n <= most:
        raise RequestError(f"n must be in [1, {most}] (at most {MAX_N}, and all of a request's replies run at "
                           f"once: max_batch_size is {settings.engine.max_batch_size}), got {n}", param="n")
    return n


def fit_max_new_tokens(requested: int | None, key: str, prompt_len: int, settings: HandlerSettings) -> int:
    """An explicit value (of field `key`) must fit; the default shrinks to the room the prompt leaves."""
    room = settings.engine.max_seq_len - prompt_len
    if room < 1:
        raise RequestError(
            f"prompt is {prompt_len} tokens; max_seq_len {settings.engine.max_seq_len} leaves no room to generate"
        )
    if requested is None:
        return min(settings.default_max_new_tokens, room)
    if requested < 1:
        raise RequestError(f"{key} must be >= 1, got {requested}", param=key)
    if requested > settings.max_new_tokens_limit:
        raise RequestError(f"{key} {requested} exceeds the limit {settings.max_new_tokens_limit}", param=key)
    if requested > room:
        raise RequestError(
            f"prompt ({prompt_len} tokens) plus {key} ({requested}) exceeds max_seq_len {settings.engine.max_seq_len}",
            param=key,
        )
    return requested
