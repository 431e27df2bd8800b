"""What FP8 weights cost in accuracy on the embedded model (SmolLM2-135M-Instruct), base and adapters.

    python scripts/fp8_accuracy.py                  # CPU (the torch reference of the FP8 GEMM)
    python scripts/fp8_accuracy.py --device cuda    # the FP8 GEMMs (compute capability 8.9+)
    python scripts/fp8_accuracy.py --prompts 16 --adapters pirate   # fewer

For the base model and each demo adapter, the unquantized model (float32 on CPU, bfloat16 on a
GPU) answers PROMPTS greedily through its chat template (TOKENS new tokens each); then each
variant (the model with ``quantization="fp8"``, and on CPU the model in bfloat16 for scale) is
measured against those answers:

- greedy agreement: the share of answers it reproduces token for token, and the mean share of
  each answer's tokens before its first differing one;
- mean |log-prob difference|: over the answers' tokens, teacher-forced (both models read the
  reference answer), the absolute difference of the log-probability each gives the next token.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing loramux

from loramux import LLM, LoRARequest, SamplingParams  # noqa: E402
from loramux.serving.server import demo_adapters  # noqa: E402

PROMPTS = [
    "What is the capital of France?", "Name three primary colours.", "Why is the sky blue?",
    "Write a haiku about autumn.", "How many legs does a spider have?", "What is 12 times 7?",
    "Give me a tip for learning to cook.", "Who wrote Romeo and Juliet?", "What does a CPU do?",
    "Describe a cat in one sentence.", "What is photosynthesis?", "Suggest a name for a pet goldfish.",
    "How do I boil an egg?", "What is the largest ocean on Earth?", "Translate 'thank you' into Spanish.",
    "What is the boiling point of water?", "Tell me a fun fact about octopuses.", "What is a prime number?",
    "Why do we have seasons?", "Recommend a book for a long flight.", "What causes rain?",
    "What is the capital of Japan?", "Explain gravity to a child.", "What is the speed of light?",
    "How do bees make honey?", "What is the tallest mountain?", "Write a short greeting for a birthday card.",
    "What are the three states of matter?", "Why do leaves change colour?", "What is the capital of Canada?",
    "How does a rainbow form?", "What is machine learning?",
]
TOKENS = 32


def answers(llm: LLM, prompts: list[list[int]], lora) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         lora_request=lora, use_tqdm=False)]


def answer_logprobs(llm: LLM, prompts: list[list[int]], reference: list[list[int]], lora) -> list[list[float]]:
    """Each reference answer's tokens' log-probs under ``llm``, teacher-forced."""
    full = [p + a for p, a in zip(prompts, reference)]
    outputs = llm.generate([{"prompt_token_ids": f} for f in full], SamplingParams(max_tokens=1, prompt_logprobs=0),
                           lora_request=lora, use_tqdm=False)
    return [[entry[t].logprob for t, entry in zip(f[len(p):], o.prompt_logprobs[len(p):])]
            for p, f, o in zip(prompts, full, outputs)]


def compare(reference: list[list[int]], got: list[list[int]], ref_lp: list[list[float]],
            got_lp: list[list[float]]) -> dict:
    prefixes = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), len(r)) / len(r)
                for r, g in zip(reference, got)]
    diffs = [abs(a - b) for r, g in zip(ref_lp, got_lp) for a, b in zip(r, g)]
    return {"identical_answers": sum(r == g for r, g in zip(reference, got)) / len(reference),
            "tokens_before_first_difference": sum(prefixes) / len(prefixes),
            "mean_abs_logprob_difference": sum(diffs) / len(diffs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help="the first N of PROMPTS")
    parser.add_argument("--adapters", nargs="*", default=None, help="demo adapters to measure (default: all)")
    args = parser.parse_args()
    reference_dtype = "float32" if args.device == "cpu" else "bfloat16"
    variants = {"fp8": dict(dtype=reference_dtype, quantization="fp8")}
    if args.device == "cpu":
        variants["bfloat16"] = dict(dtype="bfloat16")
    adapters = {name: LoRARequest(name, i, path) for i, (name, path, _) in enumerate(demo_adapters(), start=1)
                if args.adapters is None or name in args.adapters}
    # no prefix cache: a prompt's cached positions get no prompt log-probs, and the answers share prefixes
    options = dict(device=args.device, max_loras=max(1, len(adapters)), max_lora_rank=8, max_model_len=256,
                   enable_prefix_caching=False)
    llm = LLM(dtype=reference_dtype, **options)
    tokenizer = llm.get_tokenizer()
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in PROMPTS[: args.prompts]]
    prompts = [tokenizer(text, add_special_tokens=False).input_ids for text in texts]
    targets = {"base": None, **adapters}
    reference = {name: answers(llm, prompts, lora) for name, lora in targets.items()}
    reference_lp = {name: answer_logprobs(llm, prompts, reference[name], lora) for name, lora in targets.items()}
    del llm
    results = {"device": args.device, "reference_dtype": reference_dtype, "prompts": len(prompts),
               "new_tokens": TOKENS}
    for variant, kwargs in variants.items():
        print(f"measuring {variant} ...", file=sys.stderr, flush=True)
        llm = LLM(**{**options, **kwargs})
        results[variant] = {
            name: compare(reference[name], answers(llm, prompts, lora), reference_lp[name],
                          answer_logprobs(llm, prompts, reference[name], lora))
            for name, lora in targets.items()}
        del llm
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
