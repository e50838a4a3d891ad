import numpy as np
import pytest
import scipy.sparse as ss
import torch
from dataengine.formats import BSRMatrix, COOMatrix, CSRMatrix


def _sparse_dense(rng, shape=(12, 16), density=0.2):
    a = rng.standard_normal(shape)
    a[rng.random(shape) > density] = 0
    return a


def test_coo_csr_dense_round_trip(rng):
    a = _sparse_dense(rng)
    coo = COOMatrix.from_dense(a)
    np.testing.assert_array_equal(coo.to_dense(), a)
    csr = coo.to_csr()
    np.testing.assert_array_equal(csr.to_dense(), a)
    np.testing.assert_array_equal(csr.to_coo().to_dense(), a)


def test_torch_interop(rng):
    a = _sparse_dense(rng)
    t = torch.from_numpy(a)
    csr = CSRMatrix.from_dense(a)
    np.testing.assert_array_equal(csr.to_torch().to_dense().numpy(), a)
    np.testing.assert_array_equal(CSRMatrix.from_torch(t.to_sparse_csr()).to_dense(), a)
    np.testing.assert_array_equal(COOMatrix.from_torch(t.to_sparse_coo()).to_dense(), a)
    np.testing.assert_array_equal(COOMatrix.from_dense(a).to_torch().to_dense().numpy(), a)
    bsr = BSRMatrix.from_dense(a, (4, 4))
    np.testing.assert_array_equal(bsr.to_torch().to_dense().numpy(), a)
    back = BSRMatrix.from_torch(t.to_sparse_bsr((4, 4)))
    np.testing.assert_array_equal(back.to_dense(), a)
    assert back.blocksize == (4, 4)


def test_scipy_interop(rng):
    a = _sparse_dense(rng)
    np.testing.assert_array_equal(CSRMatrix.from_dense(a).to_scipy().toarray(), a)
    np.testing.assert_array_equal(CSRMatrix.from_scipy(ss.csr_matrix(a)).to_dense(), a)
    np.testing.assert_array_equal(COOMatrix.from_scipy(ss.coo_matrix(a)).to_dense(), a)
    np.testing.assert_array_equal(COOMatrix.from_dense(a).to_scipy().toarray(), a)
    bsr = BSRMatrix.from_dense(a, (3, 4))
    np.testing.assert_array_equal(bsr.to_scipy().toarray(), a)
    np.testing.assert_array_equal(BSRMatrix.from_scipy(ss.csr_matrix(a), (3, 4)).to_dense(), a)


def test_bsr_only_stores_nonzero_blocks():
    a = np.zeros((8, 8))
    a[0, 5] = 1.0
    a[6, 1] = 2.0
    bsr = BSRMatrix.from_dense(a, (4, 4))
    assert bsr.indptr.tolist() == [0, 1, 2] and bsr.indices.tolist() == [1, 0]
    assert bsr.blocks.shape == (2, 4, 4)


def test_bad_shapes_named():
    with pytest.raises(ValueError, match="blocksize"):
        BSRMatrix.from_dense(np.zeros((6, 8)), (4, 4))
    with pytest.raises(ValueError, match="indptr: expected length 4"):
        CSRMatrix(np.array([0, 1]), np.array([0]), np.array([1.0]), (3, 3))
    with pytest.raises(ValueError, match="x: expected a 2-D"):
        COOMatrix.from_dense(np.zeros(3))
