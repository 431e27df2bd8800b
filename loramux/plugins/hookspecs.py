"""The hook specifications: what a loramux plugin can implement.

A plugin is a module (or object) with functions marked ``@loramux.hookimpl`` and named exactly as
a spec below. Hook names carry no prefix. A hookimpl may take any subset of the spec's arguments,
by name, and must never give one a default value: pluggy does not pass such an argument.
Hooks run when adapters are resolved or layers are wrapped, never inside the per-step loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    import torch

    from loramux.registry.config import LoRAConfig
    from loramux.resolvers.base import Resolver
    from loramux.resolvers.settings import ResolverSettings

__all__ = ["hookimpl", "hookspec", "PROJECT_NAME"]

PROJECT_NAME = "loramux"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# -------------------------------------------------------------------------------------------------
# Adapter resolution
# -------------------------------------------------------------------------------------------------


@hookspec
def register_resolvers(register: Callable[[Resolver], None], settings: ResolverSettings) -> None:
    """Register adapter sources: call ``register(resolver)`` once per :class:`Resolver`.

    Called once per :class:`~loramux.registry.Registry` (and by ``loramux inspect``), when it is
    built. A resolver finds an adapter by name (``resolve``) and fetches the URIs of its
    ``schemes`` (``fetch``); see :mod:`loramux.resolvers.base`. Read your configuration (an
    environment variable, a config file) here; register nothing when there is none.

    Resolvers are tried in registration order unless the user sets an order
    (``settings.order``: ``--lora-resolvers s3,filesystem``, ``LORAMUX_LORA_RESOLVERS``); a
    plugin's impls run in pluggy's usual order (last registered first; ``tryfirst``/``trylast``
    move them).

    :param register: call it with a :class:`~loramux.resolvers.base.Resolver` instance. Two
        resolvers with the same ``name``, or claiming the same URI scheme, are an error naming
        both plugins; anything that is not a ``Resolver`` is refused and the plugin's resolvers
        are left out.
    :param settings: the :class:`~loramux.resolvers.ResolverSettings` of the registry being
        built (resolver order, the filesystem root, the Hub allow-list), as the user gave them
        (flags or arguments, with environment variables as defaults). Take only ``register`` if
        you need none of it: a hookimpl may take any subset of the arguments.
    :returns: nothing; return values are ignored.
    """


# -------------------------------------------------------------------------------------------------
# Layer wrapping
# -------------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def create_lora_layer(
    base_layer: torch.nn.Module, module_name: str, lora_config: LoRAConfig
) -> torch.nn.Module | None:
    """Wrap one layer of the base model so that it applies LoRA, or decline with None.

    Called once per targeted module when a model is patched for LoRA. Return a
    ``BaseLayerWithLoRA`` (:mod:`loramux.engine.layers.base`) that wraps ``base_layer`` (its
    ``get_base_layer()`` returns ``base_layer``) and declares its sizes, the dtype of its adapter
    weights and the forward routes it allows (docs/plugins.md, "The LoRA layer contract"), for
    layer types you support; None for all others. loramux's own implementation, for
    ``nn.Linear``, ``nn.Embedding``, GPT-2's ``Conv1D`` and packed projections, is ``trylast``,
    so a plugin's answer wins over it.

    Stops at first non-None result. A result that is not a ``torch.nn.Module`` wrapping
    ``base_layer``, or a wrapper that fails the checks of the contract (a dry run on a tiny
    input), is refused with a warning naming the plugin and the fix, and the next implementation
    is asked instead.

    :param base_layer: the module to wrap, as it is in the base model.
    :param module_name: its dotted name in the base model, e.g. ``model.layers.0.self_attn.q_proj``.
    :param lora_config: the bounds to size LoRA buffers for (``max_lora_rank``, ``lora_dtype``;
        the adapter weight pool sizes the slots).
    :returns: the wrapper module, or None for "not mine".
    """
