"""ds_async.data and ds_async.tokenizer on real text: the shared corpus and the Lee corpus embedded in gensim."""

import json
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from ds_async import hub
from ds_async.checkpoint.state import data_state_from_file, data_state_to_file
from ds_async.config import ConfigError, DataConfig, parse
from ds_async.config_sections import DataSource
from ds_async.data import (
    LEE_CORPUS,
    DataError,
    PackedBatches,
    check_encoding,
    document_encoder,
    eos_id,
    load_text_stream,
    load_tokenizer,
    open_batches,
    resolve_files,
    resolve_source,
)
from ds_async.tokenizer import main as train_tokenizer_main
from ds_async.tokenizer import train_bpe

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "corpus"


@pytest.fixture(scope="module")
def corpus() -> Path:
    if not (CORPUS / "tokenizers" / "bpe8192.json").is_file():
        pytest.skip(f"shared corpus not found at {CORPUS} (the repo must be cloned next to shared/)")
    return CORPUS


@pytest.fixture(scope="module")
def tokenizer(corpus):
    return load_tokenizer(str(corpus / "tokenizers" / "bpe8192.json"))


@pytest.fixture(scope="module")
def lee_texts() -> list[str]:
    return [row["text"] for row in load_text_stream(LEE_CORPUS, "train")]


def token_stream(tokenizer, texts) -> list[int]:
    """The packing contract, built one document at a time: tokens + EOS per document, concatenated."""
    stream = []
    for text in texts:
        stream += tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        stream.append(eos_id(tokenizer))
    return stream


def take(batches, n):
    return [next(batches) for _ in range(n)]


def flat_inputs(batches) -> list[int]:
    return torch.cat([inputs.flatten() for inputs, _ in batches]).tolist()


def documents(tokens: list[int], eos: int) -> list[tuple[int, ...]]:
    """Token sequences of the complete documents (those whose EOS is present) in a packed stream."""
    docs, start = [], 0
    for i, token in enumerate(tokens):
        if token == eos:
            docs.append(tuple(tokens[start:i]))
            start = i + 1
    return docs


def write_docs(path: Path, texts: list[str], field: str = "text") -> None:
    if path.suffix == ".txt":
        path.write_text("\n".join(texts) + "\n")
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    else:
        pq.write_table(pa.table({field: texts}), path)


def test_embedded_corpus_splits():
    builder, train = resolve_files(LEE_CORPUS, "train")
    assert builder == "text" and train.endswith("lee_background.cor")
    assert resolve_files(LEE_CORPUS, "validation")[1].endswith("lee.cor")
    texts = [row["text"] for row in load_text_stream(LEE_CORPUS, "validation")]
    assert len(texts) == 50 and all(len(t) > 100 for t in texts)
    with pytest.raises(ValueError, match="splits"):
        resolve_files(LEE_CORPUS, "test")


def test_resolve_local_files_and_hub_names(tmp_path):
    for name in ("b.txt", "a.txt", "c.cor", "d.jsonl", "e.json", "f.parquet"):
        (tmp_path / name).touch()
    assert resolve_files(str(tmp_path / "*.txt"), "train") == ("text", [str(tmp_path / n) for n in ("a.txt", "b.txt")])
    assert resolve_files(str(tmp_path / "c.cor"), "train") == ("text", [str(tmp_path / "c.cor")])
    assert resolve_files([str(tmp_path / "d.jsonl"), str(tmp_path / "e.json")], "train")[0] == "json"
    assert resolve_files(str(tmp_path / "*.parquet"), "validation") == ("parquet", [str(tmp_path / "f.parquet")])
    assert resolve_files("HuggingFaceFW/fineweb-edu", "train") == ("HuggingFaceFW/fineweb-edu", None)
    with pytest.raises(ValueError, match="extensions"):
        resolve_files([str(tmp_path / "a.txt"), str(tmp_path / "f.parquet")], "train")


def test_glob_matching_nothing_names_the_pattern(tmp_path):
    pattern = str(tmp_path / "missing-*.parquet")
    with pytest.raises(FileNotFoundError, match="missing-"):
        resolve_files(pattern, "train")


@pytest.mark.parametrize("suffix", [".txt", ".jsonl", ".parquet"])
def test_every_builder_streams_the_documents(tmp_path, lee_texts, suffix):
    texts = lee_texts[:5]
    write_docs(tmp_path / f"docs{suffix}", texts, field="body")
    rows = list(load_text_stream(str(tmp_path / f"*{suffix}"), "train", text_field="body"))
    assert [row["body"] for row in rows] == texts


