# SPDX-License-Identifier: Apache-2.0
"""A watch over what a decode step dispatches, for the CUDA data path's step on CPU tensors
(``tests/unit/test_cuda_device_step.py``): host reads of step data, the ops each layer
launches (a kernel of the platform counted as one), and the shapes it allocates.

The platform's kernels run their torch references on CPU tensors; on CUDA each is one
launch (Triton), so the watch wraps them: inside one, nothing is counted or checked.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from vllm_infinigen.platforms.cuda import kernels
from vllm_infinigen.platforms.cuda.block_cache import DeviceBlockCache

# (module or class, function name): each one kernel launch on CUDA.
KERNELS = ((kernels, "int_scores"), (kernels, "alpha_counts"), (kernels, "select"),
           (kernels, "bound_scores"), (DeviceBlockCache, "place"), (kernels, "gather_units"),
           (kernels, "write_tokens"), (kernels, "encode_groups"), (kernels, "encode_bounds"),
           (kernels, "attend_units"), (kernels, "write_cached_tokens"))
# Ops that read step data back to the host (a device sync on CUDA), or that size
# their output by it.
HOST_READS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2",
              "item", "is_nonzero"}
HOST_METHODS = {"tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__",
                "__index__", "nonzero", "masked_select"}
HOST_FUNCTIONS = {"tensor", "as_tensor", "from_numpy", "nonzero", "masked_select"}
# Ops that launch nothing: views and allocations.
NO_LAUNCH = {"view", "_unsafe_view", "reshape", "slice", "select", "permute", "expand",
             "unsqueeze", "squeeze", "t", "transpose", "as_strided", "alias", "detach",
             "split", "split_with_sizes", "unbind", "empty", "empty_like", "empty_strided",
             "new_empty", "new_empty_strided", "lift_fresh", "_reshape_alias", "unflatten",
             "flatten", "view_as", "expand_as", "narrow", "chunk"}


class HostRead(AssertionError):
    """A decode step read step data back to the host."""


class StepWatch:
    """Watches a step: what runs ``with watch.layer(name):`` is InfiniGen's work
    for a layer (what the model itself computes around it is not watched)."""

    def __init__(self, *, forbid_host_reads: bool = True):
        self.forbid = forbid_host_reads
        self.inside_kernel = 0
        self.current: str | None = None
        self.ops: dict[str, list[str]] = {}
        self.shapes: list[tuple[str, tuple]] = []

    @contextlib.contextmanager
    def layer(self, name: str) -> Iterator[None]:
        previous, self.current = self.current, name
        try:
            yield
        finally:
            self.current = previous

    def record(self, name: str, out) -> None:
        if self.current is None:
            return
        self.ops.setdefault(self.current, []).append(name)
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        shapes = tuple(tuple(t.shape) for t in outputs if isinstance(t, torch.Tensor))
        self.shapes.append((name, shapes))

    def refuse(self, what: str) -> None:
        if self.forbid and not self.inside_kernel and self.current is not None:
            raise HostRead(f"{what} in {self.current}")


class _Dispatch(TorchDispatchMode):
    def __init__(self, watch: StepWatch):
        super().__init__()
        self.watch = watch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        watch = self.watch
        if watch.inside_kernel:
            return out
        name = func._opname
        if name in HOST_READS:
            watch.refuse(f"aten.{name}")
        if name in ("index", "index_put", "index_put_") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool
                for i in (args[1] if len(args) > 1 and isinstance(args[1], (list, tuple))
                          else ())):
            watch.refuse(f"aten.{name} with a boolean mask")
        if name not in NO_LAUNCH:
            watch.record(name, out)
        return out


class _Functions(TorchFunctionMode):
    def __init__(self, watch: StepWatch):
        super().__init__()
        self.watch = watch

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        is_method = getattr(func, "__objclass__", None) is torch.Tensor or (
            getattr(func, "__qualname__", "").startswith("Tensor.")
            or getattr(func, "__qualname__", "").startswith("_TensorBase."))
        if (is_method and name in HOST_METHODS) or (not is_method and name in HOST_FUNCTIONS):
            self.watch.refuse(f"{'Tensor.' if is_method else 'torch.'}{name}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def watching(watch: StepWatch, monkeypatch: pytest.MonkeyPatch) -> Iterator[StepWatch]:
    """Installs the watch: the platform's kernels counted as one op each."""
    for owner, name in KERNELS:
        original = getattr(owner, name)

        def wrapped(*args, _original=original, _name=name, **kwargs):
            if watch.inside_kernel:
                return _original(*args, **kwargs)
            watch.inside_kernel += 1
            try:
                out = _original(*args, **kwargs)
            finally:
                watch.inside_kernel -= 1
            watch.record(f"kernel:{_name}", out)
            return out

        monkeypatch.setattr(owner, name, wrapped)
    with _Functions(watch), _Dispatch(watch):
        yield watch
