import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workbench.data import ByteTokenizer, ShardedSampler, TokenDataset, load_corpus, make_lm_data

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "workbench" / "assets" / "corpus.txt"


def test_corpus_size_and_content():
    text = load_corpus()
    assert 0 < len(text.encode()) <= 300 * 1024
    lines = text.splitlines()
    assert any("=" in line for line in lines) and any(line.endswith(".") for line in lines)


def test_corpus_generator_is_deterministic(tmp_path):
    out = tmp_path / "corpus.txt"
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_corpus.py"), "--out", str(out)], check=True,
                   capture_output=True)
    assert out.read_bytes() == SHIPPED.read_bytes()


def test_load_corpus_user_file(tmp_path):
    f = tmp_path / "mine.txt"
    f.write_text("hello\n", encoding="utf-8")
    assert load_corpus(str(f)) == "hello\n"
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        load_corpus(str(tmp_path / "nope.txt"))


def test_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "317+48=365\nThe cat sees a red ball. ünïcödé ✓"
    ids = tok.encode(text)
    assert ids.dtype == torch.long and int(ids.max()) < tok.vocab_size == 256
    assert tok.decode(ids) == text
    assert tok.decode(ids.tolist()) == text
    assert tok.encode("").numel() == 0
    assert "\ufffd" in tok.decode([0xFF])  # invalid utf-8 decodes with replacement, never raises


def test_dataset_windows_and_shift():
    tokens = torch.arange(23)
    ds = TokenDataset(tokens, seq_len=5)
    assert len(ds) == 4  # (23 - 1) // 5
    x, y = ds.get([0, 3])
    assert x.shape == y.shape == (2, 5)
    assert torch.equal(x[0], torch.arange(0, 5)) and torch.equal(y[0], torch.arange(1, 6))
    assert torch.equal(x[1], torch.arange(15, 20)) and torch.equal(y[1], torch.arange(16, 21))


def test_dataset_too_short():
    TokenDataset(torch.arange(6), seq_len=5)  # exactly one window fits
    with pytest.raises(ValueError, match="too short"):
        TokenDataset(torch.arange(5), seq_len=5)


def test_make_lm_data():
    ds = make_lm_data(64)
    x, y = ds.get([0])
    assert len(ds) > 1000 and x.shape == (1, 64)
    assert torch.equal(x[0, 1:], y[0, :-1])


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_shards_partition_global_batch(dp_size):
    samplers = [ShardedSampler(100, 8, dp_rank=r, dp_size=dp_size, seed=3) for r in range(dp_size)]
    single = ShardedSampler(100, 8, seed=3)
    for step in [0, 1, 11, 12, 13, 40]:  # 12 batches per epoch: crosses several epoch boundaries
        shards = [s.indices(step) for s in samplers]
        assert all(len(sh) == 8 // dp_size for sh in shards)
        assert sum(shards, []) == samplers[0].global_indices(step) == single.global_indices(step)
        assert len(set(single.global_indices(step))) == 8


def test_epochs_cover_windows_and_reshuffle():
    s = ShardedSampler(20, 5, seed=0)
    epoch0 = sum((s.global_indices(i) for i in range(4)), [])
    epoch1 = sum((s.global_indices(i) for i in range(4, 8)), [])
    assert sorted(epoch0) == sorted(epoch1) == list(range(20))
    assert epoch0 != epoch1
    assert ShardedSampler(20, 5, seed=1).global_indices(0) != s.global_indices(0)


def test_tail_of_epoch_dropped():
    s = ShardedSampler(10, 4, seed=0)  # 2 full batches per epoch, 2 windows dropped
    assert s.batches_per_epoch == 2
    assert s.global_indices(2) == ShardedSampler(10, 4, seed=0).global_indices(2)
    assert len(set(s.global_indices(0) + s.global_indices(1))) == 8


def test_iteration_and_resume():
    a = ShardedSampler(50, 4, dp_rank=1, dp_size=2, seed=7)
    it = iter(a)
    first = [next(it) for _ in range(5)]
    assert first == [a.indices(i) for i in range(5)] and a.step == 5 and a.local_batch == 2
    state = a.state_dict()
    assert state == {"step": 5, "seed": 7, "global_batch": 4}
    expected = [next(it) for _ in range(10)]
    b = ShardedSampler(50, 4, dp_rank=1, dp_size=2, seed=7)
    b.load_state_dict(state)
    it_b = iter(b)
    assert [next(it_b) for _ in range(10)] == expected
    # Resuming on a different dp size continues the same global order.
    c = ShardedSampler(50, 4, seed=7)
    c.load_state_dict(state)
    assert c.indices(c.step) == a.global_indices(5)


def test_resume_mismatch():
    s = ShardedSampler(50, 4, seed=7)
    with pytest.raises(ValueError, match="seed"):
        s.load_state_dict({"step": 3, "seed": 8, "global_batch": 4})
    with pytest.raises(ValueError, match="global_batch"):
        s.load_state_dict({"step": 3, "seed": 7, "global_batch": 8})


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_windows=100, global_batch=10, dp_size=4),
         r"global_batch in \[8, 12\].*dp_size in \[1, 2, 5, 10\]"),
        (dict(num_windows=100, global_batch=8, dp_rank=2, dp_size=2), "dp_rank=2.*0..1"),
        (dict(num_windows=100, global_batch=8, dp_rank=-1, dp_size=2), "dp_rank=-1"),
        (dict(num_windows=5, global_batch=8), "larger than"),
        (dict(num_windows=5, global_batch=0), "global_batch must be"),
        (dict(num_windows=5, global_batch=4, dp_size=0), "dp_size must be"),
    ],
)
def test_sampler_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ShardedSampler(**kwargs)
