"""Chapter 15: a JSON schema -> a regex, as Outlines does (whitespace-free JSON)."""
from __future__ import annotations

import json
import re

JSON_STRING_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u(?:[0-9a-cA-Ce-fE-F][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2}))'
# one character of a JSON string: a character JSON need not escape, or an escape; \u escapes of surrogates (a pair
# decodes to one character) are left out so that a length bound counts exactly the characters the validator counts
JSON_INTEGER = r"-?(?:0|[1-9][0-9]*)"
MAX_REGEX_CHARS = 1_000_000  # a longer regex is refused: an array writes its item's regex twice, so nesting doubles it


#: The keywords each type may carry (besides ANNOTATIONS); any other keyword is a ValueError: a constraint the regex
#: would not enforce would let an invalid instance through
KEYWORDS = {"object": {"properties", "required", "additionalProperties"}, "integer": set(), "boolean": set(),
            "null": set(), "string": {"minLength", "maxLength"}, "array": {"items", "minItems", "maxItems"}}
ANNOTATIONS = {"type", "title", "description", "$schema"}


def _bounds(schema: dict, low: str, high: str) -> tuple:
    lo, hi = schema.get(low, 0), schema.get(high)
    def whole(v):
        return isinstance(v, int) and not isinstance(v, bool)

    if not (whole(lo) and lo >= 0 and (hi is None or whole(hi) and hi >= lo)):
        raise ValueError(f"schema: {low} and {high} must be integers with 0 <= {low} <= {high}, got {lo!r} and {hi!r}")
    return lo, hi


def schema_regex(schema: dict) -> str:
    """A regex whose language is compact JSON (no whitespace, properties in the schema's order) of instances of
    `schema`: objects (every property written, required or not: a valid instance that leaves out an optional one is
    not generated), integers, strings (minLength / maxLength, counted in characters as the validator counts them),
    enums, arrays (items, minItems / maxItems), booleans and null. Every string of the language is valid JSON and
    valid for the schema. A recursive schema ($ref) has no regular language: ValueError, as for any keyword outside
    this subset (minimum, pattern, format, ...), naming it, and for a regex over MAX_REGEX_CHARS characters (arrays
    nested 40 deep would write one of 2**40)."""
    return _checked(_regex(schema))


def _checked(regex: str) -> str:
    _bound(len(regex))
    return regex


def _bound(length: int) -> None:
    if length > MAX_REGEX_CHARS:
        raise ValueError(f"schema: its regex is over {MAX_REGEX_CHARS} characters (an array writes its item's regex "
                         f"twice: nested arrays double it)")


def _regex(schema: dict) -> str:
    if not isinstance(schema, dict):
        raise ValueError(f"schema must be a dict, got {type(schema).__name__}")
    if "$ref" in schema:
        raise ValueError("schema: $ref (recursion) has no regular language; use a grammar (xgrammar) for it")
    if "enum" in schema:
        extra = set(schema) - ANNOTATIONS - {"enum"}
        if extra or "type" in schema:
            raise ValueError(f"schema: an enum takes no other keyword here, got {sorted(extra | ({'type'} & set(schema)))}")
        if not isinstance(schema["enum"], list) or not schema["enum"]:
            raise ValueError(f"schema: enum must be a non-empty list, got {schema['enum']!r}")
        return "(?:" + "|".join(re.escape(json.dumps(v, ensure_ascii=False, separators=(",", ":")))
                                for v in schema["enum"]) + ")"
    kind = schema.get("type")
    if not isinstance(kind, str) or kind not in KEYWORDS:
        raise ValueError(f"schema: type {kind!r} is not in this subset (object, integer, string, boolean, null, array, enum)")
    extra = set(schema) - ANNOTATIONS - KEYWORDS[kind]
    if extra:
        raise ValueError(f"schema: keyword {sorted(extra)[0]!r} of a {kind} is not in this subset (the regex would not "
                         f"enforce it)")
    if kind == "object":
        props, required = schema.get("properties", {}), schema.get("required", [])
        if not isinstance(props, dict) or not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ValueError(f"schema: properties must be a dict and required a list of names, got {props!r} and "
                             f"{required!r}")
        missing = set(required) - set(props)
        if missing:
            raise ValueError(f"schema: required property {sorted(missing)[0]!r} is not in properties")
        parts, total = [], 0
        for name, sub in props.items():
            parts.append(re.escape(json.dumps(name, ensure_ascii=False)) + ":" + _regex(sub))
            total += len(parts[-1]) + 1
            _bound(total)
        return r"\{" + ",".join(parts) + r"\}"
    if kind == "integer":
        return JSON_INTEGER
    if kind == "string":
        lo, hi = _bounds(schema, "minLength", "maxLength")
        return '"' + JSON_STRING_CHAR + "{%d,%s}" % (lo, "" if hi is None else hi) + '"'
    if kind == "boolean":
        return "(?:true|false)"
    if kind == "null":
        return "null"
    item = _regex(schema.get("items", {}))
    lo, hi = _bounds(schema, "minItems", "maxItems")
    if hi == 0:
        return r"\[\]"
    body = item + "(?:," + item + "){%d,%s}" % (max(lo - 1, 0), "" if hi is None else hi - 1)
    return _checked(r"\[" + (body if lo > 0 else "(?:" + body + ")?") + r"\]")
