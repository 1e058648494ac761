"""The clean room: a learner's answers tested in a fresh process, one exercise at a time.

This program runs inside the grading sandbox (``sandbox.py``), never in the grader. It reads a
job (JSON, on stdin) with, for each chapter, the course's set-up cell, every solution cell's
reference code and the learner's answer, and the chapter's test cells; it writes one line
per test on stdout: ``<nonce> {"chapter", "grade_id", "passed", "message", "error"}``.

For each chapter the set-up cell (trusted, the course's own) runs once. Then each exercise
runs in a forked child of its own, in a namespace where

* the *other* exercises are the reference solutions, so one mistake costs one exercise;
* this exercise is only the *definitions* of the learner's answer (imports, functions,
  classes and ``NAME = constant`` lines): no other top-level statement runs;
* the identity of every attribute of the modules the tests use and of torch.Tensor's classes
  is recorded, and checked after each call into the learner's code and after each test, so
  monkeypatching is caught before an assertion can use it; so is a new subclass of
  torch.Tensor that changes what a tensor does (its own ``__torch_function__``,
  ``__torch_dispatch__`` or methods), a change to the test's names or to the names the
  course's functions use, a trace or profile function, and, in what a call returns (or an
  ``__init__`` made), a tensor with attributes of its own that hide torch.Tensor's
  (``t.double = ...``), and, in what a call returns to a test or to the course's code, an
  object whose class of the answer's own decides how it compares, computes or converts
  (``class Six(int)`` with an ``__eq__`` that says yes: ``lies``);
* the tests see the learner's definitions of what the exercise asks for only: a name of
  the learner's own that is also a set-up name, a builtin or an import of the reference
  (``checks``, ``abs``, ``torch``) is, for the tests, what the set-up, Python or the reference
  bound; and they run with subclasses' ``__torch_function__`` off.

The parent watches each child: a test that runs past the time limit is stopped, a child that
dies (``os._exit``, a crash) is reported, and the child's own output goes nowhere, so a loop
that prints forever is just a loop. Memory and process caps are set on the sandbox by the
grader (``limits.py``); hitting them is reported in plain words. The learner's code shares a
process with the tests: this defeats monkeypatching, it is not a defence against code written
to attack this module itself (the sandbox bounds what such code can reach to its own score).
"""
from __future__ import annotations

import ast
import builtins
import collections
import functools
import gc
import importlib
import inspect
import json
import math
import os
import select
import signal
import sys
import time
import types
import weakref
from typing import NamedTuple

from ..answers import defined_names, import_statements, student_definitions

FORBIDDEN_NAMES = {"course_lib", "importlib", "__import__"}


def forbidden_use(source: str) -> str:
    """The first line of a cell that reaches for the course's reference code, or ''."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ""
    lines = source.splitlines()
    for node in ast.walk(tree):
        hit = (isinstance(node, ast.Import) and any(a.name.split(".")[0] in FORBIDDEN_NAMES for a in node.names)
               or isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FORBIDDEN_NAMES
               or isinstance(node, ast.Name) and node.id in FORBIDDEN_NAMES
               or isinstance(node, ast.Constant) and isinstance(node.value, str) and "course_lib" in node.value)
        if hit:
            return lines[node.lineno - 1].strip()
    return ""


#: imported by torch on first use (an optimizer step, importing transformers' models) and then re-binding
#: ``torch.manual_seed``, the one watched attribute it re-binds (``TorchRewrap``); importing it takes 0.9 s
LAZY_IMPORT = "torch._dynamo"
#: what a learner's course imports in several exercises' processes, each time afresh (they end with their exercise):
#: LAZY_IMPORT, and Hugging Face's models (1 s), which the tests of 4 chapters build through ``course_lib.hf`` (the
#: sandbox's environment keeps them off the hub, as ``course_lib.hf`` does); imported once, before the exercises fork
SHARED_IMPORTS = (LAZY_IMPORT, "transformers.modeling_utils")


class TorchRewrap:
    """Recognises torch's own re-binding of ``torch.manual_seed`` when it imports ``LAZY_IMPORT``: a function running
    the code of torch's ``_disable_dynamo`` wrapper, in its module, around the original. What that code and module
    are is read when this is made, before any learner code runs (learner code could replace ``_disable_dynamo``)."""

    def __init__(self):
        from torch import _compile

        self._code = _compile._disable_dynamo(TorchRewrap).__code__  # the wrapper's code, whatever it wraps
        self._globals = vars(_compile)

    def __call__(self, namespace, key: str, old, new) -> bool:
        """Whether ``namespace.key``'s change from ``old`` to ``new`` is torch's own re-binding."""
        import torch

        if namespace is not torch or key != "manual_seed" or getattr(new, "__code__", None) is not self._code:
            return False
        cells = dict(zip(self._code.co_freevars, new.__closure__ or ()))
        return new.__globals__ is self._globals and "fn" in cells and cells["fn"].cell_contents is old


def tensor_subclasses() -> set[type]:
    """Every subclass of torch.Tensor that exists now, however made (a class statement, ``type(...)``)."""
    import torch

    found, todo = set(), [torch.Tensor]
    while todo:
        for sub in type.__subclasses__(todo.pop()):  # type's own: a metaclass cannot hide a class from it
            if sub not in found:
                found.add(sub)
                todo.append(sub)
    return found


#: what a class may define without changing what a tensor does
HARMLESS = {"__module__", "__qualname__", "__doc__", "__init__", "__new__", "__init_subclass__", "__slots__",
            "__annotations__", "__repr__", "__str__"}


@functools.cache
def tensor_attributes() -> frozenset[str]:
    """The names of torch.Tensor's attributes, its own and inherited (read before learner code runs: ``Integrity``)."""
    import torch

    return frozenset(dir(torch.Tensor))


