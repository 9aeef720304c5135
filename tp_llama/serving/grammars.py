"""Compiling a request's grammar (JSON schema, regex, choice, GBNF or Lark) into a matcher, off the step loop.

A grammar that cannot be compiled, uses a feature llguidance lacks, or takes longer than
`COMPILE_LIMIT_S` is refused with a 400 naming the feature and, for a schema, where in it: a reply is
never left unconstrained. Compiling runs on worker threads (llguidance releases the GIL) so the
sequences already running keep stepping; a compiled grammar is cached by its text and each request
takes its own copy of the matcher.
"""

from __future__ import annotations

import json
import re
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import llguidance

from tp_llama.engine.constraint import Constraint, parser_limits
from tp_llama.serving.request import GrammarSpec, RequestError

COMPILE_LIMIT_S = 1.0
CACHED_GRAMMARS = 256
# Replies are compact JSON with readable separators: free whitespace lets a model pad a reply
# without end (vLLM's disable_any_whitespace exists for this).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def llguidance_grammar(spec: GrammarSpec) -> str:
    """The spec in llguidance's grammar format; RequestError where the text cannot even be read."""
    try:
        if spec.kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(spec.text, overrides=JSON_OPTIONS)
        if spec.kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(choice) for choice in json.loads(spec.text)))
        return llguidance.grammar_from("regex" if spec.kind == "regex" else "grammar", spec.text)
    except ValueError as exc:
        raise RequestError(f"{spec.param}: cannot be compiled: {_first_line(exc)}", param=spec.param) from None
    except RecursionError:
        raise RequestError(f"{spec.param}: nested too deeply to compile", param=spec.param) from None


def _first_line(error: Any) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def explain(spec: GrammarSpec, error: str) -> str:
    """llguidance's error with the place in the schema it concerns (a JSON pointer), where it can be found."""
    message = " ".join(line.strip(" |") for line in error.splitlines() if line.strip(" |^"))
    if spec.kind != "json":
        return f"{spec.param}: cannot be compiled: {message}"
    schema = json.loads(spec.text)
    path = None
    keys = re.search(r"Unimplemented keys: \[(.*?)\]", error)
    if keys:
        names = [name.strip(' "') for name in keys.group(1).split(",")]
        path = _find(schema, lambda node: any(name in node for name in names))
        message = f"unsupported keyword(s) {', '.join(names)}"
    fmt = re.search(r"Unknown format: (\S+)", error)
    if fmt:
        path = _find(schema, lambda node: node.get("format") == fmt.group(1))
        message = f"unsupported string format {fmt.group(1)!r}"
    if "regex parse error" in error:
        path = _find(schema, lambda node: isinstance(node.get("pattern"), str) and node["pattern"] in error)
    where = f" at {path or '/'}" if keys or fmt or path else ""
    return f"{spec.param}: the schema cannot be enforced{where}: {message}"


def _find(node: Any, wanted, path: str = "") -> str | None:
    """The JSON pointer of the first object under `node` that `wanted` accepts."""
    if isinstance(node, dict):
        if wanted(node):
            return path or "/"
        children = node.items()
    elif isinstance(node, list):
        children = enumerate(node)
    else:
        return None
    for key, child in children:
        found = _find(child, wanted, f"{path}/{str(key).replace('~', '~0').replace('/', '~1')}")
        if found:
            return found
    return None


@dataclass(eq=False)
class Pending:
    """A grammar being compiled for a request; `result()` once `ready`."""

    spec: GrammarSpec
    future: Future
    started: float
    began: list[float]  # when a worker began compiling it: empty while it waits behind other grammars

    @property
    def ready(self) -> bool:
        return self.future.done() or time.perf_counter() - self.started > COMPILE_LIMIT_S

    def result(self) -> Constraint:
        """The request's own matcher; RequestError when the grammar is refused or took too long (503 where it
        waited behind other requests' grammars for half its time or more: it is not the one to blame)."""
        if not self.future.done():
            param = self.spec.param
            if not self.began or self.began[0] - self.started >= COMPILE_LIMIT_S / 2:
                raise RequestError(f"{param}: the grammar compilers are busy with other requests' grammars; retry",
                                   503, param=param)
            raise RequestError(f"{param}: the grammar did not compile within {COMPILE_LIMIT_S:g} s; "
                               "simplify it (fewer alternatives, smaller bounds)", param=param)
        try:
            matcher = self.future.result()
        except RequestError:
            raise
        except Exception as exc:  # llguidance's own failure: this request's 500, not the whole call's
            raise RequestError(f"{self.spec.param}: compiling the grammar failed ({type(exc).__name__}: {exc})", 500,
                               param=self.spec.param) from exc
        return Constraint(matcher.deep_copy())


class GrammarCompiler:
    """Rank 0's grammar compiler: worker threads, a cache by grammar text, llguidance's limits set."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, workers: int = 2) -> None:
        self.tokenizer = tokenizer
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[tuple[str, str], tuple[Future, list[float]]] = OrderedDict()

    def submit(self, spec: GrammarSpec) -> Pending:
        """Start compiling (or take the cached grammar); RequestError at once for text that cannot be read."""
        key = (spec.kind, spec.text)
        cached = self._cache.get(key)
        if cached is None:
            began: list[float] = []
            cached = self._cache[key] = self._pool.submit(self._begin, began, spec, llguidance_grammar(spec)), began
            while len(self._cache) > CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return Pending(spec, cached[0], time.perf_counter(), cached[1])

    def compile_now(self, spec: GrammarSpec) -> Constraint:
        """Compile on the caller's thread, within the time limit (the offline paths)."""
        pending = self.submit(spec)
        try:
            pending.future.result(timeout=COMPILE_LIMIT_S)
        except TimeoutError:
            pass
        return pending.result()

    def _begin(self, began: list[float], spec: GrammarSpec, grammar: str) -> llguidance.LLMatcher:
        began.append(time.perf_counter())
        return self._compile(spec, grammar)

    def _compile(self, spec: GrammarSpec, grammar: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, limits=parser_limits(), log_level=0)
        if matcher.is_error():
            raise RequestError(explain(spec, matcher.get_error()), param=spec.param)
        probe = matcher.deep_copy()  # the first mask: a grammar whose language is empty fails here
        probe.compute_bitmask()
        if probe.is_error():
            raise RequestError(f"{spec.param}: the grammar matches no reply at all", param=spec.param)
        return matcher
