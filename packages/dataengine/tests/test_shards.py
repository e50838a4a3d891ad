import numpy as np
import pytest
from dataengine.data import ShardError, TokenDataset, write_dataset


def test_round_trip_and_index(small_dataset):
    ds, samples, domains = small_dataset
    assert len(ds) == 600 and len(ds.shard_names) > 3
    assert ds.num_tokens == sum(len(s) for s in samples)
    for i in [0, 1, 137, 599]:
        np.testing.assert_array_equal(ds.tokens(i), samples[i])
    np.testing.assert_array_equal(ds.lengths, [len(s) for s in samples])
    np.testing.assert_array_equal(ds.domains, domains)
    name, j = ds.locate(599)
    assert name == ds.shard_names[-1]
    assert set(ds.domain_ids("code")) == {i for i, d in enumerate(domains) if d == 1}
    with pytest.raises(IndexError, match="sample id"):
        ds.tokens(600)


def test_parquet_shards(tmp_path):
    pytest.importorskip("pyarrow")
    samples = [np.arange(n) for n in (3, 0, 7, 12)]
    ds = write_dataset(tmp_path, samples, [0, 1, 1, 0], ("a", "b"), format="parquet", shard_tokens=10)
    assert len(ds.shard_names) == 2
    for i, s in enumerate(samples):
        np.testing.assert_array_equal(ds.tokens(i), s)
    np.testing.assert_array_equal(ds.domains, [0, 1, 1, 0])


def test_missing_shard_named(small_dataset):
    ds, *_ = small_dataset
    (ds.root / "shard_00002.tokens").unlink()
    with pytest.raises(ShardError, match=r"shard 'shard_00002': missing file .*shard_00002.tokens"):
        TokenDataset(ds.root)


def test_truncated_shard_named(small_dataset):
    ds, *_ = small_dataset
    path = ds.root / "shard_00001.tokens"
    path.write_bytes(path.read_bytes()[:-6])
    with pytest.raises(ShardError, match=r"shard 'shard_00001'.*truncated or corrupt"):
        TokenDataset(ds.root)


def test_bad_offsets_and_checksum_named(small_dataset):
    ds, *_ = small_dataset
    off = ds.root / "shard_00003.offsets"
    arr = np.fromfile(off, dtype=np.int64)
    arr[2], arr[3] = arr[3] + 5, arr[2]
    arr.tofile(off)
    with pytest.raises(ShardError, match=r"shard 'shard_00003'.*not a valid offset table"):
        TokenDataset(ds.root)
    # A flipped token byte keeps every size right; only the checksum catches it.
    arr[2], arr[3] = arr[3], arr[2] - 5
    arr.tofile(off)
    tok = ds.root / "shard_00000.tokens"
    raw = bytearray(tok.read_bytes())
    raw[10] ^= 0xFF
    tok.write_bytes(bytes(raw))
    TokenDataset(ds.root)  # sizes fine
    with pytest.raises(ShardError, match=r"shard 'shard_00000': checksum mismatch"):
        TokenDataset(ds.root, verify=True)


def test_writer_validates(tmp_path):
    with pytest.raises(ValueError, match="tokens: expected ids in 0..65535"):
        write_dataset(tmp_path, [np.array([70000])])
    with pytest.raises(ValueError, match="domain"):
        write_dataset(tmp_path / "b", [np.array([1])], domains=["zzz"])
    with pytest.raises(ShardError, match="missing index"):
        TokenDataset(tmp_path / "nothing")
