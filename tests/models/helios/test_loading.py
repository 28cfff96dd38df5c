"""Loading a Helios folder: the components in their dtypes (the VAE float32), its description from configs alone,
and a broken folder refused naming the subfolder and what is wrong. No process group."""

from __future__ import annotations

import shutil

import pytest
import torch

from models.common.folder_problems import ModelLoadError


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from models.helios.default import ensure_default_helios_model

    return ensure_default_helios_model(tmp_path_factory.mktemp("helios"))


def test_loads_and_describes_the_embedded_default(folder):
    from models.common.loading import detect_family
    from models.helios.loading import describe_helios, load_helios

    assert detect_family(folder) == "helios"
    components = load_helios(folder, dtype=torch.bfloat16)
    assert components.transformer.dtype == torch.bfloat16 and components.vae.dtype == torch.float32
    assert type(components.scheduler).__name__ == "HeliosScheduler"
    geometry, layers = describe_helios(folder)
    assert (geometry.temporal_compression, geometry.spatial_compression, geometry.patch_size, layers) == (4, 8, 2, 2)


def test_a_bf16_model_with_amplified_history_keys_runs_two_chunks(folder):
    """bf16 as on CUDA, with ``is_amplify_history`` (the embedded default has it): ``history_key_scale`` is kept in
    float32 by ``from_pretrained`` and would hand SDPA float32 history keys beside bf16 queries, which it refuses
    (found by bench/gpu_check.py on an H200); the model runs it in its own dtype."""
    from cp_infer import single_process_state
    from cp_infer.request import GenerationRequest
    from cp_infer.sampler import SampleControl, sample
    from models.helios.adapter import HeliosModel
    from models.helios.loading import load_helios

    model = HeliosModel(load_helios(folder, dtype=torch.bfloat16), state=single_process_state())
    assert model.components.transformer.config.is_amplify_history
    request = GenerationRequest(prompt="a red fox runs through fresh snow", negative_prompt="blurry", num_frames=17,
                                height=32, width=32, num_inference_steps=2, guidance_scale=4.0, seed=5,
                                options={"num_latent_frames_per_chunk": 3})
    latents = {}
    frames = sample(model, request, state=single_process_state(), control=SampleControl(on_latents=latents.update))
    assert frames.shape == (17, 32, 32, 3)
    assert torch.isfinite(torch.as_tensor(latents["latents"]).float()).all()


def test_a_broken_folder_is_refused_naming_the_subfolder(folder, tmp_path):
    from models.helios.loading import load_helios

    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    shutil.rmtree(broken / "vae")
    with pytest.raises(ModelLoadError, match=r"missing the subfolder\(s\) vae/"):
        load_helios(broken)
    shutil.copytree(folder / "vae", broken / "vae")
    weights = next((broken / "transformer").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ModelLoadError, match="transformer"):
        load_helios(broken)


def test_a_schedule_the_chunk_loop_does_not_run_is_refused_naming_it(folder, tmp_path):
    """A pyramid's schedule (stages=3) in a HeliosPipeline folder (which sets one stage's timesteps) is refused,
    naming the scheduler config's values and where a pyramid goes; so is HeliosScheduler's dmd type in a pyramid
    folder (it does not step in diffusers 0.42)."""
    import json

    from cp_infer import single_process_state
    from models.helios.adapter import HeliosModel
    from models.helios.loading import load_helios

    pyramid = tmp_path / "pyramid"
    shutil.copytree(folder, pyramid)
    config_file = pyramid / "scheduler" / "scheduler_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "stages": 3}))
    with pytest.raises(ValueError, match="stages=3.*goes with HeliosPyramidPipeline"):
        HeliosModel(load_helios(pyramid), state=single_process_state())
    index_file = pyramid / "model_index.json"
    index_file.write_text(json.dumps({**json.loads(index_file.read_text()), "_class_name": "HeliosPyramidPipeline"}))
    config_file.write_text(json.dumps({**config, "stages": 3, "scheduler_type": "dmd"}))
    with pytest.raises(ValueError, match="scheduler_type='dmd' does not step"):
        HeliosModel(load_helios(pyramid), state=single_process_state())
