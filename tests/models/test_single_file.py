"""Single-file checkpoints (``--model FILE.safetensors --config DIR|ORG/NAME``, ``models.common.single_file``): a tiny
model's transformer and VAEs written in Lightricks' original key layout (diffusers' own converters, inverted here)
load through ``from_single_file`` and generate the frames (and LTX-2's soundtrack) of the diffusers folder they came
from, bit for bit; files that cannot be told or are not safetensors are refused in one line.

The inverse layout is checked against diffusers itself: its ``from_single_file`` on the written file (whole, not
the per-component keys cp-infer hands it) gives back the folder's weights exactly, so a wrong inversion fails here
rather than passing by accident.

Equality is exact (the same weights, modules and arithmetic) once both models hold their weights in memory of their
own: NOTE(mmap-alignment): ``from_pretrained`` leaves a folder's weights as views into the memory-mapped safetensors
file, at the file's offsets, and the CPU kernels pick their vectorised paths by the data's alignment, which changes
their summation order (~1e-6, here 1 uint8 level in a frame); ``from_single_file`` copies into freshly allocated
(64-byte aligned) parameters. The folder's reference is therefore taken with its weights copied the same way.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from cp_infer.request import GenerationRequest
from cp_infer.sampler import SampleControl, sample
from models.common.loading import ModelLoadError, resolve_files

from ._hub_fixtures import folder_files, lay_out_snapshot

# diffusers' prefix table (original block index -> diffusers module) of each VAE side, read off
# `convert_ltx_vae_checkpoint_to_diffusers` (the 0.9.1 decoder, as the tiny VAE is shaped; the base encoder) and
# `convert_ltx2_vae_to_diffusers`.
_LTX_VAE_BLOCKS = {
    "encoder": ["down_blocks.0", "down_blocks.0.downsamplers.0", "down_blocks.0.conv_out", "down_blocks.1",
                "down_blocks.1.downsamplers.0", "down_blocks.1.conv_out", "down_blocks.2",
                "down_blocks.2.downsamplers.0", "down_blocks.3", "mid_block"],
    "decoder": ["mid_block", "up_blocks.0.upsamplers.0", "up_blocks.0", "up_blocks.1.upsamplers.0", "up_blocks.1",
                "up_blocks.2.upsamplers.0", "up_blocks.2", "up_blocks.3.upsamplers.0", "up_blocks.3"],
}
_LTX2_VAE_BLOCKS = {
    "encoder": ["down_blocks.0", "down_blocks.0.downsamplers.0", "down_blocks.1", "down_blocks.1.downsamplers.0",
                "down_blocks.2", "down_blocks.2.downsamplers.0", "down_blocks.3", "down_blocks.3.downsamplers.0",
                "mid_block"],
    "decoder": ["mid_block", "up_blocks.0.upsamplers.0", "up_blocks.0", "up_blocks.1.upsamplers.0", "up_blocks.1",
                "up_blocks.2.upsamplers.0", "up_blocks.2"],
}
_STATS = {"latents_mean": "per_channel_statistics.mean-of-means", "latents_std": "per_channel_statistics.std-of-means"}


def _blocks_back(key: str, tables: dict[str, list[str]], block: str) -> str:
    """``encoder.down_blocks.0.conv_out.x`` -> ``encoder.down_blocks.2.x``: the longest diffusers module prefix
    of the key's side, replaced by its original flat block."""
    side, _, rest = key.partition(".")
    if side not in tables:
        return key
    for index, prefix in sorted(enumerate(tables[side]), key=lambda item: -len(item[1])):
        if rest == prefix or rest.startswith(prefix + "."):
            return f"{side}.{block}.{index}{rest[len(prefix):]}"
    return key


