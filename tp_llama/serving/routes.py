"""Which front door a request's path opens. TorchServe hands the handler everything under
/predictions/NAME/ and passes the tail as the `url_path` header:

- "" (POST /predictions/NAME): the native API (native.py);
- "v1/completions", "v1/chat/completions": OpenAI's (openai_api.py); "v1/responses": OpenAI's Responses
  API (responses_api.py); "v1/models": the served model, answered at once;
- "tokenize", "detokenize", "tokenizer_info" (under /predictions/NAME/VERSION/, where
  lm-evaluation-harness looks for them): vLLM's tokenizer endpoints, answered at once
  (tokenizer_endpoints.py).

Every path but the native one answers errors in OpenAI's shape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tp_llama.serving.native import NativeRequest, parse_request
from tp_llama.serving.models import models_list
from tp_llama.serving.openai_api import MODELS, PATHS, parse_openai
from tp_llama.serving.openai_logprobs import raw_token_bytes
from tp_llama.serving.request import FrontDoor, RequestError
from tp_llama.serving.responses_api import RESPONSES, parse_responses
from tp_llama.serving.settings import HandlerSettings
from tp_llama.serving.tokenizer_endpoints import PATHS as TOKENIZER_PATHS
from tp_llama.serving.tokenizer_endpoints import tokenizer_reply

OPENAI_PATHS = (*PATHS, RESPONSES)


def openai_shaped(path: str) -> bool:
    """Whether the path's errors take OpenAI's shape (every path but the native API's)."""
    return path == "v1" or path.startswith("v1/") or path in TOKENIZER_PATHS


def repeats(ids: list[str], path_of: Callable[[int], str]) -> dict[int, tuple[str, RequestError]]:
    """A 400 for each request id already earlier in a call's list, in its front door's shape (path_of: a
    position's path). TorchServe never sends one twice; where it did, the first's last reply forgot the id and
    the repeat's raised KeyError, failing the whole call."""
    error = RequestError("this request id appears twice in the call; each request needs its own id")
    return {idx: ("openai" if openai_shaped(path_of(idx)) else "native", error)
            for idx, rid in enumerate(ids) if rid in ids[:idx]}


def answer_now(path: str, request: dict[str, Any], settings: HandlerSettings, tokenizer: Any,
               model: str) -> dict[str, Any] | None:
    """The reply of a request answered without the engine (the models list, the tokenizer endpoints); None
    for a path that generates."""
    if path == MODELS:
        return models_list(model, settings)
    if path in TOKENIZER_PATHS:
        return tokenizer_reply(path, request, settings, tokenizer)
    return None


def open_request(path: str, request: dict[str, Any], settings: HandlerSettings, tokenizer: Any, vocab_size: int,
                 model: str, request_id: str) -> FrontDoor:
    """The parsed request of a generating path, ready for its sequences; RequestError (404 for a path that
    is none of these) for the client."""
    if openai_shaped(path):
        if path == RESPONSES:
            api = parse_responses(request, settings, tokenizer, vocab_size, model, request_id)
        elif path in PATHS:
            api = parse_openai(path, request, settings, tokenizer, vocab_size, model, request_id)
        else:
            raise RequestError(f"unknown path {path!r}: this server has /{MODELS} (GET), POST "
                               f"/{', /'.join(OPENAI_PATHS)}, and {', '.join(TOKENIZER_PATHS)} beside v1", 404)
        api.start(tokenizer.decode, raw_token_bytes(tokenizer))
        return api
    if path:
        raise RequestError(f"unknown path {path!r}: POST /predictions/NAME for the native API, or "
                           "/predictions/NAME/VERSION/v1/completions (chat/completions, responses)", 404)
    return NativeRequest(parse_request(request, settings, tokenizer, vocab_size, model), tokenizer.decode)
