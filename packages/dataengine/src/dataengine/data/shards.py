"""A sharded on-disk token dataset: numpy memmap shards plus a JSON index.

Layout under `root/`:
  index.json               {"version", "dtype", "domains", "shards": [{name, format, num_samples,
                            num_tokens, crc32}]}
  <name>.tokens            raw token ids (dtype from the index), all samples back to back
  <name>.offsets           int64 [num_samples + 1], sample i is tokens[offsets[i]:offsets[i+1]]
  <name>.domains           int16 [num_samples], domain id of each sample
  <name>.parquet           (format "parquet") columns tokens: list<int>, length: int64, domain: int16

Opening checks every shard's files against the index (existence, sizes, offsets); `verify=True`
also checks CRC32 checksums. A problem raises ShardError naming the shard and the file.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tilehal import ArgumentError, TileStackError, check_choice, check_int

INDEX_NAME = "index.json"
# A shard name is one plain file-name stem: an index naming "../x" must not reach outside the root.
_SHARD_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}")


class SampleIndexError(ArgumentError, IndexError):
    """A sample id outside the dataset (an IndexError, so `for x in dataset` stops as usual)."""


class ShardError(TileStackError, OSError):
    """A shard file is missing, truncated or fails its checksum."""

    def __init__(self, shard: str, message: str) -> None:
        self.shard = shard
        super().__init__(f"shard {shard!r}: {message}")


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def _pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("Parquet shards need pyarrow: pip install 'tilestack-dataengine[parquet]'") from exc
    return pa, pq


def _path(root: object, name: str) -> Path:
    if not isinstance(root, (str, os.PathLike)):
        raise ArgumentError(f"{name}: expected a path (str or os.PathLike), got {type(root).__name__}")
    return Path(root)


class ShardWriter:
    """Write samples into shards of about `shard_tokens` tokens each; `close()` writes the index."""

    def __init__(self, root: str | os.PathLike, dtype: Any = np.uint16, domains: Sequence[str] = ("default",),
                 shard_tokens: int = 1 << 26, format: str = "npy") -> None:
        check_choice(format, "format", ("npy", "parquet"))
        root = _path(root, "root")
        try:
            self.dtype = np.dtype(dtype)
        except (TypeError, ValueError):
            raise ArgumentError(f"dtype: expected an integer numpy dtype for token ids, got {dtype!r}") from None
        if self.dtype.kind not in "ui":
            raise ArgumentError(f"dtype: expected an integer numpy dtype for token ids, got {self.dtype}")
        if not isinstance(domains, (list, tuple)) or not domains or not all(isinstance(d, str) for d in domains):
            raise ArgumentError(f"domains: expected a non-empty sequence of domain names, got {domains!r}")
        if len(set(domains)) != len(domains):
            raise ArgumentError(f"domains: expected distinct names, got {list(domains)}")
        self.shard_tokens = check_int(shard_tokens, "shard_tokens", lo=1)
        if format == "parquet":
            _pyarrow()
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.domains = list(domains)
        self.format = format
        self._shards: list[dict] = []
        self._reset()

    def _reset(self) -> None:
        self._samples: list[np.ndarray] = []
        self._doms: list[int] = []
        self._ntok = 0

    def add(self, tokens: Any, domain: int | str = 0) -> None:
        from ..packing import token_array

        arr = token_array(tokens, "tokens")  # float ids (truncated, NaN -> 0 or -2**63) are refused
        if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(self.dtype).max):
            raise ArgumentError(f"tokens: expected ids in 0..{np.iinfo(self.dtype).max} for {self.dtype}, "
                                f"got {arr.min()}..{arr.max()}")
        d = self.domains.index(domain) if isinstance(domain, str) and domain in self.domains else domain
        if isinstance(d, (str, bool)) or not isinstance(d, (int, np.integer)) or not 0 <= d < len(self.domains):
            raise ArgumentError(f"domain: expected one of {self.domains} or 0..{len(self.domains) - 1}, got {domain!r}")
        self._samples.append(arr.astype(self.dtype, copy=False))
        self._doms.append(d)
        self._ntok += arr.size
        if self._ntok >= self.shard_tokens:
            self._flush()

    def _flush(self) -> None:
        if not self._samples:
            return
        name = f"shard_{len(self._shards):05d}"
        lengths = np.array([s.size for s in self._samples], dtype=np.int64)
        doms = np.asarray(self._doms, dtype=np.int16)
        if self.format == "npy":
            files = {"tokens": np.concatenate(self._samples), "offsets": np.concatenate([[0], np.cumsum(lengths)]),
                     "domains": doms}
            crc = {}
            for ext, arr in files.items():
                path = self.root / f"{name}.{ext}"
                np.ascontiguousarray(arr).tofile(path)
                crc[ext] = _crc32(path)
        else:
            pa, pq = _pyarrow()
            table = pa.table({"tokens": [s.tolist() for s in self._samples], "length": lengths, "domain": doms})
            path = self.root / f"{name}.parquet"
            pq.write_table(table, path)
            crc = {"parquet": _crc32(path)}
        self._shards.append({"name": name, "format": self.format, "num_samples": len(self._samples),
                             "num_tokens": int(lengths.sum()), "crc32": crc})
        self._reset()

    def close(self) -> Path:
        self._flush()
        index = {"version": 1, "dtype": self.dtype.name, "domains": self.domains, "shards": self._shards}
        tmp = self.root / (INDEX_NAME + ".tmp")
        tmp.write_text(json.dumps(index, indent=1))
        tmp.replace(self.root / INDEX_NAME)
        return self.root / INDEX_NAME

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()


def write_dataset(root: str | os.PathLike, samples: Sequence, domains: Sequence[int] | None = None,
                  domain_names: Sequence[str] = ("default",), **kwargs: Any) -> TokenDataset:
    """Convenience: write `samples` (with optional per-sample domain ids) and open the dataset."""
    with ShardWriter(root, domains=domain_names, **kwargs) as w:
        for i, s in enumerate(samples):
            w.add(s, 0 if domains is None else domains[i])
    return TokenDataset(root)


@dataclass
class _Shard:
    name: str
    format: str
    num_samples: int
    num_tokens: int
    tokens: Any = None  # memmap (npy) or pyarrow ListArray (parquet)
    offsets: np.ndarray | None = None


class TokenDataset:
    """Read-only view over a sharded token dataset; sample ids are global across shards.

    `lengths` and `domains` come from the index files, so length- and domain-based decisions need
    no token reads; `tokens(i)` reads one sample through a memmap.
    """

    def __init__(self, root: str | os.PathLike, verify: bool = False) -> None:
        self.root = _path(root, "root")
        index_path = self.root / INDEX_NAME
        if not index_path.is_file():
            raise ShardError(INDEX_NAME, f"missing index file {index_path}")
        try:
            index = json.loads(index_path.read_text())
        except json.JSONDecodeError as exc:
            raise ShardError(INDEX_NAME, f"index is not valid JSON: {exc}") from exc
        self.verify = check_choice(verify, "verify", (False, True))
        metas = self._check_index(index)
        self.domain_names: list[str] = list(index["domains"])
        self._shards: list[_Shard] = []
        lengths, domains = [], []
        for meta in metas:
            shard = _Shard(meta["name"], meta["format"], int(meta["num_samples"]), int(meta["num_tokens"]))
            lens, doms = self._open(shard, meta.get("crc32", {}), verify)
            if doms.size and (doms.min() < 0 or doms.max() >= len(self.domain_names)):
                raise ShardError(shard.name, f"domain ids outside 0..{len(self.domain_names) - 1} (corrupt)")
            self._shards.append(shard)
            lengths.append(lens)
            domains.append(doms)
        self.lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        self.domains = np.concatenate(domains).astype(np.int64) if domains else np.zeros(0, np.int64)
        self._starts = np.concatenate([[0], np.cumsum([s.num_samples for s in self._shards])]).astype(np.int64)

    def _check_index(self, index: Any) -> list[dict]:
        """The index's shard entries, after checking every field a reader relies on."""
        def bad(what: str) -> ShardError:
            return ShardError(INDEX_NAME, f"{self.root / INDEX_NAME}: {what}")

        if not isinstance(index, dict):
            raise bad(f"expected a JSON object, got {type(index).__name__}")
        for key in ("dtype", "domains", "shards"):
            if key not in index:
                raise bad(f"missing key {key!r}")
        try:
            self.dtype = np.dtype(index["dtype"])
        except TypeError:
            raise bad(f"'dtype': expected a numpy integer dtype name, got {index['dtype']!r}") from None
        if self.dtype.kind not in "ui":
            raise bad(f"'dtype': expected an integer dtype, got {self.dtype}")
        if not isinstance(index["domains"], list) or not all(isinstance(d, str) for d in index["domains"]):
            raise bad(f"'domains': expected a list of names, got {index['domains']!r}")
        if not isinstance(index["shards"], list):
            raise bad(f"'shards': expected a list, got {type(index['shards']).__name__}")
        seen = set()
        for k, meta in enumerate(index["shards"]):
            if not isinstance(meta, dict):
                raise bad(f"'shards'[{k}]: expected an object, got {type(meta).__name__}")
            for key in ("name", "format", "num_samples", "num_tokens"):
                if key not in meta:
                    raise bad(f"'shards'[{k}]: missing key {key!r}")
            name = meta["name"]
            if not isinstance(name, str) or not _SHARD_NAME.fullmatch(name) or ".." in name:
                raise bad(f"'shards'[{k}]['name']: expected a plain file name inside the dataset, got {name!r}")
            if name in seen:
                raise bad(f"'shards'[{k}]['name']: {name!r} appears twice")
            seen.add(name)
            if meta["format"] not in ("npy", "parquet"):
                raise bad(f"'shards'[{k}]['format']: expected 'npy' or 'parquet', got {meta['format']!r}")
            for key in ("num_samples", "num_tokens"):
                v = meta[key]
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise bad(f"'shards'[{k}][{key!r}]: expected an integer >= 0, got {v!r}")
            if not isinstance(meta.get("crc32", {}), dict):
                raise bad(f"'shards'[{k}]['crc32']: expected an object, got {meta['crc32']!r}")
        return index["shards"]

    def __getstate__(self) -> dict:
        # Workers reopen the memmaps instead of pickling mapped arrays; `verify` travels with them.
        return {"root": str(self.root), "verify": self.verify}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["root"], verify=state.get("verify", False))

    def _file(self, shard: _Shard, ext: str) -> Path:
        path = self.root / f"{shard.name}.{ext}"
        if path.is_symlink() and not os.path.realpath(path).startswith(os.path.realpath(self.root) + os.sep):
            raise ShardError(shard.name, f"{path} is a symlink leading outside the dataset root")
        if not path.is_file():
            raise ShardError(shard.name, f"missing file {path}")
        return path

    def _open(self, shard: _Shard, crc: dict, verify: bool) -> tuple[np.ndarray, np.ndarray]:
        exts = ["tokens", "offsets", "domains"] if shard.format == "npy" else ["parquet"]
        paths = {ext: self._file(shard, ext) for ext in exts}
        if verify:
            for ext, path in paths.items():
                if ext in crc and _crc32(path) != crc[ext]:
                    raise ShardError(shard.name, f"checksum mismatch in {path} (file is corrupt)")
        if shard.format == "parquet":
            _, pq = _pyarrow()
            try:
                table = pq.read_table(paths["parquet"])
            except Exception as exc:  # pyarrow raises several types for damaged files
                raise ShardError(shard.name, f"cannot read {paths['parquet']}: {exc}") from exc
            if table.num_rows != shard.num_samples:
                raise ShardError(shard.name, f"expected {shard.num_samples} rows, found {table.num_rows}")
            shard.tokens = table.column("tokens").combine_chunks()
            return (table.column("length").to_numpy().astype(np.int64),
                    table.column("domain").to_numpy().astype(np.int64))
        expected = {"tokens": shard.num_tokens * self.dtype.itemsize, "offsets": (shard.num_samples + 1) * 8,
                    "domains": shard.num_samples * 2}
        for ext, size in expected.items():
            actual = paths[ext].stat().st_size
            if actual != size:
                raise ShardError(shard.name, f"{paths[ext]} has {actual} bytes, expected {size} (truncated or corrupt)")
        offsets = np.fromfile(paths["offsets"], dtype=np.int64)
        if offsets[0] != 0 or offsets[-1] != shard.num_tokens or bool((np.diff(offsets) < 0).any()):
            raise ShardError(shard.name, f"{paths['offsets']} is not a valid offset table (corrupt)")
        shard.offsets = offsets
        shard.tokens = (np.memmap(paths["tokens"], dtype=self.dtype, mode="r") if shard.num_tokens
                        else np.zeros(0, self.dtype))
        return np.diff(offsets), np.fromfile(paths["domains"], dtype=np.int16)

    def __len__(self) -> int:
        return int(self._starts[-1])

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def shard_names(self) -> list[str]:
        return [s.name for s in self._shards]

    def _check_id(self, i: Any) -> int:
        if isinstance(i, np.ndarray) and i.ndim == 0:
            i = i.item()
        i = check_int(i, "sample id")
        if not 0 <= i < len(self):
            raise SampleIndexError(f"sample id: expected 0..{len(self) - 1}, got {i}")
        return i

    def locate(self, i: int) -> tuple[str, int]:
        """(shard name, index inside the shard) of global sample i."""
        i = self._check_id(i)
        s = int(np.searchsorted(self._starts, i, side="right")) - 1
        return self._shards[s].name, i - int(self._starts[s])

    def tokens(self, i: int) -> np.ndarray:
        """Token ids of sample i (a copy, int64)."""
        i = self._check_id(i)
        s = int(np.searchsorted(self._starts, i, side="right")) - 1
        shard, j = self._shards[s], i - int(self._starts[s])
        if shard.format == "parquet":
            return np.asarray(shard.tokens[j].values.to_numpy(zero_copy_only=False), dtype=np.int64)
        lo, hi = shard.offsets[j], shard.offsets[j + 1]
        return np.asarray(shard.tokens[lo:hi], dtype=np.int64)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.tokens(i)

    def domain_ids(self, domain: int | str) -> np.ndarray:
        if isinstance(domain, str):
            if domain not in self.domain_names:
                raise ArgumentError(f"domain: expected one of {self.domain_names}, got {domain!r}")
            d = self.domain_names.index(domain)
        else:
            d = check_int(domain, "domain", lo=0, hi=max(len(self.domain_names) - 1, 0))
        return np.flatnonzero(self.domains == d)
