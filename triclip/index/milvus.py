"""Milvus as a home for an index folder: where to connect, the collections' layout, what they record.

    client = connect("/data/triclip.db")            # Milvus Lite: a local folder ending in .db, in this process
    client = connect("http://milvus.example:19530")  # a Milvus server (Standalone or Distributed)
    props = read_properties(client, "triclip")        # what triclip index export recorded, or None

``triclip index export`` (:mod:`triclip.index.milvus_export`) writes one collection of image rows
and, with captions, a second one named ``{collection}_captions``::

    images    row (INT64, primary: the row in the index version), id, image (path), captions (JSON list),
              label (JSON), file (JSON: device, inode, size, mtime_ns, as meta.jsonl), vector (FLOAT_VECTOR, m)
    captions  row (INT64, primary: the caption row, text_rows.npy), image_row, caption_no, id, caption, vector

The image collection's properties (string values, ``triclip.`` keys) record where the rows came from
and how to read them: the run (folder and fingerprint), the index folder, the live version exported
and a hash of its manifest, D, m, the importance order, the budget and the Milvus index chosen,
how many rows are written (a watermark, :data:`DONE`), and, in chunks, the compact transform that
queries go through and the manifest and curves the app's panels draw (:func:`write_blob`).

Milvus Lite (pymilvus's ``milvus-lite``) serves one process at a time: a second one is refused
with one line (:func:`connect`).
"""

from __future__ import annotations

import base64
import fcntl
import json
import logging
import os
import re
import zlib
from pathlib import Path

from triclip.core.errors import UserError, first_line

PREFIX = "triclip."  # every property this module writes starts with it
FORMAT = "1"  # PREFIX + "format": the layout above
DONE, TEXT_DONE = PREFIX + "done", PREFIX + "text_done"  # rows written so far, in row order (the resume point)
IDS_SHA, TEXT_SHA = PREFIX + "ids_sha256", PREFIX + "text_sha256"  # of the ids / caption rows below the watermark
CHUNK_CHARS = 60_000  # a blob is split into properties of at most this many characters
ID_CHARS, PATH_CHARS, CAPTION_CHARS = 1024, 4096, 16_384  # VARCHAR lengths; longer values are refused (ids,
# paths) or cut (a caption beyond 16k characters: the text tower reads ~256 tokens)
NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,200}$")  # a Milvus collection name (room for "_captions")
SERVER_SCHEMES = ("http://", "https://", "tcp://")


def captions_name(collection: str) -> str:
    """The caption collection that goes with ``collection``."""
    return f"{collection}_captions"


def is_milvus_uri(text: str) -> bool:
    """True for a Milvus server URI, or a path ending in ``.db`` that is not a triclip index folder."""
    if not isinstance(text, str):
        return False
    if text.startswith(SERVER_SCHEMES):
        return True
    path = Path(text)
    return path.name.endswith(".db") and not (path / "CURRENT").exists() and not (path / "manifest.json").exists()


def check_collection_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise UserError(
            f"--collection {name!r} is not a Milvus collection name (letters, digits and _, not starting with a digit,"
            " at most 200 characters)"
        )
    return name


# ---------------------------------------------------------------------------- connecting


def connect(uri: str, timeout: float = 10.0):
    """A ``pymilvus.MilvusClient`` for ``uri``; UserError (one line) when it cannot be had in ``timeout`` seconds.

    ``PATH.db``: Milvus Lite, in this process (the folder is made if missing; its parent must exist).
    ``http://HOST:PORT`` (``https``, ``tcp``): a Milvus server.
    """
    quiet_loggers()
    if not isinstance(uri, str) or not (uri.startswith(SERVER_SCHEMES) or uri.endswith(".db")):
        raise UserError(f"{uri!r} is not a Milvus URI: give a Milvus Lite file PATH.db or a server http://HOST:19530")
    if uri.endswith(".db") and not uri.startswith(SERVER_SCHEMES):
        _check_lite_path(Path(uri))
    from pymilvus import MilvusClient

    try:
        client = MilvusClient(uri=uri, timeout=timeout)
    except Exception as err:  # noqa: BLE001 (pymilvus raises its own classes and grpc's)
        raise UserError(_why_not_connected(uri, err, timeout)) from None
    client._triclip_lite = None if uri.startswith(SERVER_SCHEMES) else uri  # close() stops Lite's server
    return client


def _check_lite_path(path: Path) -> None:
    if not path.parent.is_dir():
        raise UserError(f"cannot open Milvus Lite file {path}: its folder {path.parent} does not exist")
    if path.exists() and not path.is_dir():
        raise UserError(f"{path} is not a Milvus Lite file (Milvus Lite keeps a folder there; this is a file)")
    if path.is_dir() and any(path.iterdir()) and not (path / "LOCK").exists():
        raise UserError(f"{path} holds files that are not Milvus Lite's; give a new or a Milvus Lite PATH.db")


