# SPDX-License-Identifier: Apache-2.0
"""What each platform refuses is the platform's (``platforms.refusal_for``): on
CUDA an uncapped pool, InfiniGen's own policy and transfer, and CUDA-graph
settings that would capture the attention or the KV-cache write inside a
piecewise graph; vLLM's default CUDA graphs run. The CPU build refuses none."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm.engine.arg_utils import EngineArgs
from vllm.platforms.interface import PlatformEnum

import vllm_infinigen
from vllm_infinigen.config import InfiniGenConfig
from vllm_infinigen.frontend import checks
from vllm_infinigen.platforms import REFUSALS, refusal_for
from vllm_infinigen.platforms.cuda.refusals import (
    ATTENTION_OP,
    BREAKABLE_ENV,
    KV_CACHE_UPDATE_OP,
)

STORIES_DIR = str(Path(vllm_infinigen.__file__).parent / "assets" / "stories260k")
vllm_infinigen.register()


def _args(**kwargs) -> EngineArgs:
    return EngineArgs(model=STORIES_DIR, **kwargs)


@pytest.fixture(autouse=True)
def _no_breakable_graphs(monkeypatch):
    monkeypatch.delenv(BREAKABLE_ENV, raising=False)


@pytest.mark.parametrize("kwargs", [
    {},  # vLLM's default: FULL_AND_PIECEWISE on CUDA
    {"compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE"}},
    {"compilation_config": {"cudagraph_mode": "PIECEWISE"}},
    {"compilation_config": {"cudagraph_mode": "FULL"}},  # resolved to FULL_AND_PIECEWISE
    {"compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}},
    {"compilation_config": {"cudagraph_mode": "NONE"}},
    {"enforce_eager": True},
    {"compilation_config": {"splitting_ops": []}},  # no piecewise graph left
    {"compilation_config": {"splitting_ops": [ATTENTION_OP, KV_CACHE_UPDATE_OP]}},
    {"compilation_config": {"use_inductor_graph_partition": True,
                            "splitting_ops": [ATTENTION_OP, KV_CACHE_UPDATE_OP]}},
    {"compilation_config": {"use_inductor_graph_partition": True,
                            "cudagraph_mode": "FULL_DECODE_ONLY"}},
    {"compilation_config": {"mode": 0, "splitting_ops": ["vllm::other"]}},  # no pieces
], ids=["default", "full-and-piecewise", "piecewise", "full", "full-decode-only", "none",
        "eager", "no-splitting", "both-split", "partition-split", "partition-decode-only",
        "not-compiled"])
def test_cuda_runs_cuda_graphs(kwargs):
    assert refusal_for("cuda", _args(**kwargs), InfiniGenConfig()) is None


def test_check_engine_args_accepts_default_graphs_on_cuda(monkeypatch):
    """The front end asks the platform (faked): no --enforce-eager."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "_enum", PlatformEnum.CUDA)  # vLLM's is_cuda()
    assert checks.check_engine_args(_args(), InfiniGenConfig()) is None


