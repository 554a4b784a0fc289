# SPDX-License-Identifier: Apache-2.0
"""Front end: the ``--kv-manager``/``--infinigen-*`` flags and ``LLM(...)`` keywords.

Both are derived from the settings' declarations (``config.py``): a setting
added there is a flag with its ``--help`` line, a keyword and an
``additional_config["infinigen"]`` key without a change here. Flags and
keywords fold into ``additional_config`` (a real, hashed ``VllmConfig``
field that reaches every engine process); ``patch/patch_arg_utils.py`` calls
these from the wrapped ``EngineArgs`` methods.
"""

from __future__ import annotations

import argparse
from typing import Any

from vllm_infinigen import config

KV_MANAGER_HELP = ("KV-cache manager: 'vllm' (default, unchanged behaviour) or "
                   "'infinigen' (speculative sparse decode attention).")


def split_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Removes ``kv_manager`` and ``infinigen_*`` from kwargs and returns them."""
    extras = {}
    for key in list(kwargs):
        if key == "kv_manager" or key.startswith(config.KWARG_PREFIX):
            extras[key] = kwargs.pop(key)
    return extras


def fold_into_additional_config(
    additional_config: dict[str, Any] | None, extras: dict[str, Any]
) -> dict[str, Any]:
    """Merges ``kv_manager``/``infinigen_*`` values (None = not given) into a copy.

    Raises:
        ValueError: On an unknown ``infinigen_*`` name or bad value.
    """
    known = [field.name for field in config.settings()]
    merged = dict(additional_config or {})
    values = dict(merged.get("infinigen") or {})
    for key, value in extras.items():
        if value is None:
            continue
        if key == "kv_manager":
            # "vllm" is the default: leave the config (and its hash) as stock.
            if value == "vllm":
                merged.pop("kv_manager", None)
            else:
                merged["kv_manager"] = value
            continue
        name = key[len(config.KWARG_PREFIX):]
        if name not in known:
            raise ValueError(
                f"unknown InfiniGen option {key!r}; known: "
                f"{[config.KWARG_PREFIX + known_name for known_name in known]}"
            )
        values[name] = value
    if values:
        merged["infinigen"] = values
    config.infinigen_config_of(merged)  # validates, naming the flag
    return merged


# The flags' argparse default is None ("not given"), which vLLM's help formatter
# (argparse.ArgumentDefaultsHelpFormatter) would print as "(default: None)" after
# the real default the help names. It appends nothing to a help that mentions
# %(default); this mention renders as the empty string.
_NO_DEFAULT_NOTE = "%(default).0s"


def add_infinigen_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The InfiniGen argument group: ``--kv-manager`` and one flag per setting."""
    group = parser.add_argument_group(
        "InfiniGen", "Dynamic KV-cache management (vllm-infinigen)."
    )
    group.add_argument("--kv-manager", choices=config.KV_MANAGERS, default=None,
                       help=KV_MANAGER_HELP + _NO_DEFAULT_NOTE)
    for field in config.settings():
        meta = field.metadata
        notes = [] if meta["choices"] is None else ["one of " + ", ".join(meta["choices"])]
        if meta["show_default"] and field.default is not None:
            notes.append(f"default {field.default}")
        help_text = (meta["help"] + (f" ({'; '.join(notes)})" if notes else "")
                     + _NO_DEFAULT_NOTE)
        # Values are checked by InfiniGenConfig, naming the flag; default None
        # means "not given", so that only what the user typed is folded in.
        group.add_argument(config.flag(field.name), type=config.value_type(field),
                           default=None, help=help_text)
    return parser


def extras_from_cli(args: argparse.Namespace) -> dict[str, Any]:
    """The ``kv_manager``/``infinigen_*`` values of a parsed command line."""
    extras = {"kv_manager": getattr(args, "kv_manager", None)}
    for field in config.settings():
        name = config.KWARG_PREFIX + field.name
        extras[name] = getattr(args, name, None)
    return extras