@functools.cache
def hideable_attributes() -> frozenset[str]:
    """Those an object's own attribute hides (not data descriptors): after ``t.double = f``, ``t.double()`` is f's."""
    import torch

    return frozenset(name for name in tensor_attributes()
                     if not hasattr(type(inspect.getattr_static(torch.Tensor, name)), "__set__"))


def overriding_tensor(cls: type, known: set[type], modules: set[str]) -> bool:
    """Whether a subclass of torch.Tensor changes what a tensor does: torch's operations on it (its own
    ``__torch_function__`` or ``__torch_dispatch__``) or any other of torch.Tensor's attributes (its own ``double``,
    ``__sub__``, ``__float__``), in a class of its MRO not in ``known`` (the subclasses that existed before); and is
    not torch's: torch defines such classes when it imports its own modules (fake tensors, say), each reachable as
    ``module.QualifiedName`` of a module of torch's files imported since ``modules`` (the modules imported before).
    A learner's is defined in a cell; naming an older module (``functools``) or a module of its own does not pass."""
    import torch

    plain = known | {torch.Tensor, torch._C.TensorBase, object}
    overrides = any(name in tensor_attributes() and name not in HARMLESS and
                    value is not torch._C._disabled_torch_function_impl
                    for k in cls.__mro__ if k not in plain for name, value in vars(k).items())
    module = sys.modules.get(cls.__module__) if cls.__module__ not in modules else None
    in_torch = os.path.realpath(getattr(module, "__file__", None) or "/").startswith(torch_folder())
    return overrides and not (in_torch and _named(module, cls.__qualname__) is cls)


def _named(start, qualname: str):
    """What ``start`` (a module, or a module's globals) holds under the dotted ``qualname``; None where nothing does."""
    first, *rest = qualname.split(".")
    found = start.get(first) if isinstance(start, dict) else getattr(start, first, None)
    for part in rest:
        found = getattr(found, part, None)
    return found


@functools.cache
def torch_folder() -> str:
    """The folder of torch's own modules, with a trailing separator."""
    import torch

    return os.path.join(os.path.dirname(os.path.realpath(torch.__file__)), "")


#: what ``lies`` does not look into
SKIPPED = (str, bytes, int, float, complex, type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
           types.MethodType)


#: what an object's class decides when a test compares it, computes with it, converts it, asks its truth, looks into it
#: or up its attributes (``==``, ``<``, ``-``, ``abs``, ``float``, ``len``, ``in``, ``for``, ``x.tolist``, ``isinstance``
#: through ``__class__``), or hands it to numpy or torch
VALUE_PROTOCOL = frozenset(
    {f"__{name}__" for name in ("eq ne lt le gt ge bool len iter next reversed getitem contains getattr getattribute "
                                "class float int index complex round trunc floor ceil abs neg pos invert array "
                                "array_ufunc array_function torch_function torch_dispatch").split()}
    | {f"__{prefix}{op}__" for op in "add sub mul matmul truediv floordiv mod divmod pow lshift rshift and or xor".split()
       for prefix in ("", "r", "i")})
