"""Prompt lookup: the tokens after the most recent longest match of the sequence's ending."""

from __future__ import annotations

from llmserve.spec_decode.ngram_proposer import NgramProposer


def test_proposes_what_followed_the_longest_match():
    proposer = NgramProposer(num_tokens=3, min_n=2, max_n=4)
    # ending "1 2 3": matched at 0..2 (length 3) and "2 3" alone at 6..7 (length 2): the longest wins
    assert proposer.lookup([1, 2, 3, 4, 5, 9, 2, 3, 8, 1, 2, 3]) == [4, 5, 9]


def test_the_most_recent_of_equal_matches_wins():
    proposer = NgramProposer(num_tokens=2, min_n=2, max_n=2)
    assert proposer.lookup([5, 6, 1, 5, 6, 2, 5, 6]) == [2, 5]


def test_no_proposal_below_min_n_or_without_a_match():
    proposer = NgramProposer(num_tokens=4, min_n=3, max_n=4)
    assert proposer.lookup([1, 2, 7, 1, 2]) == []  # only "1 2" recurs: shorter than 3
    assert proposer.lookup([1, 2, 3, 4]) == []
    assert proposer.lookup([]) == []


def test_a_proposal_stops_at_the_end_and_at_the_asked_length():
    proposer = NgramProposer(num_tokens=5, min_n=1, max_n=3)
    assert proposer.lookup([4, 8, 4]) == [8, 4]  # what follows the match runs into the ending itself
    assert proposer.lookup([1, 2, 3, 9, 9, 1, 2, 3], num_tokens=2) == [9, 9]
    assert proposer.lookup([1, 2, 1], num_tokens=0) == []


def test_matches_longer_than_max_n_count_as_max_n():
    proposer = NgramProposer(num_tokens=1, min_n=1, max_n=2)
    # "7 1 2" matches at 0..2 (length 3, counted 2) and "1 2" at 4..5: equal, the most recent wins
    assert proposer.lookup([7, 1, 2, 10, 1, 2, 11, 7, 1, 2]) == [11]
