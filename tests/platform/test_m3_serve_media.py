"""A real `msaserve serve --model DIR` on a tiny MiniMax-M3 VL checkpoint answers the official
`openai` client with transformers' greedy text for a text prompt, an image and a video: the
Preprocess deployment picks M3's processor from the checkpoint, the gateway writes its placeholder
text, the engine merges the vision tower's rows. Expected: the checkpoint's chat template applied
by transformers' tokenizer, generate() of MiniMaxM3SparseForConditionalGeneration on the same
pixel values (equal to transformers' processors', tests/preprocess/test_m3_processor.py)."""

import base64
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import torch
from local_serve_app import free_port
from PIL import Image

from msaserve.platform.media import MEDIA_MARKER
from msaserve.preprocess.minimax_m3.processor import M3Preprocessor

for _folder in ("models", "preprocess"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / _folder))
from m3_checkpoint import write_m3_checkpoint  # noqa: E402
from preprocess_media import encode_image, make_video, photo_array  # noqa: E402

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

MSASERVE = str(Path(sys.executable).parent / "msaserve")
MAX_TOKENS = 16
IMAGE = encode_image(Image.fromarray(photo_array(112, 84, seed=3)), "PNG")
VIDEO = make_video(width=84, height=56, seconds=1.0, fps=10)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory, oracle = write_m3_checkpoint(tmp_path_factory.mktemp("m3") / "vl", vl=True, seed=2)
    port, dashboard = free_port(), free_port()
    log_path = directory.parent / "serve.log"
    log = open(log_path, "w")  # noqa: SIM115 (closed below; the process writes to it)
    repo = str(Path(__file__).parents[2])
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p),
    }
    process = subprocess.Popen(
        [MSASERVE, "serve", "--model", str(directory), "--port", str(port),
         "--dashboard-port", str(dashboard)],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while "Ready in" not in (text := log_path.read_text()):
            assert process.poll() is None and time.monotonic() < deadline, text[-3000:]
            time.sleep(0.5)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        yield client, directory, oracle
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def _data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


PARTS = {
    "text": None,
    "image": {"type": "image_url", "image_url": {"url": _data_url(IMAGE, "image/png")}},
    "video": {"type": "video_url", "video_url": {"url": _data_url(VIDEO, "video/mp4")}},
}


def _expected(directory: Path, oracle, kind: str) -> tuple[str, int]:
    """(transformers' greedy text, its prompt length in tokens)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    content = "What is this?" + MEDIA_MARKER
    media: dict[str, torch.Tensor] = {}
    if kind == "text":
        content = content.replace(MEDIA_MARKER, "")
    else:
        item = M3Preprocessor().process_media(IMAGE if kind == "image" else VIDEO, kind)
        content = content.replace(MEDIA_MARKER, item.placeholder_text)
        prefix = "pixel_values" if kind == "image" else "pixel_values_videos"
        media = {prefix: torch.from_numpy(item.patches), f"{kind}_grid_thw": torch.tensor(item.grids)}
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = oracle.generate(ids, attention_mask=torch.ones_like(ids), **media, max_new_tokens=MAX_TOKENS,
                              do_sample=False)  # fmt: skip
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True), ids.shape[1]


@pytest.mark.parametrize("kind", PARTS)
def test_greedy_text_equals_transformers(server, kind):
    client, directory, oracle = server
    content: list[dict] = [{"type": "text", "text": "What is this?"}]
    if PARTS[kind] is not None:
        content.append(PARTS[kind])
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=[{"role": "user", "content": content}],
        max_tokens=MAX_TOKENS, temperature=0.0,
    )  # fmt: skip
    text, prompt_tokens = _expected(directory, oracle, kind)
    assert reply.usage.prompt_tokens == prompt_tokens
    assert reply.choices[0].message.content == text and text
