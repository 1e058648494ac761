"""Learner-facing checks: the visible test cells call these for instant, specific feedback.

A failed check raises ``CheckFailed`` (an ``AssertionError``) whose message says what is
wrong, with numbers. ``core`` holds the generic assertions and the tolerance policy
(``RTOL``, ``ATOL``); each chapter's checks live in their own module and are re-exported
here, so notebooks write ``checks.check_masked_softmax(masked_softmax)``. Every ``check_*`` raises an unfinished
exercise's ``NotImplementedError`` as ``NotWrittenYet`` (``core.says_unfinished``).
"""
from .core import *  # noqa: F401,F403
from .core import ATOL, RTOL, CheckFailed, NotWrittenYet, says_unfinished  # noqa: F401  (explicit for readers and linters)
from .ch01 import *  # noqa: F401,F403
from .ch02 import *  # noqa: F401,F403
from .ch03 import *  # noqa: F401,F403
from .ch04 import *  # noqa: F401,F403
from .ch05 import *  # noqa: F401,F403
from .ch06 import *  # noqa: F401,F403
from .ch07 import *  # noqa: F401,F403
from .ch08 import *  # noqa: F401,F403
from .ch09 import *  # noqa: F401,F403
from .ch10 import *  # noqa: F401,F403
from .ch11 import *  # noqa: F401,F403
from .ch12 import *  # noqa: F401,F403
from .ch13 import *  # noqa: F401,F403
from .ch14 import *  # noqa: F401,F403
from .ch15 import *  # noqa: F401,F403
from .ch16 import *  # noqa: F401,F403

globals().update({name: says_unfinished(value) for name, value in list(globals().items())
                  if name.startswith("check_") and callable(value)})
