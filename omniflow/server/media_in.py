"""Media a request refers to, as bytes: `data:` URIs, bare base64, local files, and (only
with `--allow-remote-media`) http(s) URLs. Every failure is a 400 naming the field."""

from __future__ import annotations

import asyncio
import base64
import binascii
import os
import urllib.parse
import urllib.request

from omniflow.server.errors import bad_request

REMOTE_TIMEOUT_S = 10.0


async def fetch(url: str, where: str, *, allow_remote: bool, max_bytes: int) -> bytes:
    """The bytes `url` names (`where`: the request field, for errors)."""
    if url.startswith("data:"):
        return _data_uri(url, where, max_bytes)
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme in ("http", "https"):
        if not allow_remote:
            raise bad_request(
                f"'{where}': remote URLs are off on this server; send the file as a data: URI "
                "(or start the server with --allow-remote-media)",
                param=where,
            )
        return await asyncio.to_thread(_download, url, where, max_bytes)
    if scheme == "file" or url.startswith(("/", "./", "../", "~")):
        path = urllib.parse.unquote(urllib.parse.urlsplit(url).path) if scheme == "file" else url
        return await asyncio.to_thread(_read_file, os.path.expanduser(path), where, max_bytes)
    if scheme and len(scheme) > 1:
        raise bad_request(
            f"'{where}': unsupported URL scheme '{scheme}'; send a data: URI, a local file path "
            "or an http(s) URL",
            param=where,
        )
    return _base64(url, where, max_bytes)  # the peer sends bare base64 too


def _data_uri(url: str, where: str, max_bytes: int) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep:
        raise bad_request(f"'{where}': a data: URI needs a ',' before its data", param=where)
    if header.endswith(";base64"):
        return _base64(payload, where, max_bytes)
    data = urllib.parse.unquote_to_bytes(payload)
    _check_size(len(data), where, max_bytes)
    return data


def _base64(text: str, where: str, max_bytes: int) -> bytes:
    _check_size(len(text) * 3 // 4, where, max_bytes)
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(
            f"'{where}': not valid base64 (nor a data: URI, file path or URL)", param=where
        ) from None


def _read_file(path: str, where: str, max_bytes: int) -> bytes:
    try:
        size = os.path.getsize(path)
        _check_size(size, where, max_bytes)
        with open(path, "rb") as file:
            return file.read(max_bytes + 1)
    except OSError as err:
        raise bad_request(
            f"'{where}': cannot read local file '{path}': {err.strerror}", param=where
        ) from None


def _download(url: str, where: str, max_bytes: int) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=REMOTE_TIMEOUT_S) as reply:  # noqa: S310
            data = reply.read(max_bytes + 1)
    except (OSError, ValueError) as err:
        raise bad_request(f"'{where}': cannot fetch {url}: {err}", param=where) from None
    _check_size(len(data), where, max_bytes)
    return data


def _check_size(size: int, where: str, max_bytes: int) -> None:
    if size > max_bytes:
        raise bad_request(
            f"'{where}': the file is {size} bytes; this server takes at most {max_bytes}",
            param=where,
        )