#: the builtin types whose subclasses ``lies`` looks for in objects' attributes too (and torch.Tensor's)
BUILTIN_VALUES = (int, float, complex, str, bytes, list, tuple, dict, set, frozenset)
#: a class's flag (``__flags__``) that its attributes cannot be set: Python's and C extensions' own types
IMMUTABLE_TYPE = 1 << 8
#: a class's flag that it was made by a class statement or ``type()`` (its objects may keep attributes in __slots__)
HEAP_TYPE = 1 << 9


#: the modules of libraries whose objects stand in for others (``unittest.mock.ANY`` equals anything, so may a
#: ``pytest.approx``): their classes are not a library's say on how a test's value compares
STAND_INS = ("unittest.mock", "_pytest.")


@functools.cache
def _total_ordering() -> frozenset:
    """The code of the comparisons ``functools.total_ordering`` writes into a class."""
    return frozenset(function.__code__ for pairs in functools._convert.values() for _, function in pairs)


def _function_of(value):
    """The Python function behind a class attribute: itself (the learner's own where ``_guard`` wrapped it), or the
    function a staticmethod, classmethod, property, bound method or functools.partial holds; None where there is no
    Python code (a builtin's method)."""
    for _ in range(10):
        if isinstance(value, types.FunctionType) and value in _GUARDED:
            value = _GUARDED[value]
        elif isinstance(value, (staticmethod, classmethod, types.MethodType)):
            value = value.__func__
        elif isinstance(value, property):
            value = value.fget
        elif isinstance(value, functools.partial):
            value = value.func
        else:
            break
    return value if isinstance(value, types.FunctionType) else None


def _defined_by(function: types.FunctionType, cls: type) -> bool:
    """Whether ``cls`` is the class that ``function``'s module (a library's) holds under ``cls``'s name, or, made in one
    of its functions, the class ``function`` was written in, and the library's objects do not stand in for others
    (``STAND_INS``): a library's own class, whatever module name it gives (``collections.abc.Sequence`` is
    ``_collections_abc``'s), and not an answer's class that borrows a library's function."""
    module = function.__globals__.get("__name__")
    if not isinstance(module, str) or module.startswith(STAND_INS):
        return False
    if "<locals>" in cls.__qualname__:
        return function.__code__.co_qualname.startswith(cls.__qualname__ + ".")
    return _named(function.__globals__, cls.__qualname__) is cls


def _library_class(cls: type) -> bool:
    """Whether ``cls`` is a library's: reachable as ``module.QualifiedName`` (or made in a function) of an imported
    module that is Python's builtins or has a file (an answer's class says ``__main__``, or names a module that does
    not hold it), other than the libraries of stand-ins (``STAND_INS``)."""
    module = sys.modules.get(cls.__module__)
    if (module is None or not (module is builtins or os.path.isabs(getattr(module, "__file__", None) or ""))
            or cls.__module__.startswith(STAND_INS)):
        return False
    return _named(module, cls.__qualname__) is cls or "<locals>" in cls.__qualname__


def _answer_decides(value, name: str, cls: type) -> bool:
    """Whether ``value``, the attribute ``name`` of class ``cls``, is the answer's own say on what ``name`` does: Python
    code that is not the course's (its set-up and reference cells), one dataclasses generated, or a library's (a file,
    or frozen into Python) other than that of the library's own class (``_defined_by``), of a class ``cls`` inherits
    from anyway and the comparisons functools.total_ordering writes (``__eq__ = typing.cast`` is the answer's say); or
    an object without code, in a class not a library's, other than a slot of a class ``cls`` inherits from under its
    own name (``__eq__ = int.__le__``, ``(6).__eq__``, a callable or functools.partial named ``__eq__``; torch.Tensor's
    ``__abs__ = TensorBase.abs`` is torch's)."""
    if value is None:
        return False
    function = _function_of(value)
    if function is None:  # a builtin's method: a slot of a class it inherits from, under its own name, or a library's
        return not (type(value) in (types.WrapperDescriptorType, types.MethodDescriptorType) and value.__name__ == name
                    and value.__objclass__ in type.__dict__["__mro__"].__get__(cls) or _library_class(cls))
    code = function.__code__
    origin = code.co_filename
    if os.path.isabs(origin) or origin.startswith("<frozen "):  # a library's code (a file, or frozen into Python:
        # collections.abc's): its own class's, one a class it inherits from holds (enum's Flag copies its __or__ into an
        # IntFlag of the answer's), or what functools.total_ordering writes
        return not (_defined_by(function, cls) or code in _total_ordering()
                    or any(getattr(_function_of(type.__dict__["__dict__"].__get__(base).get(name)), "__code__", None)
                           is code for base in type.__dict__["__mro__"].__get__(cls)[1:]))
    return not (origin.startswith("<reference ") or origin == "<set-up cell>"
                or origin == "<string>" and code.co_qualname.startswith("__create_fn__."))


