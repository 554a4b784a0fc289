# SPDX-License-Identifier: Apache-2.0
"""The EngineArgs patch: InfiniGen kwargs and flags, stock behaviour when off, refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from vllm.config import KVTransferConfig
from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from vllm.platforms.interface import PlatformEnum
from vllm.utils.argparse_utils import FlexibleArgumentParser

import vllm_infinigen
from vllm_infinigen.config import FLAG_OF_FIELD
from vllm_infinigen.frontend import checks
from vllm_infinigen.patch import apply, patch_arg_utils
from vllm_infinigen.platforms import WORKERS

STORIES_DIR = str(Path(vllm_infinigen.__file__).parent / "assets" / "stories260k")
vllm_infinigen.register()  # what vLLM's plugin loader does in every process


# ---------------------------------------------------------------------------
# Keyword arguments (LLM(...) and EngineArgs(...))


@pytest.mark.parametrize("cls", [EngineArgs, AsyncEngineArgs])
def test_kwargs_fold_into_additional_config(cls):
    args = cls(model="x", kv_manager="infinigen", infinigen_budget=0.5)
    assert args.additional_config == {"kv_manager": "infinigen", "infinigen": {"budget": 0.5}}
    assert not hasattr(args, "kv_manager") and not hasattr(args, "infinigen_budget")


def test_kwargs_merge_with_given_additional_config():
    given = {"other": 1, "infinigen": {"alpha": 2.0}}
    args = EngineArgs(model="x", additional_config=given, kv_manager="infinigen",
                      infinigen_budget=0.5, infinigen_sink_tokens=4, infinigen_alpha=None)
    assert args.additional_config == {
        "other": 1,
        "kv_manager": "infinigen",
        "infinigen": {"alpha": 2.0, "budget": 0.5, "sink_tokens": 4},
    }
    assert given == {"other": 1, "infinigen": {"alpha": 2.0}}  # not mutated


def test_unknown_infinigen_kwarg_raises():
    with pytest.raises(ValueError) as info:
        EngineArgs(model="x", kv_manager="infinigen", infinigen_foo=1)
    assert "'infinigen_foo'" in str(info.value)
    assert "infinigen_budget" in str(info.value)  # lists the known ones


def test_bad_kwarg_value_names_flag():
    with pytest.raises(ValueError, match="--infinigen-budget"):
        EngineArgs(model="x", kv_manager="infinigen", infinigen_budget=2.0)


def test_infinigen_kwargs_need_the_manager():
    with pytest.raises(ValueError, match="--kv-manager infinigen"):
        EngineArgs(model="x", infinigen_budget=0.5)


def test_unknown_kv_manager_raises():
    with pytest.raises(ValueError, match="--kv-manager"):
        EngineArgs(model="x", kv_manager="lmcache")


def stock_engine_args(cls, **kwargs):
    """``cls(**kwargs)`` through vLLM's own, unpatched ``__init__``."""
    args = cls.__new__(cls)
    patch_arg_utils._original_init[cls](args, **kwargs)
    return args


@pytest.mark.parametrize("cls", [EngineArgs, AsyncEngineArgs])
@pytest.mark.parametrize("kwargs", [{}, {"additional_config": {"a": 1}}])
def test_without_infinigen_kwargs_behaves_as_stock(cls, kwargs):
    args = cls(model="x", **kwargs)
    assert args.additional_config == kwargs.get("additional_config", {})
    assert vars(args) == vars(stock_engine_args(cls, model="x", **kwargs))


# ---------------------------------------------------------------------------
# Command line


def parse(argv, cls=AsyncEngineArgs):
    parser = FlexibleArgumentParser()
    cls.add_cli_args(parser)
    return cls.from_cli_args(parser.parse_args(argv))


def test_cli_flags_fold_into_additional_config():
    args = parse(["--model", "x", "--kv-manager", "infinigen", "--infinigen-alpha", "3"])
    assert type(args) is AsyncEngineArgs
    assert args.additional_config == {"kv_manager": "infinigen", "infinigen": {"alpha": 3.0}}