# Shuffled parquet streams pause 5 s whenever an iteration ends (datasets' workaround for apache/arrow#45214),
# so the shuffled cases below read text and JSON files.
@pytest.mark.parametrize("shuffle_buffer", [0, 16])
def test_packing_emits_every_token_once_in_order(corpus, tokenizer, shuffle_buffer):
    if shuffle_buffer:
        ds = load_text_stream(LEE_CORPUS, "train")
    else:
        ds = load_text_stream(str(corpus / "enwiki-validation.parquet"), "validation")
    batches = take(PackedBatches(ds, tokenizer, seq_len=96, micro_batch_size=3, seed=5,
                                 shuffle_buffer=shuffle_buffer, tokenize_batch=4), 40)
    assert all(x.shape == y.shape == (3, 96) and x.dtype == y.dtype == torch.long for x, y in batches)

    ordered = ds.shuffle(seed=5, buffer_size=shuffle_buffer) if shuffle_buffer else ds
    texts = [row["text"] for _, row in zip(range(60), ordered)]  # 60 non-empty documents > 40 batches
    expected = token_stream(tokenizer, texts)
    inputs = flat_inputs(batches)
    labels = torch.cat([labels.flatten() for _, labels in batches]).tolist()
    assert len(expected) > len(inputs)
    assert inputs == expected[: len(inputs)]
    # Row by row: labels are the inputs shifted by one, continuing into the next row's first token.
    assert labels == expected[1 : len(inputs) + 1]


def test_end_of_stream_drops_only_the_last_partial_batch(tokenizer):
    ds = load_text_stream(LEE_CORPUS, "validation")
    batches = list(PackedBatches(ds, tokenizer, seq_len=64, micro_batch_size=2, shuffle_buffer=0, repeat=False))
    expected = token_stream(tokenizer, [row["text"] for row in ds])
    assert len(batches) == (len(expected) - 1) // 128
    assert flat_inputs(batches) == expected[: len(batches) * 128]


@pytest.mark.parametrize("num_files", [1, 4])
def test_data_parallel_ranks_read_disjoint_documents(tmp_path, tokenizer, lee_texts, num_files):
    # One file: ranks take alternate documents. Four files: ranks take alternate files.
    for i in range(num_files):
        write_docs(tmp_path / f"part{i}.jsonl", lee_texts[i * 20 : (i + 1) * 20])
    ds = load_text_stream(str(tmp_path / "*.jsonl"), "train")
    eos = eos_id(tokenizer)
    ranks = [
        documents(flat_inputs(PackedBatches(ds, tokenizer, seq_len=16, micro_batch_size=1, dp_rank=r,
                                            dp_world_size=2, seed=3, shuffle_buffer=8, repeat=False)), eos)
        for r in range(2)
    ]
    everything = documents(token_stream(tokenizer, lee_texts[: num_files * 20]), eos)
    assert set(ranks[0]).isdisjoint(ranks[1])
    assert set(ranks[0]) | set(ranks[1]) <= set(everything)
    # Each rank loses at most its last document, in the dropped partial batch.
    assert len(ranks[0]) + len(ranks[1]) >= len(everything) - 2
    if num_files == 1:
        shuffled = documents(token_stream(tokenizer, [r["text"] for r in ds.shuffle(seed=3, buffer_size=8)]), eos)
        assert ranks[0] == shuffled[0::2][: len(ranks[0])]
        assert ranks[1] == shuffled[1::2][: len(ranks[1])]


def test_same_seed_same_batches_other_seed_other_batches(tokenizer):
    ds = load_text_stream(LEE_CORPUS, "train")

    def first_batches(seed):
        return flat_inputs(take(PackedBatches(ds, tokenizer, seq_len=128, micro_batch_size=2, seed=seed,
                                              shuffle_buffer=100), 5))

    assert first_batches(1) == first_batches(1)
    assert first_batches(1) != first_batches(2)


def test_repeat_reshuffles_each_epoch(tmp_path, tokenizer, lee_texts):
    write_docs(tmp_path / "docs.txt", [t[:150] for t in lee_texts[:12]])
    batches = PackedBatches(load_text_stream(str(tmp_path / "docs.txt"), "train"), tokenizer,
                            seq_len=32, micro_batch_size=2, seed=0, shuffle_buffer=12)
    docs = documents(flat_inputs(take(batches, 40)), eos_id(tokenizer))
    assert batches.state_dict()["epoch"] >= 2
    first, second = docs[:12], docs[12:24]
    assert sorted(first) == sorted(second) and first != second