def lookalike(cls: type, asked: frozenset = frozenset(), watched: frozenset = frozenset()) -> list[str]:
    """The operations that the answer's own code decides for objects of ``cls`` (``VALUE_PROTOCOL``; for a tensor,
    any of torch.Tensor's attributes but ``HARMLESS``), read from the classes of its MRO up to one of ``asked`` (the
    classes the exercise asks for, which decide with what they inherit), other than ``watched`` (those ``Integrity``
    watches) and the immutable ones (int, numpy's scalars: no code can change them), as ``Class.__eq__``."""
    import torch

    names = VALUE_PROTOCOL | (tensor_attributes() - HARMLESS) if issubclass(cls, torch.Tensor) else VALUE_PROTOCOL
    found = []
    for k in type.__dict__["__mro__"].__get__(cls):  # type's own: a metaclass cannot fake either
        if k in asked:  # what the exercise asks for decides how its objects compare, with what it inherits
            break
        if k in watched or k.__flags__ & IMMUTABLE_TYPE:
            continue
        own = type.__dict__["__dict__"].__get__(k)
        found += [f"{k.__qualname__}.{name}" for name in sorted(names & own.keys()) if _answer_decides(own[name], name, k)]
    return found


def lies(returned, held=(), asked: frozenset = frozenset(), watched: frozenset = frozenset(),
         limit: int = 10_000) -> list[str]:
    """What lies among the objects reachable from ``returned`` and ``held`` (through lists, tuples, sets, dicts,
    deques, mapping proxies, numpy arrays of objects and objects' attributes; the first ``limit``):

    * a tensor with an attribute of its own that hides torch.Tensor's (``t.double = ...``: ``t.double()`` would run
      it, not torch), and an object that claims to be a tensor (its ``__class__``) and is not one;
    * an object whose class of the answer's own decides how a test compares, computes with or converts it
      (``lookalike``: ``class Six(int)`` whose ``__eq__`` says yes to anything, a plain object whose ``__sub__``
      gives 0): any such object in ``returned`` and its containers, where a test reads it; in ``held`` and in objects'
      attributes, where an answer's helper objects may order themselves honestly, only subclasses of the builtin
      values and of torch.Tensor;
    * a weakref.proxy returned: what it stands in for, out of reach, decides how it compares.

    ``asked``: the classes the exercise asks for, whose objects may compare as they like; ``watched``: the classes
    ``Integrity`` watches."""
    import torch

    found, seen, classes = [], set(), {}
    todo = [(value, False) for value in held] + [(value, True) for value in returned]
    while todo and len(seen) < limit:
        value, direct = todo.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        cls = type(value)
        if direct or issubclass(cls, (*BUILTIN_VALUES, torch.Tensor)) and cls not in BUILTIN_VALUES:
            if cls not in classes:  # read once per check: many objects share a class
                classes[cls] = lookalike(cls, asked, watched)
            found += [f"how {name.split('.')[-1]} works (your class {name.rsplit('.', 1)[0]})" for name in classes[cls]]
        # what the object is, by its type (an object's __class__ may claim anything)
        if issubclass(cls, SKIPPED):
            continue
        if issubclass(cls, weakref.ProxyTypes):  # what it stands in for is out of reach, and decides what it does
            if direct:
                found.append("how a weakref.proxy compares (what it stands in for decides, out of the tests' sight)")
            continue
        if issubclass(cls, torch.Tensor):
            found += [f"torch.Tensor.{name} (an attribute of a tensor)" for name in sorted(set(vars(value)) &
                                                                                        hideable_attributes())]
            continue
        if isinstance(value, torch.Tensor):
            found.append(f"torch.Tensor (an object of class {cls.__qualname__} that claims to be one)")
            continue
        numpy = sys.modules.get("numpy")
        if numpy is not None and issubclass(cls, numpy.ndarray):  # its items, where it holds Python objects
            if numpy.ndarray.__dict__["dtype"].__get__(value).hasobject:
                todo += [(item, direct) for item in numpy.ndarray.tolist(numpy.ndarray.ravel(value))]
        if cls is types.MappingProxyType:  # the mapping it shows, which decides how it compares
            todo += [(item, direct) for item in gc.get_referents(value)]
            continue
        containers = [kind for kind in (list, tuple, set, frozenset, dict, collections.deque) if issubclass(cls, kind)]
        for kind in containers:  # the items as the builtin holds them, whatever a subclass says
            todo += [(item, direct) for item in (kind.__iter__(value) if kind is not dict else
                                                 (item for pair in dict.items(value) for item in pair))]
        if not containers and (cls.__dictoffset__ or cls.__flags__ & HEAP_TYPE):
            # an object with attributes: what the garbage collector sees it hold (no property can hide it), its dict
            # or, where Python keeps an object's attributes inline or in __slots__, their values
            for held in gc.get_referents(value):
                todo += [(item, False) for item in (held.values() if type(held) is dict else (held,))]
    return list(dict.fromkeys(found))


