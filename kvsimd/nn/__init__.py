"""Models: configuration, weights, the forward passes over the compiled layers, generation.

- ``config``: :class:`ModelConfig` and its check.
- ``weights``: the weight dataclasses a loader fills, their checks, their packing into the
  compiled layers (``kvsimd._kvsimd.Layers``: the one layer implementation).
- ``model``: what every model shares (prefill chunk, decode step, uncached pass).
- ``decoder`` / ``encoder_decoder``: :class:`Decoder`, :class:`EncoderDecoder`.
- ``generate``: sampling and the generate loop.
"""
from kvsimd.nn.config import ModelConfig
from kvsimd.nn.decoder import Decoder
from kvsimd.nn.encoder_decoder import EncoderDecoder
from kvsimd.nn.generate import sample
from kvsimd.nn.weights import AttentionWeights, FFNWeights, LayerWeights, NormWeights

__all__ = ["ModelConfig", "Decoder", "EncoderDecoder", "sample", "AttentionWeights", "FFNWeights", "LayerWeights",
           "NormWeights"]