@pytest.mark.parametrize(
    ("files", "dp_rank", "dp_world_size"),
    [(["a.txt"], 0, 1), (["a.jsonl"], 1, 2), (["a.jsonl", "b.jsonl", "c.jsonl", "d.jsonl"], 1, 2)],
)
def test_resume_matches_uninterrupted_iteration(tmp_path, tokenizer, lee_texts, files, dp_rank, dp_world_size):
    # Short documents so that epochs last a few batches and resumption points land in several epochs.
    texts = [t[:120] for t in lee_texts[:12]]
    per_file = len(texts) // len(files)
    for i, name in enumerate(files):
        write_docs(tmp_path / name, texts[i * per_file : (i + 1) * per_file])
    ds = load_text_stream([str(tmp_path / name) for name in files], "train")

    def fresh():
        return PackedBatches(ds, tokenizer, seq_len=24, micro_batch_size=2, dp_rank=dp_rank,
                             dp_world_size=dp_world_size, seed=7, shuffle_buffer=6, tokenize_batch=5)

    reference = take(fresh(), 50)
    epochs = set()
    for k in (1, 5, 12, 20, 34):
        interrupted = fresh()
        take(interrupted, k)
        state = json.loads(json.dumps(interrupted.state_dict()))  # a checkpoint holds plain data
        epochs.add(state["epoch"])
        resumed = fresh()
        resumed.load_state_dict(state)
        assert resumed.tokens_seen == k * 2 * 24
        for (x, y), (ref_x, ref_y) in zip(take(resumed, 16), reference[k : k + 16]):
            assert torch.equal(x, ref_x) and torch.equal(y, ref_y)
    assert len(epochs) >= 3


def test_empty_documents_are_skipped_and_counted(tmp_path, tokenizer, lee_texts):
    texts = [lee_texts[0], "", "   \t ", lee_texts[1], "\u3000", lee_texts[2]]
    write_docs(tmp_path / "docs.jsonl", texts)
    batches = PackedBatches(load_text_stream(str(tmp_path / "docs.jsonl"), "train"), tokenizer,
                            seq_len=32, micro_batch_size=1, shuffle_buffer=0, repeat=False, tokenize_batch=2)
    inputs = flat_inputs(list(batches))
    assert batches.state_dict()["skipped_docs"] == 3
    assert inputs == token_stream(tokenizer, lee_texts[:3])[: len(inputs)]


def test_epoch_without_text_fails_instead_of_spinning(tmp_path, tokenizer):
    write_docs(tmp_path / "blank.jsonl", ["", " "])
    batches = PackedBatches(load_text_stream(str(tmp_path / "blank.jsonl"), "train"), tokenizer,
                            seq_len=8, micro_batch_size=1, source="ds_async.data.train: blank.jsonl")
    with pytest.raises(DataError, match=r"ds_async.data.train: blank.jsonl: no usable text: all 2 documents "
                                        r"data-parallel rank 0 read in a whole pass were skipped \(2 empty\)"):
        next(batches)


def _small_tokenizer(tmp_path):
    path = tmp_path / "tok" / "tokenizer.json"
    train_bpe(iter(["a few words to learn merges from", "and a few more words"] * 20), 300, str(path))
    return load_tokenizer(str(path))


def test_sources_without_usable_text_name_the_source_and_the_cause(tmp_path):
    """An empty file, rows without ``data.text_field`` and a file of nothing but non-UTF-8 lines: a DataError
    naming the source at the first ``peek`` (the trainer's check at start), which keeps nothing back."""
    tok = _small_tokenizer(tmp_path)
    (tmp_path / "empty.txt").write_text("")
    write_docs(tmp_path / "body.jsonl", ["some text", "more text"], field="body")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 cr\xe8me\nna\xefve\n".encode("latin-1"))
    cases = {"empty.txt": r"no documents \(empty\)",
             "body.jsonl": r"no usable text: .*\(2 empty\); the rows have no column 'text' "
                           r"\(ds_async.data.text_field\), they have 'body', 'id'",
             "latin1.txt": r"no usable text: .*\(2 non-utf8\); non-UTF-8 text files are skipped line by line"}
    for name, message in cases.items():
        batches = PackedBatches(load_text_stream(str(tmp_path / name), "train"), tok, seq_len=8,
                                micro_batch_size=1, source=f"ds_async.data.train: {name}")
        with pytest.raises(DataError, match=rf"^ds_async.data.train: {name}: {message}"):
            batches.peek()
    two = PackedBatches(load_text_stream(str(tmp_path / "body.jsonl"), "train"), tok, seq_len=8, micro_batch_size=1,
                        dp_rank=1, dp_world_size=2, text_field="body", source="ds_async.data.train: body.jsonl")
    next(two)
    one_doc = tmp_path / "one.jsonl"
    write_docs(one_doc, ["only one document here, read by rank 0"])
    with pytest.raises(DataError, match=r"no documents for data-parallel rank 1 of 2 \(empty, or fewer documents"):
        PackedBatches(load_text_stream(str(one_doc), "train"), tok, seq_len=8, micro_batch_size=1, dp_rank=1,
                      dp_world_size=2, source="ds_async.data.train: one.jsonl").peek()


