# SPDX-License-Identifier: Apache-2.0
"""Worker side: installs InfiniGen into a loaded vLLM model (attention impls, hooks, specs).

The wrapped impl is platform-neutral: it hands a sparse layer's new K/V and its
attention to the runtime, and leaves dense layers to the platform's own kernel."""

from __future__ import annotations

import dataclasses
import functools
import math
import typing

import torch
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionCGSupport

from vllm_infinigen.worker.layer_state import LayerSource, LayerState
from vllm_infinigen.scheduler.spec import InfiniGenSparseSpec
from vllm_infinigen.worker.capture import capture_pre_hook
from vllm_infinigen.worker.runtime import InfiniGenRuntime

logger = init_logger(__name__)


class InfiniGenImplMixin:
    """Mixed into a layer's attention impl class; runs InfiniGen around it.

    Dense layers run the platform kernel; sparse layers never touch vLLM's
    cache (their KV-cache group has no blocks).
    """

    infinigen_runtime: InfiniGenRuntime
    infinigen_layer: LayerState

    @classmethod
    def wrap(cls, impl, runtime: InfiniGenRuntime, state: LayerState):
        """A new impl of a subclass of ``type(impl)`` with ``impl``'s attributes.

        The layer looks its impl up at every call, so the swap holds under
        torch.compile.
        """
        base = type(impl)
        wrapped = object.__new__(type(f"InfiniGen{base.__name__}", (cls, base), {}))
        wrapped.__dict__.update(impl.__dict__,
                                infinigen_runtime=runtime, infinigen_layer=state)
        return wrapped

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        state = self.infinigen_layer
        if not state.sparse:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        runtime = self.infinigen_runtime
        if runtime.resident:  # vLLM's blocks (dummy runs too); the pool through the write below
            super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        context = get_forward_context()
        if not takes_part(runtime, context.attn_metadata):  # its slots: all PAD_SLOT_ID
            return
        dense_metadata = context.attn_metadata[runtime.reference_layer]
        if runtime.fuses_short(dense_metadata):
            return  # the forward writes and attends in one op (``runtime.decode_short``)
        _write(runtime, state, context, dense_metadata, key, value)

    def fused_output_quant_supported(self, quant_key) -> bool:
        """False: vLLM's attention + output-quant fusion (opt-in, CUDA) stays off. The
        sparse layers' kernels write unquantized output and take no output scale, and
        a pattern vLLM registers for a layer may match every layer (its layer-name
        wildcard)."""
        return False

    def write_restored(self, layer, key, value, slot_mapping) -> None:
        """K/V copied back from the pool into vLLM's blocks (``worker/restore.py``):
        the stock update alone (the pool holds them already)."""
        super().do_kv_cache_update(layer, key, value, layer.kv_cache, slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        runtime, state = self.infinigen_runtime, self.infinigen_layer
        if runtime.resident:  # device-first, before the move: vLLM's kernel and blocks
            return super().forward(layer, query, key, value, kv_cache, attn_metadata,
                                   output, output_scale, output_block_scale)
        if not takes_part(runtime, attn_metadata):
            if state.sparse and attn_metadata is not None:
                return output  # its metadata is the marker: no stock kernel to run
            return super().forward(layer, query, key, value, kv_cache, attn_metadata,
                                   output, output_scale, output_block_scale)
        context = get_forward_context()
        dense_metadata = context.attn_metadata[runtime.reference_layer]
        plan = runtime.plan_for(dense_metadata, runtime.block_size)
        fused = (state.sparse and key is not None and plan.short_decode_only
                 and runtime.fuses_short(dense_metadata))
        if state.sparse and key is not None and not fused and writes_in_forward(layer):
            _write(runtime, state, context, dense_metadata, key, value)
        if plan.short_decode_only:  # nothing speculates, nothing is captured
            if not state.sparse:
                return super().forward(layer, query, key, value, kv_cache, attn_metadata,
                                       output, output_scale, output_block_scale)
            if fused:
                # Its write (skipped by its KV update) and its dense rows, in one op.
                runtime.decode_short(state, dense_metadata,
                                     context.slot_mapping[runtime.reference_layer],
                                     query, key, value, output)
            else:
                runtime.attend_decode(state, plan, query, output)  # its dense rows
            return output
        plan = runtime.begin_layer(state, dense_metadata,
                                   context.slot_mapping[runtime.reference_layer],
                                   block_size=runtime.block_size)
        if not state.sparse:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata,
                                   output, output_scale, output_block_scale)
        runtime.attend(state, plan, query, output)
        return output


