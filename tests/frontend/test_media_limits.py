"""Hostile and broken media: every limit of MediaLimits, decompression bombs, truncated, corrupt and
random files. Each case must end in a MediaError naming the problem (and the limit), or, where the
damage leaves a complete decodable file, in a complete result: never another exception, never a
partially decoded picture or video."""

from __future__ import annotations

import sys
import warnings

import numpy as np
import pytest
from ninfer_qwen3_5.frontend.errors import FrontendError
from ninfer_qwen3_5.frontend.vision import (
    MediaDecodeError,
    MediaError,
    MediaLimitError,
    MediaLimits,
    VisionDependencyError,
    load_image,
    load_video,
    preprocess_image,
    process_image,
)
from PIL import Image, ImageFile
from support.media import encode, make_video, picture, png_header_only

PICTURE = Image.fromarray(picture(61, 47))


def _flip_bits(data: bytes, rng: np.random.Generator) -> bytes:
    out = bytearray(data)
    for _ in range(int(rng.integers(1, 4))):
        pos = int(rng.integers(len(out)))
        out[pos] ^= 1 << int(rng.integers(8))
    return bytes(out)


# --- limits -------------------------------------------------------------------------------------------------

def test_limits_must_be_positive():
    with pytest.raises(ValueError, match="max_video_frames"):
        MediaLimits(max_video_frames=0)
    with pytest.raises(ValueError, match="max_image_bytes"):
        MediaLimits(max_image_bytes=True)


def test_encoded_size_limit_from_bytes_and_from_path(tmp_path):
    data = encode(PICTURE, "PNG")
    path = tmp_path / "p.png"
    path.write_bytes(data)
    limits = MediaLimits(max_image_bytes=len(data) - 1)
    for source in (data, path, str(path)):
        with pytest.raises(MediaLimitError, match=f"{len(data)} exceeds the limit of {len(data) - 1}") as e:
            load_image(source, limits)
        assert e.value.problem == "image_bytes" and e.value.actual == len(data)
    assert load_image(data, MediaLimits(max_image_bytes=len(data))).size == (61, 47)


def test_decoded_pixels_are_checked_from_the_header_before_decoding(monkeypatch):
    def no_decoding(self):
        raise AssertionError("pixels were decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    with pytest.raises(MediaLimitError, match=r"61x47\): 2867 exceeds the limit of 2000") as e:
        load_image(encode(PICTURE, "PNG"), MediaLimits(max_image_pixels=2000))
    assert e.value.problem == "image_pixels"
    # A bomb's header: Pillow's guard inside Image.open sees it first, and it is reported against our limit.
    with pytest.raises(MediaLimitError, match="10000000000 exceeds the limit of 67108864") as e:
        load_image(png_header_only(100_000, 100_000))
    assert e.value.actual == 10**10 and e.value.limit == MediaLimits().max_image_pixels
    with pytest.raises(MediaLimitError, match=r"\(5000x5000\): 25000000 exceeds the limit of 1000000"):
        load_image(png_header_only(5000, 5000), MediaLimits(max_image_pixels=10**6))


def test_pillows_bomb_warning_becomes_our_error():
    """A header between Pillow's warning and error thresholds, our own limit set above both: Pillow's
    guard decides, and its warning must come out as a MediaLimitError, not as a warning."""
    side = int((Image.MAX_IMAGE_PIXELS * 1.2) ** 0.5)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(MediaLimitError, match="decompression-bomb") as e:
            load_image(png_header_only(side, side), MediaLimits(max_image_pixels=10**12))
    assert e.value.problem == "image_pixels" and e.value.actual == side * side
    assert not [w for w in seen if issubclass(w.category, Image.DecompressionBombWarning)]


def test_pillows_bomb_error_becomes_our_error():
    with pytest.raises(MediaLimitError, match="decompression-bomb") as e:
        load_image(png_header_only(20_000, 20_000), MediaLimits(max_image_pixels=10**12))
    assert e.value.actual == 400_000_000


def test_a_pil_image_is_held_to_the_pixel_limit():
    with pytest.raises(MediaLimitError, match="image_pixels|exceeds"):
        load_image(PICTURE, MediaLimits(max_image_pixels=100))


def test_items_per_request():
    limits = MediaLimits(max_images_per_request=3, max_videos_per_request=1)
    limits.check_counts(3, 1)
    with pytest.raises(MediaLimitError, match="images in the request: 4 exceeds the limit of 3") as e:
        limits.check_counts(4, 0)
    assert e.value.problem == "images_per_request"
    with pytest.raises(MediaLimitError, match="videos in the request: 2 exceeds the limit of 1"):
        limits.check_counts(0, 2)


def test_truncated_decoding_switch_is_refused(monkeypatch):
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    with pytest.raises(FrontendError, match="LOAD_TRUNCATED_IMAGES") as e:
        load_image(encode(PICTURE, "PNG"))
    assert not isinstance(e.value, MediaError)  # the server's setup is at fault, not the request


def test_missing_libraries_name_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "PIL", None)
    with pytest.raises(VisionDependencyError, match=r"ninfer-qwen3_5\[vision\]"):
        load_image(b"\x89PNG")
    monkeypatch.setitem(sys.modules, "av", None)
    with pytest.raises(VisionDependencyError, match=r"PyAV.*ninfer-qwen3_5\[vision\]"):
        load_video(b"\0\0\0\x18ftypmp42")


def test_geometry_the_processor_cannot_represent():
    with pytest.raises(MediaDecodeError, match="aspect ratio of 300.0, above the limit of 200") as e:
        preprocess_image(encode(Image.new("RGB", (300, 1)), "PNG"))
    assert e.value.problem == "aspect_ratio"
    with pytest.raises(MediaDecodeError, match="no pixels"):
        process_image(Image.new("RGB", (0, 0)))


