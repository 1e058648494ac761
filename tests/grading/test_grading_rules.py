"""The grader's rules, tested directly (fast): reading a submission, the reference-import rule,
what the clean room loads, isolation of exercises, and the clean room's limits and errors."""
from __future__ import annotations

import copy
import os

import pytest

from course_lib.grading import Limits
from course_lib.answers import student_definitions
from course_lib.grading.cleanroom import forbidden_use
from course_lib.grading.runner import chapter_job, run_cleanroom
from course_lib.grading.submission import nbgrader_meta, read_submission


def cell(cell_id, source="", grade_id=None, solution=False, grade=False, cell_type="code"):
    meta = {"nbgrader": {"grade_id": grade_id, "solution": solution, "grade": grade, "points": 1 if grade else 0}} if grade_id else {}
    return {"id": cell_id, "cell_type": cell_type, "source": source, "metadata": meta, "outputs": []}


SETUP = cell("setup", "import torch")
SOURCE = {"cells": [SETUP,
                    cell("double-solution", "def double(x):\n    return 2 * x\n", "double-solution", solution=True),
                    cell("double-visible", "assert double(3) == 6", "double-visible", grade=True),
                    cell("quad-solution", "def quad(x):\n    return double(double(x))\n", "quad-solution", solution=True),
                    cell("quad-visible", "assert quad(3) == 12", "quad-visible", grade=True)],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}


def submitted(double="def double(x):\n    return 2 * x\n", quad="def quad(x):\n    return double(double(x))\n"):
    notebook = copy.deepcopy(SOURCE)
    notebook["cells"][1]["source"], notebook["cells"][3]["source"] = double, quad
    return notebook


def markdown_answer():
    notebook = submitted()
    notebook["cells"][1]["cell_type"] = "markdown"
    del notebook["cells"][1]["outputs"]
    return notebook


def deleted_answer():
    notebook = submitted()
    del notebook["cells"][1]
    return notebook


#: SHORT: what the two students that never return (loop, printing_loop) cost; the tests it times take microseconds
DEFAULT, SHORT = Limits(timeout=20), Limits(timeout=1)
OPTIMIZER_STEP = ("import torch\n"
                  "def double(x):\n"
                  "    model = torch.nn.Linear(2, 1)\n"
                  "    opt = torch.optim.AdamW(model.parameters(), lr=0.1)\n"
                  "    model(torch.ones(1, 2)).sum().backward()\n"
                  "    opt.step()\n"
                  "    return 2 * x\n")
#: the optimizer step where torch._dynamo is not imported yet (its premise asserted), and is after it
LAZY_OPTIMIZER_STEP = OPTIMIZER_STEP.replace("def double(x):\n", "import sys\ndef double(x):\n"
                                             "    assert 'torch._dynamo' not in sys.modules\n").replace(
    "    return 2 * x\n", "    assert 'torch._dynamo' in sys.modules\n    return 2 * x\n")
SEED_PATCH = "import functools\nimport torch\ndef {name}(x):\n    torch.manual_seed = {new}\n    return {result}\n"
WRAPPED, REWRAPPED = "functools.wraps(torch.manual_seed)(lambda seed: None)", "torch._compile._disable_dynamo(lambda seed: None)"
FORGED_REWRAP = ("import types\nimport torch\nfrom torch import _compile\n"
                 "def forge(fn, *args, **kwargs):\n"
                 "    def outer(fn):\n"
                 "        def inner(*a, **k):\n"
                 "            return True or fn\n"
                 "        return inner\n"
                 "    code = outer(None).__code__\n"
                 "    return types.FunctionType(code, vars(_compile), 'inner', None, (types.CellType(fn),))\n"
                 "def double(x):\n"
                 "    _compile._disable_dynamo = forge\n"
                 "    torch.allclose = forge(torch.allclose)\n"
                 "    return 2 * x\n")
#: a clean room of one chapter, as `course check NN` runs: torch._dynamo is not imported up front (as in a run of several
#: chapters), so torch imports it while the tests run
ONE_CHAPTER = Limits(timeout=19)
#: The submissions the clean room grades: name -> (notebook, limits). Each is one chapter of one clean room run per
#: limits, as a learner's chapters share one clean room when graded: Python and torch start once per run, not per test.
GRADED = {
    "markdown_answer": (markdown_answer(), DEFAULT),
    "deleted_answer": (deleted_answer(), DEFAULT),
    "earlier_bug": (submitted(double="def double(x):\n    return 3 * x\n"), DEFAULT),
    "later_bug": (submitted(quad="def quad(x):\n    return double(x)\n"), DEFAULT),
    "loop": (submitted(double="def double(x):\n    while True:\n        pass\n"), SHORT),
    "exit": (submitted(double="import os\ndef double(x):\n    os._exit(3)\n"), DEFAULT),
    "printing_loop": (submitted(double="def double(x):\n    while True:\n        print('x' * 1000)\n"), SHORT),
    "memory_hog": (submitted(double="import torch\ndef double(x):\n    torch.ones(3 * 2**30, dtype=torch.uint8)\n"
                                    "    return 2 * x\n"), Limits(timeout=20, memory_gib=2)),
    "optimizer_step": (submitted(double=OPTIMIZER_STEP), DEFAULT),
    # torch.manual_seed replaced by what looks like torch's own lazy re-binding of it: a wrapper of the original, and
    # torch's own wrapper of another function; alone, an optimizer step (torch imports torch._dynamo), then a wrapper
    "seed_wrapped": (submitted(double=SEED_PATCH.format(name="double", new=WRAPPED, result="2 * x")), DEFAULT),
    "seed_rewrapped": (submitted(double=SEED_PATCH.format(name="double", new=REWRAPPED, result="2 * x")), DEFAULT),
    "alone": (submitted(double=LAZY_OPTIMIZER_STEP, quad=SEED_PATCH.format(name="quad", new=WRAPPED, result="4 * x")),
              ONE_CHAPTER),
    # torch's wrapper forged: _disable_dynamo replaced by a factory of functions that look like torch's re-binding
    # (its module, its closure cell "fn" holding the original) and return True, then wrapped around torch.allclose
    "forged_rewrap": (submitted(double=FORGED_REWRAP), DEFAULT),
    "patch_when_called": (submitted(double="import torch\ndef double(x):\n    torch.allclose = lambda *a, **k: True\n"
                                           "    return 2 * x\n"), DEFAULT),
}

