"""Each compiled decoder layer leaves its closing residual add to the next call, where inductor fuses
it into the next layer's input RMSNorm; the last layer's goes into the model's final norm.

A stock Llama-family layer ends with `hidden = residual + mlp(...)`. One layer is one compiled graph
(compile.py), so that add is a pass of its own over the step's hidden states, and the next layer's
input RMSNorm reads the sum back. vLLM's layers return (MLP output, residual) and fuse the add into
the next norm. Here the engine's compiled unit is `handoff_forward`: the stock forward's operations
in the stock order, but for the closing add, which opens the next call instead. The layers' wrappers
(compile.py) pass the pending residual along through one ResidualHandoff per model; the final norm's
wrapper adds the last one. The first layer adds zeros (one memset a step), so that every layer runs
the same graph.

Only for layers whose class forward is LlamaDecoderLayer's (the same bytecode: Mistral, Qwen2/3,
Gemma and others in transformers 5.24 share it); any other keeps its own forward. Nothing between two
layers may see the partial output: a step with forward hooks on the decoder (transformers installs
them to record hidden states) runs the stock forwards, and anything else that replaces the tensor
between layers is an error, not a silently wrong sum.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch

HANDOFF_ATTR = "_ponytail_residual_handoff"
FINAL_NORM = "the decoder's final norm"


def _code_key(forward) -> tuple:
    code = inspect.unwrap(forward).__code__
    return code.co_code, code.co_consts, code.co_names, code.co_varnames


def _stock_forward_key() -> tuple | None:
    try:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    except ImportError:  # a transformers without Llama: nothing hands off
        return None
    return _code_key(LlamaDecoderLayer.forward)


def layers_can_hand_off(layers, decoder) -> bool:
    """Whether every layer runs LlamaDecoderLayer's forward and the decoder has a final `norm` module."""
    stock = _stock_forward_key()
    return (stock is not None and isinstance(getattr(decoder, "norm", None), torch.nn.Module)
            and all(_code_key(type(layer).forward) == stock for layer in layers))


def handoff_forward(self, hidden_states: torch.Tensor, residual: torch.Tensor, **kwargs):
    """LlamaDecoderLayer.forward with the previous layer's closing add first and its own left out:
    returns (MLP output, residual), whose sum is the stock forward's output."""
    hidden_states = hidden_states + residual
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
    hidden_states = residual + hidden_states
    residual = hidden_states
    hidden_states = self.post_attention_layernorm(hidden_states)
    return self.mlp(hidden_states), residual


def add_then_norm(norm: torch.nn.Module, hidden_states: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """The last layer's closing add and the final norm, one compiled graph."""
    return norm(hidden_states + residual)


def _hooked(module: torch.nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


@dataclass(slots=True)
class ResidualHandoff:
    """The add one layer left for the next call: `output` is the tensor that layer returned (its MLP's
    output), `residual` what still has to be added to it. Empty between forward passes."""

    modules: list[torch.nn.Module]  # the decoder's layers and final norm: hooks on any turn the handoff off
    active: bool = False  # decided at each forward pass's first layer
    output: torch.Tensor | None = field(default=None, repr=False)
    residual: torch.Tensor | None = field(default=None, repr=False)

    def start(self, hidden_states: torch.Tensor, by_name_only: bool) -> torch.Tensor:
        """At the first layer: whether this pass hands off (the decoder's loop passes all but the hidden
        states by name, and no hook would see a partial output), and the zeros it adds."""
        self.output = self.residual = None
        hooks = torch.nn.modules.module  # the global hooks nn.Module.__call__ reads too
        global_hooks = hooks._global_forward_hooks or hooks._global_forward_pre_hooks
        self.active = by_name_only and not global_hooks and not any(_hooked(m) for m in self.modules)
        return torch.zeros_like(hidden_states)

    def take(self, hidden_states: torch.Tensor, consumer: str) -> torch.Tensor:
        """The residual to add to hidden_states, which must be the tensor the previous layer returned."""
        if self.output is None or hidden_states is not self.output:
            what = "no layer handed off a residual" if self.output is None else "it received another tensor"
            raise RuntimeError(f"{consumer} expected the previous decoder layer's output with its residual add "
                               f"still pending (runner/residual_handoff.py), but {what}: something between the "
                               "decoder's layers replaced their output; build the LLM with compile_model=False")
        residual = self.residual
        self.output = self.residual = None
        self.active = consumer != FINAL_NORM  # after the final norm a lone layer call hands nothing off
        return residual

    def give(self, output: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        self.output, self.residual = output, residual
        return output

    @property
    def pending(self) -> bool:
        return self.output is not None


def install(model, decoder, layers) -> ResidualHandoff | None:
    """A handoff for the model's layers, its final norm wrapped to take the last add; None where the
    layers keep their own forwards (layers_can_hand_off)."""
    if not layers_can_hand_off(layers, decoder):
        return None
    norm = decoder.norm
    handoff = ResidualHandoff(modules=[*layers, norm])
    compiled = torch.compile(add_then_norm, dynamic=True)

    def norm_forward(hidden_states):
        if handoff.pending:
            return compiled(norm, hidden_states, handoff.take(hidden_states, FINAL_NORM))
        return type(norm).forward(norm, hidden_states)

    norm.forward = norm_forward
    setattr(model, HANDOFF_ATTR, handoff)
    return handoff


def uninstall(model, decoder) -> None:
    if vars(model).pop(HANDOFF_ATTR, None) is not None:
        vars(decoder.norm).pop("forward", None)


def check_consumed(model) -> None:
    """After a forward pass: the final norm took the last layer's pending add (else the model's output
    left it out: its decoder does not end with `self.norm(hidden_states)`)."""
    handoff = vars(model).get(HANDOFF_ATTR)
    if handoff is not None and handoff.pending:
        handoff.output = handoff.residual = None
        raise RuntimeError("the decoder's last layer left its residual add to the final norm, which never ran on "
                           f"its output: {type(model).__name__}'s decoder does not end with its `norm`; build the LLM "
                           "with compile_model=False")
