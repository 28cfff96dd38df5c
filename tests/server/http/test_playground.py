"""The playground page (``GET /``) in headless Chromium against the real 2-rank server with an API key.

Debian's ``chromium`` and ``chromium-driver`` are required (``.ci/run`` installs them): without them every test
fails, it does not skip. The tests share one server and one browser tab, so the key asked for by the first test is
kept (``sessionStorage``) for the rest. Slow jobs come from conftest's fault markers: ``[slow]`` sleeps 0.25 s per
step on rank 0, ``[slow-decode]`` 1 s after each decoded piece (a 65-frame video arrives in 4 pieces), so a job is
long enough to see its progress, watch its video play before it completes, and cancel it. Every wait polls a
condition with a deadline; none of them decides anything by time alone.
"""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from ..conftest import API_KEY, REPO

pytestmark = pytest.mark.timeout(240)

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
ADAPTER = "playground"
"""The adapter this module places in the shared server's folder (the LoRA tests place theirs under other names)."""
SMALL = {"num_frames": "9", "width": "96", "height": "64", "num_inference_steps": "2"}


@pytest.fixture(scope="module")
def server(api_server, cache_dir):
    """The session's API server (``api_server``: 2 ranks, a key, conftest's faults), with an adapter of this
    module's own name in its adapter folder (a server reads the folder per request)."""
    from models.ltx_video.default import ensure_default_model
    from models.ltx_video.loading import load_ltx_video

    from ...lora_adapters import LTX_VIDEO_A, make_adapter

    make_adapter(load_ltx_video(ensure_default_model(cache_dir)), api_server.lora_dir / f"{ADAPTER}.safetensors",
                 seed=1, targets=LTX_VIDEO_A)
    return api_server


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.fail(f"{CHROMIUM} and {CHROMEDRIVER} are needed: apt-get install chromium chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--mute-audio",
                "--autoplay-policy=no-user-gesture-required", "--window-size=1280,800"):
        options.add_argument(arg)
    # Debian's driver, named explicitly: selenium-manager must not look for (or download) one.
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    downloads = tmp_path_factory.mktemp("downloads")
    driver.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)})
    driver.downloads = downloads
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(condition, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def js(driver, script: str, *args):
    return driver.execute_script(script, *args)


def by_id(driver, element_id: str):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, element_id)


def visible(driver, element_id: str) -> bool:
    return js(driver, "const e = document.getElementById(arguments[0]); return !!e && !e.hidden && "
                      "e.getClientRects().length > 0;", element_id)


def open_page(driver, server) -> None:
    """Load the page; give the key if it asks (only the first time: the tab keeps it)."""
    driver.get(server.url + "/")
    wait_for(lambda: visible(driver, "key-panel") or by_id(driver, "generate").is_enabled(), 30, "the page to load")
    if visible(driver, "key-panel"):
        by_id(driver, "api-key").send_keys(API_KEY)
        by_id(driver, "key-save").click()
    wait_for(lambda: by_id(driver, "generate").is_enabled(), 30, "the model's options")


def fill(driver, prompt: str, **values: str) -> None:
    js(driver, "document.getElementById('reset').click(); document.getElementById('image').value = '';")
    field = by_id(driver, "prompt")
    field.clear()
    field.send_keys(prompt)
    for name, value in values.items():
        js(driver, "const e = document.getElementById(arguments[0]); e.value = arguments[1]; "
                   "e.dispatchEvent(new Event('input'));", f"opt-{name}", value)


def current(driver) -> dict:
    return js(driver, "const c = document.getElementById('current'); const v = document.getElementById('player');"
                      "return {id: c.dataset.job || null, status: c.dataset.status || null, "
                      "progress: document.getElementById('progress').value, time: v.currentTime, "
                      "text: document.getElementById('status').textContent};")


def submit(driver) -> str:
    before = current(driver)["id"]
    by_id(driver, "generate").click()
    return wait_for(lambda: (c := current(driver))["id"] != before and c["id"], 30, "the job id")


def history_item(driver, job_id: str):
    from selenium.webdriver.common.by import By

    found = driver.find_elements(By.CSS_SELECTOR, f"#jobs li[data-id='{job_id}']")
    return found[0] if found else None


