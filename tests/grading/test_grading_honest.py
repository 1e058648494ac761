"""The clean room's checks against cheating, met by HONEST answers: a right answer written differently from the
reference, or with ordinary habits (helpers, caches, warnings, progress bars, seeding, dataclasses, modules with
buffers and hooks, torch.compile, torch.func), passes every test. The expected verdict is the exercise's own
contract (the answer computes what the tests ask), not the grader's output.

The ``xfail(strict=True)`` cases are honest answers the clean room wrongly refuses today (found by review); the
comment of each names the message it gets. Remove the marker with the fix: the test then guards it."""
from __future__ import annotations

import pytest

from course_lib.answers import student_definitions
from course_lib.grading.runner import chapter_job, run_cleanroom
from course_lib.grading.submission import read_submission

from tests.grading.test_grading_rules import CHECKED, DEFAULT, with_answer

T = "import torch\n"
#: name -> an honest, right answer of double-solution in CHECKED (tests: a tensor in, twice it out)
HONEST = {
    "global_counter": T + "CALLS = 0\ndef double(x):\n    global CALLS\n    CALLS += 1\n    return 2 * x\n",
    "module_cache": T + "_CACHE = {}\ndef double(x):\n    key = tuple(x.shape)\n    if key not in _CACHE:\n"
                        "        _CACHE[key] = 2.0\n    return _CACHE[key] * x\n",
    "lazy_global": T + "def double(x):\n    global _TWO\n    _TWO = torch.tensor(2.0)\n    return _TWO * x\n",
    "lru_cache": T + "import functools\n@functools.lru_cache(maxsize=None)\ndef factor():\n    return 2.0\n"
                     "def double(x):\n    return factor() * x\n",
    "generator": T + "def parts(x):\n    yield x\n    yield x\ndef double(x):\n    return sum(parts(x))\n",
    "parameter": T + "def double(x):\n    return torch.nn.Parameter(2 * x)\n",
    "requires_grad": T + "def double(x):\n    w = torch.tensor(2.0, requires_grad=True)\n    return w * x\n",
    "tensor_note": T + "def double(x):\n    out = 2 * x\n    out.note = 'doubled'\n    return out\n",
    "warns": T + "import warnings\ndef double(x):\n    warnings.warn('doubling', stacklevel=2)\n    return 2 * x\n",
    "reimports": T + "import torch.nn.functional as F\nimport numpy as np\ndef double(x):\n"
                     "    zero = torch.from_numpy(np.zeros(x.shape, dtype=np.float32))\n"
                     "    return F.relu(x) * 2 - F.relu(-x) * 2 + zero\n",
    "tqdm": T + "from tqdm.auto import tqdm\ndef double(x):\n    for _ in tqdm(range(3)):\n        pass\n"
                "    return 2 * x\n",
    "seeding": T + "import random\nimport numpy as np\ndef double(x):\n    random.seed(0)\n    np.random.seed(0)\n"
                   "    torch.manual_seed(0)\n    return 2 * x\n",
    "threads": T + "def double(x):\n    n = torch.get_num_threads()\n    torch.set_num_threads(1)\n    out = 2 * x\n"
                   "    torch.set_num_threads(n)\n    return out\n",
    "compile": T + "@torch.compile(backend='eager')\ndef twice(x):\n    return 2 * x\ndef double(x):\n"
                   "    return twice(x)\n",
    "torch_func": T + "from torch.func import vmap, grad\ndef double(x):\n"
                      "    return vmap(grad(lambda t: (t * t).sum()))(x.reshape(-1, 1)).reshape(x.shape)\n",
    "dataclass_and_namedtuple": T + "from dataclasses import dataclass\nfrom typing import NamedTuple\n"
                                    "@dataclass(frozen=True, slots=True)\nclass Cfg:\n    k: float = 2.0\n"
                                    "class Pair(NamedTuple):\n    a: torch.Tensor\n    b: torch.Tensor\n"
                                    "def double(x):\n    p = Pair(x, x)._replace(b=x)\n"
                                    "    return Cfg().k / 2 * (p.a + p.b)\n",
    "static_class_and_slots": T + "class Doubler:\n    __slots__ = ('k',)\n    def __init__(self):\n"
                                  "        self.k = 2\n"
                                  "    @staticmethod\n    def apply(x):\n        return x\n    @classmethod\n"
                                  "    def make(cls):\n"
                                  "        return cls()\n    @property\n    def value(self):\n        return self.k\n"
                                  "def double(x):\n    return Doubler.make().value * Doubler.apply(x)\n",
    "module_with_buffer_hooks": T + "class Double(torch.nn.Module):\n    def __init__(self):\n"
                                    "        super().__init__()\n"
                                    "        self.register_buffer('k', torch.tensor(2.0))\n        self.double = 2\n"
                                    "        self.float = torch.tensor(2.0)\n"
                                    "        self.register_forward_hook(lambda m, i, o: None)\n"
                                    "    def forward(self, x):\n        return self.k * x\n"
                                    "def double(x):\n    return Double()(x)\n",
    "subclass_new_method": T + "class Doubled(torch.Tensor):\n    def describe(self):\n        return 'doubled'\n"
                               "def double(x):\n    return (2 * x).as_subclass(Doubled)\n",
    "autograd_function": T + "class Twice(torch.autograd.Function):\n    @staticmethod\n    def forward(ctx, x):\n"
                             "        return 2 * x\n    @staticmethod\n    def backward(ctx, g):\n"
                             "        return 2 * g\n"
                             "def double(x):\n    return Twice.apply(x)\n",
    "profiler": T + "def double(x):\n    with torch.profiler.profile() as prof:\n        out = 2 * x\n    return out\n",
    # a warning aimed at the caller's caller lands in the test cell's globals, where Python adds __warningregistry__
    # (refused before review revgrade: "your code replaced the tests' __warningregistry__")
    "warns_two_up": T + "import warnings\ndef double(x):\n    warnings.warn('doubling', stacklevel=3)\n"
                        "    return 2 * x\n",
    # "definitions ... constants" (notebook 00): an annotated constant, a tuple of constants and a lambda that calls
    # torch (dropped by student_definitions before review revgrade: "NameError: name 'FACTOR' is not defined")
    "annotated_constant": T + "FACTOR: float = 2.0\ndef double(x):\n    return FACTOR * x\n",
    "tuple_of_constants": T + "A, B = 1.0, 1.0\ndef double(x):\n    return (A + B) * x\n",
    "lambda_calling_torch": T + "double = lambda x: torch.mul(x, 2)\n",
    # a tensor subclass of the answer's own that only prints itself differently changes nothing the tests see
    "subclass_repr": T + "class Named(torch.Tensor):\n    def __repr__(self):\n        return 'named'\n"
                         "def double(x):\n    return (2 * x).as_subclass(Named)\n",
}
#: name -> an honest, right answer the clean room wrongly refuses today (each comment: why, and what the refusal says)
WRONGLY_REFUSED = {
    # torch.fx patches math's functions while it traces, and the learner's traced function is checked mid-trace:
    # "your code replaced math.acos, math.acosh, math.asin: tests cannot be tricked"
    "fx_trace": T + "import torch.fx\ndef twice(x):\n    return 2 * x\n"
                    "def double(x):\n    return torch.fx.symbolic_trace(twice)(x)\n",
    # and fx's Proxy reaches torch's functions through __torch_function__, which the tests run with off
    # (DisableTorchFunctionSubclass): "mul(): argument 'input' (position 1) must be Tensor, not Proxy" (chapter 01's
    # attention with torch.softmax traced: the same, 4 of 5 tests lost)
    "fx_trace_torch_op": T + "import torch.fx\ndef twice(x):\n    return torch.mul(x, 2)\n"
                             "def double(x):\n    return torch.fx.symbolic_trace(twice)(x)\n",
    # the same for torch.export, which patches builtins.max/min and math.pow while it traces a learner's forward:
    # "your code replaced builtins.max, builtins.min, math.pow: tests cannot be tricked"
    "export": T + "class M(torch.nn.Module):\n    def forward(self, x):\n        return 2 * x\n"
                  "def double(x):\n    return torch.export.export(M(), (x,)).module()(x)\n",
    # TorchScript reads the function's source, which an answer compiled from a string has not (Jupyter has it):
    # "your answer could not be loaded: OSError: Can't get source for <function twice ...>"
    "jit_script": T + "@torch.jit.script\ndef twice(x: torch.Tensor) -> torch.Tensor:\n    return 2 * x\n"
                      "def double(x):\n    return twice(x)\n",
}


