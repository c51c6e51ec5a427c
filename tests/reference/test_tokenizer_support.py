"""Shared pieces of the tokenizer reference tests (no tests here): the tok_cli driver, a varied test corpus,
and tokenizers trained on the spot with the `tokenizers` library, one per family tandem supports, built the way
the real models' tokenizer.json files are (the real pre-tokenizer regexes, normalizers, decoders and
post-processors of GPT-2, Llama 3, Qwen2, Llama 2 and TinyLlama).
"""
import json
import random
import subprocess
import threading

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

# The pre-tokenizer regexes of the real tokenizer.json files.
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")

SPECIALS = {
    "gpt2": ["<|endoftext|>"],
    "llama3": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
               "<|reserved_special_token_0|>"],
    "qwen2": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "llama2": ["<unk>", "<s>", "</s>"],
    "tinyllama": ["<unk>", "<s>", "</s>"],
    "metaspace": ["<unk>", "<s>", "</s>"],
}

BASE_TEXTS = [
    "Hello world! This is a test of the tokenizer, with numbers 12345 and 3.14159.",
    "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX! It's, we'll, they've, I'm, he'd, YOU'LL, SHE'S",
    "Élève, naïve café — «guillemets» and “quotes”, Straße, Œuvre, ﬁ ligature, Ångström",
    "日本語のテキストも少し含めます。中文也有一些内容，包括标点符号！한국어 문장도 있습니다.",
    "مرحبا بالعالم، هذا نص عربي للاختبار ١٢٣٤٥",
    "नमस्ते दुनिया, यह एक परीक्षण है। हिन्दी में अंक १२३",
    "emoji 👩‍👩‍👧‍👦 family, 🏳️‍🌈 flag, 👍🏽 tone, 🎉🎉🎉 and 🇯🇵 regional indicators",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }  // C code\r\n",
    "   leading spaces, trailing spaces   ",
    "tabs\t\tand\nnewlines\n\n\nand\r\ncarriage returns\r\n   \n \n",
    "digits 0 1 12 123 1234 12345 123456 9876543210 and 1,000,000.00",
    "mixed: abc123def 42nd 3rd x1y2z3 v2.0.1-rc3",
    "punctuation!!! ??? ... --- *** ((())) [[[]]] {{{}}} <<<>>> @#$%^&",
    "Unicode spaces:\u00a0nbsp\u2003em\u3000ideographic\u2028line\u2029para\u0085nel\u180emongolian\u200bzwsp",
    "combining: e\u0301 a\u0308 o\u0302 (decomposed) vs é ä ô (composed); Hangul jamo \u1100\u1161\u11a8",
    "control\x00chars\x01\x02\x7f and \x1b[31mANSI\x1b[0m",
    "a" * 300 + " " + "ab" * 200,
    "ſ'S Long-s with apostrophe 'S and 'LL and 'Re",
    "",
    " ",
    "x",
]


def corpus_for(specials):
    """The base texts, texts with the family's special tokens inside, and seeded random strings."""
    texts = list(BASE_TEXTS)
    for s in specials:
        texts += [f"{s}Hello{s}", f"before {s} after", f"{s}", f"  {s}  spaced  {s}\n", f"x{s}{s}y"]
    rng = random.Random(1234)
    pool = list("abcdefghijklmnopqrstuvwxyzABCXYZ0123456789 .,;:!?'\"-()\n\t") + list("éüßçñ日本語中文한국ا ب ت ह न म 👩‍👧🎉€£¥") + \
        [" ", "  ", "\n\n", "'s", "'ll", "\u00a0", "\u3000"] + specials
    for _ in range(150):
        texts.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 60))))
    return texts


TRAIN_TEXTS = [t for t in BASE_TEXTS if t] * 20


def _train_bpe(pre, specials, vocab_size, alphabet=()):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre
    tr = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, initial_alphabet=list(alphabet),
                             show_progress=False)
    tok.train_from_iterator(TRAIN_TEXTS, tr)
    return tok


def _byte_level(name):
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if name == "gpt2":
        pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        regex = LLAMA3_REGEX if name == "llama3" else QWEN2_REGEX
        pre = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                                       pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok = _train_bpe(pre, SPECIALS[name], 900, alphabet)
    tok.decoder = decoders.ByteLevel()
    if name == "qwen2":
        tok.normalizer = normalizers.NFC()
    if name == "llama3":
        bos = tok.token_to_id("<|begin_of_text|>")
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B:1",
                                          special_tokens=[("<|begin_of_text|>", bos)])])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    if name == "gpt2":
        # Added tokens exercising every flag: stripping, whole-word matching, matching after normalization.
        tok.add_tokens([AddedToken("<tool>", lstrip=True, rstrip=True, normalized=False),
                        AddedToken("hello", single_word=True, normalized=True),
                        AddedToken(" spaced", normalized=False)])
        tok.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True, normalized=False)])
    spec = json.loads(tok.to_str())
    if name == "llama3":
        spec["model"]["ignore_merges"] = True   # as in Llama 3's tokenizer.json
    if name == "gpt2":   # the legacy "a b" merge spelling (byte-level tokens never hold a space)
        spec["model"]["merges"] = [" ".join(pair) for pair in spec["model"]["merges"]]
    return spec


