"""What a sharded rank holds, measured from outside: two fresh rank processes load a folder whose transformer
dominates (``--weights sharded``, the rank's own code: ``open_model`` and ``sample``, no allocator setting of the
test's) and generate once, while this process samples each one's private memory (``/proc/PID/smaps_rollup``:
anonymous pages plus private file pages) every 5 ms. Above what the rank held before its load, the peak at load and
while generating stays within the memory plan's (``cp-infer memory``: half the transformer and of the text encoder,
the other components, the root and two blocks gathered while one runs) plus :data:`MARGIN`; the load adds at least
the rank's shards (the measure sees them). For LTX-Video, LTX-2 and Wan; LTX-Video again with ``--offload`` of
everything, which on the CPU moves nothing.

Each transformer is widened to 12 blocks of ~16 MiB (weights of 1-4 MiB, ~200 MiB in all), so that the weights are
most of what a rank holds and glibc's heap sees the churn of gathered tensors larger than its initial mmap threshold.
Before a rank's baseline is read it has run the family's embedded default (the interpreter's first-use costs:
imports, kernels, the tokenizer) and trimmed its heap. The ranks are forked from the harness's fork server
(``tests.harness.fork_process``), which has imported torch and the engine: its pages are the rank's shared ones until
the rank writes them, and the warm-up and its garbage collection have written those it will before the baseline.
"""

from __future__ import annotations

import ctypes
import gc
import os
import threading
import time

import pytest

from ..harness import fork_context, fork_process

FAMILIES = ("ltx-video", "ltx2", "wan")
MARGIN = 80 << 20
"""Above the plan: a tiny request's activations and the interpreter's objects (a replicated rank's own grew 26-38 MiB
at this request, measured the same way), and the allocator's slack (chunks under the 1 MiB mmap threshold are the
heap's). A rank that kept each gathered block in its heap (glibc's dynamic threshold, before ``cp_infer.weights``
fixed it) went 123-255 MiB past the plan here (every case failed)."""


def _write(family: str, folder) -> None:
    import torch

    from models.common.embedded import write_pipeline

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if family == "ltx-video":
            from diffusers import LTXPipeline, LTXVideoTransformer3DModel

            from models.ltx_video.default import build_default_components

            c = build_default_components()
            c["transformer"] = LTXVideoTransformer3DModel(
                in_channels=16, out_channels=16, patch_size=1, patch_size_t=1, num_attention_heads=8,
                attention_head_dim=64, cross_attention_dim=512, num_layers=12,
                caption_channels=c["text_encoder"].config.d_model).eval()
            write_pipeline(LTXPipeline(**c), folder)
        elif family == "ltx2":
            from diffusers import LTX2Pipeline, LTX2VideoTransformer3DModel

            from models.ltx2.default import build_ltx2_components

            c = build_ltx2_components()
            tiny = c["transformer"].config
            c["transformer"] = LTX2VideoTransformer3DModel(
                in_channels=tiny.in_channels, out_channels=tiny.out_channels, num_attention_heads=8,
                attention_head_dim=64, cross_attention_dim=512, audio_in_channels=tiny.audio_in_channels,
                audio_out_channels=tiny.audio_out_channels, audio_num_attention_heads=tiny.audio_num_attention_heads,
                audio_attention_head_dim=tiny.audio_attention_head_dim,
                audio_cross_attention_dim=tiny.audio_cross_attention_dim, num_layers=12,
                caption_channels=tiny.caption_channels, rope_type=tiny.rope_type).eval()
            write_pipeline(LTX2Pipeline(**c), folder)
        else:
            from diffusers import WanTransformer3DModel

            from models.wan.default import build_wan_pipeline

            pipe = build_wan_pipeline("t2v")
            pipe.transformer = WanTransformer3DModel(
                patch_size=(1, 2, 2), num_attention_heads=8, attention_head_dim=64, in_channels=16, out_channels=16,
                text_dim=pipe.text_encoder.config.d_model, freq_dim=256, ffn_dim=2048, num_layers=12,
                cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024).eval()
            write_pipeline(pipe, folder)


def _request(family: str):
    from cp_infer.request import GenerationRequest

    size = dict(prompt="a red fox runs through fresh snow", negative_prompt="blurry", num_frames=9, height=64,
                width=64, num_inference_steps=2, seed=3, max_sequence_length=128)
    if family == "ltx2":
        return GenerationRequest.of(**size, stages=1, guidance_scale=3.0)
    return GenerationRequest.of(**size, guidance_scale=3.0)


def _tiny(family: str):
    from models.ltx2.default import ensure_default_ltx2_model
    from models.ltx_video.default import ensure_default_model
    from models.wan.default import ensure_default_wan_model

    return {"ltx-video": ensure_default_model, "ltx2": ensure_default_ltx2_model,
            "wan": ensure_default_wan_model}[family]()


