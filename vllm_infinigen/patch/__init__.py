# SPDX-License-Identifier: Apache-2.0
"""Runtime patches of vLLM, applied from the ``vllm.general_plugins`` entry point.

Patch index
===========

``patch_arg_utils.py``
    File: ``vllm/engine/arg_utils.py`` (``EngineArgs.__init__``,
    ``EngineArgs.add_cli_args``, ``EngineArgs.from_cli_args``,
    ``EngineArgs.create_engine_config``; ``AsyncEngineArgs.__init__``).
    Why: vLLM has no hook for a plugin's own engine flags. Users type
    ``--kv-manager infinigen`` and ``LLM(kv_manager="infinigen")``.
    How: the flags and keyword arguments are folded into
    ``additional_config`` (a real, hashed ``VllmConfig`` field); when the
    InfiniGen manager is selected, ``create_engine_config`` validates it,
    prepares the skew file and sets ``worker_cls`` and ``kv_transfer_config``.
    With ``--kv-manager vllm`` (the default) every wrapper falls through to
    ``_original_<fn>`` with the arguments unchanged.
    Related upstream work: none (plugins cannot extend EngineArgs in 0.32).
    Future plan: drop when vLLM lets general plugins register engine args.
"""

_applied = False


def apply_all() -> None:
    """Applies every patch once per process."""
    global _applied
    if _applied:
        return
    from vllm_infinigen.patch import patch_arg_utils

    patch_arg_utils.apply()
    _applied = True
