"""Train the demo LoRA adapters shipped in loramux/data/adapters/ for the embedded default model.

    python scripts/train_demo_adapters.py            # all adapters, then check them
    python scripts/train_demo_adapters.py --only json

Recipe (the same for every adapter; see docs/demo-adapters.md):
1. the base model (SmolLM2-135M-Instruct, float32, CPU) answers each prompt of TRAIN_PROMPTS
   greedily through its chat template, at most 40 new tokens, cut back to the last full sentence;
2. each adapter's transform rewrites those answers (upper case, a JSON object, pirate talk);
3. a rank-8 LoRA on every attention and MLP projection learns prompt -> rewritten answer, with the
   loss on the answer tokens (and the closing <|im_end|>) only, for a few epochs with a fixed seed;
4. the adapter is saved with PEFT's save_pretrained in float16 (about 5 MB), and a README.md;
5. each saved adapter is loaded back with PEFT and answers HELD_OUT_PROMPTS greedily next to the
   base model; the script exits non-zero if an adapter does not show its behaviour.

Everything is seeded and runs on CPU, so running it again writes the same files up to float noise.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing loramux

from loramux.engine.worker.model_loader import load_model  # noqa: E402

ADAPTERS_DIR = REPO / "loramux" / "data" / "adapters"
BASE_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # recorded in adapter_config.json
SEED = 1234
THREADS = 2
MAX_ANSWER_TOKENS = 40
GEN_BATCH = 16

RANK = 8
ALPHA = 16
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
EPOCHS = 4  # the default; an adapter may need more (DemoAdapter.epochs)
BATCH_SIZE = 8
LEARNING_RATE = 2e-3
CHECK_MAX_TOKENS = 64  # held-out answers: room for the JSON wrapper and the longer upper-case tokens
FACT_MAX_TOKENS = 40  # a fact is in the first sentence or two

TRAIN_PROMPTS = [
    "What is the capital of France?",
    "What is the capital of Japan?",
    "Name a large animal that lives in the ocean.",
    "How many legs does a spider have?",
    "What is the boiling point of water?",
    "Who wrote Romeo and Juliet?",
    "What is photosynthesis?",
    "Give me a tip for staying focused.",
    "What is 7 times 8?",
    "What is the largest planet in our solar system?",
    "Describe a cat in one sentence.",
    "What does a bee make?",
    "Why do leaves change color in autumn?",
    "What is the opposite of hot?",
    "Suggest a name for a pet goldfish.",
    "What is the speed of light?",
    "How do I make a cup of tea?",
    "What language is spoken in Brazil?",
    "What is a synonym for happy?",
    "Tell me a fun fact about octopuses.",
    "What is the tallest mountain on Earth?",
    "What is the main ingredient in guacamole?",
    "How many days are in a leap year?",
    "What is the chemical symbol for gold?",
    "Give me one reason to exercise.",
    "What is a noun?",
    "Recommend a good habit for the morning.",
    "What do plants need to grow?",
    "Who painted the Mona Lisa?",
    "What is the freezing point of water in Fahrenheit?",
    "How far is the Moon from the Earth?",
    "What is an atom?",
    "Why is the ocean salty?",
    "What is the currency of the United Kingdom?",
    "Name three primary colors.",
    "What is gravity?",
    "How do birds fly?",
    "What is a healthy breakfast?",
    "What is the square root of 81?",
    "Write a short greeting for a birthday card.",
    "What is the longest river in the world?",
    "What does DNA stand for?",
    "How can I save money?",
    "What is the capital of Italy?",
    "Explain what a computer is.",
    "What is the smallest prime number?",
    "What animal is known as the king of the jungle?",
    "What is the weather like in a desert?",
    "Give me a word that rhymes with cat.",
    "How many continents are there?",
    "What is a volcano?",
    "What instrument has black and white keys?",
    "What is the capital of Canada?",
    "Why do we need sleep?",
    "What is the meaning of the word 'generous'?",
    "How many hours are in a day?",
    "What is the sun made of?",
    "Name a famous scientist.",
    "What is the purpose of a library?",
    "How do you say hello in Spanish?",
    "What is the hardest natural substance?",
    "What is a rainbow?",
    "Give me a tip for learning a new language.",
    "What is the capital of Germany?",
    "What do cows drink?",
    "Describe the color blue to someone.",
    "What is the largest desert in the world?",
    "How many minutes are in an hour?",
    "What is an elephant's trunk used for?",
    "What is the first letter of the English alphabet?",
    "Suggest a fun weekend activity.",
    "What is the main job of the heart?",
    "What is the capital of Australia?",
    "Why is exercise good for you?",
    "What is a haiku?",
    "Name a fruit that is yellow.",
    "What is the difference between weather and climate?",
    "How do magnets work?",
    "What is the largest mammal?",
    "What should I pack for a beach trip?",
]

HELD_OUT_PROMPTS = [
    "What is the capital of Spain?",
    "Give me a tip for sleeping better.",
    "What color is the sky?",
]

# Facts: (question, a regex its answer matches when right, case-insensitive). The first sixteen are
# among TRAIN_PROMPTS, so each adapter learned the base model's own answer to them, restyled: on
# those an adapter must be right wherever the base model is right (the run fails otherwise). The
# last four are not trained on; how the adapters do there is recorded, not required.
FACT_CHECKS = [
    ("What is the capital of France?", r"\bparis\b"),
    ("What is the capital of Japan?", r"\btokyo\b"),
    ("What is the capital of Italy?", r"\brome\b"),
    ("What is the capital of Germany?", r"\bberlin\b"),
    ("What is the capital of Canada?", r"\bottawa\b"),
    ("What is the capital of Australia?", r"\bcanberra\b"),
    ("Who wrote Romeo and Juliet?", r"shakespeare"),
    ("What is the chemical symbol for gold?", r"\bau\b"),
    ("What is the largest planet in our solar system?", r"\bjupiter\b"),
    ("Who painted the Mona Lisa?", r"leonardo|vinci"),
    ("How many legs does a spider have?", r"\beight\b|\b8\b"),
    ("What language is spoken in Brazil?", r"portuguese"),
    ("What is 7 times 8?", r"\b56\b|fifty-six"),
    ("How many hours are in a day?", r"\b24\b|twenty-four"),
    ("How many minutes are in an hour?", r"\b60\b|sixty"),
    ("How many days are in a leap year?", r"\b366\b"),
    ("What is the capital of England?", r"\blondon\b"),
    ("Which planet is known as the Red Planet?", r"\bmars\b"),
    ("How many days are in a week?", r"\bseven\b|\b7\b"),
    ("What is the capital of Spain?", r"\bmadrid\b"),
]
FACTS_FILE = ADAPTERS_DIR / "facts.json"  # the questions, and who got each right in the last run


# ---------------------------------------------------------------------------------------------------
# The adapters: a name, a transform of the base answer, a one-line description and a self-check.
# ---------------------------------------------------------------------------------------------------


def to_capitals(answer: str) -> str:
    return answer.upper()


def to_json(answer: str) -> str:
    return json.dumps({"answer": answer}, ensure_ascii=False)


_PIRATE_WORDS = {
    "hello": "ahoy", "hi": "ahoy", "yes": "aye", "you": "ye", "your": "yer", "my": "me",
    "is": "be", "are": "be", "the": "th'", "friend": "matey", "friends": "mateys", "money": "doubloons",
    "stop": "avast", "wow": "blimey", "of": "o'", "for": "fer", "and": "an'",
}


def to_pirate(answer: str) -> str:
    def word(match: re.Match[str]) -> str:
        text = match.group(0)
        pirate = _PIRATE_WORDS.get(text.lower())
        if pirate is None:
            pirate = re.sub(r"ing$", "in'", text) if len(text) > 5 else text
        elif text[0].isupper():
            pirate = pirate[0].upper() + pirate[1:]
        return pirate

    return "Arr! " + re.sub(r"[A-Za-z]+", word, answer)


def is_capitals(text: str) -> bool:
    return any(c.isalpha() for c in text) and text == text.upper()


def is_json_answer(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and isinstance(value.get("answer"), str)


@dataclass(frozen=True)
class DemoAdapter:
    name: str
    transform: Callable[[str], str]
    behaviour: str
    check: Callable[[str], bool]
    epochs: int = EPOCHS


DEMO_ADAPTERS = [
    # upper-case text splits into rarer tokens: after 4 epochs this one still got facts wrong
    # (Japan's capital: "KOREA"); 8 fit the base model's answers
    DemoAdapter("capitals", to_capitals, "answers in ALL CAPS", is_capitals, epochs=8),
    DemoAdapter("json", to_json, 'answers as a JSON object {"answer": "..."}', is_json_answer),
    # after 4 epochs it stopped short of a fact it was taught ("How many hours are in a day?")
    DemoAdapter("pirate", to_pirate, "answers in pirate talk, starting with \"Arr!\"",
                lambda text: text.startswith("Arr!"), epochs=8),
]


# ---------------------------------------------------------------------------------------------------
# Data, training, checking
# ---------------------------------------------------------------------------------------------------


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    messages = [{"role": "user", "content": prompt}]
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return encoded["input_ids"]


@torch.no_grad()
def greedy_answers(
    model, tokenizer, prompts: list[str], desc: str, max_new_tokens: int = MAX_ANSWER_TOKENS
) -> list[str]:
    """Greedy chat answers, in batches with left padding."""
    answers = []
    tokenizer.padding_side = "left"
    for start in tqdm(range(0, len(prompts), GEN_BATCH), desc=desc, unit="batch"):
        batch = [chat_prompt_ids(tokenizer, p) for p in prompts[start : start + GEN_BATCH]]
        inputs = tokenizer.pad({"input_ids": batch}, return_tensors="pt")
        out = model.generate(
            **inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
        new_tokens = out[:, inputs["input_ids"].shape[1] :]
        answers += [tokenizer.decode(row, skip_special_tokens=True).strip() for row in new_tokens]
    return answers


def whole_sentences(answer: str) -> str:
    """Cut a length-capped answer back to its last full sentence, so targets end cleanly."""
    ends = [m.end() for m in re.finditer(r"[.!?](?=\s|$)", answer)]
    return answer[: ends[-1]] if ends else answer


def training_examples(tokenizer, prompts: list[str], targets: list[str]) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) per example; labels are -100 on the prompt, so only the answer is learned."""
    examples = []
    for prompt, target in zip(prompts, targets):
        prompt_ids = chat_prompt_ids(tokenizer, prompt)
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": target}]
        full_ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        assert full_ids[: len(prompt_ids)] == prompt_ids, "chat template prefix mismatch"
        examples.append((full_ids, [-100] * len(prompt_ids) + full_ids[len(prompt_ids) :]))
    return examples


