"""The test helper that tells a near tie from a different output (``greedy.py``)."""

from greedy import TIE, greedy_difference


def _run(tokens, *steps):
    return {"tokens": tokens, "logprobs": [{str(t): lp for t, lp in step.items()} for step in steps]}


def test_equal_outputs_need_no_logprobs():
    assert greedy_difference({"tokens": [1, 2]}, {"tokens": [1, 2]}) is None


def test_a_difference_at_a_near_tie_in_both_runs_is_forgiven():
    ref = _run([5, 7, 9], {5: -7.60}, {7: -7.50, 8: -7.50 - TIE / 2}, {9: -7.7})
    got = _run([5, 8, 3], {5: -7.60}, {8: -7.51, 7: -7.51}, {3: -7.4})  # an exact tie, then anything
    assert greedy_difference(got, ref) is None


def test_a_difference_the_reference_does_not_rank_close_is_wrong():
    ref = _run([5, 7], {5: -7.6}, {7: -7.50, 8: -7.50 - 4 * TIE})
    got = _run([5, 8], {5: -7.6}, {8: -7.51, 7: -7.52})
    assert "no near tie" in greedy_difference(got, ref)


def test_a_difference_the_output_itself_does_not_rank_close_is_wrong():
    ref = _run([5, 7], {5: -7.6}, {7: -7.50, 8: -7.50})
    got = _run([5, 8], {5: -7.6}, {8: -7.0, 7: -7.5})
    assert "the got run put 7 0.5000 below 8" in greedy_difference(got, ref)


def test_a_token_outside_the_top_logprobs_or_no_logprobs_is_wrong():
    ref = _run([5, 7], {5: -7.6}, {7: -7.50, 9: -7.50})
    got = _run([5, 8], {5: -7.6}, {8: -7.5, 7: -7.5})
    assert "not among the reference run's top logprobs" in greedy_difference(got, ref)
    assert "kept no logprobs" in greedy_difference({"tokens": [5, 8]}, ref)
    assert "3 tokens against 2" in greedy_difference({"tokens": [5, 7, 1]}, ref)
