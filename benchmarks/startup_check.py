"""Engine start-up on the GPU (load, profile + compile, graph capture), then steps of several
token counts: with TORCH_LOGS=recompiles, any compile after start shows in the log.

    PYTHONPATH=. TORCH_LOGS=recompiles python benchmarks/startup_check.py
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loramux import LoRARequest, SamplingParams  # noqa: E402
from benchmarks.throughput import ALL_SEVEN, random_adapter  # noqa: E402
from loramux.engine.llm_engine import LLMEngine  # noqa: E402
from loramux.engine.model_loader import load_model  # noqa: E402

t0 = time.perf_counter()
model = load_model(sys.argv[1] if len(sys.argv) > 1 else "llama-3.1-8b", dtype="bfloat16", device="cuda",
                   load_format="dummy")[0]
torch.cuda.synchronize()
t1 = time.perf_counter()
engine = LLMEngine(model, max_loras=4, max_lora_rank=16, max_num_seqs=64, max_model_len=2048)
t2 = time.perf_counter()
print(f"STARTUP load {t1 - t0:.1f} s, engine (profile + compile + {engine.runner.num_graphs} graphs) {t2 - t1:.1f} s",
      flush=True)
engine.registry.bind(random_adapter(model.config, "a", 16, ALL_SEVEN, 1, "cuda", torch.bfloat16))
for n, length in ((1, 7), (3, 100), (17, 33), (64, 130)):
    t = time.perf_counter()
    for i in range(n):
        lora = LoRARequest("a", 1) if i % 2 else None
        engine.add_request(f"{n}-{i}", {"prompt_token_ids": list(range(3, 3 + length))},
                           SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), lora)
    while engine.has_unfinished_requests():
        engine.step()
    print(f"STEPS {n} requests x {length} tokens: {time.perf_counter() - t:.2f} s", flush=True)
