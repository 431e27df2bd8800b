"""Layer plugins through the LoRA layer contract: an int8 weight-only ``ScaledLinear`` and a 1x1
convolution (tests/plugins/) equal PEFT, and a plugin's mistakes are caught when the layer is
wrapped, naming the plugin and the fix, never on a first forward."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import peft_greedy, save_peft_adapter, tiny_llama
from test_plugins import load_plugin_file
from torch import nn

import loramux
from loramux import LLM, LoRARequest, SamplingParams
from loramux.engine.layers import BaseLayerWithLoRA, LayerSupport, LinearWithLoRA, Route
from loramux.engine.adapters.lora_model import LoRAModelManager, wrap_layer
from loramux.errors import IncompatibleAdapterError
from loramux.plugins import plugin_errors, reset_plugin_manager
from loramux.registry import LoRAConfig, load_adapter

CONFIG = LoRAConfig(max_loras=3, max_lora_rank=8)
MLP = ["gate_proj", "up_proj", "down_proj"]
scaled = load_plugin_file("scaled_linear_lora")
conv = load_plugin_file("conv1x1_lora")


@pytest.fixture
def fresh_errors():
    """A plugin manager whose reported errors are this test's only."""
    reset_plugin_manager()
    yield
    reset_plugin_manager()


def quantized(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """``model`` with its MLP projections int8 `ScaledLinear` layers, and the float model those
    compute (what PEFT runs)."""
    served, oracle = copy.deepcopy(model), copy.deepcopy(model)
    for layer, reference in zip(served.model.layers, oracle.model.layers):
        for name in MLP:
            q = scaled.ScaledLinear.quantize(getattr(layer.mlp, name))
            setattr(layer.mlp, name, q)
            setattr(reference.mlp, name, q.dequantized())
    return served, oracle


def test_scaled_linear_serves_peft_adapters_on_an_int8_model(registered, tmp_path):
    """Two adapters over the int8 MLP (and q/v) in one mixed batch: PEFT's logits on the float
    model the int8 one computes, row by row; the wrapper declares the routes it allows."""
    from peft import PeftModel

    registered(scaled, "scaled-linear")
    served, reference = quantized(tiny_llama())
    dirs = {"mlp": save_peft_adapter(copy.deepcopy(reference), tmp_path / "mlp", seed=1, r=4, target_modules=MLP),
            "all": save_peft_adapter(copy.deepcopy(reference), tmp_path / "all", seed=2,
                                     target_modules=["q_proj", "v_proj", *MLP])}
    oracle = PeftModel.from_pretrained(copy.deepcopy(reference), dirs["mlp"], adapter_name="mlp")
    oracle.load_adapter(dirs["all"], adapter_name="all")
    manager = LoRAModelManager(served, CONFIG)
    layer = manager.layers["model.layers.0.mlp.up_proj"]
    assert type(layer) is scaled.ScaledLinearWithLoRA and layer.lora_dtype == torch.float32
    assert layer.route_plan.eager_prefill is Route.BASE_THEN_DELTA  # no GEMM onto the delta: it scales
    for name, directory in dirs.items():
        manager.activate(load_adapter(directory, name=name))
    ids = torch.randint(3, 128, (3, 5), generator=torch.Generator().manual_seed(0))
    names = ["all", None, "mlp"]
    manager.set_mapping(manager.token_slots(names, 5))
    with torch.no_grad():
        got = served(ids).logits
        expected = oracle(ids, adapter_names=[n or "__base__" for n in names]).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_scaled_linear_through_llm_generate(registered, tmp_path):
    """Installed as a plugin, served through `LLM.generate`: PEFT's greedy tokens, and the wrapped
    layers reached through `LLM.lora_manager`."""
    registered(scaled, "scaled-linear")
    served, reference = quantized(tiny_llama())
    path = save_peft_adapter(copy.deepcopy(reference), tmp_path / "mlp", seed=3, target_modules=["v_proj", *MLP])
    llm = LLM(served, max_loras=2, max_lora_rank=8, max_num_seqs=2, max_model_len=32)
    assert type(llm.lora_manager.layers["model.layers.1.mlp.down_proj"]) is scaled.ScaledLinearWithLoRA
    prompt = [5, 9, 14, 3, 7]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": prompt}] * 2, params,
                        lora_request=[LoRARequest("mlp", 1, str(path)), None], use_tqdm=False)
    assert list(outs[0].outputs[0].token_ids) == peft_greedy(path, prompt, 6, model=copy.deepcopy(reference))
    assert list(outs[1].outputs[0].token_ids) == peft_greedy(None, prompt, 6, model=copy.deepcopy(reference))
    assert llm.lora_manager.resident() == ["mlp"]


