"""`ray job submit` against a real, token-authenticated Ray head, as in clusters/README.md.

The fixture starts its own head with `ray start --head --block` on free ports, in its own
temp dir, with RAY_AUTH_MODE=token and a token of its own (RAY_AUTH_TOKEN_PATH), so it
neither reads nor writes ~/.ray/auth_token and shares nothing with other Ray instances on
this machine. The Jobs SDK sends the token as `Authorization: Bearer <token>`; the jobs run
`examples/train_mlp_with_kill.py` from a working_dir upload of this repository, and the tests
read the run's events.jsonl from the storage path the job was given.
"""

import json
import os
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from ray.exceptions import AuthenticationError
from ray.job_submission import JobStatus, JobSubmissionClient

REPO = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))
HEAD_CPUS = 4
HEAD_START_TIMEOUT_S = 60
JOB_TIMEOUT_S = 150
STEPS = 80
KILL_STEP = 30


def _free_ports(count: int) -> list[int]:
    """Free ports from the OS; every socket stays bound until all are, so the ports differ."""
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


class Head:
    """A `ray start --head --block` process; stopping it ends only the processes it started."""

    def __init__(self, tmp: Path) -> None:
        self.token = secrets.token_hex(32)
        token_path = tmp / "auth_token"
        token_path.write_text(self.token)
        gcs, dashboard, agent_http, agent_grpc, runtime_env_agent, client_server, metrics = _free_ports(7)
        self.address = f"http://127.0.0.1:{dashboard}"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        self.env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_path))
        # The job's `python` is whatever PATH finds on the head, as on a cluster node: this venv's.
        self.env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{self.env.get('PATH', '')}"
        self.log_path = tmp / "head.log"
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(
            [RAY, "start", "--head", "--block", "--disable-usage-stats",
             f"--port={gcs}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
             f"--dashboard-agent-listen-port={agent_http}", f"--dashboard-agent-grpc-port={agent_grpc}",
             f"--runtime-env-agent-port={runtime_env_agent}", f"--ray-client-server-port={client_server}",
             f"--metrics-export-port={metrics}", f"--num-cpus={HEAD_CPUS}", f"--temp-dir={tmp / 'ray'}"],
            env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
        )
        self.jobs: JobSubmissionClient | None = None

    def wait_ready(self) -> None:
        deadline = time.monotonic() + HEAD_START_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"ray start exited with {self.process.returncode}:\n{self.log_path.read_text()}")
            try:
                self.jobs = JobSubmissionClient(self.address, headers={"Authorization": f"Bearer {self.token}"})
                # The dashboard answers before its job agent runs ("No available agent to submit
                # job"): a job of no work is accepted only once submissions are.
                self.jobs.submit_job(entrypoint="true")
                return
            except RuntimeError as exc:
                if "No available agent" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(1)
            # Refused connections and 5xx answers (requests' errors are OSErrors) while it starts.
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no dashboard at {self.address} after {HEAD_START_TIMEOUT_S}s:\n"
                                       f"{self.log_path.read_text()}") from None
                time.sleep(1)

    def stop(self) -> None:
        # `ray stop` would end every Ray instance on this machine; signal only this head's tree.
        try:
            started = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            started = []
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
        for process in started:
            try:
                process.terminate()
            except psutil.NoSuchProcess:
                pass
        for process in psutil.wait_procs(started, timeout=10)[1]:
            process.kill()
        self._log.close()


@pytest.fixture(scope="module")
def head():
    # A short path: Ray's unix sockets live under the temp dir and paths are limited to ~107 bytes.
    tmp = Path(tempfile.mkdtemp(prefix="elastic-head-", dir="/tmp"))
    head = Head(tmp)
    try:
        head.wait_ready()
        yield head
    finally:
        head.stop()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def finished_jobs(head, tmp_path_factory):
    """The submitted training jobs, each waited for: one, whose worker is killed mid-run. It also
    serves the job that completes and journals its run; a second, fault-free job with the example's
    default scaling flags cost the suite ten seconds of CPU, for the defaults alone.

    Returns {run name: (status, job logs, the run's events)}.
    """
    storage = tmp_path_factory.mktemp("runs")
    # The killed run has exactly 2 workers from its first step, so rank 1 exists when the fault is
    # due; with min_workers=1 the run could start alone and outrun its second worker.
    flags = {"killed": ["--min-workers", "2", "--max-workers", "2", "--inject", f"kill:rank=1,step={KILL_STEP}"]}
    job_ids = {
        name: head.jobs.submit_job(
            entrypoint=shlex.join(["python", "examples/train_mlp_with_kill.py", "--storage-path", str(storage),
                                   "--name", name, "--steps", str(STEPS), *extra]),
            runtime_env={"working_dir": str(REPO)},
        )
        for name, extra in flags.items()
    }
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline and not all(head.jobs.get_job_status(i).is_terminal() for i in job_ids.values()):
        time.sleep(1)
    finished = {}
    for name, job_id in job_ids.items():
        journal = storage / name / "events.jsonl"
        events = [json.loads(line) for line in journal.read_text().splitlines()] if journal.exists() else []
        finished[name] = (head.jobs.get_job_status(job_id), head.jobs.get_job_logs(job_id), events)
    return finished


@pytest.mark.timeout(120)
def test_dashboard_rejects_a_client_with_the_wrong_token(head):
    with pytest.raises(AuthenticationError, match="Forbidden"):
        JobSubmissionClient(head.address, headers={"Authorization": "Bearer not-the-token"})


@pytest.mark.timeout(120)
def test_ray_cli_submits_with_the_token_from_the_environment(head):
    # The client side of clusters/README.md: RAY_AUTH_MODE=token plus the head's token (here
    # through RAY_AUTH_TOKEN_PATH), then a plain `ray job submit` that waits for the job.
    submitted = subprocess.run(
        [RAY, "job", "submit", "--address", head.address, "--working-dir", ".", "--",
         "python", "-c", "print('hello from the head')"],
        cwd=REPO, env=head.env, capture_output=True, text=True, timeout=90,
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    assert "hello from the head" in submitted.stdout


@pytest.mark.timeout(HEAD_START_TIMEOUT_S + JOB_TIMEOUT_S + 30)
def test_submitted_job_runs_to_completion_and_journals_the_run(finished_jobs):
    status, logs, events = finished_jobs["killed"]
    assert status == JobStatus.SUCCEEDED, logs
    types = [e["type"] for e in events]
    assert {"run_started", "generation_formed", "run_finished"} <= set(types), types
    assert events[-1]["type"] == "run_finished" and events[-1]["step"] == STEPS, events[-1]


@pytest.mark.timeout(HEAD_START_TIMEOUT_S + JOB_TIMEOUT_S + 30)
def test_submitted_job_heals_a_killed_worker_and_still_succeeds(finished_jobs):
    status, logs, events = finished_jobs["killed"]
    assert status == JobStatus.SUCCEEDED, logs
    [failed] = [e for e in events if e["type"] == "worker_failed"]
    assert failed["rank"] == 1 and failed["kind"] == "death", failed
    [recovery] = [e for e in events if e["type"] == "recovery"]
    assert recovery["from_checkpoint"] is False, "the survivor's state should carry the run on"
    assert events[-1]["type"] == "run_finished" and events[-1]["step"] == STEPS, events[-1]