def test_peek_keeps_the_micro_batch_and_counts_what_it_read(tmp_path, lee_texts):
    tok = _small_tokenizer(tmp_path)
    path = tmp_path / "mixed.txt"
    path.write_bytes(b"\n".join([t.encode() for t in lee_texts[:40]] + [b"\xff\xfe garbage"] * 10) + b"\n")

    def fresh():
        return PackedBatches(load_text_stream(str(path), "train"), tok, seq_len=16, micro_batch_size=2,
                             shuffle_buffer=0, tokenize_batch=64)

    peeked = fresh()
    peeked.peek()
    assert peeked.documents == 50 and peeked.skipped["non_utf8"] == 10
    plain = fresh()
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(next(peeked), next(plain)))


def test_share_of_non_utf8_documents_is_refused_or_warned_about():
    assert check_encoding(100, 9, "ds_async.data.train: x.txt") is None
    assert check_encoding(0, 0, "ds_async.data.train: x.txt") is None
    assert check_encoding(100, 10, "ds_async.data.train: x.txt") == (
        "ds_async: warning: ds_async.data.train: x.txt: 10 of the first 100 documents are not valid UTF-8 and are "
        "skipped (another encoding, or binary data mixed in?)")
    with pytest.raises(DataError, match=r"ds_async.data.train: x.txt: 50 of the first 100 documents are not valid "
                                        r"UTF-8; this is not UTF-8 text \(binary data, or another encoding"):
        check_encoding(100, 50, "ds_async.data.train: x.txt")


def test_train_bpe_and_load_it_back(tmp_path, lee_texts):
    path = train_bpe(iter(lee_texts), vocab_size=400, out_path=str(tmp_path / "new" / "tokenizer.json"))
    raw = Tokenizer.from_file(path)
    assert raw.get_vocab_size() == 400 and raw.token_to_id("<|endoftext|>") == 0

    tokenizer = load_tokenizer(path)
    assert eos_id(tokenizer) == 0
    text = "Byte-level BPE round-trips anything: naïve café, 東京, <|endoftext|>."
    ids = tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert 0 not in ids and tokenizer.decode(ids) == text


def test_document_encoder_is_the_tokenizer_call(corpus, tokenizer):
    """The streams' encoder (a copy of the Rust backend, no offsets) gives the ids of the tokenizer call on real
    documents, a literal ``<|endoftext|>`` and an empty one included, whatever truncation and padding the
    tokenizer's own backend carries (the call switches them off), and leaves that backend's settings alone."""
    texts = pq.read_table(corpus / "enwiki-validation.parquet").column("text").to_pylist()[:40]
    texts += ["a literal <|endoftext|> inside a document", ""]
    want = tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert sum(map(len, want)) > 10_000 and 0 not in want[-2] and want[-1] == []

    truncating = load_tokenizer(str(corpus / "tokenizers" / "bpe8192.json"))
    truncating.backend_tokenizer.enable_truncation(max_length=16)
    truncating.backend_tokenizer.enable_padding(length=4096)
    assert document_encoder(truncating)(texts) == want
    assert truncating.backend_tokenizer.truncation["max_length"] == 16
    assert truncating.backend_tokenizer.padding["length"] == 4096
    assert truncating.backend_tokenizer.encode_special_tokens is False


def test_tokenizer_command(tmp_path):
    out = tmp_path / "tok" / "tokenizer.json"
    train_tokenizer_main(["--data", LEE_CORPUS, "--split", "validation", "--vocab-size", "300",
                          "--max-docs", "40", "--out", str(out)])
    assert Tokenizer.from_file(str(out)).get_vocab_size() == 300