def test_cli_every_flag():
    args = parse([
        "--model", "x", "--kv-manager", "infinigen", "--infinigen-alpha", "4.5",
        "--infinigen-speculation-keys", "partial", "--infinigen-partial-ratio", "0.25",
        "--infinigen-budget", "0.1", "--infinigen-dense-layers", "3",
        "--infinigen-sink-tokens", "4", "--infinigen-recent-tokens", "8",
    ], cls=EngineArgs)
    assert args.additional_config["infinigen"] == {
        "alpha": 4.5, "speculation_keys": "partial", "partial_ratio": 0.25, "budget": 0.1,
        "dense_layers": 3, "sink_tokens": 4, "recent_tokens": 8,
    }


def test_cli_flags_merge_with_additional_config_flag():
    args = parse([
        "--model", "x", "--additional-config",
        json.dumps({"a": 1, "kv_manager": "infinigen",
                    "infinigen": {"alpha": 2.0, "budget": 0.1}}),
        "--infinigen-budget", "0.5",
    ])
    assert args.additional_config == {
        "a": 1, "kv_manager": "infinigen", "infinigen": {"alpha": 2.0, "budget": 0.5},
    }


def test_cli_flags_reach_the_processes_vllm_spawns_with_the_arguments():
    """``--api-server-count`` > 1 and data parallelism hand the parsed arguments to
    new processes, which build their engine arguments before loading this plugin
    (vLLM's stock ``from_cli_args``): the settings travel in --additional-config."""
    parser = FlexibleArgumentParser()
    AsyncEngineArgs.add_cli_args(parser)
    namespace = parser.parse_args(["--model", "x", "--kv-manager", "infinigen",
                                   "--infinigen-budget", "0.1"])
    AsyncEngineArgs.from_cli_args(namespace)  # the parent's
    child = patch_arg_utils._original_from_cli_args.__func__(AsyncEngineArgs, namespace)
    assert child.additional_config == {"kv_manager": "infinigen", "infinigen": {"budget": 0.1}}
    assert AsyncEngineArgs.from_cli_args(namespace).additional_config == child.additional_config


def test_a_config_object_in_additional_config_is_stock():
    """vLLM takes any hashable config object there (``SupportsHash``)."""
    from vllm_infinigen.config import infinigen_config_of

    assert infinigen_config_of(type("Custom", (), {"compute_hash": lambda self: "x"})()) is None


def test_cli_bad_flag_value_names_flag():
    with pytest.raises(ValueError, match="--infinigen-budget"):
        parse(["--model", "x", "--kv-manager", "infinigen", "--infinigen-budget", "1.5"])


def test_cli_unknown_kv_manager_is_a_parse_error():
    with pytest.raises(SystemExit):
        parse(["--model", "x", "--kv-manager", "lmcache"])


@pytest.mark.parametrize("extra", [[], ["--additional-config", '{"a": 1}']])
def test_cli_without_infinigen_flags_behaves_as_stock(extra):
    argv = ["--model", "x", *extra]
    stock_parser = FlexibleArgumentParser()
    patch_arg_utils._original_add_cli_args(stock_parser)
    stock_ns = stock_parser.parse_args(argv)
    stock = patch_arg_utils._original_from_cli_args.__func__(EngineArgs, stock_ns)

    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    namespace = parser.parse_args(argv)
    args = EngineArgs.from_cli_args(namespace)

    assert args.additional_config == ({"a": 1} if extra else {})
    assert vars(args) == vars(stock)
    # Only the InfiniGen flags are new, and they default to "not given".
    added = set(vars(namespace)) - set(vars(stock_ns))
    assert added == {"kv_manager"} | {f"infinigen_{name}" for name in
                                      FLAG_OF_FIELD}
    assert all(getattr(namespace, name) is None for name in added)
    assert {k: v for k, v in vars(namespace).items() if k not in added} == vars(stock_ns)


# ---------------------------------------------------------------------------
# check_engine_args


def test_check_engine_args_accepts_plain_args():
    assert checks.check_engine_args(EngineArgs(model=STORIES_DIR)) is None
    # Ray workers run on the CPU backend since patch_ray (tests/unit/test_patch_ray.py).
    ray_tp = EngineArgs(model=STORIES_DIR, tensor_parallel_size=2,
                        distributed_executor_backend="ray")
    assert checks.check_engine_args(ray_tp) is None
    own = KVTransferConfig(kv_connector=checks.CONNECTOR_NAME, kv_role="kv_both")
    args = EngineArgs(model=STORIES_DIR, kv_transfer_config=own,
                      worker_cls=WORKERS["cpu"], enable_prefix_caching=False)
    assert checks.check_engine_args(args) is None