class Integrity:
    """Remembers the identity of every attribute of some modules and of torch.Tensor and its subclasses, and which
    subclasses of torch.Tensor exist; reports changes (torch re-binding its own attribute on a lazy import is not
    one: ``TorchRewrap``), new subclasses that change what a tensor does (``overriding_tensor``), and changes to
    names ``watch`` is given."""

    def __init__(self, namespaces: list):
        import torch

        self._namespaces = [(ns, dict(vars(ns))) for ns in namespaces]
        self._rewrapped_by_torch = TorchRewrap()
        self._tensor_subclasses = tensor_subclasses()
        # what a tensor does: its classes' attributes named as torch.Tensor's (a new one hides an inherited one)
        hideable_attributes()  # read now, before learner code
        classes = self._tensor_subclasses | {torch.Tensor, torch._C.TensorBase}
        self.watched = frozenset(classes)  # the classes whose attributes changes() compares
        self._classes = [(cls, dict(vars(cls))) for cls in classes]
        self._modules = set(sys.modules)
        self._hooks = (sys.gettrace(), sys.getprofile())  # a function of these runs at every call, unguarded
        self._names: dict[str, tuple[dict, dict]] = {}
        self.scope: dict = {}  # the running test's names

    def watch(self, label: str, names: dict, keys) -> None:
        """Also report a change to ``names[key]``, each of ``keys`` (as ``label key``), in place of what ``label``
        watched before."""
        self._names[label] = (names, {key: names[key] for key in keys})

    def watch_scope(self, scope: dict, source: str) -> None:
        """Watch ``scope``, what the test cell ``source`` runs in (code that reaches the test's frame could change it:
        ``sys._getframe(1).f_globals``): the names the cell does not bind itself, and any name while learner code runs
        (``changes(since=...)``)."""
        self.scope = scope
        self.watch("the tests'", scope, scope.keys() - bound_names(source))

    def changes(self, since: dict | None = None) -> list[str]:
        """What changed; ``since``: ``scope`` as it was before a call into learner code."""
        changed = [f"{label} {key}" for label, (names, before) in self._names.items() for key, value in before.items()
                   if names.get(key, _UNBOUND) is not value]
        if any(now is not then for now, then in zip((sys.gettrace(), sys.getprofile()), self._hooks)):
            changed.append("sys.settrace or sys.setprofile's function")
        if since is not None:
            changed += [f"the tests' {key}" for key in sorted(since.keys() | self.scope.keys())
                        if self.scope.get(key, _UNBOUND) is not since.get(key, _UNBOUND) and key not in PYTHON_WRITES]
        for ns, before in self._namespaces:
            now = vars(ns)
            for key, value in before.items():
                if key not in now or now[key] is not value and not self._rewrapped_by_torch(ns, key, value, now[key]):
                    changed.append(f"{getattr(ns, '__name__', ns)}.{key}")
        for cls, before in self._classes:
            now = vars(cls)
            changed += [f"{cls.__module__}.{cls.__qualname__}.{key}" for key in sorted(now.keys() | before.keys())
                        if key in tensor_attributes() and now.get(key, _UNBOUND) is not before.get(key, _UNBOUND)]
        changed += [f"what torch's operations do on a tensor (your subclass {cls.__qualname__} of torch.Tensor)"
                    for cls in tensor_subclasses() - self._tensor_subclasses
                    if overriding_tensor(cls, self._tensor_subclasses, self._modules)]
        return list(dict.fromkeys(changed))