def test_tokenizer_command_trains_only_on_what_training_reads(tmp_path, lee_texts):
    """Rows the trainer skips (no text, not text, whitespace, undecodable bytes) are not the tokenizer's text: the
    command neither fails on them nor learns merges from U+FFFD's bytes, however often they repeat."""
    lines = [json.dumps(row) for row in ({"text": None}, {"text": 7}, {"text": "   "}, {"other": "no text here"})]
    lines += [json.dumps({"text": "caf\ufffd " * 50})] * 20 + [json.dumps({"text": t}) for t in lee_texts[:40]]
    (tmp_path / "docs.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "tokenizer.json"
    train_tokenizer_main(["--data", str(tmp_path / "docs.jsonl"), "--vocab-size", "400", "--out", str(out)])
    vocab = Tokenizer.from_file(str(out)).get_vocab()
    (replacement, _), = pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str("\ufffd")
    assert len(replacement) == 3 and len(vocab) == 400 and not [t for t in vocab if replacement[:2] in t]


def test_load_tokenizer(corpus, tmp_path):
    assert eos_id(load_tokenizer(str(corpus / "tokenizers" / "bpe8192.json"))) == 0
    no_eos = tmp_path / "no_eos.json"
    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(no_eos))
    with pytest.raises(ValueError, match="no EOS"):
        load_tokenizer(str(no_eos))
    with pytest.raises(FileNotFoundError):
        load_tokenizer(str(tmp_path / "absent.json"))


# ------------------------------------------------------------------ hub-style sources (issue 22): DataSource objects
def write_configs_dataset(root: Path, texts: list[str]) -> Path:
    """A script-free dataset folder as the hub holds them: README.md YAML declaring two configs with their own
    data_files (``alpha`` with train and validation splits, ``beta`` train only)."""
    (root / "alpha").mkdir(parents=True)
    (root / "beta").mkdir()
    write_docs(root / "alpha" / "train.parquet", texts[0:6])
    write_docs(root / "alpha" / "validation.parquet", texts[6:8])
    write_docs(root / "beta" / "train-0.parquet", texts[8:12], field="body")
    (root / "README.md").write_text(
        "---\nconfigs:\n- config_name: alpha\n  data_files:\n  - split: train\n    path: alpha/train.parquet\n"
        "  - split: validation\n    path: alpha/validation.parquet\n  default: true\n"
        "- config_name: beta\n  data_files: beta/*.parquet\n---\n# two configs\n")
    return root


def texts_of(batches: PackedBatches, tokenizer, n: int | None = None) -> list[str]:
    """The documents a non-repeating stream packs, decoded back (the last one may be cut off)."""
    tokens = flat_inputs(list(batches) if n is None else take(batches, n))
    return [tokenizer.decode(list(doc)) for doc in documents(tokens, eos_id(tokenizer))]


def test_data_source_objects_are_parsed_strictly():
    cfg = parse({"model": {"config": {"vocab_size": 8}}, "data": {
        "train": {"path": "allenai/c4", "name": "en", "revision": "main", "data_files": {"train": ["a/*.json.gz"]}},
        "validation": {"split": "validation"}}})
    assert cfg.data.train == DataSource(path="allenai/c4", name="en", revision="main",
                                        data_files={"train": ["a/*.json.gz"]})
    with pytest.raises(ConfigError, match=r"ds_async\.data\.train\.naem: unknown key \(did you mean "
                                          r"'ds_async\.data\.train\.name'\?\)"):
        parse({"data": {"train": {"path": "allenai/c4", "naem": "en"}}})
    with pytest.raises(ConfigError, match=r"ds_async\.data\.validation\.from_train: expected int"):
        parse({"data": {"validation": {"from_train": "10"}}})
    with pytest.raises(ConfigError, match=r"ds_async\.data\.validation: expected str or DataSource"):
        parse({"data": {"validation": 5}})

    def error(train, validation=None) -> str:
        with pytest.raises(ConfigError) as e:
            resolve_source(DataConfig(train=train, validation=validation), "validation")
        return str(e.value)

    assert error(DataSource(name="en")).startswith("ds_async.data.train.path: required")
    assert error("c4", DataSource(from_train=0)).startswith("ds_async.data.validation.from_train: must be >= 1")
    assert error("c4", DataSource(from_train=5, split="test")).startswith("ds_async.data.validation.split: not with "
                                                                          "from_train")
    assert error(DataSource(path="c4", from_train=5)).startswith("ds_async.data.train.from_train: only in")
    assert error(DataSource(path="x/*.parquet", name="en")).startswith("ds_async.data.train.name: does not apply")
    assert error("x/*.parquet", DataSource(split="validation")).startswith("ds_async.data.validation.path: required")
    assert error("c4", None).startswith("ds_async.data.validation: null")
    # Another split of the training dataset: every other field comes from data.train.
    train = DataSource(path="allenai/c4", name="en", revision="r1", data_dir="d", text_field="body")
    assert resolve_source(DataConfig(train=train, validation=DataSource(split="validation")), "validation") == \
        (DataSource(path="allenai/c4", name="en", revision="r1", data_dir="d", text_field="body",
                    split="validation"), 0)
    assert resolve_source(DataConfig(train="allenai/c4", validation=DataSource(from_train=7)), "train") == \
        (DataSource(path="allenai/c4", split="train"), 7)


