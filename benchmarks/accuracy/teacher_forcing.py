# SPDX-License-Identifier: Apache-2.0
"""Teacher forcing in vLLM v1: force every output token and read its raw logprob.

InfiniGen sparsifies decode steps only, so prompt logprobs (dense prefill) never
see it. Here the reference text is decoded token by token instead::

    prompt (dense prefill)          continuation (decode, teacher-forced)
    [p0 p1 ... p_{P-1}]  ->  c0  ->  c1  ->  ...  ->  c_{S-1}
                          ^ scored from the prefill's last logits; c1.. from decode

At output step j a logits processor masks every token but ``c_j``, so ``c_j`` is
sampled and fed back; vLLM computes the returned logprob before any logits
processor runs (``logprobs_mode="raw_logprobs"``), so it is the model's own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

FORCED_TOKEN_IDS = "forced_token_ids"
LOGPROBS_MODE = "raw_logprobs"


class TeacherForcingLogitsProcessor(LogitsProcessor):
    """Makes output token j of a request ``extra_args["forced_token_ids"][j]``.

    Requests without ``forced_token_ids`` are untouched. Runs in the engine
    core: vLLM calls ``update_state`` before every step and ``apply`` on the
    logits of the step, before sampling (the processor is not argmax-invariant,
    so greedy requests see it too).
    """

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        # batch index -> (forced token ids, the request's live output token list)
        self.forced: dict[int, tuple[Sequence[int], list[int]]] = {}

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Checked on the frontend when the request is added."""
        forced = (sampling_params.extra_args or {}).get(FORCED_TOKEN_IDS)
        if forced is None:
            return
        if not isinstance(forced, (list, tuple)) or not forced or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in forced
        ):
            raise ValueError(
                f"extra_args[{FORCED_TOKEN_IDS!r}] must be a non-empty list of "
                f"token ids, got {forced!r}"
            )
        if sampling_params.max_tokens is None or sampling_params.max_tokens > len(forced):
            raise ValueError(
                f"max_tokens ({sampling_params.max_tokens}) must be at most "
                f"len(extra_args[{FORCED_TOKEN_IDS!r}]) ({len(forced)}), or later "
                "tokens would not be forced"
            )

    def is_argmax_invariant(self) -> bool:
        return False

    @staticmethod
    def _new_state(
        params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]
    ) -> tuple[Sequence[int], list[int]] | None:
        forced = (params.extra_args or {}).get(FORCED_TOKEN_IDS)
        return None if forced is None else (forced, output_ids)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.forced, batch_update, self._new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [B, V]; rows of forced requests keep only their next token."""
        rows, token_ids = [], []
        for index, (forced, output_ids) in self.forced.items():
            step = len(output_ids)
            if step < len(forced):
                rows.append(index)
                token_ids.append(forced[step])
        if not rows:
            return logits
        row_index = torch.tensor(rows, device=logits.device)
        token_index = torch.tensor(token_ids, device=logits.device)
        kept = logits[row_index, token_index]
        logits[row_index] = float("-inf")
        logits[row_index, token_index] = kept
        return logits


def engine_kwargs() -> dict[str, Any]:
    """``LLM(...)`` keyword arguments that teacher forcing needs."""
    return {
        "logits_processors": [TeacherForcingLogitsProcessor],
        "logprobs_mode": LOGPROBS_MODE,
    }


def check_engine(llm) -> None:
    """Raises ValueError unless ``llm`` was created with ``**engine_kwargs()``."""
    model_config = llm.llm_engine.model_config
    if model_config.logprobs_mode != LOGPROBS_MODE:
        raise ValueError(
            f"teacher forcing needs LLM(logprobs_mode={LOGPROBS_MODE!r}), got "
            f"{model_config.logprobs_mode!r}: the logprobs would be post-mask"
        )
    if not any(
        processor is TeacherForcingLogitsProcessor
        or str(processor).endswith(":" + TeacherForcingLogitsProcessor.__name__)
        for processor in model_config.logits_processors or []
    ):
        raise ValueError(
            "teacher forcing needs LLM(logits_processors=[TeacherForcingLogitsProcessor]); "
            "pass **engine_kwargs() to LLM"
        )


def force_continuations(
    llm,
    prompts: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[int]],
    num_logprobs: int = 0,
) -> list[list[dict[int, Any]]]:
    """Teacher-forces each continuation through decode; the logprobs of every step.

    Args:
        llm: A ``vllm.LLM`` created with ``**engine_kwargs()``.
        prompts: Token ids prefilled densely, one list per sequence.
        continuations: Token ids teacher-forced through decode, one list per
            sequence (same order as ``prompts``).
        num_logprobs: How many of the model's top tokens to return per step
            (vLLM's ``SamplingParams.logprobs``; at most the engine's
            ``max_logprobs``). The forced token is always returned as well.

    Returns:
        For each sequence and step j, vLLM's ``{token id: Logprob}`` of the
        distribution ``p(. | prompt, continuation[:j])``: the top
        ``num_logprobs`` tokens and ``continuation[j]``, each with its raw
        logprob and its rank in the whole vocabulary.

    Raises:
        ValueError: If the engine lacks the processor or returns processed
            logprobs.
        RuntimeError: If a generated token is not the forced one.
    """
    check_engine(llm)
    if len(prompts) != len(continuations):
        raise ValueError(
            f"{len(prompts)} prompts but {len(continuations)} continuations"
        )
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=len(continuation),
            ignore_eos=True,
            logprobs=num_logprobs,
            detokenize=False,
            extra_args={FORCED_TOKEN_IDS: list(continuation)},
        )
        for continuation in continuations
    ]
    requests = [TokensPrompt(prompt_token_ids=list(prompt)) for prompt in prompts]
    outputs = llm.generate(requests, params, use_tqdm=False)
    steps = []
    for index, (output, continuation) in enumerate(zip(outputs, continuations)):
        completion = output.outputs[0]
        if list(completion.token_ids) != list(continuation):
            raise RuntimeError(
                f"sequence {index}: the engine did not follow the forced tokens "
                f"(first {len(completion.token_ids)} of {len(continuation)} generated)"
            )
        steps.append(list(completion.logprobs))
    return steps


def score_continuations(
    llm, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]]
) -> list[list[float]]:
    """Raw logprobs of each continuation under decode, in one batched call.

    Args:
        llm: A ``vllm.LLM`` created with ``**engine_kwargs()``.
        prompts: Token ids prefilled densely, one list per sequence.
        continuations: Token ids teacher-forced through decode, one list per
            sequence (same order as ``prompts``).

    Returns:
        For each sequence, ``log p(continuation[j] | prompt, continuation[:j])``
        for every j.

    Raises:
        ValueError: If the engine lacks the processor or returns processed
            logprobs.
        RuntimeError: If a generated token is not the forced one.
    """
    steps = force_continuations(llm, prompts, continuations)
    return [
        [step[token].logprob for step, token in zip(sequence, continuation)]
        for sequence, continuation in zip(steps, continuations)
    ]


def split_for_decode(
    prompt: Sequence[int], continuation: Sequence[int], decode_prompt_tokens: int
) -> tuple[list[int], list[int]]:
    """Moves the last ``decode_prompt_tokens`` prompt tokens into the forced part.

    Forcing them through decode makes the first continuation token a decode
    step too (otherwise it is scored from the dense prefill's last logits),
    and gives the continuation's context the KV of decode steps, as in
    generation. The scored logprobs of ``continuation`` are then
    ``logprobs[decode_prompt_tokens:]`` of the forced sequence.

    Returns:
        (prefilled tokens, forced tokens).

    Raises:
        ValueError: If fewer than one prompt token would be left to prefill.
    """
    if not 0 <= decode_prompt_tokens < len(prompt):
        raise ValueError(
            f"decode_prompt_tokens must be in [0, {len(prompt)}) for a "
            f"{len(prompt)}-token prompt, got {decode_prompt_tokens}"
        )
    cut = len(prompt) - decode_prompt_tokens
    return list(prompt[:cut]), list(prompt[cut:]) + list(continuation)


def score_continuation(
    llm, prompt_token_ids: Sequence[int], continuation_token_ids: Sequence[int]
) -> list[float]:
    """``score_continuations`` for one sequence."""
    return score_continuations(llm, [prompt_token_ids], [continuation_token_ids])[0]


def perplexity(logprobs: Sequence[float]) -> float:
    """exp of the mean negative log-likelihood (nats per token)."""
    if not logprobs:
        raise ValueError("perplexity of no tokens")
    return math.exp(-sum(logprobs) / len(logprobs))


def prefill_scores(
    llm, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]]
) -> list[list[float]]:
    """Logprobs of each continuation from prompt logprobs, in one prefill per sequence.

    On an InfiniGen engine in evaluation mode (``eval_dense_prefix`` =
    ``len(prompt)``), rows past the prompt attend over the selection as decode
    rows do, so this equals ``score_continuations`` in one prefill; otherwise
    it is dense attention (InfiniGen's default prefill).

    Returns:
        For each sequence, ``log p(continuation[j] | prompt, continuation[:j])``.
    """
    if len(prompts) != len(continuations):
        raise ValueError(f"{len(prompts)} prompts but {len(continuations)} continuations")
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0,
                            detokenize=False)
    requests = [TokensPrompt(prompt_token_ids=list(p) + list(c))
                for p, c in zip(prompts, continuations)]
    outputs = llm.generate(requests, params, use_tqdm=False)
    return [
        [output.prompt_logprobs[len(prompt) + j][token].logprob
         for j, token in enumerate(continuation)]
        for output, prompt, continuation in zip(outputs, prompts, continuations)
    ]
