"""Run storage: one URI (a local directory by default, an object store through pyarrow.fs) that
holds Parquet batches, checkpoints and logs. Writes go to a temporary name and are renamed, so a
reader never sees half a file."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq


class Storage:
    def __init__(self, uri: str) -> None:
        if "://" in uri:
            self.fs, self.root = pafs.FileSystem.from_uri(uri)
        else:
            self.fs, self.root = pafs.LocalFileSystem(), str(Path(uri).resolve())
        self.uri = uri

    def path(self, *parts: str) -> str:
        return "/".join((self.root.rstrip("/"), *parts))

    def local_path(self, *parts: str) -> Path:
        """A path on this machine (checkpoints that vLLM loads must be local)."""
        if not isinstance(self.fs, pafs.LocalFileSystem):
            raise RuntimeError(f"{self.uri} is not a local directory")
        return Path(self.path(*parts))

    def write_table(self, table: pa.Table, *parts: str) -> str:
        """Write Parquet atomically; returns its path."""
        final = self.path(*parts)
        self.fs.create_dir(final.rsplit("/", 1)[0], recursive=True)
        temp = f"{final}.tmp-{uuid.uuid4().hex}"
        pq.write_table(table, temp, filesystem=self.fs, compression="zstd")
        self.fs.move(temp, final)
        return final

    def write_bytes(self, data: bytes, *parts: str) -> str:
        """Write a blob atomically; returns its path."""
        final = self.path(*parts)
        self.fs.create_dir(final.rsplit("/", 1)[0], recursive=True)
        temp = f"{final}.tmp-{uuid.uuid4().hex}"
        with self.fs.open_output_stream(temp) as out:
            out.write(data)
        self.fs.move(temp, final)
        return final

    def read_bytes(self, path: str) -> bytes:
        with self.fs.open_input_stream(path) as stream:
            return stream.read()

    def read_table(self, path: str) -> pa.Table:
        return pq.read_table(path, filesystem=self.fs)

    def exists(self, path: str) -> bool:
        return self.fs.get_file_info(path).type != pafs.FileType.NotFound


def replace_dir(temp: Path, final: Path) -> None:
    """Move a fully written directory into place (checkpoints), replacing an older one."""
    if final.exists():
        old = final.with_name(f"{final.name}.old-{uuid.uuid4().hex}")
        os.rename(final, old)
        os.rename(temp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(temp, final)