def test_config_names_splits_and_data_files_of_a_local_dataset_folder(tmp_path, tokenizer, lee_texts):
    texts = [t[:80] for t in lee_texts[:12]]
    root = str(write_configs_dataset(tmp_path / "ds", texts))

    def read(train, validation=None, role="train", **data):
        cfg = DataConfig(train=train, validation=validation, shuffle_buffer=0, seq_len=8, **data)
        batches = open_batches(cfg, role, tokenizer, 1)
        if role == "train":  # the training stream repeats: one epoch's worth
            batches._repeat = False
        return texts_of(batches, tokenizer)

    def close(got, expected):  # the stream drops its last partial batch: at most one document short, cut off
        return got[: len(got) - 1] == expected[: len(got) - 1] and len(got) >= len(expected) - 1

    assert close(read({"path": root}), texts[0:6])  # the default config
    assert close(read(DataSource(path=root, name="alpha"), DataSource(split="validation"), role="validation"),
                 texts[6:8])
    assert close(read(DataSource(path=root, name="beta", text_field="body")), texts[8:12])
    assert close(read(DataSource(path=root, data_files="beta/*.parquet", text_field="body")), texts[8:12])
    assert close(read(DataSource(path="parquet", data_files={"train": [f"{root}/alpha/*.parquet"]})),
                 texts[0:6] + texts[6:8])
    with pytest.raises(DataError, match=r"^ds_async\.data\.train: .*name='gamma'.*BuilderConfig 'gamma' not found"):
        read(DataSource(path=root, name="gamma"))
    with pytest.raises(DataError, match=r"^ds_async\.data\.validation: .*Bad split: validation"):
        read(DataSource(path=root, name="beta"), DataSource(split="validation"), role="validation")


def test_every_load_dataset_argument_is_passed_through(monkeypatch):
    import datasets

    calls = []
    monkeypatch.setattr(hub, "unreachable", lambda: None)  # a hub that answers, as the stand-in load_dataset does
    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: calls.append((args, kwargs)) or
                        datasets.Dataset.from_dict({"text": ["x"]}).to_iterable_dataset())
    source = DataSource(path="allenai/c4", name="en", revision="607bd4c", data_files={"train": "en/c4-train.0000*"},
                        data_dir="en", split="train")
    load_text_stream(source, "validation")
    assert calls == [(("allenai/c4",), {"name": "en", "revision": "607bd4c", "data_dir": "en", "split": "train",
                                        "data_files": {"train": "en/c4-train.0000*"}, "streaming": True})]


