"""Dropout's rate as one live setting: the ``p`` of every dropout module of a model.

A dropout module reads its ``p`` at each forward, so a new value set between optimizer
steps trains from the next forward exactly as a model built with it (the masks keep
``1 - p`` of the elements and scale them by ``1 / (1 - p)``). So do the rate attributes
of modules that draw their dropout without a module, at each forward
(:data:`RATE_ATTRIBUTES`: ``nn.MultiheadAttention.dropout``, the ``attention_dropout``
of Hugging Face attention layers, which they pass to ``scaled_dot_product_attention``):
those are set too, so that no dropout of the model is left at the old rate. Dropout
drawn from a plain number in a forward is out of reach, and so is the fused LayerNorm's
(:class:`gpuopt.kernels.FusedLayerNormDropoutActivation`): a model whose dropout is only
there, or has such a fused one at a rate above 0, is refused with the reason.
"""

from __future__ import annotations

from torch import nn

from gpuopt.kernels import FusedLayerNormDropoutActivation

#: The module classes whose ``p`` is dropout's rate (their subclasses too).
DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                   nn.FeatureAlphaDropout)
#: Float attributes that modules read at each forward as the rate of a dropout they draw
#: themselves: ``nn.MultiheadAttention.dropout``; ``attention_dropout`` of Hugging Face
#: attention layers (Llama, Mistral, Qwen... pass it to the attention function).
RATE_ATTRIBUTES = ("dropout", "attention_dropout")


class DropoutRate:
    """The ``p`` of every dropout module of a model, read and set as one value.

    Args:
        model: the model; its dropout modules are found once, here (a module added
            later is not set).

    Attributes:
        refusal: why this model's dropout cannot be one live setting (no dropout
            module; modules at different rates, which one value would flatten; a fused
            LayerNorm with dropout of its own), or None.
    """

    def __init__(self, model: nn.Module) -> None:
        self.modules = [module for module in model.modules()
                        if isinstance(module, DROPOUT_MODULES)]
        #: (module, attribute name) of each float rate a module reads at its forward.
        self.attributes = [(module, name) for module in model.modules()
                           for name in RATE_ATTRIBUTES
                           if type(vars(module).get(name)) is float]
        rates = sorted({float(module.p) for module in self.modules}
                       | {getattr(module, name) for module, name in self.attributes})
        fused = sum(isinstance(module, FusedLayerNormDropoutActivation)
                    and module.dropout_p > 0 for module in model.modules())
        self.refusal: str | None = None
        if fused:
            self.refusal = (f"{type(model).__name__} has {fused} fused LayerNorm-dropout "
                            "module(s) with a dropout rate of their own (dropout_p)")
        elif not self.modules and not self.attributes:
            self.refusal = (f"{type(model).__name__} has no nn.Dropout module (dropout by "
                            "torch.nn.functional.dropout or a dropout_p argument is out of "
                            "reach)")
        elif len(rates) > 1:
            count = len(self.modules) + len(self.attributes)
            self.refusal = (f"{type(model).__name__}'s {count} dropout modules and rates "
                            f"have different rates ({', '.join(f'{p:g}' for p in rates)}): "
                            "one value would flatten them")

    @property
    def p(self) -> float | None:
        """The rate of every dropout module, in ``[0, 1]``.

        None where :attr:`refusal` says why there is none. Setting it sets every module's
        ``p`` (a few attribute writes: call it between optimizer steps; it never touches the
        device).

        Raises (the setter):
            ValueError: a rate outside ``[0, 1]`` or not a number, or a model with a
                :attr:`refusal` (None is taken there and changes nothing).
        """
        if self.refusal is not None:
            return None
        return (float(self.modules[0].p) if self.modules
                else getattr(*self.attributes[0]))

    @p.setter
    def p(self, value: float | None) -> None:
        if self.refusal is not None:
            if value is None:
                return
            raise ValueError(self.refusal)
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not 0.0 <= value <= 1.0:
            raise ValueError(f"dropout must be a number in [0, 1], got {value!r}")
        for module in self.modules:
            module.p = float(value)
        for owner, name in self.attributes:
            setattr(owner, name, float(value))