@pytest.fixture(scope="module")
def honest_verdicts():
    """name -> {grade_id: Verdict} for HONEST and WRONGLY_REFUSED, graded in one clean room run."""
    answers = {**HONEST, **WRONGLY_REFUSED}
    jobs = [chapter_job(name, CHECKED, read_submission(CHECKED, with_answer(CHECKED, answer)).answers)
            for name, answer in answers.items()]
    found: dict[str, dict] = {}
    for (name, grade_id), verdict in run_cleanroom(jobs, DEFAULT, sandboxed=False).items():
        found.setdefault(name, {})[grade_id] = verdict
    return found


@pytest.mark.parametrize("student", sorted(HONEST))
def test_an_honest_right_answer_passes_every_test(honest_verdicts, student):
    verdicts = honest_verdicts[student]
    assert len(verdicts) == 4 and all(verdict.passed for verdict in verdicts.values()), verdicts


@pytest.mark.xfail(strict=True, reason="the clean room refuses these honest answers today (review revgrade)")
@pytest.mark.parametrize("student", sorted(WRONGLY_REFUSED))
def test_an_honest_right_answer_the_clean_room_refuses_today_passes(honest_verdicts, student):
    verdicts = honest_verdicts[student]
    assert len(verdicts) == 4 and all(verdict.passed for verdict in verdicts.values()), verdicts


def test_the_constants_a_learner_writes_are_kept_as_definitions():
    """Oracle: each line is a constant or a definition that runs nothing at definition time."""
    for source, name in [("FACTOR: float = 2.0\n", "FACTOR"), ("A, B = 1.0, 2.0\n", "B"),
                         ("double = lambda x: max(x, 2 * x)\n", "double")]:
        scope: dict = {}
        exec(student_definitions(source), scope)
        assert name in scope, (source, student_definitions(source))