def test_unaccepted_image_format():
    with pytest.raises(MediaDecodeError, match="accepted format") as e:
        load_image(encode(PICTURE, "TIFF"))
    assert e.value.problem == "format"


# --- broken images ------------------------------------------------------------------------------------------

FORMATS = ["PNG", "JPEG", "GIF", "WEBP", "BMP"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_truncated_images_fail_or_decode_in_full(fmt):
    """Cut at every byte: PNG and JPEG always fail; formats without an end marker the decoder needs
    (GIF's trailer, BMP's last row padding) may decode, and then only to the complete original."""
    data = encode(PICTURE, fmt)
    full = np.asarray(load_image(data).convert("RGB"))
    decoded = 0
    for cut in range(1, len(data), 3 if len(data) > 3000 else 1):
        try:
            img = load_image(data[:cut])
        except MediaDecodeError:
            continue
        decoded += 1
        assert np.array_equal(np.asarray(img.convert("RGB")), full), cut
    if fmt in ("PNG", "JPEG"):
        assert decoded == 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_bit_flipped_images_fail_or_decode_in_full(fmt):
    """Seeded bit flips. PNG's checksums catch all of them; other formats may decode damaged pixels,
    but then a whole picture (JPEG entropy data and raw BMP pixels carry no checksum)."""
    rng = np.random.default_rng(7)
    data = encode(PICTURE, fmt)
    for _ in range(150):
        try:
            img = load_image(_flip_bits(data, rng))
        except MediaError:
            continue
        assert fmt != "PNG"
        assert np.asarray(img.convert("RGB")).shape == (img.size[1], img.size[0], 3)


def test_random_bytes_are_rejected():
    rng = np.random.default_rng(3)
    prefixes = [b"", b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff\xe0", b"GIF89a", b"RIFF\0\0\0\0WEBPVP8 ", b"BM"]
    for prefix in prefixes:
        for size in (1, 50, 4000):
            with pytest.raises(MediaDecodeError):
                load_image(prefix + rng.integers(0, 256, size, dtype=np.uint8).tobytes())
    with pytest.raises(MediaDecodeError, match="no bytes"):
        load_image(b"")


# --- videos -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def clip() -> bytes:
    return make_video(99, 65, 20, 10)  # 2 s at 10 fps


def test_video_limits_name_the_problem_and_the_limit(clip):
    cases = [
        (MediaLimits(max_video_bytes=1000), "video_bytes", f"{len(clip)} exceeds the limit of 1000"),
        (MediaLimits(max_video_frame_pixels=6000), "video_frame_pixels", r"99x65\): 6435 exceeds the limit of 6000"),
        (MediaLimits(max_video_frames=19), "video_frames", "frames: 20 exceeds the limit of 19"),
        (MediaLimits(max_video_seconds=1.5), "video_seconds", "2 exceeds the limit of 1.5"),
        (MediaLimits(max_video_decoded_pixels=100_000), "video_decoded_pixels",
         r"\(20 frames x 6435\): 128700 exceeds the limit of 100000"),
    ]
    for limits, problem, message in cases:
        with pytest.raises(MediaLimitError, match=message) as e:
            load_video(clip, limits=limits)
        assert e.value.problem == problem


def test_counted_frames_are_limited_too():
    data = make_video(64, 48, 20, 10, codec="libvpx-vp9", pix_fmt="yuv420p", container="webm")
    with pytest.raises(MediaLimitError, match=r"frames \(counted\): 11 exceeds the limit of 10"):
        load_video(data, limits=MediaLimits(max_video_frames=10))
    with pytest.raises(MediaLimitError, match=r"decoded pixels \(counted\) \(4 frames x 3072\)"):
        load_video(data, limits=MediaLimits(max_video_decoded_pixels=10_000))


def test_a_single_frame_video_is_too_short():
    from ninfer_qwen3_5.frontend.vision import preprocess_video

    with pytest.raises(MediaDecodeError, match="1 frame") as e:
        preprocess_video(make_video(64, 48, 1, 10))
    assert e.value.problem == "too_few_frames"


def test_unaccepted_containers_and_codecs():
    with pytest.raises(MediaDecodeError, match="not an MP4") as e:
        load_video(encode(PICTURE, "GIF"))
    assert e.value.problem == "format"
    with pytest.raises(MediaDecodeError, match="codec 'ffv1' is not accepted") as e:
        load_video(make_video(32, 32, 4, 10, codec="ffv1", pix_fmt="yuv420p", container="matroska"))
    assert e.value.problem == "codec"


def test_truncated_videos_fail_or_decode_in_full(clip):
    full = load_video(clip).frames
    for cut in list(range(1, len(clip), 11)) + list(range(len(clip) - 64, len(clip))):
        try:
            video = load_video(clip[:cut])
        except MediaError:
            continue
        assert np.array_equal(video.frames, full), cut


def test_bit_flipped_and_random_videos_fail_or_decode_in_full(clip):
    rng = np.random.default_rng(11)
    for _ in range(120):
        try:
            video = load_video(_flip_bits(clip, rng))
        except MediaError:
            continue
        assert video.frames.shape == (len(video.frame_indices), 65, 99, 3)
    for prefix in (b"", b"\0\0\0\x18ftypisom", b"\x1a\x45\xdf\xa3", b"RIFF\0\0\0\0AVI "):
        with pytest.raises(MediaDecodeError):
            load_video(prefix + rng.integers(0, 256, 3000, dtype=np.uint8).tobytes())
