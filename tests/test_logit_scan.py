"""The compiled passes over a row of logits (edgellm.generation.logit_scan) against numpy: np.argmax and the count of
non-finite values for scan, a full lexsort for top_k, and the sampler's draws through either path."""
import numpy as np
import pytest

from edgellm.errors import NumericalError, SamplingError
from edgellm.generation import logit_scan
from edgellm.generation.decoding import check_finite, take_row
from edgellm.generation.sampling import Sampler, SamplingParams, as_logits, token_logprobs, top_k_indices

SIZES = [1, 5, 63, 64, 65, 1000, 49152, 262144, 262147]  # below, at and around a chunk; both real vocabularies


def _row(n, seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * 4).astype(np.float32)


def _full_sort_top(x, k):
    return np.lexsort((np.arange(x.size), -x))[:k]


@pytest.mark.parametrize("n", SIZES)
def test_scan_is_argmax_and_counts_non_finite(n):
    x = _row(n, n)
    assert logit_scan.scan(x)[:2] == (0, int(np.argmax(x)))
    x[np.random.default_rng(1).integers(0, n, 3)] = x.max()  # equal maxima: the first one
    assert logit_scan.scan(x)[:2] == (0, int(np.argmax(x)))
    x[-1] = x.max() + 1  # the largest in the ragged tail (or the last chunk)
    assert logit_scan.scan(x)[:2] == (0, n - 1)
    for bad in (np.nan, np.inf, -np.inf, -np.nan):
        y = x.copy()
        y[n // 2] = bad
        y[0] = bad
        assert logit_scan.scan(y)[0] == int((~np.isfinite(y)).sum())


def test_scan_signed_zeros_and_negative_rows():
    x = np.full(300, -5.0, np.float32)
    x[[70, 200]] = [-0.0, 0.0]  # equal values: np.argmax takes the first, whatever its sign bit
    assert logit_scan.scan(x)[:2] == (0, 70) == (0, int(np.argmax(x)))
    x[[70, 200]] = [0.0, -0.0]
    assert logit_scan.scan(x)[:2] == (0, 70)
    y = -np.abs(_row(1000, 3)) - 1  # every key negative
    assert logit_scan.scan(y)[:2] == (0, int(np.argmax(y)))
    tiny = np.array([-np.float32(1e-45), -0.0, np.float32(1e-45)], np.float32)  # denormals order as floats
    assert logit_scan.scan(tiny)[:2] == (0, 2)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("k", [1, 40, 333])
def test_top_k_matches_a_full_sort_and_the_numpy_path(n, k):
    rng = np.random.default_rng(n + k)
    x = _row(n, n + k)
    x[rng.integers(0, n, 30)] = x.max()  # ties at the very top
    x[rng.integers(0, n, 200)] = np.float32(np.sort(x)[-min(k, n)])  # ties right at the cut
    expected = _full_sort_top(x, k)
    np.testing.assert_array_equal(logit_scan.top_k(x, k), expected)
    np.testing.assert_array_equal(logit_scan.top_k(x, k, logit_scan.scan(x)[2]), expected)  # the scan's maxima
    np.testing.assert_array_equal(top_k_indices(x, k), expected)


def test_top_k_hard_orders_and_banned_tokens():
    ascending = np.arange(100_000, dtype=np.float32)  # every chunk maximum replaces one in the running set
    np.testing.assert_array_equal(logit_scan.top_k(ascending, 40), _full_sort_top(ascending, 40))
    flat = np.zeros(5000, np.float32)
    flat[[10, 3000]] = -0.0
    assert logit_scan.top_k(flat, 4).tolist() == [0, 1, 2, 3]
    banned = np.full(70_000, -np.inf, np.float32)  # a row where a few tokens are allowed (a grammar's mask)
    banned[[5, 69_999, 3333]] = [1.0, 2.0, 1.0]
    assert logit_scan.top_k(banned, 5).tolist() == [69_999, 5, 3333, 0, 1]
    assert logit_scan.top_k(banned, 5).tolist() == top_k_indices(banned, 5).tolist()
    assert logit_scan.top_k(_row(10, 0), 0).size == 0
    assert logit_scan.top_k(_row(10, 0), 50).tolist() == _full_sort_top(_row(10, 0), 50).tolist()


@pytest.mark.parametrize("params", [SamplingParams(temperature=0), SamplingParams(),
                                    SamplingParams(top_k=5, top_p=0.5, repeat_penalty=1.3)])
def test_sampler_draws_the_same_tokens_through_either_path(params):
    """A strided row takes the numpy path (the compiled passes need contiguous rows), a contiguous one the
    compiled passes, with or without check_finite's scan handed on: the same draws from the same seed."""
    rows = np.repeat(_row(262144 * 3, 9).reshape(3, 262144), 2, axis=1)  # each value twice: [::2] is the row
    fast, handed, slow = Sampler(params, seed=7), Sampler(params, seed=7), Sampler(params, seed=7)
    history = [1, 2, 3, 2]
    for row in rows:
        strided = row[::2]
        contiguous = np.ascontiguousarray(strided)
        assert not strided.flags.c_contiguous and check_finite(strided, "here") is None
        scanned = check_finite(contiguous, "here")
        assert scanned[0] == int(np.argmax(contiguous))
        for _ in range(4):
            token = slow.sample(strided, history)
            assert fast.sample(contiguous, history) == token == handed.sample(contiguous, history, scanned)


def test_checks_refuse_what_they_refused_before():
    x = _row(70_000, 2)
    x[123] = np.nan
    with pytest.raises(NumericalError, match="1 NaN and 0 Inf"):
        check_finite(x, "here")
    with pytest.raises(SamplingError, match="NaN"):
        as_logits(x)
    x[123] = np.inf
    with pytest.raises(SamplingError, match=r"\+Inf"):
        as_logits(x)
    x[123] = -np.inf  # a banned token: the sampler takes it, the model's own rows may not hold it
    assert as_logits(x) is x
    with pytest.raises(NumericalError, match="0 NaN and 1 Inf"):
        check_finite(x, "here")
    with pytest.raises(SamplingError, match="every logit is -Inf"):
        as_logits(np.full(100, -np.inf, np.float32))
    check_finite(_row(70_000, 3), "here")
    check_finite(_row(70_000, 3)[::2], "here")  # the numpy path
    with pytest.raises(NumericalError):
        check_finite(np.array([[1.0, np.nan]], np.float32), "rows")


def test_take_row_copies_and_scans_in_one_pass():
    """The scheduler copies each row out of the engine's reused buffer: the copy is the row's, and check_finite
    takes the scan made on the way instead of reading the copy again."""
    buffer = _row(2 * 262147, 4).reshape(2, 262147)
    copy, found = take_row(buffer[1])
    np.testing.assert_array_equal(copy, buffer[1])
    assert not np.shares_memory(copy, buffer)
    assert found[:2] == (0, int(np.argmax(buffer[1])))
    np.testing.assert_array_equal(found[2], logit_scan.scan(buffer[1])[2])
    assert check_finite(copy, "here", found)[0] == found[1]
    buffer[1, 777] = np.inf
    copy, found = take_row(buffer[1])
    assert copy[777] == np.inf and found[0] == 1
    with pytest.raises(NumericalError, match="0 NaN and 1 Inf"):
        check_finite(copy, "here", found)
    strided = buffer[:, 5]  # a column: the numpy path, no scan
    copy, found = take_row(strided)
    assert found is None and copy.flags.c_contiguous and copy.tolist() == strided.tolist()


def test_logprobs_take_the_handed_on_scan_with_the_same_answer():
    row = _row(262144, 6)
    row[[10, 20_000]] = row.max()  # a tie among the alternatives
    scanned = check_finite(row, "here")
    for token in (10, 123, int(np.argmin(row))):
        assert token_logprobs(row, token, 5, scanned) == token_logprobs(row, token, 5) == \
            token_logprobs(np.repeat(row, 2)[::2], token, 5)  # compiled with the scan, compiled alone, numpy
