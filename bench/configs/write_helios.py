"""Write ``bench/configs/helios/``: Helios at its released size, configs only (no weights), for ``cp-infer memory``.

Sources: the transformer and the VAE are their classes' defaults in diffusers 0.42 (``HeliosTransformer3DModel()``:
40 blocks of 40 x 128 heads, FFN 13824, UMT5-XXL's 4096-wide text, the short/mid/long history patch embeddings;
``AutoencoderKLWan()``: Wan 2.1's VAE, which ``BestWishYsh/Helios-Base`` ships); the text encoder is UMT5-XXL's
encoder (``google/umt5-xxl``'s ``config.json``: 24 layers, d_model 4096, d_ff 10240, 64 heads of 64, vocabulary
256384), which ``HeliosPipeline`` reads the last hidden states of.

    python -m bench.configs.write_helios    # rewrites the folder
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).with_name("helios")

UMT5_XXL = {
    "architectures": ["UMT5EncoderModel"],
    "model_type": "umt5",
    "d_model": 4096,
    "d_ff": 10240,
    "d_kv": 64,
    "num_heads": 64,
    "num_layers": 24,
    "vocab_size": 256384,
    "feed_forward_proj": "gated-gelu",
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "is_encoder_decoder": False,
    "dropout_rate": 0.0,
}


def main() -> None:
    import torch
    from diffusers import AutoencoderKLWan, HeliosScheduler, HeliosTransformer3DModel

    index = {"_class_name": "HeliosPipeline"}
    for name, cls in (("transformer", HeliosTransformer3DModel), ("vae", AutoencoderKLWan)):
        with torch.device("meta"):
            model = cls()
        model.save_config(OUT / name)
        index[name] = ["diffusers", cls.__name__]
    HeliosScheduler(stages=1, use_dynamic_shifting=True).save_config(OUT / "scheduler")
    index["scheduler"] = ["diffusers", "HeliosScheduler"]
    (OUT / "text_encoder").mkdir(parents=True, exist_ok=True)
    (OUT / "text_encoder" / "config.json").write_text(json.dumps(UMT5_XXL, indent=2) + "\n")
    index["text_encoder"] = ["transformers", "UMT5EncoderModel"]
    index["tokenizer"] = ["transformers", "T5TokenizerFast"]
    (OUT / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")


if __name__ == "__main__":
    main()