def _ltx_vae_key(key: str) -> str:
    if key in _STATS:
        return "vae." + _STATS[key]
    key = _blocks_back(key, _LTX_VAE_BLOCKS, "up_blocks" if key.startswith("decoder.") else "down_blocks")
    if key.startswith("decoder.time_embedder."):
        key = "decoder.last_time_embedder." + key.removeprefix("decoder.time_embedder.")
    if key == "decoder.scale_shift_table":
        key = "decoder.last_scale_shift_table"
    key = key.replace("resnets", "res_blocks").replace("conv_shortcut.conv", "conv_shortcut")
    return "vae." + key.replace("norm3.", "norm3.norm.")


def _ltx_transformer_key(key: str) -> str:
    for new, old in (("proj_in", "patchify_proj"), ("time_embed", "adaln_single"), ("norm_q", "q_norm"),
                     ("norm_k", "k_norm")):
        key = key.replace(new, old)
    return "model.diffusion_model." + key


def _ltx2_vae_key(key: str) -> str:
    if key in _STATS:
        return "vae." + _STATS[key]
    key = _blocks_back(key, _LTX2_VAE_BLOCKS, "up_blocks" if key.startswith("decoder.") else "down_blocks")
    return "vae." + key.replace("resnets", "res_blocks")


def _ltx2_audio_vae_key(key: str) -> str:
    return "audio_vae." + _STATS.get(key, key)


def _ltx2_transformer_key(key: str) -> str:
    if key.startswith("audio_time_embed."):
        key = "audio_adaln_single." + key.removeprefix("audio_time_embed.")
    elif key.startswith("time_embed."):
        key = "adaln_single." + key.removeprefix("time_embed.")
    for new, old in (("av_cross_attn_video_scale_shift", "av_ca_video_scale_shift_adaln_single"),
                     ("av_cross_attn_video_a2v_gate", "av_ca_a2v_gate_adaln_single"),
                     ("av_cross_attn_audio_scale_shift", "av_ca_audio_scale_shift_adaln_single"),
                     ("av_cross_attn_audio_v2a_gate", "av_ca_v2a_gate_adaln_single"),
                     ("video_a2v_cross_attn_scale_shift_table", "scale_shift_table_a2v_ca_video"),
                     ("audio_a2v_cross_attn_scale_shift_table", "scale_shift_table_a2v_ca_audio"),
                     ("proj_in", "patchify_proj"), ("norm_q", "q_norm"), ("norm_k", "k_norm")):
        key = key.replace(new, old)
    return "model.diffusion_model." + key


_LAYOUTS = {
    "ltx-video": {"transformer": _ltx_transformer_key, "vae": _ltx_vae_key},
    "ltx2": {"transformer": _ltx2_transformer_key, "vae": _ltx2_vae_key, "audio_vae": _ltx2_audio_vae_key},
}


def _write_single_file(folder: Path, family: str, out: Path) -> dict[str, dict[str, torch.Tensor]]:
    """The folder's transformer and VAE(s) as one safetensors file in the original layout; returns each component's
    diffusers state dict."""
    from safetensors.torch import load_file

    tensors, states = {}, {}
    for component, rename in _LAYOUTS[family].items():
        state = load_file(folder / component / "diffusion_pytorch_model.safetensors")
        states[component] = state
        renamed = {rename(k): v for k, v in state.items()}
        assert len(renamed) == len(state), f"{component}: the inverse maps two keys onto one"
        tensors.update(renamed)
    save_file(tensors, out)
    return states


@pytest.fixture(scope="module", params=["ltx-video", "ltx2"])
def case(request, tmp_path_factory):
    """(family, the embedded folder, the single file made from it, its components' diffusers state dicts)."""
    from models.common.loading import resolve_model

    family = request.param
    folder = resolve_model("tiny-ltx-video" if family == "ltx-video" else "tiny-ltx2")
    path = tmp_path_factory.mktemp(f"single-{family}") / f"tiny-{family}.safetensors"
    return family, folder, path, _write_single_file(folder, family, path)


