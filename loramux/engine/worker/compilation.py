"""Regional compilation of the model (its repeated decoder layer), and the on-disk compile caches.

Compiling the whole 8B forward with ``torch.compile`` traces and lowers all 32 layers, a minute
or more at start. Every decoder layer runs the same code on weights of the same shapes, so we compile
the layer instead (torch's "regional compilation" recipe): one code object, one compiled graph
that all layers share, built in the time of one layer. The elementwise chains that needed
compiling (RMSNorm, RoPE, SiLU-mul, the residual adds) all live inside the layer; what stays eager
is the embedding lookup, the rotary table, the final norm and the logits head, a handful of
kernels per step (and inside a CUDA graph their launches cost nothing).

Two things would make that one graph many:

- The custom ops take a per-layer int (``loramux::attention(..., module.layer_idx, ...)`` and
  ``loramux::lora_layer(x, layer.layer_id, ...)``), and dynamo bakes an ``nn.Module``'s int
  attributes into the graph as constants: one recompile per layer. We let dynamo treat those
  ints as symbolic (``allow_unspec_int_on_nn_module``) and name them dynamic from the first
  compile (``torch.compiler.config.dynamic_sources``), so they are graph inputs. Torch versions
  whose ``dynamic_sources`` takes no regex still share the graph, after one recompile (dynamo's
  automatic dynamic shapes): two frames for any number of layers.
- The token count: a layer's inputs are ``[1, T, ...]`` (every token of the step packed in one
  row). Before each call we mark the T dim dynamic (``maybe_mark_dynamic``), so the first compile
  serves every T >= 2 and nothing compiles after start (the runner never passes T = 1, which
  dynamo would specialise).

Caches: `configure_compile_caches` points inductor's cache (FX graph cache, AOTAutograd cache,
the automatic-dynamic profile) and Triton's kernel cache into the loramux cache dir unless the
user set ``TORCHINDUCTOR_CACHE_DIR`` / ``TRITON_CACHE_DIR``, so a second start reuses the
compiled graphs and kernels.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from loramux import envs

__all__ = [
    "CompileCacheDirs",
    "CompiledRegions",
    "LAYER_INT_ATTRIBUTES",
    "compile_repeated_blocks",
    "compiled_frames",
    "configure_compile_caches",
    "repeated_blocks",
    "restore_eager_blocks",
]

#: Module int attributes our custom ops take, which must not specialise a layer's graph:
#: transformers' ``self_attn.layer_idx`` (read by ``loramux_attention``) and the LoRA wrappers'
#: ``layer_id`` (read by ``BaseLayerWithLoRA.forward``).
LAYER_INT_ATTRIBUTES = ("layer_idx", "layer_id")

INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
TRITON_CACHE_ENV = "TRITON_CACHE_DIR"


# -- caches -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CompileCacheDirs:
    """Where compiled artefacts live: ``inductor`` (FX graphs, AOTAutograd, dynamic-shape
    profiles) and ``triton`` (compiled kernels, ours and inductor's)."""

    inductor: Path
    triton: Path


def configure_compile_caches(root: Path | None = None) -> CompileCacheDirs:
    """Keep compiled graphs and kernels on disk under ``root`` (default: the loramux cache dir,
    ``$LORAMUX_CACHE_DIR`` or ``~/.cache/loramux``), in ``torch-compile/`` and ``triton/``.

    A directory the user named in ``TORCHINDUCTOR_CACHE_DIR`` or ``TRITON_CACHE_DIR`` wins. Call it
    before the first compile or kernel launch of the process; torch and Triton read the variables
    when they first look for a cached artefact.
    """
    if root is None:
        from loramux.resolvers.cache import cache_dir

        root = cache_dir()
    inductor = Path(envs.export_default(INDUCTOR_CACHE_ENV, str(Path(root) / "torch-compile")))
    # Triton reads the variable whenever it looks up a kernel (its ``knobs.cache.dir``)
    triton_dir = Path(envs.export_default(TRITON_CACHE_ENV, str(Path(root) / "triton")))
    return CompileCacheDirs(inductor=inductor, triton=triton_dir)


# -- regional compilation -----------------------------------------------------------------------


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: the items of every outermost ``nn.ModuleList`` of two or more
    modules of one class (a transformers model's decoder layers). Lists nested in a block (MoE
    experts) are part of that block's graph."""
    blocks: list[nn.Module] = []
    inside: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in inside):
            continue
        if isinstance(module, nn.ModuleList) and len(module) >= 2 and len({type(m) for m in module}) == 1:
            blocks.extend(module)
            inside.append(name)
    return blocks


def compiled_frames() -> int:
    """Frames dynamo has compiled in this process (every compile and recompile counts one)."""
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])


