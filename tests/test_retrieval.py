"""Retrieval generators: the needle is in the haystack and prompts hit their token targets."""

import pytest

from quantkit.calib.data import builtin_texts
from quantkit.eval.retrieval import TASKS, Filler, build_item, generate, score


@pytest.fixture(scope="module")
def count(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    return lambda text: len(tok(text, add_special_tokens=False)["input_ids"])


@pytest.fixture(scope="module")
def filler():
    return Filler(builtin_texts("eval"))


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("length", [512, 2048])
def test_needles_present_and_length_on_target(task, length, count, filler):
    item = build_item(task, length, 0.5, seed=3, count=count, filler=filler)
    assert length - 40 <= item.tokens <= length, (item.tokens, length)
    for answer in item.answers:
        assert answer in item.prompt
    if task in ("variable_tracking",):
        assert all(f"VAR {a}" in item.prompt for a in item.answers)


def test_depth_moves_the_needle(count, filler):
    first = build_item("niah_number", 1024, 0.0, seed=1, count=count, filler=filler)
    last = build_item("niah_number", 1024, 1.0, seed=1, count=count, filler=filler)
    pos = lambda item: item.prompt.index(item.answers[0]) / len(item.prompt)
    assert pos(first) < 0.15 and pos(last) > 0.8


def test_generation_is_deterministic(count, filler):
    a = generate(["passkey", "json_kv"], [512], 3, seed=7, count=count, filler=filler)
    b = generate(["passkey", "json_kv"], [512], 3, seed=7, count=count, filler=filler)
    assert [x.prompt for x in a] == [x.prompt for x in b] and len({x.id for x in a}) == 6


def test_ruler_string_match():
    assert score("The pass key is 12345.", ["12345"]) == 1.0
    assert score("XYZ and abc", ["xyz", "ABC", "def"]) == pytest.approx(2 / 3)


def test_items_of_one_length_share_the_haystack_up_to_their_needle(count, filler):
    """So a prefix cache computes it once: a shallower needle's prompt, cut at its needle, begins a deeper one's."""
    deep = build_item("niah_number", 1024, 1.0, seed=1, count=count, filler=filler, haystack_seed=0)
    shallow = build_item("passkey", 1024, 0.5, seed=2, count=count, filler=filler, haystack_seed=0)
    cut = shallow.prompt.index("The pass key is")
    assert cut > len(shallow.prompt) // 3 and deep.prompt.startswith(shallow.prompt[:cut])
    other = build_item("passkey", 1024, 0.5, seed=2, count=count, filler=filler, haystack_seed=1)
    assert other.prompt[:cut] != shallow.prompt[:cut]


def test_default_items_cover_every_depth_deepest_first(count, filler):
    items = generate(list(TASKS), [512, 1024], 3, seed=0, count=count, filler=filler)
    for length in (512, 1024):
        depths = [it.depth for it in items if it.length == length]
        assert len(depths) == 3 * len(TASKS) and set(depths) == {0.0, 0.25, 0.5, 0.75, 1.0}
        assert depths == sorted(depths, reverse=True)
    assert [it.length for it in items] == sorted(it.length for it in items)
