"""Operator traces of one training step in msprobe's data-dump layout (task ``statistics``), framework-neutral:
:mod:`msprobe_mlflow.trace.files` writes and reads them; the frameworks' tracers record them
(:mod:`msprobe_mlflow.torch_kernels.operator_trace`); ``locate`` compares two of them."""
