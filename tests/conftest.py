"""What every test process needs: MindSpore's launch blocking (where MindSpore is installed), a temporary working
folder, and MLflow stores that leave no trace."""
import importlib.util
import os
import uuid

import mlflow
import pytest

from mlflow_stores import sqlite_uri

if importlib.util.find_spec("mindspore") is not None:
    import mindspore

    # An op without a kernel on this CPU leaves the next ops failing too unless launch blocking was switched on
    # before the process's first MindSpore op; the API checker switches it on, but only the first call counts.
    mindspore.runtime.launch_blocking()
else:  # the torch-only stage (scripts/test-torch-only, `pip install ".[torch,transformers,lightning]"`): the
    # monitor's MindSpore tests skip themselves; the API checker (it replays MindSpore calls) and the deployment
    # tests (the `server` extra) run in the first stage only
    collect_ignore_glob = ["test_api_check_*.py", "test_topology.py", "test_topology_s3.py"]

SLOW_TESTS = {line.strip() for line in open(os.path.join(os.path.dirname(__file__), "slow_tests.txt"), encoding="utf-8")
              if line.strip() and not line.startswith("#")}


def pytest_collection_modifyitems(items):
    """Marks the tests listed in slow_tests.txt ``slow``: ``-m "not slow"`` is the fast tier of the development loop."""
    for item in items:
        if item.nodeid in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)


MLFLOW_ENVIRONMENT = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID")


@pytest.fixture(scope="session", autouse=True)
def temporary_working_folder_for_fixtures(tmp_path_factory):
    """Module and session fixtures run before a test enters its own folder (below): they work in a temporary one
    too. This matters most for MLflow, which resolves a SQLite store's default artifact root (``./mlruns``) once,
    when the store is first used in the process."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path_factory.mktemp("working_folder"))
        yield


@pytest.fixture(autouse=True)
def temporary_working_folder(tmp_path, monkeypatch):
    """Every test, and every process it starts, works in its own temporary folder: what MLflow writes relative to
    the working folder (``./mlruns`` for an experiment created without an artifact location, the Default
    experiment's artifacts, ``./mlflow.db`` without a tracking URI) and the tools' defaults (``./msprobe_dump``)
    never land in the clone."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def mode(request):
    """MindSpore in the mode a test is parametrized with (``indirect``): ``"pynative"`` or ``"graph"``, its previous
    mode restored after it."""
    mindspore = pytest.importorskip("mindspore")
    previous = mindspore.get_context("mode")
    mindspore.set_context(mode=mindspore.PYNATIVE_MODE if request.param == "pynative" else mindspore.GRAPH_MODE)
    yield request.param
    mindspore.set_context(mode=previous)


@pytest.fixture
def pynative():
    """MindSpore in PyNative mode for the test, its previous mode restored after it."""
    mindspore = pytest.importorskip("mindspore")
    previous = mindspore.get_context("mode")
    mindspore.set_context(mode=mindspore.PYNATIVE_MODE)
    yield
    mindspore.set_context(mode=previous)


@pytest.fixture(autouse=True)
def mlflow_environment_restored():
    """mlflow.set_tracking_uri/set_experiment export MLFLOW_* variables; subprocesses of later tests (torchrun
    jobs with a store of their own) must not inherit them."""
    saved = {name: os.environ.get(name) for name in MLFLOW_ENVIRONMENT}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="module")
def sqlite_store(tmp_path_factory):
    """A SQLite MLflow store for a test module, made the current one: ``(uri, folder)``."""
    folder = tmp_path_factory.mktemp("mlflow_store")
    uri = sqlite_uri(folder)
    previous, exported = mlflow.get_tracking_uri(), os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    yield uri, folder
    mlflow.set_tracking_uri(previous)
    if exported is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = exported


@pytest.fixture
def tmp_sqlite_uri(tmp_path):
    """The URI of a SQLite MLflow store of this test's own, ``tmp_path/mlflow.db`` (made when first opened), for the
    processes and clients a test points at it; unlike ``sqlite_store``, not made the current one."""
    return sqlite_uri(tmp_path)


@pytest.fixture
def tmp_experiment(sqlite_store, tmp_path):
    """A fresh experiment in the module's SQLite store, made the current one, its artifacts in this test's folder."""
    experiment_id = mlflow.create_experiment(f"test-{uuid.uuid4().hex[:8]}",
                                             artifact_location=(tmp_path / "artifacts").as_uri())
    mlflow.set_experiment(experiment_id=experiment_id)
    return experiment_id


@pytest.fixture(autouse=True)
def no_monitoring_session_left_open():
    """A test that leaves a monitor running (or drops one without ``stop()``) must not leave the next one a process
    whose hooks are a monitor's: its sessions are closed and the process's hooks put back after it."""
    yield
    from msprobe_mlflow.session import _open_sessions

    for session in _open_sessions.sessions():
        session.close()
    _open_sessions.release_unused()
