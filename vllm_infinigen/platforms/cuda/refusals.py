# SPDX-License-Identifier: Apache-2.0
"""What ``--kv-manager infinigen`` cannot run on vLLM's CUDA build (the neutral
refusals are ``frontend/checks.py``'s; ``platforms.refusal_for`` dispatches here).

CUDA graphs run. A uniform decode step (every row one decode token) runs on
the device alone, so vLLM captures it in a full decode graph; a step with
prompt rows plans on the host, inside the attention op and the KV-cache write
op, which vLLM's piecewise graphs leave eager (its default splitting ops,
``CompilationConfig.set_splitting_ops_for_v1``). The sparse layers' backend
declares exactly that (``worker/attention.sparse_backend``), so vLLM keeps its
default FULL_AND_PIECEWISE and resolves FULL to it. Refused: what would
capture either op inside a piecewise graph.
"""

from __future__ import annotations

import os

from vllm.config.compilation import CompilationMode, CUDAGraphMode
from vllm.engine.arg_utils import EngineArgs

from vllm_infinigen.config import InfiniGenConfig, flag

ATTENTION_OP = "vllm::unified_attention_with_output"
KV_CACHE_UPDATE_OP = "vllm::unified_kv_cache_update"
BREAKABLE_ENV = "VLLM_USE_BREAKABLE_CUDAGRAPH"  # vllm/envs.py: "1" turns it on
# With these modes vLLM captures no piecewise graph (FULL_DECODE_ONLY: a step
# with prompt rows runs eagerly).
NO_PIECEWISE = (CUDAGraphMode.NONE, CUDAGraphMode.FULL_DECODE_ONLY)
DECODE_ONLY = """--compilation-config '{"cudagraph_mode": "FULL_DECODE_ONLY"}'"""


def refusal(args: EngineArgs, config: InfiniGenConfig) -> str | None:
    """Why the CUDA build cannot run ``args`` with ``config`` (None: it can).

    The device block cache gathers whole blocks from a pool with a row per
    slot; the baselines read the pool with host-side torch, which on CUDA is
    pinned host memory; the copy worker is the CPU build's.
    """
    if config.cpu_pool_gib is not None:
        return (f"{flag('cpu_pool_gib')} is not supported on CUDA (the device block cache "
                f"gathers whole blocks from a pool with a row per slot); remove it")
    if getattr(args, "enable_dbo", False) or (getattr(args, "ubatch_size", 0) or 0) > 1:
        # (and device-first's two sets of full graphs, which its wrapper does not expose)
        return ("vLLM's micro-batching (--enable-dbo, --ubatch-size) runs two parts of a "
                "step in turn, layer by layer, and InfiniGen keeps one selection per layer "
                "and step: remove --enable-dbo and --ubatch-size")
    if config.policy != "infinigen":
        return (f"{flag('policy')} {config.policy} runs on the CPU build only; on CUDA use "
                f"{flag('policy')} infinigen")
    if config.transfer != "auto":
        return (f"{flag('transfer')} {config.transfer} applies to the CPU build; on CUDA "
                f"the device block cache moves the blocks: remove it")
    block_size = getattr(args, "block_size", None)  # None: the platform's, 16
    if block_size is not None and block_size & (block_size - 1):
        return (f"--block-size {block_size}: the CUDA attention kernel reads blocks of a "
                f"power of two tokens; use 16, 32, 64 or 128")
    graphs = getattr(args.compilation_config, "cudagraph_mode", None)
    if (config.eval_dense_prefix is not None and not args.enforce_eager
            and graphs != CUDAGraphMode.NONE):
        return (f"{flag('eval_dense_prefix')} plans every step on the host, which a full "
                f"decode CUDA graph would replay without; add --enforce-eager")
    return graph_refusal(args)


def graph_refusal(args: EngineArgs) -> str | None:
    """A CUDA-graph setting that would capture the attention or the KV-cache
    write of a step with prompt rows inside a piecewise graph (None: none)."""
    compilation = args.compilation_config
    graphs = getattr(compilation, "cudagraph_mode", None)  # None: vLLM's default
    if args.enforce_eager or graphs in NO_PIECEWISE:
        return None
    why = ("InfiniGen plans a step with prompt rows on the host, in the attention and "
           "the KV-cache write, which a piecewise graph would replay without")
    if os.environ.get(BREAKABLE_ENV, "0") == "1":
        return (f"{BREAKABLE_ENV}=1 captures the KV-cache write ({KV_CACHE_UPDATE_OP}) "
                f"inside its piecewise graphs ({why}); unset it, or add {DECODE_ONLY}")
    if getattr(compilation, "mode", None) not in (None, CompilationMode.VLLM_COMPILE):
        return None  # no compiled pieces: a step with prompt rows runs eagerly
    splitting = getattr(compilation, "splitting_ops", None)
    if splitting is None:  # vLLM's: the attention ops and the KV-cache writes
        if getattr(compilation, "use_inductor_graph_partition", None):
            return (f"--compilation-config use_inductor_graph_partition keeps the KV-cache "
                    f"write ({KV_CACHE_UPDATE_OP}) inside the piecewise graphs ({why}); "
                    f"add \"splitting_ops\": [\"{ATTENTION_OP}\", \"{KV_CACHE_UPDATE_OP}\"], "
                    f"or {DECODE_ONLY}")
        return None
    missing = [op for op in (ATTENTION_OP, KV_CACHE_UPDATE_OP) if op not in splitting]
    if splitting and missing:  # [] leaves no piecewise graph (vLLM: FULL)
        return (f"--compilation-config splitting_ops must include {', '.join(missing)} "
                f"with piecewise CUDA graphs ({why}); add it, or {DECODE_ONLY}")
    return None
