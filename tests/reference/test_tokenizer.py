"""The C tokenizer against Hugging Face `tokenizers`: same ids, same decoded text, same streaming chunks, on
tokenizers trained here for every family (GPT-2, Llama 3, Qwen2 byte-level BPE; Llama 2 / TinyLlama style
SentencePiece BPE with byte fallback) and a varied corpus; invalid UTF-8; every Unicode code point through the
three real pre-tokenizer regexes; config files; malformed tokenizer.json files.
"""
import json
import random
import unicodedata

import pytest
from conftest import tool
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from test_tokenizer_support import BYTE_LEVEL, FAMILIES, SPECIALS, TokCli, build_family, corpus_for, load_error


@pytest.fixture(scope="module")
def exe():
    return tool("tok_cli")


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory, exe):
    name = request.param
    path, hf = build_family(name, tmp_path_factory.mktemp(name))
    cli = TokCli(exe, path)
    yield name, path, hf, cli
    cli.close()


def test_ids_match_hf(family):
    name, _, hf, cli = family
    texts = corpus_for(SPECIALS[name])
    for add in (False, True):
        ours = cli.many([{"op": "encode", "text": t, "add_special_tokens": add} for t in texts])
        theirs = hf.encode_batch(texts, add_special_tokens=add)
        for t, o, h in zip(texts, ours, theirs):
            assert o.get("ids") == h.ids, f"{name} add_special_tokens={add} text={t!r}"


def test_decode_matches_hf_and_round_trips(family):
    name, _, hf, cli = family
    texts = corpus_for(SPECIALS[name])
    enc = hf.encode_batch(texts, add_special_tokens=True)
    for skip in (False, True):
        ours = cli.many([{"op": "decode", "ids": e.ids, "skip_special_tokens": skip} for e in enc])
        for t, e, o in zip(texts, enc, ours):
            assert o.get("text") == hf.decode(e.ids, skip_special_tokens=skip), f"{name} skip={skip} text={t!r}"
    # decode(encode(x)) == x. The byte-level families round-trip everything (Qwen2 up to its NFC step); the
    # SentencePiece families drop the space their decoder strips when a special token starts the text, so they
    # are checked on text without added tokens. (The kitchen-sink and Metaspace-split tokenizers lose text by
    # design: NFKC, stripped added tokens, removed splits.)
    ours = cli.many([{"op": "encode", "text": t} for t in texts])
    dec = cli.many([{"op": "decode", "ids": o["ids"]} for o in ours])
    for t, d in zip(texts, dec):
        if name in BYTE_LEVEL:
            assert d["text"] == (unicodedata.normalize("NFC", t) if name == "qwen2" else t), f"{name} {t!r}"
        elif name in ("llama2", "tinyllama") and not any(s in t for s in SPECIALS[name] + ["world"]) \
                and not t.startswith(" "):
            assert d["text"] == t, f"{name} {t!r}"


def test_stream_matches_hf_decode_stream(family):
    name, _, hf, cli = family
    texts = corpus_for(SPECIALS[name])[:60]
    for skip in (False, True):
        for t in texts:
            ids = hf.encode(t, add_special_tokens=True).ids
            ds = DecodeStream(skip_special_tokens=skip)
            theirs = [ds.step(hf, i) for i in ids]
            ours = cli.ask(op="stream", ids=ids, skip_special_tokens=skip)
            assert ours["chunks"] == theirs, f"{name} skip={skip} text={t!r}"
            # Everything emitted plus what is still held equals the whole decode.
            assert "".join(c for c in ours["chunks"] if c) + ours["rest"] == hf.decode(ids, skip_special_tokens=skip)


# The characters GPT-2's byte alphabet gives the bytes 0x80..0xFF.
HIGH_BYTE_CHARS = [chr(289 + b - 127 if b <= 160 else 323 if b == 173 else b) for b in range(0x80, 0x100)]