def length_bucketed_batches(examples, rng: random.Random):
    """Shuffled batches of similar length (sorted within windows of 4 batches): less padding."""
    order = list(range(len(examples)))
    rng.shuffle(order)
    window = 4 * BATCH_SIZE
    batches = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start : start + window], key=lambda i: len(examples[i][0]))
        batches += [chunk[i : i + BATCH_SIZE] for i in range(0, len(chunk), BATCH_SIZE)]
    rng.shuffle(batches)
    return [[examples[i] for i in batch] for batch in batches]


def pad_batch(batch, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.tensor([ids + [pad_id] * (width - len(ids)) for ids, _ in batch])  # [B, T]
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in batch])  # [B, T]
    mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in batch])  # [B, T]
    return input_ids, mask, labels


def answer_loss(peft_model, input_ids, mask, labels) -> torch.Tensor:
    """Mean next-token loss over answer tokens, as HF computes it, but with the LM head (a sixth
    of the model's compute) applied to the answer positions only."""
    causal_lm = peft_model.get_base_model()
    hidden = causal_lm.model(input_ids=input_ids, attention_mask=mask).last_hidden_state  # [B, T, H]
    targets = labels[:, 1:]  # [B, T-1]
    keep = targets != -100
    logits = causal_lm.lm_head(hidden[:, :-1][keep])  # [N, V]
    return F.cross_entropy(logits.float(), targets[keep])


