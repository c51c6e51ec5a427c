"""tandem-serve on model folders as users bring them, driven by the official `openai` client.

- The tokenizer saved by current transformers: its tokenizer_config.json holds
  "model_max_length": 1000000000000000019884624838656 (int(1e30), transformers' "no limit"), an integer beyond
  int64 that jansson alone refuses; the server must start and serve text and chat.
"""
import shutil

import pytest

from server_fixtures import CHATML_TEMPLATE, EOS_TOKEN, TandemServer, tiny_model_dir  # noqa: F401 (pytest fixture)

openai = pytest.importorskip("openai")

TRANSFORMERS_NO_LIMIT = "1000000000000000019884624838656"


def copy_weights(src, dst):
    """config.json and the safetensors of the tiny model, nothing of its tokenizer."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name == "config.json" or f.suffix == ".safetensors" or f.name.endswith(".safetensors.index.json"):
            shutil.copy(f, dst / f.name)


def client_of(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_tokenizer_saved_by_transformers_loads(tiny_model_dir, tmp_path):
    from transformers import PreTrainedTokenizerFast
    model_dir = tmp_path / "model"
    copy_weights(tiny_model_dir, model_dir)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(tiny_model_dir / "tokenizer.json"), eos_token=EOS_TOKEN,
                                  pad_token="<|endoftext|>")
    tok.chat_template = CHATML_TEMPLATE
    tok.save_pretrained(model_dir)
    cfg = (model_dir / "tokenizer_config.json").read_text()
    assert f'"model_max_length": {TRANSFORMERS_NO_LIMIT}' in cfg, cfg  # what this test is about

    with TandemServer(model_dir, "--served-model-name", "tiny") as server:
        client = client_of(server)
        r = client.completions.create(model="tiny", prompt="the quick brown fox", max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 4 and r.choices[0].text
        c = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "seven wizards"}],
                                           max_tokens=3, temperature=0)
        assert c.choices[0].finish_reason in ("stop", "length")
        assert "chat template: chatml" in server.log_text()
