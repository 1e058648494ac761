"""Chapter 15: a JSON schema -> a regex, as Outlines does (whitespace-free JSON)."""
from __future__ import annotations

import json
import re

JSON_STRING_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u(?:[0-9a-cA-Ce-fE-F][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2}))'
# one character of a JSON string: a character JSON need not escape, or an escape; \u escapes of surrogates (a pair
# decodes to one character) are left out so that a length bound counts exactly the characters the validator counts'
JSON_INTEGER = r"-?(?:0|[1-9][0-9]*)"


def schema_regex(schema: dict) -> str:
    """A regex whose language is the compact JSON (no whitespace, properties in schema order) of the instances of
    `schema`: objects whose properties are all required, integers, strings (minLength / maxLength), enums of
    strings or integers, arrays (items, minItems / maxItems), booleans and null. A recursive schema ($ref) has no
    regular language: ValueError, as for any other keyword outside this subset."""
    if not isinstance(schema, dict):
        raise ValueError(f"schema must be a dict, got {type(schema).__name__}")
    if "$ref" in schema:
        raise ValueError("schema: $ref (recursion) has no regular language; use a grammar (xgrammar) for it")
    if "enum" in schema:
        return "(?:" + "|".join(re.escape(json.dumps(v, ensure_ascii=False)) for v in schema["enum"]) + ")"
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        required = schema.get("required", list(props))
        if set(required) != set(props):
            raise ValueError("schema: every property must be required (optional properties are not in this subset)")
        parts = [re.escape(json.dumps(name, ensure_ascii=False)) + ":" + schema_regex(sub) for name, sub in props.items()]
        return r"\{" + ",".join(parts) + r"\}"
    if kind == "integer":
        return JSON_INTEGER
    if kind == "string":
        lo, hi = schema.get("minLength", 0), schema.get("maxLength")
        return '"' + JSON_STRING_CHAR + "{%d,%s}" % (lo, "" if hi is None else hi) + '"'
    if kind == "boolean":
        return "(?:true|false)"
    if kind == "null":
        return "null"
    if kind == "array":
        item = schema_regex(schema.get("items", {}))
        lo, hi = schema.get("minItems", 0), schema.get("maxItems")
        if hi == 0:
            return r"\[\]"
        rest = "(?:," + item + "){%d,%s}" % (max(lo - 1, 0), "" if hi is None else hi - 1)
        body = item + rest
        return r"\[" + (body if lo > 0 else "(?:" + body + ")?") + r"\]"
    raise ValueError(f"schema: type {kind!r} is not in this subset (object, integer, string, boolean, null, array, enum)")