def takes_part(runtime: InfiniGenRuntime, attn_metadata) -> bool:
    """Whether a forward is a step InfiniGen takes part in. Not: a dummy run
    without attention metadata (vLLM's profile run, its piecewise CUDA-graph
    captures and its sampler warm-up, the last two with every slot
    PAD_SLOT_ID), nor a run before the pool exists (with CUDA graphs, vLLM's
    ``profile_cudagraph_memory`` warms up and captures on a minimal KV cache
    inside ``determine_available_memory``, before the worker allocates the
    pool in ``initialize_from_config``; ``runtime.block_size`` is 0 until then)."""
    return attn_metadata is not None and runtime.block_size > 0


def writes_in_forward(layer) -> bool:
    """Whether vLLM makes no KV-update call for ``layer`` (its backend says its
    forward writes: ``sparse_backend`` on the CPU), so that the sparse
    layer's forward writes its new K/V to the pool itself (before its
    attention, as the update call would have)."""
    return getattr(getattr(layer, "attn_backend", None), "forward_includes_kv_cache_update",
                   False)


def _write(runtime: InfiniGenRuntime, state: LayerState, context, dense_metadata,
           key: torch.Tensor, value: torch.Tensor) -> None:
    """A sparse layer's new K/V [T, H_kv, D] into the pool, at the dense group's slots."""
    slots = context.slot_mapping[runtime.reference_layer]
    runtime.begin_step(dense_metadata, slots)
    num_tokens = slots.shape[0]
    runtime.write(state, key[:num_tokens], value[:num_tokens], slots, dense_metadata)


def layer_sources(model: torch.nn.Module, vllm_config, skew: list[torch.Tensor | None],
                  device: torch.device,
                  query_weights: dict[int, torch.nn.Module] | None = None,
                  ) -> list[LayerSource]:
    """Every attention layer of ``model``, in order, with its skew slice.

    Args:
        skew: Per layer [H_kv of this rank, D, R] skew slices (None: int keys).
        query_weights: {layer_idx: query projection} (a platform's, e.g.
            ``platforms/cpu/query_weights.py``).

    Raises:
        ValueError: Unless there is one attention layer per decoder layer.
    """
    from vllm.model_executor.layers.attention import Attention

    attention = {
        name: module
        for name, module in vllm_config.compilation_config.static_forward_context.items()
        if isinstance(module, Attention)
    }
    by_index = sorted((extract_layer_index(name), name) for name in attention)
    if [idx for idx, _ in by_index] != list(range(len(by_index))):
        raise ValueError("InfiniGen needs one attention layer per decoder layer")
    modules = dict(model.named_modules())
    return [
        LayerSource(idx, name, attention[name], modules.get(name.rsplit(".", 1)[0]),
                    None if skew[idx] is None
                    else skew[idx].to(device=device, dtype=torch.float32).contiguous(),
                    (query_weights or {}).get(idx))
        for idx, name in by_index
    ]


