"""Media a request refers to, as bytes: `data:` URIs and bare base64 always; local files only
under the directories the operator names (`--allowed-media-dir`, none by default); http(s)
URLs only with `--allow-remote-media`; and decoded (`decoded`) within the server's limits
off the event loop. Every failure is a 400 naming the field.

A local path is resolved (links followed) and must lie in an allowed directory, outside the
kernel's pseudo filesystems (/proc, /sys, /dev: no process's descriptors or shared-memory
rings); it is opened without following a link in its last component and without waiting
(a FIFO opens at once), and must then be a regular file, which is read to at most the media
size limit. Whatever the reason a path is refused (missing, outside, a link out, a pipe, a
device, unreadable), the answer is the same text, so that it tells nothing about the
server's files. A download has a deadline as a whole, not only per read, and follows
redirects to http(s) alone: no read blocks a thread for ever. Decoded images larger than the
plan's buffer for them are scaled down to fit (`fit_images`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import math
import os
import stat
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch

from omniflow.errors import OmniflowError
from omniflow.media import MediaError
from omniflow.runtime.port_values import encode
from omniflow.server.errors import bad_request

REMOTE_TIMEOUT_S = 10.0  # each network read, and (x3) a whole download
DOWNLOAD_CHUNK = 1 << 16
# Where no request's path may lead, whatever directory the operator allows.
PSEUDO_FILESYSTEMS = ("/proc", "/sys", "/dev")
T = TypeVar("T")


class MediaDirError(OmniflowError):
    """An `--allowed-media-dir` that cannot be one."""


def allowed_dirs(paths: list[str]) -> tuple[str, ...]:
    """The operator's `--allowed-media-dir`s, resolved: each an existing directory outside
    the pseudo filesystems."""
    resolved = []
    for path in paths:
        real = os.path.realpath(path)
        if not os.path.isdir(real):
            raise MediaDirError(f"--allowed-media-dir {path}: not a directory")
        if _pseudo(real):
            raise MediaDirError(
                f"--allowed-media-dir {path}: {real} is in a pseudo filesystem "
                f"({', '.join(PSEUDO_FILESYSTEMS)}), whose files are never media"
            )
        resolved.append(real)
    return tuple(resolved)


async def fetch(
    url: str,
    where: str,
    *,
    allow_remote: bool,
    allowed: tuple[str, ...],
    max_bytes: int,
) -> bytes:
    """The bytes `url` names (`where`: the request field, for errors): a `data:` URI, bare
    base64, a path or `file://` URL under one of the `allowed` directories, or an http(s)
    URL if `allow_remote`."""
    if url.startswith("data:"):
        return data_uri(url, where, max_bytes)
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme in ("http", "https"):
        if not allow_remote:
            raise bad_request(
                f"'{where}': remote URLs are off on this server; send the file as a data: URI "
                "(or start the server with --allow-remote-media)",
                param=where,
            )
        return await asyncio.to_thread(_download, url, where, max_bytes)
    if scheme == "file" or url.startswith(("/", "./", "../", "~")):
        if scheme == "file" and parts.netloc not in ("", "localhost"):
            raise _no_file(where)
        path = urllib.parse.unquote(parts.path) if scheme == "file" else url
        path = os.path.expanduser(path)
        return await asyncio.to_thread(_read_file, path, where, allowed, max_bytes)
    if scheme and len(scheme) > 1:
        raise bad_request(
            f"'{where}': unsupported URL scheme '{scheme}'; send a data: URI (or an http(s) "
            "URL where the server allows them)",
            param=where,
        )
    # The peer sends bare base64 too.
    return base64_bytes(url, where, max_bytes, " (nor a data: URI, file path or URL)")


async def decoded(decode: Callable[..., T], data: bytes, where: str, *limits, note: str = "") -> T:
    """`decode(data, *limits)` (a decoder of `omniflow.media`, which checks what a file
    declares against its limits before it decodes) in a worker thread, so that the event
    loop serves on meanwhile; a file it refuses is a 400 naming `where` (`note` added to
    its message)."""
    try:
        return await asyncio.to_thread(decode, data, *limits)
    except MediaError as err:
        raise bad_request(f"'{where}': {err}{note}", param=where) from None


def data_uri(url: str, where: str, max_bytes: int) -> bytes:
    """A `data:` URI's bytes (base64 or percent-encoded), or a 400 naming `where`."""
    header, sep, payload = url.partition(",")
    if not sep:
        raise bad_request(f"'{where}': a data: URI needs a ',' before its data", param=where)
    if header.endswith(";base64"):
        return base64_bytes(payload, where, max_bytes)
    data = urllib.parse.unquote_to_bytes(payload)
    _check_size(len(data), where, max_bytes)
    return data