@pytest.mark.parametrize(
    "kwargs,flag",
    [
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
         "--speculative-config"),
        ({"pipeline_parallel_size": 2}, "--pipeline-parallel-size"),
        ({"decode_context_parallel_size": 2}, "--decode-context-parallel-size"),
        ({"prefill_context_parallel_size": 2}, "--prefill-context-parallel-size"),
        ({"kv_transfer_config": KVTransferConfig(kv_connector="NixlConnector",
                                                 kv_role="kv_both")},
         "--kv-transfer-config"),
        ({"kv_offloading_size": 4.0}, "--kv-offloading-size"),
        ({"worker_cls": "my.Worker"}, "--worker-cls"),
        ({"kv_cache_dtype": "fp8_inc"}, "--kv-cache-dtype"),
        ({"kv_cache_dtype": "bfloat16"}, "--kv-cache-dtype"),
        ({"enable_sleep_mode": True}, "--enable-sleep-mode"),
    ],
    ids=lambda value: value if isinstance(value, str) else None,
)
def test_check_engine_args_refuses(kwargs, flag):
    with pytest.raises(ValueError) as info:
        checks.check_engine_args(EngineArgs(model=STORIES_DIR, **kwargs))
    assert str(info.value).startswith("--kv-manager infinigen: ")
    assert flag in str(info.value)


@pytest.mark.parametrize("dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_is_taken_for_infinigens_own_policy(dtype):
    from vllm_infinigen.config import InfiniGenConfig

    args = EngineArgs(model=STORIES_DIR, kv_cache_dtype=dtype)
    assert checks.check_engine_args(args, InfiniGenConfig()) is None
    with pytest.raises(ValueError, match=f"--kv-cache-dtype {dtype}: --infinigen-policy h2o "
                                         "reads the pool with torch"):
        checks.check_engine_args(args, InfiniGenConfig(policy="h2o"))


def test_cuda_accepts_graphs_and_an_eager_engine_and_names_its_worker(monkeypatch):
    """vLLM's default CUDA graphs, eager, no graphs (what CUDA refuses:
    test_platform_refusals.py)."""
    from vllm.platforms import current_platform

    from vllm_infinigen.config import InfiniGenConfig

    monkeypatch.setattr(current_platform, "_enum", PlatformEnum.CUDA)  # vLLM's is_cuda()
    for kwargs in ({}, {"enforce_eager": True},
                   {"compilation_config": {"cudagraph_mode": "NONE"}}):
        assert checks.check_engine_args(EngineArgs(model=STORIES_DIR, **kwargs),
                                        InfiniGenConfig()) is None
    assert WORKERS["cuda"].endswith("platforms.cuda.worker.InfiniGenCUDAWorker")


def fake_model_dir(path, config):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_check_engine_args_refuses_unsupported_models(tmp_path):
    gpt2 = fake_model_dir(tmp_path / "gpt2", {"model_type": "gpt2"})
    with pytest.raises(ValueError, match="model type 'gpt2' is not supported"):
        checks.check_engine_args(EngineArgs(model=gpt2))
    gemma2 = fake_model_dir(tmp_path / "gemma2", {"model_type": "gemma2"})
    with pytest.raises(ValueError, match="model type 'gemma2' is not supported: attention "
                                         "logit soft-capping"):
        checks.check_engine_args(EngineArgs(model=gemma2))


def _shapes(model_dir) -> dict[str, int]:
    from vllm_infinigen.layout import ModelLayout

    layout = ModelLayout.of_model_dir(model_dir)
    return {"num_layers": layout.num_layers, "num_kv_heads": layout.num_kv_heads,
            "head_dim": layout.head_dim}


def test_model_shapes(tmp_path):
    assert _shapes(STORIES_DIR) == {
        "num_layers": 5, "num_kv_heads": 4, "head_dim": 32,
    }
    # Without num_key_value_heads and head_dim: MHA, hidden_size / heads.
    opt = fake_model_dir(tmp_path / "opt", {
        "model_type": "opt", "num_hidden_layers": 3, "num_attention_heads": 4,
        "hidden_size": 64,
    })
    assert _shapes(opt) == {
        "num_layers": 3, "num_kv_heads": 4, "head_dim": 16,
    }


# ---------------------------------------------------------------------------
# Run-once guard


def _patched_methods() -> dict:
    """The engine-argument methods the patch replaces, as the classes hold them now."""
    return {
        "init": EngineArgs.__dict__["__init__"],
        "async_init": AsyncEngineArgs.__dict__["__init__"],
        "add_cli_args": EngineArgs.__dict__["add_cli_args"],
        "from_cli_args": EngineArgs.__dict__["from_cli_args"],
        "create_engine_config": EngineArgs.__dict__["create_engine_config"],
    }


def test_apply_all_twice_is_idempotent(monkeypatch):
    before = _patched_methods()
    apply.apply_all()
    apply.apply_all()
    vllm_infinigen.register()
    after = _patched_methods()
    assert after == before
    # One wrapper around vLLM's own __init__, not a wrapper of a wrapper.
    for cls in (EngineArgs, AsyncEngineArgs):
        original = patch_arg_utils._original_init[cls]
        assert cls.__dict__["__init__"].__wrapped__ is original
        assert not hasattr(original, "__wrapped__")
    assert patch_arg_utils._original_create_engine_config is not (
        patch_arg_utils._create_engine_config
    )

    calls = []
    post_init = EngineArgs.__post_init__

    def counting_post_init(self):
        calls.append(type(self))
        post_init(self)

    monkeypatch.setattr(EngineArgs, "__post_init__", counting_post_init)
    args = EngineArgs(model="x", kv_manager="infinigen", infinigen_alpha=3.0)
    assert calls == [EngineArgs]
    assert args.additional_config == {"kv_manager": "infinigen", "infinigen": {"alpha": 3.0}}
    async_args = parse(["--model", "x", "--kv-manager", "infinigen"])
    assert calls == [EngineArgs, AsyncEngineArgs]
    assert async_args.additional_config == {"kv_manager": "infinigen"}


def test_apply_twice_keeps_the_originals():
    original = patch_arg_utils._original_create_engine_config
    patch_arg_utils.apply()
    assert patch_arg_utils._original_create_engine_config is original
    assert patch_arg_utils._original_create_engine_config is not patch_arg_utils._create_engine_config
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())  # no recursion
    assert parser.parse_args(["--kv-manager", "infinigen"]).kv_manager == "infinigen"