def install(runtime: InfiniGenRuntime, sources: list[LayerSource]) -> None:
    """Swaps each full-attention layer's attention impl for InfiniGen's and
    hooks the speculating layers' ``qkv_proj`` (both listed in the patch
    index); sliding-window layers keep vLLM's impl and cache."""
    for source, state in zip(sources, runtime.layers):
        attention = source.attention
        if state.windowed:
            continue
        if state.sparse:
            device_first = runtime.config.device_first
            attention.get_kv_cache_spec = _sparse_spec_getter(attention, device_first)
            attention.attn_backend = (
                resident_backend(attention.attn_backend) if device_first
                else sparse_backend(attention.attn_backend,
                                    writes_in_forward=not runtime.data_path.plans_on_device))
        else:
            check_dense_backend(attention.attn_backend)
        if state.next is not None:
            if state.next.qkv_proj is None or state.qkv_proj is None:
                raise ValueError(f"InfiniGen: layer {source.name} has no qkv_proj to hook")
            _check_query_norm(state.next)
            state.qkv_proj.register_forward_pre_hook(capture_pre_hook(source.name))
        attention.impl = InfiniGenImplMixin.wrap(attention.impl, runtime, state)
    config, layers = runtime.config, runtime.layers
    sparse = runtime.sparse_layers
    windowed = [s.layer_idx for s in layers if s.windowed]
    logger.info(
        "InfiniGen: %d layers, dense %s, sparse %s%s, "
        "%s, budget %.2f, speculation keys %s, dense below %d context tokens; "
        "speculation through %s%s",
        len(layers), [s.layer_idx for s in layers if not s.sparse and not s.windowed],
        [s.layer_idx for s in sparse],
        f", sliding-window (left to vLLM) {windowed}" if windowed else "",
        "alpha off (every row keeps its budget)" if math.isinf(config.alpha)
        else f"alpha {config.alpha:g}", config.budget,
        _keys_of(sparse[0]) if sparse else "none", config.min_context,
        "the query slice of qkv_proj" if all(s.query_proj is not None for s in sparse)
        else "the whole qkv_proj",
        ", the per-head q_norm" if any(s.q_norm is not None for s in sparse) else "",
    )


# What the step plan reads of the dense layers' metadata (``worker/step_plan.py``).
DENSE_METADATA_FIELDS = ("query_start_loc", "seq_lens", "block_table")


def check_dense_backend(backend) -> None:
    """Refuses a dense-layer backend whose metadata lacks the fields the step plan
    reads (vLLM's FlashInfer, its first choice on some GPUs, keeps none of them),
    naming ``--attention-backend``; a metadata class it cannot read is let through."""
    builder = backend.get_builder_cls()
    metadata = next((args[0] for base in getattr(builder, "__orig_bases__", ())
                     if (args := typing.get_args(base))), None)
    if not dataclasses.is_dataclass(metadata):
        return
    missing = set(DENSE_METADATA_FIELDS) - {field.name for field in dataclasses.fields(metadata)}
    if missing:
        raise ValueError(
            f"InfiniGen plans each step from the dense layers' attention metadata "
            f"({', '.join(DENSE_METADATA_FIELDS)}), and vLLM's {backend.get_name()} backend "
            f"keeps no {', '.join(sorted(missing))}; start with --attention-backend "
            "FLASH_ATTN (or TRITON_ATTN)")


class SparseLayerMetadata:
    """The attention metadata vLLM's runner hands a sparse layer: a marker.
    The layer reads the dense group's metadata (``runtime.reference_layer``),
    whose block ids address the pool; its own group holds no blocks."""

    __slots__ = ()


SPARSE_METADATA = SparseLayerMetadata()


@functools.cache
def sparse_backend(backend: type, writes_in_forward: bool = False) -> type:
    """``backend`` with a metadata builder that builds nothing, for the sparse
    layers' KV-cache groups; with ``writes_in_forward`` (the CPU: a data path
    planning on the host, no CUDA graphs), also declaring that its forward
    writes the layer's K/V (``forward_includes_kv_cache_update``), so that
    vLLM skips the layer's ``unified_kv_cache_update`` call (a custom op and
    its Python per sparse layer and step) and the forward writes to the pool
    (``writes_in_forward``). CUDA keeps vLLM's separate update call.

    vLLM builds attention metadata for every KV-cache group at every step;
    the sparse layers' groups (one per ``group_size`` layers,
    ``layout.kv_cache_group_size``) would each pay a stock build (on the
    CPU: scheduler metadata for the attention kernel) that nothing reads.
    Their builder returns ``SPARSE_METADATA`` once per step, for a CUDA graph
    capture too, and the other groups reuse it (``supports_update_block_table``).
    Cached per backend, so that every sparse layer shares one class (vLLM
    groups layers by it).

    CUDA graphs: the builder declares what InfiniGen's step supports, not
    what the stock kernels would (the sparse layers never run them): full
    graphs for uniform single-token decode batches, whose step runs on the
    device alone, and piecewise graphs otherwise (a step with prompt rows
    plans on the host, in the attention op, which piecewise graphs leave
    eager). vLLM's runner takes the least support over the KV-cache groups
    (``gpu_model_runner._check_and_update_cudagraph_mode``), so its default
    FULL_AND_PIECEWISE stays, and FULL resolves to FULL_AND_PIECEWISE
    (``CompilationConfig.resolve_cudagraph_mode_and_sizes``). The CPU build
    captures no graphs.
    """
    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        return SPARSE_METADATA

    def build_for_cudagraph_capture(self, common_attn_metadata):
        return SPARSE_METADATA  # stock ones may edit the metadata they built

    def update_block_table(self, metadata, block_table, slot_mapping):
        return metadata

    def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
        return cls._cudagraph_support

    return _with_builder(backend, "InfiniGenSparse", {
        "build": build, "build_for_cudagraph_capture": build_for_cudagraph_capture,
        "supports_update_block_table": True, "update_block_table": update_block_table,
        "_cudagraph_support": AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE,
        "get_cudagraph_support": classmethod(get_cudagraph_support)},
        {"forward_includes_kv_cache_update": True} if writes_in_forward else {})


