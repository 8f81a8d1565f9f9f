"""Dropout's rate as one live setting: the ``p`` of every dropout module of a model.

A dropout module reads its ``p`` at each forward, so a new value set between optimizer
steps trains from the next forward exactly as a model built with it (the masks keep
``1 - p`` of the elements and scale them by ``1 / (1 - p)``). Dropout a model draws
without a module (``torch.nn.functional.dropout`` in a forward, the ``dropout_p`` of
``scaled_dot_product_attention``) is out of reach, and so is the fused LayerNorm's
(:class:`gpuopt.kernels.FusedLayerNormDropoutActivation`): a model whose dropout is
only there, or has such a fused one at a rate above 0, is refused with the reason.
"""

from __future__ import annotations

from torch import nn

from gpuopt.kernels import FusedLayerNormDropoutActivation

#: The module classes whose ``p`` is dropout's rate (their subclasses too).
DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                   nn.FeatureAlphaDropout)


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
        rates = sorted({float(module.p) for module in self.modules})
        fused = sum(isinstance(module, FusedLayerNormDropoutActivation)
                    and module.dropout_p > 0 for module in model.modules())
        self.refusal: str | None = None
        if fused:
            self.refusal = (f"{type(model).__name__} has {fused} fused LayerNorm-dropout "
                            "module(s) with a dropout rate of their own (dropout_p)")
        elif not self.modules:
            self.refusal = (f"{type(model).__name__} has no nn.Dropout module (dropout by "
                            "torch.nn.functional.dropout or a dropout_p argument is out of "
                            "reach)")
        elif len(rates) > 1:
            self.refusal = (f"{type(model).__name__}'s {len(self.modules)} dropout modules "
                            f"have different rates ({', '.join(f'{p:g}' for p in rates)}): "
                            "one value would flatten them")

    @property
    def p(self) -> float | None:
        """The rate of every dropout module, in ``[0, 1]``; None where :attr:`refusal`
        says why there is none. Setting it sets every module's ``p`` (a few attribute
        writes: call it between optimizer steps; it never touches the device).

        Raises (the setter):
            ValueError: a rate outside ``[0, 1]`` or not a number, or a model with a
                :attr:`refusal` (None is taken there and changes nothing).
        """
        return None if self.refusal is not None else float(self.modules[0].p)

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
