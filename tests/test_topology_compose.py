"""docker/: the compose file describes the topology tests/test_topology.py runs without Docker.

No Docker engine runs on the test machines. ``docker compose config`` checks the file where the client has the
compose plugin; everywhere, the YAML is parsed and checked here: the services and their health checks, named
volumes, secrets only as references to docker/.env (documented in .env.example, the real .env git-ignored),
the server's PostgreSQL backend, proxied artifacts on MinIO and basic authentication.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

DOCKER = Path(__file__).resolve().parents[1] / "docker"
COMPOSE_FILE = DOCKER / "docker-compose.yml"
# ${NAME}, ${NAME:-default}, ${NAME-default}, ${NAME:?message}, ${NAME?message}
REFERENCE = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<operator>:?[-?])(?P<rest>[^}]*))?\}")
SECRET_NAME = re.compile(r"PASSWORD|SECRET")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))


def env_example() -> dict[str, str]:
    pairs = [line.split("=", 1) for line in (DOCKER / ".env.example").read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    return {name.strip(): value.strip() for name, value in pairs}


def strings(node) -> list[str]:
    """Every string in a parsed YAML tree (keys excluded)."""
    if isinstance(node, dict):
        return [s for value in node.values() for s in strings(value)]
    if isinstance(node, list):
        return [s for value in node for s in strings(value)]
    return [node] if isinstance(node, str) else []


def test_the_three_services_have_health_checks_restart_policies_and_named_volumes(compose):
    services = compose["services"]
    assert {"postgres", "minio", "mlflow"} <= set(services)
    for name in ("postgres", "minio", "mlflow"):
        service = services[name]
        assert service["restart"] == "unless-stopped", name
        check = service["healthcheck"]
        assert check["test"][0] in ("CMD", "CMD-SHELL") and len(check["test"]) > 1, name
        assert {"interval", "timeout", "retries"} <= set(check), name
    assert set(compose["volumes"]) == {"postgres-data", "minio-data"}
    assert "postgres-data:/var/lib/postgresql/data" in services["postgres"]["volumes"]
    assert "minio-data:/data" in services["minio"]["volumes"]
    assert services["minio"]["command"][:2] == ["server", "/data"]


def test_the_server_waits_for_healthy_stores_and_runs_postgres_proxied_s3_artifacts_and_basic_auth(compose):
    mlflow = compose["services"]["mlflow"]
    assert mlflow["depends_on"] == {"postgres": {"condition": "service_healthy"},
                                    "minio": {"condition": "service_healthy"}}
    command = mlflow["command"]
    assert command[:2] == ["mlflow", "server"]
    assert command[command.index("--host") + 1] == "0.0.0.0"
    assert "--serve-artifacts" in command
    assert command[command.index("--artifacts-destination") + 1].startswith("s3://")
    assert command[command.index("--app-name") + 1] == "basic-auth"
    environment = mlflow["environment"]
    for key, database in (("MLFLOW_BACKEND_STORE_URI", "mlflow"), ("MLFLOW_AUTH_DATABASE_URI", "mlflow_auth")):
        assert environment[key] == f"postgresql+psycopg://mlflow:${{POSTGRES_PASSWORD}}@postgres:5432/{database}"
    assert environment["MLFLOW_S3_ENDPOINT_URL"] == "http://minio:9000"
    assert "mlflow:5000" in environment["MLFLOW_SERVER_ALLOWED_HOSTS"].split(",")  # the smoke test's Host header
    # The auth database the URI names is created when the PostgreSQL volume is first initialised.
    assert "./postgres-init:/docker-entrypoint-initdb.d:ro" in compose["services"]["postgres"]["volumes"]
    assert "CREATE DATABASE mlflow_auth;" in (DOCKER / "postgres-init/10-auth-database.sql").read_text()


def test_a_training_job_gets_the_three_mlflow_variables(compose):
    job = compose["x-training-job-environment"]
    assert set(job) == {"MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"}
    assert job["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    assert compose["services"]["smoke-test"]["environment"] == job
    assert compose["services"]["smoke-test"]["profiles"] == ["check"]  # not started by a plain 'up'


def test_secrets_are_only_references_to_the_env_file_and_required_ones_fail_loudly(compose):
    for name, service in compose["services"].items():
        for key, value in service.get("environment", {}).items():
            if SECRET_NAME.search(key) or key == "AWS_SECRET_ACCESS_KEY":
                assert REFERENCE.fullmatch(value), f"{name}.{key} = {value!r} is not a ${{VAR}} reference"
    references = [m for text in strings(compose) for m in REFERENCE.finditer(text)]
    for match in references:
        if SECRET_NAME.search(match["name"]):
            assert match["operator"] in (None, ":?"), f"secret {match['name']} must have no default: {match[0]}"
    required = {m["name"] for m in references if m["operator"] == ":?"}
    assert {"POSTGRES_PASSWORD", "MINIO_ROOT_PASSWORD", "MLFLOW_ADMIN_PASSWORD",
            "MLFLOW_FLASK_SERVER_SECRET_KEY"} <= required


def test_env_example_documents_every_variable_with_placeholder_secrets(compose):
    example = env_example()
    referenced = {m["name"] for text in strings(compose) for m in REFERENCE.finditer(text)}
    assert referenced <= set(example), f"not in .env.example: {sorted(referenced - set(example))}"
    for name, value in example.items():
        if SECRET_NAME.search(name):
            assert value.startswith("change-me"), f".env.example: {name} must be a change-me placeholder"


def test_the_real_env_file_is_git_ignored_and_the_example_is_not():
    repository = DOCKER.parent
    if not (repository / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    ignored = subprocess.run(["git", "check-ignore", "-q", "docker/.env"], cwd=repository)
    assert ignored.returncode == 0
    example = subprocess.run(["git", "check-ignore", "-q", "docker/.env.example"], cwd=repository)
    assert example.returncode == 1


def test_the_image_installs_the_backend_artifact_and_auth_dependencies_and_runs_unprivileged():
    dockerfile = (DOCKER / "Dockerfile").read_text()
    for requirement in ('"mlflow==${MLFLOW_VERSION}"', '"psycopg[binary]', '"boto3', '"Flask-WTF'):
        assert requirement in dockerfile, requirement
    assert re.search(r"^USER mlflow$", dockerfile, re.M) and re.search(r"^HEALTHCHECK ", dockerfile, re.M)
    assert subprocess.run(["sh", "-n", str(DOCKER / "entrypoint.sh")]).returncode == 0


def compose_plugin() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0


@pytest.mark.skipif(not compose_plugin(), reason="the docker client here has no compose plugin")
def test_docker_compose_config_accepts_the_file_with_the_example_env_and_names_a_missing_secret(tmp_path):
    valid = subprocess.run(["docker", "compose", "--env-file", str(DOCKER / ".env.example"), "-f", str(COMPOSE_FILE),
                            "config", "--quiet"], capture_output=True, text=True)
    assert valid.returncode == 0, valid.stderr
    empty = tmp_path / "empty.env"
    empty.write_text("")
    missing = subprocess.run(["docker", "compose", "--env-file", str(empty), "-f", str(COMPOSE_FILE), "config",
                              "--quiet"], capture_output=True, text=True)
    assert missing.returncode != 0 and "in docker/.env" in missing.stderr
