"""Write ``bench/configs/ltx2/``: LTX-2 at its released size, configs only (no weights), for ``cp-infer memory``.

Sources: every diffusers component is its class's defaults in diffusers 0.42 (``LTX2VideoTransformer3DModel()`` is the
released 19B transformer: 48 blocks, 32 x 128 video heads, 32 x 64 audio heads, 18.9B parameters; the VAEs, vocoder,
text connectors and latent upsampler likewise); the text encoder is Gemma 3 12B (``google/gemma-3-12b-it``'s
``config.json``: text 48 layers, hidden 3840, MLP 15360, 16 heads of 256 with 8 key/value heads, vocabulary 262208;
the SigLIP vision tower, 27 layers of 1152), which LTX2Pipeline reads the hidden states of.

    python -m bench.configs.write_ltx2    # rewrites the folder
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).with_name("ltx2")

GEMMA3_12B = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "image_token_index": 262144,
    "mm_tokens_per_image": 256,
    "initializer_range": 0.02,
    "text_config": {
        "model_type": "gemma3_text",
        "hidden_size": 3840,
        "intermediate_size": 15360,
        "num_hidden_layers": 48,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "vocab_size": 262208,
        "max_position_embeddings": 131072,
        "query_pre_attn_scalar": 256,
        "sliding_window": 1024,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    },
    "vision_config": {
        "model_type": "siglip_vision_model",
        "hidden_size": 1152,
        "image_size": 896,
        "intermediate_size": 4304,
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "patch_size": 14,
        "vision_use_head": False,
    },
}


def main() -> None:
    import torch
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from diffusers.pipelines.ltx2.latent_upsampler import LTX2LatentUpsamplerModel
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    index = {"_class_name": "LTX2Pipeline"}
    for name, cls in (("transformer", LTX2VideoTransformer3DModel), ("vae", AutoencoderKLLTX2Video),
                      ("audio_vae", AutoencoderKLLTX2Audio), ("vocoder", LTX2Vocoder),
                      ("connectors", LTX2TextConnectors), ("latent_upsampler", LTX2LatentUpsamplerModel)):
        with torch.device("meta"):
            model = cls()
        model.save_config(OUT / name)
        index[name] = ["diffusers", cls.__name__]
    (OUT / "text_encoder").mkdir(parents=True, exist_ok=True)
    (OUT / "text_encoder" / "config.json").write_text(json.dumps(GEMMA3_12B, indent=2) + "\n")
    index["text_encoder"] = ["transformers", "Gemma3ForConditionalGeneration"]
    (OUT / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")


if __name__ == "__main__":
    main()