@functools.cache
def resident_backend(backend: type) -> type:
    """``backend`` for the sparse layers' KV-cache groups with
    ``--infinigen-residency device-first``: its stock metadata (a resident
    layer runs the stock kernel over its group's blocks), with the CUDA-graph
    support of the step after the move declared: at most full graphs of
    uniform single-token decode batches (``sparse_backend``), so that vLLM
    captures no full graph that InfiniGen's step could not run in once the
    engine moved. Both residencies' full graphs are captured at start-up
    (``platforms/cuda/residency.py``)."""
    stock = backend.get_builder_cls()
    moved = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
        support = stock.get_cudagraph_support(vllm_config, kv_cache_spec)
        return support if support.value <= moved.value else moved

    return _with_builder(backend, "InfiniGenResident",
                         {"get_cudagraph_support": classmethod(get_cudagraph_support)})


def _with_builder(backend: type, prefix: str, attributes: dict,
                  backend_attributes: dict | None = None) -> type:
    """A subclass of ``backend`` (with ``backend_attributes``) whose metadata
    builder is a subclass of its stock one with ``attributes``, declaring no
    full graph of variable-length decode batches (InfiniGen's step has none);
    named ``prefix`` + theirs."""
    stock = backend.get_builder_cls()

    def get_varlen_cudagraph_max_query_len(cls, vllm_config, kv_cache_spec):
        return None

    builder = type(f"{prefix}{stock.__name__}", (stock,), {
        "get_varlen_cudagraph_max_query_len": classmethod(get_varlen_cudagraph_max_query_len),
        **attributes})
    return type(f"{prefix}{backend.__name__}", (backend,),
                {"get_builder_cls": staticmethod(lambda: builder), **(backend_attributes or {})})


def _keys_of(state) -> str:
    """The speculation keys, as the start-up log names them."""
    if state.speculation_keys == "partial":
        return f"partial (rank {state.rank} of {state.head_size})"
    if state.bound_keys:
        return "bounds (each channel's max and min per 16-token unit)"
    return "int (every channel)"


def _check_query_norm(state: LayerState) -> None:
    """The speculation applies ``q_norm`` per head (Qwen3's layout): refuse
    another layout rather than compute a wrong query.

    Raises:
        ValueError: When the norm's weight is not one value per head channel.
    """
    norm = state.q_norm
    weight = getattr(norm, "weight", None)
    if norm is not None and (weight is None or tuple(weight.shape) != (state.head_size,)):
        raise ValueError(
            f"InfiniGen: layer {state.layer_name} has a q_norm of weight shape "
            f"{None if weight is None else tuple(weight.shape)}; speculation supports "
            f"a per-head query norm only ({state.head_size} channels)"
        )


def _sparse_spec_getter(attn: torch.nn.Module, device_first: bool):
    """The layer's ``get_kv_cache_spec``, returning the pool-backed sparse spec."""
    original = attn.get_kv_cache_spec

    def get_kv_cache_spec(vllm_config):
        spec = original(vllm_config)
        return None if spec is None else InfiniGenSparseSpec.of(spec, device_first)

    return get_kv_cache_spec