def test_page_loads_asks_for_the_key_once_and_shows_the_models_options(server, browser):
    anonymous = httpx.get(server.url + "/", timeout=10)
    assert anonymous.status_code == 200 and "text/html" in anonymous.headers["content-type"]
    assert "default-src 'self'" in anonymous.headers["content-security-policy"]
    assert httpx.get(server.url + "/playground/options", timeout=10).status_code == 401  # the data needs the key

    browser.get(server.url + "/")
    wait_for(lambda: visible(browser, "key-panel"), 30, "the page to ask for the key")
    assert "invalid_api_key" in by_id(browser, "error").text  # the API's own 401, as it returned it
    by_id(browser, "api-key").send_keys("not-the-key-at-all")
    by_id(browser, "key-save").click()
    wait_for(lambda: "missing, wrong or revoked API key" in by_id(browser, "error").text, 10, "the 401 of a wrong key")
    assert not by_id(browser, "generate").is_enabled()
    by_id(browser, "api-key").send_keys(API_KEY)
    by_id(browser, "key-save").click()
    wait_for(lambda: by_id(browser, "generate").is_enabled(), 30, "the options once the key is right")
    assert not visible(browser, "key-panel") and not visible(browser, "error")

    # Every declared option is a field, with its default and this deployment's range.
    declared = server.client.get("/playground/options").json()["options"]
    names = {o["name"] for o in declared}
    assert {"num_frames", "num_inference_steps", "guidance_scale", "temporal_tile_size"} <= names
    fields = js(browser, "return [...document.querySelectorAll('[data-option]')].map(e => "
                         "[e.dataset.option, e.value, e.min ?? '', e.max ?? '']);")
    by_name = {name: (value, lo, hi) for name, value, lo, hi in fields}
    assert set(by_name) == names
    for option in declared:
        value, lo, hi = by_name[option["name"]]
        default = option["default"]
        if default is None or option["type"] == "string":
            assert value == (default or ""), option
        else:
            assert json.loads(value) == default, option
        if option["type"] in ("integer", "number") and option["maximum"] is not None:
            assert float(hi) == option["maximum"] and float(lo) == option["minimum"], option
    assert by_name["num_frames"][2] == "65"  # --max-frames 65, not the model's own range

    # The length hint counts windows as the server cuts them (80-frame tiles, 24 frames shared).
    fill(browser, "a lighthouse", num_frames="161")
    assert by_id(browser, "length-hint").get_attribute("data-windows") == "3"
    fill(browser, "a lighthouse", num_frames="65")
    assert by_id(browser, "length-hint").get_attribute("data-windows") == "1"
    # A Wan model's tiles are 4k+1 frames (window_tile_causal): the page counts as models.wan.options does.
    from models.wan.options import wan_options, wan_windows_of

    assert wan_options().window_tile_causal and not server.client.get("/playground/options").json()[
        "window_tile_causal"]
    js(browser, "state.model.temporal_compression = 4; state.model.window_tile_causal = true;")
    for frames, tile, overlap in (("81", "81", "20"), ("161", "81", "20"), ("161", "41", "8")):
        fill(browser, "a lighthouse", num_frames=frames, temporal_tile_size=tile, temporal_overlap=overlap)
        windows = wan_windows_of({"num_frames": int(frames), "temporal_tile_size": int(tile),
                                  "temporal_overlap": int(overlap)})
        want = 1 if windows is None else len(windows)
        assert by_id(browser, "length-hint").get_attribute("data-windows") == str(want), (frames, tile, overlap)
    assert want > 3
    # An image-to-video folder's windows chain on one latent frame: it declares no temporal_overlap.
    js(browser, "document.querySelector('[data-option=\"temporal_overlap\"]').remove();")
    fill(browser, "a lighthouse", num_frames="161", temporal_tile_size="41")
    chained = wan_windows_of({"num_frames": 161, "temporal_tile_size": 41})
    assert by_id(browser, "length-hint").get_attribute("data-windows") == str(len(chained)) == "4"

    # Once given, the key is not asked for again; nothing came from another origin.
    browser.refresh()
    wait_for(lambda: by_id(browser, "generate").is_enabled(), 30, "the reloaded page")
    assert not visible(browser, "key-panel")
    urls = js(browser, "return performance.getEntriesByType('resource').map(e => e.name);")
    assert urls and all(u.startswith(server.url + "/") for u in urls), urls


