"""The instructor's course folder: copy to ~/course/nbgrader_config.py and run nbgrader and
``course collect-and-grade`` from ~/course. Releases come from the installed course's notebooks/;
nbgrader's submitted/, feedback/ and gradebook land in ~/course.
"""
from course_lib.grading import configure_course_folder

configure_course_folder(get_config())  # noqa: F821 - injected by traitlets
