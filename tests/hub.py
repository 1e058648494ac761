"""A real JupyterHub for the end-to-end test: Unix users, the hub and its proxy, each user's server over HTTP.

``Hub`` starts JupyterHub (from the course's virtual environment, configurable-http-proxy from npm)
as root, bound to 127.0.0.1, with the course's documented configuration (docs/hub/) and a test
overlay (ports, state folder, the users, an API service for the test). Everything the test does
afterwards goes through HTTP: the hub's REST API, and each user's single-user server (its contents
API, nbgrader's assignment handlers, and a kernel for commands the user would type).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
PROXY = Path(sys.prefix) / "chp" / "node_modules" / ".bin" / "configurable-http-proxy"
COURSE_ID = "attention-to-decoding"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def missing_requirements() -> str:
    """Why the hub test cannot run here, or ''."""
    if sys.platform != "linux":
        return "the hub test needs Linux"
    if os.geteuid() != 0:
        return "the hub test creates Unix users: it runs as root (as CI does)"
    if shutil.which("useradd") is None:
        return "the hub test needs useradd"
    if not PROXY.exists():
        return f"configurable-http-proxy is not installed ({PROXY}): run `make hub`"
    try:
        import jupyterhub  # noqa: F401
    except ImportError:
        return "jupyterhub is not installed"
    return ""


def create_user(name: str, home: Path) -> pwd.struct_passwd:
    subprocess.run(["useradd", "--create-home", "--home-dir", str(home), "--shell", "/bin/bash", "--user-group", name],
                   check=True, capture_output=True)
    return pwd.getpwnam(name)


def processes_of(name: str) -> list[str]:
    """The command lines of every process of Unix user ``name`` (read from /proc)."""
    try:
        uid = pwd.getpwnam(name).pw_uid
    except KeyError:
        return []
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and proc.stat().st_uid == uid:
                command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{proc.name} {command}")
        except OSError:  # it ended meanwhile
            continue
    return found


def remove_user(name: str) -> None:
    for line in processes_of(name):
        try:
            os.kill(int(line.split()[0]), signal.SIGKILL)
        except OSError:
            pass
    subprocess.run(["userdel", "--remove", name], capture_output=True)


class Hub:
    """JupyterHub on 127.0.0.1 with Unix users ``learners`` and ``instructor``, state in ``base``."""

    def __init__(self, base: Path, instructor: str, learners: list[str]):
        self.base, self.instructor, self.learners = base, instructor, learners
        self.port, self.hub_port, self.proxy_api_port = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = secrets.token_hex(32)
        self.exchange = base / "exchange"
        self.config_path = base / "etc-jupyter"  # what an instructor puts in /etc/jupyter
        self.state = base / "hub"
        self.proc: subprocess.Popen | None = None
        self.log = self.state / "jupyterhub.log"

    # -- set-up -------------------------------------------------------------------------------------------------
    def write_files(self) -> None:
        self.base.chmod(0o755)
        self.state.mkdir(mode=0o700)
        self.exchange.mkdir()
        self.exchange.chmod(0o1777)  # as nbgrader's docs ask: everyone may create their course folder and submit
        self.config_path.mkdir()
        learner_config = (ROOT / "docs" / "hub" / "nbgrader_config.py").read_text()
        (self.config_path / "nbgrader_config.py").write_text(
            learner_config.replace('"/srv/nbgrader/exchange"', repr(str(self.exchange))))
        users = [self.instructor, *self.learners]
        (self.state / "jupyterhub_config.py").write_text(f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
c = get_config()  # noqa: F821
load_subconfig({str(ROOT / 'docs' / 'hub' / 'jupyterhub_config.py')!r})  # noqa: F821 - the documented configuration
# the test's overlay: ports, state, users, the test's own API service
c.JupyterHub.bind_url = {self.url!r}
c.JupyterHub.hub_bind_url = "http://127.0.0.1:{self.hub_port}"
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{self.proxy_api_port}"
c.ConfigurableHTTPProxy.command = [{str(PROXY)!r}]
c.JupyterHub.db_url = "sqlite:///{self.state}/jupyterhub.sqlite"
c.JupyterHub.cookie_secret_file = "{self.state}/cookie_secret"
c.JupyterHub.pid_file = "{self.state}/jupyterhub.pid"
c.Authenticator.allowed_users = {set(users)!r}
c.Authenticator.admin_users = {{{self.instructor!r}}}
c.JupyterHub.spawner_class = "tests.hub_spawner.RevealingSpawner"
c.Spawner.cmd = [{str(VENV_BIN / 'jupyterhub-singleuser')!r}]
c.Spawner.environment.update({{"JUPYTER_CONFIG_PATH": {str(self.config_path)!r},
                               "PATH": {str(VENV_BIN)!r} + ":/usr/local/bin:/usr/bin:/bin"}})
c.Spawner.start_timeout = 180
c.Spawner.http_timeout = 180
c.JupyterHub.services = [{{"name": "course-test", "api_token": {self.token!r}}}]
c.JupyterHub.load_roles = [{{"name": "course-test", "services": ["course-test"],
                             "scopes": ["admin:users", "admin:servers", "tokens", "read:hub"]}}]
""")

    def start(self) -> None:
        self.write_files()
        env = {**os.environ, "COURSE_HUB_KEEP": os.pathsep.join([str(Path(sys.base_prefix).resolve()), sys.prefix, str(ROOT)]),
               "COURSE_HUB_STAGE": str(self.state / "stage"), "PATH": f"{VENV_BIN}:{os.environ['PATH']}"}
        env.pop("JUPYTERHUB_API_TOKEN", None)
        with self.log.open("w") as log:
            self.proc = subprocess.Popen([str(VENV_BIN / "jupyterhub"), "-f", str(self.state / "jupyterhub_config.py")],
                                         cwd=self.state, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyterhub exited ({self.proc.returncode}):\n{self.log.read_text()[-5000:]}")
            try:
                if requests.get(f"{self.url}/hub/api/", timeout=5).ok:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"jupyterhub did not answer within 120 s:\n{self.log.read_text()[-5000:]}")

    def stop(self) -> None:
        """SIGTERM, as an operator would (the hub stops the servers and the proxy it started)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    # -- the hub's REST API ------------------------------------------------------------------------------------
    def api(self, method: str, path: str, **kwargs) -> requests.Response:
        """The hub's REST API, as the test's service (admin of users and servers, not of their servers' content)."""
        return requests.request(method, f"{self.url}/hub/api{path}", timeout=60,
                                headers={"Authorization": f"token {self.token}"}, **kwargs)

    def user_token(self, name: str) -> str:
        """A token of ``name``'s own, as the hub's token page would give (access to that user's server only)."""
        response = self.api("POST", f"/users/{name}/tokens", json={"note": "course test", "expires_in": 3600})
        response.raise_for_status()
        return response.json()["token"]

    def start_servers(self, names: list[str], timeout: float = 180) -> dict[str, "UserServer"]:
        """Each user's server, all spawned at once (as a class logging in together); name -> its UserServer once
        every one answers. The requests go out together: the hub answers each only when its spawn is done (or after
        its slow_spawn_timeout, 10 s), so requests sent in turn would spawn the servers one at a time."""
        with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
            responses = list(pool.map(lambda name: self.api("POST", f"/users/{name}/server"), names))
        for name, response in zip(names, responses):
            if response.status_code not in (201, 202, 400):
                raise RuntimeError(f"starting {name}'s server: {response.status_code} {response.text}")
        started, servers = time.monotonic(), {}
        while time.monotonic() < started + timeout:
            for name in [name for name in names if name not in servers]:
                server = self.api("GET", f"/users/{name}").json().get("servers", {}).get("", {})
                if server.get("ready"):
                    servers[name] = UserServer(self, name, self.user_token(name))
                elif not server.get("pending") and time.monotonic() > started + 10:  # neither starting nor started
                    raise RuntimeError(f"{name}'s server failed to start:\n{self.log.read_text()[-5000:]}")
            if len(servers) == len(names):
                return servers
            time.sleep(0.1)
        late = [name for name in names if name not in servers]
        raise RuntimeError(f"the servers of {late} did not start within {timeout} s:\n{self.log.read_text()[-5000:]}")


class UserServer:
    """One user's single-user server, driven with that user's own token."""

    def __init__(self, hub: Hub, name: str, token: str):
        self.hub, self.name, self.token = hub, name, token
        self.url = f"{hub.url}/user/{name}"
        self.kernel: str | None = None  # the id of this user's kernel, once ``run`` started it

    def request(self, method: str, path: str, **kwargs) -> requests.Response:
        return requests.request(method, f"{self.url}{path}", timeout=300,
                                headers={"Authorization": f"token {self.token}"}, **kwargs)

    def json(self, method: str, path: str, **kwargs):
        response = self.request(method, path, **kwargs)
        if not response.ok:
            raise RuntimeError(f"{self.name}: {method} {path}: {response.status_code} {response.text[:2000]}")
        return response.json()

    # the Jupyter server's contents API: what JupyterLab does when a notebook is opened and saved
    def read_notebook(self, path: str) -> dict:
        return self.json("GET", f"/api/contents/{path}", params={"content": 1, "type": "notebook"})["content"]

    def save_notebook(self, path: str, notebook: dict) -> None:
        self.json("PUT", f"/api/contents/{path}", json={"type": "notebook", "format": "json", "content": notebook})

    # nbgrader's assignment handlers: what the Assignments tab of JupyterLab calls
    def assignments(self, action: str | None = None, assignment: str | None = None) -> list:
        if action is None:
            return self.json("GET", "/assignments", params={"course_id": COURSE_ID})
        return self.json("POST", f"/assignments/{action}", data={"course_id": COURSE_ID, "assignment_id": assignment})

    # a kernel: what the user would type in a notebook or a terminal
    def run(self, code: str, timeout: float = 600) -> str:
        """Execute ``code`` in this user's kernel (started on the first call, as a notebook kept open); returns its
        output; raises on an error."""
        if self.kernel is None:
            self.kernel = self.json("POST", "/api/kernels", json={"name": "python3"})["id"]
        return asyncio.run(self._execute(self.kernel, code, timeout))

    def close(self) -> None:
        """Shut this user's kernel down, as closing the notebook does."""
        if self.kernel is not None:
            self.request("DELETE", f"/api/kernels/{self.kernel}")
            self.kernel = None

    async def _execute(self, kernel_id: str, code: str, timeout: float) -> str:
        from tornado.httpclient import HTTPRequest
        from tornado.websocket import websocket_connect

        ws_url = self.url.replace("http://", "ws://") + f"/api/kernels/{kernel_id}/channels"
        connection = await websocket_connect(HTTPRequest(ws_url, headers={"Authorization": f"token {self.token}"}))
        msg_id = uuid.uuid4().hex
        connection.write_message(json.dumps({
            "header": {"msg_id": msg_id, "username": self.name, "session": uuid.uuid4().hex, "msg_type": "execute_request",
                       "version": "5.3"},
            "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
            "content": {"code": code, "silent": False, "store_history": False, "user_expressions": {},
                        "allow_stdin": False, "stop_on_error": True}}))
        output, error, replied, idle = [], None, False, False
        deadline = time.monotonic() + timeout
        while not (replied and idle):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{self.name}: the code did not finish within {timeout} s:\n{''.join(output)}")
            message = await asyncio.wait_for(connection.read_message(), remaining)
            if message is None:
                raise RuntimeError(f"{self.name}: the kernel's connection closed")
            message = json.loads(message)
            if message.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind = message["msg_type"]
            if kind == "stream":
                output.append(message["content"]["text"])
            elif kind == "error":
                error = "\n".join(message["content"]["traceback"])
            elif kind == "execute_reply":
                replied = True
            elif kind == "status" and message["content"]["execution_state"] == "idle":
                idle = True
        connection.close()
        if error:
            raise RuntimeError(f"{self.name}: the code raised:\n{error}\noutput:\n{''.join(output)}")
        return "".join(output)