def bound_names(source: str) -> set[str]:
    """The names a cell binds or deletes at top level, wherever in it (assignments, imports, defs, loops, ``as``)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {alias.asname or alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and node.name:
            names.add(node.name)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            names |= set(node.names)
    return names


def tampering(changed: list[str]) -> str:
    return f"your code replaced {', '.join(changed[:3])}: tests cannot be tricked"


def _watched(namespace: dict) -> list:
    import numpy
    import torch

    import course_lib.checks

    watched = [builtins, math, torch, torch.nn.functional, torch.testing, numpy]  # torch.Tensor's classes: Integrity
    watched += [m for name, m in sys.modules.items() if name.startswith("course_lib.checks") and m is not None]
    watched += [v for v in namespace.values() if isinstance(v, types.ModuleType)]
    watched.append(course_lib.checks)
    watched.append(sys.modules[__name__])  # the clean room's own checks (``cleanroom.lies = ...`` would end them)
    return list({id(ns): ns for ns in watched}.values())


#: what Python itself writes into a namespace when code runs (a warning attributed to the test cell's code)
PYTHON_WRITES = {"__warningregistry__"}


def _class_names(source: str) -> set[str]:
    """The names of the classes a cell's definitions define at top level."""
    return {node.name for node in ast.parse(student_definitions(source)).body if isinstance(node, ast.ClassDef)}


class Answer(NamedTuple):
    """What ``_guarded`` needs to know of the exercise's answer: the file names its cells were compiled under, and the
    classes it defines that the exercise asks for, as classes (its reference defines a class of the name: their objects
    may define how they compare; a class answering for a function may not), and the file names of its tests."""
    files: frozenset
    classes: frozenset
    tests: frozenset


#: each wrapper ``_guarded`` made -> the learner's function it calls
_GUARDED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _guarded(function, integrity: Integrity, answer: Answer):
    """Call the learner's function, then refuse its result if it changed a watched module or the test's names, or
    if what it returned (or the object its ``__init__`` made) lies (``lies``): a tensor's own attributes, and what
    decides how it compares or computes where it is returned to code other than the answer's own (a test, the course's
    code; within the answer, its helpers may order themselves as they like)."""
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        names = dict(integrity.scope)
        result = function(*args, **kwargs)
        # what the call returned and the object an __init__ made; not every call's arguments (a model: ~10 ms)
        made = args[:1] if function.__name__ == "__init__" else ()
        caller = sys._getframe(1).f_code.co_filename
        if caller in answer.files:  # within the answer: its helpers may order themselves as they like
            returned, held = (), (result, *made)
        else:  # a test gets the object an __init__ made (its class called) as it gets a result; other code, its result
            returned, held = ((result, *made), ()) if caller in answer.tests else ((result,), made)
        changed = lies(returned, held, answer.classes, integrity.watched) + integrity.changes(since=names)
        if changed:
            raise AssertionError(tampering(changed))
        return result
    _GUARDED[wrapper] = function
    return wrapper


def _guard(namespace: dict, names: set[str], integrity: Integrity, answer: Answer) -> None:
    for name in names:
        obj = namespace.get(name)
        if inspect.isfunction(obj):
            namespace[name] = _guarded(obj, integrity, answer)
        elif inspect.isclass(obj):
            for attr, value in list(vars(obj).items()):
                if inspect.isfunction(value):
                    setattr(obj, attr, _guarded(value, integrity, answer))
                elif type(value) in (staticmethod, classmethod) and inspect.isfunction(value.__func__):  # __new__ too
                    setattr(obj, attr, type(value)(_guarded(value.__func__, integrity, answer)))
                elif type(value) is property and not (attr.startswith("__") and attr.endswith("__")):
                    # what its getter returns reaches a test as a method's result does (a __class__ or __dict__ of
                    # its own, which the clean room's check reads, is named by that check, unwrapped)
                    for part, copy in (("fget", property.getter), ("fset", property.setter), ("fdel", property.deleter)):
                        if inspect.isfunction(getattr(value, part)):
                            value = copy(value, _guarded(getattr(value, part), integrity, answer))
                    setattr(obj, attr, value)
                elif type(value) is functools.cached_property and inspect.isfunction(value.func):
                    value.func = _guarded(value.func, integrity, answer)


def limit_hit(error: BaseException, limits: dict) -> str:
    """The plain-words error for an exception that means a grading limit was hit, or ''."""
    text = f"{type(error).__name__}: {error}"
    if isinstance(error, MemoryError) or "can't allocate memory" in text or "Cannot allocate memory" in text:
        return f"your code used more than {limits['memory_gib']:g} GiB of memory (the grading limit)"
    if isinstance(error, BlockingIOError) or "Resource temporarily unavailable" in text:
        return f"your code started more than {limits['processes']} processes or threads (the grading limit)"
    return ""


# --- the child: one exercise ------------------------------------------------------------------

_UNBOUND = object()  # a name nothing bound before the learner's cell


