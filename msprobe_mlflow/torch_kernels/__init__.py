"""The PyTorch kernels: gradients to statistics on the device, with no monitor around them.

``statistics`` (one step's statistics of many gradients), ``sharded`` (DTensor and FSDP1 pieces reduced to the full
gradient's), ``parameter_norms``, ``fused`` (the numba CPU kernel), ``md5`` (16 MD5s side by side), ``openmp`` (torch's
OpenMP threads) and ``host_copy`` (the one device-to-host copy). They import torch, numba and the core only, so that a
kernel imports without the monitor (:mod:`msprobe_mlflow.pytorch`), which is built on them; this file imports nothing.
"""
