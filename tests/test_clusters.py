"""The files in clusters/: launcher configs pass Ray's own checks, the RayJob has what KubeRay needs.

Each launcher config goes through what `ray up` does before it talks to a cloud:
`prepare_config` (merge with the provider's defaults) and then `validate_config` (Ray's
`ray-schema.json`, through jsonschema, plus its cross-field checks). Broken copies must be
rejected, so the check is known to bite. No network and no cloud credentials are needed.
The job they run, examples/train_lm.py, is held to what clusters/README.md says of it.
"""

import copy
import importlib.util
import re
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml
from packaging.requirements import Requirement
from ray.autoscaler._private.util import prepare_config, validate_config

CLUSTERS = Path(__file__).resolve().parents[1] / "clusters"
REPO = CLUSTERS.parent
# Every cluster launcher config in clusters/ (they have a `provider`), so a new one is checked too.
LAUNCHER_CONFIGS = sorted(p.name for p in CLUSTERS.glob("*.yaml") if "provider" in yaml.safe_load(p.read_text()))
KUBERAY_MANIFESTS = sorted(p.name for p in CLUSTERS.glob("*.yaml") if "apiVersion" in yaml.safe_load(p.read_text()))
GPU_WORKER = "gpu_worker"
# Ray's launcher gives the head an instance profile / service account and no worker one.
AWS_INSTANCE_PROFILE = re.compile(r"arn:aws:iam::[^:]+:instance-profile/[\w+=,.@-]+")
GCS_READ_WRITE_SCOPE = "https://www.googleapis.com/auth/devstorage.read_write"
LOGIN_SHELL_AUTH = "echo 'export RAY_AUTH_MODE=token' >> ~/.bashrc"

pytestmark = pytest.mark.timeout(60)


def _load(name: str) -> dict:
    return yaml.safe_load((CLUSTERS / name).read_text())


def _ray_up_checks(config: dict) -> dict:
    """The offline part of `ray up`: fill in the provider's defaults, then validate."""
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def _rayjob_runtime_env() -> dict:
    return yaml.safe_load(_load("kuberay-rayjob.yaml")["spec"]["runtimeEnvYAML"])