def _exercise_namespace(setup: dict, solutions: list[dict], exercise: str) -> tuple[dict, set[str], dict]:
    """The set-up namespace with every solution cell loaded: the reference ones for the other
    exercises, the learner's definitions for ``exercise``. Returns it, the learner's names, and
    ``shadowed``: for each name the learner bound that the exercise does not ask for (its reference
    solution does not define it), what it was before (``_UNBOUND``: nothing, a builtin's name), and for
    each the reference binds by an import (``import torch``), what that import binds."""
    namespace = dict(setup)
    learner: set[str] = set()
    asked: set[str] = set()
    imported: dict = {}  # what the exercise's reference binds by importing (its torch): what the tests see
    before_learner, learners_value = {}, {}
    for solution in solutions:
        if solution["exercise"] != exercise:
            exec(compile(solution["reference"], f"<reference {solution['grade_id']}>", "exec"), namespace)
            continue
        asked |= defined_names(solution["reference"])
        imports, theirs = import_statements(solution["reference"]), {}
        exec(compile(imports, f"<reference {solution['grade_id']}>", "exec"), theirs)
        imported |= {name: theirs[name] for name in defined_names(imports) if name in theirs}
        if solution["answer"] is None:
            continue
        before = dict(namespace)
        exec(compile(student_definitions(solution["answer"]), f"<{solution['grade_id']}>", "exec"), namespace)
        bound = {name for name, value in namespace.items() if name not in before or before[name] is not value}
        for name in bound:
            before_learner.setdefault(name, before.get(name, _UNBOUND))
            learners_value[name] = namespace[name]
        learner |= bound
    shadowed = {name: imported.get(name, before_learner[name]) for name in learner - (asked - imported.keys())
                if namespace.get(name, _UNBOUND) is learners_value[name]}  # not bound again by a later reference
    return namespace, learner, shadowed


def _tests_namespace(namespace: dict, shadowed: dict) -> dict:
    """What a test cell runs in: the learner's definitions of what the exercise asks for, and every other
    name as the set-up and the references bound it. A learner's own ``checks``, ``torch`` or ``abs`` stays
    theirs (their functions still see it), but the tests never call it."""
    seen = dict(namespace)
    for name, value in shadowed.items():
        if value is _UNBOUND:
            del seen[name]
        else:
            seen[name] = value
    return seen


def _run_exercise(setup: dict, solutions: list[dict], exercise: dict, limits: dict, send) -> None:
    import torch

    from course_lib.checks.core import explain

    integrity = Integrity(_watched(setup))
    try:
        namespace, learner, shadowed = _exercise_namespace(setup, solutions, exercise["name"])
    except BaseException as error:  # noqa: BLE001 - the tests below report what is missing
        namespace, learner = None, set()
        loading = f"{type(error).__name__}: {error}"
    else:
        cells = [s for s in solutions if s["exercise"] == exercise["name"]]
        classes = set().union(*(_class_names(s["reference"]) for s in cells))  # a class the reference defines
        answer = Answer(frozenset(f"<{s['grade_id']}>" for s in cells),
                        frozenset(namespace[name] for name in (learner - shadowed.keys()) & classes
                                  if inspect.isclass(namespace[name])),
                        frozenset(f"<{test['grade_id']}>" for test in exercise["tests"]))
        _guard(namespace, learner, integrity, answer)
        for name in (learner - shadowed.keys()) - classes:  # asked for, not as a class: a class answering is called
            if inspect.isclass(namespace[name]):  # as a function is (int's constructor runs none of the answer's code)
                namespace[name] = _guarded(namespace[name], integrity, answer)
        # the course's functions look their names up here when called: the learner's code may not re-bind them
        integrity.watch("the course code's", namespace, namespace.keys() - learner)
        namespace = _tests_namespace(namespace, shadowed)
    for test in exercise["tests"]:
        send({"start": test["grade_id"]})
        verdict = {"grade_id": test["grade_id"], "passed": False, "message": "", "error": ""}
        changed = integrity.changes()
        if namespace is None:
            verdict["message"] = f"your answer could not be loaded: {loading}"
        elif changed:
            verdict["message"] = tampering(changed)
        else:
            try:
                scope = dict(namespace)
                integrity.watch_scope(scope, test["source"])
                # a tensor subclass's own __torch_function__ does not run here: torch's operations are torch's
                with torch._C.DisableTorchFunctionSubclass():
                    exec(compile(test["source"], f"<{test['grade_id']}>", "exec"), scope)
            except BaseException as error:  # noqa: BLE001 - a failed test, whatever it raised
                verdict["message"] = explain(error)
                verdict["error"] = limit_hit(error, limits)
            else:
                changed = integrity.changes()
                verdict["passed"] = not changed
                verdict["message"] = tampering(changed) if changed else ""
        send(verdict)


