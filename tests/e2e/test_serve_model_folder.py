"""tandem-serve on model folders as users bring them, driven by the official `openai` client.

- The tokenizer saved by current transformers: its tokenizer_config.json holds
  "model_max_length": 1000000000000000019884624838656 (int(1e30), transformers' "no limit"), an integer beyond
  int64 that jansson alone refuses; the server must start and serve text and chat.
- A folder without tokenizer.json: the server starts, says at start-up that text is off and why, serves
  token-id prompts, and answers every text request with a 400 in the OpenAI error format saying it has no
  tokenizer (not an internal function's name).
"""
import shutil

import pytest

from server_fixtures import (CHATML_TEMPLATE, EOS_TOKEN, TandemServer, http_json,  # noqa: F401 (pytest fixture)
                             tiny_model_dir)

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


def assert_no_tokenizer_error(exc, param):
    assert exc.status_code == 400
    err = exc.body  # the client keeps the "error" object of the answer
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert "this server has no tokenizer" in err["message"] and "tokenizer.json" in err["message"], err
    assert "NULL" not in err["message"] and "tokenizer_encode" not in err["message"], err


def test_folder_without_tokenizer_serves_token_ids_and_refuses_text(tiny_model_dir, tmp_path):
    model_dir = tmp_path / "weights-only"
    copy_weights(tiny_model_dir, model_dir)
    with TandemServer(model_dir, "--served-model-name", "tiny") as server:
        log = server.log_text()
        assert f"no tokenizer: {model_dir} has no tokenizer.json, so text is off" in log, log
        assert "chat_template_from_tokenizer" not in log and "NULL" not in log, log
        client = client_of(server)

        r = client.completions.create(model="tiny", prompt=[5, 17, 42], max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
        assert len(r.choices[0].token_ids) == 3 and r.choices[0].text == ""

        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", prompt="the quick brown fox", max_tokens=3)
        assert_no_tokenizer_error(e.value, "prompt")
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert_no_tokenizer_error(e.value, "messages")

        for path, body, param in (("/tokenize", {"prompt": "hi"}, "prompt"),
                                  ("/detokenize", {"tokens": [5, 17]}, "tokens"),
                                  ("/generate/", {"prompts": ["hi"], "max_tokens": 2}, "prompt")):
            status, out, _ = http_json("POST", server.url + path, body)
            assert status == 400 and out["error"]["param"] == param, (path, out)
            assert "this server has no tokenizer" in out["error"]["message"], (path, out)
        status, out, _ = http_json("POST", server.url + "/generate/", {"prompts": [[5, 17]], "max_tokens": 2})
        assert status == 200 and len(out["completion_ids"][0]) >= 1, out


def test_forced_chat_template_without_tokenizer_is_a_start_up_error(tiny_model_dir, tmp_path):
    model_dir = tmp_path / "weights-only"
    copy_weights(tiny_model_dir, model_dir)
    with pytest.raises(AssertionError, match="--chat-template chatml needs a tokenizer"):
        TandemServer(model_dir, "--chat-template", "chatml")
