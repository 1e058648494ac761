"""nbgrader settings for instructors who run nbgrader directly (formgrader, `nbgrader ...`).

`course release`, `course grade` and `course check` use the same settings: they live in
course_lib.grading.configure so there is one source of truth.
"""
from course_lib.grading import configure

configure(get_config())  # noqa: F821  (get_config is injected by traitlets)