# --- the parent: one child per exercise, watched ------------------------------------------------

def _describe_exit(status: int) -> str:
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        name = signal.Signals(number).name if number in signal.Signals._value2member_map_ else str(number)
        if number == signal.SIGKILL:
            return "the process running your code was killed (signal SIGKILL: often, out of memory)"
        return f"the process running your code died (signal {name})"
    return f"your code ended the process running the tests (exit code {os.WEXITSTATUS(status)})"


def _watch(pid: int, fd: int, exercise: dict, timeout: float):
    """Yield the child's verdicts; stop it if a test runs past ``timeout``; turn its death into error verdicts."""
    expected = [t["grade_id"] for t in exercise["tests"]]
    done: set[str] = set()
    running, deadline, buffer = None, time.monotonic() + timeout, b""
    problem = ""
    with os.fdopen(fd, "rb", buffering=0) as pipe:
        while True:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([pipe], [], [], max(left, 0))
            if not ready:
                problem = f"a test of this exercise did not finish within {timeout:g} s (the grading limit per test)"
                os.kill(pid, signal.SIGKILL)
                break
            chunk = pipe.read(65536)
            if not chunk:
                break
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                try:
                    message = json.loads(line)
                except ValueError:  # not a line the tests wrote: ignored
                    continue
                if not isinstance(message, dict):
                    continue
                if "start" in message:
                    running, deadline = message["start"], time.monotonic() + timeout
                elif message.get("grade_id") in expected and message["grade_id"] not in done:
                    done.add(message["grade_id"])
                    running = None
                    yield message
            if len(done) == len(expected):  # processes it left behind may still hold the pipe open
                break
    _, status = os.waitpid(pid, 0)
    _stop_leftovers(pid)
    if not problem and len(done) < len(expected):
        problem = _describe_exit(status)
    for grade_id in expected:
        if grade_id not in done:
            where = " while this test ran" if grade_id == running else ""
            yield {"grade_id": grade_id, "passed": False, "message": problem + where, "error": problem}


def _stop_leftovers(group: int) -> None:
    """Kill what the exercise's child left running (its process group), and reap it: in the sandbox this
    process is PID 1, orphans become its children, and a zombie still counts against the process cap."""
    try:
        os.killpg(group, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.01)


def _fork_exercise(setup: dict, solutions: list[dict], exercise: dict, limits: dict, verdicts_fd: int):
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the learner's code runs here, with nowhere to print and no way to the verdicts
        os.setpgid(0, 0)
        os.close(read_end)
        os.close(verdicts_fd)
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        channel = os.fdopen(write_end, "w")

        def send(message: dict) -> None:
            channel.write(json.dumps(message) + "\n")
            channel.flush()

        try:
            _run_exercise(setup, solutions, exercise, limits, send)
        finally:
            os._exit(0)
    os.close(write_end)
    return pid, read_end


def run(job: dict, out) -> None:
    """Test every chapter of ``job``; write each verdict to ``out`` as soon as it is known."""
    nonce, limits = job["nonce"], job["limits"]

    def report(chapter: str, verdict: dict) -> None:
        out.write(f"{nonce} {json.dumps({'chapter': chapter, **verdict})}\n")
        out.flush()

    if len(job["chapters"]) > 1:
        # a learner's course: some chapters' tests import them (4 of 17 transformers' models, 1 more torch's own code
        # that imports LAZY_IMPORT): once here, not in each of their exercises' processes. One chapter seldom does.
        for name in SHARED_IMPORTS:
            importlib.import_module(name)
    for chapter in job["chapters"]:
        setup: dict = {"__name__": "__main__"}
        exec(compile(chapter["setup"], "<set-up cell>", "exec"), setup)  # trusted: the course's own cell
        _watched(setup)  # its imports happen once here, not in every child
        for exercise in chapter["exercises"]:
            if not exercise["tests"]:
                continue
            pid, fd = _fork_exercise(setup, chapter["solutions"], exercise, limits, out.fileno())
            for verdict in _watch(pid, fd, exercise, limits["timeout"]):
                report(chapter["chapter"], verdict)
    out.write(f"{nonce} {json.dumps({'done': True})}\n")
    out.flush()


def main() -> None:
    job = json.loads(sys.stdin.read())
    # the verdicts go to a private copy of stdout; whatever else prints goes nowhere (stderr is the grader's log)
    out = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_RDWR), 1)
    run(job, out)


if __name__ == "__main__":
    main()
