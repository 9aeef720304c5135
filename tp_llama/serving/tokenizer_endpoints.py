"""vLLM's tokenizer endpoints, answered by rank 0 at once, without the engine: POST .../tokenize,
POST .../detokenize and GET .../tokenizer_info under /predictions/NAME/VERSION/.

They sit where lm-evaluation-harness looks for them (its `local-completions` model strips
`/v1/completions` from the base URL and probes `tokenizer_info`, then `tokenize`): a client that finds
them counts and scores tokens with the served checkpoint's own tokenizer, which a Meta checkpoint
ships as `tokenizer.model` and not as the Hugging Face folder such clients otherwise ask for.

- tokenize: `{"prompt", "add_special_tokens" (default true: BOS first)}` or `{"messages",
  "add_special_tokens" (default false: the chat template adds its own), "add_generation_prompt",
  "tools", ...}` -> `{"count", "max_model_len", "tokens", "token_strs"}`. A special token's text in a
  prompt is that token (as a Hugging Face tokenizer reads it), so a client can find the end-of-text id
  by encoding `eos_token`; the generation paths keep such text as plain text.
- detokenize: `{"tokens"}` -> `{"prompt"}`.
- tokenizer_info: the tokenizer's facts (`eos_token`, `bos_token`, their ids, the vocabulary's size,
  `model_max_length`).
"""

from __future__ import annotations

import re
from typing import Any

from tp_llama.serving.openai_api import chat_messages
from tp_llama.serving.request import (
    ChatTokenizer,
    RequestError,
    boolean_field,
    decode_body,
    request_body,
    type_name,
)
from tp_llama.serving.settings import HandlerSettings
from tp_llama.serving.tool_use import chat_ids

TOKENIZE, DETOKENIZE, TOKENIZER_INFO = "tokenize", "detokenize", "tokenizer_info"
PATHS = (TOKENIZE, DETOKENIZE, TOKENIZER_INFO)
_PROMPT_FIELDS = {"model", "prompt", "add_special_tokens", "return_token_strs"}
_CHAT_FIELDS = {"model", "messages", "add_special_tokens", "return_token_strs", "add_generation_prompt",
                "continue_final_message", "tools", "tool_choice", "parallel_tool_calls"}


def tokenizer_reply(path: str, request: dict[str, Any], settings: HandlerSettings, tokenizer: Any) -> dict[str, Any]:
    """The reply of one tokenizer request (path: one of PATHS); RequestError for the client."""
    if path == TOKENIZER_INFO:
        return tokenizer_info(tokenizer, settings)
    body = decode_body(request_body(request), settings.max_request_bytes)
    if path == TOKENIZE:
        return tokenize(body, tokenizer, settings)
    return detokenize(body, tokenizer)


def _names(tokenizer: Any) -> dict[int, str]:
    return tokenizer.special_names() if hasattr(tokenizer, "special_names") else {}


def encode_with_specials(tokenizer: ChatTokenizer, text: str) -> list[int]:
    """`text` encoded without BOS, each special token's name in it read as that token."""
    ids_of = {name: token for token, name in _names(tokenizer).items()}
    if not ids_of:
        return tokenizer.encode(text, bos=False)
    pattern = re.compile("|".join(re.escape(name) for name in sorted(ids_of, key=len, reverse=True)))
    ids: list[int] = []
    at = 0
    for match in pattern.finditer(text):
        if match.start() > at:
            ids += tokenizer.encode(text[at:match.start()], bos=False)
        ids.append(ids_of[match.group()])
        at = match.end()
    return ids + (tokenizer.encode(text[at:], bos=False) if at < len(text) else [])


def _refuse_unknown(body: dict[str, Any], allowed: set[str]) -> None:
    for key in body:
        if key not in allowed:
            raise RequestError(f"Unrecognized request argument supplied: {key}", param=key)


def tokenize(body: dict[str, Any], tokenizer: Any, settings: HandlerSettings) -> dict[str, Any]:
    """A text prompt or a chat, as the ids the generation paths would feed the model."""
    if ("prompt" in body) == ("messages" in body):
        raise RequestError("send exactly one of prompt or messages", param="prompt")
    if "prompt" in body:
        _refuse_unknown(body, _PROMPT_FIELDS)
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise RequestError(f"prompt must be a string, got {type_name(prompt)}", param="prompt")
        specials = body.get("add_special_tokens")
        ids = ([tokenizer.bos_id] if specials is None or boolean_field(body, "add_special_tokens") else [])
        ids += encode_with_specials(tokenizer, prompt)
    else:
        _refuse_unknown(body, _CHAT_FIELDS)
        if body.get("add_generation_prompt") is False or boolean_field(body, "continue_final_message"):
            raise RequestError("the chat templates here always end where the assistant replies: "
                               "add_generation_prompt must be true and continue_final_message false",
                               param="add_generation_prompt")
        boolean_field(body, "add_generation_prompt")
        ids, _ = chat_ids(body, chat_messages(body["messages"]), tokenizer, settings.tool_format)
        if boolean_field(body, "add_special_tokens"):
            ids = [tokenizer.bos_id] + ids  # on top of the template's own, as vLLM adds them
    reply: dict[str, Any] = {"count": len(ids), "max_model_len": settings.engine.max_seq_len, "tokens": ids,
                             "token_strs": None}
    if boolean_field(body, "return_token_strs"):
        reply["token_strs"] = [tokenizer.decode([token]) for token in ids]
    return reply


def detokenize(body: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    _refuse_unknown(body, {"model", "tokens"})
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise RequestError("tokens must be an array of token ids", param="tokens")
    bad = [t for t in tokens if not 0 <= t < tokenizer.n_words]
    if bad:
        raise RequestError(f"token ids must be in [0, {tokenizer.n_words}), got {bad[0]}", param="tokens")
    return {"prompt": tokenizer.decode(tokens)}


def tokenizer_info(tokenizer: Any, settings: HandlerSettings) -> dict[str, Any]:
    """The facts a client needs to tokenize as the server does (lm-evaluation-harness reads eos_token and
    bos_token, and finds their ids through tokenize)."""
    names = _names(tokenizer)
    return {
        "tokenizer_class": type(tokenizer).__name__, "family": getattr(tokenizer, "family", None),
        "bos_token": names.get(tokenizer.bos_id), "eos_token": names.get(tokenizer.eos_id),
        "bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id,
        "stop_token_ids": sorted(getattr(tokenizer, "stop_ids", [tokenizer.eos_id])),
        "vocab_size": tokenizer.n_words, "model_max_length": settings.engine.max_seq_len,
        "add_bos_token": True, "add_eos_token": False,
    }