def test_a_prompt_shows_progress_and_plays_before_it_completes(server, browser):
    open_page(browser, server)
    fill(browser, "[slow] [slow-decode] a kite over a windy beach", num_frames="65", width="96", height="64",
         num_inference_steps="8")
    job_id = submit(browser)

    # The progress bar moves with the job's events (0.25 s per step: 8 steps take 2 s).
    wait_for(lambda: (c := current(browser))["status"] == "in_progress" and 0 < c["progress"] < 100, 30,
             "a progress between 0 and 100")
    # The video plays from the stream while the job is still being made: its clock advances, and only then is the
    # job's own record read (so what the record says held when the clock had already moved).
    first = wait_for(lambda: (t := current(browser)["time"]) > 0 and t, 60, "the video to start playing")
    later = wait_for(lambda: (t := current(browser)["time"]) > first and t, 10, "the video's time to advance")
    record = server.client.get(f"/v1/videos/{job_id}").json()
    assert record["status"] == "in_progress" and record["progress"] < 100, (first, later, record)

    wait_for(lambda: current(browser)["status"] == "completed", 90, "the job to complete on the page")
    assert js(browser, "return document.getElementById('progress').value;") == 100
    assert server.client.get(f"/v1/videos/{job_id}").json()["status"] == "completed"

    # History: a thumbnail that decoded, and a download that is the stored MP4.
    wait_for(lambda: (li := history_item(browser, job_id)) and js(
        browser, "return arguments[0].querySelector('img.thumb').naturalWidth;", li) > 0, 30, "the thumbnail")
    history_item(browser, job_id).find_element("css selector", "button.download").click()
    target = browser.downloads / f"{job_id}.mp4"
    stored = server.client.get(f"/v1/videos/{job_id}/content").content
    wait_for(lambda: target.is_file() and target.read_bytes() == stored, 30, "the downloaded MP4")


def timeline(driver) -> list[tuple[str, str]]:
    return js(driver, "return [...document.querySelectorAll('#timeline li')].map(l => [l.dataset.state, "
                      "l.textContent]);")


def test_what_people_set_first_is_shown_and_the_rest_folds_under_advanced(server, browser):
    open_page(browser, server)
    for name in ("prompt", "image", "opt-num_frames", "opt-frame_rate", "opt-height", "opt-width",
                 "opt-num_inference_steps", "opt-guidance_scale", "seed", f"lora-{ADAPTER}", "live", "generate"):
        assert visible(browser, name), name
    assert not js(browser, "return document.getElementById('advanced').open;")
    folded = js(browser, "return [...document.querySelectorAll('#advanced [data-option]')].map(e => "
                         "e.dataset.option);")
    assert {"temporal_tile_size", "decode_timestep", "cache"} <= set(folded)
    assert not js(browser, "return [...document.querySelectorAll('#advanced [data-option]')].some(e => "
                           "e.checkVisibility());")
    # An API error naming a folded option unfolds it.
    fill(browser, "a lighthouse", **SMALL, decode_timestep="2")
    by_id(browser, "generate").click()
    wait_for(lambda: by_id(browser, "error-param").text == "(param: decode_timestep)", 10, "the range error")
    field = by_id(browser, "opt-decode_timestep")
    assert js(browser, "return arguments[0].checkVisibility();", field) and "invalid" in field.get_attribute("class")
    js(browser, "document.getElementById('advanced').open = false;")


