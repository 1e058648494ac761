"""nbgrader's settings for everyone on the hub: copy to /etc/jupyter/nbgrader_config.py.

Learners' Assignments tab (fetch, submit, fetch feedback) and the instructor's commands both read
it. The exchange folder must exist, owned by root, mode 1777 (nbgrader's own requirement):
``mkdir -p /srv/nbgrader/exchange && chmod 1777 /srv/nbgrader/exchange``.
"""
c = get_config()  # noqa: F821 - injected by traitlets
c.CourseDirectory.course_id = "attention-to-decoding"
c.Exchange.root = "/srv/nbgrader/exchange"