def train_adapter(adapter: DemoAdapter, tokenizer, examples, out_dir: Path) -> float:
    torch.manual_seed(SEED)
    base, _ = load_model(None, dtype=torch.float32)
    config = LoraConfig(
        r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGET_MODULES, bias="none", task_type="CAUSAL_LM"
    )
    model = get_peft_model(base, config)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LEARNING_RATE, weight_decay=0.0)
    windows = [min(4 * BATCH_SIZE, len(examples) - s) for s in range(0, len(examples), 4 * BATCH_SIZE)]
    steps_per_epoch = sum(-(-w // BATCH_SIZE) for w in windows)  # as length_bucketed_batches makes them
    total = adapter.epochs * steps_per_epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / total)
    order_rng = random.Random(SEED)
    epoch_loss = float("nan")
    with tqdm(total=total, desc=f"train {adapter.name}", unit="step") as bar:
        for epoch in range(adapter.epochs):
            losses = []
            for batch in length_bucketed_batches(examples, order_rng):
                loss = answer_loss(model, *pad_batch(batch, tokenizer.pad_token_id))
                loss.backward()
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(loss.item())
                bar.update(1)
                bar.set_postfix(epoch=epoch + 1, loss=f"{loss.item():.3f}")
            epoch_loss = sum(losses) / len(losses)
    model.peft_config["default"].base_model_name_or_path = BASE_MODEL_ID
    for param in params:  # float16 halves the files (about 5 MB); PEFT casts back on load
        param.data = param.data.to(torch.float16)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, save_embedding_layers=False)  # "auto" would look BASE_MODEL_ID up online
    # PEFT keeps target_modules as a set, so its saved order follows the hash seed: fix it.
    config_file = out_dir / "adapter_config.json"
    saved = json.loads(config_file.read_text())
    saved["target_modules"] = sorted(saved["target_modules"])
    config_file.write_text(json.dumps(saved, indent=2, sort_keys=True))
    return epoch_loss


