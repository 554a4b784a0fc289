# SPDX-License-Identifier: Apache-2.0
"""The OpenMP reservation patch: InfiniGen's engines get stock vLLM's worker cores.

vLLM reserves a core per rank for the engine process and one more when a KV
connector is configured (for NIXL); InfiniGen's connector runs no thread, and
on a two-core host the extra count left the engine process no core at all.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import vllm.utils.cpu_resource_utils as cr_utils
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.cpu_resource_utils import LogicalCPUInfo
from vllm.utils.ompmultiprocessing import OMPProcessManager

import vllm_infinigen
from vllm_infinigen.frontend.checks import CONNECTOR_NAME
from vllm_infinigen.patch import patch_omp_reservation

STORIES_DIR = str(Path(vllm_infinigen.__file__).parent / "assets" / "stories260k")
vllm_infinigen.register()  # what vLLM's plugin loader does in every process


@pytest.fixture
def cores(monkeypatch):
    """A host of ``n`` single-thread cores on one NUMA node, vLLM's binding automatic."""
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    monkeypatch.setattr(cr_utils, "get_visible_memory_node", lambda: [0])

    def host(n: int) -> None:
        cpus = [LogicalCPUInfo(id=i, physical_core=i, numa_node=0) for i in range(n)]
        monkeypatch.setattr(cr_utils, "get_allowed_cpu_list", lambda: list(cpus))

    return host


def config_with(connector: str | None) -> SimpleNamespace:
    parallel = SimpleNamespace(local_world_size=1, data_parallel_rank_local=None,
                               _api_process_count=1)
    transfer = None if connector is None else SimpleNamespace(kv_connector=connector)
    return SimpleNamespace(parallel_config=parallel, kv_transfer_config=transfer)


def binding(config) -> tuple[list[list[int]], list[int]]:
    manager = OMPProcessManager(config)
    return [list(cpus) for cpus in manager.cpu_lists], list(manager.reserved_cpu_list)


def unpatched_binding(config) -> tuple[list[list[int]], list[int]]:
    manager = OMPProcessManager.__new__(OMPProcessManager)
    patch_omp_reservation._original_init(manager, config)
    return [list(cpus) for cpus in manager.cpu_lists], list(manager.reserved_cpu_list)


@pytest.mark.parametrize("n, stock", [(2, ([[0]], [1])), (4, ([[0, 1, 2]], [3]))])
def test_infinigen_workers_get_stock_cores(cores, n, stock):
    cores(n)
    assert binding(config_with(None)) == stock
    assert binding(config_with(CONNECTOR_NAME)) == stock
    # What vLLM alone gives InfiniGen's connector: on two cores no core for the
    # engine process, on four one core fewer for the worker.
    assert unpatched_binding(config_with(CONNECTOR_NAME)) == {
        2: ([[0, 1]], []), 4: ([[0, 1]], [2, 3])}[n]


def test_other_connectors_keep_vllms_count(cores):
    cores(4)
    assert binding(config_with("NixlConnector")) == ([[0, 1]], [2, 3])


def test_the_users_reservation_still_rules(cores, monkeypatch):
    cores(4)
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    assert binding(config_with(CONNECTOR_NAME)) == ([[0, 1, 2, 3]], [])
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "2")
    assert binding(config_with(CONNECTOR_NAME)) == ([[0, 1]], [2, 3])


def test_an_infinigen_engine_config_is_recognised(cores):
    cores(4)
    config = EngineArgs(model=STORIES_DIR, kv_manager="infinigen").create_engine_config()
    assert patch_omp_reservation.uses_own_connector(config)
    stock = EngineArgs(model=STORIES_DIR).create_engine_config()
    assert not patch_omp_reservation.uses_own_connector(stock)
    assert binding(config) == binding(stock) == ([[0, 1, 2]], [3])


def test_apply_twice_wraps_once():
    patch_omp_reservation.apply()
    patch_omp_reservation.apply()
    assert OMPProcessManager.__dict__["__init__"] is patch_omp_reservation._init
    assert patch_omp_reservation._original_init is not patch_omp_reservation._init


def test_a_ray_workers_cores_are_stock_vllms_too(cores, monkeypatch):
    """A Ray worker asks for its cores before vLLM loads the plugins in it: as in that
    fresh process, neither the plugins nor the patch are in place here."""
    pytest.importorskip("ray", reason="Ray is not installed (the ray and test extras)")
    import vllm.plugins

    from vllm_infinigen.patch import apply
    from vllm_infinigen.platforms.cpu.ray_connection import omp_cpu_list

    monkeypatch.setattr(OMPProcessManager, "__init__", patch_omp_reservation._original_init)
    monkeypatch.setattr(patch_omp_reservation, "_original_init", None)
    monkeypatch.setattr(apply, "_applied", False)
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    cores(4)
    assert omp_cpu_list(config_with(CONNECTOR_NAME), 0) == [0, 1, 2]
    assert omp_cpu_list(config_with(None), 0) == [0, 1, 2]