def test_hf_paths_go_to_datasets_unchanged_and_fail_in_one_line():
    import os
    import subprocess
    import sys

    files = "hf://datasets/HuggingFaceFW/fineweb@v1.4.0/sample/10BT/*.parquet"
    assert resolve_files(files, "train") == ("parquet", [files])
    # Offline (as here, and made sure of by HF_HUB_OFFLINE): datasets' own error, in one line that names the key and
    # the source. A subprocess, as huggingface_hub reads HF_HUB_OFFLINE when imported.
    code = ("import sys; from ds_async.data import DataError, load_text_stream\n"
            "from ds_async.config_sections import DataSource\n"
            "for source in sys.argv[1:]:\n"
            "    try: load_text_stream(DataSource(path=source, name='sample-10BT') if source.endswith('fineweb') else "
            "source, 'train', key='ds_async.data.train')\n"
            "    except DataError as e: print(e)")
    out = subprocess.run([sys.executable, "-c", code, files, "hf://datasets/HuggingFaceFW/fineweb"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"}).stdout
    lines = out.splitlines()
    assert len(lines) == 2, out
    assert lines[0].startswith(f"ds_async.data.train: {files}: cannot open the data (")
    assert lines[1].startswith("ds_async.data.train: hf://datasets/HuggingFaceFW/fineweb (name='sample-10BT'): "
                               "cannot open the data (") and "HuggingFaceFW/fineweb" in lines[1][70:]


@pytest.mark.parametrize("dp_world_size", [1, 2])
@pytest.mark.parametrize("stored", ["jsonl", "parquet-bytes"])
def test_validation_held_out_of_a_train_only_dataset(tmp_path, tokenizer, lee_texts, dp_world_size, stored):
    """``validation.from_train``: the first documents in file order are the validation set and never trained on,
    whether the text column holds strings or UTF-8 bytes."""
    texts = [t[:100] for t in lee_texts[:24]]
    for i in range(2):
        part = texts[i * 12 : (i + 1) * 12]
        if stored == "jsonl":
            write_docs(tmp_path / f"part{i}.jsonl", part)
        else:
            pq.write_table(pa.table({"text": pa.array([t.encode() for t in part], pa.binary())}),
                           tmp_path / f"part{i}.parquet")
    cfg = DataConfig(train=str(tmp_path / f"*.{stored.split('-')[0]}"), validation=DataSource(from_train=5),
                     shuffle_buffer=6, seq_len=16)
    held = set(texts[:5])  # the first documents in file order

    validation = [texts_of(open_batches(cfg, "validation", tokenizer, 1, dp_rank=r, dp_world_size=dp_world_size),
                           tokenizer) for r in range(dp_world_size)]
    read = [t for docs in validation for t in docs]
    assert set(read) <= held and len(read) >= 5 - dp_world_size and len(set(read)) == len(read)

    skipped = 0
    for r in range(dp_world_size):
        train = open_batches(cfg, "train", tokenizer, 2, dp_rank=r, dp_world_size=dp_world_size, seed=1)
        seen = texts_of(train, tokenizer, 60)  # several epochs, each in another order
        assert train.state_dict()["epoch"] >= 2
        assert not held & set(seen) and set(seen) <= set(texts[5:])
        skipped += train.skipped["held_out"]
    assert skipped >= 2 * 5  # in two epochs or more


@pytest.mark.parametrize(("shuffle_buffer", "dp_rank", "dp_world_size"), [(0, 0, 1), (8, 0, 1), (8, 1, 2), (5, 2, 3)])
def test_resume_continues_from_the_streams_own_position(tmp_path, tokenizer, lee_texts, shuffle_buffer, dp_rank,
                                                        dp_world_size):
    """Exact resume from the stream's own state: after loading it, the documents read before the save do not pass
    through the dataset again, where the fallback for streams without a state re-reads them all. (Counts of rows
    passed vary by datasets' look-ahead of one row per interleaved file, read by threads.)"""
    texts = [t[:90] for t in lee_texts[:48]]
    for i in range(4):  # 4 files: ranks take whole files (1 or 2 ranks) or every third document (3 ranks)
        write_docs(tmp_path / f"part{i}.txt", texts[i * 12 : (i + 1) * 12])
    passed = [0]

    def count(row):
        passed[0] += 1
        return row

    ds = load_text_stream(str(tmp_path / "*.txt"), "train", text_field="body").map(count)

    def fresh():
        return PackedBatches(ds, tokenizer, seq_len=24, micro_batch_size=2, dp_rank=dp_rank,
                             dp_world_size=dp_world_size, seed=4, shuffle_buffer=shuffle_buffer, tokenize_batch=3,
                             text_field="body")

    def resume_and_compare(state, k) -> int:
        """Rows that pass through the dataset while the resumed stream yields 12 batches equal to the reference's."""
        resumed = fresh()
        passed[0] = 0
        resumed.load_state_dict(state)
        for (x, y), (ref_x, ref_y) in zip(take(resumed, 12), reference[k : k + 12]):
            assert torch.equal(x, ref_x) and torch.equal(y, ref_y)
        return passed[0]

    reference = take(fresh(), 60)
    mid_epoch = 0
    for k in (4, 9, 25, 33):
        interrupted = fresh()
        take(interrupted, k)
        state = interrupted.state_dict()
        stream = state["stream"]
        assert stream["source"] is not None or stream["read"] == 0
        # Through a checkpoint file as ds_async.checkpoint writes it (torch.load weights_only), and through JSON.
        path = tmp_path / "data.pt"
        torch.save(data_state_to_file(state), path)
        with_state = max(resume_and_compare(data_state_from_file(torch.load(path, weights_only=True)), k),
                         resume_and_compare(json.loads(json.dumps(state)), k))
        # A stream without a state: the same batches, after re-reading up to the saved count.
        interrupted._docs._source.state_dict = lambda: (_ for _ in ()).throw(NotImplementedError)
        fallback = interrupted.state_dict()
        assert fallback["stream"]["source"] is None
        rereading = resume_and_compare(fallback, k)
        if stream["read"] and not stream["exhausted"]:
            mid_epoch += 1
            assert rereading >= stream["read"] and with_state <= rereading - stream["read"] + 8
    assert mid_epoch >= 2


def test_streams_end_without_datasets_shutdown_sleep():
    """datasets sleeps at the end of every iterator over several shards (5 s, for interpreter exit only): ds_async
    turns that off while the process runs and waits once at exit instead (``ds_async.data``)."""
    import datasets

    import ds_async.data  # noqa: F401

    assert datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN == 0


def test_close_joins_the_reader_threads_now(corpus, tokenizer):
    """datasets reads the corpus' train shards with a thread pool that a dropped stream leaves to the garbage
    collector, whose join may then run inside threading's bookkeeping of a starting thread and deadlock there (a CI
    run hung so). close() shuts the pool down at once, with the collector off as it is between its runs."""
    import gc
    import threading

    def pool():
        return {t for t in threading.enumerate() if t.name.startswith("ThreadPoolExecutor")}

    before = pool()
    gc.disable()
    try:
        batches = PackedBatches(load_text_stream(str(corpus / "enwiki-train-*.parquet"), "train"), tokenizer,
                                seq_len=32, micro_batch_size=2, seed=0, shuffle_buffer=4)
        next(batches)
        assert pool() - before  # the shards are being read by datasets' pool
        batches.close()
        for thread in pool() - before:  # told to stop: they end by themselves (never, without close)
            thread.join(timeout=30)
        assert not pool() - before
        assert batches.state_dict()["tokens"] == 64 and batches.skipped == {"empty": 0, "short": 0, "non_utf8": 0,
                                                                             "not_text": 0}
    finally:
        gc.enable()


def test_the_exit_waits_for_arrow_threads_from_the_close_not_the_last_read(corpus, tokenizer):
    """arrow's reader threads wind down after close() returns; a process that exits under them aborts ("terminate
    called without an active exception": 2 of 5 loaded 4-step CPU runs did). The exit's wait counts from the close."""
    import time

    from ds_async.data import sources as data

    batches = PackedBatches(load_text_stream(str(corpus / "enwiki-train-*.parquet"), "train"), tokenizer,
                            seq_len=32, micro_batch_size=2, seed=0, shuffle_buffer=4)
    next(batches)
    closing = time.monotonic()
    batches.close()
    assert data._last_read[0] >= closing


@pytest.mark.parametrize("train", ["enwiki", "parquet-from-train"])
def test_reading_streams_draws_nothing_from_the_global_rngs(tmp_path, corpus, tokenizer, lee_texts, train):
    """The trainer reads its data at start on a thread while the model builds (``TrainerSetup._read_sources``: the
    training stream opened and its first micro-batch buffered, the evaluation's micro-batches read), so the reads
    must leave Python's, NumPy's and torch's global generators alone: the model's build and training draw from
    them. Shuffled training streams (several epochs) and a validation set held out of the training files."""
    if train == "enwiki":
        cfg = DataConfig(train=str(corpus / "enwiki-train-00000-of-00006.parquet"),
                         validation=str(corpus / "enwiki-validation.parquet"), shuffle_buffer=50, seq_len=64)
    else:
        pq.write_table(pa.table({"text": lee_texts[:30]}), tmp_path / "lee.parquet")
        cfg = DataConfig(train=str(tmp_path / "lee.parquet"), validation=DataSource(from_train=5), shuffle_buffer=8,
                         seq_len=64)
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    train_stream = open_batches(cfg, "train", tokenizer, 2, seed=5)
    train_stream.peek()
    take(train_stream, 40 if train == "enwiki" else 60)
    validation = open_batches(cfg, "validation", tokenizer, 2)
    take(validation, 2)
    train_stream.close(), validation.close()
    if train != "enwiki":
        assert train_stream.state_dict()["epoch"] >= 1
    assert random.getstate() == before[0]
    assert np.array_equal(np.random.get_state()[1], before[1])
    assert torch.equal(torch.get_rng_state(), before[2])
