"""What sets Llama 4's tokenizer and prompts apart from Llama 3's, as data.

Llama 4 (Scout, Maverick) ships a tiktoken ``tokenizer.model`` like Llama 3's, but with 200,000 ranks,
o200k's pre-tokenizer and 2,048 special tokens in an order of its own after the ranks; its chat turns
are framed by ``<|header_start|>`` / ``<|header_end|>`` and end ``<|eot|>`` (``<|eom|>`` after a tool
result). The values are those of Meta's reference code, llama-models 0.3.0 (``llama_models.llama4``);
tests/test_llama4_tokenizer.py checks them against it. They sit in a module of their own, importing
nothing of the project, so that both tokenizer.py and tool_format.py can read them.
"""

from __future__ import annotations

# The number of ranks in Meta's Llama 4 tokenizer.model (Llama 3's has 128,000): with no params.json
# beside the file, this is what tells the two families apart.
LLAMA4_NUM_RANKS = 200_000
LLAMA4_NUM_SPECIAL = 2048

# o200k's pre-tokenizer: unlike Llama 3's, a word splits where lower case turns to upper ("camelCase"
# is two pieces), a contraction stays with its word, and a punctuation run keeps a "/" after it.
_LEAD = r"[^\r\n\p{L}\p{N}]?"  # at most one leading non-letter, non-digit (a space, a quote)
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"  # letters that may open a word: capitals, caseless, marks
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"  # letters that may close one: lower case, caseless, marks
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
LLAMA4_SPLIT_PATTERN = "|".join(
    [
        f"{_LEAD}{_UPPER}*{_LOWER}+{_CONTRACTION}",  # a word ending in lower case ("Paris", "the")
        f"{_LEAD}{_UPPER}+{_LOWER}*{_CONTRACTION}",  # a capitals run, with any lower case after ("NASA")
        r"\p{N}{1,3}",  # digits, in groups of up to three
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",  # punctuation run, keeping the line breaks and slashes after it
        r"\s*[\r\n]+",  # whitespace ending in line breaks
        r"\s+(?!\S)",  # whitespace, leaving the last space for the next word
        r"\s+",  # any remaining whitespace
    ]
)


def _reserved(group: str, first: int, count: int) -> list[str]:
    return [f"<|{group}_reserved_special_token_{i}|>" for i in range(first, first + count)]


# Meta's order, which fixes every id (the first is number LLAMA4_NUM_RANKS): the text tokens, the post-training
# chat tokens, the vision tokens, the reasoning tokens, then plain reserved ones up to 2,048.
_NAMED = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "<|header_start|>", "<|header_end|>", "<|eom|>", "<|eot|>", "<|step|>",
    *_reserved("text_post_train", 0, 6),
    "<|python_start|>", "<|python_end|>", "<|finetune_right_pad|>",  # in place of reserved 6 and 7
    *_reserved("text_post_train", 8, 61),
    "<|image_start|>", "<|image_end|>", *_reserved("vision", 0, 2),
    "<|tile_x_separator|>", "<|tile_y_separator|>", *_reserved("vision", 2, 4),
    "<|image|>", *_reserved("vision", 6, 1), "<|patch|>", *_reserved("vision", 7, 1041),
    *_reserved("reasoning", 0, 8), "<|reasoning_thinking_start|>", "<|reasoning_thinking_end|>",
]
LLAMA4_SPECIAL_TOKENS = _NAMED + [f"<|reserved_special_token_{i}|>" for i in range(LLAMA4_NUM_SPECIAL - len(_NAMED))]

# The system prompt that lists the tools, from Meta's Llama 4 prompt format ("Zero shot function calling -
# system message" in llama-models' models/llama4/prompt_format.md, the text of
# https://www.llama.com/docs/model-cards-and-prompt-formats/llama4/); the tools follow it as a JSON list
# laid out as Llama 3.2's (tool_format.py writes both).
LLAMA4_TOOLS_HEAD = """\
You are a helpful assistant and an expert in function composition. You can answer general questions \
using your internal knowledge OR invoke functions when necessary. Follow these strict guidelines:

1. FUNCTION CALLS:
- ONLY use functions that are EXPLICITLY listed in the function list below
- If NO functions are listed (empty function list []), respond ONLY with internal knowledge or \
"I don't have access to [Unavailable service] information"
- If a function is not in the list, respond ONLY with internal knowledge or \
"I don't have access to [Unavailable service] information"
- If ALL required parameters are present AND the query EXACTLY matches a listed function's purpose: \
output ONLY the function call(s)
- Use exact format: [func_name1(param1=value1, param2=value2), func_name2(...)]
Examples:
CORRECT: [get_weather(location="Vancouver"), calculate_route(start="Boston", end="New York")] \
<- Only if get_weather and calculate_route are in function list
INCORRECT: get_weather(location="New York")
INCORRECT: Let me check the weather: [get_weather(location="New York")]
INCORRECT: [get_events(location="Singapore")] <- If function not in list

2. RESPONSE RULES:
- For pure function requests matching a listed function: ONLY output the function call(s)
- For knowledge questions: ONLY output text
- For missing parameters: ONLY request the specific missing parameters
- For unavailable services (not in function list): output ONLY with internal knowledge or \
"I don't have access to [Unavailable service] information". Do NOT execute a function call.
- If the query asks for information beyond what a listed function provides: output ONLY with internal \
knowledge about your limitations
- NEVER combine text and function calls in the same response
- NEVER suggest alternative functions when the requested service is unavailable
- NEVER create or invent new functions not listed below

3. STRICT BOUNDARIES:
- ONLY use functions from the list below - no exceptions
- NEVER use a function as an alternative to unavailable information
- NEVER call functions not present in the function list
- NEVER add explanatory text to function calls
- NEVER respond with empty brackets
- Use proper Python/JSON syntax for function calls
- Check the function list carefully before responding

4. TOOL RESPONSE HANDLING:
- When receiving tool responses: provide concise, natural language responses
- Don't repeat tool response verbatim
- Don't add supplementary information

Here is a list of functions in JSON format that you can invoke:
"""


def is_llama4_params(raw: object) -> bool:
    """Whether a parsed params.json is a Llama 4 checkpoint's: only Llama 4's mixture of experts has
    ``moe_args``, at the top level or under a ``"model"`` key."""
    if not isinstance(raw, dict):
        return False
    model = raw.get("model")
    return "moe_args" in raw or (isinstance(model, dict) and "moe_args" in model)
