# SPDX-License-Identifier: Apache-2.0
"""The host syncs a call would make on a GPU, seen on the CPU.

With the device tensors on ``meta`` (no values, no copies), ``host_syncs()``
records these operations, each of which makes the host wait for the device's
queued work on CUDA:
- a tensor made from host data straight onto the device (``torch.tensor(data,
  device=...)``, ``torch.as_tensor``, ``Tensor.new_tensor``): a copy from
  pageable memory, which torch follows with a stream synchronize;
- a blocking copy between the host and the device (``.to``, ``.cpu()``,
  ``copy_``; the way without is ``non_blocking=True`` from pinned memory, and
  off CUDA, where nothing pins, ``non_blocking=True`` is what is checked);
- a read of device values on the host (``.item()``, ``.tolist()``,
  ``.numpy()``; these raise on meta anyway), and data-dependent shapes
  (``nonzero``, boolean masks: these raise on meta).

Not seen: host lists or CPU tensors used as indices into a device tensor
(``x[[1, 2]] = v``), and, off CUDA, whether a ``non_blocking`` copy's source is
pinned.

vLLM queues a step's forward and, with async scheduling (its CUDA default), the
next step's preparation behind it; a sync in the per-step work outside the
forward (counters, releases) makes the host wait for the forward there.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_FROM_HOST_DATA = {torch.tensor, torch.as_tensor}
_DEVICE_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy,
                 torch.Tensor.cpu}


def _on_device(device) -> bool:
    return device is not None and torch.device(device).type != "cpu"


def _target_device(args, kwargs):
    """The device a ``Tensor.to`` call names, or None."""
    for value in (*args[1:], kwargs.get("device")):
        if isinstance(value, (str, torch.device)):
            return torch.device(value)
        if isinstance(value, torch.Tensor):
            return value.device
    return None


def _non_blocking(args, kwargs) -> bool:
    """``Tensor.to``'s non_blocking, by keyword or in place (after the device or
    the dtype: ``to(device, dtype, non_blocking)``, ``to(dtype, non_blocking)``)."""
    if "non_blocking" in kwargs:
        return bool(kwargs["non_blocking"])
    flags = [value for value in args[1:] if isinstance(value, bool)]
    return bool(flags[0]) if flags else False


class _Recorder(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FROM_HOST_DATA and _on_device(kwargs.get("device")):
            self.syncs.append(f"{func.__name__}(host data, device={kwargs['device']})")
        elif func is torch.Tensor.new_tensor and _on_device(
                kwargs.get("device") or args[0].device):
            self.syncs.append(f"new_tensor(host data) on {args[0].device}")
        elif func is torch.Tensor.cuda:
            self._copy(args[0], torch.device("cuda"), kwargs.get("non_blocking", False))
        elif func in _DEVICE_READS and _on_device(args[0].device):
            self.syncs.append(f"Tensor.{func.__name__} of a {args[0].device} tensor")
        elif func is torch.Tensor.to:
            self._copy(args[0], _target_device(args, kwargs), _non_blocking(args, kwargs))
        elif func is torch.Tensor.copy_:
            self._copy(args[1], args[0].device,
                       args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        return func(*args, **kwargs)

    def _copy(self, source: torch.Tensor, target, non_blocking: bool) -> None:
        if target is None or (source.device.type == "cpu") == (target.type == "cpu"):
            return  # no host-device copy
        if source.device.type == "cpu" and non_blocking and (
                target.type != "cuda" or source.is_pinned()):
            return  # (only CUDA pins: off it, the call's non_blocking is what shows)
        direction = "to" if source.device.type == "cpu" else "from"
        self.syncs.append(f"a blocking copy {direction} the device ({source.device} -> "
                          f"{target}, non_blocking={non_blocking})")


@contextlib.contextmanager
def host_syncs():
    """Yields the list of the syncs the block makes (see the module docstring)."""
    recorder = _Recorder()
    with recorder:
        yield recorder.syncs