def base64_bytes(text: str, where: str, max_bytes: int, nor: str = "") -> bytes:
    """Base64 `text` decoded (at most `max_bytes` of it), or a 400 naming `where` (`nor`:
    what else the field could have been, for the message)."""
    _check_size(len(text) * 3 // 4, where, max_bytes)
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"'{where}': not valid base64{nor}", param=where) from None


def _no_file(where: str):
    """The one answer to a path the server will not read, whatever the reason."""
    return bad_request(
        f"'{where}': no media file this server may read at that path (it reads local files "
        "only in the directories its operator allows, --allowed-media-dir); send the file as "
        "a data: URI",
        param=where,
    )


def _pseudo(path: str) -> bool:
    return any(_inside(path, top) for top in PSEUDO_FILESYSTEMS)


def _inside(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _read_file(path: str, where: str, allowed: tuple[str, ...], max_bytes: int) -> bytes:
    real = os.path.realpath(path)
    if _pseudo(real) or not any(_inside(real, d) for d in allowed):
        raise _no_file(where)
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(real, flags)
    except OSError:
        raise _no_file(where) from None
    try:
        info = os.fstat(fd)
        # What was opened, not what the name led to a moment before (a link swapped since).
        opened = _opened_path(fd) or real
        if not stat.S_ISREG(info.st_mode) or not any(_inside(opened, d) for d in allowed):
            raise _no_file(where)
        _check_size(info.st_size, where, max_bytes)
        with os.fdopen(fd, "rb", closefd=False) as file:
            data = file.read(max_bytes + 1)
    except OSError:
        raise _no_file(where) from None
    finally:
        os.close(fd)
    _check_size(len(data), where, max_bytes)
    return data


def _opened_path(fd: int) -> str | None:
    """The path of an open file, as the kernel knows it (None where /proc cannot say)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


class _HTTPOnlyRedirects(urllib.request.HTTPRedirectHandler):
    """Redirects to http(s) alone (urllib's own would follow one to ftp:)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if urllib.parse.urlsplit(newurl).scheme.lower() not in ("http", "https"):
            raise urllib.error.HTTPError(newurl, code, "redirect to a non-http URL", headers, fp)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


_OPENER = urllib.request.build_opener(_HTTPOnlyRedirects)


def _download(url: str, where: str, max_bytes: int) -> bytes:
    deadline = time.monotonic() + 3 * REMOTE_TIMEOUT_S
    parts, size = [], 0
    try:
        with _OPENER.open(url, timeout=REMOTE_TIMEOUT_S) as reply:
            while chunk := reply.read(DOWNLOAD_CHUNK):
                parts.append(chunk)
                size += len(chunk)
                _check_size(size, where, max_bytes)
                if time.monotonic() > deadline:
                    raise bad_request(
                        f"'{where}': {url} took over {3 * REMOTE_TIMEOUT_S:g} s to download",
                        param=where,
                    )
    except (OSError, ValueError) as err:
        raise bad_request(f"'{where}': cannot fetch {url}: {err}", param=where) from None
    return b"".join(parts)


def _check_size(size: int, where: str, max_bytes: int) -> None:
    if size > max_bytes:
        raise bad_request(
            f"'{where}': the file is {size} bytes; this server takes at most {max_bytes}",
            param=where,
        )


def fit_images(images: list[torch.Tensor], room: int) -> list[torch.Tensor]:
    """Images (uint8 `[H, W, 3]`) that travel together as one value, scaled down alike (their
    aspect ratios kept; bicubic, as the Qwen processors resize) until they fit `room` bytes
    on the wire: a chat's photo larger than the plan's image buffer (omni chat's: 1024 x
    1024) is seen at the size the plan holds, as clients' own helpers (qwen-omni-utils'
    `fetch_image`) scale to a pixel bound, rather than refused. Images that fit are
    returned as they are."""
    from PIL import Image

    for _ in range(8):  # each pass lands within the room but for rounding and the header
        size = encode("image", images if len(images) > 1 else images[0]).nbytes
        if size <= room:
            return images
        scale = math.sqrt(room / size) * 0.995
        resized = []
        for image in images:
            height, width = image.shape[:2]
            shape = (max(1, int(width * scale)), max(1, int(height * scale)))
            picture = Image.fromarray(image.numpy()).resize(shape, Image.Resampling.BICUBIC)
            resized.append(torch.from_numpy(np.asarray(picture, dtype=np.uint8).copy()))
        images = resized
    return images
