"""Whether a JSON schema admits any value at all, before a grammar is built from it.

A `$ref` cycle with no way out (`{"$defs": {"n": {"$ref": "#/$defs/n"}}}`, or an object that requires
itself) compiles into a grammar whose matcher dead-ends at that point of the reply: the reply would stop
there, cut mid-value, under a 200. Such a schema is refused with the request instead.

The check follows the parts of JSON Schema that force content (`$ref`, `anyOf` / `oneOf` / `allOf`,
required properties, `minItems`, `prefixItems`); every other keyword is taken as satisfiable, since the
grammar compilers refuse what they cannot enforce on their own.
"""

from __future__ import annotations

from typing import Any


def check_has_instance(schema: Any, where: str) -> None:
    """Raise ValueError naming `where` when no value meets `schema`."""
    try:
        met = has_instance(schema)
    except RecursionError:
        raise ValueError(f"{where}: nested too deeply") from None
    if not met:
        raise ValueError(f"{where}: no value meets this schema (a $ref cycle, or required properties, "
                         "with no way out)")


def has_instance(schema: Any) -> bool:
    """Whether some value meets `schema`: a fixpoint over its local `$ref`s, each taken as empty until one
    of its alternatives is shown to end."""
    known: dict[str, bool] = {}
    while True:
        before = dict(known)
        result = _meets(schema, schema, known, set())
        if known == before:
            return result


def _meets(node: Any, root: Any, known: dict[str, bool], seen: set[str]) -> bool:
    if isinstance(node, bool):
        return node
    if not isinstance(node, dict):
        return True
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        if ref in seen:
            return known.get(ref, False)
        seen.add(ref)
        target = _resolve(root, ref)
        known[ref] = target is None or _meets(target, root, known, seen)  # a dangling $ref is refused elsewhere
        if not known[ref]:
            return False
    for key, needs in (("anyOf", any), ("oneOf", any), ("allOf", all)):
        parts = node.get(key)
        if isinstance(parts, list) and parts and not needs(_meets(p, root, known, seen) for p in parts):
            return False
    kinds = node.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds if isinstance(kinds, list) else []
    if kinds and all(kind in ("object", "array") for kind in kinds):
        return any(_container_meets(node, kind, root, known, seen) for kind in kinds)
    if not kinds and "properties" in node:
        return _container_meets(node, "object", root, known, seen)
    return True


def _container_meets(node: dict, kind: str, root: Any, known: dict[str, bool], seen: set[str]) -> bool:
    """An object meets its schema where each required property can; an array where its first
    `minItems` items (and its `prefixItems`) can."""
    if kind == "object":
        properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        required = node.get("required") if isinstance(node.get("required"), list) else []
        return all(_meets(properties.get(name, True), root, known, seen) for name in required if isinstance(name, str))
    prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
    low = node.get("minItems", 0)
    needs_items = isinstance(low, int) and low > len(prefix)
    return (all(_meets(p, root, known, seen) for p in prefix)
            and (not needs_items or _meets(node.get("items", True), root, known, seen)))


def _resolve(root: Any, ref: str) -> Any:
    """The node a local JSON pointer names, None where it names nothing."""
    node = root
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