def _sentencepiece(name):
    """BPE with byte_fallback and <0xNN> tokens, the layout of Llama 2 / TinyLlama tokenizer.json files."""
    trained = _train_bpe(pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
                         SPECIALS[name], 700)
    spec = json.loads(trained.to_str())
    tspec = json.loads(trained.to_str())
    # Renumber: the 3 specials, then <0x00>..<0xFF>, then the learned pieces.
    old = sorted(tspec["model"]["vocab"].items(), key=lambda kv: kv[1])
    vocab = {}
    for tokstr, _ in old[:3]:
        vocab[tokstr] = len(vocab)
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for tokstr, _ in old[3:]:
        if tokstr not in vocab:
            vocab[tokstr] = len(vocab)
    spec["model"] = {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                     "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                     "vocab": vocab, "merges": tspec["model"]["merges"]}
    spec["added_tokens"] = [{"id": vocab[s], "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": True} for s in SPECIALS[name]]
    sp_decoder = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    bos_template = {"type": "TemplateProcessing",
                    "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                    "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                             {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                    "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}}
    if name == "llama2":   # legacy Llama 2: the normalizer adds the ▁ prefix, no pre-tokenizer at all
        spec["normalizer"] = {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}
        spec["pre_tokenizer"] = None
        spec["decoder"] = sp_decoder
        spec["post_processor"] = bos_template
        # A normalized added token: matched on the normalized text, in its normalized spelling.
        spec["added_tokens"].append({"id": len(vocab), "content": "world", "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": True, "special": False})
    elif name == "tinyllama":   # what transformers writes for Llama-family models converted with legacy=False
        spec["normalizer"] = None
        spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False}
        spec["decoder"] = sp_decoder
        spec["post_processor"] = bos_template
    else:   # Metaspace everywhere (split on ▁, Metaspace decoder after ByteFallback)
        spec["normalizer"] = None
        spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}
        spec["decoder"] = {"type": "Sequence", "decoders": [
            {"type": "ByteFallback"}, {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always",
                                       "split": True}]}
        spec["post_processor"] = None
    return spec


def _kitchen_sink():
    """Every other supported component in one tokenizer: NFKC, a regex Replace and Prepend normalizer; Split
    with each behaviour and invert, Digits, ByteLevel with add_prefix_space; subword prefix and word suffix;
    a regex Replace decoder; a [CLS] $A [SEP] template; added tokens with every flag."""
    norm = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(Regex(r"[\u2018\u2019]"), "'"),
                                 normalizers.Replace("  ", " "), normalizers.Prepend("#")])
    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\d+"), behavior="merged_with_previous"),
        pre_tokenizers.Split(" ", behavior="merged_with_next"),
        pre_tokenizers.Split(Regex(r"[.!?]+"), behavior="contiguous", invert=True),
        pre_tokenizers.Split(Regex(r"x*"), behavior="removed"),
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)])
    tok = Tokenizer(models.BPE(continuing_subword_prefix="##", end_of_word_suffix="</w>"))
    tok.normalizer = norm
    tok.pre_tokenizer = pre
    tr = trainers.BpeTrainer(vocab_size=900, special_tokens=SPECIALS["kitchen"], continuing_subword_prefix="##",
                             end_of_word_suffix="</w>", show_progress=False,
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TRAIN_TEXTS, tr)
    tok.decoder = decoders.Sequence([decoders.Replace(Regex("##|</w>"), ""), decoders.ByteLevel()])
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))])
    tok.add_tokens([AddedToken("foo", single_word=True, normalized=True), AddedToken("<b>", lstrip=True),
                    AddedToken("  ", normalized=False), AddedToken("bar", rstrip=True, normalized=True)])
    tok.add_special_tokens([AddedToken("[MASK]", lstrip=True, rstrip=True, special=True)])
    return json.loads(tok.to_str())


SPECIALS["kitchen"] = ["[CLS]", "[SEP]", "[MASK]"]
FAMILIES = ["gpt2", "llama3", "qwen2", "llama2", "tinyllama", "metaspace", "kitchen"]
BYTE_LEVEL = ["gpt2", "llama3", "qwen2"]


def build_family(name, directory):
    """Trains the family's tokenizer and writes directory/tokenizer.json; returns (path, HF Tokenizer)."""
    spec = _kitchen_sink() if name == "kitchen" else _byte_level(name) if name in BYTE_LEVEL else _sentencepiece(name)
    path = directory / "tokenizer.json"
    path.write_text(json.dumps(spec, ensure_ascii=False))
    return path, Tokenizer.from_file(str(path))


class TokCli:
    """A running tok_cli: one JSON request per line, one JSON answer per line."""

    def __init__(self, exe, path, *extra):
        self.proc = subprocess.Popen([exe, str(path), *extra], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, encoding="utf-8")
        first = self.proc.stdout.readline() if self.proc.poll() is not None else None
        if first is None:
            self.proc.stdin.write('{"op":"info"}\n')
            self.proc.stdin.flush()
            first = self.proc.stdout.readline()
        assert first and "vocab_size" in first, f"tok_cli could not load {path}: {first}"

    def ask(self, **req):
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "tok_cli exited"
        return json.loads(line)

    def many(self, reqs):
        """Pipelines a batch of requests (much faster than one round trip each). A writer thread feeds
        stdin while we read stdout, so neither pipe can fill up and stall the other."""
        def feed():
            for r in reqs:
                self.proc.stdin.write(json.dumps(r) + "\n")
            self.proc.stdin.flush()
        writer = threading.Thread(target=feed)
        writer.start()
        answers = [json.loads(self.proc.stdout.readline()) for _ in reqs]
        writer.join()
        return answers

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def load_error(exe, path):
    """Runs tok_cli on a tokenizer that must not load; returns its error message."""
    proc = subprocess.run([exe, str(path)], input="", capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, f"expected a load failure, got rc={proc.returncode}: {proc.stdout}"
    return json.loads(proc.stdout)["error"]