def test_rocm_is_refused_by_its_name_not_its_device_type(monkeypatch):
    """vLLM's ROCm platform reports device type "cuda": the tables key vLLM's
    platform, so ROCm is refused by name instead of taking CUDA's worker."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "_enum", PlatformEnum.ROCM)
    monkeypatch.setattr(current_platform, "device_type", "cuda")
    with pytest.raises(ValueError, match="'rocm' platform is not supported.*--kv-manager vllm"):
        checks.check_engine_args(_args(), InfiniGenConfig())


@pytest.mark.parametrize("kwargs,env,flag", [
    ({"compilation_config": {"splitting_ops": [ATTENTION_OP]}}, False, KV_CACHE_UPDATE_OP),
    ({"compilation_config": {"splitting_ops": [KV_CACHE_UPDATE_OP],
                             "cudagraph_mode": "PIECEWISE"}}, False, ATTENTION_OP),
    ({"compilation_config": {"use_inductor_graph_partition": True}}, False,
     "use_inductor_graph_partition"),
    ({}, True, BREAKABLE_ENV),
], ids=["kv-write-in-a-piece", "attention-in-a-piece", "inductor-partition", "breakable"])
def test_cuda_refuses_a_piecewise_graph_around_host_planning(monkeypatch, kwargs, env, flag):
    if env:
        monkeypatch.setenv(BREAKABLE_ENV, "1")
    args = _args(**kwargs)
    reason = refusal_for("cuda", args, InfiniGenConfig())
    assert reason is not None and flag in reason
    assert "FULL_DECODE_ONLY" in reason  # what to set instead
    assert refusal_for("cpu", args, InfiniGenConfig()) is None
    for eager in (_args(enforce_eager=True, **kwargs),
                  _args(**{**kwargs, "compilation_config": {
                      **kwargs.get("compilation_config", {}),
                      "cudagraph_mode": "FULL_DECODE_ONLY"}})):
        assert refusal_for("cuda", eager, InfiniGenConfig()) is None


@pytest.mark.parametrize("settings,flag", [
    ({"cpu_pool_gib": 1.0}, "--infinigen-cpu-pool-gib"),
    ({"policy": "h2o"}, "--infinigen-policy"),
    ({"transfer": "copy"}, "--infinigen-transfer"),
    ({"residency": "device-first"}, "--enable-dbo"),
    ({}, "--enable-dbo"),
    ({"ubatch_size": 2}, "--ubatch-size"),
], ids=["capped-pool", "baseline", "transfer", "residency-with-dbo", "dbo", "ubatch"])
def test_cuda_refuses_what_its_data_path_cannot_run(monkeypatch, settings, flag):
    """With vLLM's default graphs, through the front end (platform faked).
    Micro-batching in any residency: its two parts of a step run layer by layer in
    turn, and each layer keeps one selection (the first part's taken by the second)."""
    from vllm.platforms import current_platform

    settings = dict(settings)
    kwargs = ({"ubatch_size": settings.pop("ubatch_size")} if "ubatch_size" in settings
              else {"enable_dbo": True} if flag == "--enable-dbo" else {})
    config = InfiniGenConfig(**settings)
    assert refusal_for("cpu", _args(**kwargs), config) is None
    assert flag in refusal_for("cuda", _args(**kwargs), config)
    monkeypatch.setattr(current_platform, "_enum", PlatformEnum.CUDA)
    with pytest.raises(ValueError) as info:
        checks.check_engine_args(_args(**kwargs), config)
    assert str(info.value).startswith("--kv-manager infinigen: ")
    assert flag in str(info.value)


@pytest.mark.parametrize("dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_both_platforms_take_fp8_kv_with_infinigens_policy(monkeypatch, dtype):
    """The pinned pool, the device block cache and the Triton attention hold
    FP8 too (``platforms/cuda/kernels``); the baselines' policies stay refused
    in FP8 on every platform (``frontend/checks.py``)."""
    from vllm.platforms import current_platform

    args = _args(kv_cache_dtype=dtype)
    assert refusal_for("cpu", args, InfiniGenConfig()) is None
    assert refusal_for("cuda", args, InfiniGenConfig()) is None
    monkeypatch.setattr(current_platform, "_enum", PlatformEnum.CUDA)
    checks.check_engine_args(args, InfiniGenConfig())  # no refusal
    with pytest.raises(ValueError, match="--infinigen-policy"):
        checks.check_engine_args(args, InfiniGenConfig(policy="h2o"))


def test_cuda_refuses_a_block_size_its_attention_kernel_cannot_read(monkeypatch):
    """vLLM takes any block size, InfiniGen a multiple of 16 (``check_block_size``); the
    CUDA attention kernel a power of two: 48 was refused at the first sparse step."""
    from vllm.platforms import current_platform

    for block_size in (16, 32, 128, None):
        assert refusal_for("cuda", _args(block_size=block_size), InfiniGenConfig()) is None
    assert refusal_for("cpu", _args(block_size=48), InfiniGenConfig()) is None
    monkeypatch.setattr(current_platform, "_enum", PlatformEnum.CUDA)
    with pytest.raises(ValueError, match="--kv-manager infinigen: --block-size 48: the CUDA "
                       "attention kernel reads blocks of a power of two tokens"):
        checks.check_engine_args(_args(block_size=48), InfiniGenConfig())


def test_cuda_runs_device_first_with_vllms_default_graphs():
    """Both residencies' full graphs are captured (``platforms/cuda/residency.py``)."""
    config = InfiniGenConfig(residency="device-first")
    for kwargs in ({}, {"enforce_eager": True},
                   {"compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}}):
        assert refusal_for("cuda", _args(**kwargs), config) is None


def test_cuda_runs_evaluation_mode_eagerly_only():
    """Evaluation mode plans every step on the host: no full decode graph."""
    config = InfiniGenConfig(eval_dense_prefix=16)
    assert "--enforce-eager" in refusal_for("cuda", _args(), config)
    assert refusal_for("cuda", _args(enforce_eager=True), config) is None
    assert refusal_for("cpu", _args(), config) is None


def test_a_platform_without_a_table_line_refuses_nothing():
    assert "cpu" not in REFUSALS
    assert refusal_for("cpu", _args(), InfiniGenConfig(policy="h2o")) is None
    assert refusal_for("tpu", _args(), InfiniGenConfig()) is None
