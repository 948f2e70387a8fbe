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


def test_a_unit_inside_another_or_never_run_takes_no_place_in_a_span():
    """MBart's attention units run inside its layer units, and its decoder built alone never
    runs the cross-attention unit: the engine recomputes both with their layer. The plan opened
    a span at each (a layer joined the span of the unit before it: the peak 30% low at ci 2)."""
    inner = (False, True, True, False, True, True)  # layer, self-attention, cross-attention, ...
    assert spans.first_units(6, 2, (), inner) == [0, 0, 0, 0, 0, 0]
    assert spans.first_units(6, 1, (), inner) == [0, 0, 0, 3, 3, 3]
    assert spans.first_units(6, 1, (False, False, False, True, False, False), inner)[3] == 3
    nine = inner + inner[:3]
    first = tuple(spans.first_units(9, 3, (), nine))
    assert first == (0,) * 9
    # Only the layers count for what a recomputation frees: the last one and one prefetched stay.
    assert spans.recompute_freed(first, 8, 1, nine) == (0,)
    assert spans.recompute_freed(first, 7, 1, nine) == ()  # not the span's last


def test_a_unit_called_again_opens_a_span_per_call():
    # The engine never puts a module twice in one span: ALBERT's one shared layer, called 6
    # times, checkpoints 6 inputs and recomputes one call at a time, at any ci.
    assert spans.first_units(1, 2, calls=(6,)) == [0]
    assert spans.span_starts([0], (6,)) == [6]
    # two shared layers, 3 calls each, ci 2: [0] [0] [0 1] [1] [1]
    first = spans.first_units(2, 2, calls=(3, 3))
    assert first == [0, 0] and spans.span_starts(first, (3, 3)) == [3, 2]
    # blocks 0 1 1 2 3, ci 2: [0 1] [1 2] [3]
    first = spans.first_units(4, 2, calls=(1, 2, 1, 1))
    assert first == [0, 0, 1, 3] and spans.span_starts(first, (1, 2, 1, 1)) == [1, 1, 0, 1]
    assert spans.first_units(4, 2) == [0, 0, 2, 2]  # (called once each)
