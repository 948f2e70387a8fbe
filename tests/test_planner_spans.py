"""Activation-checkpoint spans as the engine forms them, and what a recomputation frees."""

from zeroshard.planner import spans


def test_spans_break_where_the_units_do_not_chain():
    assert spans.first_units(5, 2) == [0, 0, 2, 2, 4]
    assert spans.first_units(4, 9) == [0, 0, 0, 0]
    # T5: the decoder's first block is fed the decoder's embeddings, not the encoder's output.
    assert spans.first_units(4, 4, (False, True, False, True)) == [0, 0, 2, 2]


def test_a_recomputation_frees_the_span_s_units_but_the_prefetched_ones():
    first = tuple(spans.first_units(6, 6))
    assert list(spans.recompute_freed(first, 5, 1)) == [0, 1, 2, 3]  # 4 prefetched, 5 computing
    assert list(spans.recompute_freed(first, 4, 1)) == []  # not a span's last
    first = tuple(spans.first_units(4, 2))
    assert [list(spans.recompute_freed(first, i, 1)) for i in range(4)] == [[], [], [], []]
    assert list(spans.recompute_freed(first, 3, 0)) == [2]
