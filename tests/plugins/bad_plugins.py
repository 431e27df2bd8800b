"""Plugins that break a hook's contract, each in its own way. loramux must name each one and carry
on without it."""

from __future__ import annotations

import loramux
from loramux.resolvers import Resolver


class DefaultArgument:
    """pluggy never passes an argument that has a default, so ``register`` would stay None."""

    @loramux.hookimpl
    def register_resolvers(self, register=None):
        register(Resolver())


class UnknownHook:
    """A typo: the hook is ``register_resolvers``."""

    @loramux.hookimpl
    def register_resolver(self, register):
        pass


class FutureHook:
    """A hook from a newer loramux, marked optional: accepted, never called."""

    @loramux.hookimpl(optionalhook=True)
    def on_adapter_loaded(self, adapter):
        pass


class ExtraArgument:
    """Asks for an argument the spec does not have."""

    @loramux.hookimpl
    def register_resolvers(self, register, config):
        pass


class RaisingResolvers:
    @loramux.hookimpl
    def register_resolvers(self, register):
        raise RuntimeError("simulated: the plugin's configuration is broken")


class NotAResolver:
    @loramux.hookimpl
    def register_resolvers(self, register):
        register({"name": "dict-is-not-a-resolver"})


class NamedResolver(Resolver):
    def __init__(self, name: str, schemes: tuple[str, ...] = ()) -> None:
        self.name = name
        self.schemes = schemes


class Registers:
    """Registers the resolvers it is given (for collision tests)."""

    def __init__(self, *resolvers: Resolver) -> None:
        self.resolvers = resolvers

    @loramux.hookimpl
    def register_resolvers(self, register):
        for resolver in self.resolvers:
            register(resolver)


class CrashingResolver(Resolver):
    """Breaks the resolver contract at lookup time: a bare exception instead of a LoRAError."""

    name = "crashing"
    schemes = ("crash",)

    def resolve(self, base_model_name, lora_name):
        raise ConnectionError("simulated: the backing store is down")

    def fetch(self, uri):
        raise ConnectionError("simulated: the backing store is down")


class WrongResultResolver(Resolver):
    name = "wrong-result"

    def resolve(self, base_model_name, lora_name):
        return 42


class NotAWrapper:
    """Answers create_lora_layer with something that does not wrap the layer."""

    @loramux.hookimpl
    def create_lora_layer(self, base_layer, module_name, lora_config):
        return "not a module"


class RaisingLayer:
    @loramux.hookimpl
    def create_lora_layer(self, base_layer, module_name, lora_config):
        raise RuntimeError("simulated: a bug in the plugin")


class WrapsEverything:
    """A stand-in for loramux's built-in layer plugin: answers last, for any layer."""

    def __init__(self) -> None:
        self.calls = 0

    @loramux.hookimpl(trylast=True)
    def create_lora_layer(self, base_layer, module_name, lora_config):
        import torch

        self.calls += 1

        class Wrapper(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.base_layer = base_layer

            def get_base_layer(self):
                return self.base_layer

        return Wrapper()


# An instance an entry point can name (``bad_plugins:unknown_hook``).
unknown_hook = UnknownHook()
