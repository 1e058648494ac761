"""The plug-in rule (README, "Plugging in the learner's code: one way"), read off every signature in course_lib.

A course function that runs another one it lets the caller replace takes it as a keyword argument named after
the function it replaces, whose default is the course's own: ``generate(..., top_k_filter=top_k_filter)``. Two
forms break it, and ``plug_in_violations`` finds both in any module:

* a course function (or class) as the default of a keyword named otherwise (``choose=greedy_choice``): the caller
  cannot tell from the keyword which course function it replaces (a class may be named in snake case:
  ``encoder_layer=EncoderLayer``);
* a ``None`` default that the body replaces with a course function (``decode = decode or greedy_decode``,
  ``model_class or MODEL_CLASSES[model]``): the function the keyword stands for hides in the body;
* a module-level table keyed by such a keyword (``SAMPLING = {"top_k_filter": ...}``): the same function passed a
  second way, by its name (a name-to-function mapping).
"""
from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
import sys
import textwrap
import types

import pytest

import course_lib

def _functions(module: types.ModuleType):
    """The functions and methods a module defines (not those it imports or aliases): (qualified name, function)."""
    def walk(owner, qualified: str):
        for name, value in vars(owner).items():
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if getattr(value, "__module__", None) != module.__name__ or getattr(value, "__qualname__", None) != qualified + name:
                continue
            if inspect.isfunction(value):
                yield f"{module.__name__}.{qualified}{name}", value
            elif inspect.isclass(value):
                yield from walk(value, f"{qualified}{name}.")
    yield from walk(module, "")


def _fallbacks(function) -> dict[str, str]:
    """The parameters with a None default that the body replaces with a callable: {parameter: the fallback's text}.

    The forms: ``p or X``, ``X if p is None else p`` (or ``p if p is not None else X``) and ``if p is None: p = X``,
    X a name that is callable where the function lives, an attribute whose last name is a function or class
    defined in the function's package, or an entry of a module's table of functions (``TABLE[key]``)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return {}
    parameters = {name for name, p in inspect.signature(function).parameters.items() if p.default is None}
    package = function.__module__.split(".")[0]

    def callable_fallback(node) -> bool:
        if isinstance(node, ast.Name):
            value = function.__globals__.get(node.id, getattr(__import__("builtins"), node.id, None))
            return callable(value)
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):  # a {name: function} table
            table = function.__globals__.get(node.value.id)
            return isinstance(table, dict) and bool(table) and all(callable(v) for v in table.values())
        if isinstance(node, ast.Attribute):
            defined = {name for m in list(sys.modules.values()) if (getattr(m, "__name__", "") or "").startswith(package)
                       for name, v in vars(m).items() if callable(v) and getattr(v, "__module__", "").startswith(package)}
            defined |= {attr for m in list(sys.modules.values()) if (getattr(m, "__name__", "") or "").startswith(package)
                        for v in vars(m).values() if inspect.isclass(v) for attr in vars(v) if callable(getattr(v, attr, None))}
            return node.attr in defined
        return False

    def is_none_test(node, name, op) -> bool:
        return (isinstance(node, ast.Compare) and isinstance(node.left, ast.Name) and node.left.id == name
                and len(node.ops) == 1 and isinstance(node.ops[0], op)
                and isinstance(node.comparators[0], ast.Constant) and node.comparators[0].value is None)

    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or) and isinstance(node.values[0], ast.Name):
            name = node.values[0].id
            if name in parameters and any(callable_fallback(v) for v in node.values[1:]):
                found[name] = ast.unparse(node)
        elif isinstance(node, ast.IfExp):
            for name in parameters:
                if is_none_test(node.test, name, ast.Is) and callable_fallback(node.body) \
                        or is_none_test(node.test, name, ast.IsNot) and callable_fallback(node.orelse):
                    found[name] = ast.unparse(node)
        elif isinstance(node, ast.If):
            for name in parameters:
                if is_none_test(node.test, name, ast.Is) and any(
                        isinstance(s, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in s.targets)
                        and callable_fallback(s.value) for s in node.body):
                    found[name] = ast.unparse(node).splitlines()[0] + " ..."
    return found


def _names_of(default) -> set[str]:
    """The names a keyword may take for this default: its own, and for a class also in snake case (EncoderLayer:
    encoder_layer, GPT: gpt), as Python spells a parameter."""
    name = default.__name__
    return {name, re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()} if inspect.isclass(default) else {name}


def plug_in_violations(module: types.ModuleType) -> dict[str, str]:
    """Every break of the plug-in rule in the functions and methods `module` defines: {qualified name: why}."""
    found = {}
    package = module.__name__.split(".")[0]
    for qualname, function in _functions(module):
        try:
            parameters = inspect.signature(function).parameters
        except (TypeError, ValueError):
            continue
        for name, p in parameters.items():
            default = p.default
            if p.default is inspect.Parameter.empty or not callable(default) \
                    or not getattr(default, "__module__", "").startswith(package):  # print, say, replaces nothing
                continue
            if name not in _names_of(default):
                found[f"{qualname}({name})"] = (f"the callable default {getattr(default, '__qualname__', default)!r} "
                                                f"of {name!r}: name the keyword after the function it replaces")
        for name, text in _fallbacks(function).items():
            found[f"{qualname}({name})"] = (f"{name}=None falls back to a course function ({text}): default {name!r} "
                                            "to it under its own name")
    found.update(_tables_by_name(module))
    return found


def _plug_in_keywords(package: str) -> set[str]:
    """The keywords of the package's functions that take a course function under its own name (``top_k_filter``)."""
    keywords = set()
    for module in [m for m in list(sys.modules.values()) if (getattr(m, "__name__", "") or "").split(".")[0] == package]:
        for _, function in _functions(module):
            try:
                parameters = inspect.signature(function).parameters
            except (TypeError, ValueError):
                continue
            keywords |= {name for name, p in parameters.items() if callable(p.default)
                         and getattr(p.default, "__module__", "").startswith(package) and name in _names_of(p.default)}
    return keywords