def _config_files(folder: Path, path: Path) -> dict[str, bytes]:
    """The folder's files but the weights of the components the single file ``path`` supplies."""
    from models.common.single_file import checkpoint_contents

    held = checkpoint_contents(path).components
    assert held == {"transformer", "vae"}  # LTX-2's audio VAE too comes from the config (diffusers 0.42)
    return {rel: data for rel, data in folder_files(folder).items()
            if not (rel.split("/")[0] in held and rel.endswith(".safetensors"))}


def test_the_inverse_layout_is_what_diffusers_converts(case):
    """diffusers' own ``from_single_file`` on the whole file gives back the folder's weights exactly."""
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        AutoencoderKLLTXVideo,
        LTX2VideoTransformer3DModel,
        LTXVideoTransformer3DModel,
    )

    family, folder, path, states = case
    classes = ({"transformer": LTXVideoTransformer3DModel, "vae": AutoencoderKLLTXVideo} if family == "ltx-video"
               else {"transformer": LTX2VideoTransformer3DModel, "vae": AutoencoderKLLTX2Video,
                     "audio_vae": AutoencoderKLLTX2Audio})
    for component, cls in classes.items():
        if hasattr(cls, "from_single_file"):
            got = cls.from_single_file(str(path), config=str(folder), subfolder=component, local_files_only=True,
                                       low_cpu_mem_usage=False).state_dict()
        else:  # AutoencoderKLLTX2Audio (diffusers 0.42): no from_single_file, but a converter all the same
            from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES
            from safetensors.torch import load_file

            convert = SINGLE_FILE_LOADABLE_CLASSES[cls.__name__]["checkpoint_mapping_fn"]
            got = convert(checkpoint={k: v for k, v in load_file(path).items() if k.startswith(f"{component}.")})
        assert set(got) == set(states[component]), component
        for key, value in states[component].items():
            assert torch.equal(got[key], value), f"{component}.{key}"


def _generate(model, seed: int):
    audio = []
    request = GenerationRequest.of(prompt="a lighthouse in a storm, waves breaking", negative_prompt="blurry",
                                   num_frames=9, height=64, width=96, num_inference_steps=2, seed=seed, stages=1)
    frames = sample(model, request, state=model.state, control=SampleControl(on_audio=lambda w, _sr: audio.append(w)))
    return frames, audio


@torch.no_grad()
def _own_memory(model):
    """``model`` with its transformer's and VAEs' weights copied out of the memory-mapped file
    (NOTE(mmap-alignment))."""
    for name in ("transformer", "vae", "audio_vae"):
        module = getattr(model.components, name, None)
        for tensor in () if module is None else (*module.parameters(), *module.buffers()):
            tensor.data = tensor.data.clone()
    return model


def test_single_file_generates_as_its_folder(case, tmp_path):
    """With a config folder that lacks the transformer's and the VAE's weights: they can only come from the file."""
    from cp_infer import single_process_state
    from models.registry import describe_model, open_model

    family, folder, path, _ = case
    config = tmp_path / "config"
    for rel, data in _config_files(folder, path).items():
        (config / rel).parent.mkdir(parents=True, exist_ok=True)
        (config / rel).write_bytes(data)
    seed = random.randrange(2**31)
    state = single_process_state()
    mapped = _generate(open_model(folder, dtype="fp32", state=state), seed)
    expected = _generate(_own_memory(open_model(folder, dtype="fp32", state=state)), seed)
    got = _generate(open_model(str(path), config=str(config), dtype="fp32", state=state), seed)
    assert np.array_equal(got[0], expected[0])
    assert np.abs(got[0].astype(int) - mapped[0]).max() <= 1  # NOTE(mmap-alignment)
    assert len(got[1]) == len(expected[1]) == (1 if family == "ltx2" else 0)
    for a, b in zip(got[1], expected[1], strict=True):
        assert np.array_equal(a, b)
    info = describe_model(str(path), config=str(config))
    assert info.family == family and info.path == config.resolve()
    assert info.options == describe_model(folder).options