def test_stream_random_ids_match_hf_decode_stream(family):
    """Random id sequences (not text the encoder produced): byte tokens that leave characters unfinished or make
    invalid UTF-8 (lone continuation bytes, truncated sequences followed by ASCII), special and other added
    tokens, skip on and off. Byte-level families take the ByteLevel fast path, the others the reference path;
    every chunk must equal HF's."""
    name, _, hf, cli = family
    rng = random.Random(7)
    vocab = hf.get_vocab()
    size = hf.get_vocab_size()
    added = sorted(hf.get_added_tokens_decoder())
    if name in BYTE_LEVEL:   # the 128 high bytes, each its own token
        high = [vocab[c] for c in HIGH_BYTE_CHARS]
    else:                    # byte-fallback tokens <0x80>..<0xFF>, where the family has them
        high = [i for t, i in vocab.items() if t.startswith("<0x") and int(t[3:5], 16) >= 0x80] or list(range(size))
    seqs = []
    for _ in range(300):
        ids = []
        for _ in range(rng.randint(1, 30)):
            r = rng.random()
            ids.append(rng.choice(high) if r < 0.5 else rng.choice(added) if r < 0.6 else rng.randrange(size))
        seqs.append(ids)
    for skip in (False, True):
        ours = cli.many([{"op": "stream", "ids": ids, "skip_special_tokens": skip} for ids in seqs])
        for ids, o in zip(seqs, ours):
            ds = DecodeStream(skip_special_tokens=skip)
            try:
                theirs = [ds.step(hf, i) for i in ids]
            except Exception:   # HF's InvalidPrefix: ours must refuse too
                assert "error" in o, f"{name} skip={skip} ids={ids}"
                continue
            assert o.get("chunks") == theirs, f"{name} skip={skip} ids={ids}"
            # ByteLevel decodes bytes as a whole, so the chunks add up to the decode. (ByteFallback does not:
            # HF's own chunks give one U+FFFD per byte of an invalid run cut by the window differently.)
            if name in BYTE_LEVEL:
                assert "".join(c for c in theirs if c) + o["rest"] == hf.decode(ids, skip_special_tokens=skip)


def test_stream_holds_back_split_characters(family):
    """A character split over several ids (byte tokens) is emitted once, whole, never as U+FFFD."""
    name, _, hf, cli = family
    ids = hf.encode("a 日本 👩‍👧 b", add_special_tokens=False).ids
    ours = cli.ask(op="stream", ids=ids)
    chunks = [c for c in ours["chunks"] if c]
    assert all("\ufffd" not in c for c in chunks), chunks
    assert "".join(chunks) + ours["rest"] == hf.decode(ids)


def test_invalid_utf8_encodes_like_python_replace(family):
    name, _, hf, cli = family
    samples = [b"\xff", b"abc\xe4\xb8", b"\xc3\x28 ok", b"\xed\xa0\x80x", b"\xf4\x90\x80\x80", b"\xe0\x80\x80",
               b"a\x00b", b"\xf0\x9f\x98", b"\x80\x80\x80 hi \xfe", b"caf\xe9 ok"]
    ours = cli.many([{"op": "encode", "hex": b.hex()} for b in samples])
    for b, o in zip(samples, ours):
        assert o.get("ids") == hf.encode(b.decode("utf-8", "replace"), add_special_tokens=False).ids, f"{name} {b!r}"


def test_every_code_point(family):
    """All of Unicode through every family: GPT-2's, Llama 3's and Qwen2's regexes (\\s, \\p{L}, \\p{N}, case
    folding must agree with Oniguruma's everywhere), Qwen2's NFC and the kitchen sink's NFKC (utf8proc vs HF's
    tables), byte fallback for every character the SentencePiece vocabularies lack."""
    name, _, hf, cli = family
    cps = [c for c in range(0x110000) if not 0xD800 <= c < 0xE000]
    chunks = ["".join(chr(c) for c in cps[i:i + 2048]) for i in range(0, len(cps), 2048)]
    # Interleave spaces and digits so the regexes' "space before letter" and digit-group rules fire too.
    chunks += [" ".join(chr(c) for c in cps[i:i + 1024]) + " 1234" for i in range(0, len(cps), 16384)]
    ours = cli.many([{"op": "encode", "text": c} for c in chunks])
    theirs = hf.encode_batch(chunks, add_special_tokens=False)
    for c, o, h in zip(chunks, ours, theirs):
        if o.get("ids") != h.ids:
            first = next(i for i, (a, b) in enumerate(zip(o["ids"], h.ids)) if a != b) if o.get("ids") else 0
            pytest.fail(f"{name}: chunk starting U+{ord(c[0]):04X} differs at id {first}")


