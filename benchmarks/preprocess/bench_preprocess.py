"""Media preprocessing on one CPU core: msaserve.preprocess against the usual ways.

Images: 50 deterministic photo-like JPEGs (25 at 12 MP, 25 at 1.2–3.7 MP) through our pipeline
and through transformers' Qwen2-VL image processor (the PIL one: the fast one needs
torchvision), both from the JPEG bytes to patches at the same target size (min/max pixels), with
the outputs compared. Video: 720p H.264 clips sampled at 2 fps by our keyframe-seeking sampler and
by decoding every frame (converting only the sampled ones), outputs compared: a 20 s clip with
2-s keyframe spacing, the same with libx264's default (250 frames), and a 300 s clip (the 20 s one
looped, remuxed) where the 64-frame cap spreads samples 4.7 s apart.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/preprocess/bench_preprocess.py [--quick]

Prints a table last; writes benchmarks/results/preprocess.json.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before numpy / torch load their thread pools

import argparse
import io
import json
import platform
import statistics
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path

import av
import numpy as np
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from msaserve.preprocess.config import PreprocessConfig
from msaserve.preprocess.patchify import normalise_table, patchify, smart_resize
from msaserve.preprocess.pipeline import Preprocessor
from msaserve.preprocess.video import sample_times

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "preprocess.json"
COMMAND = "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/preprocess/bench_preprocess.py"
SMALL_SIZES = [(1280, 960), (1920, 1080), (2048, 1536), (2560, 1440), (1080, 1920)]
LARGE_SIZES = [(4032, 3024), (3024, 4032), (4000, 3000)]


# ---- inputs -------------------------------------------------------------------------------------


def photo(width: int, height: int, seed: int) -> np.ndarray:
    """[H, W, 3] uint8: smooth colour regions, edges, texture and sensor-like noise."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (height // 96 + 2, width // 96 + 2, 3), dtype=np.uint8)
    base = np.asarray(Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC), np.int16)
    blocks = rng.integers(0, 256, (height // 24 + 1, width // 24 + 1), dtype=np.uint8)
    edges = np.asarray(Image.fromarray(blocks).resize((width, height), Image.Resampling.NEAREST), np.int16)
    texture = rng.integers(0, 256, (height // 3 + 1, width // 3 + 1), dtype=np.uint8)
    fine = np.asarray(Image.fromarray(texture).resize((width, height), Image.Resampling.BILINEAR), np.int16)
    noise = rng.normal(0, 3, (height, width, 1)).astype(np.int16)
    mixed = base + (edges[..., None] - 128) // 6 + (fine[..., None] - 128) // 8 + noise
    return np.clip(mixed, 0, 255).astype(np.uint8)


def make_images(count: int) -> list[tuple[str, bytes]]:
    images = []
    for i in range(count):
        large = i % 2 == 0
        sizes = LARGE_SIZES if large else SMALL_SIZES
        width, height = sizes[(i // 2) % len(sizes)]
        buffer = io.BytesIO()
        Image.fromarray(photo(width, height, seed=i)).save(buffer, "JPEG", quality=90)
        images.append(("12MP" if large else "1-4MP", buffer.getvalue()))
    return images


def make_720p(seconds: int, fps: int, keyframe_interval: int | None) -> bytes:
    """A panning, textured 720p H.264 clip (libx264 veryfast, yuv420p); keyframe_interval None =
    libx264's default (250 frames)."""
    scene = photo(1280 + 8 * seconds * fps, 720, seed=99)
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = 1280, 720, "yuv420p"
        stream.options = {"preset": "veryfast", "crf": "23"}
        if keyframe_interval:
            stream.codec_context.gop_size = keyframe_interval
        rng = np.random.default_rng(5)
        for i in range(seconds * fps):
            frame = scene[:, 8 * i : 8 * i + 1280].copy()
            frame[100 + (i * 3) % 400 : 200 + (i * 3) % 400, 300:500] = rng.integers(
                0, 256, 3
            )  # a moving box
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def loop_clip(data: bytes, repeats: int) -> bytes:
    """The clip `repeats` times in a row, remuxed without re-encoding (each copy starts with a
    keyframe): a long video for the price of a short encode."""
    out = io.BytesIO()
    with av.open(io.BytesIO(data)) as source, av.open(out, "w", format="mp4") as target:
        src = source.streams.video[0]
        dst = target.add_stream_from_template(src)
        packets = [p for p in source.demux(src) if p.dts is not None]
        for k in range(repeats):
            for p in packets:
                copy = av.Packet(bytes(p))
                copy.pts, copy.dts = p.pts + k * src.duration, p.dts + k * src.duration
                copy.time_base, copy.duration, copy.is_keyframe = p.time_base, p.duration, p.is_keyframe
                copy.stream = dst
                target.mux(copy)
    return out.getvalue()


# ---- the two sides ------------------------------------------------------------------------------


def transformers_image(processor: Qwen2VLImageProcessorPil, data: bytes) -> tuple[np.ndarray, tuple]:
    image = Image.open(io.BytesIO(data)).convert("RGB")
    out = processor(image, return_tensors="np")
    return out["pixel_values"], tuple(int(v) for v in out["image_grid_thw"][0])


def decode_every_frame(data: bytes, config: PreprocessConfig) -> tuple[np.ndarray, tuple]:
    """The baseline: decode every frame in order; convert the one at or after each sample time."""
    table = normalise_table(config)
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        stream.codec_context.thread_count = config.video_decoder_threads  # as ours: one core
        duration = float(stream.duration * stream.time_base)
        start = float(stream.start_time * stream.time_base) if stream.start_time else 0.0
        height, width = smart_resize(
            stream.height, stream.width, config.factor, config.video_min_pixels, config.video_max_pixels
        )
        times = sample_times(start, duration, config)
        half_frame = 0.5 / float(stream.average_rate)
        frames, next_time = [], iter(times)
        target = next(next_time)
        for frame in container.decode(stream):
            while target is not None and frame.time >= target - half_frame:
                frames.append(
                    frame.to_ndarray(width=width, height=height, format="rgb24", interpolation="BICUBIC")
                )
                target = next(next_time, None)
    return patchify(np.stack(frames), config, table)


def timed(fn, rounds: int) -> tuple[float, object]:
    """Median CPU time (all threads of this process, pinned to one core) of `rounds` calls, and
    the last result. CPU time, not wall time: the machine is shared, and CPU seconds are what
    "per core" means; on an idle core the two agree."""
    times, result = [], None
    for _ in range(rounds):
        started = time.process_time()
        result = fn()
        times.append(time.process_time() - started)
    return statistics.median(times), result


# ---- measurements -------------------------------------------------------------------------------


def bench_images(count: int, rounds: int) -> dict:
    images = make_images(count)
    exact_cfg = PreprocessConfig(fast_jpeg_downscale=False)
    sides = {
        "msaserve": Preprocessor(PreprocessConfig()),
        "msaserve-exact": Preprocessor(exact_cfg),
    }
    processor = Qwen2VLImageProcessorPil(min_pixels=exact_cfg.min_pixels, max_pixels=exact_cfg.max_pixels)
    for _, data in images[:4]:  # warm-up
        transformers_image(processor, data)
        for pre in sides.values():
            pre.process_media(data, "image")
    per_class: dict[str, dict[str, float]] = {}
    diffs: dict[str, list[float]] = {name: [] for name in sides}
    for group in ("12MP", "1-4MP"):
        subset = [data for g, data in images if g == group]
        row = {}
        row["transformers"], reference = timed(
            lambda s=subset: [transformers_image(processor, d) for d in s], rounds
        )
        for name, pre in sides.items():
            row[name], ours = timed(lambda s=subset, p=pre: [p.process_media(d, "image") for d in s], rounds)
            for (ref_patches, ref_grid), item in zip(reference, ours, strict=True):
                assert item.grid_thw == ref_grid, f"grid {item.grid_thw} != transformers {ref_grid}"
                diffs[name].append(float(np.abs(item.patches - ref_patches).mean()))
                diffs[name + "/max"] = [
                    *diffs.get(name + "/max", []),
                    float(np.abs(item.patches - ref_patches).max()),
                ]
        per_class[group] = {k: len(subset) / v for k, v in row.items()}  # images/s
    totals = {
        name: count / sum(count / 2 / per_class[g][name] for g in per_class) for name in per_class["12MP"]
    }
    return {"per_class": per_class, "total": totals, "diffs": diffs, "count": count}


def bench_video(seconds: int, rounds: int) -> dict:
    config = PreprocessConfig()  # 2 fps, ≤ 64 frames, frames ≤ 768·28·28 pixels
    pre = Preprocessor(config)
    results = {}
    gop_2s = make_720p(seconds, 30, 60)
    clips = {
        f"{seconds} s, gop 2 s": (gop_2s, seconds),
        f"{seconds} s, x264 gop 250": (make_720p(seconds, 30, None), seconds),
        # Longer than video_max_frames / fps = 32 s: 64 samples spread wider than a GOP, so seeks pay.
        f"{seconds * 15} s, gop 2 s": (loop_clip(gop_2s, 15), seconds * 15),
    }
    for label, (data, clip_seconds) in clips.items():
        pre.process_media(data, "video")  # warm-up
        decode_every_frame(data, config)
        ours_s, item = timed(lambda d=data: pre.process_media(d, "video"), rounds)
        base_s, (base_patches, base_grid) = timed(lambda d=data: decode_every_frame(d, config), rounds)
        assert item.grid_thw == base_grid, f"grid {item.grid_thw} != baseline {base_grid}"
        results[label] = {
            "ours_realtime": clip_seconds / ours_s,
            "baseline_realtime": clip_seconds / base_s,
            "max_abs_diff": float(np.abs(item.patches - base_patches).max()),
            "frames": item.num_frames,
            "grid": item.grid_thw,
        }
    return results


# ---- report -------------------------------------------------------------------------------------


def git_revision() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def hardware() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
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
    total = images["total"]
    rows = list(video.values())
    gop2, long_clip = rows[0], rows[2]
    entries = {
        "preprocess.image_speedup_vs_transformers": total["msaserve"] / total["transformers"],
        "preprocess.image_speedup_vs_transformers_exact": total["msaserve-exact"] / total["transformers"],
        "preprocess.images_per_second_per_core": total["msaserve"],
        "preprocess.transformers_images_per_second_per_core": total["transformers"],
        "preprocess.video_realtime_factor": gop2["ours_realtime"],
        "preprocess.video_realtime_factor_decode_all": gop2["baseline_realtime"],
        "preprocess.video_realtime_factor_long": long_clip["ours_realtime"],
        "preprocess.video_realtime_factor_long_decode_all": long_clip["baseline_realtime"],
    }
    units = {"speedup": "x", "per_second": "images/s", "realtime": "video s / CPU s"}
    out = {}
    for name, value in entries.items():
        unit = next(u for key, u in units.items() if key in name)
        out[name] = {"value": round(value, 3), "unit": unit, **common}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    return out


def print_table(images: dict, video: dict) -> None:
    print(
        f"\nImages ({images['count']} JPEGs, 1 core): images per CPU second; "
        "speedup vs transformers' Qwen2VLImageProcessorPil"
    )
    print(f"{'class':8} {'transformers':>13} {'msaserve':>10} {'speedup':>8} {'exact':>8} {'speedup':>8}")
    for group, row in [*images["per_class"].items(), ("all", images["total"])]:
        t, ours, exact = row["transformers"], row["msaserve"], row["msaserve-exact"]
        print(f"{group:8} {t:13.2f} {ours:10.2f} {ours / t:7.2f}x {exact:8.2f} {exact / t:7.2f}x")
    d = images["diffs"]
    print(
        f"outputs vs transformers (normalised units): exact mean|Δ| ≤ {max(d['msaserve-exact']):.2e}, "
        f"max|Δ| ≤ {max(d['msaserve-exact/max']):.2e}; default mean|Δ| ≤ {max(d['msaserve']):.4f}, "
        f"max|Δ| ≤ {max(d['msaserve/max']):.3f}"
    )
    print("\nVideo (720p H.264, 30 fps, 2 fps up to 64 frames, 1 core): seconds of video per CPU second")
    print(f"{'clip':24} {'decode-all':>11} {'msaserve':>9} {'ratio':>7} {'frames':>7} {'max|Δ|':>8}")
    for label, row in video.items():
        ratio = row["ours_realtime"] / row["baseline_realtime"]
        print(
            f"{label:24} {row['baseline_realtime']:11.2f} {row['ours_realtime']:9.2f} {ratio:6.2f}x "
            f"{row['frames']:7d} {row['max_abs_diff']:8.1e}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=50)
    parser.add_argument("--video-seconds", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="10 images, 6 s of video, 1 round (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.images, args.video_seconds, args.rounds = 10, 6, 1
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core, as one preprocess replica
    torch.set_num_threads(1)
    images = bench_images(args.images, args.rounds)
    video = bench_video(args.video_seconds, args.rounds)
    command = COMMAND + (" --quick" if args.quick else "")
    results = write_results(images, video, command)
    for name, entry in results.items():
        print(f"{name} = {entry['value']} {entry['unit']}")
    print_table(images, video)


if __name__ == "__main__":
    main()