def test_a_live_video_is_directed_from_the_page(server, browser, tmp_path):
    """The director's panel: a live video's first two windows (33 frames in 32-frame windows sharing 24), then a
    direction typed in with an image chosen for it, a bad one (the API's error), and the end; the timeline shows each
    window's prompt and where it stands, and the window that starts from the image; the video plays while it is
    made; it is the one request of its directions (the image as conditions at frame 9, where window 2 starts), frame
    for frame."""
    from cp_infer.video_io import read_mp4

    cut = tmp_path / "cut.png"
    Image.fromarray(np.random.default_rng().integers(0, 256, (64, 96, 3), dtype=np.uint8)).save(cut)
    open_page(browser, server)
    fill(browser, "[slow] a red fox runs", **{**SMALL, "num_frames": "33", "num_inference_steps": "4"},
         temporal_tile_size="32", temporal_overlap="24")
    js(browser, "document.getElementById('live').checked = true;")
    job_id = submit(browser)
    wait_for(lambda: visible(browser, "director") and len(timeline(browser)) == 2, 30, "the first two windows")
    wait_for(lambda: [s for s, _ in timeline(browser)] == ["made", "made"], 60, "the first two windows made")
    assert "what happens next" in by_id(browser, "live-hint").text

    by_id(browser, "direction-windows").clear()
    by_id(browser, "direction-windows").send_keys("0")
    by_id(browser, "direction").send_keys("the fox jumps")
    by_id(browser, "direct").click()
    wait_for(lambda: visible(browser, "error"), 10, "the API's error")
    assert by_id(browser, "error-param").text == "(param: windows)"

    by_id(browser, "direction-windows").clear()
    by_id(browser, "direction-windows").send_keys("1")
    assert visible(browser, "direction-image-row")  # LTX-Video's windows each take an image of their own
    by_id(browser, "direction-image").send_keys(str(cut))
    by_id(browser, "direct").click()
    wait_for(lambda: len(timeline(browser)) == 3 and not visible(browser, "error"), 10, "the third window")
    assert timeline(browser)[2][1].startswith("the fox jumps [from an image]"), timeline(browser)
    assert by_id(browser, "direction").get_attribute("value") == by_id(browser, "direction-image").get_attribute(
        "value") == ""
    by_id(browser, "end-live").click()
    wait_for(lambda: current(browser)["status"] == "completed", 90, "the video to end")
    assert [s for s, _ in timeline(browser)] == ["made"] * 3
    assert not by_id(browser, "direct").is_enabled() and not by_id(browser, "end-live").is_enabled()
    wait_for(lambda: current(browser)["time"] > 0, 30, "the video to play")

    job = server.client.get(f"/v1/videos/{job_id}").json()
    assert job["num_frames"] == 41 and job["live"]["ended"] and job["live"]["windows_made"] == 3, job
    assert [(d["prompt"], d["image"]) for d in job["live"]["directions"]] == [("[slow] a red fox runs", False),
                                                                             ("the fox jumps", True)]
    whole = server.submit({
        "prompt": "[slow] a red fox runs", "num_frames": 41, "size": "96x64", "num_inference_steps": 4,
        "seed": job["seed"], "temporal_tile_size": 32, "temporal_overlap": 24,
        "conditions": [{"media": "data:image/png;base64," + base64.b64encode(cut.read_bytes()).decode(),
                        "frame_index": 9}],
        "prompt_segments": [{"start_window": 0, "end_window": 1, "text": "[slow] a red fox runs"},
                            {"start_window": 2, "end_window": 2, "text": "the fox jumps"}]})
    assert server.wait_job(whole["id"], timeout=120)["status"] == "completed", server.log_tail()
    for name in (job_id, whole["id"]):
        (tmp_path / f"{name}.mp4").write_bytes(server.client.get(f"/v1/videos/{name}/content").content)
    np.testing.assert_array_equal(read_mp4(tmp_path / f"{job_id}.mp4")[0],
                                  read_mp4(tmp_path / f"{whole['id']}.mp4")[0])


def test_image_to_video_from_an_uploaded_file(server, browser, tmp_path):
    open_page(browser, server)
    rng = np.random.default_rng()
    image = tmp_path / "first.png"
    Image.fromarray(rng.integers(0, 256, (64, 96, 3), dtype=np.uint8)).save(image)
    fill(browser, "a lantern on a lake at night", **SMALL)
    by_id(browser, "image").send_keys(str(image))
    job_id = submit(browser)
    wait_for(lambda: current(browser)["status"] in ("completed", "failed", "cancelled"), 90, "the job to end")
    record = server.client.get(f"/v1/videos/{job_id}").json()
    assert record["status"] == "completed" and record["input_reference"] is True, record
    assert record["prompt"] == "a lantern on a lake at night" and record["num_frames"] == 9
    wait_for(lambda: (li := history_item(browser, job_id)) and "from an image" in li.text, 10, "the history entry")