def _rank(rank: int, port: int, folder: str, family: str, weights: str, offload: tuple, inbox, outbox) -> None:
    """One rank: started, then (each step once this test has read the memory before it) loaded, then one generation."""
    import traceback

    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        import torch

        from cp_infer import ParallelConfig, init_parallel
        from cp_infer.request import resolve_request
        from cp_infer.sampler import sample
        from models.registry import open_model

        torch.set_num_threads(1)
        state = init_parallel(ParallelConfig(backend="gloo", device="cpu", timeout_s=600), rank=rank, world_size=2,
                              local_rank=rank)
        # The interpreter's own first-use costs (lazy imports, kernels, tokenizers) are no part of the weights: paid
        # before the measure, by the embedded default of the family (tensors of a few KiB, which leave glibc's mmap
        # threshold where it starts).
        warm = open_model(_tiny(family), dtype="fp32", state=state, weights="replicated")
        sample(warm, resolve_request(_request(family), warm.options), state=state)
        del warm
        gc.collect()
        ctypes.CDLL(None).malloc_trim(0)  # what it freed back to the OS: the measure starts from what the rank holds
        outbox.put((rank, "started"))
        inbox.get()
        model = open_model(folder, dtype="fp32", state=state, weights=weights, offload=offload)
        outbox.put((rank, "loaded"))
        inbox.get()
        sample(model, resolve_request(_request(family), model.options), state=state)
        outbox.put((rank, "generated"))
    except BaseException:
        outbox.put((rank, "error: " + traceback.format_exc()))
    inbox.get()


def _private(pid: int) -> int:
    """Private bytes of ``pid``: its anonymous pages and its private file pages (``smaps_rollup``)."""
    total = 0
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                total += int(line.split()[1]) * 1024
    return total


def measure_ranks(folder: str, family: str, weights: str, offload: tuple = ()) -> list[dict[str, int]]:
    """Per rank: its private bytes before the load (``base``) and the peak ``load`` and ``generate`` above it."""
    from server.cli.launch import free_port

    ctx = fork_context()  # the ranks: fresh processes, forked from one that has imported torch and the engine
    outbox = ctx.Queue()
    inboxes = [ctx.Queue() for _ in range(2)]
    port = free_port()
    procs = [fork_process(_rank, r, port, folder, family, weights, offload, inboxes[r], outbox) for r in range(2)]
    for p in procs:
        p.start()
    phase = ["started", "started"]
    peaks: list[dict[str, int]] = [{}, {}]
    stop = threading.Event()

    def sample_memory() -> None:
        while not stop.is_set():
            for r, p in enumerate(procs):
                try:
                    now = _private(p.pid)
                except (OSError, ValueError):
                    continue
                peaks[r][phase[r]] = max(peaks[r].get(phase[r], 0), now)
            time.sleep(0.005)

    def wait(step: str) -> None:
        for _ in procs:
            rank, said = outbox.get(timeout=600)
            if said != step:
                pytest.fail(f"rank {rank} of {family} ({weights}): {said}")

    sampler = threading.Thread(target=sample_memory, daemon=True)
    try:
        wait("started")
        base = [_private(p.pid) for p in procs]  # each rank waits for this test to read it
        sampler.start()
        phase[:] = ["load", "load"]
        for inbox in inboxes:
            inbox.put("go")
        wait("loaded")
        phase[:] = ["generate", "generate"]
        for inbox in inboxes:
            inbox.put("go")
        wait("generated")
    finally:
        stop.set()
        for inbox in inboxes:
            inbox.put("exit")
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [{"base": base[r], **{k: peaks[r].get(k, 0) - base[r] for k in ("load", "generate")}} for r in range(2)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded-memory")

    def folder(family: str):
        if not (root / family).is_dir():
            _write(family, root / family)
        return root / family

    return folder


def _assert_within(ranks, components, family: str, plan, what: str) -> None:
    """Each rank's peaks within the plan's (and the margin); its load at least its shards, which are its own pages
    (the other components are pages of the files both ranks map)."""
    from cp_infer.placement import format_bytes

    planned = plan.peak_device_bytes + plan.host_bytes
    for rank, held in enumerate(ranks):
        shards = sum(c.shard_nbytes(2, rank) for c in components if c.shardable)
        assert held["load"] >= 0.9 * shards, (
            f"{family} {what}: rank {rank}'s load added {format_bytes(held['load'])} of private memory, less than its "
            f"shards' {format_bytes(shards)}: the measure misses them")
        for phase in ("load", "generate"):
            assert held[phase] <= planned + MARGIN, (
                f"{family} {what}: rank {rank} held {format_bytes(held[phase])} of private memory above its "
                f"{format_bytes(held['base'])} before the load, {phase}; the plan's peak is {format_bytes(planned)}")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_sharded_rank_holds_its_half_and_two_blocks(folders, family):
    from cp_infer.placement import plan_memory
    from models.common.placement import model_components

    folder = folders(family)
    components = model_components(folder, dtype="fp32")
    plan = plan_memory(components, ranks=2, sharded=True)
    assert plan.peak_device_bytes < 0.8 * sum(c.nbytes for c in components), "the folder's weights shard too little"
    _assert_within(measure_ranks(str(folder), family, "sharded"), components, family, plan, "sharded")


def test_offload_on_the_cpu_moves_nothing(folders):
    """``--offload`` on the CPU: the offload device is the device, so the offloaded components' bytes move from the
    plan's device column to its CPU column and nowhere in memory: a sharded rank with everything offloaded holds what
    one without holds (its peak within the same plan), no more, no less than its shards and what it gathers."""
    from cp_infer.placement import OFFLOAD_COMPONENTS, plan_memory
    from models.common.placement import model_components

    folder = folders("ltx-video")
    components = model_components(folder, dtype="fp32")
    plain = plan_memory(components, ranks=2, sharded=True)
    offloaded = plan_memory(components, ranks=2, sharded=True, offload=OFFLOAD_COMPONENTS)
    assert offloaded.device_bytes == 0 and offloaded.host_bytes == plain.device_bytes
    assert offloaded.peak_device_bytes + offloaded.host_bytes == plain.peak_device_bytes
    _assert_within(measure_ranks(str(folder), "ltx-video", "sharded", OFFLOAD_COMPONENTS), components, "ltx-video",
                   offloaded, "sharded, everything offloaded")