@pytest.mark.parametrize("cls", [EngineArgs, AsyncEngineArgs])
def test_explicit_vllm_manager_keeps_config_stock(cls):
    assert cls(model="x", kv_manager="vllm").additional_config == cls(model="x").additional_config
    ns = cls.add_cli_args(FlexibleArgumentParser()).parse_args(["--kv-manager", "vllm"])
    assert cls.from_cli_args(ns).additional_config == cls(model="x").additional_config


def test_check_engine_args_refuses_no_sparse_layer():
    args = EngineArgs(model=STORIES_DIR, kv_manager="infinigen", infinigen_dense_layers=5)
    with pytest.raises(ValueError, match="--infinigen-dense-layers"):
        checks.check_engine_args(args)


def test_check_engine_args_refuses_disabled_hybrid_manager():
    args = EngineArgs(model=STORIES_DIR, disable_hybrid_kv_cache_manager=True)
    with pytest.raises(ValueError, match="--disable-hybrid-kv-cache-manager"):
        checks.check_engine_args(args)


def test_non_dict_additional_config_is_stock():
    from vllm_infinigen.config import kv_manager_of

    assert kv_manager_of(object()) == "vllm"


def test_check_engine_args_refuses_split_dense_groups_and_block_override():
    args = EngineArgs(model=STORIES_DIR, kv_manager="infinigen", infinigen_dense_layers=4)
    with pytest.raises(ValueError, match="--infinigen-dense-layers 4"):
        checks.check_engine_args(args)
    args = EngineArgs(model=STORIES_DIR, num_gpu_blocks_override=100)
    with pytest.raises(ValueError, match="--num-gpu-blocks-override"):
        checks.check_engine_args(args)