def test_an_adapter_is_applied_with_its_scale_and_a_bad_scale_is_the_apis_error(server, browser):
    open_page(browser, server)
    assert visible(browser, "loras") and by_id(browser, f"lora-{ADAPTER}").get_attribute("data-lora") == ADAPTER
    fill(browser, "a lighthouse", **SMALL)
    js(browser, f"document.getElementById('lora-{ADAPTER}').checked = true; "
                f"document.getElementById('lora-{ADAPTER}-scale').value = '9';")
    by_id(browser, "generate").click()
    wait_for(lambda: visible(browser, "error"), 30, "the API's error")
    assert "loras[0].scale" in by_id(browser, "error-param").text
    assert "invalid" in by_id(browser, "loras").get_attribute("class")

    js(browser, f"document.getElementById('lora-{ADAPTER}-scale').value = '0.75';")
    job_id = submit(browser)
    wait_for(lambda: current(browser)["status"] == "completed", 120, "the job with an adapter to complete")
    job = server.client.get(f"/v1/videos/{job_id}").json()
    assert job["loras"] == [{"name": ADAPTER, "scale": 0.75}]
    # Reset clears the choice: the next job runs the base weights.
    js(browser, "document.getElementById('reset').click();")
    assert not by_id(browser, f"lora-{ADAPTER}").is_selected()


def test_a_bad_value_shows_the_apis_error(server, browser):
    open_page(browser, server)
    jobs_before = server.client.get("/v1/videos", params={"limit": 100}).json()["data"]
    fill(browser, "a bad length", **{**SMALL, "num_frames": "40"})
    by_id(browser, "generate").click()
    wait_for(lambda: visible(browser, "error"), 10, "the error")
    expected = server.client.post("/v1/videos", json={"prompt": "a bad length", "num_frames": 40, "width": 96,
                                                      "height": 64, "num_inference_steps": 2}).json()["error"]
    assert by_id(browser, "error-message").text == expected["message"]
    assert by_id(browser, "error-code").text == f"{expected['code']}:"
    assert by_id(browser, "error-param").text == "(param: num_frames)"
    assert "invalid" in by_id(browser, "opt-num_frames").get_attribute("class")
    assert server.client.get("/v1/videos", params={"limit": 100}).json()["data"] == jobs_before  # nothing queued

    fill(browser, "a bad scale", **{**SMALL, "guidance_scale": "1000"})
    by_id(browser, "generate").click()
    wait_for(lambda: by_id(browser, "error-param").text == "(param: guidance_scale)", 10, "the range error")
    assert "guidance_scale" in by_id(browser, "error-message").text


def test_cancel_stops_the_job_and_delete_removes_it(server, browser):
    open_page(browser, server)
    fill(browser, "[slow] a bell tower at noon", **{**SMALL, "num_inference_steps": "40"})  # ~10 s of steps
    job_id = submit(browser)
    wait_for(lambda: (c := current(browser))["status"] == "in_progress" and c["progress"] > 0, 30, "progress")
    by_id(browser, "cancel").click()
    wait_for(lambda: current(browser)["status"] == "cancelled", 15, "the page to show the job cancelled")
    record = server.client.get(f"/v1/videos/{job_id}").json()
    assert record["status"] == "cancelled" and record["progress"] < 100, record
    assert not by_id(browser, "cancel").is_enabled() and by_id(browser, "generate").is_enabled()

    wait_for(lambda: (li := history_item(browser, job_id)) and li.get_attribute("data-status") == "cancelled", 10,
             "the cancelled job in the history")
    history_item(browser, job_id).find_element("css selector", "button.delete").click()
    wait_for(lambda: history_item(browser, job_id) is None, 30, "the deleted job to leave the history")
    assert server.client.get(f"/v1/videos/{job_id}").status_code == 404