#: A chapter whose tests use a set-up name (``checks``) and builtins (``abs``, ``float``), as the course's do, some
#: after the learner's code has run (``out = double(...)`` first).
CHECKED = {"cells": [cell("setup", "import torch\nfrom course_lib import checks"),
                     cell("double-solution", "def double(x):\n    return 2 * x\n", "double-solution", solution=True),
                     cell("double-close", 'checks.assert_close(double(torch.ones(3)), torch.full((3,), 2.0), "double(1)")',
                          "double-close", grade=True),
                     cell("double-abs", "assert abs(float(double(torch.tensor(1.5))) - 3.0) < 1e-6", "double-abs",
                          grade=True),
                     cell("double-then", 'want = torch.full((3,), 2.0)\nout = double(torch.ones(3))\n'
                          'checks.assert_close(out, want, "out")', "double-then", grade=True),
                     cell("double-list", 'out = double(torch.ones(3))\nchecks.assert_tensor(out, "out")\n'
                          "assert out.tolist() == [2.0, 2.0, 2.0]", "double-list", grade=True)],
           "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
ZERO = "import torch\ndef double(x):\n    return x * 0\n"
#: the tests' own names shadowed: a class named `checks` whose every attribute does nothing, `abs` always 0
SHADOWS = ZERO + ("class Nothing(type):\n    def __getattr__(cls, name):\n        return lambda *a, **k: None\n"
                  "class checks(metaclass=Nothing):\n    pass\ndef abs(x):\n    return 0\n")
#: a tensor subclass whose __torch_function__ says no entry differs (`>` all False) and any number is 3
FUNCTION_LIAR = ("import torch\n"
                 "class Liar(torch.Tensor):\n"
                 "    @classmethod\n"
                 "    def __torch_function__(cls, func, types, args=(), kwargs=None):\n"
                 "        with torch._C.DisableTorchFunctionSubclass():\n"
                 "            out = func(*args, **(kwargs or {}))\n"
                 "        if func is torch.Tensor.__gt__:\n"
                 "            return torch.zeros_like(out).as_subclass(Liar)\n"
                 "        if func is torch.Tensor.__float__:\n"
                 "            return 3.0\n"
                 "        return out.as_subclass(Liar) if isinstance(out, torch.Tensor) else out\n"
                 "def double(x):\n"
                 "    return (x * 0).as_subclass(Liar)\n")
#: the same lie one level down: a wrapper subclass whose __torch_dispatch__ makes torch's `gt` all False
DISPATCH_LIAR = ("import torch\n"
                 "class Liar(torch.Tensor):\n"
                 "    @staticmethod\n"
                 "    def __new__(cls, elem):\n"
                 "        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype)\n"
                 "    def __init__(self, elem):\n"
                 "        self.elem = elem\n"
                 "    @classmethod\n"
                 "    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):\n"
                 "        unwrap = lambda a: a.elem if isinstance(a, Liar) else a\n"
                 "        out = func(*map(unwrap, args), **{k: unwrap(v) for k, v in (kwargs or {}).items()})\n"
                 "        if func is torch.ops.aten.gt.Tensor:\n"
                 "            out = torch.zeros_like(out)\n"
                 "        return Liar(out) if isinstance(out, torch.Tensor) else out\n"
                 "def double(x):\n"
                 "    return Liar(x * 0)\n")
#: a plain tensor with a `double` of its own: checks.assert_close's `actual.double()` gets an object whose every
#: comparison is False
ATTRIBUTE_LIAR = ("import torch\n"
                  "class Nothing:\n"
                  "    def __getattr__(self, name):\n"
                  "        return lambda *a, **k: self\n"
                  "    def __sub__(self, other):\n"
                  "        return self\n"
                  "    def __gt__(self, other):\n"
                  "        return self\n"
                  "    def __bool__(self):\n"
                  "        return False\n"
                  "def double(x):\n"
                  "    out = x * 0\n"
                  "    out.double = lambda: Nothing()\n"
                  "    return out\n")
#: DISPATCH_LIAR (any number is 3) named as a class of a module that was imported before it (`functools.Liar`)
FORGED_LIAR = DISPATCH_LIAR.replace(
    "        if func is torch.ops.aten.gt.Tensor:\n",
    "        if func is torch.ops.aten._local_scalar_dense.default:\n"
    "            return 3.0\n"
    "        if func is torch.ops.aten.gt.Tensor:\n").replace(
    "def double(x):\n", "import functools\nclass Forge:\n    Liar.__module__ = 'functools'\n    functools.Liar = Liar\n"
    "def double(x):\n")
#: a tensor subclass that lies with plain methods, no torch hooks: `double()` is itself, `x - y` is zeros
METHOD_LIAR = ("import torch\n"
               "class Liar(torch.Tensor):\n"
               "    def __sub__(self, other):\n"
               "        return torch.zeros_like(other)\n"
               "    def double(self):\n"
               "        return self\n"
               "    def tolist(self):\n"
               "        return [2.0] * len(self)\n"
               "def double(x):\n"
               "    return (x * 0).as_subclass(Liar)\n")
#: ATTRIBUTE_LIAR's `double` as a class whose __new__ (a staticmethod) returns the lying tensor
NEW_LIAR = ATTRIBUTE_LIAR.replace("def double(x):\n    out = x * 0\n    out.double = lambda: Nothing()\n"
                                  "    return out\n",
                                  "class double:\n    def __new__(cls, x):\n        out = x * 0\n"
                                  "        out.double = lambda: Nothing()\n        return out\n")
#: torch.Tensor given a `double` of its own (hiding torch._C.TensorBase's) that lies for the answer's tensors only
TENSOR_PATCH = ATTRIBUTE_LIAR.replace("def double(x):\n    out = x * 0\n    out.double = lambda: Nothing()\n",
                                      "MARKED = []\n"
                                      "class Patch:\n"
                                      "    plain = torch.Tensor.double\n"
                                      "    torch.Tensor.double = lambda self, plain=plain: (\n"
                                      "        Nothing() if id(self) in MARKED else plain(self))\n"
                                      "def double(x):\n    out = x * 0\n    MARKED.append(id(out))\n")
#: torch.nn.Parameter given a `double` of its own, and the answer a Parameter
PARAMETER_PATCH = ATTRIBUTE_LIAR.replace("def double(x):\n    out = x * 0\n    out.double = lambda: Nothing()\n",
                                         "class Patch:\n    torch.nn.Parameter.double = lambda self: Nothing()\n"
                                         "def double(x):\n    out = torch.nn.Parameter(x * 0)\n")
#: ATTRIBUTE_LIAR's tensor of a subclass whose __dict__ hides what the tensor's own attributes are
DICT_LIAR = ATTRIBUTE_LIAR.replace("def double(x):\n    out = x * 0\n",
                                   "class Liar(torch.Tensor):\n    __dict__ = property(lambda self: {})\n"
                                   "def double(x):\n    out = (x * 0).as_subclass(Liar)\n")
#: ATTRIBUTE_LIAR's lie told after the answer's function has returned (where the clean room checks it), by a profile
#: function that runs when the clean room's own wrapper of it returns
PROFILE_LIAR = ATTRIBUTE_LIAR.replace("import torch\n", "import sys\nimport torch\n").replace(
    "    out.double = lambda: Nothing()\n",
    "    sys.setprofile(lambda frame, event, arg: (setattr(arg, 'double', lambda: Nothing()), sys.setprofile(None))\n"
    "                   if event == 'return' and arg is not None and frame.f_code.co_name == 'wrapper'\n"
    "                   and frame.f_code.co_filename.endswith('cleanroom.py') else None)\n")
#: FORGED_LIAR put in a torch module the answer imports itself (not yet imported when the clean room looked): not a
#: change the clean room sees, but a tensor whose class of the answer's own decides what torch does, returned to a test
FORGED_FRESH_LIAR = FORGED_LIAR.replace("import functools\n", "import torch.utils.model_zoo as zoo\n").replace(
    "    Liar.__module__ = 'functools'\n    functools.Liar = Liar\n",
    "    Liar.__module__ = zoo.__name__\n    zoo.Liar = Liar\n")
#: a `double` class whose metaclass (nested in another class: never wrapped) returns zeros whose own `double` gives
#: the expected values (a plain tensor: nothing of the answer's own is called while the test compares)
META_LIAR = ("import torch\n"
             "class Holder:\n    class Meta(type):\n        def __call__(cls, x):\n"
             "            out = x * 0\n            out.double = lambda: torch.full((3,), 2.0, dtype=torch.float64)\n"
             "            return out\n"
             "class double(metaclass=Holder.Meta):\n    pass\n")
#: META_LIAR's metaclass on LAYER's Scale, which the exercise asks for as a class (a class answering for a function,
#: as META_LIAR's double, is called as a function is: what it returns is looked at)
META_LAYER_LIAR = ("import torch\nimport types\n"
                   "class Holder:\n    class Meta(type):\n        def __call__(cls, k):\n"
                   "            weight = torch.zeros(3)\n"
                   "            weight.double = lambda: torch.full((3,), 2.0, dtype=torch.float64)\n"
                   "            return types.SimpleNamespace(weight=weight)\n"
                   "class Scale(metaclass=Holder.Meta):\n    pass\n")
#: an object that is no tensor but says it is one (its __class__), with the list the test wants
CLAIMS_TENSOR = ("import torch\n"
                 "class Fake:\n"
                 "    __class__ = property(lambda self: torch.Tensor)\n"
                 "    def tolist(self):\n"
                 "        return [2.0, 2.0, 2.0]\n"
                 "def double(x):\n"
                 "    return Fake()\n")
#: the learner's function reaches the test's frame and puts a `checks` whose every check does nothing in its names
FRAME_REACH = ("import sys\n"
               "class Nothing(type):\n"
               "    def __getattr__(cls, name):\n"
               "        return lambda *a, **k: None\n"
               "class NoChecks(metaclass=Nothing):\n"
               "    pass\n"
               "def double(x):\n"
               "    frame = sys._getframe(1)\n"
               "    while frame is not None:\n"
               "        if 'checks' in frame.f_globals:\n"
               "            frame.f_globals['checks'] = NoChecks\n"
               "        frame = frame.f_back\n"
               "    return x * 0\n")
#: the same reach for a name the test binds itself (`want`, the expected values), made all zeros as its answer
FRAME_REBINDS = FRAME_REACH.replace("'checks' in", "'want' in").replace("['checks'] = NoChecks", "['want'] = x * 0")
#: an honest answer whose helpers happen to have the names of a builtin and of a set-up name
HONEST_NAMES = ("import torch\ndef abs(x):\n    return x if x >= 0 else -x\n"
                "class checks:\n    factor = 2\ndef double(x):\n    return checks.factor * x\n")
#: SOURCE's wrong double (0) whose objects decide how the test's `==` goes: an int subclass, a plain object, an int
#: subclass that aliases another operation and says it is numpy's; each told to say yes
SIX = "class Six(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"
LOOKALIKES = {"int_lookalike": SIX + "def double(x):\n    return Six(0)\n",
              "plain_lookalike": ("class Anything:\n    def __eq__(self, other):\n        return True\n"
                                  "def double(x):\n    return Anything()\n"),
              "aliased_lookalike": ("class Six(int):\n    __module__ = 'numpy'\n    __eq__ = int.__le__\n"
                                    "def double(x):\n    return Six(0)\n")}
#: more of SOURCE's wrong doubles whose `==` says yes: an `__eq__` without code of the answer's own that only says its
#: name is `__eq__` (a callable object, a functools.partial, a bound method of the 6 it is compared with), a library's
#: function that is not the class's (mock's `_ANY.__eq__`, typing.cast(self, other) -> other), a library's stand-in
#: returned as it is (unittest.mock.ANY, a pytest.approx whose tolerance takes anything), and a numpy array of objects
#: that holds a Six
LOOKALIKES_MORE = {
    "callable_lookalike": ("class Yes:\n    __name__ = '__eq__'\n    def __call__(self, other):\n        return True\n"
                           "class Six(int):\n    __eq__ = Yes()\n    __hash__ = int.__hash__\n"
                           "def double(x):\n    return Six(0)\n"),
    "partial_lookalike": ("import functools\nimport operator\nclass Six(int):\n    __hash__ = int.__hash__\n"
                          "def double(x):\n    Six.__eq__ = functools.partial(operator.is_not, None)\n"
                          "    Six.__eq__.__name__ = '__eq__'\n    return Six(0)\n"),
    "bound_lookalike": ("class Six(int):\n    __hash__ = int.__hash__\n"
                        "def double(x):\n    Six.__eq__ = (6).__eq__\n    return Six(0)\n"),
    "borrowed_lookalike": ("import unittest.mock\nclass Six(int):\n    __eq__ = unittest.mock._ANY.__eq__\n"
                           "    __hash__ = int.__hash__\ndef double(x):\n    return Six(0)\n"),
    "cast_lookalike": ("import typing\nclass Six(int):\n    __eq__ = typing.cast\n    __hash__ = int.__hash__\n"
                       "def double(x):\n    return Six(0)\n"),
    "mock_any": "import unittest.mock\ndef double(x):\n    return unittest.mock.ANY\n",
    "approx_any": "import pytest\ndef double(x):\n    return pytest.approx(0, abs=100)\n",
    "numpy_objects": ("import numpy\n" + SIX + "def double(x):\n    return numpy.array(Six(0), dtype=object)\n"),
    "proxied_mapping": ("import types\nclass Yes(dict):\n    def __eq__(self, other):\n        return True\n"
                        "    __hash__ = None\ndef double(x):\n    return types.MappingProxyType(Yes())\n"),
    "class_for_function": ("class double:\n    def __init__(self, x):\n        self.x = x\n"
                           "    def __eq__(self, other):\n        return True\n"),
    "new_for_function": ("class double(int):\n    def __new__(cls, x):\n        return int.__new__(cls, 0)\n"
                         "    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"),
    "int_for_function": "class double(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n",
    "patched_clean_room": (SIX + "import sys\ndef double(x):\n"
                           "    sys.modules['course_lib.grading.cleanroom'].lies = lambda *args, **kwargs: []\n"
                           "    return Six(0)\n"),
    "patched_integrity": (SIX + "import sys\ndef double(x):\n    room = sys.modules['course_lib.grading.cleanroom']\n"
                          "    room.Integrity.changes = lambda self, since=None: []\n"
                          "    room.lies = lambda *args, **kwargs: []\n    return Six(0)\n"),
    "weak_proxy": ("import weakref\n" + SIX.replace("Six(int)", "Anything") + "KEPT = []\n"
                   "def double(x):\n    KEPT.append(Anything())\n    return weakref.proxy(KEPT[-1])\n")}
#: honest answers of SOURCE's double whose helpers order themselves (a heap of objects with their own `<`, a dataclass
#: with order=True, functools.total_ordering) or that return an IntEnum member or a numpy integer
HONEST_VALUES = {"honest_helpers": ("import dataclasses\nimport enum\nimport functools\nimport heapq\n"
                                    "@functools.total_ordering\nclass Item:\n"
                                    "    def __init__(self, v):\n        self.v = v\n"
                                    "    def __lt__(self, other):\n        return self.v < other.v\n"
                                    "    def __eq__(self, other):\n        return self.v == other.v\n"
                                    "@dataclasses.dataclass(order=True)\nclass Pair:\n    a: int\n"
                                    "class Kind(enum.IntEnum):\n    TWO = 2\n"
                                    "def double(x):\n    heap = []\n    for v in (x, x):\n"
                                    "        heapq.heappush(heap, Item(v))\n"
                                    "    total = sum(heapq.heappop(heap).v for _ in range(2))\n"
                                    "    assert Pair(1) < Pair(2) and Item(1) <= Item(1)\n"
                                    "    return total * Kind.TWO // 2\n"),
                 "honest_enum": "import enum\nclass Kind(enum.IntEnum):\n    SIX = 6\ndef double(x):\n    return Kind(2 * x)\n",
                 "honest_numpy": "import numpy\ndef double(x):\n    return numpy.int64(2 * x)\n",
                 # an IntFlag of the answer's own holds enum's Flag.__or__ (enum copies it there)
                 "honest_flag": ("import enum\nclass Bits(enum.IntFlag):\n    TWO = 2\n    FOUR = 4\n"
                                 "def double(x):\n    return Bits(2 * x)\n"),
                 # a Counter subclass, a numpy array of Python ints, a class that says int's own __eq__ is its __eq__
                 "honest_library_values": ("import collections\nimport numpy\n"
                                           "class Tally(collections.Counter):\n    pass\n"
                                           "class Whole(int):\n    __eq__ = int.__eq__\n    __hash__ = int.__hash__\n"
                                           "def double(x):\n    count = sum(Tally({'a': x, 'b': x}).values())\n"
                                           "    return Whole(numpy.array([count], dtype=object)[0])\n")}
#: a list-returning exercise: the look-alike hides in the list the test compares and computes with
PAIRS = {"cells": [cell("setup", "import torch"),
                   cell("pair-solution", "def pair(x):\n    return [x, 2 * x]\n", "pair-solution", solution=True),
                   cell("pair-equal", "assert pair(3) == [3, 6]", "pair-equal", grade=True),
                   cell("pair-second", "assert pair(3)[1] - 6 == 0", "pair-second", grade=True)],
         "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
LISTED_LOOKALIKE = ("class Anything(float):\n    def __eq__(self, other):\n        return True\n"
                    "    def __sub__(self, other):\n        return 0\n"
                    "def pair(x):\n    return [Anything(0), Anything(0)]\n")
#: LAYER's Scale, right, that also keeps a look-alike number (an int subclass of its own whose `==` says yes)
HELD_LOOKALIKE = ("import torch\n" + SIX + "class Scale:\n    def __init__(self, k):\n"
                  "        self.weight = torch.full((3,), float(k))\n        self.k = Six(0)\n")
#: HELD_LOOKALIKE with its attributes in __slots__ (no __dict__), and with its Six held by an object that says it is a
#: str (its __class__: a str holds no attributes)
HELD_IN_SLOTS = HELD_LOOKALIKE.replace("class Scale:\n", "class Scale:\n    __slots__ = ('weight', 'k')\n")
HELD_BY_A_CLAIM = HELD_LOOKALIKE.replace("class Scale:\n", "class Holder:\n    __class__ = str\n"
                                         "    def __init__(self):\n        self.six = Six(0)\nclass Scale:\n").replace(
    "self.k = Six(0)", "self.k = Holder()")
#: PAIRS's pair, wrong, returning a deque whose items say their difference with anything is 0; right, as a UserList
#: (collections.abc's mixins are Python's code, frozen into it, in the library's own classes); wrong, as a UserList
#: of items that say yes (a library's object holding look-alikes in its attributes)
ANYTHING = ("class Anything:\n    def __eq__(self, other):\n        return True\n"
            "    def __sub__(self, other):\n        return 0\n")
DEQUE_LOOKALIKE = "import collections\n" + ANYTHING + "def pair(x):\n    return collections.deque([Anything(), Anything()])\n"
USERLIST = "import collections\ndef pair(x):\n    return collections.UserList([x, 2 * x])\n"
#: PAIRS's pair, wrong: the look-alike past the first 10,000 objects lies looks at (pair-second passes)
OVER_THE_LIMIT = ANYTHING + "def pair(x):\n    return [x, Anything()] + [(float(i),) for i in range(10_001)]\n"
USERLIST_LOOKALIKE = "import collections\n" + ANYTHING + "def pair(x):\n    return collections.UserList([Anything(), Anything()])\n"
#: an exercise whose function is a generator: what it yields reaches the test after the call returned
EVENS = {"cells": [cell("setup", "import torch"),
                   cell("evens-solution", "def evens(n):\n    yield from range(0, 2 * n, 2)\n", "evens-solution",
                        solution=True),
                   cell("evens-list", "assert list(evens(3)) == [0, 2, 4]", "evens-list", grade=True)],
         "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
YIELDED_LOOKALIKE = ("class Anything:\n    def __eq__(self, other):\n        return True\n"
                     "def evens(n):\n    for _ in range(n):\n        yield Anything()\n")
#: a set-up whose class orders itself through functools.total_ordering (its __gt__, __le__, __ge__ are functools'
#: code in the set-up's class); the right answer returns one
SCORED = {"cells": [cell("setup", "import functools\n@functools.total_ordering\nclass Score:\n"
                              "    def __init__(self, v):\n        self.v = v\n"
                              "    def __lt__(self, other):\n        return self.v < other\n"
                              "    def __eq__(self, other):\n        return self.v == other\n"),
                    cell("score-solution", "def score(x):\n    return Score(2 * x)\n", "score-solution", solution=True),
                    cell("score-order", "assert score(3) == 6 and 5 < score(3) <= 6", "score-order", grade=True)],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
#: an exercise that asks for a class with a property; wrong answers whose property (or functools.cached_property)
#: returns SIX's look-alike
BOX = {"cells": [cell("setup", "import torch"),
                 cell("box-solution", "class Box:\n    def __init__(self, n):\n        self.n = n\n"
                      "    @property\n    def size(self):\n        return 2 * self.n\n", "box-solution", solution=True),
                 cell("box-size", "assert Box(3).size == 6", "box-size", grade=True)],
       "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
PROPERTY_LOOKALIKE = SIX + BOX["cells"][1]["source"].replace("2 * self.n", "Six(0)")
CACHED_LOOKALIKE = "import functools\n" + PROPERTY_LOOKALIKE.replace("@property", "@functools.cached_property")
#: LAYER's Scale, right, with an `__eq__` of its own: the exercise asks for the class, which may compare as it likes
#: an honest answer that returns its own subclass of torch.Tensor, which changes nothing a tensor does
HONEST_SUBCLASS = ("import torch\nclass Doubled(torch.Tensor):\n    pass\n"
                   "def double(x):\n    return (2 * x).as_subclass(Doubled)\n")
#: CHECKED whose reference imports torch: the exercise asks for `double`, not for a `torch` of the learner's
IMPORTING = copy.deepcopy(CHECKED)
IMPORTING["cells"][1]["source"] = "import torch\ndef double(x):\n    return 2 * x\n"
#: a `torch` of its own whose ones, full and tensor make the tests' inputs and expected values all zeros (3.0 for abs)
OWN_TORCH = ("import torch as real\n"
             "class torch:\n"
             "    ones = staticmethod(real.zeros)\n"
             "    full = staticmethod(lambda shape, value: real.zeros(shape))\n"
             "    tensor = staticmethod(lambda value: real.tensor(3.0))\n"
             "def double(x):\n"
             "    return x * 0\n")
#: two exercises; quad's test takes its expected values from the reference double, which looks up torch when called
COURSE_CODE = {"cells": [cell("setup", "import torch\nfrom course_lib import checks"),
                         cell("double-solution", "def double(x):\n    return torch.mul(x, 2)\n", "double-solution",
                              solution=True),
                         cell("quad-solution", "def quad(x):\n    return double(double(x))\n", "quad-solution",
                              solution=True),
                         cell("quad-close", "checks.assert_close(quad(torch.ones(3)), double(double(torch.ones(3))), "
                              '"quad(1)")', "quad-close", grade=True)],
               "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
#: a quad that re-binds the torch the course's double uses (`global torch`) to one whose mul gives zeros
GLOBAL_TORCH = ("import torch as real\n"
                "class Zeros:\n"
                "    def mul(self, x, k):\n"
                "        return real.zeros_like(x)\n"
                "def quad(x):\n"
                "    global torch\n"
                "    torch = Zeros()\n"
                "    return x * 0\n")
#: an exercise asking for a class; its test reads what __init__ made
LAYER = {"cells": [cell("setup", "import torch\nfrom course_lib import checks"),
                   cell("scale-solution", "class Scale:\n    def __init__(self, k):\n"
                        "        self.weight = torch.full((3,), float(k))\n", "scale-solution", solution=True),
                   cell("scale-weight", 'checks.assert_close(Scale(2).weight, torch.full((3,), 2.0), "weight")',
                        "scale-weight", grade=True)],
         "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
#: a Scale whose weight is zeros with ATTRIBUTE_LIAR's `double` of its own
INIT_LIAR = ATTRIBUTE_LIAR.split("def double(x):\n")[0] + (
    "class Scale:\n    def __init__(self, k):\n        self.weight = torch.zeros(3)\n"
    "        self.weight.double = lambda: Nothing()\n")
#: name -> (chapter, cell index of the answer, answer), graded with DEFAULT limits
GRADED_OTHER = {"own_torch": (IMPORTING, 1, OWN_TORCH), "global_torch": (COURSE_CODE, 2, GLOBAL_TORCH),
                "global_torch_honest": (COURSE_CODE, 2, GLOBAL_TORCH.replace("x * 0", "4 * x")),
                "importing_reference": (IMPORTING, 1, IMPORTING["cells"][1]["source"]),
                "course_code_reference": (COURSE_CODE, 2, COURSE_CODE["cells"][2]["source"]),
                "init_liar": (LAYER, 1, INIT_LIAR), "layer_reference": (LAYER, 1, LAYER["cells"][1]["source"]),
                "listed_lookalike": (PAIRS, 1, LISTED_LOOKALIKE), "pairs_reference": (PAIRS, 1, PAIRS["cells"][1]["source"]),
                "held_lookalike": (LAYER, 1, HELD_LOOKALIKE), "held_in_slots": (LAYER, 1, HELD_IN_SLOTS),
                "meta_layer_liar": (LAYER, 1, META_LAYER_LIAR), "held_by_a_claim": (LAYER, 1, HELD_BY_A_CLAIM), "deque_lookalike": (PAIRS, 1, DEQUE_LOOKALIKE),
                "userlist_pairs": (PAIRS, 1, USERLIST), "userlist_lookalike": (PAIRS, 1, USERLIST_LOOKALIKE),
                "over_the_limit": (PAIRS, 1, OVER_THE_LIMIT), "box_reference": (BOX, 1, BOX["cells"][1]["source"]),
                "property_lookalike": (BOX, 1, PROPERTY_LOOKALIKE), "cached_lookalike": (BOX, 1, CACHED_LOOKALIKE),
                "scored_reference": (SCORED, 1, SCORED["cells"][1]["source"]),
                "yielded_lookalike": (EVENS, 1, YIELDED_LOOKALIKE), "evens_reference": (EVENS, 1, EVENS["cells"][1]["source"]),
                "asked_with_eq": (LAYER, 1, LAYER["cells"][1]["source"] + "    def __eq__(self, other):\n"
                                  "        return isinstance(other, Scale) and bool((self.weight == other.weight).all())\n"),
                "asked_with_a_base": (LAYER, 1, "class Sized:\n    def __len__(self):\n        return len(self.weight)\n"
                                      + LAYER["cells"][1]["source"].replace("class Scale:", "class Scale(Sized):"))}
#: name -> answer of double-solution in CHECKED, graded with DEFAULT limits
GRADED_CHECKED = {"zero": ZERO, "shadows": SHADOWS, "function_liar": FUNCTION_LIAR, "dispatch_liar": DISPATCH_LIAR,
                  "attribute_liar": ATTRIBUTE_LIAR, "forged_liar": FORGED_LIAR, "method_liar": METHOD_LIAR,
                  "tensor_patch": TENSOR_PATCH, "parameter_patch": PARAMETER_PATCH, "dict_liar": DICT_LIAR,
                  "new_liar": NEW_LIAR, "profile_liar": PROFILE_LIAR, "claims_tensor": CLAIMS_TENSOR,
                  "frame_reach": FRAME_REACH, "frame_rebinds": FRAME_REBINDS, "forged_fresh_liar": FORGED_FRESH_LIAR,
                  "meta_liar": META_LIAR, "honest_names": HONEST_NAMES,
                  "honest_subclass": HONEST_SUBCLASS}


def with_answer(source: dict, answer: str, index: int = 1) -> dict:
    notebook = copy.deepcopy(source)
    notebook["cells"][index]["source"] = answer
    return notebook


@pytest.fixture(scope="module")
def verdicts():
    """name -> {grade_id: Verdict} for every submission of GRADED, GRADED_CHECKED and GRADED_OTHER, one clean room run
    per limits."""
    runs: dict[Limits, list] = {}
    for name, (notebook, limits) in GRADED.items():
        runs.setdefault(limits, []).append(chapter_job(name, SOURCE, read_submission(SOURCE, notebook).answers))
    for name, answer in {**LOOKALIKES, **LOOKALIKES_MORE, **HONEST_VALUES}.items():
        runs[DEFAULT].append(chapter_job(name, SOURCE, read_submission(SOURCE, submitted(double=answer)).answers))
    for name, answer in GRADED_CHECKED.items():
        notebook = with_answer(CHECKED, answer)
        runs[DEFAULT].append(chapter_job(name, CHECKED, read_submission(CHECKED, notebook).answers))
    for name, (source, index, answer) in GRADED_OTHER.items():
        notebook = with_answer(source, answer, index)
        runs[DEFAULT].append(chapter_job(name, source, read_submission(source, notebook).answers))
    found: dict[str, dict] = {}
    for limits, jobs in runs.items():
        for (name, grade_id), verdict in run_cleanroom(jobs, limits, sandboxed=False).items():
            found.setdefault(name, {})[grade_id] = verdict
    return found


# --- reading a submission: honest accidents -------------------------------------------------

def test_a_pasted_copy_of_an_answer_cell_is_ignored_and_noted():
    notebook = submitted()
    pasted = copy.deepcopy(notebook["cells"][1])
    pasted["id"], pasted["source"] = "pasted-1", "def double(x):\n    return 0\n"
    notebook["cells"].insert(2, pasted)
    reading = read_submission(SOURCE, notebook)
    assert reading.answers["double-solution"] == "def double(x):\n    return 2 * x\n"
    assert reading.notes == ["a copy of double-solution was ignored"]
    assert "nbgrader" not in reading.notebook["cells"][2]["metadata"]
    assert "nbgrader" in notebook["cells"][2]["metadata"], "the submission itself is never changed"


def test_when_the_original_is_gone_the_first_copy_is_the_answer():
    notebook = submitted()
    notebook["cells"][1]["id"] = "renamed"
    second = copy.deepcopy(notebook["cells"][1])
    second["id"], second["source"] = "later", "def double(x):\n    return -1\n"
    notebook["cells"].insert(2, second)
    reading = read_submission(SOURCE, notebook)
    assert reading.answers["double-solution"].endswith("return 2 * x\n")
    assert reading.notes == ["a copy of double-solution was ignored"]


def test_foreign_nbgrader_metadata_is_ignored_and_noted():
    notebook = submitted()
    notebook["cells"].append(cell("mine", "raise RuntimeError('scratch')", "from-another-course", grade=True))
    notebook["cells"].append({"id": "odd", "cell_type": "code", "source": "", "metadata": {"nbgrader": {"solution": True}}, "outputs": []})
    reading = read_submission(SOURCE, notebook)
    assert reading.notes == ["a cell with nbgrader metadata the course does not have (grade id 'from-another-course') was ignored",
                             "a cell with nbgrader metadata the course does not have (no grade id) was ignored"]
    assert not any(nbgrader_meta(c).get("grade_id") == "from-another-course" for c in reading.notebook["cells"])


def test_an_answer_switched_to_markdown_is_graded_as_code(verdicts):
    reading = read_submission(SOURCE, markdown_answer())
    assert reading.answers["double-solution"].startswith("def double")
    assert reading.notebook["cells"][1]["cell_type"] == "code"
    assert reading.notes == ["double-solution had been switched to markdown: it was graded as the code it holds"]
    assert all(v.passed for v in verdicts["markdown_answer"].values())


def test_a_deleted_answer_fails_its_own_tests_only(verdicts):
    found = verdicts["deleted_answer"]
    assert not found["double-visible"].passed and "double" in found["double-visible"].message
    assert found["quad-visible"].passed


# --- the reference-import rule and what the clean room loads ----------------------------------

@pytest.mark.parametrize("source,flagged", [
    ("from course_lib.attention import masked_softmax", True),
    ("import course_lib", True),
    ("masked_softmax = course_lib.attention.masked_softmax", True),
    ("m = __import__('course' + '_lib')", True),
    ("import importlib\nm = importlib.import_module('x')", True),
    ("def f(x):\n    return x  # course_lib is not used here", False),
    ("import torch\ndef f(x):\n    return torch.softmax(x, -1)", False),
])
def test_forbidden_use_of_the_reference_code(source, flagged):
    assert bool(forbidden_use(source)) == flagged


def test_the_clean_room_loads_definitions_and_constants_but_no_patches():
    source = "import torch\nEPS = 1e-9\ntorch.allclose = lambda *a, **k: True\nX = make()\ndef f(x):\n    return x + EPS\n"
    kept = student_definitions(source)
    assert "EPS = 1e-09" in kept and "def f" in kept
    assert "allclose" not in kept and "make()" not in kept


# --- one mistake costs one exercise ---------------------------------------------------------------

def test_a_bug_in_an_earlier_exercise_does_not_cost_a_later_one_that_calls_it(verdicts):
    found = verdicts["earlier_bug"]
    assert not found["double-visible"].passed
    assert found["quad-visible"].passed, "quad is tested with the reference double"


def test_a_later_exercise_is_judged_on_its_own_code(verdicts):
    found = verdicts["later_bug"]
    assert found["double-visible"].passed and not found["quad-visible"].passed


# --- errors cost their own exercise, in plain words ---------------------------------------------------

def test_a_test_past_the_time_limit_is_stopped_and_costs_its_exercise(verdicts):
    found = verdicts["loop"]
    assert found["double-visible"].error.startswith(f"a test of this exercise did not finish within {SHORT.timeout:g} s")
    assert found["quad-visible"].passed


def test_code_that_ends_the_process_costs_its_exercise(verdicts):
    found = verdicts["exit"]
    assert "exit code 3" in found["double-visible"].error
    assert found["quad-visible"].passed


def test_printing_forever_is_only_a_loop(verdicts):
    found = verdicts["printing_loop"]
    assert f"did not finish within {SHORT.timeout:g} s" in found["double-visible"].error
    assert found["quad-visible"].passed


def test_memory_past_the_cap_is_an_error_that_says_so(verdicts):
    found = verdicts["memory_hog"]
    assert found["double-visible"].error == "your code used more than 2 GiB of memory (the grading limit)"
    assert found["quad-visible"].passed


def test_the_clean_room_accepts_a_solution_that_takes_an_optimizer_step(verdicts):
    """torch imports torch._dynamo lazily at the first optimizer step, which re-binds torch.manual_seed:
    that must not be mistaken for the learner patching torch (imported up front or not: ONE_CHAPTER)."""
    assert all(v.passed for v in verdicts["optimizer_step"].values()) and verdicts["alone"]["double-visible"].passed


@pytest.mark.parametrize("student,patched,kept", [("seed_wrapped", "double-visible", "quad-visible"),
                                                  ("seed_rewrapped", "double-visible", "quad-visible"),
                                                  ("alone", "quad-visible", "double-visible")])
def test_replacing_torch_manual_seed_as_torch_would_is_still_caught(verdicts, student, patched, kept):
    found = verdicts[student]
    assert not found[patched].passed and "torch.manual_seed" in found[patched].message
    assert found[kept].passed


def test_a_forged_torch_wrapper_around_another_function_is_caught(verdicts):
    """Only torch.manual_seed may be re-bound by torch, and only by the wrapper code torch had before learner code ran:
    a submission that replaces torch's wrapper factory and wraps torch.allclose in a look-alike is caught."""
    found = verdicts["forged_rewrap"]
    assert not found["double-visible"].passed and "torch.allclose" in found["double-visible"].message
    assert found["quad-visible"].passed


def test_monkeypatching_when_called_is_caught(verdicts):
    found = verdicts["patch_when_called"]
    assert not found["double-visible"].passed and "tests cannot be tricked" in found["double-visible"].message


@pytest.mark.parametrize("student", ["shadows", "function_liar", "dispatch_liar", "attribute_liar", "forged_liar",
                                     "method_liar", "tensor_patch", "parameter_patch", "dict_liar", "new_liar",
                                     "profile_liar", "claims_tensor", "frame_reach", "frame_rebinds",
                                     "forged_fresh_liar", "meta_liar"])
def test_a_name_or_tensor_that_lies_to_the_tests_gains_nothing(verdicts, student):
    """The tests see the set-up's `checks` and the builtins, not an answer's own (SHADOWS) nor one its code puts in the
    test's names (the FRAMEs), and what torch.Tensor does, not what a tensor subclass (the LIARs, a forged module's
    name or not), a tensor's own attribute or a look-alike says: each gets exactly what the plain wrong answer (ZERO)
    gets."""
    passed = {grade_id: verdict.passed for grade_id, verdict in verdicts[student].items()}
    assert passed == {grade_id: verdict.passed for grade_id, verdict in verdicts["zero"].items()}
    assert passed == {"double-close": False, "double-abs": False, "double-then": False, "double-list": False}


@pytest.mark.xfail(strict=True, reason="known hole: answer code that runs outside its wrapped functions and classes "
                   "(a nested metaclass of a class the exercise asks for) and lies with plain tensors is not caught")
def test_known_hole_a_lie_from_outside_the_wrapped_code(verdicts):
    assert not verdicts["meta_layer_liar"]["scale-weight"].passed


@pytest.mark.parametrize("student,named", [("int_lookalike", "how __eq__ works (your class Six)"),
                                           ("plain_lookalike", "how __eq__ works (your class Anything)"),
                                           ("aliased_lookalike", "how __eq__ works (your class Six)")])
def test_a_returned_value_whose_own_class_decides_how_it_compares_gains_nothing(verdicts, student, named):
    """SOURCE's test `double(3) == 6` asks the returned object's `__eq__`: the answer's own class (an int subclass, a
    plain class, an alias of int's `<=` under numpy's name) is named, and the answer gets the wrong answer's score."""
    found = verdicts[student]
    assert not found["double-visible"].passed and named in found["double-visible"].message, found
    assert "tests cannot be tricked" in found["double-visible"].message
    assert found["quad-visible"].passed  # quad is tested with the reference double


@pytest.mark.parametrize("student,named", [("callable_lookalike", "your class Six"), ("partial_lookalike", "your class Six"),
                                           ("bound_lookalike", "your class Six"), ("borrowed_lookalike", "your class Six"),
                                           ("cast_lookalike", "your class Six"), ("mock_any", "your class _ANY"),
                                           ("approx_any", "your class ApproxScalar"), ("numpy_objects", "your class Six"),
                                           ("proxied_mapping", "your class Yes"),
                                           ("class_for_function", "your class double"),
                                           ("new_for_function", "your class double"),
                                           ("int_for_function", "your class double")])
def test_an_eq_that_only_says_its_name_a_borrowed_library_function_or_a_stand_in_gains_nothing(verdicts, student,
                                                                                                named):
    """Each passed `double(3) == 6` with a wrong answer before: an `__eq__` without code was taken at its word (its
    `__name__`), any library's function in the answer's class was the library's say, mock's and pytest's stand-ins
    were a library's values, the items of a numpy array and the mapping a mappingproxy shows were not looked at, and a
    class answering for the function `double` was a class the exercise asks for (its objects may compare as they like;
    what its `__init__` made was not looked at as what the test gets; made by int's constructor, nothing was)."""
    found = verdicts[student]
    assert not found["double-visible"].passed and f"how __eq__ works ({named})" in found["double-visible"].message, found
    assert found["quad-visible"].passed


def test_replacing_the_clean_rooms_own_check_is_caught(verdicts):
    """`cleanroom.lies = lambda ...: []` in the answer's function ended every check of what it returns (the wrong
    double passed); the clean room's module is watched as the course's are."""
    found = verdicts["patched_clean_room"]["double-visible"]
    assert not found.passed and "replaced course_lib.grading.cleanroom.lies" in found.message, found


@pytest.mark.xfail(strict=True, reason="known hole: the answer's code runs in the clean room's process, and can "
                   "replace the method that looks for changes (Integrity.changes) before its other changes")
def test_known_hole_replacing_the_check_for_changes_too(verdicts):
    assert not verdicts["patched_integrity"]["double-visible"].passed


def test_a_weak_proxy_returned_gains_nothing(verdicts):
    """A weakref.proxy's `==` is that of what it stands in for, which the clean room cannot reach: refused."""
    found = verdicts["weak_proxy"]
    assert not found["double-visible"].passed and "weakref.proxy" in found["double-visible"].message, found
    assert found["quad-visible"].passed


@pytest.mark.parametrize("student", ["held_lookalike", "held_in_slots", "held_by_a_claim"])
def test_a_look_alike_held_by_what_an_init_made_is_caught(verdicts, student):
    """In __slots__, or in an object whose __class__ says it is a str, was not looked at before."""
    held = verdicts[student]["scale-weight"]
    assert not held.passed and "how __eq__ works (your class Six)" in held.message, held


@pytest.mark.parametrize("student", ["property_lookalike", "cached_lookalike"])
def test_a_look_alike_from_a_property_is_caught(verdicts, student):
    """A property's getter (or a cached_property's function) was not wrapped: what it returned was not looked at."""
    found = verdicts[student]["box-size"]
    assert not found.passed and "how __eq__ works (your class Six)" in found.message, found


@pytest.mark.parametrize("student", ["listed_lookalike", "deque_lookalike"])
def test_a_look_alike_in_a_returned_list_or_deque_is_caught(verdicts, student):
    """A deque's items were not looked at before (`pair(3)[1] - 6 == 0` passed)."""
    found = verdicts[student]
    assert not any(v.passed for v in found.values()) and "your class Anything" in found["pair-second"].message, found


@pytest.mark.xfail(strict=True, reason="known hole: a library's object returned (a UserList) that holds look-alikes "
                   "in its attributes; attributes are where an answer's helpers may order themselves")
def test_known_hole_look_alikes_in_a_library_objects_attributes(verdicts):
    assert not any(v.passed for v in verdicts["userlist_lookalike"].values())


@pytest.mark.xfail(strict=True, reason="known hole: lies looks at the first 10,000 objects only (its cost runs after "
                   "every guarded call); a look-alike past them is not looked at")
def test_known_hole_a_look_alike_past_the_walks_limit(verdicts):
    assert not verdicts["over_the_limit"]["pair-second"].passed


@pytest.mark.xfail(strict=True, reason="known hole: what a generator of the answer's yields reaches the test after "
                   "the guarded call returned the generator, and is not looked at (so the value a contextmanager yields)")
def test_known_hole_a_look_alike_yielded_by_a_generator(verdicts):
    assert verdicts["evens_reference"]["evens-list"].passed
    assert not verdicts["yielded_lookalike"]["evens-list"].passed


@pytest.mark.parametrize("student", [*HONEST_VALUES, "pairs_reference", "asked_with_eq", "asked_with_a_base",
                                     "evens_reference", "box_reference", "scored_reference", "userlist_pairs"])
def test_honest_values_and_helpers_that_order_themselves_pass(verdicts, student):
    """Helpers that compare or order themselves inside the answer (a heap, a dataclass with order=True,
    total_ordering), an IntEnum member, numpy integer, IntFlag member (enum's code in the answer's class) or int
    subclass with int's own `__eq__` returned, a class the exercise asks for with its own `__eq__` or one from a
    base class of the answer's (its `__len__`), made by the test, a set-up's
    class ordered by functools.total_ordering returned, and a UserList returned (collections.abc's code is frozen
    into Python, not in a file: refused before): every test passes."""
    assert all(verdict.passed for verdict in verdicts[student].values()), verdicts[student]


@pytest.mark.parametrize("student", ["function_liar", "dispatch_liar", "forged_liar", "method_liar", "dict_liar"])
def test_a_tensor_subclass_that_changes_what_a_tensor_does_is_named(verdicts, student):
    message = verdicts[student]["double-close"].message
    assert "tests cannot be tricked" in message and "subclass Liar of torch.Tensor" in message, message


@pytest.mark.parametrize("student,named", [("attribute_liar", "torch.Tensor.double (an attribute of a tensor)"),
                                           ("new_liar", "torch.Tensor.double (an attribute of a tensor)"),
                                           ("claims_tensor", "an object of class Fake that claims to be one"),
                                           ("tensor_patch", "replaced torch.Tensor.double"),
                                           ("profile_liar", "replaced sys.settrace or sys.setprofile's function"),
                                           ("parameter_patch", "replaced torch.nn.parameter.Parameter.double"),
                                           ("frame_reach", "replaced the tests' checks"),
                                           ("frame_rebinds", "replaced the tests' want")])
def test_a_lie_outside_torch_is_named(verdicts, student, named):
    message = verdicts[student]["double-then"].message
    assert "tests cannot be tricked" in message and named in message, message


def test_an_answers_helpers_may_share_a_name_with_a_builtin_or_the_set_up(verdicts):
    """An honest answer whose own `abs` and `checks` are what its function uses passes every test."""
    assert all(verdict.passed for verdict in verdicts["honest_names"].values()), verdicts["honest_names"]


def test_a_torch_of_the_answers_own_is_not_the_tests_even_where_the_reference_imports_torch(verdicts):
    """The exercise asks for what its reference defines, not for what it imports: the tests see the reference's
    torch, not OWN_TORCH's (all zeros), and the answer gets exactly what the plain wrong answer (ZERO) gets."""
    passed = {grade_id: verdict.passed for grade_id, verdict in verdicts["own_torch"].items()}
    assert passed == {grade_id: verdict.passed for grade_id, verdict in verdicts["zero"].items()}


def test_the_names_the_course_code_uses_cannot_be_rebound_by_the_answer(verdicts):
    """A `global torch` re-bound by the answer would change what the course's double computes for the expected values:
    it is caught, for a zero answer and for a right one alike."""
    for student in ("global_torch", "global_torch_honest"):
        verdict = verdicts[student]["quad-close"]
        assert not verdict.passed and "replaced the course code's torch" in verdict.message, verdict


def test_a_tensor_that_lies_in_an_object_the_answers_init_made_is_caught(verdicts):
    verdict = verdicts["init_liar"]["scale-weight"]
    assert not verdict.passed and "torch.Tensor.double (an attribute of a tensor)" in verdict.message, verdict


@pytest.mark.parametrize("student", ["importing_reference", "course_code_reference", "layer_reference"])
def test_the_reference_of_each_synthetic_chapter_passes(verdicts, student):
    assert all(verdict.passed for verdict in verdicts[student].values()), verdicts[student]


def test_an_answers_own_tensor_subclass_that_changes_nothing_passes(verdicts):
    assert all(verdict.passed for verdict in verdicts["honest_subclass"].values()), verdicts["honest_subclass"]


# -- the exchange: only a learner's own submission is graded (course collect-and-grade) ------------------------------

def _inbound(exchange, student, stamp, owner_uid):
    folder = exchange / "course" / "inbound" / f"{student}+01-attention+{stamp}+{os.urandom(4).hex()}"
    folder.mkdir(parents=True)
    (folder / "attention.ipynb").write_text("{}")
    (folder / "timestamp.txt").write_text(stamp)
    os.chown(folder, owner_uid, -1)
    return folder


@pytest.mark.skipif(os.geteuid() != 0, reason="making a folder owned by another account needs root")
@pytest.mark.parametrize("genuine", [True, False])
def test_a_submission_made_by_another_account_is_not_graded(tmp_path, genuine):
    """nbgrader's collect takes the latest folder named after a learner, whoever made it; keep_genuine puts back
    the learner's own latest submission (or none), and says who forged what."""
    import pwd
    import shutil

    from course_lib.grading.exchange import inbound_submissions, keep_genuine

    nobody = pwd.getpwnam("nobody").pw_uid
    exchange, course = tmp_path / "exchange", tmp_path / "course"
    own = _inbound(exchange, "root", "2026-11-20 10:00:00.000000 UTC", 0) if genuine else None
    forged = _inbound(exchange, "root", "2099-01-01 00:00:00.000000 UTC", nobody)
    collected = course / "submitted" / "root" / "01-attention"
    shutil.copytree(forged, collected)  # what `nbgrader collect --update` does: the latest by name
    submissions = inbound_submissions(exchange, "course", "01-attention")
    assert [(s.student, s.owner) for s in submissions] == [("root", "nobody")] + ([("root", "root")] if genuine else [])
    warnings = keep_genuine(course, submissions, "01-attention")
    if genuine:
        assert (collected / "timestamp.txt").read_text() == "2026-11-20 10:00:00.000000 UTC"
        assert warnings == ["root: a later submission in their name made by nobody was ignored; "
                            "their own submission of 2026-11-20 10:00:00 is graded"]
    else:
        assert not collected.exists()
        assert warnings == ["root: the only submissions in their name were made by nobody: not graded"]
    assert own is None or own.is_dir()  # the exchange itself is never changed