@pytest.mark.parametrize("dense,sparse", [
    (2, 14), (2, 3), (3, 4), (4, 2), (5, 3), (1, 7), (3, 3),
])
def test_kv_cache_group_size_matches_vllm(dense, sparse):
    """Our mirror of the grouping equals vLLM's own grouping of the specs."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from tests.vllm_api import kv_cache_groups_uniform_page_size
    from vllm_infinigen.layout import kv_cache_group_size
    from vllm_infinigen.scheduler.spec import InfiniGenSparseSpec

    full = FullAttentionSpec(block_size=128, num_kv_heads=1, head_size=32,
                             dtype=torch.float32)
    specs = {f"model.layers.{i}.self_attn.attn": full for i in range(dense)}
    specs.update({f"model.layers.{dense + i}.self_attn.attn": InfiniGenSparseSpec.of(full)
                  for i in range(sparse)})
    groups = kv_cache_groups_uniform_page_size(specs)
    # A group short of layers is padded to the size (the padding is unnamed).
    assert max(len(group.layer_names) for group in groups) == kv_cache_group_size(dense, sparse)


def test_pool_cap_below_one_step_is_refused_before_start():
    from benchmarks.harness.paths import BUNDLED_MODEL

    # stories260K: 3,072 B of pool per token; 100 tokens < 128 per step.
    args = EngineArgs(model=str(BUNDLED_MODEL), dtype="float32", max_model_len=512,
                      max_num_batched_tokens=128, kv_manager="infinigen",
                      infinigen_cpu_pool_gib=100 * 3072 / 2**30)
    with pytest.raises(ValueError, match=r"--infinigen-cpu-pool-gib .* holds 100 tokens"
                                         r".*--max-num-batched-tokens"):
        args.create_engine_config()


def test_importing_modules_patches_nothing():
    """Only register() (the entry point) changes vLLM; imports do not."""
    import subprocess
    import sys

    code = """
import importlib, pkgutil
import vllm_infinigen
from vllm.engine.arg_utils import EngineArgs
before = (EngineArgs.__init__, EngineArgs.add_cli_args, EngineArgs.create_engine_config)
for module in pkgutil.walk_packages(vllm_infinigen.__path__, "vllm_infinigen."):
    if module.name.endswith("__main__") or module.name.endswith("ray_cpu"):
        continue  # runs the kernel build / needs Ray
    importlib.import_module(module.name)
after = (EngineArgs.__init__, EngineArgs.add_cli_args, EngineArgs.create_engine_config)
assert before == after, "an import patched EngineArgs"
from vllm.v1 import kv_cache_spec_registry as registry
from vllm_infinigen.scheduler.spec import InfiniGenSparseSpec
assert InfiniGenSparseSpec not in registry._REGISTRY_KVCACHESPEC_LIST
vllm_infinigen.register()
assert EngineArgs.create_engine_config is not before[2], "register() did not patch"
assert InfiniGenSparseSpec in registry._REGISTRY_KVCACHESPEC_LIST
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_start_up_calibration_that_would_not_fit_is_refused_naming_prepare():
    from vllm_infinigen.frontend.skew_setup import check_calibration_fits
    from vllm_infinigen.skewing.calibration import calibration_memory_bytes

    model = STORIES_DIR
    needed = calibration_memory_bytes(model)
    check_calibration_fits(model, free=needed)
    with pytest.raises(ValueError, match=r"needs about .* GiB, but .* GiB are free; run "
                       r"`vllm-infinigen prepare .* --out FILE` .* --infinigen-skew-file FILE"):
        check_calibration_fits(model, free=needed - 1)


# ---------------------------------------------------------------------------
# Model runner: InfiniGen's worker extends vLLM's V1 runner


def test_model_runner_v2_chosen_by_vllm_itself_is_switched_to_v1(monkeypatch):
    """Triton with a CPU backend makes vLLM pick Model Runner V2 unless told
    otherwise; with InfiniGen on, the engine processes are told otherwise."""
    import os

    import vllm.config.vllm as vllm_config_module

    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)
    monkeypatch.setenv(checks.V2_RUNNER_ENV, "unset below; restored as absent")
    monkeypatch.delenv(checks.V2_RUNNER_ENV)
    stock = EngineArgs(model=STORIES_DIR).create_engine_config()
    assert stock.use_v2_model_runner and checks.V2_RUNNER_ENV not in os.environ
    config = EngineArgs(model=STORIES_DIR, kv_manager="infinigen").create_engine_config()
    assert os.environ[checks.V2_RUNNER_ENV] == "0"
    assert not config.use_v2_model_runner


