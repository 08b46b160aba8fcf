"""MiniMax-M3's processors on one CPU core: msaserve.preprocess.minimax_m3 against transformers'.

Images: deterministic photo-like JPEGs and PNGs in three classes (12 MP, 1–4 MP, web-sized
0.3–0.8 MP), from the encoded bytes to patches: ours (`M3Preprocessor.process_media`) and
transformers' `MiniMaxM3VLImageProcessor` on the PIL image opened from the same bytes. Video: a
720p H.264 clip (30 fps) sampled at 2 fps, ours against transformers' PyAV reader (`load_video`,
which decodes every frame up to the last sampled one, as ours must to keep decode-order indices)
+ `MiniMaxM3VLVideoProcessor`. Every output is checked equal (patches bit for bit, grids, chunks)
before its time counts. CPU time of this process pinned to one core, median of `--rounds`.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python benchmarks/preprocess/bench_m3_processor.py [--quick]

Needs the torchvision oracle wheel in .oracle-site/ (`make setup`). Prints a table last; writes
benchmarks/results/preprocess_m3.json.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before numpy / torch load their thread pools

import argparse
import io
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from msaserve.preprocess.minimax_m3.config import M3ProcessorConfig
from msaserve.preprocess.minimax_m3.processor import M3Preprocessor

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from m3_oracle import processors  # noqa: E402  (before transformers: it enables torchvision)

RESULTS = ROOT / "benchmarks" / "results" / "preprocess_m3.json"
COMMAND = "OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python benchmarks/preprocess/bench_m3_processor.py"
IMAGE_CLASSES = {
    "12MP": [(4032, 3024), (3024, 4032), (4000, 3000)],
    "1-4MP": [(1280, 960), (1920, 1080), (2048, 1536), (1080, 1920)],
    "web": [(640, 480), (800, 600), (1024, 768), (500, 700)],
}


def photo(width: int, height: int, seed: int) -> np.ndarray:
    """[H, W, 3] uint8: smooth colour regions, edges, texture and sensor-like noise."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (height // 96 + 2, width // 96 + 2, 3), dtype=np.uint8)
    base = np.asarray(Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC), np.int16)
    texture = rng.integers(0, 256, (height // 3 + 1, width // 3 + 1), dtype=np.uint8)
    fine = np.asarray(Image.fromarray(texture).resize((width, height), Image.Resampling.BILINEAR), np.int16)
    noise = rng.normal(0, 3, (height, width, 1)).astype(np.int16)
    return np.clip(base + (fine[..., None] - 128) // 8 + noise, 0, 255).astype(np.uint8)


def make_images(per_class: int) -> dict[str, list[bytes]]:
    out: dict[str, list[bytes]] = {}
    for name, sizes in IMAGE_CLASSES.items():
        out[name] = []
        for i in range(per_class):
            width, height = sizes[i % len(sizes)]
            buffer = io.BytesIO()
            fmt = "PNG" if name == "web" and i % 2 else "JPEG"
            Image.fromarray(photo(width, height, seed=i)).save(
                buffer, fmt, **({"quality": 90} if fmt == "JPEG" else {})
            )
            out[name].append(buffer.getvalue())
    return out


def make_720p(seconds: int, fps: int = 30) -> bytes:
    import av

    scene = photo(1280 + 8 * seconds * fps, 720, seed=99)
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = 1280, 720, "yuv420p"
        stream.options = {"preset": "veryfast", "crf": "23"}
        for i in range(seconds * fps):
            frame = av.VideoFrame.from_ndarray(scene[:, 8 * i : 8 * i + 1280].copy(), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def timed(fn, rounds: int) -> tuple[float, object]:
    """Median CPU seconds of `rounds` calls (this process, one core) and the last result."""
    times, result = [], None
    for _ in range(rounds):
        started = time.process_time()
        result = fn()
        times.append(time.process_time() - started)
    return statistics.median(times), result


def bench_images(per_class: int, rounds: int) -> dict[str, dict[str, float]]:
    image_cls = processors()[0]
    reference = image_cls()
    ours = M3Preprocessor()
    rows = {}
    for name, images in make_images(per_class).items():

        def run_reference(images=images):
            return [reference(images=[Image.open(io.BytesIO(d))], return_tensors="np") for d in images]

        def run_ours(images=images):
            return [ours.process_media(d, "image") for d in images]

        run_reference(), run_ours()  # warm-up
        ref_s, ref_out = timed(run_reference, rounds)
        ours_s, ours_out = timed(run_ours, rounds)
        for r, item in zip(ref_out, ours_out, strict=True):
            assert [item.grid_thw] == [tuple(g) for g in r["image_grid_thw"].tolist()]
            assert np.array_equal(item.patches, r["pixel_values"]), "patches differ from transformers"
        rows[name] = {"transformers": len(images) / ref_s, "msaserve": len(images) / ours_s}
    return rows


def bench_video(seconds: int, rounds: int) -> dict[str, float]:
    _, video_cls, _, video_utils = processors()
    fps = 2.0
    reference = video_cls(do_sample_frames=False)  # frames come sampled from load_video
    ours = M3Preprocessor(M3ProcessorConfig(do_sample_frames=True, video_fps=fps))
    data = make_720p(seconds)
    with tempfile.NamedTemporaryFile(suffix=".mp4") as file:
        file.write(data)
        file.flush()
        sampler = partial(video_utils.default_sample_indices_fn, fps=fps)

        def run_reference():
            frames, metadata = video_utils.load_video(file.name, backend="pyav", sample_indices_fn=sampler)
            return reference(videos=[frames], video_metadata=[metadata], return_tensors="np")

        def run_ours():
            return ours.process_media(data, "video")

        run_reference(), run_ours()
        ref_s, ref_out = timed(run_reference, rounds)
        ours_s, item = timed(run_ours, rounds)
    assert item.grids == [tuple(g) for g in ref_out["video_grid_thw"].tolist()]
    assert np.array_equal(item.patches, ref_out["pixel_values_videos"]), "video patches differ"
    return {"transformers": seconds / ref_s, "msaserve": seconds / ours_s, "frames": item.num_frames}


def git_revision() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def hardware() -> str:
    cpu = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return (
        f"{cpu}, 1 core (sched_setaffinity), {platform.python_implementation()} {platform.python_version()}"
    )


def write_results(images: dict, video: dict, command: str) -> dict:
    common = {
        "command": command,
        "hardware": hardware(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "git_revision": git_revision(),
    }
    entries = {
        f"preprocess_m3.image_speedup_{name}": row["msaserve"] / row["transformers"]
        for name, row in images.items()
    }
    entries["preprocess_m3.video_speedup"] = video["msaserve"] / video["transformers"]
    entries["preprocess_m3.video_realtime_factor"] = video["msaserve"]
    out = {}
    for name, value in entries.items():
        unit = "video s / CPU s" if "realtime" in name else "x"
        out[name] = {"value": round(value, 3), "unit": unit, **common}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    return out


def print_table(images: dict, video: dict) -> None:
    print("\nM3 images, 1 core: images per CPU second (outputs equal bit for bit)")
    print(f"{'class':8} {'transformers':>13} {'msaserve':>10} {'speedup':>8}")
    for name, row in images.items():
        t, ours = row["transformers"], row["msaserve"]
        print(f"{name:8} {t:13.2f} {ours:10.2f} {ours / t:7.2f}x")
    print(
        f"\nM3 video (720p H.264, 30 fps, 2 fps sampled = {video['frames']} frames, 1 core): "
        "video s per CPU s"
    )
    t, ours = video["transformers"], video["msaserve"]
    print(f"{'clip':8} {t:13.2f} {ours:10.2f} {ours / t:7.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-class", type=int, default=8)
    parser.add_argument("--video-seconds", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="2 images a class, 3 s of video, 1 round")
    args = parser.parse_args()
    if args.quick:
        args.per_class, args.video_seconds, args.rounds = 2, 3, 1
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core, as one preprocess replica
    torch.set_num_threads(1)
    images = bench_images(args.per_class, args.rounds)
    video = bench_video(args.video_seconds, args.rounds)
    results = write_results(images, video, COMMAND + (" --quick" if args.quick else ""))
    for name, entry in results.items():
        print(f"{name} = {entry['value']} {entry['unit']}")
    print_table(images, video)


if __name__ == "__main__":
    main()
