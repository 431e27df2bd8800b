"""`LLM`: offline generation over many adapters at once, as with vLLM.

    from loramux import LLM, LoRARequest, SamplingParams
    llm = LLM(enable_lora=True, max_loras=2)
    outputs = llm.generate(
        ["Name a colour.", "Name a colour.", "Name a colour."],
        SamplingParams(temperature=0, max_tokens=32),
        lora_request=[None, LoRARequest("caps", 1, path_a), LoRARequest("json", 2, path_b)],
    )
    for out in outputs:
        print(out.outputs[0].text)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import replace
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

from loramux.engine.config import EngineConfig
from loramux.engine.llm_engine import LLMEngine, PromptType
from loramux.engine.core.outputs import RequestOutput
from loramux.engine.sampling_params import SamplingParams
from loramux.registry import LoRARequest

if TYPE_CHECKING:
    from loramux.engine.adapters.lora_model import LoRAModelManager

__all__ = ["LLM"]

Conversation = list[dict]


class LLM:
    """A base model serving LoRA adapters, for offline batches.

    ``LLM(model, **options)`` or ``LLM(config=EngineConfig(...))``: the options are the fields of
    :class:`~loramux.engine.config.EngineConfig`, each documented there with its default (those
    left at None take the device's: ``max_num_seqs``, ``max_model_len``, ...). The ones most runs
    set: ``model`` (a Hugging Face model id or dir, a loaded ``PreTrainedModel``, or None for the
    embedded SmolLM2-135M-Instruct), ``enable_lora``, ``max_loras`` (an optional cap on the adapters
    in one step; by default ``max_gpu_lora_bytes`` bounds them), ``max_lora_rank``,
    ``max_cpu_loras``, ``lora_modules`` (adapters registered at start), ``dtype``, ``device``,
    ``max_num_seqs``, ``max_model_len``, ``quantization``, ``tensor_parallel_size``
    (docs/architecture.md, "Tensor parallelism"). An unknown option is a TypeError naming the
    closest one.
    """

    def __init__(self, model=None, *, config: EngineConfig | None = None, **kwargs) -> None:
        self.llm_engine = LLMEngine(model, config=config, **kwargs)
        self._ids = itertools.count()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Give the engine's device memory back and stop its threads and workers (idempotent).
        ``del llm`` and leaving a ``with LLM(...) as llm:`` block do the same; ``generate`` raises
        `~loramux.errors.EngineClosedError` after."""
        self.llm_engine.close()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    @property
    def lora_manager(self) -> LoRAModelManager | None:
        """The engine's LoRA manager, or None when LoRA is off: its ``layers`` (each wrapped
        layer by module name, as a layer plugin made it), ``pool`` (the adapter weight pool),
        ``resident()`` (the adapters in GPU slots) and ``stats``. To look at, not to drive:
        requests name adapters through ``lora_request``."""
        return self.llm_engine.lora_manager

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt in one continuous batch; outputs come back in prompt order.

        :param prompts: a string, ``{"prompt_token_ids": [...]}``, or a list of them.
        :param sampling_params: one for all prompts, or one per prompt (default: ``SamplingParams()``).
        :param lora_request: one adapter for all prompts, or one per prompt (None = base model).
        :param use_tqdm: show a progress bar.
        :returns: one finished `RequestOutput` per prompt, with ``SamplingParams.n`` completions in
            its ``outputs`` (``index`` 0 to n-1). A request whose adapter failed to load finishes
            with ``finish_reason="error"`` and its ``error``; the others are unaffected.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        n = len(prompts)
        params = _per_prompt(sampling_params, n, "sampling_params", SamplingParams) or [SamplingParams()] * n
        loras = _per_prompt(lora_request, n, "lora_request", LoRARequest) or [None] * n
        engine = self.llm_engine
        # one engine request per sample: "llm-<k>", or "llm-<k>-<i>" for sample i of n > 1
        samples: list[tuple[str, list[str]]] = []
        added = []
        try:
            for prompt, p, lora in zip(prompts, params, loras):
                request_id = f"llm-{next(self._ids)}"
                ids = [request_id] if p.n == 1 else [f"{request_id}-{i}" for i in range(p.n)]
                samples.append((request_id, ids))
                for index, sample_id in enumerate(ids):
                    engine.add_request(sample_id, prompt, p if p.n == 1 else p.for_sample(index), lora)
                    added.append(sample_id)
        except BaseException:
            engine.abort_request(added)
            raise
        finished = self._run(added, use_tqdm)
        return [_merge_samples(request_id, [finished[i] for i in ids]) for request_id, ids in samples]

    def chat(
        self,
        messages: Conversation | Seq[Conversation],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to conversations (``[{"role": "user", "content": "..."}]``, or a list
        of them), formatted with the model's chat template."""
        tokenizer = self.llm_engine.tokenizer
        if tokenizer is None:
            raise ValueError(f"model {self.llm_engine.model_name!r} has no tokenizer, so no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(
                conversation, chat_template=chat_template, add_generation_prompt=add_generation_prompt, tokenize=False
            )
            # the template already holds any BOS token: do not add special tokens again
            ids = tokenizer(text, add_special_tokens=False).input_ids
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, lora_request, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        wanted = set(ids)
        bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        generated = 0
        try:
            while len(finished) < len(ids) and engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        generated += len(output.outputs[0].token_ids)
                        bar.set_postfix_str(f"{generated} tokens generated", refresh=False)
                        bar.update(1)
        except BaseException:
            engine.abort_request([i for i in ids if i not in finished])
            raise
        finally:
            bar.close()
        return finished


def _merge_samples(request_id: str, outputs: list[RequestOutput]) -> RequestOutput:
    """One prompt's samples as one output (vLLM's shape): their completions, numbered, in ``outputs``."""
    if len(outputs) == 1:
        return outputs[0]
    completions = [output.outputs[0] for output in outputs]
    for index, completion in enumerate(completions):
        completion.index = index
    error = next((o.error for o in outputs if o.error is not None), None)
    return replace(outputs[0], request_id=request_id, outputs=completions, error=error)


def _per_prompt(value, n: int, name: str, single_type) -> list | None:
    if value is None:
        return None
    if isinstance(value, single_type):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(f"{name}: got {len(values)} for {n} prompts; give one, or one per prompt")
    return values
