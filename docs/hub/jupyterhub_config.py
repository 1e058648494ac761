"""JupyterHub for the course: learners and instructors as Unix users, nbgrader's exchange on the same machine.

Copy to /etc/jupyterhub/jupyterhub_config.py, fill in the users, and start the hub as root:
``jupyterhub -f /etc/jupyterhub/jupyterhub_config.py`` (docs/hub.md walks through it).
The course's end-to-end test (tests/system/test_hub.py) loads this very file and changes only ports,
state folders, the users and the spawner's view of a private interpreter.
"""
c = get_config()  # noqa: F821 - injected by traitlets

COURSE = "/opt/attention-to-decoding"  # the course, cloned and set up with `make setup`, readable by everyone

# Behind a TLS-terminating reverse proxy (nginx, Caddy); or set c.JupyterHub.ssl_key / ssl_cert.
c.JupyterHub.bind_url = "http://127.0.0.1:8000"

# JupyterHub's proxy, installed from npm by `make hub` (pinned by docs/hub/package-lock.json).
c.ConfigurableHTTPProxy.command = [f"{COURSE}/.venv/chp/node_modules/.bin/configurable-http-proxy"]

# Learners log in with their Unix accounts (PAM); each server runs as its learner's own Unix user.
c.JupyterHub.authenticator_class = "pam"
c.Authenticator.allowed_users = set()  # e.g. {"ada", "alan"}; or c.PAMAuthenticator.allowed_groups = {"course"}
c.Authenticator.admin_users = {"instructor"}

# The course's environment for every server: JupyterLab with the course's widgets, nbgrader's
# Assignments tab, the `course` command (course check NN, and collect-and-grade for instructors).
c.Spawner.cmd = [f"{COURSE}/.venv/bin/jupyterhub-singleuser"]
c.Spawner.default_url = "/lab"
c.Spawner.notebook_dir = "~"
c.Spawner.environment = {
    "PATH": f"{COURSE}/.venv/bin:/usr/local/bin:/usr/bin:/bin",
    "OMP_NUM_THREADS": "1",  # many learners share the cores: one thread each keeps the machine responsive
}

# Servers and the proxy stop with the hub; idle servers can be culled with jupyterhub-idle-culler.
c.JupyterHub.cleanup_servers = True
c.JupyterHub.cleanup_proxy = True