def _tables_by_name(module: types.ModuleType) -> dict[str, str]:
    """The module-level tables (dicts) `module` defines with a key that is a plug-in keyword: a second way to pass that
    function, by its name inside a table (the old ``serving.SAMPLING``, whose requests carried ``top_k_filter``)."""
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError, SyntaxError):
        return {}
    defined = {target.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
               for target in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(target, ast.Name)}
    keywords = _plug_in_keywords(module.__name__.split(".")[0])
    found = {}
    for name in sorted(defined):
        table = vars(module).get(name)
        if isinstance(table, dict):
            for key in sorted(k for k in table if isinstance(k, str) and k in keywords):
                found[f"{module.__name__}.{name}[{key!r}]"] = (f"the table {name} is keyed by the plug-in keyword {key!r}: a "
                                                               "name-to-function mapping; pass the function by keyword")
    return found


def course_modules() -> list[types.ModuleType]:
    return [importlib.import_module(info.name)
            for info in pkgutil.walk_packages(course_lib.__path__, "course_lib.")]


def test_every_course_lib_signature_keeps_the_plug_in_rule():
    found = {}
    for module in course_modules():
        found.update(plug_in_violations(module))
    assert not found, "\n".join(f"{k}: {v}" for k, v in sorted(found.items()))


#: each exception's old form, as course_lib had it, in a scratch module, with the violation the checker must name
OLD_FORMS = '''
from course_lib.gpt import GPT


def bpe_encode(text, merges):
    return []


def bpe_decode(ids, vocab):
    return ""


class BPETokenizer:  # course_lib.bpe
    def __init__(self, merges, encode=None, decode=None):
        self._encode = encode or bpe_encode
        self._decode = decode or bpe_decode


class GRUSeq2Seq:
    def greedy_decode(self, src, src_lengths, max_len):
        return src


def evaluate_reversal(model, batches, max_len, decode=None):  # course_lib.seq2seq
    decode = decode or type(model).greedy_decode
    return decode(model, batches, None, max_len)


MODEL_CLASSES = {"GPT": GPT}


def build(model, config, model_class=None):  # course_lib.assets
    cls = model_class or MODEL_CLASSES[model]
    return cls(config)


def sample(logits, sampler=None):  # the same fallback written as a conditional
    return (bpe_encode if sampler is None else sampler)(logits, None)


def decode(logits, tokenizer=None):  # and as a statement
    if tokenizer is None:
        tokenizer = BPETokenizer
    return tokenizer(logits)


def greedy_choice(logits):
    return logits


def extend(idx, n, next_logits, choose=greedy_choice):  # course_lib.gpt: a course function under another name
    return choose(next_logits(idx))


def top_k_filter(logits, k):
    return logits


def process_logits(logits, top_k=None, top_k_filter=top_k_filter):  # the rule's own form
    return top_k_filter(logits, top_k)


#: course_lib.serving.SAMPLING: a request carried its processor functions by name, beside its settings
SAMPLING = {"top_k": (lambda v: v is None or v >= 0, "None or an integer >= 0"),
            "top_k_filter": (callable, "a function (the course's top_k_filter by default)")}
'''

FIXED_FORMS = '''
from course_lib.gpt import GPT


def bpe_encode(text, merges):
    return []


class BPETokenizer:
    def __init__(self, merges, bpe_encode=bpe_encode, log=print, cache=None):
        self.bpe_encode, self.cache = bpe_encode, cache or {}


def build(model, config, gpt=GPT, GPT=GPT):
    return gpt(config)
'''


def scratch_module(tmp_path, source, name):
    import importlib.util

    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (inspect.getsource finds the file through it)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def test_the_checker_names_each_old_form_of_the_exceptions(tmp_path):
    module = scratch_module(tmp_path, OLD_FORMS, "plug_in_old_forms")
    try:
        found = plug_in_violations(module)
    finally:
        del sys.modules["plug_in_old_forms"]
    assert set(found) == {f"plug_in_old_forms.{k}" for k in (
        "BPETokenizer.__init__(encode)", "BPETokenizer.__init__(decode)", "evaluate_reversal(decode)",
        "build(model_class)", "sample(sampler)", "decode(tokenizer)", "extend(choose)", "SAMPLING['top_k_filter']")}, found
    assert "keyed by the plug-in keyword 'top_k_filter'" in found["plug_in_old_forms.SAMPLING['top_k_filter']"]
    assert "falls back to a course function (model_class or MODEL_CLASSES[model])" in found["plug_in_old_forms.build(model_class)"]
    assert "the callable default 'greedy_choice' of 'choose'" in found["plug_in_old_forms.extend(choose)"]


def test_the_checker_passes_the_rule_and_what_replaces_nothing(tmp_path):
    """Keywords named after the course function (or class, in either spelling), a non-course callable (print), and
    a None default that falls back to a value, not a function."""
    module = scratch_module(tmp_path, FIXED_FORMS, "plug_in_fixed_forms")
    try:
        assert plug_in_violations(module) == {}
    finally:
        del sys.modules["plug_in_fixed_forms"]
