"""A message's content: a string, or a list of parts (text and images).

The native shape, which every door translates to and every provider from::

    "content": "plain text"
    "content": [{"type": "text", "text": "What is in this picture?"},
                {"type": "image", "url": "https://example.com/cat.png", "detail": "low"}]

An image is given by an ``https:``/``http:`` URL (the upstream fetches it; the broker never does)
or a ``data:image/<png|jpeg|gif|webp>;base64,...`` URL, whose bytes must decode and start as
their media type says. ``detail`` (``auto``, ``low``, ``high``) is optional. Parts are for user
messages only (the models take images from the user; a system, assistant or tool message is a
string). The body-size limit bounds the bytes of data URLs; :data:`MAX_IMAGES` bounds how many
images one request may hold.
"""

from __future__ import annotations

import binascii
import dataclasses
import urllib.parse
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

# Images one request may hold, over all its messages (Anthropic's own limit per request).
MAX_IMAGES: Final = 100
MAX_URL_CHARS: Final = 8192  # of an http(s) URL; a data URL is bounded by the body limit
DETAILS: Final = ("auto", "low", "high")
# Each media type and how its bytes begin.
MEDIA_TYPES: Final[dict[str, tuple[bytes, ...]]] = {
    "image/png": (b"\x89PNG\r\n\x1a\n",),
    "image/jpeg": (b"\xff\xd8\xff",),
    "image/gif": (b"GIF87a", b"GIF89a"),
    "image/webp": (b"RIFF",),
}

Detail = Literal["auto", "low", "high"]


@dataclasses.dataclass(frozen=True, slots=True)
class Image:
    """An image part, parsed: its URL, and for a data URL its media type and base64 data."""

    url: str
    detail: str | None = None
    media_type: str | None = None  # set for data URLs only
    data: str | None = None  # the base64 text of a data URL

    @property
    def host(self) -> str:
        """The host of an http(s) URL ("" for data)."""
        return "" if self.data is not None else urllib.parse.urlsplit(self.url).hostname or ""


def parse_image_url(url: str, *, check: bool = True) -> Image:
    """``url`` checked as an image's URL; ValueError saying what is wrong with it. Without
    ``check``, a data URL's data is not decoded (a URL already checked on the way in)."""
    if url[:5].lower() == "data:":
        return _data_url(url, check)
    if len(url) > MAX_URL_CHARS:
        raise ValueError(f"an image URL is at most {MAX_URL_CHARS} characters")
    try:
        split = urllib.parse.urlsplit(url)
    except ValueError:
        split = None
    if split is None or split.scheme.lower() not in ("http", "https") or not split.hostname:
        raise ValueError(
            "an image URL must be an http(s) URL with a host, or a data URL "
            "(data:image/png;base64,...)"
        )
    return Image(url)


def _data_url(url: str, check: bool) -> Image:
    header, comma, data = url.partition(",")
    media_type, _, coding = header[5:].partition(";")
    media_type = media_type.lower()
    if not comma or coding.lower() != "base64":
        raise ValueError("an image data URL must be data:<media type>;base64,<data>")
    magic = MEDIA_TYPES.get(media_type)
    if magic is None:
        raise ValueError(
            f"image media type {media_type[:64]!r} is not supported "
            f"(this broker takes: {', '.join(MEDIA_TYPES)})"
        )
    if not check:
        return Image(url, media_type=media_type, data=data)
    try:
        head = binascii.a2b_base64(data[:16], strict_mode=True)
        binascii.a2b_base64(data, strict_mode=True)
    except binascii.Error:
        raise ValueError("the image data URL's data is not valid base64") from None
    if not head.startswith(magic) or (media_type == "image/webp" and head[8:12] != b"WEBP"):
        raise ValueError(f"the image data URL's bytes are not {media_type}")
    return Image(url, media_type=media_type, data=data)


class TextPart(BaseModel):
    """A text part of a message's content."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


class ImagePart(BaseModel):
    """An image part of a user message's content."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["image"]
    url: str = Field(
        min_length=1, description="an http(s) URL, or data:image/<png|jpeg|gif|webp>;base64,..."
    )
    detail: Detail | None = None

    @field_validator("url")
    @classmethod
    def _url(cls, url: str) -> str:
        parse_image_url(url)
        return url


def _kind(value: Any) -> str:
    return "str" if isinstance(value, str) else "parts"


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]
# Chosen by the value's kind, so that a refusal names the parts' problem alone.
Content = Annotated[
    Annotated[str, Tag("str")] | Annotated[list[ContentPart], Tag("parts")],
    Discriminator(_kind),
]


def check_parts(role: str, content: Any) -> None:
    """ValueError when ``content`` is a list of parts that ``role`` may not carry, or empty."""
    if isinstance(content, list):
        if role != "user":
            raise ValueError(
                f"content parts are for user messages only (a {role} message's content is a string)"
            )
        if not content:
            raise ValueError("content must hold at least one part")


def stored(content: Any) -> Any:
    """Content as the stored request keeps it: parts without their unset fields (a string is
    itself, so the fingerprint of a plain message is what it always was)."""
    if not isinstance(content, list):
        return content
    return [{k: v for k, v in part.items() if v is not None} for part in content]


def text_of(content: Any) -> str:
    """The text of a message's content: the string, or its text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(
        str(part.get("text", ""))
        for part in content
        if isinstance(part, Mapping) and part.get("type") == "text"
    )


def images_of(content: Any) -> list[Image]:
    """The images of a message's content, in order (none for a string)."""
    if not isinstance(content, list):
        return []
    images = []
    for part in content:
        if isinstance(part, Mapping) and part.get("type") == "image":
            image = parse_image_url(str(part.get("url", "")), check=False)
            images.append(dataclasses.replace(image, detail=part.get("detail")))
    return images


def count_images(messages: Iterable[Mapping[str, Any]]) -> int:
    """How many image parts ``messages`` hold."""
    return sum(
        1
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, Mapping) and part.get("type") == "image"
    )
