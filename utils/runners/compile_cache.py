"""Compiled passes kept on disk: a later start of the same model on the same machine loads its graphs.

Why this file exists: inductor's FX-graph cache refuses a graph whose frozen weights were packed for
oneDNN (`BypassFxGraphCache("mkldnn tensors unpickleable")`), so every start compiled again (minutes
for a 1.5B model). Yet a frozen weight never has to be pickled: inductor's freezing-aware caching
stores frozen parameters by name and, on a hit, takes them from the graph being compiled (packed
again by the freezing passes of that start, in seconds). The refusal is a blanket check that comes
before that rule. `frozen_onednn_weights_cached()` narrows it while one of our models compiles: a frozen oneDNN tensor enters the key
by its shape and dtype only, as every other frozen parameter does; anything else is checked as before.
Only two private members of `torch._inductor.codecache` are touched; a torch release without them
keeps its own behaviour (the cache bypasses, every start compiles, exact either way).

What the key then lacks: the weights' values. The GEMM kernels inductor generates pack each weight
into a constant of their own, which the cache stores by value; two models of the same shapes (a
fine-tune and its base) would share an entry. `model_key(model)` is therefore a no-op graph pass whose
`uuid` is a fingerprint of the model's weights and config: set as inductor's custom pass while a model
compiles, it enters the key, so each model has its own entries.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["frozen_onednn_weights_cached", "model_key", "weights_fingerprint"]

SAMPLES = 4096  # values read from each weight for the fingerprint: a strided sample, not every byte

@contextmanager
def frozen_onednn_weights_cached() -> Iterator[bool]:
    """While a model of ours compiles (its `model_key` in inductor's config), let inductor's FX-graph
    cache store and find graphs whose frozen weights are oneDNN-packed -> whether it can (False: this
    torch release lacks the members). Inductor's own checks are back on exit: another compile in the
    process (a user's own `torch.compile`, without our weights key) is never keyed by shapes alone."""
    try:
        from torch._inductor import codecache
        from torch._inductor.freezing_utils import is_frozen_param
        validator, pickler, ident = codecache.CacheabilityValidator, codecache.FxGraphCachePickler, codecache._ident
        check, reduce = validator.check_tensor, pickler._reduce_tensor
    except (ImportError, AttributeError):
        yield False
        return

    def check_tensor(tensor: torch.Tensor) -> None:
        if not (tensor.is_mkldnn and is_frozen_param(tensor)):
            check(tensor)

    def reduce_tensor(self, tensor: torch.Tensor):
        if tensor.is_mkldnn and is_frozen_param(tensor):  # looked up by name at every start, like any frozen weight
            return ident, (("frozen oneDNN weight", tuple(tensor.shape), str(tensor.dtype)),)
        return reduce(self, tensor)

    validator.check_tensor, pickler._reduce_tensor = staticmethod(check_tensor), reduce_tensor
    try:
        yield True
    finally:
        validator.check_tensor, pickler._reduce_tensor = staticmethod(check), reduce


def weights_fingerprint(model: nn.Module) -> str:
    """A hash of `model`'s config and of every weight's name, shape, dtype, sum and a strided sample of its values:
    different weights give a different fingerprint in practice, in well under a second for a 1.5B model."""
    digest = hashlib.sha256()
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        digest.update(config.to_json_string(use_diff=False).encode())
    for name, tensor in sorted(model.state_dict(keep_vars=True).items()):
        flat = tensor.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // SAMPLES)].to(torch.float32)
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(sample.cpu().numpy().tobytes())
        digest.update(repr(float(tensor.detach().sum(dtype=torch.float64))).encode())  # every value, once
    return digest.hexdigest()[:24]


def model_key(model: nn.Module):
    """A graph pass that changes nothing and whose `uuid` is `model`'s fingerprint: inductor's
    `post_grad_custom_post_pass` while `model` compiles, so that the FX-graph cache keys its graphs
    by the weights too. None where this torch release has no custom passes (the key stays inductor's)."""
    try:
        from torch._inductor.custom_graph_pass import CustomGraphPass
    except ImportError:
        return None

    class ModelKey(CustomGraphPass):
        def __init__(self, fingerprint: str) -> None:
            self.fingerprint = fingerprint

        def __call__(self, graph: torch.fx.Graph) -> None:
            return None

        def uuid(self) -> str:
            return self.fingerprint

    return ModelKey(weights_fingerprint(model))