def test_model_runner_v2_asked_for_is_refused_naming_the_variable(monkeypatch):
    import vllm.config.vllm as vllm_config_module

    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)  # else vLLM refuses V2 itself
    monkeypatch.setenv(checks.V2_RUNNER_ENV, "1")
    with pytest.raises(ValueError, match="--kv-manager infinigen.*VLLM_USE_V2_MODEL_RUNNER=0"):
        EngineArgs(model=STORIES_DIR, kv_manager="infinigen").create_engine_config()
    assert EngineArgs(model=STORIES_DIR).create_engine_config().use_v2_model_runner


def test_the_worker_refuses_model_runner_v2():
    from vllm_infinigen.platforms.cpu.worker import InfiniGenCPUWorker

    worker = InfiniGenCPUWorker.__new__(InfiniGenCPUWorker)
    worker.use_v2_model_runner = True
    with pytest.raises(RuntimeError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        worker.init_device()


def test_the_connector_is_no_consumer_so_vllm_frees_blocks_at_once():
    """With async scheduling (vLLM's CUDA default: two steps in flight) vLLM's
    scheduler holds a finished request's blocks a step longer for a consumer
    connector, whose loads may not be ordered after the steps still writing them
    (``Scheduler.defer_block_free``). InfiniGen loads nothing that way: with the
    blocks held, device-first residency would see fewer free blocks and move to
    the pool where a synchronous engine stays resident."""
    config = EngineArgs(model=STORIES_DIR, kv_manager="infinigen").create_engine_config()
    transfer = config.kv_transfer_config
    assert transfer.kv_connector == checks.CONNECTOR_NAME
    assert transfer.is_kv_producer and not transfer.is_kv_consumer
    from vllm_infinigen.scheduler.connector import InfiniGenConnector

    # A producer's default is True (recompute a preempted request whose hand-off is
    # pending): InfiniGen hands nothing off.
    assert InfiniGenConnector.requires_kv_delivery.fget(None) is False


def test_the_connector_declines_sleep_mode():
    """vLLM 0.33's connector base asks ``supports_sleep_mode`` (default True)."""
    from vllm_infinigen.scheduler.connector import InfiniGenConnector

    declared = InfiniGenConnector.__dict__["supports_sleep_mode"]
    assert isinstance(declared, property) and declared.fget(None) is False


# vLLM's prefix caching


@pytest.mark.parametrize("settings", [{}, {"infinigen_policy": "quest"},
                                      {"infinigen_policy": "streaming"},
                                      {"infinigen_residency": "device-first"}])
def test_prefix_caching_is_on_by_default_as_in_stock(settings):
    stock = EngineArgs(model=STORIES_DIR).create_engine_config()
    config = EngineArgs(model=STORIES_DIR, kv_manager="infinigen",
                        **settings).create_engine_config()
    assert stock.cache_config.enable_prefix_caching
    assert config.cache_config.enable_prefix_caching
    explicit = EngineArgs(model=STORIES_DIR, kv_manager="infinigen", enable_prefix_caching=False,
                          **settings).create_engine_config()
    assert not explicit.cache_config.enable_prefix_caching


PREFIX_CACHING_REFUSED = [
    ({"infinigen_policy": "h2o"}, "--infinigen-policy h2o"),
    ({"infinigen_eval_dense_prefix": 16}, "--infinigen-eval-dense-prefix"),
]


@pytest.mark.parametrize("settings,flag", PREFIX_CACHING_REFUSED)
def test_prefix_caching_is_off_by_default_where_it_cannot_run(settings, flag, monkeypatch):
    said: list[str] = []
    monkeypatch.setattr(patch_arg_utils.logger, "info",
                        lambda message, *args: said.append(message % args))
    config = EngineArgs(model=STORIES_DIR, kv_manager="infinigen",
                        **settings).create_engine_config()
    assert not config.cache_config.enable_prefix_caching
    assert any(line.startswith(f"InfiniGen: prefix caching off (vLLM's default is on): {flag}")
               for line in said), said


@pytest.mark.parametrize("settings,flag", PREFIX_CACHING_REFUSED)
def test_prefix_caching_asked_for_where_it_cannot_run_is_refused(settings, flag):
    args = EngineArgs(model=STORIES_DIR, kv_manager="infinigen", enable_prefix_caching=True,
                      **settings)
    with pytest.raises(ValueError) as info:
        args.create_engine_config()
    message = str(info.value)
    assert message.startswith("--kv-manager infinigen: --enable-prefix-caching: ")
    assert flag in message and "--no-enable-prefix-caching" in message