def _locked(lock: Path) -> bool:
    """Whether another process holds Milvus Lite's lock on its folder (its ``LOCK`` file)."""
    try:
        fd = os.open(lock, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def _why_not_connected(uri: str, err: Exception, timeout: float) -> str:
    text = milvus_message(err)
    if uri.endswith(".db") and not uri.startswith(SERVER_SCHEMES):
        if _locked(Path(uri) / "LOCK"):
            return f"Milvus Lite file {uri} is open in another process (Milvus Lite serves one process at a time)"
        return f"cannot open Milvus Lite file {uri}: {text}"
    return f"cannot reach Milvus at {uri} within {timeout:g} s: {text}"


def milvus_message(err: Exception) -> str:
    """The one-line reason inside a pymilvus / grpc exception."""
    message = getattr(err, "message", None)
    if isinstance(message, str) and message.strip():
        return message.strip().splitlines()[0][:300]
    return first_line(err, limit=300)


def quiet_loggers() -> None:
    """pymilvus and Milvus Lite log each failed call with a traceback on stderr (and grpc's server, which runs
    Milvus Lite in this process, each call Lite does not implement): the caller says what matters in one line."""
    for name in ("pymilvus", "milvus_lite", "grpc._server"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.CRITICAL + 1)
        logger.propagate = False


def close(client) -> None:
    """Close the client; for Milvus Lite also stop its in-process server, so the ``.db`` is free for another process."""
    try:
        client.close()
    except Exception:  # noqa: BLE001 (closing what may already be gone)
        pass
    uri = getattr(client, "_triclip_lite", None)
    if uri:
        release_lite(uri)


def is_lite(client) -> bool:
    """Whether the server is Milvus Lite (a ``.db`` in this process, or ``milvus-lite server`` on a port): it has
    fewer index types than a Milvus server (``triclip.index.milvus_export.INDEX_FOR_CODEC``)."""
    try:
        return str(client.get_server_version()).startswith("milvus_lite")
    except Exception:  # noqa: BLE001 (an old server without the call: not Lite)
        return False


def release_lite(path: str) -> None:
    try:
        from milvus_lite.server_manager import server_manager_instance
    except ImportError:
        return
    server_manager_instance.release_server(path)


# ---------------------------------------------------------------------------- properties


def read_properties(client, collection: str) -> dict | None:
    """The ``triclip.`` properties of ``collection`` (prefix dropped), or None when there is no such collection."""
    if not client.has_collection(collection):
        return None
    described = client.describe_collection(collection)
    props = described.get("properties") or {}
    return {k[len(PREFIX):]: v for k, v in props.items() if k.startswith(PREFIX)}


def write_properties(client, collection: str, values: dict) -> None:
    """Set ``triclip.{key}`` = ``str(value)`` (JSON for lists and dicts) on ``collection``."""
    client.alter_collection_properties(collection, properties=properties(values))


def properties(values: dict) -> dict:
    """``{"triclip.{key}": value as a string}`` (JSON for lists and dicts)."""
    return {PREFIX + k: v if isinstance(v, str) else json.dumps(v) for k, v in values.items()}


def encode_blob(name: str, obj) -> dict:
    """``obj`` as JSON, zlib-compressed and base64-encoded, in properties ``{name}.0``, ``{name}.1``, ... and
    ``{name}.parts`` (the count): a blob too big for one property value."""
    text = base64.b64encode(zlib.compress(json.dumps(obj).encode("utf-8"), 6)).decode("ascii")
    parts = [text[i : i + CHUNK_CHARS] for i in range(0, len(text), CHUNK_CHARS)] or [""]
    return {**{f"{name}.{i}": p for i, p in enumerate(parts)}, f"{name}.parts": str(len(parts))}


def decode_blob(props: dict, name: str):
    """The object :func:`encode_blob` stored under ``name``; UserError when it is missing or damaged."""
    try:
        parts = int(props[f"{name}.parts"])
        text = "".join(props[f"{name}.{i}"] for i in range(parts))
        return json.loads(zlib.decompress(base64.b64decode(text)).decode("utf-8"))
    except (KeyError, ValueError, zlib.error) as err:
        raise UserError(f"the collection's {name} record is missing or damaged ({first_line(err)}); export again") from None


def find_collection(client, uri: str, collection: str | None) -> str:
    """The image collection to search: ``collection``, or the one triclip collection at ``uri``."""
    if collection is not None:
        check_collection_name(collection)
        props = read_properties(client, collection)
        if props is None:
            raise UserError(f"{uri} has no collection {collection!r} (triclip index export --to {uri} --collection {collection})")
        if props.get("format") is None:
            raise UserError(f"collection {collection!r} at {uri} was not written by triclip index export")
        return collection
    ours = [name for name in sorted(client.list_collections()) if (read_properties(client, name) or {}).get("format")]
    if len(ours) == 1:
        return ours[0]
    if not ours:
        raise UserError(f"{uri} holds no collection written by triclip index export")
    raise UserError(f"{uri} holds several triclip collections ({', '.join(ours)}): choose one with --collection")