class ConvModel(nn.Module):
    """Token embeddings mixed by a pointwise convolution over [B, C, L], then a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(50, 16)
        self.mix = nn.Conv1d(16, 12, kernel_size=1)
        self.head = nn.Linear(12, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.mix(self.embed(ids).transpose(1, 2)).transpose(1, 2))


def test_conv1x1_serves_peft_convolution_adapters(registered, tmp_path):
    """PEFT saves a convolution's LoRA as [r, in, 1] and [out, r, 1]: the loader keeps them, the
    plugin's weight-layout hook maps them, and a mixed batch equals PEFT row by row."""
    from peft import PeftModel

    registered(conv, "conv1x1")
    model = ConvModel().eval()
    dirs = {name: save_peft_adapter(copy.deepcopy(model), tmp_path / name, seed=seed, r=r, target_modules=targets)
            for name, seed, r, targets in (("mix", 1, 4, ["mix"]), ("both", 2, 8, ["mix", "head"]))}
    adapter = load_adapter(dirs["mix"], name="mix")
    assert adapter.modules["mix"].lora_a.shape == (4, 16, 1) and adapter.modules["mix"].lora_b.shape == (12, 4, 1)
    oracle = PeftModel.from_pretrained(copy.deepcopy(model), dirs["mix"], adapter_name="mix")
    oracle.load_adapter(dirs["both"], adapter_name="both")
    served = copy.deepcopy(model)
    manager = LoRAModelManager(served, CONFIG)
    assert type(manager.layers["mix"]) is conv.Conv1x1WithLoRA
    manager.activate(adapter)
    manager.activate(load_adapter(dirs["both"], name="both"))
    ids = torch.randint(0, 50, (3, 6), generator=torch.Generator().manual_seed(1))
    names = ["both", "mix", None]
    manager.set_mapping(manager.token_slots(names, 6))
    with torch.no_grad():
        got = served(ids)
        expected = oracle(ids, adapter_names=[n or "__base__" for n in names])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got[0], model(ids)[0])
    manager.set_mapping(manager.token_slots(names, 6), static=True)  # as a step graph maps them
    assert manager.layers["mix"].route_plan.graph is Route.DELTA_APART  # the CPU: apart, in order
    with torch.no_grad():
        torch.testing.assert_close(served(ids), expected, rtol=1e-5, atol=1e-5)


def test_without_its_layout_hook_a_convolution_adapter_is_refused_naming_it(tmp_path):
    """No plugin for the convolution: its adapter fails validation naming the layer type; a
    wrapper without a layout hook would name ``adapter_matrices``."""
    model = ConvModel().eval()
    path = save_peft_adapter(copy.deepcopy(model), tmp_path / "mix", target_modules=["mix"])
    manager = LoRAModelManager(copy.deepcopy(model), CONFIG)
    with pytest.raises(IncompatibleAdapterError, match="Conv1d, which loramux cannot apply LoRA to"):
        manager.validate(load_adapter(path, name="mix"))


# -- mistakes, caught when the layer is wrapped ------------------------------------------------------


class ForgetsDtype:
    """Wraps `ScaledLinear` without ``dtype=``: its int8 weight cannot hold adapters."""

    @staticmethod
    @loramux.hookimpl
    def create_lora_layer(base_layer, module_name, lora_config):
        if isinstance(base_layer, scaled.ScaledLinear):
            return BaseLayerWithLoRA(base_layer, module_name, lora_config, in_features=base_layer.in_features,
                                     output_sizes=(base_layer.out_features,))
        return None


class Doubled(nn.Linear):
    """A float layer whose product is scaled: not ``x @ weight.T``."""

    def forward(self, x):
        return 2 * super().forward(x)


class ClaimsGemmOntoDelta(BaseLayerWithLoRA):
    """Declares the GEMM onto the delta for a layer that scales its product."""

    support = LayerSupport({Route.BASE_THEN_DELTA, Route.DELTA_THEN_GEMM})

    def __init__(self, base_layer, module_name, lora_config):
        super().__init__(base_layer, module_name, lora_config, in_features=base_layer.in_features,
                         output_sizes=(base_layer.out_features,))


class OwnDeltaUndeclared(LinearWithLoRA):
    """Adds another delta in ``apply_lora`` but declares the standard routes it inherits."""

    def apply_lora(self, x, y, meta):
        super().apply_lora(x, y, meta)
        super().apply_lora(x, y, meta)


class LegacyOwnKernels(LinearWithLoRA):
    """Written for the per-slot layout: its own kernels read ``lora_a_stacked``."""

    support = LayerSupport(own_delta=True)

    def apply_lora(self, x, y, meta):
        y += x @ self.lora_a_stacked[0].T


class WrongSpec(BaseLayerWithLoRA):
    """A convolution wrapped as if its tokens were the leading dims of its input."""

    support = LayerSupport({Route.DELTA_APART})

    def example_input(self, num_tokens):
        return torch.randn(1, self.in_features, num_tokens)


def answers(wrapper_type, base_type):
    class Plugin:
        @staticmethod
        @loramux.hookimpl
        def create_lora_layer(base_layer, module_name, lora_config):
            if type(base_layer) is base_type:
                if wrapper_type is WrongSpec:
                    return WrongSpec(base_layer, module_name, lora_config, in_features=base_layer.in_channels,
                                     output_sizes=(base_layer.out_channels,))
                return wrapper_type(base_layer, module_name, lora_config)
            return None

    return Plugin()


