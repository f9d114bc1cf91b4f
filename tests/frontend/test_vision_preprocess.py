"""Image and video preprocessing against transformers' Qwen3.5 processors (the oracle).

Images: for every kind of input (odd sizes, smaller than one patch, panoramic, greyscale, alpha, palette,
16-bit, animated GIF, CMYK, EXIF-rotated) our rows and grid must equal transformers' PIL-backend
processor bit for bit with ``backend="pil"``, and its torchvision-backend processor bit for bit with the
default backend where torchvision is installed (not in CI: there the default backend is held within two
uint8 levels of the PIL backend, the most the two bicubic implementations' rounding differs by).
Videos: decoding equals transformers' PyAV reader; rows, grid, sampled frames and timestamps equal its
Qwen3-VL video processor where torchvision is installed; the row layout is checked against an
independent per-row reference and against the image path.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from ninfer_qwen3_5.frontend.vision import (
    DecodedVideo,
    ImagePreprocessConfig,
    VideoPreprocessConfig,
    load_image,
    load_video,
    preprocess_image,
    process_image,
    process_video,
)
from ninfer_qwen3_5.frontend.vision.pixels import patch_rows
from PIL import Image, ImageOps
from support.media import (
    encode,
    hf_composites_alpha,
    hf_image_processor,
    hf_video_processor,
    make_video,
    picture,
    white_composite,
)


def _rgb(w, h, seed=0):
    return Image.fromarray(picture(w, h, seed))


def _rgba(w, h):
    return Image.fromarray(picture(w, h, 1, channels=4), "RGBA")


def _palette(w, h, transparent):
    img = _rgb(w, h, 2).quantize(colors=64)
    if transparent:
        img.info["transparency"] = 5
    return img


def _animated_gif(w, h):
    frames = [_rgb(w, h, seed).quantize(colors=32) for seed in range(3)]
    return encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)


def _exif_rotated_jpeg(w, h):
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    return encode(_rgb(w, h, 3), "JPEG", quality=90, exif=exif.tobytes())


# name -> encoded bytes
IMAGES = {
    "odd_333x517_png": lambda: encode(_rgb(333, 517), "PNG"),
    "odd_517x333_jpeg": lambda: encode(_rgb(517, 333, 4), "JPEG", quality=85),
    "tiny_1x1": lambda: encode(_rgb(1, 1), "PNG"),
    "tiny_7x5_below_one_patch": lambda: encode(_rgb(7, 5), "PNG"),
    "tiny_15x40": lambda: encode(_rgb(15, 40), "PNG"),
    "panoramic_4000x64": lambda: encode(_rgb(4000, 64), "PNG"),
    "panoramic_4000x30": lambda: encode(_rgb(4000, 30), "PNG"),
    "tall_40x2000": lambda: encode(_rgb(40, 2000), "PNG"),
    "greyscale_L": lambda: encode(_rgb(301, 199).convert("L"), "PNG"),
    "greyscale_alpha_LA": lambda: encode(_rgba(120, 97).convert("LA"), "PNG"),
    "rgba": lambda: encode(_rgba(257, 190), "PNG"),
    "palette_P": lambda: encode(_palette(211, 150, False), "PNG"),
    "palette_P_transparent": lambda: encode(_palette(211, 150, True), "PNG"),
    "png_16bit_I16": lambda: encode(Image.fromarray(picture(180, 130, 5)[..., 0].astype(np.uint16) * 257 // 64),
                                    "PNG"),
    "animated_gif_first_frame": lambda: _animated_gif(97, 83),
    "webp": lambda: encode(_rgb(250, 160, 6), "WEBP", quality=80),
    "bmp": lambda: encode(_rgb(99, 101, 7), "BMP"),
    "cmyk_jpeg": lambda: encode(_rgb(140, 100, 8).convert("CMYK"), "JPEG", quality=90),
    "exif_rotated_jpeg": lambda: _exif_rotated_jpeg(160, 96),
}


def _oracle_input(data: bytes) -> Image.Image:
    """What the transformers processor is given: the decoded image, EXIF orientation applied (as its
    loaders do), in its own mode (the processor converts to RGB itself). A transformers that drops alpha
    instead of compositing onto white (older releases) is given the composite, so that everything after
    the RGB conversion is still compared; test_transparency_is_composited_onto_white checks that step."""
    img = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    transparent = "A" in img.getbands() or img.info.get("transparency") is not None
    return white_composite(img) if transparent and not hf_composites_alpha() else img


@pytest.mark.parametrize("name", IMAGES)
def test_image_rows_equal_transformers_pil_backend(name):
    data = IMAGES[name]()
    ours = preprocess_image(data, ImagePreprocessConfig(backend="pil"))
    ref = hf_image_processor("pil")(_oracle_input(data), return_tensors="pt")
    assert ours.grid_thw == tuple(ref["image_grid_thw"][0].tolist())
    assert ours.pixel_values.dtype == torch.float32 and ours.pixel_values.shape == ref["pixel_values"].shape
    assert torch.equal(ours.pixel_values, ref["pixel_values"])
    assert ours.num_tokens == ours.num_patches // 4 and ours.pixel_values.shape == (ours.num_patches, 1536)


@pytest.mark.parametrize("name", ["odd_333x517_png", "tiny_7x5_below_one_patch", "rgba", "png_16bit_I16",
                                  "exif_rotated_jpeg", "panoramic_4000x30"])
def test_default_backend_equals_transformers_torchvision_backend(name):
    proc = hf_image_processor("torchvision")  # skips without torchvision
    data = IMAGES[name]()
    ours = preprocess_image(data)
    ref = proc(_oracle_input(data), return_tensors="pt")
    assert ours.grid_thw == tuple(ref["image_grid_thw"][0].tolist())
    assert torch.equal(ours.pixel_values, ref["pixel_values"])


@pytest.mark.parametrize("name", ["odd_333x517_png", "tiny_7x5_below_one_patch", "rgba", "exif_rotated_jpeg"])
def test_default_backend_within_two_levels_of_pil_backend(name):
    data = IMAGES[name]()
    ours = preprocess_image(data)
    ref = hf_image_processor("pil")(_oracle_input(data), return_tensors="pt")
    assert ours.grid_thw == tuple(ref["image_grid_thw"][0].tolist())
    # one uint8 level is 1/255 before normalisation, 1/127.5 after (std 0.5)
    assert (ours.pixel_values - ref["pixel_values"]).abs().max().item() <= 2 / 127.5 + 1e-6


@pytest.mark.parametrize("backend", ["pil", "torchvision"])
def test_smaller_budgets_shrink_and_grow_like_transformers(backend):
    """The max-pixels (shrink) and min-pixels (grow) branches with budgets small enough to be cheap."""
    for size, budget in [((1200, 900), {"shortest_edge": 4096, "longest_edge": 200_000}),
                         ((90, 30), {"shortest_edge": 150_000, "longest_edge": 1_000_000})]:
        img = _rgb(*size, 9)
        cfg = ImagePreprocessConfig(min_pixels=budget["shortest_edge"], max_pixels=budget["longest_edge"],
                                    backend=backend)
        ours = process_image(img, cfg)
        ref = hf_image_processor(backend, size=budget)(img, return_tensors="pt")
        assert ours.grid_thw == tuple(ref["image_grid_thw"][0].tolist())
        assert torch.equal(ours.pixel_values, ref["pixel_values"])


def test_transparency_is_composited_onto_white():
    """Pixels by hand: fully transparent -> white, opaque -> itself, half -> the blend with white."""
    rgba = np.zeros((32, 32, 4), np.uint8)
    rgba[:, :16] = (200, 0, 0, 0)
    rgba[:, 16:] = (0, 100, 0, 255)
    rgba[:8] = (0, 0, 0, 128)
    cfg = ImagePreprocessConfig(min_pixels=32 * 32, backend="pil")  # keeps 32x32: no resize
    rows = process_image(Image.fromarray(rgba, "RGBA"), cfg).pixel_values.view(1, 1, 2, 2, 3, 2, 16, 16)
    # (window row, window col, row in window, col in window, channel, frame, y, x) -> picture [3, 32, 32]
    pic = rows[:, :, :, :, :, 0].permute(4, 0, 2, 5, 1, 3, 6).reshape(3, 32, 32) * 0.5 + 0.5
    level = (pic * 255).round()
    assert level[:, 8:, :16].eq(255).all()                                       # transparent red -> white
    assert level[:, 8:, 16:].eq(torch.tensor([0.0, 100, 0]).view(3, 1, 1)).all()   # opaque green
    assert level[:, :8].eq(127).all()   # black at alpha 128/255 over white: 255 * 127/255, rounded by Pillow


def test_animated_gif_gives_its_first_frame():
    data = _animated_gif(64, 64)
    first = Image.open(io.BytesIO(data)).convert("RGB")
    assert np.array_equal(np.asarray(load_image(data).convert("RGB")), np.asarray(first))


def test_patch_rows_follow_the_tower_layout():
    """Row r is the patch at (temporal group t, window (wy, wx), position (my, mx) in the window), its
    1536 values ordered channel, frame, pixel row, pixel column."""
    p, tp, m = 4, 2, 2
    frames = torch.randn(3, 3, 16, 24)  # 3 frames: the third is repeated to fill the second pair
    rows, (gt, gh, gw) = patch_rows(frames, p, tp, m)
    assert (gt, gh, gw) == (2, 4, 6) and rows.shape == (2 * 4 * 6, 3 * tp * p * p)
    padded = torch.cat([frames, frames[-1:]])
    for r in range(rows.shape[0]):
        t, within = divmod(r, gh * gw)
        window, pos = divmod(within, m * m)
        wy, wx = divmod(window, gw // m)
        my, mx = divmod(pos, m)
        y, x = (wy * m + my) * p, (wx * m + mx) * p
        expected = padded[t * tp:(t + 1) * tp, :, y:y + p, x:x + p].permute(1, 0, 2, 3).reshape(-1)
        assert torch.equal(rows[r], expected), r


def test_an_image_fills_its_temporal_pair_with_itself():
    rows = preprocess_image(IMAGES["odd_333x517_png"]()).pixel_values.view(-1, 3, 2, 16, 16)
    assert torch.equal(rows[:, :, 0], rows[:, :, 1])


def test_digest_identifies_the_rows():
    data = IMAGES["odd_333x517_png"]()
    a, b = preprocess_image(data), preprocess_image(data)
    assert a.digest == b.digest and len(a.digest) == 64
    changed = np.asarray(Image.open(io.BytesIO(data))).copy()
    changed[100, 100, 0] ^= 0x80
    assert preprocess_image(Image.fromarray(changed)).digest != a.digest
    assert preprocess_image(data, ImagePreprocessConfig(image_mean=(0.4, 0.5, 0.5))).digest != a.digest
    assert preprocess_image(data, ImagePreprocessConfig(backend="pil")).digest != a.digest


# --- videos -------------------------------------------------------------------------------------------------

VIDEOS = {  # name -> (width, height, frames, fps)
    "2s_at_10fps_odd_99x65": (99, 65, 20, 10),
    "odd_frame_count_25": (99, 65, 25, 10),
    "1s_at_30fps_640x360": (640, 360, 30, 30),
    "tiny_17x9_below_one_factor": (17, 9, 7, 5),
}


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    root = tmp_path_factory.mktemp("videos")
    paths = {}
    for name, (w, h, n, fps) in VIDEOS.items():
        paths[name] = root / f"{name}.mp4"
        paths[name].write_bytes(make_video(w, h, n, fps))
    return paths


def test_video_sampling_and_timestamps_2s_at_10fps(videos):
    """20 frames at 10 fps, 2 sampled per second: int(20 / 10 * 2) = 4 frames, linspace(0, 19, 4) rounded
    = 0, 6, 13, 19; two temporal pairs shown at (0 + 0.6) / 2 and (1.3 + 1.9) / 2 seconds."""
    video = process_video(load_video(videos["2s_at_10fps_odd_99x65"]))
    assert video.frame_indices == (0, 6, 13, 19) and video.fps == 10.0
    assert video.timestamps == pytest.approx((0.3, 1.6))
    assert video.grid_thw == (2, 4, 6) and video.tokens_per_frame == 6 and video.num_tokens == 12
    odd = process_video(load_video(videos["odd_frame_count_25"]))  # 5 frames: the last pair repeats frame 24
    assert odd.frame_indices == (0, 6, 12, 18, 24) and odd.grid_thw[0] == 3
    assert odd.timestamps == pytest.approx((0.3, 1.5, 2.4))


@pytest.mark.parametrize("name", VIDEOS)
def test_video_decoding_equals_transformers_pyav_reader(videos, name):
    from transformers.video_utils import load_video as hf_load_video

    ours = load_video(videos[name])
    frames, meta = hf_load_video(str(videos[name]), backend="pyav",
                                 sample_indices_fn=lambda metadata, **_: np.array(ours.frame_indices))
    assert ours.total_frames == meta.total_num_frames and ours.fps == meta.fps
    assert ours.frames.dtype == np.uint8 and np.array_equal(ours.frames, frames)


@pytest.mark.parametrize("name", VIDEOS)
def test_video_rows_equal_transformers_video_processor(videos, name):
    proc = hf_video_processor()  # skips without torchvision
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_utils import load_video as hf_load_video

    frames, meta = hf_load_video(str(videos[name]), backend="pyav")  # every frame: the processor samples
    kwargs = {"cap_pixels_per_frame": False} if "cap_pixels_per_frame" in proc.valid_kwargs.__annotations__ else {}
    ref = proc(videos=[frames], video_metadata=[meta], return_metadata=True, return_tensors="pt", **kwargs)
    ref_meta = ref["video_metadata"][0]
    ours = process_video(load_video(videos[name]))
    assert ours.frame_indices == tuple(int(i) for i in ref_meta.frames_indices)
    assert ours.grid_thw == tuple(ref["video_grid_thw"][0].tolist())
    assert torch.equal(ours.pixel_values, ref["pixel_values_videos"])
    expected_times = Qwen3VLProcessor._calculate_timestamps(None, ref_meta.frames_indices, ref_meta.fps, 2)
    assert [f"{t:.1f}" for t in ours.timestamps] == [f"{t:.1f}" for t in expected_times]


def test_still_video_rows_are_the_image_rows_twice():
    """Four copies of one picture, as decoded frames: the video budget gives the same size as the image
    rule here (333x517 -> 320x512 both ways), so each temporal pair equals the image's rows."""
    pic = picture(517, 333, 11)
    video = process_video(DecodedVideo(np.stack([pic] * 4), (0, 1, 2, 3), 4.0, 4))
    image = process_image(Image.fromarray(pic))
    assert video.grid_thw == (2, *image.grid_thw[1:])
    assert torch.equal(video.pixel_values, torch.cat([image.pixel_values, image.pixel_values]))


def test_webm_without_a_frame_count_is_counted(tmp_path):
    data = make_video(64, 48, 20, 10, codec="libvpx-vp9", pix_fmt="yuv420p", container="webm")
    import av

    with av.open(io.BytesIO(data)) as c:
        assert c.streams.video[0].frames == 0  # the case under test: the header does not say
    video = load_video(data)
    assert video.total_frames == 20 and video.frame_indices == (0, 6, 13, 19)
    assert video.frames.shape == (4, 48, 64, 3)


def test_video_config_changes_sampling():
    cfg = VideoPreprocessConfig(fps=5.0, max_frames=6)
    video = load_video(make_video(32, 32, 20, 10), cfg)
    assert video.frame_indices == tuple(int(i) for i in np.linspace(0, 19, 6).round())
