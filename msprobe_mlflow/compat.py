"""Every private or internal name of the libraries we run on, in one place: what it is for, the versions it was
checked with (pyproject.toml's ranges; ``tests/test_compat.py`` runs each against the installed library) and what
happens when a newer version drops it (a fallback that keeps the result right, else an error that says so).

Imports nothing at import time: each function imports its library when called. FSDP1's internals (its
``FlatParameter`` bookkeeping) stay in :mod:`msprobe_mlflow.pytorch.fsdp1`, FSDP1's own compatibility layer: they
are read in one place there, by class and attribute name.
"""
from __future__ import annotations

import contextlib

# The ranges pyproject.toml accepts; tests/test_compat.py has run every name here with torch 2.13, mlflow 3.17,
# lightning 2.6, numba 0.68 and MindSpore 2.10 (and runs it with whatever is installed).
CHECKED_WITH = {"torch": ">=2.1", "mlflow": ">=3.7,<4", "lightning": ">=2.2,<3", "numba": ">=0.60",
                "mindspore": ">=2.4"}
# Ascend's operator precision settings, as MindSpore's AscendOpPrecisionConf names its getters and set_context's
# ascend_config its keys.
ASCEND_PRECISION_SETTINGS = ("precision_mode", "op_precision_mode", "matmul_allow_hf32", "conv_allow_hf32")


class MissingPrivateApi(RuntimeError):
    """A private name this package needs is gone from the installed library (a version newer than checked)."""

    def __init__(self, library: str, name: str, used_for: str):
        import importlib.metadata

        try:
            version = importlib.metadata.version(library)
        except importlib.metadata.PackageNotFoundError:
            version = "(unknown version)"
        super().__init__(f"{library} {version} has no {name}, which msprobe-mlflow uses {used_for}; it was checked "
                         f"with {library}{CHECKED_WITH[library]}: install a version in that range")


def default_store():
    """torch.distributed's rendezvous store (``distributed_c10d._get_default_store``, no public equivalent): the
    end-of-run exchange goes through it, not through a collective (see ``pytorch.distributed.summary_all_gather``)."""
    from torch.distributed import distributed_c10d

    getter = getattr(distributed_c10d, "_get_default_store", None)
    if getter is None:
        raise MissingPrivateApi("torch", "torch.distributed.distributed_c10d._get_default_store",
                                "for the ranks' end-of-run exchange (aggregate_metrics)")
    return getter()


def current_experiment_id() -> str:
    """MLflow's current experiment (``mlflow.tracking.fluent._get_experiment_id``, no public equivalent): it honours
    ``set_experiment`` and ``MLFLOW_EXPERIMENT_NAME`` / ``_ID``."""
    from mlflow.tracking import fluent

    getter = getattr(fluent, "_get_experiment_id", None)
    if getter is None:
        raise MissingPrivateApi("mlflow", "mlflow.tracking.fluent._get_experiment_id",
                                "to find the current experiment of the runs it creates")
    return getter()


def lightning_trainer(module):
    """The Lightning trainer a ``LightningModule`` is attached to (its ``_trainer``; the public ``trainer`` raises
    when there is none), None for another module or where Lightning keeps it elsewhere."""
    return getattr(module, "_trainer", None)


def mlflow_logger_tracking_uri(logger) -> str | None:
    """The tracking URI a Lightning ``MLFlowLogger`` was given (``_tracking_uri``; the public ``experiment`` would
    start its run). None where Lightning drops it: the caller then logs to MLflow's active tracking URI."""
    return getattr(logger, "_tracking_uri", None)


def tensor_version(tensor):
    """The tensor's in-place version counter (``Tensor._version``), which every in-place op bumps. Where torch has
    none, a value equal to no other: every tensor then counts as changed."""
    return getattr(tensor, "_version", object())


def foreach_norm(tensors: list, dtype=None) -> list:
    """Each tensor's 2-norm in one call (``torch._foreach_norm``, as ``clip_grad_norm_`` uses), accumulated and
    returned in ``dtype`` (None: the tensors'); where torch drops it, ``torch.linalg.vector_norm`` one tensor at a
    time: slower, and a norm may differ from ``_foreach_norm``'s in its last bit (a recorded norm may change in
    that bit)."""
    import torch

    if hasattr(torch, "_foreach_norm"):
        return list(torch._foreach_norm(tensors, 2, dtype=dtype))
    return [torch.linalg.vector_norm(tensor, dtype=dtype) for tensor in tensors]


def set_numba_cache_dir(folder: str) -> bool:
    """Where numba caches compiled kernels from now on (``numba.core.config.CACHE_DIR``, read when a cached function
    is first compiled or loaded). False where numba has no such setting: it keeps its default folder (each process
    may then compile again, seconds, with the same kernel)."""
    from numba.core import config

    if not hasattr(config, "CACHE_DIR"):
        return False
    config.CACHE_DIR = folder
    return True


@contextlib.contextmanager
def numba_slp_vectorize():
    """numba's superword vectoriser on for the compilations inside (``numba.core.config.SLP_VECTORIZE``, off by
    default), then as it was. Where numba has no such setting nothing changes: the kernel is slower, not different."""
    from numba.core import config

    if not hasattr(config, "SLP_VECTORIZE"):
        yield
        return
    previous, config.SLP_VECTORIZE = config.SLP_VECTORIZE, 1
    try:
        yield
    finally:
        config.SLP_VECTORIZE = previous


def mindspore_amp_level(cell) -> str:
    """The level ``mindspore.amp.auto_mixed_precision`` gave ``cell`` (its ``_amp_level``, no public equivalent):
    ``""`` where none. Level O1 leaves no other mark on the network (it rewrites the network's code); where MindSpore
    drops the attribute, ``""``: the gradients' significands then show such a network's 16-bit format
    (``mindspore/compute_format.py``)."""
    level = getattr(cell, "_amp_level", "")
    return level if isinstance(level, str) else ""


def ascend_precision_settings() -> dict[str, str]:
    """Ascend's operator precision settings (:data:`ASCEND_PRECISION_SETTINGS`) as MindSpore holds them, ``""``
    where not set; the switches as ``"1"`` and ``"0"``. Read from ``AscendOpPrecisionConf`` (MindSpore 2.5 and later
    on Ascend, no public getter: it holds ``mindspore.device_context.ascend.op_precision``'s settings and falls back
    to ``set_context(ascend_config=...)``'s); where that is missing, from the public
    ``get_context("ascend_config")``, which holds only ``set_context``'s (the others then read as not set)."""
    import mindspore

    try:
        from mindspore._c_expression import AscendOpPrecisionConf

        conf = AscendOpPrecisionConf.get_instance()
        found = {name: getattr(conf, name)() for name in ASCEND_PRECISION_SETTINGS}
    except (ImportError, AttributeError):
        found = mindspore.get_context("ascend_config") or {}

    def text(value) -> str:  # set_context's switches are bools, AscendOpPrecisionConf's "1" and "0"
        return ("1" if value else "0") if isinstance(value, bool) else str(value or "")

    return {name: text(found.get(name)) for name in ASCEND_PRECISION_SETTINGS}