def _train_lm():
    """examples/train_lm.py as a module; its __main__ part, which trains, does not run."""
    spec = importlib.util.spec_from_file_location("train_lm", REPO / "examples/train_lm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _misspell_a_node_type_field(config):
    node_type = config["available_node_types"][GPU_WORKER]
    node_type["min_worker"] = node_type.pop("min_workers")


def _ask_for_more_nodes_than_the_cluster_allows(config):
    config["available_node_types"][GPU_WORKER]["min_workers"] = config["max_workers"] + 1


def _name_a_missing_head_type(config):
    config["head_node_type"] = "no_such_type"


def _give_a_fractional_gpu_count(config):
    config["available_node_types"][GPU_WORKER]["resources"]["GPU"] = 0.5


def test_every_cluster_file_is_a_checked_launcher_config_or_kuberay_manifest():
    assert LAUNCHER_CONFIGS == ["aws.yaml", "gcp.yaml"]
    assert KUBERAY_MANIFESTS == ["kuberay-rayjob.yaml"]
    assert sorted(p.name for p in CLUSTERS.glob("*.y*ml")) == sorted(LAUNCHER_CONFIGS + KUBERAY_MANIFESTS)


@pytest.mark.parametrize("name", LAUNCHER_CONFIGS)
def test_launcher_config_passes_rays_own_validation(name):
    _ray_up_checks(_load(name))


@pytest.mark.parametrize("name", LAUNCHER_CONFIGS)
@pytest.mark.parametrize("break_it", [_misspell_a_node_type_field, _ask_for_more_nodes_than_the_cluster_allows,
                                      _name_a_missing_head_type, _give_a_fractional_gpu_count])
def test_broken_copy_of_launcher_config_is_rejected(name, break_it):
    config = _load(name)
    break_it(config)
    with pytest.raises((jsonschema.ValidationError, ValueError)):
        _ray_up_checks(config)


@pytest.mark.parametrize("name", LAUNCHER_CONFIGS)
def test_gpu_workers_autoscale_between_min_and_max_on_spot_capacity(name):
    config = _load(name)
    gpu = config["available_node_types"][GPU_WORKER]
    assert 0 < gpu["min_workers"] < gpu["max_workers"] <= config["max_workers"]
    assert gpu["resources"]["GPU"] >= 1
    node = gpu["node_config"]
    if config["provider"]["type"] == "aws":
        assert node["InstanceMarketOptions"]["MarketType"] == "spot"
    else:
        assert node["scheduling"]["preemptible"] is True
    head = config["available_node_types"][config["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0 and head["resources"]["CPU"] == 0, "workers belong on GPU nodes"


@pytest.mark.parametrize("name", LAUNCHER_CONFIGS)
def test_every_node_starts_ray_with_token_auth_and_receives_the_token(name):
    config = _load(name)
    for commands in (config["head_start_ray_commands"], config["worker_start_ray_commands"]):
        [start] = [c for c in commands if "ray start" in c]
        assert start.index("RAY_AUTH_MODE=token") < start.index("ray start")
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"


@pytest.mark.parametrize("name", LAUNCHER_CONFIGS)
def test_login_shells_on_every_node_send_the_token_so_ray_exec_ray_status_is_let_in(name):
    prepared = _ray_up_checks(_load(name))
    for commands in (prepared["head_setup_commands"], prepared["worker_setup_commands"]):
        assert any(LOGIN_SHELL_AUTH in c for c in commands), commands


@pytest.mark.parametrize("name", LAUNCHER_CONFIGS)
def test_every_worker_type_gets_cloud_credentials_of_its_own_to_write_checkpoint_shards(name):
    prepared = _ray_up_checks(_load(name))
    workers = {k: t for k, t in prepared["available_node_types"].items() if k != prepared["head_node_type"]}
    assert workers
    for node_type, spec in workers.items():
        node = spec["node_config"]
        if prepared["provider"]["type"] == "aws":
            assert AWS_INSTANCE_PROFILE.fullmatch(node["IamInstanceProfile"]["Arn"]), node_type
        else:
            [account] = node["serviceAccounts"]
            assert account["email"].endswith(f"@{prepared['provider']['project_id']}.iam.gserviceaccount.com")
            assert GCS_READ_WRITE_SCOPE in account["scopes"], node_type


@pytest.mark.parametrize("name", LAUNCHER_CONFIGS)
def test_nodes_install_the_tested_ray_and_the_files_they_mount_exist(name):
    config = _load(name)
    assert any(f"'ray[default]=={ray.__version__}'" in c for c in config["setup_commands"])
    assert any("download.pytorch.org/whl/cpu" in c for c in config["head_setup_commands"]), "head: CPU torch"
    assert not any("whl/cpu" in c for c in config["worker_setup_commands"]), "GPU workers: CUDA torch"
    for remote, local in config["file_mounts"].items():
        if local.startswith("./"):
            assert (REPO / local).exists(), f"file_mounts[{remote!r}] = {local!r} is not in the repository"


def test_rayjob_runs_train_lm_on_an_autoscaling_gpu_cluster_with_token_auth():
    job = _load("kuberay-rayjob.yaml")
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    spec = job["spec"]
    assert spec["entrypoint"].split()[:2] == ["python", "examples/train_lm.py"] and "--use-gpu" in spec["entrypoint"]
    assert (REPO / "examples/train_lm.py").exists()
    runtime_env = _rayjob_runtime_env()
    assert runtime_env["working_dir"].endswith(".zip"), "the submitter pod needs the code as an archive URL"
    assert runtime_env["env_vars"]["ELASTIC_CLUSTER_AUTOSCALES"] == "1"

    cluster = spec["rayClusterSpec"]
    assert cluster["rayVersion"] == ray.__version__
    assert cluster["authOptions"]["mode"] == "token"
    assert cluster["enableInTreeAutoscaling"] is True
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    [head_container] = head["template"]["spec"]["containers"]
    assert head_container["image"].startswith(f"rayproject/ray:{ray.__version__}-")
    assert "nvidia.com/gpu" not in head_container["resources"]["limits"]

    [gpu_group] = cluster["workerGroupSpecs"]
    assert 0 < gpu_group["minReplicas"] <= gpu_group["replicas"] <= gpu_group["maxReplicas"]
    assert gpu_group["minReplicas"] < gpu_group["maxReplicas"], "the worker group must be able to grow"
    [worker] = gpu_group["template"]["spec"]["containers"]
    assert worker["image"].startswith(f"rayproject/ray:{ray.__version__}-")
    assert int(worker["resources"]["limits"]["nvidia.com/gpu"]) >= 1


def test_rayjob_installs_every_dependency_of_the_project_but_ray_which_its_image_holds():
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml takes Python 3.11")
    project = {r.name: r for r in map(Requirement, tomllib.loads((REPO / "pyproject.toml").read_text())
                                                     ["project"]["dependencies"])}
    pip = {r.name: r for r in map(Requirement, _rayjob_runtime_env()["pip"])}
    assert pip.keys() == project.keys() - {"ray"}
    assert project["ray"].specifier.contains(ray.__version__)
    for name, installed in pip.items():
        wanted = project[name].specifier
        pinned = [s.version for s in installed.specifier if s.operator == "=="]
        assert installed.specifier == wanted or (pinned and wanted.contains(pinned[0])), f"{installed} vs {wanted}"


def test_rayjob_keeps_its_run_in_a_bucket_that_its_pods_may_write():
    spec = _load("kuberay-rayjob.yaml")["spec"]
    args = spec["entrypoint"].split()
    # shutdownAfterJobFinishes deletes the cluster, and its disks, when the job ends.
    assert "--storage-path" in args, "the run would land on the cluster's disks"
    storage = args[args.index("--storage-path") + 1]
    assert storage.startswith(("s3://", "gs://")), storage
    cluster = spec["rayClusterSpec"]
    pods = [cluster["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in cluster["workerGroupSpecs"]]
    assert {pod.get("serviceAccountName") for pod in pods} == {"elastic-storage"}


def test_docs_warn_of_train_lm_killing_a_rank_and_name_flags_it_has():
    train_lm = _train_lm()
    source = (REPO / "examples/train_lm.py").read_text()
    entrypoint_flags = re.findall(r"--[a-z][\w-]*", _load("kuberay-rayjob.yaml")["spec"]["entrypoint"])
    for flag in ["--no-fault", *entrypoint_flags]:
        assert f'"{flag}"' in source, f"examples/train_lm.py has no {flag}"
    for doc in ("README.md", "kuberay-rayjob.yaml"):
        text = (CLUSTERS / doc).read_text()
        assert f"rank {train_lm.FAULT.rank} at step {train_lm.FAULT.step} on purpose" in text, doc
        assert "--no-fault" in text, doc


def test_train_lm_says_a_resubmitted_run_resumed_at_its_last_step_instead_of_failing():
    from elastic import Result

    train_lm = _train_lm()
    resumed = {"type": "run_resumed", "step": 300, "checkpoint": "s3://bucket/runs/train_lm/checkpoints/step_300"}
    nothing = Result(metrics={}, step=0, goodput=0.0, value=None, path="s3://bucket/runs/train_lm", events=[resumed])
    assert train_lm.summary(nothing, "train_lm", 300).startswith(
        "nothing to train: run 'train_lm' resumed from its checkpoint of step 300, which reached --steps 300")
    formed = [{"type": "generation_formed", "world_size": n} for n in (3, 2, 3)]
    trained = Result(metrics={"loss": 2.0}, step=300, goodput=0.9, value=None, path="/runs/train_lm", events=formed)
    assert train_lm.summary(trained, "train_lm", 300).startswith(
        "300 steps, world sizes 3 -> 2 -> 3, goodput 0.90, final loss 2.000")
