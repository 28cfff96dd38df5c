"""Random LoRA adapters for the embedded tiny models, saved as diffusers' ``save_lora_weights`` writes them.

peft makes them (``LoraConfig(init_lora_weights=False)``: B is random too, so an adapter changes the output; peft's
default B = 0 would let a test pass without applying anything), from the model's own modules; the file is diffusers'
layout (``transformer.<module>.lora_A.weight``, ``connectors.`` for LTX-2's text connectors) with its adapter
metadata, so ``pipe.load_lora_weights`` reads it as it reads a trained one.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = ["LTX2_A", "LTX2_B", "LTX2_CONNECTORS", "LTX_VIDEO_A", "LTX_VIDEO_B", "make_adapter"]

# Module name suffixes (peft's target_modules) of two adapters per family that overlap in some modules (their
# updates then add up there, in the request's order) and reach every kind of layer: self- and cross-attention
# (the text keys and values kept per request), the caption projection, the feed-forward, the in/out projections.
LTX_VIDEO_A = ("to_q", "to_k", "to_v", "to_out.0")
LTX_VIDEO_B = ("attn2.to_v", "ff.net.2", "caption_projection.linear_1", "proj_in")
LTX2_A = ("attn1.to_q", "attn1.to_v", "audio_attn1.to_k", "audio_to_video_attn.to_v", "attn2.to_k")
LTX2_B = ("attn1.to_v", "ff.net.0.proj", "audio_ff.net.2", "video_to_audio_attn.to_q", "proj_out")
LTX2_CONNECTORS = ("text_proj_in", "video_connector.transformer_blocks.0.attn1.to_q",
                   "audio_connector.transformer_blocks.0.ff.net.2")


def _peft_layers(module: torch.nn.Module, targets: Sequence[str], *, rank: int, seed: int, scale: float):
    from peft import LoraConfig, get_peft_model_state_dict

    module = copy.deepcopy(module)
    config = LoraConfig(r=rank, lora_alpha=rank, target_modules=list(targets), init_lora_weights=False)
    torch.manual_seed(seed)
    module.add_adapter(config, adapter_name="made")
    layers = get_peft_model_state_dict(module, adapter_name="made")
    # Small enough that the video stays a video, large enough to move every uint8 level that the comparisons see.
    layers = {key: value * scale if "lora_B" in key else value for key, value in layers.items()}
    return layers, module.peft_config["made"].to_dict()


def make_adapter(components, path: str | Path, *, seed: int, targets: Sequence[str], rank: int = 4,
                 connectors: Sequence[str] = (), scale: float = 0.5) -> Path:
    """A random adapter of ``components``' transformer (the modules ``targets`` names; ``connectors``: also LTX-2's
    text connectors) written to ``path`` (``NAME.safetensors``); returns ``path``."""
    from diffusers.loaders import LTX2LoraLoaderMixin

    path = Path(path)
    layers, metadata = {}, {}
    layers["transformer"], metadata["transformer"] = _peft_layers(components.transformer, targets, rank=rank,
                                                                  seed=seed, scale=scale)
    if connectors:
        layers["connectors"], metadata["connectors"] = _peft_layers(components.connectors, connectors, rank=rank,
                                                                    seed=seed + 1, scale=scale)
    # diffusers' own writer (save_lora_weights calls it; LTX2Pipeline's takes the transformer's layers only).
    LTX2LoraLoaderMixin._save_lora_weights(save_directory=str(path.parent), lora_layers=layers,
                                           lora_metadata=metadata, weight_name=path.name)
    return path