class CompiledRegions:
    """The compiled blocks of one model, with what compiling them cost.

    :ivar blocks: the blocks whose ``forward`` now runs compiled.
    :ivar compile_seconds: wall time of the calls that compiled a frame (tracing, lowering,
        kernel compiles or cache loads, and that call's own run).
    :ivar frames: frames compiled by those calls (one per block class when its blocks share one graph).
    """

    def __init__(self, blocks: list[nn.Module], compiled_forwards: dict[type, Callable]) -> None:
        self.blocks = blocks
        self._compiled_forwards = compiled_forwards
        self.compile_seconds = 0.0
        self.frames = 0

    def call(self, block: nn.Module, hidden_states: torch.Tensor, *args, **kwargs):
        """Run ``block``'s compiled forward, its token dim marked dynamic."""
        tokens = hidden_states.shape[1] if hidden_states.dim() >= 2 else hidden_states.shape[0]
        for value in (hidden_states, *args, *kwargs.values()):
            _mark_token_dim(value, tokens)
        before = compiled_frames()
        started = time.perf_counter()
        out = self._compiled_forwards[type(block)](block, hidden_states, *args, **kwargs)
        compiled = compiled_frames() - before
        if compiled:
            self.frames += compiled
            self.compile_seconds += time.perf_counter() - started
        return out


def _mark_token_dim(value, tokens: int) -> None:
    """Mark the token dim of HF's packed ``[1, T, ...]`` layout (and of ``[T]`` vectors) dynamic,
    in a tensor or a tuple of tensors (the rotary ``(cos, sin)``)."""
    if isinstance(value, (tuple, list)):
        for item in value:
            _mark_token_dim(item, tokens)
    elif isinstance(value, torch.Tensor):
        dim = 1 if value.dim() >= 2 else 0
        if value.dim() and value.shape[dim] == tokens:
            torch._dynamo.maybe_mark_dynamic(value, dim)


def compile_repeated_blocks(model: nn.Module, *, backend: str | Callable = "inductor",
                            mode: str | None = None) -> CompiledRegions:
    """Compile ``model``'s repeated blocks (`repeated_blocks`) in place: one graph for all of them.

    Each block's ``forward`` becomes a call of one shared ``torch.compile`` of its class's forward
    (one per block class); hooks and everything outside the blocks stay eager. ``backend`` and
    ``mode`` are ``torch.compile``'s (tests use ``"eager"``, ``"aot_eager"`` or a compile counter).

    Sets process-wide dynamo options (as the runner did for the whole-model compile): ints on
    modules may be symbolic, the `LAYER_INT_ATTRIBUTES` are dynamic from the first compile,
    unrelated sizes are never unified by value (``use_duck_shape=False``), and the recompile limit
    leaves room for a process that builds several engines.

    :raises ValueError: the model has no repeated blocks (no ``nn.ModuleList`` of one class).
    """
    blocks = repeated_blocks(model)
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} has no repeated blocks (an nn.ModuleList of two or more modules of one "
            "class) to compile; pass compilation=False (CUDA graphs without compile) or enforce_eager=True"
        )
    _configure_dynamo()
    # one compiled function per block class (a text model has one; a vision-language model two)
    compiled = {cls: torch.compile(cls.forward, backend=backend, mode=mode) for cls in dict.fromkeys(map(type, blocks))}
    regions = CompiledRegions(blocks, compiled)
    for block in blocks:
        # an instance attribute shadows the class's forward; nn.Module.__call__ (and its hooks) stays eager
        block.forward = _BlockForward(regions, block)
    return regions


class _BlockForward:
    """``block.forward`` after `compile_repeated_blocks` (`restore_eager_blocks` removes it)."""

    def __init__(self, regions: CompiledRegions, block: nn.Module) -> None:
        self._regions = regions
        self._block = block

    def __call__(self, *args, **kwargs):
        return self._regions.call(self._block, *args, **kwargs)


def restore_eager_blocks(model: nn.Module) -> int:
    """Undo `compile_repeated_blocks` on ``model`` (an eager engine built on a model a compiled
    one used); returns how many blocks were restored."""
    restored = 0
    for module in model.modules():
        if isinstance(module.__dict__.get("forward"), _BlockForward):
            del module.forward
            restored += 1
    return restored


def _configure_dynamo() -> None:
    import torch.fx.experimental._config as fx_config

    dynamo = torch._dynamo.config
    dynamo.cache_size_limit = max(dynamo.cache_size_limit, 64)
    dynamo.allow_unspec_int_on_nn_module = True
    # token counts are unrelated sizes: no guard equating them because they were once equal
    fx_config.use_duck_shape = False
    wanted = [rf".*\.{name}$" for name in LAYER_INT_ATTRIBUTES]
    current = [s for s in torch.compiler.config.dynamic_sources.split(",") if s.strip()]
    torch.compiler.config.dynamic_sources = ",".join(dict.fromkeys(current + wanted))