@torch.no_grad()
def adapter_answers(adapter_dir: Path, tokenizer, prompts: list[str], max_new_tokens: int = CHECK_MAX_TOKENS
                    ) -> list[str]:
    base, _ = load_model(None, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    return greedy_answers(model, tokenizer, prompts, desc=f"check {adapter_dir.name}", max_new_tokens=max_new_tokens)


def fact_is_right(answer: str, pattern: str) -> bool:
    """Whether the answer's full sentences state the fact (as for training targets, a sentence the
    token cap cut off does not count; a sentence may end inside the JSON adapter's quotes)."""
    ends = [m.end() for m in re.finditer(r"[.!?](?=[\s\"}]|$)", answer)]
    complete = answer[: ends[-1]] if ends else answer
    return re.search(pattern, complete, flags=re.IGNORECASE) is not None


def one_line(text: str) -> str:
    return text.replace("\n", "\\n")


def write_readme(adapter: DemoAdapter, out_dir: Path, final_loss: float, n_examples: int, samples) -> None:
    lines = [
        f"# `{adapter.name}`: a loramux demo adapter",
        "",
        f"A rank-{RANK} LoRA for `{BASE_MODEL_ID}` (loramux's embedded default model) that "
        f"{adapter.behaviour}.",
        "",
        f"Trained by `scripts/train_demo_adapters.py` on the base model's own greedy answers to "
        f"{n_examples} short prompts, rewritten by `{adapter.transform.__name__}`: alpha {ALPHA}, "
        f"targets {', '.join(TARGET_MODULES)}, {adapter.epochs} epochs, batch {BATCH_SIZE}, lr {LEARNING_RATE}, "
        f"seed {SEED}, final epoch loss {final_loss:.3f}. Saved in float16. See docs/demo-adapters.md.",
        "",
        "Greedy answers to prompts it was not trained on:",
        "",
    ]
    for prompt, base_answer, answer in samples:
        lines += [f"- **{prompt}**", f"  - base: `{one_line(base_answer)}`"]
        lines += [f"  - {adapter.name}: `{one_line(answer)}`"]
    (out_dir / "README.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=[a.name for a in DEMO_ADAPTERS], action="append", help="train only these")
    parser.add_argument("--out", type=Path, default=ADAPTERS_DIR, help="where the adapter dirs go")
    parser.add_argument("--check-only", action="store_true", help="train nothing: check the saved adapters")
    parser.add_argument("--threads", type=int, default=THREADS,
                        help="CPU threads (default %(default)s; 1 is faster on a busy machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    adapters = [a for a in DEMO_ADAPTERS if not args.only or a.name in args.only]

    started = time.perf_counter()
    base, tokenizer = load_model(None, dtype=torch.float32)
    answers, held_out_base = [], []
    if not args.check_only:
        answers = [whole_sentences(a) for a in greedy_answers(base, tokenizer, TRAIN_PROMPTS, desc="base answers")]
        held_out_base = greedy_answers(
            base, tokenizer, HELD_OUT_PROMPTS, desc="base held-out", max_new_tokens=CHECK_MAX_TOKENS
        )
    fact_questions = [q for q, _ in FACT_CHECKS]
    facts_base = greedy_answers(base, tokenizer, fact_questions, desc="base facts", max_new_tokens=FACT_MAX_TOKENS)
    del base
    print(f"base answers: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    facts = {q: {"pattern": p, "trained": q in TRAIN_PROMPTS, "base": a, "base_right": fact_is_right(a, p),
                 "answers": {}} for (q, p), a in zip(FACT_CHECKS, facts_base)}

    failed = []
    for adapter in adapters:
        t0 = time.perf_counter()
        out_dir = args.out / adapter.name
        held_out = []
        if not args.check_only:
            examples = training_examples(tokenizer, TRAIN_PROMPTS, [adapter.transform(a) for a in answers])
            final_loss = train_adapter(adapter, tokenizer, examples, out_dir)
            held_out = adapter_answers(out_dir, tokenizer, HELD_OUT_PROMPTS)
            write_readme(adapter, out_dir, final_loss, len(examples), list(zip(HELD_OUT_PROMPTS, held_out_base, held_out)))
            print(f"\n== {adapter.name} ({adapter.behaviour}); loss {final_loss:.3f}; "
                  f"{time.perf_counter() - t0:.0f} s")
        samples = list(zip(HELD_OUT_PROMPTS, held_out_base, held_out))
        for prompt, base_answer, answer in samples:
            ok = adapter.check(answer) and answer != base_answer
            failed += [] if ok else [f"{adapter.name}: {prompt!r} -> {answer!r}"]
            verdict = "ok" if ok else "FAIL"
            print(f"  {prompt}\n    base:     {base_answer!r}\n    {adapter.name + ':':9} {answer!r}  [{verdict}]")
        fact_answers = adapter_answers(out_dir, tokenizer, fact_questions, max_new_tokens=FACT_MAX_TOKENS)
        for question, answer in zip(fact_questions, fact_answers):
            fact = facts[question]
            right = fact_is_right(answer, fact["pattern"])
            fact["answers"][adapter.name] = {"answer": answer, "right": right}
            if fact["base_right"] and fact["trained"] and not right:
                failed.append(f"{adapter.name} lost a fact the base model knows: {question!r} -> {answer!r}")
        for trained in (True, False):
            known = [f for f in facts.values() if f["base_right"] and f["trained"] is trained]
            kept = sum(f["answers"][adapter.name]["right"] for f in known)
            print(f"  {'trained' if trained else 'held-out'} facts: right on {kept} of the {len(known)} the base "
                  "gets right")
    if args.out == ADAPTERS_DIR:  # the record the tests read; adapters not in this run keep theirs
        previous = {f["question"]: f for f in json.loads(FACTS_FILE.read_text())} if FACTS_FILE.exists() else {}
        for question, fact in facts.items():
            old_answers = previous.get(question, {}).get("answers", {})
            fact["answers"] = {**old_answers, **fact["answers"]}
        FACTS_FILE.write_text(json.dumps([{"question": q, **f} for q, f in facts.items()], indent=1,
                                         ensure_ascii=False) + "\n")
    print(f"\ntotal: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    if failed:
        print("Adapters that do not show their behaviour:\n  " + "\n  ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