def test_single_file_with_a_hub_config_that_lacks_their_weights(case, tmp_path, monkeypatch):
    """``--config org/name`` (offline, from the hub cache): the config repo's transformer and VAE weights are not
    needed."""
    from cp_infer import single_process_state
    from models.registry import open_model

    family, folder, path, _ = case
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    lay_out_snapshot(tmp_path / "hf" / "hub", "org/config", _config_files(folder, path), commit="c" * 40)
    model = open_model(str(path), config="org/config", dtype="fp32", state=single_process_state())
    assert resolve_files(str(path), config="org/config").checkpoint == path.resolve()
    assert model.transformer.config.num_layers >= 1


def test_refusals(case, tmp_path):
    family, folder, path, _ = case
    other = resolve_files("tiny-ltx2" if family == "ltx-video" else "tiny-ltx-video").folder
    pickle = tmp_path / "model.ckpt"
    pickle.write_bytes(b"\x80\x04not safetensors")
    with pytest.raises(ModelLoadError, match=r"not a \.safetensors checkpoint; cp-infer loads safetensors only"):
        resolve_files(str(pickle), config=str(folder))
    with pytest.raises(ModelLoadError, match=f"is an {family} model, but its --config .* is an "):
        resolve_files(str(path), config=str(other))
    with pytest.raises(ModelLoadError, match="single-file checkpoint: name the diffusers folder .* with --config"):
        resolve_files(str(path))
    with pytest.raises(ModelLoadError, match="--config .* is for a single-file checkpoint"):
        resolve_files(str(folder), config=str(folder))
    vae_only = tmp_path / "vae.safetensors"
    save_file({"vae.encoder.conv_in.conv.weight": torch.randn(2, 2)}, vae_only)
    with pytest.raises(ModelLoadError, match="holds no LTX-Video or LTX-2 transformer .* family cannot be told"):
        resolve_files(str(vae_only), config=str(folder))
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="cannot be read: .* truncated"):
        resolve_files(str(cut), config=str(folder))


def test_a_checkpoint_short_of_weights_is_refused(case, tmp_path):
    """A file whose transformer lacks a block's weights is refused naming them, not loaded with initial values."""
    from safetensors.torch import load_file

    from cp_infer import single_process_state
    from models.registry import open_model

    family, folder, path, _ = case
    tensors = {k: v for k, v in load_file(path).items() if ".transformer_blocks.1." not in k}
    short = tmp_path / "short.safetensors"
    save_file(tensors, short)
    with pytest.raises(ModelLoadError, match=r"could not load transformer from single-file checkpoint .* lacks \d+ of "
                                             r"the model's weights \(transformer_blocks\.1\."):
        open_model(str(short), config=str(folder), dtype="fp32", state=single_process_state())


def test_a_distilled_single_file_declares_the_distilled_recipe(case, tmp_path):
    """A distilled LTX-2 checkpoint is told by its file's name (``ltx-2-19b-distilled.safetensors``) when its configs
    come from a dev folder, and the loaded model records the file; LTX-Video has no distilled recipe, so the name
    changes nothing there."""
    from models.common.loading import resolve_files
    from models.ltx2.loading import load_ltx2
    from models.ltx2.options import DISTILLED_SIGMAS
    from models.ltx_video.loading import load_ltx_video
    from models.registry import describe_model

    family, folder, path, _ = case
    distilled = tmp_path / f"tiny-{family}-distilled.safetensors"
    os.link(path, distilled)
    dev_options = describe_model(str(path), config=str(folder)).options
    options = describe_model(str(distilled), config=str(folder)).options
    if family == "ltx2":
        assert dev_options["sigmas"].default is None and dev_options["num_inference_steps"].default != 8
        assert options["sigmas"].default == DISTILLED_SIGMAS and options["num_inference_steps"].default == 8
    else:
        assert [(o.name, o.default) for o in options] == [(o.name, o.default) for o in dev_options]
    load = load_ltx2 if family == "ltx2" else load_ltx_video
    assert load(resolve_files(str(distilled), config=str(folder))).checkpoint == distilled