@pytest.mark.parametrize(("plugin", "base", "problem", "fix"), [
    (ForgetsDtype(), lambda: scaled.ScaledLinear.quantize(nn.Linear(16, 8)),
     "its base layer's weight is torch.int8, and no dtype= was given", "pass dtype="),
    (answers(ClaimsGemmOntoDelta, Doubled), lambda: Doubled(16, 8, bias=False),
     "route DELTA_THEN_GEMM gives another output", "DELTA_THEN_GEMM only where base_layer(x) is x @ weight.T"),
    (answers(OwnDeltaUndeclared, nn.Linear), lambda: nn.Linear(16, 8),
     "route BASE_THEN_DELTA gives another output", "Declare LayerSupport(own_delta=True)"),
    (answers(LegacyOwnKernels, nn.Linear), lambda: nn.Linear(16, 8),
     "route BASE_THEN_DELTA failed: AttributeError", "lora_a_stacked is gone (no per-slot copy is kept"),
    (answers(WrongSpec, nn.Conv1d), lambda: nn.Conv1d(16, 8, 1),
     "rows_shape gives [1, 16] for example_input(3)", "Make rows_shape return the dims"),
], ids=["no dtype", "gemm onto delta", "own delta undeclared", "per-slot layout", "layout"])
def test_a_plugins_mistake_is_caught_when_the_layer_is_wrapped(registered, fresh_errors, plugin, base, problem, fix):
    """The plugin is named with the problem and the fix; its layer goes to the next plugin
    (loramux's own wrapper, if any: a plain linear keeps LoRA), and nothing fails later."""
    registered(plugin, "careless")
    layer = base()
    wrapper = wrap_layer(layer, "model.block.proj", CONFIG)
    (error,) = plugin_errors()
    assert "plugin 'careless'" in str(error) and "'model.block.proj'" in str(error)
    assert problem in str(error) and fix in str(error), str(error)
    if isinstance(layer, nn.Linear):  # loramux's own wrapper; not a plain bias-free nn.Linear: no GEMM onto its delta
        assert type(wrapper) is LinearWithLoRA and wrapper.route_plan.eager_prefill is Route.BASE_THEN_DELTA
    else:
        assert wrapper is None


def test_a_layer_left_unwrapped_by_a_broken_plugin_fails_its_adapters_only(registered, fresh_errors, tmp_path):
    """The int8 layers stay unwrapped: an adapter that targets them is refused naming the layer
    type, and one on the projections loramux wraps itself runs as PEFT does."""
    registered(ForgetsDtype(), "careless")
    served, reference = quantized(tiny_llama())
    manager = LoRAModelManager(served, CONFIG)
    assert "model.layers.0.mlp.up_proj" not in manager.layers and "model.layers.0.self_attn.q_proj" in manager.layers
    mlp = save_peft_adapter(copy.deepcopy(reference), tmp_path / "mlp", target_modules=MLP)
    with pytest.raises(IncompatibleAdapterError, match="ScaledLinear, which loramux cannot apply LoRA to"):
        manager.validate(load_adapter(mlp, name="mlp"))
    qv = save_peft_adapter(copy.deepcopy(reference), tmp_path / "qv", seed=4)
    manager.activate(load_adapter(qv, name="qv"))
    prompt = [4, 8, 15, 16, 23]
    manager.set_mapping(manager.token_slots(["qv"], len(prompt)))
    from peft import PeftModel

    oracle = PeftModel.from_pretrained(copy.deepcopy(reference), qv)
    with torch.no_grad():
        torch.testing.assert_close(served(torch.tensor([prompt])).logits, oracle(torch.tensor([prompt])).logits,
                                   rtol=1e-4, atol=1e-4)


def test_layer_support_refuses_a_declaration_without_an_in_order_route():
    with pytest.raises(ValueError, match="at least one of"):
        LayerSupport({Route.DELTA_BESIDE})
    with pytest.raises(ValueError, match="every layer takes it"):
        LayerSupport({Route.BASE, Route.BASE_THEN_DELTA})
    with pytest.raises(ValueError, match="never call apply_lora"):
        LayerSupport({Route.BASE_THEN_DELTA, Route.DELTA_BESIDE}, own_delta=True)


class DefinesSetLora(LinearWithLoRA):
    """Written against the constructor of earlier versions, with a slot writer of its own."""

    def set_lora(self, slot, weights):  # never called: the adapter weight pool writes every layer
        raise AssertionError("set_lora is not part of the contract")


def test_a_wrapper_with_methods_loramux_no_longer_calls_is_warned_naming_them(registered, fresh_errors):
    registered(answers(DefinesSetLora, nn.Linear), "legacy")
    with pytest.warns(UserWarning, match=r"DefinesSetLora defines set_lora, which loramux no longer calls.*own_delta"):
        wrapper = wrap_layer(nn.Linear(16, 8), "model.block.proj", CONFIG)
    assert type(wrapper) is DefinesSetLora and not plugin_errors()  # it still serves, on the pool
