"""Image parsing: data URLs, remote URLs (refused unless allowed), hashing, placeholders."""

from __future__ import annotations

import base64
import http.server
import io
import threading
from collections.abc import Callable, Iterator

import pytest
from PIL import Image

from services.errors import InvalidArgument
from tokenizer_svc.multimodal import (
    ImageData,
    ImageTokenSpec,
    MediaPolicy,
    content_hash,
    expand_image_placeholders,
    load_image,
)

PngFactory = Callable[..., str]
FIELD = "messages[0].content[1].image_url"
POLICY = MediaPolicy()


def _encoded(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def _data_url(raw: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(raw).decode()


def _invalid(match: str = FIELD.replace("[", r"\[").replace("]", r"\]")) -> pytest.RaisesExc[InvalidArgument]:
    return pytest.raises(InvalidArgument, match=match)


def test_data_url_decodes_to_rgb(png_data_url: PngFactory) -> None:
    image = load_image(png_data_url((3, 2), (200, 10, 30)), FIELD, POLICY)
    assert (image.width, image.height, image.shape) == (3, 2, (2, 3, 3))
    assert image.rgb == bytes([200, 10, 30]) * 6
    assert len(image.identifier) == 64 and int(image.identifier, 16) >= 0


def test_hash_depends_on_pixels_not_encoding() -> None:
    picture = Image.new("RGB", (4, 3), (1, 2, 3))
    picture.putpixel((1, 1), (250, 0, 0))
    png = load_image(_data_url(_encoded(picture, "PNG")), FIELD, POLICY)
    bmp = load_image(_data_url(_encoded(picture, "BMP"), "image/bmp"), FIELD, POLICY)
    assert png.identifier == bmp.identifier == content_hash(4, 3, picture.tobytes())
    other = load_image(_data_url(_encoded(Image.new("RGB", (4, 3), (1, 2, 3)), "PNG")), FIELD, POLICY)
    assert other.identifier != png.identifier
    # Same pixel bytes, other shape: a different image.
    assert content_hash(6, 2, picture.tobytes()) != png.identifier


def test_alpha_is_composited_on_white(png_data_url: PngFactory) -> None:
    image = load_image(png_data_url((1, 1), (0, 0, 0, 0), "RGBA"), FIELD, POLICY)
    assert image.rgb == bytes([255, 255, 255])


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("data:image/png;base64,@@@notbase64@@@", "invalid base64"),
        (_data_url(b"definitely not an image"), "not a decodable image"),
        ("data:text/plain;base64,aGVsbG8=", "media type"),
        ("data:image/png,rawbytes", "base64"),
        ("data:image/png;base64", "malformed"),
        ("file:///etc/passwd", "only data: and http"),
        ("http://127.0.0.1:1/x.png", "not allowed"),
        ("https://example.com/cat.png", "not allowed"),
    ],
)
def test_bad_urls_name_the_field(url: str, match: str) -> None:
    with _invalid() as info:
        load_image(url, FIELD, POLICY)
    assert info.value.param == FIELD
    assert match in str(info.value)


def test_size_and_pixel_limits(png_data_url: PngFactory) -> None:
    url = png_data_url((64, 64))
    with _invalid("larger than"):
        load_image(url, FIELD, MediaPolicy(max_image_bytes=50))
    with _invalid("pixels"):
        load_image(url, FIELD, MediaPolicy(max_image_pixels=64 * 63))


class _ImageHandler(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "http://127.0.0.1/elsewhere.png")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def image_server() -> Iterator[tuple[str, bytes]]:
    _ImageHandler.body = _encoded(Image.new("RGB", (5, 5), (9, 8, 7)), "PNG")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ImageHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _ImageHandler.body
    server.shutdown()
    server.server_close()


def test_remote_fetch_from_allowed_host(image_server: tuple[str, bytes]) -> None:
    base, body = image_server
    allowed = MediaPolicy(allowed_domains=("127.0.0.1",), fetch_timeout_s=5.0)
    image = load_image(base + "/cat.png", FIELD, allowed)
    assert image.identifier == load_image(_data_url(body), FIELD, POLICY).identifier
    with _invalid("HTTP 302"):
        load_image(base + "/redirect", FIELD, allowed)
    with _invalid("larger than"):
        load_image(base + "/cat.png", FIELD, MediaPolicy(allowed_domains=("127.0.0.1",), max_image_bytes=10))
    with _invalid("not allowed"):
        load_image(base + "/cat.png", FIELD, MediaPolicy(allowed_domains=("localhost",)))


def test_placeholder_count_must_match_images() -> None:
    spec = ImageTokenSpec("<image>", 7, 3)
    image = ImageData("ab" * 32, 1, 1, b"\x00\x00\x00")
    ids, items = expand_image_placeholders([1, 7, 2, 7], [image, image], spec)
    assert ids == [1, 7, 7, 7, 2, 7, 7, 7]
    assert [(i.offset, i.length) for i in items] == [(1, 3), (5, 3)]
    with _invalid("2 image placeholders"):
        expand_image_placeholders([1, 7, 2, 7], [image], spec)


def test_only_common_raster_formats_are_decoded() -> None:
    picture = Image.new("RGB", (2, 2), (5, 6, 7))
    for fmt in ("JPEG", "GIF", "WEBP", "BMP", "TIFF"):
        assert load_image(_data_url(_encoded(picture, fmt)), FIELD, POLICY).shape == (2, 2, 3)
    for fmt in ("EPS", "PPM"):  # EPS would run Ghostscript
        with _invalid("not a decodable image"):
            load_image(_data_url(_encoded(picture, fmt)), FIELD, POLICY)
