#!/usr/bin/env python3
"""Encode throughput: HF `tokenizers` on one thread vs tandem's C tokenizer, same text, same tokenizer.

    RAYON_NUM_THREADS=1 python bench/bench_tokenizer.py [--mb 8] [--build build] [--repeat 3]

English text: the docstrings of the Python packages installed next to this interpreter (torch, transformers,
numpy, ... — prose written by people, deterministic for a given environment), cut at --mb megabytes.
Tokenizer: a Llama-3-style byte-level BPE (the real Llama 3 pre-tokenizer regex, ignore_merges) with a 32k
vocabulary trained on that text with the `tokenizers` library. Both sides encode the whole text in one call
("doc") and one call per paragraph ("paragraphs"), after one untimed warm-up pass each; the ids are checked
equal first. Prints MB/s for both and the ratio.
"""
import argparse
import ast
import json
import os
import pathlib
import re
import subprocess
import sys
import sysconfig
import tempfile
import time

os.environ.setdefault("RAYON_NUM_THREADS", "1")        # HF single-threaded (set before the import)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")


def english_text(megabytes):
    """Docstrings of installed packages, mostly-ASCII paragraphs, until `megabytes` MB."""
    site = pathlib.Path(sysconfig.get_paths()["purelib"])
    out, size = [], 0
    for path in sorted(site.rglob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if not doc or len(doc) < 200:
                    continue
                ascii_share = sum(c.isascii() for c in doc) / len(doc)
                if ascii_share < 0.98 or len(re.findall(r"[A-Za-z]+", doc)) < 30:
                    continue
                out.append(doc.strip() + "\n\n")
                size += len(out[-1].encode())
                if size >= megabytes * 1e6:
                    return "".join(out)
    return "".join(out)


def train(text):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=32000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|begin_of_text|>", "<|end_of_text|>"], show_progress=False)
    tok.train_from_iterator(text.split("\n\n"), trainer)
    return tok


def hf_speed(tok, text, paragraphs, repeat):
    items = [p + "\n\n" for p in text.split("\n\n")[:-1]] if paragraphs else [text]
    if paragraphs and text.split("\n\n")[-1]:
        items.append(text.split("\n\n")[-1])

    # encode_batch_fast skips offset tracking: HF's fastest path (RAYON_NUM_THREADS=1 keeps it on one thread).
    def one_pass():
        return sum(len(e.ids) for e in tok.encode_batch_fast(items, add_special_tokens=False))

    tokens = one_pass()   # warm-up (fills HF's word cache, as tandem's warm-up pass does)
    t0 = time.perf_counter()
    for _ in range(repeat):
        one_pass()
    dt = time.perf_counter() - t0
    return len(text.encode()) * repeat / dt / 1e6, tokens


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=8.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--build", default=os.environ.get("TANDEM_BUILD_DIR", str(ROOT / "build")))
    args = ap.parse_args()
    exe = pathlib.Path(args.build) / "bench" / "bench_tokenizer"
    if not exe.exists():
        sys.exit(f"{exe} not built (cmake --build {args.build} --target bench_tokenizer)")

    text = english_text(args.mb)
    print(f"text: {len(text.encode()) / 1e6:.2f} MB of docstrings from {sysconfig.get_paths()['purelib']}")
    t0 = time.perf_counter()
    tok = train(text[: 3_000_000])
    print(f"tokenizer: Llama-3-style byte-level BPE, vocab {tok.get_vocab_size()}, trained in "
          f"{time.perf_counter() - t0:.1f} s")
    with tempfile.TemporaryDirectory() as d:
        tj = pathlib.Path(d) / "tokenizer.json"
        spec = tok.to_str()
        spec = spec.replace('"ignore_merges":false', '"ignore_merges":true')   # as Llama 3 ships
        tj.write_text(spec)
        tok = Tokenizer.from_file(str(tj))
        tf = pathlib.Path(d) / "text.txt"
        tf.write_text(text)

        # Same ids first: a speed comparison between different answers would mean nothing.
        sample = text[:200_000]
        cli = pathlib.Path(args.build) / "tests" / "tok_cli"
        if cli.exists():
            check = subprocess.run([str(cli), str(tj)], input=json.dumps({"op": "encode", "text": sample}) + "\n",
                                   capture_output=True, text=True, check=True)
            ours = json.loads(check.stdout)["ids"]
            if ours != tok.encode(sample, add_special_tokens=False).ids:
                sys.exit("tandem and HF ids differ: no speed comparison")
            print("ids: identical on the first 200 kB")

        print(f"{'mode':<12}{'HF tokenizers (1 thread)':>26}{'tandem':>12}{'ratio':>9}")
        for mode in ("doc", "paragraphs"):
            hf_mbs, _ = hf_speed(tok, text, mode == "paragraphs", args.repeat)
            run = subprocess.run([str(exe), str(tj), str(tf), "--mode", mode, "--repeat", str(args.repeat)],
                                 capture_output=True, text=True, check=True)
            ours = float(re.search(r"([\d.]+) MB/s", run.stdout).group(1))
            print(f"{mode:<12}{hf_mbs:>20.2f} MB/s{ours:>7.2f} MB/s{ours / hf_mbs:>8.2f}x")


if __name__ == "__main__":
    main()