def test_config_files(tmp_path, exe):
    """tokenizer_config.json / generation_config.json: special ids and several eos ids; add_bos_token is
    reported, while what encode adds follows tokenizer.json's post-processor, as transformers 5 does."""
    from transformers import AutoTokenizer

    path, hf = build_family("tinyllama", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
        "eos_token": {"__type": "AddedToken", "content": "</s>", "lstrip": False, "rstrip": False,
                      "normalized": False, "special": True},
        "pad_token": "<unk>", "add_bos_token": True, "add_eos_token": True}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 5]}))
    cli = TokCli(exe, tmp_path)
    info = cli.ask(op="info")
    auto = AutoTokenizer.from_pretrained(str(tmp_path))
    assert info["bos_id"] == auto.bos_token_id == 1
    assert info["pad_id"] == auto.pad_token_id
    assert info["eos_ids"] == [2, 5] and info["eos_id"] == 2
    assert info["add_bos_token"] == 1 and info["bos_token"] == "<s>" and info["eos_token"] == "</s>"
    for t in ["Hello world", "日本語 text", ""]:
        assert cli.ask(op="encode", text=t, add_special_tokens=True)["ids"] == auto(t)["input_ids"], t
    cli.close()


@pytest.mark.parametrize("mutate,field", [
    (lambda s: s.pop("model"), "model"),
    (lambda s: s["model"].pop("merges"), "merges"),
    (lambda s: s["model"]["merges"].__setitem__(0, ["no-such-token", "x"]), "model.merges[0]"),
    (lambda s: s["model"]["merges"].__setitem__(1, "a b c"), "model.merges[1]"),
    (lambda s: s["model"]["merges"].__setitem__(2, 7), "model.merges[2]"),
    (lambda s: s["model"]["vocab"].__setitem__("zz", "seven"), "model.vocab"),
    (lambda s: s["model"].__setitem__("type", "WordPiece"), "model.type"),
    (lambda s: s["model"].__setitem__("byte_fallback", "yes"), "model.byte_fallback"),
    (lambda s: s.__setitem__("added_tokens", [{"id": 0, "content": 5}]), "added_tokens[0].content"),
    (lambda s: s.__setitem__("normalizer", {"type": "NoSuchNormalizer"}), "normalizer.type"),
    (lambda s: s["pre_tokenizer"]["pretokenizers"][0].__setitem__("behavior", "Sideways"),
     "pre_tokenizer.pretokenizers[0].behavior"),
    (lambda s: s["pre_tokenizer"]["pretokenizers"][0].__setitem__("pattern", {"Regex": "(unclosed"}),
     "pre_tokenizer.pretokenizers[0].pattern"),
    (lambda s: s.__setitem__("decoder", {"type": "Strip", "content": "ab", "start": 1, "stop": 0}), "decoder.content"),
    (lambda s: s.__setitem__("version", "2.0"), "version"),
])
def test_malformed_tokenizer_json_names_the_field(tmp_path, exe, mutate, field):
    path, _ = build_family("llama3", tmp_path)
    spec = json.loads(path.read_text())
    mutate(spec)
    path.write_text(json.dumps(spec))
    with pytest.raises(Exception):   # HF refuses these files too
        Tokenizer.from_file(str(path))
    assert field in load_error(exe, path)


@pytest.mark.parametrize("section,value", [
    ("normalizer", {"type": "Lowercase"}),
    ("pre_tokenizer", {"type": "Whitespace"}),
    ("decoder", {"type": "WordPiece", "prefix": "##", "cleanup": True}),
    ("post_processor", {"type": "RobertaProcessing", "sep": ["</s>", 2], "cls": ["<s>", 0], "trim_offsets": True,
                        "add_prefix_space": False}),
])
def test_valid_but_unsupported_components_are_named(tmp_path, exe, section, value):
    """Components HF has but tandem does not implement are refused by name, never silently skipped."""
    path, _ = build_family("gpt2", tmp_path)
    spec = json.loads(path.read_text())
    spec[section] = value
    path.write_text(json.dumps(spec))
    Tokenizer.from_file(str(path))   # HF loads it
    msg = load_error(exe, path)
    assert section in msg and value["type"] in msg


def test_unreadable_inputs(tmp_path, exe):
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": {"a": 0}, ')
    assert "invalid JSON" in load_error(exe, tmp_path)
    assert "No such file" in load_error(exe, tmp_path / "missing")
