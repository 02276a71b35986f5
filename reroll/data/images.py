"""Images in data rows: read from the row's image field, checked to open, kept as encoded bytes.

A row's images (``data.images.field``, default ``images``) are one value or a list of them, each:

- a file path, read relative to the data file's directory (an absolute path as it is);
- a base64 string, bare or as a ``data:image/png;base64,...`` URI (no URLs: nothing is fetched);
- a Hugging Face dataset's ``Image`` feature: a PIL image, or ``{"bytes": ..., "path": ...}`` as
  Parquet exports of such datasets hold it.

Each becomes the image file's bytes (PNG, JPEG, ...: whatever the source held; a PIL image is saved as
PNG), which is what travels to the engines and the trainers and is decoded there. ``row_images`` checks
that every image opens and names the file, the row and the image that does not. Needs Pillow
(``pip install 'reroll[vision]'``).
"""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from typing import Any

from reroll.errors import UserError


class ImageError(UserError):
    """A row's image that cannot be read or does not open as an image."""


def pil() -> Any:
    """The ``PIL.Image`` module, or an ``ImageError`` saying how to install it."""
    try:
        from PIL import Image
    except ImportError as e:
        raise ImageError("rows with images need Pillow: pip install 'reroll[vision]'") from e
    return Image


def open_image(data: bytes) -> Any:
    """The image of encoded ``data`` as an RGB ``PIL.Image`` (what image processors take)."""
    return pil().open(io.BytesIO(data)).convert("RGB")


def image_values(row: dict[str, Any], field: str | None) -> list[Any]:
    """The raw image values of ``row``'s ``field`` (a list, whatever the row holds; empty without it)."""
    if field is None or row.get(field) is None:
        return []
    value = row[field]
    return list(value) if isinstance(value, list | tuple) else [value]


def row_images(where: str, row: dict[str, Any], field: str | None, base: Path | None) -> tuple[bytes, ...]:
    """``row``'s images as encoded bytes, each checked to open. ``where`` names the row in errors
    (``train.jsonl: row 3``); ``base`` is the directory paths are read from (None: the current one)."""
    out = []
    for k, value in enumerate(image_values(row, field)):
        what = f"{where}: image {k + 1} of field {field!r}"
        data = _image_bytes(what, value, base)
        try:
            with pil().open(io.BytesIO(data)) as im:
                im.verify()  # reads the whole file: a truncated or corrupt one fails here
        except ImageError:
            raise
        except Exception as e:
            raise ImageError(
                f"{what} does not open as an image ({type(e).__name__}: {e}): fix or remove the image, or "
                "drop the row"
            ) from e
        out.append(data)
    return tuple(out)


def check_images(
    name: str, rows: list[dict[str, Any]], field: str | None, base: Path | None, most: int
) -> None:
    """Every image of ``rows`` (of the file ``name``) opens, and no row holds more than ``most``; the first
    that fails is an ``ImageError`` naming its row (``reroll validate``)."""
    for i, row in enumerate(rows):
        images = row_images(f"{name}: row {i + 1}", row, field, base)
        if len(images) > most:
            raise ImageError(
                f"{name}: row {i + 1} has {len(images)} images, more than rollout.images.max_per_prompt "
                f"({most}): raise it, or drop images from the row"
            )


def without_images(row: dict[str, Any], field: str | None) -> dict[str, Any]:
    """``row`` as a reward sees it: without its image field (its images travel with the sample)."""
    return {k: v for k, v in row.items() if k != field} if field in row else row


def _image_bytes(what: str, value: Any, base: Path | None) -> bytes:
    """One image value's encoded bytes (see the module docstring for the forms taken)."""
    if isinstance(value, bytes | bytearray):
        return bytes(value)
    if isinstance(value, dict) and ("bytes" in value or "path" in value):  # datasets' Image, undecoded
        if value.get("bytes"):
            return bytes(value["bytes"])
        return _image_bytes(what, value.get("path"), base)
    if hasattr(value, "save") and hasattr(value, "size"):  # a PIL image (datasets' Image, decoded)
        buffer = io.BytesIO()
        value.save(buffer, format="PNG")
        return buffer.getvalue()
    if not isinstance(value, str) or not value:
        raise ImageError(
            f"{what} is {type(value).__name__}, not an image: give a file path, a base64 string or a "
            "data:image/...;base64 URI"
        )
    if value.startswith(("http://", "https://")):
        raise ImageError(
            f"{what} is a URL ({value[:60]}): nothing is downloaded; save the image and give its path"
        )
    if value.startswith("data:"):
        head, _, payload = value.partition(",")
        if not head.endswith(";base64"):
            raise ImageError(
                f"{what}: a data URI must be base64 ('data:image/png;base64,...'); it starts {head!r}"
            )
        return _b64(what, payload)
    path = Path(value) if base is None or Path(value).is_absolute() else base / value
    if len(value) < 1024 and path.is_file():
        return path.read_bytes()
    if len(value) >= 64 and "." not in value[-5:]:  # long and no file extension: base64
        return _b64(what, value)
    relative = (
        "" if base is None or Path(value).is_absolute() else f" (read relative to the data file, in {base})"
    )
    raise ImageError(f"{what}: no file {str(path)!r}{relative}: fix the path, or give the image as base64")


def _b64(what: str, text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"{what}: not a file path and not valid base64 ({e}): fix the value") from e


def encode_image(image: Any, format: str = "PNG") -> bytes:
    """A PIL image's encoded bytes (``format``), e.g. for a row's base64 string or a file."""
    buffer = io.BytesIO()
    image.save(buffer, format=format)
    return buffer.getvalue()