_LAYOUT = """
const W = document.documentElement.clientWidth;
const problems = [];
const scrolled = document.documentElement.scrollWidth;
if (scrolled > W) problems.push(`page scrolls sideways: ${scrolled} > ${W}`);
const controls = 'button, input, select, textarea, label, video, progress, img, legend, h1, h2';
const els = [...document.querySelectorAll(controls)]
  .filter(e => e.getClientRects().length && getComputedStyle(e).visibility !== 'hidden');
const name = e => e.id ? `#${e.id}` : `${e.tagName.toLowerCase()}${e.htmlFor ? '[for=' + e.htmlFor + ']' : ''}` +
  `${e.className ? '.' + e.className : ''}${e.textContent ? ' "' + e.textContent.slice(0, 20) + '"' : ''}`;
const rects = els.map(e => [e, e.getBoundingClientRect()]);
for (const [e, r] of rects) {
  if (r.left < -0.5 || r.right > W + 0.5) problems.push(`${name(e)} is cut off: ${r.left}..${r.right} of ${W}`);
  if (['BUTTON', 'LABEL', 'LEGEND'].includes(e.tagName) && e.scrollWidth > e.clientWidth + 1)
    problems.push(`${name(e)}'s text is cut off: ${e.scrollWidth} > ${e.clientWidth}`);
}
for (let i = 0; i < rects.length; i++) for (let j = i + 1; j < rects.length; j++) {
  const [a, ra] = rects[i], [b, rb] = rects[j];
  if (a.contains(b) || b.contains(a)) continue;
  const w = Math.min(ra.right, rb.right) - Math.max(ra.left, rb.left);
  const h = Math.min(ra.bottom, rb.bottom) - Math.max(ra.top, rb.top);
  if (w > 1 && h > 1) problems.push(`${name(a)} overlaps ${name(b)} (${w.toFixed(0)}x${h.toFixed(0)} px)`);
}
return [els.length, problems];
"""


@pytest.mark.parametrize("width,height,mobile", [(1280, 800, False), (390, 844, True)])
def test_no_control_overlaps_or_is_cut_off(server, browser, tmp_path, width, height, mobile):
    if not server.client.get("/v1/videos", params={"limit": 1}).json()["data"]:
        server.wait_job(server.submit({"prompt": "a quiet harbour", "num_frames": 9, "size": "96x64",
                                       "num_inference_steps": 2})["id"])
    browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": width, "height": height, "deviceScaleFactor": 1, "mobile": mobile})
    try:
        open_page(browser, server)
        wait_for(lambda: js(browser, "return document.querySelectorAll('#jobs li').length;"), 30, "the history")
        wait_for(lambda: js(browser, "return [innerWidth, innerHeight];") == [width, height], 10, "the viewport")
        browser.save_screenshot(str(tmp_path / f"playground-{width}x{height}.png"))
        js(browser, "document.getElementById('advanced').open = true;")  # every option's field, unfolded
        js(browser, "document.getElementById('history').scrollIntoView();")
        browser.save_screenshot(str(tmp_path / f"playground-{width}x{height}-history.png"))
        count, problems = js(browser, _LAYOUT)
        assert count > 20 and not problems, "\n".join(problems)
    finally:
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


def test_without_a_key_the_page_and_its_options_need_none(tmp_path):
    # The in-process app on the test suite's stub engine: without --api-key nothing the page fetches asks for one.
    from fastapi.testclient import TestClient

    from server.http.app import AppConfig, create_app

    from .test_server_app import _stub

    with TestClient(create_app(AppConfig(), _stub(tmp_path))) as client:
        files = {"/": "index.html", "/playground/playground.js": "playground.js",
                 "/playground/playground.css": "playground.css"}
        for path, name in files.items():
            r = client.get(path)
            page = REPO / "server" / "http" / "playground" / name
            assert r.status_code == 200 and r.content == page.read_bytes(), path
        options = client.get("/playground/options")
        assert options.status_code == 200 and options.json()["options"], options.text
        assert client.post("/", json={}).status_code in (404, 405)  # only GET and HEAD of the files are served


@pytest.mark.parametrize("api_key", [None, "unit-test-key-0123456789"])
def test_the_site_icon_is_served_with_and_without_a_key(tmp_path, api_key):
    # Browsers ask for /favicon.ico on their own (no token): the page's icon, public as the page is.
    import io

    from fastapi.testclient import TestClient

    from server.http.app import AppConfig, create_app

    from .test_server_app import _stub

    with TestClient(create_app(AppConfig(api_key=api_key), _stub(tmp_path))) as client:
        r = client.get("/favicon.ico")
        assert r.status_code == 200 and r.headers["content-type"].startswith("image/"), r.headers
        assert r.content == (REPO / "server" / "http" / "playground" / "favicon.ico").read_bytes()
        icon = Image.open(io.BytesIO(r.content))
        assert icon.format == "ICO" and (32, 32) in icon.info["sizes"]
        assert client.head("/favicon.ico").status_code == 200
        page = client.get("/").text
        assert '<link rel="icon" href="/favicon.ico"' in page
        if api_key is not None:
            assert client.get("/v1/videos").status_code == 401  # the icon opened nothing else
